"""edgefl next to Flower 1.42, side by side: bytes per client per round, round latency, client RSS, accuracy.

Both systems run the same job on this machine, alternately: 2 clients, 5 rounds, FedAvg, a head of
512 x 10 (the shipped ``digits_cnn_int8_rawin`` backbone) trained 1 local epoch (SGD, lr 0.05, batch 32)
on the same non-IID digits shards (``edgefl.datasets``), evaluated on the same test split. Each client
talks to its server through its own port of a byte-counting TCP proxy on 127.0.0.1 (TCP payload bytes,
both directions: framing, statuses and keep-alives included). The proxy's socket toward the server
stands for the client's own: ``TCP_NODELAY`` for both systems, and for edgefl's agents also
``TCP_QUICKACK`` re-armed after every read, as ``edgefl.mqtt_socket`` does (``BENCH_NO_QUICKACK=1``
leaves it off).

- **edgefl**: a real mosquitto (``bench.round_overhead.mosquitto``), 2 real agent processes
  (``edgefl run firmware_configs/dev_x86.toml`` with the gateway profiles' ``status.heartbeat_s = 60``:
  replay -> LiteRT -> store -> head training -> CBOR update, QoS 1) and the real coordinator
  (``Coordinator.run_round``) in this process, connected to the broker directly. Variants
  (:data:`VARIANTS`): ``int8`` as shipped (int8 both ways, mosquitto's defaults, the agents'
  dashboards and personal heads on) and five that each change one thing of it: ``float32`` and
  ``topk_int8`` (the wire), ``int8_nodelay`` (mosquitto's ``set_tcp_nodelay true``),
  ``int8_no_dashboard`` (the dashboards off), ``int8_no_personal`` (the personal heads off: work
  Flower's client does not do; its ratios are named ``..._no_personal``, the headline stays ``int8``).
- **Flower**: the legacy gRPC ``start_server`` (FedAvg) and 2 ``start_client`` NumPyClients
  (``bench/peer_flower.py``), run with the python of Flower's own venv (``--flower-venv``, created
  with ``flwr==1.42.0`` and numpy when absent; the only network use is that pip install), training
  on the embeddings edgefl's backbone gives for the same shards.

Figures (both systems alike: the same interpreter flags, -OO unless ``--plain``, the same glibc malloc
settings, bytecode compiled for those flags and every file read once before the first run): bytes
(up + down) per client per round over rounds 1..5, and for edgefl the same bytes by MQTT
packet kind (PUBLISH per topic kind, PUBACK, PINGREQ...: :class:`MqttSplitter` in the proxy); round
start -> aggregation (edgefl: ``run_round`` begins -> ``publish_global`` called; Flower:
``configure_fit`` -> ``aggregate_fit`` returned), median of rounds 2..5; ``cycle_ms``: one round's
start to the next round's start (edgefl's new head encoded and published included, as Flower's model
goes out inside its round), median of rounds 2..4, and for edgefl where it goes (``cycle_split_ms``,
:func:`cycle_split`); ``cpu_ms_per_round_device`` (each client process,
every thread) and ``cpu_ms_per_round_server`` (edgefl: the coordinator, in this process, plus mosquitto;
Flower: its server process) over the same start-to-start cycles; peak RSS (VmHWM) of each client
process; final test accuracy. Ratios: ``peak_rss_like_for_like_d512`` against ``int8_no_dashboard``
(no page, as Flower's client has none), the others against ``int8``.
With ``--repeats N`` every figure is the median over the N alternating repeats.

Run: ``.venv/bin/python -m bench.peer --json PATH`` writes ``{"ratios": {METRIC: edgefl/Flower},
"accuracy": {...}, "runs": [...]}`` and prints a markdown table. ``--rss-only N`` measures only
edgefl's agents' peak RSS, dashboard on and off, N runs each (no Flower, no network).
``--cpu-rounds N`` measures only the CPU each system uses per round, every process counted
(:func:`cpu_per_round`). ``--rounds N`` runs N rounds instead of 5 (steady-state medians).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.round_overhead import mosquitto
from edgefl.coordinator.service import Coordinator
from edgefl.coordinator.strategies import make_strategy
from edgefl.datasets import load_digits, partition_non_iid, split_digits
from edgefl.evaluation import accuracy, embed_all
from edgefl.launcher import MALLOC_ENV as DEMO_MALLOC_ENV
from edgefl.launcher import free_port, launch_agent, stop_agents
from edgefl.mqtt_socket import quickack
from edgefl.resources import shipped
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import HeadLayout

ROUNDS = 5
EPOCHS, LR, BATCH = 1, 0.05, 32
FLOWER_VERSION = "1.42.0"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class Variant:
    """One edgefl configuration of the bench."""

    name: str
    uplink: Compression
    downlink: HeadLayout
    broker_nodelay: bool
    dashboard: bool
    personal: bool = True


VARIANTS = (
    Variant("int8", Compression.INT8, HeadLayout.INT8, False, True),
    Variant("float32", Compression.NONE, HeadLayout.FLOAT32, False, True),
    Variant("topk_int8", Compression.TOPK_INT8, HeadLayout.INT8, False, True),
    Variant("int8_nodelay", Compression.INT8, HeadLayout.INT8, True, True),
    Variant("int8_no_personal", Compression.INT8, HeadLayout.INT8, False, True, personal=False),
    Variant("int8_no_dashboard", Compression.INT8, HeadLayout.INT8, False, False),
)
"""``int8`` (int8 both ways, mosquitto's defaults, the agents' dashboards and personal heads on, as
shipped) and variants that each change one thing of it: the wire (``float32``, ``topk_int8``), the
broker's ``set_tcp_nodelay`` (``int8_nodelay``), the personal heads off (``int8_no_personal``: work
Flower's client does not do; ``personal.enabled = false``, not the shipped setting), or the
dashboards off (``int8_no_dashboard``)."""

INTERPRETER_FLAGS: tuple[str, ...] = ("-OO",)
"""Both systems' processes (edgefl's agents, Flower's server and clients) run with these flags and
with :data:`MALLOC_ENV` (as edgefl's systemd unit runs an agent); ``--plain`` runs both without."""
MALLOC_ENV: dict[str, str] = dict(DEMO_MALLOC_ENV)


# --- the counting proxy (a child process: ``python -m bench.peer proxy LOG LABEL:LPORT:TPORT ...``) --------
_MQTT_TYPES = {
    1: "CONNECT",
    2: "CONNACK",
    3: "PUBLISH",
    4: "PUBACK",
    8: "SUBSCRIBE",
    9: "SUBACK",
    12: "PINGREQ",
    13: "PINGRESP",
    14: "DISCONNECT",
}


class MqttSplitter:
    """Cuts one direction of an MQTT byte stream into packets and names each one.

    A PUBLISH is named by its topic's kind (``PUBLISH round``, ``PUBLISH status``...: the topic
    segments after ``<prefix>/<fleet>/``, the device id dropped), other packets by their type.
    Source: MQTT 5.0 §2.1 (fixed header, Variable Byte Integer), §3.3.2 (PUBLISH topic name).
    """

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[str, int]]:
        """Append ``data``; return (kind, packet bytes) of every packet now complete."""
        self.buf += data
        out: list[tuple[str, int]] = []
        while len(self.buf) >= 2:
            mult, length, i = 1, 0, 1
            while True:
                if i >= len(self.buf):
                    return out
                byte = self.buf[i]
                length += (byte & 0x7F) * mult
                mult *= 128
                i += 1
                if not byte & 0x80:
                    break
            if len(self.buf) < i + length:
                return out
            ptype = self.buf[0] >> 4
            kind = _MQTT_TYPES.get(ptype, f"type{ptype}")
            if ptype == 3:
                tlen = int.from_bytes(self.buf[i : i + 2], "big")
                parts = bytes(self.buf[i + 2 : i + 2 + tlen]).decode("utf-8", "replace").split("/")[2:]
                if len(parts) >= 2 and parts[0] in ("update", "status", "samples", "predictions"):
                    parts = parts[:1]
                kind = "PUBLISH " + ("/".join(parts) or "(alias)")
            out.append((kind, i + length))
            del self.buf[: i + length]
        return out


