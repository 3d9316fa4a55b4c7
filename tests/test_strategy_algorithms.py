from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgefl.coordinator.fedavg import FedAvg, FedProx
from edgefl.coordinator.fedbuff import FedBuff
from edgefl.coordinator.normbound import NormBound, clip_factor, update_norm
from edgefl.coordinator.optimisers import (
    FedAdam,
    FedAvgM,
    FedYogi,
    adam_moments,
    adaptive_step,
    bound_coordinates,
    server_momentum,
    yogi_moments,
)
from edgefl.coordinator.robust import Median, TrimmedMean, coordinate_median, trimmed_mean
from edgefl.coordinator.strategies import STRATEGY_NAMES, make_strategy
from edgefl.coordinator.strategy import Offer, aggregate_checked, sample_clients
from edgefl.errors import UpdateRejected


def f32(*x: float) -> np.ndarray:
    return np.array(x, np.float32)


def test_server_momentum_by_hand() -> None:
    v = server_momentum(None, f32(1.0, -2.0), 0.9)
    np.testing.assert_array_equal(v, [1.0, -2.0])
    v = server_momentum(v, f32(1.0, 0.0), 0.5)
    # 0.5 * [1, -2] + [1, 0] = [1.5, -1]
    np.testing.assert_array_equal(v, [1.5, -1.0])
    with pytest.raises(ValueError):
        server_momentum(v, f32(1.0), 0.5)
    with pytest.raises(ValueError):
        server_momentum(None, f32(1.0), 1.0)


def test_fedavgm_accumulates_momentum_over_rounds() -> None:
    s = FedAvgM(server_momentum=0.5, server_lr=1.0)
    W, b = np.zeros((1, 2), np.float32), np.zeros(2, np.float32)
    d = np.array([[2.0, 0.0]], np.float32)
    W, b = s.step(W, b, d, f32(0.0, 1.0))
    np.testing.assert_array_equal(W, [[2.0, 0.0]])
    W, b = s.step(W, b, d, f32(0.0, 1.0))
    # v = 0.5*2 + 2 = 3 → W = 2 + 3 = 5; b: v = 0.5 + 1 = 1.5 → 1 + 1.5
    np.testing.assert_array_equal(W, [[5.0, 0.0]])
    np.testing.assert_array_equal(b, [0.0, 2.5])


def test_adam_moments_by_hand() -> None:
    m, v = adam_moments(f32(0.0), f32(0.0), f32(2.0), 0.9, 0.99)
    np.testing.assert_allclose(m, [0.2], rtol=1e-6)      # 0.1 * 2
    np.testing.assert_allclose(v, [0.04], rtol=1e-6)     # 0.01 * 4
    m, v = adam_moments(m, v, f32(0.0), 0.9, 0.99)
    np.testing.assert_allclose(m, [0.18], rtol=1e-6)
    np.testing.assert_allclose(v, [0.0396], rtol=1e-6)


def test_yogi_second_moment_moves_additively() -> None:
    # v < d^2: v grows by (1-b2) d^2 (like Adam's target, but additive): 1 + 0.01*4 = 1.04
    _, v = yogi_moments(f32(0.0), f32(1.0), f32(2.0), 0.9, 0.99)
    np.testing.assert_allclose(v, [1.04], rtol=1e-6)
    # v > d^2: v shrinks by (1-b2) d^2: 10 - 0.04 = 9.96 (Adam would give 0.99*10 + 0.04 = 9.94)
    _, v = yogi_moments(f32(0.0), f32(10.0), f32(2.0), 0.9, 0.99)
    np.testing.assert_allclose(v, [9.96], rtol=1e-6)
    _, va = adam_moments(f32(0.0), f32(10.0), f32(2.0), 0.9, 0.99)
    np.testing.assert_allclose(va, [9.94], rtol=1e-6)


def test_adaptive_step_by_hand() -> None:
    # eta m / (sqrt(v) + tau) = 0.5 * 0.2 / (0.2 + 0.05)  (sqrt(0.04) = 0.2) = 0.4
    np.testing.assert_allclose(adaptive_step(f32(0.2), f32(0.04), 0.5, 0.05), [0.4], rtol=1e-6)


def test_bound_coordinates_by_hand() -> None:
    # |step_i| <= 2 |d_i|: 0.4 within 2 x 0.5; 0.4 cut to 0.2; -3 cut to -1; 0.3 cut to 0 where d = 0
    out = bound_coordinates(f32(0.4, 0.4, -3.0, 0.3), f32(0.5, -0.1, 0.5, 0.0), 2.0)
    np.testing.assert_allclose(out, [0.4, 0.2, -1.0, 0.0], rtol=1e-6)


