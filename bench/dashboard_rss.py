"""What the dashboard costs an agent in memory: RSS/PSS of an agent-like process with and without it.

A child process stands in for the agent: it imports ``edgefl.agent.daemon`` (numpy, LiteRT, paho-mqtt,
cbor2, asyncio), opens the shipped int8 digits backbone with ``edgefl.runtime.Backbone`` and idles on
its event loop. The bench then walks it through the stages below and reads ``/proc/<pid>/status``
and ``/proc/<pid>/smaps_rollup`` after each (median of 5 readings, 0.2 s apart):

1. ``base``: the agent without the dashboard.
2. ``import``: ``import edgefl.dashboard.app`` (aiohttp and its dependencies).
3. ``serve``: ``edgefl.dashboard.app.serve`` running, no client; status from ``edgefl.agent.memstat`` figures.
4. ``5 SSE``: 5 browsers' worth of SSE streams open for ``--hold-s`` seconds, one push per second
   (raw sockets that read everything, as a browser does).
5. ``scraped``: after 20 ``/metrics`` scrapes (prometheus_client is imported on the first one).
6. ``closed``: the 5 streams gone.

Bytecode is written and used (``PYTHONDONTWRITEBYTECODE`` is removed for the child and a first
child run warms the caches), as on a gateway where the wheel was installed with compiled files.

Run: ``.venv/bin/python -m bench.dashboard_rss`` (markdown table; ``--json PATH`` for the numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KiB = 1024

CHILD = r"""
import asyncio, sys, time
from pathlib import Path
import edgefl.agent.daemon
from edgefl.agent import memstat
from edgefl.runtime import Backbone

model = Path(sys.argv[1])
backbone = Backbone(model) if model.exists() else None
inferred = 0

def status():
    global inferred
    inferred += 1  # changes every call, so a stream gets one push per push interval
    return {
        "device": "bench", "state": "idle", "round": 1, "version": 1, "cap_bytes": 96 << 20,
        "rss_bytes": memstat.rss_bytes(), "pss_bytes": memstat.pss_bytes(),
        "peak_rss_bytes": memstat.peak_rss_bytes(),
        "system_available_bytes": memstat.system_available_bytes(),
        "phase_peaks": {"inference": 1, "batch": 2, "train": 3, "encode": 4, "publish": 5, "apply": 6},
        "last_update_bytes": 5310, "local_accuracy": 0.9, "inference_rate": 100.0, "pipeline_mode": "fused",
        "rejected": {"bad_cbor": 1}, "broker_connected": True, "store_samples": 512,
        "inferred_total": inferred,
    }

async def main():
    loop = asyncio.get_running_loop()
    runner = None
    print("ready", flush=True)
    while True:
        cmd = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if cmd == "import":
            import edgefl.dashboard.app
            print("ok", flush=True)
        elif cmd == "serve":
            from edgefl.dashboard.app import DashboardState, serve
            runner, port = await serve(DashboardState("device", "bench", status), "127.0.0.1", 0)
            print(port, flush=True)
        else:
            if runner is not None:
                await runner.cleanup()
            return

asyncio.run(main())
"""


def figures(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and Pss of a process, in bytes."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * KiB
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            out["Pss"] = int(line.split()[1]) * KiB
    return out


def settle(pid: int, n: int = 5, gap_s: float = 0.2) -> dict[str, int]:
    readings = []
    for _ in range(n):
        time.sleep(gap_s)
        readings.append(figures(pid))
    return {k: int(statistics.median(r[k] for r in readings)) for k in readings[0]}


class Stream:
    """One SSE client on a raw socket that reads everything the server sends (as a browser does)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n")
        self.events = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(65536):
                self.events += chunk.count(b"\ndata: ") + chunk.startswith(b"data: ")
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(2)


def run_child(model: Path, hold_s: float, env: dict[str, str]) -> dict[str, dict[str, int]]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(model)], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None

    def ask(cmd: str) -> str:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(cmd + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    stages: dict[str, dict[str, int]] = {}
    try:
        assert proc.stdout.readline().strip() == "ready"
        stages["base"] = settle(proc.pid)
        assert ask("import") == "ok"
        stages["import"] = settle(proc.pid)
        port = int(ask("serve"))
        time.sleep(2.5)  # the publisher takes its first history samples
        stages["serve"] = settle(proc.pid)
        streams = [Stream(port) for _ in range(5)]
        time.sleep(hold_s)
        stages["5 SSE"] = settle(proc.pid)
        assert all(s.events >= hold_s / 2 for s in streams), [s.events for s in streams]
        for _ in range(20):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                r.read()
        stages["scraped"] = settle(proc.pid)
        for s in streams:
            s.close()
        time.sleep(0.5)
        stages["closed"] = settle(proc.pid)
        ask("quit")
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return stages


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "digits_cnn_int8.tflite")
    parser.add_argument("--hold-s", type=float, default=10.0, help="seconds the 5 streams stay open")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    run_child(args.model, 1.0, env)  # writes and warms the bytecode caches
    runs = [run_child(args.model, args.hold_s, env) for _ in range(args.runs)]
    keys = ("VmRSS", "RssAnon", "RssFile", "Pss")
    table = {stage: {k: int(statistics.median(r[stage][k] for r in runs)) for k in keys} for stage in runs[0]}
    base = table["base"]

    def mib(n: float) -> str:
        return f"{n / (1 << 20):.2f}"

    print(f"RSS of an agent-like process (median of {args.runs} runs), MiB; delta against `base`\n")
    print("| stage | VmRSS | RssAnon | RssFile | Pss | Δ VmRSS | Δ RssAnon | Δ Pss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for stage, f in table.items():
        absolute = " | ".join(mib(f[k]) for k in keys)
        delta = " | ".join(mib(f[k] - base[k]) for k in ("VmRSS", "RssAnon", "Pss"))
        print(f"| {stage} | {absolute} | {delta} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "median": table}, indent=2))


if __name__ == "__main__":
    main()
