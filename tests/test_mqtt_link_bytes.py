"""The link layer's byte bound (edgefl/mqtt_link.py, ``max_held_bytes``) on a real mosquitto: reading
stops while the payloads received and not handled reach it, and nothing is lost or dropped."""

from __future__ import annotations

import asyncio

import pytest
from conftest import Broker, wait_until

from edgefl.mqtt_link import Message
from edgefl.transport import MqttTransport

pytestmark = [pytest.mark.timeout(120), pytest.mark.broker]

BOUND = 1_000_000
SIZE = 100_000
N = 40  # 4 MB published: four times the bound


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_link_bytes_bound_stops_reading_and_loses_nothing(
    mosquitto: Broker, fleet: str, protocol: str
) -> None:
    """40 x 100 KB QoS 1 messages to a transport bounded at 1 MB that nobody reads: it stops reading at
    the bound (under 1 MB + one message held, fewer than 40 queued). A consumer that keeps what it took
    (``consumer_bytes``) and lets go of it 5 messages at a time then gets all 40, once, intact, in
    order, while the bytes held never passed the bound by more than one message; nothing dropped."""

    async def main() -> tuple[list[Message], int, int, int]:
        a = MqttTransport(mosquitto.host, mosquitto.port, f"a-{fleet}", protocol=protocol)
        b = MqttTransport(
            mosquitto.host, mosquitto.port, f"b-{fleet}", protocol=protocol, max_held_bytes=BOUND
        )
        kept: list[Message] = []
        b.consumer_bytes = lambda: sum(len(m.payload) for m in kept)
        await a.start()
        await b.start()
        try:
            await b.subscribe(f"{fleet}/#", 1)
            for start in range(0, N, 20):  # paho queues at most 64 unacknowledged publishes
                await asyncio.gather(
                    *(a.publish(f"{fleet}/m/{i}", bytes([i]) * SIZE, qos=1) for i in range(start, start + 20))
                )
            assert b._conn is not None
            await wait_until(lambda: b._conn is not None and b._conn.paused, 30, "reading stopped")
            held, queued = b.held_bytes(), b.queue.qsize()
            got: list[Message] = []
            while len(got) < N:
                msg = await asyncio.wait_for(b.queue.get(), 30)
                got.append(msg)
                kept.append(msg)
                if len(kept) == 5:
                    kept.clear()
                    b.bytes_freed()
            kept.clear()
            return got, held, queued, b.held_bytes_peak
        finally:
            await a.stop()
            await b.stop()

    got, held, queued, peak = asyncio.run(main())
    assert BOUND <= held < BOUND + SIZE and queued < N
    assert peak < BOUND + SIZE
    assert [m.topic for m in got] == [f"{fleet}/m/{i}" for i in range(N)]
    assert all(m.payload == bytes([i]) * SIZE for i, m in enumerate(got))


def test_link_bytes_message_larger_than_the_bound_is_taken_alone(mosquitto: Broker, fleet: str) -> None:
    """Messages of 300 KB to a transport bounded at 100 KB: each is still read (alone), all 6 arrive."""

    async def main() -> tuple[list[Message], int, int]:
        a = MqttTransport(mosquitto.host, mosquitto.port, f"a-{fleet}")
        b = MqttTransport(mosquitto.host, mosquitto.port, f"b-{fleet}", max_held_bytes=100_000)
        await a.start()
        await b.start()
        try:
            await b.subscribe(f"{fleet}/#", 1)
            await asyncio.gather(*(a.publish(f"{fleet}/big/{i}", bytes([i]) * 300_000) for i in range(6)))
            got = [await asyncio.wait_for(b.queue.get(), 30) for _ in range(6)]
            return got, b.held_bytes_peak, b.dropped_total
        finally:
            await a.stop()
            await b.stop()

    got, peak, dropped = asyncio.run(main())
    assert [m.payload for m in got] == [bytes([i]) * 300_000 for i in range(6)]
    assert peak == 300_000 and dropped == 0
