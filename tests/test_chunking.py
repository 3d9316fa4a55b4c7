"""Chunking: MQTT packet arithmetic, split/reassemble, bounds, and a real mosquitto with max_packet_size."""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
import time
import uuid
from pathlib import Path

import cbor2
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from conftest import start_mosquitto, stop_broker
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from edgefl.errors import DecodeError
from edgefl.transport import MqttTransport
from edgefl.wire.chunking import (
    CHUNK_ENTRY_BYTES,
    Chunk,
    Reassembler,
    decode_chunk,
    encode_chunk,
    is_chunk,
    max_payload_bytes,
    publish_overhead,
    publish_packet_bytes,
    split_message,
)
from edgefl.wire.rounds import Update, UpdateMetrics, decode_update, encode_update


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_update(d: int = 400, k: int = 10) -> Update:
    rng = np.random.default_rng(0)
    return Update(
        round=3,
        base_version=2,
        device="dev-1",
        num_examples=50,
        delta_W=rng.standard_normal((d, k)).astype(np.float32),
        delta_b=rng.standard_normal(k).astype(np.float32),
        metrics=UpdateMetrics(0.5, 0.9, 0.01, 1 << 20),
        update_id="dev-1:3:2",
    )


def test_publish_overhead_matches_hand_count() -> None:
    # MQTT 5, QoS 1, topic "a/b" (3 bytes), 10-byte payload:
    # variable header = 2 + 3 (topic) + 2 (packet id) + 1 (properties length 0) = 8; remaining = 18
    assert publish_overhead("a/b", 10) == 1 + 1 + 8
    assert publish_packet_bytes("a/b", 10) == 20
    # MQTT 3.1.1 QoS 0: no packet id, no properties
    assert publish_packet_bytes("a/b", 10, qos=0, mqtt5=False) == 1 + 1 + 5 + 10
    # remaining length 127 -> 1 byte, 128 -> 2 bytes (MQTT 5.0 §1.5.5)
    assert publish_packet_bytes("a/b", 119) == 1 + 1 + 127
    assert publish_packet_bytes("a/b", 120) == 1 + 2 + 128
    assert publish_overhead("é", 0, qos=0, mqtt5=False) == 1 + 1 + 2 + 2  # UTF-8 bytes, not characters


def test_max_payload_bytes_is_tight_at_varint_boundaries() -> None:
    for limit in [40, 129, 130, 131, 4096, 16_386, 16_387, 2_097_155, 262_144]:
        p = max_payload_bytes(limit, "edgefl/f/update/dev-1")
        assert publish_packet_bytes("edgefl/f/update/dev-1", p) <= limit
        assert publish_packet_bytes("edgefl/f/update/dev-1", p + 1) > limit
    with pytest.raises(ValueError, match="no PUBLISH fits"):
        max_payload_bytes(10, "a/long/topic/name")


def test_split_small_message_is_unchanged() -> None:
    assert split_message(b"small", "t", 4096) == [b"small"]


@pytest.mark.parametrize("limit", [200, 257, 1000, 4096, 20_000])
def test_split_and_reassemble_roundtrip(limit: int) -> None:
    payload = encode_update(make_update(400, 10))  # 16.5 KB
    topic = "edgefl/fleet/update/dev-1"
    chunks = split_message(payload, topic, limit, msg_id="dev-1:3:2")
    if publish_packet_bytes(topic, len(payload)) <= limit:
        assert chunks == [payload]
        return
    assert len(chunks) >= 2
    for c in chunks:
        assert publish_packet_bytes(topic, len(c)) <= limit
    # full chunks are nearly as large as allowed (a few bytes of slack for the widest index)
    assert publish_packet_bytes(topic, len(chunks[0])) >= limit - 4
    r = Reassembler()
    order = list(range(len(chunks)))
    random.Random(limit).shuffle(order)  # arrival order does not matter
    got = [r.feed(topic, chunks[i]) for i in order]
    assert all(g is None for g in got[:-1]) and got[-1] == payload
    assert len(r) == 0  # delivered once (the last chunk only), nothing held
    assert decode_update(got[-1]).update_id == "dev-1:3:2"


