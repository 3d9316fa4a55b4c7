"""The fleet page as an operator's console, and the device page, in a real headless Chromium.

At 1366x900 every row of a 10-device fleet is on the first screen, worst headroom first; a stopped
broker (a real mosquitto under a real :class:`Coordinator`) and a finished job show within 5 s;
header and value columns line up (text bounding boxes); at 390x844 nothing leaves the viewport or
overlaps. The routes behind the page (``/api/rounds``, the coordinator's ``/api/history``) are
tested over HTTP. Test names carry ``console`` or ``fleet_page`` (``pytest -k "console or
fleet_page"``).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CHROMIUM, CHROMIUM_ARGS, Broker, start_mosquitto, stop_broker
from playwright.sync_api import Browser, Page, expect, sync_playwright
from test_dashboard_browser import PageErrors, ThreadedDashboard, painted_pixels

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.dashboard.app import MAX_ROUNDS_PAGE, DashboardState
from edgefl.topics import Topics
from edgefl.transport import MqttTransport

MiB = 1 << 20
DASH = "–"
WIDE = {"width": 1366, "height": 900}
PHONE = {"width": 390, "height": 844}
T0 = datetime.datetime(2026, 12, 6, 3, 0, tzinfo=datetime.UTC)


def round_records(n: int) -> list[dict[str, Any]]:
    """``n`` round records as a coordinator keeps them (one every 4 s from ``T0``)."""
    return [
        {
            "round": r,
            "time": (T0 + datetime.timedelta(seconds=4 * r)).isoformat(),
            "asked": 10,
            "counted": 9 - r % 3,
            "clients": 9 - r % 3,
            "accuracy": 0.9 - 0.4 / (r + 1),
            "fed_accuracy": 0.88 - 0.4 / (r + 1),
            "fed_worst_decile": 0.7 - 0.3 / (r + 1),
            "update_bytes_mean": 20_900.0,
            "duration_s": 3.25,
            "refused": {"stale_round": 1} if r % 7 == 0 else {},
            "declined": {"over_budget": 2} if r % 5 == 0 else {},
        }
        for r in range(1, n + 1)
    ]


# headroom (free share of a 96 MiB cap) of gw-00 ... gw-09: two red (< 5 %), two amber (< 15 %)
HEADROOM = (0.50, 0.45, 0.40, 0.30, 0.25, 0.20, 0.14, 0.10, 0.04, 0.02)


def fleet_status(progress: dict[str, Any]) -> Callable[[], Mapping[str, Any]]:
    """A 10-device fleet's coordinator status; ``progress["fleet_state"]`` may replace the state."""

    def status() -> Mapping[str, Any]:
        cap = 96 * MiB
        devices = {
            f"gw-{i:02d}": {
                "state": ("idle", "training", "waiting")[i % 3],
                "online": True,
                "rss_bytes": round(cap * (1 - free)),
                "cap_bytes": cap,
                "peak_rss_bytes": round(cap * (1 - free)) + 2 * MiB,
                "last_round": progress["round"] - 1,
                "reason": "memory: train estimate exceeds headroom" if free < 0.05 else "",
                "personal_accuracy": 0.95 - 0.01 * i,
                "global_accuracy": 0.90 - 0.01 * i,
                "refused": {},
                "declined": {"over_budget": 3} if free < 0.05 else {},
            }
            for i, free in enumerate(HEADROOM)
        }
        return {
            "round": progress["round"],
            "state": "collecting",
            "updates_received": 4,
            "updates_expected": 10,
            "deadline_s_left": 20.0,
            "version": progress["round"] - 1,
            "broker_connected": True,
            "fleet_state": progress.get("fleet_state", {"state": "collecting", "text": "collecting 4 of 10"}),
            "devices": devices,
            "rounds": progress["rounds"][-50:],
            "rejected": {"stale_round": 3},
            "model_mismatches": {},
        }

    return status


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_page(browser: Browser, url: str, viewport: dict[str, int]) -> tuple[Page, PageErrors]:
    page = browser.new_context(viewport=viewport).new_page()  # type: ignore[arg-type]
    errors = PageErrors(page)
    page.goto(url + "/")
    expect(page.locator("#live")).to_have_text("live", timeout=5000)
    return page, errors


