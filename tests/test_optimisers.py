"""Server optimisers of the FedAvg family: the momentum buffer bounded per coordinate by the round's mean."""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.coordinator.optimisers import COORDINATE_FACTOR, FedAvgM, bound_coordinates
from edgefl.coordinator.strategy import Offer, aggregate_checked

W0, B0 = np.zeros((1, 2), np.float32), np.zeros(2, np.float32)


def one_round(
    s: FedAvgM, r: int, W: np.ndarray, b: np.ndarray, w: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray]:
    s.configure_round(r, (1, 2))
    s.offer(Offer("a", np.array([w], np.float32), np.zeros(2, np.float32), 10))
    W1, b1, refusal = aggregate_checked(s, W, b)
    assert refusal is None
    return W1, b1


def test_shipped_momentum_drops_a_direction_the_round_does_not_support() -> None:
    """Round 1 moves coordinate 0 by 1; round 2's mean is (0, 1): the buffer (0.9, 1) keeps no
    coordinate beyond twice the round's mean there, so coordinate 0 does not move and the buffer
    forgets it; round 3's mean (0, 1) then steps (0, 1.9)."""
    assert COORDINATE_FACTOR == 2.0
    s = FedAvgM(server_momentum=0.9, clip_norm=10.0)
    W, b = one_round(s, 1, W0, B0, (1.0, 0.0))
    np.testing.assert_allclose(W, [[1.0, 0.0]])
    W, b = one_round(s, 2, W, b, (0.0, 1.0))
    np.testing.assert_allclose(W, [[1.0, 1.0]])
    np.testing.assert_allclose(s.server_state["v_W"], [[0.0, 1.0]])
    W, b = one_round(s, 3, W, b, (0.0, 1.0))
    np.testing.assert_allclose(W, [[1.0, 2.9]], rtol=1e-6)
    np.testing.assert_array_equal(b, B0)


def test_shipped_momentum_bound_is_twice_the_rounds_mean_in_every_coordinate() -> None:
    """|step_i| <= 2 |mean_i| whatever the sign: a coordinate the round leaves alone does not move."""
    step = np.array([3.0, -3.0, 0.5, -0.1, 7.0], np.float32)
    mean = np.array([1.0, 1.0, -1.0, 0.0, 2.0], np.float32)
    out = bound_coordinates(step, mean, COORDINATE_FACTOR)
    np.testing.assert_allclose(out, [2.0, -2.0, 0.5, 0.0, 4.0])
    # the step's norm is then at most twice the mean's
    assert float(np.linalg.norm(out)) <= 2 * float(np.linalg.norm(mean)) + 1e-6
    assert pytest.approx(float(np.linalg.norm(out))) == float(np.sqrt(4 + 4 + 0.25 + 16))
