"""A 1280-wide float MobileNet under a 96 MiB cap, dashboard on: round peaks and the lowest working cap.

Drives the shipped path (issue 14 item 5): a real agent process (``python -OO -m edgefl.cli run
firmware_configs/gateway_aarch64_256mb_mobilenet.toml``, dashboard on, replaying 64 random 96x96 RGB
frames: memory does not depend on the pixel values), a real mosquitto on 127.0.0.1 and the real
coordinator (``edgefl.coordinator.service.Coordinator``, FedAvg, 2 local epochs, the device selected so
a decline closes the round at once). Per try: the agent's status after the rounds (the governor's
per-phase peak RSS, exact through ``clear_refs`` + ``VmHWM``; its lifetime peak; the inference batch
it granted; deferrals and declines) and the peak RSS sampled from outside every 5 ms
(``/proc/<pid>/statm``).

- **at the profile's cap** (96 MiB): ``--tries`` fresh agents, ``--rounds`` rounds each;
- **lowest working cap**: bisection (1 MiB steps) on ``memory.cap_mb`` (reserve as the profile's, or
  ``--reserve``), one fresh agent per try; a try
  works when every round was trained (none deferred past its deadline or declined) and the agent's
  peak RSS stayed under the cap.

Run: ``.venv/bin/python -m bench.big_backbone`` (prints markdown for docs/benchmarks.md; ``--json PATH``);
``--classes 19`` runs a 1280 x 19 float head (the shipped backbone's head replaced); ``--profile
firmware_configs/dev_x86.toml --model models/digits_cnn_int8_rawin.tflite --no-bisect`` the demo's agent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.agent.memstat import rss_bytes
from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.launcher import launch_agent, stop_agents
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "firmware_configs" / "gateway_aarch64_256mb_mobilenet.toml"
MODEL = ROOT / "models" / "mobilenet_v2_035_96_float32.tflite"
MIB = 1 << 20
PHASES = ("inference", "train", "encode", "publish", "apply")


class OutsideRss:
    """Peak RSS of another process, sampled every ``interval_s`` from ``/proc/<pid>/statm``."""

    def __init__(self, pid: int, interval_s: float = 0.005) -> None:
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except OSError:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_try(
    broker_url: str,
    cap_mb: int,
    rounds: int,
    tmp: Path,
    *,
    reserve_mb: int | None = None,
    deadline_s: float = 30.0,
    optimize: bool = True,
    model: Path = MODEL,
    profile: Path = PROFILE,
) -> dict[str, Any]:
    """One fresh agent at ``cap_mb``: ``rounds`` rounds; its status and peaks afterwards.

    ``reserve_mb`` overrides the profile's ``memory.reserve_mb`` (None: the profile's, 4);
    ``optimize`` False runs the agent without ``-OO`` (docstrings kept); ``model`` replaces the
    profile's (``model.path``); ``profile`` replaces the shipped big-backbone profile.
    """
    fleet = f"big{uuid.uuid4().hex[:8]}"
    bb = Backbone(model)
    classes = int(bb.head_from_model()[0].shape[1])
    rng = np.random.default_rng(0)
    data = tmp / f"{fleet}.npz"
    np.savez(
        data,
        x=rng.integers(0, 256, size=(64, *bb.sample_shape), dtype=np.uint8),
        y=rng.integers(0, classes, size=64),
    )
    host, port = broker_url.removeprefix("mqtt://").split(":")
    overrides = {
        "device.id": "dev-1",
        "device.fleet": fleet,
        "device.state_dir": str(tmp / fleet),
        "broker.url": broker_url,
        "source.kind": "replay",
        "source.path": str(data),
        "model.path": str(model),
        "memory.cap_mb": str(cap_mb),
        **({"memory.reserve_mb": str(reserve_mb)} if reserve_mb is not None else {}),
        "memory.min_system_available_mb": "0",
        "dashboard.port": "0",
        "status.interval_s": "0.5",
    }
    log = tmp / f"{fleet}.log"
    proc = launch_agent(profile, overrides, log, optimize=optimize)
    watch = OutsideRss(proc.pid)

    async def main() -> tuple[list[Any], dict[str, Any], dict[str, int]]:
        t = MqttTransport(host, int(port), f"coord-{fleet}")
        await t.start(wait_s=10)
        W0, b0 = bb.head_from_model()
        coord = Coordinator(
            t,
            Topics("edgefl", fleet),
            W0,
            b0,
            model_sha256=bb.sha256,
            strategy=FedAvg(local_epochs=2, lr=0.05, batch_size=16, min_clients=1, deadline_s=deadline_s),
        )
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            ready: list[str] = []
            while not ready and proc.poll() is None:  # an agent the start-up check refused exits
                with contextlib.suppress(TimeoutError):
                    ready = await coord.registry.wait_for_devices(1, timeout_s=1)
            if not ready:
                return [], {"refused_start": log.read_text(errors="replace")[-400:]}, {}
            records = [await coord.run_round(r, selected=("dev-1",)) for r in range(1, rounds + 1)]
            # the status that follows the last round's global head (applied) or decline
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                st = coord.registry.devices.get("dev-1", {})
                done = st.get("round") == rounds and st.get("state") in ("waiting", "idle")
                if done and st.get("version") == coord.state.version:
                    break
                await asyncio.sleep(0.1)
            status = dict(coord.registry.devices["dev-1"])
            url = status.get("dashboard_url")
            if isinstance(url, str):  # the agent's own status now (its retained one waits for news)
                body = await asyncio.to_thread(_get, url.rstrip("/") + "/api/status")
                status.update(json.loads(body)["status"])
            return records, status, dict(coord.state.declined)
        finally:
            pump.cancel()
            await t.stop()

    try:
        records, status, declined = asyncio.run(main())
    finally:
        outside = watch.stop()
        stop_agents([proc])
    adm = status.get("admissions", {}).get("inference", {})
    pipe = status.get("pipeline", {})
    return {
        "cap_mb": cap_mb,
        "records": [str(r) for r in records],
        "status": status,
        "trained": sum(r.clients for r in records),
        "declined": sum(r.declined for r in records),
        "declined_by_reason": declined,
        "rounds": rounds,
        "peak_rss_bytes": status.get("peak_rss_bytes"),
        "outside_peak_rss_bytes": outside,
        "phase_peaks": status.get("phase_peaks", {}),
        "batch_asked": pipe.get("batch"),
        "batch_granted": pipe.get("tensor_batch"),
        "allocated_batch": pipe.get("allocated_batch"),
        "inference_admission": adm,
        "over_budget_batches": status.get("over_budget_batches"),
        "deferrals": status.get("deferrals", {}),
        "admissions": status.get("admissions", {}),
        "phase_rise": status.get("phase_rise", {}),
        "dashboard_url": status.get("dashboard_url"),
    }


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        body: bytes = resp.read()
        return body


def works(r: dict[str, Any]) -> bool:
    """Every round trained and the agent's peak RSS under the cap."""
    peak = max(int(r["peak_rss_bytes"] or 0), int(r["outside_peak_rss_bytes"]))
    return bool(r["trained"] == r["rounds"] and peak <= r["cap_mb"] * MIB)