@pytest.fixture
def fleet_page() -> Iterator[tuple[ThreadedDashboard, dict[str, Any]]]:
    rounds = round_records(1200)
    progress: dict[str, Any] = {"round": 1201, "rounds": rounds}
    state = DashboardState(
        "coordinator",
        "fleet console",
        fleet_status(progress),
        get_rounds=lambda: progress["rounds"],
        push_interval_s=0.25,
    )
    server = ThreadedDashboard(state)
    try:
        yield server, progress
    finally:
        server.close()


ROWS_JS = """() => [...document.querySelectorAll('#devices tbody tr')].map(r => {
  const b = r.getBoundingClientRect();
  return {device: r.dataset.device, top: b.top, bottom: b.bottom, left: b.left, right: b.right}; })"""


def test_fleet_page_console_ten_devices_on_the_first_screen_worst_first(
    browser: Browser, fleet_page: tuple[ThreadedDashboard, dict[str, Any]], tmp_path: Path
) -> None:
    server, _ = fleet_page
    page, errors = open_page(browser, server.url, WIDE)
    expect(page.locator("#devices tbody tr")).to_have_count(10)
    assert page.evaluate("window.scrollY") == 0
    rows = page.evaluate(ROWS_JS)
    for row in rows:  # every row whole inside the 1366x900 viewport, without scrolling
        assert row["top"] >= 0 and row["bottom"] <= WIDE["height"], row
        assert row["left"] >= 0 and row["right"] <= WIDE["width"], row
    # worst headroom first, and the state in words above them
    assert [r["device"] for r in rows] == [f"gw-{i:02d}" for i in range(9, -1, -1)]
    expect(page.locator("#fleet-state")).to_have_text("collecting 4 of 10")
    box = page.locator("#fleet-state").bounding_box()
    assert box is not None and box["y"] + box["height"] <= rows[0]["top"]
    # headroom in free MiB and % of the cap, coloured against 15 % (amber) and 5 % (red)
    cell = '#devices tr[data-device="{}"] td[data-col="headroom"]'
    assert page.text_content(cell.format("gw-09")) == "1.9 MiB · 2 %"
    assert page.text_content(cell.format("gw-00")) == "48.0 MiB · 50 %"
    levels = {f"gw-{i:02d}": page.get_attribute(cell.format(f"gw-{i:02d}"), "data-level") for i in range(10)}
    assert levels == {
        **{f"gw-{i:02d}": "ok" for i in range(6)},
        "gw-06": "warn",
        "gw-07": "warn",
        "gw-08": "bad",
        "gw-09": "bad",
    }
    row9 = '#devices tr[data-device="gw-09"] td'
    assert page.text_content(row9 + '[data-col="peak"]') == "96.1 MiB · 100 %"
    assert page.text_content(row9 + '[data-col="state"]') == "idle"
    assert page.text_content(row9 + '[data-col="reason"]') == (
        "memory: train estimate exceeds headroom · declined over_budget 3"
    )
    assert page.text_content(row9 + '[data-col="last_round"]') == "1,200"
    assert page.text_content(row9 + '[data-col="personal"]') == "86.0 %"
    assert page.text_content(row9 + '[data-col="global"]') == "81.0 %"
    page.screenshot(path=tmp_path / "fleet-1366.png")
    assert errors.items == []
    page.context.close()


def test_fleet_page_console_sorts_by_any_column(
    browser: Browser, fleet_page: tuple[ThreadedDashboard, dict[str, Any]]
) -> None:
    server, progress = fleet_page
    page, errors = open_page(browser, server.url, WIDE)
    expect(page.locator("#devices tbody tr")).to_have_count(10)

    def order() -> list[str]:
        return [r["device"] for r in page.evaluate(ROWS_JS)]

    page.click('#devices th button[data-sort="device"]')
    assert order() == [f"gw-{i:02d}" for i in range(10)]
    assert page.get_attribute('#devices th[data-col="device"]', "aria-sort") == "ascending"
    page.click('#devices th button[data-sort="device"]')
    assert order() == [f"gw-{i:02d}" for i in range(9, -1, -1)]
    page.click('#devices th button[data-sort="personal"]')  # lowest accuracy first
    assert order()[0] == "gw-09"
    # the order holds across pushes: a new round number arrives and the rows are drawn again
    progress["round"] = progress["round"] + 1
    server.notify()
    expect(page.locator("#round")).to_have_text(f"{progress['round']:,}")
    assert order()[0] == "gw-09" and order()[-1] == "gw-00"
    assert errors.items == []
    page.context.close()


