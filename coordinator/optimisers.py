"""Server optimisers of the FedAvg family: momentum (FedAvgM) and adaptive steps (FedAdam, FedYogi), bounded.

Each treats the round's weighted-mean delta as a pseudo-gradient and changes only FedAvg's server
step (``FedAvg.step``); the step is bounded per coordinate by ``bound_coordinates`` (at most
``COORDINATE_FACTOR`` x the round's mean delta there) so a clipped hostile direction is neither
carried nor amplified round after round. The maths is in pure numpy functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.normbound import clip_factor, scale_delta, update_norm
from edgefl.types import F32

COORDINATE_FACTOR = 2.0
"""How many FedAvg steps a momentum or adaptive server step may take in any coordinate.

``bound_coordinates(step, mean_delta, COORDINATE_FACTOR)``: where a round's updates cancel (a
norm-bounded hostile update opposing the honest ones there) the server step is as short as FedAvg's,
so neither momentum nor Adam's small second moment carries or amplifies that direction; elsewhere
the step keeps up to twice FedAvg's (momentum's ``1 / (1 - beta)`` and Adam's damping of large
coordinates act within it). The step's norm is then at most twice the round's mean delta's, itself
within the per-update norm bound. Measured with ``bench/poison.py`` over six partitions
(docs/benchmarks.md, "Poisoning"): FedAvgM's worst loss under attack 0.04 (0.10 with its buffer's
norm clipped to a quarter of the bound instead), FedAdam's and FedYogi's about half of their
unbounded steps'; the clean runs gain a little."""


def server_momentum(momentum: F32 | None, mean_delta: F32, beta: float) -> F32:
    """Server momentum buffer of FedAvgM: ``v = beta * v + mean_delta`` (``v = mean_delta`` at first).

    Parameters
    ----------
    momentum : float32 array or None
        Previous buffer ``v`` (None before the first round).
    mean_delta : float32 array, same shape
        The round's weighted-mean delta (local - global, i.e. a descent direction).
    beta : float
        Momentum coefficient in [0, 1).

    Returns
    -------
    float32 array: the new buffer; the server then applies ``W += server_lr * v``.

    Raises
    ------
    ValueError
        If ``beta`` is outside [0, 1) or the shapes differ.

    Source: Hsu, Qi, Brown 2019, "Measuring the Effects of Non-Identical Data Distribution for
    Federated Visual Classification", §3 (FedAvgM): ``v <- beta v + Delta w; w <- w - v``, written
    here with Delta = local - global so the sign is ``+``.
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

    Parameters
    ----------
    m : float32 array
        First moment of the previous round (0 at first).
    v : float32 array, same shape
        Second moment of the previous round (``tau^2`` at first).
    delta : float32 array, same shape
        The round's weighted-mean delta (pseudo-gradient with the sign of a descent step).
    beta1 : float in [0, 1)
        First-moment decay.
    beta2 : float in [0, 1)
        Second-moment decay.

    Returns
    -------
    (m, v) : float32 arrays.

    Source: Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2 (FedAdam), no bias
    correction (as in the paper).
    """
    d = delta.astype(np.float32)
    m1: F32 = (np.float32(beta1) * m + np.float32(1.0 - beta1) * d).astype(np.float32)
    v1: F32 = (np.float32(beta2) * v + np.float32(1.0 - beta2) * d * d).astype(np.float32)
    return m1, v1


def yogi_moments(m: F32, v: F32, delta: F32, beta1: float, beta2: float) -> tuple[F32, F32]:
    """FedYogi moment estimates: ``m`` as Adam, ``v = v - (1-b2) d^2 sign(v - d^2)``.

    Yogi's second moment moves towards ``d^2`` by an additive step rather than a multiplicative
    one, so a sudden large delta cannot blow up the effective learning rate's denominator.

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

    Parameters
    ----------
    m : float32 array
        First moment after this round.
    v : float32 array, same shape
        Second moment after this round.
    server_lr : float
        Server learning rate eta.
    tau : float
        Adaptivity (> 0): larger tau makes the step closer to server momentum SGD.

    Returns
    -------
    float32 array: the step added to the global parameters.

    Source: Reddi et al. 2021, Algorithm 2, line ``x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)``.
    """
    out: F32 = (np.float32(server_lr) * m / (np.sqrt(v) + np.float32(tau))).astype(np.float32)
    return out


