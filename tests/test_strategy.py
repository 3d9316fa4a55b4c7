from __future__ import annotations

import numpy as np
import pytest

from edgefl.coordinator.fedavg import FedAvg, RunningWeightedSum


def _weighted_mean(deltas: list[np.ndarray], weights: list[int]) -> np.ndarray:
    acc = RunningWeightedSum(deltas[0].shape)
    for d, n in zip(deltas, weights, strict=True):
        acc.add(d, n)
    return acc.mean()


def test_running_sum_weighted_mean_by_hand() -> None:
    a = np.array([[1.0, 2.0]], np.float32)
    b = np.array([[3.0, 6.0]], np.float32)
    # weights 1 and 3: (1*1 + 3*3)/4 = 2.5, (1*2 + 3*6)/4 = 5
    np.testing.assert_array_equal(_weighted_mean([a, b], [1, 3]), [[2.5, 5.0]])


def test_running_sum_equal_weights_is_plain_mean() -> None:
    rng = np.random.default_rng(0)
    ds = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(5)]
    np.testing.assert_allclose(_weighted_mean(ds, [7] * 5), np.mean(ds, axis=0), rtol=1e-6)


def test_running_sum_rejects_bad_input() -> None:
    a = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="no update added"):
        RunningWeightedSum((2, 2)).mean()
    with pytest.raises(ValueError, match="must be > 0"):
        _weighted_mean([a], [0])
    with pytest.raises(ValueError, match="shape"):
        _weighted_mean([a, np.zeros((3, 2), np.float32)], [1, 1])


def test_running_sum_streams_in_any_order() -> None:
    s1, s2 = RunningWeightedSum((2,)), RunningWeightedSum((2,))
    items = [(np.array([1.0, 0.0], np.float32), 2), (np.array([0.0, 4.0], np.float32), 6)]
    for d, n in items:
        s1.add(d, n)
    for d, n in reversed(items):
        s2.add(d, n)
    np.testing.assert_array_equal(s1.mean(), [0.25, 3.0])
    np.testing.assert_array_equal(s1.mean(), s2.mean())
    assert s1.total_weight == 8


def test_fedavg_step_with_server_lr() -> None:
    W = np.ones((2, 2), np.float32)
    b = np.zeros(2, np.float32)
    dW = np.full((2, 2), 0.5, np.float32)
    db = np.array([1.0, -1.0], np.float32)
    W1, b1 = FedAvg().step(W, b, dW, db)
    np.testing.assert_array_equal(W1, np.full((2, 2), 1.5))
    np.testing.assert_array_equal(b1, [1.0, -1.0])
    W2, b2 = FedAvg(server_lr=0.5).step(W, b, dW, db)
    np.testing.assert_array_equal(W2, np.full((2, 2), 1.25))
    np.testing.assert_array_equal(b2, [0.5, -0.5])
