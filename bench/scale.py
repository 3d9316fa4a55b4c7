"""Scale: N simulated devices across S sites, hierarchical (site aggregators + root) or flat (issue 16).

Everything runs on 127.0.0.1. Flat (``--flat``): one mosquitto and one real ``edgefl coordinator``
(the shipped ``firmware_configs/coordinator.toml``, FedAvg, ``min_clients = N``). Hierarchical: one
mosquitto per site, each bridged to a root mosquitto, one ``edgefl coordinator --set role=site`` per
site and one ``--set role=root`` at the root. The coordinators are the product's processes.

The devices are simulated, not agents: each device has its own Ed25519 key (the coordinator's
``security.device_keys_dir`` holds every ``<device>.pub``, so updates are verified as in the product)
and its update of the demo's head (digits backbone, float32 delta) is encoded and signed once per round
*before* the rounds start (``edgefl.wire``: ``sign_message(encode_update, ...)``). A device is one
MQTT 3.1.1 connection of :class:`MiniPublisher` (CONNECT, QoS 1 PUBLISH, PUBACK over asyncio streams:
no thread per client, as paho would need; at 10,000 devices and 2 rounds the bench process peaks at
520-550 MiB, ~420 MB of which are the pre-signed updates).
``--devices-per-connection K`` multiplexes K logical devices (each on its own ``update/<device>``
topic) over one connection; the default, 1, is one connection per device (mosquitto has no
per-connection limit that needs it; the process' file limit, ``ulimit -n``, does above ~20,000).

A round: the bench waits for the round announcement at every site broker (bridged down from the
root in the hierarchical run), takes the root broker's ``$SYS`` counters, sends every device's
update (each connection at a uniform random time within ``--spread`` s, 0: all at once; each waits
for its PUBACKs), waits for the global head of that round at every site broker, then takes the
``$SYS`` counters again:

- ``seconds_to_close``: first update sent → the round's global head seen at every site broker
  (``seconds_after_last_update``: from the last PUBACK a device got to that head);
- ``updates_counted``, ``duplicates``, ``missing``: from the root coordinator's ``files.log`` line of the
  round (``update_ids``: the device update ids in the global head; a duplicate is an id counted twice,
  in this round or an earlier one; missing = sent and not counted);
- ``root_peak_rss_bytes`` / ``site_peak_rss_bytes``: the processes' ``VmHWM``, reset at the round's
  start by writing ``5`` to ``/proc/<pid>/clear_refs`` (Linux >= 4.0; ``peak_reset`` false when not
  permitted: the peak is then since the process started); sites: the largest site;
- ``updates_per_s_drained`` / ``cpu_us_per_update``: the root (flat: the one) coordinator's updates
  counted over ``seconds_to_close``, and its CPU time (user + system, ``/proc/<pid>/stat``) over the
  same window per update counted (null if it exited before it was read or used less than a clock
  tick: a small round); ``sites_drain``: the same
  per site aggregator (its devices' updates counted at the root);
- ``messages_into_root`` / ``bytes_into_root``: increase of the root mosquitto's
  ``$SYS/broker/publish/messages/received`` (mosquitto 2.0 leaves retained publishes out of it, so
  the root coordinator's own ``round`` and ``global`` are not counted) and ``$SYS/broker/bytes/received``
  (every MQTT byte the root broker read: PUBACKs and the root coordinator's publishes included),
  with ``sys_interval 1``; ``root_broker_dropped``: ``$SYS/broker/publish/messages/dropped``.

``--root-outage S`` (hierarchical): the root mosquitto (``persistence true``) is stopped as round 1's
updates start and started again S seconds later; the sites' bridges (``cleansession false``) hold
the partials meanwhile. That round's ``messages_into_root``/``bytes_into_root`` count from the restart.
``--uplink-cut S`` (hierarchical): each affected site's bridge reaches the root broker through a TCP
proxy of the bench (:class:`Uplink`); as round 1's updates start the proxies drop their connections and
refuse new ones for S seconds (the site brokers, their devices and site aggregators keep running).
``--site-restart`` (hierarchical): halfway through round 1's sending (``--spread`` / 2 s after the
first update) each affected site aggregator is killed (SIGKILL) and started again on its state file.
``--affected-sites K``: the first K sites (0, the default: every site). ``--root-stateless``: the root
mosquitto runs with ``persistence false``, so ``--root-outage`` brings it back without the root
coordinator's session or the retained round (as a crash between saves or a new node would).
``--root-cluster N`` (hierarchical): the root broker is an N-node nats-server cluster
(:mod:`bench.cluster`); every site bridge lists all nodes, the bench's watcher uses the last one, and
node 0 stops as round 1's updates start (no ``$SYS``: the message and byte counts are null). The root
coordinator connects to node 0 too, with the others as ``broker.alternates`` (``--root-on-last-node``:
to the last node only, as before that key existed).

Run: ``.venv/bin/python -m bench.scale --devices 10000 --sites 20 --rounds 3 --json PATH``
(``--flat`` for the same N through one flat coordinator).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.cluster import Cluster, wait_port
from edgefl.coordinator.bridge import bridge_config
from edgefl.launcher import free_port
from edgefl.mqtt_link import Message
from edgefl.mqtt_socket import remaining_length
from edgefl.resources import shipped
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.types import F32
from edgefl.wire.global_model import decode_global_model
from edgefl.wire.rounds import Update, UpdateMetrics, decode_round, encode_update
from edgefl.wire.signing import SigningKey, sign_message

MIB = 1 << 20
PREFIX = "edgefl"
MODEL = "models/digits_cnn_int8_rawin.tflite"


# --------------------------------------------------------------------------------------------------
# A minimal MQTT 3.1.1 publisher (OASIS MQTT 3.1.1, sections 3.1 CONNECT, 3.2 CONNACK, 3.3 PUBLISH,
# 3.4 PUBACK, 3.14 DISCONNECT; remaining length: section 2.2.3)
# --------------------------------------------------------------------------------------------------


def _utf8(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("!H", len(raw)) + raw


def connect_packet(client_id: str, keepalive_s: int = 0) -> bytes:
    """CONNECT, MQTT 3.1.1, clean session, no will, no credentials (bytes on the wire)."""
    body = _utf8("MQTT") + bytes([4, 0x02]) + struct.pack("!H", keepalive_s) + _utf8(client_id)
    return b"\x10" + remaining_length(len(body)) + body


def publish_packet(topic: str, payload: bytes, packet_id: int) -> bytes:
    """PUBLISH with QoS 1, not retained (bytes on the wire); ``packet_id`` in 1..65535."""
    body = _utf8(topic) + struct.pack("!H", packet_id) + payload
    return b"\x32" + remaining_length(len(body)) + body


class MiniPublisher:
    """One MQTT 3.1.1 connection that publishes QoS 1 messages and waits for their PUBACKs.

    Parameters
    ----------
    client_id : str
        MQTT client id (unique per broker).
    """

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._next_id = 0

    async def connect(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        """Open the TCP connection and complete CONNECT/CONNACK.

        Raises
        ------
        ConnectionError
            If the broker refuses (CONNACK return code != 0) or answers something else.
        TimeoutError
            If it does not answer within ``timeout_s``.
        """
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 16), timeout_s)
        self._reader, self._writer = reader, writer
        writer.write(connect_packet(self.client_id))
        ack = await asyncio.wait_for(reader.readexactly(4), timeout_s)
        if ack[0] != 0x20 or ack[3] != 0:
            raise ConnectionError(f"{self.client_id}: CONNACK {ack.hex()} (refused)")

    async def publish_all(self, items: Sequence[tuple[str, bytes]], timeout_s: float = 600.0) -> int:
        """Publish every (topic, payload) with QoS 1, pipelined, and wait for every PUBACK.

        Returns
        -------
        int
            Bytes written (whole packets).

        Raises
        ------
        ConnectionError
            If the connection closes or answers a packet other than PUBACK.
        TimeoutError
            If the PUBACKs do not all arrive within ``timeout_s``.
        """
        assert self._reader is not None and self._writer is not None
        pending: set[int] = set()
        sent = 0
        for topic, payload in items:
            self._next_id = self._next_id % 65535 + 1
            pkt = publish_packet(topic, payload, self._next_id)
            pending.add(self._next_id)
            self._writer.write(pkt)
            sent += len(pkt)
        await self._writer.drain()
        reader = self._reader

        async def acks() -> None:
            while pending:
                head = await reader.readexactly(4)
                if head[0] != 0x40 or head[1] != 2:
                    raise ConnectionError(f"{self.client_id}: expected PUBACK, got {head.hex()}")
                pending.discard(struct.unpack("!H", head[2:])[0])

        await asyncio.wait_for(acks(), timeout_s)
        return sent

    async def close(self) -> None:
        """Send DISCONNECT and close the socket (errors ignored: the broker may be gone)."""
        if self._writer is None:
            return
        try:
            self._writer.write(b"\xe0\x00")
            await self._writer.drain()
            self._writer.close()
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass


# --------------------------------------------------------------------------------------------------
# Simulated devices: keys, pre-encoded signed updates
# --------------------------------------------------------------------------------------------------


def device_ids(devices: int, sites: int) -> list[list[str]]:
    """Device ids per site: ``s<site>-d<n>``, devices spread evenly (the first sites get one more)."""
    out: list[list[str]] = [[] for _ in range(sites)]
    for i in range(devices):
        out[i % sites].append(f"s{i % sites:03d}-d{i:06d}")
    return out


def device_key(device: str) -> SigningKey:
    """A device's Ed25519 key, derived from its id (deterministic: the bench's key files match)."""
    return SigningKey(hashlib.sha256(b"edgefl-bench-scale:" + device.encode()).digest())


def write_keys(devices: Sequence[str], directory: Path) -> None:
    """Write ``<device>.pub`` (64 hex digits) for every device into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for dev in devices:
        (directory / f"{dev}.pub").write_text(device_key(dev).verify_key.hex + "\n")


