"""``edgefl demo``: a whole federated job on one machine, on real data.

An embedded broker (or an existing one), the coordinator in this process and N agent processes, each
fed its non-IID shard of the digits live over MQTT; baselines (factory head, central and local-only
training) on the same embeddings bound the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import tempfile
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.agent import memstat
from edgefl.agent.config import load_profile
from edgefl.agent.core import DeviceCore
from edgefl.agent.governor import Governor
from edgefl.agent.trainer import fit_head
from edgefl.coordinator.profile import RoundsConfig
from edgefl.coordinator.roundlog import plural
from edgefl.coordinator.service import Coordinator
from edgefl.coordinator.strategies import strategy_from_tables
from edgefl.datasets import FACTORY_CLASSES, load_digits, partition_non_iid, split_digits
from edgefl.evaluation import accuracy
from edgefl.feed import FeedOptions, feed
from edgefl.launcher import free_port, launch_agent, stop_agents
from edgefl.profiles import BrokerConfig
from edgefl.records import atomic_write
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.validators import parse_broker_url
from edgefl.wire.compression import Compression

logger = logging.getLogger(__name__)


BASELINE_EPOCHS = 60


HEAD_ACCURACY_KEYS = ("personal_accuracy", "global_accuracy")
"""The agents' accuracies of their two heads on their holdout (status fields, ``--json`` keys)."""


async def _wait_statuses(
    devices: Mapping[str, Mapping[str, Any]],
    names: Iterable[str],
    done: Callable[[str, Mapping[str, Any]], bool],
    timeout_s: float,
) -> list[str]:
    """Poll the devices' statuses until ``done(name, status)`` for each of ``names``; those late."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    while (late := [n for n in names if not done(n, devices.get(n, {}))]) and loop.time() < until:
        await asyncio.sleep(0.1)  # statuses come every status.interval_s
    return late


def _accuracy(value: object) -> float | None:
    """A status accuracy as a float (None when absent or not a number)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@contextlib.contextmanager
def _workdir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="edgefl-demo-") as d:
            yield Path(d)


async def _embedded_broker(port: int) -> Any:
    """Start amqtt on 127.0.0.1:``port``, its own faults contained (:func:`contain_broker_faults`)."""
    from amqtt.broker import Broker

    contain_broker_faults(asyncio.get_running_loop())

    broker = Broker(
        {
            "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}", "max_connections": 64}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
    )
    await broker.start()
    return broker


def contain_broker_faults(loop: asyncio.AbstractEventLoop) -> Callable[[], int]:
    """Log the embedded broker's own unhandled exceptions as one debug line each, not a traceback.

    amqtt 0.12's connect handler dies (``dictionary changed size during iteration``) when a client
    subscribes meanwhile; that client reconnects. Other exceptions reach the loop's previous handler.
    Returns a function giving how many were contained.
    """
    previous = loop.get_exception_handler()
    contained = 0

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        nonlocal contained
        exc = context.get("exception")
        tb = exc.__traceback__ if isinstance(exc, BaseException) else None
        if tb is not None and any(f"{os.sep}amqtt{os.sep}" in f.filename for f in traceback.extract_tb(tb)):
            contained += 1
            logger.debug("embedded broker: %s: %r (its client reconnects)", context.get("message"), exc)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
    return lambda: contained


