"""A forged coordinator presence never stops a coordinator whose profile signs (the fleet's lease).

The unit tests drive :class:`~edgefl.coordinator.lease.Lease` and
:class:`~edgefl.coordinator.lease.PresenceTrust` on real signed bytes; the others run real
``edgefl coordinator`` processes (and real agents) on the session's real mosquitto, with a forger
publishing on the lease topic as anyone the broker lets write there could.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import INT8_MODEL, Broker, start_replay_agent
from test_lease import presences, read_log, start_coordinator, wait_for_log

from edgefl.coordinator.lease import (
    CLOCK_SKEW_S,
    LEASE_HEARTBEAT_S,
    PROBE_MARGIN_S,
    Lease,
    PresenceTrust,
)
from edgefl.coordinator.registry import LOGGED_REFUSALS
from edgefl.datasets import load_digits, partition_non_iid, split_digits
from edgefl.errors import DecodeError
from edgefl.launcher import stop_agents
from edgefl.mqtt_link import Message
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.presence import Presence, decode_presence, encode_presence
from edgefl.wire.signing import SigningKey, generate_signing_key, sign_message, write_key_pair

pytestmark = pytest.mark.timeout(240)

FLEET = "plant-3"
INSTANCE = "aaaaaaaaaaaaaaaa"
OTHER = "0123456789abcdef"


def signed(p: Presence, key: SigningKey, fleet: str = FLEET) -> bytes:
    return sign_message(encode_presence, p, key, fleet=fleet)


def lease_for(key: SigningKey, previous: str | None = None) -> Lease:
    transport = MqttTransport("127.0.0.1", 1, "never-started")  # the lease's handler publishes nothing
    trust = PresenceTrust(FLEET, key.verify_key, previous)
    return Lease(transport, Topics("edgefl", FLEET).coordinator, INSTANCE, signing_key=key, trust=trust)


def on_lease_topic(payload: bytes, retain: bool = False) -> Message:
    return Message(Topics("edgefl", FLEET).coordinator, payload, retain)


def test_lease_forgery_signed_presence_verifies_only_under_its_key_fleet_and_time() -> None:
    key, other_key = generate_signing_key(), generate_signing_key()
    now = 1_765_000_000.0
    p = Presence(OTHER, "gw-2", 42, now - 100.0, 7, 5.0, sent=now - 1.0)
    trust = PresenceTrust(FLEET, key.verify_key)
    payload = signed(p, key)
    got = trust.read(payload, now=now)
    assert (got.instance, got.seq, got.sent, len(got.signature)) == (OTHER, 7, now - 1.0, 64)
    assert PresenceTrust(FLEET, None).read(encode_presence(p), now=now) == p  # no key: as before

    def reason(payload: bytes, **kw: float | bool) -> str:
        with pytest.raises(DecodeError) as err:
            trust.read(payload, **kw)  # type: ignore[arg-type]
        return str(err.value.reason)

    assert reason(encode_presence(p), now=now) == "unsigned"
    assert reason(signed(p, other_key), now=now) == "bad_signature"
    assert reason(signed(p, key, fleet="plant-4"), now=now) == "bad_signature"
    assert reason(payload.replace(b"gw-2", b"gw-3"), now=now) == "bad_signature"
    # a signature proves origin, not freshness: older than two heartbeats and the clock skew is a replay
    late = now + 2 * 5.0 + CLOCK_SKEW_S + 1.0
    assert reason(payload, now=late) == "expired"
    assert trust.read(payload, now=late, fresh=False).instance == OTHER  # the holder topic's is old
    assert reason(payload, now=now - CLOCK_SKEW_S - 2.0) == "expired"  # from the future
    unstamped = Presence(OTHER, "gw-2", 42, now - 100.0, 7, 5.0)
    assert reason(signed(unstamped, key), now=now) == "expired"


def test_lease_forgery_running_lease_obeys_only_a_signed_fresh_presence() -> None:
    key = generate_signing_key()
    lease = lease_for(key)
    mine = lease.presence
    # our own presence as published: signed by us, decodes to us
    own = decode_presence(lease.encode(mine))
    assert own.instance == INSTANCE and len(own.signature) == 64 and abs(own.sent - time.time()) < 60
    now = time.time()
    earlier = Presence(OTHER, "forger", 7, mine.started - 100.0, 1, LEASE_HEARTBEAT_S, sent=now)
    for payload, reason in (
        (encode_presence(earlier), "unsigned"),
        (signed(earlier, generate_signing_key()), "bad_signature"),
        (signed(earlier, key, fleet="plant-4"), "bad_signature"),
    ):
        with pytest.raises(DecodeError) as err:
            lease.handle(on_lease_topic(payload))
        assert err.value.reason == reason
        assert not lease.lost.is_set()
    # a validly signed presence of another instance that took the fleet first: two real coordinators
    lease.handle(on_lease_topic(signed(earlier, key)))
    assert lease.lost.is_set() and "forger" in lease.lost_to


def test_lease_forgery_replayed_signed_presences_move_nothing() -> None:
    key = generate_signing_key()
    gone = "feedfacefeedface"
    lease = lease_for(key, previous=gone)
    now = time.time()
    started = lease.presence.started - 100.0
    # this state file's previous coordinator is gone (its lock is ours): its presence is a replay
    with pytest.raises(DecodeError) as err:
        lease.handle(on_lease_topic(signed(Presence(gone, "gw", 1, started, 9, 5.0, sent=now), key)))
    assert err.value.reason == "expired"
    # a retained copy only records its seq; the same seq again unretained is a replay, not a live peer
    seen = Presence(OTHER, "gw-2", 2, started, 5, 5.0, sent=now)
    lease.handle(on_lease_topic(signed(seen, key), retain=True))
    assert not lease.lost.is_set()
    with pytest.raises(DecodeError) as err:
        lease.handle(on_lease_topic(signed(seen, key)))
    assert err.value.reason == "duplicate" and not lease.lost.is_set()
    # a later seq recorded long ago (older than two heartbeats and the clock skew) is a replay too
    old_s = now - 2 * LEASE_HEARTBEAT_S - CLOCK_SKEW_S - 5
    with pytest.raises(DecodeError) as err:
        lease.handle(on_lease_topic(signed(dataclasses.replace(seen, seq=6, sent=old_s), key)))
    assert err.value.reason == "expired" and not lease.lost.is_set()
    # the next heartbeat of a live instance that started first still wins
    lease.handle(on_lease_topic(signed(dataclasses.replace(seen, seq=6), key)))
    assert lease.lost.is_set()


class Forger:
    """Publishes unsigned presences of an invented instance that started long ago, ``seq`` moving, on the
    fleet's lease topic (retained first, then unretained every ``every_s``), from a thread of its own."""

    def __init__(self, broker: Broker, fleet: str, every_s: float = 0.2) -> None:
        self.broker, self.topic, self.every_s = broker, Topics("edgefl", fleet).coordinator, every_s
        self.sent = 0
        self.stop = threading.Event()
        self.connected = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()
        assert self.connected.wait(15), "the forger did not connect"

    async def _run(self) -> None:
        t = MqttTransport(self.broker.host, self.broker.port, f"forger-{time.monotonic_ns()}")
        await t.start(wait_s=10)
        self.connected.set()
        try:
            seq = 0
            while not self.stop.is_set():
                seq += 1
                p = Presence(OTHER, "forger", 7, 1_000_000.0, seq, LEASE_HEARTBEAT_S, sent=time.time())
                await t.publish(self.topic, encode_presence(p), qos=1, retain=seq == 1)
                self.sent += 1
                await asyncio.sleep(self.every_s)
        finally:
            await t.stop()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)


