from __future__ import annotations

import numpy as np
import pytest

from edgefl.coordinator.fedbuff import FedBuff, FedBuffer, staleness_weight
from edgefl.coordinator.strategies import make_strategy
from edgefl.coordinator.strategy import Offer, Schedule
from edgefl.errors import UpdateRejected


def test_staleness_weight_by_hand() -> None:
    assert staleness_weight(0) == 1.0
    assert staleness_weight(3) == 0.5  # 1/sqrt(4)
    assert staleness_weight(3, exponent=1.0) == 0.25
    assert staleness_weight(8, exponent=0.0) == 1.0
    with pytest.raises(ValueError):
        staleness_weight(-1)


def test_buffer_applies_after_k_updates_with_staleness_discount() -> None:
    buf = FedBuffer((1, 1), 2, server_lr=1.0)
    W, b = np.zeros((1, 1), np.float32), np.zeros(1, np.float32)
    assert not buf.offer(np.array([[4.0]], np.float32), np.array([2.0], np.float32), 1, 0)
    assert buf.offer(np.array([[4.0]], np.float32), np.array([2.0], np.float32), 1, 3)
    W1, b1 = buf.flush(W, b)
    # (1*4 + 0.5*4) / 2 = 3 ; (1*2 + 0.5*2) / 2 = 1.5
    np.testing.assert_array_equal(W1, [[3.0]])
    np.testing.assert_array_equal(b1, [1.5])
    assert buf.count == 0 and buf.total_examples == 0
    with pytest.raises(ValueError):
        buf.flush(W1, b1)


def test_buffer_weights_by_examples_and_server_lr() -> None:
    buf = FedBuffer((1, 1), 2, server_lr=0.5)
    buf.offer(np.array([[1.0]], np.float32), np.array([0.0], np.float32), 3, 0)
    buf.offer(np.array([[5.0]], np.float32), np.array([0.0], np.float32), 1, 0)
    W1, _ = buf.flush(np.ones((1, 1), np.float32), np.zeros(1, np.float32))
    # 1 + 0.5 * (3*1 + 1*5)/4 = 2
    np.testing.assert_array_equal(W1, [[2.0]])


def test_buffer_rejects_bad_updates() -> None:
    buf = FedBuffer((2, 1), 3, max_staleness=2)
    ok_W, ok_b = np.zeros((2, 1), np.float32), np.zeros(1, np.float32)
    with pytest.raises(UpdateRejected) as e:
        buf.offer(ok_W, ok_b, 1, 3)
    assert e.value.reason == "too_stale"
    with pytest.raises(UpdateRejected) as e:
        buf.offer(np.zeros((3, 1), np.float32), ok_b, 1, 0)
    assert e.value.reason == "bad_shape"
    with pytest.raises(UpdateRejected) as e:
        buf.offer(ok_W, ok_b, 0, 0)
    assert e.value.reason == "no_examples"
    assert buf.count == 0


def test_fedbuff_strategy_is_a_buffered_schedule_with_one_weighted_sum() -> None:
    s = FedBuff(buffer_size=2, server_lr=1.0, max_staleness=7, clip_norm=100.0)
    cfg = s.configure_round(1, (1, 1))
    assert cfg.schedule is Schedule.BUFFERED and cfg.min_clients == 2
    s.offer(Offer("d0", np.array([[4.0]], np.float32), np.array([2.0], np.float32), 1, staleness=0))
    s.offer(Offer("d1", np.array([[4.0]], np.float32), np.array([2.0], np.float32), 1, staleness=3))
    with pytest.raises(UpdateRejected) as e:
        s.offer(Offer("d2", np.zeros((1, 1), np.float32), np.zeros(1, np.float32), 1, staleness=8))
    assert e.value.reason == "too_stale" and s.accepted == 2
    W1, b1 = s.aggregate(np.zeros((1, 1), np.float32), np.zeros(1, np.float32))
    # as the FedBuffer test: (1*4 + 0.5*4) / 2 = 3, (1*2 + 0.5*2) / 2 = 1.5
    np.testing.assert_array_equal(W1, [[3.0]])
    np.testing.assert_array_equal(b1, [1.5])
    assert make_strategy("fedavg").configure_round(1, (1, 1)).schedule is Schedule.SYNC
