"""Head helpers for tests (never shipped): the checked form of the trainer's Ditto step."""

from __future__ import annotations

import numpy as np

from edgefl.head import cross_entropy_grad_into, ditto_update
from edgefl.types import F32


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
    """:func:`edgefl.head.ditto_update` on the classes in ``columns`` (bool [K]), the gradient kept.

    ValueError if shapes disagree, ``lr`` <= 0 or ``lam`` < 0.
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
    tied = None if columns.all() else ~columns
    ditto_update(
        W, b, grad_W.copy(), grad_b.copy(), np.float32(lr), np.float32(lam), W_global, b_global, tied
    )


paired_cross_entropy_grad_into = cross_entropy_grad_into
"""The global and the personal head stacked (``[W, V]``): :func:`cross_entropy_grad_into` with H = 2."""