def test_fedadam_first_round_by_hand() -> None:
    s = FedAdam(server_lr=0.1, beta1=0.9, beta2=0.99, tau=0.1)
    W, b = np.zeros((1, 1), np.float32), np.zeros(1, np.float32)
    W1, b1 = s.step(W, b, np.array([[1.0]], np.float32), f32(0.0))
    # m = 0.1, v = 0.99 * 0.01 + 0.01 * 1 = 0.0199, step = 0.1 * 0.1 / (sqrt(0.0199) + 0.1)
    expect = 0.1 * 0.1 / (np.sqrt(0.0199) + 0.1)
    np.testing.assert_allclose(W1, [[expect]], rtol=1e-5)
    # b: m = 0, so no move
    np.testing.assert_array_equal(b1, [0.0])


def test_fedyogi_differs_from_fedadam_after_two_rounds() -> None:
    a, y = FedAdam(server_lr=0.1, tau=0.01), FedYogi(server_lr=0.1, tau=0.01)
    W, b = np.zeros((1, 1), np.float32), np.zeros(1, np.float32)
    Wa, ba, Wy, by = W, b, W, b
    for d in (5.0, 0.1):
        Wa, ba = a.step(Wa, ba, np.array([[d]], np.float32), f32(0.0))
        Wy, by = y.step(Wy, by, np.array([[d]], np.float32), f32(0.0))
    assert Wa[0, 0] > 0 and Wy[0, 0] > 0
    # After the large delta, Yogi's v decays additively (slower than Adam's) → smaller second step.
    assert Wy[0, 0] < Wa[0, 0]


def test_coordinate_median_by_hand() -> None:
    ds = [f32(1.0, 10.0), f32(2.0, -5.0), f32(100.0, 0.0)]
    np.testing.assert_array_equal(coordinate_median(ds), [2.0, 0.0])
    # even count: mean of the middle two
    np.testing.assert_array_equal(coordinate_median([f32(1.0), f32(3.0), f32(7.0), f32(100.0)]), [5.0])
    with pytest.raises(ValueError):
        coordinate_median([])
    with pytest.raises(ValueError):
        coordinate_median([f32(1.0), f32(1.0, 2.0)])


def test_trimmed_mean_by_hand() -> None:
    ds = [f32(1.0), f32(2.0), f32(3.0), f32(4.0), f32(1000.0)]
    # beta 0.2 of 5 → drop 1 at each end: mean(2, 3, 4) = 3
    np.testing.assert_array_equal(trimmed_mean(ds, 0.2), [3.0])
    # beta 0.1 of 5 → floor(0.5) = 0 dropped: plain mean 202
    np.testing.assert_array_equal(trimmed_mean(ds, 0.1), [202.0])
    # per coordinate: the trimmed values differ by coordinate
    ds2 = [f32(0.0, 9.0), f32(1.0, 1.0), f32(9.0, 0.0), f32(2.0, 2.0)]
    np.testing.assert_array_equal(trimmed_mean(ds2, 0.25), [1.5, 1.5])
    with pytest.raises(ValueError):
        trimmed_mean(ds, 0.5)


def offer_all(s: Any, W: np.ndarray, dW: list[np.ndarray], db: list[np.ndarray], ns: list[int]) -> None:
    s.configure_round(1, W.shape)
    for k, (w, bb, n) in enumerate(zip(dW, db, ns, strict=True)):
        s.offer(Offer(f"d{k}", w, bb, n))


def test_robust_strategies_ignore_claimed_counts() -> None:
    W, b = np.zeros((1, 2), np.float32), np.zeros(2, np.float32)
    dW = [np.array([[1.0, 1.0]], np.float32), np.array([[2.0, 2.0]], np.float32),
          np.array([[-50.0, 99.0]], np.float32)]
    db = [f32(0.0, 1.0), f32(0.0, 2.0), f32(0.0, 3.0)]
    fixed: dict[str, Any] = {"clip_norm": 1e6}  # no clipping here: the robust rule alone
    med = Median(server_lr=1.0, **fixed)
    offer_all(med, W, dW, db, [1, 1, 10_000])
    W1, b1 = med.aggregate(W, b)
    np.testing.assert_array_equal(W1, [[1.0, 2.0]])
    np.testing.assert_array_equal(b1, [0.0, 2.0])
    tm = TrimmedMean(trim_fraction=0.34, **fixed)  # floor(0.34 * 3) = 1 per end → the median for 3
    offer_all(tm, W, dW, db, [1, 1, 1])
    W2, _ = tm.aggregate(W, b)
    np.testing.assert_array_equal(W2, [[1.0, 2.0]])
    small = Median(max_updates=2, tolerate=0, **fixed)
    with pytest.raises(UpdateRejected) as e:
        offer_all(small, W, dW, db, [1, 1, 1])
    assert e.value.reason == "too_many" and small.accepted == 2


