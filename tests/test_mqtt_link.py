"""Tests of the link layer (edgefl/mqtt_link.py, edgefl/mqtt_socket.py): PUBLISH packets parsed from the
read buffer, writes gathered per turn of the loop, on a real mosquitto."""

from __future__ import annotations

import asyncio

import pytest
from conftest import Broker

import edgefl.mqtt_link as link_mod
import edgefl.mqtt_socket as socket_mod
from edgefl.mqtt_link import Message
from edgefl.mqtt_socket import PacketFilter
from edgefl.transport import MqttTransport

pytestmark = [pytest.mark.timeout(120), pytest.mark.broker]


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_link_burst_of_publishes_arrives_whole_in_order_and_acknowledged(
    mosquitto: Broker, fleet: str, protocol: str
) -> None:
    """A burst of QoS 1 and QoS 0 messages, small and larger than one socket read, retained or not,
    parsed from the read buffer: every one arrives once, intact, in order within its QoS; every QoS 1
    one is acknowledged (the sender's publishes all complete)."""
    sizes = [0, 1, 300, 20_832, socket_mod.READ_BYTES + 17, 3 * socket_mod.READ_BYTES]

    async def main() -> list[Message]:
        a = MqttTransport(mosquitto.host, mosquitto.port, f"a-{fleet}", protocol=protocol)
        b = MqttTransport(mosquitto.host, mosquitto.port, f"b-{fleet}", protocol=protocol, queue_size=1024)
        await a.start()
        await b.start()
        try:
            await a.publish(f"{fleet}/kept", b"retained", qos=1, retain=True)
            await b.subscribe(f"{fleet}/#", 1)
            for start in range(0, 300, 50):  # paho queues at most 64 unacknowledged publishes
                sends = [
                    a.publish(f"{fleet}/m/{i}", bytes([i % 251]) * sizes[i % len(sizes)], qos=i % 2)
                    for i in range(start, start + 50)
                ]
                await asyncio.gather(*sends)  # every QoS 1 publish got its PUBACK from the broker
            got: list[Message] = []
            while len(got) < 301:
                got.append(await asyncio.wait_for(b.queue.get(), 30))
            return got
        finally:
            await a.stop()
            await b.stop()

    got = asyncio.run(main())
    assert got[0] == Message(f"{fleet}/kept", b"retained", True)
    index = [int(m.topic.rsplit("/", 1)[1]) for m in got[1:]]
    # ordered within each QoS (MQTT 5.0 §4.6): the broker may pass a QoS 0 message before a QoS 1 one
    assert [i for i in index if i % 2] == list(range(1, 300, 2))
    assert [i for i in index if not i % 2] == list(range(0, 300, 2))
    for i, m in zip(index, got[1:], strict=True):
        assert m.payload == bytes([i % 251]) * sizes[i % len(sizes)] and not m.retain, i


def test_link_subscribe_after_a_write_goes_out_without_the_keepalive_tick(
    mosquitto: Broker, fleet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packets queued after earlier ones were written are flushed on the next turn of the loop, not
    by the keep-alive timer (turned off here): each SUBSCRIBE gets its SUBACK."""
    monkeypatch.setattr(link_mod, "MISC_INTERVAL_S", 3600.0)

    async def main() -> None:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"s-{fleet}")
        await t.start()
        try:
            for i in range(3):
                await t.subscribe(f"{fleet}/s/{i}", 1, timeout_s=20)
            assert t.subscriptions == tuple(f"{fleet}/s/{i}" for i in range(3))
        finally:
            await t.stop()

    asyncio.run(main())


def test_link_packet_filter_passes_a_stream_of_packets_in_any_split() -> None:
    """Whole packets pass the filter unchanged, however the stream is cut into reads."""
    packets = b"".join(
        bytes([0x30]) + socket_mod.remaining_length(5 + n) + b"\x00\x03a/b" + b"x" * n
        for n in (0, 5, 200, 70_000)
    )
    for step in (1, 3, 64, 4096, socket_mod.READ_BYTES):
        f = PacketFilter(1 << 20, mqtt5=False)
        out = b"".join(f.feed(packets[i : i + step]) for i in range(0, len(packets), step))
        assert out == packets and f.dropped_total == 0, step


def test_link_a_packet_cut_by_the_end_of_the_stream_ends_the_connection() -> None:
    """A broker that closes the connection in the middle of a packet: the transport reports the
    connection lost (and would reconnect) instead of waiting for the rest of the packet forever."""

    async def main() -> bool:
        accepted = asyncio.Event()

        async def broker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(2)  # CONNECT's fixed header (its length fits one byte here)
            accepted.set()
            writer.write(bytes([0x20, 0x02, 0x00, 0x00]))  # CONNACK, accepted (MQTT 3.1.1)
            writer.write(bytes([0x30, 0x40, 0x00, 0x03]) + b"a/b")  # a PUBLISH announcing 64 bytes
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(broker, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        t = MqttTransport("127.0.0.1", port, "cut-1", protocol="3.1.1")
        try:
            await t.start(wait_s=None)
            await asyncio.wait_for(accepted.wait(), 20)
            conn = t._conn
            assert conn is not None
            await asyncio.wait_for(conn.lost.wait(), 20)  # paho was told: the connection is over
            return t.queue.empty()
        finally:
            await t.stop()
            server.close()

    assert asyncio.run(main())


def test_link_a_topic_that_is_not_utf8_is_acknowledged_never_held() -> None:
    """A broker that passes a PUBLISH whose topic is not UTF-8 (MQTT 5.0 §1.5.4 forbids it): the
    message is acknowledged like any other (a refused one must not hold an in-flight slot) and the
    next one arrives."""

    async def main() -> tuple[set[int], list[str]]:
        acked: set[int] = set()
        both = asyncio.Event()

        async def broker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            first = await reader.readexactly(2)  # CONNECT's fixed header (its length fits one byte)
            await reader.readexactly(first[1])
            writer.write(bytes([0x20, 0x02, 0x00, 0x00]))  # CONNACK, accepted (MQTT 3.1.1)
            for mid, topic in ((7, b"edgefl/\xff\xfe"), (8, b"a/b")):
                body = len(topic).to_bytes(2, "big") + topic + mid.to_bytes(2, "big") + b"payload"
                writer.write(bytes([0x32]) + socket_mod.remaining_length(len(body)) + body)
            await writer.drain()
            while not both.is_set():
                head = await reader.readexactly(2)
                rest = await reader.readexactly(head[1])
                if head[0] == 0x40:  # PUBACK
                    acked.add(int.from_bytes(rest[:2], "big"))
                    if {7, 8} <= acked:
                        both.set()

        server = await asyncio.start_server(broker, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        t = MqttTransport("127.0.0.1", port, "utf8-1", protocol="3.1.1")
        try:
            await t.start(wait_s=None)
            topics = [(await asyncio.wait_for(t.queue.get(), 20)).topic for _ in range(2)]
            await asyncio.wait_for(both.wait(), 20)
            return acked, topics
        finally:
            await t.stop()
            server.close()

    acked, topics = asyncio.run(main())
    assert acked == {7, 8}
    assert topics == ["edgefl/\ufffd\ufffd", "a/b"]
