"""The log line of a switch between the personal and the global head says what the decision rests on."""

from __future__ import annotations

from edgefl.agent.personal import head_switch_message, personal_behind


def test_personal_switch_back_line_never_claims_the_personal_head_scores_higher() -> None:
    """Personal 2/4 right, global 3/4, one disagreement won by the global head: within chance, so the
    personal head serves again; the line gives both accuracies and the disagreements, not ">=" (it
    said "(0.500 >= 0.750)")."""
    assert not personal_behind(1, 0)
    line = head_switch_message(False, 2, 3, 4, 1, 0)
    assert line == (
        "personal head no longer behind the global head on the holdout (personal 0.500, global 0.750, "
        "4 samples; of the samples they disagree on the global head alone is right on 1, the personal "
        "head alone on 0: no lead beyond chance): predictions use the personal head"
    )


def test_personal_switch_behind_line_gives_both_accuracies() -> None:
    """Global 4/4 right, personal 2/4: two disagreements, both the global head's (2 > sqrt(2))."""
    assert personal_behind(2, 0)
    assert head_switch_message(True, 2, 4, 4, 2, 0) == (
        "personal head behind the global head on the holdout (0.500 < 1.000, 4 samples): "
        "predictions use the global head"
    )
