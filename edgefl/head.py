"""The trainable head: the model's last dense layer, ``logits = E @ W + b``, in float32 numpy.

The backbone is frozen; only this layer is trained on the device, so one embedding per sample is
computed once and reused for every local epoch (see DESIGN.md, "The job").

Two kinds of head, told apart by K alone (so a head decoded from the network needs no extra field):
K >= 2 is a softmax classifier (labels ``0..K-1``, softmax cross-entropy, prediction = argmax);
K = 1 is a logistic (binary) classifier (labels 0/1, binary cross-entropy on the one logit,
prediction = ``logit > 0``). The model's own activation after its last FULLY_CONNECTED
(``softmax``, ``logistic`` or ``none``) only matters to reproduce its output: :func:`activate`.
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
    """One version of the head; immutable so it can be swapped atomically by rebinding a reference.

    Attributes
    ----------
    W : float32 [D, K]
        Weights (D = embedding size, K = number of classes).
    b : float32 [K]
        Biases.
    version : int
        Global model version this head came from (0 = the factory head shipped with the model).
    """

    W: F32
    b: F32
    version: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        """``(D, K)``: embedding size and number of classes."""
        return (int(self.W.shape[0]), int(self.W.shape[1]))

    def logits(self, emb: F32) -> F32:
        """Logits of a batch of embeddings.

        Parameters
        ----------
        emb : float32 [N, D]

        Returns
        -------
        float32 [N, K]
        """
        out: F32 = (emb @ self.W + self.b).astype(np.float32, copy=False)
        return out

    def predict(self, emb: F32) -> I64:
        """Class predictions for embeddings ``emb`` float32 [N, D] → int64 [N].

        argmax of the logits (K >= 2), or ``logit > 0`` i.e. probability > 0.5 (K = 1: class 0 or 1).
        """
        z = self.logits(emb)
        if z.shape[1] == 1:
            return (z[:, 0] > 0).astype(np.int64)
        pred: I64 = np.argmax(z, axis=1).astype(np.int64)
        return pred

    def scores(self, emb: F32) -> tuple[I64, F32]:
        """Predictions and the probability of each predicted class.

        Parameters
        ----------
        emb : float32 [N, D]

        Returns
        -------
        classes : int64 [N]
        score : float32 [N]
            softmax probability of the argmax (K >= 2), or ``sigmoid(z)`` / ``1 - sigmoid(z)`` for
            class 1 / 0 (K = 1).
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
    """Which labels a head with K = ``num_classes`` outputs can learn.

    Parameters
    ----------
    labels : integer array [N]
    num_classes : int
        K (1 = logistic head, labels 0/1).

    Returns
    -------
    bool [N]
        True where ``0 <= label < K`` (``< 2`` when K = 1).
    """
    upper = label_range(num_classes)
    ok: np.ndarray = (labels >= 0) & (labels < upper)
    return ok


def activate(logits: F32, activation: str) -> F32:
    """The model's own activation after its last FULLY_CONNECTED, applied to head logits.

    Parameters
    ----------
    logits : float32 [N, K]
    activation : "softmax" | "logistic" | "none"

    Returns
    -------
    float32 [N, K]

    Raises
    ------
    ValueError
        For another activation name.
    """
    if activation == "softmax":
        return softmax(logits.copy())
    if activation == "logistic":
        return sigmoid(logits)
    if activation == "none":
        return logits
    raise ValueError(f"activation {activation!r}: expected softmax, logistic or none")


def sigmoid(z: F32) -> F32:
    """Logistic function ``1 / (1 + exp(-z))``, computed without overflow for large ``|z|``."""
    zf = z.astype(np.float32, copy=False)
    e = np.exp(-np.abs(zf))
    out: F32 = np.where(zf >= 0, 1 / (1 + e), e / (1 + e)).astype(np.float32)
    return out


