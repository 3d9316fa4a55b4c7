"""Privacy accounting helpers for tests and benches (never shipped)."""

from __future__ import annotations

from edgefl.coordinator.privacy import ledger_epsilon


def dp_epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> float:
    """Epsilon of ``rounds`` DP-FedAvg rounds of one setting: :func:`ledger_epsilon` of one run."""
    return ledger_epsilon([(noise_multiplier, sampling_rate, rounds)], delta)