async def _proxy_main(log_path: str, specs: Sequence[str]) -> None:
    counts: list[tuple[float, str, str, int, str]] = []
    mqtt_labels = {spec.split(":")[0] for spec in specs if spec.endswith(":mqtt")}

    async def pipe(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        label: str,
        way: str,
        server_sock: Any = None,
    ) -> None:
        # an MQTT stream is logged packet by packet, anything else (gRPC) read by read
        splitter = MqttSplitter() if label in mqtt_labels else None
        # the proxy's socket toward the server stands for the client's own: for edgefl's agents it
        # re-arms TCP_QUICKACK after every read as the agent's transport does (edgefl.transport)
        quick = way == "down" and splitter is not None and not os.environ.get("BENCH_NO_QUICKACK")
        sock = server_sock if quick else None
        try:
            while data := await reader.read(65536):
                now = time.time()
                writer.write(data)  # forwarded first: the counting below is not on the message's path
                if sock is not None:
                    quickack(sock)
                if splitter is None:
                    counts.append((now, label, way, len(data), "-"))
                else:
                    counts.extend((now, label, way, n, kind) for kind, n in splitter.feed(data))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def handler(label: str, target: int) -> Any:
        async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
            sr, sw = await asyncio.open_connection("127.0.0.1", target)
            for s in (cw, sw):
                s.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server_sock = sw.get_extra_info("socket")
            await asyncio.gather(pipe(cr, sw, label, "up"), pipe(sr, cw, label, "down", server_sock))

        return handle

    servers = []
    for spec in specs:
        label, lport, tport = spec.split(":")[:3]
        servers.append(await asyncio.start_server(handler(label, int(tport)), "127.0.0.1", int(lport)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    with open(log_path, "w") as fh:
        for t, label, way, n, kind in counts:
            fh.write(f"{t:.6f} {label} {way} {n} {kind.replace(' ', '_')}\n")


class Proxy:
    """The counting proxy as a child process: one listening port per client label."""

    def __init__(self, work: Path, targets: dict[str, int], mqtt: bool = False) -> None:
        self.log = work / f"proxy-{time.time_ns()}.txt"
        self.ports = {label: free_port() for label in targets}
        specs = [
            f"{label}:{self.ports[label]}:{port}{':mqtt' if mqtt else ''}" for label, port in targets.items()
        ]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.peer", "proxy", str(self.log), *specs], cwd=HERE.parent
        )
        _wait_listening(list(self.ports.values()), 20)

    def stop(self) -> list[tuple[float, str, str, int, str]]:
        """Stop the proxy and return its log: (time s, label, "up"/"down", bytes, packet kind or "-")."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=15)
        rows = []
        for line in self.log.read_text().splitlines():
            t, label, way, n, kind = line.split()
            rows.append((float(t), label, way, int(n), kind.replace("_", " ")))
        return rows


def _wait_listening(ports: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for port in ports:
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}") from None
                time.sleep(0.05)


Rows = list[tuple[float, str, str, int, str]]


def _bytes_per_round(rows: Rows, label: str, t0: float, t1: float) -> float:
    return sum(r[3] for r in rows if r[1] == label and t0 <= r[0] < t1) / ROUNDS


def _breakdown(rows: Rows, t0: float, t1: float) -> dict[str, dict[str, list[float]]]:
    """Per way and packet kind: [packets, bytes] per client per round (both clients' mean), rounds 1..5."""
    out: dict[str, dict[str, list[float]]] = {"up": {}, "down": {}}
    clients = len({r[1] for r in rows}) or 1
    for t, _, way, n, kind in rows:
        if t0 <= t < t1:
            cell = out[way].setdefault(kind, [0.0, 0.0])
            cell[0] += 1 / (ROUNDS * clients)
            cell[1] += n / (ROUNDS * clients)
    return out


def _vm_hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for pid {pid}")


def task_cpu_s(pid: int) -> float:
    """CPU time (s) of every live thread of ``pid``: ``/proc/<pid>/task/*/schedstat``'s first fields summed.

    Nanosecond resolution (``/proc/<pid>/stat``'s ticks are 10 ms, as much as a round's work); threads
    that already exited are not in it (an agent's threads live as long as it does).
    """
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def _pid_of_conf(conf_name: str) -> int:
    """The pid of the process whose command line names ``conf_name`` (the bench's mosquitto)."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if conf_name in (d / "cmdline").read_bytes().decode("utf-8", "replace"):
                    return int(d.name)
            except OSError:
                continue
    raise RuntimeError(f"no process runs {conf_name}")


def per_cycle(marks: dict[int, float]) -> list[float]:
    """Differences between consecutive round starts ``marks[r + 1] - marks[r]`` for r = 2 .. ROUNDS - 1.

    Round 1 (start-up traffic) and the last round (no next start) are left out, for both systems.
    """
    return [marks[r + 1] - marks[r] for r in range(2, ROUNDS)]


def warm_page_cache(roots: Sequence[Path]) -> int:
    """Read every ``.py``, ``.pyc`` and shared library under ``roots`` once (both systems start warm).

    Returns the bytes read.
    """
    n = 0
    for root in roots:
        for path in root.rglob("*"):
            if path.suffix in (".py", ".pyc", ".so") or ".so." in path.name:
                try:
                    with open(path, "rb") as fh:
                        while chunk := fh.read(1 << 20):
                            n += len(chunk)
                except OSError:
                    continue
    return n


# --- the shared job -----------------------------------------------------------------------------------------
@dataclass
class Job:
    """What both systems use: shards (raw for edgefl, embeddings for Flower), test set, factory head."""

    model: Path
    sha256: str
    W0: Any
    b0: Any
    raw_shards: list[Path]
    emb_shards: list[Path]
    emb_test: Any
    y_test: Any
    init: Path


def make_job(work: Path) -> Job:
    """Split digits as the demo does, 2 non-IID shards; embed them with edgefl's backbone for Flower."""
    model = shipped("models/digits_cnn_int8_rawin.tflite")
    backbone = Backbone(model, num_threads=1)
    x, y = load_digits()
    split = split_digits(y)
    pool = split.devices
    shards = [pool[s] for s in partition_non_iid(y[pool], 2, seed=0)]
    mean, std = (0.0,), (16.0,)
    W0, b0 = backbone.head_from_model()
    raw, emb = [], []
    for i, shard in enumerate(shards, 1):
        raw.append(work / f"dev-{i}.npz")
        np.savez(raw[-1], x=x[shard], y=y[shard])
        emb.append(work / f"emb-{i}.npz")
        np.savez(emb[-1], x=embed_all(backbone, x[shard], mean, std), y=y[shard])
    init = work / "init.npz"
    np.savez(init, W=W0, b=b0)
    return Job(
        model,
        backbone.sha256,
        W0,
        b0,
        raw,
        emb,
        embed_all(backbone, x[split.test], mean, std),
        y[split.test],
        init,
    )


# --- one edgefl run ------------------------------------------------------------------------------
class _TimedCoordinator(Coordinator):
    agg_at: dict[int, float]
    update_at: dict[int, list[float]]

    def _accept(self, rnd: Any, update: Any, size_bytes: int) -> None:
        self.update_at.setdefault(update.round, []).append(time.time())  # an update reached the round
        super()._accept(rnd, update, size_bytes)

    async def publish_global(self, round_no: int) -> None:
        self.agg_at[round_no] = time.time()  # aggregation done, the new head about to go out
        await super().publish_global(round_no)


def cycle_split(
    starts: dict[int, float], update_at: dict[int, list[float]], agg_at: dict[int, float]
) -> dict[str, float]:
    """Where edgefl's cycle goes, ms, medians of rounds 2 .. ROUNDS - 1 (as :func:`per_cycle`).

    ``to_first_update``: round start (announcement) -> the first update accepted (the global head's
    and the announcement's way to a device, its training, the update's way back);
    ``to_last_update``: first -> last update; ``to_aggregate``: last update -> aggregated;
    ``to_next_start``: aggregated -> the next round's start (the head encoded and published).
    """
    rounds = range(2, ROUNDS)
    parts = {
        "to_first_update": [min(update_at[r]) - starts[r] for r in rounds],
        "to_last_update": [max(update_at[r]) - min(update_at[r]) for r in rounds],
        "to_aggregate": [agg_at[r] - max(update_at[r]) for r in rounds],
        "to_next_start": [starts[r + 1] - agg_at[r] for r in rounds],
    }
    return {k: 1e3 * statistics.median(v) for k, v in parts.items()}


async def _edgefl_rounds(
    port: int, job: Job, v: Variant, fleet: str, cpu: dict[str, int] | None = None
) -> tuple[dict[int, float], dict[str, dict[int, float]], _TimedCoordinator]:
    transport = MqttTransport("127.0.0.1", port, f"coord-{fleet}")
    await transport.start(wait_s=15)
    strategy = make_strategy(
        "fedavg", local_epochs=EPOCHS, lr=LR, batch_size=BATCH, min_clients=2, deadline_s=60.0
    )
    coord = _TimedCoordinator(
        transport,
        Topics("edgefl", fleet),
        job.W0,
        job.b0,
        model_sha256=job.sha256,
        strategy=strategy,
        # no central evaluation between rounds (Flower's server runs none either: fraction_evaluate 0,
        # no evaluate_fn); the final head is evaluated once, after the run (run_edgefl)
        evaluate=None,
        compression=v.uplink,
        downlink=v.downlink,
        lr_decay=1.0,
    )
    coord.agg_at, coord.update_at = {}, {}
    pump = asyncio.create_task(coord.pump())
    starts: dict[int, float] = {}
    cpu = cpu or {}  # label -> pid whose CPU is read as each round starts
    marks: dict[str, dict[int, float]] = {label: {} for label in (*cpu, "coordinator")}
    try:
        await coord.start()
        await coord.registry.wait_for_devices(2, timeout_s=180)
        # start-up statuses (ready; the coordinator's own retained head counted as a redelivery) are
        # not round traffic: left to arrive before round 1's window opens (they landed in it in some runs)
        await asyncio.sleep(1.0)
        for r in range(1, ROUNDS + 1):
            starts[r] = time.time()
            for label, pid in cpu.items():
                marks[label][r] = task_cpu_s(pid)
            marks["coordinator"][r] = time.process_time()  # this process: the coordinator
            rec = await coord.run_round(r)
            if rec.clients != 2:
                raise RuntimeError(f"edgefl {v.name} round {r}: {rec.clients} updates")
        await asyncio.sleep(1.0)  # the last global head reaches the devices
        starts[ROUNDS + 1] = time.time()
    finally:
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        await transport.stop()
    return starts, marks, coord


def agent_overrides(
    run_dir: Path, proxy: Proxy, fleet: str, job: Job, i: int, *, dashboard: bool, personal: bool = True
) -> dict[str, str]:
    """Profile overrides of the bench's agent ``dev-<i>`` (i = 1, 2): replaying shard i through the proxy."""
    return {
        "device.id": f"dev-{i}",
        "device.fleet": fleet,
        "device.state_dir": str(run_dir / f"state{i}"),
        "broker.url": f"mqtt://127.0.0.1:{proxy.ports[f'c{i}']}",
        "source.kind": "replay",
        "source.path": str(job.raw_shards[i - 1]),
        "model.path": str(job.model),
        "training.store_capacity": "1024",
        "dashboard.enabled": "true" if dashboard else "false",
        "personal.enabled": "true" if personal else "false",
        "status.heartbeat_s": "60",  # as the gateway profiles
    }


def run_edgefl(work: Path, job: Job, v: Variant) -> dict[str, Any]:
    """One edgefl run of variant ``v``; per-client figures."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"edgefl-{v.name}-", dir=work))
    profile = HERE.parent / "firmware_configs" / "dev_x86.toml"
    with mosquitto(run_dir, "set_tcp_nodelay true" if v.broker_nodelay else "set_tcp_nodelay false") as port:
        proxy = Proxy(run_dir, {"c1": port, "c2": port}, mqtt=True)
        fleet = f"peer{os.getpid()}{v.name.replace('_', '')}"
        procs = [
            launch_agent(
                profile,
                agent_overrides(run_dir, proxy, fleet, job, i, dashboard=v.dashboard, personal=v.personal),
                run_dir / f"dev-{i}.log",
                optimize="-OO" in INTERPRETER_FLAGS,
                malloc=bool(MALLOC_ENV),
            )
            for i in (1, 2)
        ]
        pids = {"c1": procs[0].pid, "c2": procs[1].pid, "broker": _pid_of_conf(f"mosquitto-{port}.conf")}
        try:
            starts, marks, coord = asyncio.run(_edgefl_rounds(port, job, v, fleet, pids))
            hwm = [_vm_hwm_kib(p.pid) for p in procs]
        finally:
            stop_agents(procs)
            rows = proxy.stop()
    rounds = range(2, ROUNDS + 1)
    return {
        "system": "edgefl",
        "variant": v.name,
        "bytes_per_round": [_bytes_per_round(rows, f"c{i}", starts[1], starts[ROUNDS + 1]) for i in (1, 2)],
        "up_per_round": [
            _bytes_per_round([r for r in rows if r[2] == "up"], f"c{i}", starts[1], starts[ROUNDS + 1])
            for i in (1, 2)
        ],
        "round_ms": 1e3 * statistics.median(coord.agg_at[r] - starts[r] for r in rounds),
        "cycle_split_ms": cycle_split(starts, coord.update_at, coord.agg_at),
        "cycle_ms": 1e3 * statistics.median(per_cycle(starts)),
        "cpu_ms_per_round_device": [1e3 * statistics.median(per_cycle(marks[c])) for c in ("c1", "c2")],
        "cpu_ms_per_round_server": 1e3
        * statistics.median(
            a + b for a, b in zip(per_cycle(marks["coordinator"]), per_cycle(marks["broker"]), strict=True)
        ),
        "cpu_ms_per_round_broker": 1e3 * statistics.median(per_cycle(marks["broker"])),
        "breakdown": _breakdown(rows, starts[1], starts[ROUNDS + 1]),
        "peak_rss_kib": hwm,
        "accuracy": accuracy(coord.W, coord.b, job.emb_test, job.y_test),
    }


def run_flower(work: Path, job: Job, venv: Path) -> dict[str, Any]:
    """One Flower run (legacy gRPC server and clients); per-client figures."""
    run_dir = Path(tempfile.mkdtemp(prefix="flower-", dir=work))
    py = [str(venv / "bin" / "python"), *INTERPRETER_FLAGS]
    env = dict(
        os.environ,
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        **MALLOC_ENV,
    )
    sport = free_port()
    script = str(HERE / "peer_flower.py")
    out = run_dir / "server.json"
    logs = [open(run_dir / f"{n}.log", "wb") for n in ("server", "c1", "c2")]  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [*py, script, "server", f"127.0.0.1:{sport}", str(ROUNDS), str(job.init), str(out)],
        stdout=logs[0],
        stderr=subprocess.STDOUT,
        env=env,
    )
    procs = [server]
    try:
        _wait_listening([sport], 120)
        proxy = Proxy(run_dir, {"c1": sport, "c2": sport})
        for i in (1, 2):
            cmd = [
                *py,
                script,
                "client",
                f"127.0.0.1:{proxy.ports[f'c{i}']}",
                str(job.emb_shards[i - 1]),
                str(EPOCHS),
                str(LR),
                str(BATCH),
                str(run_dir / f"c{i}.json"),
            ]
            procs.append(subprocess.Popen(cmd, stdout=logs[i], stderr=subprocess.STDOUT, env=env))
        for p in procs:
            p.wait(timeout=300)
        rows = proxy.stop()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for fh in logs:
            fh.close()
    doc = json.loads(out.read_text())
    start = {r: t for e, r, t in doc["events"] if e == "fit_start"}
    end = {r: t for e, r, t in doc["events"] if e == "fit_end"}
    server_cpu = {r: c for e, r, c in doc["events"] if e == "fit_start_cpu"}
    clients = [json.loads((run_dir / f"c{i}.json").read_text()) for i in (1, 2)]
    final = np.load(str(out) + ".npz")
    t_end = end[ROUNDS] + 1.0
    return {
        "system": "flower",
        "bytes_per_round": [_bytes_per_round(rows, f"c{i}", start[1], t_end) for i in (1, 2)],
        "up_per_round": [
            _bytes_per_round([r for r in rows if r[2] == "up"], f"c{i}", start[1], t_end) for i in (1, 2)
        ],
        "round_ms": 1e3 * statistics.median(end[r] - start[r] for r in range(2, ROUNDS + 1)),
        "cycle_ms": 1e3 * statistics.median(per_cycle(start)),
        # a client's round r begins with its fit(r): its CPU from one fit's start to the next
        "cpu_ms_per_round_device": [
            1e3 * statistics.median(per_cycle({k + 1: f[1] for k, f in enumerate(c["fits"])}))
            for c in clients
        ],
        "cpu_ms_per_round_server": 1e3 * statistics.median(per_cycle(server_cpu)),
        "peak_rss_kib": [c["status"]["VmHWM"] for c in clients],
        "accuracy": accuracy(final["W"], final["b"], job.emb_test, job.y_test),
    }


def ensure_flower(venv: Path) -> None:
    """Create Flower's venv with flwr 1.42.0 and numpy unless it already has them."""
    py = venv / "bin" / "python"
    if (
        py.exists()
        and subprocess.run([str(py), "-c", "import flwr, numpy"], capture_output=True).returncode == 0
    ):
        return
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"flwr=={FLOWER_VERSION}", "numpy"], check=True)


