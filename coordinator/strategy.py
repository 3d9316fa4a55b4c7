"""Aggregation strategies: how the coordinator turns devices' updates into the next global head.

The maths lives in pure numpy functions tested on hand-checkable arrays (``weighted_mean``,
``server_momentum``, ``adam_moments``, ``yogi_moments``, ``adaptive_step``, ``coordinate_median``,
``trimmed_mean``, ``sample_clients``); ``Strategy`` subclasses wire them to the round
(``configure_round``, ``aggregate``), as Flower does.

Two ways in for the coordinator:

* streaming strategies (``needs_all_updates = False``: FedAvg, FedProx, FedAvgM, FedAdam, FedYogi)
  get the round's weighted mean, folded one update at a time (``RunningWeightedSum``, O(model)
  memory), through ``aggregate(W, b, mean_dW, mean_db)``;
* robust strategies (``needs_all_updates = True``: median, trimmed mean) must see every update, so
  the coordinator holds at most ``max_updates`` of them and calls
  ``aggregate_updates(W, b, deltas_W, deltas_b, num_examples)``. Every strategy implements
  ``aggregate_updates``, so a coordinator that keeps all updates may always call it.

The asynchronous FedBuff strategy (``asynchronous = True``) lives in ``coordinator/fedbuff.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from edgefl.types import F32


def weighted_mean(deltas: Sequence[F32], num_examples: Sequence[int]) -> F32:
    """Mean of arrays weighted by example counts: ``sum_k n_k * d_k / sum_k n_k``.

    Parameters
    ----------
    deltas : sequence of float32 arrays
        All the same shape.
    num_examples : sequence of int
        Example counts (> 0), same length.

    Returns
    -------
    float32 array of that shape (accumulated in float64).

    Raises
    ------
    ValueError
        If empty, lengths differ, shapes differ, or a weight is not positive.

    Source: FedAvg server update, McMahan et al. 2017, Algorithm 1.
    """
    if not deltas or len(deltas) != len(num_examples):
        raise ValueError(f"weighted_mean: {len(deltas)} deltas, {len(num_examples)} weights")
    acc = RunningWeightedSum(deltas[0].shape)
    for d, n in zip(deltas, num_examples, strict=True):
        acc.add(d, n)
    return acc.mean()


class RunningWeightedSum:
    """A weighted sum folded one update at a time, so memory is O(model), not O(devices x model).

    Parameters
    ----------
    shape : tuple of int
        Shape of every array added.
    """

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self._sum = np.zeros(shape, dtype=np.float64)
        self.total_weight = 0

    def add(self, delta: F32, weight: int) -> None:
        """Fold ``weight * delta`` into the sum.

        Raises
        ------
        ValueError
            If ``delta.shape`` differs from ``shape`` or ``weight <= 0``.
        """
        if delta.shape != self.shape:
            raise ValueError(f"RunningWeightedSum: shape {delta.shape}, expected {self.shape}")
        if weight <= 0:
            raise ValueError(f"RunningWeightedSum: weight {weight} must be > 0")
        self._sum += np.float64(weight) * delta
        self.total_weight += weight

    def mean(self) -> F32:
        """Return the weighted mean so far, float32 of ``shape``.

        Raises
        ------
        ValueError
            If nothing was added.
        """
        if self.total_weight == 0:
            raise ValueError("RunningWeightedSum: no update added")
        out: F32 = (self._sum / self.total_weight).astype(np.float32)
        return out


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

    Parameters
    ----------
    m : float32 array
        Previous first moment (0 at first).
    v : float32 array, same shape
        Previous second moment (``tau^2`` at first).
    delta : float32 array, same shape
        The round's weighted-mean delta.
    beta1 : float in [0, 1)
        First-moment decay.
    beta2 : float in [0, 1)
        Second-moment decay.

    Returns
    -------
    (m, v) : float32 arrays (``v`` stays >= 0 when it starts >= 0).

    Source: Reddi et al. 2021, Algorithm 2 (FedYogi); Zaheer et al. 2018 (Yogi).
    """
    d = delta.astype(np.float32)
    d2 = d * d
    m1: F32 = (np.float32(beta1) * m + np.float32(1.0 - beta1) * d).astype(np.float32)
    v1: F32 = (v - np.float32(1.0 - beta2) * d2 * np.sign(v - d2)).astype(np.float32)
    return m1, v1