def test_fedavg_offer_then_aggregate_is_the_weighted_mean() -> None:
    W, b = np.zeros((1, 1), np.float32), np.zeros(1, np.float32)
    s = FedAvg(clip_norm=1e6)
    dW = [np.array([[1.0]], np.float32), np.array([[4.0]], np.float32)]
    offer_all(s, W, dW, [f32(0.0), f32(2.0)], [2, 1])
    W1, b1 = s.aggregate(W, b)
    np.testing.assert_array_equal(W1, [[2.0]])  # (2*1 + 1*4)/3
    np.testing.assert_allclose(b1, [2.0 / 3.0], rtol=1e-6)
    with pytest.raises(ValueError, match="no update"):
        s.configure_round(2, (1, 1))
        s.aggregate(W, b)


def test_fedprox_sends_mu_in_round_config() -> None:
    cfg = FedProx(prox_mu=0.1, local_epochs=3).configure_round(4, (2, 2))
    assert cfg.prox_mu == 0.1 and cfg.local_epochs == 3
    assert FedAvg().configure_round(1, (2, 2)).prox_mu == 0.0
    with pytest.raises(ValueError):
        FedProx(prox_mu=-1.0)


def test_sample_clients_fraction_minimum_and_determinism() -> None:
    devs = [f"d{i}" for i in range(10)]
    rng = np.random.default_rng(0)
    got = sample_clients(devs, 0.3, 2, rng)
    assert len(got) == 3 and set(got) <= set(devs) and list(got) == sorted(got)
    assert len(sample_clients(devs, 0.05, 2, np.random.default_rng(0))) == 2  # minimum wins
    assert sample_clients(devs[:2], 0.5, 4, np.random.default_rng(0)) == ("d0", "d1")  # capped at n
    s = FedAvg(fraction=0.5, min_clients=2, seed=7)
    assert s.sample_clients(devs, 3) == s.sample_clients(list(reversed(devs)), 3)
    rounds = {s.sample_clients(devs, r) for r in range(1, 20)}
    assert len(rounds) > 1  # the choice changes from round to round
    assert FedAvg().sample_clients(devs, 1) == tuple(sorted(devs))
    assert FedAvg().sample_clients([], 1) == ()
    with pytest.raises(ValueError):
        sample_clients(devs, 0.0, 1, rng)


def test_make_strategy_names() -> None:
    kinds = {name: type(make_strategy(name)) for name in STRATEGY_NAMES}
    assert kinds["fedavg"] is FedAvg
    assert kinds["fedprox"] is FedProx and kinds["fedavgm"] is FedAvgM
    assert kinds["fedadam"] is FedAdam and kinds["fedyogi"] is FedYogi
    assert kinds["median"] is Median and kinds["trimmed-mean"] is TrimmedMean
    assert kinds["fedbuff"] is FedBuff
    assert make_strategy("fedprox", prox_mu=0.5).round_config(1).prox_mu == 0.5
    assert all(make_strategy(n).name == n for n in STRATEGY_NAMES)
    with pytest.raises(ValueError, match="unknown strategy"):
        make_strategy("fedsgd")


def test_update_norm_and_clip_factor_by_hand() -> None:
    assert update_norm(np.array([[3.0]], np.float32), f32(4.0)) == 5.0
    assert update_norm(np.array([[3e38, 3e38]], np.float32), f32(0.0)) == pytest.approx(3e38 * 2**0.5)
    assert update_norm(np.array([[np.inf]], np.float32), f32(0.0)) == np.inf
    assert clip_factor(5.0, 1.0) == 0.2
    assert clip_factor(0.5, 1.0) == 1.0
    assert clip_factor(0.0, 1.0) == 1.0


def test_norm_bound_fixed_and_adaptive_by_hand() -> None:
    fixed = NormBound(2.0)
    assert fixed.bound() == 2.0
    ad = NormBound(None, multiplier=2.0, warmup=3)
    for n in (1.0, 3.0):
        ad.observe(n)
    assert not ad.ready()
    ad.observe(1000.0)
    assert ad.ready() and ad.bound() == 6.0  # 2 x median(1, 3, 1000), frozen for the round
    ad.observe(5000.0)
    assert ad.bound() == 6.0
    ad.begin()  # nothing committed: no history yet
    assert ad.bound() == np.inf
    with pytest.raises(ValueError):
        NormBound(0.0)
    with pytest.raises(ValueError):
        NormBound(None, multiplier=0.5)