def prepare_interpreters(venv: Path) -> None:
    """Both systems alike before any run: bytecode compiled for :data:`INTERPRETER_FLAGS` in both
    environments (``compileall -o 2`` for ``-OO``, as ``make demo`` does for edgefl: an interpreter that
    compiles its imports at start-up would pay for it in RSS and time), then their files read once
    (:func:`warm_page_cache`: the first run of either system starts as warm as the others)."""
    level = "2" if "-OO" in INTERPRETER_FLAGS else "0"
    ours = Path(sys.prefix)
    for python, root in ((venv / "bin" / "python", venv), (Path(sys.executable), ours)):
        sites = sorted(root.glob("lib/python3*/site-packages"))
        subprocess.run(
            [str(python), "-m", "compileall", "-q", "-j", "0", "-o", level, *map(str, sites)],
            capture_output=True,
        )
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-o", level, str(HERE.parent / "edgefl")],
        capture_output=True,
    )
    warm_page_cache([venv, ours, HERE.parent])


def _cpu_ms() -> float:
    """CPU time (user + system) of this process and of its waited-for children so far, in ms."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return 1e3 * (own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime)


def cpu_per_round(work: Path, job: Job, venv: Path, extra: int, repeats: int) -> dict[str, Any]:
    """CPU time per round of each system, every process of it counted (``--cpu-rounds``).

    Each system runs the job with :data:`ROUNDS` rounds and with ``ROUNDS + extra``; the difference of
    the CPU they used (``getrusage``: this process, where edgefl's coordinator runs, and the children
    waited for: Flower's server and clients, edgefl's agents and mosquitto, the counting proxy),
    divided by ``extra``, is what one more round costs, start-up and shutdown left out. edgefl runs
    its ``int8_nodelay`` variant. Systems alternate; ``repeats`` pairs of runs each.

    Returns
    -------
    dict
        ``cpu_ms_per_round`` {"flower", "edgefl": median ms}, ``ratio`` (edgefl / Flower),
        ``runs`` {system: [ms per round, one per repeat]}, ``extra_rounds``.
    """
    global ROUNDS
    base = ROUNDS
    variant = next(v for v in VARIANTS if v.name == "int8_nodelay")
    runs: dict[str, list[float]] = {"flower": [], "edgefl": []}
    try:
        for rep in range(repeats):
            for system in ("flower", "edgefl") if rep % 2 == 0 else ("edgefl", "flower"):
                used = []
                for rounds in (base, base + extra):
                    ROUNDS = rounds
                    before = _cpu_ms()
                    if system == "flower":
                        run_flower(work, job, venv)
                    else:
                        run_edgefl(work, job, variant)
                    used.append(_cpu_ms() - before)
                runs[system].append((used[1] - used[0]) / extra)
                print(f"{system}: {runs[system][-1]:.2f} ms of CPU per round", flush=True)
    finally:
        ROUNDS = base
    med = {system: statistics.median(values) for system, values in runs.items()}
    return {
        "cpu_ms_per_round": med,
        "ratio": med["edgefl"] / med["flower"],
        "runs": runs,
        "extra_rounds": extra,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats (and over the 2 clients), the ratios edgefl/Flower and the accuracies."""

    def med(system: str, key: str, variant: str | None = None) -> float:
        values = []
        for r in runs:
            if r["system"] == system and (variant is None or r.get("variant") == variant):
                v = r[key]
                values.append(statistics.median(v) if isinstance(v, list) else v)
        return float(statistics.median(values))

    def split(variant: str) -> dict[str, float]:
        parts = [r["cycle_split_ms"] for r in runs if r.get("variant") == variant and "cycle_split_ms" in r]
        return {k: float(statistics.median(p[k] for p in parts)) for k in (parts[0] if parts else {})}

    fb, frt, frss = med("flower", "bytes_per_round"), med("flower", "round_ms"), med("flower", "peak_rss_kib")
    ratios = {
        "bytes_total_float32_d512": med("edgefl", "bytes_per_round", "float32") / fb,
        "bytes_total_int8_d512": med("edgefl", "bytes_per_round", "int8") / fb,
        "bytes_total_topk_int8_d512": med("edgefl", "bytes_per_round", "topk_int8") / fb,
        "round_ms_default_broker": med("edgefl", "round_ms", "int8") / frt,
        "round_ms_nodelay_broker": med("edgefl", "round_ms", "int8_nodelay") / frt,
        "peak_rss_dashboard_on_d512": med("edgefl", "peak_rss_kib", "int8") / frss,
        "cycle_ms_default_broker": med("edgefl", "cycle_ms", "int8") / med("flower", "cycle_ms"),
        "cycle_ms_nodelay_broker": med("edgefl", "cycle_ms", "int8_nodelay") / med("flower", "cycle_ms"),
        "cpu_ms_per_round_device": med("edgefl", "cpu_ms_per_round_device", "int8")
        / med("flower", "cpu_ms_per_round_device"),
        "cpu_ms_per_round_server": med("edgefl", "cpu_ms_per_round_server", "int8")
        / med("flower", "cpu_ms_per_round_server"),
        "peak_rss_like_for_like_d512": med("edgefl", "peak_rss_kib", "int8_no_dashboard") / frss,
        # work Flower's client does not do, off (not the shipped setting): what the personal head costs
        "cycle_ms_no_personal": med("edgefl", "cycle_ms", "int8_no_personal") / med("flower", "cycle_ms"),
        "cpu_ms_per_round_device_no_personal": med("edgefl", "cpu_ms_per_round_device", "int8_no_personal")
        / med("flower", "cpu_ms_per_round_device"),
    }
    absolute = {
        "flower": {
            "bytes_per_round": fb,
            "up_per_round": med("flower", "up_per_round"),
            "round_ms": frt,
            "cycle_ms": med("flower", "cycle_ms"),
            "cpu_ms_per_round_device": med("flower", "cpu_ms_per_round_device"),
            "cpu_ms_per_round_server": med("flower", "cpu_ms_per_round_server"),
            "peak_rss_kib": frss,
        },
        **{
            v.name: {
                "bytes_per_round": med("edgefl", "bytes_per_round", v.name),
                "up_per_round": med("edgefl", "up_per_round", v.name),
                "round_ms": med("edgefl", "round_ms", v.name),
                "cycle_ms": med("edgefl", "cycle_ms", v.name),
                "cpu_ms_per_round_device": med("edgefl", "cpu_ms_per_round_device", v.name),
                "cpu_ms_per_round_server": med("edgefl", "cpu_ms_per_round_server", v.name),
                "cpu_ms_per_round_broker": med("edgefl", "cpu_ms_per_round_broker", v.name),
                "peak_rss_kib": med("edgefl", "peak_rss_kib", v.name),
                "cycle_split_ms": split(v.name),
            }
            for v in VARIANTS
        },
    }
    acc = {
        v.name: med("edgefl", "accuracy", v.name)
        for v in VARIANTS
        if v.name in ("int8", "float32", "topk_int8")
    }
    acc["flower_float32"] = med("flower", "accuracy")
    return {"ratios": ratios, "accuracy": acc, "absolute": absolute}


