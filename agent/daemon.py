"""The agent daemon: wires tasks, transport, signals and the status page to the device core.

The device's round lives in :class:`edgefl.agent.core.DeviceCore` (classify, answer a round, apply a
global head). This module only runs it: tasks in one ``TaskGroup`` -- the sample source (live MQTT
ingest, or a replay file) feeds batches to the core and publishes a prediction per live sample; the
message pump files samples and labels into the bounded ingest queue at once (``agent/ingest.py``) and
hands round and global messages (reassembled from chunks) to the control loop, which gives them to the
core and publishes what it produced; the status loop publishes the retained DeviceStatus; the outbox
loop re-sends unacknowledged updates after every (re)connect. Every call into the core runs on one
worker thread, so the interpreter, the store and the outbox are only ever used by one thread and the
event loop never blocks.

The status page is not built here: the composition root (``edgefl/cli.py``) hands the daemon a
:class:`StatusPage` (the device package does not import the dashboard).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from edgefl.agent import estimates, heap
from edgefl.agent.config import Profile
from edgefl.agent.core import ApplyStatus, Classified, DeviceCore, RoundResult, RoundStatus
from edgefl.agent.ingest import LOGGED_REFUSALS, Ingest, Queued
from edgefl.agent.status import samples_level, status_news
from edgefl.aio import wait_event
from edgefl.errors import (
    BudgetExceeded,
    CredentialsRefused,
    DecodeError,
    EdgeflError,
    StartupError,
    TransportError,
    UpdateRejected,
)
from edgefl.profiles import broker_password
from edgefl.tlsconf import ssl_context_for
from edgefl.topics import Topics
from edgefl.transport import Message, MqttTransport, Will
from edgefl.wire.chunking import Reassembler, is_chunk, publish_packet_bytes, split_message
from edgefl.wire.messages import (
    DeviceStatus,
    Prediction,
    decode_label,
    decode_sample,
    encode_prediction,
    encode_status,
    offline_status,
)
from edgefl.wire.reasons import Reason

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

REFUSED_NOT_AUTHORIZED = "refused: not authorized"
"""What the status, the page and ``/healthz`` say while the broker refuses the agent's credentials."""
IDLE_GRACE_S = 0.5
"""Housekeeping (deferred writes, ``malloc_trim``) waits until no message came for this long (seconds)."""
DEFERRED_WRITE_MAX_S = 30.0
"""A deferred state write waits at most about this long (seconds) when rounds come back to back."""

COMPACT_STATUS_FIELDS = frozenset(
    {
        "model_sha256",
        "head_shape",
        "ts",
        "eval_version",
        "eval_accuracy",
        "personal_accuracy",
        "global_accuracy",
        "serving_head",
        "eval_count",
        "round",
        "version",
        "reason",
        "ready",
        "store_samples",
        "new_samples",
        "rss_bytes",
        "peak_rss_bytes",
        "cap_bytes",
        "pss_bytes",
        "system_available_bytes",
        "last_update_bytes",
        "rejected",
        "pid",
        "degraded",
        "samples_received",
        "labels_received",
        "predictions_published",
        "ingest_dropped",
    }
)
"""Status fields kept when the full status would exceed the broker's maximum packet size."""


class StatusPage(Protocol):
    """What the daemon needs of a status page (the CLI builds one from ``edgefl.dashboard``)."""

    async def start(self, status: Callable[[], dict[str, Any]]) -> str:
        """Start serving ``status()`` documents; return the page's URL."""

    def notify(self) -> None:
        """The status changed: push it to open pages."""

    async def stop(self) -> None:
        """Stop serving."""

    def counters(self) -> dict[str, int]:
        """Connections the page refused (over its caps) and closed (header or body timeout)."""


@dataclass
class AgentState:
    """Live figures of the agent (status message, dashboard)."""

    state: str = "idle"
    reason: str = ""
    round: int = 0
    inferred_total: int = 0
    correct_total: int = 0
    stored_total: int = 0
    replay_done: bool = False
    ingest_ready: bool = False
    """Live ingest: subscribed to the samples and labels topics."""
    labelled_total: int = 0
    """Classified samples that had a label (the denominator of ``inference_accuracy``)."""
    last_update_bytes: int = 0
    last_update_ts: float | None = None
    """Wall-clock time (Unix s) the last update was sent: with ``ts`` the page tells its age."""
    local_accuracy: float = float("nan")
    rejected: Counter[str] = field(default_factory=Counter)
    last_rejected: dict[str, str] = field(default_factory=dict)
    """The last live-ingest refusal: ``reason``, ``detail``, ``topic`` (a feed shows it)."""
    over_budget_batches: int = 0
    """Sample batches the memory governor refused to run (each retried once memory frees)."""
    faults: Counter[str] = field(default_factory=Counter)
    """Failures the daemon survived, by where: ``batch`` (a source batch), ``status`` (a status tick)."""


