"""A round log with rotten bytes (a bad block, a disk that wrote garbage) does not stop the coordinator.

``log_missing_rounds`` runs at every start of a coordinator with ``files.state``: it read the round log
as UTF-8 text, so one byte that is not UTF-8 ended the start with a ``UnicodeDecodeError`` traceback
(exit 75), and the unit restarted it into the same crash for as long as the log was there.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import INT8_MODEL

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.history import RoundRecord
from edgefl.coordinator.roundlog import log_missing_rounds
from edgefl.coordinator.service import Coordinator
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport


def _coordinator_at_round_3() -> Coordinator:
    """A coordinator (never connected) whose state closed rounds 1..3, as a restart loads it."""
    bb = Backbone(INT8_MODEL)
    W, b = bb.head_from_model()
    t = MqttTransport("127.0.0.1", 1, "coord-roundlog")
    coord = Coordinator(t, Topics("edgefl", "rot"), W, b, model_sha256=bb.sha256, strategy=FedAvg())
    coord.state.history = [RoundRecord(r, 2, 0.5, 100.0, 1.0) for r in (1, 2, 3)]
    coord.state.round, coord.state.version = 3, 3
    coord.counted = {r: [f"gw-1:{r}:0", f"gw-2:{r}:0"] for r in (1, 2, 3)}
    return coord


def test_durable_round_log_with_rotten_bytes_keeps_its_good_lines_and_gets_the_missing_rounds(
    tmp_path: Path,
) -> None:
    log = tmp_path / "rounds.jsonl"
    good = json.dumps({"round": 1, "counted": 2}) + "\n"
    log.write_bytes(good.encode() + b'{"round": 2, \xcf\xff\xfe garbage}\n' + b"\x9c\x00\xcf")
    appended = log_missing_rounds(log, _coordinator_at_round_3(), "median")
    assert appended == 2  # rounds 2 and 3: the rotten line vouches for none
    lines = log.read_bytes().split(b"\n")
    assert lines[0] == good.strip().encode()
    assert [json.loads(x)["round"] for x in lines[-3:-1]] == [2, 3] and lines[-1] == b""
    assert all(json.loads(x)["recovered"] is True for x in lines[-3:-1])
