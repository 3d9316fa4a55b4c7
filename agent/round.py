"""The device's round: a RoundAnnouncement in, an update (or a Decline) kept in the outbox out.

No transport, no asyncio: the caller publishes ``entry.payload``.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from edgefl import heap
from edgefl.agent import estimates
from edgefl.agent.outbox import Answered, Dropped, OutboxEntry
from edgefl.agent.personal import PersonalHeads
from edgefl.agent.state import ProgressHook
from edgefl.agent.trainer import LocalResult, train_local
from edgefl.errors import DecodeError
from edgefl.head import Head
from edgefl.wire.cbor import MessageType, Scanned
from edgefl.wire.compression import CompressedDelta, Compression
from edgefl.wire.reasons import Reason
from edgefl.wire.rounds import (
    Decline,
    RoundAnnouncement,
    Update,
    UpdateMetrics,
    decode_round,
    encode_decline,
    encode_update,
)
from edgefl.wire.signing import sign_message, verify_payload

logger = logging.getLogger(__name__)

_P = TypeVar("_P", bound=bytes | Scanned)


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
    """Training or encoding deferred (``reason`` says why); retried by :meth:`DeviceCore.retry_deferred`."""
    DECLINED = "declined"
    """Refused to the coordinator: a Decline kept in the outbox (:attr:`RoundResult.entry`)."""
    REFUSED = "refused"
    """A bad or unusable announcement: ``reason`` is the refusal's code (counted by the caller)."""


@dataclass(frozen=True, slots=True)
class RoundResult:
    """The outcome of one round announcement.

    ``round`` the announced round (0 when the bytes did not decode); ``reason`` for REFUSED the
    refusal code (``stale_round``, ``bad_signature``, ``unsigned``, a
    :class:`~edgefl.errors.DecodeError` reason, ``failed``), for DEFERRED the governor's; ``detail``
    the human-readable why. TRAINED: ``entry`` the signed, encoded Update as kept in the outbox
    (publish ``entry.payload``), ``dropped`` older outbox entries evicted to make room, ``local`` the
    local training's delta, loss, accuracy and time, ``update_bytes`` ``len(entry.payload)``;
    DECLINED: ``entry`` the Decline message, kept and published the same way.
    """

    status: RoundStatus
    round: int
    reason: str = ""
    detail: str = ""
    entry: OutboxEntry | None = None
    dropped: tuple[Dropped, ...] = ()
    local: LocalResult | None = None
    update_bytes: int = 0


DECLINE_AFTER_FRACTION = 0.5
"""A deferred round is retried until this fraction of its ``deadline_s`` has passed, then declined."""


@dataclass(frozen=True, slots=True)
class Deferred:
    """A round not answered yet, retried by :meth:`DeviceCore.retry_deferred` until its time is up.

    ``since_s``: ``time.monotonic()`` of its first deferral; ``reason``: the latest why; ``decline``:
    the Decline's reason when its time is up, ``over_budget``, ``too_few_examples`` or ``no_head``
    (``docs/protocol.md``, "Decline").
    """

    ann: RoundAnnouncement
    since_s: float
    reason: str
    decline: str = Reason.OVER_BUDGET


