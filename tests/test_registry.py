"""The coordinator's device registry keeps a status only within a status's own bounds (hostile statuses).

A status is kept, one per device id, for as long as the device is known: a status as large as an update
may be (a 45 KiB list of small integers decodes to ~0.5 MiB of Python objects) let statuses, or the
ghost ids of one publisher, grow the coordinator's memory by gigabytes. Select with ``pytest -k hostile``.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections import Counter
from typing import Any

import pytest
from conftest import INT8_MODEL, Broker, coordinator_and_device, wait_until

from edgefl.coordinator import registry
from edgefl.coordinator.registry import REASONS_KEPT, DeviceRegistry
from edgefl.coordinator.service import Coordinator
from edgefl.errors import DecodeError
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.wire.cbor import Limits
from edgefl.wire.status import STATUS_MAX_BYTES, STATUS_MAX_ITEMS, DeviceStatus, encode_status

pytestmark = pytest.mark.timeout(120)


def _agent_like(device: str) -> dict[str, Any]:
    """A status as big as an agent's with every refusal reason counted (~60 fields, 50 reasons)."""
    fields: dict[str, Any] = {f"field_{i}": i * 1000 for i in range(60)}
    fields["rejected"] = {f"reason_{k}": k + 1 for k in range(50)}
    fields["last_rejected"] = {
        "reason": "reason_1",
        "detail": "d" * 200,
        "topic": f"edgefl/f/samples/{device}",
    }
    fields["ready"] = True
    return fields


def _registry() -> DeviceRegistry:
    return DeviceRegistry(model_sha256="0" * 64, head_shape=(8, 4), clipped=Counter(), limits=Limits())


