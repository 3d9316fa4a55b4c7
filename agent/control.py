"""The daemon's round task: round and global messages in, updates and declines out.

One task answers rounds (:meth:`RoundTask.round_loop`); other tasks only ask it
(:meth:`~edgefl.agent.reporter.StatusReporter._wake_rounds`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from edgefl import heap
from edgefl.agent.config import Profile
from edgefl.agent.core import ApplyStatus
from edgefl.agent.reporter import StatusPage
from edgefl.agent.round import RoundResult, RoundStatus
from edgefl.agent.source import SampleSource
from edgefl.aio import wait_event
from edgefl.errors import DecodeError, EdgeflError, TransportError
from edgefl.mqtt_link import Message
from edgefl.wire.chunking import Reassembler, is_chunk, split_message

logger = logging.getLogger(__name__)


IDLE_GRACE_S = 0.5
"""Seconds without a message before the core's flush (the writes left behind) and ``malloc_trim`` run."""


class RoundTask(SampleSource):
    """The one task that answers rounds, and the message pump (a part of ``edgefl.agent.daemon.Agent``)."""

    def __init__(self, profile: Profile, status_page: StatusPage | None) -> None:
        super().__init__(profile, status_page)
        self.reassembler = Reassembler(
            max_message_bytes=self.core.limits.max_message_bytes,
            max_chunk_bytes=profile.broker.max_packet_bytes,
            max_total_bytes=2 * self.core.limits.max_message_bytes,
        )
        # round and global messages wait here while the pump files samples (a round's training must not
        # hold up the transport's queue, whose overflow would drop a round or a head)
        self._control: asyncio.Queue[Message] = asyncio.Queue(maxsize=64)
        self._rounds_waiting = 0  # round-topic messages in ``_control`` (put by the pump, taken by handle)
        self._control_bytes = 0  # their payload bytes (in the transport's byte bound)
        self._next_retry_at = -math.inf  # when the deferred round may be retried again (monotonic)

    async def pump(self) -> None:
        """Take incoming messages: samples and labels to the ingest queue, the rest to the round task."""
        assert self.transport is not None
        while True:
            msg = await self.transport.queue.get()
            if self._is_ingest(msg.topic):
                self.receive_ingest(msg)
            else:
                if msg.topic == self.topics.round:
                    self._rounds_waiting += 1
                self._control_bytes += len(msg.payload)
                await self._control.put(msg)
                self._round_wake.set()

    async def round_loop(self) -> None:
        """The round task: every round is answered here, in the order its messages and asks came.

        Each pass: re-send the outbox if asked, answer the waiting round, retry the deferred one, then
        handle one message. Idle: the personal step, the status check, and after :data:`IDLE_GRACE_S`
        the personal evaluation, then the core's flush and ``malloc_trim`` if writes were left behind.
        """
        while True:
            if self._control.empty() and not self._round_asks and not self._retry_due():
                if self.core.personal_step_due:
                    # the personal step of the round just answered, once no message waits (it changes
                    # nothing that is sent; a round that comes first runs it before its training)
                    await self._personalise()
                    continue
                behind = self.core.behind_since
                if behind is not None and time.monotonic() - behind >= self.profile.training.flush_interval_s:
                    # rounds back to back: the writes left behind still go out within the store's window
                    await self._work(self.core.flush)
                    continue
                self._status_go.set()
                self._round_wake.clear()
                idle_since, wait_s = time.monotonic(), self._idle_wait_s()
                if wait_s is None:
                    await self._round_wake.wait()
                elif not await wait_event(self._round_wake, wait_s):
                    if time.monotonic() - idle_since >= IDLE_GRACE_S:
                        if self.core.personal_due:
                            # a step taken with the round's training is evaluated here, unless the
                            # next global head came first (its evaluation covers both heads)
                            await self._personalise()
                        if self.core.behind_since is not None or self._acked:
                            # a round, a head or an acknowledgement: its garbage back to the kernel too
                            await self._work(self.core.flush)
                            await self._work(heap.malloc_trim)
                    continue
            if not self._status_connected:
                self._status_go.clear()  # a round's status changes are checked once it is handled
            asks, self._round_asks = self._round_asks, set()
            try:
                if "resend" in asks:
                    await self.resend_outbox()
                if "ready" in asks:
                    await self.answer_ready()
                if self._retry_due():
                    await self.retry_deferred()
            except (ValueError, ArithmeticError, OSError, EdgeflError) as exc:
                self._fault("round", " and ".join(sorted(asks)) or "deferred round retry", exc)
            if not self._control.empty():
                msg = self._control.get_nowait()
                self._control_bytes -= len(msg.payload)
                if self.transport is not None:
                    self.transport.bytes_freed()
                await self.handle(msg)

    async def _personalise(self) -> None:
        """Run the core's due personal step (or its evaluation) on the worker; a failure is counted."""
        try:
            if await self._work(self.core.personalise) is not None:
                self._changed()
        except (ValueError, ArithmeticError, OSError, EdgeflError) as exc:
            self._fault("personal", "personal step", exc)  # the next round tries again

    def _retry_due(self) -> bool:
        return self.core.deferred is not None and time.monotonic() >= self._next_retry_at

    def _idle_wait_s(self) -> float | None:
        """How long the idle round task waits for a message: the trim's grace, the deferred round's retry."""
        core = self.core
        later = core.behind_since is not None or core.personal_due or self._acked
        waits = [IDLE_GRACE_S] if later else []
        if core.deferred is not None:
            waits.append(max(0.0, self._next_retry_at - time.monotonic()))
        return min(waits) if waits else None

    async def handle(self, msg: Message) -> None:
        """Dispatch one GlobalModel (whole or in chunks) or RoundAnnouncement; anything else is ``bad_topic``.

        A round message behind which another waits is skipped. A bad message is logged with topic,
        size and reason, counted in ``rejected``, and dropped.
        """
        what = f"message on {msg.topic[:200]} ({len(msg.payload)} bytes)"
        if msg.topic == self.topics.round:
            self._rounds_waiting -= 1
        newer_round = self._rounds_waiting > 0
        try:
            topic, payload = msg.topic, msg.payload
            if not payload:
                return  # a retained message being cleared
            base = self.topics.global_model
            if topic == base or topic.startswith(base + "/"):
                if is_chunk(payload):
                    whole = self.reassembler.feed(base, payload)
                    if whole is None:
                        return
                    payload = whole
                elif topic != base:
                    raise DecodeError("bad_chunk", f"{topic[:200]}: not a chunk")
                applied = await self._work(self.core.receive_global, payload)
                if applied.status == ApplyStatus.REFUSED:
                    self._reject(applied.reason, what, applied.detail)
                    return
                self._changed()  # a head applied, or a redelivery counted (redelivered_total is news)
                if applied.status == ApplyStatus.APPLIED:
                    await self.answer_ready()
            elif topic == self.topics.round:
                if newer_round:
                    # a persistent session's backlog after a restart, then the retained announcement:
                    # only the newest round can be open, training for an older one is wasted
                    logger.debug("%s skipped: a newer round message waits", what)
                    return
                await self.on_round(await self._work(self.core.receive_round, payload))
            else:
                raise DecodeError("bad_topic", f"unexpected topic {topic[:200]}")
        except DecodeError as exc:
            self._reject(exc.reason, what, exc.detail)
        except Exception as exc:
            # last line of defence: whatever a message made us do failed; count it, keep running (a
            # run of such messages, acknowledged when queued, never makes the daemon deaf)
            more = self._count_rejected("failed")
            if more is not None:
                logger.error("handling %s failed: %s: %s%s", what, type(exc).__name__, exc, more)
            self._set_state("idle", f"last message failed: {exc}")

    async def answer_ready(self) -> None:
        """Answer the core's pending round if it became answerable (head applied, samples stored)."""
        if self.core.pending_round is None:  # set only by worker calls already returned: no hop needed
            return
        result = await self._work(self.core.answer_ready)
        if result is not None:
            await self.on_round(result)

    async def on_round(self, result: RoundResult) -> None:
        """Act on the core's answer to a round: publish a trained update, show a deferral, count a refusal.

        Declines of deferred rounds that this answer's round superseded are published first.
        """
        # appended only by the round task's worker call that produced ``result``: no hop needed
        for superseded in self.core.take_declines():
            await self.on_round(superseded)
        for dropped in result.dropped:
            logger.warning("outbox: dropped %s (%s)", dropped.update_id, dropped.reason)
        if result.round:
            self.state.round = max(self.state.round, result.round)
        status = result.status
        if status == RoundStatus.REFUSED:
            self._reject(result.reason, f"round {result.round}", result.detail)
            if result.reason == "failed":
                self._set_state("idle", f"round {result.round} failed: {result.detail}")
        elif status == RoundStatus.DEFERRED:
            self._next_retry_at = time.monotonic() + self.profile.status.interval_s
            self._set_state("deferred", result.reason)
        elif status == RoundStatus.WAITING_HEAD:
            # answered when the head comes (answer_ready), declined no_head if it has not come in time
            self._next_retry_at = time.monotonic() + self.profile.status.interval_s
            why = f"{result.detail}: waiting for its head"
            if self.state.reason != why:  # once, not at every retry
                logger.info("round %d: %s", result.round, why)
            self._set_state("waiting", why)
        elif status == RoundStatus.ANSWERED:
            logger.info("round %d: %s; not trained again", result.round, result.detail)
            self._changed()
        elif status == RoundStatus.TRAINED:
            await self._sent(result)  # the personal step follows when no message waits (round_loop)
        elif status == RoundStatus.DECLINED:
            await self._declined(result)
        else:
            self._changed()

    async def _sent(self, result: RoundResult) -> None:
        entry, local = result.entry, result.local
        assert entry is not None and local is not None
        self._set_state("uploading")
        try:
            await self._send_update(entry.update_id, entry.payload, counted=True)
        except TransportError as exc:
            # the outbox keeps it: re-sent after the next (re)connect, the round is not trained again
            logger.warning("round %d: update not delivered yet: %s", result.round, exc)
            self._set_state("idle", f"update not delivered yet: {exc}")
            return
        self.state.last_update_bytes = result.update_bytes
        self.state.last_update_ts = round(time.time(), 3)
        self.state.local_accuracy = local.accuracy
        logger.info(
            "round %d: sent update (%d examples, %d bytes, loss %.3f, %.1f ms)",
            result.round,
            local.num_examples,
            result.update_bytes,
            local.loss,
            local.train_s * 1e3,
        )
        self._set_state("waiting")

    async def _declined(self, result: RoundResult) -> None:
        """Publish a Decline (kept in the outbox like an update: re-sent after a reconnect)."""
        entry = result.entry
        assert entry is not None
        self._set_state("idle", f"round {result.round} declined: {result.detail}")
        try:
            await self._send_update(entry.update_id, entry.payload)
        except TransportError as exc:
            logger.warning("round %d: decline not delivered yet: %s", result.round, exc)

    async def retry_deferred(self) -> None:
        """Retry the core's deferred round (memory may have freed) or send its decline when time is up."""
        self._next_retry_at = time.monotonic() + self.profile.status.interval_s  # its own news is no reason
        result = await self._work(self.core.retry_deferred)
        if result is not None:
            await self.on_round(result)

    async def _send_update(self, update_id: str, payload: bytes, counted: bool = False) -> None:
        """Publish an update (chunked), then drop it from the outbox; ``counted``: the attempt is counted.

        TransportError if a chunk was not acknowledged: the update stays in the outbox.
        """
        assert self.transport is not None
        topic = self.topics.update(self.device)
        limit = self.packet_limit()
        if not counted:
            await self._work(self.core.mark_sent, update_id)
        with self.core.phase("publish"):
            for part in split_message(payload, topic, limit, msg_id=update_id.replace(":", "-")):
                await self.transport.publish(topic, part, qos=1)
        self._acked.append(update_id)  # PUBACKed: the core hears of it with the next worker call

    async def resend_outbox(self) -> None:
        """After a (re)connect: send each unacknowledged update of the current round again, once."""
        dropped, pending = await self._work(self.core.to_resend, self.state.round)
        for d in dropped:
            logger.info("outbox: dropped %s (%s)", d.update_id, d.reason)
        for entry in pending:
            try:
                await self._send_update(entry.update_id, entry.payload)
                logger.info("outbox: re-sent %s", entry.update_id)
            except TransportError as exc:
                logger.warning("outbox: re-send of %s failed: %s", entry.update_id, exc)
