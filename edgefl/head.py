"""The trainable head: the model's last dense layer, ``logits = E @ W + b``, in float32 numpy.

The backbone is frozen, so each embedding is computed once for every local epoch. K >= 2 is a
softmax classifier (labels ``0..K-1``, argmax); K = 1 a logistic one (labels 0/1, ``logit > 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgefl.errors import UpdateRejected
from edgefl.types import F32, I64

MAX_HEAD_ABS = 1.0e4
"""Largest |weight| or |bias| a valid head may hold (ours stay below ~10; float32 overflows near 1e38)."""


@dataclass(frozen=True, slots=True)
class Head:
    """One version of the head (immutable: swapped by rebinding a reference).

    ``W`` float32 [D, K], ``b`` float32 [K]; ``version`` the global model version it came from (0: the
    factory head shipped with the model).
    """

    W: F32
    b: F32
    version: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        """``(D, K)``: embedding size and number of classes."""
        return (int(self.W.shape[0]), int(self.W.shape[1]))

    def logits(self, emb: F32) -> F32:
        """Logits float32 [N, K] of embeddings ``emb`` float32 [N, D]."""
        out: F32 = (emb @ self.W + self.b).astype(np.float32, copy=False)
        return out

    def predict(self, emb: F32) -> I64:
        """Class predictions int64 [N] of emb float32 [N, D]: argmax (K >= 2), or ``logit > 0`` (K = 1)."""
        z = self.logits(emb)
        if z.shape[1] == 1:
            return (z[:, 0] > 0).astype(np.int64)
        pred: I64 = np.argmax(z, axis=1).astype(np.int64)
        return pred

    def scores(self, emb: F32) -> tuple[I64, F32]:
        """Predictions int64 [N] of ``emb`` float32 [N, D] and the probability float32 [N] of each.

        The softmax probability of the argmax (K >= 2), or ``sigmoid(z)`` / ``1 - sigmoid(z)`` for class
        1 / 0 (K = 1).
        """
        z = self.logits(emb)
        if z.shape[1] == 1:
            p1 = sigmoid(z[:, 0])
            cls = (z[:, 0] > 0).astype(np.int64)
            score: F32 = np.where(cls == 1, p1, np.float32(1) - p1).astype(np.float32)
            return cls, score
        p = softmax(z)
        cls = np.argmax(p, axis=1).astype(np.int64)
        return cls, p[np.arange(len(cls)), cls].astype(np.float32)


def label_range(num_classes: int) -> int:
    """Number of valid labels for a head with ``num_classes`` outputs: 2 for K = 1 (0/1), else K."""
    return 2 if num_classes == 1 else num_classes


def check_labels(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Where a head with K = ``num_classes`` outputs can learn ``labels`` [N]: bool [N], ``0 <= label < K``.

    K = 1 (a logistic head) learns labels 0 and 1.
    """
    upper = label_range(num_classes)
    ok: np.ndarray = (labels >= 0) & (labels < upper)
    return ok


def sigmoid(z: F32) -> F32:
    """Logistic function ``1 / (1 + exp(-z))``, computed without overflow for large ``|z|``."""
    zf = z.astype(np.float32, copy=False)
    e = np.exp(-np.abs(zf))
    out: F32 = np.where(zf >= 0, 1 / (1 + e), e / (1 + e)).astype(np.float32)
    return out


def validate_head(W: F32, b: F32, shape: tuple[int, int]) -> None:
    """Check a candidate head (W float32 [D, K], b float32 [K]) against the model's ``shape`` (D, K).

    UpdateRejected ``bad_shape``, ``bad_dtype`` (not float32), ``not_finite``, or ``bad_value`` (an
    |value| over :data:`MAX_HEAD_ABS`).
    """
    if W.shape != shape or b.shape != (shape[1],):
        raise UpdateRejected(
            "bad_shape", f"head W{W.shape} b{b.shape}, model expects W{shape} b({shape[1]},)"
        )
    if W.dtype != np.float32 or b.dtype != np.float32:
        raise UpdateRejected("bad_dtype", f"head dtypes {W.dtype}/{b.dtype}, expected float32")
    if not (np.isfinite(W).all() and np.isfinite(b).all()):
        raise UpdateRejected("not_finite", "head contains NaN or infinite values")
    largest = max(float(np.abs(W).max(initial=0.0)), float(np.abs(b).max(initial=0.0)))
    if largest > MAX_HEAD_ABS:
        # finite but absurd: logits would overflow float32 on ordinary embeddings
        raise UpdateRejected("bad_value", f"head has |value| {largest:.3g} > {MAX_HEAD_ABS:g}")


def softmax(logits: F32) -> F32:
    """Row-wise softmax of ``logits`` float32 [N, K], numerically stable (max subtracted)."""
    z = logits - logits.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    out: F32 = z.astype(np.float32, copy=False)
    return out


