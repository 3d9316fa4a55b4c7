"""Aggregation strategies: how the coordinator turns devices' updates into the next global head.

One interface, as Flower's strategies: ``configure_round`` (settings of a round, and a fresh
accumulator), ``offer`` (one update, checked, norm-bounded and folded in) and ``aggregate`` (the next
head). Each strategy owns its accumulator: a weighted running sum for the FedAvg family (O(model)
memory), the round's updates for the robust rules (at most ``max_updates``), a staleness-weighted sum
for FedBuff (``coordinator/fedbuff.py``), a clipped sum for the DP wrapper (``coordinator/privacy.py``).
The service never looks at a strategy's type: ``RoundConfig.schedule`` says whether a round is
synchronous or a buffered-asynchronous step.

Robust by default: every update's joint L2 norm is bounded before it is folded in (``NormBound``:
a fixed bound, or ``multiplier x`` the running median norm of the round), and a clipped update is
counted by device. The maths lives in pure numpy functions tested on hand-checkable arrays.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from edgefl.errors import UpdateRejected
from edgefl.head import validate_head
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


MAX_UPDATE_EXAMPLES = 1_000_000
"""Most examples one update may claim (``num_examples``; more is refused as ``bad_value``).

An agent trains on its embedding store (``store_capacity``, 4,096 by default): a million
1,280-float embeddings is 5 GB, beyond any 256 MB gateway. It also caps a site's ``weight`` at the
root: at most ``count x MAX_UPDATE_EXAMPLES`` (a site cannot outweigh the others by its claim)."""


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
        self.total_weight: float = 0

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

    def add_sum(self, weighted_sum: npt.NDArray[np.float64], weight: float) -> None:
        """Fold another accumulator's float64 sum and total weight in (a site's partial at the root).

        Adding float64 sums is the same sum as folding their updates one by one, up to the order of
        float64 additions (relative error ~1e-16, far below the float32 mean's resolution).

        Raises
        ------
        ValueError
            If the shape differs or ``weight <= 0``.
        """
        if weighted_sum.shape != self.shape:
            raise ValueError(f"RunningWeightedSum: shape {weighted_sum.shape}, expected {self.shape}")
        if not weight > 0:
            raise ValueError(f"RunningWeightedSum: weight {weight} must be > 0")
        self._sum += weighted_sum
        self.total_weight += weight

    def fits(self, weighted_sum: npt.NDArray[np.float64], weight: float) -> bool:
        """Whether :meth:`add_sum` of these would keep the sum and the total weight finite (float64)."""
        with np.errstate(over="ignore", invalid="ignore"):
            total = self._sum + weighted_sum
        return bool(np.isfinite(total).all()) and math.isfinite(self.total_weight + weight)

    @property
    def sum(self) -> npt.NDArray[np.float64]:
        """A copy of the float64 weighted sum so far (shape ``shape``)."""
        return self._sum.copy()

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


def trimmed_minimum(beta: float, tolerate: int) -> int:
    """Fewest updates ``n`` for which a beta-trimmed mean drops ``tolerate`` values at each end.

    Parameters
    ----------
    beta : float in (0, 0.5)
        Trimmed fraction at each end (``trimmed_mean``).
    tolerate : int >= 0
        Hostile values to withstand per coordinate.

    Returns
    -------
    int: the least ``n >= 2 tolerate + 1`` with ``floor(beta n) >= tolerate`` (1 when ``tolerate = 0``).

    Raises
    ------
    ValueError
        If ``tolerate > 0`` and ``beta`` is outside (0, 0.5).

    Source: Yin et al. 2018, Definition 2 (``floor(beta m)`` values trimmed at each end).
    """
    if tolerate <= 0:
        return 1
    if not 0.0 < beta < 0.5:
        raise ValueError(f"trimmed_minimum: beta = {beta}: must be in (0, 0.5) to tolerate {tolerate}")
    n = max(2 * tolerate + 1, math.ceil(tolerate / beta) - 1)
    while math.floor(beta * n + 1e-9) < tolerate:
        n += 1
    return n


def weighted_coordinate_median(estimates: Sequence[npt.NDArray[np.float64]], weights: Sequence[float]) -> F32:
    """Coordinate-wise weighted median of site estimates (the root step of the median rule over sites).

    Per coordinate, the values are sorted and the median is the value where the cumulative weight
    first reaches half the total; when it lands exactly on half, the mean of that value and the next
    (so equal weights give ``np.median``).

    Parameters
    ----------
    estimates : sequence of float arrays
        One per site, all the same shape.
    weights : sequence of float > 0
        The updates each estimate covers.

    Returns
    -------
    float32 array of that shape.

    Raises
    ------
    ValueError
        If empty, lengths or shapes differ, or a weight is not positive.

    Source: weighted median (Edgeworth 1888); used over site medians as in hierarchical robust
    aggregation (docs/operations.md, "Many sites").
    """
    if not estimates or len(estimates) != len(weights) or any(not w > 0 for w in weights):
        raise ValueError(f"weighted_coordinate_median: {len(estimates)} estimates, weights {list(weights)}")
    x = _stack([np.asarray(e) for e in estimates], "weighted_coordinate_median")  # [S, ...]
    w = np.asarray(weights, dtype=np.float64)
    order = np.argsort(x, axis=0, kind="stable")
    xs = np.take_along_axis(x, order, axis=0)
    ws = w[order]
    cum = np.cumsum(ws, axis=0)
    half = cum[-1] / 2.0
    idx = np.argmax(cum >= half * (1 - 1e-12), axis=0)  # first index reaching half the weight
    lo = np.take_along_axis(xs, idx[None, ...], axis=0)[0]
    at_half = np.isclose(np.take_along_axis(cum, idx[None, ...], axis=0)[0], half, rtol=1e-12, atol=0.0)
    nxt = np.take_along_axis(xs, np.minimum(idx + 1, x.shape[0] - 1)[None, ...], axis=0)[0]
    out: F32 = np.where(at_half, (lo + nxt) / 2.0, lo).astype(np.float32)
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


def update_norm(delta_W: F32, delta_b: F32) -> float:
    """Joint L2 norm of an update ``sqrt(||dW||^2 + ||db||^2)``, accumulated in float64.

    Parameters
    ----------
    delta_W : float32 [D, K]
    delta_b : float32 [K]

    Returns
    -------
    float (``inf`` or ``nan`` when a value is not finite).

    Source: Abadi et al. 2016, Algorithm 1 (per-example norm); McMahan et al. 2018 (per-user norm).
    """
    sq = float(np.sum(np.square(delta_W, dtype=np.float64)) + np.sum(np.square(delta_b, dtype=np.float64)))
    return math.sqrt(sq) if sq >= 0 else math.nan


def clip_factor(norm: float, bound: float) -> float:
    """Factor that brings an update of L2 norm ``norm`` within ``bound``: ``min(1, bound / norm)``.

    Parameters
    ----------
    norm : float >= 0
        The update's norm.
    bound : float >= 0
        The bound.

    Returns
    -------
    float in [0, 1] (1 for a zero update).

    Source: Abadi et al. 2016, Algorithm 1 (``g / max(1, ||g|| / C)``).
    """
    return min(1.0, bound / norm) if norm > 0 else 1.0


def scale_delta(delta: F32, factor: float) -> F32:
    """``delta * factor`` computed in float64 (a 3e38 value times 1e-40 stays exact), as float32."""
    if factor == 1.0:
        return delta
    out: F32 = (delta.astype(np.float64) * factor).astype(np.float32)
    return out


HOSTILE_SHARE = 0.2
"""Largest share of a FedAvg-family aggregate's updates that may be hostile (``Strategy.min_updates``)."""


class FleetHistory:
    """Honest-looking values of the fleet's last rounds (update norms, example counts) and their median.

    Values of the open round are gathered with :meth:`add` (O(1); at most ``per_round`` kept a
    round) and join the history at :meth:`commit`, once the round is aggregated; the history keeps
    the last ``rounds`` committed rounds. :meth:`median` is computed once per round (at most
    ``rounds x per_round`` values), so the cost per update is O(1) whatever the fleet's size.

    Parameters
    ----------
    rounds : int >= 1
        Committed rounds kept (1: the last aggregated round, whose norms lag the current ones least
        while the learning rate decays).
    per_round : int >= 1
        Values kept from one round (the first ones; later ones are not needed for a median).

    Raises
    ------
    ValueError
        If ``rounds`` or ``per_round`` is < 1.
    """

    def __init__(self, rounds: int = 1, per_round: int = 1024) -> None:
        if rounds < 1 or per_round < 1:
            raise ValueError(f"FleetHistory: rounds = {rounds}, per_round = {per_round}: need >= 1")
        self.per_round = per_round
        self._rounds: deque[list[float]] = deque(maxlen=rounds)
        self._open: list[float] = []

    def add(self, value: float) -> None:
        """Note one value of the open round (ignored beyond ``per_round``)."""
        if len(self._open) < self.per_round:
            self._open.append(float(value))

    def discard(self) -> None:
        """Forget the open round's values (its aggregate was not adopted)."""
        self._open = []

    def commit(self) -> None:
        """The open round's values join the history (the oldest round leaves it)."""
        if self._open:
            self._rounds.append(self._open)
        self._open = []

    def __len__(self) -> int:
        """Values in the committed history."""
        return sum(len(r) for r in self._rounds)

    def median(self) -> float:
        """Median of the committed history (NaN when it is empty)."""
        values = [v for r in self._rounds for v in r]
        return float(np.median(values)) if values else math.nan

    def snapshot(self) -> list[list[float]]:
        """The committed rounds' values, oldest first (CBOR-able)."""
        return [list(r) for r in self._rounds]

    def restore(self, rounds: Sequence[Sequence[float]]) -> None:
        """Put back a :meth:`snapshot` (non-finite or negative values are dropped)."""
        self._rounds.clear()
        for r in rounds:
            kept = [float(v) for v in r if math.isfinite(float(v)) and float(v) >= 0][: self.per_round]
            if kept:
                self._rounds.append(kept)
        self._open = []


class NormBound:
    """Bound on each update's joint L2 norm, and on its weight: fixed, or from the fleet's history.

    Adaptive: a round's bound is ``multiplier x`` the lower of two medians: of the honest-looking
    norms of the last aggregated round (``FleetHistory``, known when the round opens) and of the
    round's first ``warmup`` norms (updates wait until they are known, then the bound is frozen
    for the round). The history caps it, so hostile updates arriving first cannot widen it; the
    round's own median can only tighten it (the norms shrink as the learning rate decays, and the
    history lags them by a round); with ``warmup = 2t + 1``, ``t`` hostile updates cannot move that
    median outside the honest ones'. An update's norm joins the history as ``min(norm, bound)``: a
    clipped update counts at the bound, so a minority cannot raise the median, while a majority
    whose norms grew (drift) moves it by at most ``multiplier`` a round. Before the fleet has a
    history, the round's median alone sets it.

    The weight (claimed example count) can be bounded the same way, by ``weight_multiplier x`` the
    median honest-looking claim (the root bounds a site's claim per update so; a device's own
    claim is bounded by ``MAX_UPDATE_EXAMPLES`` only, so that a flat round and the same round split
    over sites aggregate alike).

    Parameters
    ----------
    clip_norm : float > 0 or None
        Fixed bound C; None = adaptive.
    multiplier : float >= 1
        Adaptive bound in units of the history's median norm.
    warmup : int >= 1
        Norms needed before an adaptive bound applies.
    weight_multiplier : float >= 1
        Weight bound in units of the history's median claim (inf: none).

    Raises
    ------
    ValueError
        On out-of-range parameters.

    Source: fixed clipping as McMahan et al. 2018 (DP-FedAvg); a median-based bound as Sun et al.
    2019, "Can You Really Backdoor Federated Learning?" (norm difference clipping), with the
    median taken over past rounds as Andrew et al. 2021 ("Differentially Private Learning with
    Adaptive Clipping") estimate theirs from past rounds, never from the round it bounds.
    """

    def __init__(
        self,
        clip_norm: float | None = None,
        *,
        multiplier: float = 2.0,
        warmup: int = 3,
        weight_multiplier: float = math.inf,
    ) -> None:
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm = {clip_norm}: must be > 0")
        if not multiplier >= 1.0 or warmup < 1 or not weight_multiplier >= 1.0:
            why = f"clip_multiplier = {multiplier}, warmup = {warmup}, weight_multiplier = "
            why += str(weight_multiplier)
            raise ValueError(f"{why}: need >= 1")
        self.clip_norm = clip_norm
        self.multiplier = multiplier
        self.warmup = warmup
        self.weight_multiplier = weight_multiplier
        self.history = FleetHistory()
        self.weights = FleetHistory()
        self.history_warmup = warmup  # values the history needs to set a round's bounds
        self.norms: list[float] = []  # the round's first norms and claims, while there is no history
        self.claims: list[float] = []
        self._bound: float | None = clip_norm
        self._history_bound: float | None = None
        self._weight_cap: float | None = math.inf if math.isinf(weight_multiplier) else None

    def begin(self) -> None:
        """Open a round: the history's bound (when there is enough history), nothing observed yet."""
        self.norms, self.claims = [], []
        self.history.discard()
        self.weights.discard()
        self._bound = self.clip_norm
        self._history_bound = None
        if self.clip_norm is None and len(self.history) >= self.history_warmup:
            self._history_bound = self.multiplier * self.history.median()
        self._weight_cap = math.inf if math.isinf(self.weight_multiplier) else None
        if self._weight_cap is None and len(self.weights) >= self.history_warmup:
            self._weight_cap = self.weight_multiplier * self.weights.median()

    def _with_history(self, round_bound: float) -> float:
        h = self._history_bound
        return round_bound if h is None else min(round_bound, h)

    def observe(self, norm: float, weight: float = 1.0) -> None:
        """Record an update offered in this round (only needed while the bounds wait for it)."""
        waiting = self._bound is None or self._weight_cap is None
        if waiting and len(self.norms) < self.warmup:
            self.norms.append(norm)
            self.claims.append(weight)
        if self._bound is None and len(self.norms) >= self.warmup:
            self._bound = self._with_history(self.multiplier * float(np.median(self.norms)))
        if self._weight_cap is None and len(self.claims) >= self.warmup:
            self._weight_cap = self.weight_multiplier * float(np.median(self.claims))

    def history_bound(self) -> float:
        """The bound the history alone sets for this round: fixed, else from the last round (inf: none).

        The root bounds sites' partials with it (it hears a few partials a round, not ``warmup``
        norms of the same kind).
        """
        if self.clip_norm is not None:
            return self.clip_norm
        h = self._history_bound
        return math.inf if h is None else h

    def ready(self) -> bool:
        """True when the bounds can be applied (fixed, or ``warmup`` norms of the round seen)."""
        return self._bound is not None and self._weight_cap is not None

    def bound(self) -> float:
        """The norm bound now.

        Fixed; else ``multiplier x`` the lower of the history's median and the median of the round's
        first ``warmup`` norms (of those seen so far before then; inf when there is neither).
        """
        if self._bound is not None:
            return self._bound
        if not self.norms:
            return self.history_bound()
        return self._with_history(self.multiplier * float(np.median(self.norms)))

    def weight_cap(self) -> float:
        """The weight bound now (as :meth:`bound`; inf before any claim, or without a multiplier)."""
        if self._weight_cap is not None:
            return self._weight_cap
        if not self.claims:
            return math.inf
        return self.weight_multiplier * float(np.median(self.claims))

    def accept(self, norm: float, weight: float) -> None:
        """Note an accepted update's norm and weight, each at most its bound, for the history."""
        self.history.add(min(norm, self.bound()))
        self.weights.add(min(weight, self.weight_cap()))

    def commit(self) -> None:
        """The round was aggregated: its honest-looking values join the history."""
        self.history.commit()
        self.weights.commit()

    def snapshot(self) -> dict[str, Any]:
        """The history as CBOR-able values (part of the coordinator's durable state)."""
        return {"norms": self.history.snapshot(), "weights": self.weights.snapshot()}

    def restore(self, snap: Mapping[str, Any]) -> None:
        """Put back a :meth:`snapshot`."""
        self.history.restore(snap.get("norms", []))
        self.weights.restore(snap.get("weights", []))


class Schedule(StrEnum):
    """How the service runs a round: a synchronous round, or one buffered-asynchronous server step."""

    SYNC = "sync"
    BUFFERED = "buffered"


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
        Updates that close the round early (a buffered step: the buffer size K).
    deadline_s : float
        Seconds the round stays open.
    prox_mu : float
        FedProx proximal coefficient for the clients (0 = none).
    schedule : Schedule
        SYNC: updates must be for this round and its base version. BUFFERED (FedBuff): updates
        trained from any earlier version are welcome, with their staleness.
    """

    local_epochs: int
    lr: float
    batch_size: int
    min_clients: int
    deadline_s: float
    prox_mu: float = 0.0
    schedule: Schedule = Schedule.SYNC


@dataclass(frozen=True, slots=True)
class Offer:
    """An update as a strategy sees it (decoded, dense, of the head's shape).

    Attributes
    ----------
    device : str
    delta_W : float32 [D, K]
        Local minus base global weights.
    delta_b : float32 [K]
    num_examples : int > 0
    staleness : int >= 0
        Global versions published since the update's base version (0 in synchronous rounds).
    """

    device: str
    delta_W: F32
    delta_b: F32
    num_examples: int
    staleness: int = 0


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What a strategy reports after ``aggregate`` (stdout line, log, JSON, dashboard).

    Attributes
    ----------
    clipped : int
        Updates of the round scaled down by the norm bound.
    norm_bound : float
        The bound applied last in the round (inf when nothing was offered).
    epsilon : float
        Privacy loss so far at ``delta`` (NaN without DP).
    delta : float
        The DP delta (NaN without DP).
    """

    clipped: int
    norm_bound: float
    epsilon: float = math.nan
    delta: float = math.nan


@dataclass(frozen=True, slots=True)
class SiteSums:
    """A site's share of a round: exported by ``Strategy.site_sums``, folded at the root by ``offer_sums``.

    Attributes
    ----------
    combine : str
        ``"sum"`` (FedAvg family, DP: ``W``/``b`` are weighted sums of norm-bounded deltas),
        ``"median"`` or ``"trimmed-mean"`` (the site's robust estimate of the mean delta).
    W : float64 [D, K]
    b : float64 [K]
    weight : float > 0
        Total weight of the sums (examples; updates for DP), or the updates an estimate covers.
    count : int >= 1
        Updates covered.
    clipped : int >= 0
        Updates the site's norm bound scaled down.
    """

    combine: str
    W: npt.NDArray[np.float64]
    b: npt.NDArray[np.float64]
    weight: float
    count: int
    clipped: int


class Strategy(ABC):
    """Interface of every aggregation strategy: ``configure_round``, ``offer``, ``aggregate``.

    The base class checks each offered update (shape, example count, finite values), bounds its
    norm (``NormBound``) and counts clipped updates by device; subclasses own the accumulator
    (``_begin``, ``_fold``, ``_aggregate``) and any server state (``server_state``, restored by
    ``refuse`` when the service refuses the aggregated head).

    Parameters
    ----------
    local_epochs, lr, batch_size : client training settings sent with each round.
    min_clients : int
        Updates that close a round early (before the deadline); also the least number of devices
        ``sample_clients`` chooses.
    deadline_s : float
        Seconds a round stays open.
    server_lr : float
        Server learning rate eta.
    fraction : float in (0, 1]
        Share of the available devices asked to train each round (``sample_clients``).
    seed : int
        Seed of the client sampling (the choice of round r depends only on ``seed``, ``r`` and the
        set of available devices, so a restarted coordinator repeats it).
    clip_norm : float > 0 or None
        Fixed bound on each update's joint L2 norm; None = adaptive (``clip_multiplier x`` the
        round's median norm).
    clip_multiplier : float >= 1
        See ``NormBound``.
    tolerate : int >= 0
        Hostile devices a round must withstand (``robustness.tolerate``, 1 in a coordinator
        profile; 0 here, for library use): the strategy never aggregates fewer than
        ``min_updates`` updates (a round with fewer is refused as ``too_few`` by
        ``aggregate_checked``), and the adaptive norm bound warms up on ``max(3, 2 tolerate + 1)``
        norms.

    Raises
    ------
    ValueError
        On out-of-range parameters.
    """

    name = "strategy"

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
        clip_norm: float | None = None,
        clip_multiplier: float = 2.0,
        tolerate: int = 0,
    ) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction = {fraction}: must be in (0, 1]")
        if tolerate < 0:
            raise ValueError(f"tolerate = {tolerate}: must be >= 0")
        self.tolerate = tolerate
        self.local_epochs = local_epochs
        self.lr = lr
        self.batch_size = batch_size
        self.min_clients = min_clients
        self.deadline_s = deadline_s
        self.server_lr = server_lr
        self.fraction = fraction
        self.seed = seed
        self.norm_bound = NormBound(clip_norm, multiplier=clip_multiplier, warmup=max(3, 2 * tolerate + 1))
        self.server_state: dict[str, F32] = {}
        self.clipped: Counter[str] = Counter()
        self.accepted = 0
        self._shape: tuple[int, int] | None = None
        self._pending: list[tuple[Offer, float]] = []
        self._round_clipped = 0
        self._last_bound = math.inf
        self._saved: dict[str, F32] = {}

    # -- the interface ----------------------------------------------------------------------------
    @property
    def min_updates(self) -> int:
        """Fewest updates a round may aggregate and still withstand ``tolerate`` hostile ones.

        The FedAvg family's comes from the norm bound: an aggregate of ``n`` bounded updates moves
        at most ``tolerate x bound / n`` towards the hostile ones, so ``n >= tolerate /
        HOSTILE_SHARE`` (5 for one) keeps them to a fifth of it, and a majority of the norms a
        first round's bound warms up on honest (``2 tolerate + 1``); 1 when nothing is tolerated.
        Robust rules derive theirs from their own breakdown point.
        """
        if self.tolerate == 0:
            return 1
        return max(2 * self.tolerate + 1, math.ceil(self.tolerate / HOSTILE_SHARE - 1e-9))

    def tolerance(self) -> str:
        """What the strategy withstands, for the start line and ``check-config``.

        Returns
        -------
        str, e.g. ``"tolerates 1 hostile device of 5"`` (``"tolerates no hostile device"`` at 0).
        """
        if self.tolerate == 0:
            return "tolerates no hostile device"
        dev = "device" if self.tolerate == 1 else "devices"
        return f"tolerates {self.tolerate} hostile {dev} of {self.min_updates}"

    def round_config(self, round_no: int) -> RoundConfig:
        """Settings of round ``round_no``: ``min_clients`` is at least ``min_updates``."""
        need = max(self.min_clients, self.min_updates)
        return RoundConfig(self.local_epochs, self.lr, self.batch_size, need, self.deadline_s)

    def configure_round(self, round_no: int, shape: tuple[int, int]) -> RoundConfig:
        """Begin round ``round_no``: a fresh accumulator for heads of ``shape`` (D, K), and its settings.

        Parameters
        ----------
        round_no : int
            The round (1-based).
        shape : (D, K)
            Head shape.

        Returns
        -------
        RoundConfig
        """
        self._shape = shape
        self._pending = []
        self._round_clipped = 0
        self._last_bound = math.inf
        self.accepted = 0
        self.norm_bound.begin()
        self._begin(shape)
        return self.round_config(round_no)

    def offer(self, update: Offer) -> None:
        """Check one update, bound its norm and fold it into the round's accumulator.

        Parameters
        ----------
        update : Offer

        Raises
        ------
        UpdateRejected
            ``no_round`` (``configure_round`` not called), ``bad_shape``, ``no_examples``,
            ``not_finite`` (a NaN/inf value, or a norm that overflows float64), or a strategy's own
            reason (``too_many``, ``too_stale``). A refused update leaves the accumulator unchanged.
        """
        shape = self._shape
        if shape is None:
            raise UpdateRejected("no_round", "no round configured")
        if update.delta_W.shape != shape or update.delta_b.shape != (shape[1],):
            raise UpdateRejected(
                "bad_shape", f"delta {update.delta_W.shape}/{update.delta_b.shape}, head {shape}"
            )
        if update.num_examples <= 0:
            raise UpdateRejected("no_examples", f"num_examples = {update.num_examples}")
        if update.num_examples > MAX_UPDATE_EXAMPLES:
            why = f"num_examples = {update.num_examples} > {MAX_UPDATE_EXAMPLES} (MAX_UPDATE_EXAMPLES)"
            raise UpdateRejected("bad_value", why)
        norm = update_norm(update.delta_W, update.delta_b)
        if not math.isfinite(norm):
            raise UpdateRejected("not_finite", f"update from {update.device} has norm {norm}")
        self._check(update)
        self.accepted += 1
        self.norm_bound.observe(norm, update.num_examples)
        self._pending.append((update, norm))
        if self.norm_bound.ready():
            self._drain()

    def aggregate(self, W: F32, b: F32) -> tuple[F32, F32]:
        """The next global head from the round's accumulated updates.

        Parameters
        ----------
        W : float32 [D, K]
            Current global weights.
        b : float32 [K]
            Current global biases.

        Returns
        -------
        New (W, b), float32 (not yet checked: the service validates it and calls ``refuse`` if
        it will not publish it).

        Raises
        ------
        ValueError
            If no update was accepted in the round.
        """
        self._drain()
        if self.accepted == 0:
            raise ValueError(f"{self.name}: no update to aggregate")
        self._saved = dict(self.server_state)
        self.norm_bound.commit()
        return self._aggregate(W.astype(np.float32), b.astype(np.float32))

    def site_sums(self) -> SiteSums:
        """Export the round's accumulator as a site's share (the site role; see ``docs/operations.md``).

        Returns
        -------
        SiteSums
            The norm-bounded weighted sums (FedAvg family, DP) or the site's robust estimate.

        Raises
        ------
        ValueError
            If no update was accepted, or the strategy has no hierarchical form (FedBuff).
        """
        self._drain()
        if self.accepted == 0:
            raise ValueError(f"{self.name}: no update to export")
        return self._site_sums()

    def offer_sums(self, sums: SiteSums) -> None:
        """Fold one site's share into the round's accumulator (the root role).

        With a fixed norm bound, a share of weighted sums (``combine = "sum"``) whose mean is longer
        than the bound is refused: every update folded into it was bounded, so its weighted mean
        cannot be longer (triangle inequality). A site that did not bound its updates is caught here.

        Parameters
        ----------
        sums : SiteSums

        Raises
        ------
        UpdateRejected
            ``no_round``, ``bad_shape``, ``not_finite`` (also: the round's sums would overflow
            float64), ``bad_value`` (another combine rule than this strategy's, a non-positive
            weight, a weight above ``count x MAX_UPDATE_EXAMPLES``, or a mean beyond the norm bound).
            A robust estimate's weight is not trusted at all: the root weighs sites alike and
            bounds each estimate's norm (see ``_Robust``).
        """
        shape = self._shape
        if shape is None:
            raise UpdateRejected("no_round", "no round configured")
        if sums.W.shape != shape or sums.b.shape != (shape[1],):
            raise UpdateRejected("bad_shape", f"partial {sums.W.shape}/{sums.b.shape}, head {shape}")
        norm = update_norm(sums.W, sums.b)  # type: ignore[arg-type]  # float64 works the same
        if not math.isfinite(norm):
            raise UpdateRejected("not_finite", f"partial norm {norm}")
        if not sums.weight > 0 or sums.count < 1:
            raise UpdateRejected("bad_value", f"partial weight {sums.weight}, count {sums.count}")
        if sums.combine != self.combine:
            why = f"partial combines by {sums.combine}, {self.name} by {self.combine}"
            raise UpdateRejected("bad_value", why)
        if sums.combine == "sum" and sums.weight > sums.count * MAX_UPDATE_EXAMPLES:
            why = f"partial weight {sums.weight:.4g} > {sums.count} updates x {MAX_UPDATE_EXAMPLES} examples"
            raise UpdateRejected("bad_value", why)
        bound = self.norm_bound.clip_norm
        mean_norm = norm / sums.weight
        # a coordinate-wise median can be longer than every update it covers: only sums are checked
        if bound is not None and sums.combine == "sum" and mean_norm > bound * (1 + 1e-6):
            raise UpdateRejected("bad_value", f"partial mean norm {mean_norm:.4g} > norm bound {bound:.4g}")
        clipped = sums.clipped
        if sums.combine == "sum":
            sums, scaled = self._bounded_sum(sums, mean_norm)
            clipped += sums.count if scaled else 0
        self._fold_sums(sums)
        self.accepted += sums.count
        self._round_clipped += clipped
        self._last_bound = bound if bound is not None else self._last_bound

    def bound_site_weights(self, multiplier: float = 2.0) -> None:
        """Bound each site's claimed weight per update at the root (``offer_sums``).

        Parameters
        ----------
        multiplier : float >= 1
            A partial's weight per update is at most ``multiplier x`` the median weight per update of
            the partials of the last aggregated round (``NormBound.weight_cap``).
        """
        self.norm_bound.weight_multiplier = multiplier
        self.norm_bound.history_warmup = 1  # a root hears a few sites a round, not many devices
        self.norm_bound.begin()

    def _bounded_sum(self, sums: SiteSums, mean_norm: float) -> tuple[SiteSums, bool]:
        """A sum partial scaled down to what its site may claim: weight per update and mean norm.

        The weight per update is bounded by ``NormBound.weight_cap`` (from the last round's partials
        when ``bound_site_weights`` was called), the mean's norm by the adaptive bound from the last
        round's honest-looking partial means (a fixed bound refuses instead: see ``offer_sums``). Both
        join the history. Returns the (possibly scaled) sums and whether they were scaled.
        """
        per = sums.weight / sums.count
        cap = self.norm_bound.weight_cap()
        bound = self.norm_bound.history_bound()
        self.norm_bound.weights.add(min(per, cap))
        self.norm_bound.history.add(min(mean_norm, bound))
        weight, f = sums.weight, 1.0
        if per > cap:
            weight = cap * sums.count
            f = weight / sums.weight  # the same mean, at the capped weight
        if mean_norm > bound:
            f *= bound / mean_norm  # the mean within the bound
        if weight == sums.weight and f == 1.0:
            return sums, False
        return replace(sums, W=sums.W * f, b=sums.b * f, weight=weight), True

    combine = "sum"
    """How this strategy's site shares combine at the root (``SiteSums.combine``)."""

    def snapshot(self) -> dict[str, Any]:
        """The round's accumulator as CBOR-able values: a site persists it after every accepted update.

        Returns
        -------
        dict
            ``accepted``, ``clipped``, ``norms`` (the adaptive bound's), ``pending`` (updates waiting
            for the bound's warm-up, raw float32 bytes) and ``acc`` (the strategy's own sums).

        Raises
        ------
        ValueError
            If no round is configured, or the strategy has no site/root form (FedBuff).
        """
        if self._shape is None:
            raise ValueError("no round configured")
        pending = [
            [u.device, u.delta_W.tobytes(), u.delta_b.tobytes(), u.num_examples, u.staleness, norm]
            for u, norm in self._pending
        ]
        return {
            "accepted": self.accepted,
            "clipped": self._round_clipped,
            "norms": list(self.norm_bound.norms),
            "claims": list(self.norm_bound.claims),
            "pending": pending,
            "acc": self._snapshot(),
        }

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back a :meth:`snapshot` of the round just configured (``configure_round`` first).

        Raises
        ------
        ValueError, KeyError, TypeError
            If the snapshot does not fit this strategy or the head's shape.
        """
        shape = self._shape
        if shape is None:
            raise ValueError("no round configured")
        self._restore(snap["acc"], shape)
        self.accepted = int(snap["accepted"])
        self._round_clipped = int(snap["clipped"])
        self.norm_bound.norms, self.norm_bound.claims = [], []
        claims = snap.get("claims") or [1.0] * len(snap["norms"])
        for norm, claim in zip(snap["norms"], claims, strict=True):
            self.norm_bound.observe(float(norm), float(claim))
        self._pending = [
            (
                Offer(
                    str(dev),
                    np.frombuffer(w, np.float32).reshape(shape).copy(),
                    np.frombuffer(b, np.float32).reshape(shape[1]).copy(),
                    int(n),
                    int(st),
                ),
                float(norm),
            )
            for dev, w, b, n, st, norm in snap["pending"]
        ]

    def _snapshot(self) -> dict[str, Any]:
        raise ValueError(f"{self.name} has no site/root form: run it flat")

    def _restore(self, acc: dict[str, Any], shape: tuple[int, int]) -> None:
        raise ValueError(f"{self.name} has no site/root form: run it flat")

    def _site_sums(self) -> SiteSums:
        raise ValueError(f"{self.name} has no site/root form: run it flat")

    def _fold_sums(self, sums: SiteSums) -> None:
        raise ValueError(f"{self.name} has no site/root form: run it flat")

    def refuse(self) -> None:
        """Undo the server-state change of the last ``aggregate`` (its head was not published)."""
        self.server_state.clear()
        self.server_state.update(self._saved)

    def report(self) -> RoundReport:
        """Clipping figures of the round just aggregated (see ``RoundReport``)."""
        return RoundReport(self._round_clipped, self._last_bound)

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
        return sample_clients(available, self.fraction, max(self.min_clients, self.min_updates), rng)

    # -- what subclasses define -------------------------------------------------------------------
    def _check(self, update: Offer) -> None:
        """Refuse an update for a strategy-specific reason (raise ``UpdateRejected``); default: accept."""
        return None

    @abstractmethod
    def _begin(self, shape: tuple[int, int]) -> None:
        """Start an empty accumulator for heads of ``shape``."""

    @abstractmethod
    def _fold(self, update: Offer) -> None:
        """Fold an accepted, norm-bounded update into the accumulator."""

    @abstractmethod
    def _aggregate(self, W: F32, b: F32) -> tuple[F32, F32]:
        """Combine the accumulator into the next head."""

    def _drain(self) -> None:
        bound = self.norm_bound.bound()
        cap = self.norm_bound.weight_cap()
        self._last_bound = bound
        for upd, norm in self._pending:
            self.norm_bound.accept(norm, upd.num_examples)
            f = clip_factor(norm, bound)
            if f < 1.0:
                self.clipped[upd.device] += 1
                self._round_clipped += 1
                upd = replace(upd, delta_W=scale_delta(upd.delta_W, f), delta_b=scale_delta(upd.delta_b, f))
            if upd.num_examples > cap:
                upd = replace(upd, num_examples=max(1, int(cap)))
            self._fold(upd)
        self._pending = []

    # -- durable state ----------------------------------------------------------------------------
    def durable_state(self) -> dict[str, Any]:
        """What must survive a restart: the fleet's norm history and the server optimiser's state.

        Returns
        -------
        dict of CBOR-able values (the coordinator saves it with its head; see ``restore_durable``).
        """
        server = {k: [list(v.shape), v.astype(np.float32).tobytes()] for k, v in self.server_state.items()}
        return {"bound": self.norm_bound.snapshot(), "server": server}

    def restore_durable(self, doc: Mapping[str, Any]) -> None:
        """Put back a :meth:`durable_state` (before the first round of this process).

        Raises
        ------
        ValueError, KeyError, TypeError
            If the document does not fit (the caller refuses the state file as ``bad_state``).
        """
        self.norm_bound.restore(doc.get("bound", {}))
        server: dict[str, F32] = {}
        for k, (shape, raw) in doc.get("server", {}).items():
            server[str(k)] = np.frombuffer(raw, np.float32).reshape([int(n) for n in shape]).copy()
        self.server_state.clear()
        self.server_state.update(server)


class FedAvg(Strategy):
    """FedAvg with a server learning rate: ``W += server_lr * sum_k n_k dW_k / sum_k n_k``.

    The accumulator is a weighted running sum (O(model) memory). Subclasses change only the
    server step (``step``): FedAvgM, FedAdam, FedYogi; FedProx changes the clients' objective.

    Parameters
    ----------
    **kwargs
        As ``Strategy``.

    Source: McMahan et al. 2017, Algorithm 1; server learning rate as in Reddi et al. 2021, Algorithm 1.
    """

    name = "fedavg"

    def _begin(self, shape: tuple[int, int]) -> None:
        self._sum_W = RunningWeightedSum(shape)
        self._sum_b = RunningWeightedSum((shape[1],))

    def _fold(self, update: Offer) -> None:
        self._sum_W.add(update.delta_W, update.num_examples)
        self._sum_b.add(update.delta_b, update.num_examples)

    def _aggregate(self, W: F32, b: F32) -> tuple[F32, F32]:
        return self.step(W, b, self._sum_W.mean(), self._sum_b.mean())

    def _site_sums(self) -> SiteSums:
        w = self._sum_W.total_weight
        return SiteSums("sum", self._sum_W.sum, self._sum_b.sum, float(w), self.accepted, self._round_clipped)

    def _fold_sums(self, sums: SiteSums) -> None:
        if not (self._sum_W.fits(sums.W, sums.weight) and self._sum_b.fits(sums.b, sums.weight)):
            raise UpdateRejected(
                "not_finite", f"the round's sums overflow float64 with a partial of weight {sums.weight:.4g}"
            )
        self._sum_W.add_sum(sums.W, sums.weight)
        self._sum_b.add_sum(sums.b, sums.weight)

    def _snapshot(self) -> dict[str, Any]:
        weight = self._sum_W.total_weight
        return {"W": self._sum_W.sum.tobytes(), "b": self._sum_b.sum.tobytes(), "weight": weight}

    def _restore(self, acc: dict[str, Any], shape: tuple[int, int]) -> None:
        weight = float(acc["weight"])
        if weight > 0:
            self._sum_W.add_sum(np.frombuffer(acc["W"], np.float64).reshape(shape), weight)
            self._sum_b.add_sum(np.frombuffer(acc["b"], np.float64).reshape(shape[1]), weight)

    def step_bound(self) -> float:
        """Bound on a momentum or adaptive server step: the round's per-update norm bound (``clip_step``)."""
        return self.step_factor * self._last_bound

    step_factor = 0.25
    """A momentum or adaptive server step's bound in units of the round's per-update norm bound.

    The mean of a round's norm-bounded updates from non-IID devices is far shorter than the bound
    (their directions differ): in the clean runs of ``bench/poison.py`` the FedAvg step is about a
    quarter of it. A longer momentum or adaptive step carries more than a round's mean, which is
    what a persistent hostile direction builds up; at 0.25 FedAvgM, FedAdam and FedYogi keep every
    attack of that bench within 0.06 of their clean runs (docs/benchmarks.md, "Poisoning")."""

    def step(self, W: F32, b: F32, mean_dW: F32, mean_db: F32) -> tuple[F32, F32]:
        """Server step from the round's mean delta: ``W + server_lr * mean_dW`` (and b alike).

        Parameters
        ----------
        W : float32 [D, K]
            Current global weights.
        b : float32 [K]
            Current global biases.
        mean_dW : float32 [D, K]
            Mean of the round's weight deltas.
        mean_db : float32 [K]
            Mean of the round's bias deltas.

        Returns
        -------
        New (W, b), float32.
        """
        eta = np.float32(self.server_lr)
        return (W + eta * mean_dW).astype(np.float32), (b + eta * mean_db).astype(np.float32)


class FedProx(FedAvg):
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

    def round_config(self, round_no: int) -> RoundConfig:
        """FedAvg's settings plus ``prox_mu``."""
        return replace(super().round_config(round_no), prox_mu=self.prox_mu)


class FedAvgM(FedAvg):
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

    def step(self, W: F32, b: F32, mean_dW: F32, mean_db: F32) -> tuple[F32, F32]:
        """Fold the round's mean delta into the momentum buffers and step the head along them."""
        vW = server_momentum(self.server_state.get("v_W"), mean_dW, self.beta)
        vb = server_momentum(self.server_state.get("v_b"), mean_db, self.beta)
        vW, vb = clip_step(vW, vb, self.step_bound())  # the buffer itself: a clipped direction fades
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
        """Update the moments with the round's mean delta and take the adaptive server step."""
        out = []
        for name, x, d in (("W", W, mean_dW), ("b", b, mean_db)):
            m0 = self.server_state.get("m_" + name, np.zeros_like(d, dtype=np.float32))
            v0 = self.server_state.get("v_" + name, np.full_like(d, self.tau**2, dtype=np.float32))
            m, v = self._moments(m0, v0, d)
            self.server_state["m_" + name], self.server_state["v_" + name] = m, v
            out.append(adaptive_step(x, m, v, self.server_lr, self.tau))
        step_W, step_b = (out[0] - W).astype(np.float32), (out[1] - b).astype(np.float32)
        sW, sb = clip_step(step_W, step_b, self.step_bound())
        return (W + sW).astype(np.float32), (b + sb).astype(np.float32)


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


class _Robust(Strategy):
    """Robust rules that need every update of a round at once: the accumulator is the round's updates.

    Memory is O(max_updates x model). A device's claimed example count is not weighed: it would
    let one device with a large claim dominate, which is what robust aggregation guards against
    (Yin et al. 2018 weigh all machines alike).

    Parameters
    ----------
    max_updates : int
        Most updates held for one round; more are refused (``too_many``).
    **kwargs
        As ``Strategy``.
    """

    def __init__(self, *, max_updates: int = 64, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if max_updates < 1:
            raise ValueError(f"max_updates = {max_updates}: must be >= 1")
        self.max_updates = max_updates
        self._kept_W: list[F32] = []
        self._kept_b: list[F32] = []
        self._site_W: list[npt.NDArray[np.float64]] = []
        self._site_b: list[npt.NDArray[np.float64]] = []
        self._site_n: list[float] = []

    def _check_min(self) -> None:
        if self.min_updates > self.max_updates:
            why = f"{self.name} needs {self.min_updates} updates to tolerate {self.tolerate}"
            raise ValueError(f"max_updates = {self.max_updates}: {why}")

    def _check(self, update: Offer) -> None:
        if self.accepted >= self.max_updates:
            raise UpdateRejected("too_many", f"{self.name} holds at most {self.max_updates} updates a round")

    def _begin(self, shape: tuple[int, int]) -> None:
        self._kept_W, self._kept_b = [], []
        self._site_W, self._site_b, self._site_n = [], [], []

    def _fold(self, update: Offer) -> None:
        self._kept_W.append(update.delta_W)
        self._kept_b.append(update.delta_b)

    @abstractmethod
    def _combine(self, deltas: Sequence[F32]) -> F32:
        """The robust rule itself (coordinate-wise median, trimmed mean)."""

    @abstractmethod
    def _combine_sites(self, estimates: Sequence[npt.NDArray[np.float64]], weights: Sequence[float]) -> F32:
        """The root step: combine site estimates with ``weights`` (equal: see ``_bounded_sites``)."""

    def _aggregate(self, W: F32, b: F32) -> tuple[F32, F32]:
        eta = np.float32(self.server_lr)
        if self._site_n:  # root: site estimates, and any update offered directly as a site of one
            site_W, site_b = self._bounded_sites()
            weights = [1.0] * (len(site_W) + len(self._kept_W))
            dW = self._combine_sites([*site_W, *(k.astype(np.float64) for k in self._kept_W)], weights)
            db = self._combine_sites([*site_b, *(k.astype(np.float64) for k in self._kept_b)], weights)
        else:
            dW, db = self._combine(self._kept_W), self._combine(self._kept_b)
        W1: F32 = (W + eta * dW).astype(np.float32)
        b1: F32 = (b + eta * db).astype(np.float32)
        return W1, b1

    def _bounded_sites(self) -> tuple[list[npt.NDArray[np.float64]], list[npt.NDArray[np.float64]]]:
        """The site estimates, each scaled down to the norm bound (counted in ``clipped``).

        The bound is the fixed ``clip_norm``, else the lower median of the estimates' norms (with
        a majority of honest sites, an honest site's norm). A site's self-reported weight is not
        used: the root weighs sites alike (equal weights), so one site that claims a huge weight or
        thousands of invented update ids is one estimate of S, moving the head by at most
        ``bound / S`` (the trimmed mean) or not at all while it is not the median.
        """
        norms = [
            math.sqrt(float(np.sum(w * w)) + float(np.sum(b * b)))
            for w, b in zip(self._site_W, self._site_b, strict=True)
        ]
        bound = self.norm_bound.clip_norm
        if bound is None:
            bound = sorted(norms)[(len(norms) - 1) // 2]
        out_W, out_b = [], []
        for w, b, n in zip(self._site_W, self._site_b, norms, strict=True):
            if n > bound * (1 + 1e-6):
                w, b = w * (bound / n), b * (bound / n)
                self._round_clipped += 1
            out_W.append(w)
            out_b.append(b)
        self._last_bound = bound
        return out_W, out_b

    def _site_sums(self) -> SiteSums:
        W = self._combine(self._kept_W).astype(np.float64)
        b = self._combine(self._kept_b).astype(np.float64)
        n = len(self._kept_W)
        return SiteSums(self.combine, W, b, float(n), n, self._round_clipped)

    def _snapshot(self) -> dict[str, Any]:
        return {"W": [w.tobytes() for w in self._kept_W], "b": [b.tobytes() for b in self._kept_b]}

    def _restore(self, acc: dict[str, Any], shape: tuple[int, int]) -> None:
        self._kept_W = [np.frombuffer(w, np.float32).reshape(shape).copy() for w in acc["W"]]
        self._kept_b = [np.frombuffer(b, np.float32).reshape(shape[1]).copy() for b in acc["b"]]

    def _fold_sums(self, sums: SiteSums) -> None:
        self._site_W.append(sums.W)
        self._site_b.append(sums.b)
        self._site_n.append(sums.weight)


class Median(_Robust):
    """Coordinate-wise median of the round's deltas (see ``coordinate_median``).

    Source: Yin et al. 2018, Definition 1.
    """

    name = "median"
    combine = "median"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._check_min()

    @property
    def min_updates(self) -> int:
        """``2 tolerate + 1`` updates.

        Then ``tolerate`` values cannot move a coordinate's median outside the honest values (Yin
        et al. 2018: breakdown point 1/2).
        """
        return 2 * self.tolerate + 1

    def _combine(self, deltas: Sequence[F32]) -> F32:
        return coordinate_median(deltas)

    def _combine_sites(self, estimates: Sequence[npt.NDArray[np.float64]], weights: Sequence[float]) -> F32:
        """Weighted coordinate median of the site medians (``weighted_coordinate_median``)."""
        return weighted_coordinate_median(estimates, weights)


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
    combine = "trimmed-mean"

    def __init__(self, *, trim_fraction: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= trim_fraction < 0.5:
            raise ValueError(f"trim_fraction = {trim_fraction}: must be in [0, 0.5)")
        self.trim_fraction = trim_fraction
        if self.tolerate > 0 and trim_fraction == 0.0:
            why = f"it cannot tolerate {self.tolerate} hostile device"
            raise ValueError(f"trim_fraction = 0 trims nothing: {why}")
        self._check_min()

    @property
    def min_updates(self) -> int:
        """Fewest ``n`` with ``floor(trim_fraction n) >= tolerate`` (and at least ``2 tolerate + 1``).

        Each coordinate then drops ``tolerate`` values at both ends, so ``tolerate`` hostile
        values are trimmed or lie between honest ones (Yin et al. 2018, Definition 2).
        """
        return trimmed_minimum(self.trim_fraction, self.tolerate)

    def _combine(self, deltas: Sequence[F32]) -> F32:
        return trimmed_mean(deltas, self.trim_fraction)

    def _combine_sites(self, estimates: Sequence[npt.NDArray[np.float64]], weights: Sequence[float]) -> F32:
        """Weighted mean of the site trimmed means (the root passes equal weights: see ``_bounded_sites``)."""
        w = np.asarray(weights, dtype=np.float64)
        x = _stack([np.asarray(e) for e in estimates], "trimmed_mean sites")
        out: F32 = (np.tensordot(w, x, axes=1) / w.sum()).astype(np.float32)
        return out


STRATEGY_NAMES = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "median", "trimmed-mean", "fedbuff")
DEFAULT_STRATEGY = "trimmed-mean"
"""The strategy of ``edgefl coordinator`` when none is named: trimmed mean (beta 0.2) after the norm
bound, the only rule that kept every attack of ``bench/poison.py`` within 0.03 of its clean run
(FedAvg with the norm bound alone lost 0.07 to a x -10 device: see docs/benchmarks.md)."""


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
        "fedavg": FedAvg,
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


def aggregate_checked(strategy: Strategy, W: F32, b: F32) -> tuple[F32, F32, UpdateRejected | None]:
    """Aggregate a round and keep the result only if the agents would accept it.

    The candidate head must pass ``edgefl.head.validate_head`` (shape, float32, finite, every
    |value| <= ``MAX_HEAD_ABS``), the check every agent applies to a global head. Otherwise the
    strategy's server state is restored (``Strategy.refuse``) and the current head is returned.

    Parameters
    ----------
    strategy : Strategy
        With at least one accepted update in the current round.
    W : float32 [D, K]
        Current global weights.
    b : float32 [K]
        Current global biases.

    Returns
    -------
    (W, b, refused): the new head and None, or the current head and the refusal (its ``reason``:
    ``too_few`` when fewer than ``strategy.min_updates`` updates were accepted, nothing aggregated;
    ``not_finite``, ``bad_value``, ``bad_shape``, ``bad_dtype``).

    Raises
    ------
    ValueError
        If no update was accepted in the round.
    """
    if strategy.accepted < strategy.min_updates:
        why = (
            f"{strategy.accepted} updates, {strategy.name} needs {strategy.min_updates} "
            f"to tolerate {strategy.tolerate} hostile"
        )
        return W, b, UpdateRejected("too_few", why)
    W1, b1 = strategy.aggregate(W, b)
    try:
        validate_head(W1, b1, (int(W.shape[0]), int(W.shape[1])))
    except UpdateRejected as exc:
        strategy.refuse()
        return W, b, exc
    return W1, b1, None
