"""A long-running agent's working memory does not follow its data's counts (what bench.soak's RSS slope
measures): federated evaluation on the holdout (edgefl/agent/personal.py) through fixed-size buffers."""

from __future__ import annotations

import ctypes
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import DEV_PROFILE, INT8_MODEL

from edgefl.agent.config import Profile, load_profile
from edgefl.agent.core import DeviceCore
from edgefl.agent.personal import personal_behind
from edgefl.head import Head

D, K = 512, 10  # the digits model's embedding and classes


def profile_for(tmp: Path, chunk: int) -> Profile:
    return load_profile(
        DEV_PROFILE,
        {
            "device.id": "dev-1",
            "device.state_dir": str(tmp / "state"),
            "model.path": str(INT8_MODEL),
            "memory.cap_mb": "4096",
            "memory.min_system_available_mb": "0",
            "dashboard.enabled": "false",
            "training.store_capacity": "4096",
            "training.holdout_every": "2",  # a holdout of 2048 samples: room for every size tried
            "training.chunk_size": str(chunk),
            "training.chunk_floor": "1",
        },
    )


def reference(core: DeviceCore) -> tuple[float, float, int, int]:
    """Accuracies of the global and personal heads on the whole holdout, and the samples only one of them
    gets right (global only, personal only), with Head.predict on one float32 copy of the holdout."""
    assert core.holdout is not None and core.personal is not None
    emb, lbl = next(core.holdout.chunks(len(core.holdout)))
    right = core.head.predict(emb) == lbl
    right_p = core.personal.predict(emb) == lbl
    return (
        float(np.mean(right)),
        float(np.mean(right_p)),
        int(np.sum(right & ~right_p)),
        int(np.sum(right_p & ~right)),
    )