def validate_head(W: F32, b: F32, shape: tuple[int, int]) -> None:
    """Check a candidate head before it replaces the current one.

    Parameters
    ----------
    W : float32 [D, K]
    b : float32 [K]
    shape : (D, K) expected by the model.

    Raises
    ------
    UpdateRejected
        ``bad_shape`` if the shapes differ from ``shape``, ``bad_dtype`` if not float32,
        ``not_finite`` if any value is NaN or infinite, ``bad_value`` if any |value| > ``MAX_HEAD_ABS``.
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
    """Row-wise softmax, numerically stable (max subtracted).

    Parameters
    ----------
    logits : float32 [N, K]

    Returns
    -------
    float32 [N, K], rows summing to 1.
    """
    z = logits - logits.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    out: F32 = z.astype(np.float32, copy=False)
    return out


def cross_entropy(W: F32, b: F32, emb: F32, labels: I64) -> tuple[float, F32, F32]:
    """Mean softmax cross-entropy of a batch and its gradient with respect to the head.

    Parameters
    ----------
    W : float32 [D, K]
    b : float32 [K]
    emb : float32 [N, D]
        Embeddings (N >= 1 samples).
    labels : int64 [N]
        Class indices in ``[0, K)``.

    Returns
    -------
    loss : float
        Mean cross-entropy in nats.
    grad_W : float32 [D, K]
    grad_b : float32 [K]

    Raises
    ------
    ValueError
        If ``emb`` is empty or shapes disagree.

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
    """The gradient of :func:`cross_entropy` into caller-owned buffers, without the loss.

    The same floating-point operations in the same order as :func:`cross_entropy`'s gradient, so
    the result is bit for bit the same, with no heap allocation but numpy's small reductions: the
    device's local SGD runs this once a batch (the loss was computed and dropped at every
    step, and each step allocated its logits, probabilities and gradients anew).

    Parameters
    ----------
    W : float32 [D, K]
    b : float32 [K]
    emb : float32 [N, D], C-contiguous (N >= 1)
    labels : int64 [N]
        Class indices in ``[0, K)``.
    z : float32 [N, K], C-contiguous
        Scratch: left holding ``(softmax(emb @ W + b) - onehot(labels)) / N``.
    grad_W : float32 [D, K], C-contiguous
        Receives the gradient with respect to ``W``.
    grad_b : float32 [K]
        Receives the gradient with respect to ``b``.
    rows : int64 [N]
        ``arange(N)`` (kept by the caller to save allocating it every step).
    logit_scale : float32 [K] or None
        If given, the loss is that of the scaled logits ``s_k * (emb @ W + b)_k`` and the gradient
        is the chain rule's (``z`` is left holding ``s * (softmax - onehot) / N``); None = 1 for
        every class, bit for bit the plain gradient. The personal step scales the classes a
        device never had a label for by FedRS's alpha (:func:`restricted_logit_scale`).

    Source: as :func:`cross_entropy` (Bishop 2006, §4.3.4).
    """
    n = emb.shape[0]
    np.matmul(emb, W, out=z)
    z += b
    if logit_scale is not None:
        z *= logit_scale
    z -= z.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    z[rows, labels] -= 1.0
    z /= n
    if logit_scale is not None:
        z *= logit_scale
    np.matmul(emb.T, z, out=grad_W)
    np.sum(z, axis=0, out=grad_b)


def paired_cross_entropy_grad_into(
    W2: F32,
    b2: F32,
    emb: F32,
    labels: I64,
    z: F32,
    grad_W: F32,
    grad_b: F32,
    rows: I64,
    logit_scale: F32 | None = None,
) -> None:
    """:func:`cross_entropy_grad_into` of two softmax heads stacked, each bit for bit its own.

    ``W2 = [W, V]`` stacks two heads of the same shape; the batch's logits of both come from one
    stacked ``emb @ W2`` and both gradients from one ``emb.T @ z`` (numpy multiplies each head
    with the same BLAS call as alone, so each half is exactly :func:`cross_entropy_grad_into`'s),
    and one softmax runs over both. The device trains its global and its personal head over the
    same batches this way: half the Python calls of two heads, and the global head's arithmetic
    unchanged by the personal one beside it.

    Parameters
    ----------
    W2 : float32 [2, D, K], C-contiguous
        ``[W, V]``: the first head's weights, then the second's.
    b2 : float32 [2, 1, K]
        Their biases.
    emb : float32 [N, D], C-contiguous (N >= 1)
    labels : int64 [N]
        Class indices in ``[0, K)``.
    z : float32 [2, N, K], C-contiguous
        Scratch: left holding both heads' ``(softmax - onehot) / N`` (the second's times ``logit_scale``).
    grad_W : float32 [2, D, K], C-contiguous
        Receives ``[dW, dV]``.
    grad_b : float32 [2, 1, K]
        Receives both heads' bias gradients.
    rows : int64 [N]
        ``arange(N)``.
    logit_scale : float32 [K] or None
        The second head's logit scale (:func:`restricted_logit_scale`); the first head's loss is
        always the plain softmax cross-entropy.

    Source: as :func:`cross_entropy` (Bishop 2006, §4.3.4), per head.
    """
    n = emb.shape[0]
    np.matmul(emb, W2, out=z)
    z += b2
    if logit_scale is not None:
        z[1] *= logit_scale
    # the ufuncs' reduce: np.max/np.sum's values without their Python wrappers (a few us a call)
    z -= np.maximum.reduce(z, axis=2, keepdims=True)
    np.exp(z, out=z)
    z /= np.add.reduce(z, axis=2, keepdims=True)
    z[:, rows, labels] -= 1.0
    z /= n
    if logit_scale is not None:
        z[1] *= logit_scale
    np.matmul(emb.T, z, out=grad_W)
    np.add.reduce(z, axis=1, keepdims=True, out=grad_b)