def test_hostile_status_of_many_small_items_is_refused_too_large_and_not_kept() -> None:
    reg = _registry()
    half = list(range(1000, 1000 + STATUS_MAX_ITEMS // 2 + 10))  # each list within the container bound
    many = DeviceStatus("ghost-1", "online", {"ready": True, "a": half, "b": half})
    payload = encode_status(many)
    assert len(payload) < STATUS_MAX_BYTES  # the items, not the bytes, are over the bound
    with pytest.raises(DecodeError) as err:
        reg.note_status("ghost-1", payload)
    assert err.value.reason == "too_large"
    assert "data items" in str(err.value)
    big = DeviceStatus("ghost-2", "online", {"ready": True, **{f"k{i:04d}": "v" * 200 for i in range(100)}})
    with pytest.raises(DecodeError) as err:
        reg.note_status("ghost-2", encode_status(big))
    assert err.value.reason == "too_large"
    assert f"> {STATUS_MAX_BYTES}" in str(err.value)
    assert reg.devices == {}
    # an agent's status with every counter it can carry is kept, whole
    reg.note_status("gw-1", encode_status(DeviceStatus("gw-1", "online", _agent_like("gw-1"))))
    assert reg.devices["gw-1"]["rejected"]["reason_49"] == 50
    assert reg.online_devices() == ["gw-1"]


def test_hostile_statuses_within_the_bounds_cost_the_registry_tens_of_kib_a_device() -> None:
    # the worst a status may weigh once decoded: as many small integers as the bounds let through
    reg = _registry()
    fields = {"a": list(range(10_000, 10_000 + STATUS_MAX_ITEMS - 16))}
    tracemalloc.start()
    try:
        for i in range(20):
            reg.note_status(f"ghost-{i}", encode_status(DeviceStatus(f"ghost-{i}", "online", fields)))
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(reg.devices) == 20
    assert kept / 20 < 64 * 1024, kept / 20  # ~34 KiB; before the status bounds 0.5 MiB


@pytest.mark.broker
def test_hostile_oversized_statuses_are_counted_and_the_coordinator_keeps_the_fleet(
    mosquitto: Broker, fleet: str
) -> None:
    bb = Backbone(INT8_MODEL)
    topics = Topics("edgefl", fleet)

    async def main() -> Coordinator:
        async with coordinator_and_device(mosquitto, fleet, topics, bb) as (coord, tx, pump):
            huge = {"ready": True, "a": list(range(1000, 15_000))}  # ~45 KiB, under the packet limit
            for i in range(30):
                dev = f"ghost-{i}"
                await tx.publish(topics.status(dev), encode_status(DeviceStatus(dev, "online", huge)), qos=1)
            fields = {**_agent_like("gw-1"), "model_sha256": bb.sha256}
            await tx.publish(
                topics.status("gw-1"), encode_status(DeviceStatus("gw-1", "online", fields)), qos=1
            )
            await wait_until(lambda: "gw-1" in coord.registry.devices, 30, "the honest status kept")
            assert not pump.done()
            return coord

    coord = asyncio.run(main())
    assert set(coord.registry.devices) == {"gw-1"}
    assert coord.state.rejected["too_large"] == 30
    assert coord.registry.rejected_by_device["ghost-7"]["too_large"] == 1
    doc = coord.dashboard_status()
    assert {"by": "coordinator", "reason": "too_large", "count": 30, "detail": ""} in doc["refusals"]


def test_hostile_status_of_invented_reasons_keeps_the_largest_and_the_page_rows_stay_right() -> None:
    reg = _registry()
    # hundreds of invented reasons (an agent has ~50): the largest REASONS_KEPT are kept with the status
    counts: dict[str, Any] = {f"invented_{k:03d}": k + 1 for k in range(400)}
    counts["bogus_text"] = "many"  # not a count: never kept, never a row
    counts["<script>alert(1)</script>" + "z" * 200] = 10_000  # a reason is cut to 64 characters on the page
    fields = {
        "ready": True,
        "rejected": counts,
        "last_rejected": {"reason": "invented_399", "detail": "d" * 250},
    }
    reg.note_status("ghost-1", encode_status(DeviceStatus("ghost-1", "online", fields)))
    reg.note_status("gw-1", encode_status(DeviceStatus("gw-1", "online", {"rejected": {"bad_label": 3}})))
    kept = reg.devices["ghost-1"]["rejected"]
    assert len(kept) == REASONS_KEPT
    assert min(kept.values()) == 400 - REASONS_KEPT + 2  # the 63 largest invented ones and the script
    assert "bogus_text" not in kept
    rows = reg.refusals({"too_large": 2}, limit=3)
    assert rows[0] == {"by": "coordinator", "reason": "too_large", "count": 2, "detail": ""}
    assert [(r["by"], r["reason"], r["count"]) for r in rows[1:]] == [
        ("ghost-1", ("<script>alert(1)</script>" + "z" * 200)[:64], 10_000),
        ("ghost-1", "invented_399", 400),
        ("ghost-1", "invented_398", 399),
    ]
    assert rows[2]["detail"] == "d" * 79 + "…"
    assert [r for r in reg.refusals({}, limit=100) if r["by"] == "gw-1"] == [
        {"by": "gw-1", "reason": "bad_label", "count": 3, "detail": ""}
    ]


def test_hostile_unique_status_strings_share_a_bounded_table() -> None:
    """Statuses full of strings never seen before: the table that shares short strings stays within
    ``STRINGS_KEPT`` (``sys.intern`` would keep each one for good on CPython 3.12.0-3.12.5), and a
    string two devices send is still one object in both entries."""
    reg = _registry()
    for i in range(40):
        fields = {"ready": True, **{f"k{i}-{j}": f"v{i}-{j}" for j in range(200)}}
        reg.note_status(f"dev-{i}", encode_status(DeviceStatus(f"dev-{i}", "online", fields)))
    assert len(registry._strings) <= registry.STRINGS_KEPT
    assert registry.STRINGS_KEPT < 40 * 400  # the flood was larger than the table
    for i in (40, 41):
        fields = {"ready": True, "model": "digits-int8"}
        reg.note_status(f"dev-{i}", encode_status(DeviceStatus(f"dev-{i}", "online", fields)))
    assert reg.devices["dev-40"]["model"] is reg.devices["dev-41"]["model"]
