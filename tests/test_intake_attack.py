"""What one device account can do to the coordinator through the topics the broker's ACL lets it write.

Real mosquitto and an in-process coordinator. Select with ``pytest -k hostile``.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import INT8_MODEL, Broker, wait_until

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.status import DeviceStatus, encode_status

pytestmark = pytest.mark.timeout(120)


@pytest.mark.broker
def test_hostile_silent_mark_survives_the_device_clearing_its_retained_status(
    mosquitto: Broker, fleet: str
) -> None:
    """A device asked and silent is not waited for again by clearing its status and publishing it anew.

    Its account may write ``status/<device>``: an empty retained payload there made the coordinator
    forget the device with its silence mark, so the next status (10^6 new samples) opened a round
    and held it to its deadline again, every round.
    """
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    topics = Topics("edgefl", fleet)
    fields = {"ready": True, "store_samples": 100, "new_samples": 10**6, "model_sha256": bb.sha256}
    status = encode_status(DeviceStatus("gw-3", "online", fields))
    honest = encode_status(DeviceStatus("gw-1", "online", {**fields, "new_samples": 5}))

    async def main() -> tuple[dict[str, int], list[str], dict[str, int | None]]:
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
            coord.state.round = 4
            await tx.publish(topics.status("gw-1"), honest, qos=1)
            await tx.publish(topics.status("gw-3"), status, qos=1, retain=True)
            await wait_until(lambda: len(coord.registry.devices) == 2, 30, "both statuses kept")
            coord.registry.note_silent(["gw-3"], 4)  # asked in round 4, it sent nothing
            await tx.publish(topics.status("gw-3"), b"", qos=1, retain=True)
            await wait_until(lambda: "gw-3" not in coord.registry.devices, 30, "gw-3's status cleared")
            await tx.publish(topics.status("gw-3"), status, qos=1, retain=True)
            await wait_until(lambda: "gw-3" in coord.registry.devices, 30, "gw-3's status kept again")
            assert not pump.done()
            reg = coord.registry
            return dict(reg.unanswered), reg.waited_devices(), reg.ready_new_samples()
        finally:
            await tx.publish(topics.status("gw-3"), b"", qos=1, retain=True)
            pump.cancel()
            await tx.stop()
            await t.stop()

    unanswered, waited, new_samples = asyncio.run(main())
    assert unanswered == {"gw-3": 4}
    assert waited == ["gw-1"]
    assert new_samples == {"gw-1": 5, "gw-3": 0}  # its claim opens no round