def test_soak_evaluate_counts_every_holdout_sample_in_fixed_chunks(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    core = DeviceCore.open(profile_for(tmp_path, chunk=16))
    assert core.holdout is not None and len(core.holdout) == 0
    assert core.evaluate() is None
    core.head = Head(rng.normal(size=(D, K)).astype(np.float32), rng.normal(size=K).astype(np.float32), 3)
    core.personal = Head(rng.normal(size=(D, K)).astype(np.float32), np.zeros(K, np.float32), 3)
    seen = []
    # sizes below, at and across the 16-row chunk, and a tail of every length
    for add in (1, 14, 1, 1, 15, 17, 40, 9):
        core.holdout.add(rng.normal(size=(add, D)).astype(np.float32), rng.integers(0, K, add))
        acc, acc_p, only_g, only_p = reference(core)
        ev = core.evaluate()
        assert ev is not None and core.personal_evaluation is not None
        assert (ev.version, ev.count) == (3, len(core.holdout))
        assert ev.accuracy == acc and core.personal_evaluation.accuracy == acc_p
        assert core.personal_fallback == personal_behind(only_g, only_p)
        seen.append((len(core.holdout), round(acc, 4)))
    assert [n for n, _ in seen] == [1, 15, 16, 17, 32, 49, 89, 98]
    assert len({a for _, a in seen}) > 1  # random heads on random samples: the counts differ


def test_soak_evaluate_logistic_head_counts_logit_above_zero(tmp_path: Path) -> None:
    core = DeviceCore.open(profile_for(tmp_path, chunk=8))
    assert core.holdout is not None
    emb = np.zeros((20, D), np.float32)
    emb[:, 0] = np.linspace(-1.0, 1.0, 20)  # logit = emb[:, 0]: the first 10 negative, the last 10 positive
    # a 1-class (logistic) head on the same store layout: the holdout keeps labels 0/1
    labels = np.array([0] * 10 + [0] * 4 + [1] * 6)
    core.holdout.add(emb, labels)
    W = np.zeros((D, 1), np.float32)
    W[0, 0] = 1.0
    core.head = Head(W, np.zeros(1, np.float32), 1)
    core.personal = None
    ev = core.evaluate()
    assert ev is not None and ev.count == 20 and ev.accuracy == pytest.approx(16 / 20)


def _used_heap() -> int | None:
    """glibc's bytes in use by malloc (``mallinfo2().uordblks``), None without glibc's mallinfo2."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None

    class Info(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd")] + [
            (f, ctypes.c_size_t) for f in ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
        ]

    fn.restype = Info
    return int(fn().uordblks)


def test_soak_evaluate_memory_does_not_follow_the_holdout_count(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    chunk = 64
    core = DeviceCore.open(profile_for(tmp_path, chunk=chunk))
    assert core.holdout is not None
    core.head = Head(rng.normal(size=(D, K)).astype(np.float32), np.zeros(K, np.float32), 1)
    core.personal = Head(rng.normal(size=(D, K)).astype(np.float32), np.zeros(K, np.float32), 1)

    def grow_to(n: int) -> None:
        assert core.holdout is not None
        add = n - len(core.holdout)
        core.holdout.add(rng.normal(size=(add, D)).astype(np.float32), rng.integers(0, K, add))

    def peak_of_evaluate() -> int:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            core.evaluate()
            return tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()

    grow_to(130)
    small = peak_of_evaluate()
    grow_to(600)
    large = peak_of_evaluate()
    # one chunk's buffers (float32 [64, 512] = 128 KiB, its float16 gather 64 KiB, a few [64] and [64, K]),
    # whatever the holdout's size (the chunks(256) it replaced held 768 KiB at 256 samples and more)
    assert large <= chunk * D * 6 + 16_384, large
    assert abs(large - small) <= 4096, (small, large)
    # each holdout length once: numpy keeps up to 7 freed buffers of every size under 1 KiB, so arrays of
    # the holdout's length left ~1-2 KiB of heap behind each new length (~380 KiB over 200 lengths)
    core = DeviceCore.open(profile_for(tmp_path / "b", chunk=chunk))
    core.head = Head(rng.normal(size=(D, K)).astype(np.float32), np.zeros(K, np.float32), 1)
    core.personal = Head(rng.normal(size=(D, K)).astype(np.float32), np.zeros(K, np.float32), 1)
    assert core.holdout is not None
    emb = rng.normal(size=(1, D)).astype(np.float32)
    for _ in range(3 * chunk):  # warm: every tail length of a chunk seen
        core.holdout.add(emb, np.array([1]))
        core.evaluate()
    used = _used_heap() or 0
    if not used:
        pytest.skip("glibc's mallinfo2 is not available")
    for _ in range(200):
        assert core.holdout is not None
        core.holdout.add(emb, np.array([1]))
        core.evaluate()
    grew = _used_heap() or 0
    assert grew - used < 16 << 10, grew - used


def test_soak_train_local_heap_does_not_follow_the_store_count(tmp_path: Path) -> None:
    """Each new store count makes a new length for the epoch's last, shorter chunk: its sort, shuffle and
    loss arrays are views of [chunk] buffers now (31 KiB of heap kept over 64 new tail lengths before,
    9 KiB after, measured here: what is left is mostly the store's own gather of the labels)."""
    from edgefl.agent.store import EmbeddingStore
    from edgefl.agent.trainer import PersonalStep, train_local

    rng = np.random.default_rng(0)
    store = EmbeddingStore(tmp_path / "store", 4096, D, K)
    head = Head(rng.normal(size=(D, K)).astype(np.float32) * np.float32(0.01), np.zeros(K, np.float32), 1)
    store.add(rng.normal(size=(600, D)).astype(np.float32), rng.integers(0, K, 600))
    one = rng.normal(size=(1, D)).astype(np.float32)

    def train(seed: int) -> float:
        step = PersonalStep(head.W.copy(), head.b.copy(), np.ones(K, bool), 0.1, 0.05)
        res = train_local(
            head, store, local_epochs=2, lr=0.05, batch_size=16, chunk_size=64, seed=seed, personal=step
        )
        return res.accuracy

    for seed in range(3):
        train(seed)
    used = _used_heap() or 0
    if not used:
        pytest.skip("glibc's mallinfo2 is not available")
    for seed in range(64):  # 601 .. 664 samples: every tail length of a 64-row chunk once
        store.add(one, np.array([1]))
        assert 0.0 <= train(seed) <= 1.0
    grew = (_used_heap() or 0) - used
    assert len(store) == 664 and grew < 24 << 10, grew


def test_soak_record_writes_intern_their_file_names_once(tmp_path: Path) -> None:
    """Python 3.11's pathlib interns path components: the ``.tmp`` and ``.prev`` names a record write
    builds stay interned between writes (one entry each in CPython's table, not one more a write)."""
    import sys

    from edgefl.records import read_record, sibling, write_record

    path = tmp_path / "soak_meta.rec"
    for k in range(3):
        assert write_record(path, b"payload %d" % k) == k  # the generation, +1 a write
    assert read_record(path) == b"payload 2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["soak_meta.rec", "soak_meta.rec.prev"]
    for suffix in (".tmp", ".prev", ".prev.tmp"):
        fresh = "".join(["soak_meta", ".rec", suffix])  # an equal string, not the one the writes used
        assert sys.intern(fresh) is not fresh, suffix  # the writes' own name is still the interned one
    assert sibling(path, ".tmp") is sibling(path, ".tmp")
    assert sibling(path, ".tmp") == tmp_path / "soak_meta.rec.tmp"
