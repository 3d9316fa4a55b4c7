from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgefl.agent.store import EmbeddingStore
from edgefl.agent.trainer import fit_head, train_local
from edgefl.head import Head


def test_store_ring_overwrites_oldest_and_persists(tmp_path: Path) -> None:
    s = EmbeddingStore(tmp_path, capacity=4, dim=2)
    emb = np.arange(12, dtype=np.float32).reshape(6, 2)
    s.add(emb, np.arange(6, dtype=np.int64))
    assert len(s) == 4
    got = np.concatenate([e for e, _ in s.chunks(3)])
    labels = np.concatenate([lab for _, lab in s.chunks(3)])
    # slots 0,1 hold samples 4,5; slots 2,3 hold samples 2,3
    assert labels.tolist() == [4, 5, 2, 3]
    np.testing.assert_array_equal(got[0], [8.0, 9.0])
    assert got.dtype == np.float32
    s.flush()
    again = EmbeddingStore(tmp_path, capacity=4, dim=2)
    assert len(again) == 4
    # another model shape: starts empty
    assert len(EmbeddingStore(tmp_path, capacity=4, dim=3)) == 0
    with pytest.raises(ValueError):
        s.add(np.zeros((2, 3), np.float32), np.zeros(2, np.int64))


def _blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n).astype(np.int64)
    centres = np.array([[3, 0, 0, 0], [0, 3, 0, 0], [0, 0, 3, 0]], np.float32)
    return (centres[y] + rng.normal(0, 0.5, (n, 4))).astype(np.float32), y


def test_train_local_learns_and_reports(tmp_path: Path) -> None:
    emb, y = _blobs(200, 0)
    s = EmbeddingStore(tmp_path, capacity=256, dim=4)
    s.add(emb, y)
    head = Head(np.zeros((4, 3), np.float32), np.zeros(3, np.float32), 5)
    res = train_local(head, s, local_epochs=3, lr=0.5, batch_size=16, chunk_size=64)
    assert res.num_examples == 200
    assert res.accuracy > 0.95
    assert res.loss < np.log(3)
    assert res.delta_W.shape == (4, 3) and res.delta_W.dtype == np.float32
    # the global head is untouched; W + delta classifies well
    assert not head.W.any()
    assert float(np.mean(Head(res.delta_W, res.delta_b).predict(emb) == y)) > 0.95
    clipped = train_local(head, s, local_epochs=3, lr=0.5, batch_size=16, chunk_size=64, clip_norm=0.1)
    norm = np.sqrt((clipped.delta_W**2).sum() + (clipped.delta_b**2).sum())
    assert norm == pytest.approx(0.1, rel=1e-4)


def test_chunk_size_changes_memory_not_result_much(tmp_path: Path) -> None:
    emb, y = _blobs(120, 1)
    s = EmbeddingStore(tmp_path, capacity=128, dim=4)
    s.add(emb, y)
    head = Head(np.zeros((4, 3), np.float32), np.zeros(3, np.float32))
    a = train_local(head, s, local_epochs=2, lr=0.3, batch_size=8, chunk_size=8)
    b = train_local(head, s, local_epochs=2, lr=0.3, batch_size=8, chunk_size=120)
    assert a.accuracy > 0.9 and b.accuracy > 0.9


def test_fit_head_and_empty_store(tmp_path: Path) -> None:
    emb, y = _blobs(90, 2)
    W, b = fit_head(
        np.zeros((4, 3), np.float32), np.zeros(3, np.float32), emb, y, epochs=5, lr=0.5, batch_size=16
    )
    assert float(np.mean(Head(W, b).predict(emb) == y)) > 0.95
    s = EmbeddingStore(tmp_path / "e", capacity=8, dim=4)
    with pytest.raises(ValueError, match="empty"):
        train_local(Head(W, b), s, local_epochs=1, lr=0.1, batch_size=4, chunk_size=4)
