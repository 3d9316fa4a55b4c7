"""MQTT transport: paho-mqtt 2.x (callback API v2) bridged into asyncio.

paho runs its network loop in its own thread (``loop_start``); its callbacks only hop to the event
loop with ``call_soon_threadsafe`` (STYLE.md rule 6) and never raise into paho's thread. Every public
call is async with a timeout. QoS 1 publishes are tracked by ``mid`` until their PUBACK. Incoming
messages go through a bounded queue (the RAM cap covers buffers too); when it is full the message is
dropped and counted.

Source: MQTT 5.0 (OASIS 2019) and MQTT 3.1.1 (OASIS 2014); paho-mqtt 2.x client API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.reasoncodes import ReasonCode

from edgefl.aio import wait_event, within
from edgefl.errors import TransportError
from edgefl.wire.chunking import publish_packet_bytes

logger = logging.getLogger(__name__)

# Patchable timing constants (tests shorten them instead of sleeping).
RECONNECT_MIN_S = 1
RECONNECT_MAX_S = 30
CONNECT_TIMEOUT_S = 10.0


def _set_nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    """Disable Nagle's algorithm on the broker socket (paho ``on_socket_open``).

    A round is a few small request/response exchanges; with Nagle on both ends and delayed ACKs, each
    costs ~40 ms of stall on loopback (bench/round_overhead.py: 95.8 ms → 11.1 ms per round with
    TCP_NODELAY here and ``set_tcp_nodelay true`` in mosquitto).
    """
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass(frozen=True, slots=True)
class Message:
    """One received MQTT message: ``topic`` (str), ``payload`` (bytes), ``retain`` (bool)."""

    topic: str
    payload: bytes
    retain: bool


@dataclass(frozen=True, slots=True)
class Will:
    """Last will: published by the broker (retained) if the client vanishes without a clean stop."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


