"""The dashboard pages in a real headless Chromium (Debian's ``chromium``, driven by playwright).

``dashboard_target`` is the device whose page is opened. Today it is this test process: a real
``DashboardState`` served on a background event loop, whose status reads this process's memory from
``/proc`` and whose round state the test moves idle -> training -> waiting. To test a real agent
instead, make the fixture start one (with its dashboard enabled) and return its URL, its pid and an
``advance`` that drives a round through the coordinator; the tests do not change.

Screenshots go to the test's temp dir; with ``EDGEFL_DOCS_SCREENSHOTS=1`` the device and coordinator
tests run their scenario for a minute. The README's pictures come from a real run instead
(``python -m bench.screenshots``).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CHROMIUM, CHROMIUM_ARGS
from playwright.sync_api import (
    Browser,
    BrowserContext,
    ConsoleMessage,
    Page,
    Request,
    Response,
    expect,
    sync_playwright,
)

import edgefl.dashboard.app
from edgefl.agent import memstat
from edgefl.dashboard.app import DashboardState, serve

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
DASH = "–"
TOKEN = "browser-token-0123456789abcdef"
DOCS = os.environ.get("EDGEFL_DOCS_SCREENSHOTS") == "1"
DOCS_RUN_S = 65.0
VIEWPORT = {"width": 1280, "height": 900}


class ThreadedDashboard:
    """``serve(state)`` on an event loop in a background thread (playwright's sync API owns this one)."""

    def __init__(self, state: DashboardState, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = state
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dashboard-loop", daemon=True)
        self.thread.start()
        started = asyncio.run_coroutine_threadsafe(serve(state, host, port), self.loop)
        self.runner, self.port = started.result(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def notify(self) -> None:
        self.loop.call_soon_threadsafe(self.state.notify)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


PHASES_IN_STATE = {"idle": ("inference", "batch", "apply"), "training": ("train",),
                   "waiting": ("encode", "publish")}


class Ballast:
    """Memory this process really touches and really returns (an anonymous mapping, not the heap)."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes)
        view = np.frombuffer(self.map, dtype=np.uint8)
        view[:] = 1
        del view

    def release(self) -> None:
        self.map.close()


@dataclass
class LiveDevice:
    """A device status with this process's real memory figures and a round state set by the test."""

    state: str = "idle"
    round: int = 0
    version: int = 0
    last_update_bytes: int | None = None
    local_accuracy: float | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)
    inferred_total: int = 0
    # 256 MiB, or twice this process's RSS when it is larger: a test worker that ran other tests first
    # (the poisoning runs, the parsed tree of test_layout) held 288 MiB, over a fixed 256 MiB cap
    cap_bytes: int = field(default_factory=lambda: max(256 * MiB, 2 * (memstat.rss_bytes() // MiB) * MiB))

    def status(self) -> dict[str, Any]:
        rss = memstat.rss_bytes()
        self.inferred_total += 37
        for phase in PHASES_IN_STATE.get(self.state, ()):
            self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), rss)
        return {
            "device": "gw-test-01",
            "state": self.state,
            "reason": "",
            "round": self.round,
            "version": self.version,
            "cap_bytes": self.cap_bytes,
            "rss_bytes": rss,
            "pss_bytes": memstat.pss_bytes(),
            "peak_rss_bytes": memstat.peak_rss_bytes(),
            "system_available_bytes": memstat.system_available_bytes(),
            "phase_peaks": dict(self.phase_peaks),
            "last_update_bytes": self.last_update_bytes,
            "local_accuracy": self.local_accuracy,
            "inference_rate": 410.0,
            "pipeline_mode": "fused",
            "rejected": {"bad_cbor": 1},
            "broker_connected": True,
            "store_samples": 512,
            "inferred_total": self.inferred_total,
        }


@dataclass
class DashboardTarget:
    """A running dashboard for the browser tests.

    Attributes
    ----------
    url : str
        Base URL, ``http://127.0.0.1:<port>``.
    pid : int
        The process whose ``/proc`` figures the page must show (the agent).
    advance : callable () -> str
        Moves the device to its next round state and returns the state the page must then show.
    steps : int
        How many times ``advance`` is called to walk one round (idle -> training -> waiting -> idle).
    """

    url: str
    pid: int
    advance: Callable[[], str]
    steps: int


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def context(browser: Browser) -> Iterator[BrowserContext]:
    """One browser profile for the tests without credentials (a new page per test)."""
    ctx = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
    yield ctx
    ctx.close()


@pytest.fixture
def dashboard_target() -> Iterator[DashboardTarget]:
    device = LiveDevice()
    ballast: list[Ballast] = []
    server = ThreadedDashboard(DashboardState("device", "gw-test-01", device.status, push_interval_s=0.5,
                                              history_interval_s=1.0))
    cycle = iter(["training", "waiting", "idle"] * 1000)

    def advance() -> str:
        # real work of the round's size: training touches 24 MiB, released when the update is sent
        state = next(cycle)
        if state == "training":
            device.round += 1
            ballast.append(Ballast(24 * MiB))
        elif state == "waiting":
            while ballast:
                ballast.pop().release()
            device.last_update_bytes = 5310 + device.round
            device.local_accuracy = min(0.97, 0.80 + 0.02 * device.round)
        else:
            device.version = device.round
        device.state = state
        server.notify()
        return state

    try:
        yield DashboardTarget(server.url, os.getpid(), advance, steps=3)
    finally:
        server.close()
        for b in ballast:
            b.release()


class PageErrors:
    """Console errors, uncaught exceptions, failed and 4xx/5xx requests of a page."""

    def __init__(self, page: Page) -> None:
        self.items: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.items.append(f"pageerror: {exc}"))
        page.on("requestfailed", self._failed)
        page.on("response", self._response)

    def _console(self, msg: ConsoleMessage) -> None:
        if msg.type in ("error", "warning"):
            self.items.append(f"console.{msg.type}: {msg.text}")

    def _failed(self, request: Request) -> None:
        # the page's own EventSource is aborted when the page closes; anything else is an error
        if request.failure != "net::ERR_ABORTED":
            self.items.append(f"request failed: {request.url} {request.failure}")

    def _response(self, response: Response) -> None:
        if response.status >= 400:
            self.items.append(f"HTTP {response.status}: {response.url}")


def open_page(context: BrowserContext, url: str) -> tuple[Page, PageErrors]:
    page = context.new_page()
    errors = PageErrors(page)
    page.goto(url + "/")
    expect(page.locator("#live")).to_have_text("live", timeout=5000)
    page.evaluate("window.__sameDocument = true")  # gone if the page reloads
    return page, errors


def wait_for(check: Callable[[], bool], timeout_s: float = 3.0, what: str = "") -> None:
    """Poll ``check`` from the test (the page's CSP forbids eval, so no ``wait_for_function``)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what or check}"
        time.sleep(0.02)


def expect_state(page: Page, state: str) -> None:
    expect(page.locator("#state")).to_have_attribute("data-state", state, timeout=3000)


def gauge_snapshot(page: Page) -> dict[str, str]:
    """The gauge's figures (raw ``data-value`` and shown text) and fill width, read in one evaluation."""
    js = """() => { const g = (id) => document.getElementById(id); const out = {};
                   for (const id of ["rss", "cap", "pss", "peak", "sysavail"]) {
                     out[id] = g(id).dataset.value; out[id + "_text"] = g(id).textContent; }
                   out.fill = g("gauge-fill").style.width; out.pct_text = g("rss-pct").textContent;
                   out.headroom_text = g("headroom").textContent; return out; }"""
    snapshot: dict[str, str] = page.evaluate(js)
    return snapshot


def data_value(page: Page, selector: str) -> str:
    value = page.get_attribute(selector, "data-value")
    assert value is not None, selector
    return value


def fmt_bytes(n: float) -> str:
    """The page's byte format (app.js ``bytes``)."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


def width_percent(page: Page, selector: str) -> float:
    style = page.get_attribute(selector, "style") or ""
    return float(style.split("width:")[1].split("%")[0])


def painted_pixels(page: Page, canvas_id: str) -> int:
    js = """id => { const c = document.getElementById(id);
                    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                    let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }"""
    n: int = page.evaluate(js, canvas_id)
    return n


def docs_screenshot(page: Page, name: str, tmp_path: Path) -> None:
    page.screenshot(path=tmp_path / name, full_page=True)


def test_browser_device_page_shows_real_rss_and_live_round_state(
    context: BrowserContext, dashboard_target: DashboardTarget, tmp_path: Path
) -> None:
    target = dashboard_target
    page, errors = open_page(context, target.url)

    # the gauge shows the agent's RSS as /proc reports it (figures read in one go: pushes go on)
    gauge = gauge_snapshot(page)
    actual = memstat.rss_bytes(target.pid)
    shown = int(gauge["rss"])
    assert abs(shown - actual) <= max(4 * MiB, 0.03 * actual), (shown, actual)
    assert gauge["rss_text"] == fmt_bytes(shown)
    cap = int(gauge["cap"])
    assert float(gauge["fill"].split("%")[0]) == pytest.approx(100 * shown / cap, abs=0.01)
    assert gauge["pct_text"] == f"{100 * shown / cap:.1f} %"
    # headroom is rendered from the same status; a push landing between the snapshot's reads moved it
    # one 0.1 MiB display step once (112.3 vs 112.2 MiB in a fresh-clone run)
    value, unit = gauge["headroom_text"].split()
    assert unit == fmt_bytes(cap - shown).split()[1]
    assert float(value) == pytest.approx(float(fmt_bytes(cap - shown).split()[0]), abs=0.11)
    for key in ("pss", "peak", "sysavail"):
        assert gauge[key + "_text"] == fmt_bytes(int(gauge[key])), key
    assert int(gauge["peak"]) >= shown - 4 * MiB

    # the round state follows the agent without a reload
    assert page.get_attribute("#state", "data-state") == "idle"
    deadline = time.monotonic() + (DOCS_RUN_S if DOCS else 0.0)
    while True:
        for _ in range(target.steps):
            expected = target.advance()
            expect_state(page, expected)
            if expected == "waiting":
                assert page.text_content("#update-bytes") != DASH
            if DOCS:
                time.sleep(4.0)
        if time.monotonic() >= deadline:
            break
    assert page.evaluate("window.__sameDocument") is True
    assert page.text_content("#round") != DASH and page.text_content("#round") != "0"

    # still the real figure after the round
    shown = int(data_value(page, "#rss"))
    actual = memstat.rss_bytes(target.pid)
    assert abs(shown - actual) <= max(4 * MiB, 0.03 * actual), (shown, actual)
    assert painted_pixels(page, "rss-chart") > 500
    target.advance()  # training: the screenshot shows a round in progress
    expect_state(page, "training")
    docs_screenshot(page, "dashboard-device.png", tmp_path)
    assert (tmp_path / "dashboard-device.png").stat().st_size > 10_000
    assert errors.items == []
    page.close()


def test_browser_gauge_follows_the_process_rss(context: BrowserContext) -> None:
    device = LiveDevice()
    server = ThreadedDashboard(DashboardState("device", "gw", device.status, push_interval_s=0.25))
    try:
        page, errors = open_page(context, server.url)
        def shown() -> int:
            return int(data_value(page, "#rss"))

        def agrees() -> bool:  # the page shows what /proc says now (the next push settles it)
            return abs(shown() - memstat.rss_bytes()) <= 4 * MiB

        before = shown()
        ballast = Ballast(48 * MiB)
        wait_for(lambda: shown() > before + 40 * MiB and agrees(), what="the page to show 48 MiB more")
        grown = shown()
        ballast.release()
        wait_for(lambda: shown() < grown - 40 * MiB and agrees(), what="the page to show 48 MiB less")
        assert errors.items == []
        page.close()
    finally:
        server.close()


def deadline_s(page: Page) -> float:
    return float((page.text_content("#deadline") or "nan").split()[0])


def coordinator_status(progress: dict[str, Any]) -> Callable[[], Mapping[str, Any]]:
    def status() -> Mapping[str, Any]:
        rnd = progress["round"]
        doc: dict[str, Any] = {
            "round": rnd,
            "state": progress["state"],
            "updates_received": progress["received"],
            "updates_expected": 4,
            "deadline_s_left": max(0.0, progress["deadline_at"] - time.monotonic()),
            "version": rnd - 1,
            "accuracy_history": [{"round": r, "accuracy": 0.9 - 0.3 / r} for r in range(1, rnd)],
            "devices": {
                "gw-kitchen": {"state": "training", "online": True, "rss_bytes": 41 * MiB,
                               "cap_bytes": 96 * MiB, "last_round": rnd - 1, "reason": ""},
                "gw-garage": {"state": "deferred", "online": True, "rss_bytes": 88 * MiB,
                              "cap_bytes": 96 * MiB, "last_round": rnd - 2,
                              "reason": "memory: train estimate exceeds headroom"},
                "gw-attic": {"state": "waiting", "online": True, "rss_bytes": 63 * MiB,
                             "cap_bytes": 96 * MiB, "last_round": rnd - 1, "reason": ""},
                "gw-shed": {"state": "offline", "online": False, "rss_bytes": None, "cap_bytes": 64 * MiB,
                            "last_round": 2, "reason": "last will"},
            },
            "rejected": {"stale_round": 2, "bad_shape": 1},
        }
        if progress["hostile"]:  # a device id chosen by an attacker must render as text
            doc["devices"]["<img src=x onerror=alert(1)>"] = {"state": "idle", "online": True}
        return doc

    return status


def test_browser_coordinator_page_live(context: BrowserContext, tmp_path: Path) -> None:
    progress: dict[str, Any] = {"round": 6, "state": "open", "received": 1,
                                "deadline_at": time.monotonic() + 30, "hostile": True}
    server = ThreadedDashboard(DashboardState("coordinator", "fleet demo", coordinator_status(progress)))
    try:
        page, errors = open_page(context, server.url)
        assert page.text_content("#round") == "6"
        assert page.text_content("#received") == "1" and page.text_content("#expected") == "4"
        assert width_percent(page, "#progress-fill") == pytest.approx(25.0)
        rows = page.locator("#devices tbody tr")
        assert rows.count() == 5
        names = [rows.nth(i).locator("td").first.text_content() for i in range(5)]
        assert "<img src=x onerror=alert(1)>" in names  # text, not markup
        assert page.locator("#devices img").count() == 0
        shed = '#devices tr[data-device="gw-shed"] td'
        assert page.text_content(shed + '[data-col="state"]') == "offline"
        assert page.text_content(shed + '[data-col="headroom"]') == DASH  # no RSS reported
        assert page.text_content(shed + '[data-col="reason"]') == "last will"
        # worst first: the offline device, one without a memory report, then the least headroom
        order = [rows.nth(i).get_attribute("data-device") for i in range(5)]
        assert order == ["gw-shed", "<img src=x onerror=alert(1)>", "gw-garage", "gw-attic", "gw-kitchen"]
        garage = '#devices tr[data-device="gw-garage"] td[data-col="headroom"]'
        assert page.text_content(garage) == "8.0 MiB · 8 %"
        assert page.get_attribute(garage, "data-level") == "warn"  # under 15 % of the cap free
        assert page.text_content("#online-count") == "devices 4 / 5 online"
        first = deadline_s(page)
        assert 25 <= first <= 30
        assert painted_pixels(page, "accuracy-chart") > 500

        # updates arrive: the page follows without a reload
        progress["received"] = 3
        server.notify()
        expect(page.locator("#received")).to_have_text("3", timeout=3000)
        wait_for(lambda: deadline_s(page) < first, what="the deadline to count down")
        end = time.monotonic() + (DOCS_RUN_S if DOCS else 0.0)
        while time.monotonic() < end:  # docs mode: a few more rounds for the accuracy chart
            time.sleep(5.0)
            progress.update(round=progress["round"] + 1, received=progress["received"] % 4 + 1,
                            deadline_at=time.monotonic() + 30)
            server.notify()
        progress.update(state="collecting", hostile=False)
        server.notify()
        expect(page.locator("#fleet-state")).to_have_attribute("data-state", "collecting", timeout=3000)
        expect(page.locator("#fleet-state")).to_have_text(f"collecting {progress['received']} of 4")
        expect(rows).to_have_count(4)
        assert page.evaluate("window.__sameDocument") is True
        docs_screenshot(page, "dashboard-coordinator.png", tmp_path)
        assert errors.items == []
        page.close()
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["device", "coordinator"])
def test_browser_missing_keys_render_as_dash(context: BrowserContext, kind: str) -> None:
    server = ThreadedDashboard(DashboardState(kind, "empty", lambda: {}))  # type: ignore[arg-type]
    try:
        page, errors = open_page(context, server.url)
        texts = page.eval_on_selector_all("[data-field]", "els => els.map(e => e.textContent)")
        assert texts and set(texts) == {DASH}
        assert page.text_content("#state" if kind == "device" else "#fleet-state") == DASH
        if kind == "device":
            assert page.text_content("#rss-pct") == DASH and page.text_content("#headroom") == DASH
            assert page.locator("#phases td.num").all_text_contents() == [DASH] * 6
            assert page.text_content("#broker") == f"broker {DASH}"
        else:
            assert page.text_content("#deadline") == DASH
            assert page.locator("#devices tbody td").all_text_contents() == [DASH]
        assert errors.items == []
        page.close()
    finally:
        server.close()


def test_browser_page_reconnects_after_the_agent_restarts(
    context: BrowserContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(edgefl.dashboard.app, "SSE_RETRY_MS", 200)  # the browser's reconnect delay
    first = LiveDevice(state="training")
    server = ThreadedDashboard(DashboardState("device", "gw", first.status))
    page, errors = open_page(context, server.url)
    expect_state(page, "training")
    server.close()
    expect(page.locator("#live")).to_have_attribute("data-state", "stale", timeout=3000)
    expect(page.locator("#stale-note")).to_contain_text("the agent does not answer")
    second = LiveDevice(state="deferred")
    server = ThreadedDashboard(DashboardState("device", "gw", second.status), port=server.port)
    try:
        expect(page.locator("#live")).to_have_text("live", timeout=5000)
        expect_state(page, "deferred")
        assert page.evaluate("window.__sameDocument") is True
        # the browser logs the refused reconnection attempts while the agent was down; nothing else
        assert [e for e in errors.items if "ERR_CONNECTION_REFUSED" not in e] == []
        page.close()
    finally:
        server.close()


def test_browser_token_dashboard_with_basic_credentials(browser: Browser) -> None:
    device = LiveDevice()
    state = DashboardState("device", "gw", device.status, token=TOKEN, push_interval_s=0.25)
    server = ThreadedDashboard(state, host="0.0.0.0")  # bound on all interfaces, reached via loopback
    try:
        # a browser asks the operator once (any user name, the token as password); EventSource reuses it
        authorised = browser.new_context(viewport=VIEWPORT,  # type: ignore[arg-type]
                                         http_credentials={"username": "operator", "password": TOKEN})
        page, errors = open_page(authorised, server.url)
        device.state = "training"
        server.notify()
        expect_state(page, "training")
        assert abs(int(data_value(page, "#rss")) - memstat.rss_bytes()) <= 4 * MiB
        assert errors.items == []
        authorised.close()
        anonymous = browser.new_context()
        assert anonymous.request.get(server.url + "/api/status").status == 401
        anonymous.close()
    finally:
        server.close()
