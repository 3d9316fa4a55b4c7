"""Shared fixtures: a real mosquitto broker on 127.0.0.1, unique topic prefixes, the shipped models."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# first of the product: edgefl.cli's process settings (one BLAS thread, the malloc knobs) go into the
# environment before numpy loads, as for the shipped commands; the xdist workers inherit them. Without
# them each worker's OpenBLAS starts a thread per core that spin-waits between the in-process tests'
# small matrix products (the poisoning rounds used 2.4x the CPU on 2 cores)
import edgefl.cli  # noqa: F401
from edgefl.launcher import free_port, stop_agents
from tests.support.broker import Broker, mosquitto_path, restart_mosquitto, start_mosquitto, stop_broker

if TYPE_CHECKING:
    from edgefl.coordinator.service import Coordinator
    from edgefl.runtime import Backbone
    from edgefl.topics import Topics
    from edgefl.transport import MqttTransport

# tests import these from here; the launcher is tests/support/broker.py (benches use it too)
__all__ = ["Broker", "free_port", "mosquitto_path", "restart_mosquitto", "start_mosquitto", "stop_broker"]

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
FLOAT_MODEL = MODELS / "digits_cnn_float32.tflite"
INT8_MODEL = MODELS / "digits_cnn_int8.tflite"
RAWIN_MODEL = MODELS / "digits_cnn_int8_rawin.tflite"  # the dev profile's model: uint8 raw input
DEV_PROFILE = ROOT / "firmware_configs" / "dev_x86.toml"
CHROMIUM = "/usr/bin/chromium"  # Debian's chromium, driven by playwright with executable_path
# without the background-networking flags Chromium tries hosts this closed network refuses
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


BROKER_FIXTURES = frozenset({"mosquitto", "bridged_brokers", "tls_broker", "mtls_broker", "acl_broker"})
"""Fixtures that start a mosquitto: a test using one (directly or through another) is marked ``broker``."""
SUBPROCESS_FIXTURES = BROKER_FIXTURES | {
    "pki",
    "wheel",
    "host_house",
    "sse_server",
    "browser",
    "two_agents",
    "agents",
    "agent_log",
}
"""Fixtures that start a process: a test that uses one is marked ``subprocess``."""
FAST_TIER_ENV = "EDGEFL_FAST_TIER"
"""Set by ``make check``: a test there that starts a process fails, naming the marker it lacks."""


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``long`` marker (the ordering below reads it)."""
    config.addinivalue_line(
        "markers",
        "long: waits out a long window (a soak's minutes, a round's deadline, rounds of real processes): "
        "handed out right after the benches, so that the wait overlaps other tests",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests whose fixtures start mosquitto or a process (``make check`` deselects them), and
    hand out the files that start processes before the others.

    xdist gives each worker the next test as it finishes one, in this order: with the long tests
    (a bench's rounds: the longest CPU-bound items; then processes, brokers) first and the many short
    in-process ones last, the workers end together rather than one waiting out a long test handed
    out last. Right after the benches come the ``long`` tests, mostly waiting (a soak's window, a
    round's deadline): handed out among the last, one of them ran alone for the final 20 s of a
    4-worker run. A file's tests keep their order. (``--dist loadgroup`` hands out the
    ``xdist_group`` groups of several tests before single tests.)
    """
    heavy: dict[str, bool] = {}
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & BROKER_FIXTURES:
            item.add_marker(pytest.mark.broker)
        if names & SUBPROCESS_FIXTURES:
            item.add_marker(pytest.mark.subprocess)
        path = item.nodeid.split("::")[0]
        heavy[path] = heavy.get(path, False) or item.get_closest_marker("subprocess") is not None
    first_seen = {path: i for i, path in enumerate(heavy)}

    def order(it: pytest.Item) -> tuple[bool, bool, bool, int]:
        path = it.nodeid.split("::")[0]
        bench, long = (it.get_closest_marker(m) is None for m in ("bench", "long"))
        return bench, long, not heavy[path], first_seen[path]

    items.sort(key=order)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Agent processes a test starts (it appends them): stopped after the test, then the last
    3000 characters of every ``*.log`` in ``tmp_path`` printed (pytest shows them on a failure)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        stop_agents(procs)
        for log in tmp_path.glob("*.log"):
            print(log.read_text(errors="replace")[-3000:])


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """In ``make check`` (the fast tier), a test that starts a process fails: mark it ``subprocess``."""
    node = request.node
    if not os.environ.get(FAST_TIER_ENV) or any(node.get_closest_marker(m) for m in ("broker", "subprocess")):
        yield
        return
    started: list[str] = []
    popen_init = subprocess.Popen.__init__

    def refuse(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        started.append(str(args)[:120])
        raise AssertionError(
            f"{node.nodeid} starts a process ({str(args)[:120]}): mark it "
            "@pytest.mark.subprocess (or broker), the fast tier runs none"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
    monkeypatch.setattr(subprocess.Popen, "__init__", popen_init)
    assert started == [], f"started a process in the fast tier: {started}"


async def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``cond`` every 20 ms for up to ``timeout_s``; AssertionError naming ``what`` if it stays false."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


#: Status interval of test agents (profile key status.interval_s): a wait for a fresh status is short.
TEST_STATUS_INTERVAL_S = "0.2"


async def next_status_fields(transport: Any) -> dict[str, Any]:
    """The next non-empty DeviceStatus on ``transport``'s queue (subscribed to a status topic): its
    fields plus ``state``; empty payloads (a cleared retained status) are skipped."""
    from edgefl.wire.status import decode_status

    while True:
        msg = await transport.queue.get()
        if msg.payload:
            st = decode_status(msg.payload)
            return dict(st.fields, state=st.state)


@contextlib.asynccontextmanager
async def coordinator_and_device(
    broker: Broker, fleet: str, topics: Topics, bb: Backbone, **options: Any
) -> AsyncIterator[tuple[Coordinator, MqttTransport, asyncio.Task[None]]]:
    """An in-process coordinator on ``bb``'s head and a device-side transport, both on ``broker``.

    FedAvg (1 epoch, lr 0.05, batch 16, ``min_clients`` 1, deadline 5 s); ``options``: more
    :class:`Coordinator` keywords. Yields the coordinator, the device transport and the coordinator's pump
    task, the coordinator started (adoption wait 0.2 s); on exit the pump is cancelled and both
    transports stopped.
    """
    from edgefl.coordinator.fedavg import FedAvg
    from edgefl.coordinator.service import Coordinator
    from edgefl.transport import MqttTransport

    W0, b0 = bb.head_from_model()
    t = MqttTransport(broker.host, broker.port, f"coord-{fleet}")
    tx = MqttTransport(broker.host, broker.port, f"dev-{fleet}")
    await t.start(wait_s=10)
    await tx.start(wait_s=10)
    strategy = FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=1, deadline_s=5)
    coord = Coordinator(t, topics, W0, b0, model_sha256=bb.sha256, strategy=strategy, **options)
    pump = asyncio.create_task(coord.pump())
    try:
        await coord.start(adopt_wait_s=0.2)
        yield coord, tx, pump
    finally:
        pump.cancel()
        await tx.stop()
        await t.stop()


async def next_status(coord: Any, device: str, timeout_s: float = 15.0) -> dict[str, Any]:
    """Wait until ``coord`` (a Coordinator) holds a status of ``device`` newer than the one it holds now.

    Each received status replaces the device's entry by a new dict, so identity tells a new one.
    """
    devices = coord.registry.devices
    before = devices.get(device)
    await wait_until(
        lambda: devices.get(device) is not None and devices.get(device) is not before,
        timeout_s,
        f"a new status from {device}",
    )
    return dict(coord.registry.devices[device])


def read_mqtt_packet(sock: socket.socket) -> tuple[int, bytes]:
    """One MQTT packet read from ``sock`` (plain or TLS): (its first byte, its body)."""
    first = sock.recv(1)[0]
    length, shift = 0, 0
    while True:
        byte = sock.recv(1)[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return first, body


@pytest.fixture(scope="session")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One real mosquitto broker for the whole session, on a free 127.0.0.1 port."""
    b = start_mosquitto(tmp_path_factory.mktemp("mosquitto"))
    yield b
    stop_broker(b)


class Link:
    """A TCP link from a site broker's bridge to the root broker that a test can cut: the site's uplink.

    Parameters
    ----------
    target_port : int
        The root broker's port on 127.0.0.1; the bridge connects to ``port`` instead.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._up = threading.Event()
        self._up.set()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._server.accept()
            except OSError:
                return  # closed
            if not self._up.is_set():
                down.close()  # the uplink is cut: the bridge's connection attempt fails
                continue
            try:
                up = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:
                down.close()
                continue
            up.settimeout(None)
            with self._lock:
                self._conns += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Drop the link's connections and refuse new ones until :meth:`restore`."""
        self._up.clear()
        with self._lock:
            conns, self._conns = self._conns, []
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restore(self) -> None:
        """Accept the bridge's connections again."""
        self._up.set()

    def close(self) -> None:
        self._server.close()
        self.cut()


@dataclass
class BridgedBrokers:
    """A root mosquitto and one mosquitto per site, each site bridged to the root through a :class:`Link`."""

    root: Broker
    sites: dict[str, Broker]
    links: dict[str, Link]


def start_bridged_brokers(tmp: Path, sites: tuple[str, ...]) -> BridgedBrokers:
    """Start a root broker and bridged site brokers (bridge config from ``edgefl bridge-config``'s function).

    Every broker keeps its sessions and queues on disk (``persistence true``) as docs/operations.md says.
    """
    from edgefl.coordinator.bridge import bridge_config

    def persistent(name: str) -> str:
        folder = tmp / f"store-{name}"
        folder.mkdir()
        return f"persistence true\npersistence_location {folder}/\nautosave_interval 1\n"

    root = start_mosquitto(tmp, persistent("root"))
    brokers: dict[str, Broker] = {}
    links: dict[str, Link] = {}
    for site in sites:
        link = Link(root.port)
        bridge = bridge_config(site, f"mqtt://127.0.0.1:{link.port}", restart_timeout_s=(1, 1))
        brokers[site] = start_mosquitto(tmp, persistent(site) + bridge)
        links[site] = link
    return BridgedBrokers(root, brokers, links)


@pytest.fixture(scope="module")
def bridged_brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BridgedBrokers]:
    """A root broker and two bridged site brokers (``site-a``, ``site-b``) for a test module."""
    b = start_bridged_brokers(tmp_path_factory.mktemp("bridged"), ("site-a", "site-b"))
    yield b
    for link in b.links.values():
        link.close()
    for broker in (*b.sites.values(), b.root):
        stop_broker(broker)


@pytest.fixture
def fleet() -> str:
    """A unique fleet name, so each test has its own topic space on the shared broker."""
    return f"t{uuid.uuid4().hex[:10]}"


def start_replay_agent(
    broker: Broker, fleet: str, tmp: Path, dev: str, x: Any, y: Any, **extra: str
) -> subprocess.Popen[bytes]:
    """Start a real agent process (dev profile, int8 model) replaying x, y; its log is tmp/<dev>.log."""
    import numpy as np

    from edgefl.launcher import launch_agent

    np.savez(tmp / f"{dev}.npz", x=x, y=y)
    overrides = {
        "device.id": dev,
        "device.fleet": fleet,
        "device.state_dir": str(tmp / dev),
        "broker.url": broker.url,
        "source.kind": "replay",
        "source.path": str(tmp / f"{dev}.npz"),
        "model.path": str(INT8_MODEL),
        "dashboard.enabled": "false",
        "status.interval_s": TEST_STATUS_INTERVAL_S,
        **{k.replace("__", "."): v for k, v in extra.items()},
    }
    return launch_agent(DEV_PROFILE, overrides, tmp / f"{dev}.log")


def start_ingest_agent(
    broker: Broker, fleet: str, tmp: Path, dev: str, **extra: str
) -> subprocess.Popen[bytes]:
    """Start a real agent process (dev profile and its raw-input int8 model) taking live samples over MQTT.

    ``source.kind = "mqtt"``: samples on ``samples/<dev>``, labels on ``labels/<dev>``, predictions on
    ``predictions/<dev>``. Extra keys as ``start_replay_agent``'s (``source__queue_max="4"``).
    """
    from edgefl.launcher import launch_agent

    overrides = {
        "device.id": dev,
        "device.fleet": fleet,
        "device.state_dir": str(tmp / dev),
        "broker.url": broker.url,
        "source.kind": "mqtt",
        "dashboard.enabled": "false",
        "status.interval_s": TEST_STATUS_INTERVAL_S,
        **{k.replace("__", "."): v for k, v in extra.items()},
    }
    return launch_agent(DEV_PROFILE, overrides, tmp / f"{dev}.log")


# --------------------------------------------------------------------------------------------------
# A test PKI (``cryptography``): CA, broker certificate for 127.0.0.1, client certificate, password file
# --------------------------------------------------------------------------------------------------

USER, PASSWORD = "edge-device", "correct horse battery staple"


@dataclass(frozen=True)
class Pki:
    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    wrong_name_cert: Path
    wrong_name_key: Path
    client_cert: Path
    client_key: Path
    passwd: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        key_path = path.with_suffix(".key")
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        key_path.chmod(0o600)


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    cn: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    *,
    server_ip: str | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = dt.datetime.now(dt.UTC)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server_ip else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca[1].public_key()), critical=False)
    )
    if server_ip is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(server_ip))]), critical=False
        )
    return builder.sign(ca[1], hashes.SHA256()), key


