"""One coordinator per fleet: a lock on its state folder and a lease on the broker.

The lease is a retained :class:`~edgefl.wire.presence.Presence` on ``<prefix>/<fleet>/coordinator``;
every case: ``docs/protocol.md`` ("Presence"), ``docs/operations.md`` ("One coordinator per fleet").
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
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Final

from edgefl.coordinator.registry import sampled_log
from edgefl.errors import BrokerRefused, DecodeError, EdgeflError, TransportError
from edgefl.mqtt_link import Message
from edgefl.records import RecordError, atomic_write, decode_record, encode_record
from edgefl.transport import MqttTransport, Will
from edgefl.wire.cbor import MessageType
from edgefl.wire.presence import Presence, decode_presence, encode_presence
from edgefl.wire.reasons import Reason
from edgefl.wire.signing import SigningKey, VerifyKey, sign_message, verify_payload

logger = logging.getLogger(__name__)


LEASE_HEARTBEAT_S: Final = 5.0
"""Seconds between two republishes of a holder's presence (a tiny retained message)."""

PROBE_RETAINED_WAIT_S: Final = 1.0
"""How long a probe waits for the retained presence after its SUBACK (it comes right after)."""

PROBE_RECEIVE_MAX: Final = 64
"""The probe's Receive Maximum: a renamed session's backlog (unacknowledged) fills at most this many of
its 256 queue slots, the rest stay free for the QoS 0 presences it reads."""

PROBE_MARGIN_S: Final = 1.0
"""Added to two heartbeats before a presence that did not move is called stale (seconds)."""

PROBE_HEARTBEAT_MAX_S: Final = 30.0
"""The longest heartbeat a probe believes (a presence claiming more is watched for two of these only)."""

CLOCK_SKEW_S: Final = 30.0
"""The clock difference allowed between two coordinators' hosts when a signed presence's age is checked."""

SEQS_KEPT: Final = 16
"""Instances whose highest ``seq`` a lease remembers (a replayed presence does not move it)."""


class LeaseHeld(EdgeflError):
    """Another live coordinator runs this fleet (``edgefl coordinator`` exits 6).

    ``where``: what is held (``"fleet F on broker B"``, ``"state file P"``); ``holder``: who, in words.
    """

    def __init__(self, where: str, holder: str) -> None:
        super().__init__(f"another coordinator runs this fleet: {where} is held by {holder}")


class AccountInUse(TransportError):
    """The broker names clients after their account and another live client uses this coordinator's.

    A configuration error (exit 1, not restarted): each fleet's coordinator needs its own account.
    """


def new_instance() -> str:
    """A fresh random instance id (32 lowercase hex digits)."""
    return secrets.token_hex(16)


def _host() -> str:
    return (socket.gethostname() or "unknown").replace(" ", "_")[:255]


def instance_path(state: Path) -> Path:
    """Where the instance that holds ``state``'s lock records its id: ``<state>.instance`` beside it."""
    return state.with_name(state.name + ".instance")


def record_instance(state: Path, instance: str, *, stopped: bool = False) -> None:
    """Record ``instance`` as the coordinator of state file ``state`` (atomic, checksummed; lock held).

    ``stopped``: it stopped cleanly (written at its clean stop; a crash leaves the record of its start).
    Raises OSError if the file cannot be written.
    """
    doc: dict[str, object] = {"instance": instance, "host": _host(), "state": str(state.resolve())}
    doc["pid"] = os.getpid()
    if stopped:
        doc["stopped"] = True
    atomic_write(instance_path(state), encode_record(json.dumps(doc, sort_keys=True).encode()))


def _own_record(state: Path) -> dict[str, object] | None:
    """The instance record of ``state`` if written on this host for this very state file (else None)."""
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
    return doc


def previous_instance(state: Path) -> str | None:
    """The instance id the last coordinator of ``state`` recorded (:func:`record_instance`), if it is ours.

    Call it with the state file's lock held (that process is gone). None without a record written on
    this host for this very state file; an unreadable one is logged.
    """
    doc = _own_record(state)
    return None if doc is None else str(doc["instance"])


