"""Round overhead on loopback: announcement out -> all updates in -> global head published.

A real mosquitto on 127.0.0.1, the real coordinator (``edgefl.coordinator.service.Coordinator.run_round``)
and 4 device clients, all on ``edgefl.transport.MqttTransport`` (paho-mqtt 2.x, QoS 1), with a
1280 x 10 float32 head (a MobileNet-sized head: 51 kB per update and per global head). The 4
devices run in a child process (as on real gateways, they do not share the coordinator's GIL); they
do no training: on the announcement they publish a pre-computed update at once, so what is timed is
the protocol: encode, broker hops, PUBACKs, decode, aggregation, the retained global publish. Like
agents, the devices subscribe to the global head, so the broker writes it to each of them.

Each configuration runs ``--rounds`` rounds after ``--warmup`` rounds, ``--passes`` times (interleaved,
so a shared machine's load drift hits every configuration); the figure is the median of
``RoundRecord.duration_s`` (the coordinator's clock from just before the announcement is published
to the global head's PUBACK). The clients run the shipped transport as it is: ``TCP_NODELAY`` on their
own writes (``edgefl.mqtt_socket.set_nodelay``) and ``TCP_QUICKACK`` re-armed after every read
(``edgefl.mqtt_socket.quickack``). Configurations: mosquitto at its defaults (Nagle on) or with
``set_tcp_nodelay true``, each with the clients' quick ACKs on (shipped) or off (the module switch
``edgefl.mqtt_socket.TCP_QUICKACK = None``, set in both processes before they connect).

Run: ``.venv/bin/python -m bench.round_overhead`` (prints a markdown table; ``--json PATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import edgefl.mqtt_socket as mqtt_socket
from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.mqtt_link import Message
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.rounds import Update, UpdateMetrics, decode_round, encode_update
from tests.support.broker import start_mosquitto, stop_broker

D, K = 1280, 10
N_DEVICES = 4


@contextlib.contextmanager
def mosquitto(tmp: Path, extra: str) -> Iterator[int]:
    """A mosquitto on a free 127.0.0.1 port (tests/support/broker.py, as the tests run it) plus ``extra``."""
    broker = start_mosquitto(tmp, extra)
    try:
        yield broker.port
    finally:
        stop_broker(broker)


QUICKACK_OPT = mqtt_socket.TCP_QUICKACK  # the shipped value (None off Linux: nothing to switch)


def set_quickack(on: bool) -> None:
    """Quick ACKs in this process's clients as shipped (``on``), or delayed ACKs (the module switch off)."""
    mqtt_socket.TCP_QUICKACK = QUICKACK_OPT if on else None


class TimedCoordinator(Coordinator):
    """The service's coordinator, recording when each update reaches its handler."""

    coord_got: list[float]

    def handle(self, msg: Message) -> None:
        if "/update/" in msg.topic:
            self.coord_got.append(time.monotonic())
        super().handle(msg)


async def device_loop(t: MqttTransport, topics: Topics, name: str) -> None:
    rng = np.random.default_rng(int(name[3:]))
    dW = rng.normal(0, 1e-3, (D, K)).astype(np.float32)
    db = np.zeros(K, np.float32)
    last = 0
    while True:
        msg = await t.queue.get()
        if msg.topic != topics.round:
            continue
        ann = decode_round(msg.payload)
        if ann.round <= last:
            continue
        last = ann.round
        upd = Update(
            ann.round,
            ann.base_version,
            name,
            100,
            dW,
            db,
            UpdateMetrics(0.1, 0.9, 0.0, 0),
            f"{name}:{ann.round}:{ann.base_version}",
            ann.compression,
        )
        await t.publish(topics.update(name), encode_update(upd), qos=1)


async def devices_main(port: int, fleet: str, quickack: bool, ready: Any, stop: Any) -> None:
    set_quickack(quickack)
    topics = Topics("edgefl", fleet)
    devs = [MqttTransport("127.0.0.1", port, f"dev{i}-{port}") for i in range(N_DEVICES)]
    for d in devs:
        await d.start()
        await d.subscribe(topics.round, 1)
        await d.subscribe(topics.global_model, 1)  # as an agent does: the head reaches every device
    tasks = [asyncio.create_task(device_loop(d, topics, f"dev{i}")) for i, d in enumerate(devs)]
    await asyncio.sleep(0.2)  # subscriptions settle
    ready.set()
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for d in devs:
        await d.stop()


def devices_process(port: int, fleet: str, quickack: bool, ready: Any, stop: Any) -> None:
    asyncio.run(devices_main(port, fleet, quickack, ready, stop))


