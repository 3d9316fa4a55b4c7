"""What each performance device of the agent and the dashboard buys, measured with it and without it.

Three figures, each a user sees, each against the plain code the device replaces (interleaved repeats,
medians):

- ``proc``: CPU per classified sample (``DeviceCore.classify`` of one sample, the gateway profile:
  one admission and one ``inference`` phase, four ``/proc`` reads and one ``clear_refs`` write) with
  the shipped ``/proc`` reader (one ``os.read`` on a raw descriptor) against ``Path.read_text``; and
  what that is in % of a core at ``--rate`` samples/s (``edgefl feed``'s default: 50).
- ``store``: a round's training time (``train_local``: 4096 samples x D = 512, K = 10, 2 epochs,
  batch 16, chunk 64: the gateway and coordinator profiles) with the store's float16 gather
  (``half_bits_to_float32``) against numpy's own cast; with a personal head trained along the
  global one (``PersonalStep``) against ``train_personal`` after it.
- ``choose``: an agent's start with ``pipeline.mode = "auto"`` (``rpi4.toml``): measuring fused
  against unfused at batches 1, 4, 8, 16 against reading the decision kept per model.
- ``rounds-page``: ``/api/rounds`` response time of the fleet page on a long round log (the
  dashboard reusing each page's response while the records are the same object) against a response
  built for every request.

Run: ``.venv/bin/python -m bench.devices proc|store|choose|rounds-page``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.resources import shipped


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _interleaved(variants: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median over ``repeats`` rounds of each variant's figure, the variants taking turns."""
    got: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            got[name].append(run())
    return {name: float(np.median(v)) for name, v in got.items()}


def proc(repeats: int, rate: float) -> None:
    """CPU per classified sample: the shipped /proc reader against Path.read_text."""
    from edgefl.agent import memstat
    from edgefl.agent.config import load_profile
    from edgefl.agent.core import DeviceCore

    profile = load_profile(shipped("firmware_configs/gateway_aarch64_256mb.toml"))
    with tempfile.TemporaryDirectory(prefix="edgefl-bench-devices-") as d:
        core = DeviceCore.open(profile, state_dir=Path(d))
        assert core.pipeline is not None
        x = np.zeros((1, *core.pipeline.sample_shape), np.uint8)
        shipped_read = memstat._read_proc

        def read_text(proc: Path, pid: int | str | None, filename: str) -> str:
            return (proc / filename if pid is None else proc / str(pid) / filename).read_text()

        def run(reader: Callable[[Path, int | str | None, str], str]) -> Callable[[], float]:
            def once() -> float:
                memstat._read_proc = reader  # type: ignore[assignment]
                for _ in range(50):
                    core.classify(x)
                c0 = _cpu_s()
                for _ in range(2000):
                    core.classify(x)
                memstat._read_proc = shipped_read
                return (_cpu_s() - c0) / 2000

            return once

        med = _interleaved({"shipped": run(shipped_read), "Path.read_text": run(read_text)}, repeats)
    print(f"peak method {core.governor.peak_method}; CPU per classify() of 1 sample, median of {repeats}:")
    for name, s in med.items():
        print(f"  {name:15s} {s * 1e6:6.1f} us   {s * rate * 100:.2f} % of a core at {rate:g} samples/s")


def store(repeats: int) -> None:
    """A round's training time: the store's float16 gather against numpy's cast."""
    from edgefl.agent import store as store_mod
    from edgefl.agent import trainer
    from edgefl.agent.store import EmbeddingStore
    from edgefl.head import Head

    rng = np.random.default_rng(0)
    n, dim, k = 4096, 512, 10
    with tempfile.TemporaryDirectory(prefix="edgefl-bench-devices-") as d:
        st = EmbeddingStore(Path(d), n, dim, k)
        st.add(rng.standard_normal((n, dim)).astype(np.float32), rng.integers(0, k, n).astype(np.int64))
        head = Head(np.zeros((dim, k), np.float32), np.zeros(k, np.float32), 0)
        gather = store_mod.half_bits_to_float32

        def numpy_cast(half_bits: np.ndarray, out: Any) -> Any:
            np.copyto(out, half_bits.view(np.float16))
            return out

        def run(convert: Callable[[np.ndarray, Any], Any]) -> Callable[[], float]:
            def once() -> float:
                store_mod.half_bits_to_float32 = convert  # type: ignore[assignment]
                t0 = time.perf_counter()
                trainer.train_local(head, st, local_epochs=2, lr=0.05, batch_size=16, chunk_size=64)
                store_mod.half_bits_to_float32 = gather
                return time.perf_counter() - t0

            return once

        def personal(along: bool) -> Callable[[], float]:
            def once() -> float:
                W, b, columns = head.W.copy(), head.b.copy(), np.ones(k, bool)
                step = trainer.PersonalStep(W, b, columns, lam=0.0, lr=0.05) if along else None
                t0 = time.perf_counter()
                trainer.train_local(
                    head, st, local_epochs=2, lr=0.05, batch_size=16, chunk_size=64, personal=step
                )
                if not along:
                    trainer.train_personal(
                        W, b, head, st, columns, lam=0.0, epochs=2, lr=0.05, batch_size=16, chunk_size=64
                    )
                return time.perf_counter() - t0

            return once

        med = _interleaved(
            {
                "half_bits_to_float32": run(gather),
                "numpy cast": run(numpy_cast),
                "personal along": personal(True),
                "personal after": personal(False),
            },
            repeats,
        )
    print(f"train_local, {n} x {dim} store, 2 epochs, median of {repeats}:")
    for name, s in med.items():
        print(f"  {name:21s} {s * 1e3:6.1f} ms")


