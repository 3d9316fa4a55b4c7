"""Federated accuracy: one device cannot set the fleet's figure by claiming a huge evaluation count.

Fast tier: ``federated_evaluation`` (coordinator/history.py) caps each device's weight at the low
median of the reported counts. Select with ``pytest -k hostile``.
"""

from __future__ import annotations

import math

import pytest

from edgefl.coordinator.history import federated_evaluation, personal_heads_summary

HONEST = [(0.90, 200), (0.92, 220), (0.94, 180), (0.88, 210)]


def test_hostile_huge_eval_count_moves_the_figure_by_its_share_only() -> None:
    clean, _, _ = federated_evaluation(HONEST)
    assert clean == pytest.approx((0.90 * 200 + 0.92 * 200 + 0.94 * 180 + 0.88 * 200) / 780)
    mean, worst, devices = federated_evaluation([*HONEST, (0.0, 10**12)])
    assert devices == 5
    # the cap is the low median of (180, 200, 210, 220, 1e12) = 210: gw-10 weighs 210 of 1010
    expected = (0.90 * 200 + 0.92 * 210 + 0.94 * 180 + 0.88 * 210 + 0.0 * 210) / 1010
    assert mean == pytest.approx(expected)
    assert mean > 0.7  # uncapped it would be 0.000 (the claim weighs 1e12 against 810)
    assert worst == 0.0  # the worst decile is the device's own figure, as before
    high, _, _ = federated_evaluation([(0.1, 100), (1.0, 10**9)])
    assert high == pytest.approx(0.55)  # two devices: the invented count weighs as much as the honest


def test_hostile_invalid_accuracies_and_counts_are_left_out() -> None:
    mean, _, devices = federated_evaluation([*HONEST, (50.0, 10**6), (-7.0, 10**6), (math.nan, 5), (0.5, 0)])
    assert devices == 4
    assert mean == pytest.approx(federated_evaluation(HONEST)[0])
    none_mean, none_worst, none = federated_evaluation([(1.5, 10)])
    assert none == 0 and math.isnan(none_mean) and math.isnan(none_worst)


def test_hostile_personal_heads_summary_is_capped_too() -> None:
    devices = {
        f"gw-{i}": {"personal_accuracy": a, "global_accuracy": a, "eval_count": n}
        for i, (a, n) in enumerate(HONEST)
    }
    devices["gw-10"] = {"personal_accuracy": 0.0, "global_accuracy": 0.0, "eval_count": 10**12}
    summary = personal_heads_summary(devices)
    assert summary is not None
    assert summary["devices"] == 5
    assert summary["global_mean"] == pytest.approx(federated_evaluation([*HONEST, (0.0, 10**12)])[0])
    assert summary["global_mean"] > 0.7
