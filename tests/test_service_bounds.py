"""A coordinator service's per-round memory stays bounded however many rounds it runs (service.py)."""

from __future__ import annotations

import numpy as np

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.history import COUNTED_ROUNDS, HISTORY_ROUNDS, RoundRecord
from edgefl.coordinator.service import Coordinator
from edgefl.topics import Topics


def coordinator() -> Coordinator:
    W, b = np.zeros((4, 3), np.float32), np.zeros(3, np.float32)
    return Coordinator(None, Topics("edgefl", "f"), W, b, model_sha256="0" * 64, strategy=FedAvg())  # type: ignore[arg-type]


def test_soak_coordinator_round_memory_is_bounded_after_many_rounds() -> None:
    """What a closed round leaves in memory (record, counted ids, reasons, the page's and the state file's
    rows) is kept for the last rounds only, after rounds past every bound, as run_round and the runner
    leave it."""
    coord = coordinator()
    rounds = HISTORY_ROUNDS + 250
    for r in range(1, rounds + 1):
        coord.counted[r] = [f"dev-1:{r}:0", f"dev-2:{r}:0"]
        coord.keep_record(RoundRecord(r, 2, 0.5, 100.0, 1.0))
        coord.note_round_reasons(r, {"late": 1} if r % 2 else {}, {})
        if r % 7 == 0:  # the page and the state file read it now and then
            coord.dashboard_rounds()
            coord._history_rows()
    first = rounds - HISTORY_ROUNDS + 1
    assert [h.round for h in coord.state.history] == list(range(first, rounds + 1))
    assert sorted(coord.counted) == list(range(rounds - COUNTED_ROUNDS + 1, rounds + 1))
    assert sorted(coord._round_reasons) == list(range(first, rounds + 1))
    page = coord.dashboard_rounds()
    assert [p["round"] for p in page] == list(range(first, rounds + 1))
    assert page[-1]["refused"] == {} and page[-2]["refused"] == {"late": 1}
    assert [row[0] for row in coord._history_rows()] == list(range(first, rounds + 1))
