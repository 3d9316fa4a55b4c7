"""The MQTT transport's link layer: the broker socket driven by the event loop, into a bounded queue.

A QoS 1 message is acknowledged only once it is in the bounded queue (or committed); a full queue
holds it unacknowledged (the broker's Receive Maximum bounds them), then stops reading the socket:
a burst is never acknowledged and lost. Only QoS 0 messages are dropped, counted, when it is full.

Source: MQTT 5.0 (OASIS 2019) §3.1.2.11.3, §4.9; MQTT 3.1.1 (OASIS 2014); paho-mqtt 2.x client API.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paho.mqtt.reasoncodes import ReasonCode

from edgefl.errors import TransportError
from edgefl.mqtt_socket import OVERSIZE_TOPIC, BoundedClient, Publish

logger = logging.getLogger(__name__)

#: Drops of a full incoming queue logged one by one before the log only names every 1000th.
LOGGED_DROPS = 20
#: The hold line of QoS 1 messages waiting for room in the queue, in queue sizes (beyond: dropped, counted).
HOLD_FACTOR = 4
#: Seconds between two ``loop_misc`` calls (keep-alive PINGREQ, overdue PINGRESP).
MISC_INTERVAL_S = 1.0
#: Packets read in one turn of the event loop while more bytes wait (a flood cannot hold the loop).
READS_PER_TURN = 64


@dataclass(frozen=True, slots=True)
class Message:
    """One received MQTT message: ``topic`` (str), ``payload`` (bytes), ``retain`` (bool)."""

    topic: str
    payload: bytes
    retain: bool


class FlowQueue(asyncio.Queue[Message]):
    """The incoming queue: each take lets the transport move a held QoS 1 message in (and PUBACK it)."""

    def __init__(self, maxsize: int, on_take: Callable[[Message], None]) -> None:
        super().__init__(maxsize=maxsize)
        self._on_take = on_take

    def get_nowait(self) -> Message:
        """As :meth:`asyncio.Queue.get_nowait` (``get`` ends in it too), then refill from the hold line."""
        item = super().get_nowait()
        self._on_take(item)
        return item


@dataclass(eq=False)
class Connection:
    """One paho client's life: its in-flight PUBACK and SUBACK futures, keyed by ``mid``, die with it."""

    client: BoundedClient
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    pubacks: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    subacks: dict[int, asyncio.Future[list[ReasonCode]]] = field(default_factory=dict)
    unsubacks: dict[int, asyncio.Future[list[ReasonCode]]] = field(default_factory=dict)
    acked: bool = False  # a successful CONNACK arrived
    acked_at: float = 0.0  # time.monotonic() of the successful CONNACK
    answered: bool = False  # a CONNACK arrived, accepting or refusing (the broker speaks our protocol)
    closed: bool = False
    sock: Any = None  # the socket the event loop watches (None before the connect and after the close)
    writing: bool = False  # the loop waits for the socket to be writable (the send buffer was full)
    misc: asyncio.TimerHandle | None = None  # the next ``loop_misc`` (keep-alive)
    paused: bool = False  # reading stopped: no room for another message (TCP holds the rest)
    flush_due: bool = False  # a _flush is scheduled for the loop's next turn

    def fail_all(self, reason: str) -> None:
        """Fail every pending PUBACK/SUBACK/UNSUBACK future with ``TransportError(reason)``; mark closed."""
        self.closed = True
        for futs in (self.pubacks, self.subacks, self.unsubacks):
            for mid, fut in futs.items():
                if not fut.done():
                    fut.set_exception(TransportError(f"{reason} (mid={mid})"))
            futs.clear()


