"""A full disk while rounds run is counted, not fatal: the rounds go on and their log lines wait for room.

The state file is rewritten in place (no new blocks), but the round log grows: on a full disk (here a
file-size limit, ``RLIMIT_FSIZE``, the log already at it) the append of round 1's line ended the
running coordinator with ``cannot start: [Errno 27] File too large`` (exit 4), and every restart
ended the same way while the start-up appended the rounds the log missed. Real mosquitto, real
agents, the real coordinator process on the shipped profile.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import INT8_MODEL, ROOT, Broker, start_replay_agent
from test_service import log_lines

from edgefl.datasets import load_digits
from edgefl.launcher import stop_agents

pytestmark = pytest.mark.timeout(240)

COORDINATOR_PROFILE = ROOT / "firmware_configs" / "coordinator.toml"
FSIZE = 64 * 1024  # the state file's record (~24 KiB here) fits; the round log is filled up to it


def _small_files() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE, FSIZE))


def _coordinator_cmd(broker: Broker, fleet: str, rounds: int, *files: str) -> list[str]:
    """``edgefl coordinator`` on the shipped profile; changed: broker, fleet, model, tolerate 0, 2 clients."""
    cmd = [
        sys.executable,
        "-m",
        "edgefl.cli",
        "--log-level",
        "WARNING",
        "coordinator",
        str(COORDINATOR_PROFILE),
    ]
    for item in (
        f"broker.url={broker.url}",
        f"fleet.name={fleet}",
        f"model.path={INT8_MODEL}",
        "robustness.tolerate=0",
        f"rounds.count={rounds}",
        "rounds.expected_clients=2",
        "rounds.deadline_s=60",
        *files,
        "dashboard.enabled=false",
    ):
        cmd += ["--set", item]
    return cmd


def _coordinator(tmp: Path, broker: Broker, fleet: str, limit: bool) -> subprocess.CompletedProcess[str]:
    cmd = _coordinator_cmd(
        broker, fleet, 3, f"files.state={tmp / 'state.rec'}", f"files.log={tmp / 'rounds.jsonl'}"
    )
    return subprocess.run(
        cmd, cwd=tmp, capture_output=True, text=True, timeout=200, preexec_fn=_small_files if limit else None
    )


@pytest.mark.broker
@pytest.mark.subprocess
def test_durable_full_disk_during_rounds_is_counted_and_the_rounds_go_on(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    log = tmp_path / "rounds.jsonl"
    pad = json.dumps({"round": 0, "pad": ""})
    log.write_text(json.dumps({"round": 0, "pad": "x" * (FSIZE - len(pad) - 1)}) + "\n")
    assert log.stat().st_size == FSIZE
    x, y = load_digits()
    devices = ("dev-1", "dev-2")
    agents = [
        start_replay_agent(mosquitto, fleet, tmp_path, d, x[k * 96 : (k + 1) * 96], y[k * 96 : (k + 1) * 96])
        for k, d in enumerate(devices)
    ]
    try:
        full = _coordinator(tmp_path, mosquitto, fleet, limit=True)
    finally:
        stop_agents(agents)
    out, err = full.stdout, full.stderr
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in rounds] == ["round 1/3", "round 2/3", "round 3/3"], out + err
    assert full.returncode == 0, err
    # counted: one line for the refused appends in a row, naming the log, not one a round
    refused = [line for line in err.splitlines() if "not written" in line]
    assert len(refused) == 1 and f"round log {log} not written" in refused[0], err
    assert log.stat().st_size == FSIZE  # nothing torn appended

    log.write_text("")  # room again: the next start appends the rounds the state file closed
    again = _coordinator(tmp_path, mosquitto, fleet, limit=False)
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout
    assert [(e["round"], e["recovered"], len(e["update_ids"])) for e in log_lines(log)] == [
        (1, True, 2),
        (2, True, 2),
        (3, True, 2),
    ]


def _state_never_fits() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (12 * 1024, 12 * 1024))  # the state record is ~24 KiB


@pytest.mark.broker
@pytest.mark.subprocess
def test_durable_full_disk_at_a_round_close_holds_the_round_and_keeps_running(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """The state file cannot hold the closed round: its head is not published and the process stays up
    (it exited 4 ``cannot start: [Errno 27] File too large`` at the close), until SIGTERM (exit 75)."""
    x, y = load_digits()
    agents = [
        start_replay_agent(mosquitto, fleet, tmp_path, d, x[k * 96 : (k + 1) * 96], y[k * 96 : (k + 1) * 96])
        for k, d in enumerate(("dev-1", "dev-2"))
    ]
    state = tmp_path / "state.rec"
    cmd = _coordinator_cmd(mosquitto, fleet, 1, f"files.state={state}")
    coord = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_state_never_fits,
    )
    try:
        assert coord.stderr is not None
        head = []
        for line in coord.stderr:
            head.append(line)
            if "the round's result waits for it" in line:
                break
        assert "round 1: state file" in head[-1], "".join(head)
        assert coord.poll() is None  # still running, the round's head held back
        coord.send_signal(signal.SIGTERM)
        out, err = coord.communicate(timeout=60)
    finally:
        if coord.poll() is None:
            coord.kill()
        stop_agents(agents)
    err = "".join(head) + err
    assert not [line for line in out.splitlines() if line.startswith("round 1")], out  # never closed
    assert "cannot start" not in err, err
    assert coord.returncode == 75, err
    assert err.strip().splitlines()[-1].startswith(f"edgefl coordinator: state file {state} not saved"), err
