"""Coordinator RSS and page size under a status flood: retained statuses from invented device ids.

A real mosquitto on 127.0.0.1 and a real ``edgefl coordinator`` process (the shipped
``firmware_configs/coordinator.toml``, waiting for a device that never comes, so it only handles
statuses). A flooder publishes ``--messages`` retained ``status/<id>`` messages (QoS 1) from invented
ids. The coordinator's RSS (``VmRSS``) is read before, after the flood, and after a restart (the broker
delivers every retained status again). The registry is bounded by ``fleet.max_devices``.

``--kind`` picks the ghosts: ``minimal`` (two fields), ``mismatch`` (naming another backbone, which
used to grow the coordinator's mismatch list without bound), ``honest`` (a copy of a real agent's
status, ~1.2 kB, naming the right backbone). The coordinator's page is on: ``/api/status`` is
fetched after the flood and its size in bytes recorded. ``--no-restart`` skips the restart.

Run: ``.venv/bin/python -m bench.status_flood [--messages 50000] [--max-devices N] [--kind K] --json PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from edgefl.launcher import free_port
from edgefl.profiles import sha256_file
from edgefl.resources import shipped
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.status import DeviceStatus, encode_status
from tests.support.broker import start_mosquitto, stop_broker

MIB = 1 << 20


def rss_bytes(pid: int) -> int:
    """``VmRSS`` of a process, in bytes (Linux ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_coordinator(
    port: int, fleet: str, max_devices: int, log: Path, page_port: int
) -> subprocess.Popen[bytes]:
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
        "dashboard.enabled=true",
        f"dashboard.port={page_port}",
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


def ghost_fields(kind: str, i: int) -> dict[str, Any]:
    """The status fields of ghost ``i`` of ``kind`` (see the module docstring)."""
    if kind == "minimal":
        return {"ready": False, "round": i}
    if kind == "mismatch":
        return {"ready": True, "round": i, "model_sha256": f"{i:064x}"}
    # a real agent's status fields (dev_x86.toml, replay source), as it publishes them
    sha = sha256_file(shipped("models/digits_cnn_int8_rawin.tflite"))
    counters = {"connects": 1, "queue_dropped": 0, "oversize_dropped": 0, "callback_errors": 0}
    return {
        "round": i, "version": 3, "reason": "", "degraded": False, "write_failures": 0, "ready": True,
        "store_samples": 512, "stored_total": 512, "inferred_total": 1024, "inference_accuracy": 0.91,
        "last_update_bytes": 20611, "redelivered_total": 0, "outbox_pending": 0, "deferred_round": None,
        "declined_total": 0, "over_budget_batches": 0, "cap_bytes": 100663296, "rss_bytes": 48000000,
        "pss_bytes": 46000000, "peak_rss_bytes": 52000000, "system_available_bytes": 1 << 30,
        "phase_peaks": {p: 1000000 for p in ("inference", "batch", "train", "encode", "publish", "apply")},
        "rejected": {"stale_round": 1}, "faults": {}, "pipeline_mode": "fused",
        "pipeline": {"batches": 32, "samples": 1024}, "model_sha256": sha, "head_shape": [512, 10],
        "ts": round(time.time(), 3), "eval_version": 3, "eval_accuracy": 0.9, "eval_count": 64,
        "pid": 1000 + i, "dashboard_url": "", "transport": counters,
    }  # fmt: skip


async def flood(port: int, fleet: str, n: int, kind: str = "minimal") -> float:
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
                        encode_status(DeviceStatus(f"fake-{i}", "online", ghost_fields(kind, i))),
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
    ap.add_argument("--kind", choices=("minimal", "mismatch", "honest"), default="minimal")
    ap.add_argument("--no-restart", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="edgefl-flood-") as d:
        tmp = Path(d)
        broker = start_mosquitto(tmp)
        port = broker.port
        try:
            page = free_port()
            coord = start_coordinator(port, "flood", args.max_devices, tmp / "c.log", page)
            time.sleep(8)  # imports, model, adoption wait
            before = settle(coord.pid)
            seconds = asyncio.run(flood(port, "flood", args.messages, args.kind))
            after = settle(coord.pid, 60)
            with urllib.request.urlopen(f"http://127.0.0.1:{page}/api/status", timeout=30) as r:
                page_bytes = len(r.read())
            coord.terminate()
            coord.wait(180)
            restarted = 0
            if not args.no_restart:
                again = start_coordinator(port, "flood", args.max_devices, tmp / "c.log", free_port())
                time.sleep(8)
                restarted = settle(again.pid, 60)
                again.terminate()
                again.wait(180)
            lines = (tmp / "c.log").read_text(errors="replace").count("\n")
        finally:
            stop_broker(broker)
    result: dict[str, Any] = {
        "messages": args.messages,
        "kind": args.kind,
        "max_devices": args.max_devices,
        "flood_s": round(seconds, 1),
        "rss_before_mib": round(before / MIB, 1),
        "rss_after_flood_mib": round(after / MIB, 1),
        "rss_after_restart_mib": round(restarted / MIB, 1) if restarted else None,
        "rss_growth_mib": round((after - before) / MIB, 1),
        "api_status_bytes": page_bytes,
        "log_lines": lines,
    }
    print(
        "| messages | kind | max_devices | RSS before | after the flood | growth | after a restart "
        "| /api/status | log lines |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.messages:,} | {args.kind} | {args.max_devices:,} | {result['rss_before_mib']} MiB | "
        f"{result['rss_after_flood_mib']} MiB | {result['rss_growth_mib']} MiB | "
        f"{result['rss_after_restart_mib']} MiB | {page_bytes:,} B | {lines} |"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
