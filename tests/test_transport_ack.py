"""A message whose handling fails is acknowledged and counted, never left unacknowledged.

Against a real mosquitto on 127.0.0.1. An unacknowledged QoS 1 message holds one of the broker's
in-flight slots for the connection (MQTT 5.0 §4.9: the Receive Maximum, the queue's size; mosquitto's
``max_inflight_messages`` on 3.1.1): a run of them used to leave a peer connected but deaf. Each test
injects a fault into the real handling path for more messages than the window (> 64 and > 256), then
checks that a good message still arrives and that the faults were counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import DEV_PROFILE, INT8_MODEL, Broker, coordinator_and_device, wait_until

from edgefl.agent.config import load_profile
from edgefl.agent.core import DeviceCore
from edgefl.agent.daemon import Agent
from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.hierarchy import SiteAggregator
from edgefl.coordinator.registry import DeviceRegistry
from edgefl.mqtt_link import Message
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.status import DeviceStatus, encode_status

pytestmark = pytest.mark.timeout(120)

#: More bad messages than the transport's queue (256) and its hold line's floor (64) together.
BAD = 300


async def _publish_many(tx: MqttTransport, items: list[tuple[str, bytes]]) -> None:
    """Publish QoS 1 messages 50 at a time (each batch waits for its PUBACKs)."""
    for start in range(0, len(items), 50):
        await asyncio.gather(*(tx.publish(t, p, qos=1) for t, p in items[start : start + 50]))


@pytest.mark.parametrize(("protocol", "ack_on_commit"), [("3.1.1", False), ("5", False), ("5", True)])
def test_transport_ack_refused_messages_never_make_the_transport_deaf(
    mosquitto: Broker, fleet: str, protocol: str, ack_on_commit: bool
) -> None:
    """300 messages whose hand-over to the queue raises, then a good one: it arrives; 300 refused."""
    topic = f"edgefl/{fleet}/in"

    async def main() -> tuple[Message, dict[str, int], int]:
        rx = MqttTransport(
            mosquitto.host,
            mosquitto.port,
            f"rx-{fleet}-{protocol}",
            protocol=protocol,
            ack_on_commit=ack_on_commit,
            session_expiry_s=60 if ack_on_commit else 0,
        )
        tx = MqttTransport(mosquitto.host, mosquitto.port, f"tx-{fleet}-{protocol}")
        put = rx.queue.put_nowait

        def faulty_put(msg: Message) -> None:  # a fault in the handling path, not in the broker
            if msg.payload.startswith(b"bad"):
                raise RuntimeError("injected fault")
            put(msg)

        rx.queue.put_nowait = faulty_put  # type: ignore[method-assign,assignment]
        await rx.start(wait_s=10)
        await tx.start(wait_s=10)
        try:
            await rx.subscribe(topic, 1)
            await _publish_many(tx, [(topic, b"bad %d" % i) for i in range(BAD)])
            await tx.publish(topic, b"good", qos=1)
            got = await asyncio.wait_for(rx.queue.get(), 30)
            rx.commit()
            return got, rx.counters(), rx.queue.qsize()
        finally:
            await tx.stop()
            await rx.stop()

    got, counters, left = asyncio.run(main())
    assert got.payload == b"good"
    assert counters["refused"] == BAD
    assert counters["queue_dropped"] == 0 and left == 0


def test_transport_ack_coordinator_handler_faults_never_make_it_deaf(
    mosquitto: Broker, fleet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 statuses whose handling raises (a fault past decoding), then a good status: it is registered.

    Each fault is counted as ``rejected["failed"]`` on its device, logged on one line for the first
    ones, and the coordinator's pump keeps going.
    """
    bb = Backbone(INT8_MODEL)
    W0 = bb.head_from_model()[0]
    register = DeviceRegistry.register

    def faulty_register(self: DeviceRegistry, device: str, entry: dict[str, Any]) -> None:
        if device.startswith("bad-"):
            raise KeyError("injected fault")
        register(self, device, entry)

    monkeypatch.setattr(DeviceRegistry, "register", faulty_register)
    topics = Topics("edgefl", fleet)

    async def main() -> tuple[int, dict[str, Any]]:
        async with coordinator_and_device(mosquitto, fleet, topics, bb) as (coord, tx, _):
            bad = [
                (topics.status(f"bad-{i}"), encode_status(DeviceStatus(f"bad-{i}", "online", {"round": 0})))
                for i in range(BAD)
            ]
            await _publish_many(tx, bad)
            await tx.publish(
                topics.status("good"), encode_status(DeviceStatus("good", "online", {"round": 0})), qos=1
            )
            await wait_until(lambda: "good" in coord.registry.devices, 30, "the good status")
            return coord.state.rejected["failed"], dict(coord.registry.devices)

    failed, devices = asyncio.run(main())
    assert failed == BAD
    assert list(devices) == ["good"]
    assert np.isfinite(W0).all()