async def run_config(port: int, quickack: bool, rounds: int, warmup: int) -> dict[str, Any]:
    """``rounds`` timed rounds after ``warmup`` on a fresh coordinator and device process: raw figures."""
    set_quickack(quickack)
    fleet = f"bench{port}"
    topics = Topics("edgefl", fleet)
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=devices_process, args=(port, fleet, quickack, ready, stop), daemon=True)
    proc.start()
    coord_t = MqttTransport("127.0.0.1", port, f"coord-{port}")
    await coord_t.start()
    if not await asyncio.to_thread(ready.wait, 30):
        raise RuntimeError("device process did not start")
    W = np.zeros((D, K), np.float32)
    b = np.zeros(K, np.float32)
    coord = TimedCoordinator(
        coord_t,
        topics,
        W,
        b,
        model_sha256="0" * 64,
        strategy=FedAvg(min_clients=N_DEVICES, deadline_s=10.0),
    )
    coord.coord_got = []
    await coord.start()
    pump = asyncio.create_task(coord.pump())
    durations: list[float] = []
    to_last: list[float] = []
    try:
        for r in range(1, warmup + rounds + 1):
            coord.coord_got = []
            t0 = time.monotonic()
            rec = await coord.run_round(r)
            if rec.clients != N_DEVICES:
                raise RuntimeError(f"round {r}: {rec.clients} updates")
            if r > warmup:
                durations.append(rec.duration_s)
                to_last.append(max(coord.coord_got) - t0)
    finally:
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        stop.set()
        await asyncio.to_thread(proc.join, 10)
        await coord_t.stop()
    return {
        "duration_ms": [1e3 * x for x in durations],
        "to_last_update_ms": [1e3 * x for x in to_last],
        "update_bytes": coord.state.history[-1].update_bytes_mean,
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, p10 and p90 of the rounds of every pass of one configuration, pooled."""
    ms = [x for run in runs for x in run["duration_ms"]]
    to_last = [x for run in runs for x in run["to_last_update_ms"]]
    return {
        "rounds": len(ms),
        "median_ms": statistics.median(ms),
        "p10_ms": float(np.percentile(ms, 10)),
        "p90_ms": float(np.percentile(ms, 90)),
        "share_over_40_ms": sum(x >= 40.0 for x in ms) / len(ms),  # a delayed ACK holds up to 40 ms
        "to_last_update_median_ms": statistics.median(to_last),
        "pass_medians_ms": [statistics.median(run["duration_ms"]) for run in runs],
        "update_bytes": runs[-1]["update_bytes"],
        "duration_ms": ms,
    }


# tests/support/broker.py writes ``set_tcp_nodelay true``; a later line sets mosquitto's default back
DEFAULTS, NODELAY = "set_tcp_nodelay false", "set_tcp_nodelay true"
CONFIGS: list[tuple[str, bool, str]] = [
    ("broker defaults, quick ACKs on (shipped)", True, DEFAULTS),
    ("broker defaults, quick ACKs off", False, DEFAULTS),
    ("broker set_tcp_nodelay true, quick ACKs on (shipped)", True, NODELAY),
    ("broker set_tcp_nodelay true, quick ACKs off", False, NODELAY),
]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=50, help="timed rounds per configuration and pass")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--passes", type=int, default=1, help="passes over all configurations (pooled)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in CONFIGS}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.passes):  # interleaved, so a shared machine's load drift hits every configuration
            for label, quickack, extra in CONFIGS:
                with mosquitto(Path(tmp), extra) as port:
                    runs[label].append(asyncio.run(run_config(port, quickack, args.rounds, args.warmup)))
                load.append(os.getloadavg()[0])
    results = {label: summary(r) for label, r in runs.items()}
    print("| configuration | median ms | p10 ms | p90 ms | rounds >= 40 ms | announcement -> updates in ms |")
    print("|---|---|---|---|---|---|")
    for label, r in results.items():
        print(
            f"| {label} | {r['median_ms']:.1f} | {r['p10_ms']:.1f} | {r['p90_ms']:.1f} | "
            f"{100 * r['share_over_40_ms']:.0f} % | {r['to_last_update_median_ms']:.1f} |"
        )
    print(
        f"\nupdate size {next(iter(results.values()))['update_bytes']:.0f} bytes, "
        f"{N_DEVICES} devices, head {D}x{K}, {args.passes} x {args.rounds} rounds per configuration, "
        f"1-minute load average {min(load):.1f}-{max(load):.1f}"
    )
    for label, r in results.items():
        print(f"median of each pass, {label}: {' '.join(f'{x:.1f}' for x in r['pass_medians_ms'])} ms")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
