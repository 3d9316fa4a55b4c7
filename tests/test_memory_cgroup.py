"""Kernel enforcement: an agent in a child memory cgroup limited to its cap is never OOM-killed.

The child cgroup is created under the test process's own memory cgroup (v1 ``memory.limit_in_bytes``
or v2 ``memory.max``) and removed afterwards; where the kernel or the container refuses, the test is
skipped with the reason. ``test_wired_governor_reads_the_kernel_limit`` needs the governor wired into
``agent/daemon.py`` (the status then carries ``cgroup_limit_bytes``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import DEV_PROFILE, INT8_MODEL, TEST_STATUS_INTERVAL_S, Broker, next_status
from test_memory import _coordinator, _digits_shard

from edgefl.agent.memstat import CGROUP_ROOT, MIB

pytestmark = pytest.mark.timeout(300)

PROFILE_CAP_MB = 96
KERNEL_LIMIT_MB = 90  # under the profile's cap, so the governor's cap must come from the kernel


@dataclass
class ChildCgroup:
    path: Path
    version: int

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def max_usage(self) -> int | None:
        f = self.path / ("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")
        return int(f.read_text()) if f.exists() else None


def _own_memory_cgroup() -> tuple[Path, int]:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if "memory" in controllers.split(","):
            return CGROUP_ROOT / "memory" / rel.lstrip("/"), 1
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return CGROUP_ROOT / line[3:].lstrip("/"), 2
    raise OSError("no memory cgroup in /proc/self/cgroup")


@pytest.fixture
def child_cgroup() -> Iterator[ChildCgroup]:
    try:
        parent, version = _own_memory_cgroup()
        path = parent / f"edgefl-test-{uuid.uuid4().hex[:8]}"
        path.mkdir()
    except OSError as exc:
        reason = f"cannot create a child memory cgroup under the test's own cgroup: {exc}"
        print(reason)
        pytest.skip(reason)
    cg = ChildCgroup(path, version)
    try:
        limit = str(KERNEL_LIMIT_MB * MIB)
        if version == 1:
            (path / "memory.limit_in_bytes").write_text(limit)
            swap = path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(limit)  # no swapping out to dodge the limit
        else:
            (path / "memory.max").write_text(limit)
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
    except OSError as exc:
        path.rmdir()
        reason = f"cannot set a memory limit on {path}: {exc}"
        print(reason)
        pytest.skip(reason)
    try:
        yield cg
    finally:
        deadline = time.monotonic() + 10
        while cg.procs.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        path.rmdir()


def _launch_in(cg: ChildCgroup, overrides: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``edgefl.launcher.launch_agent``'s command, with the child joining the cgroup before exec."""
    cmd = [sys.executable, "-m", "edgefl.cli", "--log-level", "WARNING", "run", str(DEV_PROFILE)]
    for k, v in overrides.items():
        cmd += ["--set", f"{k}={v}"]

    def join() -> None:
        cg.procs.write_text(str(os.getpid()))

    with open(log, "ab") as f:
        return subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MALLOC_ARENA_MAX": "2"},
            preexec_fn=join,  # before exec: the agent is charged to the child from its start
        )


def _run_rounds(
    mosquitto: Broker, fleet: str, tmp: Path, cg: ChildCgroup, rounds: int
) -> tuple[list[int], dict[str, Any], subprocess.Popen[bytes]]:
    from edgefl.launcher import stop_agents

    proc = _launch_in(
        cg,
        {
            "device.id": "dev-1",
            "device.fleet": fleet,
            "device.state_dir": str(tmp / "state"),
            "broker.url": mosquitto.url,
            "source.kind": "replay",
            "source.path": str(_digits_shard(tmp)),
            "model.path": str(INT8_MODEL),
            "memory.cap_mb": str(PROFILE_CAP_MB),
            "training.store_capacity": "1024",
            "status.interval_s": TEST_STATUS_INTERVAL_S,
        },
        tmp / "agent.log",
    )

    async def main() -> tuple[list[int], dict[str, Any]]:
        t, coord = await _coordinator(mosquitto, fleet, deadline_s=20.0)
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            await coord.registry.wait_for_devices(1, timeout_s=90)
            clients = [(await coord.run_round(r)).clients for r in range(1, rounds + 1)]
            return clients, await next_status(coord, "dev-1")  # a status sent after the rounds
        finally:
            pump.cancel()
            await t.stop()

    try:
        clients, status = asyncio.run(main())
        assert proc.poll() is None, f"the agent exited with {proc.returncode}"
    finally:
        stop_agents([proc])
        print((tmp / "agent.log").read_text(errors="replace")[-2000:])
    return clients, status, proc


def test_agent_under_kernel_limit_is_never_oom_killed(
    mosquitto: Broker, fleet: str, tmp_path: Path, child_cgroup: ChildCgroup
) -> None:
    clients, _, proc = _run_rounds(mosquitto, fleet, tmp_path, child_cgroup, rounds=5)
    print(f"cgroup v{child_cgroup.version} max usage {child_cgroup.max_usage()} bytes, rounds {clients}")
    assert clients == [1] * 5
    assert proc.returncode in (0, -15), proc.returncode
    assert child_cgroup.oom_kills() == 0
    usage = child_cgroup.max_usage()
    if usage is not None:
        assert usage <= KERNEL_LIMIT_MB * MIB


def test_wired_governor_reads_the_kernel_limit(
    mosquitto: Broker, fleet: str, tmp_path: Path, child_cgroup: ChildCgroup
) -> None:
    clients, status, _ = _run_rounds(mosquitto, fleet, tmp_path, child_cgroup, rounds=1)
    assert clients == [1]
    assert status["cgroup_limit_bytes"] == KERNEL_LIMIT_MB * MIB
    assert status["cap_bytes"] == KERNEL_LIMIT_MB * MIB
    assert status["peak_rss_bytes"] <= status["cap_bytes"]
