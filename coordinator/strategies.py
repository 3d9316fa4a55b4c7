"""Every aggregation strategy by name: what a profile's ``strategy.name`` builds."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Final

from edgefl.coordinator.fedavg import FedAvg, FedProx
from edgefl.coordinator.fedbuff import FedBuff
from edgefl.coordinator.optimisers import FedAdam, FedAvgM, FedYogi
from edgefl.coordinator.profile import RobustnessConfig, RoundsConfig, StrategyConfig
from edgefl.coordinator.robust import Median, TrimmedMean
from edgefl.coordinator.strategy import Strategy

STRATEGIES: Final[dict[str, type[Strategy]]] = {
    cls.name: cls for cls in (FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, Median, TrimmedMean, FedBuff)
}
"""Each strategy class by its ``name`` (a profile's ``strategy.name``)."""
STRATEGY_NAMES = tuple(STRATEGIES)

ROUND_SETTINGS: Final = ("local_epochs", "lr", "batch_size", "min_clients", "deadline_s")
"""The ``[rounds]`` keys every strategy takes, under the same names."""


def make_strategy(name: str, **kwargs: Any) -> Strategy:
    """Build a strategy by name.

    ``name``: one of ``STRATEGY_NAMES``; ``kwargs``: ``Strategy``'s settings plus the strategy's own
    (``prox_mu``, ``server_momentum``, ``tau``, ``trim_fraction``, ``buffer_size``...). Raises
    ValueError if the name is unknown.
    """
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGY_NAMES)}")
    return cls(**kwargs)


def strategy_from_tables(
    name: str,
    rounds: RoundsConfig,
    settings: StrategyConfig | None = None,
    robustness: RobustnessConfig | None = None,
) -> Strategy:
    """Build the strategy ``name`` from a profile's ``[rounds]``, ``[strategy]`` and ``[robustness]`` tables.

    ``settings``: the strategy's own keys, those set (None: its default); ``robustness`` None keeps the
    strategies' defaults. Raises ValueError (unknown name, out-of-range value) or TypeError (a key the
    strategy does not take).
    """
    kwargs: dict[str, Any] = {key: getattr(rounds, key) for key in ROUND_SETTINGS}
    for f in fields(settings) if settings is not None else ():
        value = getattr(settings, f.name)
        if f.name != "name" and value is not None:
            kwargs[f.name] = value
    if robustness is not None:
        kwargs.update(
            clip_norm=robustness.norm_bound,
            clip_multiplier=robustness.adaptive_factor,
            tolerate=robustness.tolerate,
        )
    return make_strategy(name, **kwargs)