def choose(repeats: int) -> None:
    """``pipeline.mode = "auto"`` at an agent's start: measured against the decision kept on disk."""
    from edgefl.agent.pipeline import choose as choose_mode
    from edgefl.runtime import Backbone

    for model, mean, std in (
        ("models/digits_cnn_int8_rawin.tflite", (0.0,), (16.0,)),
        ("models/mobilenet_v2_035_96_int8_rawin.tflite", (127.5,), (127.5,)),
    ):
        backbone = Backbone(shipped(model), num_threads=1)

        def run(kept: bool, args: tuple[Any, ...]) -> Callable[[], float]:
            def once() -> float:
                with tempfile.TemporaryDirectory(prefix="edgefl-bench-devices-") as d:
                    if kept:
                        choose_mode(*args, cache_dir=Path(d))
                    t0 = time.perf_counter()
                    choose_mode(*args, cache_dir=Path(d))
                    return time.perf_counter() - t0

            return once

        args = (backbone, mean, std)
        med = _interleaved({"measured": run(False, args), "kept": run(True, args)}, repeats)
        print(f"{model}: " + ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in med.items()))


def rounds_page(repeats: int, rounds: int) -> None:
    """/api/rounds response time on a long log: each page's response reused against built per request."""
    from edgefl.coordinator.roundarchive import RoundArchive
    from edgefl.dashboard import app
    from edgefl.dashboard.app import DashboardState, serve

    with tempfile.TemporaryDirectory(prefix="edgefl-bench-devices-") as d:
        log = Path(d) / "rounds.jsonl"
        with open(log, "w") as f:
            for r in range(1, rounds + 1):
                rec = {"round": r, "time": "2026-12-06T04:00:00Z", "asked": 3, "counted": 3,
                       "accuracy": r / 10_000, "fed_accuracy": 0.5, "fed_worst_decile": 0.25,
                       "fed_devices": 3, "refused": {}, "declined": {"over_budget": 1},
                       "update_ids": [f"gw-{k}:{r}:0" for k in range(3)], "version": r,
                       "strategy": "median"}  # fmt: skip
                f.write(json.dumps(rec) + "\n")
        recent: list[dict[str, Any]] = []
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()

        def run(pages: int) -> Callable[[], float]:
            def once() -> float:
                app.MAX_CACHED_PAGES = pages
                arch = RoundArchive(log, lambda: recent)
                state = DashboardState("coordinator", "bench", lambda: {}, get_rounds=arch.records_async)
                runner, port = asyncio.run_coroutine_threadsafe(serve(state, "127.0.0.1", 0), loop).result(30)
                url = f"http://127.0.0.1:{port}/api/rounds?after=-1"
                try:
                    urllib.request.urlopen(url, timeout=60).read()  # the log's first read
                    times = []
                    for _ in range(10):
                        t0 = time.perf_counter()
                        urllib.request.urlopen(url, timeout=60).read()
                        times.append(time.perf_counter() - t0)
                finally:
                    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
                return float(np.median(times))

            return once

        shipped_pages = app.MAX_CACHED_PAGES
        med = _interleaved({"reused": run(shipped_pages), "built per request": run(0)}, repeats)
        app.MAX_CACHED_PAGES = shipped_pages
        loop.call_soon_threadsafe(loop.stop)
        size = log.stat().st_size
    print(f"/api/rounds?after=-1, {rounds} rounds ({size / 1e6:.0f} MB log), warm, median of {repeats}:")
    for name, s in med.items():
        print(f"  {name:17s} {s * 1e3:6.1f} ms")


def main(argv: list[str] | None = None) -> int:
    """Run one figure and print it."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figure", choices=("proc", "store", "choose", "rounds-page"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rate", type=float, default=50.0, help="proc: samples/s for the %% of a core")
    ap.add_argument("--rounds", type=int, default=300_000, help="rounds-page: rounds in the log")
    args = ap.parse_args(argv)
    if args.figure == "proc":
        proc(args.repeats, args.rate)
    elif args.figure == "store":
        store(args.repeats)
    elif args.figure == "choose":
        choose(args.repeats)
    else:
        rounds_page(args.repeats, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
