from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgefl.agent.store import EmbeddingStore
from edgefl.agent.trainer import Shuffler, fit_head, train_local
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


@pytest.mark.parametrize("classes", [3, 1])
def test_train_local_metrics_are_the_final_heads_loss_and_accuracy(tmp_path: Path, classes: int) -> None:
    """The reported loss and accuracy are those of the trained head over every stored sample: the
    sample-weighted mean of ``loss_and_grad``'s loss per chunk and ``Head.predict`` (K = 3 and the
    logistic K = 1), whatever the chunk size (the loss up to float32 summation order: one chunk of
    all samples is evaluated in its shuffled order, not read again)."""
    from edgefl.head import loss_and_grad

    emb, y = _blobs(150, 2)
    if classes == 1:
        y = (y == 0).astype(np.int64)
    s = EmbeddingStore(tmp_path, capacity=256, dim=4)
    s.add(emb, y)
    head = Head(np.zeros((4, classes), np.float32), np.zeros(classes, np.float32))
    for chunk in (7, 64, 150):
        res = train_local(head, s, local_epochs=1, lr=0.3, batch_size=8, chunk_size=chunk)
        final = Head(head.W + res.delta_W, head.b + res.delta_b)
        loss_sum = 0.0
        for e, lbl in s.chunks(chunk):
            loss_sum += loss_and_grad(final.W, final.b, e, lbl)[0] * len(lbl)
        stored = np.concatenate([e for e, _ in s.chunks(150)])
        assert res.loss == pytest.approx(loss_sum / 150, rel=1e-6)
        assert res.accuracy == float(np.sum(final.predict(stored) == y)) / 150


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


def test_integrity_store_refuses_non_finite_embeddings_and_sets_aside_corrupt_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = EmbeddingStore(tmp_path, capacity=8, dim=2, num_classes=3)
    emb = np.array([[1, 2], [np.inf, 0], [np.nan, 1], [7e4, 0], [3, 4]], np.float32)  # 7e4 > float16 max
    assert s.add(emb, np.array([0, 1, 2, 0, 1], np.int64)) == 0  # no label refused
    assert s.refused_not_finite == 3 and len(s) == 2
    got = np.concatenate([e for e, _ in s.chunks(8)])
    np.testing.assert_array_equal(got, [[1, 2], [3, 4]])
    s.flush()
    assert len(EmbeddingStore(tmp_path, capacity=8, dim=2, num_classes=3)) == 2  # intact: kept

    # one flipped bit in the oldest sample's label: its row's checksum catches it; the newer sample is
    # recovered, the lost one logged with its count
    lbl = tmp_path / "store_lbl.i16"
    data = bytearray(lbl.read_bytes())
    data[1] ^= 0x40
    lbl.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="edgefl.agent.store"):
        again = EmbeddingStore(tmp_path, capacity=8, dim=2, num_classes=3)
    assert (len(again), again.lost_at_open) == (1, 1)
    assert not list(tmp_path.glob("*.corrupt"))  # nothing set aside
    got = np.concatenate([e for e, _ in again.chunks(8)])
    np.testing.assert_array_equal(got, [[3, 4]])
    assert [r.message for r in caplog.records if "could not be recovered" in r.message] == [
        f"store in {tmp_path}: 1 sample(s) could not be recovered (torn or failing their checksum); "
        "1 recovered"
    ]
    again.add(np.ones((3, 2), np.float32), np.array([0, 1, 2], np.int64))
    again.flush()
    back = EmbeddingStore(tmp_path, capacity=8, dim=2, num_classes=3)
    assert (len(back), back.lost_at_open) == (4, 0)  # rebuilt, usable
    assert np.concatenate([lab for _, lab in back.chunks(8)]).tolist() == [1, 0, 1, 2]


def test_integrity_store_refuses_insane_metadata_even_with_a_good_checksum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import json

    from edgefl.records import read_record, write_record

    s = EmbeddingStore(tmp_path, capacity=8, dim=2, num_classes=3)
    s.add(np.ones((3, 2), np.float32), np.array([0, 1, 2], np.int64))
    s.flush()
    meta_path = tmp_path / "store_meta.rec"
    good = json.loads(read_record(meta_path) or b"")
    for change, why in (
        ({"count": 100000}, "count = 100000: must be in 0..capacity 8"),
        ({"head": 9}, "head = 9: out of range for count 3, capacity 8"),
        ({"count": "3"}, "count '3' / head 3 are not integers"),
    ):
        s = EmbeddingStore(tmp_path, capacity=8, dim=2, num_classes=3)
        s.add(np.ones((3, 2), np.float32), np.array([0, 1, 2], np.int64))
        s.flush()
        write_record(meta_path, json.dumps({**good, **change}).encode())
        caplog.clear()
        again = EmbeddingStore(tmp_path, capacity=8, dim=2, num_classes=3)
        assert (len(again), set_aside_reasons(caplog, tmp_path)) == (0, [why])
    # a label >= K written with a matching checksum (not a bit flip: a store from a K = 10 head)
    s = EmbeddingStore(tmp_path, capacity=8, dim=2, num_classes=10)
    s.add(np.ones((1, 2), np.float32), np.array([9], np.int64))
    s.flush()
    caplog.clear()
    again = EmbeddingStore(tmp_path, capacity=8, dim=2, num_classes=3)
    assert (len(again), set_aside_reasons(caplog, tmp_path)) == (0, ["label 9 outside 0..2"])


