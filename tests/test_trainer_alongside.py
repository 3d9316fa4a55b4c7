"""train_local with the personal head alongside, rounds back to back: the update is the plain SGD path's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgefl.agent.store import EmbeddingStore
from edgefl.agent.trainer import PersonalStep, Shuffler, train_local, train_personal
from edgefl.head import Head, cross_entropy, loss_and_grad, sgd_step

D, K = 16, 6


def _reference(head: Head, emb: np.ndarray, lbl: np.ndarray, *, epochs: int, lr: float, bs: int, chunk: int,
               seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The pre-alongside device loop written out: Shuffler order, chunk shuffles, loss_and_grad + sgd_step."""
    n = len(lbl)
    chunk = min(chunk, n)
    sh = Shuffler(seed)
    W, b = head.W.copy(), head.b.copy()
    for _ in range(epochs):
        order = np.argsort(sh.keys(n))
        within = sh.keys(n)
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            sel = np.sort(order[start : start + m])[np.argsort(within[start : start + m])]
            for s in range(0, m, bs):
                rows = sel[s : s + bs]
                _, gW, gb = loss_and_grad(W, b, emb[rows], lbl[rows])
                sgd_step(W, b, gW, gb, lr)
    return W, b


@pytest.mark.parametrize("chunk", [1024, 64, 7])
def test_trainer_alongside_rounds_back_to_back_match_the_reference(tmp_path: Path, chunk: int) -> None:
    """Four rounds, the store growing between them, one personal head carried in place from round to
    round: every round's update is the reference SGD loop's, its loss the final head's over the store,
    and the personal head ends where train_personal from the same start ends (whole-store chunks and
    chunks smaller than the store, as rpi4's and the 256 MB gateway's chunk sizes give)."""
    rng = np.random.default_rng(11)
    st = EmbeddingStore(tmp_path, 512, D, num_classes=K)
    centers = rng.normal(size=(K, D)).astype(np.float32)
    head = Head(rng.normal(size=(D, K)).astype(np.float32) * 0.1, np.zeros(K, np.float32), 0)
    columns = np.array([True, True, True, True, False, False])
    V, c = head.W.copy(), head.b.copy()
    for r, add in enumerate((33, 60, 1, 214), start=1):
        y = rng.integers(0, 4, add)
        st.add((centers[y] + 0.5 * rng.normal(size=(add, D))).astype(np.float32), y)
        emb, lbl = (np.concatenate(a) for a in zip(*((e.copy(), l.copy()) for e, l in st.chunks(4096))))
        V_ref, c_ref = V.copy(), c.copy()
        train_personal(V_ref, c_ref, head, st, columns, lam=0.0, epochs=2, lr=0.08, batch_size=16,
                       chunk_size=chunk, absent_alpha=0.0, seed=r)
        res = train_local(head, st, local_epochs=2, lr=0.05, batch_size=16, chunk_size=chunk, seed=r,
                          personal=PersonalStep(V, c, columns, 0.0, 0.08, 0.0))
        W_ref, b_ref = _reference(head, emb, lbl, epochs=2, lr=0.05, bs=16, chunk=chunk, seed=r)
        np.testing.assert_allclose(head.W + res.delta_W, W_ref, rtol=0, atol=1e-5)
        np.testing.assert_allclose(head.b + res.delta_b, b_ref, rtol=0, atol=1e-5)
        assert res.num_examples == len(lbl)
        loss_ref, _, _ = cross_entropy(W_ref, b_ref, emb, lbl)
        assert res.loss == pytest.approx(loss_ref, rel=1e-4)
        start_loss, _, _ = cross_entropy(head.W, head.b, emb, lbl)
        assert res.loss < start_loss  # a stable step size on separable blobs: every round descends
        np.testing.assert_allclose(V, V_ref, rtol=0, atol=1e-5)
        np.testing.assert_allclose(c, c_ref, rtol=0, atol=1e-5)
        n, ch = len(lbl), min(chunk, len(lbl))
        per_epoch = sum(-(-min(ch, n - s) // 16) for s in range(0, n, ch))
        assert res.personal is not None and res.personal.steps == 2 * per_epoch
        head = Head(W_ref, b_ref, r)  # the next round starts from the applied head