def test_chunk_encoding_fields() -> None:
    payload = bytes(range(256)) * 4
    chunks = split_message(payload, "t", 300, msg_id="m1")
    first = cbor2.loads(chunks[0])
    assert list(first) == ["v", "type", "id", "index", "count", "size", "sha256", "data"]
    assert first["type"] == "chunk" and first["id"] == "m1" and first["index"] == 0
    assert first["count"] == len(chunks) and first["size"] == 1024
    assert first["sha256"] == hashlib.sha256(payload).hexdigest()
    assert b"".join(cbor2.loads(c)["data"] for c in chunks) == payload
    assert all(is_chunk(c) for c in chunks) and not is_chunk(payload) and not is_chunk(b"")
    assert not is_chunk(encode_update(make_update(2, 2)))


def test_split_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        split_message(b"", "t", 100)
    with pytest.raises(ValueError, match="msg_id"):
        split_message(b"x" * 500, "t", 100, msg_id="bad id")
    with pytest.raises(ValueError, match="too small"):
        split_message(b"x" * 500, "t", 130)


def _chunk(**kw: object) -> bytes:
    base: dict[str, object] = {
        "id": "m",
        "index": 0,
        "count": 2,
        "size": 4,
        "sha256": "0" * 64,
        "data": b"ab",
    }
    base.update(kw)
    return cbor2.dumps({"v": 1, "type": "chunk", **base})  # raw: no int()/bytes() coercion on the way


def test_encode_chunk_matches_raw_layout() -> None:
    assert encode_chunk(Chunk("m", 0, 2, 4, "0" * 64, b"ab")) == _chunk()


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (_chunk(index=2), "bad_chunk"),
        (_chunk(count=5), "bad_chunk"),
        (_chunk(data=b""), "bad_chunk"),
        (_chunk(data=b"abcde"), "bad_chunk"),
        (_chunk(size=10**9), "too_large"),
        (_chunk(id="a b"), "bad_value"),
        (_chunk(sha256="XYZ"), "bad_value"),
        (_chunk(index=-1), "bad_value"),
        (_chunk(count=True), "wrong_type"),
        (_chunk(data="ab"), "wrong_type"),
        (_chunk(extra=1), "unknown_key"),
        (cbor2.dumps({"v": 1, "type": "chunk"}), "missing_key"),
        (cbor2.dumps({"v": 1, "type": "update"}), "wrong_type"),
        (_chunk()[:-1], "bad_cbor"),
        (_chunk() + b"\x00", "trailing_bytes"),
        (b"\xbb" + b"\xff" * 8, "too_large"),  # map of 2**64-1 pairs: refused before allocation
        (b"x" * 2000, "too_large"),
    ],
)
def test_decode_chunk_rejects_with_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_chunk(payload, max_chunk_bytes=1000, max_message_bytes=1000)
    assert info.value.reason == reason


def test_reassembler_all_or_nothing_on_bad_checksum() -> None:
    payload = b"0123456789" * 100
    chunks = split_message(payload, "t", 200, msg_id="m")
    tampered = cbor2.loads(chunks[1])
    tampered["data"] = bytes([tampered["data"][0] ^ 1]) + tampered["data"][1:]
    r = Reassembler()
    for c in [chunks[0], cbor2.dumps(tampered), *chunks[2:-1]]:
        assert r.feed("t", c) is None
    with pytest.raises(DecodeError) as info:
        r.feed("t", chunks[-1])
    assert info.value.reason == "bad_checksum"
    assert len(r) == 0  # nothing kept; nothing delivered (every feed returned None or raised)


def test_reassembler_duplicates_and_conflicts() -> None:
    payload = b"abcdefghij" * 50
    chunks = split_message(payload, "t", 150, msg_id="m")
    r = Reassembler()
    assert r.feed("t", chunks[0]) is None
    assert r.feed("t", chunks[0]) is None  # QoS 1 re-delivery: ignored
    other = cbor2.loads(chunks[0])
    other["data"] = b"Z" * len(other["data"])
    with pytest.raises(DecodeError, match="chunk_conflict"):
        r.feed("t", cbor2.dumps(other))
    wrong_sha = cbor2.loads(chunks[1])
    wrong_sha["sha256"] = "f" * 64
    with pytest.raises(DecodeError, match="chunk_conflict"):
        r.feed("t", cbor2.dumps(wrong_sha))
    # the same id on another key is another set
    assert r.feed("other/topic", chunks[1]) is None and len(r) == 2
    for c in chunks[1:-1]:
        assert r.feed("t", c) is None
    assert r.feed("t", chunks[-1]) == payload
    assert r.feed("t", chunks[-1]) is None and len(r) == 1  # late duplicate after completion: ignored


