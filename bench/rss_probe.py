"""Where an agent's anonymous memory goes over a long run: one real agent, sampled from inside.

A cheap stand-in for :mod:`bench.soak`'s RSS figure: mosquitto, ``edgefl coordinator`` (paced, as the soak
sets it) and ONE agent on ``firmware_configs/dev_x86.toml`` fed live over MQTT (``--rate`` labelled samples
a second: faster than the soak's 2 so that the store fills in minutes), no faults. The agent runs through
this module's wrapper (``python -m bench.rss_probe wrap OUT -- <edgefl args>``), which starts a thread in
the agent's process that appends one JSON line to ``OUT`` every ``--every-s`` seconds: ``RssAnon``
(``/proc/self/status``), glibc's ``mallinfo2`` (``arena``, ``hblkhd``: live mmapped blocks,
``uordblks``, ``fordblks``), and with ``--trace`` the tracemalloc blocks of 64 KiB or more (numpy
registers its buffers with tracemalloc) with their tracebacks, and the top line-level growth since the
previous line. The product is run as shipped; nothing of this is in it.

Run: ``python -m bench.rss_probe --minutes 10 --rate 10 --out out/probe.jsonl [--trace]``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def _mallinfo() -> dict[str, int]:
    libc = ctypes.CDLL("libc.so.6")
    fn = libc.mallinfo2
    fn.restype = _Mallinfo2
    m = fn()
    return {name: int(getattr(m, name)) for name in _FIELDS}


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _anon_maps() -> list[list[int]]:
    """``[start, size KiB, rss KiB]`` of each anonymous private mapping of 132 KiB to 60 MiB (malloc's
    mmapped blocks among them), from ``/proc/self/smaps``."""
    out: list[list[int]] = []
    cur: list[int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            start, _, end = head[0].partition("-")
            size = (int(end, 16) - int(start, 16)) >> 10
            anon = len(head) == 5 and head[1] == "rw-p"
            cur = [int(start, 16), size, 0] if anon and 132 <= size <= 60 << 10 else None
            if cur is not None:
                out.append(cur)
        elif cur is not None and head[0] == "Rss:":
            cur[2] = int(head[1])
    return out


def _sampler(out: Path, every_s: float, trace: bool, maps: bool, dump: bool = False) -> None:
    import tracemalloc

    prev = None
    t0 = time.monotonic()
    while True:
        time.sleep(every_s)
        row: dict[str, Any] = {
            "pid": os.getpid(),
            "t": round(time.monotonic() - t0, 1),
            "rss_anon": _rss_anon(),
            **_mallinfo(),
        }
        if maps:
            row["maps"] = _anon_maps()
        if trace and tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot()
            if dump:  # the whole snapshot, for offline comparison (tracemalloc.Snapshot.load)
                snap.dump(str(out.with_name(f"{out.stem}.{os.getpid()}.{int(row['t']):05d}.snap")))
            row["traced"] = tracemalloc.get_traced_memory()[0]
            big = sorted((tr for tr in snap.traces if tr.size >= 64 << 10), key=lambda tr: -tr.size)
            row["big"] = [
                [tr.size, [f"{f.filename.split('/')[-1]}:{f.lineno}" for f in tr.traceback][-6:]]
                for tr in big[:8]
            ]
            if prev is not None:
                diff = snap.compare_to(prev, "lineno")
                row["grew"] = [
                    [d.size_diff, d.count_diff, str(d.traceback[0]).split("/")[-1]]
                    for d in diff[:12]
                    if d.size_diff > 0
                ]
            prev = snap
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def wrap(argv: list[str]) -> int:
    """``wrap OUT EVERY FLAGS -- edgefl args``: start the sampler thread, then run ``edgefl``.

    ``FLAGS``: ``t`` tracemalloc, ``d`` also each whole snapshot to ``OUT``'s folder
    (``<stem>.<pid>.<t>.snap``), ``m`` the anonymous mappings, ``-`` none.
    """
    out, every, trace, maps = Path(argv[0]), float(argv[1]), "t" in argv[2], "m" in argv[2]
    dump = "d" in argv[2]
    args = argv[argv.index("--") + 1 :]
    if trace:
        import tracemalloc

        tracemalloc.start(8)
    threading.Thread(target=_sampler, args=(out, every, trace, maps, dump), daemon=True, name="probe").start()
    from edgefl.cli import main as cli_main

    return cli_main(args)


def run(a: argparse.Namespace) -> int:
    """Run the probe fleet (module docstring) for ``a.minutes``."""
    import tempfile

    from bench.soak import Soak

    out = a.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)

    class Probe(Soak):
        def start_agent(self, dev: str) -> None:  # the shipped command through the wrapper
            import subprocess

            sets = {
                "device.id": dev,
                "device.fleet": self.fleet,
                "device.state_dir": str(self.workdir / dev),
                "broker.url": self.url,
                "training.seed": "0",
                "dashboard.enabled": "false",
            }
            sets.update(dict(s.partition("=")[::2] for s in a.agent_set))
            cmd = [sys.executable, "-OO", "-m", "bench.rss_probe", "wrap", str(out), str(a.every_s)]
            cmd += ["tm" if a.trace else "m", "--", "--log-level", "INFO", "run", str(self.args.profile)]
            for k, v in sets.items():
                cmd += ["--set", f"{k}={v}"]
            with open(self.workdir / f"{dev}.log", "ab") as log:
                proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent
                )
            self.agents[dev] = proc
            self._track(dev, proc)

        def plan(self, t0: float, duration: float) -> list[tuple[float, str]]:
            return [p for p in super().plan(t0, duration) if not p[1].startswith("second")]

    ns = argparse.Namespace(
        minutes=a.minutes,
        devices=1,
        seed=0,
        rate=a.rate,
        interval_s=a.interval_s,
        min_new_samples=a.min_new_samples,
        agent_kills=0,
        coordinator_kills=a.coordinator_kills,
        broker_kills=a.broker_kills,
        witness_agents=0,
        coordinator_set=["robustness.tolerate=0", "rounds.min_clients=1"],
        profile=a.profile,
    )
    with tempfile.TemporaryDirectory(prefix="edgefl-probe-") as d:
        workdir = a.workdir or Path(d)
        workdir.mkdir(parents=True, exist_ok=True)
        res = asyncio.run(Probe(ns, workdir).run())
    print(json.dumps({k: res[k] for k in ("rounds", "samples_fed", "rss_warmup_growth_mib_per_hour")}))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.rss_probe``: run the probe (or, ``wrap``, be the agent's wrapper)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "wrap":
        return wrap(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.rss_probe", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--interval-s", type=float, default=4.0)
    p.add_argument("--min-new-samples", type=int, default=16)
    p.add_argument("--every-s", type=float, default=30.0)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--broker-kills", type=int, default=0, help="kill -9 of the broker, spread over the run")
    p.add_argument("--coordinator-kills", type=int, default=0, help="kill -9 of the coordinator, idem")
    p.add_argument("--out", type=Path, default=Path("out/probe.jsonl"))
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument(
        "--profile", type=Path, default=Path(__file__).parent.parent / "firmware_configs" / "dev_x86.toml"
    )
    p.add_argument("--agent-set", action="append", default=[], metavar="KEY=VALUE")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    sys.exit(main())
