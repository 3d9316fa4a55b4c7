"""The device's round, in one place and without a transport: what every caller of the device runs.

:class:`DeviceCore` owns the device's model state (backbone, pipeline, head, embedding store, error
feedback residual, outbox, last answered round) and three operations:

- **classify**: a batch of raw samples -> predictions, their embeddings kept in the store with labels;
- **round bytes in -> outbox entry out**: verify, decode, check (selected, exactly once, base version,
  samples, memory), train the head locally, error feedback, encode, sign, keep the update in the outbox
  and persist the answered round;
- **global bytes in -> applied**: verify, decode, validate, apply (atomic head swap) and persist.

It opens no socket, starts no task or thread and never awaits: ``edgefl run`` (``agent/daemon.py``)
calls it from one worker thread and wires the transport, signals and dashboard around it;
``edgefl memory-report``, ``bench/memory.py``, ``bench/learning.py`` and the demo's agents run the
same methods, so their figures measure the shipped path. Refusals come back as results with a reason
(``RoundResult.reason``, ``ApplyResult.reason``), never as exceptions; the message formats are
:mod:`edgefl.wire.messages`'s.

Not thread-safe: one caller thread at a time (the daemon's single worker).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import cbor2
import numpy as np

from edgefl.agent import estimates, heap
from edgefl.agent.config import Profile
from edgefl.agent.feedback import ErrorFeedback
from edgefl.agent.governor import Admission, Governor
from edgefl.agent.outbox import Dropped, Outbox, OutboxEntry
from edgefl.agent.pipeline import Pipeline, choose
from edgefl.agent.store import EmbeddingStore
from edgefl.agent.trainer import LocalResult, PersonalResult, train_local, train_personal
from edgefl.errors import BudgetExceeded, DecodeError, EdgeflError, ModelError, UpdateRejected
from edgefl.head import Head, personal_columns, validate_head
from edgefl.records import read_record, write_record
from edgefl.runtime import Backbone
from edgefl.types import F32, I64
from edgefl.wire.cbor import Limits, MessageType
from edgefl.wire.compression import CompressedDelta, Compression
from edgefl.wire.messages import (
    Decline,
    GlobalModel,
    RoundAnnouncement,
    Update,
    UpdateMetrics,
    decode_global_model,
    decode_round,
    encode_decline,
    encode_global_model,
    encode_update,
    global_model_version,
    resolve_global_head,
)
from edgefl.wire.reasons import Reason
from edgefl.wire.signing import (
    SigningKey,
    VerifyKey,
    load_signing_key,
    parse_verify_key,
    sign_message,
    verify_payload,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ANSWERED_FILE",
    "HEAD_FILE",
    "OUTBOX_FILE",
    "PERSONAL_FILE",
    "SEEN_VERSION_FILE",
    "Answered",
    "ApplyResult",
    "ApplyStatus",
    "Classified",
    "Deferred",
    "DeviceCore",
    "RoundResult",
    "RoundStatus",
    "check_model_fits",
]

HEAD_FILE = "global_head.rec"
"""The last applied global head (a checksummed record of the GlobalModel message)."""
OUTBOX_FILE = "outbox.rec"
"""Updates awaiting their PUBACK (:class:`~edgefl.agent.outbox.Outbox`)."""
ANSWERED_FILE = "answered_round.rec"
"""Where earlier versions kept the last answered round (still read; the round
is now recorded in the outbox record, in the write that keeps its update: :class:`Answered`)."""
PERSONAL_FILE = "personal_head.rec"
"""The device's personal head, the classes it may personalise and the global version it was last
pulled toward (a checksummed record; CBOR ``{"v": 1, "fleet", "model_sha256", "version", "shape",
"W", "b", "columns"}``, the arrays as little-endian float32 / uint8 bytes)."""
PERSONAL_SEED_OFFSET = 0x5EED
"""Added to the round's shuffle seed for the personal step (its own sample order)."""
SEEN_VERSION_FILE = "seen_version.rec"
"""The newest head version named by a signed round announcement (the device's rollback floor)."""

PhaseHook = Callable[[str], AbstractContextManager[Any]]
"""``phase(name)`` -> a context manager around one phase (default: the governor's measurement)."""
ProgressHook = Callable[[str, str], None]
"""``progress(state, reason)``: told when a phase of the round starts (called on the caller's thread)."""


# --- results ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Classified:
    """What :meth:`DeviceCore.classify` produced for a batch of N samples.

    Attributes
    ----------
    embeddings : float32 [N, D]
    predictions : int64 [N]
        Class index per sample.
    version : int
        The global head version that produced the predictions.
    refused_labels : int
        Samples :meth:`DeviceCore.observe` did not store: their label is outside ``0..K-1`` (``bad_label``).
    refused_not_finite : int
        Samples :meth:`DeviceCore.observe` did not store: their embedding is not finite (``not_finite``).
    scores : float32 [N] or None
        Probability of each predicted class (:meth:`Head.scores`: softmax, or the sigmoid for K = 1).
    head : "personal" | "global"
        Which head classified the batch (:meth:`DeviceCore.serving_head`).
    """

    embeddings: F32
    predictions: I64
    version: int
    refused_labels: int = 0
    refused_not_finite: int = 0
    scores: F32 | None = None
    head: str = "global"


class RoundStatus(StrEnum):
    """What became of a round announcement (:attr:`RoundResult.status`)."""

    TRAINED = "trained"
    """An update was made and kept in the outbox (:attr:`RoundResult.entry`): send it."""
    NOT_SELECTED = "not_selected"
    """The announcement selects other devices."""
    ANSWERED = "answered"
    """This round (or a later one) was already answered, maybe before a restart: nothing is sent again."""
    WAITING_HEAD = "waiting_head"
    """The round builds on a global head not yet applied; kept pending (``take_ready_round``)."""
    DEFERRED = "deferred"
    """The memory governor deferred training or encoding (``reason`` says why); kept as
    :attr:`DeviceCore.deferred` and retried by :meth:`DeviceCore.retry_deferred`."""
    DECLINED = "declined"
    """The round was refused to the coordinator: a signed Decline message kept in the outbox
    (:attr:`RoundResult.entry`, publish it like an update); ``reason`` is its reason (``over_budget``)."""
    REFUSED = "refused"
    """A bad or unusable announcement: ``reason`` is the refusal's code (counted by the caller)."""


@dataclass(frozen=True, slots=True)
class RoundResult:
    """The outcome of one round announcement.

    Attributes
    ----------
    status : RoundStatus
    round : int
        The announced round (0 when the bytes did not decode).
    reason : str
        For REFUSED the refusal code (``stale_round``, ``bad_signature``, ``unsigned``, a
        :class:`~edgefl.errors.DecodeError` reason, ``failed``); for DEFERRED the governor's reason.
    detail : str
        Human-readable explanation.
    entry : OutboxEntry or None
        TRAINED: the signed, encoded Update as kept in the outbox (publish ``entry.payload``);
        DECLINED: the Decline message, kept and published the same way.
    dropped : tuple[Dropped, ...]
        Older outbox entries evicted to make room (TRAINED only).
    local : LocalResult or None
        TRAINED only: the local training's delta, loss, accuracy and time.
    update_bytes : int
        TRAINED only: ``len(entry.payload)``.
    """

    status: RoundStatus
    round: int
    reason: str = ""
    detail: str = ""
    entry: OutboxEntry | None = None
    dropped: tuple[Dropped, ...] = ()
    local: LocalResult | None = None
    update_bytes: int = 0


class ApplyStatus(StrEnum):
    """What became of a global head (:attr:`ApplyResult.status`)."""

    APPLIED = "applied"
    SAME_VERSION = "same_version"
    """The version already running (a retained re-delivery): nothing to do."""
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """The outcome of one GlobalModel message.

    Attributes
    ----------
    status : ApplyStatus
    version : int
        The message's head version (0 when it did not decode).
    round : int
        The round the head closed (0 when it did not decode).
    reason : str
        For REFUSED: ``wrong_model``, ``not_newer``, ``not_finite``, ``bad_shape``, ``unsigned``,
        ``bad_signature``, another DecodeError reason, or ``failed`` (the head could not be persisted).
    detail : str
    """

    status: ApplyStatus
    version: int = 0
    round: int = 0
    reason: str = ""
    detail: str = ""


