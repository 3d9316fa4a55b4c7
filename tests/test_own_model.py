"""The user's own model: heads of every kind reproduce the model, train, aggregate; labels checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import MODELS

from edgefl import modelfile
from edgefl.agent.store import EmbeddingStore
from edgefl.agent.trainer import train_local
from edgefl.coordinator.strategies import make_strategy
from edgefl.coordinator.strategy import Offer
from edgefl.head import Head
from edgefl.runtime import Backbone
from tests.support.models import activate, logits_range, run_backbone

SHIPPED = sorted(MODELS.glob("*.tflite"))
TEST_MODELS = sorted((MODELS / "test").glob("*.tflite"))


def own_variants(tmp: Path) -> list[Path]:
    """Every shipped model rewritten to a single output (the logits): the embedding is internal."""
    out = []
    for src in SHIPPED:
        buf = src.read_bytes()
        graph = modelfile.read_graph(buf)
        fc = modelfile.head_fc(graph)
        assert fc is not None
        path = tmp / f"own_{src.name}"
        path.write_bytes(modelfile.set_outputs(buf, [graph.ops[fc].outputs[0]]))
        out.append(path)
    return out


def _inputs(bb: Backbone, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (n, *bb.sample_shape)
    if bb.path.parent.name == "test":  # the test models: standard-normal features (their calibration)
        return bb.quantize_input(rng.standard_normal(shape).astype(np.float32))
    if bb.input_dtype == np.float32:
        return rng.random(shape, dtype=np.float32)
    info = np.iinfo(bb.input_dtype)
    return rng.integers(info.min, info.max + 1, size=shape).astype(bb.input_dtype)


#: LiteRT's int8 SOFTMAX (fixed-point exp) lands up to 1.3 output steps from the exact softmax of
#: the model's own rounded logits (0.3 % of values, tests/test_own_model.py); every other int8 head
#: activation is within one step.
INT8_SOFTMAX_STEPS = 1.5


def head_vs_model(bb: Backbone, x: np.ndarray) -> tuple[float, float]:
    """Max |head output - model output| and the tolerance: one output step (int8) or 1e-5 (float)."""
    W, b = bb.head_from_model()
    emb, out = run_backbone(bb, x)
    z = (emb @ W + b).astype(np.float32)
    limits = logits_range(bb)
    if limits is not None:  # the model's own FC output saturates outside its calibration range
        z = np.clip(z, *limits).astype(np.float32)
    got = activate(z, bb.head_activation)
    q = bb.output_quant
    if q.scale > 0:
        # the model saturates at its output type's range
        info = np.iinfo(np.int8 if q.zero_point < 0 or out.min() < 0 else np.uint8)
        got = np.clip(got, (info.min - q.zero_point) * q.scale, (info.max - q.zero_point) * q.scale)
        steps = INT8_SOFTMAX_STEPS if bb.head_activation == "softmax" else 1.0
        return float(np.abs(got - out).max()), q.scale * steps
    return float(np.abs(got - out).max()), 1e-5


@pytest.mark.parametrize("xnnpack", [False, True])
def test_own_model_head_reproduces_every_model(tmp_path: Path, xnnpack: bool) -> None:
    assert TEST_MODELS
    for path in [*SHIPPED, *own_variants(tmp_path), *TEST_MODELS]:
        bb = Backbone(path, xnnpack=xnnpack)
        assert (not bb.embedding_output) == (path.name.startswith("own_") or path in TEST_MODELS)  # prepared
        if "softmax" in path.name:
            assert bb.head_activation == "softmax" and bb.resizable
        diff, tol = head_vs_model(bb, _inputs(bb, 64, 1))
        assert diff <= tol * 1.0001, f"{path.name}: head differs from the model by {diff} > {tol}"


def test_own_model_store_refuses_labels_outside_k(tmp_path: Path) -> None:
    s = EmbeddingStore(tmp_path / "k1", capacity=8, dim=2, num_classes=1)
    emb = np.ones((4, 2), np.float32)
    assert s.add(emb, np.array([0, 1, 2, -1])) == 2  # K = 1: labels 0/1 only
    assert len(s) == 2 and s.refused_labels == 2
    _, lbl = next(s.chunks(8))
    np.testing.assert_array_equal(lbl, [0, 1])
    s10 = EmbeddingStore(tmp_path / "k10", capacity=8, dim=2, num_classes=10)
    assert s10.add(emb, np.array([9, 10, 3, 0])) == 1 and len(s10) == 3 and s10.refused_labels == 1
    with pytest.raises(ValueError, match="num_classes"):
        EmbeddingStore(tmp_path / "k0", capacity=8, dim=2, num_classes=0)


def _binary_blobs(n: int, seed: int, shift: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n).astype(np.int64)
    emb = rng.normal(0, 1, (n, 4)).astype(np.float32)
    emb[:, 0] += np.where(y == 1, shift, -shift).astype(np.float32)
    return emb, y


def test_logistic_head_trains_and_aggregates(tmp_path: Path) -> None:
    head = Head(np.zeros((4, 1), np.float32), np.zeros(1, np.float32), 0)
    results = []
    for dev, n in (("a", 120), ("b", 40)):
        emb, y = _binary_blobs(n, seed=len(dev) + n, shift=2.0)
        s = EmbeddingStore(tmp_path / dev, capacity=256, dim=4, num_classes=1)
        assert s.add(emb, y) == 0
        r = train_local(head, s, local_epochs=3, lr=0.5, batch_size=16, chunk_size=64)
        assert r.delta_W.shape == (4, 1) and r.delta_b.shape == (1,)
        assert r.accuracy > 0.9 and r.loss < np.log(2)
        results.append(r)
    strategy = make_strategy("fedavg", clip_norm=1e30)  # the maths alone, no norm bound
    strategy.configure_round(1, (4, 1))
    for dev, r, n in zip("ab", results, (120, 40), strict=True):
        strategy.offer(Offer(dev, r.delta_W, r.delta_b, n))
    W, b = strategy.aggregate(head.W, head.b)
    # FedAvg by hand: the example-weighted mean of the deltas
    expect_W = (120 * results[0].delta_W + 40 * results[1].delta_W) / 160
    np.testing.assert_allclose(W, expect_W, rtol=1e-6, atol=1e-7)
    emb, y = _binary_blobs(400, seed=99, shift=2.0)
    assert float(np.mean(Head(W, b).predict(emb) == y)) > 0.9
