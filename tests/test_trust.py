"""The coordinator's trust in update ids, declines and site partials (the H16 attacker findings).

Real mosquitto, real coordinator, forged messages signed by a valid device key.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from conftest import INT8_MODEL, Broker, wait_until

from edgefl.coordinator.service import Coordinator
from edgefl.coordinator.strategy import FedAvg
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.codec import Decline, Update, UpdateMetrics, encode_decline, encode_update
from edgefl.wire.signing import generate_signing_key, sign_message

pytestmark = pytest.mark.timeout(120)


def test_trust_declines_cannot_squat_another_devices_update_ids(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """dev-1, with its own valid key, declines with dev-2's update ids (the H16 trial): refused as
    ``bad_value``; a decline of another round, or of an unselected device, is refused too; dev-2's
    real update then counts and the round closes with both devices' answers."""
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    keys = {d: generate_signing_key() for d in ("dev-1", "dev-2", "dev-3")}
    topics = Topics("edgefl", fleet)

    def decline(dev: str, rnd: int, base: int, uid: str) -> bytes:
        msg = Decline(rnd, base, dev, "over_budget", "x" * 200, uid)
        return sign_message(encode_decline, msg, keys[dev], fleet=fleet)

    def update(dev: str, rnd: int, base: int) -> bytes:
        up = Update(rnd, base, dev, 10, np.full_like(W0, 0.01), np.zeros_like(b0),
                    UpdateMetrics(0.1, 0.9, 0.01, 1), f"{dev}:{rnd}:{base}")  # fmt: skip
        return sign_message(encode_update, up, keys[dev], fleet=fleet)

    async def main() -> tuple[Coordinator, int, int]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        dev = MqttTransport(mosquitto.host, mosquitto.port, f"dev-{fleet}")
        await t.start(wait_s=10)
        await dev.start(wait_s=10)
        strategy = FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=2, deadline_s=30)
        coord = Coordinator(
            t, topics, W0, b0, model_sha256=bb.sha256, strategy=strategy,
            device_keys={d: k.verify_key for d, k in keys.items()},
        )  # fmt: skip
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            run1 = asyncio.create_task(coord.run_round(1, selected=("dev-1", "dev-2")))
            await wait_until(lambda: coord.state.round == 1, 10, "round 1 open")
            forged = [
                decline("dev-1", r, r - 1, f"dev-2:{r}:{r - 1}")
                for r in (1, 2, 3)  # dev-2's ids
            ] + [
                decline("dev-1", 1, 0, "dev-1:1:0"),  # its own update id, without the suffix
                decline("dev-1", 2, 1, "dev-1:2:1:declined"),  # a round not open
                decline("dev-1", 1, 5, "dev-1:1:5:declined"),  # another base version
                decline("dev-3", 1, 0, "dev-3:1:0:declined"),  # not selected
            ]
            for p in forged:
                await dev.publish(topics.update("dev-1" if b"dev-1" in p else "dev-3"), p, qos=1)
            want = {"bad_value": 4, "stale_round": 1, "stale_base": 1, "not_selected": 1}
            await wait_until(lambda: dict(coord.state.rejected) == want, 10, "forged declines refused")
            await dev.publish(topics.update("dev-2"), update("dev-2", 1, 0), qos=1)
            await dev.publish(topics.update("dev-1"), decline("dev-1", 1, 0, "dev-1:1:0:declined"), qos=1)
            await dev.publish(topics.update("dev-1"), decline("dev-1", 1, 0, "dev-1:1:0:declined"), qos=1)
            record = await run1
            # the re-send arrives after both answers closed the round
            await wait_until(lambda: coord.state.rejected["round_closed"] == 1, 10, "the re-sent decline")
            return coord, record.clients, record.declined
        finally:
            pump.cancel()
            await dev.stop()
            await t.stop()

    coord, clients, declined = asyncio.run(main())
    assert (clients, declined) == (1, 1)  # dev-2's update counted, dev-1's own decline once
    assert coord.counted[1] == ["dev-2:1:0"]
    assert dict(coord.state.declined) == {"over_budget": 1}
    assert dict(coord.state.rejected) == {
        "bad_value": 4, "stale_round": 1, "stale_base": 1, "not_selected": 1, "round_closed": 1
    }  # fmt: skip
