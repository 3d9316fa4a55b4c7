"""The MQTT bridge against a real mosquitto: round trips, PUBACK, retained messages, last will,
broker restarts (lost/back logged once each), backoff with full jitter."""

from __future__ import annotations

import asyncio
import logging
import random
import signal
from pathlib import Path

import numpy as np
import pytest
from conftest import DEV_PROFILE, INT8_MODEL, Broker, free_port, start_mosquitto, stop_broker

import edgefl.transport as transport_mod
from edgefl.demo import launch_agent, stop_agents
from edgefl.errors import TransportError
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.codec import decode_status

pytestmark = pytest.mark.timeout(120)


def test_transport_roundtrip_puback_and_retained(mosquitto: Broker, fleet: str) -> None:
    async def main() -> None:
        a = MqttTransport(mosquitto.host, mosquitto.port, f"a-{fleet}")
        b = MqttTransport(mosquitto.host, mosquitto.port, f"b-{fleet}")
        await a.start()
        await b.start()
        try:
            await b.subscribe(f"{fleet}/x", 1)
            await asyncio.sleep(0.2)
            await a.publish(f"{fleet}/x", b"hello", qos=1)  # returns only after the PUBACK
            msg = await asyncio.wait_for(b.queue.get(), 5)
            assert (msg.topic, msg.payload, msg.retain) == (f"{fleet}/x", b"hello", False)
            await a.publish(f"{fleet}/retained", b"kept", qos=1, retain=True)
            c = MqttTransport(mosquitto.host, mosquitto.port, f"c-{fleet}")
            await c.start()
            await c.subscribe(f"{fleet}/retained", 1)
            late = await asyncio.wait_for(c.queue.get(), 5)
            assert (late.payload, late.retain) == (b"kept", True)
            await c.stop()
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


def test_transport_bounded_queue_drops_and_counts(mosquitto: Broker, fleet: str) -> None:
    async def main() -> None:
        a = MqttTransport(mosquitto.host, mosquitto.port, f"a-{fleet}")
        b = MqttTransport(mosquitto.host, mosquitto.port, f"b-{fleet}", queue_size=3)
        await a.start()
        await b.start()
        try:
            await b.subscribe(f"{fleet}/q", 1)
            await asyncio.sleep(0.2)
            for i in range(8):
                await a.publish(f"{fleet}/q", bytes([i]), qos=1)
            await asyncio.sleep(0.5)
            assert b.queue.qsize() == 3
            assert b.dropped_total == 5
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


def test_transport_broker_down_at_start_then_restart(
    tmp_path: Path, fleet: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport_mod, "RECONNECT_MIN_S", 0.05)
    monkeypatch.setattr(transport_mod, "RECONNECT_MAX_S", 0.3)
    port = free_port()
    caplog.set_level(logging.INFO, logger="edgefl.transport")

    async def main() -> None:
        t = MqttTransport("127.0.0.1", port, f"t-{fleet}")
        await t.start(wait_s=None)  # broker not there yet: must not block or raise
        with pytest.raises(TransportError, match="not connected"):
            await t.publish(f"{fleet}/x", b"1")
        await asyncio.sleep(0.3)
        broker = start_mosquitto(tmp_path, port=port)
        try:
            await asyncio.wait_for(t.connected.wait(), 10)
            await t.subscribe(f"{fleet}/echo", 1)
            stop_broker(broker)
            await asyncio.sleep(1.0)  # several failed reconnect attempts
            assert not t.connected.is_set()
            broker = start_mosquitto(tmp_path, port=port)
            await asyncio.wait_for(t.connected.wait(), 10)
            await asyncio.sleep(0.3)
            # the subscription was renewed on the new connection
            await t.publish(f"{fleet}/echo", b"back", qos=1)
            msg = await asyncio.wait_for(t.queue.get(), 5)
            assert msg.payload == b"back"
        finally:
            await t.stop()
            stop_broker(broker)

    asyncio.run(main())
    text = [r.getMessage() for r in caplog.records]
    assert sum("broker lost" in m for m in text) == 1, text
    assert sum("broker back" in m for m in text) == 1, text
    assert sum("unreachable" in m for m in text) == 2, text  # once at start-up, once during the outage


def test_backoff_full_jitter_bounds() -> None:
    rng = random.Random(0)
    for failures, cap in ((1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (20, 30.0)):
        draws = [MqttTransport.backoff_s(failures, rng) for _ in range(400)]
        assert min(draws) >= 0.0 and max(draws) <= cap
        assert max(draws) > 0.8 * cap and min(draws) < 0.2 * cap  # spread over the whole range
    assert np.isclose(np.mean([MqttTransport.backoff_s(6, rng) for _ in range(4000)]), 15.0, rtol=0.05)


def test_last_will_marks_a_killed_agent_offline(mosquitto: Broker, fleet: str, tmp_path: Path) -> None:
    proc = launch_agent(
        DEV_PROFILE,
        {
            "device.id": "dev-will",
            "device.fleet": fleet,
            "device.state_dir": str(tmp_path / "state"),
            "broker.url": mosquitto.url,
            "broker.keepalive_s": "2",
            "model.path": str(INT8_MODEL),
            "dashboard.enabled": "false",
        },
        tmp_path / "agent.log",
    )
    topics = Topics("edgefl", fleet)

    async def main() -> list[str]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"w-{fleet}")
        await t.start()
        states: list[str] = []
        try:
            await t.subscribe(topics.status("dev-will"), 1)
            while "online" not in states and "idle" not in states:
                msg = await asyncio.wait_for(t.queue.get(), 30)
                states.append(decode_status(msg.payload).state)
            proc.send_signal(signal.SIGKILL)
            while states[-1] != "offline":
                msg = await asyncio.wait_for(t.queue.get(), 30)
                states.append(decode_status(msg.payload).state)
        finally:
            await t.stop()
        return states

    try:
        states = asyncio.run(main())
    finally:
        stop_agents([proc])
    assert states[-1] == "offline"
    assert proc.returncode == -signal.SIGKILL