def previous_stopped_cleanly(state: Path) -> bool:
    """True when the last coordinator of ``state`` recorded its clean stop (False after a crash or kill).

    Call it with the state file's lock held, as :func:`previous_instance`.
    """
    doc = _own_record(state)
    return doc is not None and doc.get("stopped") is True


class PresenceTrust:
    """Which presences a coordinator believes: with the fleet's coordinator key, only signed, fresh ones.

    ``fleet``: bound by the signature; ``key``: the public half of ``security.signing_key_file`` (None:
    every decodable presence is believed); ``previous``: this state file's previous instance (gone);
    ``refused``: presences :meth:`refuse` counted, by reason.
    """

    def __init__(self, fleet: str, key: VerifyKey | None, previous: str | None = None) -> None:
        self.fleet = fleet
        self.key = key
        self.previous = previous
        self.refused: Counter[str] = Counter()

    @property
    def signed(self) -> bool:
        """Whether presences must be signed."""
        return self.key is not None

    def read(self, payload: bytes, *, fresh: bool = True, now: float | None = None) -> Presence:
        """Verify (with a key) and decode a presence; ``fresh``: with a key, it must be recent too.

        Fresh as ``docs/protocol.md`` ("Presence") says, against ``now`` (Unix s, default the clock).
        Raises DecodeError: ``unsigned``, ``bad_signature``, ``expired`` (old or unstamped ``sent``), or a
        decoding reason of ``docs/protocol.md`` ("Presence").
        """
        if self.key is not None:
            verify_payload(payload, self.key, fleet=self.fleet, kind=MessageType.PRESENCE)
        p = decode_presence(payload)
        if self.key is not None and fresh:
            now = time.time() if now is None else now
            age_s = now - p.sent
            max_age_s = 2 * min(p.heartbeat_s, PROBE_HEARTBEAT_MAX_S) + CLOCK_SKEW_S
            if p.sent <= 0 or not -CLOCK_SKEW_S <= age_s <= max_age_s:
                shown = "not stamped" if p.sent <= 0 else f"sent {age_s:.0f} s ago"
                why = f"presence of {describe(p)}: {shown} (a replay?), at most {max_age_s:.0f} s"
                raise DecodeError(Reason.EXPIRED, why)
        return p

    def refuse(self, topic: str, size: int, exc: DecodeError) -> None:
        """Count a presence refused outside the running coordinator's intake, and log it (throttled)."""
        reason = str(exc.reason)
        self.refused[reason] += 1
        more = sampled_log(self.refused[reason], reason)
        if more is not None:
            logger.warning("lease topic %s: presence refused (%d bytes): %s%s", topic[:200], size, exc, more)


def describe(p: Presence) -> str:
    """``instance 1a2b3c4d on host gw (pid 42), since 2026-12-06T04:00:00Z``."""
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(p.started))
    return f"instance {p.instance[:8]} on host {p.host} (pid {p.pid}), since {since}"


