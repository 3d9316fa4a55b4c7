"""Live ingest: samples and labels over MQTT into a real agent, predictions back (issue 14, items 6 and 7).

Real mosquitto, real agent processes on the dev profile's raw-input int8 model, real LiteRT; the
bookkeeping class (agent/ingest.py) also on its own, where exact drop and expiry orders are checked.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    PASSWORD,
    RAWIN_MODEL,
    USER,
    Broker,
    Pki,
    mosquitto_passwd_path,
    start_ingest_agent,
    start_mosquitto,
    stop_broker,
    tls_conf,
    wait_until,
)

from edgefl.agent.ingest import Ingest
from edgefl.agent.pipeline import Pipeline
from edgefl.datasets import load_digits
from edgefl.errors import DecodeError, TransportError, UpdateRejected
from edgefl.head import Head
from edgefl.runtime import Backbone
from edgefl.tlsconf import make_ssl_context
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.ingest import (
    IngestRefusal,
    Label,
    Prediction,
    Sample,
    decode_answer,
    decode_label,
    decode_prediction,
    decode_sample,
    encode_label,
    encode_prediction,
    encode_sample,
)
from edgefl.wire.rounds import Decline, RoundAnnouncement, decode_decline, decode_update, encode_round
from edgefl.wire.status import decode_status

pytestmark = pytest.mark.timeout(180)

DIGITS_SHAPE = (8, 8, 1)


def reason_of(fn: Any) -> str:
    with pytest.raises(DecodeError) as info:
        fn()
    return str(info.value.reason)


# ----------------------------------------------------------------------------------------------
# The three messages


def test_ingest_messages_round_trip_and_refusals() -> None:
    x = np.arange(64, dtype=np.uint8).reshape(DIGITS_SHAPE)
    s = decode_sample(
        encode_sample(Sample("cam:1", x, 7, 1.5)), sample_shape=DIGITS_SHAPE, dtype="uint8", num_classes=10
    )
    assert (s.id, s.label, s.ts) == ("cam:1", 7, 1.5) and s.x.dtype == np.uint8
    np.testing.assert_array_equal(s.x, x)
    bare = decode_sample(encode_sample(Sample("2", x)), sample_shape=DIGITS_SHAPE, dtype="uint8")
    assert (bare.label, bare.ts) == (None, None)
    assert decode_label(encode_label(Label("cam:1", 3)), num_classes=10) == Label("cam:1", 3)
    p = Prediction("cam:1", 4, 0.75, 12, 0.003)
    assert decode_prediction(encode_prediction(p)) == p

    def sample(x_: np.ndarray, label: int | None = None, k: int = 10) -> None:
        decode_sample(
            encode_sample(Sample("a", x_, label)), sample_shape=DIGITS_SHAPE, dtype="uint8", num_classes=k
        )

    assert reason_of(lambda: sample(x.reshape(8, 8))) == "bad_shape"
    assert reason_of(lambda: sample(x.reshape(1, 8, 8, 1))) == "bad_shape"
    assert reason_of(lambda: sample(x.astype(np.float32))) == "bad_dtype"
    assert reason_of(lambda: sample(x.astype(np.int16))) == "bad_dtype"
    assert reason_of(lambda: sample(x, 10)) == "bad_label"
    sample(x, 1, k=1)  # a K = 1 (logistic) head learns labels 0 and 1
    assert reason_of(lambda: sample(x, 2, k=1)) == "bad_label"
    assert reason_of(lambda: decode_label(encode_label(Label("a", 10)), num_classes=10)) == "bad_label"
    assert reason_of(lambda: decode_label(encode_label(Label("a b", 1)))) == "bad_value"
    assert reason_of(lambda: decode_prediction(encode_label(Label("a", 1)))) == "wrong_type"
    with pytest.raises(ValueError, match="uint8/int16/float32"):
        encode_sample(Sample("a", x.astype(np.float64)))


# ----------------------------------------------------------------------------------------------
# The bookkeeping on its own: exact orders


def sample(i: int, label: int | None = None) -> Sample:
    return Sample(f"s{i}", np.full(DIGITS_SHAPE, i % 17, np.uint8), label)


def test_ingest_queue_unit_drops_oldest_expires_pending_refuses_duplicates() -> None:
    now = [0.0]
    ing = Ingest(queue_max=4, pending_max=3, label_expiry_s=10.0, clock=lambda: now[0])
    dropped = [ing.offer_sample(sample(i)) for i in range(10)]
    assert [d.id for d in dropped if d is not None] == ["s0", "s1", "s2", "s3", "s4", "s5"]
    assert ing.counters.ingest_dropped == 6 and ing.counters.samples_received == 10
    with pytest.raises(UpdateRejected) as dup:
        ing.offer_sample(sample(9))  # a QoS 1 redelivery
    assert dup.value.reason == "duplicate"
    ing.offer_label(Label("s8", 5))  # still queued: labelled in place
    rows = ing.take(8)
    assert [(r.id, r.label) for r in rows] == [("s6", None), ("s7", None), ("s8", 5), ("s9", None)]
    ing.offer_label(Label("s7", 4))  # in flight (being classified): kept for it, not refused
    with pytest.raises(UpdateRejected) as twice:
        ing.offer_label(Label("s8", 5))
    assert twice.value.reason == "duplicate"
    for k, r in enumerate(rows):
        ing.settle(r.id, np.full(4, k, np.float32), predicted=k)
    late = ing.take_labelled()  # s7's label came while it was in flight
    assert late is not None and late[1].tolist() == [4] and late[2].tolist() == [1]
    ing.offer_sample(sample(10))
    ing.settle(ing.take(1)[0].id, np.zeros(4, np.float32), predicted=0)
    ing.offer_sample(sample(11))
    ing.settle(ing.take(1)[0].id, np.zeros(4, np.float32), predicted=0)  # pending_max = 3: s6 goes
    assert ing.pending == 3 and ing.counters.pending_evicted == 1
    with pytest.raises(UpdateRejected) as unknown:
        ing.offer_label(Label("s6", 1))
    assert unknown.value.reason == "unknown_sample"
    ing.offer_label(Label("s9", 2))
    late = ing.take_labelled()
    assert late is not None
    np.testing.assert_array_equal(late[0], np.full((1, 4), 3, np.float32))
    assert late[1].tolist() == [2] and late[2].tolist() == [3] and ing.take_labelled() is None
    now[0] = 10.5  # s10 and s11 waited longer than label_expiry_s
    assert ing.expire() == 2 and ing.pending == 0 and ing.counters.pending_expired == 2
    with pytest.raises(UpdateRejected):
        ing.offer_label(Label("s10", 1))
    ing.offer_sample(sample(12))
    ing.forget(ing.take(1))  # its classification failed
    with pytest.raises(UpdateRejected):
        ing.offer_label(Label("s12", 1))
    assert ing.counters.labels_received == 3


def test_ingest_label_conflict_unit_disputes_unstored_and_counts_stored() -> None:
    """A second, different label within label_expiry_s is refused (label_conflict), wherever the sample is."""
    now = [0.0]
    ing = Ingest(queue_max=8, pending_max=8, label_expiry_s=10.0, clock=lambda: now[0])

    def conflict(sample_id: str, label: int) -> str:
        with pytest.raises(UpdateRejected) as exc:
            ing.offer_label(Label(sample_id, label))
        assert exc.value.reason == "label_conflict"
        return exc.value.detail

    # pending, answered by a hijacker first: its label is matched and stored before the genuine one
    for i in range(3):
        ing.offer_sample(sample(i))
    rows = ing.take(3)
    for k, r in enumerate(rows):
        ing.settle(r.id, np.full(4, k, np.float32), predicted=k)
    ing.offer_label(Label("s0", 7))  # the attacker
    ing.offer_label(Label("s1", 7))  # the attacker
    stored = ing.take_labelled()  # s0 and s1 go to the store
    assert stored is not None and stored[1].tolist() == [7, 7]
    assert "its first label stays in the store" in conflict("s0", 2)  # the genuine label, late
    with pytest.raises(UpdateRejected) as same:
        ing.offer_label(Label("s1", 7))  # the same label again is a redelivery
    assert same.value.reason == "duplicate"
    # matched, not stored yet: removed, neither label is kept
    ing.offer_label(Label("s2", 7))
    assert "neither label is stored" in conflict("s2", 3)
    assert ing.take_labelled() is None
    assert "disputed already" in conflict("s2", 7)  # any later label too
    # queued with its inline label: classified, never stored nor parked
    ing.offer_sample(sample(3, label=1))
    conflict("s3", 4)
    (row,) = ing.take(1)
    assert row.label is None
    ing.settle(row.id, np.zeros(4, np.float32), predicted=0)
    assert ing.pending == 0 and ing.take_labelled() is None
    # in flight, its label came meanwhile: dropped, not parked
    ing.offer_sample(sample(4))
    (row,) = ing.take(1)
    ing.offer_label(Label("s4", 5))
    conflict("s4", 6)
    ing.settle(row.id, np.zeros(4, np.float32), predicted=0)
    assert ing.pending == 0 and ing.take_labelled() is None
    # in flight with its own inline label: the caller stores it as it is classified
    ing.offer_sample(sample(5, label=2))
    (row,) = ing.take(1)
    conflict("s5", 3)
    ing.settle(row.id, np.zeros(4, np.float32), predicted=2)
    assert ing.counters.conflicts_stored == 2  # six label_conflict refusals above (the caller counts them)
    # after label_expiry_s the id is forgotten: a label is unknown, not a conflict
    now[0] = 10.5
    with pytest.raises(UpdateRejected) as late:
        ing.offer_label(Label("s0", 2))
    assert late.value.reason == "unknown_sample"


# ----------------------------------------------------------------------------------------------
# Real agents


class Gateway:
    """A gateway app on the real broker: sends samples and labels, reads predictions, statuses, updates."""

    def __init__(self, broker: Broker, fleet: str, device: str, **tls: Any) -> None:
        self.topics = Topics("edgefl", fleet)
        self.device = device
        self.t = MqttTransport(broker.host, broker.port, f"gw-{fleet}-{device}", queue_size=4096, **tls)
        self.predictions: dict[str, Prediction] = {}
        self.refusals: list[IngestRefusal] = []
        self.status: dict[str, Any] = {}
        self.updates: list[Any] = []
        self._pump: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Gateway:
        await self.t.start(wait_s=10)
        for topic in (
            self.topics.predictions(self.device),
            self.topics.status(self.device),
            self.topics.update(self.device),
        ):
            await self.t.subscribe(topic, 1)
        self._pump = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._pump is not None
        self._pump.cancel()
        await self.t.stop()

    async def _read(self) -> None:
        while True:
            msg = await self.t.queue.get()
            if msg.topic == self.topics.predictions(self.device):
                p = decode_answer(msg.payload)
                if isinstance(p, IngestRefusal):
                    self.refusals.append(p)
                    continue
                assert p.id not in self.predictions, f"two predictions of {p.id}"
                self.predictions[p.id] = p
            elif msg.topic == self.topics.status(self.device):
                self.status = {"state": (st := decode_status(msg.payload)).state, **st.fields}
            else:
                try:
                    self.updates.append(decode_update(msg.payload))
                except DecodeError:  # a Decline (wrong_type as an Update)
                    self.updates.append(decode_decline(msg.payload))

    async def sample(self, s: Sample, qos: int = 1) -> None:
        await self.t.publish(self.topics.samples(self.device), encode_sample(s), qos=qos)

    async def raw(self, topic: str, payload: bytes) -> None:
        await self.t.publish(topic, payload, qos=1)

    async def label(self, sample_id: str, label: int) -> None:
        await self.t.publish(self.topics.labels(self.device), encode_label(Label(sample_id, label)), qos=1)

    async def ready(self) -> None:
        await wait_until(lambda: bool(self.status.get("ready")), 60, f"{self.device} subscribed")

    async def until(self, what: str, **want: Any) -> dict[str, Any]:
        """Wait for a status whose fields equal ``want`` (statuses come every 0.2 s)."""
        await wait_until(lambda: all(self.status.get(k) == v for k, v in want.items()), 30, what)
        return self.status


def model_predictions(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The model's own classification of raw digits x: its head (factory, version 0) on its embedding."""
    bb = Backbone(RAWIN_MODEL)
    emb = Pipeline(bb, (0.0,), (16.0,), mode="fused", batch=8).run(x)[0]
    return Head(*bb.head_from_model()).scores(emb)