def encode_updates(
    devices: Sequence[str], shape: tuple[int, int], fleet: str, rounds: int
) -> dict[int, dict[str, bytes]]:
    """Signed Update payloads per round and device (round r answers base version r - 1).

    Each device's delta is fixed (``N(0, 0.01)`` from a seed of its index), its ``num_examples`` is
    10..49 and its update id ``<device>-r<round>``.
    """
    D, K = shape
    out: dict[int, dict[str, bytes]] = {r: {} for r in range(1, rounds + 1)}
    for i, dev in enumerate(devices):
        rng = np.random.default_rng(i)
        dW: F32 = (rng.standard_normal((D, K)) * 0.01).astype(np.float32)
        db: F32 = (rng.standard_normal(K) * 0.01).astype(np.float32)
        key = device_key(dev)
        for r in range(1, rounds + 1):
            up = Update(
                round=r,
                base_version=r - 1,
                device=dev,
                num_examples=10 + i % 40,
                delta_W=dW,
                delta_b=db,
                metrics=UpdateMetrics(loss=0.5, accuracy=0.8, train_s=0.1, peak_rss_bytes=40 * MIB),
                update_id=f"{dev}:{r}:{r - 1}",
            )
            out[r][dev] = sign_message(encode_update, up, key, fleet=fleet)
    return out


