"""One federated round's state machine at the coordinator: open → collecting → closed.

Updates are checked (round number, base version, selection, duplicate ``update_id``) and folded
into a running weighted sum as they arrive (streaming aggregation, O(model) memory).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from edgefl.coordinator.strategy import RunningWeightedSum
from edgefl.errors import UpdateRejected
from edgefl.types import F32
from edgefl.wire.codec import Update


class RoundPhase(StrEnum):
    """Where a round is in its life."""

    OPEN = "open"
    CLOSED = "closed"


@dataclass
class Round:
    """State of one round.

    Parameters
    ----------
    number : int
        Round number (1-based).
    base_version : int
        Global model version the devices must train from.
    shape : (D, K)
        Head shape: updates of another shape are refused.
    deadline_s : float
        Seconds from opening until the round closes with what it has.
    min_clients : int
        Updates that close the round before the deadline.
    selected : frozenset[str] or None
        Devices asked to take part (None = any device).
    keep_updates : int
        0 for streaming strategies (only running sums kept); otherwise the round also keeps up to this
        many updates for strategies that need them all (median, trimmed mean) and refuses more.
    check_round : bool
        False in asynchronous mode (FedBuff), where updates of earlier rounds are welcome.
    """

    number: int
    base_version: int
    shape: tuple[int, int]
    deadline_s: float
    min_clients: int
    selected: frozenset[str] | None = None
    keep_updates: int = 0
    check_round: bool = True
    opened_at: float = field(default_factory=time.monotonic)
    phase: RoundPhase = RoundPhase.OPEN
    devices: list[str] = field(default_factory=list)
    update_ids: set[str] = field(default_factory=set)
    update_bytes: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    kept: list[tuple[F32, F32, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sum_W = RunningWeightedSum(self.shape)
        self.sum_b = RunningWeightedSum((self.shape[1],))

    @property
    def clients(self) -> int:
        """Updates accepted so far."""
        return len(self.devices)

    @property
    def deadline_at(self) -> float:
        """Monotonic time (s) at which the round closes regardless."""
        return self.opened_at + self.deadline_s

    def complete(self) -> bool:
        """True when ``min_clients`` updates arrived (or every selected device answered)."""
        if self.selected is not None and set(self.devices) >= self.selected:
            return True
        return self.clients >= self.min_clients

    def offer(self, update: Update, size_bytes: int) -> None:
        """Accept an update into the round's running sums.

        Parameters
        ----------
        update : Update
            A decoded, validated update (dense float32 deltas).
        size_bytes : int
            Its size on the wire (for the round's bytes figure).

        Raises
        ------
        UpdateRejected
            ``round_closed``, ``stale_round`` (other round number), ``stale_base`` (other base version),
            ``not_selected``, ``duplicate`` (same ``update_id`` or same device twice), ``bad_shape``,
            ``no_examples``, ``too_many`` (a robust strategy's bound on held updates).
        """
        if self.phase is not RoundPhase.OPEN:
            raise UpdateRejected("round_closed", f"round {self.number} is closed")
        if self.check_round and update.round != self.number:
            raise UpdateRejected(
                "stale_round", f"update for round {update.round}, round {self.number} is open"
            )
        if self.check_round and update.base_version != self.base_version:
            raise UpdateRejected(
                "stale_base", f"update from version {update.base_version}, round uses {self.base_version}"
            )
        if self.selected is not None and update.device not in self.selected:
            raise UpdateRejected(
                "not_selected", f"device {update.device} not selected for round {self.number}"
            )
        if update.update_id in self.update_ids or update.device in self.devices:
            raise UpdateRejected(
                "duplicate", f"update {update.update_id} from {update.device} already counted"
            )
        if update.delta_W.shape != self.shape or update.delta_b.shape != (self.shape[1],):
            raise UpdateRejected("bad_shape", f"delta {update.delta_W.shape}, expected {self.shape}")
        if update.num_examples <= 0:
            raise UpdateRejected("no_examples", f"num_examples = {update.num_examples}")
        if self.keep_updates:
            if len(self.kept) >= self.keep_updates:
                raise UpdateRejected(
                    "too_many", f"round {self.number} already holds {len(self.kept)} updates"
                )
            self.kept.append((update.delta_W, update.delta_b, update.num_examples))
        self.sum_W.add(update.delta_W, update.num_examples)
        self.sum_b.add(update.delta_b, update.num_examples)
        self.devices.append(update.device)
        self.update_ids.add(update.update_id)
        self.update_bytes.append(size_bytes)
        self.losses.append(update.metrics.loss)

    def close(self) -> None:
        """Stop accepting updates."""
        self.phase = RoundPhase.CLOSED
