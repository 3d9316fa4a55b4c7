"""``robustness.tolerate``: each rule's fewest updates, the history-based norm bound, clipped server steps.

Pure strategy maths on arrays checked by hand (the service's use of it: tests/test_robustness.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.normbound import NormBound, update_norm
from edgefl.coordinator.optimisers import FedAvgM
from edgefl.coordinator.privacy import DPFedAvg
from edgefl.coordinator.robust import TrimmedMean, trimmed_minimum
from edgefl.coordinator.strategies import STRATEGY_NAMES, make_strategy
from edgefl.coordinator.strategy import Offer, Strategy, aggregate_checked

W0, B0 = np.zeros((1, 2), np.float32), np.zeros(2, np.float32)


def offer(s: Strategy, dev: str, w: tuple[float, float], b: tuple[float, float] = (0.0, 0.0)) -> None:
    s.offer(Offer(dev, np.array([w], np.float32), np.array(b, np.float32), 10))


def test_shipped_minimum_of_each_rule_by_hand() -> None:
    assert [trimmed_minimum(0.2, t) for t in (0, 1, 2, 3)] == [1, 5, 10, 15]
    assert [trimmed_minimum(0.25, t) for t in (1, 2)] == [4, 8]
    assert trimmed_minimum(0.45, 1) == 3  # floor(0.45 x 3) = 1, and 2t + 1 = 3
    want = {"median": 3, "trimmed-mean": 5, "fedavg": 5, "fedprox": 5, "fedavgm": 5, "fedadam": 5,
            "fedyogi": 5, "fedbuff": 5}  # fmt: skip
    for name in STRATEGY_NAMES:
        s = make_strategy(name, tolerate=1, min_clients=2)
        assert s.min_updates == want[name], name
        floor = 3 if name == "fedbuff" else 2  # fedbuff: its buffer size
        assert s.configure_round(1, (1, 2)).min_clients == max(want[name], floor), name
    assert make_strategy("trimmed-mean", tolerate=1).tolerance() == "tolerates 1 hostile device of 5"
    assert make_strategy("median", tolerate=2).tolerance() == "tolerates 2 hostile devices of 5"
    assert make_strategy("fedavg", tolerate=2).tolerance() == "tolerates 2 hostile devices of 10"
    assert make_strategy("fedavg").tolerance() == "tolerates no hostile device"
    eight = make_strategy("trimmed-mean", tolerate=1, min_clients=8)
    assert eight.configure_round(1, (1, 2)).min_clients == 8
    dp = DPFedAvg(FedAvg(tolerate=1), clip_norm=1.0, noise_multiplier=1.0, expected_clients=3.0)
    assert dp.min_updates == 5
    with pytest.raises(ValueError, match="trims nothing"):
        TrimmedMean(trim_fraction=0.0, tolerate=1)
    with pytest.raises(ValueError, match="needs 10 updates"):
        TrimmedMean(trim_fraction=0.2, tolerate=2, max_updates=8)
    with pytest.raises(ValueError, match="tolerate = -1"):
        FedAvg(tolerate=-1)


def test_shipped_round_below_the_minimum_is_refused_too_few_and_keeps_the_head() -> None:
    """The issue's attack: a round closing at 2 updates, one of them x -10. Trimmed mean (beta 0.2,
    tolerate 1) refuses to aggregate fewer than 5: ``too_few``, the head and server state kept."""
    s = TrimmedMean(trim_fraction=0.2, tolerate=1, min_clients=2)
    s.configure_round(1, (1, 2))
    offer(s, "evil", (-10.0, -10.0))
    offer(s, "good", (1.0, 1.0))
    W1, _, refusal = aggregate_checked(s, W0, B0)
    assert refusal is not None and refusal.reason == "too_few"
    assert "2 updates, trimmed-mean needs 5" in refusal.detail
    np.testing.assert_array_equal(W1, W0)
    for dev, v in (("a", 1.0), ("b", 1.2), ("c", 0.8)):
        offer(s, dev, (v, v))
    W2, _, refusal = aggregate_checked(s, W0, B0)
    assert refusal is None  # sorted per coordinate: -10, 0.8, 1, 1, 1.2 → trimmed mean of 0.8, 1, 1
    np.testing.assert_allclose(W2, [[2.8 / 3, 2.8 / 3]], rtol=1e-6)


def test_shipped_adaptive_bound_comes_from_the_fleets_history_never_the_round_alone() -> None:
    """Round 1 warms up on its first three norms (0.6, 0.8, 1.6 → bound 2 x 0.8 = 1.6). In round 2 two
    hostile updates of norm 100 arrive first: the round's first three norms (100, 100, 0.5) would
    set 200, the history caps it at 2 x median of round 1's honest-looking norms (1.6): both are
    clipped to 1.6. The bound is the lower of the two, so the round can tighten it, never widen it."""
    s = FedAvg()
    s.configure_round(1, (1, 2))
    for dev, v in (("a", 0.6), ("b", 0.8), ("c", 1.6)):
        offer(s, dev, (v, 0.0))
    assert s.norm_bound.bound() == pytest.approx(1.6)  # 2 x median(0.6, 0.8, 1.6)
    aggregate_checked(s, W0, B0)
    s.configure_round(2, (1, 2))
    assert s.norm_bound.bound() == pytest.approx(1.6)  # before anything arrives: the history's
    offer(s, "evil1", (100.0, 0.0))
    offer(s, "evil2", (100.0, 0.0))
    offer(s, "a", (0.5, 0.0))
    W1, _, _ = aggregate_checked(s, W0, B0)
    assert s.clipped == {"evil1": 1, "evil2": 1}
    np.testing.assert_allclose(W1, [[(1.6 + 1.6 + 0.5) / 3, 0.0]], rtol=1e-6)
    # round 3's history: round 2's norms, the clipped ones at the bound (1.6, 1.6, 0.5); the round's
    # own first three (0.1, 0.1, 0.2) tighten it to 2 x 0.1
    s.configure_round(3, (1, 2))
    assert s.norm_bound.bound() == pytest.approx(2 * 1.6)
    for dev, v in (("a", 0.1), ("b", 0.1), ("c", 0.2)):
        offer(s, dev, (v, 0.0))
    assert s.norm_bound.bound() == pytest.approx(0.2)


def test_shipped_history_is_o1_per_update_and_bounded() -> None:
    nb = NormBound(None, warmup=3)
    for _ in range(50):
        nb.begin()
        for i in range(3000):
            nb.accept(1.0 + (i % 7), 1.0)
        nb.commit()
        assert len(nb.history) <= nb.history.per_round
    assert nb.norms == []  # nothing of the round kept once the history bounds it


def test_shipped_momentum_step_is_bounded_per_coordinate_by_twice_the_rounds_mean() -> None:
    """FedAvgM (beta 0.9, fixed bound 4): a steady mean delta (1, 0) would grow the momentum buffer
    towards 10; bounded per coordinate by twice the round's mean, it goes 1, 1.9, then stays at 2."""
    s = FedAvgM(server_momentum=0.9, clip_norm=4.0)
    W, b = W0, B0
    for r, want in zip(range(1, 6), (1.0, 1.9, 2.0, 2.0, 2.0), strict=True):
        s.configure_round(r, (1, 2))
        offer(s, "a", (1.0, 0.0))
        W1, b1, _ = aggregate_checked(s, W, b)
        assert update_norm(W1 - W, b1 - b) == pytest.approx(want, rel=1e-6)
        W, b = W1, b1
    np.testing.assert_allclose(W, [[8.9, 0.0]], rtol=1e-5)


