"""Memory benchmark: import baseline, per-phase peaks, lowest cap, hygiene, and RSS growth over 500 rounds.

Every figure comes from a fresh child process (``python -m bench.memory --child TASK ...``) so
that nothing measured before leaks into it:

- **import baseline**: ``VmHWM``, ``RssAnon``/``RssFile`` and PSS of a bare Python, then with
  numpy, LiteRT, aiohttp (its server, as ``edgefl.dashboard`` imports it), paho-mqtt and cbor2
  imported one after the other (cumulative), each in its own process.
- **phases**: ``edgefl.agent.memreport.run_round`` (the device core the daemon runs,
  ``edgefl.agent.core.DeviceCore``: classify, answer a round, publish, apply; in-process, tracemalloc
  off) for the digits CNN and MobileNetV2-0.35-96, float32 and int8;
  peak RSS per phase is exact (``clear_refs`` + ``VmHWM``), peak PSS is sampled every 2 ms.
  ``publish`` goes to a real mosquitto on 127.0.0.1 when one is installed.
- **lowest cap**: bisection on the governor's cap (1 MiB steps, reserve 1 MiB): a round completes
  when no phase is deferred and its measured peak RSS stays under the cap.
- **hygiene**: one variable changed at a time against the defaults of ``edgefl/cli.py``.
- **leak check**: the device core's round in a loop in one process (no MQTT: classify 64 samples,
  answer the round -- train, encode, outbox --, apply the next head, ``malloc_trim``), RSS after
  round 10 and 500.

Run: ``.venv/bin/python -m bench.memory`` (writes the ``## Memory`` section of docs/benchmarks.md;
``--json PATH`` for the raw figures; ``--quick`` for a short leak loop).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edgefl.launcher import MALLOC_ENV
from tests.support.broker import mosquitto_path, start_mosquitto, stop_broker

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
PROFILE = ROOT / "firmware_configs" / "dev_x86.toml"
SHIPPED_MOBILENET = ROOT / "firmware_configs" / "gateway_aarch64_256mb_mobilenet.toml"
DOC = ROOT / "docs" / "benchmarks.md"
MIB = 1 << 20

MODEL_SETS = {
    "digits_cnn_int8.tflite": {"pipeline.mean": "0", "pipeline.std": "16", "pipeline.batch": "8"},
    "digits_cnn_float32.tflite": {"pipeline.mean": "0", "pipeline.std": "16", "pipeline.batch": "8"},
    "mobilenet_v2_035_96_int8.tflite": {
        "pipeline.mean": "127.5",
        "pipeline.std": "127.5",
        "pipeline.batch": "8",
    },
    "mobilenet_v2_035_96_float32.tflite": {
        "pipeline.mean": "127.5",
        "pipeline.std": "127.5",
        "pipeline.batch": "8",
    },
}
IMPORT_STEPS = [
    ("python", ""),
    ("+ numpy", "import numpy"),
    ("+ LiteRT", "from ai_edge_litert import interpreter"),
    # as the dashboard imports it: the server without aiohttp's client (edgefl.dashboard.aiohttp_server)
    ("+ aiohttp", "import edgefl.dashboard, aiohttp.web"),
    ("+ paho-mqtt", "import paho.mqtt.client"),
    ("+ cbor2", "import cbor2"),
]
BASE_ENV = {"MALLOC_ARENA_MAX": "2", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


# --- child tasks ------------------------------------------------------------------------------------
def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "Threads"):
            out[key] = int(line.split()[1]) * (1024 if key != "Threads" else 1)
    from edgefl.agent.memstat import pss_bytes

    out["Pss"] = pss_bytes() or 0
    return out


def child_imports(step: int) -> dict[str, Any]:
    for _, stmt in IMPORT_STEPS[: step + 1]:
        if stmt:
            exec(stmt, {})
    return _status()


@contextlib.contextmanager
def _pss_sampler(peaks: dict[str, int], name: str) -> Iterator[None]:
    from edgefl.agent.memstat import pss_bytes

    stop = threading.Event()
    best = [pss_bytes() or 0]

    def run() -> None:
        while not stop.wait(0.002):
            best[0] = max(best[0], pss_bytes() or 0)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()
        best[0] = max(best[0], pss_bytes() or 0)
        peaks[name] = max(peaks.get(name, 0), best[0])


def _device_key() -> str:
    """A fresh Ed25519 device key in a temporary file (the shipped path signs every update)."""
    from edgefl.wire.signing import generate_signing_key

    path = Path(tempfile.mkdtemp(prefix="edgefl-key-")) / "device.key"
    path.write_text(generate_signing_key().seed.hex())
    path.chmod(0o600)
    return str(path)


def _profile(model: str, cap_mb: int = 96, reserve_mb: int = 8, extra: dict[str, str] | None = None) -> Any:
    from edgefl.agent.config import load_profile

    overrides: dict[str, object] = {
        "security.signing_key_file": _device_key(),
        "model.path": str(MODELS / model),
        "memory.cap_mb": str(cap_mb),
        "memory.reserve_mb": str(reserve_mb),
        "memory.min_system_available_mb": "0",
        **MODEL_SETS[model],
        **(extra or {}),
    }
    return load_profile(PROFILE, overrides)


def child_round(
    model: str, cap_mb: int, reserve_mb: int, broker: str | None, samples: int, pss: bool
) -> dict[str, Any]:
    from edgefl.agent.governor import Governor
    from edgefl.agent.memreport import run_round

    pss_peaks: dict[str, int] = {}

    class PssGovernor(Governor):
        """A governor that also samples PSS inside each phase's measurement."""

        @contextlib.contextmanager
        def phase(self, name: str) -> Iterator[None]:
            with super().phase(name), _pss_sampler(pss_peaks, name) if pss else contextlib.nullcontext():
                yield

    profile = _profile(model, cap_mb, reserve_mb)
    gov = PssGovernor(profile.cap_bytes, reserve_mb * MIB, 0)
    rep = run_round(profile, samples=samples, governor=gov, trace=False, broker=broker)
    out = dataclasses.asdict(rep)
    out["pss_peaks"] = pss_peaks
    out["lifetime_peak"] = gov.peak_rss_bytes
    out["status"] = _status()
    return out


