"""The MQTT client: connection lifecycle, subscriptions and publishes, async with timeouts (paho-mqtt 2.x).

One paho client per connection on :class:`edgefl.mqtt_link.Link`; only the blocking connect runs in
a thread. QoS 1 publishes and subscribes wait for their acknowledgement and fail with TransportError
when the connection is lost; reconnects back off with full jitter; MQTT 5 falls back to 3.1.1.

Source: MQTT 5.0 (OASIS 2019) and MQTT 3.1.1 (OASIS 2014); paho-mqtt 2.x client API.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from edgefl.aio import wait_event, within
from edgefl.errors import BrokerRefused, TransportError
from edgefl.mqtt_link import Connection, Link
from edgefl.mqtt_socket import BoundedClient, Publish, set_nodelay
from edgefl.validators import MQTT_MAX_PACKET_BYTES
from edgefl.wire.chunking import publish_packet_bytes

if TYPE_CHECKING:
    from edgefl.profiles import BrokerConfig

logger = logging.getLogger(__name__)

# Patchable timing constants (tests shorten them instead of sleeping).
RECONNECT_MIN_S = 1
RECONNECT_MAX_S = 30
CONNECT_TIMEOUT_S = 10.0
SUBACK_TIMEOUT_S = 10.0
TAKEOVER_WINDOW_S = 10.0
"""A connection closed without a reason this soon after its CONNACK counts towards :data:`TAKEOVER_LOSSES`."""
TAKEOVER_LOSSES = 3
"""Such closes in a row: another client takes the client id's session at each connect (MQTT 5.0 §3.1.4)."""


@dataclass(frozen=True, slots=True)
class Will:
    """Last will: published by the broker (retained) if the client vanishes without a clean stop."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


def _decade(n: int) -> bool:
    """True for 1, 10, 100, 1000... (a repeated event logged at these counts)."""
    return n > 0 and str(n).rstrip("0") == "1"


def _retrieve_all(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Mark the outcome of futures nobody will await as seen (no "exception was never retrieved")."""
    for fut in futures:
        fut.add_done_callback(lambda f: None if f.cancelled() else f.exception())