def binary_cross_entropy(W: F32, b: F32, emb: F32, labels: I64) -> tuple[float, F32, F32]:
    """Mean binary cross-entropy of a logistic head (K = 1) and its gradient.

    Parameters
    ----------
    W : float32 [D, 1]
    b : float32 [1]
    emb : float32 [N, D]
    labels : int64 [N]
        0 or 1.

    Returns
    -------
    loss : float
        Mean ``-y log p - (1 - y) log(1 - p)`` in nats, ``p = sigmoid(z)``, computed as
        ``softplus(z) - y z`` (no overflow, no log of 0).
    grad_W : float32 [D, 1]
    grad_b : float32 [1]

    Raises
    ------
    ValueError
        If ``emb`` is empty, shapes disagree or K != 1.

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
    """The head's loss and gradient: :func:`binary_cross_entropy` when K = 1, else :func:`cross_entropy`.

    Parameters and returns as those two functions (``W`` float32 [D, K], ``labels`` int64 [N]).
    """
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
    """One in-place SGD step on the head, with the optional FedProx proximal term.

    ``W -= lr * (grad_W + mu * (W - W0))`` (and the same for ``b``).

    Parameters
    ----------
    W : float32 [D, K], updated in place.
    b : float32 [K], updated in place.
    grad_W : float32 [D, K]
    grad_b : float32 [K]
    lr : float
        Learning rate.
    prox_mu : float
        FedProx proximal coefficient mu (0 = plain SGD).
    W0, b0 : float32 [D, K], [K]
        The global head the round started from (required when ``prox_mu > 0``).

    Raises
    ------
    ValueError
        If ``prox_mu > 0`` and no ``W0``/``b0`` is given.

    Source: FedProx local objective, Li et al. 2020, "Federated Optimization in Heterogeneous
    Networks", eq. (2).
    """
    if prox_mu > 0.0:
        if W0 is None or b0 is None:
            raise ValueError("sgd_step: prox_mu > 0 needs the round's starting head W0, b0")
        W -= np.float32(lr) * (grad_W + np.float32(prox_mu) * (W - W0))
        b -= np.float32(lr) * (grad_b + np.float32(prox_mu) * (b - b0))
    else:
        W -= np.float32(lr) * grad_W
        b -= np.float32(lr) * grad_b


def personal_columns(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """The head columns a device may personalise: the classes it has had a label for.

    Parameters
    ----------
    labels : integer array [N]
        Labels the device has had (values outside the head's range are ignored).
    num_classes : int
        K (1 = logistic head, labels 0/1).

    Returns
    -------
    bool [K]
        True for class ``k`` when some label equals ``k``. For a logistic head (K = 1) the one
        column separates class 0 from class 1, so it is True only when both have been seen.
    """
    y = np.asarray(labels).astype(np.int64, copy=False)
    y = y[check_labels(y, num_classes)]
    counts = np.bincount(y, minlength=label_range(num_classes))
    if num_classes == 1:
        return np.array([bool(counts[0] > 0 and counts[1] > 0)])
    seen: np.ndarray = counts > 0
    return seen


def restricted_logit_scale(columns: np.ndarray, alpha: float) -> F32 | None:
    """The personal step's logit scale: 1 for the classes a device may personalise, ``alpha`` for the rest.

    A device that has labels for some classes only sees every one of its samples labelled with
    one of them; plain softmax training then raises those classes' scores above every other
    class everywhere (the other classes are never the answer on its data), and the device stops
    predicting the classes it has no labels for even where the fleet's head recognises them.
    FedRS's restricted softmax scales the absent classes' logits by ``alpha`` inside the local
    loss (0: they count as a constant logit 0; 1: plain softmax), so the labelled classes are
    fitted against each other rather than pushed above the absent ones. Prediction uses the
    unscaled logits.

    Parameters
    ----------
    columns : bool [K]
        Classes the device may personalise (:func:`personal_columns`).
    alpha : float
        Scale of the other classes' logits in the loss, 0..1.

    Returns
    -------
    float32 [K] or None
        None when every class is personal or ``alpha`` is 1 (the plain softmax).

    Raises
    ------
    ValueError
        If ``alpha`` is outside 0..1.

    Source: X.-C. Li, D.-C. Zhan, "FedRS: Federated Learning with Restricted Softmax for Label
    Distribution Non-IID Data", KDD 2021, §4 (the scaled logits of missing classes).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"restricted_logit_scale: alpha = {alpha} must be in 0..1")
    if columns.all() or alpha == 1.0:
        return None
    scale: F32 = np.where(columns, np.float32(1.0), np.float32(alpha)).astype(np.float32)
    return scale


def ditto_step(
    W: F32,
    b: F32,
    grad_W: F32,
    grad_b: F32,
    lr: float,
    lam: float,
    W_global: F32,
    b_global: F32,
    columns: np.ndarray,
) -> None:
    """One in-place class-restricted proximal step on a personal head.

    For the classes in ``columns``: ``W[:, k] -= lr * (grad_W[:, k] + lam * (W[:, k] - W_global[:, k]))``
    (and the same for ``b[k]``); every other column is set equal to the global head's. A device
    with labels for some classes only thus never moves the scores of classes it has no evidence
    about (their logits stay the global head's, so a later label of such a class is still recognised
    as well as the fleet recognises it), while the classes it knows are fitted to its own data
    with a pull ``lam`` toward the global head.

    Parameters
    ----------
    W : float32 [D, K]
        The personal head's weights, updated in place.
    b : float32 [K]
        The personal head's biases, updated in place.
    grad_W : float32 [D, K]
        Gradient of the local loss with respect to ``W`` (the personal head's).
    grad_b : float32 [K]
    lr : float
        Learning rate (> 0).
    lam : float
        Proximal coefficient lambda (>= 0): 0 = local training alone; large = the global head.
    W_global, b_global : float32 [D, K], [K]
        The global head the device last applied.
    columns : bool [K]
        Classes the device may personalise (:func:`personal_columns`).

    Raises
    ------
    ValueError
        If shapes disagree, ``lr <= 0`` or ``lam < 0``.

    Source: Ditto's personal objective ``min_v F_k(v) + lam/2 ||v - w*||^2`` and its local update,
    T. Li, S. Hu, A. Beirami, V. Smith, "Ditto: Fair and Robust Federated Learning Through
    Personalization", ICML 2021, Algorithm 1; restricted to the device's labelled classes here.
    """
    K = W.shape[1]
    if (
        W.shape != W_global.shape
        or grad_W.shape != W.shape
        or b.shape != (K,)
        or grad_b.shape != (K,)
        or b_global.shape != (K,)
        or columns.shape != (K,)
    ):
        raise ValueError(
            f"ditto_step: W {W.shape}, grad_W {grad_W.shape}, W_global {W_global.shape}, "
            f"b {b.shape}, columns {columns.shape}"
        )
    if lr <= 0 or lam < 0:
        raise ValueError(f"ditto_step: lr = {lr} must be > 0 and lam = {lam} >= 0")
    ditto_update(W, b, grad_W.copy(), grad_b.copy(), np.float32(lr), np.float32(lam), W_global, b_global,
                 None if columns.all() else ~columns)  # fmt: skip


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
    """:func:`ditto_step` without its checks, writing over the gradient (the trainer's inner loop).

    Parameters as :func:`ditto_step`, except: ``grad_W``/``grad_b`` are scratch (overwritten),
    ``lr``/``lam`` are float32 scalars, and ``tied`` is the bool [K] complement of ``columns`` or
    None when every column is personal. No heap beyond numpy's scalars: the step's only arrays
    are the personal head and its gradient.
    """
    # every column stepped (whole-array operations, no gather), then the tied ones overwritten:
    # the same values as stepping the personal columns alone. W - lr (g + lam (W - Wg)) is
    # (1 - lr lam) W - lr g + lr lam Wg, in place: no temporary head (the gradient's buffer takes
    # lr lam Wg once the step no longer needs it); lam 0 is plain SGD
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
