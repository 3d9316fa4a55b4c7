"""The device's state: its model, keys, stores and outbox, how each is read back, and the one write policy.

Every state write goes through :meth:`DeviceState._persist`. What the broker cannot give back (an
update before its publish, the answered round, the rollback floor) is written at once; what it can
(an applied head, the personal head, an acknowledgement) is written behind, by the next
:meth:`DeviceState.flush`. A failed write (a full disk) is counted, logged once, marks the device
``degraded`` and is retried while the device carries on. A record (:func:`~edgefl.records.write_record`)
for another fleet or model, or unreadable, is ignored.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import cbor2

from edgefl.agent.config import Profile
from edgefl.agent.feedback import ErrorFeedback
from edgefl.agent.governor import Governor
from edgefl.agent.outbox import Answered, Dropped, Outbox, OutboxEntry
from edgefl.agent.store import EmbeddingStore, holdout_capacity
from edgefl.errors import EdgeflError
from edgefl.head import Head, validate_head
from edgefl.records import read_record, write_record
from edgefl.wire.cbor import Limits
from edgefl.wire.global_model import decode_global_model
from edgefl.wire.signing import SigningKey, VerifyKey, load_signing_key, parse_verify_key

logger = logging.getLogger(__name__)

HEAD_FILE = "global_head.rec"
"""The last applied global head (a checksummed record of the GlobalModel message)."""
OUTBOX_FILE = "outbox.rec"
"""Updates awaiting their PUBACK (:class:`~edgefl.agent.outbox.Outbox`)."""
SEEN_VERSION_FILE = "seen_version.rec"
"""The newest head version named by a signed round announcement (the device's rollback floor)."""

PhaseHook = Callable[[str], AbstractContextManager[Any]]
"""``phase(name)`` -> a context manager around one phase (default: the governor's measurement)."""
ProgressHook = Callable[[str, str], None]
"""``progress(state, reason)``: told when a phase of the round starts (called on the caller's thread)."""


DISK_FULL = "disk full"
""":attr:`DeviceCore.degraded` when a state write failed with ``ENOSPC`` or ``EDQUOT``."""


def write_problem(exc: OSError) -> str:
    """What a failed state write means for the device: ``"disk full"`` or ``"cannot write state: ..."``."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DISK_FULL
    if exc.errno == errno.ENOENT:
        return "cannot write state: the state folder or a file in it is missing (removed while running?)"
    return f"cannot write state: {exc.strerror or exc}"


class DeviceState:
    """The device's model, keys, stores and outbox, and its state on disk (the base of ``DeviceCore``).

    Parameters and errors as :class:`~edgefl.agent.core.DeviceCore`'s.
    """

    def __init__(
        self,
        profile: Profile,
        head: Head,
        model_sha256: str,
        *,
        governor: Governor | None,
        state_dir: Path | None,
        store_capacity: int | None,
        phase: PhaseHook | None,
    ) -> None:
        self.profile = profile
        self.device = profile.device.id
        self.fleet = profile.device.fleet
        self.model_sha256 = model_sha256
        self.state_dir = Path(state_dir if state_dir is not None else profile.device.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        mem = profile.memory
        self.governor = governor or Governor(
            profile.cap_bytes, mem.reserve_mb << 20, mem.min_system_available_mb << 20
        )
        self.phase: PhaseHook = phase or self.governor.phase
        """Wraps each phase of the core (and a caller's, e.g. the daemon's ``publish``) in its measurement."""
        self.limits = Limits(max_message_bytes=max(profile.broker.max_packet_bytes, 1 << 20))
        self.head = head
        self._load_head()
        sec = profile.security
        self.signing_key: SigningKey | None = (
            load_signing_key(sec.signing_key_file) if sec.signing_key_file else None
        )
        self.coordinator_key: VerifyKey | None = (
            parse_verify_key(sec.coordinator_public_key) if sec.coordinator_public_key else None
        )
        self.outbox = Outbox(self.state_dir / OUTBOX_FILE, sec.outbox_max_bytes)
        self.feedback = ErrorFeedback(self.head.shape, model_sha256)
        capacity = store_capacity if store_capacity is not None else profile.training.store_capacity
        D, K = self.head.shape
        self.store = EmbeddingStore(self.state_dir, capacity, D, num_classes=K)
        every = profile.training.holdout_every
        self.holdout: EmbeddingStore | None = (
            EmbeddingStore(self.state_dir / "holdout", holdout_capacity(capacity, every), D, num_classes=K)
            if every
            else None
        )
        self.stores = (self.store,) if self.holdout is None else (self.store, self.holdout)
        """The training store, then the holdout when there is one."""
        self._log_answered()
        self.seen_version = self._load_seen_version()
        self.degraded = ""
        """Why state is not being persisted ("" when it is; :data:`DISK_FULL` on a full disk)."""
        self.write_failures = 0
        """State writes that failed (each logged; the device carries on, see :meth:`retry_persist`)."""
        self._unsaved: dict[str, Callable[[], object]] = {}  # what to write again once the disk has room
        self._behind: dict[str, Callable[[], object]] = {}  # writes left for the next flush
        self._acks_behind = 0  # acknowledged updates still in the outbox record (written behind)
        self.behind_since: float | None = None
        """``time.monotonic()`` of the oldest write left behind (None: nothing behind)."""
        self._logged: set[tuple[str, str]] = set()
        self._load_residual()

    @property
    def head_path(self) -> Path:
        """The persisted global head."""
        return self.state_dir / HEAD_FILE

    def _load_head(self) -> None:
        """Restore the last applied global head from its record (previous generation if torn)."""
        data = read_record(self.head_path)
        if data is None:
            return
        try:
            gm = decode_global_model(data, limits=self.limits, expect_shape=self.head.shape)
            if gm.model_sha256 != self.model_sha256:
                logger.info("stored global head belongs to another model; using the factory head")
                return
            validate_head(gm.W, gm.b, self.head.shape)
            self.head = Head(gm.W, gm.b, gm.version)
            logger.info("restored global head version %d from %s", gm.version, self.head_path)
        except EdgeflError as exc:
            logger.warning("stored global head %s unusable (%s); using the factory head", self.head_path, exc)

    @property
    def answered(self) -> Answered | None:
        """The last round this device answered in its fleet (the outbox record keeps it), else None."""
        a = self.outbox.answered
        return a if a is not None and a.fleet == self.fleet else None

    def _log_answered(self) -> None:
        """Log the answered round the outbox record holds (one for another fleet is ignored)."""
        a = self.outbox.answered
        if a is not None and a.fleet != self.fleet:
            logger.info("outbox %s: answered round is for fleet %s; ignored", self.outbox.path, a.fleet)
        elif a is not None:
            logger.info("last answered round %d (%s)", a.round, a.update_id)

    def _load_residual(self) -> None:
        """Restore the error-feedback residual the outbox record keeps (written with each answer)."""
        carried = self.outbox.residual
        if carried is not None and not self.feedback.load_bytes(carried, f"outbox {self.outbox.path}"):
            self.outbox.residual = None  # another model or shape, or unreadable: start from zero

    def _load_seen_version(self) -> int:
        """The newest version a signed round announced (CBOR ``{"v": 1, "fleet", "version"}``), else 0."""
        path = self.state_dir / SEEN_VERSION_FILE
        data = read_record(path)
        if data is None:
            return 0
        try:
            obj = cbor2.loads(data)
            version = obj.get("version") if isinstance(obj, dict) and obj.get("v") == 1 else None
            if type(version) is not int or version < 0:
                raise ValueError("not a seen-version record")
        except (cbor2.CBORDecodeError, ValueError, TypeError) as exc:
            logger.error("seen-version record %s unusable (%s); ignored", path, exc)
            return 0
        if obj.get("fleet") != self.fleet:
            logger.info("seen-version record %s is for another fleet; ignored", path)
            return 0
        return version

    def _see_version(self, version: int) -> None:
        """Raise the rollback floor to ``version`` (a signed round's base version) and persist it."""
        if version <= self.seen_version:
            return
        self.seen_version = version

        def write() -> None:
            payload = {"v": 1, "fleet": self.fleet, "version": self.seen_version}
            write_record(self.state_dir / SEEN_VERSION_FILE, cbor2.dumps(payload))

        self._persist("seen_version", write)

    def _persist(self, what: str, write: Callable[[], object], *, behind: bool = False) -> bool:
        """Run ``write`` (the state ``what``); on ``OSError`` count, log, mark degraded, keep it to retry.

        Returns whether it succeeded; ``behind``: only noted for the next :meth:`flush` (True).
        """
        if behind:
            self._behind[what] = write
            if self.behind_since is None:
                self.behind_since = time.monotonic()
            return True
        try:
            write()
        except OSError as exc:
            self.write_failures += 1
            problem = write_problem(exc)
            self._unsaved[what] = write
            if (problem, what) not in self._logged:  # once per state and problem, then only counted
                self._logged.add((problem, what))
                then = (
                    "persisting waits for room"
                    if problem == DISK_FULL
                    else "writing is retried every status tick"
                )
                logger.warning(
                    "degraded: %s (%s not persisted: %s); classifying goes on, %s", problem, what, exc, then
                )
            self.degraded = problem
            return False
        self._unsaved.pop(what, None)
        if what == "outbox":
            self._acks_behind = 0
        if self._behind.pop(what, None) is not None and not self._behind:
            self.behind_since = None  # this write made the one left behind unneeded
        if self.degraded and not self._unsaved:
            logger.warning("state writable again: persisting resumed (was %s)", self.degraded)
            self.degraded = ""
            self._logged.clear()
        return True

    def retry_persist(self) -> bool:
        """Write again what a failed write left unsaved (every status interval); True when nothing is left."""
        for what, write in list(self._unsaved.items()):
            if not self._persist(what, write):
                return False
        return not self._unsaved

    def _unflushed(self) -> int:
        return sum(s.unflushed for s in self.stores)

    def flush_due(self) -> bool:
        """Whether a store flush is due (``training.flush_every`` or ``flush_interval_s`` reached)."""
        cfg = self.profile.training
        if "store" in self._unsaved or "holdout" in self._unsaved:
            return False  # retry_persist writes it once there is room
        if self._unflushed() >= cfg.flush_every:
            return True
        return any(s.flush_due(cfg.flush_every, cfg.flush_interval_s) for s in self.stores)

    def unflushed_since(self) -> float | None:
        """``time.monotonic()`` of the oldest sample stored since the last flush (None: all flushed)."""
        known = [t for s in self.stores if (t := s.unflushed_since) is not None]
        return min(known) if known else None

    def flush(self) -> bool:
        """Make the stored samples and the writes left behind durable; False if a write failed.

        Never raises (a failure as :meth:`_persist`). A restart before it loses no acknowledged
        work: the retained head comes again, an acknowledged update is re-sent and counted once.
        """
        behind, self._behind, self.behind_since = self._behind, {}, None
        ok = self._persist("store", self.store.flush)
        if self.holdout is not None:
            ok = self._persist("holdout", self.holdout.flush) and ok
        for what, write in behind.items():
            ok = self._persist(what, write) and ok
        return ok

    # --- outbox -----------------------------------------------------------------------------------
    def _persist_outbox(self, write: Callable[[], object]) -> bool:
        """Persist an outbox change; False if it failed (the retry writes the whole outbox, in memory)."""
        if self._persist("outbox", write):
            return True
        self._unsaved["outbox"] = self.outbox.save
        return False

    def mark_sent(self, update_id: str) -> int:
        """Count one publish attempt of an outbox entry (persisted); its attempts, 0 if unknown or unsaved."""
        attempts = 0

        def write() -> None:
            nonlocal attempts
            attempts = self.outbox.mark_sent(update_id)

        self._persist_outbox(write)
        return attempts

    def acknowledged(self, update_id: str) -> bool:
        """The broker acknowledged ``update_id`` (PUBACK): forget it; whether it was kept.

        The outbox is written behind (:meth:`flush`) or by its next write.
        """
        if not self.outbox.forget(update_id):
            return False
        self._acks_behind += 1
        self._persist("outbox", self.outbox.save, behind=True)
        return True

    @property
    def outbox_pending(self) -> int:
        """Updates a restart would send again (unacknowledged, or acknowledged but written behind)."""
        return len(self.outbox) + self._acks_behind

    def to_resend(self, current_round: int, max_sends: int = 2) -> tuple[list[Dropped], list[OutboxEntry]]:
        """After a (re)connect: ``(dropped, pending)``, entries of rounds before ``current_round`` dropped.

        ``pending``: those sent fewer than ``max_sends`` times.
        """
        dropped: list[Dropped] = []
        self._persist_outbox(lambda: dropped.extend(self.outbox.drop_stale(current_round)))
        return dropped, [e for e in self.outbox.pending() if e.sends < max_sends]
