"""Coordinator RSS under a status flood: retained statuses from invented device ids (issue 13 item 10).

A real mosquitto on 127.0.0.1 and a real ``edgefl coordinator`` process (the shipped
``firmware_configs/coordinator.toml``, waiting for a device that never comes, so it only handles
statuses). A flooder publishes ``--messages`` retained ``status/<id>`` messages (QoS 1) from invented
ids. The coordinator's RSS (``VmRSS``) is read before, after the flood, and after a restart (the broker
delivers every retained status again). The registry is bounded by ``fleet.max_devices``.

Run: ``.venv/bin/python -m bench.status_flood [--messages 50000] [--max-devices 10000] --json PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from edgefl.resources import shipped
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.messages import DeviceStatus, encode_status
from tests.support.broker import start_mosquitto, stop_broker

MIB = 1 << 20


def rss_bytes(pid: int) -> int:
    """``VmRSS`` of a process, in bytes (Linux ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_coordinator(port: int, fleet: str, max_devices: int, log: Path) -> subprocess.Popen[bytes]:
    """An ``edgefl coordinator`` that waits (up to 1 h) for one ready device and never runs a round."""
    cmd = [
        sys.executable,
        "-m",
        "edgefl.cli",
        "coordinator",
        str(shipped("firmware_configs/coordinator.toml")),
    ]
    for item in (
        f"broker.url=mqtt://127.0.0.1:{port}",
        f"fleet.name={fleet}",
        f"fleet.max_devices={max_devices}",
        "rounds.expected_clients=1",
        "rounds.wait_devices_s=3600",
    ):
        cmd += ["--set", item]
    with open(log, "ab") as sink:
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)


def settle(pid: int, seconds: float = 30.0) -> int:
    """RSS once it stopped moving (two readings 1 s apart within 64 KiB), or after ``seconds``."""
    last = rss_bytes(pid)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = rss_bytes(pid)
        if abs(now - last) < 64 * 1024:
            return now
        last = now
    return last


async def flood(port: int, fleet: str, n: int) -> float:
    """Publish ``n`` retained statuses from invented ids; returns the seconds it took."""
    topics = Topics("edgefl", fleet)
    tx = MqttTransport("127.0.0.1", port, "flooder")
    await tx.start(wait_s=10)
    t0 = time.monotonic()
    try:
        for start in range(0, n, 20):
            await asyncio.gather(
                *(
                    tx.publish(
                        topics.status(f"fake-{i}"),
                        encode_status(DeviceStatus(f"fake-{i}", "online", {"ready": False, "round": i})),
                        qos=1,
                        retain=True,
                    )
                    for i in range(start, min(n, start + 20))
                )
            )
    finally:
        await tx.stop()
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    """Run the bench; print a markdown table and write ``--json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--max-devices", type=int, default=10_000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="edgefl-flood-") as d:
        tmp = Path(d)
        broker = start_mosquitto(tmp)
        port = broker.port
        try:
            coord = start_coordinator(port, "flood", args.max_devices, tmp / "c.log")
            time.sleep(8)  # imports, model, adoption wait
            before = settle(coord.pid)
            seconds = asyncio.run(flood(port, "flood", args.messages))
            after = settle(coord.pid, 60)
            coord.terminate()
            coord.wait(180)
            again = start_coordinator(port, "flood", args.max_devices, tmp / "c.log")
            time.sleep(8)
            restarted = settle(again.pid, 60)
            again.terminate()
            again.wait(180)
        finally:
            stop_broker(broker)
    result: dict[str, Any] = {
        "messages": args.messages,
        "max_devices": args.max_devices,
        "flood_s": round(seconds, 1),
        "rss_before_mib": round(before / MIB, 1),
        "rss_after_flood_mib": round(after / MIB, 1),
        "rss_after_restart_mib": round(restarted / MIB, 1),
    }
    print("| messages | max_devices | RSS before | after the flood | after a restart |")
    print("|---|---|---|---|---|")
    print(
        f"| {args.messages:,} | {args.max_devices:,} | {result['rss_before_mib']} MiB | "
        f"{result['rss_after_flood_mib']} MiB | {result['rss_after_restart_mib']} MiB |"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
