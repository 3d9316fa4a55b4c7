"""The agent daemon: wires the parts together (the only module that does, STYLE.md rule 1).

Tasks, all in one ``TaskGroup``: the sample source (replay file) classifies every sample and keeps it
in the store; the message pump applies global heads and runs local training when a round opens; the
status loop publishes the retained DeviceStatus. The interpreter and the trainer run on one worker
thread, so one interpreter is only ever used by one thread and the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgefl.agent import memory
from edgefl.agent.config import Profile
from edgefl.agent.feedback import ErrorFeedback
from edgefl.agent.outbox import Outbox
from edgefl.agent.pipeline import Pipeline, choose
from edgefl.agent.store import EmbeddingStore
from edgefl.agent.trainer import LocalResult, train_local
from edgefl.aio import wait_event
from edgefl.errors import EdgeflError, ModelError, TransportError, UpdateRejected
from edgefl.head import Head, validate_head
from edgefl.profiles import broker_password
from edgefl.records import read_record, write_record
from edgefl.runtime import Backbone
from edgefl.tlsconf import ssl_context_for
from edgefl.topics import Topics
from edgefl.transport import Message, MqttTransport, Will
from edgefl.types import F32, I64
from edgefl.wire.chunking import Reassembler, is_chunk, publish_packet_bytes, split_message
from edgefl.wire.codec import (
    CompressedDelta,
    Compression,
    DecodeError,
    DeviceStatus,
    GlobalModel,
    Limits,
    MessageType,
    RoundAnnouncement,
    Update,
    UpdateMetrics,
    decode_global_model,
    decode_round,
    encode_global_model,
    encode_status,
    encode_update,
    offline_status,
)
from edgefl.wire.messages import global_model_version, resolve_global_head
from edgefl.wire.signing import is_signed, load_signing_key, parse_verify_key, sign_message, verify_payload

if TYPE_CHECKING:
    from edgefl.dashboard.app import DashboardState

logger = logging.getLogger(__name__)

COMPACT_STATUS_FIELDS = frozenset(
    {
        "round",
        "version",
        "reason",
        "ready",
        "store_samples",
        "rss_bytes",
        "peak_rss_bytes",
        "cap_bytes",
        "pss_bytes",
        "system_available_bytes",
        "last_update_bytes",
        "rejected",
        "pid",
    }
)
"""Status fields kept when the full status would exceed the broker's maximum packet size."""

VOLATILE_STATUS_FIELDS = frozenset(
    {
        "rss_bytes",
        "pss_bytes",
        "peak_rss_bytes",
        "system_available_bytes",
        "phase_peaks",
        "phase_last",
        "admissions",
        "inferred_total",
        "inference_accuracy",
        "pipeline",
        "transport",
    }
)
"""Status fields that move all the time: a change in them alone waits for ``status.heartbeat_s``."""


@dataclass
class AgentState:
    """Live figures of the agent (status message, dashboard)."""

    state: str = "idle"
    reason: str = ""
    round: int = 0
    last_trained_round: int = 0
    inferred_total: int = 0
    correct_total: int = 0
    stored_total: int = 0
    replay_done: bool = False
    last_update_bytes: int = 0
    local_accuracy: float = float("nan")
    rejected: Counter[str] = field(default_factory=Counter)
    redelivered: int = 0  # retained global heads of the version held, skipped before decoding