def adaptive_step(x: F32, m: F32, v: F32, server_lr: float, tau: float) -> F32:
    """Server step of FedAdagrad/FedAdam/FedYogi: ``x + eta * m / (sqrt(v) + tau)``.

    Parameters
    ----------
    x : float32 array
        Current global parameters.
    m : float32 array, same shape
        First moment after this round.
    v : float32 array, same shape
        Second moment after this round.
    server_lr : float
        Server learning rate eta.
    tau : float
        Adaptivity (> 0): larger tau makes the step closer to server momentum SGD.

    Returns
    -------
    float32 array: the new parameters.

    Source: Reddi et al. 2021, Algorithm 2, line ``x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)``.
    """
    out: F32 = (x + np.float32(server_lr) * m / (np.sqrt(v) + np.float32(tau))).astype(np.float32)
    return out


def _stack(deltas: Sequence[F32], where: str) -> npt.NDArray[np.float64]:
    if not deltas:
        raise ValueError(f"{where}: no update")
    shape = deltas[0].shape
    for d in deltas:
        if d.shape != shape:
            raise ValueError(f"{where}: shape {d.shape}, expected {shape}")
    return np.stack([d.astype(np.float64) for d in deltas])


def coordinate_median(deltas: Sequence[F32]) -> F32:
    """Coordinate-wise median of the updates (unweighted; the mean of the two middle values when even).

    Parameters
    ----------
    deltas : sequence of float32 arrays
        The m updates, all the same shape.

    Returns
    -------
    float32 array of that shape.

    Raises
    ------
    ValueError
        If empty or the shapes differ.

    Source: Yin, Chen, Ramchandran, Bartlett 2018, "Byzantine-Robust Distributed Learning: Towards
    Optimal Statistical Rates", Definition 1 (coordinate-wise median).
    """
    out: F32 = np.median(_stack(deltas, "coordinate_median"), axis=0).astype(np.float32)
    return out


def trimmed_mean(deltas: Sequence[F32], beta: float) -> F32:
    """Coordinate-wise trimmed mean: per coordinate, drop the ``floor(beta m)`` largest and smallest values.

    Parameters
    ----------
    deltas : sequence of float32 arrays
        The m updates, all the same shape.
    beta : float in [0, 0.5)
        Fraction trimmed from each end (``beta = 0`` is the plain mean).

    Returns
    -------
    float32 array of that shape: the mean of the ``m - 2 floor(beta m)`` remaining values.

    Raises
    ------
    ValueError
        If empty, the shapes differ, or ``beta`` is outside [0, 0.5).

    Source: Yin et al. 2018, Definition 2 (coordinate-wise beta-trimmed mean).
    """
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"trimmed_mean: beta = {beta}: must be in [0, 0.5)")
    x = np.sort(_stack(deltas, "trimmed_mean"), axis=0)
    k = math.floor(beta * x.shape[0])
    out: F32 = x[k : x.shape[0] - k].mean(axis=0).astype(np.float32)
    return out


def sample_clients(
    available: Sequence[str], fraction: float, min_clients: int, rng: np.random.Generator
) -> tuple[str, ...]:
    """Choose the devices of a round: ``max(min_clients, ceil(fraction * n))`` of ``n``, without replacement.

    Parameters
    ----------
    available : sequence of str
        Device ids that are online and ready (order does not matter: they are sorted first, so the
        choice depends only on the set and the generator).
    fraction : float in (0, 1]
        Share of the available devices asked to train.
    min_clients : int >= 1
        Lower bound on the number chosen (capped at ``n``).
    rng : numpy.random.Generator
        Source of the choice.

    Returns
    -------
    tuple of str, sorted; all of ``available`` when ``fraction == 1`` or ``n <= min_clients``.

    Raises
    ------
    ValueError
        If ``fraction`` is outside (0, 1] or ``min_clients < 1``.

    Source: client sampling of FedAvg, McMahan et al. 2017, Algorithm 1 (``m = max(C K, 1)``).
    """
    if not 0.0 < fraction <= 1.0 or min_clients < 1:
        raise ValueError(f"sample_clients: fraction = {fraction}, min_clients = {min_clients}")
    pool = sorted(set(available))
    k = min(len(pool), max(min_clients, math.ceil(fraction * len(pool) - 1e-9)))
    if k == len(pool):
        return tuple(pool)
    chosen = rng.choice(len(pool), size=k, replace=False)
    return tuple(sorted(pool[int(i)] for i in chosen))


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """What ``configure_round`` decides for one round (sent in the RoundAnnouncement).

    Attributes
    ----------
    local_epochs : int
    lr : float
        Client SGD learning rate.
    batch_size : int
    min_clients : int
        Updates that close the round early.
    deadline_s : float
        Seconds the round stays open.
    prox_mu : float
        FedProx proximal coefficient for the clients (0 = none).
    """

    local_epochs: int
    lr: float
    batch_size: int
    min_clients: int
    deadline_s: float
    prox_mu: float = 0.0


