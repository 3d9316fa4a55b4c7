"""The aggregation interface: how the coordinator asks a strategy for the next global head.

One interface, as Flower's strategies: ``configure_round`` (settings and a fresh accumulator),
``offer`` (one update, checked, norm-bounded and folded in) and ``aggregate`` (the next head, from
never fewer than ``min_updates`` updates). Each strategy owns its accumulator; the service never
looks at a strategy's type.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from edgefl.coordinator.normbound import NormBound, clip_factor, scale_delta, update_norm
from edgefl.errors import UpdateRejected
from edgefl.head import validate_head
from edgefl.types import F32

MAX_UPDATE_EXAMPLES = 1_000_000
"""Most examples one update may claim (more is ``bad_value``); a site's weight is at most ``count x`` it."""

HOSTILE_SHARE = 0.2
"""Largest share of a FedAvg-family aggregate's updates that may be hostile (``Strategy.min_updates``)."""


def check_setting(ok: bool, name: str, value: object, rule: str) -> None:
    """Raise ValueError ``"{name} = {value}: must be {rule}"`` unless ``ok`` (a setting out of range)."""
    if not ok:
        raise ValueError(f"{name} = {value}: must be {rule}")


def sample_clients(
    available: Sequence[str], fraction: float, min_clients: int, rng: np.random.Generator
) -> tuple[str, ...]:
    """Choose the devices of a round: ``max(min_clients, ceil(fraction * n))`` of ``n``, without replacement.

    A sorted tuple, a function of the set of ``available`` ids and ``rng``. ValueError unless
    ``fraction`` is in (0, 1] and ``min_clients`` >= 1.

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


def array_from(raw: bytes, dtype: type[np.floating[Any]], shape: int | tuple[int, ...]) -> npt.NDArray[Any]:
    """A writable copy of the ``dtype`` array of ``shape`` held in ``raw`` (ValueError: it does not fit)."""
    return np.frombuffer(raw, dtype).reshape(shape).copy()


class Schedule(StrEnum):
    """How the service runs a round: a synchronous round, or one buffered-asynchronous server step."""

    SYNC = "sync"
    BUFFERED = "buffered"


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """What ``configure_round`` decides for one round (sent in the RoundAnnouncement).

    ``min_clients``: updates that close the round early (a buffered step: its buffer size);
    ``prox_mu``: FedProx proximal coefficient for the clients (0 = none); ``schedule``: SYNC
    (updates for this round and base version) or BUFFERED (from any earlier version, with staleness).
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

    ``delta_W`` float32 [D, K] and ``delta_b`` float32 [K]: local minus base global; ``num_examples``
    > 0; ``staleness``: versions published since its base (0 in synchronous rounds).
    """

    device: str
    delta_W: F32
    delta_b: F32
    num_examples: int
    staleness: int = 0


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What a strategy reports after ``aggregate`` (stdout line, log, JSON, dashboard).

    Updates ``clipped`` by the norm bound, the last ``norm_bound`` (inf: nothing offered), the DP
    ``epsilon`` so far at ``delta`` (NaN without DP).
    """

    clipped: int
    norm_bound: float
    epsilon: float = math.nan
    delta: float = math.nan


@dataclass(frozen=True, slots=True)
class SiteSums:
    """A site's share of a round: exported by ``Strategy.site_sums``, folded at the root by ``offer_sums``.

    ``combine``: ``"sum"`` (``W`` float64 [D, K], ``b`` float64 [K] are weighted sums of bounded
    deltas, ``weight`` their total) or ``"median"`` / ``"trimmed-mean"`` (the site's robust estimate);
    ``count`` updates covered, ``clipped`` of them by the site's norm bound.
    """

    combine: str
    W: npt.NDArray[np.float64]
    b: npt.NDArray[np.float64]
    weight: float
    count: int
    clipped: int