def test_reassembler_expires_abandoned_sets() -> None:
    clock = FakeClock()
    r = Reassembler(expiry_s=30.0, clock=clock)
    a = split_message(b"a" * 600, "t", 200, msg_id="a")
    b = split_message(b"b" * 600, "t", 200, msg_id="b")
    r.feed("t", a[0])
    clock.t += 20
    r.feed("t", b[0])
    clock.t += 15  # a idle 35 s, b idle 15 s
    assert r.expire() == 1 and len(r) == 1
    for c in a[1:]:  # a's remaining chunks form a new, incomplete set: nothing half-old is delivered
        assert r.feed("t", c) is None
    for c in b[1:-1]:
        assert r.feed("t", c) is None
    assert r.feed("t", b[-1]) == b"b" * 600


def test_reassembler_bounded_sets_and_bytes() -> None:
    small = 1000 + 9 * CHUNK_ENTRY_BYTES  # 1,000 bytes in 9 chunks: data and each chunk's bookkeeping
    big_set = 2000 + 17 * CHUNK_ENTRY_BYTES
    r = Reassembler(max_sets=2, max_total_bytes=4400, max_message_bytes=2000, max_chunk_bytes=300)
    msgs = {name: split_message(name.encode() * 1000, "t", 250, msg_id=name) for name in "xyz"}
    assert {len(m) for m in msgs.values()} == {9}
    r.feed("t", msgs["x"][0])
    r.feed("t", msgs["y"][0])
    assert len(r) == 2
    r.feed("t", msgs["z"][0])  # evicts x, the least recently active
    assert len(r) == 2 and r.evicted_total == 1 and r.reserved_bytes == 2 * small
    big = split_message(b"w" * 2000, "t", 250, msg_id="w")
    assert len(big) == 17
    r.feed("t", big[0])  # 2000 declared bytes in 17 chunks: both others evicted to stay under 4400
    assert len(r) == 1 and r.evicted_total == 3 and r.reserved_bytes == big_set
    with pytest.raises(DecodeError) as info:
        r.feed("t", split_message(b"v" * 2001, "t", 250, msg_id="v")[0])
    assert info.value.reason == "too_large"
    with pytest.raises(ValueError, match="max_total_bytes"):
        Reassembler(max_total_bytes=10, max_message_bytes=11)


def test_hostile_reassembler_a_senders_new_sets_evict_its_own_then_the_largest_holders() -> None:
    """One key's stream of new sets never evicts another key's message in progress."""
    r = Reassembler(max_sets=3, max_total_bytes=8 << 20, max_message_bytes=4 << 20, max_chunk_bytes=300)
    honest = split_message(b"h" * 1000, "t", 250, msg_id="h")
    r.feed("update/a", honest[0])
    for i in range(50):  # first chunks of 4 MiB sets: two would not fit 8 MiB beside anything
        r.feed("update/x", encode_chunk(Chunk(f"x{i}", 0, 64, 4 << 20, "0" * 64, b"\0" * 100)))
    assert r.evicted_total == 49 and len(r) == 2
    other = split_message(b"o" * 1000, "t", 250, msg_id="o")
    for c in other:  # another sender's set: the 4 MiB holder makes room, not update/a
        out = r.feed("update/b", c)
    assert out == b"o" * 1000 and r.evicted_total == 49
    r.feed("update/c", split_message(b"c" * 1000, "t", 250, msg_id="c")[0])
    r.feed("update/d", split_message(b"d" * 1000, "t", 250, msg_id="d")[0])  # 3 sets: x's goes
    assert r.evicted_total == 50
    for c in honest[1:-1]:
        assert r.feed("update/a", c) is None
    assert r.feed("update/a", honest[-1]) == b"h" * 1000


def test_reassembler_refuses_a_set_of_a_million_one_byte_chunks() -> None:
    """Declared sizes bound the data; the chunk count bounds the bookkeeping (a dict entry per chunk)."""
    r = Reassembler(max_sets=2, max_total_bytes=2 << 20, max_message_bytes=1 << 20, max_chunk_bytes=300)
    n = 1_000_000
    tiny = encode_chunk(Chunk("m", 0, n, n, hashlib.sha256(b"x" * n).hexdigest(), b"x"))
    with pytest.raises(DecodeError) as info:
        r.feed("t", tiny)
    assert info.value.reason == "too_large" and len(r) == 0 and r.reserved_bytes == 0


# --- a real broker with max_packet_size below the update size ---------------------------------------


