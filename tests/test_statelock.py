"""One agent per state folder (H17 item 1): the default ``state/<device.id>`` and ``agent.lock``.

Real agent processes (``edgefl run`` on a copy of the shipped dev profile) and a real mosquitto.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from conftest import DEV_PROFILE, INT8_MODEL, ROOT, TEST_STATUS_INTERVAL_S, Broker, wait_until

from edgefl.agent.state import DISK_FULL, write_problem
from edgefl.launcher import launch_agent, stop_agents


def test_fault_two_agents_on_one_state_folder(tmp_path: Path, mosquitto: Broker, fleet: str) -> None:
    profile = tmp_path / "dev.toml"
    shutil.copy(DEV_PROFILE, profile)  # the shipped profile, as the trial ran it, but state/ in tmp
    common = {
        "device.fleet": fleet,
        "broker.url": mosquitto.url,
        "model.path": str(INT8_MODEL),
        "source.kind": "none",
        "dashboard.enabled": "false",
        "status.interval_s": TEST_STATUS_INTERVAL_S,
    }
    procs = [
        launch_agent(profile, {"device.id": dev, **common}, tmp_path / f"{dev}.log")
        for dev in ("dev-1", "dev-2")
    ]
    locks = [tmp_path / "state" / dev / "agent.lock" for dev in ("dev-1", "dev-2")]

    def holds(lock: Path, pid: int) -> bool:
        return lock.is_file() and lock.read_text(encoding="ascii").strip() == str(pid)

    def started(lock: Path, p: subprocess.Popen[bytes]) -> Callable[[], bool]:
        return lambda: holds(lock, p.pid) or p.poll() is not None

    try:
        # --set device.id=... alone gives each device its own folder, each locked by its own agent
        for lock, p in zip(locks, procs, strict=True):
            asyncio.run(wait_until(started(lock, p), 60, str(lock)))
            assert p.poll() is None, (tmp_path / f"{lock.parent.name}.log").read_text()

        # a second dev-1 on dev-1's folder exits at once, one line naming the folder and the holder
        cmd = [sys.executable, "-m", "edgefl.cli", "--log-level", "WARNING", "run", str(profile)]
        for k, v in {"device.id": "dev-1", **common}.items():
            cmd += ["--set", f"{k}={v}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=dict(os.environ))
        assert r.returncode == 1, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("edgefl:")]
        assert lines == [
            f"edgefl: state folder {tmp_path / 'state' / 'dev-1'} is in use by another agent "
            f"(pid {procs[0].pid}); give each agent its own folder (device.state_dir, or a distinct "
            "device.id with the default state/<device.id>)"
        ], r.stderr
        assert "Traceback" not in r.stderr
        assert all(p.poll() is None for p in procs)
        assert holds(locks[0], procs[0].pid)  # the refused agent did not overwrite the holder's pid
    finally:
        stop_agents(procs)
    assert [p.returncode for p in procs] == [0, 0]

    # the kernel drops the lock with its process: a new agent takes the folder over
    again = launch_agent(profile, {"device.id": "dev-1", **common}, tmp_path / "dev-1b.log")
    try:
        asyncio.run(wait_until(started(locks[0], again), 60, "relock"))
        assert again.poll() is None, (tmp_path / "dev-1b.log").read_text()
    finally:
        stop_agents([again])


def test_fault_write_problem_names_a_missing_file_not_a_full_disk() -> None:
    """Only ENOSPC/EDQUOT are 'disk full' (persisting waits for room); ENOENT says what it is."""
    assert write_problem(OSError(errno.ENOSPC, "No space left on device")) == DISK_FULL
    assert write_problem(OSError(errno.EDQUOT, "Disk quota exceeded")) == DISK_FULL
    assert write_problem(OSError(errno.ENOENT, "No such file or directory")) == (
        "cannot write state: the state folder or a file in it is missing (removed while running?)"
    )
    assert (
        write_problem(OSError(errno.EACCES, "Permission denied")) == "cannot write state: Permission denied"
    )