class Link:
    """The receive and network half of :class:`edgefl.transport.MqttTransport` (its parameters).

    At ``max_held_bytes`` (0: none) of :meth:`held_bytes`, reading stops until the consumer frees bytes
    (a message larger than the bound is still read, alone).
    """

    def __init__(
        self, *, queue_size: int, ack_on_commit: bool, max_incoming_packet_bytes: int, max_held_bytes: int = 0
    ) -> None:
        self.max_incoming_packet_bytes = max_incoming_packet_bytes
        self.max_held_bytes = max_held_bytes
        self._kept_bytes = 0  # payload bytes in the queue and the hold line
        #: Payload bytes the consumer still holds of the messages it took (its own queue); it calls
        #: :meth:`bytes_freed` when they drop.
        self.consumer_bytes: Callable[[], int] = lambda: 0
        self.held_bytes_peak = 0  # most payload bytes held at once (:meth:`held_bytes`; with a bound)
        self.queue: asyncio.Queue[Message] = FlowQueue(queue_size, self._took)
        self.ack_on_commit = ack_on_commit
        self._unacked: dict[int, tuple[Connection, int, int]] = {}  # id(message in the queue) → its ack
        self._taken: list[tuple[Connection, int, int]] = []  # taken from the queue, not committed
        # QoS 1 messages received while the queue was full, unacknowledged (bounded: HOLD_FACTOR)
        self._held: collections.deque[tuple[Connection, int, int, Message]] = collections.deque()
        self.held_max = max(64, HOLD_FACTOR * queue_size)
        self.dropped_total = 0
        self.held_peak = 0  # most QoS 1 messages held at once, waiting for room in the queue
        self.oversize_dropped_total = 0
        self.callback_errors_total = 0
        self.refused_total = 0  # messages whose handling raised: acknowledged, counted, dropped
        self.thread_errors_total = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: Connection | None = None

    def _handle_disconnect(self, conn: Connection, rc: object, from_broker: bool = False) -> None:
        """The connection ended (:class:`edgefl.transport.MqttTransport` also logs and reconnects)."""
        conn.lost.set()

    # --- paho callbacks (on the loop, or in the connect thread): hop to the loop, never raise ----
    def _thread_error(self, where: str, exc: BaseException) -> None:
        """Count and log an exception raised in paho's network code or a socket callback (any thread)."""
        self.thread_errors_total += 1  # one int store under the GIL; read on the loop
        logger.error("error in the MQTT network loop (%s): %r", where, exc, exc_info=exc)

    def _hop(self, fn: Callable[..., None], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the event loop's next turn (thread-safe: the connect thread too)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop closing during shutdown
            loop.call_soon_threadsafe(self._guard, fn, *args)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            self.callback_errors_total += 1
            logger.exception("error in MQTT callback %s", getattr(fn, "__name__", fn))

    def _guarded(self, name: str, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn`` as a paho callback: an exception in it is counted and logged (:meth:`_thread_error`)."""

        def cb(*args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:
                self._thread_error(name, exc)

        return cb

    # --- the network loop, driven by the event loop -----------------------------------------
    def _drive(self, conn: Connection) -> None:
        """Watch ``conn``'s connected socket on the event loop (its callbacks set now, on the loop)."""
        loop = self._loop
        client = conn.client
        sock = client.socket()
        if loop is None or sock is None:
            self._handle_disconnect(conn, "socket closed during the connect")
            return
        conn.sock = sock
        client.edgefl_drop_sockpair()

        def register_write(client: Any, userdata: Any, sock: Any) -> None:
            self._flush_soon(conn)  # paho queued a packet (a PUBACK, a PINGREQ...)

        client.on_socket_register_write = self._guarded("on_socket_register_write", register_write)
        client.on_socket_close = self._guarded("on_socket_close", lambda c, u, s: self._unwatch(conn))
        loop.add_reader(sock, self._net_read, conn)
        conn.misc = loop.call_later(MISC_INTERVAL_S, self._net_misc, conn)
        self._flush(conn)  # whatever the connect could not write (normally nothing)

    def _net_read(self, conn: Connection) -> None:
        """The socket is readable: take its whole packets, up to :data:`READS_PER_TURN` a turn."""
        client = conn.client
        if conn.paused:
            return  # a read scheduled before the queue and the hold line filled
        for _ in range(READS_PER_TURN):
            if self._room() <= 0:
                self._pause_reading(conn)
                return
            try:
                got = client.edgefl_take()
            except Exception as exc:
                self._net_failed(conn, "read", exc)
                return
            if got is False:
                break  # nothing more waits: the loop watches the socket again
            if got is True:
                if conn.sock is None:
                    return  # the connection ended (on_disconnect is scheduled)
                continue
            self._deliver(conn, got)
        else:
            if self._loop is not None:
                self._loop.call_soon(self._net_read, conn)  # more is buffered: the rest next turn
        if client.edgefl_unsent():
            self._flush(conn)

    def _flush(self, conn: Connection) -> None:
        """Write what paho has queued, in one system call; ``add_writer`` while the send buffer is full."""
        conn.flush_due = False
        loop, client = self._loop, conn.client
        if loop is None or conn.sock is None:
            return
        if not self._net_step(conn, "write", client.loop_write):
            return  # closed by the write (a DISCONNECT sent, or the connection lost)
        if not self._net_step(conn, "write", client.edgefl_send):
            return
        sock = conn.sock
        if client.edgefl_unsent():
            if not conn.writing:
                loop.add_writer(sock, self._flush, conn)
                conn.writing = True
        elif conn.writing:
            loop.remove_writer(sock)
            conn.writing = False

    def _net_misc(self, conn: Connection) -> None:
        """Every :data:`MISC_INTERVAL_S`: paho's keep-alive (PINGREQ, or the end of a dead link)."""
        conn.misc = None
        if conn.sock is None or self._loop is None:
            return
        if self._net_step(conn, "keep-alive", conn.client.loop_misc):
            self._flush(conn)
            conn.misc = self._loop.call_later(MISC_INTERVAL_S, self._net_misc, conn)

    def _net_step(self, conn: Connection, where: str, step: Callable[[], object]) -> bool:
        """Run one of paho's network steps; False when the connection ended in it (or it raised)."""
        try:
            step()
        except Exception as exc:
            self._net_failed(conn, where, exc)
            return False
        return conn.sock is not None

    def _net_failed(self, conn: Connection, where: str, exc: Exception) -> None:
        """The network code raised: log it (an ``OSError`` at debug, else as a fault), end the connection."""
        if isinstance(exc, OSError):
            logger.debug("connection ended in the MQTT network loop (%s): %r", where, exc)
        else:
            self._thread_error(where, exc)
        self._release(conn)
        self._handle_disconnect(conn, f"network loop failed: {exc!r}")

    def _unwatch(self, conn: Connection) -> None:
        """Stop watching ``conn``'s socket (paho's ``on_socket_close``: before the socket closes)."""
        loop, sock = self._loop, conn.sock
        conn.sock = None
        conn.writing = False
        if conn.misc is not None:
            conn.misc.cancel()
            conn.misc = None
        if loop is not None and sock is not None and not loop.is_closed():
            with contextlib.suppress(ValueError, KeyError, OSError):
                loop.remove_reader(sock)
                loop.remove_writer(sock)

    def _abandon(self, conn: Connection, connect: asyncio.Future[None]) -> None:
        """A connect the caller stopped waiting for is over: close whatever it opened."""
        if not connect.cancelled():
            connect.exception()  # retrieved (a failed connect opened nothing to close)
        self._release(conn)

    def _release(self, conn: Connection) -> None:
        """The connection is over: stop watching its socket and close it if paho has not."""
        self._unwatch(conn)
        with contextlib.suppress(Exception):
            conn.client.edgefl_close()

    def _deliver(self, conn: Connection, got: Publish) -> None:
        """A PUBLISH read: to :meth:`_receive`, or an oversize stand-in counted, logged and acknowledged."""
        if got.topic != OVERSIZE_TOPIC:
            self._receive(conn, got.mid, got.qos, Message(got.topic, got.payload, got.retain))
            return
        size, _, topic = got.payload.partition(b"\n")
        self.oversize_dropped_total += 1
        logger.warning(
            "dropped a %s-byte message on %s: over our %d-byte packet limit (not buffered)",
            size.decode(errors="replace"),
            topic.decode(errors="replace"),
            self.max_incoming_packet_bytes,
        )
        self._ack(conn, got.mid, got.qos)  # dropped, but its flow-control slot freed

    def _flush_soon(self, conn: Connection) -> None:
        """:meth:`_flush` on the loop's next turn, once for all the packets queued in this one."""
        if not conn.flush_due and self._loop is not None:
            conn.flush_due = True
            self._loop.call_soon(self._flush, conn)

    def _ack(self, conn: Connection, mid: int, qos: int) -> None:
        """PUBACK ``mid`` on the connection it came on, with the other packets of this turn."""
        if qos > 0 and not conn.closed:
            conn.client.ack(mid, qos)
            self._flush_soon(conn)

    def _receive(self, conn: Connection, mid: int, qos: int, msg: Message) -> None:
        """Take one incoming message; one whose handling raises is still acknowledged, counted, logged."""
        if self.max_held_bytes:
            self.held_bytes_peak = max(self.held_bytes_peak, self.held_bytes() + len(msg.payload))
        try:
            self._handle_message(conn, mid, qos, msg)
        except Exception as exc:
            self.refused_total += 1
            n = self.refused_total
            if n <= LOGGED_DROPS or n % 1000 == 0:
                logger.error(
                    "refused message on %s (%d bytes): handling failed: %s: %s%s",
                    msg.topic,
                    len(msg.payload),
                    type(exc).__name__,
                    exc,
                    f" ({n} refused so far; every 1000th logged)" if n > LOGGED_DROPS else "",
                )
            self._unacked.pop(id(msg), None)  # acknowledged here, never again at a commit
            with contextlib.suppress(Exception):  # a connection closed meanwhile: nothing to ack
                self._ack(conn, mid, qos)

    def _handle_message(self, conn: Connection, mid: int, qos: int, msg: Message) -> None:
        if not self._held and not self.queue.full():
            self._kept_bytes += len(msg.payload)
            self._enqueue(conn, mid, qos, msg)
            return
        if qos > 0 and len(self._held) < self.held_max:
            self._kept_bytes += len(msg.payload)
            self._held.append((conn, mid, qos, msg))  # acknowledged when it moves into the queue
            self.held_peak = max(self.held_peak, len(self._held))
            return
        self.dropped_total += 1
        self._ack(conn, mid, qos)
        n = self.dropped_total
        if n <= LOGGED_DROPS or n % 1000 == 0:  # a flood must not become a flood of log lines
            logger.warning(
                "incoming queue full: dropped message on %s (%d bytes)%s",
                msg.topic,
                len(msg.payload),
                f" ({n} dropped so far; every 1000th logged)" if n > LOGGED_DROPS else "",
            )

    def _enqueue(self, conn: Connection, mid: int, qos: int, msg: Message) -> None:
        """Put a message in the queue; acknowledge it now, or (``ack_on_commit``) at its commit."""
        self.queue.put_nowait(msg)
        if self.ack_on_commit and qos > 0:
            self._unacked[id(msg)] = (conn, mid, qos)
        else:
            self._ack(conn, mid, qos)

    def _took(self, msg: Message) -> None:
        """The consumer took ``msg``: its ack waits for :meth:`commit`; held messages move in."""
        ack = self._unacked.pop(id(msg), None)
        if ack is not None:
            self._taken.append(ack)
        self._kept_bytes -= len(msg.payload)
        self._refill()

    def commit(self) -> None:
        """Acknowledge every message taken from the queue so far (``ack_on_commit``; else a no-op).

        Call it once what they changed is on disk (one lost with its connection comes again).
        """
        taken, self._taken = self._taken, []
        for conn, mid, qos in taken:
            self._ack(conn, mid, qos)

    def _refill(self) -> None:
        """Move held QoS 1 messages into the queue while it has room, acknowledging each."""
        while self._held and not self.queue.full():
            conn, mid, qos, msg = self._held.popleft()
            if conn.closed:
                self._kept_bytes -= len(msg.payload)
                continue  # unacknowledged on a lost connection: the broker sends it again (session)
            self._enqueue(conn, mid, qos, msg)
        self.bytes_freed()

    def held_bytes(self) -> int:
        """Payload bytes received and not yet handled: queued, held, and the consumer's."""
        return self._kept_bytes + self.consumer_bytes()

    def bytes_freed(self) -> None:
        """Resume reading if it stopped and there is room again (the consumer calls it as it frees bytes)."""
        live = self._conn
        if live is not None and live.paused and self._room() >= min(READS_PER_TURN, self.held_max // 2):
            self._resume_reading(live)

    def _room(self) -> int:
        """Messages the queue and hold line can still take (0 at ``max_held_bytes``)."""
        if self.max_held_bytes and self.held_bytes() >= self.max_held_bytes:
            return 0
        if self.queue.maxsize <= 0:
            return READS_PER_TURN  # an unbounded queue: never full
        return self.queue.maxsize - self.queue.qsize() + self.held_max - len(self._held)

    def _pause_reading(self, conn: Connection) -> None:
        """Stop reading ``conn``'s socket (TCP flow control) until the queue has room (:meth:`_refill`)."""
        conn.paused = True
        if conn.sock is not None and self._loop is not None:
            self._loop.remove_reader(conn.sock)

    def _resume_reading(self, conn: Connection) -> None:
        """Watch ``conn``'s socket again, and read now what waits above it (TLS, PacketFilter)."""
        conn.paused = False
        if conn.sock is not None and self._loop is not None:
            self._loop.add_reader(conn.sock, self._net_read, conn)
            self._loop.call_soon(self._net_read, conn)
