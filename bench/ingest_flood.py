"""A label flood on one live-ingest agent: what it refuses, what it logs, what the broker drops.

A real mosquitto on 127.0.0.1 (defaults: ``max_queued_messages 1000``), one real agent process (dev
profile, ``source.kind = "mqtt"``, dashboard off) and, in this process, a publisher that sends
``--labels`` Label messages for sample ids the agent never saw (QoS 1, ``--in-flight`` publishes
awaited together, default 20; at most 64, the transport's outgoing queue), as fast as the broker takes them.
Once the agent's ``rejected{unknown_sample}`` count stops moving (5 s), it reports:

- ``sent/s``: labels published per second (first publish to the last PUBACK);
- ``refused``: the agent's ``unknown_sample`` count; ``sent - refused`` never reached the agent:
  mosquitto dropped them for the slow client ("Outgoing messages are being dropped for client");
- ``log lines`` and ``log bytes`` of the agent's refusal log (throttled: the first 20 of a reason, then
  every 1000th).

Run: ``.venv/bin/python -m bench.ingest_flood [--labels 20000] [--in-flight 20]`` (prints a markdown row).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ingest import PROFILE, _status_when
from bench.memory import mosquitto
from edgefl.launcher import launch_agent, stop_agents
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.validators import parse_broker_url
from edgefl.wire.ingest import Label, encode_label
from edgefl.wire.status import decode_status


async def flood(url: str, fleet: str, device: str, n: int, in_flight: int = 20) -> dict[str, Any]:
    """Publish ``n`` unknown labels, then wait until the agent's refusal count is still for 5 s."""
    _, host, port = parse_broker_url(url)
    topics = Topics("edgefl", fleet)
    t = MqttTransport(host, port, f"bench-flood-{fleet}", queue_size=1024)
    await t.start(wait_s=10)
    try:
        await t.subscribe(topics.status(device), 1)
        t0 = time.monotonic()
        for k in range(0, n, in_flight):
            await asyncio.gather(
                *(
                    t.publish(topics.labels(device), encode_label(Label(f"u{i}", i % 10)), qos=1)
                    for i in range(k, min(n, k + in_flight))
                )
            )
        sent_s = time.monotonic() - t0
        refused, still_since = -1, time.monotonic()
        while time.monotonic() - still_since < 5.0:
            try:
                msg = await asyncio.wait_for(t.queue.get(), 1.0)
            except TimeoutError:
                continue
            if not msg.payload:
                continue
            rejected = decode_status(msg.payload).fields.get("rejected")
            now = int(rejected.get("unknown_sample", 0)) if isinstance(rejected, dict) else 0
            if now != refused:
                refused, still_since = now, time.monotonic()
        return {"labels": n, "sent_per_s": n / sent_s, "refused": refused}
    finally:
        await t.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the flood once and print its markdown row."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--labels", type=int, default=20000)
    ap.add_argument("--in-flight", type=int, default=20)
    args = ap.parse_args(argv)
    with mosquitto() as url, tempfile.TemporaryDirectory(prefix="edgefl-bench-flood-") as d:
        if url is None:
            print("mosquitto not installed")
            return 1
        fleet = f"flood{int(time.time() * 1000) % 10**9}"
        log = Path(d) / "agent.log"
        proc = launch_agent(
            PROFILE,
            {
                "device.id": "flood-1",
                "device.fleet": fleet,
                "device.state_dir": str(Path(d) / "state"),
                "broker.url": url,
                "source.kind": "mqtt",
                "dashboard.enabled": "false",
                "status.interval_s": "0.2",
            },
            log,
        )
        try:
            asyncio.run(_status_when(url, fleet, "flood-1", lambda f: bool(f.get("ready"))))
            row = asyncio.run(flood(url, fleet, "flood-1", args.labels, args.in_flight))
        finally:
            stop_agents([proc])
        text = log.read_text(errors="replace")
    lines = sum("rejected message" in line for line in text.splitlines())
    print("| labels sent | sent/s | refused (counted) | dropped by the broker | log lines | log bytes |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {row['labels']} | {row['sent_per_s']:.0f} | {row['refused']} | {row['labels'] - row['refused']} "
        f"| {lines} | {len(text.encode())} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
