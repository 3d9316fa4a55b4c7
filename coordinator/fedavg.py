"""The FedAvg family's accumulator and server step: a weighted running sum of norm-bounded deltas.

FedAvg (``W += server_lr x`` the weighted mean delta) and FedProx (FedAvg whose clients add a
proximal term); the server optimisers that change only the step (FedAvgM, FedAdam, FedYogi) are in
``coordinator/optimisers.py``. Memory is O(model) whatever the number of devices.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from edgefl.coordinator.strategy import Offer, RoundConfig, SiteSums, Strategy, array_from, check_setting
from edgefl.types import F32


class RunningWeightedSum:
    """A float64 weighted sum of arrays of ``shape``, folded one update at a time (O(model) memory)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self._sum = np.zeros(shape, dtype=np.float64)
        self.total_weight: float = 0

    def add(self, delta: F32, weight: int) -> None:
        """Fold ``weight * delta`` into the sum (ValueError: another shape, or ``weight <= 0``)."""
        self.add_sum(np.float64(weight) * delta, weight)

    def add_sum(self, weighted_sum: npt.NDArray[np.float64], weight: float) -> None:
        """Fold another accumulator's float64 sum and weight in (a site's partial; ValueError as ``add``)."""
        if weighted_sum.shape != self.shape:
            raise ValueError(f"RunningWeightedSum: shape {weighted_sum.shape}, expected {self.shape}")
        if not weight > 0:
            raise ValueError(f"RunningWeightedSum: weight {weight} must be > 0")
        self._sum += weighted_sum
        self.total_weight += weight

    @property
    def sum(self) -> npt.NDArray[np.float64]:
        """A copy of the float64 weighted sum so far (shape ``shape``)."""
        return self._sum.copy()

    def mean(self) -> F32:
        """The weighted mean so far, float32 of ``shape`` (ValueError if nothing was added)."""
        if self.total_weight == 0:
            raise ValueError("RunningWeightedSum: no update added")
        out: F32 = (self._sum / self.total_weight).astype(np.float32)
        return out


class FedAvg(Strategy):
    """FedAvg with a server learning rate: ``W += server_lr * sum_k n_k dW_k / sum_k n_k``.

    The accumulator is a weighted running sum (O(model) memory); subclasses change only the server step
    (FedAvgM, FedAdam, FedYogi) or the clients' objective (FedProx). ``kwargs`` as ``Strategy``.

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
        self._sum_W.add_sum(sums.W, sums.weight)
        self._sum_b.add_sum(sums.b, sums.weight)

    def _snapshot(self) -> dict[str, Any]:
        weight = self._sum_W.total_weight
        return {"W": self._sum_W.sum.tobytes(), "b": self._sum_b.sum.tobytes(), "weight": weight}

    def _restore(self, acc: dict[str, Any], shape: tuple[int, int]) -> None:
        weight = float(acc["weight"])
        if weight > 0:
            self._sum_W.add_sum(array_from(acc["W"], np.float64, shape), weight)
            self._sum_b.add_sum(array_from(acc["b"], np.float64, shape[1]), weight)


class FedProx(FedAvg):
    """FedAvg whose clients add the proximal term ``mu/2 ||w - w_global||^2`` to their local loss.

    ``prox_mu`` >= 0: mu, sent to the devices in ``RoundConfig.prox_mu``; ``kwargs`` as ``Strategy``.

    Source: Li et al. 2020, "Federated Optimization in Heterogeneous Networks", eq. (2).
    """

    name = "fedprox"

    def __init__(self, *, prox_mu: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_setting(prox_mu >= 0, "prox_mu", prox_mu, ">= 0")
        self.prox_mu = prox_mu

    def round_config(self, round_no: int) -> RoundConfig:
        """FedAvg's settings plus ``prox_mu``."""
        return replace(super().round_config(round_no), prox_mu=self.prox_mu)