def run_demo(opts: argparse.Namespace) -> int:
    """Run the demo, one line per round, the JSON result if asked; exit 0 when every round got an update.

    ``opts`` are the parsed ``edgefl demo`` arguments (``edgefl demo --help``).
    """
    for name in ("amqtt", "transitions", "passlib"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # the per-update lines would interleave with the results table; warnings still show
    quiet = (
        "edgefl.coordinator.intake",
        "edgefl.coordinator.service",
        "edgefl.runtime",
        "edgefl.transport",
        "edgefl.mqtt_link",
    )
    for name in (*quiet, "edgefl.dashboard.app"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    return asyncio.run(_run(opts))


async def _run(opts: argparse.Namespace) -> int:
    profile = load_profile(opts.profile, {"model.path": str(opts.model)} if opts.model else None)
    model_path = Path(profile.model.path)
    x, y = load_digits()
    split = split_digits(y)  # the split the shipped models were built on (models/README.md)
    pool = split.devices
    parts = partition_non_iid(y[pool], opts.devices, seed=opts.seed)  # rows of the pool
    shards = [pool[rows] for rows in parts]

    # The baselines' embeddings come from the device core the agents run (same pipeline, same head).
    with tempfile.TemporaryDirectory(prefix="edgefl-demo-core-") as core_dir:
        core = DeviceCore.open(
            profile,
            governor=Governor(1 << 32, 0, 0),  # the demo process is not a device under a cap
            state_dir=Path(core_dir),
            store_capacity=1,
        )
        W0, b0 = core.head.W, core.head.b
        model_sha256 = core.model_sha256
        emb_test = core.classify(x[split.test]).embeddings
        emb_pool = core.classify(x[pool]).embeddings
        del core
    y_test = y[split.test]
    # baselines trained to convergence: "centralized" an upper bound, "local-only" a device on its own
    total_epochs = max(BASELINE_EPOCHS, opts.local_epochs * opts.rounds)
    baseline = accuracy(W0, b0, emb_test, y_test)

    def trained(emb: np.ndarray, labels: np.ndarray, seed: int) -> float:
        W, b = fit_head(
            W0, b0, emb, labels, epochs=total_epochs, lr=opts.lr, batch_size=opts.batch_size, seed=seed
        )
        return accuracy(W, b, emb_test, y_test)

    centralized = trained(emb_pool, y[pool], opts.seed)
    local_accs = [
        trained(emb_pool[rows], y[shard], opts.seed + k)
        for k, (rows, shard) in enumerate(zip(parts, shards, strict=True))
    ]
    local_only = float(np.mean(local_accs))
    print(
        f"edgefl demo: {plural(opts.devices, 'device')}, {plural(opts.rounds, 'round')}, "
        f"model {model_path.name}, strategy {opts.strategy}, compression {opts.compression}, "
        f"factory head knows digits {FACTORY_CLASSES[0]}-{FACTORY_CLASSES[-1]}"
    )
    print(f"  test set {len(y_test)} samples; device shards {[len(s) for s in shards]} samples")
    print(
        f"  baseline (factory head) {baseline:.3f}   centralized {centralized:.3f}   "
        f"local-only (mean) {local_only:.3f}"
    )

    broker = None
    if opts.broker:
        _, host, port = parse_broker_url(opts.broker)
    else:
        host, port = "127.0.0.1", free_port()
        broker = await _embedded_broker(port)
    # the agents, the coordinator and the feeds connect alike (amqtt speaks MQTT 3.1.1 only)
    protocol = "3.1.1" if broker is not None else profile.broker.protocol
    link = BrokerConfig(
        url=f"mqtt://{host}:{port}", topic_prefix=profile.broker.topic_prefix, protocol=protocol
    )
    fleet = f"demo{os.getpid()}"
    topics = Topics(profile.broker.topic_prefix, fleet)
    names = [f"dev-{k + 1}" for k in range(len(shards))]
    procs: list[subprocess.Popen[bytes]] = []
    rc = 0
    with _workdir(opts.workdir) as work:
        try:
            for dev, shard in zip(names, shards, strict=True):
                np.savez(work / f"{dev}.npz", x=x[shard], y=y[shard])
                procs.append(
                    launch_agent(
                        opts.profile,
                        {
                            "device.id": dev,
                            "device.fleet": fleet,
                            "device.state_dir": str(work / dev),
                            "broker.url": link.url,
                            "source.kind": "mqtt",
                            "model.path": str(model_path),
                            "training.store_capacity": str(max(256, len(shard))),
                            "broker.protocol": link.protocol,
                            # the demo's agents never restart: no session for the embedded broker to keep
                            "broker.session_expiry_s": "0",
                        },
                        work / f"{dev}.log",
                    )
                )
            transport = MqttTransport(host, port, f"edgefl-coordinator-{fleet}", protocol=link.protocol)
            await transport.start(wait_s=15)
            rounds = RoundsConfig(
                local_epochs=opts.local_epochs,
                lr=opts.lr,
                batch_size=opts.batch_size,
                min_clients=opts.devices,
                deadline_s=opts.deadline_s,
            )
            strategy = strategy_from_tables(opts.strategy, rounds)
            coord = Coordinator(
                transport,
                topics,
                W0,
                b0,
                model_sha256=model_sha256,
                strategy=strategy,
                evaluate=lambda W, b: accuracy(W, b, emb_test, y_test),
                compression=Compression(opts.compression),
                topk_fraction=opts.topk_fraction,
                lr_decay=opts.lr_decay,
            )
            pump = asyncio.create_task(coord.pump())
            from edgefl.dashboard.app import DashboardState, serve

            board = DashboardState(
                "coordinator", f"fleet {fleet}", coord.dashboard_status, get_rounds=coord.dashboard_rounds
            )
            coord.on_change = board.notify
            runner, board_port = await serve(board, "127.0.0.1", 0)
            try:
                await coord.start()
                ready = await coord.registry.wait_for_devices(opts.devices, timeout_s=120)
                print(f"  {len(ready)} agents ready: {', '.join(ready)}")
                sizes = {dev: len(s) for dev, s in zip(names, shards, strict=True)}
                await _feed_devices(opts, coord, topics, link, work, sizes)
                print(f"  coordinator dashboard: http://127.0.0.1:{board_port}/")
                for dev in ready:
                    url = coord.registry.devices[dev].get("dashboard_url")
                    if url:
                        print(f"  {dev} dashboard: {url}")
                print(
                    f"  {'round':>5} {'clients':>7} {'accuracy':>8} {'federated':>9} {'worst10%':>8} "
                    f"{'update_bytes':>12} {'seconds':>7}"
                )
                for r in range(1, opts.rounds + 1):
                    rec = await coord.run_round(r)  # FedBuff: one buffered server step per line
                    print(
                        f"  {rec.round:>5} {rec.clients:>7} {rec.accuracy:>8.3f} {rec.fed_accuracy:>9.3f} "
                        f"{rec.fed_worst_decile:>8.3f} {rec.update_bytes_mean:>12.0f} {rec.duration_s:>7.2f}"
                    )
                    if rec.clients == 0:
                        rc = 1
                await asyncio.sleep(0.5)  # let the agents apply the last global head
                # their statuses carry both heads' holdout accuracy on the last head (status.interval_s)
                version = coord.state.version
                await _wait_statuses(
                    coord.registry.devices,
                    names,
                    lambda _, st: (
                        st.get("version") == version and _accuracy(st.get("personal_accuracy")) is not None
                    ),
                    2 * profile.status.interval_s + 1.0,
                )
                coord.finished = True  # the fleet page says so (while --hold keeps it up)
                board.notify()
                if opts.hold_s > 0:
                    print(f"  holding the dashboards open for {opts.hold_s:.0f} s (Ctrl-C to stop)")
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.sleep(opts.hold_s)
            finally:
                await runner.cleanup()
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
                await transport.stop()
            agents: list[dict[str, Any]] = []
            for dev, p in zip(names, procs, strict=True):
                # the governor resets VmHWM at each phase and keeps the peak itself: the larger of the two
                status = coord.registry.devices.get(dev, {})
                try:
                    vm_hwm = memstat.peak_rss_bytes(p.pid)
                except OSError:
                    vm_hwm = -1
                peak = max(int(status.get("peak_rss_bytes") or -1), vm_hwm)
                cap = int(status.get("cap_bytes") or profile.cap_bytes)
                agents.append(
                    {
                        "device": dev,
                        "cap_bytes": cap,
                        "peak_rss_bytes": peak,
                        **{key: int(status.get(key) or 0) for key in INGEST_KEYS},
                        # both heads on the agent's holdout (null before both were evaluated)
                        **{key: _accuracy(status.get(key)) for key in HEAD_ACCURACY_KEYS},
                    }
                )
        finally:
            stop_agents(procs)
            if broker is not None:
                await broker.shutdown()
        failed = [k for k, p in enumerate(procs) if p.returncode not in (0, -signal.SIGTERM)]
        if failed:
            for k in failed:
                tail = (work / f"{names[k]}.log").read_text(errors="replace").splitlines()[-15:]
                print(f"agent {names[k]} exited with {procs[k].returncode}:\n  " + "\n  ".join(tail))
            rc = 1
    for a in agents:
        print(
            f"  {a['device']}: peak RSS {a['peak_rss_bytes'] / 2**20:.1f} MiB "
            f"of cap {a['cap_bytes'] / 2**20:.0f} MiB; {a['samples_received']} samples, "
            f"{a['labels_received']} labels received, {a['predictions_published']} predictions, "
            f"{a['ingest_dropped']} dropped"
        )
    final = coord.state.history[-1].accuracy if coord.state.history else float("nan")
    print(
        f"  final accuracy {final:.3f} (baseline {baseline:.3f}, centralized {centralized:.3f}, "
        f"local-only {local_only:.3f})"
    )
    if opts.json_path:
        result = {
            "dataset": "sklearn_digits",
            "strategy": opts.strategy,
            "compression": opts.compression,
            "model": model_path.name,
            "devices": opts.devices,
            "baseline_accuracy": baseline,
            "centralized_accuracy": centralized,
            "local_only_accuracy": local_only,
            "rounds": [
                {
                    "round": h.round,
                    "clients": h.clients,
                    "accuracy": h.accuracy,
                    "update_bytes_mean": h.update_bytes_mean,
                    "duration_s": h.duration_s,
                    # federated evaluation of the round's base head on the devices' holdouts
                    "federated_accuracy": None if math.isnan(h.fed_accuracy) else h.fed_accuracy,
                    "federated_worst_decile": None if math.isnan(h.fed_worst_decile) else h.fed_worst_decile,
                    "federated_devices": h.fed_devices,
                }
                for h in coord.state.history
            ],
            "agents": agents,
        }
        atomic_write(Path(opts.json_path), (json.dumps(result, indent=2) + "\n").encode())
        print(f"  wrote {opts.json_path}")
    return rc


INGEST_KEYS = ("samples_received", "labels_received", "predictions_published", "ingest_dropped")
"""The agents' live-ingest counters the demo reports (status fields, ``--json`` keys)."""


async def _feed_devices(
    opts: argparse.Namespace,
    coord: Coordinator,
    topics: Topics,
    broker: BrokerConfig,
    work: Path,
    sizes: dict[str, int],
) -> None:
    """Feed each agent its shard (``sizes`` by device) over MQTT; wait until stored (TimeoutError: 60 s)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    transports: list[MqttTransport] = []
    try:
        # one after the other: amqtt 0.12 drops a connecting client if another subscribes meanwhile
        for dev, n in sizes.items():
            client_id = f"edgefl-feed-{topics.fleet}-{dev}"
            t = MqttTransport(
                broker.host, broker.port, client_id, protocol=broker.protocol, queue_size=2 * n + 256
            )
            await t.start(wait_s=15)
            transports.append(t)
            await t.subscribe(topics.predictions(dev), 1)
        results = await asyncio.gather(
            *(
                feed(
                    FeedOptions(
                        broker=broker,
                        fleet=topics.fleet,
                        device=dev,
                        data=work / f"{dev}.npz",
                        rate_hz=opts.feed_rate_hz,
                        label_fraction=1.0,
                        label_delay_s=opts.label_delay_s,
                        wait_s=30.0,
                        id_prefix=f"{dev}-",
                    ),
                    transport=transports[k],
                )
                for k, dev in enumerate(sizes)
            )
        )
    finally:
        for t in transports:
            await t.stop()
    fed_s = loop.time() - t0
    late = await _wait_statuses(
        coord.registry.devices, sizes, lambda dev, st: st.get("stored_total") == sizes[dev], 60 - fed_s
    )
    if late:
        raise TimeoutError(f"{late[0]} did not store its {sizes[late[0]]} samples within 60 s")
    seconds = loop.time() - t0
    sent = sum(r.samples_sent for r in results)
    predicted = sum(r.predictions_received for r in results)
    labels = f"each label {opts.label_delay_s:g} s later" if opts.label_delay_s > 0 else "labels inline"
    print(
        f"  fed {sent} samples over MQTT at {opts.feed_rate_hz:.0f}/s per device ({labels}): "
        f"{predicted} predictions back in {fed_s:.1f} s, all stored in {seconds:.1f} s"
    )
