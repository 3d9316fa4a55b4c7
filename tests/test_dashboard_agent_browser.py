"""A real agent process's dashboard in headless Chromium during a real federated round.

The agent runs the daemon (LiteRT, replay source, MQTT to the session's mosquitto) with its dashboard
on; a coordinator in this test drives rounds. The page must show the agent's RSS as ``/proc`` reports
it, and follow the round (state, round number, global version) without a reload.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CHROMIUM, CHROMIUM_ARGS, DEV_PROFILE, INT8_MODEL, Broker, free_port
from playwright.sync_api import Browser, expect, sync_playwright

from edgefl.agent import memstat
from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.datasets import load_digits, split_digits
from edgefl.launcher import launch_agent, stop_agents
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


class LoopThread:
    """An asyncio loop in a thread (playwright's sync API owns the test's thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 90) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def test_browser_real_agent_dashboard_during_real_rounds(
    mosquitto: Broker, fleet: str, tmp_path: Path, browser: Browser
) -> None:
    x, y = load_digits()
    pool = split_digits(y).devices
    np.savez(tmp_path / "shard.npz", x=x[pool[:300]], y=y[pool[:300]])
    port = free_port()
    proc = launch_agent(
        DEV_PROFILE,
        {
            "device.id": "gw-1",
            "device.fleet": fleet,
            "device.state_dir": str(tmp_path / "state"),
            "broker.url": mosquitto.url,
            "source.kind": "replay",
            "source.path": str(tmp_path / "shard.npz"),
            "model.path": str(INT8_MODEL),
            "dashboard.enabled": "true",
            "dashboard.port": str(port),
        },
        tmp_path / "agent.log",
    )
    lt = LoopThread()
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    coord_box: dict[str, Coordinator] = {}

    async def start_coordinator() -> None:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        await t.start()
        coord = Coordinator(
            t,
            Topics("edgefl", fleet),
            W0,
            b0,
            model_sha256=bb.sha256,
            strategy=FedAvg(local_epochs=2, lr=0.05, batch_size=16, min_clients=1, deadline_s=30),
        )
        coord_box["c"] = coord
        coord_box["pump"] = asyncio.ensure_future(coord.pump())  # type: ignore[assignment]
        await coord.start()
        await coord.registry.wait_for_devices(1, timeout_s=60)

    errors: list[str] = []
    try:
        lt.run(start_coordinator())
        coord = coord_box["c"]
        url = f"http://127.0.0.1:{port}/"
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        expect(page.locator("#live")).to_have_text("live", timeout=10_000)
        page.evaluate("window.__sameDocument = true")
        expect(page.locator("#state")).to_have_attribute("data-state", "idle", timeout=10_000)

        # the gauge shows the agent process's own RSS (its /proc), within the push interval's drift
        shown = int(page.get_attribute("#rss", "data-value") or 0)
        actual = memstat.rss_bytes(proc.pid)
        assert abs(shown - actual) <= max(4 * MiB, 0.05 * actual), (shown, actual)
        assert int(page.get_attribute("#cap", "data-value") or 0) == 96 * MiB

        for r in (1, 2):
            rec = lt.run(coord.run_round(r))
            assert rec.clients == 1
            # the round happened on the agent: the page follows without a reload
            expect(page.locator("#round")).to_have_text(str(r), timeout=10_000)
            expect(page.locator("#state")).to_have_attribute("data-state", "waiting", timeout=10_000)
            expect(page.locator("#version")).to_have_text(str(r), timeout=10_000)
        assert page.evaluate("window.__sameDocument") is True
        # the wire size of the last update and its age, from the agent's own clock ("20.4 KiB, 3 s ago")
        expect(page.locator("#update-bytes")).to_have_text(re.compile(r"^\d+\.\d KiB, \d+ s ago$"))
        shown = int(page.get_attribute("#rss", "data-value") or 0)
        actual = memstat.rss_bytes(proc.pid)
        assert abs(shown - actual) <= max(4 * MiB, 0.05 * actual), (shown, actual)
        page.screenshot(path=tmp_path / "agent-dashboard.png", full_page=True)
        assert (tmp_path / "agent-dashboard.png").stat().st_size > 10_000
        assert errors == []
        page.close()
    finally:
        if "c" in coord_box:
            coord_box["pump"].cancel()  # type: ignore[attr-defined]
            lt.run(coord_box["c"].transport.stop())
        lt.close()
        stop_agents([proc])
        print((tmp_path / "agent.log").read_text(errors="replace")[-2000:])
