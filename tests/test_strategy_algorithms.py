from __future__ import annotations

import numpy as np
import pytest

from edgefl.coordinator.fedbuff import FedBuff
from edgefl.coordinator.strategy import (
    STRATEGY_NAMES,
    FedAdam,
    FedAvgM,
    FedProx,
    FedYogi,
    Median,
    Strategy,
    TrimmedMean,
    adam_moments,
    adaptive_step,
    coordinate_median,
    make_strategy,
    sample_clients,
    server_momentum,
    trimmed_mean,
    yogi_moments,
)


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
    W, b = s.aggregate(W, b, d, f32(0.0, 1.0))
    np.testing.assert_array_equal(W, [[2.0, 0.0]])
    W, b = s.aggregate(W, b, d, f32(0.0, 1.0))
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
    # x + eta m / (sqrt(v) + tau) = 1 + 0.5 * 0.2 / (0.2 + 0.05)  (sqrt(0.04) = 0.2) = 1.4
    np.testing.assert_allclose(adaptive_step(f32(1.0), f32(0.2), f32(0.04), 0.5, 0.05), [1.4], rtol=1e-6)


def test_fedadam_first_round_by_hand() -> None:
    s = FedAdam(server_lr=0.1, beta1=0.9, beta2=0.99, tau=0.1)
    W, b = np.zeros((1, 1), np.float32), np.zeros(1, np.float32)
    W1, b1 = s.aggregate(W, b, np.array([[1.0]], np.float32), f32(0.0))
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
        Wa, ba = a.aggregate(Wa, ba, np.array([[d]], np.float32), f32(0.0))
        Wy, by = y.aggregate(Wy, by, np.array([[d]], np.float32), f32(0.0))
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


def test_robust_strategies_use_aggregate_updates_and_ignore_claimed_counts() -> None:
    W, b = np.zeros((1, 2), np.float32), np.zeros(2, np.float32)
    dW = [np.array([[1.0, 1.0]], np.float32), np.array([[2.0, 2.0]], np.float32),
          np.array([[-50.0, 99.0]], np.float32)]
    db = [f32(0.0, 1.0), f32(0.0, 2.0), f32(0.0, 3.0)]
    med = Median(server_lr=1.0)
    assert med.needs_all_updates
    W1, b1 = med.aggregate_updates(W, b, dW, db, [1, 1, 10_000])
    np.testing.assert_array_equal(W1, [[1.0, 2.0]])
    np.testing.assert_array_equal(b1, [0.0, 2.0])
    with pytest.raises(TypeError):
        med.aggregate(W, b, dW[0], db[0])
    tm = TrimmedMean(trim_fraction=0.34)  # floor(0.34 * 3) = 1 per end → the median for 3
    W2, _ = tm.aggregate_updates(W, b, dW, db, [1, 1, 1])
    np.testing.assert_array_equal(W2, [[1.0, 2.0]])
    with pytest.raises(ValueError):
        Median(max_updates=2).aggregate_updates(W, b, dW, db, [1, 1, 1])


def test_streaming_strategy_aggregate_updates_matches_weighted_mean() -> None:
    W, b = np.zeros((1, 1), np.float32), np.zeros(1, np.float32)
    W1, b1 = Strategy().aggregate_updates(
        W, b, [np.array([[1.0]], np.float32), np.array([[4.0]], np.float32)], [f32(0.0), f32(2.0)], [2, 1]
    )
    np.testing.assert_array_equal(W1, [[2.0]])  # (2*1 + 1*4)/3
    np.testing.assert_allclose(b1, [2.0 / 3.0], rtol=1e-6)


def test_fedprox_sends_mu_in_round_config() -> None:
    cfg = FedProx(prox_mu=0.1, local_epochs=3).configure_round(4)
    assert cfg.prox_mu == 0.1 and cfg.local_epochs == 3
    assert Strategy().configure_round(1).prox_mu == 0.0
    with pytest.raises(ValueError):
        FedProx(prox_mu=-1.0)


def test_sample_clients_fraction_minimum_and_determinism() -> None:
    devs = [f"d{i}" for i in range(10)]
    rng = np.random.default_rng(0)
    got = sample_clients(devs, 0.3, 2, rng)
    assert len(got) == 3 and set(got) <= set(devs) and list(got) == sorted(got)
    assert len(sample_clients(devs, 0.05, 2, np.random.default_rng(0))) == 2  # minimum wins
    assert sample_clients(devs[:2], 0.5, 4, np.random.default_rng(0)) == ("d0", "d1")  # capped at n
    s = Strategy(fraction=0.5, min_clients=2, seed=7)
    assert s.sample_clients(devs, 3) == s.sample_clients(list(reversed(devs)), 3)
    rounds = {s.sample_clients(devs, r) for r in range(1, 20)}
    assert len(rounds) > 1  # the choice changes from round to round
    assert Strategy().sample_clients(devs, 1) == tuple(sorted(devs))
    assert Strategy().sample_clients([], 1) == ()
    with pytest.raises(ValueError):
        sample_clients(devs, 0.0, 1, rng)


def test_make_strategy_names() -> None:
    kinds = {name: type(make_strategy(name)) for name in STRATEGY_NAMES}
    assert kinds["fedavg"] is Strategy
    assert kinds["fedprox"] is FedProx and kinds["fedavgm"] is FedAvgM
    assert kinds["fedadam"] is FedAdam and kinds["fedyogi"] is FedYogi
    assert kinds["median"] is Median and kinds["trimmed-mean"] is TrimmedMean
    assert kinds["fedbuff"] is FedBuff
    assert make_strategy("fedprox", prox_mu=0.5).configure_round(1).prox_mu == 0.5
    assert all(make_strategy(n).name == n for n in STRATEGY_NAMES)
    with pytest.raises(ValueError, match="unknown strategy"):
        make_strategy("fedsgd")
