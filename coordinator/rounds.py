"""One federated round's state machine at the coordinator: open → collecting → closed; and when to open one.

:class:`Round` checks who may take part and keeps the round's figures (the strategy owns what is
aggregated); how many updates close it lives only in :attr:`Round.close_at`. :class:`Pacing` says when
a service opens the next round; :class:`FleetState` is what the fleet page shows of both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum, auto
from typing import Any

from edgefl.errors import UpdateRejected
from edgefl.wire.rounds import Update


class RoundPhase(StrEnum):
    """Where a round is in its life."""

    OPEN = "open"
    CLOSED = "closed"


@dataclass
class Round:
    """State of one round: ``number`` (1-based), the ``base_version`` devices train from, head ``shape``.

    It closes with what it has ``deadline_s`` after opening, or early at :attr:`close_at` updates
    (``min_clients``, ``quorum`` of the devices asked, never below the strategy's ``min_updates``), or
    at a root at ``expected_sites`` partials. ``selected``: the devices asked (None: any); ``online``:
    those online at the opening; ``check_round`` False in a buffered step (FedBuff), where updates of
    earlier rounds are welcome.
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
    quorum: float | None = None
    min_updates: int = 1
    opened_at: float = field(default_factory=time.monotonic)
    phase: RoundPhase = RoundPhase.OPEN
    devices: list[str] = field(default_factory=list)
    update_ids: set[str] = field(default_factory=set)
    update_bytes: list[int] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)
    declined: list[str] = field(default_factory=list)  # devices that sent a Decline
    empty: list[str] = field(default_factory=list)  # of those, stores empty (no_samples): not asked
    # kept in step with ``devices`` and ``declined``: admitting an update is O(1), not O(round)
    _tally: _Answered | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def clients(self) -> int:
        """Updates accepted so far (directly, or covered by the partials of sites)."""
        return len(self.update_ids)

    @property
    def deadline_at(self) -> float:
        """Monotonic time (s) at which the round closes regardless."""
        return self.opened_at + self.deadline_s

    @property
    def asked(self) -> int:
        """Devices asked to take part: the selection, else those ready at the opening or answering since.

        A device that declined because its store is empty (:attr:`empty`) is not one the round waits for.
        """
        if self.selected is not None:
            return len(self.selected) - len(self.empty)
        tally = self.answered()  # |online ∪ answered| = |online| + |answered| - |answered ∩ online|
        return len(self.online) + len(tally.members) - tally.of_online - len(self.empty)

    @property
    def close_at(self) -> int:
        """Updates that close the round early: ``ceil(quorum x asked)``, at least min_clients, min_updates."""
        floor = max(self.min_clients, self.min_updates, 1)
        if self.quorum is None:
            return floor
        return max(math.ceil(self.quorum * self.asked - 1e-9), floor)

    def complete(self) -> bool:
        """True when :attr:`close_at` updates arrived, or every device asked answered or declined.

        Without a selection: every device online at the opening answered, one of them with a decline
        (or, none ready, only empty stores answered). At a root with ``expected_sites``: that many
        sites' partials arrived.
        """
        if self.expected_sites > 0:
            return len(self.sites) >= self.expected_sites
        tally = self.answered()
        if self.selected is not None and tally.of_selected >= len(self.selected):
            return True
        if (
            self.selected is None
            and self.declined
            and tally.of_online >= len(self.online)
            and (self.online or self.asked == 0)  # none ready at the opening: only empty stores answered
        ):
            return True
        return self.clients >= self.close_at

    def answered(self) -> _Answered:
        """Devices that answered (an update counted) or declined, caught up incrementally (O(new entries))."""
        tally = self._tally
        if (
            tally is None
            or tally.devices is not self.devices
            or tally.declined is not self.declined
            or tally.selected is not self.selected
            or tally.online is not self.online
            or tally.seen_devices > len(self.devices)
            or tally.seen_declined > len(self.declined)
        ):
            tally = self._tally = _Answered(self.devices, self.declined, self.selected, self.online)
        tally.catch_up()
        return tally

    def silent(self) -> list[str]:
        """The devices asked (the selection, else those online at the opening) that sent nothing it counted.

        Neither an update counted nor a decline; sorted.
        """
        pool = self.selected if self.selected is not None else self.online
        members = self.answered().members
        return sorted(d for d in pool if d not in members)

    def has_answered(self, device: str) -> bool:
        """True when ``device`` has an update counted or a decline in this round (O(1))."""
        return device in self.answered().members

    def admit(self, update: Update) -> None:
        """Check that the decoded ``update`` may take part in this round (not recorded yet: see ``record``).

        Raises ``UpdateRejected`` as :meth:`check_open`, or ``duplicate`` (same ``update_id`` or device).
        """
        self.check_open("update", update.device, update.round, update.base_version, self.check_round)
        if update.update_id in self.update_ids or update.device in self.answered().counted:
            raise UpdateRejected(
                "duplicate", f"update {update.update_id} from {update.device} already counted"
            )

    def check_open(
        self, what: str, device: str | None, round_no: int, base_version: int, check_round: bool = True
    ) -> None:
        """Check that a message (``what``) from ``device`` trained for (round, base version) may count.

        Raises UpdateRejected: ``round_closed``; with ``check_round`` ``stale_round`` (other round
        number), ``stale_base`` (other base version); ``not_selected`` (a ``device`` outside the selection).
        """
        if self.phase is not RoundPhase.OPEN:
            raise UpdateRejected("round_closed", f"round {self.number} is closed")
        if check_round and round_no != self.number:
            raise UpdateRejected("stale_round", f"{what} for round {round_no}, round {self.number} is open")
        if check_round and base_version != self.base_version:
            why = f"{what} from version {base_version}, round uses {self.base_version}"
            raise UpdateRejected("stale_base", why)
        if device is not None and self.selected is not None and device not in self.selected:
            raise UpdateRejected("not_selected", f"device {device} not selected for round {self.number}")

    def record(self, update: Update, size_bytes: int) -> None:
        """Record an update the strategy accepted (device, id, bytes on the wire)."""
        self.devices.append(update.device)
        self.update_ids.add(update.update_id)
        self.update_bytes.append(size_bytes)

    def admit_partial(self, site: str, round_no: int, base_version: int) -> None:
        """Check that a site's partial may count in this round (it is not recorded yet).

        Raises UpdateRejected as :meth:`check_open`, or ``duplicate`` (the site already counted; ids
        another site listed too are the root's business).
        """
        self.check_open(f"partial of {site}", None, round_no, base_version)
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


