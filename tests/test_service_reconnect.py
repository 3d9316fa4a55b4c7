"""The coordinator after its broker comes back: what it owns retained is published again, /healthz tells.

Real ``edgefl coordinator`` and ``edgefl run`` processes on a mosquitto of the test's own (it is
stopped, killed and restarted), with persistence as ``docs/operations.md`` configures it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Broker, free_port, restart_mosquitto, start_mosquitto, start_replay_agent, stop_broker
from test_service import log_lines, start_coordinator, wait_for

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.history import RoundRecord
from edgefl.coordinator.roundlog import log_entry, round_line
from edgefl.coordinator.rounds import Round
from edgefl.coordinator.service import Coordinator
from edgefl.datasets import load_digits
from edgefl.launcher import stop_agents
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.global_model import decode_global_model
from edgefl.wire.rounds import decode_round

pytestmark = pytest.mark.timeout(300)


def _persistent_broker(tmp: Path) -> Broker:
    """A mosquitto that saves its state only at a clean stop (autosave far away): a ``kill -9`` restores
    the snapshot of its last clean stop, as a broker without ``autosave_interval`` does for 30 min."""
    store = tmp / "store"
    store.mkdir()
    # as root, mosquitto drops to user mosquitto, who cannot write under the test's 0700 folders
    keep = "user root\n" if os.geteuid() == 0 else ""
    conf = f"persistence true\npersistence_location {store}/\nautosave_interval 3600\n{keep}"
    return start_mosquitto(tmp, conf)


async def _retained(broker: Broker, fleet: str, version: int, round_no: int, timeout_s: float) -> None:
    """Wait for the retained head of ``version`` on the fleet's ``global`` and the announcement of round
    ``round_no`` on its ``round``; AssertionError naming what came instead."""
    topics = Topics("edgefl", fleet)
    spy = MqttTransport(broker.host, broker.port, f"spy-{fleet}-{time.monotonic_ns()}")
    await spy.start(wait_s=10)
    seen: list[int] = []
    announced: list[int] = []
    try:
        await spy.subscribe(topics.global_model, 1)
        await spy.subscribe(topics.round, 1)
        end = asyncio.get_running_loop().time() + timeout_s
        while not seen or seen[-1] != version or not announced or announced[-1] != round_no:
            left = end - asyncio.get_running_loop().time()
            assert left > 0, f"heads of versions {seen} and rounds {announced}, not {version} and {round_no}"
            try:
                msg = await asyncio.wait_for(spy.queue.get(), left)
            except TimeoutError:
                continue
            if not msg.payload:
                continue
            if msg.topic == topics.round:
                announced.append(decode_round(msg.payload).round)
            else:
                seen.append(decode_global_model(msg.payload).version)
    finally:
        await spy.stop()


@pytest.mark.long
@pytest.mark.broker
@pytest.mark.subprocess
def test_durable_broker_restored_from_an_old_snapshot_gets_the_current_head_again(tmp_path: Path) -> None:
    """The broker is stopped cleanly at round 2 or so (its snapshot holds that round's head), then the
    fleet runs on; its device stops, and the broker is killed -9 and restarted: it restores the old
    snapshot, the coordinator's session included. The coordinator publishes its current head and last
    announcement again; a device started with a new, empty state folder then takes part in the next
    round (without them it would apply the old head and sit the round out)."""
    x, y = load_digits()
    broker = _persistent_broker(tmp_path)
    fleet = "restored"
    port = free_port()
    log = tmp_path / "rounds.jsonl"
    sets = (
        "rounds.interval_s=0",
        "rounds.min_new_samples=0",
        "rounds.min_clients=1",
        "rounds.deadline_s=20",
        f"files.state={tmp_path / 'state.rec'}",
        f"files.log={log}",
        "dashboard.enabled=true",
        f"dashboard.port={port}",
    )
    agents = [start_replay_agent(broker, fleet, tmp_path, "dev-1", x[:96], y[:96])]
    coord = start_coordinator(tmp_path, "coordinator", broker, fleet, *sets)
    try:
        wait_for(lambda: len(log_lines(log)) >= 2, 150, "round 2", [coord], tmp_path)
        stop_broker(broker)  # a clean stop: mosquitto saves its snapshot (this head, this round)
        assert (tmp_path / "store" / "mosquitto.db").is_file(), "no snapshot saved"
        snapshot = log_lines(log)[-1]["version"]
        broker = restart_mosquitto(broker)
        heads = "3 more heads"
        wait_for(lambda: log_lines(log)[-1]["version"] >= snapshot + 3, 150, heads, [coord], tmp_path)
        stop_agents(agents)
        # no round open, and the last one opened is in the log (a round the leaving device declined
        # closes a moment before its line is written)
        wait_for(
            lambda: _idle_and_logged(port, log),
            60,
            "the fleet waiting for its device, its last round logged",
            [coord],
            tmp_path,
        )
        last = log_lines(log)[-1]
        assert last["version"] > snapshot + 2, last
        broker.proc.kill()  # kill -9: what changed since the clean stop is lost
        broker.proc.wait(timeout=10)
        broker = restart_mosquitto(broker)
        asyncio.run(_retained(broker, fleet, last["version"], last["round"], 30))
        out = (tmp_path / "coordinator.log").read_text()
        # the broker restored our session (Session Present 1): the head went out again all the same
        v, r = last["version"], last["round"]
        republished = f"global head (version {v}) and round {r}'s announcement again"
        assert f"broker back: publishing the {republished} (it may have restored older ones)" in out, out
        # a device whose state was replaced: it takes the current head and answers the next round
        agents = [
            start_replay_agent(
                broker, fleet, tmp_path, "dev-1", x[:96], y[:96], device__state_dir=str(tmp_path / "new")
            )
        ]
        after = last["round"]
        wait_for(lambda: log_lines(log)[-1]["round"] > after, 120, "the next round", [coord], tmp_path)
        (nxt,) = [line for line in log_lines(log) if line["round"] == last["round"] + 1]
        assert (nxt["round"], nxt["counted"], nxt["silent"]) == (last["round"] + 1, 1, []), nxt
        assert nxt["version"] == last["version"] + 1, nxt
        coord.send_signal(signal.SIGTERM)
        assert coord.wait(timeout=30) == 0
    finally:
        if coord.poll() is None:
            coord.kill()
            coord.wait()
        stop_agents(agents)
        stop_broker(broker)


def _idle_and_logged(port: int, log: Path) -> bool:
    """True when the coordinator waits for devices (no round open) and its last round opened is logged."""
    fleet = _status(port)["fleet_state"]
    lines = log_lines(log)
    return fleet["state"] == "waiting_devices" and bool(lines) and lines[-1]["round"] == fleet["round"]


def _status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5) as r:
        doc: dict[str, Any] = json.loads(r.read())["status"]
    return doc


def _healthz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.broker
@pytest.mark.subprocess
def test_durable_coordinator_healthz_503_while_the_broker_is_down(tmp_path: Path) -> None:
    """The coordinator's ``/healthz`` answers 200 ``ok`` with its broker, 503 ``broker unreachable:
    HOST:PORT`` (its status's ``health``) while the broker is stopped, and 200 again once it is back."""
    broker = start_mosquitto(tmp_path)
    port = free_port()
    coord = start_coordinator(
        tmp_path, "coordinator", broker, "healthz", "dashboard.enabled=true", f"dashboard.port={port}"
    )
    try:
        wait_for(lambda: _healthz(port) == (200, "ok\n"), 90, "healthz ok", [coord], tmp_path)
        assert _status(port)["health"] == "ok"
        stop_broker(broker)
        where = f"{broker.host}:{broker.port}"
        wait_for(lambda: _healthz(port)[0] == 503, 30, "healthz 503", [coord], tmp_path)
        assert _healthz(port) == (503, f"broker unreachable: {where}\n")
        st = _status(port)
        assert (st["health"], st["broker_connected"]) == (f"broker unreachable: {where}", False), st
        broker = restart_mosquitto(broker)
        wait_for(lambda: _healthz(port) == (200, "ok\n"), 60, "healthz ok again", [coord], tmp_path)
        coord.send_signal(signal.SIGTERM)
        assert coord.wait(timeout=30) == 0
    finally:
        if coord.poll() is None:
            coord.kill()
            coord.wait()
        stop_broker(broker)


def test_durable_round_names_the_devices_that_never_answered() -> None:
    """A round asks a, b, c (online at the opening) and d (selected); what it counted or was declined
    leaves the silent ones, sorted."""
    rnd = Round(4, 3, (4, 2), 30.0, 1, online=frozenset({"c", "a", "b"}))
    rnd.devices.append("a")
    rnd.update_ids.add("a:4:3")
    rnd.declined.append("c")
    assert rnd.silent() == ["b"]
    picked = Round(4, 3, (4, 2), 30.0, 1, selected=frozenset({"d", "b"}), online=frozenset({"a"}))
    assert picked.silent() == ["b", "d"]


def test_durable_round_line_names_the_silent_devices_the_first_ten() -> None:
    rec = RoundRecord(8, 1, float("nan"), 900.0, 30.0, asked=2)
    line = round_line(rec, 0, {}, {}, silent=["gw-2"])
    assert line == (
        "round 8: 1/2 clients, refused: none, accuracy n/a, 900 B/update, 30.00 s, no answer from gw-2"
    )
    many = [f"gw-{k:02d}" for k in range(12)]
    assert round_line(rec, 0, {}, {}, silent=many).endswith(
        "no answer from gw-00, gw-01, gw-02, gw-03, gw-04, gw-05, gw-06, gw-07, gw-08, gw-09 (+2 more)"
    )
    assert round_line(rec, 0, {}, {}).endswith("30.00 s")


def test_durable_round_log_and_page_record_the_silent_devices() -> None:
    """The round log's line and the page's round record name the devices asked that sent nothing."""
    W, b = np.zeros((4, 2), np.float32), np.zeros(2, np.float32)
    strategy = FedAvg()
    coord = Coordinator(
        MqttTransport("127.0.0.1", 1883, "never-started"), Topics("edgefl", "f"), W, b,
        model_sha256="0" * 64, strategy=strategy,
    )  # fmt: skip
    rnd = Round(1, 0, (4, 2), 30.0, 1, online=frozenset({"gw-1", "gw-2", "gw-3"}))
    rnd.devices.append("gw-1")
    rnd.update_ids.add("gw-1:1:0")
    rnd.close()
    coord.state.current = rnd
    rec = RoundRecord(1, 1, float("nan"), 900.0, 30.0, asked=3)
    coord.state.history.append(rec)
    entry = log_entry(coord, rec, strategy, {}, {})
    assert (entry["silent"], entry["silent_devices"]) == (["gw-2", "gw-3"], 2), entry
    coord.note_round_reasons(1, {}, {})
    (page,) = coord.dashboard_rounds()
    assert (page["silent"], page["silent_devices"], page["declined"]) == (["gw-2", "gw-3"], 2, {}), page
    assert log_entry(coord, RoundRecord(2, 0, float("nan"), 0.0, 1.0), strategy, {}, {})["silent"] == []