class MqttTransport:
    """An asyncio-facing MQTT client.

    Parameters
    ----------
    host : str
    port : int
    client_id : str
        MQTT client identifier (unique per broker).
    will : Will or None
        Last will, set before connecting.
    protocol : "auto" | "5" | "3.1.1"
        "auto" tries MQTT 5 and falls back to 3.1.1 when the broker refuses it.
    keepalive_s : int
        Keepalive interval in seconds.
    queue_size : int
        Bound of the incoming-message queue (messages).
    username, password : str or None
        Broker credentials.
    tls_context : ssl.SSLContext or None
        TLS settings (server certificate verification, optional client certificate).
    on_connect : callable or None
        Called on the event loop after every successful CONNACK (used to publish "online").
    max_packet_bytes : int
        Largest PUBLISH packet this client may send (the profile's ``broker.max_packet_bytes``); the
        broker's CONNACK Maximum Packet Size lowers it further. Default: MQTT's own maximum.
    session_expiry_s : int
        0 = clean session. Otherwise ask the broker to keep this client's session (subscriptions and
        queued QoS 1 messages) for that many seconds while it is away (MQTT 5 Session Expiry
        Interval, §3.1.2.11; MQTT 3.1.1 clean session 0), so nothing published meanwhile is lost. Needs
        a fixed ``client_id``.
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
        username: str | None = None,
        password: str | None = None,
        tls_context: ssl.SSLContext | None = None,
        on_connect: Callable[[], None] | None = None,
        max_packet_bytes: int = 268_435_455,
        session_expiry_s: int = 0,
    ) -> None:
        self.host = host
        self.port = port
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
        self.queue: asyncio.Queue[Message] = asyncio.Queue(maxsize=queue_size)
        self.dropped_total = 0
        self.callback_errors_total = 0
        self.connected = asyncio.Event()
        self.ever_connected = False
        self._lost_logged = False
        self._subscriptions: dict[str, int] = {}
        self._pending: dict[int, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: mqtt.Client | None = None
        self._mqtt5 = protocol in ("auto", "5")
        self._session_lost = asyncio.Event()
        self._fallback_wanted = False
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False
        self._unreachable_logged = False
        self.connects_total = 0
        self.broker_max_packet_bytes: int | None = None  # MQTT 5 CONNACK Maximum Packet Size, when sent

    # --- paho thread side: hop to the loop, never raise -------------------------------------
    def _hop(self, fn: Callable[..., None], *args: Any) -> None:
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

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, rc: ReasonCode, props: Any) -> None:
        limit = getattr(props, "MaximumPacketSize", None) if props is not None else None
        self._hop(self._handle_connect, rc, limit)

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, rc: ReasonCode, props: Any
    ) -> None:
        self._hop(self._handle_disconnect, rc)

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, rc: ReasonCode, props: Any) -> None:
        self._hop(self._handle_puback, mid, rc)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        self._hop(self._handle_message, Message(msg.topic, bytes(msg.payload), bool(msg.retain)))

    # --- loop side -------------------------------------------------------------------------
    def _handle_connect(self, rc: ReasonCode, max_packet: int | None = None) -> None:
        if rc.is_failure:
            logger.warning("broker %s:%s refused the connection: %s", self.host, self.port, rc)
            if self._mqtt5 and self.protocol == "auto" and int(rc.value) in (1, 132):
                self._fallback_wanted = True
            self._session_lost.set()
            return
        assert self._client is not None
        for topic, qos in self._subscriptions.items():
            self._client.subscribe(topic, qos)
        if self.ever_connected and self._lost_logged:
            logger.info("broker back: %s:%s", self.host, self.port)
        elif not self.ever_connected:
            logger.info(
                "connected to broker %s:%s (MQTT %s)", self.host, self.port, "5" if self._mqtt5 else "3.1.1"
            )
        self._lost_logged = False
        self.ever_connected = True
        self.broker_max_packet_bytes = int(max_packet) if max_packet else None
        self._unreachable_logged = False
        self.connects_total += 1
        self.connected.set()
        if self.on_connect_cb is not None:
            self.on_connect_cb()

    def _handle_disconnect(self, rc: ReasonCode) -> None:
        if self.protocol == "auto" and self._mqtt5 and not self.ever_connected:
            # 3.1.1-only brokers (amqtt) close the socket on an MQTT 5 CONNECT instead of answering it.
            self._fallback_wanted = True
        was = self.connected.is_set()
        self.connected.clear()
        self._session_lost.set()
        if was and not self._lost_logged and not self._stopping:
            self._lost_logged = True
            logger.warning("broker lost: %s:%s (%s)", self.host, self.port, rc)

    def _handle_puback(self, mid: int, rc: ReasonCode) -> None:
        fut = self._pending.pop(mid, None)
        if fut is not None and not fut.done():
            if rc.is_failure:
                fut.set_exception(TransportError(f"publish mid={mid} refused by broker: {rc}"))
            else:
                fut.set_result(None)

    def _handle_message(self, msg: Message) -> None:
        try:
            self.queue.put_nowait(msg)
        except asyncio.QueueFull:
            self.dropped_total += 1
            logger.warning(
                "incoming queue full: dropped message on %s (%d bytes)", msg.topic, len(msg.payload)
            )

    def _make_client(self) -> mqtt.Client:
        proto = MQTTProtocolVersion.MQTTv5 if self._mqtt5 else MQTTProtocolVersion.MQTTv311
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=proto,
            reconnect_on_failure=False,
            clean_session=None if self._mqtt5 else not self.session_expiry_s,
        )
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_message = self._on_message
        client.on_socket_open = _set_nodelay
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

        Parameters
        ----------
        wait_s : float or None
            Seconds to wait for the first CONNACK; None = do not wait (the broker may be down:
            the caller keeps working and the transport connects when the broker appears).

        Raises
        ------
        TransportError
            If ``wait_s`` is given and no connection succeeded within it.
        """
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._supervisor = asyncio.create_task(self._supervise(), name=f"mqtt-supervisor-{self.client_id}")
        if wait_s is None:
            return
        try:
            await within(self.connected.wait(), wait_s)
        except TimeoutError as exc:
            raise TransportError(f"no connection to broker {self.host}:{self.port} after {wait_s} s") from exc

    @staticmethod
    def backoff_s(failures: int, rng: random.Random | None = None) -> float:
        """Delay before reconnect attempt ``failures`` (>= 1): full jitter over an exponential cap.

        ``uniform(0, min(RECONNECT_MAX_S, RECONNECT_MIN_S * 2 ** (failures - 1)))`` seconds, so a fleet
        that lost its broker at the same instant does not reconnect in lock-step.

        Source: M. Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015 ("Full Jitter").
        """
        cap = min(float(RECONNECT_MAX_S), float(RECONNECT_MIN_S) * 2.0 ** max(0, failures - 1))
        return (rng or random).uniform(0.0, cap)

    def _connect(self, client: mqtt.Client) -> None:
        """Blocking connect (run in a thread); asks for a persistent session when ``session_expiry_s`` > 0."""
        if not self._mqtt5:
            client.connect(self.host, self.port, self.keepalive_s)
            return
        props = None
        if self.session_expiry_s:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            props.SessionExpiryInterval = int(self.session_expiry_s)
        client.connect(
            self.host, self.port, self.keepalive_s, clean_start=not self.session_expiry_s, properties=props
        )

    async def _supervise(self) -> None:
        """Own the connection: connect, wait until it is lost, back off with jitter, reconnect.

        A fresh paho client per connection (paho's own reconnect is off), so the protocol can fall back
        from MQTT 5 to 3.1.1 when a broker refuses MQTT 5 before any CONNACK. paho's network thread
        runs only while a connection is up; the event loop never blocks (connect runs in a thread).
        """
        failures = 0
        while not self._stopping:
            client = self._make_client()
            self._client = client
            self._session_lost = asyncio.Event()
            self._fallback_wanted = False
            connects_before = self.connects_total
            try:
                await asyncio.to_thread(self._connect, client)
            except (OSError, ValueError, ssl.SSLError) as exc:
                if not self._unreachable_logged:
                    self._unreachable_logged = True
                    logger.warning(
                        "broker %s:%s unreachable (%s); retrying with backoff", self.host, self.port, exc
                    )
                failures += 1
                await asyncio.sleep(self.backoff_s(failures))
                continue
            client.loop_start()
            await self._session_lost.wait()
            await asyncio.to_thread(client.loop_stop)
            if self._stopping:
                break
            if self._fallback_wanted and self._mqtt5 and self.protocol == "auto":
                logger.info("broker %s:%s does not speak MQTT 5; using 3.1.1", self.host, self.port)
                self._mqtt5 = False
                continue
            failures = 1 if self.connects_total > connects_before else failures + 1
            await asyncio.sleep(self.backoff_s(failures))

    async def subscribe(self, topic: str, qos: int = 1) -> None:
        """Subscribe now (if connected) and again after every reconnect."""
        self._subscriptions[topic] = qos
        if self._client is not None and self.connected.is_set():
            self._client.subscribe(topic, qos)

    async def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, timeout_s: float = 10.0
    ) -> None:
        """Publish and, for QoS 1, wait for the broker's PUBACK.

        Parameters
        ----------
        topic : str
        payload : bytes
        qos : int (0 or 1)
        retain : bool
        timeout_s : float
            Seconds to wait for the PUBACK.

        Raises
        ------
        TransportError
            If not started, the publish was refused, or no PUBACK arrived within ``timeout_s``.
        """
        if self._loop is None:
            raise TransportError("publish before start()")
        limit = min(self.max_packet_bytes, self.broker_max_packet_bytes or self.max_packet_bytes)
        if publish_packet_bytes(topic, len(payload), qos=qos) > limit:
            # Never send it: brokers drop a client over an oversized packet, and a retry would loop.
            raise TransportError(f"publish to {topic}: {len(payload)} bytes exceed the {limit}-byte limit")
        if self._client is None or not self.connected.is_set():
            # Each connection has its own paho client: a message queued on a dead one would never leave.
            raise TransportError(f"publish to {topic}: not connected to {self.host}:{self.port}")
        fut: asyncio.Future[None] = self._loop.create_future()
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            raise TransportError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
        if qos == 0:
            return
        self._pending[info.mid] = fut
        if info.is_published():  # PUBACK already processed before we registered the mid
            self._pending.pop(info.mid, None)
            return
        try:
            await within(fut, timeout_s)
        except TimeoutError as exc:
            self._pending.pop(info.mid, None)
            raise TransportError(f"no PUBACK for {topic} (mid={info.mid}) within {timeout_s} s") from exc

    async def stop(self, final: tuple[str, bytes] | None = None, timeout_s: float = 5.0) -> None:
        """Clean stop: publish a final retained message (e.g. "offline"), disconnect, end the threads.

        Parameters
        ----------
        final : (topic, payload) or None
            Published retained with QoS 1 and waited for (PUBACK) before disconnecting.
        timeout_s : float
            Time budget for the final publish and for the disconnect.
        """
        if self._supervisor is None:
            return
        if final is not None and self.connected.is_set():
            try:
                await self.publish(final[0], final[1], qos=1, retain=True, timeout_s=timeout_s)
            except TransportError as exc:
                logger.warning("final status not acknowledged: %s", exc)
        self._stopping = True
        client = self._client
        if client is not None and self.connected.is_set():
            client.disconnect()
            await wait_event(self._session_lost, timeout_s)
        self._session_lost.set()
        self._supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._supervisor
        self._supervisor = None
        if client is not None:
            await asyncio.to_thread(client.loop_stop)
        self.connected.clear()