def mosquitto_passwd_path() -> str:
    path = shutil.which("mosquitto_passwd")
    if path is None:
        raise RuntimeError("mosquitto_passwd not installed: apt-get install mosquitto (it ships the tool)")
    return path


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = _ca("edgefl test CA")
    other = _ca("some other CA")
    _write(d / "ca.pem", ca[0])
    _write(d / "other_ca.pem", other[0])
    server = _leaf("broker", ca, server_ip="127.0.0.1")
    _write(d / "server.pem", *server)
    wrong = _leaf("broker-elsewhere", ca, server_ip="10.9.8.7")  # valid chain, wrong address
    _write(d / "wrong.pem", *wrong)
    client = _leaf("dev-1", ca)
    _write(d / "client.pem", *client)
    passwd = d / "passwd"
    subprocess.run([mosquitto_passwd_path(), "-c", "-b", str(passwd), USER, PASSWORD], check=True)
    return Pki(
        ca=d / "ca.pem",
        other_ca=d / "other_ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        wrong_name_cert=d / "wrong.pem",
        wrong_name_key=d / "wrong.key",
        client_cert=d / "client.pem",
        client_key=d / "client.key",
        passwd=passwd,
    )


def tls_conf(pki: Pki, cert: Path, key: Path, *, require_certificate: bool) -> str:
    """mosquitto config lines of a TLS listener with the test PKI and its password file."""
    return (
        "allow_anonymous false\n"
        f"password_file {pki.passwd}\n"
        f"cafile {pki.ca}\n"
        f"certfile {cert}\n"
        f"keyfile {key}\n"
        "tls_version tlsv1.2\n"
        f"require_certificate {'true' if require_certificate else 'false'}\n"
        "user root\n"  # keep read access to the test's files when CI runs as root (no effect otherwise)
    )
