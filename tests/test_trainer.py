"""The personal head trained on the round's own batches (``train_local``'s ``personal``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgefl.agent.store import EmbeddingStore
from edgefl.agent.trainer import PersonalStep, train_local, train_personal
from edgefl.head import Head, cross_entropy_grad_into, restricted_logit_scale
from tests.support.head import paired_cross_entropy_grad_into

D, K, N = 24, 5, 90


@pytest.fixture
def store(tmp_path: Path) -> EmbeddingStore:
    rng = np.random.default_rng(3)
    st = EmbeddingStore(tmp_path, 128, D, num_classes=K)
    st.add(rng.normal(size=(N, D)).astype(np.float32), rng.integers(0, 3, N))  # classes 0..2 labelled
    return st


def _head() -> Head:
    rng = np.random.default_rng(4)
    return Head(rng.normal(size=(D, K)).astype(np.float32) * 0.1, rng.normal(size=K).astype(np.float32), 2)


def test_personal_paired_gradient_is_each_heads_own() -> None:
    """[W, V] stacked: each half of the paired gradient is bit for bit the single head's (V's scaled)."""
    rng = np.random.default_rng(5)
    W, V = (rng.normal(size=(D, K)).astype(np.float32) for _ in range(2))
    b, c = (rng.normal(size=K).astype(np.float32) for _ in range(2))
    emb = rng.normal(size=(7, D)).astype(np.float32)
    y = np.array([0, 1, 2, 2, 1, 0, 4], dtype=np.int64)
    rows = np.arange(7, dtype=np.int64)
    scale = restricted_logit_scale(np.array([True, True, True, False, False]), 0.5)
    z2, gW2 = np.empty((2, 7, K), np.float32), np.empty((2, D, K), np.float32)
    gb2 = np.empty((2, 1, K), np.float32)
    W2, b2 = np.stack([W, V]), np.stack([b, c])[:, None, :]
    paired_cross_entropy_grad_into(W2, b2, emb, y, z2, gW2, gb2, rows, scale)
    for half, (H, h, s) in enumerate(((W, b, None), (V, c, scale))):
        z, gW, gb = np.empty((7, K), np.float32), np.empty((D, K), np.float32), np.empty(K, np.float32)
        cross_entropy_grad_into(H, h, emb, y, z, gW, gb, rows, s)
        np.testing.assert_array_equal(gW2[half], gW)
        np.testing.assert_array_equal(gb2[half, 0], gb)


@pytest.mark.parametrize(("lam", "alpha"), [(0.0, 0.0), (0.1, 0.5), (0.0, 1.0)])
def test_personal_alongside_equals_a_step_of_its_own(store: EmbeddingStore, lam: float, alpha: float) -> None:
    """On the same batches (same seed), the personal head trained alongside the global one ends where
    ``train_personal`` ends, and the global update is bit for bit the one trained alone."""
    head = _head()
    columns = np.array([True, True, True, False, False])
    alone = train_local(head, store, local_epochs=2, lr=0.05, batch_size=8, chunk_size=32, seed=9)
    V, c = head.W + np.float32(0.02), head.b.copy()
    V_ref, c_ref = V.copy(), c.copy()
    both = train_local(
        head, store, local_epochs=2, lr=0.05, batch_size=8, chunk_size=32, seed=9,
        personal=PersonalStep(V, c, columns, lam, 0.08, alpha),
    )  # fmt: skip
    ref = train_personal(
        V_ref, c_ref, head, store, columns, lam=lam, epochs=2, lr=0.08, batch_size=8, chunk_size=32,
        absent_alpha=alpha, seed=9,
    )  # fmt: skip
    np.testing.assert_array_equal(both.delta_W, alone.delta_W)
    np.testing.assert_array_equal(both.delta_b, alone.delta_b)
    assert (both.loss, both.accuracy, both.num_examples) == (alone.loss, alone.accuracy, N)
    np.testing.assert_array_equal(V, V_ref)
    np.testing.assert_array_equal(c, c_ref)
    np.testing.assert_array_equal(V[:, 3:], head.W[:, 3:])  # never-labelled classes: the global head's
    assert both.personal is not None and both.personal.steps == ref.steps == 2 * -(-N // 8)


def test_personal_alongside_refuses_a_head_that_does_not_fit(store: EmbeddingStore) -> None:
    head = _head()
    cols = np.ones(K, dtype=bool)
    wide = PersonalStep(np.zeros((D, K + 1), np.float32), head.b.copy(), cols, 0.0, 0.1)
    with pytest.raises(ValueError, match="personal"):
        train_local(head, store, local_epochs=1, lr=0.05, batch_size=8, chunk_size=32, personal=wide)
    still = PersonalStep(head.W.copy(), head.b.copy(), cols, 0.0, 0.0)
    with pytest.raises(ValueError, match="personal lr"):
        train_local(head, store, local_epochs=1, lr=0.05, batch_size=8, chunk_size=32, personal=still)