def test_ingest_samples_and_late_labels_train_a_round(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    started = time.monotonic()
    x, y = load_digits()
    x, y = x[:40], y[:40]
    want_cls, want_score = model_predictions(x)
    # 29 examples train the round below: under the default training.min_examples (32)
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "live-1", training__min_examples="16"))

    async def main() -> dict[str, Any]:
        async with Gateway(mosquitto, fleet, "live-1") as gw:
            await gw.ready()
            # 20 labelled inline, 20 without a label
            for i in range(40):
                await gw.sample(Sample(f"f{i}", x[i], int(y[i]) if i < 20 else None, 1_700_000_000.0 + i))
            await wait_until(lambda: len(gw.predictions) == 40, 30, "40 predictions")
            # late labels for 10 of the 20 unlabelled, once they wait in the pending table
            for i in range(20, 30):
                await gw.label(f"f{i}", int(y[i]))
            st = await gw.until("30 labelled samples stored", stored_total=30, labels_received=30)
            # a round: the device trains on the 29 stored (the 20th labelled went to the holdout)
            await gw.t.publish(
                gw.topics.round,
                encode_round(RoundAnnouncement(1, 0, 30.0, 1, 0.05, 8, 1, ("live-1",))),
                qos=1,
                retain=True,
            )
            await wait_until(lambda: len(gw.updates) == 1, 60, "the round's update")
            return {"status": st, "predictions": dict(gw.predictions), "update": gw.updates[0]}

    out = asyncio.run(main())
    st, preds, update = out["status"], out["predictions"], out["update"]
    assert (st["samples_received"], st["labels_received"], st["predictions_published"]) == (40, 30, 40)
    assert (st["ingest_dropped"], st["ingest_queued"], st["pending_labels"]) == (0, 0, 10)
    assert st["store_samples"] == 29 and st["rejected"] == {}
    assert [preds[f"f{i}"].cls for i in range(40)] == want_cls.tolist()
    np.testing.assert_allclose([preds[f"f{i}"].score for i in range(40)], want_score, rtol=1e-5)
    # a latency is a real duration: never negative, never longer than this test has run
    ran_s = time.monotonic() - started
    assert all(p.version == 0 and 0 <= p.latency_s <= ran_s for p in preds.values())
    assert (update.round, update.base_version, update.device, update.num_examples) == (1, 0, "live-1", 29)
    assert all(p.poll() is None for p in agents), "the agent died"


