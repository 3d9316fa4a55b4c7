"""Asynchronous aggregation (FedBuff): apply a buffer of K updates as they come, stale ones down-weighted.

Source: Nguyen et al. 2022, "Federated Learning with Buffered Asynchronous Aggregation" (AISTATS),
Algorithm 1; staleness weight ``s(tau) = 1 / sqrt(1 + tau)`` as in their experiments.
"""

from __future__ import annotations

import logging
from dataclasses import KW_ONLY, dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from edgefl.coordinator.strategy import Offer, RoundConfig, Schedule, Strategy, array_from
from edgefl.errors import UpdateRejected
from edgefl.types import F32

logger = logging.getLogger(__name__)


def staleness_weight(staleness: int, exponent: float = 0.5) -> float:
    """Polynomial staleness discount ``(1 + tau)^-a``.

    ``staleness`` tau >= 0: global versions published since the update's base version; ``exponent``
    a >= 0 (0.5 in Nguyen et al. 2022; 0 = no discount). Returns a float in (0, 1], 1 for a fresh
    update. Raises ValueError if either is negative.

    Source: Nguyen et al. 2022, §5 ("s(tau) = 1/sqrt(1+tau)"); Xie et al. 2019 (FedAsync), polynomial s.
    """
    if staleness < 0 or exponent < 0:
        raise ValueError(f"staleness_weight: staleness = {staleness}, exponent = {exponent}")
    return float((1.0 + staleness) ** -exponent)


def check_staleness(staleness: int, max_staleness: int) -> None:
    """Raise UpdateRejected ``too_stale`` unless ``0 <= staleness <= max_staleness`` (versions)."""
    if not 0 <= staleness <= max_staleness:
        raise UpdateRejected("too_stale", f"staleness {staleness} outside [0, {max_staleness}]")


@dataclass(eq=False)
class FedBuffer:
    """The server buffer: a staleness-weighted running sum of up to ``buffer_size`` updates.

    ``flush`` applies ``W += server_lr * sum_k s(tau_k) n_k dW_k / sum_k n_k`` (with equal ``n_k`` the
    paper's ``(1/K) sum_k s(tau_k) Delta_k``: a stale update shrinks the step). ``buffer_size`` >= 1:
    the paper's K; ``server_lr``: eta_g; updates staler than ``max_staleness`` (>= 0) are refused;
    ``exponent``: as ``staleness_weight``.
    """

    shape: tuple[int, int]
    buffer_size: int
    _: KW_ONLY
    server_lr: float = 1.0
    max_staleness: int = 20
    exponent: float = 0.5

    def __post_init__(self) -> None:
        if self.buffer_size < 1 or self.max_staleness < 0:
            why = f"buffer_size = {self.buffer_size}, max_staleness = {self.max_staleness}"
            raise ValueError(f"FedBuffer: {why}")
        self._clear()

    def _clear(self) -> None:
        self._sum_W: npt.NDArray[np.float64] = np.zeros(self.shape, np.float64)
        self._sum_b: npt.NDArray[np.float64] = np.zeros(self.shape[1], np.float64)
        self.total_examples = 0
        self.count = 0
        self.staleness: list[int] = []

    def offer(self, delta_W: F32, delta_b: F32, num_examples: int, staleness: int) -> bool:
        """Fold one update (``delta_W`` float32 [D, K], ``delta_b`` float32 [K]) into the buffer.

        Returns True when the buffer holds ``buffer_size`` updates (call ``flush``). Raises
        ``UpdateRejected``: ``bad_shape``, ``no_examples``, ``too_stale`` (outside [0, max_staleness]).
        """
        if delta_W.shape != self.shape or delta_b.shape != (self.shape[1],):
            raise UpdateRejected("bad_shape", f"delta {delta_W.shape}, expected {self.shape}")
        if num_examples <= 0:
            raise UpdateRejected("no_examples", f"num_examples = {num_examples}")
        check_staleness(staleness, self.max_staleness)
        w = staleness_weight(staleness, self.exponent) * num_examples
        self._sum_W += w * delta_W.astype(np.float64)
        self._sum_b += w * delta_b.astype(np.float64)
        self.total_examples += num_examples
        self.count += 1
        self.staleness.append(staleness)
        return self.count >= self.buffer_size

    def flush(self, W: F32, b: F32) -> tuple[F32, F32]:
        """Apply the buffer to the head (``W`` float32 [D, K], ``b`` float32 [K]) and empty it.

        Returns the new float32 (W, b); raises ValueError if the buffer is empty.
        """
        if self.count == 0:
            raise ValueError("FedBuffer.flush: empty buffer")
        scale = self.server_lr / self.total_examples
        W1: F32 = (W + scale * self._sum_W).astype(np.float32)
        b1: F32 = (b + scale * self._sum_b).astype(np.float32)
        logger.debug("FedBuff step: %d updates, staleness %s", self.count, self.staleness)
        self._clear()
        return W1, b1


class FedBuff(Strategy):
    """Buffered asynchronous strategy: devices train on; a server step every ``buffer_size`` updates.

    Rounds are ``Schedule.BUFFERED`` (updates from any earlier version; a step closes at K updates or
    the deadline); staler than ``max_staleness`` is ``too_stale``; ``buffer_size`` K and
    ``staleness_exponent`` (``exponent``) as ``FedBuffer``; ``kwargs`` as ``Strategy``.

    Source: Nguyen et al. 2022, Algorithm 1.
    """

    name = "fedbuff"

    def __init__(
        self, *, buffer_size: int = 3, max_staleness: int = 20, staleness_exponent: float = 0.5, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if buffer_size < 1 or max_staleness < 0 or staleness_exponent < 0:
            raise ValueError(
                f"buffer_size = {buffer_size}, max_staleness = {max_staleness}, "
                f"staleness_exponent = {staleness_exponent}: need >= 1, >= 0, >= 0"
            )
        self.buffer_size = buffer_size
        self.max_staleness = max_staleness
        self.staleness_exponent = staleness_exponent

    def round_config(self, round_no: int) -> RoundConfig:
        """Client settings, ``min_clients = buffer_size`` (updates per step), ``Schedule.BUFFERED``."""
        cfg = super().round_config(round_no)
        return replace(cfg, min_clients=max(self.buffer_size, self.min_updates), schedule=Schedule.BUFFERED)

    def _check(self, update: Offer) -> None:
        check_staleness(update.staleness, self.max_staleness)

    def _begin(self, shape: tuple[int, int]) -> None:
        self._buffer = FedBuffer(
            shape,
            self.buffer_size,
            server_lr=self.server_lr,
            max_staleness=self.max_staleness,
            exponent=self.staleness_exponent,
        )

    def _fold(self, update: Offer) -> None:
        self._buffer.offer(update.delta_W, update.delta_b, update.num_examples, update.staleness)

    def _aggregate(self, W: F32, b: F32) -> tuple[F32, F32]:
        return self._buffer.flush(W, b)

    def _snapshot(self) -> dict[str, Any]:
        buf = self._buffer
        return {
            "W": buf._sum_W.tobytes(),
            "b": buf._sum_b.tobytes(),
            "examples": buf.total_examples,
            "count": buf.count,
            "staleness": list(buf.staleness),
        }

    def _restore(self, acc: dict[str, Any], shape: tuple[int, int]) -> None:
        buf = self._buffer
        buf._sum_W[:] = array_from(acc["W"], np.float64, shape)
        buf._sum_b[:] = array_from(acc["b"], np.float64, shape[1])
        buf.total_examples = int(acc["examples"])
        buf.count = int(acc["count"])
        buf.staleness = [int(x) for x in acc["staleness"]]
