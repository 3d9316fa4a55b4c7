"""Local training of the head over the embedding store: the device side of a federated round."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import numpy as np

from edgefl.agent.store import EmbeddingStore
from edgefl.head import (
    Head,
    cross_entropy_grad_into,
    ditto_update,
    loss_and_grad,
    restricted_logit_scale,
    sgd_step,
)
from edgefl.types import F32, I64

_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_TOP: Final = np.uint64(1 << 63)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)
_PAD: Final = np.iinfo(np.int64).max


class Shuffler:
    """Seeded random permutations from numpy arithmetic alone (``numpy.random`` costs ~2 MiB of RSS).

    A permutation of ``n`` ranks the next ``n`` outputs of SplitMix64 seeded with ``seed`` (any
    integer, modulo 2**64): distinct 64-bit keys, the same on every platform.

    Source: G. L. Steele, D. Lea, C. H. Flood, "Fast splittable pseudorandom number generators",
    OOPSLA 2014 (SplitMix64 constants as in Vigna's ``splitmix64.c``); shuffling by sorting random
    keys: Knuth, TAOCP vol. 2, §3.4.2.
    """

    __slots__ = ("_drawn", "_seed")

    def __init__(self, seed: int) -> None:
        self._seed = np.uint64(seed % (1 << 64))
        self._drawn = 0

    def keys(self, n: int) -> I64:
        """Return int64 [n]: the next ``n`` SplitMix64 outputs (distinct); ranking them is a permutation."""
        z = np.arange(self._drawn + 1, self._drawn + n + 1, dtype=np.uint64)
        self._drawn += n
        z *= _GOLDEN  # the SplitMix64 states seed + j * golden, j = 1, 2, ... (mod 2**64)
        z += self._seed
        z ^= z >> np.uint64(30)
        z *= _MIX1
        z ^= z >> np.uint64(27)
        z *= _MIX2
        z ^= z >> np.uint64(31)
        # top bit flipped: as int64 they rank as the uint64 outputs do (numpy's argsort of uint64 keeps
        # memory it never frees; int64's keeps none)
        z ^= _TOP
        return z.view(np.int64)


@dataclass(frozen=True, slots=True)
class PersonalResult:
    """What a personal step did.

    ``steps`` SGD steps over ``num_examples`` samples (the store's size at its start) in ``train_s`` s
    of wall time (0 when taken alongside local training, :class:`PersonalStep`).
    """

    steps: int
    num_examples: int
    train_s: float


@dataclass(frozen=True, slots=True)
class LocalResult:
    """What local training produced.

    ``delta_W`` float32 [D, K], ``delta_b`` [K]: ``W_local - W_global``, the update sent to the
    coordinator; ``num_examples`` samples in the store (the FedAvg weight); ``loss``, ``accuracy`` the
    final head's mean cross-entropy (nats; binary when K = 1) and accuracy (0..1) over the store;
    ``train_s`` wall time of the local epochs, seconds (the personal head's steps included);
    ``personal`` the personal head's steps when it trained alongside (:class:`PersonalStep`).
    """

    delta_W: F32
    delta_b: F32
    num_examples: int
    loss: float
    accuracy: float
    train_s: float
    personal: PersonalResult | None = None


@dataclass(frozen=True, slots=True)
class PersonalStep:
    """A personal head to train alongside the global one (:func:`train_local`'s ``personal``).

    :func:`train_personal`'s steps, taken on the batches of the round's local training. ``W`` float32
    [D, K] (C-contiguous), ``b`` [K]: the personal head, updated in place when training returns;
    ``columns``, ``lam``, ``lr``, ``absent_alpha``: as :func:`train_personal`'s.
    """

    W: F32
    b: F32
    columns: np.ndarray
    lam: float
    lr: float
    absent_alpha: float = 1.0


class _BatchReader:
    """Shuffled mini-batches of the first ``n`` samples of a store, read a chunk at a time, buffers reused."""

    def __init__(
        self, store: EmbeddingStore, n: int, dim: int, classes: int, *, chunk_size: int, batch_size: int
    ) -> None:
        self.store, self.n, self.batch_size = store, n, batch_size
        self.chunk = min(chunk_size, n)
        self.emb: F32 = np.empty((self.chunk, dim), np.float32)
        self.lbl: I64 = np.empty(self.chunk, np.int64)
        step = min(batch_size, self.chunk)
        self._z: F32 = np.empty((step, classes), np.float32)
        self._grad_W: F32 = np.empty((dim, classes), np.float32)
        self._grad_b: F32 = np.empty(classes, np.float32)
        self._rows: I64 = np.arange(step, dtype=np.int64)
        # a chunk's rows and shuffle keys, padded to the chunk's length: the last, shorter chunk of an
        # epoch sorts arrays of the same size as the others (numpy keeps freed buffers under 1 KiB per
        # size: every new tail length would hold on to a few more)
        self._sorted: I64 = np.empty(self.chunk, np.int64)
        self._keys: I64 = np.empty(self.chunk, np.int64)
        self._sel: I64 = np.empty(self.chunk, np.int64)
        self._logistic = classes == 1
        self.logit_scale: F32 | None = None
        """float32 [K] multiplying the logits in the loss (softmax heads only); None = plain."""

    def batches(self, epochs: int, shuffler: Shuffler, stop_at: float | None) -> Iterator[tuple[F32, I64]]:
        """Yield ``(emb [b, D] float32, labels [b] int64)`` views of ``epochs`` shuffled passes."""
        n, chunk, bs = self.n, self.chunk, self.batch_size
        for _ in range(epochs):
            if stop_at is not None and time.perf_counter() > stop_at:
                return
            # the epoch's order, then the keys of every chunk's own shuffle in one draw (Shuffler.keys;
            # at most 3 x 8 bytes a sample alive, as estimates.estimate_train_bytes counts)
            order = np.argsort(shuffler.keys(n))
            within = shuffler.keys(n)
            for start in range(0, n, chunk):
                if stop_at is not None and time.perf_counter() > stop_at:
                    return
                m = min(chunk, n - start)
                sel = self._chunk_order(order[start : start + m], within[start : start + m])
                self.store.read(sel, self.emb[:m], self.lbl[:m])
                for s in range(0, m, bs):
                    e = self.emb[s : min(m, s + bs)]
                    yield e, self.lbl[s : s + e.shape[0]]

    def _chunk_order(self, rows: I64, keys: I64) -> I64:
        """int64 [m] view: ``np.sort(rows)[np.argsort(keys)]``, sorting arrays of the chunk's length only."""
        m = len(rows)
        srt, k, sel = self._sorted, self._keys, self._sel[:m]
        srt[:m] = rows
        srt[m:] = _PAD
        srt.sort()
        k[:m] = keys
        k[m:] = _PAD
        if m < len(k) and k[:m].max() == _PAD:  # a key equal to the padding (p = m / 2**64): unpadded
            np.take(srt, np.argsort(keys), out=sel, mode="clip")
        else:
            np.take(srt, np.argsort(k)[:m], out=sel, mode="clip")
        return sel

    def grad(self, W: F32, b: F32, e: F32, y: I64) -> tuple[F32, F32]:
        """Gradient ``(dW [D, K], db [K])`` float32 of the batch's mean loss at ``(W, b)`` (own buffers)."""
        if self._logistic:
            _, gW, gb = loss_and_grad(W, b, e, y)
            return gW, gb
        k = len(y)
        cross_entropy_grad_into(
            W, b, e, y, self._z[:k], self._grad_W, self._grad_b, self._rows[:k], self.logit_scale
        )
        return self._grad_W, self._grad_b


def _tie(W: F32, b: F32, head: Head, columns: np.ndarray, scaled_to_zero: bool) -> np.ndarray | None:
    """Tie the columns outside ``columns`` to the head's; the mask a step keeps tied (None: none/0 grad)."""
    if columns.all():
        return None
    tied: np.ndarray = ~columns
    W[:, tied] = head.W[:, tied]
    b[tied] = head.b[tied]
    return None if scaled_to_zero else tied


class _Pair:
    """The global and a personal head stacked, ``[W, V]`` float32 [2, D, K], trained on the same batches."""

    def __init__(
        self, head: Head, step: PersonalStep, reader: _BatchReader, lr: float, prox_mu: float
    ) -> None:
        D, K = head.shape
        if K < 2 or step.W.shape != (D, K) or step.b.shape != (K,) or step.columns.shape != (K,):
            raise ValueError(
                f"train_local: personal W {step.W.shape}, b {step.b.shape}, columns "
                f"{step.columns.shape} for a head of {(D, K)} (K >= 2)"
            )
        if step.lr <= 0 or step.lam < 0 or not 0 <= step.absent_alpha <= 1:
            raise ValueError(
                f"train_local: personal lr={step.lr}, lam={step.lam}, absent_alpha={step.absent_alpha}"
            )
        self.head, self.step_cfg, self.reader = head, step, reader
        self.lr, self.prox_mu = lr, prox_mu
        self.W2: F32 = np.empty((2, D, K), np.float32)
        self.b2: F32 = np.empty((2, 1, K), np.float32)
        self.W2[0], self.W2[1] = head.W, step.W
        self.b2[0, 0], self.b2[1, 0] = head.b, step.b
        self.W, self.b = self.W2[0], self.b2[0, 0]  # the global head's working copy
        self.V, self.c = self.W2[1], self.b2[1, 0]
        self._z: F32 = np.empty((2, len(reader._rows), K), np.float32)
        self._gW: F32 = np.empty((2, D, K), np.float32)
        self._gb: F32 = np.empty((2, 1, K), np.float32)
        self.scale = restricted_logit_scale(step.columns, step.absent_alpha)
        self.lam32 = np.float32(step.lam)
        self.lr_p32 = np.float32(step.lr)
        self.active = bool(step.columns.any())
        zeroed = self.scale is not None and step.absent_alpha == 0.0
        self.tied = _tie(self.V, self.c, head, step.columns, zeroed)  # as train_personal's
        self.steps = 0

    def train_step(self, e: F32, y: I64) -> None:
        """One SGD step of the global head and one Ditto step of the personal head on the batch."""
        k = len(y)
        gW, gb = self._gW, self._gb
        cross_entropy_grad_into(  # both heads at once: H = 2
            self.W2, self.b2, e, y, self._z[:, :k], gW, gb, self.reader._rows[:k], self.scale
        )
        self.steps += 1
        head = self.head
        sgd_step(self.W, self.b, gW[0], gb[0, 0], self.lr, prox_mu=self.prox_mu, W0=head.W, b0=head.b)
        if self.active:
            ditto_update(
                self.V, self.c, gW[1], gb[1, 0], self.lr_p32, self.lam32, self.head.W, self.head.b, self.tied
            )

    def finish(self, n: int) -> PersonalResult:
        """Copy the personal head back into the caller's arrays; what its steps did."""
        # nothing to personalise: the global head (train_personal's 0 steps)
        W, b, steps = (self.V, self.c, self.steps) if self.active else (self.head.W, self.head.b, 0)
        self.step_cfg.W[...] = W
        self.step_cfg.b[...] = b
        return PersonalResult(steps, n, 0.0)


def train_local(
    head: Head,
    store: EmbeddingStore,
    *,
    local_epochs: int,
    lr: float,
    batch_size: int,
    chunk_size: int,
    prox_mu: float = 0.0,
    clip_norm: float | None = None,
    seed: int = 0,
    time_budget_s: float | None = None,
    personal: PersonalStep | None = None,
) -> LocalResult:
    """Run ``local_epochs`` of mini-batch SGD on a copy of ``head`` over every sample of ``store``.

    The store is read one chunk of ``chunk_size`` samples at a time, shuffled per epoch and within
    each chunk. The loss is softmax cross-entropy for K >= 2, binary cross-entropy for K = 1.

    Parameters
    ----------
    head : Head
        The global head the round starts from (not modified).
    store : EmbeddingStore
        Local labelled embeddings (not empty).
    local_epochs, batch_size, chunk_size : int
        Passes over the store, samples per SGD step, samples read from the store at once (each >= 1).
    lr : float
        SGD learning rate (> 0).
    prox_mu : float
        FedProx proximal coefficient (0 = FedAvg's plain local SGD).
    clip_norm : float or None
        If set, the update ``(delta_W, delta_b)`` is scaled down to this L2 norm.
    seed : int
        Seed of the per-epoch shuffles.
    time_budget_s : float or None
        Stop after the chunk during which this many seconds have passed; None = no limit.
    personal : PersonalStep or None
        A personal head trained on the same batches (softmax heads, K >= 2): its steps are
        :func:`train_personal`'s toward ``head``, in this training's sample order; its arrays are
        updated in place. The global head's training is bit for bit the same as without it.

    Raises
    ------
    ValueError
        If the store is empty, an argument is not positive, or ``personal`` does not fit the head
        (shape, K = 1, ``lr``, ``lam`` or ``absent_alpha`` out of range).

    Source: ClientUpdate of FedAvg, McMahan et al. 2017, "Communication-Efficient Learning of Deep
    Networks from Decentralized Data", Algorithm 1; FedProx term from Li et al. 2020.
    """
    n = len(store)
    if n == 0:
        raise ValueError("train_local: the store is empty")
    if local_epochs < 1 or batch_size < 1 or chunk_size < 1 or lr <= 0:
        raise ValueError(
            f"train_local: local_epochs={local_epochs}, batch_size={batch_size}, "
            f"chunk_size={chunk_size}, lr={lr}"
        )
    t0 = time.perf_counter()
    D, K = head.shape
    shuffler = Shuffler(seed)
    stop_at = t0 + time_budget_s if time_budget_s is not None else None
    reader = _BatchReader(store, n, D, K, chunk_size=chunk_size, batch_size=batch_size)
    chunk, emb, lbl = reader.chunk, reader.emb, reader.lbl
    steps = 0
    pair = _Pair(head, personal, reader, lr, prox_mu) if personal is not None else None
    # with a personal head: the global head of its [W, V], trained in place
    W, b = (head.W.copy(), head.b.copy()) if pair is None else (pair.W, pair.b)
    for e, y in reader.batches(local_epochs, shuffler, stop_at):
        steps += 1
        if pair is not None:
            pair.train_step(e, y)
        else:
            gW, gb = reader.grad(W, b, e, y)
            sgd_step(W, b, gW, gb, lr, prox_mu=prox_mu, W0=head.W, b0=head.b)
    # the buffer holds every sample: one chunk, read whole (in the last epoch's order)
    whole = chunk == n and steps > 0
    train_s = time.perf_counter() - t0
    personal_result = pair.finish(n) if pair is not None else None
    delta_W: F32 = (W - head.W).astype(np.float32)
    delta_b: F32 = (b - head.b).astype(np.float32)
    if clip_norm is not None:
        norm = float(
            np.sqrt(np.sum(delta_W.astype(np.float64) ** 2) + np.sum(delta_b.astype(np.float64) ** 2))
        )
        if norm > clip_norm > 0:
            scale = np.float32(clip_norm / norm)
            delta_W *= scale
            delta_b *= scale
    loss_sum = 0.0
    correct = 0
    final = Head(head.W + delta_W, head.b + delta_b, head.version)
    z: F32 = np.empty((chunk, K), np.float32)  # one chunk's logits, then probabilities, in place
    rows = np.arange(chunk, dtype=np.int64)
    # and [chunk] buffers for the rest: the last, shorter chunk takes views, no array of a new length
    at = np.arange(chunk, dtype=np.int64)  # the chunk's rows in the store
    red: F32 = np.empty((chunk, 1), np.float32)
    pick = np.empty(chunk, np.int64)
    py_buf: F32 = np.empty(chunk, np.float32)
    pred_buf = np.empty(chunk, np.intp)
    hit = np.empty(chunk, bool)
    # the n samples trained on, through the same chunk buffer (not read again when it held them all)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        e, y = emb[:m], lbl[:m]
        if not whole:
            store.read(at[:m], e, y)
            at += chunk
        if K == 1:
            loss, _, _ = loss_and_grad(final.W, final.b, e, y)
            pred = final.predict(e)
        else:
            # cross_entropy's loss and Head.predict's classes from one set of logits, no gradient
            zm = z[:m]
            np.matmul(e, final.W, out=zm)
            zm += final.b
            pred = np.argmax(zm, axis=1, out=pred_buf[:m])
            zm -= np.maximum.reduce(zm, axis=1, keepdims=True, out=red[:m])
            np.exp(zm, out=zm)
            zm /= np.add.reduce(zm, axis=1, keepdims=True, out=red[:m])
            flat = np.multiply(rows[:m], K, out=pick[:m])
            flat += y
            py = np.take(zm.reshape(-1), flat, out=py_buf[:m], mode="clip")  # zm[rows, y]
            np.maximum(py, 1e-12, out=py)
            np.log(py, out=py)
            loss = float(-np.mean(py))
        loss_sum += loss * m
        correct += int(np.count_nonzero(np.equal(pred, y, out=hit[:m])))
    return LocalResult(delta_W, delta_b, n, loss_sum / n, correct / n, train_s, personal_result)


def train_personal(
    W: F32,
    b: F32,
    global_head: Head,
    store: EmbeddingStore,
    columns: np.ndarray,
    *,
    lam: float,
    epochs: int,
    lr: float,
    batch_size: int,
    chunk_size: int,
    absent_alpha: float = 1.0,
    seed: int = 0,
    time_budget_s: float | None = None,
) -> PersonalResult:
    """Train a personal head in place: ``epochs`` passes of class-restricted Ditto steps over ``store``.

    The store is read as by :func:`train_local`. Each batch takes one :func:`edgefl.head.ditto_update`
    toward ``global_head`` on the classes of ``columns``; the other columns are the global head's on
    return, and their logits are scaled by ``absent_alpha`` in the loss (FedRS's restricted softmax).

    Parameters
    ----------
    W, b : float32 [D, K] (C-contiguous), float32 [K]
        The personal head, updated in place.
    global_head : Head
        The global head it is pulled toward (not modified).
    columns : bool [K]
        Classes the device may personalise (:func:`edgefl.head.personal_columns`).
    lam : float
        Ditto's proximal coefficient (>= 0).
    absent_alpha : float
        Scale of the logits of the classes outside ``columns`` in the loss, 0..1 (1 = plain softmax).
    epochs, store, lr, batch_size, chunk_size, seed, time_budget_s
        As :func:`train_local`'s ``local_epochs``, ``store``...

    Raises
    ------
    ValueError
        If the store is empty, an argument is out of range or shapes disagree.

    Source: Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
    Personalization", ICML 2021, Algorithm 1 (the personal model's local steps); the scaled logits
    of absent classes from Li and Zhan, "FedRS: Federated Learning with Restricted Softmax for
    Label Distribution Non-IID Data", KDD 2021.
    """
    n = len(store)
    if n == 0:
        raise ValueError("train_personal: the store is empty")
    if epochs < 1 or batch_size < 1 or chunk_size < 1 or lr <= 0 or lam < 0 or not 0 <= absent_alpha <= 1:
        raise ValueError(
            f"train_personal: epochs={epochs}, batch_size={batch_size}, chunk_size={chunk_size}, "
            f"lr={lr}, lam={lam}, absent_alpha={absent_alpha}"
        )
    D, K = global_head.shape
    if W.shape != (D, K) or b.shape != (K,) or columns.shape != (K,):
        raise ValueError(f"train_personal: W {W.shape}, b {b.shape}, columns {columns.shape}, head {(D, K)}")
    t0 = time.perf_counter()
    stop_at = t0 + time_budget_s if time_budget_s is not None else None
    shuffler = Shuffler(seed)
    reader = _BatchReader(store, n, D, K, chunk_size=chunk_size, batch_size=batch_size)
    if K > 1:
        reader.logit_scale = restricted_logit_scale(columns, absent_alpha)
    steps = 0
    lr32, lam32 = np.float32(lr), np.float32(lam)
    if not columns.any():
        W[...] = global_head.W  # nothing to personalise: the global head
        b[...] = global_head.b
        return PersonalResult(0, n, time.perf_counter() - t0)
    # one step is edgefl.head.ditto_update's
    step_tied = _tie(W, b, global_head, columns, reader.logit_scale is not None and absent_alpha == 0.0)
    for e, y in reader.batches(epochs, shuffler, stop_at):
        gW, gb = reader.grad(W, b, e, y)
        ditto_update(W, b, gW, gb, lr32, lam32, global_head.W, global_head.b, step_tied)
        steps += 1
    return PersonalResult(steps, n, time.perf_counter() - t0)


def fit_head(
    W: F32,
    b: F32,
    emb: F32,
    labels: np.ndarray,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
) -> tuple[F32, F32]:
    """Train a head on in-memory arrays (the demo's central and local-only baselines, not the device path).

    ``W`` float32 [D, K], ``b`` [K] (not modified), ``emb`` float32 [N, D], ``labels`` int64 [N];
    returns the trained ``(W, b)``. ValueError if ``emb`` is empty.
    """
    if emb.shape[0] == 0:
        raise ValueError("fit_head: no samples")
    W = W.copy()
    b = b.copy()
    rng = np.random.default_rng(seed)
    y = labels.astype(np.int64)
    for _ in range(epochs):
        perm = rng.permutation(emb.shape[0])
        for s in range(0, emb.shape[0], batch_size):
            sel = perm[s : s + batch_size]
            _, gW, gb = loss_and_grad(W, b, emb[sel], y[sel])
            sgd_step(W, b, gW, gb, lr)
    return W, b
