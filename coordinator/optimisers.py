"""Server optimisers of the FedAvg family: momentum (FedAvgM) and adaptive steps (FedAdam, FedYogi), bounded.

Each changes only FedAvg's server step (``FedAvg.step``), treating the round's mean delta as a
pseudo-gradient, bounded per coordinate by ``bound_coordinates`` so a clipped hostile direction is
neither carried nor amplified (``docs/security.md``, "Norm bound").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.normbound import clip_factor, scale_delta, update_norm
from edgefl.types import F32

COORDINATE_FACTOR = 2.0
"""FedAvg steps a momentum or adaptive server step may take in any coordinate (``docs/benchmarks.md``)."""


def server_momentum(momentum: F32 | None, mean_delta: F32, beta: float) -> F32:
    """Server momentum buffer of FedAvgM: ``v = beta * v + mean_delta`` (``v = mean_delta`` at first).

    ``momentum``: the previous buffer (float32, None before the first round); ``mean_delta``: the
    round's mean delta (local - global), same shape; ``beta`` in [0, 1). Returns the new float32
    buffer. Raises ValueError if ``beta`` is outside [0, 1) or the shapes differ.

    Source: Hsu, Qi, Brown 2019, "Measuring the Effects of Non-Identical Data Distribution for
    Federated Visual Classification", §3 (FedAvgM), with Delta = local - global (sign ``+``).
    """
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"server_momentum: beta = {beta}: must be in [0, 1)")
    if momentum is None:
        return mean_delta.astype(np.float32, copy=True)
    if momentum.shape != mean_delta.shape:
        raise ValueError(f"server_momentum: momentum {momentum.shape}, delta {mean_delta.shape}")
    out: F32 = (np.float32(beta) * momentum + mean_delta).astype(np.float32)
    return out


def adam_moments(m: F32, v: F32, delta: F32, beta1: float, beta2: float) -> tuple[F32, F32]:
    """FedAdam moment estimates: ``m = b1 m + (1-b1) d``, ``v = b2 v + (1-b2) d^2``.

    ``m``, ``v``: the previous round's moments (0 and ``tau^2`` at first); ``delta``: the round's mean
    delta; all float32 of one shape; ``beta1``, ``beta2`` in [0, 1). Returns the new float32 (m, v).

    Source: Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2 (FedAdam), no bias
    correction (as in the paper).
    """
    d = delta.astype(np.float32)
    m1: F32 = (np.float32(beta1) * m + np.float32(1.0 - beta1) * d).astype(np.float32)
    v1: F32 = (np.float32(beta2) * v + np.float32(1.0 - beta2) * d * d).astype(np.float32)
    return m1, v1


def yogi_moments(m: F32, v: F32, delta: F32, beta1: float, beta2: float) -> tuple[F32, F32]:
    """FedYogi moment estimates: ``m`` as Adam, ``v = v - (1-b2) d^2 sign(v - d^2)``.

    Parameters and returns as ``adam_moments`` (``v`` stays >= 0 when it starts >= 0).

    Source: Reddi et al. 2021, Algorithm 2 (FedYogi); Zaheer et al. 2018 (Yogi).
    """
    d = delta.astype(np.float32)
    d2 = d * d
    m1: F32 = (np.float32(beta1) * m + np.float32(1.0 - beta1) * d).astype(np.float32)
    v1: F32 = (v - np.float32(1.0 - beta2) * d2 * np.sign(v - d2)).astype(np.float32)
    return m1, v1


def adaptive_step(m: F32, v: F32, server_lr: float, tau: float) -> F32:
    """Server step of FedAdagrad/FedAdam/FedYogi: ``eta * m / (sqrt(v) + tau)``.

    ``m``, ``v``: this round's moments (float32, one shape); ``server_lr`` eta; ``tau`` > 0 the
    adaptivity. Returns the float32 step added to the global parameters.

    Source: Reddi et al. 2021, Algorithm 2, line ``x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)``.
    """
    out: F32 = (np.float32(server_lr) * m / (np.sqrt(v) + np.float32(tau))).astype(np.float32)
    return out


def bound_coordinates(step: F32, mean_delta: F32, factor: float) -> F32:
    """Clip each coordinate of a server step to ``factor x`` the round's mean delta there.

    ``|step_i| <= factor |mean_delta_i|`` (``step``, ``mean_delta`` float32 of one shape; ``factor``
    > 0): no coordinate moves further than ``factor`` FedAvg steps would. Returns float32.

    Source: AdaBound (Luo, Xiong, Liu, Sun 2019, ICLR), with the bound set by the round's own FedAvg step.
    """
    cap = np.float32(factor) * np.abs(mean_delta)
    out: F32 = np.clip(step, -cap, cap).astype(np.float32)
    return out


def clip_step(step_W: F32, step_b: F32, bound: float) -> tuple[F32, F32]:
    """Scale a server step ``(step_W, step_b)`` down to joint L2 norm ``bound`` when it is longer.

    ``step_W`` float32 [D, K], ``step_b`` float32 [K], ``bound`` > 0 (inf: none). Returns the scaled
    float32 pair (the same arrays when within the bound).

    Source: the per-update clipping of McMahan et al. 2018 applied to the aggregate (Sun et al. 2019).
    """
    f = clip_factor(update_norm(step_W, step_b), bound)
    return scale_delta(step_W, f), scale_delta(step_b, f)


class FedAvgM(FedAvg):
    """FedAvg with server momentum: ``v = beta v + mean(delta)``, ``W += server_lr * v``, bounded.

    The buffer is bounded per coordinate by ``bound_coordinates`` (``COORDINATE_FACTOR`` x the
    round's mean delta) and kept bounded, so a direction the round does not support fades at once.

    Parameters
    ----------
    server_momentum : float in [0, 1)
        beta (0.9 in Hsu et al. 2019).
    **kwargs
        As ``Strategy`` (``server_lr`` defaults to 1.0).

    Source: Hsu et al. 2019 (FedAvgM); the per-coordinate bound as AdaBound (Luo et al. 2019), see
    ``bound_coordinates``.
    """

    name = "fedavgm"

    def __init__(self, *, server_momentum: float = 0.9, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= server_momentum < 1.0:
            raise ValueError(f"server_momentum = {server_momentum}: must be in [0, 1)")
        self.beta = server_momentum

    def step(self, W: F32, b: F32, mean_dW: F32, mean_db: F32) -> tuple[F32, F32]:
        """Fold the round's mean delta into the momentum buffers and step the head along them."""
        vW = server_momentum(self.server_state.get("v_W"), mean_dW, self.beta)
        vb = server_momentum(self.server_state.get("v_b"), mean_db, self.beta)
        vW = bound_coordinates(vW, mean_dW, COORDINATE_FACTOR)  # the buffer itself: an
        vb = bound_coordinates(vb, mean_db, COORDINATE_FACTOR)  # unsupported direction fades
        self.server_state["v_W"], self.server_state["v_b"] = vW, vb
        return super().step(W, b, vW, vb)


class FedAdam(FedAvg):
    """Server-side Adam over the rounds' mean deltas (pseudo-gradients).

    Parameters
    ----------
    server_lr : float
        eta.
    beta1, beta2 : float in [0, 1)
        Moment decay rates (0.9, 0.99 as in the paper).
    tau : float > 0
        Adaptivity; the second moment starts at ``tau^2``.
    **kwargs
        As ``Strategy``.

    Source: Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2 (FedAdam).
    """

    name = "fedadam"

    coordinate_factor = COORDINATE_FACTOR
    """FedAvg steps the adaptive step may take in any coordinate (``bound_coordinates``)."""

    def __init__(
        self,
        *,
        server_lr: float = 0.03,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        **kwargs: Any,
    ) -> None:
        super().__init__(server_lr=server_lr, **kwargs)
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and tau > 0.0):
            raise ValueError(f"beta1 = {beta1}, beta2 = {beta2}, tau = {tau}: need betas in [0, 1), tau > 0")
        self.beta1 = beta1
        self.beta2 = beta2
        self.tau = tau

    def _moments(self, m: F32, v: F32, delta: F32) -> tuple[F32, F32]:
        return adam_moments(m, v, delta, self.beta1, self.beta2)

    def step(self, W: F32, b: F32, mean_dW: F32, mean_db: F32) -> tuple[F32, F32]:
        """Update the moments with the round's mean delta and take the bounded adaptive server step."""
        out = []
        for name, x, d in (("W", W, mean_dW), ("b", b, mean_db)):
            m0 = self.server_state.get("m_" + name, np.zeros_like(d, dtype=np.float32))
            v0 = self.server_state.get("v_" + name, np.full_like(d, self.tau**2, dtype=np.float32))
            m, v = self._moments(m0, v0, d)
            self.server_state["m_" + name], self.server_state["v_" + name] = m, v
            step = bound_coordinates(adaptive_step(m, v, self.server_lr, self.tau), d, self.coordinate_factor)
            out.append((x + step).astype(np.float32))
        return out[0], out[1]


class FedYogi(FedAdam):
    """Server-side Yogi: FedAdam with Yogi's additive second-moment update (parameters as ``FedAdam``).

    Source: Reddi et al. 2021, Algorithm 2 (FedYogi).
    """

    name = "fedyogi"

    def _moments(self, m: F32, v: F32, delta: F32) -> tuple[F32, F32]:
        return yogi_moments(m, v, delta, self.beta1, self.beta2)
