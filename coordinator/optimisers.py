"""Server optimisers of the FedAvg family: momentum (FedAvgM) and adaptive steps (FedAdam, FedYogi), bounded.

Each replaces only ``FedAvg.step``, bounded per coordinate by ``bound_coordinates`` (``docs/security.md``,
"Norm bound").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.strategy import check_setting
from edgefl.types import F32

COORDINATE_FACTOR = 2.0
"""FedAvg steps a momentum or adaptive server step may take in any coordinate (``docs/benchmarks.md``)."""


def server_momentum(momentum: F32 | None, mean_delta: F32, beta: float) -> F32:
    """Server momentum buffer of FedAvgM: ``v = beta * v + mean_delta`` (``v = mean_delta`` at first).

    ``momentum`` float32 (None before the first round) and ``mean_delta`` (local - global) of one shape;
    ``beta`` in [0, 1). Returns the new float32 buffer; ValueError for another ``beta`` or shape.

    Source: Hsu, Qi, Brown 2019, §3 (FedAvgM), with Delta = local - global (sign ``+``).
    """
    check_setting(0.0 <= beta < 1.0, "server_momentum: beta", beta, "in [0, 1)")
    if momentum is None:
        return mean_delta.astype(np.float32, copy=True)
    if momentum.shape != mean_delta.shape:
        raise ValueError(f"server_momentum: momentum {momentum.shape}, delta {mean_delta.shape}")
    out: F32 = (np.float32(beta) * momentum + mean_delta).astype(np.float32)
    return out


def adam_moments(m: F32, v: F32, delta: F32, beta1: float, beta2: float) -> tuple[F32, F32]:
    """FedAdam moment estimates: ``m = b1 m + (1-b1) d``, ``v = b2 v + (1-b2) d^2``.

    ``m``, ``v`` (0 and ``tau^2`` at first) and the round's mean ``delta``: float32 of one shape;
    betas in [0, 1). Returns the new float32 (m, v).

    Source: Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2 (no bias correction).
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
    """Server step of FedAdam/FedYogi: ``eta * m / (sqrt(v) + tau)``, float32 of the moments' shape.

    Source: Reddi et al. 2021, Algorithm 2.
    """
    out: F32 = (np.float32(server_lr) * m / (np.sqrt(v) + np.float32(tau))).astype(np.float32)
    return out


def bound_coordinates(step: F32, mean_delta: F32, factor: float) -> F32:
    """Clip each coordinate of a server step: ``|step_i| <= factor |mean_delta_i|`` (float32, one shape).

    Source: AdaBound (Luo, Xiong, Liu, Sun 2019), with the bound set by the round's own FedAvg step.
    """
    cap = np.float32(factor) * np.abs(mean_delta)
    out: F32 = np.clip(step, -cap, cap).astype(np.float32)
    return out


class FedAvgM(FedAvg):
    """FedAvg with server momentum: ``v = beta v + mean(delta)``, ``W += server_lr * v``.

    The buffer is bounded per coordinate (``bound_coordinates``). ``server_momentum``: beta in [0, 1)
    (ValueError otherwise); ``kwargs`` as ``Strategy``.

    Source: Hsu et al. 2019 (FedAvgM); the bound as AdaBound (Luo et al. 2019).
    """

    name = "fedavgm"

    def __init__(self, *, server_momentum: float = 0.9, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_setting(0.0 <= server_momentum < 1.0, "server_momentum", server_momentum, "in [0, 1)")
        self.beta = server_momentum

    def _move(self, name: str, x: F32, mean_delta: F32) -> F32:
        """Fold the round's mean delta into the momentum buffer ``v_<name>``; step the array along it."""
        v = server_momentum(self.server_state.get("v_" + name), mean_delta, self.beta)
        # the buffer itself is bounded: a direction the round does not support fades
        v = bound_coordinates(v, mean_delta, COORDINATE_FACTOR)
        self.server_state["v_" + name] = v
        return super()._move(name, x, v)


class FedAdam(FedAvg):
    """Server-side Adam over the rounds' mean deltas (pseudo-gradients).

    ``server_lr`` eta (0.03); ``beta1``, ``beta2`` in [0, 1); ``tau`` > 0, the adaptivity (the second moment
    starts at ``tau^2``); ValueError otherwise. ``kwargs`` as ``Strategy``.

    Source: Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2 (FedAdam).
    """

    name = "fedadam"

    def __init__(self, *, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(**{"server_lr": 0.03, **kwargs})  # a smaller server step than FedAvg's
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and tau > 0.0):
            raise ValueError(f"beta1 = {beta1}, beta2 = {beta2}, tau = {tau}: need betas in [0, 1), tau > 0")
        self.beta1 = beta1
        self.beta2 = beta2
        self.tau = tau

    def _moments(self, m: F32, v: F32, delta: F32) -> tuple[F32, F32]:
        return adam_moments(m, v, delta, self.beta1, self.beta2)

    def _move(self, name: str, x: F32, mean_delta: F32) -> F32:
        """Update the moments ``m_<name>``, ``v_<name>``; take the bounded adaptive server step."""
        m0 = self.server_state.get("m_" + name, np.zeros_like(mean_delta, dtype=np.float32))
        v0 = self.server_state.get("v_" + name, np.full_like(mean_delta, self.tau**2, dtype=np.float32))
        m, v = self._moments(m0, v0, mean_delta)
        self.server_state["m_" + name], self.server_state["v_" + name] = m, v
        step = bound_coordinates(adaptive_step(m, v, self.server_lr, self.tau), mean_delta, COORDINATE_FACTOR)
        out: F32 = (x + step).astype(np.float32)
        return out


class FedYogi(FedAdam):
    """Server-side Yogi: FedAdam with Yogi's additive second-moment update (parameters as ``FedAdam``).

    Source: Reddi et al. 2021, Algorithm 2 (FedYogi).
    """

    name = "fedyogi"

    def _moments(self, m: F32, v: F32, delta: F32) -> tuple[F32, F32]:
        return yogi_moments(m, v, delta, self.beta1, self.beta2)