def test_ingest_too_few_examples_declines_then_trains(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """A round announced while the feed is still going: fewer than training.min_examples (32) stored ->
    the round waits for more (half its deadline), then a Decline ``too_few_examples``, not an update
    trained on a handful; once enough are stored the next round trains on all of them."""
    x, y = load_digits()
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "live-3"))

    async def main() -> list[Any]:
        async with Gateway(mosquitto, fleet, "live-3") as gw:
            await gw.ready()
            for i in range(20):
                await gw.sample(Sample(f"a{i}", x[i], int(y[i]), 1_700_000_000.0 + i))
            await gw.until("19 stored", store_samples=19)  # the 20th labelled went to the holdout
            await gw.t.publish(
                gw.topics.round,
                encode_round(RoundAnnouncement(1, 0, 3.0, 1, 0.05, 8, 1, ("live-3",))),
                qos=1,
                retain=True,
            )
            await wait_until(lambda: len(gw.updates) == 1, 60, "round 1's decline")
            for i in range(20, 40):
                await gw.sample(Sample(f"a{i}", x[i], int(y[i]), 1_700_000_000.0 + i))
            await gw.until("38 stored", store_samples=38)
            await gw.t.publish(
                gw.topics.round,
                encode_round(RoundAnnouncement(2, 0, 30.0, 1, 0.05, 8, 1, ("live-3",))),
                qos=1,
                retain=True,
            )
            await wait_until(lambda: len(gw.updates) == 2, 60, "round 2's update")
            await gw.until("the decline counted", declined_total=1)
            return list(gw.updates)

    declined, update = asyncio.run(main())
    assert isinstance(declined, Decline)
    assert (declined.round, declined.device, declined.reason) == (1, "live-3", "too_few_examples")
    assert declined.detail == "19 labelled examples stored, training.min_examples is 32"
    assert (update.round, update.device, update.num_examples) == (2, "live-3", 38)
    assert all(p.poll() is None for p in agents), "the agent died"