@dataclass(eq=False, slots=True)
class _Answered:
    """The devices of a round that answered (see :meth:`Round.answered`), taken in incrementally."""

    devices: list[str]
    declined: list[str]
    selected: frozenset[str] | None
    online: frozenset[str]
    counted: set[str] = field(default_factory=set)  # an update counted
    members: set[str] = field(default_factory=set)  # those and the decliners
    of_selected: int = 0  # members in the selection
    of_online: int = 0  # members online at the opening
    seen_devices: int = 0  # entries of ``devices`` and ``declined`` taken in
    seen_declined: int = 0

    def _add(self, device: str) -> None:
        if device in self.members:
            return
        self.members.add(device)
        if self.selected is not None and device in self.selected:
            self.of_selected += 1
        if device in self.online:
            self.of_online += 1

    def catch_up(self) -> None:
        """Take in what was appended to the round's lists since the last call."""
        n = len(self.devices)
        if self.seen_devices < n:
            for device in self.devices[self.seen_devices :]:
                self.counted.add(device)
                self._add(device)
            self.seen_devices = n
        n = len(self.declined)
        if self.seen_declined < n:
            for device in self.declined[self.seen_declined :]:
                self._add(device)
            self.seen_declined = n


class FleetPhase(StrEnum):
    """What a coordinator's fleet is doing (``fleet_state.state`` on its page; ``docs/operations.md``)."""

    COLLECTING = auto()  # a StrEnum's auto() value is the name in lower case: "collecting"
    WAITING_SAMPLES = auto()
    WAITING_DEVICES = auto()
    PAUSED = auto()
    FINISHED = auto()
    BROKER_UNREACHABLE = auto()


@dataclass(frozen=True, slots=True)
class FleetState:
    """The fleet's state as its page shows it: one phase, human words, and the numbers behind them.

    Each key: ``docs/operations.md``, "The round log and the fleet state" (``new_samples`` None: not
    reported).
    """

    state: FleetPhase
    text: str
    round: int = 0
    ready: int = 0
    needed: int = 0
    new_samples: int | None = None
    min_new_samples: int = 0
    asked: int | None = None
    counted: int | None = None
    close_at: int | None = None
    next_round_in_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON object of ``/api/status``'s ``fleet_state`` (every key always present)."""
        doc = dataclasses.asdict(self)
        doc["state"] = self.state.value
        doc["next_round_in_s"] = None if self.next_round_in_s is None else round(self.next_round_in_s, 1)
        return doc


@dataclass(frozen=True, slots=True)
class Pacing:
    """When a service opens its next round (``rounds.interval_s``, ``rounds.min_new_samples``).

    Once ``min_devices`` (>= 1) devices are ready, they report ``min_new_samples`` labelled samples
    stored since their last round, summed (a device that does not report the count holds no round back),
    and ``interval_s`` seconds passed since the last round started.
    """

    interval_s: float = 0.0
    min_new_samples: int = 0
    min_devices: int = 1

    def check(
        self, round_no: int, new_samples: Mapping[str, int | None], since_start_s: float | None
    ) -> FleetState:
        """The fleet's state before round ``round_no + 1`` (PAUSED, ``next_round_in_s = 0``: open it now).

        ``round_no``: the last round opened (0: none); ``new_samples``: the ready devices and the new
        labelled samples each reports (None: not reported); ``since_start_s``: since the last round
        started (None: none in this process). Returns WAITING_DEVICES, WAITING_SAMPLES or PAUSED.
        """
        ready = len(new_samples)
        reported = [n for n in new_samples.values() if n is not None]
        new = sum(reported) if reported else None
        state = functools.partial(
            FleetState,
            round=round_no,
            ready=ready,
            needed=self.min_devices,
            new_samples=new,
            min_new_samples=self.min_new_samples,
        )
        if ready < self.min_devices:
            text = f"waiting for devices: {ready} of {self.min_devices} ready"
            return state(FleetPhase.WAITING_DEVICES, text)
        gated = self.min_new_samples > 0 and new is not None and len(reported) == ready
        if gated and new is not None and new < self.min_new_samples:
            return state(FleetPhase.WAITING_SAMPLES, f"waiting: {new} of {self.min_new_samples} new samples")
        left = 0.0 if since_start_s is None else max(0.0, self.interval_s - since_start_s)
        text = f"paused: next round in {math.ceil(left)} s" if left > 0 else f"opening round {round_no + 1}"
        return state(FleetPhase.PAUSED, text, next_round_in_s=left)


def device_names(devices: Sequence[str], most: int = 10) -> str:
    """``"gw-2, gw-7"``: the first ``most`` of ``devices``, then ``"(+N more)"`` for the rest."""
    shown = ", ".join(devices[:most])
    return shown + (f" (+{len(devices) - most} more)" if len(devices) > most else "")