def cross_entropy(W: F32, b: F32, emb: F32, labels: I64) -> tuple[float, F32, F32]:
    """Mean softmax cross-entropy (nats) of a batch and its gradient with respect to the head.

    ``W`` float32 [D, K], ``b`` float32 [K], ``emb`` float32 [N, D] (N >= 1), ``labels`` int64 [N] in
    ``[0, K)``. Returns the loss, ``grad_W`` float32 [D, K] and ``grad_b`` float32 [K]. ValueError if
    ``emb`` is empty or shapes disagree.

    Source: the softmax-regression gradient ``dL/dz = softmax(z) - onehot(y)`` (Bishop 2006, §4.3.4).
    """
    n = emb.shape[0]
    if n == 0 or emb.shape[1] != W.shape[0] or labels.shape != (n,):
        raise ValueError(f"cross_entropy: emb {emb.shape}, labels {labels.shape}, W {W.shape}")
    p = softmax((emb @ W + b).astype(np.float32, copy=False))
    rows = np.arange(n)
    loss = float(-np.mean(np.log(np.maximum(p[rows, labels], 1e-12))))
    p[rows, labels] -= 1.0
    p /= n
    grad_W: F32 = (emb.T @ p).astype(np.float32, copy=False)
    grad_b: F32 = p.sum(axis=0).astype(np.float32, copy=False)
    return loss, grad_W, grad_b


def cross_entropy_grad_into(
    W: F32,
    b: F32,
    emb: F32,
    labels: I64,
    z: F32,
    grad_W: F32,
    grad_b: F32,
    rows: I64,
    logit_scale: F32 | None = None,
) -> None:
    """The gradient of :func:`cross_entropy` into caller-owned buffers, bit for bit, without the loss.

    One head: ``W`` float32 [D, K], ``b`` [K], ``z`` [N, K] scratch (left holding ``(softmax(emb @ W +
    b) - onehot) / N``), ``grad_W`` [D, K] and ``grad_b`` [K] receive the gradient. H heads stacked
    (e.g. the global and the personal head over the same batches), each bit for bit its own: ``W``
    [H, D, K], ``b`` [H, 1, K], ``z`` [H, N, K], ``grad_W`` [H, D, K], ``grad_b`` [H, 1, K]; one
    matmul, softmax and ``emb.T @ z`` serve them all. ``rows`` is ``arange(N)``; no heap allocation
    but numpy's small reductions. With ``logit_scale`` float32 [K] the last head's loss is that of its
    scaled logits and its gradient the chain rule's (:func:`restricted_logit_scale`).

    Source: as :func:`cross_entropy` (Bishop 2006, §4.3.4).
    """
    if W.ndim == 2:  # one head: a stack of one
        W, b, z, grad_W, grad_b = W[None], b[None, None], z[None], grad_W[None], grad_b[None, None]
    n = emb.shape[0]
    np.matmul(emb, W, out=z)
    z += b
    if logit_scale is not None:
        z[-1] *= logit_scale
    # the ufuncs' reduce: np.max/np.sum's values without their Python wrappers (a few us a call)
    z -= np.maximum.reduce(z, axis=2, keepdims=True)
    np.exp(z, out=z)
    z /= np.add.reduce(z, axis=2, keepdims=True)
    z[:, rows, labels] -= 1.0
    z /= n
    if logit_scale is not None:
        z[-1] *= logit_scale
    np.matmul(emb.T, z, out=grad_W)
    np.add.reduce(z, axis=1, keepdims=True, out=grad_b)


def binary_cross_entropy(W: F32, b: F32, emb: F32, labels: I64) -> tuple[float, F32, F32]:
    """Mean binary cross-entropy (nats) of a logistic head (K = 1) and its gradient.

    ``W`` float32 [D, 1], ``b`` [1], ``emb`` [N, D], ``labels`` int64 [N] of 0/1. The loss is computed
    as ``softplus(z) - y z`` (no overflow, no log of 0); returns it, ``grad_W`` [D, 1], ``grad_b`` [1].
    ValueError if ``emb`` is empty, shapes disagree or K != 1.

    Source: logistic regression, ``dL/dz = sigmoid(z) - y`` (Bishop 2006, §4.3.2).
    """
    n = emb.shape[0]
    if n == 0 or W.shape[1] != 1 or emb.shape[1] != W.shape[0] or labels.shape != (n,):
        raise ValueError(f"binary_cross_entropy: emb {emb.shape}, labels {labels.shape}, W {W.shape}")
    z = (emb @ W + b).astype(np.float32, copy=False)[:, 0]
    y = labels.astype(np.float32)
    softplus = np.maximum(z, 0) + np.log1p(np.exp(-np.abs(z)))
    loss = float(np.mean(softplus - y * z))
    g = ((sigmoid(z) - y) / np.float32(n)).astype(np.float32)[:, None]
    grad_W: F32 = (emb.T @ g).astype(np.float32, copy=False)
    grad_b: F32 = g.sum(axis=0).astype(np.float32, copy=False)
    return loss, grad_W, grad_b