def test_ingest_refuses_wrong_shape_dtype_label(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    x, y = load_digits()

    async def stale() -> None:  # a retained sample waiting on the broker before the agent subscribes
        async with Gateway(mosquitto, fleet, "live-2") as gw:
            payload = encode_sample(Sample("stale", x[3], int(y[3])))
            await gw.t.publish(gw.topics.samples("live-2"), payload, qos=1, retain=True)

    asyncio.run(stale())
    # MQTT 3.1.1: the broker hands the retained sample over at subscribe (retain flag set) and the
    # agent refuses it; over MQTT 5 it is never sent (Retain Handling 2: the label_conflict test)
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "live-2", broker__protocol="3.1.1"))

    async def main() -> dict[str, Any]:
        async with Gateway(mosquitto, fleet, "live-2") as gw:
            await gw.ready()
            await gw.t.publish(gw.topics.samples("live-2"), b"", qos=1, retain=True)  # cleared: ignored
            await gw.sample(Sample("shape", x[0].reshape(8, 8)))  # no channel dimension
            await gw.sample(Sample("dtype", x[0].astype(np.float32)))  # not the raw dtype (uint8)
            await gw.sample(Sample("int16", x[0].astype(np.int16)))
            await gw.sample(Sample("label", x[0], 10))  # K = 10: labels 0..9
            await gw.raw(gw.topics.samples("live-2"), b"\xff\x00garbage")
            await gw.sample(Sample("ok", x[1], int(y[1])))
            await gw.sample(Sample("ok", x[1], int(y[1])))  # the same id again: a duplicate
            await gw.sample(Sample("wait", x[2]))
            await wait_until(lambda: {"ok", "wait"} <= set(gw.predictions), 30, "the good predictions")
            await gw.label("wait", 12)  # out of range
            await gw.label("nobody", 3)  # no such sample
            await gw.label("wait", int(y[2]))  # the good one: stored
            return await gw.until("the refusals counted", stored_total=2, labels_received=2)

    st = asyncio.run(main())
    assert st["rejected"] == {
        "bad_value": 1,  # the retained one
        "bad_shape": 1,
        "bad_dtype": 2,
        "bad_label": 2,
        "bad_cbor": 1,
        "duplicate": 1,
        "unknown_sample": 1,
    }
    assert (st["samples_received"], st["predictions_published"], st["store_samples"]) == (2, 2, 2)
    assert all(p.poll() is None for p in agents), "the agent died"