def _mib(b: Any) -> str:
    return f"{b / MIB:.1f}" if isinstance(b, int) and b else "-"


def row(r: dict[str, Any]) -> str:
    peaks = r["phase_peaks"]
    cells = [
        str(r["cap_mb"]),
        f"{r['trained']} / {r['declined']} of {r['rounds']}",
        f"{r['batch_asked']} → {r['batch_granted']}",
        *(_mib(peaks.get(p)) for p in PHASES),
        _mib(r["peak_rss_bytes"]),
        _mib(r["outside_peak_rss_bytes"]),
        str(r["over_budget_batches"]),
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| cap (MiB) | rounds trained / declined | inference batch asked → granted | "
    + " | ".join(PHASES)
    + " | lifetime peak (governor) | peak sampled outside | batches refused |\n|"
    + "---|" * 11
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tries", type=int, default=3, help="fresh agents at the profile's cap")
    p.add_argument("--low", type=int, default=70, help="bisection's lower end (MiB, assumed failing)")
    p.add_argument("--reserve", type=int, help="memory.reserve_mb for the bisection (default: the profile's)")
    p.add_argument("--no-oo", action="store_true", help="run the agents without -OO (docstrings kept)")
    p.add_argument("--profile", type=Path, default=PROFILE, help="the agents' profile (default: shipped)")
    p.add_argument("--model", type=Path, default=MODEL, help="the agents' model (model.path)")
    p.add_argument(
        "--classes", type=int, help="a float head of K classes instead (tests/support/models.py)"
    )
    p.add_argument("--no-bisect", action="store_true", help="only the tries at the profile's cap")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from tests.support.broker import start_mosquitto, stop_broker

    tmp = Path(tempfile.mkdtemp(prefix="edgefl-big-"))
    model = args.model
    if args.classes is not None:
        from tests.support.models import widen_head

        model = tmp / f"{model.stem}_head{args.classes}.tflite"
        model.write_bytes(widen_head(args.model, args.classes))
    kw: dict[str, Any] = {"optimize": not args.no_oo, "model": model, "profile": args.profile}
    broker = start_mosquitto(tmp)
    out: dict[str, Any] = {"at_cap": [], "bisection": []}
    try:
        for _ in range(args.tries):
            out["at_cap"].append(run_try(broker.url, 96, args.rounds, tmp, **kw))
            print(row(out["at_cap"][-1]), flush=True)
        lo, hi = (95, 96) if args.no_bisect else (args.low, 96)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            r = run_try(broker.url, mid, args.rounds, tmp, reserve_mb=args.reserve, **kw)
            out["bisection"].append(r)
            print(row(r), "works" if works(r) else "fails", flush=True)
            if works(r):
                hi = mid
            else:
                lo = mid
        out["lowest_cap_mb"] = None if args.no_bisect else hi
    finally:
        stop_broker(broker)
    print(f"\nmachine: {platform.machine()}, {platform.platform()}, Python {platform.python_version()}")
    print("\n" + HEADER)
    for r in out["at_cap"] + out["bisection"]:
        print(row(r))
    oo = "without -OO" if args.no_oo else "-OO"
    if not args.no_bisect:
        reserve = args.reserve or "the profile"
        print(f"\nlowest working cap: {out['lowest_cap_mb']} MiB (reserve: {reserve}, {oo})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