#: The models whose admission estimates are checked against what each phase adds: label -> (model file,
#: profile, overrides). The 1280 x 19 float head is built from the shipped float32 MobileNet
#: (tests/support/models.py) and run under the shipped profile for that backbone.
ESTIMATE_MODELS: dict[str, tuple[str, Path, dict[str, str]]] = {
    "digits int8": ("digits_cnn_int8_rawin.tflite", PROFILE, {"pipeline.batch": "8"}),
    "MobileNet int8": (
        "mobilenet_v2_035_96_int8.tflite",
        PROFILE,
        MODEL_SETS["mobilenet_v2_035_96_int8.tflite"],
    ),
    "1280x19 float head": ("head19", SHIPPED_MOBILENET, {}),
    "streaming wake-word int8": (
        "test/streaming_kws_int8.tflite",
        PROFILE,
        {"pipeline.raw_dtype": "float32", "pipeline.mean": "0.0", "pipeline.std": "1.0"}
        | {"pipeline.batch": "1"},
    ),
}


def estimate_model(label: str, tmp: Path) -> tuple[Path, Path, dict[str, str]]:
    """The model file, profile and overrides of :data:`ESTIMATE_MODELS` ``label`` (building the 1280 x 19)."""
    name, profile, overrides = ESTIMATE_MODELS[label]
    if name == "head19":
        from tests.support.models import widen_head

        path = tmp / "mobilenet_v2_035_96_float32_head19.tflite"
        path.write_bytes(widen_head(MODELS / "mobilenet_v2_035_96_float32.tflite", 19))
        return path, profile, overrides
    return MODELS / name, profile, overrides