def bound_coordinates(step: F32, mean_delta: F32, factor: float) -> F32:
    """Clip each coordinate of a server step to ``factor x`` the round's mean delta there.

    ``|step_i| <= factor |mean_delta_i|``: an adaptive step then moves no coordinate further than
    ``factor`` FedAvg steps (server learning rate 1) would, so it is as short as FedAvg's where
    the round's updates cancel (where a norm-bounded hostile update opposes the honest ones).

    Parameters
    ----------
    step : float32 array
        The adaptive step (``adaptive_step``).
    mean_delta : float32 array, same shape
        The round's weighted-mean delta.
    factor : float > 0

    Returns
    -------
    float32 array of that shape.

    Source: AdaBound (Luo, Xiong, Liu, Sun 2019, "Adaptive Gradient Methods with Dynamic Bound of
    Learning Rate", ICLR), which clips each coordinate's adaptive rate to bounds set by SGD's; here
    the upper bound is set against the round's own SGD (FedAvg) step.
    """
    cap = np.float32(factor) * np.abs(mean_delta)
    out: F32 = np.clip(step, -cap, cap).astype(np.float32)
    return out


def clip_step(step_W: F32, step_b: F32, bound: float) -> tuple[F32, F32]:
    """Scale a server step ``(step_W, step_b)`` down to joint L2 norm ``bound`` when it is longer.

    A momentum or adaptive server step can be longer than any update of the round: momentum sums
    past rounds' steps (up to ``1 / (1 - beta)`` of them), and Adam divides by a second moment that
    a run of small steps shrinks. Bounding the step by the round's per-update norm bound keeps a
    clipped hostile direction from being carried and amplified round after round.

    Parameters
    ----------
    step_W : float32 [D, K]
    step_b : float32 [K]
    bound : float > 0 (``inf``: no bound)

    Returns
    -------
    (step_W, step_b) float32, the same arrays when within the bound.

    Source: norm clipping of the server update, as the per-update clipping of McMahan et al. 2018
    applied to the aggregate (Sun et al. 2019, norm difference clipping).
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
        eta = np.float32(self.server_lr)
        return (W + eta * vW).astype(np.float32), (b + eta * vb).astype(np.float32)


class FedAdam(FedAvg):
    """Server-side Adam over the rounds' mean deltas (pseudo-gradients).

    Parameters
    ----------
    server_lr : float
        eta (Reddi et al. tune it on a log grid; 10^-1.5..10^-0.5 typical for small heads).
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
    """How many FedAvg steps the adaptive step may take in any coordinate (``bound_coordinates``).

    Without it the step is nearly ``eta sign(m)`` in every coordinate in the first rounds (``v``
    starts at ``tau^2`` and gains ``(1 - beta2) d^2`` a round): coordinates where the round's
    updates cancel move as far as any, in the direction of a norm-bounded hostile update that
    outweighs the honest ones there, and the second moment, which that round raised, slows the
    way back. Where the bound binds in every coordinate FedAdam and FedYogi take the same step
    (their first moments are the same), as in ``bench/learning.py`` (40 rounds: within -0.2 to
    +1.5 points of the unbounded step's accuracy)."""

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
        """Update the moments with the round's mean delta and take the adaptive server step.

        The step is bounded per coordinate (``bound_coordinates``, ``coordinate_factor``).
        """
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
    """Server-side Yogi: FedAdam with Yogi's additive second-moment update.

    Parameters
    ----------
    As ``FedAdam``.

    Source: Reddi et al. 2021, Algorithm 2 (FedYogi).
    """

    name = "fedyogi"

    def _moments(self, m: F32, v: F32, delta: F32) -> tuple[F32, F32]:
        return yogi_moments(m, v, delta, self.beta1, self.beta2)
