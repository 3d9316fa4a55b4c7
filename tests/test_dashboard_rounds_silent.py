"""The fleet page's rounds table names the devices a round asked that never answered (``silent``),
in a real headless Chromium (``dashboard/static/app.js``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import CHROMIUM, CHROMIUM_ARGS
from playwright.sync_api import Browser, expect, sync_playwright
from test_dashboard_browser import DASH, PageErrors, ThreadedDashboard

from edgefl.dashboard.app import DashboardState


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _record(round_no: int, **extra: Any) -> dict[str, Any]:
    base = {"round": round_no, "asked": 2, "counted": 1, "clients": 1, "accuracy": 0.9, "refused": {},
            "declined": {}, "declined_devices": 0, "update_bytes_mean": 900.0, "duration_s": 30.0}
    return {**base, **extra}


def test_durable_fleet_page_names_the_devices_a_round_never_heard_from(browser: Browser) -> None:
    quiet = [f"gw-{k}" for k in range(7)]
    rounds = [
        _record(1),
        _record(2, silent=["gw-2"], silent_devices=1),
        _record(3, declined={"no_head": 1}, declined_devices=1, silent=quiet, silent_devices=120),
    ]
    state = DashboardState("coordinator", "fleet", lambda: {"round": 3}, get_rounds=lambda: rounds)
    server = ThreadedDashboard(state)
    try:
        page = browser.new_page()
        errors = PageErrors(page)
        page.goto(server.url + "/")
        cell = '#rounds tr[data-round="{}"] td[data-col="declined"]'
        expect(page.locator(cell.format(2))).to_have_text("no answer: gw-2", timeout=5000)
        assert page.text_content(cell.format(1)) == DASH
        assert page.text_content(cell.format(3)) == (
            "no_head 1 · no answer: gw-0, gw-1, gw-2, gw-3, gw-4 (+115)"
        )
        assert errors.items == []
        page.close()
    finally:
        server.close()