DECLINE_AFTER_FRACTION = 0.5
"""A deferred round is retried until this fraction of its ``deadline_s`` has passed, then declined."""


@dataclass(frozen=True, slots=True)
class Deferred:
    """A round the memory governor deferred, waiting for memory (:meth:`DeviceCore.retry_deferred`).

    Attributes
    ----------
    ann : RoundAnnouncement
    since_s : float
        ``time.monotonic()`` of its first deferral.
    reason : str
        The governor's latest reason (or why too few examples are stored).
    decline : str
        The Decline's reason when its time is up: ``over_budget`` (memory) or ``too_few_examples``
        (fewer than ``training.min_examples`` labelled examples stored).
    """

    ann: RoundAnnouncement
    since_s: float
    reason: str
    decline: str = Reason.OVER_BUDGET


def personal_behind(only_global: int, only_personal: int) -> bool:
    """Whether the personal head is behind the global one on the holdout by more than chance.

    Only the samples the two heads disagree on tell them apart: ``only_global`` the global head gets
    right and the personal one wrong, ``only_personal`` the reverse. The personal head is behind
    when ``only_global - only_personal > sqrt(only_global + only_personal)``: more than one
    standard deviation of that difference were both heads equally good (each disagreement a fair
    coin). A holdout of a few samples thus needs two more wins of the global head than of the
    personal one, not one, before predictions leave the personal head.

    Parameters
    ----------
    only_global, only_personal : int >= 0
        Holdout samples only the global (resp. only the personal) head classifies right.

    Returns
    -------
    bool

    Source: McNemar's statistic for paired proportions, ``(b - c) / sqrt(b + c)`` (Q. McNemar,
    "Note on the sampling error of the difference between correlated proportions or
    percentages", Psychometrika 12(2), 1947), at one standard deviation.
    """
    diff = only_global - only_personal
    return diff > 0 and diff * diff > only_global + only_personal