class Strategy:
    """Base of aggregation strategies: FedAvg with a server learning rate.

    Parameters
    ----------
    local_epochs, lr, batch_size : client training settings sent with each round.
    min_clients : int
        Updates that close a round early (before the deadline); also the least number of devices
        ``sample_clients`` chooses.
    deadline_s : float
        Seconds a round stays open.
    server_lr : float
        Server learning rate eta: ``global += eta * mean(delta)`` (1.0 = plain FedAvg).
    fraction : float in (0, 1]
        Share of the available devices asked to train each round (``sample_clients``).
    seed : int
        Seed of the client sampling (the choice of round r depends only on ``seed``, ``r`` and the
        set of available devices, so a restarted coordinator repeats it).

    Attributes
    ----------
    needs_all_updates : bool
        False: the coordinator streams updates into a weighted mean and calls ``aggregate``.
    asynchronous : bool
        False: synchronous rounds.

    Source: McMahan et al. 2017 (FedAvg); server learning rate as in Reddi et al. 2021, Algorithm 1.
    """

    name = "fedavg"
    needs_all_updates = False
    asynchronous = False

    def __init__(
        self,
        *,
        local_epochs: int = 2,
        lr: float = 0.1,
        batch_size: int = 32,
        min_clients: int = 2,
        deadline_s: float = 30.0,
        server_lr: float = 1.0,
        fraction: float = 1.0,
        seed: int = 0,
    ) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction = {fraction}: must be in (0, 1]")
        self.local_epochs = local_epochs
        self.lr = lr
        self.batch_size = batch_size
        self.min_clients = min_clients
        self.deadline_s = deadline_s
        self.server_lr = server_lr
        self.fraction = fraction
        self.seed = seed

    def configure_round(self, round_no: int) -> RoundConfig:
        """Return the settings of round ``round_no`` (the same every round for FedAvg)."""
        return RoundConfig(self.local_epochs, self.lr, self.batch_size, self.min_clients, self.deadline_s)

    def sample_clients(self, available: Sequence[str], round_no: int) -> tuple[str, ...]:
        """Devices asked to train in round ``round_no`` (see the function ``sample_clients``).

        Parameters
        ----------
        available : sequence of str
            Ready device ids.
        round_no : int
            The round (seeds the choice).

        Returns
        -------
        Sorted tuple of device ids (empty if none is available).
        """
        if not available:
            return ()
        rng = np.random.default_rng([self.seed, round_no])
        return sample_clients(available, self.fraction, self.min_clients, rng)

    def aggregate(self, W: F32, b: F32, mean_dW: F32, mean_db: F32) -> tuple[F32, F32]:
        """Apply the round's weighted-mean update to the global head.

        Parameters
        ----------
        W : float32 [D, K]
            Current global weights.
        b : float32 [K]
            Current global biases.
        mean_dW : float32 [D, K]
            Weighted mean of the round's weight deltas.
        mean_db : float32 [K]
            Weighted mean of the round's bias deltas.

        Returns
        -------
        New (W, b), float32.
        """
        eta = np.float32(self.server_lr)
        return (W + eta * mean_dW).astype(np.float32), (b + eta * mean_db).astype(np.float32)

    def aggregate_updates(
        self, W: F32, b: F32, deltas_W: Sequence[F32], deltas_b: Sequence[F32], num_examples: Sequence[int]
    ) -> tuple[F32, F32]:
        """Aggregate a round from all its updates (the streaming strategies reduce to ``aggregate``).

        Parameters
        ----------
        W : float32 [D, K]
            Current global weights.
        b : float32 [K]
            Current global biases.
        deltas_W : sequence of float32 [D, K]
            The updates' weight deltas.
        deltas_b : sequence of float32 [K]
            The updates' bias deltas (same length).
        num_examples : sequence of int > 0
            Example counts of the updates (same length).

        Returns
        -------
        New (W, b), float32.

        Raises
        ------
        ValueError
            If the sequences are empty or of different lengths, or shapes differ.
        """
        mean_dW = weighted_mean(deltas_W, num_examples)
        return self.aggregate(W, b, mean_dW, weighted_mean(deltas_b, num_examples))