def child_estimates(label: str, samples: int, rounds: int) -> dict[str, Any]:
    """Each admitted phase's estimate beside what that run added to RSS, over ``rounds`` rounds.

    The shipped device core (``DeviceCore``) with a governor whose cap admits everything as asked:
    a replay file of ``samples`` samples admitted and loaded as the daemon does, the samples classified
    in the profile's batches, then ``rounds`` rounds answered (train, encode; the personal step where
    the profile keeps one) and their global heads applied. Each phase run is paired with the admission
    made for it; "added" is the run's peak RSS (``VmHWM`` after a ``clear_refs`` reset) minus the RSS
    at its start.
    """
    import numpy as np

    from edgefl import heap
    from edgefl.agent import estimates, memstat
    from edgefl.agent.config import load_profile
    from edgefl.agent.core import ApplyStatus, DeviceCore
    from edgefl.agent.governor import Governor
    from edgefl.agent.round import RoundStatus
    from edgefl.wire.global_model import GlobalModel, encode_global_model
    from edgefl.wire.rounds import RoundAnnouncement, encode_round

    tmp = Path(tempfile.mkdtemp(prefix="edgefl-estimates-"))
    model, profile_path, extra = estimate_model(label, tmp)
    profile = load_profile(
        profile_path,
        {
            "security.signing_key_file": _device_key(),
            "model.path": str(model),
            "memory.min_system_available_mb": "0",
            "device.state_dir": str(tmp / "state"),
            **extra,
        },
    )
    gov = Governor(1 << 34, 0, 0)
    runs: dict[str, list[tuple[int, int]]] = {}
    seen: dict[str, float] = {}

    @contextlib.contextmanager
    def paired(name: str) -> Iterator[None]:
        adm = gov.admissions.get(name)
        fresh = adm is not None and adm.at_s > seen.get(name, 0.0) and not adm.deferred
        if fresh and adm is not None:
            seen[name] = adm.at_s
        start = gov.rss_bytes()
        with gov.phase(name):
            yield
        if fresh and adm is not None:
            runs.setdefault(name, []).append((adm.estimate_bytes, gov.phase_last[name] - start))

    core = DeviceCore.open(
        profile, governor=gov, state_dir=tmp / "state", store_capacity=samples, phase=paired
    )
    assert core.pipeline is not None and core.shapes is not None
    rng = np.random.default_rng(0)
    shape, classes = core.pipeline.backbone.sample_shape, core.shapes.classes
    raw_dtype = np.float32 if profile.pipeline.raw_dtype == "float32" else np.uint8
    x = rng.integers(0, 17, size=(samples, *shape)).astype(raw_dtype)
    replay = tmp / "replay.npz"
    np.savez(replay, x=x, y=rng.integers(0, max(2, classes), size=samples))
    del x
    heap.malloc_trim()
    # the replay file as the daemon admits and loads it
    need = estimates.estimate_replay_bytes(replay)
    memstat.reset_peak()
    before = memstat.rss_bytes()
    with np.load(replay) as data:
        x, y = np.asarray(data["x"]), np.asarray(data["y"]).astype(np.int64)
    runs["replay"] = [(need, memstat.peak_rss_bytes() - before)]
    batch = core.pipeline.batch
    for s in range(0, samples, batch):
        core.observe(x[s : s + batch], y[s : s + batch])
    core.flush()
    for r in range(1, rounds + 1):
        heap.malloc_trim()  # as the daemon after each round
        ann = RoundAnnouncement(r, core.head.version, 600.0, 2, 0.05, 16, 1, 1.0)
        res = core.receive_round(encode_round(ann))
        if res.status != RoundStatus.TRAINED or res.entry is None or res.local is None:
            raise RuntimeError(f"round {r}: {res.status} {res.reason} {res.detail}")
        core.acknowledged(res.entry.update_id)
        head = core.head
        gm = GlobalModel(
            r, head.version + 1, core.model_sha256, head.W + res.local.delta_W, head.b + res.local.delta_b
        )
        del res, head
        if core.receive_global(encode_global_model(gm)).status != ApplyStatus.APPLIED:
            raise RuntimeError(f"round {r}: global head not applied")
    shutil.rmtree(tmp, ignore_errors=True)
    return {"model": model.name, "D": core.shapes.embedding_dim, "K": classes, "runs": runs}


