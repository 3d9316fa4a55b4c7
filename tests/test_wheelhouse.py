"""What a wheelhouse carries beside its wheels: the profiles, models, install.sh and the systemd units.

The coordinator's unit ships beside the agents' (``systemd/edgefl-coordinator.service``), and its
restart policy follows ``edgefl coordinator``'s exit codes. Offline: the support files are written by
the builder's own step (:func:`cross_build.wheelhouse.write_support_files`), no wheel is downloaded.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest

from cross_build import wheelhouse as wh
from edgefl.coordinator import command
from edgefl.coordinator.runner import (
    EXIT_EMPTY_ROUND,
    EXIT_FAULT,
    EXIT_INVALID,
    EXIT_LEASE,
    EXIT_MODEL,
    EXIT_RUNTIME,
)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("wheel")


def _unit_values(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


@pytest.fixture
def support(tmp_path: Path) -> Path:
    out = tmp_path / "house"
    out.mkdir()
    wh.write_support_files(out, ROOT, "/srv/edgefl")
    return out


def test_wheelhouse_carries_the_coordinator_unit_beside_the_agents(support: Path) -> None:
    units = sorted(p.name for p in (support / "systemd").iterdir())
    # one agent unit per device profile whose state lives under /var/lib, and the coordinator's
    assert units == [
        "edgefl-coordinator.service",
        "gateway_aarch64_256mb.service",
        "gateway_aarch64_256mb_mobilenet.service",
        "gateway_armv7_512mb.service",
        "rpi4.service",
    ]
    assert (support / "firmware_configs" / "coordinator.toml").is_file()
    assert (support / "install.sh").stat().st_mode & 0o111
    v = _unit_values((support / "systemd" / "edgefl-coordinator.service").read_text(encoding="utf-8"))
    assert v["ExecStart"] == (
        "/srv/edgefl/current/venv/bin/edgefl coordinator /etc/edgefl/coordinator.toml $EDGEFL_ARGS"
    )
    assert (v["User"], v["StateDirectory"], v["ProtectSystem"]) == (
        "edgefl-coordinator",
        "edgefl-coordinator",
        "strict",
    )
    agent = _unit_values((support / "systemd" / "rpi4.service").read_text(encoding="utf-8"))
    assert agent["ExecStart"].startswith("/srv/edgefl/current/venv/bin/edgefl run ")


def test_wheelhouse_coordinator_unit_restarts_what_may_heal_never_config_errors_or_exit_6(
    support: Path,
) -> None:
    v = _unit_values((support / "systemd" / "edgefl-coordinator.service").read_text(encoding="utf-8"))
    assert (v["Restart"], v["StartLimitIntervalSec"]) == ("on-failure", "0")
    assert (v["RestartSec"], v["RestartSteps"], v["RestartMaxDelaySec"]) == ("10s", "6", "5min")
    prevented = {int(code) for code in v["RestartPreventExitStatus"].split()}
    usage = 2  # argparse
    assert prevented == {EXIT_INVALID, usage, EXIT_MODEL, EXIT_LEASE} == {1, 2, 3, 6}
    # restarted (on-failure, not prevented): start-up errors, a job's empty round, a fault
    assert {EXIT_RUNTIME, EXIT_EMPTY_ROUND, EXIT_FAULT} == {4, 5, 75}
    assert not prevented & {EXIT_RUNTIME, EXIT_EMPTY_ROUND, EXIT_FAULT}


def test_wheelhouse_coordinator_fault_exits_75_not_1(capsys: pytest.CaptureFixture[str]) -> None:
    """An error nobody foresaw in a running coordinator ends in 75 (restarted), never in 1 (a profile
    error, which the unit does not restart)."""

    def failing_evaluation(profile: object, backbone: object) -> None:
        raise RuntimeError("evaluation set vanished")

    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["coordinator", str(ROOT / "firmware_configs" / "coordinator.toml")])
    assert command.main(args, evaluation=failing_evaluation) == EXIT_FAULT
    err = capsys.readouterr().err
    assert "edgefl coordinator: stopped by a fault: RuntimeError: evaluation set vanished" in err


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.subprocess
def test_wheelhouse_coordinator_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    prefix = tmp_path / "opt"
    exe = prefix / "current" / "venv" / "bin" / "edgefl"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    unit = tmp_path / "edgefl-coordinator.service"
    unit.write_text(wh.render_coordinator_unit(str(prefix)), encoding="utf-8")
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    lines = [
        ln
        for ln in proc.stderr.splitlines()
        if "edgefl-coordinator.service" in ln
        and "RestartSteps" not in ln
        and "RestartMaxDelaySec" not in ln  # systemd < 254 does not know the backoff keys
    ]
    assert lines == [], proc.stderr
