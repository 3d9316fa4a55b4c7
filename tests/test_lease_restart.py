"""A coordinator restarted after a crash knows its own previous instance's lease and takes over at once.

Real ``edgefl coordinator`` processes on the session's real mosquitto. The first one reaches the broker
through a relay that, like a gateway that lost power, never closes the broker's side when the process
dies: the broker keeps its connection (and its retained presence) until the keepalive runs out. A
lease naming another coordinator's instance is still refused with exit 6, nothing written.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import socket
import threading
from pathlib import Path

import pytest
from conftest import Broker, start_mosquitto, stop_broker
from test_lease import (
    ACCOUNT,
    first_coordinator,
    presences,
    read_log,
    retained_lease,
    start_coordinator,
    wait_for_log,
)

from edgefl.coordinator.lease import (
    instance_path,
    previous_instance,
    previous_stopped_cleanly,
    record_instance,
)
from edgefl.records import decode_record
from edgefl.wire.presence import decode_presence

pytestmark = [pytest.mark.timeout(180), pytest.mark.broker, pytest.mark.subprocess]


class HalfOpenRelay:
    """A TCP relay to the broker that keeps the broker's side open after the client's side closed.

    What the broker sees of a client whose host lost power: the connection stays up until its
    keepalive runs out (1.5 x ``keepalive_s``), and only then is its last will published.
    """

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._kept: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._server.accept()
            except OSError:
                return
            up = socket.create_connection((self.broker.host, self.broker.port), timeout=5)
            up.settimeout(None)
            self._kept += [down, up]
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket, close_b: bool) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        if close_b:  # the broker closed: so does the client's side; never the other way round
            with contextlib.suppress(OSError):
                b.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._server.close()
        for sock in self._kept:
            with contextlib.suppress(OSError):
                sock.close()


def test_lease_restart_after_kill_takes_over_its_own_previous_lease_at_once(
    tmp_path: Path, mosquitto: Broker, fleet: str
) -> None:
    state = tmp_path / "coord" / "state.rec"
    state.parent.mkdir()
    relay = HalfOpenRelay(mosquitto)
    try:
        via_relay = dataclasses.replace(mosquitto, port=relay.port)
        first = start_coordinator(tmp_path, "a", via_relay, fleet, f"files.state={state}")
        try:
            mine = asyncio.run(presences(mosquitto, fleet, 1, 30))[0]
            wait_for_log(tmp_path, "a", "before round 1", first, 30)
            # the instance that took the lease is recorded beside the state file, for this host and file
            _, payload = decode_record(instance_path(state).read_bytes())
            assert mine.instance in payload.decode()
        finally:
            first.kill()  # kill -9: no clean stop, the lease is not cleared
        first.wait(timeout=30)
        # the broker still holds the dead instance's connection and its retained presence
        held = asyncio.run(retained_lease(mosquitto, fleet))
        assert held is not None and decode_presence(held).instance == mine.instance
        assert previous_instance(state) == mine.instance

        second = start_coordinator(tmp_path, "b", mosquitto, fleet, f"files.state={state}")
        try:
            wait_for_log(tmp_path, "b", "before round 1", second, 60)
            out = read_log(tmp_path, "b")
            info = "INFO edgefl.coordinator.lease: the fleet's lease names instance "
            assert info + mine.instance[:8] in out, out
            assert "this state file's previous coordinator" in out and "taken over" in out, out
            assert "stale" not in out and "WARNING edgefl.coordinator.lease" not in out, out
            # the new instance holds the lease (the dead one's will, fired at the takeover, cleared
            # its presence; the new one published its own again)
            now = asyncio.run(presences(mosquitto, fleet, 1, 30))[0]
            assert now.instance != mine.instance
            assert previous_instance(state) == now.instance
        finally:
            second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0, read_log(tmp_path, "b")
    finally:
        relay.close()


def test_lease_recorded_instance_does_not_excuse_another_live_coordinator(
    tmp_path: Path, mosquitto: Broker, fleet: str
) -> None:
    """A state file whose last coordinator stopped cleanly, started again while another coordinator
    (another state file) holds the fleet's lease: exit 6, and nothing of its own is written."""
    ours, theirs = tmp_path / "ours" / "state.rec", tmp_path / "theirs" / "state.rec"
    ours.parent.mkdir()
    theirs.parent.mkdir()
    earlier = start_coordinator(tmp_path, "earlier", mosquitto, fleet, f"files.state={ours}")
    try:
        wait_for_log(tmp_path, "earlier", "before round 1", earlier, 30)
    finally:
        earlier.send_signal(signal.SIGTERM)
    assert earlier.wait(timeout=30) == 0, read_log(tmp_path, "earlier")
    recorded = previous_instance(ours)
    assert recorded is not None

    def files() -> dict[str, bytes]:  # the lock file aside (each process writes its pid there)
        return {p.name: p.read_bytes() for p in ours.parent.iterdir() if p.suffix != ".lock"}

    files_before = files()
    assert "state.rec.instance" in files_before

    holder = start_coordinator(tmp_path, "holder", mosquitto, fleet, f"files.state={theirs}")
    try:
        live = asyncio.run(presences(mosquitto, fleet, 1, 30))[0]
        assert live.instance != recorded
        again = start_coordinator(tmp_path, "again", mosquitto, fleet, f"files.state={ours}")
        assert again.wait(timeout=60) == 6, read_log(tmp_path, "again")
        out = read_log(tmp_path, "again")
        assert "another coordinator runs this fleet" in out and live.instance[:8] in out, out
        assert files() == files_before
        assert holder.poll() is None, read_log(tmp_path, "holder")
    finally:
        holder.send_signal(signal.SIGTERM)
    assert holder.wait(timeout=30) == 0, read_log(tmp_path, "holder")


