"""Smoke runs of ``bench/scale.py`` (issue 16): its own MQTT publisher, and a small hierarchical and flat
round through real mosquitto brokers, bridges and ``edgefl coordinator`` processes. The 10,000-device
figures are the bench's (``docs/benchmarks.md``, "Scale"), not asserted here."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Broker

from bench.scale import MiniPublisher, connect_packet, device_ids, main, peak_rss, publish_packet
from edgefl.mqtt_link import Message
from edgefl.transport import MqttTransport

pytestmark = pytest.mark.timeout(240)


def test_scale_bench_packets_are_mqtt_311() -> None:
    """CONNECT and PUBLISH bytes as MQTT 3.1.1 sections 3.1 and 3.3 lay them out."""
    assert connect_packet("d1") == b"\x10\x0e\x00\x04MQTT\x04\x02\x00\x00\x00\x02d1"
    pkt = publish_packet("a/b", b"xyz", 7)
    assert pkt == b"\x32\x0a\x00\x03a/b\x00\x07xyz"
    big = publish_packet("t", b"\x00" * 200, 1)  # remaining length 205 = 0xcd 0x01 (two bytes)
    assert big[1:3] == b"\xcd\x01" and len(big) == 3 + 205


def test_scale_bench_devices_spread_over_sites() -> None:
    groups = device_ids(5, 2)
    assert groups == [["s000-d000000", "s000-d000002", "s000-d000004"], ["s001-d000001", "s001-d000003"]]


def test_scale_bench_publisher_delivers_qos1(mosquitto: Broker, fleet: str) -> None:
    """Messages of the bench's publisher reach a paho subscriber (the product's transport) once each."""

    async def run() -> tuple[int, list[Message]]:
        sub = MqttTransport("127.0.0.1", mosquitto.port, f"sub-{fleet}")
        await sub.start(wait_s=10)
        pub = MiniPublisher(f"pub-{fleet}")
        try:
            await sub.subscribe(f"{fleet}/#", 1)
            await pub.connect("127.0.0.1", mosquitto.port)
            sent = await pub.publish_all([(f"{fleet}/u/{i}", bytes([i]) * 300) for i in range(5)])
            return sent, [await asyncio.wait_for(sub.queue.get(), 10) for _ in range(5)]
        finally:
            await pub.close()
            await sub.stop()

    sent, got = asyncio.run(run())
    assert sorted((m.topic, m.payload) for m in got) == [
        (f"{fleet}/u/{i}", bytes([i]) * 300) for i in range(5)
    ]
    assert sent == 5 * len(publish_packet(f"{fleet}/u/0", b"\x00" * 300, 1))


@pytest.mark.subprocess
def test_hierarch_scale_bench_smoke(tmp_path: Path) -> None:
    """20 devices over 2 sites, 1 round: every update counted once, 2 partials into the root broker."""
    out = tmp_path / "scale.json"
    assert (
        main(["--devices", "20", "--sites", "2", "--rounds", "1", "--deadline", "60", "--json", str(out)])
        == 0
    )
    doc = json.loads(out.read_text())
    assert (doc["devices"], doc["sites"], doc["flat"]) == (20, 2, False)
    (rnd,) = doc["rounds"]
    assert rnd["updates_counted"] == 20
    assert (rnd["duplicates"], rnd["missing"], rnd["root_broker_dropped"]) == (0, 0, 0)
    assert rnd["messages_into_root"] == 2  # one partial per site, not 20 updates
    assert rnd["root_peak_rss_bytes"] > 0 and rnd["site_peak_rss_bytes"] > 0
    # each site aggregator's drain figures: its 10 devices' updates, CPU it spent (or null once gone)
    assert [s["site"] for s in rnd["sites_drain"]] == [0, 1]
    assert all(s["updates_per_s_drained"] > 0 for s in rnd["sites_drain"])
    s = rnd["seconds_to_close"]  # rounded to ms: the rate is of the unrounded time
    assert 20 / (s + 0.0005) <= rnd["updates_per_s_drained"] <= 20 / (s - 0.0005)


@pytest.mark.subprocess
def test_flat_scale_bench_smoke(tmp_path: Path) -> None:
    """The same 20 devices through one flat coordinator: 20 updates into the (only) broker."""
    out = tmp_path / "scale.json"
    args = [
        "--devices",
        "20",
        "--sites",
        "2",
        "--rounds",
        "1",
        "--flat",
        "--deadline",
        "60",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    (rnd,) = json.loads(out.read_text())["rounds"]
    assert (rnd["updates_counted"], rnd["duplicates"], rnd["missing"]) == (20, 0, 0)
    assert rnd["messages_into_root"] == 20
    assert rnd["site_peak_rss_bytes"] is None
    s = rnd["seconds_to_close"]  # rounded to ms: the rate is of the unrounded time
    assert 20 / (s + 0.0005) <= rnd["updates_per_s_drained"] <= 20 / (s - 0.0005)
    assert rnd["cpu_us_per_update"] is None or rnd["cpu_us_per_update"] > 0
    assert rnd["sites_drain"] == []


@pytest.mark.subprocess
def test_peak_rss_of_a_child_that_already_exited_comes_from_its_rusage() -> None:
    """The root coordinator ends after its last round, sometimes before the bench reads its peak."""
    child = subprocess.Popen([sys.executable, "-c", "x = bytearray(64 << 20)"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it exited; left a zombie, not reaped
    assert "VmHWM" not in Path(f"/proc/{child.pid}/status").read_text()
    assert peak_rss(child) >= 64 << 20  # its lifetime peak held the 64 MiB buffer
    assert child.returncode == 0