ALIGN_JS = """(table) => {
  const box = (el) => { const r = document.createRange(); r.selectNodeContents(el);
                        const b = r.getBoundingClientRect(); return {left: b.left, right: b.right}; };
  const heads = [...document.querySelectorAll(`#${table} thead th`)];
  const rows = [...document.querySelectorAll(`#${table} tbody tr`)].slice(0, 5);
  return heads.map((th, i) => ({
    col: th.dataset.col, num: th.classList.contains('num'), head: box(th),
    cell: (() => { const b = th.getBoundingClientRect(); return {left: b.left, right: b.right}; })(),
    values: rows.map(r => r.cells[i]).filter(td => td && td.textContent !== '').map(box),
  }));
}"""


@pytest.mark.parametrize("table", ["devices", "rounds"])
def test_fleet_page_console_header_and_value_columns_align(
    browser: Browser, fleet_page: tuple[ThreadedDashboard, dict[str, Any]], table: str
) -> None:
    server, _ = fleet_page
    page, errors = open_page(browser, server.url, WIDE)
    expect(page.locator(f"#{table} tbody tr")).to_have_count(10 if table == "devices" else 15)
    columns = page.evaluate(ALIGN_JS, table)
    assert len(columns) == (8 if table == "devices" else 9)
    for col in columns:
        assert col["values"], col
        for value in col["values"]:
            # each value sits under its own header, on the same side: right edges for numbers
            assert (
                col["cell"]["left"] - 0.5 <= value["left"] and value["right"] <= col["cell"]["right"] + 0.5
            ), col
            if col["num"]:
                assert abs(value["right"] - col["head"]["right"]) <= 2, col
            else:
                assert abs(value["left"] - col["head"]["left"]) <= 2, col
    assert errors.items == []
    page.context.close()