def set_aside_reasons(caplog: pytest.LogCaptureFixture, folder: Path) -> list[str]:
    """Why the store's files were set aside, as its ERROR lines say (each file renamed ``*.corrupt``)."""
    assert (folder / "store_meta.rec.corrupt").exists()
    head, tail = f"store in {folder} is corrupt (", "): set aside as *.corrupt, starting empty"
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    return [m.removeprefix(head).removesuffix(tail) for m in lines if m.startswith(head) and m.endswith(tail)]


def test_shuffler_permutations_are_seeded_and_fresh_each_draw() -> None:
    """A permutation is the ranks of the next keys (``np.argsort(keys(n))``, as the trainer draws it)."""

    def perm(s: Shuffler, n: int) -> np.ndarray:
        return np.argsort(s.keys(n))

    s = Shuffler(7)
    a, b = perm(s, 50), perm(s, 50)
    assert a.dtype == np.int64 and sorted(a.tolist()) == list(range(50)) == sorted(b.tolist())
    assert a.tolist() != b.tolist()  # the stream moves on: each epoch gets its own order
    again = Shuffler(7)
    assert perm(again, 50).tolist() == a.tolist()
    assert perm(Shuffler(8), 50).tolist() != a.tolist()
    # SplitMix64 seeded with 0: first outputs 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F
    # (Vigna's splitmix64.c), so 3 keys rank as [2, 1, 0]
    assert perm(Shuffler(0), 3).tolist() == [2, 1, 0]
    assert perm(Shuffler(-1), 0).tolist() == []
    # every position equally likely (5,000 seeds, 5 places: ~1,000 each)
    first = np.bincount([int(np.argmax(perm(Shuffler(k), 5) == 0)) for k in range(5000)], minlength=5)
    assert first.min() > 900 and first.max() < 1100


