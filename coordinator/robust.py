"""Robust aggregation rules: coordinate-wise median and trimmed mean, of updates or of sites' estimates.

They hold a round's updates and weigh devices alike (:class:`_Robust`), aggregating no fewer than
their breakdown point and ``tolerate`` allow; the maths is in pure numpy functions (Yin et al. 2018).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from edgefl.coordinator.normbound import update_norm
from edgefl.coordinator.strategy import Offer, SiteSums, Strategy, array_from, check_setting
from edgefl.errors import UpdateRejected
from edgefl.types import F32


def _stack(deltas: Sequence[npt.NDArray[Any]], where: str) -> npt.NDArray[np.float64]:
    if not deltas:
        raise ValueError(f"{where}: no update")
    shape = deltas[0].shape
    for d in deltas:
        if d.shape != shape:
            raise ValueError(f"{where}: shape {d.shape}, expected {shape}")
    return np.stack([d.astype(np.float64) for d in deltas])


def coordinate_median(deltas: Sequence[npt.NDArray[Any]]) -> F32:
    """Coordinate-wise median of the updates (unweighted; the mean of the two middle values when even).

    ``deltas``: float32 updates or a root's float64 site estimates, one shape; float32 out (computed in
    float64). ValueError if empty or the shapes differ.

    Source: Yin, Chen, Ramchandran, Bartlett 2018, "Byzantine-Robust Distributed Learning: Towards
    Optimal Statistical Rates", Definition 1 (coordinate-wise median).
    """
    out: F32 = np.median(_stack(deltas, "coordinate_median"), axis=0).astype(np.float32)
    return out


def trimmed_mean(deltas: Sequence[F32], beta: float) -> F32:
    """Coordinate-wise trimmed mean: per coordinate, drop the ``floor(beta m)`` largest and smallest values.

    ``deltas``: float32 of one shape, out too; ``beta`` in [0, 0.5) (0: the mean), else ValueError (also
    if empty or the shapes differ).

    Source: Yin et al. 2018, Definition 2 (coordinate-wise beta-trimmed mean).
    """
    check_setting(0.0 <= beta < 0.5, "trimmed_mean: beta", beta, "in [0, 0.5)")
    x = np.sort(_stack(deltas, "trimmed_mean"), axis=0)
    k = math.floor(beta * x.shape[0])
    out: F32 = x[k : x.shape[0] - k].mean(axis=0).astype(np.float32)
    return out


def trimmed_minimum(beta: float, tolerate: int) -> int:
    """Fewest updates ``n`` for which a beta-trimmed mean drops ``tolerate`` values at each end.

    Returns the least ``n >= 2 tolerate + 1`` with ``floor(beta n) >= tolerate`` (1 when ``tolerate =
    0``); raises ValueError if ``tolerate > 0`` and ``beta`` is outside (0, 0.5).

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


class _Robust(Strategy):
    """Robust rules that hold a round's updates (at most ``max_updates``; more are ``too_many``).

    Devices are weighed alike whatever they claim (Yin et al. 2018); ``kwargs`` as ``Strategy``.
    """

    def __init__(self, *, max_updates: int = 64, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_setting(max_updates >= 1, "max_updates", max_updates, ">= 1")
        self.max_updates = max_updates
        self._kept_W: list[F32] = []
        self._kept_b: list[F32] = []
        self._site_W: list[npt.NDArray[np.float64]] = []
        self._site_b: list[npt.NDArray[np.float64]] = []

    def _check_min(self) -> None:
        if self.min_updates > self.max_updates:
            why = f"{self.name} needs {self.min_updates} updates to tolerate {self.tolerate}"
            raise ValueError(f"max_updates = {self.max_updates}: {why}")

    def _check(self, update: Offer) -> None:
        if self.accepted >= self.max_updates:
            raise UpdateRejected("too_many", f"{self.name} holds at most {self.max_updates} updates a round")

    def _begin(self, shape: tuple[int, int]) -> None:
        self._kept_W, self._kept_b = [], []
        self._site_W, self._site_b = [], []

    def _fold(self, update: Offer) -> None:
        self._kept_W.append(update.delta_W)
        self._kept_b.append(update.delta_b)

    @abstractmethod
    def _combine(self, deltas: Sequence[F32]) -> F32:
        """The robust rule itself (coordinate-wise median, trimmed mean)."""

    @abstractmethod
    def _combine_sites(self, estimates: Sequence[npt.NDArray[np.float64]]) -> F32:
        """The root step: combine site estimates, weighed alike (see ``_bounded_sites``)."""

    def _aggregate(self, W: F32, b: F32) -> tuple[F32, F32]:
        if self._site_W:  # root: site estimates, and any update offered directly as a site of one
            site_W, site_b = self._bounded_sites()
            dW = self._combine_sites([*site_W, *(k.astype(np.float64) for k in self._kept_W)])
            db = self._combine_sites([*site_b, *(k.astype(np.float64) for k in self._kept_b)])
        else:
            dW, db = self._combine(self._kept_W), self._combine(self._kept_b)
        return self.step(W, b, dW, db)

    def _bounded_sites(self) -> tuple[list[npt.NDArray[np.float64]], list[npt.NDArray[np.float64]]]:
        """The site estimates, each scaled down to the fixed bound or the lower median norm."""
        norms = [update_norm(w, b) for w, b in zip(self._site_W, self._site_b, strict=True)]
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
        self._kept_W = [array_from(w, np.float32, shape) for w in acc["W"]]
        self._kept_b = [array_from(b, np.float32, shape[1]) for b in acc["b"]]

    def _fold_sums(self, sums: SiteSums) -> None:
        self._site_W.append(sums.W)
        self._site_b.append(sums.b)


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
        """``2 tolerate + 1`` updates (breakdown point 1/2, Yin et al. 2018)."""
        return 2 * self.tolerate + 1

    def _combine(self, deltas: Sequence[F32]) -> F32:
        return coordinate_median(deltas)

    def _combine_sites(self, estimates: Sequence[npt.NDArray[np.float64]]) -> F32:
        """Coordinate-wise median of the site medians."""
        return coordinate_median(estimates)


class TrimmedMean(_Robust):
    """Coordinate-wise trimmed mean of the round's deltas (see ``trimmed_mean``).

    ``trim_fraction`` beta in [0, 0.5): dropped at each end per coordinate; ``kwargs`` as ``_Robust``.

    Source: Yin et al. 2018, Definition 2.
    """

    name = "trimmed-mean"
    combine = "trimmed-mean"

    def __init__(self, *, trim_fraction: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_setting(0.0 <= trim_fraction < 0.5, "trim_fraction", trim_fraction, "in [0, 0.5)")
        self.trim_fraction = trim_fraction
        if self.tolerate > 0 and trim_fraction == 0.0:
            why = f"it cannot tolerate {self.tolerate} hostile device"
            raise ValueError(f"trim_fraction = 0 trims nothing: {why}")
        self._check_min()

    @property
    def min_updates(self) -> int:
        """Fewest ``n`` with ``floor(trim_fraction n) >= tolerate`` (and at least ``2 tolerate + 1``)."""
        return trimmed_minimum(self.trim_fraction, self.tolerate)

    def _combine(self, deltas: Sequence[F32]) -> F32:
        return trimmed_mean(deltas, self.trim_fraction)

    def _combine_sites(self, estimates: Sequence[npt.NDArray[np.float64]]) -> F32:
        """Mean of the site trimmed means."""
        out: F32 = _stack(estimates, "trimmed_mean sites").mean(axis=0).astype(np.float32)
        return out