def test_fleet_page_console_rounds_paged_with_times_counts_and_reasons(
    browser: Browser, fleet_page: tuple[ThreadedDashboard, dict[str, Any]]
) -> None:
    server, progress = fleet_page
    page, errors = open_page(browser, server.url, WIDE)
    rows = page.locator("#rounds tbody tr")
    expect(rows).to_have_count(15)
    assert rows.first.get_attribute("data-round") == "1200"
    newest = '#rounds tr[data-round="1197"] td'
    expected_time = (T0 + datetime.timedelta(seconds=4 * 1197)).astimezone()
    assert page.text_content(newest + '[data-col="time"]') in (
        expected_time.strftime("%H:%M:%S"),
        expected_time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    assert page.text_content(newest + '[data-col="clients"]') == "9 of 10"
    assert page.text_content(newest + '[data-col="refused"]') == "stale_round 1"
    assert page.text_content('#rounds tr[data-round="1195"] td[data-col="declined"]') == "over_budget 2"
    assert page.text_content(newest + '[data-col="federated"]') == "0.880 (0.700)"
    expect(page.locator("#rounds-page")).to_have_text("page 1 of 80")
    page.click("#rounds-older")
    assert rows.first.get_attribute("data-round") == "1185"
    expect(page.locator("#rounds-page")).to_have_text("page 2 of 80")
    page.click("#rounds-newer")
    assert rows.first.get_attribute("data-round") == "1200"
    # a new round: the page fetches only what is new and shows it first
    progress["rounds"] = progress["rounds"] + round_records(1201)[-1:]
    progress["round"] = 1202
    server.notify()
    expect(rows.first).to_have_attribute("data-round", "1201", timeout=3000)
    expect(page.locator("#rounds-count")).to_have_text("· 1,201")
    # the accuracy chart over the last 100 rounds and, zoomed out, over all 1,201
    assert painted_pixels(page, "accuracy-chart") > 2000
    page.click('.window button[data-window="0"]')
    assert page.get_attribute('.window button[data-window="0"]', "aria-pressed") == "true"
    assert painted_pixels(page, "accuracy-chart") > 2000
    # the test's own pixel reads make Chromium suggest willReadFrequently; the page reads none
    assert [e for e in errors.items if "willReadFrequently" not in e] == []
    page.context.close()


def test_fleet_page_console_finished_job_shows_within_5_s_and_stays_readable(browser: Browser) -> None:
    progress: dict[str, Any] = {"round": 1201, "rounds": round_records(1200)}
    server = ThreadedDashboard(
        DashboardState(
            "coordinator",
            "fleet console",
            fleet_status(progress),
            get_rounds=lambda: progress["rounds"],
            push_interval_s=0.25,
        )
    )
    page, errors = open_page(browser, server.url, WIDE)
    expect(page.locator("#fleet-state")).to_have_attribute("data-state", "collecting")
    progress["fleet_state"] = {"state": "finished", "text": "finished: 1,200 rounds"}
    server.notify()
    expect(page.locator("#fleet-state")).to_have_attribute("data-state", "finished", timeout=5000)
    expect(page.locator("#fleet-state")).to_have_text("finished: 1,200 rounds")
    # the coordinator exits after its job: the page keeps the last state, marked stale with its age
    server.close()
    expect(page.locator("#live")).to_have_attribute("data-state", "stale", timeout=5000)
    expect(page.locator("#live")).to_contain_text(" s old")
    expect(page.locator("#stale-note")).to_contain_text("the coordinator does not answer")
    expect(page.locator("#fleet-state")).to_have_attribute("data-state", "finished")
    assert [e for e in errors.items if "ERR_CONNECTION_REFUSED" not in e] == []
    page.context.close()


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[Broker]:
    broker = start_mosquitto(tmp_path)
    try:
        yield broker
    finally:
        if broker.proc.poll() is None:
            stop_broker(broker)


@pytest.mark.broker
def test_fleet_page_console_stopped_broker_and_finished_job_show_within_5_s(
    browser: Browser, own_broker: Broker
) -> None:
    """A real coordinator on a real broker: the broker stops, the page says so within 5 s (not "live"
    only); the job then ends as the runner ends it (transport stopped, then the page) and the page
    reads finished."""
    topics = Topics("edgefl", f"console-{time.monotonic_ns()}")
    holder: dict[str, Coordinator] = {}

    def status() -> Mapping[str, Any]:
        return holder["coord"].dashboard_status() if "coord" in holder else {}

    server = ThreadedDashboard(DashboardState("coordinator", "fleet real", status, push_interval_s=0.25))

    async def start() -> None:
        transport = MqttTransport(own_broker.host, own_broker.port, f"coord-{topics.fleet}")
        await transport.start(wait_s=10)
        holder["coord"] = Coordinator(
            transport,
            topics,
            np.zeros((4, 3), np.float32),
            np.zeros(3, np.float32),
            model_sha256="0" * 64,
            strategy=FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=1, deadline_s=60),
        )

    async def finish() -> None:
        holder["coord"].finished = True
        await holder["coord"].transport.stop()

    asyncio.run_coroutine_threadsafe(start(), server.loop).result(15)
    closed = False
    try:
        page, errors = open_page(browser, server.url, WIDE)
        expect(page.locator("#broker")).to_have_text("broker connected", timeout=5000)
        stop_broker(own_broker)
        state = page.locator("#fleet-state")
        expect(state).to_have_attribute("data-state", "broker_unreachable", timeout=5000)
        expect(state).to_have_text(f"broker unreachable: {own_broker.host}:{own_broker.port}")
        expect(page.locator("#broker")).to_have_text("broker unreachable")
        expect(page.locator("#live")).to_have_text("live")  # the page's own link is fine
        asyncio.run_coroutine_threadsafe(finish(), server.loop).result(15)
        server.close()  # the runner's order: transport, then the page (its final status goes out)
        closed = True
        expect(state).to_have_attribute("data-state", "finished", timeout=5000)
        expect(state).to_have_text("finished after round 0")
        expect(page.locator("#live")).to_have_attribute("data-state", "stale", timeout=5000)
        assert [e for e in errors.items if "ERR_CONNECTION_REFUSED" not in e] == []
        page.context.close()
    finally:
        if not closed:
            asyncio.run_coroutine_threadsafe(finish(), server.loop).result(15)
            server.close()


