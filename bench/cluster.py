"""A 2-node clustered root broker on loopback (nats-server or rabbitmq-server) and its failover probe.

Starts, without root privileges where the broker allows it (own data folder, loopback ports, no
system service), either

- ``nats``: two ``nats-server`` (Debian 2.9) routed into one cluster, each with JetStream (its own
  ``store_dir``) and the MQTT listener (NATS MQTT needs JetStream: sessions, retained messages and
  QoS 1 deliveries are JetStream streams and consumers);
- ``rabbitmq``: two ``rabbitmq-server`` (Debian 3.10) nodes ``edgefl-scale-<i>@localhost``
  (``RABBITMQ_NODENAME``, ``RABBITMQ_NODE_PORT``, ``RABBITMQ_DIST_PORT``, ``RABBITMQ_MNESIA_BASE``,
  ``RABBITMQ_LOG_BASE``, ``RABBITMQ_CONFIG_FILE``, ``RABBITMQ_ENABLED_PLUGINS_FILE``) with the
  ``rabbitmq_mqtt`` plugin, the second joined to the first (``rabbitmqctl join_cluster``);

then probes what the root tier needs when one of the 2 nodes stops (MQTT 3.1.1 QoS 1, the product's
transport, :class:`edgefl.transport.MqttTransport`):

1. ``routed_*``: a persistent-session subscriber (the root coordinator) on node A receives QoS 1
   messages published on node B (a site bridge);
2. ``queued_acked``: the subscriber disconnects; the bridge publishes messages its session must keep;
3. node A stops (``--stop-node``); ``after_stop_acked``: the bridge, connected to B, publishes again;
4. ``resume*``: the subscriber reconnects to B with its client id, no clean session (what a root
   coordinator failing over does): is its session there, with the queued messages (``b`` before the
   stop, ``c`` after)?
5. ``new_connection*``: a new client connects to B and publishes (a site bridge failing over).

Every step records its seconds and, when the broker refused, ``<step>_error``.

Run: ``.venv/bin/python -m bench.cluster nats|rabbitmq [--json PATH] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefl.errors import TransportError
from edgefl.launcher import free_port
from edgefl.transport import MqttTransport

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
"""Debian's own scripts: they run as the caller (``/usr/sbin/rabbitmq-*`` switch to user rabbitmq)."""