def test_every_strategy_bounds_norms_and_counts_clipped_by_device() -> None:
    """Norms 1, 1, 2 and 1000 (d3): adaptive bound 2 x median of the first three, 2. Before the third
    norm nothing is folded; d3 is clipped to 2, so FedAvg's mean is (1 + 1 + 2 + 2) / 4 = 1.5."""
    W, b = np.zeros((1, 1), np.float32), np.zeros(1, np.float32)
    dW = [np.array([[v]], np.float32) for v in (1.0, 1.0, 2.0, 1000.0)]
    db = [f32(0.0)] * 4
    for name in STRATEGY_NAMES:
        s = make_strategy(name)
        offer_all(s, W, dW, db, [1, 1, 1, 1])
        W1, _ = s.aggregate(W, b)
        assert s.clipped == {"d3": 1}, name
        assert s.report().clipped == 1 and s.report().norm_bound == 2.0, name
        assert float(W1[0, 0]) <= 2.0, name
    s = FedAvg()
    offer_all(s, W, dW, db, [1, 1, 1, 1])
    np.testing.assert_allclose(s.aggregate(W, b)[0], [[1.5]], rtol=1e-6)
    fixed = FedAvg(clip_norm=0.5)
    offer_all(fixed, W, dW, db, [1, 1, 1, 1])
    np.testing.assert_allclose(fixed.aggregate(W, b)[0], [[0.5]], rtol=1e-6)
    assert fixed.report().clipped == 4


def test_offer_refuses_non_finite_bad_shape_and_no_examples() -> None:
    s = FedAvg()
    with pytest.raises(UpdateRejected) as e:
        s.offer(Offer("d0", np.zeros((1, 1), np.float32), f32(0.0), 1))
    assert e.value.reason == "no_round"
    s.configure_round(1, (1, 1))
    cases = [
        (Offer("d0", np.array([[np.nan]], np.float32), f32(0.0), 1), "not_finite"),
        (Offer("d0", np.array([[1.0]], np.float32), f32(np.inf), 1), "not_finite"),
        (Offer("d0", np.zeros((2, 1), np.float32), f32(0.0), 1), "bad_shape"),
        (Offer("d0", np.zeros((1, 1), np.float32), f32(0.0), 0), "no_examples"),
    ]
    for upd, reason in cases:
        with pytest.raises(UpdateRejected) as e:
            s.offer(upd)
        assert e.value.reason == reason
    assert s.accepted == 0


def test_huge_update_is_clipped_exactly_not_overflowed() -> None:
    """A 3e38-valued update among three small ones: clipped in float64, the mean stays finite and small."""
    W, b = np.zeros((1, 2), np.float32), np.zeros(2, np.float32)
    dW = [np.array([[0.3, 0.4]], np.float32)] * 3 + [np.full((1, 2), 3e38, np.float32)]
    db = [np.zeros(2, np.float32)] * 4
    s = FedAvg()
    offer_all(s, W, dW, db, [1, 1, 1, 1])
    W1, _, refusal = aggregate_checked(s, W, b)
    assert refusal is None
    # d3 clipped to norm 2 x 0.5 = 1 along (1, 1)/sqrt(2): mean = (3 x (0.3, 0.4) + (0.7071, 0.7071)) / 4
    np.testing.assert_allclose(W1, [[(0.9 + 0.5**0.5) / 4, (1.2 + 0.5**0.5) / 4]], rtol=1e-5)


def test_aggregate_checked_refuses_a_head_out_of_the_agents_bound_and_restores_state() -> None:
    """With a fixed bound too loose for the head, FedAvgM's step leaves MAX_HEAD_ABS: refused, head and
    momentum kept."""
    W, b = np.zeros((1, 1), np.float32), np.zeros(1, np.float32)
    s = FedAvgM(server_momentum=0.5, clip_norm=1e9)
    offer_all(s, W, [np.array([[2.0]], np.float32)], [f32(0.0)], [1])
    W, b, refusal = aggregate_checked(s, W, b)
    assert refusal is None and W[0, 0] == 2.0
    v_before = s.server_state["v_W"].copy()
    offer_all(s, W, [np.array([[5e4]], np.float32)], [f32(0.0)], [1])
    W2, b2, refusal = aggregate_checked(s, W, b)
    assert refusal is not None and refusal.reason == "bad_value"
    assert W2[0, 0] == 2.0
    np.testing.assert_array_equal(s.server_state["v_W"], v_before)
    offer_all(s, W, [np.array([[1.0]], np.float32)], [f32(0.0)], [1])
    W3, _, _ = aggregate_checked(s, W2, b2)
    assert W3[0, 0] == 2.0 + 0.5 * 2.0 + 1.0  # the momentum of round 1, not of the refused round
