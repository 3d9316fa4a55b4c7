"""``bench/newclass.py``: the candidate rules' maths by hand, and the trade-off it measures.

The table itself is the bench's (``docs/benchmarks.md``, "Soak"); here: each rule's arithmetic on
arrays you can check by hand, the new-class schedule learning under a rule that lets the one device
through, and that same rule falling to one sign-flipping device (what the shipped default does not).
"""

from __future__ import annotations

import numpy as np
import pytest

from bench import poison
from bench.newclass import (
    GOAL_ROUNDS,
    DeviationHistory,
    Gate,
    GatedRound,
    candidate_factory,
    centered_clip,
    columns,
    device_votes,
    flatten,
    liar_votes,
    main,
    new_class_run,
    outlying_columns,
    server_set,
    shipped_factory,
    support,
    support_columns,
    uncontested_columns,
)
from edgefl.coordinator.strategy import Offer

pytestmark = pytest.mark.timeout(300)
SHAPE = (512, 10)  # the shipped digits CNN's head: 512-float embeddings, 10 classes


def test_newclass_centered_clip_moves_at_most_tau_over_n() -> None:
    """``c + mean clip(x_i - c, tau)``: a far update moves the result by tau / n, a near one fully."""
    x = np.array([[0.0, 0.0], [3.0, 4.0], [0.5, 0.0]])
    out = centered_clip(x, np.zeros(2), tau=1.0)
    np.testing.assert_allclose(out, [(0.0 + 0.6 + 0.5) / 3, (0.0 + 0.8 + 0.0) / 3])


def test_newclass_deviation_history_takes_the_lower_median() -> None:
    """tau = factor x min(last round's clipped median deviation, this round's median deviation)."""
    h = DeviationHistory(2.0)
    assert h.tau(np.array([1.0, 2.0, 3.0])) == 4.0  # no history: this round's median 2
    assert h.tau(np.array([10.0, 10.0, 10.0])) == 4.0  # history (median 2) caps a round of large ones
    assert h.tau(np.array([0.5, 0.5, 0.5])) == 1.0  # a round of small ones tightens it


def test_newclass_columns_round_trip() -> None:
    """Flattened (W [D, K], b [K]) <-> class columns [D + 1, K]: column k is W[:, k] then b[k]."""
    D, K = 2, 3
    W = np.arange(6.0).reshape(D, K)
    b = np.array([10.0, 11.0, 12.0])
    flat = np.concatenate([W.ravel(), b])
    cols = columns(flat[None], D, K)[0]
    np.testing.assert_array_equal(cols[:, 1], [1.0, 4.0, 11.0])
    np.testing.assert_array_equal(flatten(cols), flat)


def test_newclass_support_columns_only_a_minority_supporter_is_added() -> None:
    """Column 0: one device's bias delta is positive (supports the class): its deviation is added at
    weight w. Column 1: three supporters, a majority's column: the trimmed mean is kept."""
    D, K = 1, 2
    # per device: W[0, 0], W[0, 1], b[0], b[1]
    x = np.array(
        [
            [2.0, 1.0, 1.0, 0.5],
            [0.0, 1.0, -0.1, 0.5],
            [0.0, 1.0, -0.1, 0.5],
            [0.0, 0.0, -0.1, -0.5],
            [0.0, 0.0, -0.1, -0.5],
        ]
    )
    center = np.zeros(4)
    out = support_columns(x, center, D, K, tolerate=1, factor=0.0, w=0.5)
    np.testing.assert_allclose(out, [1.0, 0.0, 0.5, 0.0])


def test_newclass_uncontested_columns_pass_only_where_the_majority_is_quiet() -> None:
    """Column 1's median norm is 0 (<= kappa x the median over columns): every deviation enters there."""
    D, K = 1, 3
    x = np.array(
        [
            [1.0, 5.0, 1.0, 1.0, 0.0, 1.0],
            [1.0, 0.0, 1.0, 1.0, 0.0, 1.0],
            [1.0, 0.0, 1.0, 1.0, 0.0, 1.0],
        ]
    )
    center = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    out = uncontested_columns(x, center, D, K, kappa=0.5, w=1.0)
    np.testing.assert_allclose(out, [1.0, 5.0, 1.0, 1.0, 0.0, 1.0])


def test_soak_newclass_one_device_teaches_when_let_through_and_the_default_does_not() -> None:
    """The soak's schedule in-process: device 0 starts seeing 8 and 9 after 10 rounds. A rule that
    adds its unclipped column deviation (the support rule, w 1) after a norm bound of 1.5 x the
    median learns them within 20 rounds (at the shipped 1 x it does not: the novel device's update
    is the longest); the trimmed mean drops that device's values in those columns and stays near 0."""
    profile = poison.shipped_profile("trimmed-mean")
    rule = candidate_factory(support(0.0, 1.0, SHAPE), outer=1.5)
    let_through = new_class_run(rule, 0, profile, 10, GOAL_ROUNDS)
    assert let_through["rounds_to_learn"] is not None and let_through["rounds_to_learn"] <= GOAL_ROUNDS
    default = new_class_run(shipped_factory("trimmed-mean"), 0, profile, 10, GOAL_ROUNDS)
    assert default["accuracy_on_new"] < 0.2, default
    assert default["accuracy_old"] > 0.9, default  # it learned the old classes