class RoundAnswering(PersonalHeads):
    """Answer round announcements at most once (a part of :class:`~edgefl.agent.core.DeviceCore`)."""

    def _open_rounds(self, progress: ProgressHook | None) -> None:
        """Set the round fields: none deferred or declined yet; ``progress`` as :class:`DeviceCore`'s."""
        self._progress = progress
        self.deferred: Deferred | None = None
        """The round the governor deferred, retried by :meth:`retry_deferred` (None: none)."""
        self.declined_total = 0
        """Rounds refused to the coordinator with a Decline message."""
        self._declines: list[RoundResult] = []  # declines of superseded deferred rounds, to send

    def _verified(self, payload: _P, kind: MessageType) -> _P:
        """Check the coordinator's signature if a key is set (DecodeError ``unsigned``/``bad_signature``)."""
        if self.coordinator_key is not None:
            verify_payload(payload, self.coordinator_key, fleet=self.fleet, kind=kind, limits=self.limits)
        return payload

    def receive_round(self, payload: bytes) -> RoundResult:
        """Round bytes in: verify, decode and answer a RoundAnnouncement (see :meth:`answer_round`).

        ``payload``: the whole message (reassembled if it came in chunks). REFUSED with the
        DecodeError's reason for bad bytes; otherwise as :meth:`answer_round`.
        """
        try:
            ann = decode_round(self._verified(payload, MessageType.ROUND), limits=self.limits)
        except DecodeError as exc:
            return RoundResult(RoundStatus.REFUSED, 0, exc.reason, exc.detail)
        if self.coordinator_key is not None:
            # a round signed by the coordinator vouches for its base version: no head older than it
            # is applied from now on, even an old head with a valid signature (a replay)
            self._see_version(ann.base_version)
        return self.answer_round(ann)

    def answer_round(self, ann: RoundAnnouncement) -> RoundResult:
        """Answer a round at most once: train, error feedback, encode, sign, keep in the outbox, persist.

        In order: not selected -> NOT_SELECTED; round <= the last answered one -> ANSWERED; base
        version newer than the head -> WAITING_HEAD (answered once the head comes, declined
        ``no_head`` by :meth:`retry_deferred` if it has not come in time); older -> REFUSED
        ``stale_round``; empty store -> DECLINED ``no_samples``; fewer than ``training.min_examples``
        examples, or the governor defers -> DEFERRED; else trained (phase ``train``), encoded and
        signed (phase ``encode``) and kept in the outbox with the round recorded as answered ->
        TRAINED (the caller publishes it).

        Source: error feedback, Stich, Cordonnier, Jaggi 2018, "Sparsified SGD with Memory", Algorithm 1.
        """
        if self._personal_due is not None:
            self.personalise()  # the last round's personal step, if its caller left it for later
        prior = self.deferred
        if prior is not None and prior.ann.round < ann.round:
            # a newer round supersedes the deferred one: refuse it to the coordinator, never drop it
            self.deferred = None
            self._declines.append(self._decline_safely(prior))
        if isinstance(ann.selected, tuple) and self.device not in ann.selected:
            return RoundResult(RoundStatus.NOT_SELECTED, ann.round)
        if self.answered is not None and ann.round <= self.answered.round:
            return RoundResult(
                RoundStatus.ANSWERED, ann.round, detail=f"round {self.answered.round} already answered"
            )
        head = self.head
        why = f"round {ann.round} uses version {ann.base_version}, device has {head.version}"
        if ann.base_version > head.version:
            # its head has not arrived yet: answered once it comes (take_ready_round), declined
            # (no_head) if it has not come by the deferral's time
            self._defer(ann, why, Reason.NO_HEAD)
            return RoundResult(RoundStatus.WAITING_HEAD, ann.round, detail=why)
        d = self.deferred
        if d is not None and d.ann.round == ann.round and d.decline == Reason.NO_HEAD:
            self.deferred = None  # the head came: the round is answered now, not declined
        if self.evaluation is None or self.evaluation.version != head.version:
            self.evaluate()  # the base head's federated evaluation (holdout grew since, or first round)
        if ann.base_version < head.version:
            return RoundResult(RoundStatus.REFUSED, ann.round, "stale_round", why)
        need = self.profile.training.min_examples
        try:
            if len(self.store) == 0:
                # nothing to train on: say so now rather than hold the round to its deadline
                return self.decline(ann, Reason.NO_SAMPLES, "no labelled samples stored")
            if len(self.store) < need:
                # a feed may still be going: wait for more like for memory, decline when the time is up
                why = f"{len(self.store)} labelled examples stored, training.min_examples is {need}"
                return self._defer(ann, why, Reason.TOO_FEW_EXAMPLES)
            return self._train_and_encode(ann, head)
        except (ValueError, ArithmeticError, OSError) as exc:
            # a delta the codec refuses, or a state file that cannot be written (a full disk)
            return RoundResult(RoundStatus.REFUSED, ann.round, "failed", str(exc))

    def _train_and_encode(self, ann: RoundAnnouncement, head: Head) -> RoundResult:
        cfg = self.profile.training
        gov = self.governor
        D, K = head.shape
        pcfg = self.profile.personal
        # the personal step rides on the round's batches when its epochs are the round's (softmax
        # heads) and its head fits beside training; otherwise it waits for a step of its own
        along = pcfg.enabled and K > 1 and pcfg.epochs in (0, ann.local_epochs)
        probe = self._admit_pass(ann, "train", personal=True, probe=True) if along else None
        along = probe is not None and not probe.deferred
        # the probe that fits is the admission (asked again, it would read the same RSS)
        adm = gov.keep(probe) if probe is not None and along else self._admit_pass(ann, "train")
        if adm.deferred:
            return self._defer(ann, adm.reason)
        if self._progress is not None:
            self._progress("training", adm.reason)
        # what is stored from now on is new for the next round, after a restart too (the store's next flush)
        self.store.set_mark()
        alongside = self._personal_step(ann) if along else None
        with self.phase("train"):
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
                personal=alongside,
            )
        need = estimates.estimate_encode_bytes(D, K, ann.compression, ann.topk_fraction)
        enc = gov.admit("encode", lambda _: need, 1, 1)
        if enc.deferred:
            return self._defer(ann, enc.reason)
        update_id = f"{self.device}:{ann.round}:{ann.base_version}"
        ev = self.evaluation
        base_eval = ev if ev is not None and ev.version == ann.base_version else None
        with self.phase("encode"):
            delta_W, delta_b = result.delta_W, result.delta_b
            compressed: CompressedDelta | None = None
            fb = self.feedback
            prior_fb = (fb.residual_W, fb.residual_b, fb.round)
            carry: bytes | None = None
            if ann.compression != Compression.NONE:
                # add what earlier compression dropped, keep what this one drops: persisted by the
                # outbox write below; the wire form is made once, here
                delta_W, delta_b, compressed = fb.compress(
                    delta_W, delta_b, ann.compression, topk_fraction=ann.topk_fraction, round=ann.round
                )
                carry = fb.carry_bytes()
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
                    # the base head's federated evaluation rides with the update
                    eval_accuracy=base_eval.accuracy if base_eval is not None else None,
                    eval_count=base_eval.count if base_eval is not None else 0,
                ),
                update_id=update_id,
                compression=ann.compression,
            )

            def encode(m: Update) -> bytes:
                return encode_update(m, topk_fraction=ann.topk_fraction, compressed=compressed)

            payload = self._signed(encode, update)
            del update, delta_W, delta_b
            prior_carry = self.outbox.residual
            if carry is not None:
                self.outbox.residual = carry  # kept by this write of the outbox and every later one
            try:
                # its first send counted in the same write (sends=1: the daemon publishes it next)
                dropped = self._keep_answer(ann, update_id, payload, "update", sends=1)
            except OSError:
                if carry is not None:  # the residual stays as it was
                    self.outbox.residual = prior_carry
                    fb.residual_W, fb.residual_b, fb.round = prior_fb
                raise
        entry = OutboxEntry(update_id, ann.round, payload)
        if self.deferred is not None and self.deferred.ann.round <= ann.round:
            self.deferred = None
        if alongside is not None and result.personal is not None:
            # trained with the global head, after the update is kept: nothing sent depends on it
            self._adopt_personal(alongside.W, alongside.b, head.version, result.personal)
        elif self.profile.personal.enabled:
            self._personal_due = ann  # a step of its own, after the update is kept
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
        deferral (``now_s``: ``time.monotonic()`` by default), free heap is returned to the kernel and
        the round answered again; after it, the round is DECLINED (the deferral's reason). None when
        no round is deferred.
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
        waiting = (RoundStatus.DEFERRED, RoundStatus.WAITING_HEAD)
        if result.status in waiting and self.deferred is not None:
            self.deferred = dataclasses.replace(self.deferred, since_s=d.since_s)
        return result

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

        ``reason`` is a :class:`~edgefl.wire.reasons.Reason` value (``over_budget``), ``detail`` the
        why for the coordinator's log (cut to 200 printable ASCII characters). Returns DECLINED with
        the Decline as ``entry`` (publish it on ``update/<device>``). OSError if the outbox cannot be
        persisted (the decline is then not kept).
        """
        update_id = f"{self.device}:{ann.round}:{ann.base_version}:declined"
        msg = Decline(ann.round, ann.base_version, self.device, str(reason), detail, update_id)
        payload = self._signed(encode_decline, msg)
        dropped = self._keep_answer(ann, update_id, payload, "decline")
        self.declined_total += 1
        logger.warning("round %d declined (%s): %s", ann.round, reason, detail)
        return RoundResult(
            RoundStatus.DECLINED,
            ann.round,
            str(reason),
            detail,
            entry=OutboxEntry(update_id, ann.round, payload),
            dropped=dropped,
            update_bytes=len(payload),
        )

    def _signed(self, encode: Callable[[Any], bytes], msg: Any) -> bytes:
        """``encode(msg)``, signed with the device's key when it has one."""
        if self.signing_key is not None:
            return sign_message(encode, msg, self.signing_key, fleet=self.fleet)
        return encode(msg)

    def _keep_answer(
        self, ann: RoundAnnouncement, update_id: str, payload: bytes, what: str, sends: int = 0
    ) -> tuple[Dropped, ...]:
        """Keep an answer in the outbox with the round answered, in one write; the evicted (else OSError)."""
        added: list[Dropped] = []
        answered = Answered(self.fleet, ann.round, update_id)

        def add() -> None:
            added.extend(self.outbox.add(update_id, ann.round, payload, sends=sends, answered=answered))

        if not self._persist_outbox(add):
            self.outbox.forget(update_id)
            raise OSError(errno.EIO, f"{what} not kept: outbox not persisted ({self.degraded})")
        return tuple(added)

    @property
    def pending_round(self) -> RoundAnnouncement | None:
        """The round waiting for its global head (deferred until it comes, declined ``no_head`` if late)."""
        d = self.deferred
        return d.ann if d is not None and d.decline == Reason.NO_HEAD else None

    def take_ready_round(self) -> RoundAnnouncement | None:
        """The pending round, if it can be answered now (its head applied, samples stored)."""
        ann = self.pending_round
        if ann is None or ann.base_version > self.head.version or len(self.store) == 0:
            return None
        return ann

    def answer_ready(self) -> RoundResult | None:
        """Answer the pending round if it can be answered now (:meth:`take_ready_round`); None if not."""
        ann = self.take_ready_round()
        return None if ann is None else self.answer_round(ann)
