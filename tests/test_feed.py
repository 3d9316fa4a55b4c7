"""``edgefl feed``: samples checked before sending, the device's refusals named, large samples chunked.

Real ``edgefl feed`` processes against real agent processes on a real mosquitto (the dev profile's
raw-input int8 digits model, samples uint8 [8, 8, 1], K = 10).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import DEV_PROFILE, Broker, start_ingest_agent
from test_ingest import Gateway

from edgefl.datasets import load_digits
from edgefl.feed import check_samples

pytestmark = pytest.mark.timeout(180)


def feed_cmd(broker_url: str, fleet: str, device: str, data: Path, *more: str) -> list[str]:
    cmd = [sys.executable, "-m", "edgefl.cli", "feed", "--broker", broker_url, "--fleet", fleet]
    return [*cmd, "--device", device, "--data", str(data), "--rate", "0", *more]


def ready(broker: Broker, fleet: str, device: str) -> None:
    async def main() -> None:
        async with Gateway(broker, fleet, device) as gw:
            await gw.ready()

    asyncio.run(main())


@pytest.mark.subprocess  # the edgefl feed CLI
def test_feed_profile_checks_shape_dtype_and_labels_before_sending(tmp_path: Path) -> None:
    x, y = load_digits()
    assert check_samples(DEV_PROFILE, x[:5], y[:5]) == []
    bad_x = x[:5].reshape(5, 64).astype(np.float32)
    bad_y = np.array([1, 10, 11, 2, 12])
    assert check_samples(DEV_PROFILE, bad_x, bad_y) == [
        "x: samples of shape [64], the device's model (digits_cnn_int8_rawin.tflite) takes samples of "
        "[8, 8, 1]",
        "x: dtype float32, the device takes uint8 (pipeline.raw_dtype)",
        "y: 3 label(s) outside 0..9 (the model's head has K = 10 classes): [10, 11, 12]",
    ]
    # the CLI names them and sends nothing: no broker listens on port 9 (exit 4 if it tried)
    np.savez(tmp_path / "bad.npz", x=bad_x, y=bad_y)
    cmd = feed_cmd("mqtt://127.0.0.1:9", "f", "dev-1", tmp_path / "bad.npz", "--profile", str(DEV_PROFILE))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if "TensorFlow Lite" not in line]
    assert lines[0] == f"edgefl feed: {tmp_path / 'bad.npz'} does not fit device dev-1:"
    assert lines[1].strip().startswith("x: samples of shape [64]") and "[10, 11, 12]" in lines[3]
    # a [broker]-only file checks nothing (no model to check against)
    only_broker = tmp_path / "broker.toml"
    only_broker.write_text('[broker]\nurl = "mqtt://127.0.0.1:9"\n')
    assert check_samples(only_broker, bad_x, bad_y) == []


def test_feed_without_profile_names_the_devices_refusal(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    x, y = load_digits()
    np.savez(tmp_path / "flat.npz", x=x[:6].reshape(6, 64), y=y[:6])
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-r"))
    ready(mosquitto, fleet, "dev-r")
    cmd = feed_cmd(mosquitto.url, fleet, "dev-r", tmp_path / "flat.npz", "--wait", "60")
    done = subprocess.run(
        [*cmd, "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr  # samples without a prediction: not exit 4
    assert "fed 6 samples to dev-r" in done.stdout and "0 predictions" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == (
        "edgefl feed: device dev-r refused samples (bad_shape 6): last: "
        "x: shape [64], this model takes samples of [8, 8, 1]"
    )
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["refused"], result["predictions_received"]) == ({"bad_shape": 6}, 0)


def test_feed_samples_over_the_packet_limit_travel_in_chunks(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    x, y = load_digits()
    n = 12
    np.savez(tmp_path / "few.npz", x=x[:n], y=y[:n])
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-c"))
    ready(mosquitto, fleet, "dev-c")
    # a 120-character id makes each Sample ~250 bytes: over a 270-byte packet limit with its topic
    small = tmp_path / "small.toml"
    small.write_text(f'[broker]\nurl = "{mosquitto.url}"\nmax_packet_bytes = 270\n')
    cmd = feed_cmd(mosquitto.url, fleet, "dev-c", tmp_path / "few.npz", "--profile", str(small))
    cmd += ["--id-prefix", "i" * 120, "--json", str(tmp_path / "c.json"), "--wait", "60"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "c.json").read_text())
    assert (result["samples_sent"], result["chunked"], result["predictions_received"]) == (n, n, n)
    assert result["refused"] == {}
