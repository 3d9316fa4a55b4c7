"""The standalone coordinator under a flood of large messages from one device account: a real mosquitto,
a real ``edgefl coordinator`` service process, a real MQTT client publishing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import cbor2
import paho.mqtt.client as mqtt
import pytest
from conftest import ROOT, Broker
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from test_service import wait_for

pytestmark = pytest.mark.timeout(240)

FLOOD = 600
PAYLOAD_BYTES = 250_000


def vm_hwm_bytes(pid: int) -> int:
    """The process's peak RSS (VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.subprocess
def test_hostile_flood_of_large_updates_waits_at_the_broker_not_in_the_coordinators_memory(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    # 600 junk updates of 250 kB (150 MB) at QoS 1 from one account: the coordinator took up to its
    # Receive Maximum (256) of them into its queue and hold line, ~150 MB of peak RSS more than before
    # the flood; it now stops reading at 16 MiB held and the rest waits at the broker.
    log = tmp_path / "coordinator.log"
    cmd = [
        sys.executable,
        "-m",
        "edgefl.cli",
        "coordinator",
        str(ROOT / "firmware_configs" / "coordinator.toml"),
    ]
    cmd += ["--broker", mosquitto.url, "--fleet", fleet, "--set", f"files.state={tmp_path / 'state.rec'}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"att-{uuid.uuid4().hex[:8]}",
        protocol=MQTTProtocolVersion.MQTTv5,
    )
    try:
        wait_for(
            lambda: "before round 1: waiting" in log.read_text(),
            90,
            "before round 1: waiting",
            [proc],
            tmp_path,
        )
        before = vm_hwm_bytes(proc.pid)
        client.connect(mosquitto.host, mosquitto.port)
        client.loop_start()
        junk = [
            os.urandom(PAYLOAD_BYTES),
            cbor2.dumps({"v": 1, "type": "update", "x": [[1] * 100] * (PAYLOAD_BYTES // 400)}),
            b"\x9f" * PAYLOAD_BYTES,
            cbor2.dumps({"v": 1, "type": "update", "round": 1, "delta": {"W": bytes(PAYLOAD_BYTES)}}),
        ]
        topic = f"edgefl/{fleet}/update/dev-x"
        for i in range(FLOOD):
            info = client.publish(topic, junk[i % len(junk)], qos=1)
            if i % 50 == 49:
                info.wait_for_publish(60)
        marker = cbor2.dumps({"v": 1, "type": "status", "device": "dev-z", "state": "idle"})
        client.publish(f"edgefl/{fleet}/status/dev-y", marker, qos=1).wait_for_publish(60)  # after the flood
        wait_for(
            lambda: "status names device 'dev-z' on status/dev-y" in log.read_text(),
            150,
            "status names device 'dev-z' on status/dev-y",
            [proc],
            tmp_path,
        )
        growth = vm_hwm_bytes(proc.pid) - before
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        client.disconnect()
        client.loop_stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"\ncoordinator peak RSS growth under {FLOOD} x {PAYLOAD_BYTES} B: {growth / 2**20:.1f} MiB")
    assert growth < 48 << 20, growth
    assert "Traceback" not in log.read_text()
