"""A coordinator whose state file cannot be written at its stop says so and exits 75 (hostile disk).

A full disk (here a file-size limit, ``RLIMIT_FSIZE``, below the state file's ~20 KiB) made the stop's
save fail silently: the log said "the open round saved" and the process exited 0 with no state file.
Real mosquitto, the real coordinator process on the shipped profile. Select with ``pytest -k hostile``.
"""

from __future__ import annotations

import asyncio
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Broker

from edgefl.transport import MqttTransport

pytestmark = pytest.mark.timeout(120)

COORDINATOR_PROFILE = ROOT / "firmware_configs" / "coordinator.toml"


def _small_files() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 * 1024, 8 * 1024))  # the state file is ~20 KiB


@pytest.mark.subprocess
def test_hostile_full_disk_at_the_stop_names_the_state_file_and_exits_75(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    state = tmp_path / "state.rec"
    cmd = [sys.executable, "-m", "edgefl.cli", "coordinator", str(COORDINATOR_PROFILE)]
    for item in (
        f"broker.url={mosquitto.url}",
        f"fleet.name={fleet}",
        f"files.state={state}",
        "dashboard.enabled=false",
    ):
        cmd += ["--set", item]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_small_files
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"coordinator of fleet {fleet}"), line
        # start-up done once it waits for round 1's devices: from then on a stop saves the state file
        assert proc.stderr is not None
        head = []
        for log_line in proc.stderr:
            head.append(log_line)
            if "before round 1:" in log_line:
                break
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
        err = "".join(head) + err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err[-2000:]
    assert f"edgefl coordinator: state file {state} not saved at the stop" in err
    assert "File too large" in err
    assert not state.exists()


@pytest.mark.broker
def test_hostile_full_disk_leaves_the_lease_released(mosquitto: Broker, fleet: str, tmp_path: Path) -> None:
    # the failed save does not keep the coordinator from clearing its lease: the next one starts at once
    async def lease_payload() -> bytes | None:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"probe-{fleet}")
        await t.start(wait_s=10)
        try:
            await t.subscribe(f"edgefl/{fleet}/coordinator", 1)
            try:
                msg = await asyncio.wait_for(t.queue.get(), 1.0)
            except TimeoutError:
                return None
            return msg.payload
        finally:
            await t.stop()

    test_hostile_full_disk_at_the_stop_names_the_state_file_and_exits_75(mosquitto, fleet, tmp_path)
    assert not asyncio.run(lease_payload())  # cleared (empty) or none retained