OVERFLOW_JS = """() => {
  const W = document.documentElement.clientWidth;
  const out = [];
  for (const el of document.body.querySelectorAll('*')) {
    const b = el.getBoundingClientRect();
    if (b.width === 0 || b.height === 0) continue;
    if (b.left < -0.5 || b.right > W + 0.5)
      out.push(`${el.tagName}#${el.id}.${el.className} ${b.left}-${b.right}`);
  }
  return {W, scroll: document.documentElement.scrollWidth, out};
}"""

OVERLAP_JS = """(selectors) => {
  const out = [];
  for (const sel of selectors) {
    for (const group of document.querySelectorAll(sel)) {
      const kids = [...group.children].filter(k => !k.hidden && k.getBoundingClientRect().width > 0);
      for (let i = 0; i < kids.length; i++) for (let j = i + 1; j < kids.length; j++) {
        const a = kids[i].getBoundingClientRect(), b = kids[j].getBoundingClientRect();
        const x = Math.min(a.right, b.right) - Math.max(a.left, b.left);
        const y = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
        if (x > 0.5 && y > 0.5) out.push(`${sel}: ${kids[i].textContent} / ${kids[j].textContent}`);
      }
    }
  }
  return out;
}"""
GROUPS = [
    ".top",
    ".pills",
    ".fleet-line",
    ".fleet-facts",
    ".card-head",
    ".legend",
    "#devices tbody tr",
    "#rounds tbody tr",
    ".figures",
    ".rows",
    ".rows > div",
    "main",
    ".pager",
    ".window",
]


def device_status() -> dict[str, Any]:
    now = time.time()
    return {
        "device": "gw-kitchen-with-a-long-name-01",
        "state": "deferred",
        "reason": "memory: train estimate 41.2 MiB exceeds the headroom left (12.0 MiB)",
        "round": 1204,
        "version": 1203,
        "cap_bytes": 96 * MiB,
        "rss_bytes": 90 * MiB,
        "pss_bytes": 70 * MiB,
        "peak_rss_bytes": 93 * MiB,
        "system_available_bytes": 310 * MiB,
        "phase_peaks": {
            "inference": 70 * MiB,
            "train": 93 * MiB,
            "encode": 71 * MiB,
            "publish": 70 * MiB,
            "apply": 70 * MiB,
        },
        "phase_rise": {"inference": 1 * MiB, "train": 22 * MiB, "encode": 2 * MiB, "publish": 0, "apply": 0},
        "last_update_bytes": 20_890,
        "last_update_ts": now - 12.0,
        "ts": now,
        "local_accuracy": 0.91,
        "eval_accuracy": 0.87,
        "eval_count": 120,
        "personal_accuracy": 0.93,
        "inference_accuracy": 0.89,
        "inference_rate": 410.0,
        "pipeline_mode": "fused",
        "rejected": {"bad_cbor_with_a_long_reason_name": 1},
        "broker_connected": False,
        "broker": "refused: not authorized",
        "store_samples": 512,
        "inferred_total": 123456,
    }