def test_transport_ack_site_faults_on_the_roots_heads_never_make_it_deaf(
    mosquitto: Broker, fleet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site acknowledges at commit (``ack_on_commit``): 300 heads whose handling raises, then a good
    status: it is registered, the 300 counted as ``failed``, and nothing is left unacknowledged."""
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()

    def faulty_head(self: SiteAggregator, msg: Message) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(SiteAggregator, "_on_head", faulty_head)
    topics = Topics("edgefl", fleet)

    async def main() -> tuple[int, list[str], int]:
        t = MqttTransport(
            mosquitto.host, mosquitto.port, f"site-{fleet}", ack_on_commit=True, session_expiry_s=60
        )
        tx = MqttTransport(mosquitto.host, mosquitto.port, f"root-{fleet}")
        await t.start(wait_s=10)
        await tx.start(wait_s=10)
        site = SiteAggregator(
            t,
            topics,
            W0,
            b0,
            model_sha256=bb.sha256,
            strategy=FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=1, deadline_s=5),
            site="s1",
        )
        pump = asyncio.create_task(site.pump())
        try:
            await site.start()
            await _publish_many(tx, [(topics.global_model, b"head %d" % i) for i in range(BAD)])
            await tx.publish(
                topics.status("good"), encode_status(DeviceStatus("good", "online", {"round": 0})), qos=1
            )
            await wait_until(lambda: "good" in site.registry.devices, 30, "the good status")
            return site.state.rejected["failed"], list(site.registry.devices), len(t._taken)
        finally:
            pump.cancel()
            await tx.stop()
            await t.stop()

    failed, devices, uncommitted = asyncio.run(main())
    assert failed == BAD
    assert devices == ["good"]
    assert uncommitted == 0


def test_transport_ack_agent_handler_faults_never_make_it_deaf(
    mosquitto: Broker, fleet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent daemon (in-process, real broker, real model): 300 global-head messages whose handling
    raises, more than its control queue (64) and its transport queue (256) hold, then a bad round: the
    bad round is still refused with its own reason, and the 300 are counted as ``failed``. (Heads, not
    round announcements: of a run of announcements only the newest is handled.)"""
    receive_global = DeviceCore.receive_global

    def faulty_global(self: DeviceCore, payload: bytes) -> Any:
        if payload.startswith(b"fault"):
            raise KeyError("injected fault")
        return receive_global(self, payload)

    monkeypatch.setattr(DeviceCore, "receive_global", faulty_global)
    profile = load_profile(
        DEV_PROFILE,
        {
            "device.id": "dev-ack",
            "device.fleet": fleet,
            "device.state_dir": str(tmp_path / "dev-ack"),
            "broker.url": mosquitto.url,
            "model.path": str(INT8_MODEL),
            "dashboard.enabled": "false",
        },
    )
    agent = Agent(profile)
    topics = Topics("edgefl", fleet)

    async def main() -> dict[str, int]:
        run = asyncio.create_task(agent.run())
        tx = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        await tx.start(wait_s=10)
        try:
            transport = await _wait_for(lambda: agent.transport)
            # the head's subscription is made once the round's is acknowledged (Agent.run's order)
            subscribed = topics.global_model + "/#"
            await wait_until(lambda: subscribed in transport.subscriptions, 60, "the agent subscribed")
            await wait_until(transport.connected.is_set, 60, "the agent connected")
            await _publish_many(tx, [(topics.global_model, b"fault %d" % i) for i in range(BAD)])
            await tx.publish(topics.round, b"\xff not cbor", qos=1)
            await wait_until(lambda: sum(agent.state.rejected.values()) > BAD, 60, "the bad round refused")
            return dict(agent.state.rejected)
        finally:
            await tx.stop()
            agent.stop_event.set()
            await asyncio.wait_for(run, 30)

    rejected = asyncio.run(main())
    assert rejected.pop("failed") == BAD
    assert sum(rejected.values()) == 1, rejected


async def _wait_for(get: Callable[[], MqttTransport | None]) -> MqttTransport:
    await wait_until(lambda: get() is not None, 60, "the agent's transport")
    value = get()
    assert value is not None
    return value