# --------------------------------------------------------------------------------------------------
# Processes: brokers and coordinators
# --------------------------------------------------------------------------------------------------


def distinct_ports(n: int) -> list[int]:
    """``n`` different free TCP ports on 127.0.0.1 (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def mosquitto_conf(port: int, extra: str = "") -> str:
    """A loopback mosquitto config for the bench: unlimited queues (QoS 1 must not be dropped)."""
    return (
        f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        "max_queued_messages 1000000\nmax_queued_bytes 0\n"
        "sys_interval 1\nmax_connections -1\n" + extra
    )


def start_mosquitto(tmp: Path, name: str, port: int, extra: str = "") -> subprocess.Popen[bytes]:
    """Start a mosquitto with :func:`mosquitto_conf` (log in ``tmp/<name>.log``) and wait for its port."""
    exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    conf = tmp / f"{name}.conf"
    conf.write_text(mosquitto_conf(port, extra))
    with open(tmp / f"{name}.log", "ab") as log:
        proc = subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    wait_port(port, proc, name)
    try:  # another process on the port answers wait_port while ours exits ("Address already in use")
        proc.wait(0.2)
        raise RuntimeError(f"{name} exited with {proc.returncode} (see {tmp / (name + '.log')})")
    except subprocess.TimeoutExpired:
        return proc


def start_coordinator(sets: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m edgefl.cli coordinator <shipped coordinator.toml> --set k=v ...`` (output to ``log``)."""
    cmd = [
        sys.executable,
        "-m",
        "edgefl.cli",
        "coordinator",
        str(shipped("firmware_configs/coordinator.toml")),
    ]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    with open(log, "ab") as sink:
        return subprocess.Popen(
            cmd, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "MALLOC_ARENA_MAX": "2"}
        )


def _status_field(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} for pid {pid}")


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, s) a process used so far (``/proc/<pid>/stat``); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drain_figures(counted: int, seconds: float, cpu0: float | None, cpu1: float | None) -> dict[str, Any]:
    """``updates_per_s_drained`` and ``cpu_us_per_update`` of one aggregator in one round.

    ``counted`` updates (device updates the aggregator counted), over ``seconds`` (first update sent →
    the round's global head seen), and its CPU time over the same window (None when the process had
    exited before it was read, or used less than one clock tick: ``/proc`` counts CPU in ticks).
    """
    rate = round(counted / seconds, 1) if seconds > 0 and counted else None
    cpu = None
    if cpu0 is not None and cpu1 is not None and counted and cpu1 > cpu0:
        cpu = round((cpu1 - cpu0) * 1e6 / counted, 1)
    return {"updates_per_s_drained": rate, "cpu_us_per_update": cpu}


