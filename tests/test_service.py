"""The coordinator as a service: pacing (devices, new samples, interval), the fleet state, SIGTERM, the
round log's fields, and no acknowledged update lost to a ``kill -9``.

The pacing and round-closing rules are checked on values one can follow by hand; the service and its
durability with real ``edgefl coordinator`` and ``edgefl run`` processes on the session's mosquitto.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import INT8_MODEL, ROOT, Broker, free_port, start_replay_agent

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.profile import load_coordinator_profile
from edgefl.coordinator.rounds import FleetPhase, Pacing, Round
from edgefl.coordinator.runner import pacing_for
from edgefl.coordinator.service import Coordinator
from edgefl.datasets import load_digits
from edgefl.launcher import stop_agents
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.rounds import Decline, encode_decline
from edgefl.wire.status import DeviceStatus, encode_status

pytestmark = pytest.mark.timeout(300)

PROFILE = ROOT / "firmware_configs" / "coordinator.toml"


# -- the rules, by hand ---------------------------------------------------------------------------
def test_pacing_waits_for_devices_then_samples_then_the_interval() -> None:
    p = Pacing(interval_s=60.0, min_new_samples=200, min_devices=4)
    st = p.check(7, {"a": 5, "b": 4, "c": 3}, None)
    assert (st.state, st.text) == (FleetPhase.WAITING_DEVICES, "waiting for devices: 3 of 4 ready")
    st = p.check(7, {"a": 5, "b": 4, "c": 3, "d": 0}, 10.0)
    assert (st.state, st.text) == (FleetPhase.WAITING_SAMPLES, "waiting: 12 of 200 new samples")
    assert st.as_dict() == {
        "state": "waiting_samples",
        "text": "waiting: 12 of 200 new samples",
        "round": 7,
        "ready": 4,
        "needed": 4,
        "new_samples": 12,
        "min_new_samples": 200,
        "asked": None,
        "counted": None,
        "close_at": None,
        "next_round_in_s": None,
    }
    st = p.check(7, {"a": 50, "b": 50, "c": 50, "d": 50}, 17.5)
    assert (st.state, st.text, st.next_round_in_s) == (FleetPhase.PAUSED, "paused: next round in 43 s", 42.5)
    st = p.check(7, {"a": 50, "b": 50, "c": 50, "d": 50}, 60.0)
    assert (st.state, st.text, st.next_round_in_s) == (FleetPhase.PAUSED, "opening round 8", 0.0)
    # a device that does not report new_samples (an older agent) does not hold the fleet back
    st = p.check(7, {"a": 1, "b": None, "c": 0, "d": 0}, None)
    assert (st.state, st.new_samples, st.next_round_in_s) == (FleetPhase.PAUSED, 1, 0.0)


def test_pacing_a_round_waits_for_the_devices_it_asked() -> None:
    def rnd(**kw: Any) -> Round:
        return Round(1, 0, (4, 2), 30.0, 2, **kw)

    online = frozenset({"a", "b", "c"})
    r = rnd(online=online, quorum=1.0)
    assert (r.asked, r.close_at) == (3, 3)  # "N of M" is counted of asked: 3 of 3, not "3/2"
    r.devices = ["a", "b"]
    r.update_ids = {"a:1:0", "b:1:0"}
    assert not r.complete()
    r.declined = ["c"]
    assert r.complete()  # everybody asked answered
    assert (
        rnd(online=online, quorum=0.5).close_at,
        rnd(online=online, quorum=0.5, min_updates=3).close_at,
    ) == (2, 3)
    assert rnd(selected=frozenset({"a", "b", "c", "d", "e"}), quorum=0.6).close_at == 3
    assert rnd(quorum=1.0).close_at == 2  # nobody ready at the opening: min_clients
    assert rnd(online=online).close_at == 2  # no quorum (library use): min_clients, as before


def test_pacing_fleet_state_of_a_coordinator_without_its_broker_and_with_a_round_open() -> None:
    W, b = np.zeros((4, 2), np.float32), np.zeros(2, np.float32)
    transport = MqttTransport("127.0.0.1", 1883, "never-started")
    coord = Coordinator(transport, Topics("edgefl", "f"), W, b, model_sha256="0" * 64, strategy=FedAvg())
    assert coord.fleet_state().as_dict()["state"] == "broker_unreachable"
    assert coord.fleet_state().text == "broker unreachable: 127.0.0.1:1883"
    transport.connected.set()  # as the transport says once connected
    coord.pacing = Pacing(0.0, 0, 1)
    assert coord.fleet_state().text == "waiting for devices: 0 of 1 ready"
    coord.state.current = Round(3, 0, (4, 2), 30.0, 1, online=frozenset({"a", "b", "c"}), quorum=1.0)
    fs = coord.fleet_state().as_dict()
    assert (fs["state"], fs["text"], fs["round"], fs["asked"], fs["counted"], fs["close_at"]) == (
        "collecting",
        "collecting 0 of 3",
        3,
        3,
        0,
        3,
    )
    assert coord.dashboard_status()["fleet_state"] == fs


def test_pacing_of_a_job_a_root_and_a_flat_service() -> None:
    def pacing(**sets: str) -> Pacing:
        return pacing_for(load_coordinator_profile(PROFILE, {"model.path": str(INT8_MODEL), **sets}))

    assert pacing() == Pacing(60.0, 32, 2)  # the shipped service
    assert pacing(**{"rounds.count": "3"}) == Pacing(0.0, 0, 1)  # a job: back to back
    root = pacing(
        **{"hierarchy.role": "root", "hierarchy.allow_unsigned_sites": "true", "hierarchy.site_devices": "9"}
    )
    assert root == Pacing(60.0, 0, 0)  # its devices report to their sites: time only
    assert root.check(4, {}, 60.0).text == "opening round 5"


# -- real processes -------------------------------------------------------------------------------
def start_coordinator(tmp: Path, name: str, broker: Broker, fleet: str, *sets: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "edgefl.cli", "--log-level", "INFO", "coordinator", str(PROFILE)]
    cmd += ["--broker", broker.url, "--fleet", fleet, "--strategy", "fedavg", "--model", str(INT8_MODEL)]
    cmd += ["--set", "robustness.tolerate=0"]  # two or three devices: no hostile one tolerated
    for item in sets:
        cmd += ["--set", item]
    log = open(tmp / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=tmp)


def fleet_state(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5) as r:
        doc: dict[str, Any] = json.loads(r.read())
    fs: dict[str, Any] = doc["status"]["fleet_state"]
    return fs


def wait_for(cond: Any, timeout_s: float, what: str, procs: list[subprocess.Popen[Any]], logs: Path) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        try:
            got = cond()
        except (OSError, ValueError, KeyError):
            got = None
        if got:
            return got
        for p in procs:
            assert p.poll() is None, f"process exited with {p.returncode}: " + "\n".join(
                f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(logs.glob("*.log"))
            )
        assert time.monotonic() < end, f"timed out waiting for {what}: " + "\n".join(
            f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(logs.glob("*.log"))
        )
        time.sleep(0.1)


def log_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_pacing_service_waits_for_new_samples_and_stops_cleanly(
    tmp_path: Path, mosquitto: Broker, fleet: str
) -> None:
    """Two devices with ~86 stored samples each: round 1 opens (172 >= 100 new samples), then the fleet
    waits, visibly, with nothing new; SIGTERM ends it with exit 0 and one timestamped round logged."""
    x, y = load_digits()
    agents = [
        start_replay_agent(
            mosquitto, fleet, tmp_path, f"dev-{k}", x[k * 96 : (k + 1) * 96], y[k * 96 : (k + 1) * 96]
        )
        for k in (1, 2)
    ]
    port = free_port()
    log = tmp_path / "rounds.jsonl"
    coord = start_coordinator(
        tmp_path,
        "coordinator",
        mosquitto,
        fleet,
        "rounds.interval_s=0.5",
        "rounds.min_new_samples=100",
        "rounds.deadline_s=60",
        f"files.state={tmp_path / 'state.rec'}",
        f"files.log={log}",
        "dashboard.enabled=true",
        f"dashboard.port={port}",
    )
    try:
        wait_for(lambda: log_lines(log), 120, "round 1 in the log", [coord], tmp_path)
        st = wait_for(
            lambda: (s := fleet_state(port))["state"] == "waiting_samples" and s,
            30,
            "waiting",
            [coord],
            tmp_path,
        )
        assert st["text"] == "waiting: 0 of 100 new samples" and st["round"] == 1, st
        assert (st["ready"], st["needed"], st["min_new_samples"]) == (2, 2, 100), st
        time.sleep(1.5)  # three intervals: nothing new, no round
        assert len(log_lines(log)) == 1 and fleet_state(port)["state"] == "waiting_samples"
    finally:
        coord.send_signal(signal.SIGTERM)
        try:
            rc = coord.wait(timeout=30)
        finally:
            stop_agents(agents)
    out = (tmp_path / "coordinator.log").read_text()
    assert rc == 0, out
    assert "before round 2: waiting: 0 of 100 new samples" in out, out
    assert "Traceback" not in out, out
    (entry,) = log_lines(log)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", entry["time"]), entry
    assert (entry["round"], entry["asked"], entry["counted"], entry["refused"], entry["declined"]) == (
        1,
        2,
        2,
        {},
        {},
    ), entry
    assert entry["lr"] == 0.05 and entry["new_samples"] >= 100, entry  # constant learning rate


@pytest.mark.parametrize(("stop", "exit_code"), [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 0)])
def test_durable_kill9_after_devices_sent_counts_every_update_once(
    tmp_path: Path, mosquitto: Broker, fleet: str, stop: signal.Signals, exit_code: int
) -> None:
    """A round asks three real devices and a fourth that does not train, so it stays open; the
    coordinator is killed -9 (or stopped: SIGTERM abandons the open round cleanly, saved) right after
    the three updates arrived. Restarted, it resumes the round, and once the fourth declines it closes
    it with each of the three updates counted exactly once."""
    x, y = load_digits()
    devices = ("dev-1", "dev-2", "dev-3")
    agents = [
        start_replay_agent(mosquitto, fleet, tmp_path, d, x[k * 96 : (k + 1) * 96], y[k * 96 : (k + 1) * 96])
        for k, d in enumerate(devices)
    ]

    async def ghost() -> None:  # a ready device that never trains: the round waits for it
        t = MqttTransport(mosquitto.host, mosquitto.port, f"ghost-{fleet}")
        await t.start(wait_s=10)
        status = DeviceStatus("dev-ghost", "idle", {"ready": True, "new_samples": 0})
        await t.publish(
            Topics("edgefl", fleet).status("dev-ghost"), encode_status(status), qos=1, retain=True
        )
        await t.stop()

    async def ghost_declines() -> None:  # the fourth answers: the round closes before its deadline
        t = MqttTransport(mosquitto.host, mosquitto.port, f"ghost-{fleet}")
        await t.start(wait_s=10)
        no = Decline(1, 0, "dev-ghost", "too_few_examples", "a ghost", "dev-ghost:1:0:declined")
        await t.publish(Topics("edgefl", fleet).update("dev-ghost"), encode_decline(no), qos=1)
        await t.stop()

    asyncio.run(ghost())
    state, log = tmp_path / "state.rec", tmp_path / "rounds.jsonl"
    sets = (
        "rounds.interval_s=0",
        "rounds.min_new_samples=0",
        "rounds.min_clients=4",
        "rounds.deadline_s=60",  # long: the round closes on the fourth device's decline
        f"files.state={state}",
        f"files.log={log}",
    )
    coordinator_log = tmp_path / "coordinator.log"
    try:
        coord = start_coordinator(tmp_path, "coordinator", mosquitto, fleet, *sets)
        wait_for(
            lambda: all(f"round 1: update from {d}" in coordinator_log.read_text() for d in devices),
            150,
            "three updates",
            [coord],
            tmp_path,
        )
        coord.send_signal(stop)
        assert coord.wait(timeout=30) == exit_code, coordinator_log.read_text()[-3000:]
        assert log_lines(log) == []  # the round had not closed
        coord = start_coordinator(tmp_path, "coordinator", mosquitto, fleet, *sets)
        resumed = "round 1 resumed from the state file"
        wait_for(lambda: resumed in coordinator_log.read_text(), 90, resumed, [coord], tmp_path)
        asyncio.run(ghost_declines())
        wait_for(lambda: log_lines(log), 90, "round 1 closed after the restart", [coord], tmp_path)
        coord.send_signal(signal.SIGTERM)
        assert coord.wait(timeout=30) == 0, coordinator_log.read_text()[-3000:]
    finally:
        if coord.poll() is None:
            coord.kill()
        stop_agents(agents)
    out = coordinator_log.read_text()
    assert "round 1 resumed from the state file" in out, out
    first = log_lines(log)[0]
    assert (first["round"], first["asked"]) == (1, 4), first
    ids = [u for line in log_lines(log) for u in line["update_ids"]]
    assert Counter(u.split(":")[0] for u in ids if u.endswith(":1:0")) == Counter(devices), ids
    assert sorted(first["update_ids"]) == [f"{d}:1:0" for d in devices], first
    assert first["counted"] == 3 and len(ids) == len(set(ids)), ids
    assert first["declined"] == {"too_few_examples": 1}, first
