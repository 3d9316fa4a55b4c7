"""One coordinator per fleet: the state file's lock, the broker lease (exit 6), a busy page port (exit 4).

Real ``edgefl coordinator`` processes against the session's real mosquitto; the lease is read by a
real MQTT client, as a second coordinator reads it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, Broker, free_port, start_mosquitto, stop_broker

from edgefl.coordinator.lease import LEASE_HEARTBEAT_S, PROBE_MARGIN_S
from edgefl.errors import DecodeError
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.presence import Presence, decode_presence, encode_presence
from edgefl.wire.status import read_new_samples

pytestmark = pytest.mark.timeout(180)

PROFILE = ROOT / "firmware_configs" / "coordinator.toml"


def start_coordinator(tmp: Path, name: str, broker: Broker, fleet: str, *sets: str) -> subprocess.Popen[str]:
    """``edgefl coordinator`` on the shipped profile (a service), its output in ``tmp/<name>.log``."""
    cmd = [sys.executable, "-m", "edgefl.cli", "coordinator", str(PROFILE), "--broker", broker.url]
    cmd += ["--fleet", fleet]
    for item in sets:
        cmd += ["--set", item]
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=tmp)


def read_log(tmp: Path, name: str) -> str:
    return (tmp / f"{name}.log").read_text()


async def presences(
    broker: Broker, fleet: str, n: int, timeout_s: float, username: str | None = None
) -> list[Presence]:
    """The first ``n`` presences seen on the fleet's lease topic (the retained one first)."""
    t = MqttTransport(broker.host, broker.port, f"watch-{fleet}-{time.monotonic_ns()}", username=username)
    await t.start(wait_s=10)
    try:
        topic = Topics("edgefl", fleet).coordinator
        await t.subscribe(topic, 1)
        seen: list[Presence] = []
        end = time.monotonic() + timeout_s
        while len(seen) < n:
            msg = await asyncio.wait_for(t.queue.get(), max(0.01, end - time.monotonic()))
            if msg.topic == topic and msg.payload:
                seen.append(decode_presence(msg.payload))
        return seen
    finally:
        await t.stop()


async def retained_lease(broker: Broker, fleet: str) -> bytes | None:
    """The retained payload on the lease topic (None when there is none), read within 2 s."""
    t = MqttTransport(broker.host, broker.port, f"peek-{fleet}-{time.monotonic_ns()}")
    await t.start(wait_s=10)
    try:
        await t.subscribe(Topics("edgefl", fleet).coordinator, 1)
        try:
            msg = await asyncio.wait_for(t.queue.get(), 2.0)
        except TimeoutError:
            return None
        return msg.payload
    finally:
        await t.stop()


