"""One coordinator per fleet: a lock on its state folder and a lease on the broker.

The state file is locked with the agents' ``flock`` (given by the composition root); its
instance is recorded beside it (``<state>.instance``) once the lease is taken. The lease is a
retained :class:`~edgefl.wire.presence.Presence` on ``<prefix>/<fleet>/coordinator``, refreshed every
``heartbeat_s`` and cleared by the holder's last will; :func:`probe_lease` reads it under a client id
of its own before the fleet's client id connects: a presence that moves is a live holder
(:class:`LeaseHeld`, exit 6), one that does not is stale, one naming this state file's previous
instance is taken over at once. Of two live holders the one that started first keeps it. The walk
through every case is ``docs/protocol.md`` ("Presence") and ``docs/operations.md`` ("One
coordinator per fleet").

Source: the MQTT "birth and last will" presence pattern (MQTT 5.0 §3.1.2.5, Will Message; §3.3.1.3,
retained messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from edgefl.errors import DecodeError, EdgeflError, TransportError
from edgefl.mqtt_link import Message
from edgefl.records import RecordError, atomic_write, decode_record, encode_record
from edgefl.transport import MqttTransport, Will
from edgefl.wire.presence import Presence, decode_presence, encode_presence

logger = logging.getLogger(__name__)


LEASE_HEARTBEAT_S: Final = 5.0
"""Seconds between two republishes of a holder's presence (a tiny retained message)."""

PROBE_RETAINED_WAIT_S: Final = 1.0
"""How long a probe waits for the retained presence after its SUBACK (it comes right after)."""

PROBE_MARGIN_S: Final = 1.0
"""Added to two heartbeats before a presence that did not move is called stale (seconds)."""

PROBE_HEARTBEAT_MAX_S: Final = 30.0
"""The longest heartbeat a probe believes (a presence claiming more is watched for two of these only)."""


class LeaseHeld(EdgeflError):
    """Another live coordinator runs this fleet (``edgefl coordinator`` exits 6).

    ``where``: what is held (``"fleet F on broker B"``, ``"state file P"``); ``holder``: who, in words.
    """

    def __init__(self, where: str, holder: str) -> None:
        super().__init__(f"another coordinator runs this fleet: {where} is held by {holder}")
        self.where = where
        self.holder = holder


def new_instance() -> str:
    """A fresh random instance id (32 lowercase hex digits)."""
    return secrets.token_hex(16)


def _host() -> str:
    return (socket.gethostname() or "unknown").replace(" ", "_")[:255]


def instance_path(state: Path) -> Path:
    """Where the instance that holds ``state``'s lock records its id: ``<state>.instance`` beside it."""
    return state.with_name(state.name + ".instance")


def record_instance(state: Path, instance: str) -> None:
    """Record ``instance`` as the coordinator of state file ``state`` (atomic, checksummed).

    Written once the lease is taken (never before: a coordinator refused with exit 6 writes nothing),
    while the state file's lock is held.

    Raises
    ------
    OSError
        If the file cannot be written.
    """
    doc = {"instance": instance, "host": _host(), "state": str(state.resolve()), "pid": os.getpid()}
    atomic_write(instance_path(state), encode_record(json.dumps(doc, sort_keys=True).encode()))


def previous_instance(state: Path) -> str | None:
    """The instance id the last coordinator of ``state`` recorded (:func:`record_instance`), if it is ours.

    Call it with the state file's lock held: that process is then gone. Only a record written on this
    host for this very state file counts (a folder copied elsewhere, or restored on another gateway,
    names another coordinator's instance as far as this one knows).

    Returns
    -------
    str or None
        The id, or None (no record, unreadable, or written for another host or state file; an
        unreadable one is logged).
    """
    path = instance_path(state)
    try:
        _, payload = decode_record(path.read_bytes())
        doc = json.loads(payload)
    except FileNotFoundError:
        return None
    except (OSError, RecordError, ValueError) as exc:
        logger.warning("%s unreadable (%s): the fleet's lease is checked as any other's", path, exc)
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("instance"), str):
        return None
    if doc.get("host") != _host() or doc.get("state") != str(state.resolve()):
        return None
    return str(doc["instance"])


def describe(p: Presence) -> str:
    """``instance 1a2b3c4d on host gw (pid 42), since 2026-12-06T04:00:00Z``."""
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(p.started))
    return f"instance {p.instance[:8]} on host {p.host} (pid {p.pid}), since {since}"


