"""Poisoning: one of five devices attacks every round; the default strategy keeps the clean accuracy.

The strategy interface on real digits updates (``bench/poison.py``: the real int8 model's embeddings,
``train_local``, the wire codec, ``Strategy.offer`` and ``aggregate_checked``, as the service runs them).
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.poison import ATTACKS, poison_task, run_poisoned
from edgefl.coordinator.strategy import DEFAULT_STRATEGY, FedAvg, Offer, aggregate_checked

pytestmark = pytest.mark.timeout(600)


def test_poison_default_strategy_stays_within_003_of_clean() -> None:
    task = poison_task(seed=0)
    clean, refused, _ = run_poisoned(task, DEFAULT_STRATEGY, None)
    assert not refused
    assert clean > task.accuracy(task.W0, task.b0) + 0.3  # it learns
    for attack in ATTACKS:
        acc, refused, clipped = run_poisoned(task, DEFAULT_STRATEGY, attack)
        print(f"{DEFAULT_STRATEGY}: clean {clean:.3f}, {attack} {acc:.3f}, clipped {clipped}, {refused}")
        assert acc >= clean - 0.03, (attack, clean, acc)
        if attack in ("scale1000", "scale-10", "huge"):
            assert clipped >= task.rounds, (attack, clipped)  # the attacker is clipped every round


def test_poison_huge_update_never_reaches_the_published_head() -> None:
    """Without a useful norm bound, the 3e38 update makes FedAvg's head non-finite: refused, head kept."""
    task = poison_task(seed=0)
    W, b = task.W0.copy(), task.b0.copy()
    s = FedAvg(clip_norm=1e39)
    s.configure_round(1, W.shape)
    huge = ATTACKS["huge"]
    s.offer(Offer("dev0", huge(np.ones_like(W)), huge(np.ones_like(b)), 100))
    s.offer(Offer("dev1", huge(np.ones_like(W)), huge(np.ones_like(b)), 100))
    W1, b1, refusal = aggregate_checked(s, W, b)
    assert refusal is not None and refusal.reason in ("not_finite", "bad_value")
    np.testing.assert_array_equal(W1, task.W0)
    np.testing.assert_array_equal(b1, task.b0)
