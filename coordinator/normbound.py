"""Bounds on what one update may move: its joint L2 norm and its claimed weight, from the fleet's history.

A fixed bound C, or ``multiplier x`` a median norm capped by the fleet's history (``NormBound``); the
maths in pure functions. ``docs/security.md``, "Norm bound", says why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from edgefl.types import F32


def update_norm(delta_W: npt.NDArray[np.floating[Any]], delta_b: npt.NDArray[np.floating[Any]]) -> float:
    """Joint L2 norm ``sqrt(||dW||^2 + ||db||^2)`` of float [D, K], [K] in float64 (inf, nan: not finite).

    Source: Abadi et al. 2016, Algorithm 1 (per-example norm); McMahan et al. 2018 (per-user norm).
    """
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is the answer (inf), not a warning
        sq = float(np.sum(np.square(delta_W, dtype=np.float64)))
        sq += float(np.sum(np.square(delta_b, dtype=np.float64)))
    return math.sqrt(sq) if sq >= 0 else math.nan


def clip_factor(norm: float, bound: float) -> float:
    """Factor in [0, 1] that brings an update of L2 norm ``norm`` within ``bound``: ``min(1, bound / norm)``.

    Source: Abadi et al. 2016, Algorithm 1 (``g / max(1, ||g|| / C)``).
    """
    return min(1.0, bound / norm) if norm > 0 else 1.0


def scale_delta(delta: F32, factor: float) -> F32:
    """``delta * factor`` computed in float64 (a 3e38 value times 1e-40 stays exact), as float32."""
    if factor == 1.0:
        return delta
    out: F32 = (delta.astype(np.float64) * factor).astype(np.float32)
    return out


class FleetHistory:
    """Honest-looking values (update norms, example counts) of the last committed round, and their median.

    The open round's values (:meth:`add`, the first ``per_round``) replace the history at :meth:`commit`.
    """

    def __init__(self, per_round: int = 1024) -> None:
        self.per_round = per_round
        self._last: list[float] = []
        self._open: list[float] = []

    def add(self, value: float) -> None:
        """Note one value of the open round (ignored beyond ``per_round``)."""
        if len(self._open) < self.per_round:
            self._open.append(float(value))

    def discard(self) -> None:
        """Forget the open round's values (its aggregate was not adopted)."""
        self._open = []

    def commit(self) -> None:
        """The open round's values, if any, become the history."""
        if self._open:
            self._last = self._open
        self._open = []

    def __len__(self) -> int:
        """Values in the committed history."""
        return len(self._last)

    def median(self) -> float:
        """Median of the committed history (NaN when it is empty)."""
        return float(np.median(self._last)) if self._last else math.nan

    def snapshot(self) -> list[list[float]]:
        """The committed round's values as a list of rounds (CBOR-able)."""
        return [list(self._last)] if self._last else []

    def restore(self, rounds: Sequence[Sequence[float]]) -> None:
        """Put back a :meth:`snapshot`: its last round with values (non-finite or negative ones dropped)."""
        self._last, self._open = [], []
        for r in rounds:
            kept = [float(v) for v in r if math.isfinite(float(v)) and float(v) >= 0][: self.per_round]
            if kept:
                self._last = kept


class NormBound:
    """Bound on each update's joint L2 norm, and on its weight: fixed, or from the fleet's history.

    ``clip_norm`` > 0: a fixed bound C. None: adaptive, ``multiplier`` (>= 1) x the lower of the medians
    of the fleet's history (``FleetHistory``) and of the round's first ``warmup`` (>= 1) norms
    (``docs/security.md``, "Norm bound"). The weight (claimed examples) is bounded alike by
    ``weight_multiplier`` (inf: none; the root sets it, ``Strategy.bound_site_weights``). ValueError on
    out-of-range parameters.

    Source: fixed clipping as McMahan et al. 2018; a median-based bound as Sun et al. 2019 ("Can You
    Really Backdoor Federated Learning?"), taken over past rounds as Andrew et al. 2021 (adaptive clipping).
    """

    def __init__(self, clip_norm: float | None = None, *, multiplier: float = 2.0, warmup: int = 3) -> None:
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm = {clip_norm}: must be > 0")
        if not multiplier >= 1.0 or warmup < 1:
            raise ValueError(f"clip_multiplier = {multiplier}, warmup = {warmup}: need >= 1")
        self.clip_norm = clip_norm
        self.multiplier = multiplier
        self.warmup = warmup
        self.weight_multiplier = math.inf
        self.history = FleetHistory()
        self.weights = FleetHistory()
        self.history_warmup = warmup  # values the history needs to set a round's bounds
        self.norms: list[float] = []  # the round's first norms and claims, while there is no history
        self.claims: list[float] = []
        self._bound: float | None = clip_norm
        self._history_bound: float | None = None
        self._weight_cap: float | None = math.inf

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
            self._bound = self.bound()
        if self._weight_cap is None and len(self.claims) >= self.warmup:
            self._weight_cap = self.weight_cap()

    def history_bound(self) -> float:
        """The bound the history alone sets for this round: fixed, else from the last round (inf: none)."""
        if self.clip_norm is not None:
            return self.clip_norm
        h = self._history_bound
        return math.inf if h is None else h

    def ready(self) -> bool:
        """True when the bounds can be applied (fixed, or ``warmup`` norms of the round seen)."""
        return self._bound is not None and self._weight_cap is not None

    def bound(self) -> float:
        """The norm bound now: fixed, else from the history and the round's norms so far (inf: neither)."""
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
        self.history.restore(snap["norms"])
        self.weights.restore(snap["weights"])
