"""The coordinator's state file keeps the round history; its rows are built again only when it changed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.history import RoundRecord
from edgefl.coordinator.service import Coordinator
from edgefl.topics import Topics


def coordinator() -> Coordinator:
    W, b = np.zeros((4, 3), np.float32), np.zeros(3, np.float32)
    return Coordinator(None, Topics("edgefl", "f"), W, b, model_sha256="0" * 64, strategy=FedAvg())  # type: ignore[arg-type]


def test_durable_state_history_rows_follow_every_change(tmp_path: Path) -> None:
    coord = coordinator()
    coord.state.history = [RoundRecord(r, 2, 0.5, 100.0, 1.0) for r in (1, 2)]
    rows = coord._history_rows()
    assert [row[0] for row in rows] == [1, 2]
    assert coord._history_rows() is rows  # unchanged: the same rows, not built again
    coord.state.history.append(RoundRecord(3, 1, 0.6, 90.0, 1.0))
    grown = coord._history_rows()
    assert [row[0] for row in grown] == [1, 2, 3]
    assert grown[0] is rows[0] and grown[1] is rows[1]  # a new round builds its own row only
    del coord.state.history[:1]  # trimmed from the front, as a service keeps its last rounds
    trimmed = coord._history_rows()
    assert [row[0] for row in trimmed] == [2, 3] and trimmed[0] is rows[1] and trimmed[1] is grown[2]
    coord.state.history[1:] = [RoundRecord(4, 1, 0.7, 90.0, 1.0)]  # changed in the middle: built again
    assert [row[0] for row in coord._history_rows()] == [2, 4]
    coord.state.history = [RoundRecord(2, 2, 0.5, 100.0, 1.0), RoundRecord(9, 1, 0.6, 90.0, 1.0)]
    assert [row[0] for row in coord._history_rows()] == [2, 9]  # replaced (a state loaded)
    coord.save_state(tmp_path / "state.rec")
    again = coordinator()
    assert again.load_state(tmp_path / "state.rec")
    assert [h.round for h in again.state.history] == [2, 9]
    coord.state.history = []
    assert coord._history_rows() == []
