"""Updates that come before their round opens (held for it): one per device, whatever one device sends.

A real ``edgefl coordinator`` service process on the session's real mosquitto, a device's updates
published by a real MQTT client.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, Broker
from test_service import wait_for

from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.rounds import Update, UpdateMetrics, encode_update

pytestmark = pytest.mark.timeout(180)


@pytest.mark.subprocess
def test_hostile_device_holds_one_early_update_however_many_base_versions_it_sends(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    # Between two rounds (most of a paced service's life) an update for the next round is held until
    # it opens, and kept in the state file. Each base version makes another valid update id: one device
    # sending 300 of them had the coordinator hold all 300 (~21 kB each, in memory and in every write
    # of the state file: 6 MB), up to 4,096 (~170 MB of RSS, ~85 MB state files).
    state = tmp_path / "state.rec"
    log = tmp_path / "coordinator.log"
    cmd = [
        sys.executable,
        "-m",
        "edgefl.cli",
        "coordinator",
        str(ROOT / "firmware_configs" / "coordinator.toml"),
    ]
    cmd += ["--broker", mosquitto.url, "--fleet", fleet, "--set", f"files.state={state}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        wait_for(
            lambda: "before round 1: waiting" in log.read_text(),
            60,
            "before round 1: waiting",
            [proc],
            tmp_path,
        )
        topic = Topics("edgefl", fleet).update("dev-x")
        W = np.random.default_rng(0).normal(size=(512, 10)).astype(np.float32)
        b = np.zeros(10, np.float32)

        async def send() -> None:
            t = MqttTransport(mosquitto.host, mosquitto.port, f"dev-x-{time.monotonic_ns()}")
            await t.start(wait_s=10)
            try:
                for base in range(300):
                    u = Update(
                        1, base, "dev-x", 50, W, b, UpdateMetrics(0.5, 0.5, 0.01, 1), f"dev-x:1:{base}"
                    )
                    await t.publish(topic, encode_update(u), qos=1)
                await t.publish(Topics("edgefl", fleet).update("dev-y"), b"\xff", qos=1)  # the last one
            finally:
                await t.stop()

        asyncio.run(send())
        wait_for(lambda: "update/dev-y" in log.read_text(), 60, "update/dev-y", [proc], tmp_path)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert text.count("held until the round opens") == 1, text[-3000:]
    assert "dev-x already has update dev-x:1:0 held for round 1" in text
    assert state.stat().st_size < 200_000, state.stat().st_size  # one held update, not 300