def holdout_capacity(store_capacity: int, every: int) -> int:
    """Samples the holdout store keeps: ``store_capacity // every``, at least 16 (0 when ``every`` is 0)."""
    return max(16, store_capacity // every) if every else 0


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Federated evaluation of one global head on the device's holdout (never trained on).

    Attributes
    ----------
    version : int
        The head's version.
    accuracy : float
        Fraction of the holdout samples the head classifies right, in [0, 1].
    count : int
        Holdout samples evaluated.
    """

    version: int
    accuracy: float
    count: int


@dataclass(frozen=True, slots=True)
class Answered:
    """The last round this device answered, persisted with the outbox (``<state_dir>/outbox.rec``).

    Stored as a CBOR map ``{"v": 1, "fleet": str, "round": int, "update_id": str}`` under the outbox
    record's ``answered`` key, written by the same atomic write that keeps the round's update (or
    Decline); earlier versions wrote it alone to ``answered_round.rec``, still read (the newer round
    wins). A record for another fleet is ignored.
    """

    fleet: str
    round: int
    update_id: str


# --- helpers ------------------------------------------------------------------------------------------
DISK_FULL = "disk full"
""":attr:`DeviceCore.degraded` when a state write failed with ``ENOSPC`` or ``EDQUOT``."""


def write_problem(exc: OSError) -> str:
    """What a failed state write means for the device: ``"disk full"`` or ``"cannot write state: ..."``.

    A missing file or folder (``ENOENT``) is named as such: the state folder was removed or renamed
    under the running agent (a second agent on the same folder is refused at start, ``agent.lock``).
    """
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DISK_FULL
    if exc.errno == errno.ENOENT:
        return "cannot write state: the state folder or a file in it is missing (removed while running?)"
    return f"cannot write state: {exc.strerror or exc}"


def check_model_fits(profile: Profile, backbone: Backbone) -> None:
    """Refuse a model the profile's samples do not fit.

    Parameters
    ----------
    profile : Profile
    backbone : Backbone

    Raises
    ------
    ModelError
        If ``pipeline.mean``/``std`` have neither 1 nor the model's channel count of values, or the
        replay file's samples do not have the model's input shape (exit code 3 at start-up).
    """
    channels = backbone.sample_shape[-1] if backbone.sample_shape else 1
    n = len(profile.pipeline.mean)
    if n not in (1, channels):
        raise ModelError(
            str(profile.model.path),
            f"model input has {channels} channel(s); pipeline.mean/std have {n} values",
        )
    src = profile.source
    if src.kind == "replay" and src.path is not None:
        try:  # the header only: the samples are loaded once admitted (the daemon's replay)
            shape = estimates.npz_headers(src.path)["x"][0][1:]
        except (KeyError, ValueError) as exc:
            raise ModelError(
                str(profile.model.path), f"source.path {src.path}: no sample array x ({exc})"
            ) from exc
        if shape != backbone.sample_shape:
            raise ModelError(
                str(profile.model.path),
                f"model expects samples of shape {backbone.sample_shape}, "
                f"source.path {src.path} holds {shape}",
            )


def _refused(round_no: int, exc: DecodeError | UpdateRejected) -> RoundResult:
    return RoundResult(RoundStatus.REFUSED, round_no, exc.reason, exc.detail)


class DeviceCore:
    """The device: classify, answer a round, apply a global head. No transport, no asyncio.

    Parameters
    ----------
    profile : Profile
        Device id and fleet, state directory, training settings, security keys, outbox size,
        message limits and (when ``governor`` is None) the memory cap.
    head : Head
        The head to start from (the model's factory head, version 0); a persisted global head of
        the same model replaces it.
    model_sha256 : str
        sha256 of the backbone ``.tflite`` (global heads for another model are refused).
    pipeline : Pipeline or None
        Preprocessing + interpreter; None for a core that only trains (bench/learning.py puts
        embeddings into the store itself), whose :meth:`classify` raises ``RuntimeError``.
    governor : Governor or None
        Admits and measures the phases; default one from ``profile.memory``.
    state_dir : Path or None
        Default ``profile.device.state_dir`` (created if missing).
    store_capacity : int or None
        Default ``profile.training.store_capacity``.
    phase : callable(str) -> context manager, optional
        Wraps each phase (``inference``, ``train``, ``encode``, ``apply``); default
        ``governor.phase`` (exact peak RSS). ``edgefl memory-report`` passes one that also traces
        the Python heap; it must call ``governor.phase`` itself.
    progress : callable(state, reason), optional
        Told ``("training", reason)`` when local training starts (the daemon shows it on the status).

    Raises
    ------
    OSError
        If the state directory cannot be created.
    EdgeflError
        If a configured key file cannot be read.
    """

    def __init__(
        self,
        profile: Profile,
        head: Head,
        model_sha256: str,
        *,
        pipeline: Pipeline | None = None,
        governor: Governor | None = None,
        state_dir: Path | None = None,
        store_capacity: int | None = None,
        phase: PhaseHook | None = None,
        progress: ProgressHook | None = None,
    ) -> None:
        self.profile = profile
        self.device = profile.device.id
        self.fleet = profile.device.fleet
        self.model_sha256 = model_sha256
        self.pipeline = pipeline
        self.state_dir = Path(state_dir if state_dir is not None else profile.device.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        mem = profile.memory
        self.governor = governor or Governor(
            profile.cap_bytes, mem.reserve_mb << 20, mem.min_system_available_mb << 20
        )
        self._phase: PhaseHook = phase or self.governor.phase
        self._progress = progress
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
        self.feedback = ErrorFeedback(self.state_dir, self.head.shape, model_sha256)
        capacity = store_capacity if store_capacity is not None else profile.training.store_capacity
        self.store = EmbeddingStore(
            self.state_dir, capacity, self.head.shape[0], num_classes=self.head.shape[1]
        )
        every = profile.training.holdout_every
        self.holdout: EmbeddingStore | None = (
            EmbeddingStore(
                self.state_dir / "holdout",
                holdout_capacity(capacity, every),
                self.head.shape[0],
                num_classes=self.head.shape[1],
            )
            if every
            else None
        )
        self._labelled = len(self.store) + (len(self.holdout) if self.holdout is not None else 0)
        self.new_samples = len(self.store)
        """Labelled samples stored since this device last trained for a round (the status's
        ``new_samples``, which paces the coordinator's rounds); after a restart, the whole store."""
        self.evaluation: Evaluation | None = None
        self.personal: Head | None = None
        """The personal head (None until the first personal step; :meth:`personalise`)."""
        self.personal_columns: np.ndarray = np.zeros(self.head.shape[1], dtype=bool)
        """bool [K]: the classes this device has had a label for (the columns it personalises)."""
        self.personal_evaluation: Evaluation | None = None
        """The personal head's accuracy on the holdout (:meth:`evaluate`)."""
        self.personal_fallback = False
        """The personal head did worse than the global head on the holdout: predictions use the global."""
        self.personal_deferred = 0
        """Personal steps the memory governor deferred (each waits for the next round)."""
        self._personal_due: RoundAnnouncement | None = None  # a round trained, its personal step not yet
        self._load_personal()
        self.redelivered = 0  # retained heads of the version held, skipped before decoding
        self.answered: Answered | None = self._load_answered()
        self.seen_version: int = self._load_seen_version()
        self.degraded = ""
        """Why state is not being persisted ("" when it is; :data:`DISK_FULL` on a full disk)."""
        self.write_failures = 0
        """State writes that failed (each logged; the device carries on, see :meth:`retry_persist`)."""
        self._unsaved: dict[str, Callable[[], object]] = {}  # what to write again once the disk has room
        self._logged: set[tuple[str, str]] = set()
        self.pending_round: RoundAnnouncement | None = None
        self.deferred: Deferred | None = None
        """The round the governor deferred, retried by :meth:`retry_deferred` (None: none)."""
        self.declined_total = 0
        """Rounds refused to the coordinator with a Decline message."""
        self._declines: list[RoundResult] = []  # declines of superseded deferred rounds, to send
        self.defer_writes = False
        """Leave state writes that no guarantee needs at once for :meth:`write_deferred` (the daemon
        runs it when no message waits: round latency): an applied head (a restart before
        the write comes back with the older head and takes the retained head again), the outbox
        after a PUBACK (a restart before the write sends that update once more; the coordinator
        counts an update id once) and the error-feedback file (the outbox record that keeps the
        update carries the new residual until then). False (the default): all are written at once."""
        self._deferred: dict[str, Callable[[], object]] = {}  # state -> its write, when idle
        self._deferred_since: float | None = None  # time.monotonic() of the oldest deferred write
        self.acks_unrecorded = 0
        """Updates acknowledged (PUBACK) since the outbox was last written: a restart re-sends them."""
        self._take_carried_residual()
        self.shapes = estimates.model_shapes(pipeline.backbone) if pipeline is not None else None

    @classmethod
    def open(
        cls,
        profile: Profile,
        *,
        governor: Governor | None = None,
        state_dir: Path | None = None,
        store_capacity: int | None = None,
        phase: PhaseHook | None = None,
        progress: ProgressHook | None = None,
        pipeline_mode: str | None = None,
    ) -> DeviceCore:
        """Load the profile's model and build the core around it (what ``edgefl run`` does).

        Parameters
        ----------
        profile : Profile
        governor, state_dir, store_capacity, phase, progress
            As :class:`DeviceCore`.
        pipeline_mode : "fused" | "unfused" | None
            Override ``pipeline.mode`` (None: the profile's; ``auto`` measures and picks).

        Raises
        ------
        ModelError
            If the model cannot be loaded or does not fit the profile's samples.
        """
        backbone = Backbone(
            profile.model.path,
            num_threads=profile.model.num_threads,
            runtime=profile.model.runtime,
            embedding_tensor=profile.model.embedding_tensor,
        )
        check_model_fits(profile, backbone)
        directory = Path(state_dir if state_dir is not None else profile.device.state_dir)
        directory.mkdir(parents=True, exist_ok=True)
        pcfg = profile.pipeline
        mode, batch = pipeline_mode or pcfg.mode, pcfg.batch
        if mode == "auto":
            mode, batch = choose(
                backbone,
                pcfg.mean,
                pcfg.std,
                batches=(1, 4, 8, 16),
                cache_dir=directory,
                raw_dtype=pcfg.raw_dtype,
            )
            if backbone.stateful:
                backbone.reset_state()  # the measurement's invokes changed the model's state
        pipeline = Pipeline(
            backbone, pcfg.mean, pcfg.std, mode="unfused" if mode == "unfused" else "fused", batch=batch
        )
        W, b = backbone.head_from_model()
        return cls(
            profile,
            Head(W, b, 0),
            backbone.backbone_sha256,
            pipeline=pipeline,
            governor=governor,
            state_dir=directory,
            store_capacity=store_capacity,
            phase=phase,
            progress=progress,
        )

    # --- persistence ------------------------------------------------------------------------------
    @property
    def head_path(self) -> Path:
        """The persisted global head."""
        return self.state_dir / HEAD_FILE

    @property
    def answered_path(self) -> Path:
        """The persisted last answered round."""
        return self.state_dir / ANSWERED_FILE

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

    def _load_answered(self) -> Answered | None:
        """The last answered round: the newer of the outbox record's and ``answered_round.rec``'s.

        The record is written with the outbox (one atomic write with the update that
        answers the round); ``answered_round.rec`` is what earlier versions wrote, still read.
        """
        found = [
            a
            for a in (
                self._parse_answered(self.outbox.answered, f"outbox {self.outbox.path}"),
                self._parse_answered(self._read_answered_file(), f"record {self.answered_path}"),
            )
            if a is not None
        ]
        if not found:
            return None
        last = max(found, key=lambda a: a.round)
        logger.info("last answered round %d (%s)", last.round, last.update_id)
        return last

    def _read_answered_file(self) -> Any:
        data = read_record(self.answered_path)
        if data is None:
            return None
        try:
            return cbor2.loads(data)
        except (cbor2.CBORDecodeError, ValueError, TypeError) as exc:
            logger.error("answered-round record %s unreadable (%s); ignored", self.answered_path, exc)
            return None

    def _parse_answered(self, obj: Any, where: str) -> Answered | None:
        """An :class:`Answered` from its CBOR map (None when absent, malformed or of another fleet)."""
        if obj is None:
            return None
        fleet = round_no = update_id = None
        if isinstance(obj, dict) and obj.get("v") == 1:
            fleet, round_no, update_id = obj.get("fleet"), obj.get("round"), obj.get("update_id")
        if type(fleet) is not str or type(round_no) is not int or round_no < 0 or type(update_id) is not str:
            logger.error("%s: the answered round has an unknown layout; ignored", where)
            return None
        if fleet != self.fleet:
            logger.info("%s: answered round is for fleet %s; ignored", where, fleet)
            return None
        return Answered(fleet, round_no, update_id)

    def _save_residual(self) -> None:
        """Write the error-feedback file; the outbox's next write stops carrying the residual."""
        self.feedback.save()
        self.outbox.residual = None

    def _take_carried_residual(self) -> None:
        """A residual the outbox carries that is newer than the file (its write was lost): take it."""
        carried = self.outbox.residual
        if carried is None:
            return
        fb = self.feedback
        prior = (fb.residual_W, fb.residual_b, fb.round)
        if fb.load_bytes(carried, f"outbox {self.outbox.path}") and fb.round > prior[2]:
            logger.info("error-feedback residual of round %d taken from the outbox record", fb.round)
            self._persist("residual", self._save_residual)
            return
        fb.residual_W, fb.residual_b, fb.round = prior
        self.outbox.residual = None  # the file has it already (or it is unusable)

    @staticmethod
    def _answered_map(answered: Answered) -> dict[str, Any]:
        """The CBOR map of an :class:`Answered` (kept in the outbox record)."""
        return {"v": 1, "fleet": answered.fleet, "round": answered.round, "update_id": answered.update_id}

    @property
    def seen_version_path(self) -> Path:
        """The persisted rollback floor (:attr:`seen_version`)."""
        return self.state_dir / SEEN_VERSION_FILE

    def _load_seen_version(self) -> int:
        """The newest version a signed round announced (CBOR ``{"v": 1, "fleet", "version"}``), else 0."""
        data = read_record(self.seen_version_path)
        if data is None:
            return 0
        try:
            obj = cbor2.loads(data)
            version = obj.get("version") if isinstance(obj, dict) and obj.get("v") == 1 else None
            if type(version) is not int or version < 0:
                raise ValueError("not a seen-version record")
        except (cbor2.CBORDecodeError, ValueError, TypeError) as exc:
            logger.error("seen-version record %s unusable (%s); ignored", self.seen_version_path, exc)
            return 0
        if obj.get("fleet") != self.fleet:
            logger.info("seen-version record %s is for another fleet; ignored", self.seen_version_path)
            return 0
        return version

    def _see_version(self, version: int) -> None:
        """Raise the rollback floor to ``version`` (a signed round's base version) and persist it.

        A write that fails (a full disk) keeps the floor in memory and is retried (:meth:`retry_persist`).
        """
        if version <= self.seen_version:
            return
        self.seen_version = version

        def write() -> None:
            payload = {"v": 1, "fleet": self.fleet, "version": self.seen_version}
            write_record(self.seen_version_path, cbor2.dumps(payload))

        self._persist("seen_version", write)

    def _persist(self, what: str, write: Callable[[], object]) -> bool:
        """Run one state write; on ``OSError`` count it, log it, mark the core degraded, keep it to retry.

        Parameters
        ----------
        what : str
            Names the state (``store``, ``outbox``, ``head``, ``residual``, ``seen_version``).
        write : callable
            Writes it (from the in-memory state, so a retry writes the latest); on failure it is
            run again by :meth:`retry_persist` until it succeeds or a later write of ``what`` does.

        Returns
        -------
        bool
            Whether the write succeeded.
        """
        self._deferred.pop(what, None)  # this write supersedes a deferred one (whole state from memory)
        if not self._deferred:
            self._deferred_since = None
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
            self.acks_unrecorded = 0
        if self.degraded and not self._unsaved:
            logger.warning("state writable again: persisting resumed (was %s)", self.degraded)
            self.degraded = ""
            self._logged.clear()
        return True

    def retry_persist(self) -> bool:
        """Write again what a failed write left unsaved (the daemon calls it every status interval).

        Returns
        -------
        bool
            True when nothing is left unsaved (:attr:`degraded` is then "").
        """
        for what, write in list(self._unsaved.items()):
            if not self._persist(what, write):
                return False
        return not self._unsaved

    # --- classify ---------------------------------------------------------------------------------
    def classify(self, raw: np.ndarray) -> Classified:
        """Embed and classify a batch of raw samples (phase ``inference``).

        Parameters
        ----------
        raw : [N, *sample_shape], N >= 1
            Raw samples (uint8 image / int16 window / float32 features).

        Returns
        -------
        Classified
            float32 [N, D] embeddings, int64 [N] predictions, the head version used.

        Raises
        ------
        ValueError
            If ``raw`` is empty or not of the model's sample shape.
        RuntimeError
            If this core has no pipeline.
        BudgetExceeded
            If the memory governor judges even one sample over budget: nothing was run (retry later).
        """
        if self.pipeline is None or self.shapes is None:
            raise RuntimeError("this DeviceCore has no pipeline (training only)")
        step = self._admit_inference(self.pipeline, self.shapes, len(raw))
        parts: list[F32] = []
        for s in range(0, len(raw), step):
            with self._phase("inference"):
                parts.append(self.pipeline.run(raw[s : s + step])[0])
        emb = parts[0] if len(parts) == 1 else np.concatenate(parts)
        head, kind = self.serving_head()  # one reference read: a swap between batches is atomic
        classes, scores = head.scores(emb)
        return Classified(emb, classes, head.version, scores=scores, head=kind)

    def serving_head(self) -> tuple[Head, str]:
        """The head that classifies: the personal one once it exists, unless it fell behind.

        Returns
        -------
        (Head, "personal" | "global")
            The global head when ``personal.enabled`` is false, before the first personal step, or
            while :attr:`personal_fallback` (the personal head did worse on the holdout).
        """
        personal = self.personal
        if personal is None or self.personal_fallback or not self.profile.personal.enabled:
            return self.head, "global"
        return personal, "personal"

    def _admit_inference(self, pipeline: Pipeline, shapes: estimates.ModelShapes, n: int) -> int:
        """The governor's grant for ``n`` samples: rows per invoke, the pipeline's batch set to fit.

        A batch the governor shrinks becomes the pipeline's tensor batch (the arena is sized by the
        largest batch ever allocated, so it is shrunk before a large call, never after); once the
        profile's batch fits again it is restored. Work judged over budget even at one sample is
        not run: free heap is returned to the kernel and the request asked again once, then refused.

        Raises
        ------
        BudgetExceeded
            If one sample is still over budget (nothing was run; the governor counted a deferral).
        """
        gov = self.governor
        cfg = self.profile.training
        # a grown arena stays: it must leave the smallest training run room under cap - reserve
        train_floor = estimates.estimate_train_bytes(
            cfg.chunk_floor,
            shapes.embedding_dim,
            shapes.classes,
            cfg.chunk_floor,
            max(1, len(self.store)),
            first_run=gov.phase_counts.get("train", 0) == 0,
            resident_rows=self.store.resident_rows,
        )

        def ask() -> Admission:
            return gov.admit_inference(
                shapes,
                n,
                resident_batch=pipeline.allocated_batch,
                prep=pipeline.mode,
                keep_bytes=train_floor,
            )

        adm = ask()
        if adm.deferred:
            gc.collect()
            heap.malloc_trim()
            adm = ask()
            if adm.deferred:
                raise BudgetExceeded("inference", adm.estimate_bytes, max(0, adm.budget_bytes))
        if adm.shrunk and adm.work < pipeline.tensor_batch:
            pipeline.set_tensor_batch(adm.work)
        elif not adm.shrunk and pipeline.tensor_batch < min(n, pipeline.batch):
            pipeline.set_tensor_batch(min(n, pipeline.batch))
        return adm.work

    def observe(self, raw: np.ndarray, labels: I64, labelled: np.ndarray | None = None) -> Classified:
        """Classify samples and keep the labelled ones' embeddings in the store (:meth:`keep`).

        Parameters
        ----------
        raw : [N, *sample_shape]
        labels : int64 [N]
            Class per sample, ``0 <= label < K`` (0/1 for K = 1); ignored where ``labelled`` is False.
        labelled : bool [N], optional
            Which samples carry a label (live ingest: the others wait for a late label); default all.

        Returns
        -------
        Classified
            Of all N samples; ``refused_*`` count the labelled ones the store refused.

        Raises
        ------
        ValueError
            As :meth:`classify`, or labels not matching the samples.
        """
        out = self.classify(raw)
        if labelled is None:
            refused, not_finite = self.keep(out.embeddings, labels)
        elif labelled.any():
            refused, not_finite = self.keep(out.embeddings[labelled], labels[labelled])
        else:
            refused = not_finite = 0
        if refused or not_finite:
            return dataclasses.replace(out, refused_labels=refused, refused_not_finite=not_finite)
        return out

    def keep(self, embeddings: F32, labels: I64) -> tuple[int, int]:
        """Keep labelled embeddings: every n-th in the holdout (``training.holdout_every``), others stored.

        The one way a labelled sample is stored, whether its label came with it or later (live ingest).

        Parameters
        ----------
        embeddings : float32 [M, D]
        labels : int64 [M]
            ``0 <= label < K`` (0/1 for K = 1); others are refused by the store (``bad_label``).

        Returns
        -------
        (refused_labels, refused_not_finite) : (int, int)
            Samples not stored for their label, and for a non-finite embedding.
        """
        every = self.profile.training.holdout_every
        if len(labels):
            self.personal_columns |= personal_columns(labels, self.head.shape[1])
        before = self.store.refused_not_finite + (self.holdout.refused_not_finite if self.holdout else 0)
        if self.holdout is None or not every:
            refused = self.store.add(embeddings, labels)
            self.new_samples += len(labels) - refused
        else:
            # every n-th labelled sample is held out of training, for federated evaluation
            held = (self._labelled + np.arange(len(labels))) % every == every - 1
            self._labelled += len(labels)
            refused = self.store.add(embeddings[~held], labels[~held])
            self.new_samples += int((~held).sum()) - refused
            if held.any():
                refused += self.holdout.add(embeddings[held], labels[held])
        after = self.store.refused_not_finite + (self.holdout.refused_not_finite if self.holdout else 0)
        # a full disk: the failed flush waits for retry_persist rather than failing at every batch
        if self._unflushed() >= self.profile.training.flush_every and "store" not in self._unsaved:
            self.flush_store()
        return refused, after - before

    def _unflushed(self) -> int:
        return self.store.unflushed + (self.holdout.unflushed if self.holdout is not None else 0)

    def flush_due(self) -> bool:
        """Whether a store flush is due (``training.flush_every`` or ``flush_interval_s`` reached)."""
        cfg = self.profile.training
        stores = (self.store,) if self.holdout is None else (self.store, self.holdout)
        if "store" in self._unsaved or "holdout" in self._unsaved:
            return False  # retry_persist writes it once there is room
        if self._unflushed() >= cfg.flush_every:
            return True
        return any(s.flush_due(cfg.flush_every, cfg.flush_interval_s) for s in stores)

    def unflushed_since(self) -> float | None:
        """``time.monotonic()`` of the oldest sample stored since the last flush (None: all flushed)."""
        times = [s.unflushed_since for s in (self.store, self.holdout) if s is not None]
        known = [t for t in times if t is not None]
        return min(known) if known else None

    def flush_store(self) -> bool:
        """Make the stored samples durable: flush the store and the holdout (never raises).

        Returns False if a write failed (a full disk: counted, logged, the core :attr:`degraded`,
        retried by :meth:`retry_persist`).
        """
        ok = self._persist("store", self.store.flush)
        if self.holdout is not None:
            ok = self._persist("holdout", self.holdout.flush) and ok
        return ok

    def evaluate(self) -> Evaluation | None:
        """Accuracy of the current head on the holdout store (federated evaluation), or None without one.

        Returns
        -------
        Evaluation or None
            ``version`` of the head, ``accuracy`` in [0, 1] and ``count`` samples; None when holdout is
            off or empty. Also kept in :attr:`evaluation` for the status.
        """
        if self.holdout is None or len(self.holdout) == 0:
            return None
        head = self.head
        personal = self.personal
        correct = correct_p = total = only_global = only_personal = 0
        for emb, lbl in self.holdout.chunks(256):
            right = head.predict(emb) == lbl
            correct += int(np.sum(right))
            if personal is not None:
                right_p = personal.predict(emb) == lbl
                correct_p += int(np.sum(right_p))
                only_global += int(np.sum(right & ~right_p))
                only_personal += int(np.sum(right_p & ~right))
            total += len(lbl)
        self.evaluation = Evaluation(head.version, correct / total, total)
        if personal is not None:
            self.personal_evaluation = Evaluation(personal.version, correct_p / total, total)
            behind = personal_behind(only_global, only_personal)
            if behind != self.personal_fallback:
                if behind:
                    logger.warning(
                        "personal head behind the global head on the holdout (%.3f < %.3f, %d samples): "
                        "predictions use the global head",
                        correct_p / total,
                        correct / total,
                        total,
                    )
                else:
                    logger.info(
                        "personal head back level with the global head on the holdout (%.3f >= %.3f): "
                        "predictions use the personal head",
                        correct_p / total,
                        correct / total,
                    )
            self.personal_fallback = behind
        return self.evaluation

    # --- rounds -----------------------------------------------------------------------------------
    def _verified(self, payload: bytes, kind: MessageType) -> bytes:
        """Check the coordinator's signature if a key is set (DecodeError ``unsigned``/``bad_signature``).

        A configured ``security.coordinator_public_key`` means every head and round must be signed by
        it, whatever ``require_signatures`` says (an unsigned one is ``unsigned``). The signed bytes
        bind this device's fleet and the message kind its topic carries (``docs/protocol.md``).
        """
        if self.coordinator_key is not None:
            verify_payload(payload, self.coordinator_key, fleet=self.fleet, kind=kind, limits=self.limits)
        return payload

    def receive_round(self, payload: bytes) -> RoundResult:
        """Round bytes in: verify, decode and answer a RoundAnnouncement (see :meth:`answer_round`).

        Parameters
        ----------
        payload : bytes
            The RoundAnnouncement message as received (whole, reassembled if it came in chunks).

        Returns
        -------
        RoundResult
            REFUSED with the DecodeError's reason for bad bytes; otherwise as :meth:`answer_round`.
        """
        try:
            ann = decode_round(self._verified(payload, MessageType.ROUND), limits=self.limits)
        except DecodeError as exc:
            return _refused(0, exc)
        if self.coordinator_key is not None:
            # a round signed by the coordinator vouches for its base version: no head older than it
            # is applied from now on, even an old head with a valid signature (a replay)
            self._see_version(ann.base_version)
        return self.answer_round(ann)

    def _selected(self, ann: RoundAnnouncement) -> bool:
        if isinstance(ann.selected, tuple):
            return self.device in ann.selected
        return True

    def answer_round(self, ann: RoundAnnouncement) -> RoundResult:
        """Answer a round at most once: train, error feedback, encode, sign, keep in the outbox, persist.

        In order: not selected -> NOT_SELECTED; round <= the last answered one (persisted across
        restarts) -> ANSWERED; base version newer than the head -> WAITING_HEAD (kept pending);
        older -> REFUSED ``stale_round``; empty store -> DECLINED ``no_samples`` at once; fewer than
        ``training.min_examples`` labelled examples -> DEFERRED (retried as for memory, declined
        ``too_few_examples`` after half the deadline: :meth:`retry_deferred`); the governor
        defers -> DEFERRED; else local epochs on the store (phase ``train``), error feedback on a
        compressed delta, the Update encoded and signed (phase ``encode``), kept in the outbox and
        the round recorded as answered -> TRAINED. The caller publishes ``entry.payload`` and acks
        it in the outbox after the PUBACK; if the publish fails the outbox re-sends it.

        Parameters
        ----------
        ann : RoundAnnouncement

        Returns
        -------
        RoundResult

        Notes
        -----
        Error feedback: Stich, Cordonnier, Jaggi 2018, "Sparsified SGD with Memory", Algorithm 1.
        """
        if self._personal_due is not None:
            self.personalise()  # the last round's personal step, if its caller left it for later
        prior = self.deferred
        if prior is not None and prior.ann.round < ann.round:
            # a newer round supersedes the deferred one: refuse it to the coordinator, never drop it
            self.deferred = None
            self._declines.append(self._decline_safely(prior))
        if not self._selected(ann):
            return RoundResult(RoundStatus.NOT_SELECTED, ann.round)
        if self.answered is not None and ann.round <= self.answered.round:
            return RoundResult(
                RoundStatus.ANSWERED, ann.round, detail=f"round {self.answered.round} already answered"
            )
        head = self.head
        if ann.base_version > head.version:
            self.pending_round = ann  # the global head for this round has not arrived yet
            return RoundResult(
                RoundStatus.WAITING_HEAD,
                ann.round,
                detail=f"round {ann.round} uses version {ann.base_version}, device has {head.version}",
            )
        if self.evaluation is None or self.evaluation.version != head.version:
            self.evaluate()  # the base head's federated evaluation (holdout grew since, or first round)
        if ann.base_version < head.version:
            return _refused(
                ann.round,
                UpdateRejected(
                    "stale_round",
                    f"round {ann.round} uses version {ann.base_version}, device has {head.version}",
                ),
            )
        if len(self.store) == 0:
            # nothing to train on: say so now rather than hold the round to its deadline
            if self.pending_round is not None and self.pending_round.round <= ann.round:
                self.pending_round = None
            try:
                return self.decline(ann, Reason.NO_SAMPLES, "no labelled samples stored")
            except OSError as exc:
                return RoundResult(RoundStatus.REFUSED, ann.round, "failed", str(exc))
        if self.pending_round is not None and self.pending_round.round <= ann.round:
            self.pending_round = None
        need = self.profile.training.min_examples
        if len(self.store) < need:
            # a feed may still be going: wait for more like for memory, decline when the time is up
            why = f"{len(self.store)} labelled examples stored, training.min_examples is {need}"
            return self._defer(ann, why, Reason.TOO_FEW_EXAMPLES)
        try:
            return self._train_and_encode(ann, head)
        except (ValueError, ArithmeticError, OSError) as exc:
            # a delta the codec refuses, or a state file that cannot be written (a full disk)
            return RoundResult(RoundStatus.REFUSED, ann.round, "failed", str(exc))

    def _train_and_encode(self, ann: RoundAnnouncement, head: Head) -> RoundResult:
        cfg = self.profile.training
        gov = self.governor
        D, K = head.shape
        adm = gov.admit_train(
            cfg.chunk_size,
            cfg.chunk_floor,
            dim=D,
            classes=K,
            batch_size=ann.batch_size,
            num_examples=len(self.store),
            resident_rows=self.store.resident_rows,
        )
        if adm.deferred:
            return self._defer(ann, adm.reason)
        if self._progress is not None:
            self._progress("training", adm.reason)
        self.new_samples = 0  # what is stored from now on is new for the next round
        with self._phase("train"):
            result = train_local(
                head,
                self.store,
                local_epochs=ann.local_epochs,
                lr=ann.lr,
                batch_size=ann.batch_size,
                chunk_size=adm.work,
                prox_mu=ann.prox_mu,
                clip_norm=cfg.clip_norm,
                seed=cfg.seed + ann.round,
                time_budget_s=ann.deadline_s,
            )
        enc = gov.admit(
            "encode",
            lambda _: estimates.estimate_encode_bytes(D, K, ann.compression, ann.topk_fraction),
            1,
            1,
        )
        if enc.deferred:
            return self._defer(ann, enc.reason)
        update_id = f"{self.device}:{ann.round}:{ann.base_version}"
        ev = self.evaluation
        base_eval = ev if ev is not None and ev.version == ann.base_version else None
        with self._phase("encode"):
            delta_W, delta_b = result.delta_W, result.delta_b
            compressed: CompressedDelta | None = None
            fb = self.feedback
            prior_fb = (fb.residual_W, fb.residual_b, fb.round)
            carry: bytes | None = None
            if ann.compression != Compression.NONE:
                # add what earlier compression dropped, keep what this one drops (persisted: with
                # defer_writes by the outbox write below, its own file later); the wire form is made
                # once, here
                delta_W, delta_b, compressed = fb.compress(
                    delta_W,
                    delta_b,
                    ann.compression,
                    topk_fraction=ann.topk_fraction,
                    persist=not self.defer_writes,
                    round=ann.round,
                )
                carry = fb.carry_bytes() if self.defer_writes else None
            update = Update(
                round=ann.round,
                base_version=ann.base_version,
                device=self.device,
                num_examples=result.num_examples,
                delta_W=delta_W,
                delta_b=delta_b,
                metrics=UpdateMetrics(
                    result.loss,
                    result.accuracy,
                    result.train_s,
                    gov.peak_rss_bytes,
                    # the base head's federated evaluation rides with the update (the
                    # status no longer goes out for it)
                    eval_accuracy=base_eval.accuracy if base_eval is not None else None,
                    eval_count=base_eval.count if base_eval is not None else 0,
                ),
                update_id=update_id,
                compression=ann.compression,
            )

            def encode(m: Update) -> bytes:
                return encode_update(m, topk_fraction=ann.topk_fraction, compressed=compressed)

            if self.signing_key is not None:
                payload = sign_message(encode, update, self.signing_key, fleet=self.fleet)
            else:
                payload = encode(update)
            del update, delta_W, delta_b
            # kept until its PUBACK: a restart re-sends it (same update_id), never re-trains the round
            added: list[Dropped] = []
            answered = Answered(self.fleet, ann.round, update_id)
            prior_carry = self.outbox.residual
            if carry is not None:
                self.outbox.residual = carry  # kept by the outbox's writes until the file is written
            if not self._persist(
                # one atomic write keeps the update, counts its first send (sends=1: the daemon
                # publishes it next) and records the round as answered: one fsync pair between
                # training and the publish instead of three (round latency)
                "outbox",
                lambda: added.extend(
                    self.outbox.add(
                        update_id, ann.round, payload, sends=1, answered=self._answered_map(answered)
                    )
                ),
            ):
                # not sent: a round whose update is not on disk could be answered twice after a restart
                self.outbox.forget(update_id)
                if carry is not None:  # the residual stays as it was on disk
                    self.outbox.residual = prior_carry
                    fb.residual_W, fb.residual_b, fb.round = prior_fb
                self._unsaved["outbox"] = self.outbox.save
                raise OSError(errno.EIO, f"update not kept: outbox not persisted ({self.degraded})")
            dropped = tuple(added)
            self.answered = answered
            if carry is not None:
                self._defer_write("residual", self._save_residual)
        entry = OutboxEntry(update_id, ann.round, payload)
        if self.deferred is not None and self.deferred.ann.round <= ann.round:
            self.deferred = None
        if self.profile.personal.enabled:
            self._personal_due = ann  # after the update is kept: it never depends on the personal head
        return RoundResult(
            RoundStatus.TRAINED,
            ann.round,
            entry=entry,
            dropped=dropped,
            local=result,
            update_bytes=len(payload),
        )

    def _defer(self, ann: RoundAnnouncement, reason: str, decline: str = Reason.OVER_BUDGET) -> RoundResult:
        """Keep ``ann`` as the deferred round (its first deferral time kept when deferred again)."""
        prior = self.deferred
        since = prior.since_s if prior is not None and prior.ann.round == ann.round else time.monotonic()
        self.deferred = Deferred(ann, since, reason, decline)
        return RoundResult(RoundStatus.DEFERRED, ann.round, reason)

    def retry_deferred(self, now_s: float | None = None) -> RoundResult | None:
        """Retry the deferred round once memory may have freed, or decline it when its time is up.

        Before :data:`DECLINE_AFTER_FRACTION` of the round's ``deadline_s`` has passed since its first
        deferral, free heap is returned to the kernel and the round answered again
        (:meth:`answer_round`: TRAINED, or DEFERRED again). After it, the round is refused to the
        coordinator (DECLINED, reason ``over_budget`` or ``too_few_examples``, the latest reason as
        detail) so that it is
        counted there instead of silently lost. The daemon calls this every status interval.

        Parameters
        ----------
        now_s : float, optional
            ``time.monotonic()`` (tests pass their own).

        Returns
        -------
        RoundResult or None
            None when no round is deferred.
        """
        d = self.deferred
        if d is None:
            return None
        now = time.monotonic() if now_s is None else now_s
        if now - d.since_s >= DECLINE_AFTER_FRACTION * d.ann.deadline_s:
            self.deferred = None
            return self._decline_safely(d)
        gc.collect()
        heap.malloc_trim()
        self.deferred = None  # whatever the answer now (trained, stale, answered...), unless deferred again
        result = self.answer_round(d.ann)
        if result.status == RoundStatus.DEFERRED and self.deferred is not None:
            self.deferred = dataclasses.replace(self.deferred, since_s=d.since_s)
        return result

    @property
    def declines_waiting(self) -> bool:
        """Declines of superseded deferred rounds wait for :meth:`take_declines`."""
        return bool(self._declines)

    def take_declines(self) -> list[RoundResult]:
        """Declines of deferred rounds a newer round superseded (DECLINED results to publish); cleared."""
        out, self._declines = self._declines, []
        return out

    def _decline_safely(self, d: Deferred) -> RoundResult:
        try:
            return self.decline(d.ann, d.decline, d.reason)
        except (ValueError, OSError) as exc:
            return RoundResult(RoundStatus.REFUSED, d.ann.round, "failed", f"decline not kept: {exc}")

    def decline(self, ann: RoundAnnouncement, reason: str, detail: str) -> RoundResult:
        """Refuse a round to the coordinator: a (signed) Decline kept in the outbox, the round answered.

        Parameters
        ----------
        ann : RoundAnnouncement
        reason : str
            A :class:`~edgefl.wire.reasons.Reason` value (``over_budget``).
        detail : str
            Why, for the coordinator's log (cut to 200 printable ASCII characters).

        Returns
        -------
        RoundResult
            DECLINED with the Decline as ``entry`` (publish it on ``update/<device>``).

        Raises
        ------
        OSError
            If the outbox cannot be persisted (the decline is then not kept).
        """
        update_id = f"{self.device}:{ann.round}:{ann.base_version}:declined"
        msg = Decline(ann.round, ann.base_version, self.device, str(reason), detail, update_id)
        if self.signing_key is not None:
            payload = sign_message(encode_decline, msg, self.signing_key, fleet=self.fleet)
        else:
            payload = encode_decline(msg)
        added: list[Dropped] = []
        answered = Answered(self.fleet, ann.round, update_id)
        amap = self._answered_map(answered)
        if not self._persist(
            "outbox", lambda: added.extend(self.outbox.add(update_id, ann.round, payload, answered=amap))
        ):
            self.outbox.forget(update_id)
            self._unsaved["outbox"] = self.outbox.save
            raise OSError(errno.EIO, f"decline not kept: outbox not persisted ({self.degraded})")
        self.answered = answered
        self.declined_total += 1
        logger.warning("round %d declined (%s): %s", ann.round, reason, detail)
        return RoundResult(
            RoundStatus.DECLINED,
            ann.round,
            str(reason),
            detail,
            entry=OutboxEntry(update_id, ann.round, payload),
            dropped=tuple(added),
            update_bytes=len(payload),
        )

    def take_ready_round(self) -> RoundAnnouncement | None:
        """The pending round, if it can be answered now (its head applied, samples stored); cleared.

        Returns
        -------
        RoundAnnouncement or None
            Pass it to :meth:`answer_round`.
        """
        ann = self.pending_round
        if ann is None or ann.base_version > self.head.version or len(self.store) == 0:
            return None
        self.pending_round = None
        return ann

    # --- global heads -----------------------------------------------------------------------------
    def receive_global(self, payload: bytes) -> ApplyResult:
        """Global bytes in: verify, decode, validate, apply and persist a GlobalModel (phase ``apply``).

        Parameters
        ----------
        payload : bytes
            The GlobalModel message (whole, reassembled if it came in chunks).

        Returns
        -------
        ApplyResult
            REFUSED with the reason for bad bytes or an unusable head; otherwise as :meth:`apply_global`.
        """
        held = self.head
        try:
            version = global_model_version(payload, limits=self.limits)
        except DecodeError:
            version = None  # the checks below name the problem, signature first
        if version is not None and version == held.version:
            # the retained head again (a reconnect): nothing to verify, decode or apply
            self.redelivered += 1
            return ApplyResult(ApplyStatus.SAME_VERSION, version)
        try:
            with self._phase("apply"):
                gm = decode_global_model(
                    self._verified(payload, MessageType.GLOBAL_MODEL),
                    limits=self.limits,
                    expect_shape=held.shape,
                )
                # a compressed head or a delta from the held version becomes a float32 head here
                gm = resolve_global_head(gm, held.version, held.W, held.b)
        except DecodeError as exc:
            return ApplyResult(ApplyStatus.REFUSED, reason=exc.reason, detail=exc.detail)
        return self.apply_global(gm)

    def apply_global(self, gm: GlobalModel) -> ApplyResult:
        """Validate a decoded global head, persist it and swap it in atomically.

        Refused: ``wrong_model`` (backbone sha256 differs), ``bad_shape``/``not_finite`` (values, or
        non-finite logits on a few stored embeddings), ``not_newer`` (older than the running head, or
        than :attr:`seen_version`, the newest version a signed round announced). A head file that
        cannot be written does not refuse the head: it runs, :attr:`degraded` says why, and the
        write is retried (:meth:`retry_persist`).

        Parameters
        ----------
        gm : GlobalModel

        Returns
        -------
        ApplyResult
        """
        try:
            if gm.model_sha256 != self.model_sha256:
                raise UpdateRejected(
                    "wrong_model",
                    f"global head for model {gm.model_sha256[:12]}, "
                    f"this backbone is {self.model_sha256[:12]}",
                )
            validate_head(gm.W, gm.b, self.head.shape)
            if gm.version < self.head.version:
                raise UpdateRejected(
                    "not_newer", f"global version {gm.version} <= current {self.head.version}"
                )
            if gm.version < self.seen_version:
                raise UpdateRejected(
                    "not_newer",
                    f"global version {gm.version} is older than version {self.seen_version} "
                    "announced by a signed round (a rollback)",
                )
            if gm.version == self.head.version:
                return ApplyResult(ApplyStatus.SAME_VERSION, gm.version, gm.round)
            # the outputs on a few stored embeddings must be finite too (a huge finite head can overflow)
            probe = next(self.store.chunks(8), None)
            if probe is not None and not np.isfinite(probe[0] @ gm.W + gm.b).all():
                raise UpdateRejected("not_finite", "global head gives non-finite logits on stored embeddings")
        except UpdateRejected as exc:
            return ApplyResult(ApplyStatus.REFUSED, gm.version, gm.round, exc.reason, exc.detail)
        new = Head(gm.W, gm.b, gm.version)
        if self.defer_writes:
            self._defer_write("head", lambda: write_record(self.head_path, encode_global_model(gm)))
        else:
            with self._phase("apply"):
                # a head that cannot be written (a full disk) still runs: the retained head is
                # delivered again after a restart, and the write is retried once there is room
                self._persist("head", lambda: write_record(self.head_path, encode_global_model(gm)))
        self.head = new
        self._tie_personal()
        self.evaluate()
        logger.info("applied global head version %d (round %d)", gm.version, gm.round)
        return ApplyResult(ApplyStatus.APPLIED, gm.version, gm.round)

    # --- personal head ----------------------------------------------------------------------------
    @property
    def personal_path(self) -> Path:
        """The persisted personal head (:data:`PERSONAL_FILE`)."""
        return self.state_dir / PERSONAL_FILE

    @property
    def personal_due(self) -> bool:
        """A round was trained and its personal step waits for :meth:`personalise`."""
        return self._personal_due is not None

    def _load_personal(self) -> None:
        """Restore the personal head and its classes from their record (previous generation if torn).

        Without a usable record the classes come from the labels already stored (a device that
        stored samples before it had a personal head), and the head waits for the next round.
        """
        D, K = self.head.shape
        data = read_record(self.personal_path)
        if data is not None:
            try:
                obj = cbor2.loads(data)
                if not isinstance(obj, dict) or obj.get("v") != 1:
                    raise ValueError("not a personal-head record")
                if obj.get("fleet") != self.fleet or obj.get("model_sha256") != self.model_sha256:
                    raise ValueError("for another fleet or model")
                version, shape = obj.get("version"), obj.get("shape")
                raw_W, raw_b, raw_c = obj.get("W"), obj.get("b"), obj.get("columns")
                if type(version) is not int or version < 0 or shape != [D, K]:
                    raise ValueError(f"version {version!r}, shape {shape!r}: expected shape {[D, K]}")
                if not (isinstance(raw_W, bytes) and isinstance(raw_b, bytes) and isinstance(raw_c, bytes)):
                    raise ValueError("W, b and columns must be byte strings")
                if len(raw_W) != D * K * 4 or len(raw_b) != K * 4 or len(raw_c) != K:
                    raise ValueError("array sizes do not match the shape")
                W = np.frombuffer(raw_W, dtype="<f4").reshape(D, K).astype(np.float32)
                b = np.frombuffer(raw_b, dtype="<f4").astype(np.float32)
                validate_head(W, b, (D, K))
                self.personal = Head(W, b, version)
                self.personal_columns = np.frombuffer(raw_c, dtype=np.uint8) != 0
                self._tie_personal()
                logger.info(
                    "restored personal head (pulled toward version %d, %d of %d classes personal) from %s",
                    version,
                    int(self.personal_columns.sum()),
                    K,
                    self.personal_path,
                )
                return
            except (cbor2.CBORDecodeError, ValueError, TypeError, UpdateRejected) as exc:
                logger.warning(
                    "stored personal head %s unusable (%s); a new one is trained", self.personal_path, exc
                )
        stores = [self.store] + ([self.holdout] if self.holdout is not None else [])
        for st in stores:
            for _, lbl in st.chunks(1024):
                self.personal_columns |= personal_columns(lbl, K)

    def _tie_personal(self) -> None:
        """Set the personal head's columns of never-labelled classes to the global head's (in place)."""
        personal = self.personal
        if personal is None or self.personal_columns.all():
            return
        tied = ~self.personal_columns
        personal.W[:, tied] = self.head.W[:, tied]
        personal.b[tied] = self.head.b[tied]

    def _save_personal(self) -> None:
        """Write the personal head, its classes and version (the one atomic, checksummed writer)."""
        personal = self.personal
        if personal is None:
            return
        payload = {
            "v": 1,
            "fleet": self.fleet,
            "model_sha256": self.model_sha256,
            "version": personal.version,
            "shape": list(personal.shape),
            "W": personal.W.astype("<f4").tobytes(),
            "b": personal.b.astype("<f4").tobytes(),
            "columns": self.personal_columns.astype(np.uint8).tobytes(),
        }
        write_record(self.personal_path, cbor2.dumps(payload))

    def personalise(self) -> PersonalResult | None:
        """The personal step of the last trained round: class-restricted Ditto steps, persisted, evaluated.

        Pulls the personal head (the global head's copy the first time) toward the current global
        head with ``personal.prox_lambda`` over ``personal.epochs`` passes of the store (0: the
        round's ``local_epochs``) at ``personal.lr_scale`` times the round's ``lr``, the columns of
        classes never labelled here tied to the global head
        (:func:`edgefl.agent.trainer.train_personal`); phase ``personal``, admitted by the governor
        as one head plus its gradient beside the chunk buffers. Then the head is written
        (:data:`PERSONAL_FILE`) and both heads are evaluated on the holdout (:meth:`evaluate`: a
        personal head behind the global one stops serving, :func:`personal_behind`).
        The update of the round is already kept: nothing here changes what is sent.

        Returns
        -------
        PersonalResult or None
            None when no step is due, personal heads are off, the store is empty or the governor
            deferred the step (:attr:`personal_deferred` counts it; the next round tries again).
        """
        ann = self._personal_due
        self._personal_due = None
        cfg = self.profile.personal
        if ann is None or not cfg.enabled or len(self.store) == 0:
            return None
        tcfg = self.profile.training
        glob = self.head
        D, K = glob.shape
        adm = self.governor.admit_personal(
            tcfg.chunk_size,
            tcfg.chunk_floor,
            dim=D,
            classes=K,
            batch_size=ann.batch_size,
            num_examples=len(self.store),
            resident_rows=self.store.resident_rows,
        )
        if adm.deferred:
            self.personal_deferred += 1
            return None
        current = self.personal
        # trained in place: the personal head's arrays are only read by this (single) caller thread
        W, b = (glob.W.copy(), glob.b.copy()) if current is None else (current.W, current.b)
        with self._phase("personal"):
            result = train_personal(
                W,
                b,
                glob,
                self.store,
                self.personal_columns.copy(),
                lam=cfg.prox_lambda,
                epochs=cfg.epochs or ann.local_epochs,
                lr=cfg.lr_scale * ann.lr,
                batch_size=ann.batch_size,
                chunk_size=adm.work,
                seed=tcfg.seed + ann.round + PERSONAL_SEED_OFFSET,
                time_budget_s=ann.deadline_s,
            )
        if not (np.isfinite(W).all() and np.isfinite(b).all()):
            logger.warning("personal step gave non-finite values; the next starts again from the global head")
            self.personal = None
            return result
        self.personal = Head(W, b, glob.version)
        self._persist("personal", self._save_personal)
        self.evaluate()
        return result

    # --- outbox -----------------------------------------------------------------------------------
    def mark_sent(self, update_id: str) -> int:
        """Count one publish attempt of an outbox entry (persisted); its attempts, 0 if unknown or unsaved."""
        attempts = 0

        def write() -> None:
            nonlocal attempts
            attempts = self.outbox.mark_sent(update_id)

        if not self._persist("outbox", write):
            self._unsaved["outbox"] = self.outbox.save  # the count is in memory; write the whole outbox
        return attempts

    def acknowledged(self, update_id: str) -> bool:
        """The broker acknowledged ``update_id`` (PUBACK): forget it (persisted); whether it was kept.

        With :attr:`defer_writes` the outbox is written by :meth:`write_deferred` or by its next
        write (a new update), and :attr:`acks_unrecorded` counts the entry until then.
        """
        if self.defer_writes:
            kept = self.outbox.forget(update_id)
            if kept:
                self.acks_unrecorded += 1
                self._defer_write("outbox", self.outbox.save)
            return kept
        kept = update_id in {e.update_id for e in self.outbox.pending()}
        if not self._persist("outbox", lambda: self.outbox.ack(update_id)):
            self._unsaved["outbox"] = self.outbox.save
        return kept

    def to_resend(self, current_round: int, max_sends: int = 2) -> tuple[list[Dropped], list[OutboxEntry]]:
        """After a (re)connect: drop entries of closed rounds, return those to send again.

        Parameters
        ----------
        current_round : int
            The round now open (entries of earlier rounds are dropped, ``stale_round``).
        max_sends : int
            Entries already sent this many times are not returned.

        Returns
        -------
        (dropped, pending)
        """
        dropped: list[Dropped] = []

        def write() -> None:
            dropped.extend(self.outbox.drop_stale(current_round))

        if not self._persist("outbox", write):
            self._unsaved["outbox"] = self.outbox.save
        return dropped, [e for e in self.outbox.pending() if e.sends < max_sends]

    def _defer_write(self, what: str, write: Callable[[], object]) -> None:
        """Keep ``write`` of state ``what`` for :meth:`write_deferred` (a later one replaces it)."""
        self._deferred[what] = write
        if self._deferred_since is None:
            self._deferred_since = time.monotonic()

    @property
    def head_unsaved(self) -> bool:
        """An applied head waits for :meth:`write_deferred` (:attr:`defer_writes`)."""
        return "head" in self._deferred

    @property
    def deferred_age_s(self) -> float | None:
        """Seconds the oldest deferred write has waited (None when none waits)."""
        since = self._deferred_since
        return None if since is None else time.monotonic() - since

    def write_deferred(self) -> bool:
        """Run the writes :attr:`defer_writes` left for later; True when all succeeded.

        A failed write (a full disk) is counted, logged and retried as any state write
        (:meth:`retry_persist`); it never raises.
        """
        ok = True
        for what, write in list(self._deferred.items()):
            ok = self._persist(what, write) and ok
        self._deferred.clear()
        self._deferred_since = None
        return ok

    def flush(self) -> bool:
        """Write the store's pending pages and metadata and deferred writes (end of a replay, shutdown).

        Returns False if something was not written: a failed write (a full disk) is counted and
        logged, marks the core :attr:`degraded` and is retried by :meth:`retry_persist`; it never raises.
        """
        deferred = self.write_deferred()
        return self.flush_store() and deferred

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The core's phase measurement around a caller's block (e.g. the daemon's ``publish``)."""
        with self._phase(name):
            yield