def wait_for_log(tmp: Path, name: str, text: str, proc: subprocess.Popen[str], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while text not in read_log(tmp, name):
        assert proc.poll() is None, read_log(tmp, name)
        assert time.monotonic() < end, f"no {text!r} in {name}.log:\n{read_log(tmp, name)}"
        time.sleep(0.05)


ACCOUNT = "broker.username=coordinator"
"""The coordinator's account on a broker that names clients after their account (docs/operations.md)."""


def first_coordinator(tmp: Path, broker: Broker, fleet: str) -> tuple[subprocess.Popen[str], Presence, Path]:
    """Coordinator ``a`` on :data:`ACCOUNT` with the state file ``tmp/coord/state.rec``, waiting before
    round 1: its process, the presence it published and its state file (killed if it never gets there)."""
    state = tmp / "coord" / "state.rec"
    state.parent.mkdir()
    first = start_coordinator(tmp, "a", broker, fleet, ACCOUNT, f"files.state={state}")
    try:
        mine = asyncio.run(presences(broker, fleet, 1, 30, username="watch-1"))[0]
        wait_for_log(tmp, "a", "before round 1", first, 30)
    except BaseException:
        first.kill()
        raise
    return first, mine, state


def test_lease_presence_round_trip_and_refusals() -> None:
    p = Presence("0123456789abcdef", "gw-1", 42, 1_765_000_000.5, 7, 5.0)
    assert decode_presence(encode_presence(p)) == p
    bad = encode_presence(Presence("0123456789abcdef", "gw-1", 42, 1.0, 7, 5.0)).replace(b"gw-1", b"gw 1")
    with pytest.raises(DecodeError) as err:
        decode_presence(bad)
    assert err.value.reason == "bad_value"
    assert read_new_samples({"new_samples": 12}) == 12
    assert read_new_samples({}) is None
    for value, reason in ((-1, "bad_value"), ("12", "wrong_type"), (True, "wrong_type")):
        with pytest.raises(DecodeError) as err:
            read_new_samples({"new_samples": value})
        assert err.value.reason == reason


def test_lease_second_coordinator_exits_6_before_it_writes_and_the_first_is_unharmed(
    tmp_path: Path, mosquitto: Broker, fleet: str
) -> None:
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    first = start_coordinator(
        tmp_path,
        "a",
        mosquitto,
        fleet,
        f"files.state={a_dir / 'state.rec'}",
        f"files.log={a_dir / 'rounds.jsonl'}",
    )
    try:
        seen = asyncio.run(presences(mosquitto, fleet, 2, 30))  # the holder's presence, then its heartbeat
        assert seen[0].instance == seen[1].instance and seen[1].seq > seen[0].seq, seen
        # another state file (the lock cannot see it): the broker lease does
        second = start_coordinator(
            tmp_path,
            "b",
            mosquitto,
            fleet,
            f"files.state={b_dir / 'state.rec'}",
            f"files.log={b_dir / 'rounds.jsonl'}",
            "dashboard.enabled=true",
            f"dashboard.port={free_port()}",
        )
        assert second.wait(timeout=2 * LEASE_HEARTBEAT_S + PROBE_MARGIN_S + 30) == 6, read_log(tmp_path, "b")
        out = read_log(tmp_path, "b")
        assert "another coordinator runs this fleet" in out and seen[0].instance[:8] in out, out
        assert "Traceback" not in out and "fleet page" not in out, out
        assert sorted(p.name for p in b_dir.iterdir()) == ["state.rec.lock"], list(b_dir.iterdir())
        # the first one kept its connection and its lease
        assert first.poll() is None, read_log(tmp_path, "a")
        again = asyncio.run(presences(mosquitto, fleet, 1, 10))[0]
        assert again.instance == seen[0].instance
        assert "broker lost" not in read_log(tmp_path, "a"), read_log(tmp_path, "a")
        # same state file: the lock refuses it at once, naming the holder's pid
        third = start_coordinator(tmp_path, "c", mosquitto, fleet, f"files.state={a_dir / 'state.rec'}")
        assert third.wait(timeout=60) == 6, read_log(tmp_path, "c")
        out = read_log(tmp_path, "c")
        held = f"state file {a_dir / 'state.rec'} is held by pid {first.pid}"
        assert f"another coordinator runs this fleet: {held}" in out, out
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0, read_log(tmp_path, "a")
    # a clean stop clears the lease: the next coordinator starts at once
    assert asyncio.run(retained_lease(mosquitto, fleet)) is None


def test_lease_stale_presence_is_taken_over(tmp_path: Path, mosquitto: Broker, fleet: str) -> None:
    """A retained presence nobody refreshes (a broker restored it after its holder died) is stale."""
    stale = Presence("feedfacefeedface", "gone", 1, 1.0, 3, 1.0)

    async def plant() -> None:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"plant-{fleet}")
        await t.start(wait_s=10)
        await t.publish(Topics("edgefl", fleet).coordinator, encode_presence(stale), qos=1, retain=True)
        await t.stop()

    asyncio.run(plant())
    proc = start_coordinator(tmp_path, "a", mosquitto, fleet)
    try:
        seen = asyncio.run(presences(mosquitto, fleet, 2, 40))
        assert seen[0] == stale and seen[1].instance != stale.instance, seen
        out = read_log(tmp_path, "a")
        assert "stale, taken over" in out and "instance feedface" in out, out
    finally:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, read_log(tmp_path, "a")
    # no device, so no round was open: the stop line does not claim one was saved
    assert "SIGTERM: stopping at round 0 (no round open)" in read_log(tmp_path, "a"), read_log(tmp_path, "a")


