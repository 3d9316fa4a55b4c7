"""``edgefl check-config`` refuses every shipped-profile variant that the run would refuse, and the run
refuses it before round 1 (exit 1, one line a problem naming the dotted key, no traceback, nothing
written).

Each case is the shipped ``firmware_configs/coordinator.toml`` (or ``dev_x86.toml``) with ``--set``
overrides, given to ``edgefl check-config`` and ``edgefl coordinator`` / ``edgefl run``: the coordinator's
refusals through the CLI's ``main`` in this process (a refused profile never gets past it), the model
that cannot load, the profile that passes and the device's refusals as real processes (exit code, no
traceback).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import DEV_PROFILE

from edgefl.profiles import output_file_problem
from edgefl.resources import shipped

pytestmark = pytest.mark.timeout(180)

COORDINATOR = shipped("firmware_configs/coordinator.toml")


def _edgefl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgefl.cli", *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


def _edgefl_here(*args: str, cwd: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``edgefl ARGS`` through the CLI's ``main`` in this process, in ``cwd``: (exit code, stdout, stderr)."""
    from edgefl import cli

    root = logging.getLogger()
    handlers, level, here = root.handlers[:], root.level, Path.cwd()
    try:
        os.chdir(cwd)
        code = cli.main(list(args))
    finally:
        os.chdir(here)
        root.handlers[:] = handlers  # the coordinator command sets up the log (basicConfig)
        root.setLevel(level)
    out = capsys.readouterr()
    return code, out.out, out.err


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


#: (case id, overrides with "{tmp}" for the test's folder, the dotted key the refusal names)
COORDINATOR_CASES = [
    ("state-folder", ["files.state={tmp}"], "files.state"),
    ("json-folder", ["files.json={tmp}"], "files.json"),
    ("log-folder", ["files.log={tmp}"], "files.log"),
    ("state-proc", ["files.state=/proc/edgefl-state.cbor"], "files.state"),
    ("json-proc", ["files.json=/proc/edgefl.json"], "files.json"),
    ("log-proc", ["files.log=/proc/self/edgefl.log"], "files.log"),
    ("log-no-folder", ["files.log={tmp}/missing/rounds.log"], "files.log"),
    ("dp-trimmed-mean", ["privacy.enabled=true"], "privacy.enabled"),
    ("fedbuff-site", ["strategy.name=fedbuff", "hierarchy.role=site", "hierarchy.site=s1"], "hierarchy.role"),
    ("option-of-another-strategy", ["strategy.server_momentum=0.9"], "strategy.server_momentum"),
    ("evaluation-not-npz", ["evaluation.path={tmp}/not.npz"], "evaluation.path"),
    ("evaluation-x-y-lengths", ["evaluation.path={tmp}/mis.npz"], "evaluation.path"),
]


@pytest.mark.parametrize(
    ("overrides", "key"), [c[1:] for c in COORDINATOR_CASES], ids=[c[0] for c in COORDINATOR_CASES]
)
def test_shipped_coordinator_profile_refused_by_check_config_and_before_round_1(
    tmp_path: Path, overrides: list[str], key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sets = _sets([o.replace("{tmp}", str(tmp_path)) for o in overrides])
    (tmp_path / "not.npz").write_bytes(b"not a zip archive")
    np.savez(tmp_path / "mis.npz", x=np.zeros((5, 8, 8, 1), np.uint8), y=np.zeros(4, np.int64))
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = _edgefl_here("check-config", str(COORDINATOR), *sets, cwd=tmp_path, capsys=capsys)
    assert code == 1, out + err
    assert f"  {key} = " in err, err
    # an unreachable broker: a profile that passed would wait for it, never reach round 1
    code, out, err = _edgefl_here(
        "coordinator", str(COORDINATOR), "--set", "broker.url=mqtt://127.0.0.1:1", *sets, cwd=tmp_path,
        capsys=capsys,
    )
    assert code == 1, out + err
    assert f"  {key} = " in err and "invalid profile" in err, err
    assert "round 1" not in out + err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.subprocess
def test_shipped_coordinator_profile_with_a_model_that_cannot_load(tmp_path: Path) -> None:
    """check-config loads the model as the coordinator does at start: exit 1 naming model.path; the
    coordinator itself refuses it before connecting with its model error (exit 3), no traceback."""
    (tmp_path / "bad.tflite").write_bytes(b"\x00" * 4096)
    sets = ["--set", f"model.path={tmp_path}/bad.tflite"]
    check = _edgefl("check-config", str(COORDINATOR), *sets, cwd=tmp_path)
    assert check.returncode == 1 and "  model.path = " in check.stderr, check.stderr
    run = _edgefl(
        "coordinator", str(COORDINATOR), "--set", "broker.url=mqtt://127.0.0.1:1", *sets, cwd=tmp_path
    )
    assert run.returncode == 3 and "model error" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr + run.stdout


@pytest.mark.subprocess
def test_shipped_coordinator_profile_with_writable_files_passes(tmp_path: Path) -> None:
    sets = _sets([f"files.{name}={tmp_path}/out.{name}" for name in ("state", "log", "json")])
    check = _edgefl("check-config", str(COORDINATOR), *sets, cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    assert list(tmp_path.iterdir()) == []


DEVICE_CASES = [
    ("state-dir-proc", "device.state_dir=/proc/edgefl", "device.state_dir"),
    ("state-dir-file", "device.state_dir={tmp}/a-file", "device.state_dir"),
]


@pytest.mark.parametrize(("override", "key"), [c[1:] for c in DEVICE_CASES], ids=[c[0] for c in DEVICE_CASES])
@pytest.mark.subprocess
def test_shipped_device_profile_refused_by_check_config_and_run(
    tmp_path: Path, override: str, key: str
) -> None:
    (tmp_path / "a-file").write_text("not a folder\n")
    sets = ["--set", override.replace("{tmp}", str(tmp_path)), "--set", "broker.url=mqtt://127.0.0.1:1"]
    check = _edgefl("check-config", str(DEV_PROFILE), *sets, cwd=tmp_path)
    assert check.returncode == 1 and f"  {key} = " in check.stderr, check.stderr
    run = _edgefl("run", str(DEV_PROFILE), *sets, cwd=tmp_path)
    assert run.returncode == 1 and f"  {key} = " in run.stderr, run.stderr
    assert "Traceback" not in run.stderr + run.stdout


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/proc/x", "is on a pseudo file system (/proc, /sys, /dev)"),
        ("/dev/null", "is on a pseudo file system (/proc, /sys, /dev)"),
        ("{tmp}", "is a folder (a file name is needed)"),
        ("{tmp}/no/x", "its folder {tmp}/no does not exist"),
        ("{tmp}/f/x", "{tmp}/f is not a folder"),
        ("{tmp}/ok.json", None),
    ],
)
def test_shipped_output_file_problem(tmp_path: Path, path: str, reason: str | None) -> None:
    (tmp_path / "f").write_text("")
    tmp = str(tmp_path.resolve())
    got = output_file_problem(Path(path.replace("{tmp}", tmp)))
    assert got == (reason.replace("{tmp}", tmp) if reason else None)