def rss_only(runs: int) -> dict[str, Any]:
    """Peak RSS (VmHWM) of edgefl's agents only: the ``int8`` variant ``runs`` times with the dashboard
    on and ``runs`` times off, alternating; medians over every agent of every run, in KiB."""
    base = next(v for v in VARIANTS if v.name == "int8")
    hwm: dict[str, list[int]] = {"dashboard_on": [], "dashboard_off": []}
    with tempfile.TemporaryDirectory(prefix="peer-") as tmp:
        work = Path(tmp)
        job = make_job(work)
        for _ in range(runs):
            for on in (True, False):
                v = Variant(base.name, base.uplink, base.downlink, base.broker_nodelay, on)
                hwm["dashboard_on" if on else "dashboard_off"] += run_edgefl(work, job, v)["peak_rss_kib"]
    return {"peak_rss_kib": hwm, "median_kib": {k: statistics.median(v) for k, v in hwm.items()}}


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m bench.peer [--repeats N] [--rounds N] [--json PATH] [--flower-venv DIR] [--rss-only N]``"""
    global ROUNDS
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["proxy"]:
        asyncio.run(_proxy_main(args_in[1], args_in[2:]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--flower-venv", type=Path, default=Path("/work/peer-venv"))
    p.add_argument(
        "--rss-only",
        type=int,
        default=0,
        metavar="N",
        help="only edgefl's agents' peak RSS: the int8 variant N times with the dashboard on and off",
    )
    p.add_argument(
        "--tmp-root",
        type=Path,
        default=None,
        help="folder for the run's files, the agents' state included (default: the system's temporary "
        "folder); a tmpfs mount (memory) makes a device's durable write free, to measure what it costs",
    )
    p.add_argument(
        "--cpu-rounds",
        type=int,
        default=0,
        metavar="N",
        help="only the CPU each system uses per round: runs of 5 and 5 + N rounds (int8_nodelay), "
        "--repeats pairs",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        metavar="N",
        help=f"rounds per run (default {ROUNDS}); cycle and CPU figures are medians of rounds 2..N-1, so a "
        "long run (e.g. 100) gives steady-state medians that one preempted process does not move",
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="both systems' processes without -OO and without the malloc settings (default: both with)",
    )
    args = p.parse_args(args_in)
    if args.rounds < 5:
        p.error("--rounds must be >= 5")
    ROUNDS = args.rounds
    if args.plain:
        global INTERPRETER_FLAGS, MALLOC_ENV
        INTERPRETER_FLAGS, MALLOC_ENV = (), {}
    if args.cpu_rounds > 0:
        ensure_flower(args.flower_venv)
        with tempfile.TemporaryDirectory(prefix="peer-", dir=args.tmp_root) as tmp:
            work = Path(tmp)
            doc = cpu_per_round(work, make_job(work), args.flower_venv, args.cpu_rounds, args.repeats)
        cpu = doc["cpu_ms_per_round"]
        print(
            f"CPU per round, every process: Flower {cpu['flower']:.1f} ms, edgefl {cpu['edgefl']:.1f} ms "
            f"(ratio {doc['ratio']:.2f})"
        )
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=1))
        return
    if args.rss_only > 0:
        out = rss_only(args.rss_only)
        for key, kib in out["median_kib"].items():
            each = ", ".join(f"{k / 1024:.1f}" for k in out["peak_rss_kib"][key])
            print(f"{key}: median {kib / 1024:.2f} MiB ({each})")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=1))
        return
    ensure_flower(args.flower_venv)
    prepare_interpreters(args.flower_venv)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="peer-", dir=args.tmp_root) as tmp:
        work = Path(tmp)
        job = make_job(work)
        for rep in range(args.repeats):
            order: list[Variant | None] = [None, *VARIANTS]  # alternate: Flower, then each edgefl variant
            for v in order if rep % 2 == 0 else reversed(order):
                run = run_flower(work, job, args.flower_venv) if v is None else run_edgefl(work, job, v)
                run["repeat"], run["loadavg"] = rep, os.getloadavg()
                print(json.dumps(run), flush=True)
                runs.append(run)
    summary = summarize(runs)
    summary["runs"] = runs
    summary["machine"] = {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()}
    summary["like_for_like"] = {"interpreter_flags": list(INTERPRETER_FLAGS), "malloc_env": MALLOC_ENV}
    a = summary["absolute"]
    print("\n| per client per round, D = 512 | Flower | edgefl | ratio |\n|---|---|---|---|")
    for name in ("float32", "int8", "topk_int8"):
        print(
            f"| bytes up + down, {name} | {a['flower']['bytes_per_round']:,.0f} B | "
            f"{a[name]['bytes_per_round']:,.0f} B | "
            f"{a[name]['bytes_per_round'] / a['flower']['bytes_per_round']:.2f} |"
        )
    for name, label in (("int8", "defaults"), ("int8_nodelay", "set_tcp_nodelay true")):
        for key, what in (
            ("cycle_ms", "round start -> next round start"),
            ("round_ms", "round start -> aggregation"),
        ):
            print(
                f"| {what}, broker {label} | {a['flower'][key]:.1f} ms | "
                f"{a[name][key]:.1f} ms | {a[name][key] / a['flower'][key]:.2f} |"
            )
    for key, what, name in (
        ("cpu_ms_per_round_device", "a client", "int8"),
        ("cpu_ms_per_round_device", "a client, personal heads off", "int8_no_personal"),
        ("cpu_ms_per_round_server", "the server", "int8"),
        ("cycle_ms", "round start -> next round start, personal heads off", "int8_no_personal"),
    ):
        print(
            f"| {what if key == 'cycle_ms' else 'CPU per round, ' + what} | {a['flower'][key]:.1f} ms | "
            f"{a[name][key]:.1f} ms | {a[name][key] / a['flower'][key]:.2f} |"
        )
    for name, label in (("int8", "dashboard on"), ("int8_no_dashboard", "dashboard off")):
        print(
            f"| peak RSS of a client (edgefl {label}) | {a['flower']['peak_rss_kib'] / 1024:.1f} MiB | "
            f"{a[name]['peak_rss_kib'] / 1024:.1f} MiB | "
            f"{a[name]['peak_rss_kib'] / a['flower']['peak_rss_kib']:.2f} |"
        )
    print("accuracy:", json.dumps(summary["accuracy"]))
    cut = a["int8"]["cycle_split_ms"]
    print("edgefl int8 cycle, ms:", ", ".join(f"{k} {v:.1f}" for k, v in cut.items()))
    print(
        "\n| edgefl, per client per round: MQTT packets by kind | "
        + " | ".join(v.name for v in VARIANTS)
        + " |"
    )
    print("|---|" + "---|" * len(VARIANTS))
    first = {r["variant"]: r["breakdown"] for r in runs if r["system"] == "edgefl" and r["repeat"] == 0}
    for way in ("up", "down"):
        kinds = sorted({k for b in first.values() for k in b[way]})
        for kind in kinds:
            cells = [
                f"{first[v.name][way][kind][1]:,.0f} B ({first[v.name][way][kind][0]:.1f})"
                if kind in first.get(v.name, {}).get(way, {})
                else "-"
                for v in VARIANTS
            ]
            print(f"| {way}: {kind} | " + " | ".join(cells) + " |")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