async def probe_lease(
    transport: MqttTransport,
    topic: str,
    fleet_where: str,
    connected: Callable[[MqttTransport], Awaitable[None]],
    previous: str | None,
    holder_topic: str,
    trust: PresenceTrust,
    *,
    previous_stopped: bool = False,
) -> Presence | None:
    """Read the fleet's lease through ``transport`` (a client id of its own, clean session); publish nothing.

    ``transport``: not started (started and stopped here), persistent session, ``ack_on_commit``;
    ``topic``: ``Topics.coordinator``; ``fleet_where``: ``"fleet F on broker B"``; ``connected(transport)``
    waits for the connection. A presence naming ``previous`` (this state file's previous instance), also
    as the last holder on ``holder_topic``, is taken over at once; ``trust``: which presences count;
    ``previous_stopped``: that instance recorded its clean stop (said so, rather than taken over).
    Returns the stale presence found, or None. Raises LeaseHeld (a live holder), AccountInUse (another
    live client took back the account's session the broker handed the probe), TransportError (what
    ``connected`` raises, or a refused subscription).
    """
    await transport.start(wait_s=None)
    try:
        await connected(transport)
        # A probe's client id is new: a session at the broker means the broker renamed it
        # (use_username_as_clientid) to a running coordinator's; nothing is acknowledged here (no commit)
        renamed = transport.session_present
        if renamed:
            while not transport.queue.empty():  # its backlog, unacknowledged: its own connection gets it all
                transport.queue.get_nowait()
            if previous is not None:
                last = await _retained_presence(transport, holder_topic, trust)
                if _ours(last, previous, previous_stopped, "the broker gave the lease probe the session of"):
                    return None
            logger.warning(
                "the broker gave the lease probe an existing session (it names clients after their "
                "account?): waiting for its coordinator's presence"
            )
        taken_before = transport.sure_takeovers_total
        # QoS 0: delivered beside a backlog of unacknowledged QoS 1 messages of a renamed session,
        # which fills the broker's Receive Maximum and would hold back a QoS 1 retained presence
        await transport.subscribe(topic, 0)
        first_wait = 2 * LEASE_HEARTBEAT_S + PROBE_MARGIN_S if renamed else PROBE_RETAINED_WAIT_S
        first = await _next_presence(transport, topic, first_wait, trust)
        if first is None and renamed and transport.sure_takeovers_total > taken_before:
            # a live client took its session back, and it is not this fleet's coordinator
            account = repr(transport.username) if transport.username else "(anonymous)"
            raise AccountInUse(
                f"{fleet_where}: account {account} is in use by another live client (the broker names "
                "clients after their account, use_username_as_clientid, and handed us its session, which "
                "it took back): give each fleet's coordinator its own account (docs/operations.md)"
            )
        if first is None:
            return None
        not_cleared = "; the broker has not cleared its lease yet"
        if _ours(first, previous, previous_stopped, "the fleet's lease names", not_cleared):
            return first
        wait_s = 2 * min(first.heartbeat_s, PROBE_HEARTBEAT_MAX_S) + PROBE_MARGIN_S
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        while (left := end - loop.time()) > 0:
            seen = await _next_presence(transport, topic, left, trust)
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


def _ours(p: Presence | None, previous: str | None, stopped: bool, how: str, why: str = "") -> bool:
    """True, with an INFO line, when ``p`` names this state file's previous instance (gone: taken over).

    ``stopped``: that instance recorded its clean stop (the line says so: resuming, no takeover).
    """
    if p is None or previous is None or p.instance != previous:
        return False
    if stopped:
        why = "it stopped cleanly" + why
        logger.info("%s %s, this state file's previous coordinator (%s): resuming", how, describe(p), why)
        return True
    why = "gone: its state file's lock is ours" + why
    logger.info("%s %s, this state file's previous coordinator (%s): taken over", how, describe(p), why)
    return True


async def _retained_presence(transport: MqttTransport, topic: str, trust: PresenceTrust) -> Presence | None:
    """The retained presence on ``topic`` (None: none within :data:`PROBE_RETAINED_WAIT_S`, or refused).

    It may be old (published once a connect): ``trust`` checks its signature only.
    """
    try:
        await transport.subscribe(topic, 0)  # QoS 0: not held back by a session's backlog (probe_lease)
    except TransportError as exc:
        logger.info("lease holder topic %s not readable (%s): the lease is checked by waiting", topic, exc)
        return None
    try:
        return await _next_presence(transport, topic, PROBE_RETAINED_WAIT_S, trust, fresh=False)
    finally:
        with contextlib.suppress(TransportError):
            await transport.unsubscribe(topic)


async def _next_presence(
    transport: MqttTransport, topic: str, timeout_s: float, trust: PresenceTrust, *, fresh: bool = True
) -> Presence | None:
    """The next presence ``trust`` believes on ``topic`` within ``timeout_s`` (None: none, or cleared)."""
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
            return trust.read(msg.payload, fresh=fresh)
        except DecodeError as exc:
            trust.refuse(topic, len(msg.payload), exc)
    return None


