"""``edgefl check-config`` on a profile for another kind of gateway says what it could not check here.

The armv7 profile runs on tflite-runtime, which an x86 build machine does not have: the check still
validates everything that is not about this machine, exits 0 (valid, per its help), and warns naming
the runtime, the model file and each check it skipped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from edgefl import cli
from edgefl.runtime import runtime_available

ROOT = Path(__file__).resolve().parents[1]
ARMV7 = ROOT / "firmware_configs" / "gateway_armv7_512mb.toml"
NO_TFLITE = pytest.mark.skipif(runtime_available("tflite"), reason="tflite-runtime is installed here")


@NO_TFLITE
def test_check_config_armv7_profile_here_warns_what_it_did_not_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["check-config", str(ARMV7)]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert out.startswith(f"{ARMV7}: ok (device unprovisioned-armv7, cap 128 MiB; model not loaded here: see")
    warning = [line for line in err.splitlines() if line.startswith("edgefl: warning: model.runtime")]
    assert len(warning) == 1, err
    text = warning[0]
    assert "model.runtime = 'tflite': tflite-runtime is not installed on this" in text
    assert "digits_cnn_int8_rawin.tflite' was NOT loaded and these were NOT checked" in text
    assert "training.store_capacity = 8192" in text and "memory.cap_mb = 128" in text
    assert "Run `edgefl check-config` on the gateway itself" in text


@NO_TFLITE
def test_check_config_armv7_profile_here_still_refuses_what_it_can_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["check-config", str(ARMV7), "--set", "broker.max_packet_bytes=100"]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert "broker.max_packet_bytes = 100: must be >=" in err, err


@pytest.mark.subprocess
def test_check_config_profile_for_this_machine_loads_its_model_without_that_warning() -> None:
    # its own process: check-config measures the RSS of the process it runs in against the cap
    profile = ROOT / "firmware_configs" / "gateway_aarch64_256mb.toml"  # ai-edge-litert: installed here
    assert runtime_available("litert")
    proc = subprocess.run(
        [sys.executable, "-m", "edgefl.cli", "check-config", str(profile)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == cli.EXIT_OK, proc.stderr
    assert proc.stdout.strip() == f"{profile}: ok (device unprovisioned-aarch64, cap 96 MiB)"
    assert "NOT loaded" not in proc.stderr
