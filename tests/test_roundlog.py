"""The round log (``files.log``): what a closed round's line keeps, after a ``kill -9`` with the round open
too, with a real ``edgefl coordinator`` and real agents on the session's mosquitto."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from conftest import Broker, start_replay_agent
from test_service import log_lines, start_coordinator, wait_for

from edgefl.coordinator.history import RoundRecord
from edgefl.coordinator.roundlog import _round_entry, round_line
from edgefl.datasets import load_digits
from edgefl.launcher import stop_agents

pytestmark = pytest.mark.timeout(300)

DEADLINE_S = 20.0


def test_roundlog_entry_keeps_the_federated_evaluation() -> None:
    rec = RoundRecord(
        7, 3, 0.91, 2048.0, 1.5, fed_accuracy=0.875, fed_worst_decile=0.5, fed_devices=3, asked=3, lr=0.05,
        closed_unix=1_800_000_000.0, new_samples=96,
    )  # fmt: skip
    entry = _round_entry(rec, 4, "fedavg", ["a:7:0"], {}, {})
    assert (entry["fed_accuracy"], entry["fed_worst_decile"], entry["fed_devices"]) == (0.875, 0.5, 3)
    assert entry["time"] == "2027-01-15T08:00:00Z" and entry["counted"] == 3
    none = _round_entry(RoundRecord(8, 0, float("nan"), 0.0, 30.0), 4, "fedavg", [], {}, {})
    assert (none["fed_accuracy"], none["fed_worst_decile"], none["fed_devices"]) == (None, None, 0)


@pytest.mark.long
def test_durable_round_resumed_after_kill9_keeps_its_opening_and_its_updates(
    tmp_path: Path, mosquitto: Broker, fleet: str
) -> None:
    """FedAvg tolerating one hostile device needs 5 updates; two devices answer, so round 1
    stays open to its deadline. The coordinator is killed -9 once both updates are in; restarted, it
    resumes the round, which is abandoned at the deadline counted from its first opening (not from the
    restart), and its log line names the two updates it counted."""
    x, y = load_digits()
    devices = ("dev-1", "dev-2")
    agents = [
        start_replay_agent(mosquitto, fleet, tmp_path, d, x[k * 96 : (k + 1) * 96], y[k * 96 : (k + 1) * 96])
        for k, d in enumerate(devices)
    ]
    state, log = tmp_path / "state.rec", tmp_path / "rounds.jsonl"
    sets = (
        "robustness.tolerate=1",  # FedAvg: 5 x 1 updates, two devices: abandoned (too_few)
        "rounds.count=1",
        "rounds.expected_clients=2",
        f"rounds.deadline_s={DEADLINE_S}",
        f"files.state={state}",
        f"files.log={log}",
    )
    coordinator_log = tmp_path / "coordinator.log"
    coord = start_coordinator(tmp_path, "coordinator", mosquitto, fleet, *sets)
    try:
        wait_for(
            lambda: all(f"round 1: update from {d}" in coordinator_log.read_text() for d in devices),
            150,
            "two updates",
            [coord],
            tmp_path,
        )
        coord.send_signal(signal.SIGKILL)
        assert coord.wait(timeout=30) == -signal.SIGKILL
        assert log_lines(log) == []  # the round had not closed
        coord = start_coordinator(tmp_path, "coordinator", mosquitto, fleet, *sets)
        wait_for(lambda: log_lines(log), 120, "round 1 closed after the restart", [], tmp_path)
        assert coord.wait(timeout=30) == 5, coordinator_log.read_text()[-3000:]  # a job's abandoned round
    finally:
        if coord.poll() is None:
            coord.kill()
        stop_agents(agents)
    out = coordinator_log.read_text()
    assert "round 1 resumed from the state file" in out, out
    (entry,) = log_lines(log)
    assert entry["round_refused"] == "too_few" and entry["counted"] == 2, entry
    assert entry["update_ids"] == [f"{d}:1:0" for d in devices], entry
    # the deadline runs from the round's first opening: closed at it, so it lasted the deadline
    assert entry["duration_s"] >= DEADLINE_S, entry


def test_roundlog_one_device_is_singular() -> None:
    one = RoundRecord(3, 1, 0.9, 100.0, 0.1, fed_accuracy=0.8, fed_worst_decile=0.8, fed_devices=1, asked=1)
    assert "(worst decile 0.800, 1 device)" in round_line(one, 0, {})
    two = RoundRecord(3, 2, 0.9, 100.0, 0.1, fed_accuracy=0.8, fed_worst_decile=0.7, fed_devices=2, asked=2)
    assert "(worst decile 0.700, 2 devices)" in round_line(two, 0, {})