def reset_peak(pid: int) -> bool:
    """Reset a process' ``VmHWM`` to its current RSS (``/proc/<pid>/clear_refs`` = 5); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss(proc: subprocess.Popen[bytes]) -> int:
    """``VmHWM`` of a child process, bytes.

    A child that has already exited (the root ends after its last round, and may be gone by the time
    the global head reaches every site) has no ``VmHWM`` left: it is reaped here, and its lifetime
    peak comes from ``wait4``'s ``ru_maxrss`` (KiB on Linux), which a ``reset_peak`` does not lower.
    """
    try:
        return _status_field(proc.pid, "VmHWM")
    except (RuntimeError, OSError):
        if proc.returncode is not None:
            raise
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        return int(usage.ru_maxrss) * 1024


# --------------------------------------------------------------------------------------------------
# Watchers: round / global at each site broker, $SYS at the root broker
# --------------------------------------------------------------------------------------------------


@dataclass
class Watch:
    """What one watcher saw: rounds announced and global heads (monotonic time first seen), $SYS counters."""

    transport: MqttTransport
    topics: Topics
    rounds: dict[int, float] = field(default_factory=dict)
    globals: dict[int, float] = field(default_factory=dict)
    sys: dict[str, int] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def pump(self) -> None:
        """Consume the watcher's messages forever."""
        while True:
            msg: Message = await self.transport.queue.get()
            self.feed(msg)

    def feed(self, msg: Message) -> None:
        """Record one message (a bad payload is ignored: the coordinators count their own refusals)."""
        now = time.monotonic()
        if msg.topic.startswith("$SYS/"):
            try:
                self.sys[msg.topic] = int(msg.payload)
            except ValueError:
                return
        elif msg.topic == self.topics.round and msg.payload:
            try:
                self.rounds.setdefault(decode_round(msg.payload).round, now)
            except Exception:  # a watcher never stops on a message
                return
        elif msg.topic.startswith(self.topics.global_model) and msg.payload:
            try:
                self.globals.setdefault(decode_global_model(msg.payload).round, now)
            except Exception:  # chunks are not decoded: the bench's head is one packet
                return
        self.changed.set()

    async def until(self, cond: Any, timeout_s: float, what: str) -> None:
        """Wait (event-driven) until ``cond()``; raises TimeoutError naming ``what``."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what} not seen within {timeout_s} s")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))


SYS_MESSAGES = "$SYS/broker/publish/messages/received"
SYS_BYTES = "$SYS/broker/bytes/received"
SYS_DROPPED = "$SYS/broker/publish/messages/dropped"
SYS_TOPICS = (SYS_MESSAGES, SYS_BYTES, SYS_DROPPED)
SYS_SETTLE_S = 1.5
"""mosquitto publishes a ``$SYS`` counter every ``sys_interval`` (1 s here) and only when it changed."""


async def start_watch(port: int, topics: Topics, name: str, sys_counters: bool) -> Watch:
    """A paho watcher (the product's transport) subscribed to ``round`` and ``global`` (+ ``$SYS``)."""
    tx = MqttTransport("127.0.0.1", port, name, queue_size=100_000)
    await tx.start(wait_s=15)
    w = Watch(tx, topics)
    await tx.subscribe(topics.round, 1)
    await tx.subscribe(topics.global_model, 1)
    if sys_counters:
        for t in SYS_TOPICS:
            await tx.subscribe(t, 0)
    return w


async def sys_counters_or_none(w: Watch, at_least: int = 0) -> tuple[int, int, int] | None:
    """:func:`sys_counters`, or None when the watcher has no ``$SYS`` values (e.g. not reconnected yet)."""
    try:
        return await sys_counters(w, at_least)
    except TimeoutError:
        return None


async def sys_counters(w: Watch, at_least: int = 0) -> tuple[int, int, int]:
    """The root broker's ($SYS publishes received, bytes received, publishes dropped) as of now.

    Waits until the publish counter reached ``at_least`` (at most 15 s: a shortfall is then what is
    measured), then :data:`SYS_SETTLE_S` (one ``sys_interval`` and a half): the last value published
    since is the counter's value at a tick after the call. mosquitto 2.0 does not count retained
    PUBLISHes in ``publish/messages/received`` (measured): the root coordinator's own ``round`` and
    ``global`` (retained) are not in it.
    """
    await w.until(lambda: all(t in w.sys for t in SYS_TOPICS), 60, "$SYS counters")
    with contextlib.suppress(TimeoutError):
        await w.until(lambda: w.sys[SYS_MESSAGES] >= at_least, 15, "the root broker's publish count")
    await asyncio.sleep(SYS_SETTLE_S)
    return w.sys[SYS_MESSAGES], w.sys[SYS_BYTES], w.sys[SYS_DROPPED]


class Uplink:
    """A TCP proxy on 127.0.0.1 between one site broker's bridge and the root broker: the site's uplink.

    :meth:`cut` drops its connections and refuses new ones (each accepted connection is closed at
    once, as an unreachable root looks to the bridge) until :meth:`restore`.

    Parameters
    ----------
    target_port : int
        The root broker's port; the bridge's ``address`` names :attr:`port` instead.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.up = True
        self.cuts = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        """Listen on a free 127.0.0.1 port (:attr:`port`)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        pair = (writer, up_writer)
        self._writers.update(pair)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            # a reset or cut connection ends the pump like an EOF: both sides are closed below
            try:
                with contextlib.suppress(ConnectionError, OSError):
                    while data := await src.read(65536):
                        dst.write(data)
                        await dst.drain()
            finally:  # cancelled too
                for w in pair:
                    w.close()
                    self._writers.discard(w)

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def cut(self) -> None:
        """Drop every connection through the proxy and refuse new ones."""
        self.up = False
        self.cuts += 1
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    def restore(self) -> None:
        """Accept (and forward) the bridge's connections again."""
        self.up = True

    async def close(self) -> None:
        """Stop listening and drop the connections."""
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


# --------------------------------------------------------------------------------------------------
# The bench
# --------------------------------------------------------------------------------------------------


@dataclass
class Site:
    """One site: its broker port, devices, connections and (hierarchical) its coordinator."""

    index: int
    port: int
    devices: list[str]
    conns: list[tuple[MiniPublisher, list[str]]] = field(default_factory=list)
    coordinator: subprocess.Popen[bytes] | None = None


async def connect_site(site: Site, per_conn: int, parallel: int = 200) -> None:
    """Open the site's device connections (``per_conn`` devices each), ``parallel`` at a time."""
    groups = [site.devices[i : i + per_conn] for i in range(0, len(site.devices), per_conn)]
    sem = asyncio.Semaphore(parallel)

    async def one(group: list[str]) -> None:
        pub = MiniPublisher(f"bench-{group[0]}")
        async with sem:
            await pub.connect("127.0.0.1", site.port)
        site.conns.append((pub, group))

    await asyncio.gather(*(one(g) for g in groups))


async def send_round(
    sites: Sequence[Site], topics: Topics, payloads: dict[str, bytes], spread_s: float, seed: int
) -> int:
    """Every device of every site publishes its update; returns the bytes sent.

    ``spread_s`` = 0: all connections at once (the burst of a round whose devices all finish
    together); otherwise each connection starts at a uniform random time in [0, ``spread_s``) s
    (devices finishing their local training at different times).
    """
    rng = np.random.default_rng(seed)

    async def one(pub: MiniPublisher, group: list[str], delay: float) -> int:
        if delay > 0:
            await asyncio.sleep(delay)
        return await pub.publish_all([(topics.update(d), payloads[d]) for d in group])

    jobs = [
        one(pub, group, float(rng.uniform(0, spread_s)) if spread_s > 0 else 0.0)
        for site in sites
        for pub, group in site.conns
    ]
    return sum(await asyncio.gather(*jobs))


def read_round_log(path: Path) -> dict[int, dict[str, Any]]:
    """The root coordinator's ``files.log`` (one JSON line per closed round) by round."""
    out: dict[int, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                out[int(entry["round"])] = entry
    return out


@dataclass
class Options:
    """The bench's command line."""

    devices: int
    sites: int
    rounds: int
    flat: bool
    per_conn: int
    deadline_s: float
    spread_s: float
    root_outage_s: float
    root_cluster: int
    uplink_cut_s: float
    site_restart: bool
    affected_sites: int
    root_stateless: bool
    root_on_last_node: bool
    json_path: Path | None
    keep: Path | None


async def run_bench(opts: Options, tmp: Path) -> dict[str, Any]:
    """Run the bench in ``tmp``; returns the JSON document (see the module docstring)."""
    fleet = f"scale{free_port()}"
    topics = Topics(PREFIX, fleet)
    shape = Backbone(shipped(MODEL)).head_from_model()[0].shape
    shape = (int(shape[0]), int(shape[1]))
    per_site = device_ids(opts.devices, opts.sites)
    every = [d for group in per_site for d in group]
    t = time.monotonic()
    payloads = await asyncio.get_running_loop().run_in_executor(
        None, encode_updates, every, shape, fleet, opts.rounds
    )
    encode_s = time.monotonic() - t
    update_bytes = len(next(iter(payloads[1].values())))
    procs: list[subprocess.Popen[bytes]] = []
    watches: list[Watch] = []
    pumps: list[asyncio.Task[None]] = []
    sites: list[Site] = []
    cluster: Cluster | None = None
    proxies: dict[int, Uplink] = {}  # site index → its uplink (--uplink-cut)
    root_log = tmp / "root-rounds.jsonl"
    try:
        # every broker's port at once: free_port() twice in a row can return the same port (a run had
        # two site brokers on one port: the second exited, "Address already in use", and its site's
        # devices and aggregator talked to the other site's broker)
        root_port, *site_ports = distinct_ports(1 + opts.sites)
        # persistence: a root broker stopped mid-round (--root-outage) keeps the root's session
        db = tmp / "root-broker-db"
        db.mkdir(exist_ok=True)
        db.chmod(0o777)  # mosquitto started as root drops to user mosquitto, who must write it
        # ... and reach it: a TemporaryDirectory is 0700, and a root broker that cannot save its state
        # comes back from --root-outage without the root coordinator's session (it then loses partials)
        tmp.chmod(tmp.stat().st_mode | 0o011)
        root_extra = "" if opts.root_stateless else f"persistence true\npersistence_location {db}/\n"
        uplinks: list[int] = []
        if opts.root_cluster:
            (tmp / "root-cluster").mkdir(exist_ok=True)
            cluster = Cluster("nats", tmp / "root-cluster", opts.root_cluster)
            await asyncio.to_thread(cluster.start)
            uplinks = list(cluster.mqtt_ports)  # the bridges: node 0 first, then the others
            root_port = uplinks[-1]  # the root coordinator and the bench's watcher: the last node
        else:
            root_broker = start_mosquitto(tmp, "root-broker", root_port, root_extra)
            procs.append(root_broker)
        common = {
            "broker.topic_prefix": PREFIX,
            "fleet.name": fleet,
            "fleet.max_devices": str(max(10_000, opts.devices + 10)),
            "rounds.count": str(opts.rounds),
            "rounds.deadline_s": str(opts.deadline_s),
            "rounds.expected_clients": "0",
            "strategy.name": "fedavg",
            "dashboard.enabled": "false",
        }
        if opts.flat:
            sites = [Site(0, root_port, every)]
            keys = tmp / "keys"
            write_keys(every, keys)
            root_sets = {
                **common,
                "broker.url": f"mqtt://127.0.0.1:{root_port}",
                "rounds.min_clients": str(opts.devices),
                "security.device_keys_dir": str(keys),
                "files.log": str(root_log),
            }
        else:
            sites = [Site(i, site_ports[i], devs) for i, devs in enumerate(per_site)]
            keys = tmp / "keys"
            root_sets = hierarchical_root_sets(common, root_port, opts, root_log, keys)
            if uplinks and not opts.root_on_last_node:
                # the root coordinator on node 0, the node that stops, failing over to the others
                root_sets["broker.url"] = f"mqtt://127.0.0.1:{uplinks[0]}"
                others = ", ".join(f'"mqtt://127.0.0.1:{port}"' for port in uplinks[1:])
                root_sets["broker.alternates"] = f"[{others}]"
            site_conf = {s.index: site_sets(common, s, keys, tmp, opts.rounds) for s in sites}
            affected = opts.affected_sites or opts.sites
            for site in sites:
                to_root = root_port
                if opts.uplink_cut_s and site.index < affected:
                    proxies[site.index] = Uplink(root_port)
                    await proxies[site.index].start()
                    to_root = proxies[site.index].port
                conf = bridge(site, to_root, fleet, uplinks)
                procs.append(start_mosquitto(tmp, f"site{site.index}-broker", site.port, conf))
        counting = not opts.root_cluster  # nats-server has no $SYS over MQTT
        root_watch = await start_watch(root_port, topics, f"bench-watch-root-{fleet}", counting)
        watches.append(root_watch)
        site_watches = [root_watch] if opts.flat else []
        if not opts.flat:
            for site in sites:
                site_watches.append(
                    await start_watch(site.port, topics, f"bench-watch-s{site.index}-{fleet}", False)
                )
            watches.extend(site_watches)
        pumps = [asyncio.create_task(w.pump()) for w in watches]
        for site in sites:
            await connect_site(site, opts.per_conn)
        connections = sum(len(s.conns) for s in sites)
        # the coordinators start last (round 1 opens when every device is connected); the sites
        # before the root: a site must be subscribed when the root's first round comes down
        if not opts.flat:
            for site in sites:
                site.coordinator = start_coordinator(
                    site_conf[site.index], tmp / f"site{site.index}-coordinator.log"
                )
                procs.append(site.coordinator)
            for site in sites:
                assert site.coordinator is not None
                await wait_logged(
                    tmp / f"site{site.index}-coordinator.log",
                    ": ready, waiting for the root's round",
                    site.coordinator,
                )
        root = start_coordinator(root_sets, tmp / "root-coordinator.log")
        procs.append(root)
        rounds: list[dict[str, Any]] = []
        counted_before: Counter[str] = Counter()
        for r in range(1, opts.rounds + 1):
            for w in site_watches:
                await w.until(lambda w=w, r=r: r in w.rounds, 300, f"round {r} announcement")
            peak_reset = reset_peak(root.pid)
            for site in sites:
                if site.coordinator is not None:
                    peak_reset = reset_peak(site.coordinator.pid) and peak_reset
            before = await sys_counters_or_none(root_watch) if counting else None
            msgs0, bytes0, drop0 = before if before is not None else (0, 0, 0)
            have_before = before is not None
            aggregators = [root, *(s.coordinator for s in sites if s.coordinator is not None)]
            cpu0 = {p.pid: cpu_seconds(p.pid) for p in aggregators}
            outage = opts.root_outage_s if r == 1 and not opts.flat else 0.0
            t0 = time.monotonic()
            node_stop = None
            if cluster is not None and r == 1:
                # node 0 of the root cluster (every bridge's first address) stops as the updates start
                node_stop = asyncio.create_task(asyncio.to_thread(cluster.stop_node, 0))
            cut = opts.uplink_cut_s if r == 1 else 0.0
            if cut:
                # the affected sites' uplinks drop as the devices start sending; back ``cut`` s later
                for proxy in proxies.values():
                    proxy.cut()
                rejoin = asyncio.create_task(restore_after(list(proxies.values()), cut))
            restarted: asyncio.Task[list[int]] | None = None
            if opts.site_restart and r == 1:
                half = opts.spread_s / 2
                restarted = asyncio.create_task(
                    restart_sites(sites[: opts.affected_sites or opts.sites], site_conf, tmp, procs, half)
                )
            if outage:
                # the root broker stops as the devices start sending: the sites' partials wait in their
                # bridges' sessions; it comes back ``outage`` s later (its $SYS counters restart at 0)
                root_broker.terminate()
                root_broker.wait(60)
                root_watch.sys.clear()
                restart = asyncio.create_task(asyncio.sleep(outage))
                msgs0 = bytes0 = drop0 = 0
                have_before = True
            sent_bytes = await send_round(sites, topics, payloads[r], opts.spread_s, r)
            if outage:
                await restart
                procs.remove(root_broker)
                root_broker = start_mosquitto(tmp, "root-broker", root_port, root_extra)
                procs.append(root_broker)
            t_sent = time.monotonic()
            if node_stop is not None:
                await node_stop
            if cut:
                await rejoin
            killed = await restarted if restarted is not None else []
            for w in site_watches:
                await w.until(
                    lambda w=w, r=r: r in w.globals, opts.deadline_s + 120, f"round {r} global head"
                )
            t1 = max(w.globals[r] for w in site_watches)
            cpu1 = {pid: cpu_seconds(pid) for pid in cpu0}
            root_peak = peak_rss(root)
            site_peak = max(
                (peak_rss(s.coordinator) for s in sites if s.coordinator is not None), default=None
            )
            after = (
                await sys_counters_or_none(root_watch, msgs0 + (len(every) if opts.flat else opts.sites))
                if counting
                else None
            )
            measured = have_before and after is not None
            msgs1, bytes1, drop1 = after if after is not None else (0, 0, 0)
            await wait_round_logged(root_log, r, root)
            entry = read_round_log(root_log)[r]
            ids = list(entry.get("update_ids", []))
            this = Counter(ids)
            dup = sum(n - 1 for n in this.values()) + sum(1 for i in this if counted_before[i])
            counted_before.update(this)
            sent_ids = {f"{d}:{r}:{r - 1}" for d in every}
            per_site_counted = Counter(i.split("-", 1)[0] for i in this)
            site_figures = [
                {
                    "site": site.index,
                    **drain_figures(
                        per_site_counted[f"s{site.index:03d}"],
                        t1 - t0,
                        cpu0.get(site.coordinator.pid),
                        cpu1.get(site.coordinator.pid),
                    ),
                }
                for site in sites
                if site.coordinator is not None
            ]
            rounds.append(
                {
                    "round": r,
                    "updates_sent": len(every),
                    "updates_counted": len(this),
                    "duplicates": dup,
                    "missing": len(sent_ids - set(this)),
                    "seconds_to_close": round(t1 - t0, 3),
                    "seconds_to_send": round(t_sent - t0, 3),
                    "seconds_after_last_update": round(t1 - t_sent, 3),
                    "root_peak_rss_bytes": root_peak,
                    "site_peak_rss_bytes": site_peak,
                    "peak_reset": peak_reset,
                    "messages_into_root": msgs1 - msgs0 if measured else None,
                    "bytes_into_root": bytes1 - bytes0 if measured else None,
                    "root_broker_dropped": drop1 - drop0 if measured else None,
                    "root_node_stopped": node_stop is not None,
                    "bytes_sent_by_devices": sent_bytes,
                    "root_outage_s": outage,
                    "uplink_cut_s": cut,
                    "uplink_cut_sites": len(proxies) if cut else 0,
                    "sites_restarted": len(killed),
                    "root_clients": entry.get("counted"),
                    **drain_figures(len(this), t1 - t0, cpu0[root.pid], cpu1[root.pid]),
                    "sites_drain": site_figures,
                    "root_refused_updates": entry.get("refused_updates", {}),
                }
            )
            print(json.dumps(rounds[-1]), flush=True)
        root.wait(120)
        return {
            "devices": opts.devices,
            "sites": opts.sites,
            "flat": opts.flat,
            "connections": connections,
            "devices_per_connection": opts.per_conn,
            "spread_s": opts.spread_s,
            "update_bytes": update_bytes,
            "head_shape": list(shape),
            "encode_s": round(encode_s, 1),
            "root_broker_persistence": not (opts.root_stateless or opts.root_cluster),
            "root_coordinator_node": (0 if not opts.root_on_last_node else opts.root_cluster - 1)
            if opts.root_cluster
            else None,
            "machine": machine(),
            "rounds": rounds,
        }
    finally:
        for site in sites:
            for pub, _ in site.conns:
                await pub.close()
        for task in pumps:
            task.cancel()
        for w in watches:
            await w.transport.stop()
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if cluster is not None:
            cluster.stop()
        for proxy in proxies.values():
            await proxy.close()


async def restore_after(proxies: Sequence[Uplink], seconds: float) -> None:
    """Restore the cut uplinks after ``seconds``."""
    await asyncio.sleep(seconds)
    for proxy in proxies:
        proxy.restore()


async def restart_sites(
    sites: Sequence[Site],
    site_conf: dict[int, dict[str, str]],
    tmp: Path,
    procs: list[subprocess.Popen[bytes]],
    after_s: float,
) -> list[int]:
    """After ``after_s`` s, kill (SIGKILL) each site's aggregator and start it again; their indexes."""
    await asyncio.sleep(after_s)
    killed: list[int] = []
    for site in sites:
        old = site.coordinator
        if old is None or old.poll() is not None:
            continue
        old.kill()
        await asyncio.to_thread(old.wait, 30)
        procs.remove(old)
        site.coordinator = start_coordinator(site_conf[site.index], tmp / f"site{site.index}-coordinator.log")
        procs.append(site.coordinator)
        killed.append(site.index)
    return killed


async def wait_round_logged(
    path: Path, r: int, proc: subprocess.Popen[bytes], timeout_s: float = 120
) -> None:
    """Wait until the root coordinator's ``files.log`` has round ``r`` (it is written after the head)."""
    deadline = time.monotonic() + timeout_s
    while r not in read_round_log(path):
        if proc.poll() is not None and r not in read_round_log(path):
            raise RuntimeError(f"root coordinator exited ({proc.returncode}) before logging round {r}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {r} not in {path} after {timeout_s} s")
        await asyncio.sleep(0.1)  # a file, not an event: polled


def write_key_pair(name: str, directory: Path) -> tuple[Path, Path]:
    """A signing key ``<name>.key`` (seed hex, 0600) and its ``<name>.pub`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    key = SigningKey(hashlib.sha256(b"edgefl-bench-scale-tier:" + name.encode()).digest())
    priv, pub = directory / f"{name}.key", directory / f"{name}.pub"
    priv.write_text(key.seed.hex() + "\n")
    priv.chmod(0o600)
    pub.write_text(key.verify_key.hex + "\n")
    return priv, pub


def site_name(site: Site) -> str:
    """The site id (``hierarchy.site``)."""
    return f"site{site.index:03d}"


async def wait_logged(path: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    """Wait until a process' log file contains ``text`` (polled: a file has no event to wait on)."""
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and text in path.read_text(errors="replace")):
        if proc.poll() is not None:
            raise RuntimeError(f"{path.name}: the process exited ({proc.returncode}) before {text!r}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name}: no {text!r} after {timeout_s} s")
        await asyncio.sleep(0.2)


def hierarchical_root_sets(
    common: dict[str, str], port: int, opts: Options, log: Path, keys: Path
) -> dict[str, str]:
    """The root coordinator's overrides: role root, a round closes at ``--sites`` signed partials."""
    root_key, _ = write_key_pair("root", keys / "root")
    return {
        **common,
        "hierarchy.role": "root",
        "hierarchy.expected_sites": str(opts.sites),
        "hierarchy.site_keys_dir": str(keys / "sites"),
        "hierarchy.site_devices": str(-(-opts.devices // opts.sites)),  # the most devices one site has
        "security.signing_key_file": str(root_key),
        "broker.url": f"mqtt://127.0.0.1:{port}",
        "rounds.min_clients": str(opts.devices),
        "files.log": str(log),
    }


def site_sets(common: dict[str, str], site: Site, keys: Path, tmp: Path, rounds: int) -> dict[str, str]:
    """A site coordinator's overrides: role site, its partial closes when its devices all answered."""
    site_key, pub = write_key_pair(site_name(site), keys / "site-private")
    (keys / "sites").mkdir(parents=True, exist_ok=True)
    shutil.copy(pub, keys / "sites" / pub.name)
    device_keys = keys / f"devices-{site.index}"
    write_keys(site.devices, device_keys)
    (tmp / f"site{site.index}-state").mkdir(exist_ok=True)
    return {
        **common,
        "hierarchy.role": "site",
        "hierarchy.site": site_name(site),
        "hierarchy.expected_devices": str(len(site.devices)),
        "hierarchy.root_key_file": str(keys / "root" / "root.pub"),
        "security.signing_key_file": str(site_key),
        "security.device_keys_dir": str(device_keys),
        "broker.url": f"mqtt://127.0.0.1:{site.port}",
        "rounds.min_clients": str(len(site.devices)),
        "rounds.count": str(rounds + 1),  # still up (and measurable) after the last round; stopped by us
        "files.log": str(tmp / f"site{site.index}-rounds.jsonl"),
        # a folder each: a coordinator holds its state file's folder (one coordinator per folder)
        "files.state": str(tmp / f"site{site.index}-state" / "state.rec"),
    }


def bridge(site: Site, root_port: int, fleet: str, cluster_ports: Sequence[int] = ()) -> str:
    """The site broker's bridge to the root, as ``edgefl bridge-config`` writes it (the product's).

    With ``cluster_ports`` (a nats-server root cluster): ``address`` lists every node (mosquitto
    tries them in order and fails over, mosquitto.conf(5)) and ``try_private false`` (a non-mosquitto
    broker refuses the bridge flag in the CONNECT protocol level).
    """
    text = bridge_config(site_name(site), f"mqtt://127.0.0.1:{root_port}", prefix=PREFIX, fleet=fleet)
    if cluster_ports:
        text = text.replace(
            f"address 127.0.0.1:{root_port}", "address " + " ".join(f"127.0.0.1:{p}" for p in cluster_ports)
        )
        text = text.replace("try_private true", "try_private false")
    return text


def machine() -> str:
    """One line about the machine: CPU model, cores, RAM, kernel, Python."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = _meminfo_total()
    except OSError:
        mem = 0
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem / (1 << 30):.0f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def _meminfo_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the bench, print one JSON line per round and write ``--json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flat", action="store_true", help="one flat coordinator and broker for every device")
    ap.add_argument("--devices-per-connection", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=600.0, help="rounds.deadline_s (seconds)")
    ap.add_argument(
        "--spread", type=float, default=0.0, help="devices send over this many seconds (0: all at once)"
    )
    ap.add_argument(
        "--root-outage",
        type=float,
        default=0.0,
        help="hierarchical: stop the root broker for this many seconds as round 1's updates start",
    )
    ap.add_argument(
        "--root-cluster",
        type=int,
        default=0,
        help="hierarchical: the root broker is an N-node nats-server cluster; node 0 stops in round 1",
    )
    ap.add_argument(
        "--uplink-cut",
        type=float,
        default=0.0,
        help="hierarchical: cut the affected sites' bridges to the root for this many seconds in round 1",
    )
    ap.add_argument(
        "--site-restart",
        action="store_true",
        help="hierarchical: kill -9 the affected site aggregators halfway through round 1's sending, restart",
    )
    ap.add_argument(
        "--affected-sites", type=int, default=0, help="the first K sites (0: all)"
    )
    ap.add_argument(
        "--root-stateless",
        action="store_true",
        help="the root mosquitto keeps no state (persistence false): --root-outage then loses its sessions",
    )
    ap.add_argument(
        "--root-on-last-node",
        action="store_true",
        help="--root-cluster: the root coordinator on the last node only (default: node 0 + alternates)",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="work in this folder and keep the logs")
    args = ap.parse_args(argv)
    if args.devices < 1 or args.sites < 1 or args.rounds < 1 or args.devices < args.sites:
        ap.error("need devices >= sites >= 1 and rounds >= 1")
    if (args.root_outage or args.root_cluster) and args.flat:
        ap.error("--root-outage and --root-cluster are for the hierarchical run")
    if (args.uplink_cut or args.site_restart) and args.flat:
        ap.error("--uplink-cut and --site-restart are for the hierarchical run")
    if args.root_outage and args.root_cluster:
        ap.error("--root-outage (mosquitto root) or --root-cluster (nats root), not both")
    opts = Options(
        args.devices,
        args.sites,
        args.rounds,
        args.flat,
        max(1, args.devices_per_connection),
        args.deadline,
        args.spread,
        args.root_outage,
        args.root_cluster,
        args.uplink_cut,
        args.site_restart,
        max(0, args.affected_sites),
        args.root_stateless,
        args.root_on_last_node,
        args.json,
        args.keep,
    )
    if opts.keep is not None:
        opts.keep.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run_bench(opts, opts.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="edgefl-scale-") as d:
            result = asyncio.run(run_bench(opts, Path(d)))
    if opts.json_path is not None:
        opts.json_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