def child_leak(model: str, rounds: int) -> dict[str, Any]:
    """The device core's round in a loop: classify 64 samples, answer a round, apply the next head."""
    import numpy as np

    from edgefl import heap
    from edgefl.agent import memstat
    from edgefl.agent.core import ApplyStatus, DeviceCore
    from edgefl.agent.round import RoundStatus
    from edgefl.wire.global_model import GlobalModel, encode_global_model
    from edgefl.wire.rounds import RoundAnnouncement, encode_round

    profile = _profile(model, cap_mb=1024, extra={"device.id": "leak"})
    state = Path(tempfile.mkdtemp(prefix="edgefl-leak-"))
    core = DeviceCore.open(profile, state_dir=state, store_capacity=1024, pipeline_mode="fused")
    assert core.pipeline is not None
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 17, size=(64, *core.pipeline.backbone.sample_shape), dtype=np.uint8)
    labels = rng.integers(0, core.head.shape[1], size=64).astype(np.int64)
    batch = profile.pipeline.batch
    rss: dict[int, int] = {}
    t0 = time.perf_counter()
    for r in range(1, rounds + 1):
        for s in range(0, 64, batch):
            core.observe(raw[s : s + batch], labels[s : s + batch])
        ann = RoundAnnouncement(r, core.head.version, 600.0, 2, 0.05, 16, 1, 1.0)
        res = core.receive_round(encode_round(ann))
        if res.status != RoundStatus.TRAINED or res.entry is None or res.local is None:
            raise RuntimeError(f"round {r}: {res.status} {res.reason} {res.detail}")
        core.acknowledged(res.entry.update_id)  # as after the PUBACK
        head = core.head
        gm_bytes = encode_global_model(
            GlobalModel(
                r, head.version + 1, core.model_sha256, head.W + res.local.delta_W, head.b + res.local.delta_b
            )
        )
        del res, head
        if core.receive_global(gm_bytes).status != ApplyStatus.APPLIED:
            raise RuntimeError(f"round {r}: global head not applied")
        del gm_bytes
        core.flush()
        heap.malloc_trim()
        if r in (1, 10, 50, 100, 200, 300, 400, 500) or r == rounds:
            rss[r] = memstat.rss_bytes()
    n = len(core.store)
    shutil.rmtree(state, ignore_errors=True)
    return {"rss": rss, "seconds": time.perf_counter() - t0, "store": n}


def child_hygiene(which: str) -> Any:
    """One hygiene measurement (the parent sets the environment)."""
    from edgefl import heap
    from edgefl.agent import memstat

    if which == "blas":
        import numpy as np

        a = np.ones((256, 256))
        _ = a @ a  # starts the BLAS thread pool
        return _status()
    if which in ("model_path", "model_bytes"):
        from ai_edge_litert import interpreter as lt

        path = MODELS / "mobilenet_v2_035_96_float32.tflite"
        before = _status()
        if which == "model_path":
            it = lt.Interpreter(model_path=str(path), num_threads=1)
        else:
            it = lt.Interpreter(model_content=path.read_bytes(), num_threads=1)
        it.allocate_tensors()
        after = _status()
        return {k: after[k] - before[k] for k in ("RssAnon", "RssFile", "VmRSS", "Pss")}
    if which.startswith("threads"):
        import numpy as np

        from edgefl.runtime import Backbone
        from tests.support.models import resize_backbone, run_backbone

        n = int(which[len("threads") :])
        bb = Backbone(MODELS / "mobilenet_v2_035_96_int8.tflite", num_threads=n)
        resize_backbone(bb, 8)
        x = np.zeros((8, *bb.sample_shape), bb.input_dtype)
        memstat.reset_peak()
        r0 = memstat.rss_bytes()
        run_backbone(bb, x)
        return {"run_peak_delta": memstat.peak_rss_bytes() - r0, **_status()}
    if which == "trim":
        out = child_round("mobilenet_v2_035_96_int8.tflite", 200, 1, None, 256, False)
        rss_before = memstat.rss_bytes()
        heap.malloc_trim()
        return {"before": rss_before, "after": memstat.rss_bytes(), "round_peak": out["lifetime_peak"]}
    if which == "store":
        import numpy as np

        from edgefl.agent.store import EmbeddingStore

        d = Path(tempfile.mkdtemp())
        before = _status()
        st = EmbeddingStore(d, 4096, 1280)
        st.add(np.ones((4096, 1280), np.float32), np.zeros(4096, np.int64))
        after = _status()
        shutil.rmtree(d)
        return {k: after[k] - before[k] for k in ("RssAnon", "RssFile", "VmRSS")}
    raise ValueError(which)


