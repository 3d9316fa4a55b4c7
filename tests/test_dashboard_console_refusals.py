"""The fleet page's "rejected" box names who refused what: the coordinator's refusals and the devices'.

A real agent process on the real mosquitto refuses samples of the wrong shape (its status counts them,
with the last one's reason in words); a real :class:`Coordinator` refuses an update that is not CBOR.
Both show in a real headless Chromium, each row labelled by who refused and why.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Broker, start_ingest_agent, wait_until
from playwright.sync_api import Browser, expect
from test_dashboard_browser import ThreadedDashboard
from test_dashboard_console import (  # noqa: F401 - the module's browser fixture
    OVERFLOW_JS,
    PHONE,
    WIDE,
    browser,
    open_page,
)
from test_ingest import Gateway

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.dashboard.app import DashboardState
from edgefl.datasets import load_digits
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.ingest import Sample

pytestmark = [pytest.mark.timeout(180), pytest.mark.broker, pytest.mark.subprocess]

DEVICE = "dev-r"
SHAPE_REFUSAL = "x: shape [64], this model takes samples of [8, 8, 1]"


def test_fleet_page_console_rejected_box_shows_the_devices_refusals_and_the_coordinators(
    browser: Browser,  # noqa: F811 - the fixture imported above
    mosquitto: Broker,
    fleet: str,
    tmp_path: Path,
    agents: list[subprocess.Popen[bytes]],
) -> None:
    topics = Topics("edgefl", fleet)
    holder: dict[str, Any] = {}

    def status() -> Mapping[str, Any]:
        return holder["coord"].dashboard_status() if "coord" in holder else {}

    server = ThreadedDashboard(DashboardState("coordinator", "fleet refusals", status, push_interval_s=0.25))

    async def start() -> None:
        transport = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        await transport.start(wait_s=10)
        coord = Coordinator(
            transport,
            topics,
            np.zeros((4, 10), np.float32),
            np.zeros(10, np.float32),
            model_sha256="0" * 64,
            strategy=FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=1, deadline_s=60),
        )
        holder["coord"] = coord
        holder["pump"] = asyncio.create_task(coord.pump())
        await coord.start(adopt_wait_s=0.5)

    async def stop() -> None:
        holder["pump"].cancel()
        await holder["coord"].transport.stop()

    asyncio.run_coroutine_threadsafe(start(), server.loop).result(30)
    try:
        agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, DEVICE))
        x, _ = load_digits()

        async def feed() -> None:
            async with Gateway(mosquitto, fleet, DEVICE) as gw:
                await gw.ready()
                for i in range(3):  # flattened: the device's model takes [8, 8, 1]
                    await gw.sample(Sample(f"s{i}", x[i].reshape(64)))
                await gw.raw(topics.update("dev-x"), b"\xff not cbor")
                await wait_until(lambda: gw.status.get("rejected", {}).get("bad_shape") == 3, 30, "3 refused")

        asyncio.run_coroutine_threadsafe(feed(), server.loop).result(90)
        page, errors = open_page(browser, server.url, WIDE)
        device_row = page.locator(f'#rejected tbody tr[data-by="{DEVICE}"]')
        expect(device_row).to_have_count(1, timeout=10_000)
        cells = device_row.locator("td")
        expect(cells.nth(0)).to_have_text(f"device {DEVICE}")
        expect(cells.nth(1)).to_have_text(f"bad_shape{SHAPE_REFUSAL}")  # the reason, its detail below
        expect(cells.nth(1).locator(".detail")).to_have_text(SHAPE_REFUSAL)
        expect(cells.nth(2)).to_have_text("3")
        own = page.locator('#rejected tbody tr[data-by="coordinator"]')
        expect(own).to_have_count(1, timeout=10_000)
        expect(own.locator("td").nth(0)).to_have_text("coordinator")
        reason = own.locator("td").nth(1).inner_text()
        assert reason in holder["coord"].state.rejected and holder["coord"].state.rejected[reason] == 1
        expect(own.locator("td").nth(2)).to_have_text("1")
        assert errors.items == []
        page.context.close()
        # on a phone the rows wrap (a device id, a reason's detail): nothing leaves the screen
        phone, errors = open_page(browser, server.url, PHONE)
        expect(phone.locator(f'#rejected tbody tr[data-by="{DEVICE}"]')).to_have_count(1, timeout=10_000)
        found = phone.evaluate(OVERFLOW_JS)
        assert found["scroll"] <= PHONE["width"] and found["out"] == [], found
        assert errors.items == []
        phone.context.close()
    finally:
        asyncio.run_coroutine_threadsafe(stop(), server.loop).result(15)
        server.close()


def test_console_refusals_rows_list_the_coordinator_first_then_devices_by_count() -> None:
    from collections import Counter

    from edgefl.coordinator.registry import DeviceRegistry
    from edgefl.wire.cbor import DEFAULT_LIMITS

    reg = DeviceRegistry(model_sha256="0" * 64, head_shape=(4, 10), clipped=Counter(), limits=DEFAULT_LIMITS)
    now = time.time()
    reg.devices["gw-1"] = {
        "rejected": {"bad_shape": 2, "bad_label": 5},
        "last_rejected": {"reason": "bad_shape", "detail": "x: shape [64]", "topic": "t"},
        "seen_at": now,
    }
    reg.devices["gw-2"] = {"rejected": {"bad_cbor": 1, "odd": True}, "seen_at": now}
    reg.devices["gw-3"] = {"rejected": "not a map", "seen_at": now}
    rows = reg.refusals({"stale_round": 1, "bad_signature": 4, "none": 0}, limit=2)
    assert rows == [
        {"by": "coordinator", "reason": "bad_signature", "count": 4, "detail": ""},
        {"by": "coordinator", "reason": "stale_round", "count": 1, "detail": ""},
        {"by": "gw-1", "reason": "bad_label", "count": 5, "detail": ""},
        {"by": "gw-1", "reason": "bad_shape", "count": 2, "detail": "x: shape [64]"},
    ]
