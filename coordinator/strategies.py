"""Every aggregation strategy by name: what a profile's ``strategy.name`` builds, and the default."""

from __future__ import annotations

from typing import Any

from edgefl.coordinator.fedavg import FedAvg, FedProx
from edgefl.coordinator.fedbuff import FedBuff
from edgefl.coordinator.optimisers import FedAdam, FedAvgM, FedYogi
from edgefl.coordinator.robust import Median, TrimmedMean
from edgefl.coordinator.strategy import Strategy

STRATEGY_NAMES = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "median", "trimmed-mean", "fedbuff")
DEFAULT_STRATEGY = "median"
"""The strategy of ``edgefl coordinator`` when none is named (``docs/benchmarks.md``, "Poisoning")."""


def make_strategy(name: str, **kwargs: Any) -> Strategy:
    """Build a strategy by name.

    ``name``: one of ``STRATEGY_NAMES``; ``kwargs``: ``Strategy``'s settings plus the strategy's own
    (``prox_mu``, ``server_momentum``, ``tau``, ``trim_fraction``, ``buffer_size``...). Raises
    ValueError if the name is unknown.
    """
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
