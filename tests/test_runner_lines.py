"""The coordinator's and the site's round lines print reason labels as their values, never enum reprs."""

from __future__ import annotations

from collections import Counter

from edgefl.coordinator.roundlog import counts_since
from edgefl.wire.reasons import Reason


def test_hostile_round_line_reason_labels_print_as_values() -> None:
    before: Counter[str] = Counter({Reason.STALE_ROUND: 1})
    now: Counter[str] = Counter({Reason.STALE_ROUND: 4, Reason.BAD_SIGNATURE: 2, "failed": 1})
    counts = counts_since(now, before)
    assert counts == {"bad_signature": 2, "failed": 1, "stale_round": 3}
    assert all(type(k) is str for k in counts)
    line = f"refused: {counts}"
    assert "Reason." not in line and "<" not in line