FedAvg = Strategy


class FedProx(Strategy):
    """FedAvg whose clients add the proximal term ``mu/2 ||w - w_global||^2`` to their local loss.

    Parameters
    ----------
    prox_mu : float >= 0
        Proximal coefficient mu, sent to the devices in ``RoundConfig.prox_mu`` (RoundAnnouncement
        ``prox_mu``); the server side is FedAvg's.
    **kwargs
        As ``Strategy``.

    Source: Li et al. 2020, "Federated Optimization in Heterogeneous Networks", eq. (2).
    """

    name = "fedprox"

    def __init__(self, *, prox_mu: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if prox_mu < 0:
            raise ValueError(f"prox_mu = {prox_mu}: must be >= 0")
        self.prox_mu = prox_mu

    def configure_round(self, round_no: int) -> RoundConfig:
        """FedAvg's settings plus ``prox_mu``."""
        return replace(super().configure_round(round_no), prox_mu=self.prox_mu)


class FedAvgM(Strategy):
    """FedAvg with server momentum: ``v = beta v + mean(delta)``, ``W += server_lr * v``.

    Parameters
    ----------
    server_momentum : float in [0, 1)
        beta (0.9 in Hsu et al. 2019).
    **kwargs
        As ``Strategy`` (``server_lr`` defaults to 1.0).

    Source: Hsu et al. 2019 (FedAvgM).
    """

    name = "fedavgm"

    def __init__(self, *, server_momentum: float = 0.9, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= server_momentum < 1.0:
            raise ValueError(f"server_momentum = {server_momentum}: must be in [0, 1)")
        self.beta = server_momentum
        self.v_W: F32 | None = None
        self.v_b: F32 | None = None

    def aggregate(self, W: F32, b: F32, mean_dW: F32, mean_db: F32) -> tuple[F32, F32]:
        """Fold the round's mean delta into the momentum buffers and step the head along them."""
        self.v_W = server_momentum(self.v_W, mean_dW, self.beta)
        self.v_b = server_momentum(self.v_b, mean_db, self.beta)
        eta = np.float32(self.server_lr)
        return (W + eta * self.v_W).astype(np.float32), (b + eta * self.v_b).astype(np.float32)


class FedAdam(Strategy):
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
        self._moments: dict[str, tuple[F32, F32]] = {}

    def _moments_of(self, name: str, delta: F32) -> tuple[F32, F32]:
        return self._moments.get(
            name, (np.zeros_like(delta, dtype=np.float32), np.full_like(delta, self.tau**2, dtype=np.float32))
        )

    def _update(self, m: F32, v: F32, delta: F32) -> tuple[F32, F32]:
        return adam_moments(m, v, delta, self.beta1, self.beta2)

    def aggregate(self, W: F32, b: F32, mean_dW: F32, mean_db: F32) -> tuple[F32, F32]:
        """Update the moments with the round's mean delta and take the adaptive server step."""
        out = []
        for name, x, d in (("W", W, mean_dW), ("b", b, mean_db)):
            m, v = self._update(*self._moments_of(name, d), d)
            self._moments[name] = (m, v)
            out.append(adaptive_step(x, m, v, self.server_lr, self.tau))
        return out[0], out[1]


class FedYogi(FedAdam):
    """Server-side Yogi: FedAdam with Yogi's additive second-moment update.

    Parameters
    ----------
    As ``FedAdam``.

    Source: Reddi et al. 2021, Algorithm 2 (FedYogi).
    """

    name = "fedyogi"

    def _update(self, m: F32, v: F32, delta: F32) -> tuple[F32, F32]:
        return yogi_moments(m, v, delta, self.beta1, self.beta2)


class _Robust(Strategy):
    """Strategies that need every update of a round at once (bounded by ``max_updates``).

    Parameters
    ----------
    max_updates : int
        Most updates the coordinator may hold for one round (it closes the round, or refuses
        more, at this count): memory is O(max_updates x model).
    **kwargs
        As ``Strategy``.
    """

    needs_all_updates = True

    def __init__(self, *, max_updates: int = 64, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if max_updates < 1:
            raise ValueError(f"max_updates = {max_updates}: must be >= 1")
        self.max_updates = max_updates

    def aggregate(self, W: F32, b: F32, mean_dW: F32, mean_db: F32) -> tuple[F32, F32]:
        """Not available: a robust rule cannot be computed from the mean.

        Raises
        ------
        TypeError
            Always: call ``aggregate_updates`` with every update of the round.
        """
        raise TypeError(f"strategy {self.name} needs all updates: call aggregate_updates()")

    def _combine(self, deltas: Sequence[F32]) -> F32:
        """The robust rule itself (coordinate-wise median, trimmed mean), defined by each subclass.

        Raises
        ------
        NotImplementedError
            On this abstract base (only ``Median`` and ``TrimmedMean`` are instantiated).
        """
        raise NotImplementedError(f"{type(self).__name__} defines no robust rule")

    def aggregate_updates(
        self, W: F32, b: F32, deltas_W: Sequence[F32], deltas_b: Sequence[F32], num_examples: Sequence[int]
    ) -> tuple[F32, F32]:
        """Robust combination of the deltas (``num_examples`` is checked but not used as a weight).

        A device's claimed example count is not weighed: it would let one device with a large
        claim dominate, which is what robust aggregation guards against (Yin et al. 2018 weigh all
        machines alike).

        Raises
        ------
        ValueError
            If empty, lengths differ, shapes differ, or more than ``max_updates`` updates are given.
        """
        if not (len(deltas_W) == len(deltas_b) == len(num_examples)) or not deltas_W:
            raise ValueError(
                f"{self.name}: {len(deltas_W)} W, {len(deltas_b)} b, {len(num_examples)} weights"
            )
        if len(deltas_W) > self.max_updates:
            raise ValueError(f"{self.name}: {len(deltas_W)} updates > max_updates = {self.max_updates}")
        eta = np.float32(self.server_lr)
        W1: F32 = (W + eta * self._combine(deltas_W)).astype(np.float32)
        b1: F32 = (b + eta * self._combine(deltas_b)).astype(np.float32)
        return W1, b1


class Median(_Robust):
    """Coordinate-wise median of the round's deltas (see ``coordinate_median``).

    Source: Yin et al. 2018, Definition 1.
    """

    name = "median"

    def _combine(self, deltas: Sequence[F32]) -> F32:
        return coordinate_median(deltas)


class TrimmedMean(_Robust):
    """Coordinate-wise trimmed mean of the round's deltas (see ``trimmed_mean``).

    Parameters
    ----------
    trim_fraction : float in [0, 0.5)
        beta: fraction dropped at each end per coordinate.
    **kwargs
        As ``_Robust``.

    Source: Yin et al. 2018, Definition 2.
    """

    name = "trimmed-mean"

    def __init__(self, *, trim_fraction: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= trim_fraction < 0.5:
            raise ValueError(f"trim_fraction = {trim_fraction}: must be in [0, 0.5)")
        self.trim_fraction = trim_fraction

    def _combine(self, deltas: Sequence[F32]) -> F32:
        return trimmed_mean(deltas, self.trim_fraction)


STRATEGY_NAMES = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "median", "trimmed-mean", "fedbuff")


def make_strategy(name: str, **kwargs: Any) -> Strategy:
    """Build a strategy by name.

    Parameters
    ----------
    name : str
        One of ``STRATEGY_NAMES``: fedavg | fedprox | fedavgm | fedadam | fedyogi | median |
        trimmed-mean | fedbuff.
    **kwargs
        Passed to the class (``Strategy``'s settings plus the strategy's own, e.g. ``prox_mu``,
        ``server_momentum``, ``tau``, ``trim_fraction``, ``buffer_size``).

    Returns
    -------
    Strategy

    Raises
    ------
    ValueError
        If the name is unknown.
    """
    from edgefl.coordinator.fedbuff import FedBuff  # fedbuff imports this module

    classes: dict[str, type[Strategy]] = {
        "fedavg": Strategy,
        "fedprox": FedProx,
        "fedavgm": FedAvgM,
        "fedadam": FedAdam,
        "fedyogi": FedYogi,
        "median": Median,
        "trimmed-mean": TrimmedMean,
        "fedbuff": FedBuff,
    }
    cls = classes.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGY_NAMES)}")
    return cls(**kwargs)