def coordinator_key(tmp: Path) -> tuple[Path, SigningKey]:
    key_file, _, key = write_key_pair(tmp / "keys", "coordinator")
    return key_file, key


def test_lease_forgery_unsigned_presences_do_not_stop_a_signed_coordinator(
    tmp_path: Path, mosquitto: Broker, fleet: str
) -> None:
    """A forger publishes moving, unsigned presences of an instance that started long before, from before
    the coordinator starts to its end: the signed coordinator takes the lease all the same, runs its
    rounds with two real agents and exits 0, and counts every forged presence it saw as ``unsigned``
    with at most ``LOGGED_REFUSALS`` log lines of the intake's (and as many of its probe's)."""
    key_file, key = coordinator_key(tmp_path)
    x, y = load_digits()
    pool = split_digits(y).devices
    shards = [(x[pool[s]], y[pool[s]]) for s in partition_non_iid(y[pool], 2)]
    forger = Forger(mosquitto, fleet)
    agents = [
        start_replay_agent(
            mosquitto,
            fleet,
            tmp_path,
            f"dev-{k + 1}",
            sx,
            sy,
            security__coordinator_public_key=key.verify_key.hex,
        )
        for k, (sx, sy) in enumerate(shards)
    ]
    summary = tmp_path / "summary.json"
    try:
        proc = start_coordinator(
            tmp_path,
            "a",
            mosquitto,
            fleet,
            f"security.signing_key_file={key_file}",
            f"model.path={INT8_MODEL}",
            "robustness.tolerate=0",
            "rounds.count=3",
            "rounds.expected_clients=2",
            "rounds.deadline_s=30",
            f"files.json={summary}",
        )
        assert proc.wait(timeout=200) == 0, read_log(tmp_path, "a")
    finally:
        forger.close()
        stop_agents(agents)
    out = read_log(tmp_path, "a")
    assert forger.sent > 3 / forger.every_s, forger.sent  # it forged the whole time
    assert "another coordinator" not in out, out
    doc = json.loads(summary.read_text())
    assert [r["round"] for r in doc["rounds"]] == [1, 2, 3] and all(r["clients"] == 2 for r in doc["rounds"])
    assert 5 <= doc["refused"]["unsigned"] <= forger.sent, doc["refused"]
    refusals = [line for line in out.splitlines() if "unsigned" in line and "presence" in line]
    assert 5 <= len(refusals) <= 2 * LOGGED_REFUSALS, refusals[:3]
    assert "Traceback" not in out, out
    assert np.isfinite([r["accuracy"] for r in doc["rounds"] if r["accuracy"] is not None]).all()