async def probe_lease(
    transport: MqttTransport,
    topic: str,
    fleet_where: str,
    connected: Callable[[MqttTransport], Awaitable[None]],
    previous: str | None = None,
    holder_topic: str | None = None,
) -> Presence | None:
    """Read the fleet's lease through ``transport`` (a client id of its own, clean session); publish nothing.

    Parameters
    ----------
    transport : MqttTransport
        Not started; started and stopped here. Give it a persistent session and ``ack_on_commit``
        (a broker that renames it to the running coordinator's client id keeps that one's messages).
    topic : str
        The lease topic (``Topics.coordinator``).
    fleet_where : str
        ``"fleet F on broker B"``, for the error.
    connected : async callable (transport) -> None
        Waits until ``transport`` is connected (raising what the caller makes of a failure).
    previous : str or None
        This state file's previous instance (:func:`previous_instance`): a presence naming it, or an
        account's session ``holder_topic`` names it the last holder of, is taken over at once.
    holder_topic : str or None
        ``Topics.coordinator_holder``.

    Returns
    -------
    Presence or None: the stale presence found (its holder is gone), or None.

    Raises
    ------
    LeaseHeld
        If a live coordinator holds the lease.
    TransportError
        What ``connected`` raises, or the broker refused the subscription.
    """
    await transport.start(wait_s=None)
    try:
        await connected(transport)
        # A probe's client id is new: a session at the broker means the broker renamed it (mosquitto's
        # use_username_as_clientid) to a running coordinator's, which it has just disconnected (its
        # will cleared the lease). Nothing taken here is acknowledged (ack_on_commit, no commit), so
        # that session keeps its messages; a live holder reconnects and republishes its presence.
        renamed = transport.session_present
        if renamed and previous is not None and holder_topic is not None:
            last = await _retained_presence(transport, holder_topic)
            if _ours(last, previous, "the broker gave the lease probe the session of"):
                return None
        if renamed:
            logger.warning(
                "the broker gave the lease probe an existing session (it names clients after their "
                "account?): waiting for its coordinator's presence"
            )
        await transport.subscribe(topic, 1)
        first_wait = 2 * LEASE_HEARTBEAT_S + PROBE_MARGIN_S if renamed else PROBE_RETAINED_WAIT_S
        first = await _next_presence(transport, topic, first_wait)
        if first is None:
            return None
        if _ours(first, previous, "the fleet's lease names", "; the broker has not cleared its lease yet"):
            return first
        wait_s = 2 * min(first.heartbeat_s, PROBE_HEARTBEAT_MAX_S) + PROBE_MARGIN_S
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        while (left := end - loop.time()) > 0:
            seen = await _next_presence(transport, topic, left)
            if seen is None:
                break
            if seen.instance != first.instance or seen.seq != first.seq:
                raise LeaseHeld(fleet_where, describe(seen))
        logger.warning(
            "the fleet's lease names %s, silent for %.0f s: stale, taken over", describe(first), wait_s
        )
        return first
    finally:
        if transport.connected.is_set():  # nothing may pile up for the probe's session
            with contextlib.suppress(TransportError):
                await transport.unsubscribe(topic)
        await transport.stop()


def _ours(p: Presence | None, previous: str | None, how: str, why: str = "") -> bool:
    """True, with an INFO line, when ``p`` names this state file's previous instance (gone: taken over)."""
    if p is None or previous is None or p.instance != previous:
        return False
    why = "gone: its state file's lock is ours" + why
    logger.info("%s %s, this state file's previous coordinator (%s): taken over", how, describe(p), why)
    return True


async def _retained_presence(transport: MqttTransport, topic: str) -> Presence | None:
    """The retained presence on ``topic`` (None: none within :data:`PROBE_RETAINED_WAIT_S`), unsubscribed.

    A subscription the broker refuses (an ACL without the topic) is None too: the caller waits instead.
    """
    try:
        await transport.subscribe(topic, 1)
    except TransportError as exc:
        logger.info("lease holder topic %s not readable (%s): the lease is checked by waiting", topic, exc)
        return None
    try:
        return await _next_presence(transport, topic, PROBE_RETAINED_WAIT_S)
    finally:
        with contextlib.suppress(TransportError):
            await transport.unsubscribe(topic)


