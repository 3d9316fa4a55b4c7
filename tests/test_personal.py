"""Personal heads: the class-restricted Ditto step by hand, the core, and real agents on a real broker."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
from conftest import (
    DEV_PROFILE,
    INT8_MODEL,
    RAWIN_MODEL,
    Broker,
    start_ingest_agent,
    start_replay_agent,
    wait_until,
)

from edgefl.agent.config import parse_profile
from edgefl.agent.core import DeviceCore
from edgefl.agent.governor import Governor
from edgefl.agent.personal import PERSONAL_FILE, personal_behind
from edgefl.agent.pipeline import Pipeline
from edgefl.agent.round import RoundStatus
from edgefl.agent.store import EmbeddingStore
from edgefl.agent.trainer import train_personal
from edgefl.coordinator.history import personal_heads_summary
from edgefl.datasets import load_digits
from edgefl.errors import ConfigError, DecodeError
from edgefl.head import (
    Head,
    cross_entropy_grad_into,
    personal_columns,
    restricted_logit_scale,
)
from edgefl.records import read_record
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import GlobalModel, encode_global_model
from edgefl.wire.ingest import (
    Prediction,
    Sample,
    decode_answer,
    decode_prediction,
    encode_prediction,
    encode_sample,
)
from edgefl.wire.rounds import RoundAnnouncement, decode_update, encode_round, encode_update
from edgefl.wire.status import decode_status
from tests.support.head import ditto_step

# ----------------------------------------------------------------------------------------------
# The step, by hand


def test_personal_ditto_step_by_hand() -> None:
    """D = 2, K = 3, class 2 never labelled: columns 0 and 1 take the step, column 2 is the global's."""
    W = np.array([[1.0, 2.0, 3.0], [0.0, -1.0, 5.0]], np.float32)
    b = np.array([0.5, 0.0, 9.0], np.float32)
    Wg = np.array([[0.0, 2.0, 4.0], [1.0, 1.0, 6.0]], np.float32)
    bg = np.array([0.5, 1.0, 7.0], np.float32)
    gW = np.array([[1.0, 0.0, 8.0], [2.0, 2.0, 8.0]], np.float32)
    gb = np.array([1.0, -1.0, 8.0], np.float32)
    ditto_step(W, b, gW, gb, 0.5, 1.0, Wg, bg, np.array([True, True, False]))
    # W - 0.5 * (g + 1.0 * (W - Wg)), column by column
    # [0,0]: 1 - 0.5 (1 + 1) = 0; [0,1]: 2 - 0.5 (0 + 0) = 2; [1,0]: 0 - 0.5 (2 - 1) = -0.5;
    # [1,1]: -1 - 0.5 (2 - 2) = -1; column 2 = Wg's (4, 6)
    np.testing.assert_array_equal(W, np.array([[0.0, 2.0, 4.0], [-0.5, -1.0, 6.0]], np.float32))
    # b: 0.5 - 0.5 (1 + 0) = 0; 0 - 0.5 (-1 - 1) = 1; bg's 7
    np.testing.assert_array_equal(b, np.array([0.0, 1.0, 7.0], np.float32))
    np.testing.assert_array_equal(gW, [[1.0, 0.0, 8.0], [2.0, 2.0, 8.0]])  # the caller's gradient is kept


def test_personal_ditto_step_lambda_zero_is_sgd_and_refusals() -> None:
    W = np.array([[1.0, 2.0]], np.float32)
    b = np.zeros(2, np.float32)
    g, far = np.array([[2.0, 4.0]], np.float32), np.full((1, 2), 100.0, np.float32)
    ditto_step(
        W, b, g, np.ones(2, np.float32), 0.25, 0.0, far, np.zeros(2, np.float32), np.array([True, True])
    )
    np.testing.assert_array_equal(W, [[0.5, 1.0]])
    np.testing.assert_array_equal(b, [-0.25, -0.25])
    with pytest.raises(ValueError, match="columns"):
        ditto_step(W, b, W, b, 0.1, 0.1, W, b, np.array([True]))
    with pytest.raises(ValueError, match="lam"):
        ditto_step(W, b, W, b, 0.1, -1.0, W, b, np.array([True, True]))


def test_personal_columns_softmax_and_logistic() -> None:
    np.testing.assert_array_equal(personal_columns(np.array([0, 2, 2, 7, -1]), 4), [True, False, True, False])
    assert personal_columns(np.array([1, 1]), 1).tolist() == [False]  # one class seen: nothing to separate
    assert personal_columns(np.array([1, 0]), 1).tolist() == [True]