class Agent:
    """One device agent: the device core, driven by MQTT and a sample source.

    Parameters
    ----------
    profile : Profile
        The validated device profile.
    status_page : StatusPage or None
        Started when ``dashboard.enabled`` (the CLI passes one built from ``edgefl.dashboard``).

    Raises
    ------
    ModelError
        If the model cannot be loaded.
    """

    def __init__(self, profile: Profile, status_page: StatusPage | None = None) -> None:
        self.profile = profile
        self.device = profile.device.id
        self.topics = Topics(profile.broker.topic_prefix, profile.device.fleet)
        self.tls_context = ssl_context_for(profile.broker)  # bad certificate files fail at start-up
        self.state = AgentState()
        self.core = DeviceCore.open(profile, progress=self._progress)
        # a new head, and the outbox after a PUBACK, are written when no message waits (control_loop):
        # their fsyncs no longer sit between an announcement and its update
        self.core.defer_writes = True
        self._trim_wanted = False  # a round's garbage is returned to the kernel when idle
        self._idle_work = asyncio.Event()  # deferred writes or a trim wait (housekeeping_loop)
        self._control_activity = asyncio.Event()  # a round or global message arrived or was handled
        self._control_busy = False
        # the status may be checked now: no round or global message in hand, or a (re)connect's
        # status is due (the broker may hold the "offline" will: it never waits for a round)
        self._status_go = asyncio.Event()
        self._status_go.set()
        self.governor = self.core.governor
        self.max_packet_bytes = profile.broker.max_packet_bytes
        self.reassembler = Reassembler(
            max_message_bytes=self.core.limits.max_message_bytes,
            max_chunk_bytes=self.max_packet_bytes,
            max_total_bytes=2 * self.core.limits.max_message_bytes,
        )
        # samples larger than a packet come in chunks on their own topic: a set of their own, so a
        # stream of them never evicts a global head's half-received chunks
        self.sample_chunks = Reassembler(
            max_sets=2,
            max_message_bytes=self.core.limits.max_message_bytes,
            max_chunk_bytes=profile.broker.max_incoming_packet_bytes,
            max_total_bytes=2 * self.core.limits.max_message_bytes,
            expiry_s=30.0,
        )
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgefl-worker")
        self.transport: MqttTransport | None = None
        self.stop_event = asyncio.Event()
        self._status_dirty = asyncio.Event()
        self.status_page = status_page
        self.dashboard_url = ""
        self._rate_window: deque[tuple[float, int]] = deque(maxlen=32)
        self._reconnected = asyncio.Event()
        self._status_connected = False  # a (re)connect happened: the next status check publishes
        self._last_said, self._last_at = "", -math.inf  # what the last published status said, and when
        self._last_level = 0  # samples_level of the last status published, lowered as it drops
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_retry_at = -math.inf  # when the deferred round may be retried again (monotonic)
        src = profile.source
        self.ingest: Ingest | None = (
            Ingest(src.queue_max, src.pending_max, src.label_expiry_s) if src.kind == "mqtt" else None
        )
        self._ingest_wake = asyncio.Event()
        self._stored = asyncio.Event()  # samples were stored: flush_loop makes them durable in time
        # round and global messages wait here while the pump files samples (a round's training must not
        # hold up the transport's queue, whose overflow would drop a round or a head)
        self._control: asyncio.Queue[Message] = asyncio.Queue(maxsize=64)

    async def _work(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the worker thread (every core call goes through here)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _progress(self, state: str, reason: str) -> None:
        """The core's progress hook (worker thread): hop to the loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._set_state, state, reason)

    # --- samples ------------------------------------------------------------------------------
    async def run_source(self) -> None:
        """Run the profile's source: live ingest (:meth:`run_ingest`), or replay a sample file."""
        src = self.profile.source
        if src.kind == "mqtt":
            await self.run_ingest()
            return
        if src.kind != "replay" or src.path is None:
            return
        # admitted before it is loaded (it cannot wait: it may use the reserve, never the cap)
        need = estimates.estimate_replay_bytes(src.path)
        adm = self.core.governor.admit("replay", lambda _: need, 1, 1, deferrable=False)
        if adm.deferred:
            why = BudgetExceeded("replay", adm.estimate_bytes, max(0, adm.budget_bytes))
            self._fault("replay", f"loading {src.path}", why)
            return
        with np.load(src.path) as data:
            x = np.asarray(data["x"])
            y = np.asarray(data["y"]).astype(np.int64)
        pipeline = self.core.pipeline
        assert pipeline is not None
        batch = pipeline.batch
        while not self.stop_event.is_set():
            for start in range(0, len(x), batch):
                if self.stop_event.is_set():
                    return
                t0 = time.monotonic()
                raw, lbl = x[start : start + batch], y[start : start + batch]
                try:
                    out = await self._observe(raw, lbl)
                    if out is None:
                        return  # stopping
                except (ValueError, ArithmeticError, OSError, EdgeflError) as exc:
                    # one batch failed (e.g. InterpreterBusy): counted and logged, the next one runs
                    self._fault("batch", f"samples {start}..{start + len(lbl) - 1}", exc)
                    await asyncio.sleep(0)
                    continue
                self._count_refused(out.refused_labels, out.refused_not_finite)
                self.state.inferred_total += len(lbl)
                self._rate_window.append((time.monotonic(), self.state.inferred_total))
                if self.core.pending_round is not None:
                    await self.answer_ready()
                self.state.correct_total += int(np.sum(out.predictions == lbl))
                self.state.labelled_total += len(lbl)
                self.state.stored_total += len(lbl)
                self._stored.set()
                if src.rate_hz > 0:
                    await asyncio.sleep(max(0.0, len(lbl) / src.rate_hz - (time.monotonic() - t0)))
                else:
                    await asyncio.sleep(0)
            await self._work(self.core.flush)  # never raises: a full disk marks the core degraded
            if not self.state.replay_done:
                self.state.replay_done = True
                logger.info("replay done: %d samples stored", len(self.core.store))
                self._changed()
            if not src.loop:
                return

    # --- live ingest (MQTT samples and labels in, predictions out) -----------------------------
    def receive_ingest(self, msg: Message) -> None:
        """File a Sample into the ingest queue or apply a Label (on the loop, at once; never raises).

        A sample of another shape or dtype than the model's, a label outside [0, K), a duplicate, a
        label for no waiting sample, a label that contradicts an earlier one (``label_conflict``), or
        a retained message (a stale sample the broker would hand over again at every reconnect) is
        refused: counted in ``rejected``, and logged with topic, size and reason for the first
        :data:`~edgefl.agent.ingest.LOGGED_REFUSALS` of each reason, then only every 1000th with the
        count (a flood of bad samples must not become a flood of log lines). An empty payload (a
        retained message being cleared) is ignored.
        """
        ingest = self.ingest
        assert ingest is not None
        pipeline = self.core.pipeline
        assert pipeline is not None
        if not msg.payload:
            return
        what = f"message on {msg.topic} ({len(msg.payload)} bytes)"
        K = self.core.head.shape[1]
        try:
            if msg.retain:
                raise DecodeError(Reason.BAD_VALUE, "retained: samples and labels are never retained")
            if msg.topic == self.topics.samples(self.device):
                payload = msg.payload
                if is_chunk(payload):  # a sample larger than the packet limit ("Chunks")
                    whole = self.sample_chunks.feed(msg.topic, payload)
                    if whole is None:
                        return
                    payload = whole
                sample = decode_sample(
                    payload,
                    limits=self.core.limits,
                    sample_shape=pipeline.sample_shape,
                    dtype=self.profile.pipeline.raw_dtype,
                    num_classes=K,
                )
                dropped = ingest.offer_sample(sample)
                if dropped is not None:
                    logger.debug("ingest queue full: dropped sample %s (oldest)", dropped.id)
            else:
                ingest.offer_label(decode_label(msg.payload, limits=self.core.limits, num_classes=K))
        except Exception as exc:
            # DecodeError/UpdateRejected name their reason; any other fault is counted as ``failed``
            known = isinstance(exc, (DecodeError, UpdateRejected))
            reason = exc.reason if isinstance(exc, (DecodeError, UpdateRejected)) else "failed"
            detail = exc.detail if isinstance(exc, (DecodeError, UpdateRejected)) else repr(exc)
            self.state.rejected[reason] += 1
            self.state.last_rejected = {"reason": str(reason), "detail": detail[:200], "topic": msg.topic}
            n = self.state.rejected[reason]
            if n <= LOGGED_REFUSALS or n % 1000 == 0:
                more = f" ({n} {reason} so far)" if n > LOGGED_REFUSALS else ""
                log = logger.warning if known else logger.error
                log("rejected %s: %s: %s%s", what, reason, detail, more)
            return
        self._ingest_wake.set()

    async def run_ingest(self) -> None:
        """Classify queued samples in batches, store the labelled, park the rest, publish predictions."""
        ingest = self.ingest
        assert ingest is not None
        pipeline = self.core.pipeline
        assert pipeline is not None
        tick_s = min(1.0, self.profile.source.label_expiry_s)
        while True:
            await wait_event(self._ingest_wake, tick_s)
            self._ingest_wake.clear()
            ingest.expire()
            self.sample_chunks.expire()
            while ingest.has_work():
                rows = ingest.take(pipeline.batch)
                if rows:
                    try:
                        await self._classify_rows(rows)
                    except (ValueError, ArithmeticError, OSError, EdgeflError) as exc:
                        ingest.forget(rows)
                        self._fault("batch", f"samples {rows[0].id}..{rows[-1].id}", exc)
                late = ingest.take_labelled()
                if late is not None:
                    emb, labels, predicted = late
                    refused, not_finite = await self._work(self.core.keep, emb, labels)
                    self._count_refused(refused, not_finite)
                    self.state.stored_total += len(labels) - refused - not_finite
                    self._stored.set()
                    self.state.correct_total += int(np.sum(predicted == labels))
                    self.state.labelled_total += len(labels)
                if self.core.pending_round is not None:
                    await self.answer_ready()
                await asyncio.sleep(0)  # let the pump file what arrived meanwhile

    def _count_refused(self, refused_labels: int, refused_not_finite: int) -> None:
        if refused_labels:
            self.state.rejected["bad_label"] += refused_labels
        if refused_not_finite:
            self.state.rejected["not_finite"] += refused_not_finite

    async def _classify_rows(self, rows: list[Queued]) -> None:
        """One batch of live samples through the core's observe path, then a Prediction per sample."""
        ingest = self.ingest
        assert ingest is not None
        raw = np.stack([r.x for r in rows])
        labelled = np.array([r.label is not None for r in rows])
        labels = np.array([r.label if r.label is not None else 0 for r in rows], dtype=np.int64)
        out = await self._observe(raw, labels, labelled)  # waits while inference is over budget
        if out is None:  # stopping
            ingest.forget(rows)
            return
        done = time.monotonic()
        self._count_refused(out.refused_labels, out.refused_not_finite)
        n_labelled = int(labelled.sum())
        self.state.inferred_total += len(rows)
        self.state.stored_total += n_labelled - out.refused_labels - out.refused_not_finite
        self._stored.set()
        if n_labelled:
            self.state.correct_total += int(np.sum(out.predictions[labelled] == labels[labelled]))
            self.state.labelled_total += n_labelled
        self._rate_window.append((done, self.state.inferred_total))
        for i, r in enumerate(rows):  # the unlabelled wait for a late label (or one came meanwhile)
            ingest.settle(r.id, out.embeddings[i], int(out.predictions[i]))
        scores = out.scores if out.scores is not None else np.ones(len(rows), dtype=np.float32)
        predictions = [
            Prediction(
                r.id,
                int(out.predictions[i]),
                float(scores[i]),
                out.version,
                max(0.0, done - r.arrived_s),
                head=out.head,
            )
            for i, r in enumerate(rows)
        ]
        await self._publish_predictions(predictions)

    async def _publish_predictions(self, predictions: list[Prediction]) -> None:
        """Publish Predictions (``source.predictions_qos``; QoS 1 acknowledgements are awaited together)."""
        assert self.transport is not None and self.ingest is not None
        counters = self.ingest.counters
        topic = self.topics.predictions(self.device)
        qos = self.profile.source.predictions_qos
        results = await asyncio.gather(
            *(self.transport.publish(topic, encode_prediction(p), qos=qos) for p in predictions),
            return_exceptions=True,
        )
        failed = 0
        for res in results:
            if isinstance(res, TransportError):
                failed += 1
            elif isinstance(res, BaseException):
                raise res
        counters.predictions_failed += failed
        counters.predictions_published += len(results) - failed
        if failed:
            logger.debug("%d prediction(s) not published (broker unreachable or no PUBACK)", failed)

    def _is_ingest(self, topic: str) -> bool:
        return self.ingest is not None and topic in (
            self.topics.samples(self.device),
            self.topics.labels(self.device),
        )

    async def _observe(
        self, raw: np.ndarray, lbl: np.ndarray, labelled: np.ndarray | None = None
    ) -> Classified | None:
        """``core.observe`` on the worker, retried every ``status.interval_s`` while it is over budget.

        The governor never runs inference it judges over budget (``BudgetExceeded``: nothing ran);
        each refusal is counted (``over_budget_batches``) and the batch waits for memory to free.

        Returns
        -------
        Classified or None
            None when the agent is stopping.
        """
        while True:
            try:
                out = await self._work(self.core.observe, raw, lbl, labelled)
            except BudgetExceeded as exc:
                self.state.over_budget_batches += 1
                if self.state.state != "deferred":
                    logger.warning("inference not run, over budget: %s; retried when memory frees", exc)
                    self._set_state("deferred", f"inference over budget: {exc}")
                if await wait_event(self.stop_event, self.profile.status.interval_s):
                    return None
                continue
            if self.state.state == "deferred" and self.state.reason.startswith("inference"):
                self._set_state("idle")
            return out

    # --- messages -----------------------------------------------------------------------------
    async def pump(self) -> None:
        """Take incoming messages forever: samples and labels to the ingest queue, others to the control."""
        assert self.transport is not None
        while True:
            msg = await self.transport.queue.get()
            if self._is_ingest(msg.topic):
                self.receive_ingest(msg)
            else:
                await self._control.put(msg)
                self._control_activity.set()

    async def control_loop(self) -> None:
        """Handle round and global messages in order (each guarded: a bad one is counted, never raised)."""
        while True:
            msg = await self._control.get()
            self._control_busy = True
            if not self._status_connected:
                self._status_go.clear()
            try:
                await self.handle(msg)
            finally:
                self._control_busy = False
                if self._control.empty():
                    self._status_go.set()
                self._control_activity.set()
                self._want_housekeeping()

    def _want_housekeeping(self) -> None:
        if self.core.deferred_age_s is not None or self._trim_wanted:
            self._idle_work.set()

    async def housekeeping_loop(self) -> None:
        """Deferred state writes and ``malloc_trim``, once no round or global message moved for a while.

        Runs when no such message came or was handled for :data:`IDLE_GRACE_S`: the writes the core
        deferred (an applied head, the outbox after a PUBACK) and returning a round's heap. A new head
        is usually followed by its round within milliseconds, and the next round's head comes while
        the last update's tail would run: that work waits (one worker thread, whose queue it would
        otherwise hold up). Writes deferred for longer than
        :data:`DEFERRED_WRITE_MAX_S` are done after the next round's answer instead (:meth:`on_round`).
        """
        while True:
            await self._idle_work.wait()
            while True:
                self._control_activity.clear()
                if await wait_event(self._control_activity, IDLE_GRACE_S):
                    continue
                if not self._control_busy and self._control.empty():
                    break
            self._idle_work.clear()
            await self._work(self._housekeeping)

    async def flush_loop(self) -> None:
        """Flush the store within ``training.flush_interval_s`` of a sample's store.

        The core flushes at once every ``training.flush_every`` samples (:meth:`DeviceCore.keep`);
        this covers a slow feed. A flush that failed (a full disk) is left to ``retry_persist``.
        """
        interval_s = self.profile.training.flush_interval_s
        while True:
            await self._stored.wait()
            self._stored.clear()
            while True:
                since = self.core.unflushed_since()
                if since is None:
                    break
                wait_s = since + interval_s - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                    continue
                if self.core.flush_due():
                    await self._work(self.core.flush_store)
                break

    def _housekeeping(self) -> None:
        """Deferred state writes (never raise: a full disk degrades) and ``malloc_trim`` (worker thread)."""
        self.core.write_deferred()
        if self._trim_wanted:
            self._trim_wanted = False
            heap.malloc_trim()
            heap.release_file_pages()  # code and constants the round faulted in and may not run again

    def _fault(self, where: str, what: str, exc: BaseException) -> None:
        """Count and log (one line, its reason) a failure the daemon survives."""
        self.state.faults[where] += 1
        logger.error("%s: %s failed: %s: %s", where, what, type(exc).__name__, exc)
        self._changed()

    def _reject(self, reason: str, what: str, detail: str) -> None:
        self.state.rejected[reason] += 1
        logger.warning("rejected %s: %s: %s", what, reason, detail)
        self._changed()

    async def handle(self, msg: Message) -> None:
        """Dispatch one message: GlobalModel (whole or in chunks), RoundAnnouncement, Sample or Label.

        Anything else is ``bad_topic``. A bad message is logged with topic, size and reason, counted in
        ``rejected``, and dropped.
        """
        what = f"message on {msg.topic} ({len(msg.payload)} bytes)"
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
                    raise DecodeError("bad_chunk", f"{topic}: not a chunk")
                applied = await self._work(self.core.receive_global, payload)
                if applied.status == ApplyStatus.REFUSED:
                    self._reject(applied.reason, what, applied.detail)
                elif applied.status == ApplyStatus.APPLIED:
                    self._changed()
                    await self.answer_ready()
                else:
                    # a redelivery counted (redelivered_total is news): say it now, not with the
                    # next state change (it used to land in the next round's bytes)
                    self._changed()
            elif topic == self.topics.round:
                await self.on_round(await self._work(self.core.receive_round, payload))
            elif self._is_ingest(topic):
                self.receive_ingest(msg)
            else:
                raise DecodeError("bad_topic", f"unexpected topic {topic}")
        except DecodeError as exc:
            self._reject(exc.reason, what, exc.detail)
        except Exception as exc:
            # last line of defence: whatever a message made us do failed; count it, keep running (the
            # message was acknowledged when it reached the queue: a run of such messages never makes
            # the daemon deaf)
            self.state.rejected["failed"] += 1
            n = self.state.rejected["failed"]
            if n <= LOGGED_REFUSALS or n % 1000 == 0:
                more = f" ({n} failed so far)" if n > LOGGED_REFUSALS else ""
                logger.error("handling %s failed: %s: %s%s", what, type(exc).__name__, exc, more)
            self._set_state("idle", f"last message failed: {exc}")

    async def answer_ready(self) -> None:
        """Answer the core's pending round if it became answerable (head applied, samples stored)."""
        if self.core.pending_round is None:  # set only by worker calls already returned: no hop needed
            return
        ann = await self._work(self.core.take_ready_round)
        if ann is not None:
            await self.on_round(await self._work(self.core.answer_round, ann))

    async def on_round(self, result: RoundResult) -> None:
        """Act on the core's answer to a round: publish a trained update, show a deferral, count a refusal.

        Declines of deferred rounds that this answer's round superseded are published first.
        """
        if self.core.declines_waiting:  # appended only by the worker call that produced ``result``
            for declined in await self._work(self.core.take_declines):
                await self._declined(declined)
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
        elif status == RoundStatus.ANSWERED:
            logger.info("round %d: %s; not trained again", result.round, result.detail)
            self._changed()
        elif status == RoundStatus.TRAINED:
            await self._sent(result)
            # the personal head's step, once the update is out (it changes nothing that is sent)
            if self.core.personal_due and await self._work(self.core.personalise) is not None:
                self._changed()
        elif status == RoundStatus.DECLINED:
            await self._declined(result)
        else:
            self._changed()
        age = self.core.deferred_age_s
        if age is not None and age > DEFERRED_WRITE_MAX_S:  # rounds back to back: no idle time came
            await self._work(self.core.write_deferred)
        self._want_housekeeping()

    async def _sent(self, result: RoundResult) -> None:
        entry, local = result.entry, result.local
        assert entry is not None and local is not None
        for dropped in result.dropped:
            logger.warning("outbox: dropped %s (%s)", dropped.update_id, dropped.reason)
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
        self._trim_wanted = True  # when idle (housekeeping_loop): the next round's message may be here

    async def _declined(self, result: RoundResult) -> None:
        """Publish a Decline (kept in the outbox like an update: re-sent after a reconnect)."""
        entry = result.entry
        assert entry is not None
        for dropped in result.dropped:
            logger.warning("outbox: dropped %s (%s)", dropped.update_id, dropped.reason)
        self._set_state("idle", f"round {result.round} declined: {result.detail}")
        try:
            await self._send_update(entry.update_id, entry.payload)
        except TransportError as exc:
            logger.warning("round %d: decline not delivered yet: %s", result.round, exc)

    async def retry_deferred(self) -> None:
        """Retry the core's deferred round (memory may have freed) or send its decline when time is up."""
        now = time.monotonic()
        if self.core.deferred is None or now < self._next_retry_at:
            return
        self._next_retry_at = now + self.profile.status.interval_s  # a retry's own news is no reason
        result = await self._work(self.core.retry_deferred)
        if result is not None:
            await self.on_round(result)

    def _on_transport_connect(self) -> None:
        self._status_connected = True  # the next status check publishes (the broker may hold the will)
        self._status_go.set()  # ... at once, even beside a round
        self._reconnected.set()
        self._changed()

    async def outbox_loop(self) -> None:
        """On every (re)connect, re-send what the outbox still holds (QoS 1 until PUBACK, across restarts)."""
        while True:
            await self._reconnected.wait()
            self._reconnected.clear()
            await self.resend_outbox()

    def _changed(self) -> None:
        """Mark the status as changed: republish it and push it to open status pages."""
        self._status_dirty.set()
        if self.status_page is not None:
            self.status_page.notify()

    def packet_limit(self) -> int:
        """The largest MQTT packet we may send: the profile's limit, or the broker's (CONNACK) if smaller."""
        broker = self.transport.broker_max_packet_bytes if self.transport is not None else None
        return min(self.max_packet_bytes, broker or self.max_packet_bytes)

    async def _send_update(self, update_id: str, payload: bytes, counted: bool = False) -> None:
        """Publish an update (chunked above the broker's packet limit), then drop it from the outbox.

        ``counted``: the outbox already counted this attempt (a fresh update is kept with its
        first send counted, ``DeviceCore.answer_round``); otherwise it is counted (persisted) first.

        Raises
        ------
        TransportError
            If a chunk was not acknowledged; the update stays in the outbox for a re-send.
        """
        assert self.transport is not None
        topic = self.topics.update(self.device)
        limit = self.packet_limit()
        if not counted:
            await self._work(self.core.mark_sent, update_id)
        with self.core.phase("publish"):
            for part in split_message(payload, topic, limit, msg_id=update_id.replace(":", "-")):
                await self.transport.publish(topic, part, qos=1)
        await self._work(self.core.acknowledged, update_id)

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

    def _set_state(self, state: str, reason: str = "") -> None:
        self.state.state = state
        self.state.reason = reason
        self._changed()

    # --- status -------------------------------------------------------------------------------
    def status_fields(self, measure: bool = True) -> dict[str, Any]:
        """The DeviceStatus fields (JSON-like): memory, round, counters.

        ``measure=False`` leaves out the memory figures read from ``/proc`` (see
        ``Governor.status``): enough to tell whether a status has news.
        """
        s = self.state
        core = self.core
        pipeline = core.pipeline
        assert pipeline is not None
        return {
            "round": s.round,
            "version": core.head.version,
            "reason": self._reason(),
            "broker": self.broker_state(),
            "health": self.health(),
            "degraded": core.degraded,
            "write_failures": core.write_failures,
            "ready": s.replay_done or s.ingest_ready,
            "store_samples": len(core.store),
            "holdout_samples": len(core.holdout) if core.holdout is not None else 0,
            "new_samples": core.new_samples,  # labelled samples stored since the last round (paces rounds)
            "stored_total": s.stored_total,  # labelled samples stored (store and holdout) since start
            "inferred_total": s.inferred_total,
            "inference_accuracy": (s.correct_total / s.labelled_total) if s.labelled_total else None,
            "last_update_bytes": s.last_update_bytes,
            "last_update_ts": s.last_update_ts,
            "redelivered_total": core.redelivered,
            # updates a restart would send again: not yet acknowledged (PUBACK), or the ack not yet written
            "outbox_pending": len(core.outbox) + core.acks_unrecorded,
            **self.ingest_fields(),
            "deferred_round": core.deferred.ann.round if core.deferred is not None else None,
            "declined_total": core.declined_total,  # rounds refused to the coordinator (Decline)
            "over_budget_batches": s.over_budget_batches,  # inference refused by the governor
            **self.governor.status(measure=measure),
            "rejected": dict(s.rejected),
            "last_rejected": dict(s.last_rejected),
            "faults": dict(s.faults),
            "pipeline_mode": pipeline.mode,
            "pipeline": pipeline.counters(),
            # model identity: the coordinator leaves a device with another backbone out of rounds
            "model_sha256": core.model_sha256,
            "head_shape": list(core.head.shape),
            "ts": round(time.time(), 3),
            # federated evaluation of the current head on the holdout (never trained on)
            **(
                {
                    "eval_version": core.evaluation.version,
                    "eval_accuracy": core.evaluation.accuracy,
                    "eval_count": core.evaluation.count,
                }
                if core.evaluation is not None
                else {}
            ),
            # the personal head beside the global one (same holdout), and which one serves predictions
            **self.personal_fields(),
            "pid": os.getpid(),
            "dashboard_url": self.dashboard_url,
            "transport": self.transport.counters() if self.transport is not None else {},
            **(
                {"dashboard_connections": self.status_page.counters()}
                if self.status_page is not None and self.dashboard_url
                else {}
            ),
        }

    def broker_state(self) -> str:
        """``connected``, ``refused: not authorized`` (credentials refused), ``lost`` or ``connecting``."""
        t = self.transport
        if t is None:
            return "connecting"
        if t.connected.is_set():
            return "connected"
        if t.credentials_refused:
            return REFUSED_NOT_AUTHORIZED
        return "lost" if t.ever_connected else "connecting"

    def health(self) -> str:
        """``ok``, or the problem that makes ``/healthz`` answer 503 (the broker refused our credentials)."""
        return REFUSED_NOT_AUTHORIZED if self.broker_state() == REFUSED_NOT_AUTHORIZED else "ok"

    def _reason(self) -> str:
        if self.broker_state() == REFUSED_NOT_AUTHORIZED:
            return f"{REFUSED_NOT_AUTHORIZED} (broker.username / password)"
        return f"degraded: {self.core.degraded}" if self.core.degraded else self.state.reason

    async def auth_watch(self) -> None:
        """Report every refusal of our credentials; after ``broker.auth_retries`` in a row, give up.

        Raises
        ------
        CredentialsRefused
            Once the broker refused the credentials ``broker.auth_retries`` times in a row (the CLI
            exits with code 5: a wrong password does not fix itself, the unit does not restart it).
        """
        t = self.transport
        assert t is not None
        limit = self.profile.broker.auth_retries
        while True:
            await t.refused.wait()
            t.refused.clear()
            self._changed()  # the page says "refused: not authorized", /healthz 503
            if not t.credentials_refused:
                continue
            n = t.auth_refusals
            if n >= limit:
                raise CredentialsRefused(
                    f"broker {t.host}:{t.port} refused the credentials {n} times in a row "
                    f"({t.last_refusal}): check broker.username and broker.password / password_file "
                    "against the broker's password file and ACL",
                    n,
                )
            logger.error(
                "%s: broker %s:%s refused the credentials (%s), %d of broker.auth_retries = %d",
                REFUSED_NOT_AUTHORIZED,
                t.host,
                t.port,
                t.last_refusal,
                n,
                limit,
            )

    def personal_fields(self) -> dict[str, Any]:
        """``serving_head`` and, once both heads were evaluated, ``personal_accuracy``/``global_accuracy``.

        ``serving_head`` is ``"personal"`` or ``"global"`` (before the first personal step, with
        ``personal.enabled`` false, or while the personal head is behind the global one on the
        holdout: ``personal_fallback`` true).
        """
        core = self.core
        out: dict[str, Any] = {
            "serving_head": core.serving_head()[1],
            "personal_fallback": core.personal_fallback,
        }
        pe, ge = core.personal_evaluation, core.evaluation
        if pe is not None and ge is not None:
            out["personal_accuracy"] = pe.accuracy
            out["global_accuracy"] = ge.accuracy
        return out

    def ingest_fields(self) -> dict[str, int]:
        """The live ingest's counters and levels (``{}`` unless ``source.kind = "mqtt"``)."""
        if self.ingest is None:
            return {}
        c = self.ingest.counters
        return {
            "samples_received": c.samples_received,
            "labels_received": c.labels_received,
            "predictions_published": c.predictions_published,
            "predictions_failed": c.predictions_failed,
            "ingest_dropped": c.ingest_dropped,
            "ingest_queued": len(self.ingest),
            "pending_labels": self.ingest.pending,
            "conflicts_stored": c.conflicts_stored,
            "pending_expired": c.pending_expired,
            "pending_evicted": c.pending_evicted,
        }

    def inference_rate(self) -> float:
        """Samples classified per second over the last few batches (0.0 when idle)."""
        w = self._rate_window
        if len(w) < 2 or time.monotonic() - w[-1][0] > 5.0:
            return 0.0
        (t0, n0), (t1, n1) = w[0], w[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def dashboard_status(self) -> dict[str, Any]:
        """The device page's status document (see ``dashboard/app.py``): the status fields plus live ones."""
        fields = self.status_fields()
        fields.update(
            device=self.device,
            state=self.state.state,
            local_accuracy=None
            if self.state.local_accuracy != self.state.local_accuracy
            else self.state.local_accuracy,
            inference_rate=self.inference_rate(),
            broker_connected=self.transport is not None and self.transport.connected.is_set(),
        )
        return fields

    async def status_loop(self) -> None:
        """Publish the retained status when it says something new, and at least every ``status.heartbeat_s``.

        Checked on every change and every ``status.interval_s``, a change during a round or global
        message's handling once that message is handled (at most one interval later); a change of
        the volatile figures or of the round's progress alone is not news
        (:func:`edgefl.agent.status.status_news`). Every (re)connect publishes (the broker may hold
        the "offline" last will). While the core is degraded (state not persisted: a full disk),
        each check retries the writes.
        """
        assert self.transport is not None
        cfg = self.profile.status
        heartbeat_s = cfg.interval_s if cfg.heartbeat_s is None else cfg.heartbeat_s
        while True:
            await wait_event(self._status_dirty, cfg.interval_s)
            # a round marks the status changed at each step (received, trained, sent, acknowledged):
            # checked once when its messages are handled, not beside its training and publish
            # (round time); never later than one interval, at once after a (re)connect
            await wait_event(self._status_go, cfg.interval_s)
            self._status_dirty.clear()
            try:
                await self.retry_deferred()
                await self._status_tick(heartbeat_s)
            except (ValueError, ArithmeticError, OSError, EdgeflError) as exc:
                self._fault("status", "status tick", exc)  # e.g. EMFILE: the next tick tries again

    async def _status_tick(self, heartbeat_s: float) -> None:
        """Retry unsaved state if degraded, then publish the retained status if it has news (connected)."""
        assert self.transport is not None
        if self.core.degraded:  # a full disk: write what waits once there is room again
            await self._work(self.core.retry_persist)
            if not self.core.degraded:
                self._changed()
        if not self.transport.connected.is_set():
            self._last_said = ""  # publish again once connected
            return
        topic = self.topics.status(self.device)
        # round progress and volatile figures are not news; the /proc reads wait until a publish
        quick = self.status_fields(measure=False)
        said = status_news(self.state.state, quick)
        if self._status_connected:
            self._status_connected, self._last_said = False, ""
        level = samples_level(quick)
        self._last_level = min(self._last_level, level)  # trained on: the next rise is news again
        if (
            said == self._last_said
            and level <= self._last_level
            and time.monotonic() - self._last_at < heartbeat_s
        ):
            return
        fields = self.status_fields()
        payload = encode_status(DeviceStatus(self.device, self.state.state, fields))
        if publish_packet_bytes(topic, len(payload)) > self.packet_limit():
            # A retained status is one message: under a small broker packet limit, send the essentials.
            fields = {k: v for k, v in fields.items() if k in COMPACT_STATUS_FIELDS}
            payload = encode_status(DeviceStatus(self.device, self.state.state, fields))
        try:
            await self.transport.publish(topic, payload, qos=1, retain=True)
        except TransportError as exc:
            logger.debug("status not published: %s", exc)
            self._last_said = ""  # try again at the next check
            return
        self._last_said, self._last_at, self._last_level = said, time.monotonic(), level

    # --- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Run until SIGTERM/SIGINT (or ``stop_event``), then stop in reverse order within a time budget."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop_event.set)
        b = self.profile.broker
        self.transport = MqttTransport(
            b.host,
            b.port,
            f"edgefl-{self.device}",
            will=Will(self.topics.status(self.device), offline_status(self.device)),
            protocol=b.protocol,
            keepalive_s=b.keepalive_s,
            username=b.username,
            password=broker_password(b),
            on_connect=self._on_transport_connect,
            tls_context=self.tls_context,
            max_packet_bytes=self.max_packet_bytes,
            max_incoming_packet_bytes=b.max_incoming_packet_bytes,
            alternates=b.alternate_addresses,  # the other nodes of a clustered broker, tried in turn
        )
        async with contextlib.AsyncExitStack() as stack:
            await self.transport.start(wait_s=None)
            stack.push_async_callback(
                self.transport.stop, (self.topics.status(self.device), offline_status(self.device))
            )
            stack.callback(self.executor.shutdown, wait=True)
            if self.profile.dashboard.enabled and self.status_page is not None:
                d = self.profile.dashboard
                try:
                    self.dashboard_url = await self.status_page.start(self.dashboard_status)
                except OSError as exc:  # EADDRINUSE, EADDRNOTAVAIL, EACCES: a start-up error, not a crash
                    raise StartupError(
                        f"dashboard cannot listen on {d.host}:{d.port} (dashboard.host / dashboard.port): "
                        f"{exc.strerror or exc}"
                    ) from exc
                stack.push_async_callback(self.status_page.stop)
                logger.info("dashboard on %s", self.dashboard_url)
            heap.malloc_trim()  # start-up's freed heap (imports, model, page) back to the kernel
            heap.release_file_pages()  # and the library pages only start-up ran
            # The round first: its retained announcement (signed: its base version is the rollback
            # floor) reaches the core before any retained head, so a device without a head never
            # applies one older than the fleet's current version (an old signed head replayed on
            # "global"). The broker sends a subscription's retained messages after its SUBACK and
            # handles SUBSCRIBEs in order; the transport renews subscriptions in this order too.
            await self.transport.subscribe(self.topics.round, 1)
            # "global/#" matches "global" itself and the chunk topics "global/<i>" of a large head
            await self.transport.subscribe(self.topics.global_model + "/#", 1)
            if self.ingest is not None:
                src = self.profile.source
                # MQTT 5: no retained sample/label at subscribe, and the retain flag kept as published
                # so one retained while subscribed is refused too (receive_ingest)
                samples = self.topics.samples(self.device)
                await self.transport.subscribe(samples, src.samples_qos, live_only=True)
                await self.transport.subscribe(self.topics.labels(self.device), 1, live_only=True)
                self.state.ingest_ready = True
            try:
                async with asyncio.TaskGroup() as tg:
                    tasks = [
                        tg.create_task(self.run_source()),
                        tg.create_task(self.pump()),
                        tg.create_task(self.control_loop()),
                        tg.create_task(self.status_loop()),
                        tg.create_task(self.outbox_loop()),
                        tg.create_task(self.housekeeping_loop()),
                        tg.create_task(self.flush_loop()),
                        tg.create_task(self.auth_watch()),
                    ]
                    await self.stop_event.wait()
                    for t in tasks:
                        t.cancel()
            finally:
                await self._work(self.core.flush)
        logger.info("agent %s stopped", self.device)
