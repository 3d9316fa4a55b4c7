"""The MQTT bridge against a real mosquitto: round trips, PUBACK, retained messages, last will,
broker restarts (lost/back logged once each), backoff with full jitter."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    DEV_PROFILE,
    INT8_MODEL,
    Broker,
    free_port,
    read_mqtt_packet,
    restart_mosquitto,
    start_mosquitto,
    stop_broker,
    wait_until,
)
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

import edgefl.mqtt_link as link_mod
import edgefl.mqtt_socket as socket_mod
import edgefl.transport as transport_mod
from edgefl.errors import TransportError
from edgefl.launcher import launch_agent, stop_agents
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.status import decode_status

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def two_clients(
    broker: Broker, fleet: str, **b_options: Any
) -> AsyncIterator[tuple[MqttTransport, MqttTransport]]:
    """Clients ``a-<fleet>`` and ``b-<fleet>`` (``b_options`` for b's transport) started, then stopped."""
    a = MqttTransport(broker.host, broker.port, f"a-{fleet}")
    b = MqttTransport(broker.host, broker.port, f"b-{fleet}", **b_options)
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


def test_transport_roundtrip_puback_and_retained(mosquitto: Broker, fleet: str) -> None:
    async def main() -> None:
        async with two_clients(mosquitto, fleet) as (a, b):
            await b.subscribe(f"{fleet}/x", 1)  # returns after the SUBACK: no sleep needed
            await a.publish(f"{fleet}/x", b"hello", qos=1)  # returns only after the PUBACK
            msg = await asyncio.wait_for(b.queue.get(), 5)
            assert (msg.topic, msg.payload, msg.retain) == (f"{fleet}/x", b"hello", False)
            await a.publish(f"{fleet}/retained", b"kept", qos=1, retain=True)
            c = MqttTransport(mosquitto.host, mosquitto.port, f"c-{fleet}")
            await c.start()
            await c.subscribe(f"{fleet}/retained", 1)
            late = await asyncio.wait_for(c.queue.get(), 5)
            assert (late.payload, late.retain) == (b"kept", True)
            await c.stop()

    asyncio.run(main())


def test_no_network_thread_the_event_loop_reads_and_writes_the_socket(
    mosquitto: Broker, fleet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """paho is driven by the event loop: no network thread runs, every packet is read and written on
    the loop's own thread, and the keep-alive still goes out (PINGREQ from ``loop_misc``)."""
    threads: set[int] = set()
    reads, writes = MqttTransport._net_read, MqttTransport._flush

    def read(self: MqttTransport, conn: Any) -> None:
        threads.add(threading.get_ident())
        reads(self, conn)

    def write(self: MqttTransport, conn: Any) -> None:
        threads.add(threading.get_ident())
        writes(self, conn)

    monkeypatch.setattr(MqttTransport, "_net_read", read)
    monkeypatch.setattr(MqttTransport, "_flush", write)
    monkeypatch.setattr(link_mod, "MISC_INTERVAL_S", 0.05)

    async def main() -> None:
        a = MqttTransport(mosquitto.host, mosquitto.port, f"a-{fleet}", keepalive_s=1)
        await a.start()
        try:
            assert not [t.name for t in threading.enumerate() if t.name.startswith("paho")]
            await a.subscribe(f"{fleet}/x", 1)
            await a.publish(f"{fleet}/x", b"hello", qos=1)
            assert (await asyncio.wait_for(a.queue.get(), 5)).payload == b"hello"
            client = a._client
            assert client is not None
            logged: list[str] = []
            client.on_log = lambda c, u, level, line: logged.append(line)  # paho's own log lines
            # idle: a 1 s keep-alive wants a PINGREQ every second, each answered
            await wait_until(
                lambda: sum(line.startswith("Received PINGRESP") for line in logged) >= 2, 10, "2 PINGRESP"
            )
            assert sum(line.startswith("Sending PINGREQ") for line in logged) >= 2, logged
            assert a.connected.is_set() and a.connects_total == 1
            await a.publish(f"{fleet}/x", b"after", qos=1)
            assert (await asyncio.wait_for(a.queue.get(), 5)).payload == b"after"
        finally:
            await a.stop()
        assert threads == {threading.get_ident()}

    asyncio.run(main())


@contextlib.contextmanager
def burst_broker(publishes: bytes) -> Iterator[int]:
    """A one-client MQTT 3.1.1 server on 127.0.0.1: CONNACK, then SUBACK and ``publishes`` in one write.

    Yields its port. It never reads again (PUBACKs stay in its socket) and takes no notice of any
    flow control, as a broker emptying an offline session's queue.
    """
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            assert read_mqtt_packet(conn)[0] >> 4 == 1  # CONNECT
            conn.sendall(b"\x20\x02\x00\x00")  # CONNACK, accepted (MQTT 3.1.1 §3.2)
            _, body = read_mqtt_packet(conn)  # SUBSCRIBE
            conn.sendall(b"\x90\x03" + body[:2] + b"\x01" + publishes)  # SUBACK and the burst at once
            done.wait(20)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        server.join(5)
        listener.close()


class ScriptedBroker:
    """An MQTT 3.1.1 server on 127.0.0.1 for one client at a time, scripted for UNSUBSCRIBE.

    It accepts every CONNECT, grants every SUBSCRIBE and answers PINGREQ; the n-th UNSUBSCRIBE
    (counted over all connections) gets ``unsubscribe[n]`` ("ack": UNSUBACK, "ignore": no answer,
    "close": the connection closed; past the list's end, "ack"). ``connections`` holds, per
    connection, the (kind, topic) of every SUBSCRIBE and UNSUBSCRIBE it read; :meth:`drop` closes
    the current connection. Source: MQTT 3.1.1 §3.8-3.11.
    """

    def __init__(self, unsubscribe: list[str]) -> None:
        self.unsubscribe = unsubscribe
        self.unsubscribes = 0
        self.connections: list[list[tuple[str, str]]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._conn: socket.socket | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if self._stop:  # close()'s own connection, made to end the accept
                conn.close()
                return
            seen: list[tuple[str, str]] = []
            self._conn = conn
            self.connections.append(seen)
            with contextlib.suppress(OSError, IndexError), conn:  # IndexError: read at EOF
                while True:
                    first, body = read_mqtt_packet(conn)
                    kind = first >> 4
                    if kind == 1:
                        conn.sendall(b"\x20\x02\x00\x00")  # CONNACK, accepted
                    elif kind in (8, 10):  # SUBSCRIBE, UNSUBSCRIBE: packet id, one topic filter
                        topic = body[4 : 4 + int.from_bytes(body[2:4], "big")].decode()
                        seen.append(("SUBSCRIBE" if kind == 8 else "UNSUBSCRIBE", topic))
                        if kind == 8:
                            conn.sendall(b"\x90\x03" + body[:2] + b"\x01")  # SUBACK, QoS 1
                            continue
                        n, self.unsubscribes = self.unsubscribes, self.unsubscribes + 1
                        action = self.unsubscribe[n] if n < len(self.unsubscribe) else "ack"
                        if action == "close":
                            break
                        if action == "ack":
                            conn.sendall(b"\xb0\x02" + body[:2])  # UNSUBACK
                    elif kind == 12:
                        conn.sendall(b"\xd0\x00")  # PINGRESP
                    elif kind == 14:
                        break  # DISCONNECT

    def drop(self) -> None:
        """Close the current connection (the client reconnects)."""
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop = True
        self.drop()
        with contextlib.suppress(OSError):  # a blocked accept() returns only for a connection
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        self._thread.join(5)
        self.listener.close()


def publish_packet(topic: bytes, payload: bytes, packet_id: int = 0) -> bytes:
    """An MQTT 3.1.1 PUBLISH: QoS 1 with ``packet_id``, QoS 0 without."""
    head, pid = (b"\x32", packet_id.to_bytes(2, "big")) if packet_id else (b"\x30", b"")
    body = len(topic).to_bytes(2, "big") + topic + pid + payload
    return head + socket_mod.remaining_length(len(body)) + body


def test_a_burst_already_in_the_socket_reaches_the_queue_in_one_turn() -> None:
    """Thirty PUBLISH packets that arrived together are all queued before the consumer runs.

    paho reads one packet a call; the transport reads on while bytes wait. A site aggregator
    writes its record whenever its queue is drained: fed one packet a turn it wrote one record
    (an fsync) per update, and a burst of 10,000 updates over 20 sites closed 29 s after the last
    one instead of 0.1 s (``bench.scale --spread 0``).
    """

    async def main(port: int) -> tuple[bytes, int]:
        t = MqttTransport("127.0.0.1", port, "burst", protocol="3.1.1")
        await t.subscribe("burst", 0)
        try:
            await t.start(wait_s=5)
            first = await asyncio.wait_for(t.queue.get(), 5)
            return first.payload, t.queue.qsize()
        finally:
            await t.stop(timeout_s=1)

    with burst_broker(b"".join(publish_packet(b"burst", b"%02d" % i) for i in range(30))) as port:
        assert asyncio.run(main(port)) == (b"00", 29)


def test_a_burst_past_the_hold_line_waits_in_tcp_and_nothing_is_lost() -> None:
    """500 QoS 1 messages at once into a queue of 3 and a hold line of 64: all arrive, in order.

    A broker that ignores our Receive Maximum (mosquitto emptying an offline session's queue) sent
    more than the hold line takes; the transport dropped the rest (acknowledged: lost). It now stops
    reading the socket while there is no room, so TCP's flow control holds the burst.
    """

    async def main(port: int) -> tuple[list[bytes], int]:
        t = MqttTransport("127.0.0.1", port, "burst", protocol="3.1.1", queue_size=3)
        await t.subscribe("burst", 1)
        try:
            await t.start(wait_s=5)
            # the consumer is late: the queue and the hold line fill, and reading stops
            await wait_until(lambda: len(t._held) == t.held_max, 10, "a full hold line")
            got = [(await asyncio.wait_for(t.queue.get(), 5)).payload for _ in range(500)]
            return got, t.dropped_total
        finally:
            await t.stop(timeout_s=1)

    burst = b"".join(publish_packet(b"burst", b"%03d" % i, packet_id=i + 1) for i in range(500))
    with burst_broker(burst) as port:
        got, dropped = asyncio.run(main(port))
    assert dropped == 0 and got == [b"%03d" % i for i in range(500)]


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_transport_bounded_queue_holds_qos1_unacknowledged_and_drops_only_qos0(
    mosquitto: Broker, fleet: str, protocol: str
) -> None:
    """A QoS 1 burst into a full queue waits unacknowledged (nothing lost); QoS 0 is dropped and counted."""

    async def main() -> None:
        async with two_clients(mosquitto, fleet, queue_size=3, protocol=protocol) as (a, b):
            await b.subscribe(f"{fleet}/q", 1)
            for i in range(8):
                await a.publish(f"{fleet}/q", bytes([i]), qos=1)
            await a.publish(f"{fleet}/q", b"end", qos=1)
            await wait_until(lambda: b.queue.full() and b.held_peak >= 3, 10, "a full queue and 3 held")
            got = [(await asyncio.wait_for(b.queue.get(), 5)).payload for _ in range(9)]
            assert got == [bytes([i]) for i in range(8)] + [b"end"]  # all, in order
            assert b.dropped_total == 0
            # QoS 0 has no flow control: what does not fit is dropped and counted
            await b.subscribe(f"{fleet}/q0", 0)
            for i in range(8):
                await a.publish(f"{fleet}/q0", bytes([i]), qos=1)
            await a.publish(f"{fleet}/q0", b"end", qos=1)
            await wait_until(lambda: b.dropped_total == 6, 10, "6 dropped QoS 0 messages")
            assert [(await b.queue.get()).payload for _ in range(3)] == [b"\x00", b"\x01", b"\x02"]

    asyncio.run(main())


@pytest.mark.subprocess
def test_transport_broker_down_at_start_then_restart(
    tmp_path: Path, fleet: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport_mod, "RECONNECT_MIN_S", 0.05)
    monkeypatch.setattr(transport_mod, "RECONNECT_MAX_S", 0.3)
    port = free_port()
    caplog.set_level(logging.INFO, logger="edgefl.transport")

    async def main() -> None:
        t = MqttTransport("127.0.0.1", port, f"t-{fleet}")
        await t.start(wait_s=None)  # broker not there yet: must not block or raise
        with pytest.raises(TransportError, match="not connected"):
            await t.publish(f"{fleet}/x", b"1")
        def unreachable() -> int:
            return sum("unreachable" in r.getMessage() for r in caplog.records)

        await wait_until(lambda: unreachable() == 1, 10, "the first connect failure logged")
        broker = start_mosquitto(tmp_path, port=port)
        try:
            await asyncio.wait_for(t.connected.wait(), 10)
            await t.subscribe(f"{fleet}/echo", 1)
            stop_broker(broker)
            await wait_until(lambda: unreachable() == 2, 10, "a failed reconnect logged")
            assert not t.connected.is_set()
            broker = start_mosquitto(tmp_path, port=port)
            await asyncio.wait_for(t.connected.wait(), 10)
            # the subscription was renewed (SUBACK) before "connected" was set
            await t.publish(f"{fleet}/echo", b"back", qos=1)
            msg = await asyncio.wait_for(t.queue.get(), 5)
            assert msg.payload == b"back"
        finally:
            await t.stop()
            stop_broker(broker)

    asyncio.run(main())
    text = [r.getMessage() for r in caplog.records]
    assert sum("broker lost" in m for m in text) == 1, text
    assert sum("broker back" in m for m in text) == 1, text
    assert sum("unreachable" in m for m in text) == 2, text  # once at start-up, once during the outage


def test_backoff_full_jitter_bounds() -> None:
    rng = random.Random(0)
    for failures, cap in ((1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (20, 30.0)):
        draws = [MqttTransport.backoff_s(failures, rng) for _ in range(400)]
        assert min(draws) >= 0.0 and max(draws) <= cap
        assert max(draws) > 0.8 * cap and min(draws) < 0.2 * cap  # spread over the whole range
    assert np.isclose(np.mean([MqttTransport.backoff_s(6, rng) for _ in range(4000)]), 15.0, rtol=0.05)
    # a coordinator's cap (one client, not a fleet): 5 s
    draws = [MqttTransport.backoff_s(20, rng, max_s=5.0) for _ in range(400)]
    assert min(draws) >= 0.0 and 4.0 < max(draws) <= 5.0


def test_last_will_marks_a_killed_agent_offline(mosquitto: Broker, fleet: str, tmp_path: Path) -> None:
    proc = launch_agent(
        DEV_PROFILE,
        {
            "device.id": "dev-will",
            "device.fleet": fleet,
            "device.state_dir": str(tmp_path / "state"),
            "broker.url": mosquitto.url,
            "broker.keepalive_s": "2",
            "model.path": str(INT8_MODEL),
            "dashboard.enabled": "false",
        },
        tmp_path / "agent.log",
    )
    topics = Topics("edgefl", fleet)

    async def main() -> list[str]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"w-{fleet}")
        await t.start()
        states: list[str] = []
        try:
            await t.subscribe(topics.status("dev-will"), 1)
            while "online" not in states and "idle" not in states:
                msg = await asyncio.wait_for(t.queue.get(), 30)
                states.append(decode_status(msg.payload).state)
            proc.send_signal(signal.SIGKILL)
            while states[-1] != "offline":
                msg = await asyncio.wait_for(t.queue.get(), 30)
                states.append(decode_status(msg.payload).state)
        finally:
            await t.stop()
        return states

    try:
        states = asyncio.run(main())
    finally:
        stop_agents([proc])
    assert states[-1] == "offline"
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_subscribe_awaits_suback_and_fails_when_refused(mosquitto: Broker, fleet: str, protocol: str) -> None:
    """subscribe returns after the SUBACK (no sleep before publishing); a filter mosquitto will not take
    (over its 200 topic levels: it disconnects instead of answering) raises TransportError, and the
    transport reconnects with its good subscriptions renewed."""

    async def main() -> None:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"s-{fleet}", protocol=protocol)
        await t.start()
        try:
            await t.subscribe(f"{fleet}/ok/x", 1)
            await t.publish(f"{fleet}/ok/x", b"mine", qos=1)
            assert (await asyncio.wait_for(t.queue.get(), 5)).payload == b"mine"
            deep = "/".join([fleet] * 250)
            with pytest.raises(
                TransportError, match=r"lost before the acknowledgement|not currently connected"
            ):
                await t.subscribe(deep, 1)
            t._subscriptions.pop(deep)  # do not send it again on the next connection
            await asyncio.wait_for(t.connected.wait(), 30)
            await t.publish(f"{fleet}/ok/x", b"again", qos=1)
            assert (await asyncio.wait_for(t.queue.get(), 5)).payload == b"again"
        finally:
            await t.stop()

    asyncio.run(main())


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_unsubscribe_awaits_unsuback_and_the_topic_stops_arriving(
    mosquitto: Broker, fleet: str, protocol: str
) -> None:
    """After unsubscribe returns, the broker delivers nothing more on that filter (a message published
    on it, then one on a filter still subscribed: only the second arrives), and the filter is no
    longer among those renewed after a reconnect."""

    async def main() -> None:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"u-{fleet}", protocol=protocol)
        await t.start()
        try:
            await t.subscribe(f"{fleet}/gone/#", 1)
            await t.subscribe(f"{fleet}/kept", 1)
            await t.publish(f"{fleet}/gone/x", b"first", qos=1)
            assert (await asyncio.wait_for(t.queue.get(), 5)).payload == b"first"
            await t.unsubscribe(f"{fleet}/gone/#")
            assert t.subscriptions == (f"{fleet}/kept",)
            await t.publish(f"{fleet}/gone/x", b"after", qos=1)
            await t.publish(f"{fleet}/kept", b"marker", qos=1)
            msg = await asyncio.wait_for(t.queue.get(), 5)
            assert (msg.topic, msg.payload) == (f"{fleet}/kept", b"marker")
            assert t.queue.empty()
        finally:
            await t.stop()

    asyncio.run(main())


@pytest.mark.subprocess
def test_unsubscribe_while_disconnected_reaches_the_persistent_session_on_reconnect(
    tmp_path: Path, fleet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A persistent session keeps the broker's copy of a subscription across a reconnect: an
    unsubscribe made while the broker is away is sent first on the next connection, so nothing
    published on that filter once ``connected`` is set again is delivered."""
    monkeypatch.setattr(transport_mod, "RECONNECT_MIN_S", 0.05)
    monkeypatch.setattr(transport_mod, "RECONNECT_MAX_S", 0.3)
    # kept as root: the dropped user could not write into pytest's private temporary folder
    keep = f"persistence true\npersistence_location {tmp_path}/\nuser root\n"
    broker = start_mosquitto(tmp_path, keep)

    async def main() -> None:
        nonlocal broker
        t = MqttTransport(broker.host, broker.port, f"p-{fleet}", session_expiry_s=300)
        await t.start()
        try:
            await t.subscribe(f"{fleet}/gone", 1)
            await t.subscribe(f"{fleet}/kept", 1)
            stop_broker(broker)  # saves the session, its two subscriptions with it
            await wait_until(lambda: not t.connected.is_set(), 10, "the connection lost")
            await t.unsubscribe(f"{fleet}/gone")  # no broker: returns at once
            assert t.subscriptions == (f"{fleet}/kept",)
            broker = restart_mosquitto(broker)
            await asyncio.wait_for(t.connected.wait(), 10)
            assert t.session_present  # the broker restored the session (both subscriptions)
            other = MqttTransport(broker.host, broker.port, f"o-{fleet}")
            await other.start()
            await other.publish(f"{fleet}/gone", b"after", qos=1)
            await other.publish(f"{fleet}/kept", b"marker", qos=1)
            await other.stop()
            msg = await asyncio.wait_for(t.queue.get(), 5)
            assert (msg.topic, msg.payload) == (f"{fleet}/kept", b"marker")
            assert t.queue.empty()
        finally:
            await t.stop()

    try:
        asyncio.run(main())
    finally:
        stop_broker(broker)


@pytest.fixture
def fast_reconnect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_mod, "RECONNECT_MIN_S", 0.05)
    monkeypatch.setattr(transport_mod, "RECONNECT_MAX_S", 0.2)


async def _connected_to(t: MqttTransport, broker: ScriptedBroker, n: int) -> None:
    """Wait until ``t`` is connected on ``broker``'s n-th connection with its subscriptions renewed."""
    await wait_until(
        lambda: len(broker.connections) >= n and t.connected.is_set() and bool(broker.connections[n - 1]),
        10,
        f"connection {n} up",
    )


def run_scripted(
    unsubscribe: list[str], body: Callable[[MqttTransport, ScriptedBroker], Awaitable[None]]
) -> None:
    """Run ``body`` with a :class:`ScriptedBroker` (``unsubscribe`` its script) and an MQTT 3.1.1
    transport connected to it and subscribed to ``a/y``; both stopped afterwards."""
    broker = ScriptedBroker(unsubscribe)

    async def main() -> None:
        t = MqttTransport("127.0.0.1", broker.port, "t-scripted", protocol="3.1.1")
        await t.start()
        try:
            await t.subscribe("a/y", 1)
            await body(t, broker)
        finally:
            await t.stop()

    try:
        asyncio.run(main())
    finally:
        broker.close()


@pytest.mark.usefixtures("fast_reconnect")
def test_unsubscribe_a_broker_closes_the_connection_on_is_sent_once_more_then_dropped() -> None:
    """MQTT 3.1.1 has no refusal in an UNSUBACK: a broker may close the connection instead. The
    unsubscribe is sent once more with the next connection, then forgotten: the transport is
    connected again on the third, which carries only the renewed subscription."""

    async def body(t: MqttTransport, broker: ScriptedBroker) -> None:
        with pytest.raises(TransportError, match="lost before the acknowledgement"):
            await t.unsubscribe("a/x")
        await _connected_to(t, broker, 3)
        assert broker.connections[1][0] == ("UNSUBSCRIBE", "a/x")
        assert broker.connections[2] == [("SUBSCRIBE", "a/y")]
        assert t.subscriptions == ("a/y",)

    run_scripted(["close", "close", "close"], body)


@pytest.mark.usefixtures("fast_reconnect")
def test_unsubscribe_without_an_unsuback_never_holds_connected_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unsubscribe left without an UNSUBACK is sent first on the next connection, whose
    ``connected`` waits only for the SUBACKs (not for the 30 s an UNSUBACK could take here), and
    not on the one after."""
    monkeypatch.setattr(transport_mod, "SUBACK_TIMEOUT_S", 30.0)

    async def body(t: MqttTransport, broker: ScriptedBroker) -> None:
        with pytest.raises(TransportError, match=r"no UNSUBACK for a/x within 0\.3 s"):
            await t.unsubscribe("a/x", timeout_s=0.3)
        broker.drop()
        await _connected_to(t, broker, 2)  # within 10 s: the UNSUBACK is not awaited first
        assert broker.connections[1] == [("UNSUBSCRIBE", "a/x"), ("SUBSCRIBE", "a/y")]
        broker.drop()
        await _connected_to(t, broker, 3)
        assert broker.connections[2] == [("SUBSCRIBE", "a/y")]

    run_scripted(["ignore", "ignore", "ignore"], body)


@pytest.mark.usefixtures("fast_reconnect")
def test_unsubscribe_an_earlier_unsuback_does_not_clear_a_later_unsubscribe() -> None:
    """unsubscribe, subscribe, unsubscribe of one topic before any answer; the first is
    acknowledged, the second is lost with the connection: it is the one sent again."""

    async def body(t: MqttTransport, broker: ScriptedBroker) -> None:
        calls = [t.unsubscribe("a/x"), t.subscribe("a/x", 1), t.unsubscribe("a/x")]
        first, second, third = await asyncio.gather(*calls, return_exceptions=True)
        assert first is None and second is None and isinstance(third, TransportError)
        assert broker.connections[0][1:] == [
            ("UNSUBSCRIBE", "a/x"),
            ("SUBSCRIBE", "a/x"),
            ("UNSUBSCRIBE", "a/x"),
        ]
        await _connected_to(t, broker, 2)
        assert broker.connections[1] == [("UNSUBSCRIBE", "a/x"), ("SUBSCRIBE", "a/y")]

    run_scripted(["ack", "close"], body)


def test_unsuback_reason_codes_are_checked() -> None:
    """An MQTT 5 UNSUBACK code >= 0x80 raises; Success, No subscription existed (0x11) and 3.1.1's
    empty list pass."""
    MqttTransport._check_unsuback("a/b", [])
    for code in (0x00, 0x11):
        MqttTransport._check_unsuback("a/b", [ReasonCode(PacketTypes.UNSUBACK, identifier=code)])
    with pytest.raises(TransportError, match="unsubscribe from a/b refused by broker: Not authorized"):
        MqttTransport._check_unsuback("a/b", [ReasonCode(PacketTypes.UNSUBACK, identifier=0x87)])


def test_suback_reason_codes_are_checked() -> None:
    """MQTT 5 refusals (>= 0x80, e.g. 0x87 Not authorized) and 3.1.1's 0x80 raise; granted QoS passes."""
    ok = ReasonCode(PacketTypes.SUBACK, identifier=1)
    MqttTransport._check_suback("a/b", [ok])
    for code, name in ((0x80, "Unspecified error"), (0x87, "Not authorized")):
        with pytest.raises(TransportError, match=f"subscribe to a/b refused by broker: {name}"):
            MqttTransport._check_suback("a/b", [ReasonCode(PacketTypes.SUBACK, identifier=code)])
    with pytest.raises(TransportError, match="2 reason codes"):
        MqttTransport._check_suback("a/b", [ok, ok])


@pytest.mark.subprocess
def test_puback_future_fails_on_connection_loss_and_new_connection_is_untouched(
    tmp_path: Path, fleet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish waiting for its PUBACK when the connection dies fails with TransportError at once (not at
    its timeout); the next connection's paho client restarts mids at 1, and its publishes complete."""
    monkeypatch.setattr(transport_mod, "RECONNECT_MIN_S", 0.05)
    monkeypatch.setattr(transport_mod, "RECONNECT_MAX_S", 0.2)
    port = free_port()
    broker = start_mosquitto(tmp_path, port=port)

    async def main() -> None:
        t = MqttTransport("127.0.0.1", port, f"p-{fleet}")
        await t.start()
        try:
            await t.subscribe(f"{fleet}/x", 1)
            await t.publish(f"{fleet}/x", b"first", qos=1)
            assert (await asyncio.wait_for(t.queue.get(), 5)).payload == b"first"
            broker.proc.send_signal(signal.SIGSTOP)  # no PUBACK can come
            stuck = asyncio.create_task(t.publish(f"{fleet}/x", b"stuck", qos=1, timeout_s=60))
            await wait_until(lambda: bool(t._conn and t._conn.pubacks), 5, "the publish in flight")
            old_conn = t._conn
            broker.proc.kill()  # the kernel closes its sockets: the connection is lost
            with pytest.raises(TransportError, match="lost before the acknowledgement"):
                await asyncio.wait_for(stuck, 30)
            broker.proc.wait()
            new = start_mosquitto(tmp_path, port=port)
            try:
                await asyncio.wait_for(t.connected.wait(), 10)
                assert t._conn is not old_conn and old_conn is not None and old_conn.closed
                await t.publish(f"{fleet}/x", b"second", qos=1)  # mid 1..2 again, on the new client
                await t.publish(f"{fleet}/x", b"third", qos=1)
                got = [(await asyncio.wait_for(t.queue.get(), 5)).payload for _ in range(2)]
                assert got == [b"second", b"third"]  # the subscription was renewed before "connected"
                assert t._conn is not None and t._conn.pubacks == {}
            finally:
                await t.stop()
                stop_broker(new)
        finally:
            await t.stop()

    try:
        asyncio.run(main())
    finally:
        if broker.proc.poll() is None:
            broker.proc.kill()
            broker.proc.wait()


def test_exception_in_paho_thread_is_counted_and_logged(
    mosquitto: Broker, fleet: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(client: object, userdata: object, sock: object) -> None:
        raise RuntimeError("boom in on_socket_open")

    monkeypatch.setattr(transport_mod, "set_nodelay", boom)
    caplog.set_level(logging.ERROR, logger="edgefl.transport")

    async def main() -> dict[str, int]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"e-{fleet}")
        await t.start()  # the callback's failure does not stop the connection
        try:
            await t.subscribe(f"{fleet}/e", 1)
            await t.publish(f"{fleet}/e", b"still works", qos=1)
            assert (await asyncio.wait_for(t.queue.get(), 5)).payload == b"still works"
            return t.counters()
        finally:
            await t.stop()

    counters = asyncio.run(main())
    assert counters["thread_errors"] == 1
    assert counters["callback_errors"] == 0
    assert any("boom in on_socket_open" in repr(r.exc_info) for r in caplog.records), caplog.records


def _publish_packet(topic: str, payload: bytes, *, qos: int, packet_id: int, mqtt5: bool) -> bytes:
    body = len(topic).to_bytes(2, "big") + topic.encode()
    body += packet_id.to_bytes(2, "big") if qos else b""
    body += b"\x00" if mqtt5 else b""
    body += payload
    return bytes([0x30 | qos << 1]) + socket_mod.remaining_length(len(body)) + body


@pytest.mark.parametrize("mqtt5", [True, False])
def test_packet_filter_replaces_oversize_publish_whatever_the_read_sizes(mqtt5: bool) -> None:
    """The stream minus the oversize PUBLISH, plus a stand-in with its packet id, for any split of reads."""
    small = _publish_packet("a/b", b"x" * 100, qos=1, packet_id=7, mqtt5=mqtt5)
    big = _publish_packet("a/global", b"\xff" * 300_000, qos=1, packet_id=8, mqtt5=mqtt5)
    tail = bytes([0x90, 3, 0, 9, 1])  # a SUBACK after it
    stand_in = _publish_packet(
        socket_mod.OVERSIZE_TOPIC, f"{len(big)}\na/global".encode(), qos=1, packet_id=8, mqtt5=mqtt5
    )
    rng = random.Random(1)
    for _ in range(20):
        f = socket_mod.PacketFilter(1024, mqtt5=mqtt5)
        stream, out = small + big + tail, b""
        while stream:
            piece = stream[: rng.randint(1, rng.choice([1, 7, 4096, socket_mod.READ_BYTES]))]
            stream = stream[len(piece) :]
            out += f.feed(piece)
        assert out == small + stand_in + tail
        assert f.dropped_total == 1
    with pytest.raises(ConnectionError, match="over our limit"):  # an oversize packet of another type
        socket_mod.PacketFilter(16, mqtt5=True).feed(bytes([0x90, 0x80, 0x01]))


@pytest.mark.skipif(socket_mod.TCP_QUICKACK is None, reason="TCP_QUICKACK is Linux's")
def test_quickack_rearmed_after_every_read(mosquitto: Broker, fleet: str) -> None:
    """Every read re-arms TCP_QUICKACK: a broker at its defaults (Nagle) never waits for our delayed ACK.

    The socket is put in delayed-ACK (pingpong) mode before a QoS 0 message arrives (no reply is sent,
    so only the read path can leave that mode at once); once it is read, quickack mode is on again.
    """
    import socket

    opt = socket_mod.TCP_QUICKACK
    assert opt is not None

    async def main() -> None:
        async with two_clients(mosquitto, fleet) as (a, b):
            await b.subscribe(f"{fleet}/q", 0)
            client = b._client
            assert client is not None
            sock = client.socket()
            assert isinstance(sock, socket.socket)
            sock.setsockopt(socket.IPPROTO_TCP, opt, 0)  # delayed ACKs, as after a request/response
            assert sock.getsockopt(socket.IPPROTO_TCP, opt) == 0
            await a.publish(f"{fleet}/q", b"x", qos=0)
            msg = await asyncio.wait_for(b.queue.get(), 5)
            assert msg.payload == b"x"
            assert sock.getsockopt(socket.IPPROTO_TCP, opt) == 1

    asyncio.run(main())


@pytest.mark.skipif(socket_mod.TCP_QUICKACK is None, reason="TCP_QUICKACK is Linux's")
def test_quickack_sets_the_option_and_ignores_closed_sockets() -> None:
    import socket

    opt = socket_mod.TCP_QUICKACK
    assert opt is not None
    server = socket.create_server(("127.0.0.1", 0))
    try:
        with socket.create_connection(server.getsockname()) as c, server.accept()[0] as s:
            c.setsockopt(socket.IPPROTO_TCP, opt, 0)
            s.sendall(b"x")
            assert c.recv(1) == b"x"
            socket_mod.quickack(c)
            assert c.getsockopt(socket.IPPROTO_TCP, opt) == 1
        socket_mod.quickack(c)  # closed: nothing raised
        socket_mod.quickack(None)
    finally:
        server.close()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
@pytest.mark.parametrize("ack_on_commit", [True, False])
def test_site_transport_ack_on_commit_gets_an_uncommitted_message_again(
    mosquitto: Broker, fleet: str, protocol: str, ack_on_commit: bool
) -> None:
    """``ack_on_commit`` (a site aggregator with a state file): a message taken but not committed when the
    process goes is not acknowledged, so the broker sends it again to the next process of the same
    session; a committed one never comes again. Without it a message is acknowledged once queued."""

    async def main() -> list[bytes]:
        a = MqttTransport(mosquitto.host, mosquitto.port, f"a-{fleet}")
        def site() -> MqttTransport:  # the same session each time
            return MqttTransport(
                mosquitto.host, mosquitto.port, f"site-{fleet}", protocol=protocol, session_expiry_s=60,
                ack_on_commit=ack_on_commit,
            )  # fmt: skip

        b = site()
        await a.start()
        await b.start()
        try:
            await b.subscribe(f"{fleet}/u", 1)
            await a.publish(f"{fleet}/u", b"m1", qos=1)
            await a.publish(f"{fleet}/u", b"m2", qos=1)
            assert (await asyncio.wait_for(b.queue.get(), 5)).payload == b"m1"
            b.commit()  # m1 is written: acknowledged
            assert (await asyncio.wait_for(b.queue.get(), 5)).payload == b"m2"  # taken, not committed
            await b.stop()  # the process goes before writing m2
            await a.publish(f"{fleet}/u", b"m3", qos=1)
            again = site()
            await again.start()
            try:
                got = [(await asyncio.wait_for(again.queue.get(), 5)).payload]
                if got[0] != b"m3":
                    got.append((await asyncio.wait_for(again.queue.get(), 5)).payload)
                again.commit()
                return got
            finally:
                await again.stop()
        finally:
            await a.stop()

    assert asyncio.run(main()) == ([b"m2", b"m3"] if ack_on_commit else [b"m3"])


def test_remaining_length_encodes_mqtt_variable_byte_integers() -> None:
    # MQTT 5.0 §1.5.5's table: the edges of 1, 2, 3 and 4 bytes
    cases = {0: "00", 127: "7f", 128: "8001", 16_383: "ff7f", 16_384: "808001", 2_097_152: "80808001"}
    for n, hexed in cases.items():
        assert socket_mod.remaining_length(n) == bytes.fromhex(hexed), n