def test_poison_newclass_rule_that_teaches_falls_to_one_sign_flipper() -> None:
    """The other side of the trade-off: the same rule on bench.poison's shipped fleet, device 0
    sending its delta sign-flipped first every round, loses more than half the clean accuracy."""
    profile = poison.shipped_profile("trimmed-mean")
    task = poison.poison_task(profile, seed=0)
    make = candidate_factory(support(0.0, 1.0, SHAPE))
    clean = poison.run_poisoned(task, profile, None, make=make)
    flipped = poison.run_poisoned(task, profile, "signflip", make=make)
    assert clean.accuracy > 0.8 and clean.sizes == [5] * task.rounds
    assert flipped.accuracy < clean.accuracy - 0.5, (clean.accuracy, flipped.accuracy)


def test_newclass_outlying_columns_add_only_the_far_deviation() -> None:
    """Column 0: device 0's deviation 4 is >= 3 x the median column norm 1: added. Column 1: none is."""
    D, K = 1, 2
    x = np.array([[4.0, 1.0, 0.0, 0.0], [1.0, 1.5, 0.0, 0.0], [1.0, 0.5, 0.0, 0.0]])
    center = np.array([1.0, 1.0, 0.0, 0.0])
    out = outlying_columns(x, center, D, K, ratio=3.0, w=1.0)
    np.testing.assert_allclose(out, [4.0, 1.0, 0.0, 0.0])


def test_newclass_cli_names_an_unknown_rule(capsys: pytest.CaptureFixture[str]) -> None:
    """``--rule`` takes the table's names; another is refused with exit 2, naming the choices."""
    with pytest.raises(SystemExit) as exc:
        main(["--rule", "krum"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--rule 'krum'" in err and "median (default)" in err


def test_newclass_gated_device_votes_per_column_on_the_holdout() -> None:
    """Holdout: two samples of class 0, both right. Column 0's candidate (b0 - 0.5) keeps them right:
    accepted; column 1's (b1 + 2) takes both: refused. One vote on the whole candidate refuses both."""
    x = np.ones((2, 1), np.float32)
    y = np.zeros(2, np.int64)
    W, b = np.zeros((1, 2), np.float32), np.array([1.0, 0.0], np.float32)
    delta = np.array([[0.0, -0.5], [0.0, 2.0]])  # items: column 0's (W, b) step, column 1's
    assert device_votes(x, y, W, b, delta, [0, 1], Gate()) == [True, False]
    assert device_votes(x, y, W, b, delta, [0, 1], Gate(per_column=False)) == [False, False]
    # the liar accepts exactly what hurts (here judged on the same samples)
    assert liar_votes(x, y, W, b, delta, [0, 1], Gate()) == [False, True]
    # no holdout: nothing to vouch for
    assert device_votes(x[:0], y[:0], W, b, delta, [0, 1], Gate()) == [False, False]


def _gated_round(
    gated: GatedRound, r: int, W: np.ndarray, b: np.ndarray, votes: list[list[bool]]
) -> tuple[np.ndarray, np.ndarray, object]:
    """One round of five equal-norm updates (nothing clipped): device 0 alone pushes class 1 up."""
    gated.configure_round(r)
    for i in range(5):
        db = np.array([-1.0, 1.0] if i == 0 else [1.0, -1.0], np.float32)
        gated.strategy.offer(Offer(f"dev{i}", np.zeros((1, 2), np.float32), db, 10))
    return gated.close(W, b, votes)


@pytest.mark.parametrize("replace", [False, True])
def test_newclass_gated_round_keeps_a_column_only_on_a_majority_vote(replace: bool) -> None:
    """Round 1: the shipped median steps b by (+1, -1); class 1, supported by device 0 alone, becomes
    the candidate (its column delta (0, +1); replacing the aggregate's -1: (0, +2)). Round 2: 3 of 5
    votes keep it on top of the new aggregate; 2 of 5 do not."""
    W0, b0 = np.zeros((1, 2), np.float32), np.zeros(2, np.float32)
    bonus = 2.0 if replace else 1.0
    for yes, kept in ((3, True), (2, False)):
        gated = GatedRound(shipped_factory("median")(), Gate(replace=replace), (1, 2))
        W1, b1, refused = _gated_round(gated, 1, W0, b0, [])
        assert refused is None and gated.cols == [1]
        np.testing.assert_allclose(b1, [1.0, -1.0])
        assert gated.pending is not None
        np.testing.assert_allclose(gated.pending, [[0.0, bonus]])
        votes = [[True]] * yes + [[False]] * (5 - yes)
        W2, b2, refused = _gated_round(gated, 2, W1, b1, votes)
        assert refused is None
        np.testing.assert_allclose(b2, [2.0, -2.0 + (bonus if kept else 0.0)])
        np.testing.assert_allclose(W2, 0.0)


def test_newclass_gated_server_set_takes_n_of_every_class_from_the_pool() -> None:
    """The coordinator's own set: 2 samples of each class present in the pool, none from outside it."""
    y = np.array([0, 0, 0, 1, 1, 2, 2, 2, 9])
    pool = np.array([0, 1, 3, 4, 5, 6, 7])
    idx = server_set(pool, y, 2, seed=0)
    assert set(idx) <= set(pool) and len(set(idx)) == 6
    assert sorted(y[idx].tolist()) == [0, 0, 1, 1, 2, 2]