@pytest.mark.subprocess
def test_device_training_does_not_import_numpy_random(tmp_path: Path) -> None:
    code = (
        "import sys, numpy as np; from pathlib import Path\n"
        "from edgefl.agent.store import EmbeddingStore; from edgefl.agent.trainer import train_local\n"
        "from edgefl.head import Head\n"
        f"s = EmbeddingStore(Path({str(tmp_path)!r}), capacity=64, dim=4)\n"
        "s.add(np.eye(4, dtype=np.float32).repeat(8, 0), np.arange(32) % 2)\n"
        "r = train_local(Head(np.zeros((4, 2), np.float32), np.zeros(2, np.float32)), s, local_epochs=2,"
        " lr=0.5, batch_size=4, chunk_size=8)\n"
        "print(r.num_examples, 'numpy.random' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["32", "False"]


def _train_local_before(
    W0: np.ndarray,
    b0: np.ndarray,
    emb16: np.ndarray,
    labels: np.ndarray,
    *,
    local_epochs: int,
    lr: float,
    batch_size: int,
    chunk_size: int,
    prox_mu: float,
    clip_norm: float | None,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """train_local as it was before issue 17's training work (commit c467618), on in-memory float16
    arrays: numpy's cast per chunk, a gathered copy and ``loss_and_grad`` + ``sgd_step`` per batch."""
    from edgefl.head import loss_and_grad, sgd_step, softmax

    n = len(labels)
    W, b = W0.copy(), b0.copy()
    shuffler = Shuffler(seed)
    for _ in range(local_epochs):
        order = np.argsort(shuffler.keys(n))
        for start in range(0, n, chunk_size):
            sel = np.sort(order[start : start + chunk_size])
            emb, lbl = emb16[sel].astype(np.float32), labels[sel].astype(np.int64)
            perm = np.argsort(shuffler.keys(emb.shape[0]))
            for s in range(0, emb.shape[0], batch_size):
                pick = perm[s : s + batch_size]
                _, gW, gb = loss_and_grad(W, b, emb[pick], lbl[pick])
                sgd_step(W, b, gW, gb, lr, prox_mu=prox_mu, W0=W0, b0=b0)
    delta_W, delta_b = (W - W0).astype(np.float32), (b - b0).astype(np.float32)
    if clip_norm is not None:
        sq = np.sum(delta_W.astype(np.float64) ** 2) + np.sum(delta_b.astype(np.float64) ** 2)
        norm = float(np.sqrt(sq))
        if norm > clip_norm > 0:
            delta_W *= np.float32(clip_norm / norm)
            delta_b *= np.float32(clip_norm / norm)
    final = Head(W0 + delta_W, b0 + delta_b)
    loss_sum, correct = 0.0, 0
    for start in range(0, n, chunk_size):
        emb = emb16[start : start + chunk_size].astype(np.float32)
        lbl = labels[start : start + chunk_size].astype(np.int64)
        if W0.shape[1] == 1:
            loss = loss_and_grad(final.W, final.b, emb, lbl)[0]
        else:
            p = softmax(final.logits(emb))
            loss = float(-np.mean(np.log(np.maximum(p[np.arange(len(lbl)), lbl], 1e-12))))
        loss_sum += loss * len(lbl)
        correct += int(np.sum(final.predict(emb) == lbl))
    return delta_W, delta_b, loss_sum / n, correct / n


@pytest.mark.parametrize(
    ("classes", "epochs", "batch", "chunk", "prox_mu", "clip"),
    [
        (10, 1, 32, 64, 0.0, None),  # the demo's round: D = 512 below, K = 10, batch 32, chunk 64
        (10, 3, 10, 37, 0.01, 0.5),  # ragged chunks and batches, FedProx, clipping
        (10, 2, 100, 16, 0.0, None),  # batch larger than the chunk
        (10, 2, 32, 1000, 0.0, None),  # one chunk holds the store
        (1, 2, 8, 24, 0.0, 2.0),  # logistic head
    ],
)
def test_train_local_is_bit_for_bit_the_sgd_before_the_buffers(
    tmp_path: Path, classes: int, epochs: int, batch: int, chunk: int, prox_mu: float, clip: float | None
) -> None:
    """The buffered trainer (chunks read in their shuffled order into one float32 buffer, the
    gradient into preallocated arrays) computes exactly what the allocating one did: the same
    delta and accuracy, bit for bit, and the loss up to float32 summation order, on 541 samples of
    D = 512."""
    rng = np.random.default_rng(classes + epochs)
    n, D = 541, 512
    y = rng.integers(0, 2 if classes == 1 else classes, n).astype(np.int64)
    centres = rng.normal(0, 1, (max(classes, 2), D)).astype(np.float32)
    emb = (centres[y] + rng.normal(0, 2, (n, D))).astype(np.float32)
    s = EmbeddingStore(tmp_path, capacity=1024, dim=D, num_classes=classes)
    s.add(emb, y)
    W0 = rng.normal(0, 0.05, (D, classes)).astype(np.float32)
    b0 = rng.normal(0, 0.05, classes).astype(np.float32)
    res = train_local(
        Head(W0, b0), s, local_epochs=epochs, lr=0.05, batch_size=batch, chunk_size=chunk,
        prox_mu=prox_mu, clip_norm=clip, seed=11,
    )
    dW, db, loss, acc = _train_local_before(
        W0, b0, emb.astype(np.float16), y, local_epochs=epochs, lr=0.05, batch_size=batch,
        chunk_size=chunk, prox_mu=prox_mu, clip_norm=clip, seed=11,
    )
    assert res.delta_W.tobytes() == dW.tobytes() and res.delta_b.tobytes() == db.tobytes()
    assert res.loss == pytest.approx(loss, rel=1e-6)
    assert (res.accuracy, res.num_examples) == (acc, n)
    assert np.abs(dW).max() > 1e-4  # it did learn something


def test_store_half_bits_to_float32_is_numpys_cast_for_every_finite_half() -> None:
    from edgefl.agent.store import half_bits_to_float32

    bits = np.arange(1 << 16, dtype=np.int64).astype(np.uint16)
    halves = bits.view(np.float16)[np.isfinite(bits.view(np.float16))]  # 63,488: zeros, subnormals
    out = np.empty(halves.shape, np.float32)
    assert half_bits_to_float32(halves.view(np.int16), out) is out
    assert out.view(np.uint32).tolist() == halves.astype(np.float32).view(np.uint32).tolist()
    assert (np.signbit(out) == np.signbit(halves)).all() and out[halves == 0].size == 2


def test_store_read_fills_buffers_in_the_given_order(tmp_path: Path) -> None:
    s = EmbeddingStore(tmp_path, capacity=8, dim=3)
    emb = np.array([[0.5, -1.0, 2.0], [3.0, 4.0, -0.25], [1e-6, 65504.0, -6e-8]], np.float32)
    s.add(emb, np.array([7, 8, 9], np.int64))
    e, lbl = np.full((4, 3), np.nan, np.float32), np.zeros(4, np.int64)
    s.read(np.array([2, 0, 2, 1], np.int64), e, lbl)
    assert lbl.tolist() == [9, 7, 9, 8]
    assert e.tolist() == emb.astype(np.float16).astype(np.float32)[[2, 0, 2, 1]].tolist()
    with pytest.raises(ValueError, match="3 rows into emb"):
        s.read(np.arange(3, dtype=np.int64), e, lbl)


def test_shuffler_keys_of_one_draw_rank_as_successive_permutations() -> None:
    a, b = Shuffler(3), Shuffler(3)
    keys = a.keys(50 + 20 + 30)
    assert keys.dtype == np.int64 and len(set(keys.tolist())) == 100
    assert np.argsort(keys[:50]).tolist() == np.argsort(b.keys(50)).tolist()
    assert np.argsort(keys[50:70]).tolist() == np.argsort(b.keys(20)).tolist()
    assert np.argsort(keys[70:]).tolist() == np.argsort(b.keys(30)).tolist()
    assert a.keys(5).tolist() == b.keys(5).tolist()  # both streams moved on alike