def test_lease_forgery_signed_second_coordinator_is_still_refused_with_exit_6(
    tmp_path: Path, mosquitto: Broker, fleet: str
) -> None:
    """Two real coordinators with the same key: the second is refused at its probe (exit 6, nothing
    written), and a running one that sees a validly signed, fresh presence of an instance that took
    the fleet first stops with exit 6, as without signatures; an unsigned one before it changed nothing."""
    key_file, key = coordinator_key(tmp_path)
    signing = f"security.signing_key_file={key_file}"
    first = start_coordinator(tmp_path, "a", mosquitto, fleet, signing, f"files.state={tmp_path / 'a.rec'}")
    try:
        seen = asyncio.run(presences(mosquitto, fleet, 2, 30))
        assert all(len(p.signature) == 64 and p.sent > 0 for p in seen), seen
        second = start_coordinator(
            tmp_path, "b", mosquitto, fleet, signing, f"files.state={tmp_path / 'b.rec'}"
        )
        assert second.wait(timeout=2 * LEASE_HEARTBEAT_S + PROBE_MARGIN_S + 30) == 6, read_log(tmp_path, "b")
        out = read_log(tmp_path, "b")
        assert "another coordinator runs this fleet" in out and seen[0].instance[:8] in out, out
        assert not (tmp_path / "b.rec").exists()
        wait_for_log(tmp_path, "a", "before round 1", first, 30)  # running: its lease is watched from here
        earlier = Presence(OTHER, "other-host", 7, seen[0].started - 100.0, 1, LEASE_HEARTBEAT_S)

        async def announce(payload: bytes) -> None:
            t = MqttTransport(mosquitto.host, mosquitto.port, f"other-{time.monotonic_ns()}")
            await t.start(wait_s=10)
            await t.publish(Topics("edgefl", fleet).coordinator, payload, qos=1)
            await t.stop()

        asyncio.run(announce(encode_presence(dataclasses.replace(earlier, sent=time.time()))))
        wait_for_log(tmp_path, "a", "unsigned", first, 30)
        assert first.poll() is None, read_log(tmp_path, "a")
        asyncio.run(announce(signed(dataclasses.replace(earlier, seq=2, sent=time.time()), key, fleet)))
        assert first.wait(timeout=30) == 6, read_log(tmp_path, "a")
        out = read_log(tmp_path, "a")
        assert "another coordinator took this fleet first" in out and "other-host" in out, out
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGTERM)
            first.wait(timeout=30)