class MqttTransport(Link):
    """An asyncio-facing MQTT client.

    ``client_id`` is unique on the broker; ``will`` is set before connecting; ``protocol`` "auto" tries
    MQTT 5, then 3.1.1; ``queue_size`` bounds the incoming queue (messages); ``on_connect`` runs on the
    loop after every CONNACK and re-subscription. ``max_packet_bytes``, ``max_incoming_packet_bytes``:
    as ``docs/operations.md`` says of ``broker.*`` (an oversize PUBLISH counts in ``oversize_dropped_total``).
    ``session_expiry_s`` 0 is a clean session, else the broker keeps it that long (MQTT 5.0 §3.1.2.11;
    a fixed ``client_id``); ``alternates`` (host, port): other nodes of a clustered broker, tried round
    robin; ``ack_on_commit`` acknowledges a QoS 1 message only at :meth:`commit` (needs a session);
    ``receive_maximum``: the broker's QoS 1 messages in flight to us (MQTT 5.0 §3.1.2.11.3; 0: ``queue_size``;
    less leaves QoS 0 messages room beside unacknowledged ones);
    ``reconnect_max_s`` caps the back-off (None: ``RECONNECT_MAX_S``); ``max_held_bytes`` bounds the
    payload bytes received and not yet handled (0: none; :class:`Link`).
    """

    def __init__(
        self,
        host: str,
        port: int,
        client_id: str,
        *,
        will: Will | None = None,
        protocol: str = "auto",
        keepalive_s: int = 30,
        queue_size: int = 256,
        max_held_bytes: int = 0,
        username: str | None = None,
        password: str | None = None,
        tls_context: ssl.SSLContext | None = None,
        on_connect: Callable[[], None] | None = None,
        max_packet_bytes: int = 268_435_455,
        max_incoming_packet_bytes: int = 268_435_455,
        session_expiry_s: int = 0,
        alternates: Sequence[tuple[str, int]] = (),
        ack_on_commit: bool = False,
        reconnect_max_s: float | None = None,
        receive_maximum: int = 0,
    ) -> None:
        super().__init__(
            queue_size=queue_size,
            ack_on_commit=ack_on_commit,
            max_incoming_packet_bytes=max_incoming_packet_bytes,
            max_held_bytes=max_held_bytes,
        )
        self.host = host
        self.port = port
        self.addresses: tuple[tuple[str, int], ...] = ((host, port), *alternates)
        self._address_i = 0
        self.client_id = client_id
        self.will = will
        self.protocol = protocol
        self.keepalive_s = keepalive_s
        self.username = username
        self.password = password
        self.tls_context = tls_context
        self.on_connect_cb = on_connect
        self.max_packet_bytes = max_packet_bytes
        self.session_expiry_s = session_expiry_s
        self.reconnect_max_s = reconnect_max_s
        self.receive_maximum = receive_maximum or queue_size
        self.subscribe_failures_total = 0
        self.connected = asyncio.Event()
        self.ever_connected = False
        self._lost_logged = False
        self._quick_losses = 0  # connections in a row closed soon after their CONNACK (_note_takeover)
        #: Connections another client with our client id took over (0x8E, or closed soon after CONNACK).
        self.takeovers_total = 0
        #: Of those, the certain ones (:meth:`_note_takeover`; a broker restart alone is never one).
        self.sure_takeovers_total = 0
        #: Connect attempts that failed (the broker unreachable, refused TLS, a bad address).
        self.connect_failures_total = 0
        self._subscriptions: dict[str, tuple[int, bool]] = {}  # topic -> (qos, live_only)
        # unsubscribed without an UNSUBACK yet (topic -> the latest call's token): sent once more on connect
        self._unsubscribing: dict[str, object] = {}
        self._mqtt5 = protocol in ("auto", "5")
        self._fallback_wanted = False
        self._supervisor: asyncio.Task[None] | None = None
        self._ready_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._unreachable_logged = False
        self._closed_logged = False
        self.connects_total = 0
        #: The broker's last CONNACK refusal (None once a connection is accepted).
        self.last_refusal: ReasonCode | None = None
        #: CONNACKs in a row that refused our credentials (:attr:`credentials_refused`); 0 once accepted.
        self.auth_refusals = 0
        #: Why the broker's certificate failed verification at the last try (None once a handshake passed).
        self.last_tls_refusal: str | None = None
        #: Connection attempts in a row whose broker certificate failed verification; 0 once one passed.
        self.tls_refusals = 0
        #: Set at every CONNACK refusal and certificate failure (the caller clears it).
        self.refused = asyncio.Event()
        #: Why the last connection attempt failed, in words (None once a CONNACK accepts one).
        self.last_error: str | None = None
        self.broker_max_packet_bytes: int | None = None  # MQTT 5 CONNACK Maximum Packet Size, when sent
        #: The last CONNACK's Session Present (MQTT 5.0 §3.2.2.1.1): False, what came while away is gone.
        self.session_present = False

    @classmethod
    def for_broker(cls, broker: BrokerConfig, client_id: str, **options: Any) -> MqttTransport:
        """A transport (not started) to a profile's ``[broker]``, ``options`` (``__init__`` keywords) on top.

        ConfigError if the password or TLS files cannot be read.
        """
        from edgefl.profiles import broker_password
        from edgefl.tlsconf import ssl_context_for

        kwargs: dict[str, Any] = {
            "protocol": broker.protocol,
            "keepalive_s": broker.keepalive_s,
            "username": broker.username,
            "password": broker_password(broker),
            "max_packet_bytes": broker.max_packet_bytes,
            "max_incoming_packet_bytes": broker.max_incoming_packet_bytes,
            "alternates": broker.alternate_addresses,
            **options,
        }
        if "tls_context" not in kwargs:
            kwargs["tls_context"] = ssl_context_for(broker)
        return cls(broker.host, broker.port, client_id, **kwargs)

    @property
    def _client(self) -> BoundedClient | None:
        return self._conn.client if self._conn is not None else None

    @property
    def credentials_refused(self) -> bool:
        """True when the broker's last CONNACK refused our credentials (MQTT 5.0 §3.2.2.2: 0x86, 0x87)."""
        return self.last_refusal is not None and int(self.last_refusal.value) in (0x86, 0x87)

    @property
    def certificate_refused(self) -> bool:
        """True when the broker's certificate failed verification at the last try (``last_tls_refusal``)."""
        return self.last_tls_refusal is not None

    def packet_limit(self) -> int:
        """Largest PUBLISH packet we may send now: the smaller of the profile's and the broker's limit."""
        return min(self.max_packet_bytes, self.broker_max_packet_bytes or self.max_packet_bytes)

    def counters(self) -> dict[str, int]:
        """Transport counters for the status and ``/metrics`` (all monotonic since start)."""
        return {
            "connects": self.connects_total,
            "queue_dropped": self.dropped_total,
            "oversize_dropped": self.oversize_dropped_total,
            "callback_errors": self.callback_errors_total,
            "refused": self.refused_total,
            "thread_errors": self.thread_errors_total,
            "subscribe_failures": self.subscribe_failures_total,
        }

    def _bind(self, conn: Connection) -> None:
        """Point paho's callbacks at ``conn``: each only schedules a handler (STYLE.md rule 6)."""
        guarded = self._guarded

        def on_connect(client: Any, userdata: Any, flags: Any, rc: ReasonCode, props: Any) -> None:
            limit = getattr(props, "MaximumPacketSize", None) if props is not None else None
            present = bool(getattr(flags, "session_present", False))
            self._hop(self._handle_connect, conn, rc, limit, present)

        def on_disconnect(client: Any, userdata: Any, flags: Any, rc: ReasonCode, props: Any) -> None:
            from_broker = bool(getattr(flags, "is_disconnect_packet_from_server", False))
            self._hop(self._handle_disconnect, conn, rc, from_broker)

        def on_publish(client: Any, userdata: Any, mid: int, rc: ReasonCode, props: Any) -> None:
            self._hop(self._handle_puback, conn, mid, rc)

        def on_subscribe(client: Any, userdata: Any, mid: int, rcs: list[ReasonCode], props: Any) -> None:
            self._hop(self._handle_ack, conn.subacks, mid, list(rcs))

        def on_unsubscribe(client: Any, userdata: Any, mid: int, rcs: list[ReasonCode], props: Any) -> None:
            self._hop(self._handle_ack, conn.unsubacks, mid, list(rcs))

        def on_message(client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
            got = Publish(msg.mid, msg.qos, msg.topic, bytes(msg.payload), bool(msg.retain))
            self._hop(self._deliver, conn, got)

        c = conn.client
        c.on_connect = guarded("on_connect", on_connect)
        c.on_disconnect = guarded("on_disconnect", on_disconnect)
        c.on_publish = guarded("on_publish", on_publish)
        c.on_subscribe = guarded("on_subscribe", on_subscribe)
        c.on_unsubscribe = guarded("on_unsubscribe", on_unsubscribe)
        c.on_message = guarded("on_message", on_message)
        c.on_socket_open = guarded("on_socket_open", set_nodelay)

    # --- loop side -------------------------------------------------------------------------
    def _handle_connect(
        self, conn: Connection, rc: ReasonCode, max_packet: int | None = None, session_present: bool = False
    ) -> None:
        if conn is not self._conn:
            return
        conn.answered = True
        self.last_tls_refusal, self.tls_refusals = None, 0  # the TLS handshake (if any) passed
        if rc.is_failure:
            if self.last_refusal is None or self.last_refusal != rc:
                logger.warning("broker %s:%s refused the connection: %s", self.host, self.port, rc)
            self.last_refusal = rc
            self.last_error = f"the broker refused the connection: {rc}"
            if self.credentials_refused:
                self.auth_refusals += 1
            self.refused.set()
            if self._mqtt5 and self.protocol == "auto" and int(rc.value) in (1, 132):
                self._fallback_wanted = True
            conn.lost.set()
            return
        self.broker_max_packet_bytes = int(max_packet) if max_packet else None
        self.last_refusal = self.last_error = None
        self.auth_refusals = 0
        self.session_present = session_present
        conn.acked = True
        conn.acked_at = time.monotonic()
        # each unsubscribe still unanswered, once more before the subscriptions, then forgotten whatever
        # comes of it (a broker closing the connection on it must not get it at every reconnect)
        pending, self._unsubscribing = self._unsubscribing, {}
        unsubacks = [self._send_unsubscribe(conn, topic) for topic in sorted(pending)]
        subacks = [
            self._send_subscribe(conn, topic, qos, live_only)
            for topic, (qos, live_only) in self._subscriptions.items()
        ]
        self._ready_task = asyncio.create_task(
            self._ready(conn, subacks, unsubacks), name=f"mqtt-ready-{self.client_id}"
        )

    async def _ready(
        self,
        conn: Connection,
        subacks: list[tuple[str, asyncio.Future[list[ReasonCode]]]],
        unsubacks: list[tuple[str, asyncio.Future[list[ReasonCode]]]],
    ) -> None:
        """After CONNACK: wait for the renewed SUBACKs, then set ``connected``; then log failed UNSUBACKs."""
        for topic, fut in subacks:
            try:
                self._check_suback(topic, await within(fut, SUBACK_TIMEOUT_S))
            except (TransportError, TimeoutError) as exc:
                if conn.closed:
                    _retrieve_all([f for _, f in (*subacks, *unsubacks)])
                    return
                self.subscribe_failures_total += 1
                logger.warning("subscription to %s not renewed: %s", topic, exc or "no SUBACK")
        if conn is not self._conn or conn.closed:
            _retrieve_all([f for _, f in unsubacks])
            return
        if self.ever_connected and self._lost_logged:
            logger.info("broker back: %s:%s", self.host, self.port)
        elif not self.ever_connected:
            logger.info(
                "connected to broker %s:%s (MQTT %s)", self.host, self.port, "5" if self._mqtt5 else "3.1.1"
            )
        self._lost_logged = False
        self.ever_connected = True
        self._unreachable_logged = False
        self.connects_total += 1
        self.connected.set()
        if self.on_connect_cb is not None:
            self.on_connect_cb()
        for topic, fut in unsubacks:
            try:
                self._check_unsuback(topic, await within(fut, SUBACK_TIMEOUT_S))
            except TimeoutError:
                logger.warning("unsubscribe from %s: no UNSUBACK (not sent again)", topic)
            except TransportError as exc:
                logger.warning("%s (not sent again)", exc)

    def _loss_reason(self, rc: object, from_broker: bool) -> str:
        """Why a connection ended, in words: the broker's DISCONNECT reason, else what may have closed it."""
        cid = repr(self.client_id) + (f" or account {self.username!r}" if self.username else "")
        if isinstance(rc, ReasonCode) and from_broker:
            if int(rc.value) == 0x8E:  # MQTT 5.0 §3.14.2.1 Session taken over
                return f"session taken over: another client connected with client id {cid}"
            return f"the broker disconnected us: {rc}"
        if isinstance(rc, ReasonCode):
            return (
                "connection closed without a reason: the broker stopped, the network dropped, or "
                f"another client connected with client id {cid} and took over the session"
            )
        return str(rc)

    def _note_takeover(self, conn: Connection, from_broker: bool, rc: object) -> None:
        """Count takeovers (0x8E, or a quick close); sure ones (0x8E, TAKEOVER_LOSSES) logged at decades."""
        quick = conn.acked and time.monotonic() - conn.acked_at < TAKEOVER_WINDOW_S
        taken = from_broker and isinstance(rc, ReasonCode) and int(rc.value) == 0x8E
        if not (taken or (quick and not from_broker)) or self._stopping:
            self._quick_losses = 0
            return
        self.takeovers_total += 1
        self._quick_losses += 1
        if not (taken or self._quick_losses >= TAKEOVER_LOSSES):
            return
        self.sure_takeovers_total += 1
        if _decade(self.sure_takeovers_total):
            logger.error(
                "session taken over by another client with our client id %d time(s) since start (the "
                "broker %s:%s closed the connection %s): another client probably uses client id %s and "
                "takes over the session at each connect (one client id per process; with "
                "use_username_as_clientid, one account per process%s)",
                self.sure_takeovers_total,
                self.host,
                self.port,
                "with Session taken over" if taken else f"within {TAKEOVER_WINDOW_S:.0f} s of accepting it",
                repr(self.client_id) + (f" or account {self.username!r}" if self.username else ""),
                f": account {self.username!r} is in use elsewhere" if self.username else "",
            )

    def _handle_disconnect(self, conn: Connection, rc: object, from_broker: bool = False) -> None:
        if conn is not self._conn:
            return
        self._note_takeover(conn, from_broker, rc)
        if self.protocol == "auto" and self._mqtt5 and not self.ever_connected and not conn.answered:
            # 3.1.1-only brokers (amqtt) close the socket on an MQTT 5 CONNECT instead of answering it.
            self._fallback_wanted = True
        was = self.connected.is_set()
        self.connected.clear()
        conn.fail_all(f"connection to {self.host}:{self.port} lost before the acknowledgement")
        conn.lost.set()
        if not conn.acked and self.last_refusal is None:
            self.last_error = "the broker closed the connection before any CONNACK" + (
                f": {rc}" if isinstance(rc, str) else ""
            )
        if was and not self._lost_logged and not self._stopping:
            self._lost_logged = True
            why = self._loss_reason(rc, from_broker)
            logger.warning("broker lost: %s:%s (%s)", self.host, self.port, why)

    def _handle_puback(self, conn: Connection, mid: int, rc: ReasonCode) -> None:
        fut = conn.pubacks.pop(mid, None)
        if fut is not None and not fut.done():
            if rc.is_failure:
                fut.set_exception(BrokerRefused(f"refused by broker: {rc}", "", int(rc.value)))
            else:
                fut.set_result(None)

    @staticmethod
    def _handle_ack(
        waiting: dict[int, asyncio.Future[list[ReasonCode]]], mid: int, rcs: list[ReasonCode]
    ) -> None:
        """A SUBACK or UNSUBACK: its reason codes to the future ``waiting`` keeps for ``mid``."""
        fut = waiting.pop(mid, None)
        if fut is not None and not fut.done():
            fut.set_result(rcs)

    def _send_subscribe(
        self, conn: Connection, topic: str, qos: int, live_only: bool = False
    ) -> tuple[str, asyncio.Future[list[ReasonCode]]]:
        """SUBSCRIBE on ``conn``; the returned future gets the SUBACK's reason codes or a TransportError."""
        if live_only and self._mqtt5:  # MQTT 5.0 §3.8.3.1: Retain Handling 2, Retain As Published
            opts = SubscribeOptions(
                qos=qos, retainAsPublished=True, retainHandling=SubscribeOptions.RETAIN_DO_NOT_SEND
            )
            rc, mid = conn.client.subscribe(topic, options=opts)
        else:
            rc, mid = conn.client.subscribe(topic, qos)
        return topic, self._ack_future(conn, conn.subacks, rc, mid, f"subscribe to {topic}")

    def _ack_future(
        self,
        conn: Connection,
        waiting: dict[int, asyncio.Future[list[ReasonCode]]],
        rc: int,
        mid: int | None,
        what: str,
    ) -> asyncio.Future[list[ReasonCode]]:
        """The future (kept in ``waiting``) of packet ``mid``'s SUBACK/UNSUBACK; failed at once if unsent."""
        assert self._loop is not None
        fut: asyncio.Future[list[ReasonCode]] = self._loop.create_future()
        if rc != mqtt.MQTT_ERR_SUCCESS or mid is None:
            fut.set_exception(TransportError(f"{what} failed: {mqtt.error_string(rc)}"))
        elif conn.closed:
            fut.set_exception(TransportError(f"{what}: connection lost"))
        else:
            waiting[mid] = fut
        return fut

    @staticmethod
    def _check_suback(topic: str, rcs: list[ReasonCode]) -> None:
        """Raise TransportError if the SUBACK refused the subscription (MQTT 5.0 §3.9.3; 3.1.1 0x80)."""
        if len(rcs) != 1:
            raise TransportError(f"subscribe to {topic}: SUBACK carries {len(rcs)} reason codes, expected 1")
        if rcs[0].is_failure:
            raise BrokerRefused(f"subscribe to {topic} refused by broker: {rcs[0]}", topic, int(rcs[0].value))

    def _make_client(self) -> BoundedClient:
        proto = MQTTProtocolVersion.MQTTv5 if self._mqtt5 else MQTTProtocolVersion.MQTTv311
        client = BoundedClient(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=proto,
            reconnect_on_failure=False,
            manual_ack=True,  # PUBACK once queued (see the module docstring)
            clean_session=None if self._mqtt5 else not self.session_expiry_s,
            max_incoming_packet_bytes=self.max_incoming_packet_bytes,
        )
        client.suppress_exceptions = True
        client.max_queued_messages_set(64)
        if self.username is not None:
            client.username_pw_set(self.username, self.password)
        if self.tls_context is not None:
            client.tls_set_context(self.tls_context)
        if self.will is not None:
            client.will_set(self.will.topic, self.will.payload, self.will.qos, self.will.retain)
        return client

    async def start(self, *, wait_s: float | None = CONNECT_TIMEOUT_S) -> None:
        """Start connecting, and reconnecting forever in the background, from an asyncio task.

        ``wait_s``: seconds to wait for the first CONNACK (TransportError if none; None: do not wait).
        """
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._supervisor = asyncio.create_task(self._supervise(), name=f"mqtt-supervisor-{self.client_id}")
        if wait_s is None:
            return
        end = self._loop.time() + wait_s
        while not self.connected.is_set():  # a refusal of credentials or certificate lasts: say so now
            if self.credentials_refused:
                raise TransportError(
                    f"credentials refused by broker {self.host}:{self.port} ({self.last_refusal}): "
                    "check the username and password against the broker's password file"
                )
            if self.certificate_refused:
                raise TransportError(
                    f"broker {self.host}:{self.port}: its TLS certificate is not trusted "
                    f"({self.last_tls_refusal}): check broker.ca_file and the name or address dialled"
                )
            if self._loop.time() >= end:
                last = f" (last: {self.last_error})" if self.last_error else ""
                raise TransportError(
                    f"no connection to broker {self.host}:{self.port} after {wait_s} s{last}"
                )
            with contextlib.suppress(TimeoutError):
                await within(self.connected.wait(), min(0.2, end - self._loop.time()))

    @staticmethod
    def backoff_s(failures: int, rng: random.Random | None = None, max_s: float | None = None) -> float:
        """Delay before reconnect attempt ``failures`` (>= 1): full jitter over an exponential cap.

        ``uniform(0, min(max_s, RECONNECT_MIN_S * 2 ** (failures - 1)))`` seconds, so a fleet that lost its
        broker at once does not reconnect in lock-step.

        Source: M. Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015 ("Full Jitter").
        """
        top = float(RECONNECT_MAX_S if max_s is None else max_s)
        cap = min(top, float(RECONNECT_MIN_S) * 2.0 ** max(0, failures - 1))
        return (rng or random).uniform(0.0, cap)

    def _connect(self, client: mqtt.Client) -> None:
        """Blocking connect (run in a thread), with our Maximum Packet Size and Session Expiry on MQTT 5."""
        if not self._mqtt5:
            client.connect(self.host, self.port, self.keepalive_s)
            return
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        if self.max_incoming_packet_bytes < MQTT_MAX_PACKET_BYTES:
            props.MaximumPacketSize = int(self.max_incoming_packet_bytes)
        if self.session_expiry_s:
            props.SessionExpiryInterval = int(self.session_expiry_s)
        # the broker keeps at most this many of our QoS 1 messages unacknowledged (§3.1.2.11.3)
        props.ReceiveMaximum = max(1, min(65535, self.receive_maximum or 65535))
        client.connect(
            self.host, self.port, self.keepalive_s, clean_start=not self.session_expiry_s, properties=props
        )

    def _next_address(self) -> None:
        """Move to the next of :attr:`addresses` (a no-op with one broker)."""
        if len(self.addresses) > 1:
            self._address_i = (self._address_i + 1) % len(self.addresses)
            self.host, self.port = self.addresses[self._address_i]
            logger.info("next connection attempt: broker %s:%s", self.host, self.port)

    async def _supervise(self) -> None:
        """Own the connection: connect (a fresh paho client each time), wait for its loss, back off, again."""
        failures = 0
        while not self._stopping:
            conn = Connection(self._make_client())
            self._bind(conn)
            self._conn = conn
            self._fallback_wanted = False
            connects_before = self.connects_total
            # shielded: a stop() during the connect must not leave the thread's socket open behind
            # it (a connected client nobody reads, holding our client id until the broker's
            # keep-alive runs out); the socket is closed when the thread is done
            connect = asyncio.ensure_future(asyncio.to_thread(self._connect, conn.client))
            try:
                await asyncio.shield(connect)
            except asyncio.CancelledError:
                connect.add_done_callback(functools.partial(self._abandon, conn))
                raise
            except (OSError, ValueError, ssl.SSLError) as exc:
                conn.fail_all("connect failed")
                self._quick_losses = 0  # the broker was gone (a restart): its closes were no takeovers
                self.connect_failures_total += 1
                self.last_error = str(exc) or type(exc).__name__
                if isinstance(exc, ssl.SSLCertVerificationError):
                    # reachable, but not the broker we trust: not "unreachable" (a lasting refusal)
                    why = exc.verify_message or str(exc)
                    if why != self.last_tls_refusal:
                        logger.warning(
                            "broker %s:%s: its TLS certificate is not trusted (%s); retrying with backoff",
                            self.host,
                            self.port,
                            why,
                        )
                    self.last_tls_refusal = why
                    self.tls_refusals += 1
                    self.refused.set()
                elif not self._unreachable_logged:
                    self._unreachable_logged = True
                    logger.warning(
                        "broker %s:%s unreachable (%s); retrying with backoff", self.host, self.port, exc
                    )
                failures += 1
                self._next_address()
                await asyncio.sleep(self.backoff_s(failures, max_s=self.reconnect_max_s))
                continue
            self._drive(conn)
            await conn.lost.wait()
            self.connected.clear()
            conn.fail_all(f"connection to {self.host}:{self.port} lost before the acknowledgement")
            self._release(conn)
            if self._stopping:
                break
            if self._fallback_wanted:  # set only for "auto" on MQTT 5 (this connection's)
                logger.info(
                    "broker %s:%s closed the connection before answering MQTT 5; trying MQTT 3.1.1",
                    self.host,
                    self.port,
                )
                self._mqtt5 = False
                continue
            if not (conn.acked or self.ever_connected or self._closed_logged) and self.last_refusal is None:
                self._closed_logged = True
                logger.warning(
                    "broker %s:%s closed the connection before any CONNACK (MQTT %s)%s: not a plain "
                    "MQTT listener? (a TLS port needs mqtts://, a WebSocket port is not supported); "
                    "retrying with backoff",
                    self.host,
                    self.port,
                    "5 and 3.1.1" if self.protocol == "auto" else self.protocol,
                    (self.last_error or "").partition("CONNACK")[2],
                )
            failures = 1 if self.connects_total > connects_before else failures + 1
            self._next_address()
            await asyncio.sleep(self.backoff_s(failures, max_s=self.reconnect_max_s))

    async def subscribe(
        self, topic: str, qos: int = 1, *, live_only: bool = False, timeout_s: float = SUBACK_TIMEOUT_S
    ) -> None:
        """Subscribe, now and again after every reconnect.

        Connected, it returns once the SUBACK granted it; otherwise at once (it is sent, and its SUBACK
        awaited, before ``connected`` is next set). ``live_only`` (MQTT 5, §3.8.3.1): no retained message
        at subscribe, a later retained one arrives with ``retain`` set.

        Raises
        ------
        BrokerRefused
            If the SUBACK refused it (its reason code, e.g. 0x87 Not authorized).
        TransportError
            If no SUBACK arrived within ``timeout_s``, or the connection was lost first.
        """
        self._subscriptions[topic] = (qos, live_only)
        self._unsubscribing.pop(topic, None)
        conn = self._conn
        if conn is None or not conn.acked or conn.closed:
            return  # sent with the others on the next CONNACK
        _, fut = self._send_subscribe(conn, topic, qos, live_only)
        try:
            self._check_suback(topic, await within(fut, timeout_s))
        except TimeoutError as exc:
            raise TransportError(f"no SUBACK for {topic} within {timeout_s} s") from exc

    async def unsubscribe(self, topic: str, *, timeout_s: float = SUBACK_TIMEOUT_S) -> None:
        """Drop a subscription made with :meth:`subscribe` (not renewed after a reconnect).

        Connected, UNSUBSCRIBE is sent and its UNSUBACK awaited; not connected or left unanswered, it is
        sent once more with the next connection, then forgotten; a refusal is not sent again.

        Raises
        ------
        TransportError
            If the UNSUBACK refused it (a reason code >= 0x80), none arrived within ``timeout_s``, or the
            connection was lost first.
        """
        self._subscriptions.pop(topic, None)
        token = object()  # this call's: an answer to an earlier call must not clear a later one
        self._unsubscribing[topic] = token  # until an answer: sent once more with the next CONNACK
        conn = self._conn
        if conn is None or not conn.acked or conn.closed:
            return
        _, fut = self._send_unsubscribe(conn, topic)
        try:
            rcs = await within(fut, timeout_s)
        except TimeoutError as exc:
            raise TransportError(f"no UNSUBACK for {topic} within {timeout_s} s") from exc
        if self._unsubscribing.get(topic) is token:
            del self._unsubscribing[topic]  # answered: refused or not, sending it again cannot help
        self._check_unsuback(topic, rcs)

    def _send_unsubscribe(self, conn: Connection, topic: str) -> tuple[str, asyncio.Future[list[ReasonCode]]]:
        """UNSUBSCRIBE on ``conn``; the future gets the UNSUBACK's reason codes or a TransportError."""
        rc, mid = conn.client.unsubscribe(topic)
        return topic, self._ack_future(conn, conn.unsubacks, rc, mid, f"unsubscribe from {topic}")

    @staticmethod
    def _check_unsuback(topic: str, rcs: list[ReasonCode]) -> None:
        """Raise TransportError if the UNSUBACK refused (MQTT 5.0 §3.11.2.2; 3.1.1's carries no code)."""
        refused = [rc for rc in rcs if rc.is_failure]
        if refused:
            raise TransportError(f"unsubscribe from {topic} refused by broker: {refused[0]}")

    @property
    def subscriptions(self) -> tuple[str, ...]:
        """The topic filters subscribed (renewed after every reconnect), in the order subscribed."""
        return tuple(self._subscriptions)

    async def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, timeout_s: float = 10.0
    ) -> None:
        """Publish ``payload`` on ``topic`` and, for QoS 1, wait ``timeout_s`` for the broker's PUBACK.

        Raises
        ------
        BrokerRefused
            If the PUBACK refused it (MQTT 5: its reason code, e.g. 0x87 Not authorized).
        TransportError
            If not started, over :meth:`packet_limit`, not connected, no PUBACK arrived in time, or the
            connection was lost before it (the message may have reached the broker: QoS 1 is at least
            once).
        """
        if self._loop is None:
            raise TransportError("publish before start()")
        limit = self.packet_limit()
        if publish_packet_bytes(topic, len(payload), qos=qos, mqtt5=self._mqtt5) > limit:
            # Never send it: brokers drop a client over an oversized packet, and a retry would loop.
            raise TransportError(f"publish to {topic}: {len(payload)} bytes exceed the {limit}-byte limit")
        conn = self._conn
        if conn is None or not conn.acked or conn.closed:
            # not ``connected``: a persistent session's backlog arrives before the renewed SUBACKs
            raise TransportError(f"publish to {topic}: not connected to {self.host}:{self.port}")
        fut: asyncio.Future[None] = self._loop.create_future()
        info = conn.client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            raise TransportError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
        self._flush(conn)  # written now, not on the loop's next turn
        if qos == 0:
            return
        conn.pubacks[info.mid] = fut  # before any hop of its PUBACK can run: we have not yielded yet
        try:
            await within(fut, timeout_s)
        except TimeoutError as exc:
            if conn.pubacks.get(info.mid) is fut:  # this connection's own entry, never a newer one's
                del conn.pubacks[info.mid]
            raise TransportError(f"no PUBACK for {topic} (mid={info.mid}) within {timeout_s} s") from exc
        except BrokerRefused as exc:  # refused: name the topic (an ACL is per topic)
            raise BrokerRefused(f"publish to {topic}: {exc.detail}", topic, exc.code) from None
        except TransportError as exc:  # the connection lost before the PUBACK
            raise TransportError(f"publish to {topic}: {exc.detail}") from None

    async def stop(self, final: tuple[str, bytes] | None = None, timeout_s: float = 5.0) -> None:
        """Publish ``final`` (topic, payload) retained, await its PUBACK, disconnect (``timeout_s`` each)."""
        if self._supervisor is None:
            return
        if final is not None and self.connected.is_set():
            try:
                await self.publish(final[0], final[1], qos=1, retain=True, timeout_s=timeout_s)
            except TransportError as exc:
                logger.warning("final status not acknowledged: %s", exc)
        self._stopping = True
        conn = self._conn
        if conn is not None and self.connected.is_set():
            conn.client.disconnect()
            self._flush(conn)
            await wait_event(conn.lost, timeout_s)
        if conn is not None:
            conn.fail_all("transport stopped")
            conn.lost.set()
        self._supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._supervisor
        self._supervisor = None
        if self._ready_task is not None:
            self._ready_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ready_task
        if conn is not None:
            self._release(conn)
        self.connected.clear()
