"""The soak bench's loss count (bench/soak.py): updates in the round the coordinator saved open at its stop
are neither lost nor counted yet."""

from __future__ import annotations

from pathlib import Path

import cbor2

from bench.soak import _saved_open_round
from edgefl.records import write_record


def test_soak_updates_saved_in_the_open_round_are_read_from_the_state_file(tmp_path: Path) -> None:
    """The state file's ``open.update_ids`` (``device:round:base``) name the updates held for the resume."""
    state = tmp_path / "state.rec"
    assert _saved_open_round(state) == set()  # no state file
    write_record(state, cbor2.dumps({"round": 433, "open": None}))
    assert _saved_open_round(state) == set()  # no round open at the stop
    ids = ["dev-1:434:433", "dev-3:434:433"]
    write_record(state, cbor2.dumps({"round": 433, "open": {"round": 434, "update_ids": ids}}))
    assert _saved_open_round(state) == {("dev-1", 434), ("dev-3", 434)}