def test_personal_train_ties_unlabelled_columns_and_moves_the_rest(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    D, K = 8, 4
    store = EmbeddingStore(tmp_path, 64, D, num_classes=K)
    emb = rng.standard_normal((48, D)).astype(np.float32)
    lbl = np.array([0, 1] * 24, np.int64)  # classes 2 and 3 never labelled
    store.add(emb, lbl)
    glob = Head(rng.standard_normal((D, K)).astype(np.float32), rng.standard_normal(K).astype(np.float32), 3)
    W, b = glob.W.copy(), glob.b.copy()
    cols = personal_columns(lbl, K)
    res = train_personal(W, b, glob, store, cols, lam=0.5, epochs=3, lr=0.1, batch_size=8, chunk_size=16)
    assert res.steps == 3 * 6 and res.num_examples == 48
    np.testing.assert_array_equal(W[:, 2:], glob.W[:, 2:])
    np.testing.assert_array_equal(b[2:], glob.b[2:])
    assert np.abs(W[:, :2] - glob.W[:, :2]).max() > 1e-3
    before = np.mean(glob.predict(emb) == lbl)
    assert np.mean(Head(W, b).predict(emb) == lbl) > before  # fitted to the device's own labels


def test_personal_restricted_softmax_gradient_is_the_scaled_losss() -> None:
    """With a logit scale the gradient is that of the loss of the scaled logits (central differences)."""
    rng = np.random.default_rng(7)
    D, K, N = 5, 4, 6
    W = rng.normal(0, 0.7, (D, K)).astype(np.float32)
    b = rng.normal(0, 0.7, K).astype(np.float32)
    emb = rng.normal(0, 1, (N, D)).astype(np.float32)
    y = np.array([0, 1, 1, 0, 1, 0], np.int64)
    scale = restricted_logit_scale(personal_columns(y, K), 0.25)
    assert scale is not None and scale.tolist() == [1.0, 1.0, 0.25, 0.25]
    z, gW, gb = np.empty((N, K), np.float32), np.empty_like(W), np.empty_like(b)
    cross_entropy_grad_into(W, b, emb, y, z, gW, gb, np.arange(N, dtype=np.int64), scale)
    s64, e64 = scale.astype(np.float64), emb.astype(np.float64)

    def loss(W64: np.ndarray, b64: np.ndarray) -> float:
        logits = (e64 @ W64 + b64) * s64
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        return float(-logp[np.arange(N), y].mean())

    eps = 1e-4
    for i in range(D):
        for j in range(K):
            Wp, Wm = W.astype(np.float64), W.astype(np.float64)
            Wp[i, j] += eps
            Wm[i, j] -= eps
            assert gW[i, j] == pytest.approx((loss(Wp, b) - loss(Wm, b)) / (2 * eps), abs=2e-5)
    for j in range(K):
        bp, bm = b.astype(np.float64), b.astype(np.float64)
        bp[j] += eps
        bm[j] -= eps
        assert gb[j] == pytest.approx((loss(W, bp) - loss(W, bm)) / (2 * eps), abs=2e-5)
    # alpha 1, or every class labelled: no scale (the plain softmax, bit for bit)
    assert restricted_logit_scale(np.array([True, False]), 1.0) is None
    assert restricted_logit_scale(np.array([True, True]), 0.0) is None
    with pytest.raises(ValueError, match="alpha"):
        restricted_logit_scale(np.array([True, False]), 1.5)


def test_personal_restricted_softmax_keeps_the_fleets_classes(tmp_path: Path) -> None:
    """A device with labels for 2 of 3 classes, its samples shifted toward class 2: with plain softmax
    its personal head takes class 2's samples for its own classes; scaled to 0 it keeps recognising them.
    """
    rng = np.random.default_rng(1)
    D, K = 2, 3
    mu = np.array([[3.0, 0.0], [-3.0, 0.0], [0.0, 3.0]], np.float32)
    glob = Head(mu.T.copy(), (-0.5 * (mu**2).sum(1)).astype(np.float32), 1)  # nearest class mean
    shift = np.array([0.0, 1.5], np.float32)  # this device's samples sit 1.5 higher than the fleet's
    lbl = np.array([0, 1] * 40, np.int64)
    emb = (mu[lbl] + shift + rng.normal(0, 1, (80, D))).astype(np.float32)
    test_y = np.repeat([0, 1, 2], 100)
    test = (mu[test_y] + shift + rng.normal(0, 1, (300, D))).astype(np.float32)
    store = EmbeddingStore(tmp_path, 128, D, num_classes=K)
    store.add(emb, lbl)
    cols = personal_columns(lbl, K)
    right = {}
    for alpha in (1.0, 0.0):
        W, b = glob.W.copy(), glob.b.copy()
        train_personal(
            W, b, glob, store, cols, lam=0.0, epochs=40, lr=0.1, batch_size=8, chunk_size=128,
            absent_alpha=alpha,
        )  # fmt: skip
        assert W[:, 2].tolist() == glob.W[:, 2].tolist() and b[2] == glob.b[2]  # class 2 stays tied
        pred = Head(W, b).predict(test)
        right[alpha] = [int(np.sum(pred[test_y == k] == k)) for k in range(K)]
    glob_right = [int(np.sum(glob.predict(test)[test_y == k] == k)) for k in range(K)]
    assert glob_right == [85, 83, 99]  # the shift costs the fleet's head on the labelled classes
    # (measured: plain [98, 99, 92], scaled to 0 [93, 98, 97]; margins leave room for rounding)
    for alpha in (1.0, 0.0):
        assert right[alpha][0] + right[alpha][1] >= 185  # both fitted to the device's own classes
    assert right[0.0][2] >= 96 and right[1.0][2] <= 93  # only the restricted one keeps class 2
    with pytest.raises(ValueError, match="absent_alpha"):
        train_personal(glob.W.copy(), glob.b.copy(), glob, store, cols, lam=0.0, epochs=1, lr=0.1,
                       batch_size=8, chunk_size=128, absent_alpha=-0.5)  # fmt: skip


def test_personal_prediction_head_key_round_trip_and_refusal() -> None:
    for head in ("personal", "global", None):
        p = Prediction("s:1", 3, 0.5, 7, 0.01, head=head)
        assert decode_prediction(encode_prediction(p)) == p
    assert "head" not in cbor2.loads(encode_prediction(Prediction("s", 1, 0.5, 0, 0.0)))
    bad = cbor2.loads(encode_prediction(Prediction("s", 1, 0.5, 0, 0.0, head="global")))
    bad["head"] = "mine"
    with pytest.raises(DecodeError) as exc:
        decode_prediction(cbor2.dumps(bad))
    assert exc.value.reason == "bad_value"
    with pytest.raises(ValueError):
        encode_prediction(Prediction("s", 1, 0.5, 0, 0.0, head="mine"))


def test_personal_config_table_and_errors(tmp_path: Path) -> None:
    base = {"device": {"id": "d"}, "model": {"path": str(RAWIN_MODEL)}}
    p = parse_profile(base, tmp_path).personal
    assert (p.enabled, p.prox_lambda, p.epochs, p.lr_scale, p.absent_alpha) == (True, 0.0, 0, 1.6, 0.0)
    with pytest.raises(ConfigError) as exc:
        parse_profile(
            {**base, "personal": {"prox_lambda": -1.0, "epochs": 101, "absent_alpha": 2.0, "bogus": 1}},
            tmp_path,
        )
    text = str(exc.value)
    assert (
        "personal.prox_lambda = -1.0" in text
        and "personal.epochs = 101" in text
        and "personal.absent_alpha = 2.0" in text
        and "personal.bogus" in text
    )


# ----------------------------------------------------------------------------------------------
# The core (no broker)


def _core(tmp: Path, personal: bool, fleet: str = "f", epochs: int = 0) -> DeviceCore:
    profile = parse_profile(
        {
            "device": {"id": "dev-1", "fleet": fleet, "state_dir": str(tmp)},
            "model": {"path": str(RAWIN_MODEL)},
            "pipeline": {"raw_dtype": "uint8", "mean": [0.0], "std": [16.0]},
            "memory": {"cap_mb": 4096, "min_system_available_mb": 0},
            "training": {"min_examples": 1, "holdout_every": 4},
            "personal": {"enabled": personal, "epochs": epochs},
        },
        DEV_PROFILE.parent,
    )
    return DeviceCore.open(profile)


def _normalised(payload: bytes) -> bytes:
    """An Update's bytes with its run-dependent figures (training time, peak RSS) set to 0."""
    u = decode_update(payload)
    return encode_update(
        dataclasses.replace(u, metrics=dataclasses.replace(u.metrics, train_s=0.0, peak_rss_bytes=0))
    )


def test_personal_core_update_bytes_unchanged_and_head_persisted(tmp_path: Path) -> None:
    """Two rounds on the same data and seed, personal heads on and off: the same Update bytes."""
    x, y = load_digits()
    x, y = x[:120], y[:120] % 5  # five classes labelled: the other five columns are tied
    sent: dict[bool, list[bytes]] = {}
    for personal in (False, True):
        core = _core(tmp_path / str(personal), personal)
        core.observe(x, y)
        payloads = []
        for r in (1, 2):
            res = core.receive_round(
                encode_round(RoundAnnouncement(r, r - 1, 60.0, 2, 0.05, 16, 1, 1.0, Compression.NONE))
            )
            assert res.status == RoundStatus.TRAINED and res.entry is not None
            payloads.append(_normalised(res.entry.payload))
            core.personalise()
            upd = decode_update(res.entry.payload)
            gm = GlobalModel(r, r, core.model_sha256, core.head.W + upd.delta_W, core.head.b + upd.delta_b)
            core.receive_global(encode_global_model(gm))
        sent[personal] = payloads
        if personal:
            assert core.personal is not None and core.personal.version == 1  # pulled toward version 1
            np.testing.assert_array_equal(core.personal.W[:, 5:], core.head.W[:, 5:])  # tied to version 2
            assert not np.array_equal(core.personal.W[:, :5], core.head.W[:, :5])
            assert core.personal_evaluation is not None and core.evaluation is not None
            W = core.personal.W.copy()
            assert core.flush()  # the personal head is written behind
            reopened = _core(tmp_path / "True", True)
            assert reopened.personal is not None
            np.testing.assert_array_equal(reopened.personal.W, W)
            assert reopened.personal_columns.tolist() == [True] * 5 + [False] * 5
        else:
            assert core.personal is None and not (tmp_path / "False" / PERSONAL_FILE).exists()
    assert sent[True] == sent[False]


# ----------------------------------------------------------------------------------------------
# Real agents on the real broker


class App:
    """A gateway app: publishes samples and rounds, reads predictions, the status and updates."""

    def __init__(self, broker: Broker, fleet: str, device: str) -> None:
        self.topics = Topics("edgefl", fleet)
        self.device = device
        self.t = MqttTransport(
            broker.host, broker.port, f"app-{fleet}-{device}-{os.getpid()}", queue_size=4096
        )
        self.predictions: dict[str, Prediction] = {}
        self.status: dict[str, Any] = {}
        self.updates: list[bytes] = []
        self._pump: asyncio.Task[None] | None = None

    async def __aenter__(self) -> App:
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
                if isinstance(p, Prediction):
                    self.predictions[p.id] = p
            elif msg.topic == self.topics.status(self.device):
                st = decode_status(msg.payload)
                self.status = {"state": st.state, **st.fields}
            else:
                self.updates.append(msg.payload)

    async def samples(self, prefix: str, x: np.ndarray, y: np.ndarray | None) -> None:
        for i in range(len(x)):
            label = None if y is None else int(y[i])
            await self.t.publish(
                self.topics.samples(self.device), encode_sample(Sample(f"{prefix}{i}", x[i], label)), qos=1
            )

    async def round(self, r: int, base: int = 0) -> None:
        ann = RoundAnnouncement(r, base, 60.0, 3, 0.1, 8, 1, (self.device,), Compression.NONE)
        await self.t.publish(self.topics.round, encode_round(ann), qos=1, retain=True)

    async def until(self, what: str, **want: Any) -> dict[str, Any]:
        await wait_until(lambda: all(self.status.get(k) == v for k, v in want.items()), 60, what)
        return self.status


def _personal_predictions(state_dir: Path, x: np.ndarray) -> np.ndarray:
    """Classes of raw digits under the personal head the agent persisted (its record, read back)."""
    data = read_record(state_dir / PERSONAL_FILE)
    assert data is not None
    rec = cbor2.loads(data)
    D, K = rec["shape"]
    W = np.frombuffer(rec["W"], "<f4").reshape(D, K)
    b = np.frombuffer(rec["b"], "<f4")
    emb = Pipeline(Backbone(RAWIN_MODEL), (0.0,), (16.0,), mode="fused", batch=8).run(x)[0]
    return np.asarray(Head(W.copy(), b.copy()).predict(emb))


def test_personal_agent_serves_predictions_and_survives_kill9(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """After its round the agent's predictions come from its personal head (``head`` = personal); killed
    with SIGKILL once it wrote that head and started again, it serves the same head from its record."""
    x, y = load_digits()
    train_x, train_y = x[:64], y[:64] % 4  # four classes labelled
    probe = x[200:230]
    extra = {"training__min_examples": "8", "training__holdout_every": "0"}
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "p-1", **extra))

    async def phase(first: bool) -> dict[str, Prediction]:
        async with App(mosquitto, fleet, "p-1") as app:
            await app.until("ready", ready=True)
            if first:
                await app.samples("t", train_x, train_y)
                await app.until("64 stored", stored_total=64)
                await app.round(1)
                await wait_until(lambda: len(app.updates) == 1, 60, "the round's update")
                await app.until("personal head serving", serving_head="personal")
            else:
                assert app.status["serving_head"] == "personal"  # restored before any round
            tag = "p" if first else "q"  # the restarted agent remembers the ids it received before
            await app.samples(tag, probe, None)
            await wait_until(
                lambda: all(f"{tag}{i}" in app.predictions for i in range(len(probe))), 60, "predictions"
            )
            if first:  # written once the agent idles (the heads are written behind a round)
                record = tmp_path / "p-1" / PERSONAL_FILE
                await wait_until(record.exists, 30, "the personal head written")
            return {f"p{i}": app.predictions[f"{tag}{i}"] for i in range(len(probe))}

    before = asyncio.run(phase(True))
    proc = agents.pop()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    want = _personal_predictions(tmp_path / "p-1", probe)
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "p-1", **extra))
    after = asyncio.run(phase(False))
    for preds in (before, after):
        got = [preds[f"p{i}"] for i in range(len(probe))]
        assert [p.head for p in got] == ["personal"] * len(probe)
        assert [p.cls for p in got] == want.tolist()
        assert all(p.version == 0 for p in got)  # pulled toward the factory head, version 0
    assert all(p.poll() is None for p in agents), "the agent died"


