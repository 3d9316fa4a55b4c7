"""Aggregation strategies: how the coordinator turns devices' updates into the next global head.

The maths lives in pure numpy functions tested on hand-checkable arrays; ``Strategy`` subclasses
wire them to the round (``configure_round``, ``aggregate``), as Flower does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agent.types import F32


def weighted_mean(deltas: Sequence[F32], num_examples: Sequence[int]) -> F32:
    """Mean of arrays weighted by example counts: ``sum_k n_k * d_k / sum_k n_k``.

    Parameters
    ----------
    deltas : sequence of float32 arrays, all the same shape
    num_examples : sequence of int > 0, same length

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
        """The weighted mean so far, float32 of ``shape``.

        Raises
        ------
        ValueError
            If nothing was added.
        """
        if self.total_weight == 0:
            raise ValueError("RunningWeightedSum: no update added")
        out: F32 = (self._sum / self.total_weight).astype(np.float32)
        return out


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """What ``configure_round`` decides for one round (sent in the RoundAnnouncement)."""

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
        Updates that close a round early (before the deadline).
    deadline_s : float
        Seconds a round stays open.
    server_lr : float
        Server learning rate eta: ``global += eta * mean(delta)`` (1.0 = plain FedAvg).

    Source: McMahan et al. 2017 (FedAvg); server learning rate as in Reddi et al. 2021, Algorithm 1.
    """

    name = "fedavg"

    def __init__(
        self,
        *,
        local_epochs: int = 2,
        lr: float = 0.1,
        batch_size: int = 32,
        min_clients: int = 2,
        deadline_s: float = 30.0,
        server_lr: float = 1.0,
    ) -> None:
        self.local_epochs = local_epochs
        self.lr = lr
        self.batch_size = batch_size
        self.min_clients = min_clients
        self.deadline_s = deadline_s
        self.server_lr = server_lr

    def configure_round(self, round_no: int) -> RoundConfig:
        """Settings of round ``round_no`` (the same every round for FedAvg)."""
        return RoundConfig(self.local_epochs, self.lr, self.batch_size, self.min_clients, self.deadline_s)

    def aggregate(self, W: F32, b: F32, mean_dW: F32, mean_db: F32) -> tuple[F32, F32]:
        """Apply the round's weighted-mean update to the global head.

        Parameters
        ----------
        W : float32 [D, K], b : float32 [K]
            Current global head.
        mean_dW : float32 [D, K], mean_db : float32 [K]
            Weighted mean of the round's deltas.

        Returns
        -------
        New (W, b), float32.
        """
        eta = np.float32(self.server_lr)
        return (W + eta * mean_dW).astype(np.float32), (b + eta * mean_db).astype(np.float32)