def test_ingest_queue_drops_oldest_and_counts(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    x, _ = load_digits()
    n = 200  # under the transport's incoming queue (256): the drops can only be the ingest queue's
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "live-3", source__queue_max="2"))

    async def main() -> tuple[dict[str, Any], dict[str, Prediction]]:
        async with Gateway(mosquitto, fleet, "live-3") as gw:
            await gw.ready()
            # a burst (QoS 0, nothing awaited): far faster than 2 queued samples drain
            for i in range(n):
                await gw.sample(Sample(f"b{i}", x[i]), qos=0)
            await gw.until("every sample classified or dropped", samples_received=n, ingest_queued=0)
            st = await wait_for_sum(gw, n)
            return st, dict(gw.predictions)

    async def wait_for_sum(gw: Gateway, total: int) -> dict[str, Any]:
        await wait_until(
            lambda: gw.status.get("ingest_dropped", 0) + gw.status.get("predictions_published", 0) == total,
            30,
            "dropped + predicted = sent",
        )
        return gw.status

    st, preds = asyncio.run(main())
    dropped, published = st["ingest_dropped"], st["predictions_published"]
    assert dropped + published == n and dropped >= 1, st
    assert len(preds) == published
    assert f"b{n - 1}" in preds  # drop-oldest never drops the newest sample
    assert st["transport"]["queue_dropped"] == 0  # the drops are the ingest queue's, counted there
    assert all(p.poll() is None for p in agents), "the agent died"