class Agent:
    """One device agent.

    Parameters
    ----------
    profile : Profile
        The validated device profile.

    Raises
    ------
    ModelError
        If the model cannot be loaded.
    """

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.device = profile.device.id
        self.topics = Topics(profile.broker.topic_prefix, profile.device.fleet)
        self.backbone = Backbone(
            profile.model.path,
            num_threads=profile.model.num_threads,
            runtime=profile.model.runtime,
            embedding_tensor=profile.model.embedding_tensor,
        )
        W, b = self.backbone.head_from_model()
        self.head = Head(W, b, 0)
        self.state_dir = Path(profile.device.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        pcfg = profile.pipeline
        self._check_shapes(profile)
        mode, batch = pcfg.mode, pcfg.batch
        if mode == "auto":
            mode, batch = choose(
                self.backbone,
                pcfg.mean,
                pcfg.std,
                batches=(1, 4, 8, 16),
                cache_dir=self.state_dir,
                raw_dtype=pcfg.raw_dtype,
            )
            if self.backbone.stateful:
                self.backbone.reset_state()  # the measurement's invokes changed the model's state
        self.pipeline = Pipeline(self.backbone, pcfg.mean, pcfg.std, mode=mode, batch=batch)
        mem = profile.memory
        self.governor = memory.Governor(
            profile.cap_bytes, mem.reserve_mb << 20, mem.min_system_available_mb << 20
        )
        self.shapes = memory.model_shapes(self.backbone)
        self.max_packet_bytes = profile.broker.max_packet_bytes
        self.limits = Limits(max_message_bytes=max(profile.broker.max_packet_bytes, 1 << 20))
        self.reassembler = Reassembler(
            max_message_bytes=self.limits.max_message_bytes,
            max_chunk_bytes=self.max_packet_bytes,
            max_total_bytes=2 * self.limits.max_message_bytes,
        )
        self._load_head()
        sec = profile.security
        self.signing_key = load_signing_key(sec.signing_key_file) if sec.signing_key_file else None
        self.coordinator_key = (
            parse_verify_key(sec.coordinator_public_key) if sec.coordinator_public_key else None
        )
        self.outbox = Outbox(self.state_dir / "outbox.rec", sec.outbox_max_bytes)
        self.feedback = ErrorFeedback(self.state_dir, self.head.shape, self.backbone.sha256)
        self.store = EmbeddingStore(
            self.state_dir,
            profile.training.store_capacity,
            self.backbone.embedding_dim,
            num_classes=self.head.shape[1],
        )
        self.state = AgentState()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgefl-worker")
        self.transport: MqttTransport | None = None
        self.stop_event = asyncio.Event()
        self._pending_round: RoundAnnouncement | None = None
        self._status_dirty = asyncio.Event()
        self.dashboard: DashboardState | None = None
        self.tls_context = ssl_context_for(profile.broker)  # bad certificate files fail at start-up
        self.dashboard_url = ""
        self._rate_window: deque[tuple[float, int]] = deque(maxlen=32)
        self._outbox_lock = asyncio.Lock()
        self._reconnected = asyncio.Event()
        self._status_connected = False  # a (re)connect happened: the next status check publishes
        self._round_lock = asyncio.Lock()

    def _check_shapes(self, profile: Profile) -> None:
        """Refuse at start-up a model the profile's samples do not fit (ModelError: exit code 3)."""
        channels = self.backbone.sample_shape[-1] if self.backbone.sample_shape else 1
        n = len(profile.pipeline.mean)
        if n not in (1, channels):
            raise ModelError(
                str(profile.model.path),
                f"model input has {channels} channel(s); pipeline.mean/std have {n} values",
            )
        src = profile.source
        if src.kind == "replay" and src.path is not None:
            with np.load(src.path) as data:
                shape = tuple(int(d) for d in data["x"].shape[1:])
            if shape != self.backbone.sample_shape:
                raise ModelError(
                    str(profile.model.path),
                    f"model expects samples of shape {self.backbone.sample_shape}, "
                    f"source.path {src.path} holds {shape}",
                )

    # --- persistence -------------------------------------------------------------------------
    def _head_path(self) -> Path:
        return self.state_dir / "global_head.rec"

    def _load_head(self) -> None:
        """Restore the last applied global head from its checksummed record (previous generation if torn)."""
        data = read_record(self._head_path())
        if data is None:
            return
        try:
            gm = decode_global_model(data, limits=self.limits, expect_shape=self.head.shape)
            if gm.model_sha256 != self.backbone.sha256:
                logger.info("stored global head belongs to another model; using the factory head")
                return
            validate_head(gm.W, gm.b, self.head.shape)
            self.head = Head(gm.W, gm.b, gm.version)
            logger.info("restored global head version %d from %s", gm.version, self._head_path())
        except EdgeflError as exc:
            logger.warning(
                "stored global head %s unusable (%s); using the factory head", self._head_path(), exc
            )

    def _save_head(self, gm: GlobalModel) -> None:
        """Persist an applied global head (atomic, checksummed, previous generation kept)."""
        write_record(self._head_path(), encode_global_model(gm))

    # --- inference ---------------------------------------------------------------------------
    def classify(self, raw: np.ndarray) -> tuple[F32, I64, int]:
        """Embed and classify a batch (runs on the worker thread).

        Parameters
        ----------
        raw : [N, *sample_shape] raw samples

        Returns
        -------
        embeddings : float32 [N, D]
        predictions : int64 [N]
        version : int
            The head version that produced the predictions.
        """
        gov = self.governor
        step = gov.admit_inference(
            self.shapes, len(raw), resident_batch=self.pipeline.tensor_batch, prep=self.pipeline.mode
        ).work
        parts: list[F32] = []
        for s in range(0, len(raw), step):
            with gov.phase("inference"):
                parts.append(self.pipeline.run(raw[s : s + step])[0])
        emb = parts[0] if len(parts) == 1 else np.concatenate(parts)
        head = self.head  # one reference read: the swap is atomic
        return emb, head.predict(emb), head.version

    async def run_source(self) -> None:
        """Replay the profile's sample file: classify every sample, store it with its label."""
        src = self.profile.source
        if src.kind != "replay" or src.path is None:
            return
        with np.load(src.path) as data:
            x = np.asarray(data["x"])
            y = np.asarray(data["y"]).astype(np.int64)
        if tuple(x.shape[1:]) != self.backbone.sample_shape:
            logger.error(
                "replay file %s: samples %s, model expects %s",
                src.path,
                x.shape[1:],
                self.backbone.sample_shape,
            )
            return
        loop = asyncio.get_running_loop()
        batch = self.pipeline.batch
        while not self.stop_event.is_set():
            for start in range(0, len(x), batch):
                if self.stop_event.is_set():
                    return
                t0 = time.monotonic()
                raw, lbl = x[start : start + batch], y[start : start + batch]
                emb, pred, _ = await loop.run_in_executor(self.executor, self.classify, raw)
                # on the worker thread: serialised with training, which reads the store
                refused = await loop.run_in_executor(self.executor, self.store.add, emb, lbl)
                if refused:
                    self.state.rejected["bad_label"] += refused
                self.state.inferred_total += len(lbl)
                self._rate_window.append((time.monotonic(), self.state.inferred_total))
                if self._pending_round is not None and self._pending_round.base_version <= self.head.version:
                    ann, self._pending_round = self._pending_round, None
                    await self.handle_round(ann)
                self.state.correct_total += int(np.sum(pred == lbl))
                self.state.stored_total += len(lbl)
                if src.rate_hz > 0:
                    await asyncio.sleep(max(0.0, len(lbl) / src.rate_hz - (time.monotonic() - t0)))
                else:
                    await asyncio.sleep(0)
            self.store.flush()
            if not self.state.replay_done:
                self.state.replay_done = True
                logger.info("replay done: %d samples stored", len(self.store))
                self._changed()
            if not src.loop:
                return

    # --- messages -----------------------------------------------------------------------------
    async def pump(self) -> None:
        """Handle incoming messages forever (each guarded: a bad message is counted, never raised)."""
        assert self.transport is not None
        while True:
            msg = await self.transport.queue.get()
            await self.handle(msg)

    def _verified(self, payload: bytes, kind: MessageType) -> bytes:
        """Check the coordinator's signature when a key is set (DecodeError `unsigned`, `bad_signature`)."""
        sec = self.profile.security
        if self.coordinator_key is not None and (sec.require_signatures or is_signed(payload)):
            verify_payload(
                payload, self.coordinator_key, fleet=self.topics.fleet, kind=kind, limits=self.limits
            )
        return payload

    async def handle(self, msg: Message) -> None:
        """Dispatch one message: GlobalModel (whole or in chunks) or RoundAnnouncement; reject anything else.

        A bad message is logged with topic, size and reason, counted in ``rejected``, and dropped.
        """
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
                held = self.head
                try:
                    version = global_model_version(payload, limits=self.limits)
                except DecodeError:
                    version = None  # the checks below name the problem, signature first
                if version is not None and version == held.version:
                    self.state.redelivered += 1  # the retained head again (reconnect): nothing to decode
                    return
                with self.governor.phase("apply"):
                    gm = decode_global_model(
                        self._verified(payload, MessageType.GLOBAL_MODEL),
                        limits=self.limits,
                        expect_shape=self.head.shape,
                    )
                    gm = resolve_global_head(gm, held.version, held.W, held.b)
                await self.apply_global(gm)
            elif topic == self.topics.round:
                await self.on_round(
                    decode_round(self._verified(payload, MessageType.ROUND), limits=self.limits)
                )
            else:
                raise DecodeError("bad_topic", f"unexpected topic {topic}")
        except (DecodeError, UpdateRejected) as exc:
            self.state.rejected[exc.reason] += 1
            logger.warning("rejected message on %s (%d bytes): %s", msg.topic, len(msg.payload), exc)
            self._changed()
        except (ValueError, ArithmeticError, EdgeflError) as exc:
            # last line of defence: whatever a message made us do failed; count it, keep running
            self.state.rejected["failed"] += 1
            logger.exception("handling %s (%d bytes) failed: %s", msg.topic, len(msg.payload), exc)
            self._set_state("idle", f"last message failed: {exc}")

    async def apply_global(self, gm: GlobalModel) -> None:
        """Validate a global head and swap it in atomically.

        Raises
        ------
        UpdateRejected
            ``wrong_model`` (backbone sha256 differs), ``bad_shape``/``not_finite``, ``not_newer``.
        """
        if gm.model_sha256 != self.backbone.sha256:
            raise UpdateRejected(
                "wrong_model",
                f"global head for model {gm.model_sha256[:12]}, this backbone is {self.backbone.sha256[:12]}",
            )
        validate_head(gm.W, gm.b, self.head.shape)
        if gm.version <= self.head.version:
            if gm.version < self.head.version:
                raise UpdateRejected(
                    "not_newer", f"global version {gm.version} <= current {self.head.version}"
                )
            return  # same version again (retained re-delivery): nothing to do
        # the outputs on a few stored embeddings must be finite too (a huge but finite head can overflow)
        probe = next(self.store.chunks(8), None)
        if probe is not None and not np.isfinite(probe[0] @ gm.W + gm.b).all():
            raise UpdateRejected("not_finite", "global head gives non-finite logits on stored embeddings")
        new = Head(gm.W, gm.b, gm.version)

        def save() -> None:
            with self.governor.phase("apply"):
                self._save_head(gm)

        await asyncio.get_running_loop().run_in_executor(self.executor, save)
        self.head = new
        logger.info("applied global head version %d (round %d)", gm.version, gm.round)
        self._changed()
        if self._pending_round is not None and self._pending_round.base_version == gm.version:
            ann, self._pending_round = self._pending_round, None
            await self.on_round(ann)

    def _selected(self, ann: RoundAnnouncement) -> bool:
        if isinstance(ann.selected, tuple):
            return self.device in ann.selected
        return True

    async def handle_round(self, ann: RoundAnnouncement) -> None:
        """``on_round`` for callers outside the message pump: a refusal is counted and logged, not raised."""
        try:
            await self.on_round(ann)
        except UpdateRejected as exc:
            self.state.rejected[exc.reason] += 1
            logger.warning("round %d not taken: %s", ann.round, exc)
            self._changed()
        except (ValueError, ArithmeticError, EdgeflError) as exc:
            self.state.rejected["failed"] += 1
            logger.exception("round %d failed: %s", ann.round, exc)
            self._set_state("idle", f"round {ann.round} failed: {exc}")

    async def on_round(self, ann: RoundAnnouncement) -> None:
        """Train for a round and publish the update (once per round; one round at a time)."""
        async with self._round_lock:
            await self._on_round(ann)

    async def _on_round(self, ann: RoundAnnouncement) -> None:
        self.state.round = ann.round
        if ann.round <= self.state.last_trained_round or not self._selected(ann):
            return
        if ann.base_version > self.head.version:
            self._pending_round = ann  # the global head for this round has not arrived yet
            return
        if ann.base_version < self.head.version:
            raise UpdateRejected(
                "stale_round",
                f"round {ann.round} uses version {ann.base_version}, device has {self.head.version}",
            )
        if len(self.store) == 0:
            self._set_state("deferred", "no local samples")
            self._pending_round = ann  # retried as soon as samples are stored
            return
        await self.train_and_send(ann)

    async def train_and_send(self, ann: RoundAnnouncement) -> None:
        """Local epochs on the store, then an Update on ``update/<device>`` with QoS 1."""
        assert self.transport is not None
        head = self.head
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
        )
        if adm.deferred:
            self._set_state("deferred", adm.reason)
            return
        self._set_state("training", adm.reason)
        loop = asyncio.get_running_loop()

        def train() -> LocalResult:
            with gov.phase("train"):
                return train_local(
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

        result = await loop.run_in_executor(self.executor, train)
        delta_W, delta_b = result.delta_W, result.delta_b
        compressed: CompressedDelta | None = None
        if ann.compression != Compression.NONE:
            # Error feedback (Stich et al. 2018): add what earlier compression dropped,
            # keep what this one drops; the wire form is made once, here.
            delta_W, delta_b, compressed = self.feedback.compress(
                delta_W, delta_b, ann.compression, topk_fraction=ann.topk_fraction
            )
        update = Update(
            round=ann.round,
            base_version=ann.base_version,
            device=self.device,
            num_examples=result.num_examples,
            delta_W=delta_W,
            delta_b=delta_b,
            metrics=UpdateMetrics(result.loss, result.accuracy, result.train_s, gov.peak_rss_bytes),
            update_id=f"{self.device}:{ann.round}:{ann.base_version}",
            compression=ann.compression,
        )
        enc = gov.admit(
            "encode", lambda _: memory.estimate_encode_bytes(D, K, ann.compression, ann.topk_fraction), 1, 1
        )
        if enc.deferred:
            self._set_state("deferred", enc.reason)
            return
        with gov.phase("encode"):

            def encode(m: Update) -> bytes:
                return encode_update(m, topk_fraction=ann.topk_fraction, compressed=compressed)

            if self.signing_key is not None:
                payload = sign_message(encode, update, self.signing_key, fleet=self.topics.fleet)
            else:
                payload = encode(update)
        async with self._outbox_lock:  # kept until its PUBACK: a restart re-sends it (same update_id)
            for dropped in await asyncio.to_thread(self.outbox.add, update.update_id, ann.round, payload):
                logger.warning("outbox: dropped %s (%s)", dropped.update_id, dropped.reason)
        self._set_state("uploading")
        try:
            with gov.phase("publish"):
                await self._send_update(update.update_id, payload)
        except TransportError as exc:
            if ann.compression != Compression.NONE:  # nothing sent: the whole corrected delta stays residual
                zeros_W, zeros_b = np.zeros_like(delta_W), np.zeros_like(delta_b)
                self.feedback.record(delta_W, delta_b, zeros_W, zeros_b)
            logger.warning("round %d: update not delivered: %s", ann.round, exc)
            self._set_state("idle", f"update not delivered: {exc}")
            return
        self.state.last_trained_round = ann.round
        self.state.last_update_bytes = len(payload)
        self.state.local_accuracy = result.accuracy
        logger.info(
            "round %d: sent update (%d examples, %d bytes, loss %.3f, %.1f ms)",
            ann.round,
            result.num_examples,
            len(payload),
            result.loss,
            result.train_s * 1e3,
        )
        self._set_state("waiting")
        await loop.run_in_executor(self.executor, memory.malloc_trim)

    def _on_transport_connect(self) -> None:
        self._reconnected.set()
        self._status_connected = True
        self._changed()

    async def outbox_loop(self) -> None:
        """On every (re)connect, re-send what the outbox still holds (QoS 1 until PUBACK, across restarts)."""
        while True:
            await self._reconnected.wait()
            self._reconnected.clear()
            await self.resend_outbox()

    def _changed(self) -> None:
        """Mark the status as changed: republish it and push it to open dashboard pages."""
        self._status_dirty.set()
        if self.dashboard is not None:
            self.dashboard.notify()

    def packet_limit(self) -> int:
        """The largest MQTT packet we may send: the profile's limit, or the broker's (CONNACK) if smaller."""
        broker = self.transport.broker_max_packet_bytes if self.transport is not None else None
        return min(self.max_packet_bytes, broker or self.max_packet_bytes)

    async def _send_update(self, update_id: str, payload: bytes) -> None:
        """Publish an update (chunked above the broker's packet limit), then drop it from the outbox.

        Raises
        ------
        TransportError
            If a chunk was not acknowledged; the update stays in the outbox for a re-send.
        """
        assert self.transport is not None
        topic = self.topics.update(self.device)
        limit = self.packet_limit()
        async with self._outbox_lock:
            await asyncio.to_thread(self.outbox.mark_sent, update_id)
        for part in split_message(payload, topic, limit, msg_id=update_id.replace(":", "-")):
            await self.transport.publish(topic, part, qos=1)
        async with self._outbox_lock:
            await asyncio.to_thread(self.outbox.ack, update_id)

    async def resend_outbox(self) -> None:
        """After a (re)connect: send each unacknowledged update of the current round again, once."""
        async with self._outbox_lock:
            dropped = await asyncio.to_thread(self.outbox.drop_stale, self.state.round)
            pending = [e for e in self.outbox.pending() if e.sends < 2]
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
    def status_fields(self) -> dict[str, Any]:
        """The DeviceStatus fields (JSON-like): memory, round, counters."""
        s = self.state
        return {
            "round": s.round,
            "version": self.head.version,
            "reason": s.reason,
            "ready": s.replay_done,
            "store_samples": len(self.store),
            "inferred_total": s.inferred_total,
            "inference_accuracy": (s.correct_total / s.inferred_total) if s.inferred_total else None,
            "last_update_bytes": s.last_update_bytes,
            "redelivered_total": s.redelivered,
            **self.governor.status(),
            "rejected": dict(s.rejected),
            "pipeline_mode": self.pipeline.mode,
            "pipeline": self.pipeline.counters(),
            "pid": os.getpid(),
            "transport": self.transport.counters() if self.transport is not None else {},
            "dashboard_url": self.dashboard_url,
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
        if self.dashboard is not None:
            fields["dashboard_connections"] = {
                "refused": self.dashboard.connections_refused_total,
                "timed_out": self.dashboard.connections_timed_out_total,
            }
        return fields

    async def status_loop(self) -> None:
        """Publish the retained status when it says something new, and at least every ``status.heartbeat_s``.

        Checked on every change and every ``status.interval_s``; a change of the
        :data:`VOLATILE_STATUS_FIELDS` alone is not news. Every (re)connect publishes (the broker may
        hold the "offline" last will).
        """
        assert self.transport is not None
        cfg = self.profile.status
        heartbeat_s = cfg.interval_s if cfg.heartbeat_s is None else cfg.heartbeat_s
        last_said, last_at = "", -math.inf
        while True:
            await wait_event(self._status_dirty, cfg.interval_s)
            self._status_dirty.clear()
            if not self.transport.connected.is_set():
                last_said = ""  # publish again once connected
                continue
            topic = self.topics.status(self.device)
            fields = self.status_fields()
            said = json.dumps(
                [self.state.state, {k: v for k, v in fields.items() if k not in VOLATILE_STATUS_FIELDS}],
                sort_keys=True,
                default=str,
            )
            if self._status_connected:
                self._status_connected, last_said = False, ""
            if said == last_said and time.monotonic() - last_at < heartbeat_s:
                continue
            payload = encode_status(DeviceStatus(self.device, self.state.state, fields))
            if publish_packet_bytes(topic, len(payload)) > self.packet_limit():
                # A retained status is one message: under a small broker packet limit, send the essentials.
                fields = {k: v for k, v in fields.items() if k in COMPACT_STATUS_FIELDS}
                payload = encode_status(DeviceStatus(self.device, self.state.state, fields))
            try:
                await self.transport.publish(topic, payload, qos=1, retain=True)
            except TransportError as exc:
                logger.debug("status not published: %s", exc)
                last_said = ""  # try again at the next check
                continue
            last_said, last_at = said, time.monotonic()

    # --- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Run until SIGTERM/SIGINT (or ``stop_event``), then stop in reverse order within a time budget."""
        loop = asyncio.get_running_loop()
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
        )
        async with contextlib.AsyncExitStack() as stack:
            await self.transport.start(wait_s=None)
            stack.push_async_callback(
                self.transport.stop, (self.topics.status(self.device), offline_status(self.device))
            )
            stack.callback(self.executor.shutdown, wait=True)
            d = self.profile.dashboard
            if d.enabled:
                from edgefl.dashboard.app import DashboardState, serve  # lazy: aiohttp costs ~12 MiB of RSS

                self.dashboard = DashboardState(
                    "device",
                    self.device,
                    self.dashboard_status,
                    token=d.token,
                    header_timeout_s=d.header_timeout_s,
                    body_timeout_s=d.body_timeout_s,
                    max_connections=d.max_connections,
                    max_connections_per_client=d.max_connections_per_client,
                )
                runner, port = await serve(self.dashboard, d.host, d.port)
                stack.push_async_callback(runner.cleanup)
                self.dashboard_url = f"http://{d.host}:{port}/"
                logger.info("dashboard on %s", self.dashboard_url)
            # "global/#" matches "global" itself and the chunk topics "global/<i>" of a large head
            await self.transport.subscribe(self.topics.global_model + "/#", 1)
            await self.transport.subscribe(self.topics.round, 1)
            try:
                async with asyncio.TaskGroup() as tg:
                    tasks = [
                        tg.create_task(self.run_source()),
                        tg.create_task(self.pump()),
                        tg.create_task(self.status_loop()),
                        tg.create_task(self.outbox_loop()),
                    ]
                    await self.stop_event.wait()
                    for t in tasks:
                        t.cancel()
            finally:
                self.store.flush()
        logger.info("agent %s stopped", self.device)
