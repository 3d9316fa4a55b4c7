"""The coordinator's per-device records stay bounded under ghost statuses (real mosquitto, real page).

Ghost statuses from invented device ids, naming another backbone, online and offline: the registry
holds at most ``max_devices``; the mismatch list, the per-device refusal counters and the clipped
counts hold only devices the registry holds (forgotten with them); the log names the first mismatches
and then every 1000th; ``/api/status`` stays small. Select with ``pytest -k hostile``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
from conftest import INT8_MODEL, Broker, coordinator_and_device, wait_until

from edgefl.coordinator.registry import LOGGED_REFUSALS, PAGE_DEVICES, STRANGERS_KEPT
from edgefl.coordinator.service import Coordinator
from edgefl.dashboard.app import DashboardState, serve
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.wire.status import DeviceStatus, encode_status

pytestmark = pytest.mark.timeout(240)

GHOSTS = 3000
MAX_DEVICES = 300


def test_hostile_ghost_statuses_keep_every_per_device_record_bounded(
    mosquitto: Broker, fleet: str, caplog: pytest.LogCaptureFixture
) -> None:
    bb = Backbone(INT8_MODEL)
    topics = Topics("edgefl", fleet)
    other = "0" * 64  # another backbone's sha256
    caplog.set_level(logging.WARNING, logger="edgefl.coordinator.registry")

    def ghost(i: int) -> tuple[str, bytes]:
        dev = f"ghost-{i}"
        # a third offline (they evict each other), the rest online (the registry fills, then refuses);
        # each with a long reason and a wide counter map, as a hostile status would carry
        fields: dict[str, Any] = {
            "ready": True,
            "round": i,
            "model_sha256": other,
            "reason": "x" * 250,
            "rejected": {f"r{k}": k for k in range(64)},
        }
        return topics.status(dev), encode_status(
            DeviceStatus(dev, "offline" if i % 3 == 0 else "online", fields)
        )

    async def main() -> tuple[Coordinator, int, dict[str, Any]]:
        fleet_kit = coordinator_and_device(mosquitto, fleet, topics, bb, max_devices=MAX_DEVICES)
        async with fleet_kit as (coord, tx, _):
            runner, port = await serve(DashboardState("coordinator", fleet, coord.dashboard_status))
            try:
                for start in range(0, GHOSTS, 50):
                    await asyncio.gather(
                        *(
                            tx.publish(topic, payload, qos=1)
                            for topic, payload in map(ghost, range(start, start + 50))
                        )
                    )
                # a last status from a ghost the registry kept early: once it shows, all before it were
                # handled
                last = DeviceStatus("ghost-1", "online", {"round": -1, "model_sha256": bb.sha256})
                await tx.publish(topics.status("ghost-1"), encode_status(last), qos=1)
                await wait_until(
                    lambda: coord.registry.devices.get("ghost-1", {}).get("round") == -1,
                    120,
                    "the ghosts handled",
                )
                async with (
                    aiohttp.ClientSession() as http,
                    http.get(f"http://127.0.0.1:{port}/api/status") as r,
                ):
                    assert r.status == 200
                    body = await r.read()
                    doc = await r.json()
                return coord, len(body), doc
            finally:
                await runner.cleanup()

    coord, size, doc = asyncio.run(main())
    reg = coord.registry
    registry = set(reg.devices)
    assert len(registry) <= MAX_DEVICES
    assert set(reg.mismatched) <= registry and len(reg.mismatched) == len(registry) - 1  # not ghost-1
    assert len(set(reg.rejected_by_device) - registry) <= STRANGERS_KEPT  # refused, never registered
    assert len(set(reg.declined_by_device) - registry) <= STRANGERS_KEPT
    assert reg.mismatches_total > MAX_DEVICES  # evicted ghosts were forgotten, their mismatch with them
    status = doc["status"]
    assert len(status["devices"]) == min(PAGE_DEVICES, len(registry))
    assert status["devices_total"] == len(registry)
    assert status["model_mismatches_total"] == len(reg.mismatched)
    assert len(status["model_mismatches"]) <= PAGE_DEVICES
    assert all(len(d["rejected"]) <= 8 and len(d["reason"]) <= 200 for d in status["devices"].values())
    assert size <= 100_000, size
    named = [r for r in caplog.records if "runs another model" in r.getMessage()]
    assert LOGGED_REFUSALS <= len(named) <= LOGGED_REFUSALS + reg.mismatches_total // 1000
