"""A message whose handling fails is acknowledged and counted, never left unacknowledged.

Against a real mosquitto on 127.0.0.1. An unacknowledged QoS 1 message holds one of the broker's
in-flight slots for the connection (MQTT 5.0 §4.9: the Receive Maximum, the queue's size; mosquitto's
``max_inflight_messages`` on 3.1.1): a run of them used to leave a peer connected but deaf. Each test
injects a fault into the real handling path for more messages than the window (> 64 and > 256), then
checks that a good message still arrives and that the faults were counted.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from conftest import INT8_MODEL, Broker, wait_until

from edgefl.coordinator.service import Coordinator
from edgefl.coordinator.strategy import FedAvg
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import Message, MqttTransport
from edgefl.wire.messages import DeviceStatus, encode_status

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
    W0, b0 = bb.head_from_model()
    register = Coordinator._register

    def faulty_register(self: Coordinator, device: str, entry: dict[str, Any]) -> None:
        if device.startswith("bad-"):
            raise KeyError("injected fault")
        register(self, device, entry)

    monkeypatch.setattr(Coordinator, "_register", faulty_register)
    topics = Topics("edgefl", fleet)

    async def main() -> tuple[int, dict[str, Any]]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        tx = MqttTransport(mosquitto.host, mosquitto.port, f"dev-{fleet}")
        await t.start(wait_s=10)
        await tx.start(wait_s=10)
        coord = Coordinator(
            t,
            topics,
            W0,
            b0,
            model_sha256=bb.sha256,
            strategy=FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=1, deadline_s=5),
        )
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start(adopt_wait_s=0.2)
            bad = [
                (topics.status(f"bad-{i}"), encode_status(DeviceStatus(f"bad-{i}", "online", {"round": 0})))
                for i in range(BAD)
            ]
            await _publish_many(tx, bad)
            await tx.publish(
                topics.status("good"), encode_status(DeviceStatus("good", "online", {"round": 0})), qos=1
            )
            await wait_until(lambda: "good" in coord.state.devices, 30, "the good status")
            return coord.state.rejected["failed"], dict(coord.state.devices)
        finally:
            pump.cancel()
            await tx.stop()
            await t.stop()

    failed, devices = asyncio.run(main())
    assert failed == BAD
    assert list(devices) == ["good"]
    assert np.isfinite(W0).all()
