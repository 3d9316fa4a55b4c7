"""Which devices a round waits for: a device with an empty store is not ready, nor one of those asked.

A device with nothing stored declines any round at once (``no_samples``); it is not among the ready
devices pacing counts, a round opens for or counts in "N of M", and "N of M" is the same number on
the fleet page, on stdout and in the round log. Real ``edgefl coordinator`` and agent processes on the
real mosquitto, plus the arithmetic of :class:`Round` and the registry on values checked by hand.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Broker, free_port, start_ingest_agent, wait_until
from test_ingest import Gateway

from edgefl.coordinator.registry import DeviceRegistry
from edgefl.coordinator.rounds import Round
from edgefl.datasets import load_digits
from edgefl.wire.cbor import DEFAULT_LIMITS
from edgefl.wire.ingest import Sample

pytestmark = pytest.mark.timeout(240)

PROFILE = ROOT / "firmware_configs" / "coordinator.toml"


def test_pacing_ready_devices_leave_out_an_empty_store() -> None:
    reg = DeviceRegistry(model_sha256="0" * 64, head_shape=(4, 10), clipped=Counter(), limits=DEFAULT_LIMITS)
    now = time.time()
    reg.devices = {
        "full": {"ready": True, "state": "idle", "store_samples": 40, "new_samples": 40, "seen_at": now},
        "empty": {"ready": True, "state": "idle", "store_samples": 0, "new_samples": 0, "seen_at": now},
        "older": {"ready": True, "state": "idle", "seen_at": now},  # reports no store size: counted
        "down": {"ready": True, "state": "offline", "store_samples": 9, "seen_at": now},
    }
    assert reg.online_devices() == ["full", "older"]
    assert reg.ready_new_samples() == {"full": 40, "older": None}

    async def waits() -> tuple[list[str], str]:
        subscribed = await reg.wait_for_devices(3, 0.05)  # the status field alone (tests, the demo)
        with pytest.raises(TimeoutError) as err:  # rounds.expected_clients counts as pacing does
            await reg.wait_for_devices(3, 0.05, key=None)
        return subscribed, str(err.value)

    assert asyncio.run(waits()) == (["empty", "full", "older"], "only 2 of 3 devices ready after 0.05 s")


def test_pacing_asked_leaves_out_devices_that_declined_with_an_empty_store() -> None:
    rnd = Round(1, 0, (4, 10), 60.0, 1, online=frozenset({"a", "b"}), quorum=1.0)
    assert (rnd.asked, rnd.close_at) == (2, 2)
    rnd.declined.append("c")  # not ready at the opening, declined no_samples on the retained round
    rnd.empty.append("c")
    assert (rnd.asked, rnd.close_at) == (2, 2)
    rnd.declined.append("b")  # its status said it had samples; its store was empty after all
    rnd.empty.append("b")
    assert (rnd.asked, rnd.close_at) == (1, 1)
    rnd.declined.append("d")  # another reason: asked, and answered
    assert rnd.asked == 2
    # a job's round opened with no device ready: empty stores declining close it, nothing to wait for
    idle = Round(3, 0, (4, 10), 60.0, 1, quorum=1.0)
    assert not idle.complete()
    idle.declined.append("e")
    idle.empty.append("e")
    assert (idle.asked, idle.complete()) == (0, True)
    chosen = Round(2, 0, (4, 10), 60.0, 1, selected=frozenset({"a", "b", "c"}), quorum=1.0)
    chosen.declined.append("b")
    chosen.empty.append("b")
    assert (chosen.asked, chosen.close_at) == (2, 2)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def wait_for(
    check: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen[str], log: Path
) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < end, f"{what}:\n{log.read_text()}"
        time.sleep(0.1)


def test_pacing_empty_store_device_is_not_counted_in_n_of_m_on_page_log_and_round_log(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    log, rounds = tmp_path / "coordinator.log", tmp_path / "rounds.jsonl"
    sets = [
        "rounds.count=0",
        "rounds.interval_s=3600",  # one round in this test
        "rounds.min_new_samples=0",
        "rounds.min_clients=1",
        "robustness.tolerate=0",
        "strategy.name=fedavg",
        f"files.state={tmp_path / 'state.rec'}",
        f"files.log={rounds}",
        "dashboard.enabled=true",
        f"dashboard.port={port}",
    ]
    cmd = [sys.executable, "-m", "edgefl.cli", "coordinator", str(PROFILE), "--broker", mosquitto.url]
    cmd += ["--fleet", fleet]
    for item in sets:
        cmd += ["--set", item]
    with open(log, "w") as out:
        coord = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        wait_for(lambda: "fleet page: http" in log.read_text(), 60, "the fleet page", coord, log)
        agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-full"))
        agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-empty"))
        status_url = f"http://127.0.0.1:{port}/api/status"
        x, y = load_digits()

        async def both_up_then_feed_one() -> None:
            async with (
                Gateway(mosquitto, fleet, "dev-empty") as empty,
                Gateway(mosquitto, fleet, "dev-full") as gw,
            ):
                await empty.ready()
                await gw.ready()
                await wait_until(
                    lambda: set(get_json(status_url)["status"]["devices"]) == {"dev-full", "dev-empty"},
                    30,
                    "both devices on the page",
                )
                # both ready and subscribed, both stores empty: no device is ready to train
                fs = get_json(status_url)["status"]["fleet_state"]
                assert (fs["state"], fs["ready"], fs["text"]) == (
                    "waiting_devices",
                    0,
                    "waiting for devices: 0 of 1 ready",
                ), fs
                for i in range(40):
                    await gw.sample(Sample(f"s{i}", x[i], label=int(y[i])))

        asyncio.run(both_up_then_feed_one())
        wait_for(
            lambda: rounds.exists() and rounds.read_text().strip() != "", 90, "round 1 logged", coord, log
        )
        entry = json.loads(rounds.read_text().splitlines()[0])
        assert (entry["round"], entry["asked"], entry["counted"]) == (1, 1, 1), entry
        wait_for(lambda: "round 1: " in log.read_text(), 10, "round line", coord, log)
        line = next(ln for ln in log.read_text().splitlines() if ln.startswith("round 1: "))
        assert line.startswith("round 1: 1/1 clients, "), line
        page = get_json(f"http://127.0.0.1:{port}/api/rounds")
        record = next(r for r in page["rounds"] if r["round"] == 1)
        assert (record["asked"], record["counted"]) == (1, 1), record
        status = get_json(status_url)["status"]
        assert status["fleet_state"]["ready"] == 1  # dev-empty still reports an empty store
        assert status["fleet_state"]["state"] == "paused", status["fleet_state"]
    finally:
        coord.send_signal(signal.SIGTERM)
        coord.wait(timeout=30)
