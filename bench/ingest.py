"""Live ingest on loopback: how fast one agent classifies samples fed over MQTT, and what it drops.

A real mosquitto on 127.0.0.1, one real agent process (``edgefl run`` on the dev profile: the digits
CNN int8 raw-input model, batch 8, 96 MiB cap, dashboard off) with ``source.kind = "mqtt"``, and the
shipped feeder (``edgefl.feed.feed``, QoS 1 samples, 64 publishes in flight) in this process. Each
configuration feeds the same ``--samples`` digits at a rate (0 = as fast as the broker takes them),
all labelled inline, then reads the agent's retained status once it counted every sample:

- ``sent/s``: samples published per second by the feeder (first publish to the last PUBACK);
- ``predicted``: predictions received back; ``dropped``: the agent's ``ingest_dropped`` (queue full,
  oldest first); ``predicted + dropped = sent`` always;
- ``latency`` median and p95: the agent's own ``latency_s`` (arrival to classification, queueing
  included) over the predictions;
- ``peak RSS``: the agent's peak (governor) at the end.

Run: ``.venv/bin/python -m bench.ingest`` (prints a markdown table; ``--json PATH``). The agent
process is restarted for each configuration (fresh state).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.memory import mosquitto
from edgefl.datasets import load_digits
from edgefl.feed import FeedOptions, feed
from edgefl.launcher import launch_agent, stop_agents
from edgefl.profiles import BrokerConfig
from edgefl.resources import shipped
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.validators import parse_broker_url
from edgefl.wire.status import decode_status

PROFILE = shipped("firmware_configs/dev_x86.toml")


async def _status_when(
    url: str, fleet: str, device: str, done: Any, timeout_s: float = 60.0
) -> dict[str, Any]:
    """The agent's retained status, once ``done(fields)`` holds (statuses come every 0.2 s here)."""
    _, host, port = parse_broker_url(url)
    t = MqttTransport(host, port, f"bench-status-{fleet}")
    await t.start(wait_s=10)
    topic = Topics("edgefl", fleet).status(device)
    try:
        await t.subscribe(topic, 1)
        deadline = time.monotonic() + timeout_s
        while True:
            msg = await asyncio.wait_for(t.queue.get(), max(0.1, deadline - time.monotonic()))
            if msg.topic == topic and msg.payload:
                st = decode_status(msg.payload)
                fields = {"state": st.state, **st.fields}
                if done(fields):
                    return fields
    finally:
        await t.stop()


def run_one(url: str, rate_hz: float, n: int, queue_max: int, work: Path) -> dict[str, Any]:
    """Feed ``n`` digits to a fresh agent at ``rate_hz``; return the row's figures."""
    x, y = load_digits()
    data = work / "digits.npz"
    np.savez(data, x=np.resize(x, (n, *x.shape[1:])), y=np.resize(y, n))
    fleet = f"bench{int(time.time() * 1000) % 10**9}"
    proc = launch_agent(
        PROFILE,
        {
            "device.id": "ingest-1",
            "device.fleet": fleet,
            "device.state_dir": str(work / fleet),
            "broker.url": url,
            "source.kind": "mqtt",
            "source.queue_max": str(queue_max),
            "dashboard.enabled": "false",
            "status.interval_s": "0.2",
            "training.store_capacity": str(max(4096, n)),
        },
        work / f"{fleet}.log",
    )
    try:
        asyncio.run(_status_when(url, fleet, "ingest-1", lambda f: bool(f.get("ready"))))
        opts = FeedOptions(
            broker=BrokerConfig(url=url),
            fleet=fleet,
            device="ingest-1",
            data=data,
            rate_hz=rate_hz,
            label_fraction=1.0,
            wait_s=30.0 if queue_max >= n else 5.0,  # what a full queue dropped never comes back
        )
        result = asyncio.run(feed(opts))
        st = asyncio.run(
            _status_when(
                url,
                fleet,
                "ingest-1",
                lambda f: f.get("samples_received") == n
                and f.get("ingest_queued") == 0
                and f.get("predictions_published", 0) + f.get("ingest_dropped", 0) == n,
            )
        )
    finally:
        stop_agents([proc])
    return {
        "rate_hz": rate_hz,
        "queue_max": queue_max,
        "samples": n,
        "sent_per_s": n / result.publish_s if result.publish_s else None,
        "predicted": result.predictions_received,
        "dropped": st["ingest_dropped"],
        "latency_s_median": result.latency_s_median,
        "latency_s_p95": result.latency_s_p95,
        "peak_rss_mib": st["peak_rss_bytes"] / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the configurations and print the markdown table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--rates", default="100,500,0", help="samples/s per configuration (0: at once)")
    ap.add_argument("--queue-max", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    with mosquitto() as url, tempfile.TemporaryDirectory(prefix="edgefl-bench-ingest-") as d:
        if url is None:
            print("mosquitto not installed")
            return 1
        for rate in (float(r) for r in args.rates.split(",")):
            for queue_max in sorted({args.queue_max, 8}, reverse=True) if rate == 0 else (args.queue_max,):
                rows.append(run_one(url, rate, args.samples, queue_max, Path(d)))
    print("| rate (samples/s) | queue_max | sent/s | predicted | dropped | latency median | p95 | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        shown = "as fast as possible" if r["rate_hz"] == 0 else f"{r['rate_hz']:.0f}"
        print(
            f"| {shown} | {r['queue_max']} | {r['sent_per_s']:.0f} | {r['predicted']} | {r['dropped']} | "
            f"{r['latency_s_median'] * 1e3:.1f} ms | {r['latency_s_p95'] * 1e3:.1f} ms | "
            f"{r['peak_rss_mib']:.1f} MiB |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