def test_personal_agent_falls_back_when_worse_on_its_holdout(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """Training labels that contradict the holdout's: the personal head does worse there than the
    global head, so the agent serves the global head (``head`` = global) and says so in its status."""
    digits_x, digits_y = load_digits()
    x, y, probe = digits_x[:120], digits_y[:120].copy(), digits_x[300:310]
    # holdout_every = 2: every second labelled sample is held out (true labels); the others, which
    # train, carry a wrong one
    wrong = y.copy()
    wrong[0::2] = (y[0::2] + 3) % 10
    agents.append(
        start_ingest_agent(
            mosquitto,
            fleet,
            tmp_path,
            "p-2",
            training__min_examples="8",
            training__holdout_every="2",
            personal__prox_lambda="0",
            personal__epochs="20",
        )
    )

    async def main() -> tuple[dict[str, Any], dict[str, Prediction]]:
        async with App(mosquitto, fleet, "p-2") as app:
            await app.until("ready", ready=True)
            await app.samples("t", x, wrong)
            await app.until("120 stored", stored_total=120)
            await app.round(1)
            await wait_until(lambda: len(app.updates) == 1, 60, "the round's update")
            st = await app.until("fallback", personal_fallback=True)
            await app.samples("p", probe, None)
            await wait_until(lambda: all(f"p{i}" in app.predictions for i in range(10)), 60, "predictions")
            return st, {k: v for k, v in app.predictions.items() if k.startswith("p")}

    st, preds = asyncio.run(main())
    assert st["serving_head"] == "global"
    assert st["personal_accuracy"] < st["global_accuracy"]
    assert st["eval_count"] == 60
    assert {p.head for p in preds.values()} == {"global"}
    assert "personal head behind the global head" in (tmp_path / "p-2.log").read_text()
    assert all(p.poll() is None for p in agents), "the agent died"


def test_personal_agent_never_changes_the_update_bytes(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """The same device, data and seed with personal heads on and off (two fleets): two rounds, with the
    global head between them, give the same Update bytes (but for the training time and peak RSS)."""
    x, y = load_digits()
    x, y = x[:96], y[:96] % 6
    runs = {"on": f"{fleet}-on", "off": f"{fleet}-off"}
    for mode, fl in runs.items():
        (tmp_path / mode).mkdir()
        agents.append(
            start_replay_agent(
                mosquitto, fl, tmp_path / mode, "p-3", x, y, training__min_examples="8",
                training__holdout_every="0", personal__enabled="true" if mode == "on" else "false",
            )
        )  # fmt: skip
    backbone = Backbone(INT8_MODEL)
    W0, b0 = backbone.head_from_model()

    async def main(fl: str, serving: str) -> tuple[list[bytes], dict[str, Any]]:
        async with App(mosquitto, fl, "p-3") as app:
            await app.until("ready", ready=True)
            await app.round(1)
            await wait_until(lambda: len(app.updates) == 1, 60, "round 1's update")
            u = decode_update(app.updates[0])
            gm = GlobalModel(1, 1, backbone.sha256, W0 + u.delta_W, b0 + u.delta_b)
            await app.t.publish(app.topics.global_model, encode_global_model(gm), qos=1, retain=True)
            await app.until("version 1 applied", version=1)
            await app.round(2, base=1)
            await wait_until(lambda: len(app.updates) == 2, 60, "round 2's update")
            st = await app.until(f"{serving} head serving", serving_head=serving)
            return [_normalised(p) for p in app.updates], dict(st)

    on, st_on = asyncio.run(main(runs["on"], "personal"))
    off, st_off = asyncio.run(main(runs["off"], "global"))
    assert len(on) == 2 and on == off
    assert st_on["personal_fallback"] is False and st_off["personal_fallback"] is False
    # the personal head is written behind the round, once the agent idles
    asyncio.run(wait_until((tmp_path / "on" / "p-3" / PERSONAL_FILE).exists, 30, "the personal head written"))
    assert not (tmp_path / "off" / "p-3" / PERSONAL_FILE).exists()
    assert all(p.poll() is None for p in agents), "the agent died"


def test_personal_heads_fleet_summary_mean_and_worst_decile() -> None:
    devices: dict[str, dict[str, Any]] = {
        f"d{i}": {"personal_accuracy": 0.5 + 0.05 * i, "global_accuracy": 0.6, "eval_count": 10,
                  "serving_head": "personal" if i else "global"}
        for i in range(11)
    }  # fmt: skip
    devices["old"] = {"eval_accuracy": 0.9, "eval_count": 10}  # a device without personal heads
    s = personal_heads_summary(devices)
    assert s is not None
    assert s["devices"] == 11 and s["serving_personal"] == 10
    assert s["personal_mean"] == pytest.approx(0.75)  # 0.5 .. 1.0 in steps of 0.05, equal weights
    assert s["personal_worst_decile"] == pytest.approx(0.525)  # the worst 2 of 11: 0.5 and 0.55
    assert s["global_mean"] == pytest.approx(0.6) and s["global_worst_decile"] == pytest.approx(0.6)
    assert personal_heads_summary({"old": devices["old"]}) is None


def test_personal_behind_needs_more_than_chance() -> None:
    """Only the disagreements count: the global head must win by more than sqrt(disagreements)."""
    assert not personal_behind(0, 0)
    assert not personal_behind(1, 0)  # one sample: 1 > sqrt(1) is false
    assert personal_behind(2, 0)  # 2 > sqrt(2)
    assert not personal_behind(3, 1)  # 2 > sqrt(4) is false
    assert personal_behind(5, 1)  # 4 > sqrt(6)
    assert not personal_behind(1, 5)


def test_personal_step_admitted_by_the_governor(tmp_path: Path) -> None:
    """Over budget (a 1 MiB cap), the personal step is deferred, counted and the head left as it was.

    Two personal epochs against the round's one: the step runs on its own, after the round."""
    x, y = load_digits()
    core = _core(tmp_path, True, epochs=2)
    core.observe(x[:64], y[:64])
    ann = RoundAnnouncement(1, 0, 60.0, 1, 0.05, 16, 1, 1.0, Compression.NONE)
    assert core.receive_round(encode_round(ann)).status == RoundStatus.TRAINED and core.personal_due
    core.governor = Governor(1 << 20, 0, 0)
    assert core.personalise() is None
    assert core.personal_deferred == 1 and core.personal is None and not core.personal_due
    assert core.governor.deferrals == {"personal": 1}
    assert not (tmp_path / PERSONAL_FILE).exists()