class Collector:
    """A raw paho subscriber (MQTT 5) collecting payloads of one topic."""

    def __init__(self, port: int, topic: str) -> None:
        self.payloads: list[bytes] = []
        self.got = threading.Event()
        self.ready = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"col-{uuid.uuid4().hex[:8]}",
            protocol=MQTTProtocolVersion.MQTTv5,
        )

        def on_connect(c: mqtt.Client, u: object, f: object, rc: object, p: object) -> None:
            c.subscribe(topic, 1)

        def on_subscribe(c: mqtt.Client, u: object, mid: int, rcs: object, p: object) -> None:
            self.ready.set()

        def on_message(c: mqtt.Client, u: object, msg: mqtt.MQTTMessage) -> None:
            self.payloads.append(bytes(msg.payload))
            self.got.set()

        self.client.on_connect = on_connect
        self.client.on_subscribe = on_subscribe
        self.client.on_message = on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert self.ready.wait(10)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.subprocess
def test_chunking_through_mosquitto_with_max_packet_size(tmp_path: Path) -> None:
    limit = 4096
    broker = start_mosquitto(tmp_path, extra=f"max_packet_size {limit}")
    topic = f"edgefl/t{uuid.uuid4().hex[:8]}/update/dev-1"
    update = make_update(400, 10)
    payload = encode_update(update)
    assert publish_packet_bytes(topic, len(payload)) > 3 * limit  # a 16 KB update, a 4 KB limit
    collector = Collector(broker.port, topic)
    try:

        async def main() -> None:
            tx = MqttTransport("127.0.0.1", broker.port, f"pub-{uuid.uuid4().hex[:8]}", protocol="5")
            await tx.start(wait_s=10)
            try:
                # a packet of exactly `limit` bytes (the size chunks are cut to) goes through
                exact = b"e" * max_payload_bytes(limit, topic)
                await tx.publish(topic, exact, qos=1, timeout_s=10)
                for chunk in split_message(payload, topic, limit, msg_id=update.update_id):
                    await tx.publish(topic, chunk, qos=1, timeout_s=10)
                assert tx.connected.is_set()
            finally:
                await tx.stop()

        asyncio.run(main())
        expected = 1 + len(split_message(payload, topic, limit))
        deadline = time.monotonic() + 10
        while len(collector.payloads) < expected and time.monotonic() < deadline:
            collector.got.wait(0.05)
            collector.got.clear()
        assert len(collector.payloads) == expected
        r = Reassembler(max_chunk_bytes=limit)
        whole = None
        assert collector.payloads[0] == b"e" * max_payload_bytes(limit, topic)
        for p in collector.payloads[1:]:
            assert publish_packet_bytes(topic, len(p)) <= limit
            out = r.feed(topic, p)
            if out is not None:
                whole = out
        assert whole == payload
        got = decode_update(whole)
        assert np.array_equal(got.delta_W, update.delta_W) and got.update_id == update.update_id
    finally:
        collector.close()
        stop_broker(broker)


@pytest.mark.subprocess
def test_chunking_oversized_packet_is_refused_by_mosquitto(tmp_path: Path) -> None:
    """The same broker drops a publisher whose packet is over the limit: why nothing may exceed it.

    mosquitto 2.0.11 compares the Remaining Length (not the whole packet, as MQTT 5.0 §3.2.2.3.6
    says) with ``max_packet_size``, so it lets through up to 1 + 2 bytes more than the limit;
    :func:`max_payload_bytes` follows the specification and is the stricter of the two.
    """
    limit = 4096
    broker = start_mosquitto(tmp_path, extra=f"max_packet_size {limit}")
    topic = f"edgefl/t{uuid.uuid4().hex[:8]}/update/dev-1"
    collector = Collector(broker.port, topic)
    reasons: list[str] = []
    disconnected = threading.Event()

    def on_disconnect(c: mqtt.Client, u: object, f: object, rc: object, p: object) -> None:
        reasons.append(str(rc))
        disconnected.set()

    pub = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"big-{uuid.uuid4().hex[:8]}",
        protocol=MQTTProtocolVersion.MQTTv5,
    )
    pub.on_disconnect = on_disconnect
    try:
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        over = b"o" * (max_payload_bytes(limit, topic) + 100)
        assert publish_packet_bytes(topic, len(over)) == limit + 100
        pub.publish(topic, over, qos=1)
        assert disconnected.wait(10)
        assert reasons[0] == "Packet too large"
        assert not collector.got.wait(0.5)
        assert collector.payloads == []
    finally:
        pub.loop_stop()
        collector.close()
        stop_broker(broker)
