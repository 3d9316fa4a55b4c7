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
"""The strategy of ``edgefl coordinator`` when none is named: the coordinate-wise median after the
norm bound. Of five devices one hostile: the median's breakdown point is 1/2 (Yin et al. 2018), a
trimmed mean of 5 at beta 0.2 trims exactly one value per side and no more; on ``bench/poison.py``'s
six partitions only the median kept every attack within 0.03 of its clean run, at the same clean
accuracy (docs/benchmarks.md, "Poisoning")."""


def make_strategy(name: str, **kwargs: Any) -> Strategy:
    """Build a strategy by name.

    Parameters
    ----------
    name : str
        One of ``STRATEGY_NAMES``: fedavg | fedprox | fedavgm | fedadam | fedyogi | median |
        trimmed-mean | fedbuff.
    **kwargs
        Passed to the class (``Strategy``'s settings plus the strategy's own, e.g. ``prox_mu``,
        ``server_momentum``, ``tau``, ``trim_fraction``, ``buffer_size``).

    Returns
    -------
    Strategy

    Raises
    ------
    ValueError
        If the name is unknown.
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