def test_lease_instance_record_counts_only_for_its_own_host_and_state_file(tmp_path: Path) -> None:
    state = tmp_path / "state.rec"
    assert previous_instance(state) is None
    record_instance(state, "0123456789abcdef")
    assert previous_instance(state) == "0123456789abcdef"
    copied = tmp_path / "copy" / "state.rec"  # the folder copied elsewhere: not this file's instance
    copied.parent.mkdir()
    instance_path(copied).write_bytes(instance_path(state).read_bytes())
    assert previous_instance(copied) is None
    instance_path(state).write_bytes(instance_path(state).read_bytes()[:-3])  # torn
    assert previous_instance(state) is None


def test_lease_restart_after_kill_with_clients_named_after_their_account_takes_over_at_once(
    tmp_path: Path, fleet: str
) -> None:
    """docs/operations.md's broker (``use_username_as_clientid true``): the restarted coordinator's probe
    is given its dead predecessor's session; the holder topic names that predecessor, so it takes over
    at once. A coordinator whose state file names another instance still waits for the live holder,
    which comes back, and exits 6 having written nothing."""
    broker = start_mosquitto(tmp_path, "use_username_as_clientid true")
    try:
        first, mine, state = first_coordinator(tmp_path, broker, fleet)
        first.kill()
        first.wait(timeout=30)
        second = start_coordinator(tmp_path, "b", broker, fleet, ACCOUNT, f"files.state={state}")
        try:
            wait_for_log(tmp_path, "b", "before round 1", second, 60)
            out = read_log(tmp_path, "b")
            info = "INFO edgefl.coordinator.lease: the broker gave the lease probe the session of instance "
            assert info + mine.instance[:8] in out, out
            assert "this state file's previous coordinator" in out, out
            assert "WARNING edgefl.coordinator.lease" not in out, out
            assert "bad_topic" not in out, out  # the holder the probe read and left in the session
            now = asyncio.run(presences(broker, fleet, 1, 30, username="watch-2"))[0]
            assert now.instance not in (mine.instance,) and previous_instance(state) == now.instance

            # another state file whose record names some other instance: the live holder is waited for
            other = tmp_path / "other" / "state.rec"
            other.parent.mkdir()
            record_instance(other, "feedfacefeedface")
            before = instance_path(other).read_bytes()
            third = start_coordinator(tmp_path, "c", broker, fleet, ACCOUNT, f"files.state={other}")
            assert third.wait(timeout=60) == 6, read_log(tmp_path, "c")
            out = read_log(tmp_path, "c")
            assert "another coordinator runs this fleet" in out and now.instance[:8] in out, out
            assert "previous coordinator" not in out, out
            assert instance_path(other).read_bytes() == before and not other.exists()
            assert second.poll() is None, read_log(tmp_path, "b")
        finally:
            second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0, read_log(tmp_path, "b")
    finally:
        stop_broker(broker)