class Lease:
    """The lease a running coordinator holds: its presence, heartbeat and last will.

    ``transport``: the coordinator's own (given :meth:`will` before it starts); ``topic``:
    ``Topics.coordinator``; ``instance``: :func:`new_instance`; republished every heartbeat, and after
    each connect also on ``holder_topic`` (retained). ``signing_key`` signs every presence (``trust``,
    which decides which presences count, gets its public half); ``seen``: a presence the probe found stale.
    """

    def __init__(
        self,
        transport: MqttTransport,
        topic: str,
        instance: str,
        holder_topic: str | None = None,
        signing_key: SigningKey | None = None,
        trust: PresenceTrust | None = None,
        seen: Presence | None = None,
    ) -> None:
        self.transport = transport
        self.topic = topic
        self.holder_topic = holder_topic
        self.signing_key = signing_key
        self.trust = trust if trust is not None else PresenceTrust("", None)
        self._seqs: dict[str, int] = {} if seen is None else {seen.instance: seen.seq}
        self._holder_due = holder_topic is not None
        self.presence = Presence(
            instance=instance,
            host=_host(),
            pid=os.getpid(),
            started=time.time(),
            seq=0,
            heartbeat_s=LEASE_HEARTBEAT_S,
        )
        self.lost = asyncio.Event()
        """Set when a live coordinator that took the lease first is seen (this one must stop)."""
        self.lost_to = ""
        self.refused = False
        """Set when the broker refused a presence (logged once, as an ERROR)."""
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
                self.presence = replace(self.presence, seq=self.presence.seq + 1)
                payload = self.encode(self.presence)
                try:
                    await self.transport.publish(self.topic, payload, qos=1, retain=True)
                except BrokerRefused as exc:  # an ACL without the lease topic: other coordinators see none
                    if not self.refused:
                        logger.error("the fleet's lease is not published: %s", exc)
                    self.refused = True
                except TransportError as exc:
                    logger.debug("lease heartbeat not published: %s", exc)
                if self._holder_due and self.holder_topic is not None:
                    try:  # who took the lease last: a restart after a crash knows its own session by it
                        await self.transport.publish(self.holder_topic, payload, qos=1, retain=True)
                        self._holder_due = False
                    except TransportError as exc:
                        logger.debug("lease holder not published: %s", exc)
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.presence.heartbeat_s)

    def encode(self, p: Presence) -> bytes:
        """``p`` as published now: stamped with the time and, with a signing key, signed for the fleet."""
        stamped = replace(p, sent=time.time())
        if self.signing_key is None:
            return encode_presence(stamped)
        return sign_message(encode_presence, stamped, self.signing_key, fleet=self.trust.fleet)

    def handle(self, msg: Message) -> None:
        """A message on the lease topic: another instance's live presence taken first ends our lease.

        Raises DecodeError for a refused presence (counted by the caller): as :meth:`PresenceTrust.read`;
        ``expired`` for this state file's previous instance; ``duplicate`` for a replayed ``seq``.
        """
        if not msg.payload:
            self._kick.set()  # cleared (another instance's will): say we are here again
            return
        other = self.trust.read(msg.payload, fresh=not msg.retain)
        mine = self.presence
        if other.instance == mine.instance:
            return  # our own echo
        if other.instance == self.trust.previous and not msg.retain:
            why = f"presence of {describe(other)}, this state file's previous coordinator (gone)"
            raise DecodeError(Reason.EXPIRED, why)
        last = self._seqs.get(other.instance)
        if not msg.retain and last is not None and other.seq <= last:
            why = f"presence of {describe(other)}: seq {other.seq} <= {last} seen (a replay?)"
            raise DecodeError(Reason.DUPLICATE, why)
        self._seqs.pop(other.instance, None)
        self._seqs[other.instance] = other.seq if last is None else max(last, other.seq)
        while len(self._seqs) > SEQS_KEPT:
            del self._seqs[next(iter(self._seqs))]
        if msg.retain:
            return  # a retained copy (maybe stale): a live one comes again unretained
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
