"""One federated round's state machine at the coordinator: open → collecting → closed.

The round checks who may take part (round number and base version in a synchronous round,
selection, duplicate ``update_id`` or device) and keeps the round's figures (devices, update ids,
bytes, losses). What is aggregated is the strategy's business: an accepted update is handed to
``Strategy.offer``, which owns the accumulator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from edgefl.errors import UpdateRejected
from edgefl.wire.messages import Update


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
    check_round : bool
        False in a buffered-asynchronous step (FedBuff), where updates of earlier rounds are welcome.
    expected_sites : int
        At the root of a hierarchy: partials that close the round (0: ``min_clients`` updates do).
    online : frozenset[str]
        Devices online when the round opened (used when ``selected`` is None): once one of them
        declined and every one answered or declined, the round closes (``min_clients`` cannot come).
    """

    number: int
    base_version: int
    shape: tuple[int, int]
    deadline_s: float
    min_clients: int
    selected: frozenset[str] | None = None
    check_round: bool = True
    expected_sites: int = 0
    online: frozenset[str] = frozenset()
    opened_at: float = field(default_factory=time.monotonic)
    phase: RoundPhase = RoundPhase.OPEN
    devices: list[str] = field(default_factory=list)
    update_ids: set[str] = field(default_factory=set)
    update_bytes: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)
    declined: list[str] = field(default_factory=list)
    """Devices that refused this round with a Decline (e.g. ``over_budget``)."""

    @property
    def clients(self) -> int:
        """Updates accepted so far (directly, or covered by the partials of sites)."""
        return len(self.update_ids)

    @property
    def deadline_at(self) -> float:
        """Monotonic time (s) at which the round closes regardless."""
        return self.opened_at + self.deadline_s

    def complete(self) -> bool:
        """True when ``min_clients`` updates arrived, or every selected device answered or declined.

        Without a selection: also when some device declined and every device online at the opening
        answered or declined (no more updates are coming; waiting for the deadline would not help).
        At the root of a hierarchy with ``expected_sites``: when that many sites' partials arrived.
        """
        if self.expected_sites > 0:
            return len(self.sites) >= self.expected_sites
        answered = set(self.devices) | set(self.declined)
        if self.selected is not None and answered >= self.selected:
            return True
        if self.selected is None and self.declined and self.online and answered >= self.online:
            return True
        return self.clients >= self.min_clients

    def admit(self, update: Update) -> None:
        """Check that ``update`` may take part in this round (it is not recorded yet: see ``record``).

        Parameters
        ----------
        update : Update
            A decoded, validated update (dense float32 deltas).

        Raises
        ------
        UpdateRejected
            ``round_closed``, ``stale_round`` (other round number), ``stale_base`` (other base version),
            ``not_selected``, ``duplicate`` (same ``update_id`` or same device twice).
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

    def record(self, update: Update, size_bytes: int) -> None:
        """Record an update the strategy accepted (device, id, bytes on the wire, loss)."""
        self.devices.append(update.device)
        self.update_ids.add(update.update_id)
        self.update_bytes.append(size_bytes)
        self.losses.append(update.metrics.loss)

    def admit_partial(self, site: str, round_no: int, base_version: int, update_ids: tuple[str, ...]) -> None:
        """Check that a site's partial may count in this round (it is not recorded yet).

        Raises
        ------
        UpdateRejected
            ``round_closed``, ``stale_round`` (a partial of another round: a site that missed the
            deadline is refused by round number), ``stale_base``, ``duplicate`` (the site already
            counted). Ids another site listed too are not refused here: the root keys ids by
            (site, id) and logs and counts the overlap (``RootCoordinator``).
        """
        if self.phase is not RoundPhase.OPEN:
            raise UpdateRejected("round_closed", f"round {self.number} is closed")
        if round_no != self.number:
            why = f"partial of {site} for round {round_no}, round {self.number} is open"
            raise UpdateRejected("stale_round", why)
        if base_version != self.base_version:
            why = f"partial from version {base_version}, round uses {self.base_version}"
            raise UpdateRejected("stale_base", why)
        if site in self.sites:
            raise UpdateRejected("duplicate", f"site {site} already counted in round {self.number}")

    def record_partial(self, site: str, update_ids: tuple[str, ...], size_bytes: int) -> None:
        """Record a site's partial the strategy accepted (its update ids count as the round's clients)."""
        self.sites.append(site)
        self.update_ids.update(update_ids)
        self.update_bytes.append(size_bytes)

    def close(self) -> None:
        """Stop accepting updates."""
        self.phase = RoundPhase.CLOSED
