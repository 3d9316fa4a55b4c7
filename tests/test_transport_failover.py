"""The transport's broker address list (issue 16: a root coordinator on a clustered root broker)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    INT8_MODEL,
    ROOT,
    free_port,
    start_mosquitto,
    start_replay_agent,
    stop_broker,
    wait_until,
)

import edgefl.transport as transport_mod
from edgefl.datasets import load_digits, split_digits
from edgefl.launcher import stop_agents
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.global_model import decode_global_model
from edgefl.wire.rounds import Update, UpdateMetrics, decode_round, encode_update

pytestmark = pytest.mark.subprocess  # every test here starts a process

W0 = Backbone(INT8_MODEL).head_from_model()[0]


@pytest.fixture(autouse=True)
def _fast_reconnect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_mod, "RECONNECT_MIN_S", 0.05)
    monkeypatch.setattr(transport_mod, "RECONNECT_MAX_S", 0.3)


def test_transport_fails_over_to_the_next_broker_address(tmp_path: Path, fleet: str) -> None:
    """A lost broker: the next connection goes to the next address, the subscription comes along."""
    a, b = start_mosquitto(tmp_path), start_mosquitto(tmp_path)

    async def main() -> tuple[int, int, bytes]:
        t = MqttTransport(a.host, a.port, f"t-{fleet}", alternates=[(b.host, b.port)])
        try:
            await t.start(wait_s=10)
            first = t.port
            await t.subscribe(f"{fleet}/echo", 1)
            stop_broker(a)
            await wait_until(lambda: t.connected.is_set() and t.port == b.port, 15, "connected to b")
            await t.publish(f"{fleet}/echo", b"on b", qos=1)  # re-subscribed before "connected"
            msg = await asyncio.wait_for(t.queue.get(), 5)
            return first, t.port, msg.payload
        finally:
            await t.stop()

    try:
        assert asyncio.run(main()) == (a.port, b.port, b"on b")
    finally:
        stop_broker(b)
        stop_broker(a)


def test_transport_starts_on_the_next_address_when_the_first_is_down(tmp_path: Path, fleet: str) -> None:
    b = start_mosquitto(tmp_path)

    async def main() -> int:
        t = MqttTransport("127.0.0.1", free_port(), f"t-{fleet}", alternates=[(b.host, b.port)])
        try:
            await t.start(wait_s=10)
            return t.port
        finally:
            await t.stop()

    try:
        assert asyncio.run(main()) == b.port
    finally:
        stop_broker(b)


def test_coordinator_fails_over_to_broker_alternates(tmp_path: Path, fleet: str) -> None:
    """`edgefl coordinator` with ``broker.alternates``: its broker stops while round 1 is open; it connects
    to the next URL, announces the round there (that broker has no session of it), and closes the round
    with a device's update published on that broker (QoS 1, the global head retained there)."""
    a, b = start_mosquitto(tmp_path), start_mosquitto(tmp_path)
    log = tmp_path / "rounds.jsonl"
    cmd = [
        sys.executable, "-m", "edgefl.cli", "--log-level", "INFO", "coordinator",
        "--fleet", fleet, "--model", str(INT8_MODEL), "--rounds", "1", "--strategy", "fedavg",
        "--min-clients", "1", "--tolerate", "0", "--deadline", "60", "--broker", a.url, "--log", str(log),
        "--set", f'broker.alternates=["{b.url}"]',
    ]  # fmt: skip
    out = open(tmp_path / "coordinator.out", "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=out)
    topics = Topics("edgefl", fleet)

    async def main() -> int:
        watch_a = MqttTransport(a.host, a.port, f"watch-a-{fleet}")
        await watch_a.start(wait_s=10)
        await watch_a.subscribe(topics.round, 1)
        ann = decode_round((await asyncio.wait_for(watch_a.queue.get(), 60)).payload)  # round 1 is open
        await watch_a.stop()
        stop_broker(a)
        device = MqttTransport(b.host, b.port, f"dev-{fleet}")
        await device.start(wait_s=10)
        try:
            await device.subscribe(topics.round, 1)
            await device.subscribe(topics.global_model, 1)
            again = await _next(device, topics.round, 30)  # announced again, on b
            assert decode_round(again).round == ann.round == 1
            shape = (W0.shape[0], W0.shape[1])
            dW, db = np.full(shape, 0.01, np.float32), np.zeros(shape[1], np.float32)
            upd = Update(1, ann.base_version, "d1", 20, dW, db, UpdateMetrics(0.5, 0.5, 0.1, 1000), "d1:1:0")
            await device.publish(topics.update("d1"), encode_update(upd), qos=1)
            head = decode_global_model(await _next(device, topics.global_model, 30, version=1))
            return head.version
        finally:
            await device.stop()

    try:
        assert asyncio.run(main()) == 1
        assert proc.wait(timeout=30) == 0
        line = json.loads(log.read_text().splitlines()[0])
        assert line["update_ids"] == ["d1:1:0"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        print((tmp_path / "coordinator.out").read_text(errors="replace")[-3000:])
        stop_broker(b)
        stop_broker(a)


def test_agent_fails_over_to_broker_alternates(tmp_path: Path, fleet: str) -> None:
    """`edgefl run` with ``broker.alternates``: its broker stops after it came online; it connects to the
    next URL, and a coordinator there counts its update of round 1."""
    a, b = start_mosquitto(tmp_path), start_mosquitto(tmp_path)
    x, y = load_digits()
    pool = split_digits(y).devices[:300]
    agent = start_replay_agent(
        a, fleet, tmp_path, "dev-1", x[pool], y[pool], broker__alternates=f'["{b.url}"]'
    )
    topics = Topics("edgefl", fleet)

    async def online_on_a() -> None:
        watch = MqttTransport(a.host, a.port, f"watch-a-{fleet}")
        await watch.start(wait_s=10)
        try:
            await watch.subscribe(topics.status("dev-1"), 1)
            await _next(watch, topics.status("dev-1"), 60)
        finally:
            await watch.stop()

    log = tmp_path / "rounds.jsonl"
    try:
        asyncio.run(online_on_a())
        stop_broker(a)
        cmd = [
            sys.executable, "-m", "edgefl.cli", "coordinator", "--fleet", fleet, "--model", str(INT8_MODEL),
            "--rounds", "1", "--strategy", "fedavg", "--min-clients", "1", "--tolerate", "0",
            "--deadline", "90", "--broker", b.url, "--log", str(log),
        ]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        line = json.loads(log.read_text().splitlines()[0])
        assert line["update_ids"] == ["dev-1:1:0"], (tmp_path / "dev-1.log").read_text()[-3000:]
    finally:
        stop_agents([agent])
        stop_broker(b)
        stop_broker(a)


async def _next(t: MqttTransport, topic: str, timeout_s: float, version: int | None = None) -> bytes:
    """The next non-empty payload on ``topic`` (a global head of ``version`` when given)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    while True:
        msg = await asyncio.wait_for(t.queue.get(), max(0.1, until - loop.time()))
        if msg.topic != topic or not msg.payload:
            continue
        if version is None or decode_global_model(msg.payload).version == version:
            return msg.payload