def test_lease_fleet_page_port_in_use_is_a_clean_exit_4(
    tmp_path: Path, mosquitto: Broker, fleet: str
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = start_coordinator(
            tmp_path, "a", mosquitto, fleet, "dashboard.enabled=true", f"dashboard.port={port}"
        )
        assert proc.wait(timeout=60) == 4, read_log(tmp_path, "a")
    out = read_log(tmp_path, "a")
    assert f"cannot start: dashboard.port = {port}: cannot serve the fleet page on 127.0.0.1" in out, out
    assert "Traceback" not in out, out
    assert asyncio.run(retained_lease(mosquitto, fleet)) is None  # it never took the lease


@pytest.mark.subprocess
@pytest.mark.broker
def test_lease_probe_renamed_by_the_broker_to_the_running_coordinator_is_refused(
    tmp_path: Path, fleet: str
) -> None:
    """``use_username_as_clientid true`` (docs/operations.md's broker) gives the second coordinator's probe
    the running one's client id: the probe sees that session, waits for the holder's presence (it comes
    back within a heartbeat), and exits 6; the first one reconnects and keeps running."""
    broker = start_mosquitto(tmp_path, "use_username_as_clientid true")
    try:
        account = "broker.username=coordinator"
        first = start_coordinator(tmp_path, "a", broker, fleet, account, f"files.state={tmp_path / 'a.rec'}")
        try:
            seen = asyncio.run(presences(broker, fleet, 2, 30, username="watch-1"))
            second = start_coordinator(
                tmp_path, "b", broker, fleet, account, f"files.state={tmp_path / 'b.rec'}"
            )
            assert second.wait(timeout=60) == 6, read_log(tmp_path, "b")
            out = read_log(tmp_path, "b")
            assert "another coordinator runs this fleet" in out and seen[0].instance[:8] in out, out
            assert "an existing session" in out, out
            assert not (tmp_path / "b.rec").exists()
            assert first.poll() is None, read_log(tmp_path, "a")
            again = asyncio.run(presences(broker, fleet, 2, 30, username="watch-2"))
            assert {p.instance for p in again} == {seen[0].instance}, again
        finally:
            first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0, read_log(tmp_path, "a")
    finally:
        stop_broker(broker)


def test_lease_running_coordinator_watches_its_lease_and_stops_for_an_earlier_holder(
    tmp_path: Path, mosquitto: Broker, fleet: str
) -> None:
    """Two coordinators that got past the probe together (a cleared lease, a race): the running one
    watches the lease topic, and the one that started later stops with exit 6."""
    proc = start_coordinator(tmp_path, "a", mosquitto, fleet)
    try:
        mine = asyncio.run(presences(mosquitto, fleet, 1, 30))[0]
        wait_for_log(tmp_path, "a", "before round 1", proc, 30)  # running: its lease is watched from here
        earlier = Presence("0123456789abcdef", "other-host", 7, mine.started - 100.0, 1, LEASE_HEARTBEAT_S)

        async def announce() -> None:
            t = MqttTransport(mosquitto.host, mosquitto.port, f"other-{fleet}")
            await t.start(wait_s=10)
            await t.publish(Topics("edgefl", fleet).coordinator, encode_presence(earlier), qos=1, retain=True)
            await t.stop()

        asyncio.run(announce())
        assert proc.wait(timeout=30) == 6, read_log(tmp_path, "a")
        out = read_log(tmp_path, "a")
        assert "another coordinator took this fleet first" in out and "other-host" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