def loss_and_grad(W: F32, b: F32, emb: F32, labels: I64) -> tuple[float, F32, F32]:
    """The head's loss and gradient: :func:`binary_cross_entropy` when K = 1, else :func:`cross_entropy`."""
    if W.shape[1] == 1:
        return binary_cross_entropy(W, b, emb, labels)
    return cross_entropy(W, b, emb, labels)


def sgd_step(
    W: F32,
    b: F32,
    grad_W: F32,
    grad_b: F32,
    lr: float,
    *,
    prox_mu: float = 0.0,
    W0: F32 | None = None,
    b0: F32 | None = None,
) -> None:
    """One in-place SGD step ``W -= lr * (grad_W + prox_mu * (W - W0))`` on W [D, K] and b [K].

    ``grad_W`` and ``grad_b`` are overwritten with the step. ``W0``/``b0`` (the round's global head)
    are required when ``prox_mu > 0`` (FedProx), else ValueError; ``prox_mu`` 0 is plain SGD.

    Source: FedProx local objective, Li et al. 2020, "Federated Optimization in Heterogeneous
    Networks", eq. (2).
    """
    if prox_mu > 0.0:
        if W0 is None or b0 is None:
            raise ValueError("sgd_step: prox_mu > 0 needs the round's starting head W0, b0")
        grad_W += np.float32(prox_mu) * (W - W0)
        grad_b += np.float32(prox_mu) * (b - b0)
    grad_W *= np.float32(lr)
    W -= grad_W
    grad_b *= np.float32(lr)
    b -= grad_b


def personal_columns(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """The head columns a device may personalise, bool [K]: the classes some label of ``labels`` names.

    Labels outside the head's range are ignored. For a logistic head (K = 1) the one column separates
    class 0 from class 1, so it is True only when both have been seen.
    """
    y = np.asarray(labels).astype(np.int64, copy=False)
    y = y[check_labels(y, num_classes)]
    counts = np.bincount(y, minlength=label_range(num_classes))
    if num_classes == 1:
        return np.array([bool(counts[0] > 0 and counts[1] > 0)])
    seen: np.ndarray = counts > 0
    return seen


def restricted_logit_scale(columns: np.ndarray, alpha: float) -> F32 | None:
    """The personal step's logit scale float32 [K]: 1 for the classes in ``columns``, ``alpha`` for the rest.

    Scaling the absent classes' logits in the local loss (0: a constant logit 0; 1: plain softmax) fits
    the labelled classes against each other, not above those only the fleet knows; prediction is
    unscaled. None when every class is personal or ``alpha`` is 1; ValueError for ``alpha`` outside 0..1.

    Source: X.-C. Li, D.-C. Zhan, "FedRS: Federated Learning with Restricted Softmax for Label
    Distribution Non-IID Data", KDD 2021, §4 (the scaled logits of missing classes).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"restricted_logit_scale: alpha = {alpha} must be in 0..1")
    if columns.all() or alpha == 1.0:
        return None
    scale: F32 = np.where(columns, np.float32(1.0), np.float32(alpha)).astype(np.float32)
    return scale


def ditto_update(
    W: F32,
    b: F32,
    grad_W: F32,
    grad_b: F32,
    lr: np.float32,
    lam: np.float32,
    W_global: F32,
    b_global: F32,
    tied: np.ndarray | None,
) -> None:
    """One in-place class-restricted proximal step on a personal head (W float32 [D, K], b [K]).

    For the classes not ``tied`` (those of :func:`personal_columns`): ``W[:, k] -= lr * (grad_W[:, k] +
    lam * (W[:, k] - W_global[:, k]))`` (and ``b[k]``); the ``tied`` columns (bool [K], None: none) are
    set to the global head's, so classes without evidence stay as the fleet knows them. ``lr`` > 0 and
    ``lam`` >= 0 (0: local training alone) are float32 scalars; ``grad_W``/``grad_b`` are scratch
    (overwritten); no heap beyond numpy's scalars. The caller checks shapes and ranges.

    Source: Ditto's personal objective ``min_v F_k(v) + lam/2 ||v - w*||^2`` and its local update,
    T. Li, S. Hu, A. Beirami, V. Smith, "Ditto: Fair and Robust Federated Learning Through
    Personalization", ICML 2021, Algorithm 1; restricted to the device's labelled classes here.
    """
    # every column stepped (no gather), then the tied ones overwritten; W - lr (g + lam (W - Wg)) as
    # (1 - lr lam) W - lr g + lr lam Wg in place (the gradient's buffer takes lr lam Wg at the end)
    grad_W *= lr
    grad_b *= lr
    if lam != 0:
        c = lr * lam
        W *= np.float32(1) - c
        b *= np.float32(1) - c
        W -= grad_W
        b -= grad_b
        np.multiply(W_global, c, out=grad_W)
        np.multiply(b_global, c, out=grad_b)
        W += grad_W
        b += grad_b
    else:
        W -= grad_W
        b -= grad_b
    if tied is not None:
        W[:, tied] = W_global[:, tied]
        b[tied] = b_global[tied]
