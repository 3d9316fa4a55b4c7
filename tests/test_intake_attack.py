"""What one device account can do to the coordinator through the topics the broker's ACL lets it write.

Real mosquitto and an in-process coordinator. Select with ``pytest -k hostile``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from conftest import INT8_MODEL, Broker, coordinator_and_device, wait_until

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.wire.chunking import split_message
from edgefl.wire.rounds import Update, UpdateMetrics, encode_update
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
    topics = Topics("edgefl", fleet)
    fields = {"ready": True, "store_samples": 100, "new_samples": 10**6, "model_sha256": bb.sha256}
    status = encode_status(DeviceStatus("gw-3", "online", fields))
    honest = encode_status(DeviceStatus("gw-1", "online", {**fields, "new_samples": 5}))

    async def main() -> tuple[dict[str, int], list[str], dict[str, int | None]]:
        async with coordinator_and_device(mosquitto, fleet, topics, bb) as (coord, tx, pump):
            try:
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

    unanswered, waited, new_samples = asyncio.run(main())
    assert unanswered == {"gw-3": 4}
    assert waited == ["gw-1"]
    assert new_samples == {"gw-1": 5, "gw-3": 0}  # its claim opens no round


@pytest.mark.broker
def test_durable_early_chunked_update_kept_whole_in_the_state_file(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """An update for the next round that came as chunks is held again after a restart from the state file.

    The state file kept the held update's last chunk rather than the message: at the next start that
    chunk alone began a set that never completed, and the device's update was lost.
    """
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    topics = Topics("edgefl", fleet)
    rng = np.random.default_rng(0)
    update = Update(
        round=5,
        base_version=0,
        device="gw-3",
        num_examples=10,
        delta_W=rng.normal(size=W0.shape).astype(np.float32),
        delta_b=np.zeros(b0.shape, np.float32),
        metrics=UpdateMetrics(loss=0.5, accuracy=0.9, train_s=1.0, peak_rss_bytes=1 << 20),
        update_id="gw-3:5:0",
    )
    chunks = split_message(encode_update(update), topics.update("gw-3"), 4096, msg_id=update.update_id)
    assert len(chunks) > 1
    state = tmp_path / "state.rec"

    async def main() -> list[str]:
        async with coordinator_and_device(mosquitto, fleet, topics, bb) as (coord, tx, _):
            coord.state.round = 4  # between rounds 4 and 5: an update for round 5 is held
            for chunk in chunks:
                await tx.publish(topics.update("gw-3"), chunk, qos=1)
            await wait_until(lambda: "gw-3" in coord._early, 30, "gw-3's update held")
            coord.save_state(state)
        strategy = FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=1, deadline_s=5)
        restarted = Coordinator(coord.transport, topics, W0, b0, model_sha256=bb.sha256, strategy=strategy)
        assert restarted.load_state(state)
        return [u.update_id for u, _ in restarted._early.values()]

    assert asyncio.run(main()) == ["gw-3:5:0"]
