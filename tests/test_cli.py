"""The ``edgefl`` command's contracts: exit codes and messages of check-config, the sub-commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.subprocess  # every test here starts a process

ALL_PROFILES = sorted((ROOT / "firmware_configs").glob("*.toml"))
PROFILES = [p for p in ALL_PROFILES if p.name != "coordinator.toml"]  # device profiles


def edgefl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgefl.cli", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


@pytest.mark.parametrize("profile", ALL_PROFILES, ids=[p.stem for p in ALL_PROFILES])
def test_check_config_passes_every_shipped_profile(profile: Path) -> None:
    r = edgefl("check-config", str(profile))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{profile}: ok")


def test_check_config_lists_every_problem_and_exits_1() -> None:
    r = edgefl(
        "check-config",
        str(PROFILES[0]),
        "--set",
        "memory.cap_mb=0",
        "--set",
        "broker.qos=3",
        "--set",
        "x.y=1",
    )
    assert r.returncode == 1
    assert "memory.cap_mb = 0: must be > 0" in r.stderr
    assert "broker.qos = 3: must be 0, 1 or 2" in r.stderr
    assert "x.y: unknown table [x]" in r.stderr
    assert "Traceback" not in r.stderr


def test_help_lists_the_sub_commands() -> None:
    r = edgefl("--help")
    assert r.returncode == 0
    commands = ["run", "check-config", "demo", "coordinator", "profile", "memory-report", "wheelhouse"]
    commands.append("feed")
    for name in commands:
        assert name in r.stdout, name


def test_run_parses_without_importing_the_tools() -> None:
    # the agent's process (`edgefl run`) does not load the tools' modules; other commands see them all
    code = (
        "import sys; from edgefl.cli import build_parser\n"
        "tools = ('edgefl.agent.memreport', 'edgefl.feed', 'edgefl.modeltool',"
        " 'edgefl.coordinator.bridge')\n"
        "runs = (['--log-level', 'run', 'run', 'p.toml'], ['--log-level=INFO', 'model', 'inspect', 'm'])\n"
        "for argv in runs:\n"
        "    args = build_parser(argv).parse_args(argv)\n"
        "    print(args.command, sorted(m for m in tools if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "run []",
        "model ['edgefl.agent.memreport', 'edgefl.coordinator.bridge', 'edgefl.feed', 'edgefl.modeltool']",
    ]
    assert edgefl("run", "--help").returncode == 0
    unknown = edgefl("nosuch")
    assert unknown.returncode == 2 and "'memory-report'" in unknown.stderr


def test_check_config_of_a_coordinator_profile_names_its_role() -> None:
    profile = str(ROOT / "firmware_configs" / "coordinator.toml")
    flat = edgefl("check-config", profile)
    site = edgefl("check-config", profile, "--set", "hierarchy.role=site", "--set", "hierarchy.site=lyon")
    root_sets = ["hierarchy.role=root", "hierarchy.expected_sites=20", "hierarchy.allow_unsigned_sites=true",
                 "hierarchy.site_devices=50"]
    root = edgefl("check-config", profile, *[arg for item in root_sets for arg in ("--set", item)])
    want = (
        f"{profile}: ok (coordinator of fleet default, rounds of median until stopped, role flat, "
        "tolerates 1 hostile device of 3)\n"
    )
    assert flat.stdout == want, flat.stdout + flat.stderr
    one = ", tolerates 1 hostile device of 3)"
    assert site.stdout.rstrip().endswith(", role site lyon" + one), site.stdout + site.stderr
    assert root.stdout.rstrip().endswith(", role root of 20 sites" + one), root.stdout + root.stderr
    zero = edgefl("check-config", profile, "--set", "robustness.tolerate=0")
    assert zero.stdout.rstrip().endswith(", role flat, tolerates no hostile device)"), zero.stdout


def test_help_texts_name_every_sub_command_exit_code_and_profile_key() -> None:
    top = edgefl("--help")
    description = " ".join(top.stdout.split("\n\n")[1].split())  # the paragraph after the usage
    for name in ("run", "check-config", "demo", "coordinator", "feed", "wheelhouse", "bridge-config"):
        assert name in description, (name, description)
    coord = " ".join(edgefl("coordinator", "--help").stdout.split())
    assert "2 usage (a bad flag or --set)" in coord
    assert "and expect as many clients a round; same as --set rounds.expected_clients=VALUE" in coord
    assert "(not the devices' training.clip_norm); same as --set robustness.norm_bound=VALUE" in coord
