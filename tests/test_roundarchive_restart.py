"""The fleet page's round records after a coordinator restart: the rounds an earlier process closed keep
their refusals, declines and silent devices. Real mosquitto, real ``edgefl coordinator`` processes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import cbor2
import paho.mqtt.client as mqtt
import pytest
from conftest import ROOT, Broker, free_port
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from test_service import wait_for

pytestmark = pytest.mark.timeout(180)

PROFILE = ROOT / "firmware_configs" / "coordinator.toml"
MODEL = ROOT / "models" / "digits_cnn_int8_rawin.tflite"  # the shipped profile's


def coordinator(tmp: Path, broker: Broker, fleet: str, *sets: str) -> list[str]:
    cmd = [sys.executable, "-m", "edgefl.cli", "coordinator", str(PROFILE), "--broker", broker.url]
    cmd += [
        "--fleet",
        fleet,
        "--set",
        f"files.state={tmp / 'state.rec'}",
        "--set",
        f"files.log={tmp / 'rounds.jsonl'}",
    ]
    for item in ("robustness.tolerate=0", "rounds.min_clients=1", *sets):
        cmd += ["--set", item]
    return cmd


@pytest.mark.subprocess
def test_hostile_round_reasons_survive_a_coordinator_restart_on_the_fleet_page(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    # Round 1: a device says it is ready and never answers, another account sends a junk update.
    # The process that closed the round showed "refused: bad_cbor 1" and "no answer: dev-s"; the one
    # restarted on its state file showed "-" for both (its records come from the state file).
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"att-{uuid.uuid4().hex[:8]}",
        protocol=MQTTProtocolVersion.MQTTv5,
    )
    announced = threading.Event()
    client.on_message = lambda c, u, m: announced.set() if m.payload else None
    client.connect(mosquitto.host, mosquitto.port)
    client.loop_start()
    try:
        client.subscribe(f"edgefl/{fleet}/round", 1)
        status = {
            "ready": True,
            "store_samples": 100,
            "model_sha256": hashlib.sha256(MODEL.read_bytes()).hexdigest(),
            "head_shape": [512, 10],
            "ts": time.time(),
        }
        doc = {"v": 1, "type": "status", "device": "dev-s", "state": "idle", "fields": status}
        client.publish(f"edgefl/{fleet}/status/dev-s", cbor2.dumps(doc), qos=1, retain=True).wait_for_publish(
            10
        )
        job = subprocess.Popen(
            coordinator(tmp_path, mosquitto, fleet, "rounds.count=1", "rounds.deadline_s=4"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        assert announced.wait(60), "round 1 never announced"
        client.publish(f"edgefl/{fleet}/update/dev-x", b"\xff", qos=1).wait_for_publish(10)
        out, _ = job.communicate(timeout=90)
        assert job.returncode == 5, out  # round 1 aggregated nothing
        assert "refused: bad_cbor 1" in out and "no answer from dev-s" in out, out
        logged = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[0])
        assert logged["refused"] == {"bad_cbor": 1} and logged["silent"] == ["dev-s"], logged

        port = free_port()
        service = subprocess.Popen(
            coordinator(tmp_path, mosquitto, fleet, "dashboard.enabled=true", f"dashboard.port={port}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        try:
            rounds = wait_for(lambda: _rounds(port), 60, "the fleet page", [service], tmp_path)
        finally:
            service.terminate()
            service.wait(30)
    finally:
        client.loop_stop()
        client.disconnect()
    assert [r["round"] for r in rounds] == [1], rounds
    assert rounds[0]["refused"] == {"bad_cbor": 1}, rounds[0]
    assert rounds[0]["silent"] == ["dev-s"] and rounds[0]["silent_devices"] == 1, rounds[0]


def _rounds(port: int) -> list[dict[str, object]]:
    """The fleet page's ``/api/rounds`` rounds (OSError while the page is not up yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/rounds", timeout=5) as r:
        rounds: list[dict[str, object]] = json.load(r)["rounds"]
    return rounds