def wait_port(port: int, proc: subprocess.Popen[bytes] | None, what: str, timeout_s: float = 15.0) -> None:
    """Wait until 127.0.0.1:``port`` accepts a connection.

    Raises
    ------
    RuntimeError
        ``proc`` (when given) exited first, or the port is not open after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not listening on {port} after {timeout_s} s") from None
            time.sleep(0.05)


@dataclass
class Cluster:
    """A broker cluster on 127.0.0.1 (``nodes``, 2 by default); node ``i``'s MQTT port: ``mqtt_ports[i]``."""

    kind: str
    tmp: Path
    nodes: int = 2
    mqtt_ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)
    _ports: dict[str, list[int]] = field(default_factory=dict)

    # -- nats ----------------------------------------------------------------------------------
    def _nats_conf(self, i: int) -> Path:
        c, r = self._ports["cluster"], self._ports["client"]
        other = [f'"nats-route://127.0.0.1:{p}"' for j, p in enumerate(c) if j != i]
        conf = self.tmp / f"nats{i}.conf"
        conf.write_text(
            f'server_name: "n{i}"\nlisten: "127.0.0.1:{r[i]}"\n'
            f'jetstream {{ store_dir: "{self.tmp / f"js{i}"}" }}\n'
            f'cluster {{ name: "edgefl-root", listen: "127.0.0.1:{c[i]}", routes: [{", ".join(other)}] }}\n'
            f'mqtt {{ listen: "127.0.0.1:{self.mqtt_ports[i]}", stream_replicas: {self.nodes} }}\n'
        )
        return conf

    def _start_nats(self, i: int) -> None:
        exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
        with open(self.tmp / f"nats{i}.log", "ab") as log:
            self.procs[i] = subprocess.Popen(
                [exe, "-c", str(self._nats_conf(i))], stdout=log, stderr=subprocess.STDOUT
            )
        wait_port(self.mqtt_ports[i], self.procs[i], f"nats-server n{i}", 30)

    # -- rabbitmq ------------------------------------------------------------------------------
    def _rabbit_env(self, i: int) -> dict[str, str]:
        base = self.tmp / f"rabbit{i}"
        base.mkdir(exist_ok=True)
        (base / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self._ports['amqp'][i]}\n"
            f"mqtt.listeners.tcp.default = 127.0.0.1:{self.mqtt_ports[i]}\n"
            "mqtt.allow_anonymous = true\nloopback_users = none\n"
            "management.tcp.port = 0\n"
        )
        (base / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        return {
            **os.environ,
            "RABBITMQ_NODENAME": f"edgefl-scale-{i}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self._ports["amqp"][i]),
            "RABBITMQ_DIST_PORT": str(self._ports["dist"][i]),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(base / "pid"),
            "RABBITMQ_FEATURE_FLAGS_FILE": str(base / "feature_flags"),
        }

    def _rabbitmqctl(self, i: int, *args: str, timeout_s: float = 120) -> str:
        env = self._rabbit_env(i)
        out = subprocess.run(
            [str(RABBIT_BIN / "rabbitmqctl"), "-n", env["RABBITMQ_NODENAME"], *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if out.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} on node {i}: {out.stderr.strip()[-400:]}")
        return out.stdout

    def _start_rabbit(self, i: int, join: bool) -> None:
        env = self._rabbit_env(i)
        with open(self.tmp / f"rabbit{i}.out", "ab") as log:
            self.procs[i] = subprocess.Popen(
                [str(RABBIT_BIN / "rabbitmq-server")],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._rabbitmqctl(i, "wait", env["RABBITMQ_PID_FILE"], "--timeout", "120", timeout_s=150)
        if join:
            self._rabbitmqctl(i, "stop_app")
            self._rabbitmqctl(i, "join_cluster", "edgefl-scale-0@localhost")
            self._rabbitmqctl(i, "start_app")
        wait_port(self.mqtt_ports[i], self.procs[i], f"rabbitmq node {i}", 120)

    # -- both ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every node and wait until each listens for MQTT (rabbitmq: the others joined node 0)."""
        n = range(self.nodes)
        self.mqtt_ports = [free_port() for _ in n]
        self.procs = [None for _ in n]
        if self.kind == "nats":
            self._ports = {"cluster": [free_port() for _ in n], "client": [free_port() for _ in n]}
            for i in n:
                self._start_nats(i)
            time.sleep(3)  # the JetStream meta leader election (logged, no port to wait on)
        else:
            self._ports = {"amqp": [free_port() for _ in n], "dist": [free_port() for _ in n]}
            for i in n:
                self._start_rabbit(i, join=i > 0)

    def stop_node(self, i: int) -> None:
        """Stop node ``i`` cleanly (SIGTERM; rabbitmq: ``rabbitmqctl stop``) and wait for it."""
        p = self.procs[i]
        if p is None:
            return
        if self.kind == "rabbitmq":
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._rabbitmqctl(i, "stop", timeout_s=60)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        self.procs[i] = None

    def restart_node(self, i: int) -> None:
        """Start node ``i`` again (same data folder: it rejoins the cluster)."""
        if self.kind == "nats":
            self._start_nats(i)
            time.sleep(3)
        else:
            self._start_rabbit(i, join=False)

    def stop(self) -> None:
        """Stop every node still running."""
        for i in range(len(self.procs)):
            self.stop_node(i)


async def _client(port: int, cid: str, persistent: bool, wait_s: float = 20) -> MqttTransport:
    t = MqttTransport(
        "127.0.0.1",
        port,
        cid,
        protocol="3.1.1",
        queue_size=10_000,
        session_expiry_s=3600 if persistent else 0,
    )
    await t.start(wait_s=wait_s)
    return t


async def _publish(t: MqttTransport, topic: str, n: int, tag: str) -> int:
    """Publish ``n`` QoS 1 messages; returns how many got a PUBACK."""
    ok = 0
    for k in range(n):
        try:
            await t.publish(topic, f"{tag}-{k}".encode(), qos=1, timeout_s=10)
            ok += 1
        except TransportError:
            pass
    return ok


async def _drain(t: MqttTransport, want: int, timeout_s: float) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            msg = await asyncio.wait_for(t.queue.get(), left)
        except TimeoutError:
            break
        got.append(msg.payload.decode())
    return got


async def _step(out: dict[str, Any], name: str, coro: Any) -> Any:
    """Run one probe step; a broker error is recorded under ``out[name + "_error"]``, not raised."""
    t0 = time.monotonic()
    try:
        return await coro
    except (TransportError, RuntimeError, OSError, TimeoutError) as exc:
        out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return None
    finally:
        out[f"{name}_s"] = round(time.monotonic() - t0, 1)


async def probe(cluster: Cluster, stop: int, n: int = 10) -> dict[str, Any]:
    """The failover probe (module docstring), stopping node ``stop``; returns what each step saw."""
    topic, filt = "edgefl/probe/partial/site0", "edgefl/probe/partial/+"
    keep = (stop + 1) % cluster.nodes
    on_stop, on_keep = cluster.mqtt_ports[stop], cluster.mqtt_ports[keep]
    out: dict[str, Any] = {
        "broker": cluster.kind,
        "nodes": cluster.nodes,
        "messages_per_step": n,
        "stopped_node": stop,
    }
    # 1. the root coordinator (persistent session) on the node that will stop, a bridge on the other
    sub = await _client(on_stop, "probe-root", persistent=True)
    await sub.subscribe(filt, 1)
    pub = await _client(on_keep, "probe-bridge", persistent=True)
    out["routed_acked"] = await _publish(pub, topic, n, "a")
    out["routed_delivered"] = len(await _drain(sub, n, 15))
    # 2. the root coordinator goes away; its session should queue what the bridge publishes
    await sub.stop()
    out["queued_acked"] = await _publish(pub, topic, n, "b")
    # 3. the node stops
    t0 = time.monotonic()
    cluster.stop_node(stop)
    out["node_stop_s"] = round(time.monotonic() - t0, 1)
    out["after_stop_acked"] = await _step(out, "after_stop_publish", _publish(pub, topic, n, "c"))
    await pub.stop()
    # 4. the root coordinator reconnects to the surviving node with its client id (no clean session)
    sub2 = await _step(out, "resume", _client(on_keep, "probe-root", persistent=True, wait_s=60))
    if sub2 is not None:
        got = await _drain(sub2, 2 * n, 20)
        out["resumed_delivered_b"] = len([m for m in got if m.startswith("b")])
        out["resumed_delivered_c"] = len([m for m in got if m.startswith("c")])
        await _step(out, "resubscribe", sub2.subscribe(filt, 1))
    # 5. a new bridge connection to the surviving node publishes
    pub2 = await _step(out, "new_connection", _client(on_keep, "probe-bridge-2", persistent=True, wait_s=60))
    if pub2 is not None:
        out["new_connection_acked"] = await _publish(pub2, topic, n, "d")
        if sub2 is not None:
            out["new_connection_delivered"] = len(await _drain(sub2, n, 15))
        await pub2.stop()
    if sub2 is not None:
        await sub2.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    """Start the cluster, run the probe, print and write the JSON, stop the cluster."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("kind", choices=["nats", "rabbitmq"])
    ap.add_argument("--nodes", type=int, default=2, help="cluster size (default 2)")
    ap.add_argument("--stop-node", type=int, default=0, help="the node stopped mid-run (0-based)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="data and logs in this folder, kept")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = args.keep
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgefl-cluster-")))
        cluster = Cluster(args.kind, tmp, args.nodes)
        try:
            t0 = time.monotonic()
            cluster.start()
            started = round(time.monotonic() - t0, 1)
            result = asyncio.run(probe(cluster, args.stop_node))
            result["start_s"] = started
        finally:
            cluster.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
