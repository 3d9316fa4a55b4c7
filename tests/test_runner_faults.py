"""A coordinator started on a full disk runs (its rounds wait for room) instead of exiting at start-up.

Its instance record (``<state>.instance``, for a prompt takeover after a crash) is written at every
start: on a full disk that write ended the start with ``cannot start: [Errno 28] No space left on
device`` (exit 4, no file named), and the unit's growing restart delay (up to 5 minutes) kept the
fleet without a coordinator after room came back. Here the disk is a file-size limit
(``RLIMIT_FSIZE``) the lock file's pid fits under and no record does; real mosquitto, the real
coordinator process on the shipped profile.
"""

from __future__ import annotations

import resource
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import Broker
from test_runner_crash import _coordinator_cmd

pytestmark = pytest.mark.timeout(120)


def _nothing_fits() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # a pid fits, the smallest record does not


@pytest.mark.broker
@pytest.mark.subprocess
def test_durable_full_disk_at_start_up_runs_without_the_instance_record(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    state = tmp_path / "state.rec"
    cmd = _coordinator_cmd(mosquitto, fleet, 0, "rounds.expected_clients=0", f"files.state={state}")
    cmd[cmd.index("WARNING")] = "INFO"  # its "before round 1" line says the start is done
    coord = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_nothing_fits
    )
    try:
        assert coord.stderr is not None
        head = []
        for line in coord.stderr:
            head.append(line)
            if f"{state}.instance" in line:
                break
        assert "not written ([Errno 27] File too large)" in head[-1], "".join(head)
        for line in coord.stderr:
            head.append(line)
            if "before round 1" in line:
                break
        assert coord.poll() is None, "".join(head)  # running: the instance record is not worth a start
        coord.send_signal(signal.SIGTERM)
        _, err = coord.communicate(timeout=60)
    finally:
        if coord.poll() is None:
            coord.kill()
    err = "".join(head) + err
    assert "cannot start" not in err, err
    assert coord.returncode == 75, err  # the state file could not be saved at the stop either
    assert err.strip().splitlines()[-1].startswith(f"edgefl coordinator: state file {state} not saved"), err
