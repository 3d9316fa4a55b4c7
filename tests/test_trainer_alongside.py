"""train_local with the personal head alongside, rounds back to back: the update is the plain SGD path's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import DEV_PROFILE, RAWIN_MODEL

from edgefl.agent.config import parse_profile
from edgefl.agent.core import DeviceCore
from edgefl.agent.round import RoundStatus
from edgefl.agent.store import EmbeddingStore
from edgefl.agent.trainer import PersonalStep, Shuffler, train_local, train_personal
from edgefl.datasets import load_digits
from edgefl.head import Head, cross_entropy, loss_and_grad, sgd_step
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import GlobalModel, encode_global_model
from edgefl.wire.rounds import RoundAnnouncement, decode_update, encode_round

D, K = 16, 6


def _stored(st: EmbeddingStore) -> tuple[np.ndarray, np.ndarray]:
    """Every stored sample in storage order: float32 [n, D], int64 [n]."""
    parts = [(e.copy(), lbl.copy()) for e, lbl in st.chunks(4096)]
    return np.concatenate([e for e, _ in parts]), np.concatenate([lbl for _, lbl in parts])


def _reference(
    head: Head, emb: np.ndarray, lbl: np.ndarray, *, epochs: int, lr: float, bs: int, chunk: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
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
        emb, lbl = _stored(st)
        V_ref, c_ref = V.copy(), c.copy()
        train_personal(
            V_ref,
            c_ref,
            head,
            st,
            columns,
            lam=0.0,
            epochs=2,
            lr=0.08,
            batch_size=16,
            chunk_size=chunk,
            absent_alpha=0.0,
            seed=r,
        )
        res = train_local(
            head,
            st,
            local_epochs=2,
            lr=0.05,
            batch_size=16,
            chunk_size=chunk,
            seed=r,
            personal=PersonalStep(V, c, columns, 0.0, 0.08, 0.0),
        )
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


def test_trainer_alongside_core_rounds_are_the_plain_sgd_path(tmp_path: Path) -> None:
    """The device's rounds as rpi4 runs them (the real digits backbone, chunk_size 1024 > the store,
    personal head alongside, heads written behind, a round answered straight after the last head,
    samples arriving between rounds): each update is bit for bit the plain SGD loop's from the head
    the round starts at, and the personal head is the one train_personal takes from its start."""
    profile = parse_profile(
        {
            "device": {"id": "gw-8", "fleet": "f", "state_dir": str(tmp_path)},
            "model": {"path": str(RAWIN_MODEL)},
            "pipeline": {"raw_dtype": "uint8", "mean": [0.0], "std": [16.0]},
            "memory": {"cap_mb": 4096, "min_system_available_mb": 0},
            "training": {"min_examples": 1, "chunk_size": 1024, "chunk_floor": 64},
        },
        DEV_PROFILE.parent,
    )
    core = DeviceCore.open(profile)
    x, y = load_digits()
    pos = 0
    for r, add in enumerate((120, 60, 0, 90), start=1):
        if add:  # round 3 follows round 2's head at once, on the same store (the restarted coordinator)
            core.observe(x[pos : pos + add], y[pos : pos + add] % 6)
            pos += add
        head = Head(core.head.W.copy(), core.head.b.copy(), core.head.version)
        personal = core.personal
        start_V = (
            (head.W.copy(), head.b.copy()) if personal is None else (personal.W.copy(), personal.b.copy())
        )
        emb, lbl = _stored(core.store)
        ann = RoundAnnouncement(r, head.version, 60.0, 2, 0.05, 16, 1, 1.0, Compression.NONE)
        res = core.receive_round(encode_round(ann))
        assert res.status == RoundStatus.TRAINED and res.entry is not None and res.local is not None
        assert res.local.personal is not None  # trained alongside
        upd = decode_update(res.entry.payload)
        W_ref, b_ref = _reference(
            head, emb, lbl, epochs=2, lr=0.05, bs=16, chunk=1024, seed=profile.training.seed + r
        )
        np.testing.assert_array_equal(upd.delta_W, (W_ref - head.W).astype(np.float32))
        np.testing.assert_array_equal(upd.delta_b, (b_ref - head.b).astype(np.float32))
        V, c = start_V
        train_personal(
            V,
            c,
            head,
            core.store,
            core.personal_columns.copy(),
            lam=0.0,
            epochs=2,
            lr=0.08,
            batch_size=16,
            chunk_size=1024,
            absent_alpha=0.0,
            seed=profile.training.seed + r,
        )
        assert core.personal is not None
        np.testing.assert_array_equal(core.personal.W, V)
        if r % 2:
            core.flush()
        gm = GlobalModel(r, head.version + 1, core.model_sha256, head.W + upd.delta_W, head.b + upd.delta_b)
        core.receive_global(encode_global_model(gm))
