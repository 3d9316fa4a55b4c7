"""The coordinator's intake of chunked updates under a hostile device's stream of chunk sets: a real
mosquitto, a real coordinator process and a real agent process whose updates travel in chunks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from conftest import INT8_MODEL, ROOT, Broker, start_replay_agent
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from edgefl.datasets import load_digits, split_digits
from edgefl.launcher import stop_agents
from edgefl.wire.chunking import Chunk, encode_chunk

pytestmark = pytest.mark.timeout(240)


class ChunkFlood:
    """A device account publishing first chunks of ever new 4 MiB sets on its own update topic."""

    def __init__(self, port: int, topic: str) -> None:
        self.sent = 0
        self.stop = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"att-{uuid.uuid4().hex[:8]}",
            protocol=MQTTProtocolVersion.MQTTv5,
        )
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.thread = threading.Thread(target=self._run, args=(topic,), daemon=True)
        self.thread.start()

    def _run(self, topic: str) -> None:
        while not self.stop.wait(0.001):
            chunk = Chunk(os.urandom(8).hex(), 0, 64, 4 << 20, "0" * 64, b"\0" * 100)
            self.client.publish(topic, encode_chunk(chunk), qos=0)
            self.sent += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.subprocess
def test_hostile_chunk_flood_from_one_device_never_evicts_another_devices_update(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    # dev-1's ~21 kB update goes out in ~11 chunks of 2 KiB, each after the PUBACK of the one before;
    # dev-x meanwhile starts a new chunk set claiming 4 MiB every millisecond on its own topic. Before,
    # each of its sets evicted the least recently active set, dev-1's included: the round got 0 of 1.
    x, y = load_digits()
    pool = split_digits(y).devices[:300]
    agent = start_replay_agent(
        mosquitto, fleet, tmp_path, "dev-1", x[pool], y[pool], broker__max_packet_bytes="2048"
    )
    flood = ChunkFlood(mosquitto.port, f"edgefl/{fleet}/update/dev-x")
    try:
        profile = ROOT / "firmware_configs" / "coordinator.toml"
        cmd = [sys.executable, "-m", "edgefl.cli", "coordinator", str(profile)]
        for item in (
            f"broker.url={mosquitto.url}",
            f"fleet.name={fleet}",
            f"model.path={INT8_MODEL}",
            "robustness.tolerate=0",
            "rounds.count=1",
            "rounds.min_clients=1",
            "rounds.expected_clients=1",
            "rounds.deadline_s=30",
        ):
            cmd += ["--set", item]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    finally:
        flood.close()
        stop_agents([agent])
    assert flood.sent > 100, flood.sent
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "round 1/1: 1/1 clients" in done.stdout, done.stdout
    evictions = [line for line in done.stderr.splitlines() if "evicted" in line]
    assert not any("update/dev-1" in line for line in evictions), evictions[:5]
    # the flood's own sets make room for each other, and say so in 20 lines, then one every 1000th
    assert 0 < len(evictions) <= 20 + flood.sent // 1000, (len(evictions), flood.sent)