async def _next_presence(transport: MqttTransport, topic: str, timeout_s: float) -> Presence | None:
    """The next decodable presence on ``topic`` within ``timeout_s`` (None: none came, or it was cleared)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while (left := end - loop.time()) > 0:
        try:
            msg = await asyncio.wait_for(transport.queue.get(), left)
        except TimeoutError:
            return None
        if msg.topic != topic or not msg.payload:
            continue
        try:
            return decode_presence(msg.payload)
        except DecodeError as exc:
            logger.warning("lease topic %s: unreadable presence (%d bytes): %s", topic, len(msg.payload), exc)
    return None


class Lease:
    """The lease a running coordinator holds: its presence, heartbeat and last will.

    Parameters
    ----------
    transport : MqttTransport
        The coordinator's own transport (give it :meth:`will` before it starts).
    topic : str
        ``Topics.coordinator``.
    instance : str
        This process's instance id (:func:`new_instance`).
    heartbeat_s : float
        Seconds between two republishes.
    holder_topic : str or None
        ``Topics.coordinator_holder``: the presence is also kept there (retained, no will clears it)
        after each connect.
    """

    def __init__(
        self,
        transport: MqttTransport,
        topic: str,
        instance: str,
        heartbeat_s: float = LEASE_HEARTBEAT_S,
        holder_topic: str | None = None,
    ) -> None:
        self.transport = transport
        self.topic = topic
        self.holder_topic = holder_topic
        self._holder_due = holder_topic is not None
        self.presence = Presence(
            instance=instance,
            host=_host(),
            pid=os.getpid(),
            started=time.time(),
            seq=0,
            heartbeat_s=heartbeat_s,
        )
        self.lost = asyncio.Event()
        """Set when a live coordinator that took the lease first is seen (this one must stop)."""
        self.lost_to = ""
        self.on_lost: Callable[[], None] | None = None
        self._kick = asyncio.Event()

    @staticmethod
    def will(topic: str) -> Will:
        """The last will that clears the lease when the process dies (empty, retained, QoS 1)."""
        return Will(topic, b"", qos=1, retain=True)

    def on_connect(self) -> None:
        """Republish the presence at once after a (re)connect (the will may have cleared it)."""
        self._holder_due = self.holder_topic is not None  # the broker may have lost it
        self._kick.set()

    async def hold(self) -> None:
        """Publish the presence now and every ``heartbeat_s`` (a failed publish waits for the next)."""
        while True:
            if self.transport.connected.is_set():
                self.presence = _next(self.presence)
                try:
                    await self.transport.publish(
                        self.topic, encode_presence(self.presence), qos=1, retain=True
                    )
                except TransportError as exc:
                    logger.debug("lease heartbeat not published: %s", exc)
                if self._holder_due and self.holder_topic is not None:
                    try:  # who took the lease last: a restart after a crash knows its own session by it
                        await self.transport.publish(
                            self.holder_topic, encode_presence(self.presence), qos=1, retain=True
                        )
                        self._holder_due = False
                    except TransportError as exc:
                        logger.debug("lease holder not published: %s", exc)
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.presence.heartbeat_s)

    def handle(self, msg: Message) -> None:
        """A message on the lease topic: another instance's live presence taken first ends our lease."""
        if not msg.payload:
            self._kick.set()  # cleared (another instance's will): say we are here again
            return
        try:
            other = decode_presence(msg.payload)
        except DecodeError as exc:
            logger.warning(
                "lease topic %s: unreadable presence (%d bytes): %s", msg.topic, len(msg.payload), exc
            )
            return
        mine = self.presence
        if other.instance == mine.instance or msg.retain:
            return  # our own echo, or a retained copy (maybe stale): a live one comes again unretained
        if (other.started, other.instance) < (mine.started, mine.instance):
            self.lost_to = describe(other)
            logger.error("another coordinator took this fleet first (%s): stopping", self.lost_to)
            self.lost.set()
            if self.on_lost is not None:
                self.on_lost()
        else:
            self._kick.set()  # we were first: our presence again, the other one steps down

    async def release(self) -> None:
        """Clear the lease (an empty retained payload) on a clean stop; a failure is only logged."""
        if not self.transport.connected.is_set():
            return
        try:
            await self.transport.publish(self.topic, b"", qos=1, retain=True, timeout_s=5.0)
        except TransportError as exc:
            logger.warning("lease not cleared (%s): the broker clears it when the connection closes", exc)


def _next(p: Presence) -> Presence:
    return Presence(p.instance, p.host, p.pid, p.started, p.seq + 1, p.heartbeat_s)