@pytest.mark.parametrize("kind", ["coordinator", "device"])
def test_fleet_page_console_phone_390_nothing_overflows_or_overlaps(
    browser: Browser, fleet_page: tuple[ThreadedDashboard, dict[str, Any]], kind: str, tmp_path: Path
) -> None:
    if kind == "coordinator":
        server = fleet_page[0]
    else:
        server = ThreadedDashboard(DashboardState("device", "gw-kitchen-with-a-long-name-01", device_status))
    try:
        page, errors = open_page(browser, server.url, PHONE)
        if kind == "coordinator":
            expect(page.locator("#rounds tbody tr")).to_have_count(15)
        else:
            expect(page.locator("#state")).to_have_attribute("data-state", "deferred")
        page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        found = page.evaluate(OVERFLOW_JS)
        assert found["W"] == PHONE["width"]
        assert found["scroll"] <= PHONE["width"], found
        assert found["out"] == [], found["out"][:10]
        assert page.evaluate(OVERLAP_JS, GROUPS) == []
        page.screenshot(path=tmp_path / f"{kind}-390.png", full_page=True)
        assert errors.items == []
        page.context.close()
    finally:
        if kind == "device":
            server.close()


def test_console_device_page_says_what_it_measures(browser: Browser) -> None:
    server = ThreadedDashboard(DashboardState("device", "gw", device_status))
    try:
        page, errors = open_page(browser, server.url, WIDE)
        expect(page.locator("#broker")).to_have_text("broker refused: not authorized")
        assert page.get_attribute("#broker", "class") == "pill pill-bad"
        text = page.text_content("#update-bytes") or ""
        assert text.startswith("20.4 KiB, 1") and text.endswith(" s ago"), text
        assert 12 <= int(text.split(", ")[1].split()[0]) <= 20, text
        # accuracies named by what they are measured on
        labels = page.locator("dl.rows dt").all_text_contents()
        for label in (
            "Global head · holdout",
            "Personal head · holdout",
            "Live predictions · labels",
            "Last training · its own samples",
        ):
            assert label in labels
        assert page.text_content("#global-accuracy") == "87.0 % of 120"
        assert page.text_content("#personal-accuracy") == "93.0 %"
        # per-phase rise beside the absolute peak; batch is part of the fused inference
        assert page.text_content('#phases tr[data-phase="train"] td.num') == "93.0 MiB · 97 % · +22.0 MiB"
        assert (
            page.text_content('#phases tr[data-phase="batch"] td.num') == "part of inference (fused pipeline)"
        )
        assert "(lifetime)" in (page.text_content("#h-memory ~ dl") or "")
        # 6 MiB of 96 free (6.25 %): amber, not red; red below 5 %
        assert page.get_attribute("#gauge", "data-level") == "warn"
        assert errors.items == []
        page.context.close()
    finally:
        server.close()


def get_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, None


def test_console_rounds_api_serves_the_history_in_pages() -> None:
    records = round_records(1200)
    server = ThreadedDashboard(DashboardState("coordinator", "f", lambda: {}, get_rounds=lambda: records))
    try:
        code, doc = get_json(server.url + "/api/rounds")
        assert code == 200 and doc["total"] == 1200 and doc["last"] == 1200
        assert [r["round"] for r in doc["rounds"]] == list(range(1, 1201))
        assert doc["rounds"][6]["refused"] == {"stale_round": 1}
        _, doc = get_json(server.url + "/api/rounds?after=1190&limit=5")
        assert [r["round"] for r in doc["rounds"]] == [1191, 1192, 1193, 1194, 1195]
        _, doc = get_json(server.url + "/api/rounds?after=1200")
        assert doc["rounds"] == [] and doc["last"] == 1200
        _, doc = get_json(server.url + f"/api/rounds?limit={MAX_ROUNDS_PAGE + 1000}")
        assert len(doc["rounds"]) == 1200
        assert get_json(server.url + "/api/rounds?after=x")[0] == 400
        assert get_json(server.url + "/api/rounds?after=1" + "0" * 400)[0] == 400  # no float overflow, no 500
        assert get_json(server.url + "/api/rounds?limit=-" + "9" * 400)[0] == 400
        records[0]["accuracy"] = math.nan  # served as null, never NaN
        _, doc = get_json(server.url + "/api/rounds?limit=1")
        assert doc["rounds"][0]["accuracy"] is None
    finally:
        server.close()
    device = ThreadedDashboard(DashboardState("device", "d", lambda: {}))
    try:  # without get_rounds (a device): an empty history
        assert get_json(device.url + "/api/rounds")[1] == {"rounds": [], "total": 0, "last": None}
    finally:
        device.close()


