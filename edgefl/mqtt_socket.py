"""The MQTT client's socket: bounded bulk reads cut into whole packets, PUBLISH parsed, writes gathered.

Source: MQTT 5.0 (OASIS 2019) §2.1, §3.3; MQTT 3.1.1 (OASIS 2014); tcp(7); paho-mqtt 2.x client API.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from typing import Any, NamedTuple

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTProtocolVersion


class Publish(NamedTuple):
    """A PUBLISH of QoS 0 or 1 read from the socket, not yet acknowledged (``mid`` 0 for QoS 0)."""

    mid: int
    qos: int
    topic: str
    payload: bytes
    retain: bool


#: Topic of the stand-in for an oversize PUBLISH (MQTT 5.0 §4.7.2); payload ``b"<bytes>\n<topic>"``.
OVERSIZE_TOPIC = "$edgefl/oversize"
#: Bytes asked of the socket in one read (a burst in one system call), the bound of what waits above it.
READ_BYTES = 65_536


class PacketFilter:
    """Incoming MQTT byte stream filter: replace every PUBLISH over ``limit`` bytes before it is buffered.

    Its body is discarded in bounded pieces and a stand-in on :data:`OVERSIZE_TOPIC` (same flags and
    packet identifier) takes its place, so paho acknowledges it. Memory: the fixed header, the topic and
    one read. ``limit`` counts the fixed header (>= 2); ``mqtt5`` gives the stand-in a property list.

    Source: MQTT 5.0 §2.1.1, MQTT 3.1.1 §2.2 (fixed header).
    """

    _HDR, _PASS, _VH, _DISCARD = range(4)

    def __init__(self, limit: int, *, mqtt5: bool) -> None:
        self.limit = limit
        self.mqtt5 = mqtt5
        self._state = self._HDR
        self._hdr = bytearray()
        self._left = 0  # bytes of the current packet still to pass (PASS) or to consume (VH, DISCARD)
        self._vh = bytearray()
        self._size = 0
        self.dropped_total = 0

    def _vh_need(self) -> int:
        if len(self._vh) < 2:
            return 2
        qos = (self._hdr[0] >> 1) & 3
        return 2 + int.from_bytes(self._vh[:2], "big") + (2 if qos else 0)

    def feed(self, data: bytes) -> bytes:
        """Consume ``data`` read from the broker; the bytes paho may see (maybe none).

        ConnectionError on a malformed Remaining Length, an oversize packet that is not a PUBLISH, or an
        oversize PUBLISH too short for its own variable header.
        """
        if self._state == self._PASS and len(data) <= self._left:  # the common case: no copy
            self._left -= len(data)
            if self._left == 0:
                self._state = self._HDR
            return data
        out = bytearray()
        view = memoryview(data)
        while view:
            if self._state in (self._PASS, self._DISCARD):  # the rest of a packet: passed on, or dropped
                n = min(self._left, len(view))
                if self._state == self._PASS:
                    out += view[:n]
                view = view[n:]
                self._left -= n
                if self._left == 0:
                    self._state = self._HDR
            elif self._state == self._HDR:
                self._hdr.append(view[0])
                view = view[1:]
                if len(self._hdr) >= 2 and not self._hdr[-1] & 0x80:
                    out += self._header_done()
                elif len(self._hdr) > 5:
                    raise ConnectionError("malformed MQTT remaining length from the broker")
            else:  # VH
                n = min(self._vh_need() - len(self._vh), len(view), self._left)
                self._vh += view[:n]
                view = view[n:]
                self._left -= n
                if len(self._vh) >= 2 and len(self._vh) == self._vh_need():
                    out += self._stand_in()
                    self._state = self._DISCARD if self._left else self._HDR
                elif self._left == 0:
                    raise ConnectionError("oversize PUBLISH shorter than its variable header")
        return bytes(out)

    def _header_done(self) -> bytes:
        remaining = _varint(self._hdr, 1, len(self._hdr))[0]
        hdr = bytes(self._hdr)
        self._size = len(hdr) + remaining
        if self._size <= self.limit:
            self._hdr.clear()
            self._left = remaining
            self._state = self._PASS if remaining else self._HDR
            return hdr
        if hdr[0] >> 4 != 3:
            raise ConnectionError(
                f"broker sent a {self._size}-byte packet (type {hdr[0] >> 4}) over our limit"
            )
        self._left = remaining
        self._vh.clear()
        self._state = self._VH
        return b""

    def _stand_in(self) -> bytes:
        """A PUBLISH on OVERSIZE_TOPIC with the original flags and packet identifier (MQTT 5.0 §3.3)."""
        flags = self._hdr[0]
        qos = (flags >> 1) & 3
        topic_len = int.from_bytes(self._vh[:2], "big")
        topic = bytes(self._vh[2 : 2 + min(topic_len, 256)])
        packet_id = bytes(self._vh[2 + topic_len :]) if qos else b""
        sentinel = OVERSIZE_TOPIC.encode()
        body = (
            len(sentinel).to_bytes(2, "big")
            + sentinel
            + packet_id
            + (b"\x00" if self.mqtt5 else b"")
            + f"{self._size}\n".encode()
            + topic
        )
        self._hdr.clear()
        self._vh.clear()
        self.dropped_total += 1
        return bytes([flags]) + remaining_length(len(body)) + body


def _varint(buf: bytearray, pos: int, end: int) -> tuple[int, int, bool]:
    """The variable byte integer at ``buf[pos:end]`` (MQTT 5.0 §1.5.5): value, position after, complete."""
    value, shift = 0, 0
    while pos < end:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos, True
        shift += 7
    return value, pos, False


def remaining_length(n: int) -> bytes:
    """Encode ``n`` >= 0 as an MQTT variable byte integer ("Remaining Length"): 7 bits a byte.

    Source: MQTT 5.0 §1.5.5; MQTT 3.1.1 §2.2.3 (the same encoding).
    """
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


class BoundedClient(mqtt.Client):
    """paho's client with bulk, bounded reads (:class:`PacketFilter`) and gathered writes, driven by the loop.

    A PUBLISH of QoS 0 or 1 is parsed here (:meth:`edgefl_take`), any other packet handed to paho.
    Uses paho 2.x internals: ``_sock_recv``, ``_sock_send``, ``_sock_close`` (overridden), ``_sock``,
    ``_last_msg_in``, ``_sockpairR`` / ``_sockpairW``.

    Source: MQTT 5.0 §2.1.4 (Remaining Length), §3.3 (PUBLISH); MQTT 3.1.1 §3.3.
    """

    def __init__(self, *args: Any, max_incoming_packet_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._edgefl_mqtt5 = kwargs.get("protocol") == MQTTProtocolVersion.MQTTv5
        self._edgefl_filter = PacketFilter(max_incoming_packet_bytes, mqtt5=self._edgefl_mqtt5)
        self._edgefl_out = bytearray()  # read and let through the filter, not yet taken
        self._edgefl_eof = False  # the broker closed the connection (paho is told on its next read)
        self._edgefl_allowed = 0  # bytes of the buffer paho may read: the one packet handed to it
        self._edgefl_wbuf = bytearray()  # written by paho, not yet sent

    def edgefl_drop_sockpair(self) -> None:
        """Close the socket pair paho's own loop wakes its ``select`` with (nothing selects on it here)."""
        for name in ("_sockpairR", "_sockpairW"):
            pair = getattr(self, name, None)
            if pair is not None:
                with contextlib.suppress(OSError):
                    pair.close()
                setattr(self, name, None)

    def edgefl_send(self) -> bool:
        """Send what paho wrote since the last call, in one system call; True when nothing is left."""
        wbuf, sock = self._edgefl_wbuf, self._sock
        if wbuf and sock is not None:
            try:
                sent = sock.send(wbuf)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return False  # the kernel's send buffer is full: the caller waits for writability
            del wbuf[:sent]
        return not wbuf

    def edgefl_unsent(self) -> bool:
        """True while paho has packets queued or their bytes wait in the gathered writes."""
        return bool(self._edgefl_wbuf) or self.want_write()

    def edgefl_take(self) -> Publish | bool:
        """Take the next whole packet: a :class:`Publish` (QoS 0 or 1), True, or False.

        True: another packet, or the end of the connection, which paho handled; False: none is whole and
        the socket is dry. ConnectionError for a malformed stream or a closed socket; OSError.
        """
        buf = self._edgefl_out
        while True:
            size = len(buf)
            remaining, start, whole = _varint(buf, 1, min(size, 5))
            if whole and size >= start + remaining:
                return self._edgefl_packet(start, start + remaining)
            if self._edgefl_eof:
                buf.clear()  # a packet cut by the end of the stream never completes
                self._edgefl_allowed = 0
                self.loop_read()  # paho reads the end of the stream and reports the connection lost
                return True
            try:
                data = super()._sock_recv(READ_BYTES)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return False
            if not data:
                self._edgefl_eof = True
                continue
            quickack(self._sock)
            buf += self._edgefl_filter.feed(data)

    def _edgefl_packet(self, start: int, end: int) -> Publish | bool:
        """The whole packet ``buf[:end]`` (its variable header from ``start``): parsed, or paho's."""
        buf = self._edgefl_out
        first = buf[0]
        qos = (first >> 1) & 3
        if first >> 4 == 3 and qos < 2:
            pos = start + 2 + int.from_bytes(buf[start : start + 2], "big")
            # not UTF-8 (MQTT 5.0 §1.5.4): U+FFFD names no topic of ours, so it is refused, acknowledged
            topic = buf[start + 2 : pos].decode("utf-8", errors="replace")
            if pos + (2 if qos else 0) <= end:
                mid = 0
                if qos:
                    mid = int.from_bytes(buf[pos : pos + 2], "big")
                    pos += 2
                if self._edgefl_mqtt5:  # the properties (none is used: no topic alias was offered)
                    length, pos, _ = _varint(buf, pos, end)
                    pos += length
                if pos <= end:
                    publish = Publish(mid, qos, topic, bytes(buf[pos:end]), bool(first & 1))
                    del buf[:end]
                    self._last_msg_in = time.monotonic()  # paho's keep-alive clock: a packet came
                    return publish
        self._edgefl_allowed = end
        try:
            self.loop_read()  # paho reads exactly this packet from the buffer (_sock_recv)
        finally:
            self._edgefl_allowed = 0
        return True

    def edgefl_close(self) -> None:
        """Close the socket if it is still open (paho's ``on_socket_close`` callback runs first)."""
        self._sock_close()

    def _sock_recv(self, bufsize: int) -> bytes:
        # paho reads only the packet edgefl_take handed to it, or the end of the stream
        allowed = self._edgefl_allowed
        if not allowed:
            if self._edgefl_eof and not self._edgefl_out:
                return b""
            raise BlockingIOError  # nothing for paho now (it says MQTT_ERR_AGAIN)
        n = min(bufsize, allowed)
        out = bytes(self._edgefl_out[:n])
        del self._edgefl_out[:n]
        self._edgefl_allowed = allowed - len(out)
        return out

    def _sock_send(self, buf: bytes | bytearray) -> int:
        if self._sock is None:
            raise ConnectionError("self._sock is None")
        self._edgefl_wbuf += buf
        return len(buf)

    def _sock_close(self) -> None:
        sock = self._sock
        if sock is not None and self._edgefl_wbuf:
            with contextlib.suppress(OSError, ValueError):  # best effort: the connection is ending
                sock.send(self._edgefl_wbuf)
        self._edgefl_wbuf.clear()
        super()._sock_close()


TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)
"""Linux's ``TCP_QUICKACK`` socket option (None elsewhere: nothing is set)."""


def quickack(sock: Any) -> None:
    """Acknowledge what was just read at once, not after the delayed-ACK timer (Linux; set at every read).

    A broker running Nagle's algorithm otherwise holds its next small write up to 40 ms for our ACK.

    Source: tcp(7), ``TCP_QUICKACK``; RFC 1122 §4.2.3.2 (delayed ACK); RFC 896 (Nagle).
    """
    if TCP_QUICKACK is not None and sock is not None:
        with contextlib.suppress(OSError, AttributeError, ValueError):
            sock.setsockopt(socket.IPPROTO_TCP, TCP_QUICKACK, 1)


def set_nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    """Disable Nagle's algorithm on the broker socket: a round's small exchanges would stall ~40 ms each."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
