"""``check-config`` and ``run`` refuse what a valid profile still cannot run with here (issue 15 item 8)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEV_PROFILE, ROOT

pytestmark = pytest.mark.subprocess  # every test here starts a process


def edgefl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgefl.cli", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.store_capacity=1000000000000", "training.store_capacity = 1000000000000: the store needs"),
        ("training.store_capacity=1000000000", "of memory (D = 512), over the cap less reserve (88.0 MiB)"),
        ("device.state_dir=/proc/edgefl", "device.state_dir = '/proc/edgefl': is on a pseudo file system"),
        ("broker.max_packet_bytes=1", "broker.max_packet_bytes = 1: must be >= 512"),
        ("memory.cap_mb=40", "memory.cap_mb = 40: under the model's floor of "),
    ],
)
def test_fault_check_config_and_run_refuse_what_cannot_run(
    tmp_path: Path, override: str, message: str
) -> None:
    sets = ["--set", override, "--set", f"device.state_dir={tmp_path / 'state'}"]
    if override.startswith("device.state_dir"):
        sets = ["--set", override]
    if override.startswith("memory.cap_mb"):
        sets += ["--set", "memory.reserve_mb=4"]
    checked = edgefl("check-config", str(DEV_PROFILE), *sets)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert message in checked.stderr, checked.stderr
    assert "Traceback" not in checked.stderr
    if override.startswith(("training.store_capacity=1000000000000", "memory.cap_mb")):  # run checks too
        ran = edgefl("run", str(DEV_PROFILE), *sets, "--set", "broker.url=mqtt://127.0.0.1:9")
        assert ran.returncode == 1, ran.stderr
        assert message in ran.stderr and "Traceback" not in ran.stderr
        assert not (tmp_path / "state" / "store_emb.f16").exists()  # nothing was allocated


def test_fault_state_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    checked = edgefl("check-config", str(DEV_PROFILE), "--set", f"device.state_dir={a_file}")
    assert checked.returncode == 1
    assert f"device.state_dir = '{a_file}': is not a folder" in checked.stderr


def test_fault_check_config_states_the_floor_and_passes_the_shipped_cap(tmp_path: Path) -> None:
    ok = edgefl("check-config", str(DEV_PROFILE), "--set", f"device.state_dir={tmp_path}")
    assert ok.returncode == 0, ok.stderr
    low = edgefl(
        "check-config",
        str(DEV_PROFILE),
        "--set",
        f"device.state_dir={tmp_path}",
        "--set",
        "memory.cap_mb=40",
        "--set",
        "memory.reserve_mb=4",
    )
    floor = float(low.stderr.split("under the model's floor of ")[1].split(" MiB")[0])
    assert 40 < floor < 92  # above the refused cap, under the shipped 96 MiB less its 8 MiB reserve


def test_ingest_bounds_count_in_the_floor(tmp_path: Path) -> None:
    # queue 256 x (64 B + 300) + pending 1024 x (512 x 4 B + 300) + 4096 ids x 100 = 2,907,136 B
    low = edgefl(
        "check-config",
        str(DEV_PROFILE),
        *("--set", f"device.state_dir={tmp_path}", "--set", "memory.cap_mb=40"),
        *("--set", "memory.reserve_mb=4"),
    )
    assert "the live ingest at its bounds 2.8 MiB" in low.stderr, low.stderr
    # a pending table of 100,000 embeddings (+ the queue and ids: 235,302,784 B) does not fit 96 MiB
    big = edgefl(
        "check-config",
        str(DEV_PROFILE),
        *("--set", f"device.state_dir={tmp_path}", "--set", "source.pending_max=100000"),
    )
    assert big.returncode == 1 and "the live ingest at its bounds 224.4 MiB" in big.stderr, big.stderr


def test_check_config_warns_about_plain_credentials_and_a_username_other_than_the_device(
    tmp_path: Path,
) -> None:
    sets = ["--set", f"device.state_dir={tmp_path}", "--set", "broker.password=secret-pw"]
    remote = edgefl(
        "check-config",
        str(DEV_PROFILE),
        *sets,
        "--set",
        "broker.url=mqtt://192.0.2.7:1883",
        "--set",
        "broker.username=gateway",
    )
    assert remote.returncode == 0, remote.stderr  # warnings, not problems
    assert "broker.url = 'mqtt://192.0.2.7:1883': the broker password goes to 192.0.2.7 in plain text" in (
        remote.stderr
    )
    assert "broker.username = 'gateway' is not device.id = " in remote.stderr
    assert "secret-pw" not in remote.stderr + remote.stdout
    # on loopback, with the device's own id as username: no warning
    device_id = next(
        line.split("=", 1)[1].strip().strip('"')
        for line in DEV_PROFILE.read_text().splitlines()
        if line.strip().startswith("id") and "=" in line
    )
    local = edgefl("check-config", str(DEV_PROFILE), *sets, "--set", f"broker.username={device_id}")
    assert local.returncode == 0, local.stderr
    assert "warning: broker." not in local.stderr, local.stderr