def test_console_coordinator_history_keeps_each_devices_memory() -> None:
    rss = {"gw-a": 40 * MiB, "gw-b": 90 * MiB}

    def status() -> Mapping[str, Any]:
        return {
            "devices": {
                "gw-a": {"rss_bytes": rss["gw-a"], "cap_bytes": 96 * MiB},
                "gw-b": {"rss_bytes": rss["gw-b"], "cap_bytes": 96 * MiB},
                "gw-off": {"rss_bytes": None, "cap_bytes": 64 * MiB},
                "bad": "not a mapping",
            }
        }

    server = ThreadedDashboard(
        DashboardState("coordinator", "f", status, history_interval_s=0.05, history_len=4)
    )
    try:
        deadline = time.monotonic() + 10
        doc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            doc = get_json(server.url + "/api/history")[1]
            if len(doc["devices"].get("gw-a", [])) == 4:
                break
            time.sleep(0.05)
        assert set(doc["devices"]) == {"gw-a", "gw-b"}  # no RSS, no point
        assert len(doc["devices"]["gw-a"]) == 4  # bounded by history_len
        age, value, cap = doc["devices"]["gw-b"][-1]
        assert value == 90 * MiB and cap == 96 * MiB and 0 <= age < 5
        assert "rss" not in doc
    finally:
        server.close()


def test_fleet_page_console_final_status_reaches_the_page_at_shutdown(browser: Browser) -> None:
    """A coordinator that stops right after its job: the page gets the final status, not the one before."""
    progress: dict[str, Any] = {"round": 40, "rounds": round_records(39)}
    # no pushes but the one at shutdown: the poll interval is longer than the test
    server = ThreadedDashboard(
        DashboardState(
            "coordinator",
            "fleet console",
            fleet_status(progress),
            get_rounds=lambda: progress["rounds"],
            push_interval_s=3600.0,
        )
    )
    page, errors = open_page(browser, server.url, WIDE)
    expect(page.locator("#fleet-state")).to_have_attribute("data-state", "collecting")
    progress.update(round=41, rounds=round_records(40))
    progress["fleet_state"] = {"state": "finished", "text": "finished: 40 rounds"}
    server.close()
    expect(page.locator("#fleet-state")).to_have_attribute("data-state", "finished", timeout=5000)
    expect(page.locator("#round")).to_have_text("41")
    expect(page.locator("#live")).to_have_attribute("data-state", "stale", timeout=5000)
    assert [e for e in errors.items if "ERR_CONNECTION_REFUSED" not in e] == []
    page.context.close()