# --- parent ---------------------------------------------------------------------------------------
def run_child(args: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> Any:
    e = {**os.environ, **BASE_ENV, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--child", *args],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def mosquitto() -> Iterator[str | None]:
    """A mosquitto (tests/support/broker.py) for the bench's duration: its URL, or None if not installed."""
    try:
        mosquitto_path()
    except RuntimeError:
        yield None
        return
    with tempfile.TemporaryDirectory() as d:
        broker = start_mosquitto(Path(d))
        try:
            yield broker.url
        finally:
            stop_broker(broker)


def lowest_cap(model: str, lo: int, hi: int) -> tuple[int, dict[str, Any]]:
    """Smallest cap (MiB) at which a round completes under the governor (reserve 1 MiB)."""

    def ok(cap: int) -> tuple[bool, dict[str, Any]]:
        out = run_child(["round", model, str(cap), "1", "-", "256", "0"])
        good = out["completed"] and out["lifetime_peak"] <= cap * MIB
        return good, out

    good, best = ok(hi)
    if not good:
        raise RuntimeError(f"{model}: no round at {hi} MiB: {best['note']}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        good, out = ok(mid)
        if good:
            hi, best = mid, out
        else:
            lo = mid
    return hi, best


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        m = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        cpu = m.group(1) if m else cpu
    mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
    import numpy

    return (
        f"{platform.machine()}, {cpu}, {os.cpu_count()} CPUs, {int(mem) // 1024} MiB RAM, "
        f"Linux {platform.release()}, Python {platform.python_version()}, numpy {numpy.__version__}"
    )


def mib(x: float) -> str:
    return f"{x / MIB:.1f}"


def _keep_hand_written(old_section: str, text: str) -> str:
    """``text`` plus the old section's ``###`` subsections that ``render`` does not write (kept in place
    before the leak check: the demo agents' figures and the shipped-path comparison are written by hand)."""
    parts = re.split(r"^(?=### )", old_section, flags=re.M)[1:]
    kept = [p.rstrip() for p in parts if p.splitlines()[0] not in text]
    if not kept:
        return text
    anchor = "### RSS growth over rounds"
    extra = "\n\n".join(kept) + "\n\n"
    return text.replace(anchor, extra + anchor, 1) if anchor in text else text.rstrip() + "\n\n" + extra


def write_section(text: str) -> None:
    DOC.parent.mkdir(parents=True, exist_ok=True)
    old = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    pattern = re.compile(r"^## Memory\n.*?(?=^## |\Z)", re.S | re.M)
    found = pattern.search(old)
    if found:
        text = _keep_hand_written(found.group(0), text)
    section = text.rstrip() + "\n\n"
    new = (
        pattern.sub(lambda _: section, old, count=1)
        if pattern.search(old)
        else old.rstrip() + "\n\n" + section
    )
    DOC.write_text(new.rstrip() + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="50-round leak loop instead of 500")
    p.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    p.add_argument(
        "--estimates",
        action="store_true",
        help="only the admission estimates against what each phase adds (its subsection, in place)",
    )
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per model for --estimates")
    a = p.parse_args(argv)
    if a.child:
        task, *rest = a.child
        if task == "imports":
            out: Any = child_imports(int(rest[0]))
        elif task == "round":
            model, cap, reserve, broker, samples, pss = rest
            out = child_round(
                model, int(cap), int(reserve), None if broker == "-" else broker, int(samples), pss == "1"
            )
        elif task == "leak":
            out = child_leak(rest[0], int(rest[1]))
        elif task == "estimates":
            out = child_estimates(rest[0], int(rest[1]), int(rest[2]))
        elif task == "hygiene":
            out = child_hygiene(rest[0])
        else:
            raise SystemExit(f"unknown child task {task}")
        print(json.dumps(out))
        return 0

    results: dict[str, Any] = {"machine": machine()}
    if a.estimates:
        results["estimates"] = run_estimates(a.repeats)
        text = render_estimates(results["estimates"], results["machine"])
        print(text)
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
        if not a.no_doc:
            write_subsection(text)
            print(f"wrote {DOC}")
        return 0
    print(results["machine"])
    # import baseline
    imports = []
    for i, (name, _) in enumerate(IMPORT_STEPS):
        st = min((run_child(["imports", str(i)]) for _ in range(3)), key=lambda s: s["VmHWM"])
        imports.append({"step": name, **st})
        print(f"  import {name:<12} VmHWM {mib(st['VmHWM'])} MiB")
    results["imports"] = imports
    # phases per model
    phases = {}
    with mosquitto() as broker:
        for model in MODEL_SETS:
            out = run_child(["round", model, "256", "8", broker or "-", "512", "1"])
            phases[model] = out
            print(f"  {model}: round peak {mib(out['lifetime_peak'])} MiB, completed {out['completed']}")
    results["phases"] = phases
    results["publish"] = broker is not None
    # lowest cap
    caps = {}
    for model in MODEL_SETS:
        cap, out = lowest_cap(model, 40, 160)
        caps[model] = {
            "cap_mb": cap,
            "peak": out["lifetime_peak"],
            "train_chunk": out["phases"]["train"]["work"],
        }
        print(f"  {model}: lowest cap {cap} MiB (peak {mib(out['lifetime_peak'])} MiB)")
    results["lowest_cap"] = caps
    # hygiene
    hyg: dict[str, Any] = {}
    hyg["blas_1"] = run_child(["hygiene", "blas"])
    hyg["blas_default"] = run_child(
        ["hygiene", "blas"], env={"OPENBLAS_NUM_THREADS": "", "OMP_NUM_THREADS": ""}
    )
    hyg["model_path"] = run_child(["hygiene", "model_path"])
    hyg["model_bytes"] = run_child(["hygiene", "model_bytes"])
    hyg["threads1"] = run_child(["hygiene", "threads1"])
    hyg["threads2"] = run_child(["hygiene", "threads2"])
    hyg["trim"] = run_child(["hygiene", "trim"])
    hyg["store"] = run_child(["hygiene", "store"])
    arena = {}
    for label, env in (("MALLOC_ARENA_MAX=2", {}), ("glibc default", {"MALLOC_ARENA_MAX": ""})):
        out = run_child(["round", "mobilenet_v2_035_96_int8.tflite", "256", "8", "-", "256", "0"], env=env)
        arena[label] = out["lifetime_peak"]
    hyg["arena"] = arena
    results["hygiene"] = hyg
    print("  hygiene done")
    # leak
    rounds = 50 if a.quick else 500
    results["leak"] = run_child(["leak", "digits_cnn_int8.tflite", str(rounds)], timeout=3600)
    print(f"  leak: {results['leak']['rss']}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
    if not a.no_doc:
        write_section(render(results))
        print(f"wrote {DOC}")
    return 0


ESTIMATE_PHASES = ("replay", "inference", "train", "encode", "personal")
#: The resolution of an RSS reading here: Linux (>= 6.2) keeps a process's RSS in per-CPU counters
#: that are read without summing the CPUs' pending counts, up to 32 pages each (mm/percpu_counter).
RSS_RESOLUTION_BYTES = 32 * 4096 * (os.cpu_count() or 1)
TOLERANCE = 0.25


def run_estimates(repeats: int) -> dict[str, Any]:
    """Per model and phase: the estimate and the most a run added, first run and later runs apart."""
    out: dict[str, Any] = {}
    for label in ESTIMATE_MODELS:
        rows: dict[str, dict[str, int]] = {}
        for _ in range(repeats):
            child = run_child(["estimates", label, "256", "5"], env=MALLOC_ENV)
            out.setdefault(label, {"model": child["model"], "D": child["D"], "K": child["K"]})
            for phase, runs in child["runs"].items():
                row = rows.setdefault(phase, {"first_est": 0, "first": 0, "later_est": 0, "later": 0})
                row["first_est"] = max(row["first_est"], runs[0][0])
                row["first"] = max(row["first"], runs[0][1])
                for est, added in runs[1:]:
                    row["later_est"] = max(row["later_est"], est)
                    row["later"] = max(row["later"], added)
        out[label]["phases"] = rows
        print(f"  estimates {label}: {rows}", flush=True)
    return out


def within(estimate: int, added: int) -> bool:
    """``estimate`` within :data:`TOLERANCE` of ``added``, or within one RSS reading's resolution."""
    return abs(estimate - added) <= max(TOLERANCE * added, RSS_RESOLUTION_BYTES)


def render_estimates(r: dict[str, Any], machine_line: str) -> str:
    lines = [
        "### Admission estimates against what each phase adds",
        "",
        "`.venv/bin/python -m bench.memory --estimates` (`child_estimates`): the shipped device core "
        "(`DeviceCore`) in 3 fresh processes per model (glibc as the unit sets it), a 256-sample replay "
        "file admitted and loaded as the daemon does, the samples classified in the profile's batches, "
        "then 5 rounds answered (train, encode, the personal step) and their heads applied. Each phase "
        "run is paired with the admission made for it; *added* = the run's peak RSS (VmHWM after a "
        "`clear_refs` reset) minus the RSS at its start, the most over the processes; *later* = rounds "
        "2-5 (inference: every call after the first). The 1280 x 19 float head is the shipped float32 "
        "MobileNet with a 19-class head (`tests/support/models.py`) under "
        "`gateway_aarch64_256mb_mobilenet.toml`; the others under `dev_x86.toml`. Within: |estimate - "
        f"added| <= 25 % of added, or <= {RSS_RESOLUTION_BYTES >> 10} KiB (an RSS reading's resolution "
        f"here: 32 pages per CPU, Linux's per-CPU RSS counters). {machine_line}; "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        "Cells: estimate / added in MiB, first run; later runs after the semicolon.",
        "",
        "| model (D x K) | " + " | ".join(ESTIMATE_PHASES) + " | every phase within |",
        "|---" * (len(ESTIMATE_PHASES) + 2) + "|",
    ]
    for label, m in r.items():
        cells, ok = [], True
        for phase in ESTIMATE_PHASES:
            row = m["phases"].get(phase)
            if row is None:
                cells.append("–")
                continue
            cell = f"{row['first_est'] / MIB:.2f} / {row['first'] / MIB:.2f}"
            ok = ok and within(row["first_est"], row["first"])
            if phase != "replay":
                cell += f"; {row['later_est'] / MIB:.2f} / {row['later'] / MIB:.2f}"
                ok = ok and within(row["later_est"], row["later"])
            cells.append(cell)
        verdict = "yes" if ok else "**no**"
        lines.append(f"| {label} ({m['D']} x {m['K']}) | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines) + "\n"


def write_subsection(text: str) -> None:
    """Replace the ``###`` subsection ``text`` starts with (or add it before the leak check's)."""
    doc = DOC.read_text()
    title = text.splitlines()[0]
    pattern = re.compile(rf"^{re.escape(title)}\n.*?(?=^##|\Z)", re.S | re.M)
    if pattern.search(doc):
        doc = pattern.sub(lambda _: text.rstrip() + "\n\n", doc, count=1)
    else:
        anchor = "### RSS growth over rounds"
        doc = doc.replace(anchor, text.rstrip() + "\n\n" + anchor, 1)
    DOC.write_text(doc)


def render(r: dict[str, Any]) -> str:
    lines = [
        "## Memory",
        "",
        "`.venv/bin/python -m bench.memory` (bench/memory.py); every figure from a fresh process; "
        f"machine: {r['machine']}. MiB = 2^20 bytes. Environment as `edgefl/cli.py` sets it: "
        "`MALLOC_ARENA_MAX=2`, `OPENBLAS_NUM_THREADS=1`.",
        "",
        "### Import baseline (cumulative, each step a fresh process, best of 3)",
        "",
        "| step | peak RSS (VmHWM) | RssAnon | RssFile | PSS | Δ peak |",
        "|---|---|---|---|---|---|",
    ]
    prev = 0
    for s in r["imports"]:
        lines.append(
            f"| {s['step']} | {mib(s['VmHWM'])} | {mib(s['RssAnon'])} | {mib(s['RssFile'])} | "
            f"{mib(s['Pss'])} | +{mib(s['VmHWM'] - prev)} |"
        )
        prev = s["VmHWM"]
    lines += [
        "",
        "### Peak RSS per phase through one full round (MiB)",
        "",
        "`edgefl.agent.memreport.run_round`, which drives the device core the daemon runs "
        "(`edgefl.agent.core.DeviceCore`): 512 samples classified in batches of 8 into the store "
        "(`inference`, batch preparation included: the shipped fused pipeline does both in one "
        "call), a RoundAnnouncement's bytes answered with 2 local epochs (chunk as the governor "
        "grants, batch 16; `encode` = error feedback (a no-op uncompressed), encoding, Ed25519 signing "
        "with a device key, the "
        "outbox record and the answered-round record), the update published with QoS 1 to "
        + ("a local mosquitto" if r["publish"] else "(no mosquitto: publish not run)")
        + ", a GlobalModel's bytes verified, decoded, applied and persisted (`apply`). Peak RSS per "
        "phase is exact (VmHWM after a `clear_refs` reset); PSS is sampled every 2 ms (can miss "
        "spikes). MobileNet inputs are random uint8 images (memory does not depend on the pixel values).",
        "",
        "| model | before round | inference | train | encode | publish | apply | round peak "
        "| peak PSS (max over phases) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, out in r["phases"].items():
        ph = out["phases"]
        cells = []
        for name in ("inference", "train", "encode", "publish", "apply"):
            cells.append(mib(ph[name]["peak_rss_bytes"]) if ph[name]["runs"] else "–")
        pss = max(out["pss_peaks"].values()) if out["pss_peaks"] else 0
        lines.append(
            f"| {model} | {mib(ph['inference']['rss_before_bytes'])} | "
            + " | ".join(cells)
            + f" | {mib(out['lifetime_peak'])} | {mib(pss)} |"
        )
    lines += [
        "",
        '"before round" is the process after importing the agent\'s modules and loading the model '
        "(the import baseline plus the interpreter); the process's peak before any phase is included "
        'in "round peak".',
        "",
        "### Lowest cap at which a full round completes",
        "",
        "Bisection (1 MiB steps) on the governor's cap with `reserve_mb = 1`, one fresh process per "
        "try running the round above (256 samples, no MQTT): a try succeeds when no phase is deferred "
        "and the round's measured peak RSS stays under the cap.",
        "",
        "| model | lowest cap (MiB) | round peak at that cap (MiB) | training chunk granted |",
        "|---|---|---|---|",
    ]
    for model, c in r["lowest_cap"].items():
        lines.append(f"| {model} | {c['cap_mb']} | {mib(c['peak'])} | {c['train_chunk']} |")
    h = r["hygiene"]
    lines += [
        "",
        "### Hygiene, each measured",
        "",
        "| measure | with | without | note |",
        "|---|---|---|---|",
        f"| one BLAS thread (`OPENBLAS_NUM_THREADS=1`), after a 256x256 matmul | "
        f"{mib(h['blas_1']['VmRSS'])} MiB, {h['blas_1']['Threads']} threads | "
        f"{mib(h['blas_default']['VmRSS'])} MiB, {h['blas_default']['Threads']} threads | "
        f"{os.cpu_count()} CPUs here: each BLAS thread adds a stack and buffers |",
        f"| `MALLOC_ARENA_MAX=2`, MobileNet int8 round peak | {mib(h['arena']['MALLOC_ARENA_MAX=2'])} MiB | "
        f"{mib(h['arena']['glibc default'])} MiB | default is 8 x CPUs arenas |",
        f"| interpreter threads 1 vs 2, MobileNet int8 batch 8 run peak delta | "
        f"{mib(h['threads1']['run_peak_delta'])} MiB, {h['threads1']['Threads']} threads | "
        f"{mib(h['threads2']['run_peak_delta'])} MiB, {h['threads2']['Threads']} threads | "
        "profile `model.num_threads` |",
        f"| `malloc_trim(0)` after a MobileNet int8 round | {mib(h['trim']['after'])} MiB RSS | "
        f"{mib(h['trim']['before'])} MiB RSS | freed heap given back |",
        f"| model by path (LiteRT maps the file) vs bytes, MobileNet float32 (1.6 MB) | "
        f"anon +{mib(h['model_path']['RssAnon'])}, file +{mib(h['model_path']['RssFile'])} MiB | "
        f"anon +{mib(h['model_bytes']['RssAnon'])}, file +{mib(h['model_bytes']['RssFile'])} MiB | "
        "by path: no heap copy, file pages shared and reclaimable |",
        f"| store in a memory-mapped file, 4096 x 1280 float16 (10 MiB) | "
        f"anon +{mib(h['store']['RssAnon'])}, file +{mib(h['store']['RssFile'])} MiB | "
        "(heap: anon +10 MiB) | file pages: the kernel can write back and drop them |",
        "",
        "### RSS growth over rounds (leak check)",
        "",
    ]
    leak = r["leak"]
    rss = {int(k): v for k, v in leak["rss"].items()}
    last = max(rss)
    lines += [
        "The device core's round in a loop in one process, digits int8, **without MQTT** (classify 64 "
        "samples into the store, answer a RoundAnnouncement: train 2 epochs, encode, keep in the "
        "outbox and record the round, ack it, then verify, decode, apply and persist the next global "
        f"head, `malloc_trim`); {last} rounds in {leak['seconds']:.0f} s.",
        "",
        "| after round | " + " | ".join(str(k) for k in sorted(rss)) + " |",
        "|---" * (len(rss) + 1) + "|",
        "| RSS (MiB) | " + " | ".join(mib(rss[k]) for k in sorted(rss)) + " |",
        "",
        f"**RSS after round {last} minus after round 10: {(rss[last] - rss[10]) / 1024:+.0f} KiB.**",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
