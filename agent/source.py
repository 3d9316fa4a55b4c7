"""The daemon's sample task: a replay file or live MQTT samples and labels in, predictions out.

With ``source.kind = "mqtt"`` the message pump files samples and labels into the bounded ingest
queue at once (:meth:`SampleSource.receive_ingest`) and :meth:`SampleSource.run_ingest` classifies
them. A round that waits for samples is handed to the round task, never answered here.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from edgefl.agent.config import Profile
from edgefl.agent.core import Classified
from edgefl.agent.ingest import Ingest, Queued
from edgefl.agent.pending import PENDING_FILE, PendingFile
from edgefl.agent.reporter import StatusPage, StatusReporter
from edgefl.aio import wait_event
from edgefl.datasets import load_xy
from edgefl.errors import BudgetExceeded, DecodeError, EdgeflError, TransportError, UpdateRejected
from edgefl.mqtt_link import Message
from edgefl.wire.chunking import Reassembler, is_chunk
from edgefl.wire.ingest import (
    IngestRefusal,
    Prediction,
    decode_label,
    decode_sample,
    encode_prediction,
    encode_refusal,
    ingest_id,
)
from edgefl.wire.reasons import Reason

logger = logging.getLogger(__name__)


class SampleSource(StatusReporter):
    """The sample source task and the live ingest (a part of :class:`~edgefl.agent.daemon.Agent`)."""

    def __init__(self, profile: Profile, status_page: StatusPage | None) -> None:
        super().__init__(profile, status_page)
        # samples larger than a packet come in chunks on their own topic: a set of their own, so a
        # stream of them never evicts a global head's half-received chunks
        self.sample_chunks = Reassembler(
            max_sets=2,
            max_message_bytes=self.core.limits.max_message_bytes,
            max_chunk_bytes=profile.broker.max_incoming_packet_bytes,
            max_total_bytes=2 * self.core.limits.max_message_bytes,
            expiry_s=30.0,
        )
        src = profile.source
        self.ingest = (
            Ingest(src.queue_max, src.pending_max, src.label_expiry_s, pending_file=self._pending_file())
            if src.kind == "mqtt"
            else None
        )
        self._ingest_wake = asyncio.Event()  # correctness: a sample or label wakes the ingest task
        self._stored = asyncio.Event()  # correctness: samples stored wake flush_loop (the flush window)

    def _pending_file(self) -> PendingFile | None:
        """The pending-label file beside the store (None without ``source.pending_max``, or if unusable)."""
        src, folder = self.profile.source, self.profile.device.state_dir
        if src.pending_max == 0:
            return None
        try:
            pf = PendingFile(folder, src.pending_max, self.core.head.shape[0])
        except (OSError, ValueError) as exc:  # the store goes on; only late labels lose their wait
            logger.error(
                "pending labels: %s cannot be used (%s): samples waiting for a label live in RAM "
                "only and a restart loses them",
                folder / PENDING_FILE,
                exc,
            )
            return None
        if pf.restored:
            logger.info(
                "pending labels: %d sample(s) waiting for a late label restored from %s",
                len(pf.restored),
                pf.path,
            )
        return pf

    def _flush(self) -> None:
        """The core's flush, then ``msync`` of the pending-label file (worker thread); never raises.

        A failure of the latter is logged, the next flush retries.
        """
        self.core.flush()
        pf = self.ingest.pending_file if self.ingest is not None else None
        if pf is None:
            return
        try:
            pf.flush()
        except OSError as exc:
            logger.warning("pending labels: flush of %s failed: %s", pf.path, exc)

    async def run_source(self) -> None:
        """Run the profile's source: live ingest (:meth:`run_ingest`), or replay a sample file."""
        src = self.profile.source
        if src.kind == "mqtt":
            await self.run_ingest()
            return
        if src.kind != "replay" or src.path is None:
            return
        adm = self.core.governor.admit_replay(src.path)  # before it is loaded
        if adm.deferred:
            why = BudgetExceeded("replay", adm.estimate_bytes, max(0, adm.budget_bytes))
            self._fault("replay", f"loading {src.path}", why)
            return
        x, y = load_xy(src.path)
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
                self.state.inferred_total += len(lbl)
                self._rate_window.append((time.monotonic(), self.state.inferred_total))
                if self.core.pending_round is not None:
                    self._wake_rounds("ready")
                self._count_stored(out.predictions, lbl, out.refused_labels, out.refused_not_finite)
                pause_s = len(lbl) / src.rate_hz - (time.monotonic() - t0) if src.rate_hz > 0 else 0.0
                await asyncio.sleep(max(0.0, pause_s))
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

        A bad, duplicate, conflicting or retained message is counted in ``rejected``, logged (see
        :meth:`_count_rejected`) and its app gets a Refusal naming its id when the id can be read.
        An empty payload (a retained message cleared) is ignored.
        """
        ingest = self.ingest
        assert ingest is not None
        pipeline = self.core.pipeline
        assert pipeline is not None
        if not msg.payload:
            return
        what = f"message on {msg.topic} ({len(msg.payload)} bytes)"
        K = self.core.head.shape[1]
        payload = msg.payload
        try:
            if msg.retain:
                raise DecodeError(Reason.BAD_VALUE, "retained: samples and labels are never retained")
            if msg.topic == self.topics.samples(self.device):
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
            if isinstance(exc, (DecodeError, UpdateRejected)):
                reason, detail, log = str(exc.reason), exc.detail, logger.warning
            else:
                reason, detail, log = "failed", repr(exc), logger.error
            self.state.last_rejected = {"reason": reason, "detail": detail[:200], "topic": msg.topic}
            more = self._count_rejected(reason)
            if more is not None:
                log("rejected %s: %s: %s%s", what, reason, detail, more)
            self._tell_app(msg.topic, payload, reason, detail)
            return
        self._ingest_wake.set()

    def _tell_app(self, topic: str, payload: bytes, reason: str, detail: str) -> None:
        """Queue a Refusal naming the refused message's id, for its app (none if the id cannot be read)."""
        assert self.ingest is not None
        sample_id = ingest_id(payload, self.core.limits)
        if sample_id is not None:
            of = "sample" if topic == self.topics.samples(self.device) else "label"
            self.ingest.refusals.append(IngestRefusal(sample_id, of, reason, detail))
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
            await self._publish_refusals()
            ingest.expire()
            self.sample_chunks.expire()
            while ingest.has_work():
                await self._publish_refusals()  # those of the messages the pump filed meanwhile
                rows = ingest.take(pipeline.batch)
                if rows and self.transport is not None:
                    self.transport.bytes_freed()  # the transport may read again (source.queue_max_bytes)
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
                    self._count_stored(predicted, labels, refused, not_finite)
                if self.core.pending_round is not None:
                    self._wake_rounds("ready")
                await asyncio.sleep(0)  # let the pump file what arrived meanwhile

    def _count_stored(self, predicted: np.ndarray, labels: np.ndarray, refused: int, not_finite: int) -> None:
        """Count labelled samples handed to the store: refused (bad label, not finite), stored, correct."""
        if refused:
            self.state.rejected["bad_label"] += refused
        if not_finite:
            self.state.rejected["not_finite"] += not_finite
        self.state.stored_total += len(labels) - refused - not_finite
        self.state.correct_total += int(np.sum(predicted == labels))
        self.state.labelled_total += len(labels)
        self._stored.set()

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
        self.state.inferred_total += len(rows)
        self._count_stored(
            out.predictions[labelled], labels[labelled], out.refused_labels, out.refused_not_finite
        )
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

    async def _publish_to_apps(self, payloads: list[bytes]) -> int:
        """Publish on ``predictions/<device>``, PUBACKs awaited together; how many failed (TransportError)."""
        assert self.transport is not None
        topic = self.topics.predictions(self.device)
        qos = self.profile.source.predictions_qos
        results = await asyncio.gather(
            *(self.transport.publish(topic, p, qos=qos) for p in payloads), return_exceptions=True
        )
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, TransportError):
                raise res
        return sum(isinstance(res, TransportError) for res in results)

    async def _publish_predictions(self, predictions: list[Prediction]) -> None:
        """Publish Predictions, counted in ``predictions_published`` / ``predictions_failed``."""
        assert self.ingest is not None
        failed = await self._publish_to_apps([encode_prediction(p) for p in predictions])
        self.ingest.counters.predictions_failed += failed
        self.ingest.counters.predictions_published += len(predictions) - failed
        if failed:
            logger.debug("%d prediction(s) not published (broker unreachable or no PUBACK)", failed)

    async def _publish_refusals(self) -> None:
        """Publish the queued Refusals to their apps."""
        assert self.ingest is not None
        refusals = self.ingest.refusals
        while refusals:
            await self._publish_to_apps([encode_refusal(refusals.popleft()) for _ in range(len(refusals))])

    def _is_ingest(self, topic: str) -> bool:
        return self.ingest is not None and topic in (
            self.topics.samples(self.device),
            self.topics.labels(self.device),
        )

    async def _observe(
        self, raw: np.ndarray, lbl: np.ndarray, labelled: np.ndarray | None = None
    ) -> Classified | None:
        """``core.observe`` on the worker, retried every ``status.interval_s`` over budget; None: stopping."""
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

    async def flush_loop(self) -> None:
        """Flush the store within ``training.flush_interval_s`` of a sample's store (a slow feed)."""
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
                    await self._work(self._flush)
                break