def test_fleet_page_console_large_fleet_shows_the_worst_20_first(browser: Browser) -> None:
    cap = 96 * MiB
    devices = {
        f"gw-{i:03d}": {"state": "idle", "online": True, "rss_bytes": cap // 2 + i * MiB, "cap_bytes": cap}
        for i in range(30)
    }
    server = ThreadedDashboard(DashboardState("coordinator", "big", lambda: {"devices": devices}))
    try:
        page, errors = open_page(browser, server.url, WIDE)
        rows = page.locator("#devices tbody tr")
        expect(rows).to_have_count(20)
        assert rows.first.get_attribute("data-device") == "gw-029"  # the least headroom
        expect(page.locator("#devices-more")).to_have_text("show all 30 devices")
        expect(page.locator("#online-count")).to_have_text("devices 30 / 30 online")
        page.click("#devices-more")
        expect(rows).to_have_count(30)
        expect(page.locator("#devices-more")).to_have_text("show the first 20")
        assert errors.items == []
        page.context.close()
    finally:
        server.close()


def test_console_coordinator_round_records_follow_its_history() -> None:
    from edgefl.coordinator.history import RoundRecord

    coord = Coordinator(
        MqttTransport("127.0.0.1", 1, "console-records"),  # never started: no connection
        Topics("edgefl", "console"),
        np.zeros((4, 3), np.float32),
        np.zeros(3, np.float32),
        model_sha256="0" * 64,
        strategy=FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=1, deadline_s=60),
    )
    history = coord.state.history
    history.extend(RoundRecord(r, 2, 0.5 + r / 100, 100.0, 1.0) for r in range(1, 6))
    first = coord.dashboard_rounds()
    assert [r["round"] for r in first] == [1, 2, 3, 4, 5]
    assert first[0]["accuracy"] == 0.51 and first[0]["counted"] == 2
    assert coord.dashboard_rounds() is first  # unchanged history: the same list
    history.append(RoundRecord(6, 1, math.nan, 0.0, 2.0))
    del history[:2]  # trimmed, as a long-running service keeps its latest rounds
    again = coord.dashboard_rounds()
    assert [r["round"] for r in again] == [3, 4, 5, 6]
    assert again[0] is first[2]  # converted once
    assert math.isnan(again[-1]["accuracy"])
    # the round log's keys: time, counted, refusals and declines by reason (given by the runner)
    assert again[-1]["time"] is None and again[-1]["counted"] == 1 and "refused" not in again[-1]
    coord.note_round_reasons(6, {"stale_round": 2}, {"over_budget": 1})  # after its conversion
    assert again[-1]["refused"] == {"stale_round": 2} and again[-1]["declined"] == {"over_budget": 1}
    coord.note_round_reasons(7, {}, {"no_data": 3})  # before it
    history.append(RoundRecord(7, 0, 0.5, 0.0, 1.0, refused="too_few", declined=3, closed_unix=1.8e9))
    seventh = coord.dashboard_rounds()[-1]
    assert seventh["time"] == "2027-01-15T08:00:00Z" and seventh["round_refused"] == "too_few"
    assert seventh["declined"] == {"no_data": 3} and seventh["declined_devices"] == 3
    coord.state.history = [RoundRecord(1, 3, 0.9, 10.0, 1.0)]  # another history (a state file loaded)
    assert [(r["round"], r["counted"]) for r in coord.dashboard_rounds()] == [(1, 3)]
    status = coord.dashboard_status()
    assert status["rounds"] == coord.dashboard_rounds() and status["broker_connected"] is False


def test_console_page_marks_a_server_that_stops_answering_stale(browser: Browser) -> None:
    """The stream stays open but the server's loop is stuck: the page says stale, then live again."""
    server = ThreadedDashboard(DashboardState("device", "gw", device_status, push_interval_s=0.2))
    try:
        context = browser.new_context(viewport=WIDE)  # type: ignore[arg-type]
        context.add_init_script("window.edgeflProbeS = 0.4")  # probes every 0.4 s: silent after 1 s
        page = context.new_page()
        errors = PageErrors(page)
        page.goto(server.url + "/")
        expect(page.locator("#live")).to_have_text("live", timeout=5000)
        released = threading.Event()

        async def stuck() -> None:  # blocks the server's event loop, as a hung process would
            while not released.is_set():
                time.sleep(0.05)

        server.loop.call_soon_threadsafe(lambda: server.loop.create_task(stuck()))
        try:
            expect(page.locator("#live")).to_have_attribute("data-state", "stale", timeout=5000)
            expect(page.locator("#stale-note")).to_contain_text("the agent does not answer")
        finally:
            released.set()
        expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=5000)
        expect(page.locator("#stale-note")).to_be_hidden()
        assert errors.items == []
        context.close()
    finally:
        server.close()


def test_console_finished_job_reads_finished_after_its_transport_stopped() -> None:
    """The runner stops the transport before the page: the page's last status still says finished."""
    coord = Coordinator(
        MqttTransport("127.0.0.1", 1, "console-finished"),  # never started: not connected
        Topics("edgefl", "console"),
        np.zeros((4, 3), np.float32),
        np.zeros(3, np.float32),
        model_sha256="0" * 64,
        strategy=FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=1, deadline_s=60),
    )
    assert coord.dashboard_status()["fleet_state"]["state"] == "broker_unreachable"
    coord.finished = True
    status = coord.dashboard_status()
    assert status["fleet_state"]["state"] == "finished" and status["broker_connected"] is False