def test_lease_restart_with_an_acl_without_the_holder_topic_still_starts(tmp_path: Path, fleet: str) -> None:
    """An ACL written before the holder topic (the lease topic only): the holder is never published nor
    read (mosquitto grants the subscription and delivers nothing), so the probe waits as for any
    session, and the coordinator starts (never exit 4)."""
    acl = tmp_path / "edgefl.acl"
    acl.write_text(
        "user coordinator\n"
        f"topic readwrite edgefl/{fleet}/coordinator\ntopic readwrite edgefl/{fleet}/global/#\n"
        f"topic readwrite edgefl/{fleet}/round\ntopic read edgefl/{fleet}/update/+\n"
        f"topic read edgefl/{fleet}/status/+\n"
    )
    broker = start_mosquitto(tmp_path, f"user root\nuse_username_as_clientid true\nacl_file {acl}")
    state = tmp_path / "coord" / "state.rec"
    state.parent.mkdir()
    try:
        first = start_coordinator(tmp_path, "a", broker, fleet, ACCOUNT, f"files.state={state}")
        try:
            wait_for_log(tmp_path, "a", "before round 1", first, 30)
        finally:
            first.kill()
        first.wait(timeout=30)
        second = start_coordinator(tmp_path, "b", broker, fleet, ACCOUNT, f"files.state={state}")
        try:
            wait_for_log(tmp_path, "b", "before round 1", second, 60)
            out = read_log(tmp_path, "b")
            assert "an existing session" in out and "cannot start" not in out, out
            assert "previous coordinator" not in out, out
        finally:
            second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0, read_log(tmp_path, "b")
    finally:
        stop_broker(broker)


def test_lease_restart_after_clean_stop_says_so_not_taken_over(tmp_path: Path, fleet: str) -> None:
    """docs/operations.md's broker (``use_username_as_clientid true``): a coordinator stopped by SIGTERM
    (exit 0) records its clean stop beside the state file; the restart's probe, given its session,
    says the previous coordinator stopped cleanly and resumes (no crash-recovery "taken over" line).
    The running instance's record no longer says so: a kill of it is a crash again."""
    broker = start_mosquitto(tmp_path, "use_username_as_clientid true")
    try:
        first, mine, state = first_coordinator(tmp_path, broker, fleet)
        try:
            assert not previous_stopped_cleanly(state)  # running: a kill now would be a crash
        finally:
            first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0, read_log(tmp_path, "a")
        assert previous_instance(state) == mine.instance and previous_stopped_cleanly(state)
        second = start_coordinator(tmp_path, "b", broker, fleet, ACCOUNT, f"files.state={state}")
        try:
            wait_for_log(tmp_path, "b", "before round 1", second, 60)
            out = read_log(tmp_path, "b")
            info = "INFO edgefl.coordinator.lease: the broker gave the lease probe the session of instance "
            assert info + mine.instance[:8] in out, out
            said = next(line for line in out.splitlines() if info in line)
            clean = "this state file's previous coordinator (it stopped cleanly): resuming"
            assert said.endswith(clean), said
            assert "taken over" not in out and "gone" not in out, out
            assert "WARNING edgefl.coordinator.lease" not in out, out
            now = asyncio.run(presences(broker, fleet, 1, 30, username="watch-2"))[0]
            assert previous_instance(state) == now.instance != mine.instance
            assert not previous_stopped_cleanly(state)
        finally:
            second.kill()  # no clean stop: the record still says the second one started
        second.wait(timeout=30)
        assert previous_instance(state) == now.instance and not previous_stopped_cleanly(state)
    finally:
        stop_broker(broker)
