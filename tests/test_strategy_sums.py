"""A root's sum partials (``Strategy.offer_sums``): bounded together once the round's partials are in.

Pure arrays, no broker: the over-the-broker version is ``tests/test_trust.py`` (``-k hostile``).
"""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.strategy import SiteSums

SHAPE = (2, 3)
Z64 = np.zeros(SHAPE[1])


def _sum(mean: float, count: int, weight: float) -> SiteSums:
    return SiteSums("sum", np.full(SHAPE, mean * weight), Z64, weight, count, 0)


def _root() -> FedAvg:
    st = FedAvg(min_clients=1)
    st.bound_site_weights()  # as RootCoordinator does
    return st


def test_trust_hostile_site_in_the_first_round_is_bounded_by_the_rounds_median() -> None:
    """No history yet: three honest sites (2 updates of 10 examples, mean 1) and a thief (2 updates
    claiming 1e6 examples each, mean -100) arriving first. Its weight per update is cut to the
    round's median (10), its mean to 2 x the median mean norm: the head moves by
    (3 x 20 x 1 - 20 x 2) / 80 = 0.25 per coordinate, its pull -0.5 = 2/8 of the bound (2)."""
    st = _root()
    st.configure_round(1, SHAPE)
    st.offer_sums(_sum(-100.0, 2, 2e6))
    for _ in range(3):
        st.offer_sums(_sum(1.0, 2, 20.0))
    assert st.accepted == 8
    W, _ = st.aggregate(np.zeros(SHAPE, np.float32), np.zeros(SHAPE[1], np.float32))
    mean_norm = np.sqrt(SHAPE[0] * SHAPE[1])  # a partial mean of 1 per coordinate
    np.testing.assert_allclose(W, np.full(SHAPE, 0.25), rtol=1e-6)
    assert st.report().clipped == 2
    assert st.norm_bound.history.median() == pytest.approx(mean_norm)  # the thief counted at the bound


def test_trust_honest_claims_above_the_median_are_weighed_at_it() -> None:
    """Honest sites with different claims keep FedAvg's weights up to the median: 10 and 30 examples
    per update around a median of 20 are weighed 10 and 20."""
    st = _root()
    st.configure_round(1, SHAPE)
    for per, mean in ((10.0, 1.0), (20.0, 1.0), (30.0, 1.0)):
        st.offer_sums(_sum(mean, 1, per))
    W, _ = st.aggregate(np.zeros(SHAPE, np.float32), np.zeros(SHAPE[1], np.float32))
    np.testing.assert_allclose(W, np.full(SHAPE, 1.0), rtol=1e-6)  # the same mean at the capped weight
    assert st.report().clipped == 1


def test_trust_pending_partials_survive_a_snapshot() -> None:
    st = _root()
    st.configure_round(1, SHAPE)
    st.offer_sums(_sum(1.0, 2, 20.0))
    st.offer_sums(_sum(3.0, 1, 5.0))
    snap = st.snapshot()
    again = _root()
    again.configure_round(1, SHAPE)
    again.restore(snap)
    zeros = np.zeros(SHAPE, np.float32), np.zeros(SHAPE[1], np.float32)
    np.testing.assert_array_equal(again.aggregate(*zeros)[0], st.aggregate(*zeros)[0])
    assert again.accepted == st.accepted == 3