def test_ingest_pending_label_expiry(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    x, y = load_digits()
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "live-4", source__label_expiry_s="0.5"))

    async def main() -> dict[str, Any]:
        async with Gateway(mosquitto, fleet, "live-4") as gw:
            await gw.ready()
            await gw.sample(Sample("old", x[0]))
            await wait_until(lambda: "old" in gw.predictions, 30, "the prediction")
            await gw.until("the pending sample expired", pending_expired=1, pending_labels=0)
            await gw.label("old", int(y[0]))  # too late
            return await gw.until("the late label refused", rejected={"unknown_sample": 1})

    st = asyncio.run(main())
    assert (st["labels_received"], st["stored_total"], st["store_samples"]) == (0, 0, 0)


def test_ingest_feed_cli(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    x, y = load_digits()
    n = 60
    np.savez(tmp_path / "shard.npz", x=x[:n], y=y[:n])
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "live-5"))
    want_cls, _ = model_predictions(x[:n])

    async def ready() -> None:
        async with Gateway(mosquitto, fleet, "live-5") as gw:
            await gw.ready()

    asyncio.run(ready())
    cmd = [sys.executable, "-m", "edgefl.cli", "feed", "--broker", mosquitto.url, "--fleet", fleet]
    cmd += ["--device", "live-5", "--data", str(tmp_path / "shard.npz"), "--rate", "0"]
    cmd += ["--label-fraction", "0.5", "--label-delay", "0.3", "--json", str(tmp_path / "feed.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"fed {n} samples to live-5" in done.stdout
    result = json.loads((tmp_path / "feed.json").read_text())
    assert (result["samples_sent"], result["labels_inline"], result["labels_late"]) == (n, 0, n // 2)
    assert result["predictions_received"] == n
    assert result["correct"] == int(np.sum(want_cls == y[:n]))

    async def status() -> dict[str, Any]:
        async with Gateway(mosquitto, fleet, "live-5") as gw:
            return await gw.until("the feed's samples and labels", samples_received=n, stored_total=n // 2)

    st = asyncio.run(status())
    assert (st["labels_received"], st["predictions_published"], st["ingest_dropped"]) == (n // 2, n, 0)
    helped = subprocess.run(
        [sys.executable, "-m", "edgefl.cli", "feed", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "as a Label message on labels/<device>" in " ".join(helped.stdout.split())


def test_ingest_logistic_streaming_frames_in_order(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    # the K = 1 streaming model (resource variables, logistic head): frames classified in arrival order
    # through one interpreter, so its state carries; labels are 0/1
    streaming = RAWIN_MODEL.parent / "test" / "streaming_kws_int8.tflite"
    frames = np.random.default_rng(5).standard_normal((12, 3, 40)).astype(np.float32)
    bb = Backbone(streaming)
    emb = Pipeline(bb, (0.0,), (1.0,), mode="fused", batch=1).run(frames)[0]
    want_cls, want_score = Head(*bb.head_from_model()).scores(emb)
    agents.append(
        start_ingest_agent(
            mosquitto,
            fleet,
            tmp_path,
            "kws-live",
            model__path=str(streaming),
            pipeline__raw_dtype="float32",
            pipeline__mean="0.0",
            pipeline__std="1.0",
            pipeline__batch="1",
        )
    )

    async def main() -> tuple[dict[str, Any], dict[str, Prediction]]:
        async with Gateway(mosquitto, fleet, "kws-live") as gw:
            await gw.ready()
            for i in range(12):
                await gw.sample(Sample(f"w{i}", frames[i], i % 2 if i < 6 else None))
            await wait_until(lambda: len(gw.predictions) == 12, 30, "12 predictions")
            await gw.sample(Sample("w12", frames[0], 2))  # K = 1: labels 0 and 1 only
            await gw.label("w6", 2)
            await gw.label("w7", 1)
            st = await gw.until("7 stored, 2 refused", stored_total=7, rejected={"bad_label": 2})
            return st, dict(gw.predictions)

    st, preds = asyncio.run(main())
    assert [preds[f"w{i}"].cls for i in range(12)] == want_cls.tolist()
    np.testing.assert_allclose([preds[f"w{i}"].score for i in range(12)], want_score, rtol=1e-5)
    assert (st["samples_received"], st["labels_received"], st["pending_labels"]) == (12, 7, 5)


def test_ingest_feed_cli_over_tls_with_the_profile_broker_table(
    pki: Pki, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    # TLS and a password: the feeder takes the CA, username and password file from a profile's
    # [broker] table (as the agent does); without them it cannot connect (exit 4)
    conf = tls_conf(pki, pki.server_cert, pki.server_key, require_certificate=False)
    broker = start_mosquitto(tmp_path, extra=conf)
    try:
        url = f"mqtts://127.0.0.1:{broker.port}"
        password = tmp_path / "password"
        password.write_text(PASSWORD + "\n")
        tls = {"broker__ca_file": str(pki.ca), "broker__username": USER}
        tls["broker__password_file"] = str(password)
        agents.append(start_ingest_agent(broker, fleet, tmp_path, "tls-1", broker__url=url, **tls))
        profile = tmp_path / "feeder.toml"
        # only a [broker] table: the docs say --profile "lends the [broker] table" (H17 item 4)
        profile.write_text(
            f'[broker]\nurl = "{url}"\nca_file = "{pki.ca}"\nusername = "{USER}"\n'
            f'password_file = "{password}"\n'
        )
        x, y = load_digits()
        np.savez(tmp_path / "few.npz", x=x[:20], y=y[:20])

        async def ready() -> None:
            creds = {"tls_context": make_ssl_context(pki.ca), "username": USER, "password": PASSWORD}
            async with Gateway(broker, fleet, "tls-1", **creds) as gw:
                await gw.ready()

        asyncio.run(ready())
        base = [sys.executable, "-m", "edgefl.cli", "feed", "--broker", url, "--fleet", fleet]
        base += ["--device", "tls-1", "--data", str(tmp_path / "few.npz"), "--rate", "0", "--wait", "30"]
        fed = subprocess.run([*base, "--profile", str(profile)], capture_output=True, text=True, timeout=120)
        assert fed.returncode == 0, fed.stdout + fed.stderr
        assert "fed 20 samples to tls-1" in fed.stdout and "20 predictions" in fed.stdout
        bare = subprocess.run(base, capture_output=True, text=True, timeout=120)
        assert bare.returncode == 4, bare.stdout + bare.stderr
    finally:
        stop_broker(broker)


def test_ingest_feed_cli_to_a_device_that_never_answers(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    x, y = load_digits()
    np.savez(tmp_path / "few.npz", x=x[:5], y=y[:5])
    base = [sys.executable, "-m", "edgefl.cli", "feed", "--broker", mosquitto.url, "--fleet", fleet]
    base += ["--device", "nobody", "--data", str(tmp_path / "few.npz"), "--rate", "0", "--wait", "0.5"]
    done = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "fed 5 samples to nobody" in done.stdout and "0 predictions" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == (
        f"edgefl feed: no prediction came back on edgefl/{fleet}/predictions/nobody in 0.5 s: check "
        "--fleet and --device (the agent's device.fleet and device.id) and that the agent runs with "
        'source.kind = "mqtt"'
    )
    # a [broker]-only --profile is validated with the device profile's broker checks
    bad = tmp_path / "bad.toml"
    bad.write_text("[broker]\nqos = 3\nbogus = 1\n")
    refused = subprocess.run([*base, "--profile", str(bad)], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "broker.qos = 3" in refused.stderr and "broker.bogus: unknown key" in refused.stderr


def test_ingest_label_conflict_retained_and_throttled_log_on_a_real_agent(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """A hijacker answers predictions first: the genuine labels are label_conflict, counted; a sample
    retained before or while the agent subscribes is never taken; refusals are logged 20 per reason."""
    x, y = load_digits()
    topics = Topics("edgefl", fleet)

    async def stale() -> None:  # retained before the agent exists: MQTT 5 Retain Handling 2 skips it
        async with Gateway(mosquitto, fleet, "live-h") as gw:
            await gw.t.publish(topics.samples("live-h"), encode_sample(Sample("r0", x[0])), retain=True)

    asyncio.run(stale())
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "live-h"))

    async def main() -> dict[str, Any]:
        async with Gateway(mosquitto, fleet, "live-h") as gw:
            await gw.ready()
            for i in range(4):
                await gw.sample(Sample(f"h{i}", x[i]))
            await wait_until(lambda: len(gw.predictions) == 4, 30, "4 predictions")
            for i in range(4):  # the hijacker: a wrong label for every prediction, at once
                await gw.label(f"h{i}", (int(y[i]) + 1) % 10)
            await gw.until("the hijacker's labels stored", stored_total=4, labels_received=4)
            for i in range(4):  # the genuine app, late
                await gw.label(f"h{i}", int(y[i]))
            for i in range(25):
                await gw.label(f"nobody{i}", 1)
            # retained while subscribed: kept as published (Retain As Published), refused
            await gw.t.publish(topics.samples("live-h"), encode_sample(Sample("r1", x[1])), retain=True)
            st = await gw.until(
                "refusals counted",
                rejected={"label_conflict": 4, "unknown_sample": 25, "bad_value": 1},
            )
            await gw.t.publish(topics.samples("live-h"), b"", retain=True)
            return st

    st = asyncio.run(main())
    assert (st["samples_received"], st["labels_received"], st["stored_total"]) == (4, 4, 4)
    assert st["conflicts_stored"] == 4  # the hijacker's labels were stored first: they stay (ring store)
    log = (tmp_path / "live-h.log").read_text(errors="replace")
    assert log.count("unknown_sample: no sample") == 20  # LOGGED_REFUSALS, then only every 1000th
    assert log.count("label_conflict: sample h") == 4 and "its first label stays in the store" in log


INGEST_ACL = """\
# the gateway app: writes samples and labels of its devices, reads their predictions
user gateway
topic write edgefl/+/samples/+
topic write edgefl/+/labels/+
topic read edgefl/+/predictions/+

# every device (username = device id): reads its own samples and labels, writes its predictions
pattern read edgefl/+/samples/%u
pattern read edgefl/+/labels/%u
pattern write edgefl/+/predictions/%u
"""


@pytest.mark.subprocess
def test_ingest_acl_refuses_a_label_from_a_non_app_account(tmp_path: Path) -> None:
    """Only the gateway account writes labels/<device>: a device's Label is refused (MQTT 5 PUBACK 0x87)."""
    passwd = tmp_path / "ingest.passwd"
    for n, dev in enumerate(("gateway", "dev-1", "dev-2")):
        create = ["-c"] if n == 0 else []
        subprocess.run([mosquitto_passwd_path(), *create, "-b", str(passwd), dev, f"{dev}-pw"], check=True)
    acl = tmp_path / "ingest.acl"
    acl.write_text(INGEST_ACL)
    # "user root": keep read access to the test's files when CI runs as root (as tls_conf)
    broker = start_mosquitto(
        tmp_path, extra=f"allow_anonymous false\npassword_file {passwd}\nacl_file {acl}\nuser root\n"
    )

    async def label_as(user: str) -> str:
        tx = MqttTransport(
            "127.0.0.1", broker.port, f"probe-{user}", protocol="5", username=user, password=f"{user}-pw"
        )
        await tx.start(wait_s=10)
        try:
            await tx.publish("edgefl/f/labels/dev-1", encode_label(Label("s0", 1)), qos=1, timeout_s=5)
            return "accepted"
        except TransportError as exc:
            return f"refused: {exc}"
        finally:
            await tx.stop()

    try:
        outcomes = [asyncio.run(label_as(u)) for u in ("gateway", "dev-1", "dev-2")]
    finally:
        stop_broker(broker)
    assert outcomes[0] == "accepted"
    for refused in outcomes[1:]:
        assert refused.startswith("refused") and "Not authorized" in refused, outcomes