def test_shipped_fedadam_step_is_bounded_per_coordinate() -> None:
    """The adaptive step moves each coordinate at most ``COORDINATE_FACTOR`` (2) x the round's mean."""
    s = make_strategy("fedadam", clip_norm=0.04, server_lr=1.0)
    s.configure_round(1, (1, 2))
    offer(s, "a", (0.01, 0.0))
    W1, b1, _ = aggregate_checked(s, W0, B0)
    np.testing.assert_allclose(W1, [[0.02, 0.0]], rtol=1e-5)  # unbounded: 0.41 (m / (sqrt(v) + tau))
    np.testing.assert_array_equal(b1, B0)


def test_shipped_durable_state_round_trips_the_history_and_the_server_state() -> None:
    s = FedAvgM(server_momentum=0.5)
    s.configure_round(1, (1, 2))
    for dev, v in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        offer(s, dev, (v, 0.0))
    aggregate_checked(s, W0, B0)
    doc = s.durable_state()
    t = FedAvgM(server_momentum=0.5)
    t.restore_durable(doc)
    t.configure_round(2, (1, 2))
    assert t.norm_bound.bound() == pytest.approx(4.0)  # 2 x median(1, 2, 3), with no update yet
    np.testing.assert_array_equal(t.server_state["v_W"], s.server_state["v_W"])