class Strategy(ABC):
    """Interface of every aggregation strategy: ``configure_round``, ``offer``, ``aggregate``.

    The base class checks each offered update, bounds its norm (``NormBound``) and counts clipped
    updates by device; subclasses own the accumulator (``_begin``, ``_fold``, ``_aggregate``) and any
    ``server_state`` (restored by ``refuse`` when the service refuses the head).

    ``local_epochs``, ``lr``, ``batch_size``: the clients' training settings sent with each round;
    ``min_clients`` updates close a round early (and ``sample_clients`` chooses at least as many);
    ``deadline_s``: seconds a round stays open; ``server_lr``: eta; ``fraction`` in (0, 1] of the
    available devices is asked each round, sampled with ``seed``; ``clip_norm``, ``clip_multiplier``:
    as ``NormBound`` (which warms up on ``max(3, 2 tolerate + 1)`` norms); ``tolerate`` >= 0 hostile
    devices every round withstands (``min_updates``). ValueError on out-of-range parameters.
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
        check_setting(0.0 < fraction <= 1.0, "fraction", fraction, "in (0, 1]")
        check_setting(tolerate >= 0, "tolerate", tolerate, ">= 0")
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
        self._pending_sums: list[tuple[SiteSums, float]] = []  # a root's sum partials and their mean norms
        self._round_clipped = 0
        self._last_bound = math.inf
        self._saved: dict[str, F32] = {}

    # -- the interface ----------------------------------------------------------------------------
    @property
    def min_updates(self) -> int:
        """Fewest updates a round may aggregate and still withstand ``tolerate`` hostile ones.

        The FedAvg family's: ``n >= tolerate / HOSTILE_SHARE`` keeps the hostile pull to a fifth of
        the bound, and ``2 tolerate + 1`` keeps the warm-up norms mostly honest; 1 for no tolerance.
        """
        if self.tolerate == 0:
            return 1
        return max(2 * self.tolerate + 1, math.ceil(self.tolerate / HOSTILE_SHARE - 1e-9))

    def tolerance(self) -> str:
        """What the strategy withstands, e.g. ``"tolerates 1 hostile device of 5"`` (start line)."""
        if self.tolerate == 0:
            return "tolerates no hostile device"
        dev = "device" if self.tolerate == 1 else "devices"
        return f"tolerates {self.tolerate} hostile {dev} of {self.min_updates}"

    def round_config(self, round_no: int) -> RoundConfig:
        """Settings of round ``round_no``: ``min_clients`` is at least ``min_updates``."""
        need = max(self.min_clients, self.min_updates)
        return RoundConfig(self.local_epochs, self.lr, self.batch_size, need, self.deadline_s)

    def configure_round(self, round_no: int, shape: tuple[int, int]) -> RoundConfig:
        """Begin round ``round_no`` (1-based): a fresh accumulator for heads of ``shape`` (D, K)."""
        self._shape = shape
        self._pending = []
        self._pending_sums = []
        self._round_clipped = 0
        self._last_bound = math.inf
        self.accepted = 0
        self.norm_bound.begin()
        self._begin(shape)
        return self.round_config(round_no)

    def offer(self, update: Offer) -> None:
        """Check one update, bound its norm and fold it into the round's accumulator.

        Raises UpdateRejected, the accumulator unchanged: ``no_round`` (``configure_round`` not
        called), ``bad_shape``, ``no_examples``, ``bad_value``, ``not_finite`` (a NaN/inf value, or a
        norm that overflows float64), or a strategy's own reason (``too_many``, ``too_stale``).
        """
        self._check_shape("delta", update.delta_W, update.delta_b)
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
        """The next global head from the current one (``W`` float32 [D, K], ``b`` float32 [K]).

        Returns the new float32 (W, b), not yet checked (see ``aggregate_checked``); raises ValueError
        if no update was accepted in the round.
        """
        self._drain_sums()
        self._drain()
        if self.accepted == 0:
            raise ValueError(f"{self.name}: no update to aggregate")
        self._saved = dict(self.server_state)
        self.norm_bound.commit()
        return self._aggregate(W.astype(np.float32), b.astype(np.float32))

    def site_sums(self) -> SiteSums:
        """Export the round's accumulator as a site's share (ValueError: no update, or no site form)."""
        self._drain()
        if self.accepted == 0:
            raise ValueError(f"{self.name}: no update to export")
        return self._site_sums()

    def offer_sums(self, sums: SiteSums) -> None:
        """Fold one site's share into the round's accumulator (the root role).

        Sums are bounded together at ``aggregate``. Raises UpdateRejected: ``no_round``, ``bad_shape``,
        ``not_finite``, ``bad_value`` (another combine rule, a non-positive weight, a weight above
        ``count x MAX_UPDATE_EXAMPLES``, or a mean beyond a fixed norm bound, which its updates were
        held to: refused at once).
        """
        self._check_shape("partial", sums.W, sums.b)
        norm = update_norm(sums.W, sums.b)
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
        self._last_bound = bound if bound is not None else self._last_bound
        if sums.combine != "sum":
            self._fold_sums(sums)
        else:  # bounded once the round's partials are all in (``_drain_sums``)
            self._pending_sums.append((sums, mean_norm))
        self.accepted += sums.count
        self._round_clipped += sums.clipped

    def _check_shape(self, what: str, W: npt.NDArray[Any], b: npt.NDArray[Any]) -> None:
        """Refuse a delta before ``configure_round`` (``no_round``) or of another shape (``bad_shape``)."""
        shape = self._shape
        if shape is None:
            raise UpdateRejected("no_round", "no round configured")
        if W.shape != shape or b.shape != (shape[1],):
            raise UpdateRejected("bad_shape", f"{what} {W.shape}/{b.shape}, head {shape}")

    def bound_site_weights(self) -> None:
        """Bound each site's claimed weight per update at the root (``offer_sums``).

        A partial's weight per update is at most the median weight per update of the round's partials,
        or of the last round's when lower (why: ``docs/security.md``).
        """
        self.norm_bound.weight_multiplier = 1.0
        self.norm_bound.history_warmup = 1  # a root hears a few sites a round, not many devices
        self.norm_bound.begin()

    def _drain_sums(self) -> None:
        """Bound the round's sum partials by the lower of the last and this round's caps; fold them in."""
        pending, self._pending_sums = self._pending_sums, []
        if not pending:
            return
        nb = self.norm_bound
        cap, bound = nb.weight_cap(), nb.history_bound()
        if math.isfinite(nb.weight_multiplier):
            cap = min(cap, nb.weight_multiplier * float(np.median([p.weight / p.count for p, _ in pending])))
        if nb.clip_norm is None:
            bound = min(bound, nb.multiplier * float(np.median([m for _, m in pending])))
        for sums, mean_norm in pending:
            bounded, scaled = self._bounded_sum(sums, mean_norm, cap, bound)
            self._fold_sums(bounded)
            self._round_clipped += sums.count if scaled else 0

    def _bounded_sum(
        self, sums: SiteSums, mean_norm: float, cap: float, bound: float
    ) -> tuple[SiteSums, bool]:
        """A sum partial scaled to its caps (weight per update, mean norm), and whether it was scaled."""
        per = sums.weight / sums.count
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
        """The round's accumulator as CBOR-able values for the state file (ValueError: no round open)."""
        if self._shape is None:
            raise ValueError("no round configured")
        pending = [
            [u.device, u.delta_W.tobytes(), u.delta_b.tobytes(), u.num_examples, u.staleness, norm]
            for u, norm in self._pending
        ]
        sums = [
            [p.W.tobytes(), p.b.tobytes(), p.weight, p.count, p.clipped, m] for p, m in self._pending_sums
        ]
        return {
            "accepted": self.accepted,
            "clipped": self._round_clipped,
            "norms": list(self.norm_bound.norms),
            "claims": list(self.norm_bound.claims),
            "pending": pending,
            "sums": sums,
            "acc": self._snapshot(),
        }

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back a :meth:`snapshot` after ``configure_round`` (ValueError, KeyError, TypeError: no fit)."""
        shape = self._shape
        if shape is None:
            raise ValueError("no round configured")
        self._restore(snap["acc"], shape)
        self.accepted = int(snap["accepted"])
        self._round_clipped = int(snap["clipped"])
        self.norm_bound.norms, self.norm_bound.claims = [], []
        for norm, claim in zip(snap["norms"], snap["claims"], strict=True):
            self.norm_bound.observe(float(norm), float(claim))
        self._pending, self._pending_sums = [], []
        for dev, w, b, n, st, norm in snap["pending"]:
            dW, db = array_from(w, np.float32, shape), array_from(b, np.float32, shape[1])
            self._pending.append((Offer(str(dev), dW, db, int(n), int(st)), float(norm)))
        for w, b, weight, count, clipped, m in snap["sums"]:
            sW, sb = array_from(w, np.float64, shape), array_from(b, np.float64, shape[1])
            sums = SiteSums("sum", sW, sb, float(weight), int(count), int(clipped))
            self._pending_sums.append((sums, float(m)))

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
        """Devices asked to train in round ``round_no`` of the ``available`` ones (``sample_clients``)."""
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

    def step(self, W: F32, b: F32, mean_dW: F32, mean_db: F32) -> tuple[F32, F32]:
        """Server step from the round's mean delta: ``W + server_lr * mean_dW`` (and b alike).

        ``W``, ``mean_dW`` float32 [D, K]; ``b``, ``mean_db`` float32 [K]; returns the new (W, b),
        float32. The server optimisers (``coordinator/optimisers.py``) replace ``_move``, one array's step.
        """
        return self._move("W", W, mean_dW), self._move("b", b, mean_db)

    def _move(self, name: str, x: F32, mean_delta: F32) -> F32:
        """The server step of the head's array ``name`` ("W" or "b"): ``x + server_lr * mean_delta``."""
        out: F32 = (x + np.float32(self.server_lr) * mean_delta).astype(np.float32)
        return out

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
        """What must survive a restart (CBOR-able): the norm history and the server optimiser's state."""
        server = {k: [list(v.shape), v.astype(np.float32).tobytes()] for k, v in self.server_state.items()}
        return {"bound": self.norm_bound.snapshot(), "server": server}

    def restore_durable(self, doc: Mapping[str, Any]) -> None:
        """Put back a :meth:`durable_state` (ValueError, KeyError, TypeError: it does not fit)."""
        self.norm_bound.restore(doc["bound"])
        server: dict[str, F32] = {}
        for k, (shape, raw) in doc["server"].items():
            server[str(k)] = array_from(raw, np.float32, tuple(int(n) for n in shape))
        self.server_state.clear()
        self.server_state.update(server)


def aggregate_checked(strategy: Strategy, W: F32, b: F32) -> tuple[F32, F32, UpdateRejected | None]:
    """Aggregate a round and keep the result only if the agents would accept it (``validate_head``).

    ``W`` float32 [D, K], ``b`` float32 [K]: the current head. Returns ``(W, b, None)`` with the new
    head, or the current head and the refusal (``too_few`` below ``strategy.min_updates``, nothing
    aggregated; ``not_finite``, ``bad_value``, ``bad_shape``, ``bad_dtype``: server state restored).
    Raises ValueError if no update was accepted in the round.
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
