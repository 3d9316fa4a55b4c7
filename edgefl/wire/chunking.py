"""Chunking: messages larger than the broker's packet limit travel as chunk messages, reassembled boundedly.

Every chunk's whole PUBLISH fits the limit; the :class:`Reassembler` holds bounded sets, expires them
and verifies SHA-256, all or nothing. ``docs/protocol.md`` ("Chunks"). Source: MQTT 5.0 (OASIS 2019)
§2.1.4 (Remaining Length), §3.3 (PUBLISH), §3.1.2.11.4 and §3.2.2.3.6 (Maximum Packet Size); MQTT
3.1.1 §2.2.3, §3.3.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import re
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import cbor2

from edgefl.errors import DecodeError
from edgefl.wire.cbor import (
    SCHEMA_VERSION,
    Limits,
    MessageType,
    cbor_head_bytes,
    dump_message,
    load_message,
    read_int,
    read_text,
)
from edgefl.wire.reasons import Reason

logger = logging.getLogger(__name__)

_ID_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
_MQTT_MAX_REMAINING: Final = 268_435_455  # largest Remaining Length (4-byte variable byte integer)
_KEYS: Final = ("id", "index", "count", "size", "sha256", "data")
# every chunk we encode starts with these bytes (map header, "v": 1, "type": "chunk")
_PREFIX: Final = cbor2.dumps({"v": SCHEMA_VERSION, "type": MessageType.CHUNK.value, **dict.fromkeys(_KEYS)})[
    : 1 + 2 + 1 + 5 + 6
]


def _varint_bytes(value: int) -> int:
    """Length of an MQTT variable byte integer (MQTT 5.0 §1.5.5): 7 bits a byte, 1 to 4 bytes."""
    return min(4, max(1, -(-value.bit_length() // 7)))


def publish_overhead(topic: str, payload_bytes: int, *, qos: int = 1, mqtt5: bool = True) -> int:
    """Bytes a PUBLISH packet adds around a payload of ``payload_bytes``: fixed header, topic, packet id.

    ``mqtt5`` adds the (empty: paho sends none) property list, an upper bound for MQTT 3.1.1 too; QoS > 0
    adds the packet identifier.
    Source: MQTT 5.0 §3.3.1 (fixed header), §3.3.2 (variable header), §2.2.2 (properties).
    """
    variable = 2 + len(topic.encode("utf-8")) + (2 if qos > 0 else 0) + (1 if mqtt5 else 0)
    return 1 + _varint_bytes(variable + payload_bytes) + variable


def publish_packet_bytes(topic: str, payload_bytes: int, *, qos: int = 1, mqtt5: bool = True) -> int:
    """Size of the whole PUBLISH packet, bytes: :func:`publish_overhead` + ``payload_bytes``."""
    return payload_bytes + publish_overhead(topic, payload_bytes, qos=qos, mqtt5=mqtt5)


def max_payload_bytes(max_packet_bytes: int, topic: str) -> int:
    """Largest payload whose PUBLISH packet on ``topic`` is at most ``max_packet_bytes``.

    Sized for QoS 1 over MQTT 5 (:func:`publish_overhead`'s upper bound); ValueError if not even an
    empty payload fits.
    """
    payload = min(max_packet_bytes, _MQTT_MAX_REMAINING)
    while payload >= 0 and publish_packet_bytes(topic, payload) > max_packet_bytes:
        # the overhead is at most 2**16 + 9 bytes: one jump and at most 3 more steps
        over = publish_packet_bytes(topic, payload) - max_packet_bytes
        payload -= max(1, over)
    if payload < 0:
        raise ValueError(f"topic {topic!r:.80}: no PUBLISH fits in {max_packet_bytes} bytes")
    # the jump may overshoot by the bytes a shorter Remaining Length saved: take them back
    while publish_packet_bytes(topic, payload + 1) <= max_packet_bytes:
        payload += 1
    return payload


@dataclass(frozen=True, slots=True)
class Chunk:
    """Chunk ``index`` of ``count`` of the message ``id`` (``size`` bytes in all, ``sha256`` hex).

    ``data`` is this chunk's slice; the fields' bounds: ``docs/protocol.md`` ("Chunks").
    """

    id: str
    index: int
    count: int
    size: int
    sha256: str
    data: bytes


def encode_chunk(chunk: Chunk) -> bytes:
    """Encode a :class:`Chunk` (keys in the order of ``docs/protocol.md``, "Chunks")."""
    return dump_message(
        MessageType.CHUNK,
        {
            "id": chunk.id,
            "index": int(chunk.index),
            "count": int(chunk.count),
            "size": int(chunk.size),
            "sha256": chunk.sha256,
            "data": bytes(chunk.data),
        },
    )


def is_chunk(payload: bytes) -> bool:
    """Whether ``payload`` starts like a chunk from :func:`encode_chunk` (a cheap prefix test).

    A chunk encoded otherwise is not recognised; the message decoders then refuse it as ``wrong_type``.
    """
    return bytes(payload[: len(_PREFIX)]) == _PREFIX


def decode_chunk(
    payload: bytes, *, max_chunk_bytes: int = 1 << 20, max_message_bytes: int = 1 << 24
) -> Chunk:
    """Decode and validate one chunk of at most ``max_chunk_bytes``, its message of ``max_message_bytes``.

    DecodeError: the decoders' reasons; ``too_large`` for a ``size`` over ``max_message_bytes``;
    ``bad_chunk`` if ``index >= count``, ``count > size``, or the data is empty or longer than ``size``.
    """
    limits = Limits(max_message_bytes=max_chunk_bytes, max_depth=2, max_array_elements=16, max_items=32)
    obj = load_message(payload, limits, MessageType.CHUNK, _KEYS)
    msg_id = read_text(obj, "id", "", _ID_RE)
    count = read_int(obj, "count", "", 1)
    index = read_int(obj, "index", "", 0)
    size = read_int(obj, "size", "", 1)
    sha = read_text(obj, "sha256", "", _SHA256_RE)
    data = obj["data"]
    if type(data) is not bytes:
        raise DecodeError(Reason.WRONG_TYPE, f"data: expected a byte string, got {type(data).__name__}")
    if size > max_message_bytes:
        raise DecodeError(Reason.TOO_LARGE, f"size = {size}: whole message > {max_message_bytes} bytes")
    if index >= count:
        raise DecodeError(Reason.BAD_CHUNK, f"index = {index}: must be < count = {count}")
    if count > size:
        raise DecodeError(Reason.BAD_CHUNK, f"count = {count} > size = {size}: chunks carry >= 1 byte")
    if not 1 <= len(data) <= size:
        raise DecodeError(Reason.BAD_CHUNK, f"data: {len(data)} bytes, must be in [1, size = {size}]")
    return Chunk(id=msg_id, index=index, count=count, size=size, sha256=sha, data=data)


def split_message(
    payload: bytes, topic: str, max_packet_bytes: int, *, msg_id: str | None = None
) -> list[bytes]:
    """Cut ``payload`` into chunk messages whose PUBLISH packets on ``topic`` fit ``max_packet_bytes``.

    Returns ``[payload]`` if its packet fits, else the chunks in index order, each checked to fit (as
    :func:`max_payload_bytes`: QoS 1 over MQTT 5, an upper bound). ``msg_id`` is shared by the chunks
    (e.g. the ``update_id``: re-sent after a restart, the receiver completes a half-received set;
    default a random UUID). ValueError for an empty ``payload``, an invalid ``msg_id``, or a limit too
    small for one data byte a chunk.
    """
    if not payload:
        raise ValueError("cannot split an empty message")
    if publish_packet_bytes(topic, len(payload)) <= max_packet_bytes:
        return [bytes(payload)]
    msg_id = msg_id if msg_id is not None else uuid.uuid4().hex
    if _ID_RE.fullmatch(msg_id) is None:
        raise ValueError(f"msg_id = {msg_id!r:.80}: must match {_ID_RE.pattern}")
    budget = max_payload_bytes(max_packet_bytes, topic)
    sha = hashlib.sha256(payload).hexdigest()
    size = len(payload)

    def data_bytes(count_bound: int) -> int:
        # envelope with the widest index/count integers up to count_bound and an empty data string
        envelope = len(encode_chunk(Chunk(msg_id, count_bound, count_bound, size, sha, b""))) - 1
        room = budget - envelope
        n = room - 1
        while n > 0 and n + cbor_head_bytes(n) > room:
            n -= 1
        return n

    step = data_bytes(size)  # count <= size: a safe first bound
    if step < 1:
        raise ValueError(f"max_packet_bytes = {max_packet_bytes}: too small for a chunk on {topic!r:.80}")
    count = math.ceil(size / step)
    step = max(step, data_bytes(count))  # integers up to count are narrower: larger chunks fit
    count = math.ceil(size / step)
    chunks = []
    view = memoryview(payload)
    for i in range(count):
        enc = encode_chunk(Chunk(msg_id, i, count, size, sha, bytes(view[i * step : (i + 1) * step])))
        if publish_packet_bytes(topic, len(enc)) > max_packet_bytes:
            raise AssertionError(f"chunk {i} of {count} does not fit {max_packet_bytes} bytes")  # a bug
        chunks.append(enc)
    return chunks


@dataclass(slots=True)
class _Set:
    count: int
    size: int
    sha256: str
    last_seen: float
    parts: dict[int, bytes] = field(default_factory=dict)
    held: int = 0

    @property
    def reserved(self) -> int:
        return self.size + self.count * CHUNK_ENTRY_BYTES


CHUNK_ENTRY_BYTES = 128
"""Bookkeeping bytes charged against ``max_total_bytes`` for each chunk a set may hold, beside its data."""


class Reassembler:
    """Collects chunks into whole messages, with bounded memory and expiry.

    At most ``max_sets`` partial messages reserving at most ``max_total_bytes`` (>= ``max_message_bytes``;
    :data:`CHUNK_ENTRY_BYTES` a chunk beside the data) are held. A new set makes room from its own
    key's (sender's) older sets first, then from the key reserving the most bytes (its least recently
    active set), so one sender's stream of new sets never evicts another sender's message in progress.
    ``max_message_bytes``/``max_chunk_bytes`` bound what is accepted; a set with no chunk for
    ``expiry_s`` seconds (``clock``: monotonic) is abandoned. ValueError for an invalid bound.
    """

    def __init__(
        self,
        *,
        max_sets: int = 4,
        max_total_bytes: int = 8 << 20,
        max_message_bytes: int = 4 << 20,
        max_chunk_bytes: int = 1 << 20,
        expiry_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sets < 1 or max_message_bytes < 1 or max_chunk_bytes < 1 or not expiry_s > 0:
            raise ValueError("max_sets, max_message_bytes, max_chunk_bytes, expiry_s must be > 0")
        if max_total_bytes < max_message_bytes:
            raise ValueError(f"max_total_bytes = {max_total_bytes} < max_message_bytes = {max_message_bytes}")
        self.max_sets = max_sets
        self.max_total_bytes = max_total_bytes
        self._decode = functools.partial(
            decode_chunk, max_chunk_bytes=max_chunk_bytes, max_message_bytes=max_message_bytes
        )
        self.expiry_s = expiry_s
        self.clock = clock
        self._sets: OrderedDict[tuple[str, str], _Set] = OrderedDict()  # least recently active first
        self._done: deque[tuple[str, str, str]] = deque(maxlen=32)  # (key, id, sha256) recently completed
        self.evicted_total = 0

    @property
    def reserved_bytes(self) -> int:
        """What the partial messages held may come to, bytes: declared sizes and per-chunk bookkeeping."""
        return sum(s.reserved for s in self._sets.values())

    def __len__(self) -> int:
        return len(self._sets)

    def expire(self) -> int:
        """Drop sets with no chunk for ``expiry_s``; return how many (each logged)."""
        now = self.clock()
        stale = [k for k, s in self._sets.items() if now - s.last_seen > self.expiry_s]
        for k in stale:
            s = self._sets.pop(k)
            logger.warning(
                "chunk set %s on %s expired: %d of %d chunks after %.0f s",
                k[1],
                k[0],
                len(s.parts),
                s.count,
                self.expiry_s,
            )
        return len(stale)

    def _evict_for(self, key: str, size: int) -> None:
        def full() -> bool:
            return len(self._sets) >= self.max_sets or self.reserved_bytes + size > self.max_total_bytes

        while self._sets and full():
            own = next((k for k in self._sets if k[0] == key), None)  # least recently active first
            if own is None:
                held: dict[str, int] = {}
                for (sender, _), s in self._sets.items():
                    held[sender] = held.get(sender, 0) + s.reserved
                top = max(held.values())
                own = next(k for k in self._sets if held[k[0]] == top)
            s = self._sets.pop(own)
            self.evicted_total += 1
            if self.evicted_total <= 20 or self.evicted_total % 1000 == 0:
                logger.warning(
                    "chunk set %s on %s evicted (%d of %d chunks) to make room (%d evicted so far)",
                    own[1],
                    own[0],
                    len(s.parts),
                    s.count,
                    self.evicted_total,
                )

    def feed(self, key: str, payload: bytes) -> bytes | None:
        """Add one chunk from ``key`` (sets of different keys never mix); the whole message once complete.

        None while incomplete, or for a repeated chunk of a set in progress or recently completed.
        DecodeError as :func:`decode_chunk`; ``chunk_conflict`` if the chunk disagrees with its set;
        ``bad_chunk`` if the data would exceed the declared size; ``bad_checksum`` if the complete set
        does not match its SHA-256 (the set is dropped).
        """
        self.expire()
        c = self._decode(payload)
        k = (key, c.id)
        s = self._sets.get(k)
        if s is None:
            if (key, c.id, c.sha256) in self._done:
                return None  # late duplicate of a delivered message
            s = _Set(c.count, c.size, c.sha256, self.clock())
            if s.reserved > self.max_total_bytes:
                raise DecodeError(
                    Reason.TOO_LARGE,
                    f"chunk set {c.id}: {c.count} chunks of {c.size} bytes in all would hold "
                    f"{s.reserved} bytes > {self.max_total_bytes}",
                )
            self._evict_for(key, s.reserved)
            self._sets[k] = s
        elif (s.count, s.size, s.sha256) != (c.count, c.size, c.sha256):
            raise DecodeError(
                Reason.CHUNK_CONFLICT,
                f"chunk {c.index} of {c.id}: count/size/sha256 differ from the set's first chunk",
            )
        self._sets.move_to_end(k)
        s.last_seen = self.clock()
        held = s.parts.get(c.index)
        if held is not None:
            if held != c.data:
                raise DecodeError(
                    Reason.CHUNK_CONFLICT, f"chunk {c.index} of {c.id}: different data for a held index"
                )
            return None
        if s.held + len(c.data) > s.size:
            raise DecodeError(
                Reason.BAD_CHUNK, f"chunk {c.index} of {c.id}: data beyond the declared {s.size} bytes"
            )
        s.parts[c.index] = c.data
        s.held += len(c.data)
        if len(s.parts) < s.count:
            return None
        del self._sets[k]
        whole = b"".join(s.parts[i] for i in range(s.count))
        if len(whole) != s.size or hashlib.sha256(whole).hexdigest() != s.sha256:
            raise DecodeError(
                Reason.BAD_CHECKSUM,
                f"message {c.id}: {len(whole)} bytes reassembled do not match size/sha256",
            )
        self._done.append((key, c.id, c.sha256))
        return whole
