"""A device left out of rounds for its silence is waited for again once its own update arrives, even late.

Real mosquitto and an in-process coordinator: an honest gateway restarted during a round and slower
than the rest would otherwise never be waited for again (its updates arriving after the quorum closed
each round). Select with ``pytest -k hostile``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import INT8_MODEL, Broker, coordinator_and_device, wait_until

from edgefl.coordinator.service import Coordinator
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.wire.rounds import Update, UpdateMetrics, encode_update
from edgefl.wire.status import DeviceStatus, encode_status

pytestmark = pytest.mark.timeout(120)


@pytest.mark.broker
def test_hostile_silent_mark_cleared_by_a_late_update_not_by_a_status_or_an_old_one(
    mosquitto: Broker, fleet: str
) -> None:
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    topics = Topics("edgefl", fleet)

    def update(round_no: int) -> bytes:
        return encode_update(
            Update(
                round=round_no,
                base_version=0,
                device="gw-3",
                num_examples=10,
                delta_W=np.zeros(W0.shape, np.float32),
                delta_b=np.zeros(b0.shape, np.float32),
                metrics=UpdateMetrics(loss=0.5, accuracy=0.9, train_s=1.0, peak_rss_bytes=1 << 20),
                update_id=f"gw-3:{round_no}:0",
            )
        )

    async def main() -> Coordinator:
        async with coordinator_and_device(mosquitto, fleet, topics, bb) as (coord, tx, pump):
            coord.state.round = 4  # rounds 1-4 ran; gw-3 let round 4 pass (it was restarting)
            fields = {"ready": True, "store_samples": 100, "new_samples": 50, "model_sha256": bb.sha256}
            status = encode_status(DeviceStatus("gw-3", "online", fields))
            await tx.publish(topics.status("gw-3"), status, qos=1)
            await wait_until(lambda: "gw-3" in coord.registry.devices, 30, "gw-3's status kept")
            coord.registry.note_silent(["gw-3"], 4)
            await tx.publish(topics.status("gw-3"), status, qos=1)  # a status alone proves nothing
            await tx.publish(topics.update("gw-3"), update(2), qos=1)  # an old round's: neither
            await wait_until(lambda: coord.state.rejected["no_round"] >= 1, 30, "the old update refused")
            assert coord.registry.unanswered == {"gw-3": 4}
            await tx.publish(topics.update("gw-3"), update(4), qos=1)  # round 4's, too late to count
            await wait_until(lambda: coord.state.rejected["no_round"] >= 2, 30, "the late update refused")
            assert not pump.done()
            return coord

    coord = asyncio.run(main())
    assert coord.registry.unanswered == {}
    assert coord.registry.waited_devices() == ["gw-3"]
    assert coord.registry.ready_new_samples() == {"gw-3": 50}
