"""``edgefl memory-report PROFILE``: one full round in-process, with the peak memory of every phase.

The round is the agent's own code path without the daemon around it: classify the profile's replay
samples (or random samples of the model's input shape) batch by batch into the embedding store
(phases ``batch`` and ``inference``), train the head (``train``), encode the update (``encode``),
publish it to a broker when one is given (``publish``), and decode and apply a global head
(``apply``). Each phase runs inside :meth:`edgefl.agent.memory.Governor.phase` (exact peak RSS) and, unless
disabled, with :mod:`tracemalloc` on: the report prints per phase the peak of the Python heap and
its top allocation sites (file:line) next to the RSS peak. Allocations made by the interpreter in
C++ (its tensor arena) are not in the Python heap; the difference between the two columns is them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edgefl.agent import memory
from edgefl.agent.config import Profile

logger = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Site:
    """One allocation site of the Python heap at (near) a phase's peak: ``file:line``, bytes, blocks."""

    where: str
    size_bytes: int
    count: int


@dataclass
class PhaseReport:
    """Memory of one phase in a round.

    Attributes
    ----------
    phase : str
    runs : int
        How many times the phase ran in the round (``batch``/``inference`` once per batch).
    peak_rss_bytes : int
        Largest peak RSS of the phase (kernel ``VmHWM`` after a reset), bytes.
    rss_before_bytes : int
        RSS just before the phase's first run, bytes.
    heap_peak_bytes : int or None
        Peak of the Python heap above its level at the phase start (tracemalloc), bytes.
    sites : list[Site]
        Top allocation sites near the heap peak.
    work : int
        The work size the governor granted (batch, chunk) at the last run; 0 where not admitted.
    deferred : bool
    """

    phase: str
    runs: int = 0
    peak_rss_bytes: int = 0
    rss_before_bytes: int = 0
    heap_peak_bytes: int | None = None
    sites: list[Site] = field(default_factory=list)
    work: int = 0
    deferred: bool = False


@dataclass
class RoundReport:
    """What :func:`run_round` measured."""

    model: str
    samples: int
    baseline_rss_bytes: int
    cap_bytes: int
    peak_rss_bytes: int
    phases: dict[str, PhaseReport]
    update_bytes: int
    completed: bool
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        """JSON-like form."""
        return asdict(self)


class _HeapWatch:
    """Peak of the Python heap in a block, with a snapshot taken near the peak (a polling thread).

    tracemalloc keeps the peak size but not where it was reached; a thread polls the traced size
    every millisecond and snapshots whenever it is 5 % above the best seen, so the sites are those
    live near the peak.
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._best = 0
        self.snapshot: tracemalloc.Snapshot | None = None
        self._thread = threading.Thread(target=self._run, name="edgefl-heapwatch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            current, _ = tracemalloc.get_traced_memory()
            if current > self._best * 1.05:
                self._best = current
                self.snapshot = tracemalloc.take_snapshot()

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        self._best = tracemalloc.get_traced_memory()[0]
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()


def _own(snap: tracemalloc.Snapshot) -> tracemalloc.Snapshot:
    """Leave out the measuring's own allocations (tracemalloc, this module, frozen importlib)."""
    return snap.filter_traces(
        [
            tracemalloc.Filter(False, tracemalloc.__file__),
            tracemalloc.Filter(False, __file__),
            tracemalloc.Filter(False, "<frozen *>"),
            tracemalloc.Filter(False, threading.__file__),
        ]
    )


def _synthetic(shape: tuple[int, ...], n: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
    y = rng.integers(0, classes, size=n).astype(np.int64)
    return x, y


def _load_samples(profile: Profile, sample_shape: tuple[int, ...], classes: int, n: int) -> tuple[Any, Any]:
    src = profile.source
    if src.kind == "replay" and src.path is not None:
        with np.load(src.path) as data:
            x, y = np.asarray(data["x"]), np.asarray(data["y"]).astype(np.int64)
        if tuple(x.shape[1:]) == sample_shape:
            return x[:n], y[:n]
        logger.warning("replay samples %s do not fit the model %s: random samples", x.shape[1:], sample_shape)
    return _synthetic(sample_shape, n, classes, profile.training.seed)


def run_round(
    profile: Profile,
    *,
    samples: int = 512,
    governor: memory.Governor | None = None,
    trace: bool = True,
    top: int = 5,
    broker: str | None = None,
    state_dir: Path | None = None,
    local_epochs: int = 2,
    lr: float = 0.1,
    batch_size: int = 16,
    compression: str = "none",
    phase_hook: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
) -> RoundReport:
    """Run one full round of the agent's phases in this process and measure each phase.

    Parameters
    ----------
    profile : Profile
        Model, pipeline batch, training chunk size and memory cap come from here.
    samples : int
        Samples classified into the store before training.
    governor : Governor, optional
        Admits and measures the phases; default: one built from ``profile.memory``.
    trace : bool
        Run :mod:`tracemalloc` (heap peaks and sites; costs time and some memory).
    top : int
        Allocation sites kept per phase.
    broker : str, optional
        ``mqtt://host:port``: publish the update there (QoS 1); None skips the ``publish`` phase.
    state_dir : Path, optional
        Where the embedding store and head live; default a temporary directory.
    local_epochs, lr, batch_size, compression
        The round's settings (as a RoundAnnouncement would give them).
    phase_hook : callable(str) -> context manager, optional
        Entered around each phase inside the governor's measurement (e.g. a PSS sampler).

    Returns
    -------
    RoundReport
    """
    from edgefl.agent.pipeline import Pipeline
    from edgefl.agent.store import EmbeddingStore
    from edgefl.agent.trainer import train_local
    from edgefl.head import Head, validate_head
    from edgefl.runtime import Backbone, dequantize
    from edgefl.wire.codec import (
        Compression,
        GlobalModel,
        Limits,
        Update,
        UpdateMetrics,
        decode_global_model,
        encode_global_model,
        encode_update,
    )

    gov = governor or memory.Governor(
        profile.cap_bytes,
        profile.memory.reserve_mb * MIB,
        profile.memory.min_system_available_mb * MIB,
    )
    baseline = gov.rss_bytes()
    reports: dict[str, PhaseReport] = {p: PhaseReport(p) for p in memory.PHASES}
    if trace and not tracemalloc.is_tracing():
        tracemalloc.start(1)

    @contextlib.contextmanager
    def measured(name: str) -> Iterator[None]:
        rep = reports[name]
        if rep.runs == 0:
            rep.rss_before_bytes = gov.rss_bytes()
        watch = _HeapWatch() if trace else None
        start = tracemalloc.take_snapshot() if watch is not None else None
        if watch is not None:
            tracemalloc.reset_peak()
        level = tracemalloc.get_traced_memory()[0] if watch is not None else 0
        hook = phase_hook(name) if phase_hook is not None else contextlib.nullcontext()
        with gov.phase(name), hook, watch.watch() if watch is not None else contextlib.nullcontext():
            yield
        rep.runs += 1
        rep.peak_rss_bytes = max(rep.peak_rss_bytes, gov.phase_last[name])
        if watch is not None and start is not None:
            heap = tracemalloc.get_traced_memory()[1] - level
            if rep.heap_peak_bytes is None or heap > rep.heap_peak_bytes:
                rep.heap_peak_bytes = heap
                snap = watch.snapshot or tracemalloc.take_snapshot()
                stats = _own(snap).compare_to(_own(start), "lineno")
                rep.sites = [
                    Site(str(s.traceback[0]), s.size_diff, s.count_diff)
                    for s in stats[:top]
                    if s.size_diff > 0
                ]

    if broker is not None:
        import edgefl.transport  # noqa: F401 - loaded before any phase, as in the daemon

    with contextlib.ExitStack() as stack:
        if state_dir is None:
            state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgefl-memreport-")))
        backbone = Backbone(
            profile.model.path,
            num_threads=profile.model.num_threads,
            runtime=profile.model.runtime,
            embedding_tensor=profile.model.embedding_tensor,
        )
        shapes = memory.model_shapes(backbone)
        W, b = backbone.head_from_model()
        head = Head(W, b, 1)
        store = EmbeddingStore(
            state_dir, max(profile.training.store_capacity, samples), backbone.embedding_dim
        )
        x, y = _load_samples(profile, backbone.sample_shape, shapes.classes, samples)
        cfg = profile.pipeline
        mode: Literal["fused", "unfused"] = "unfused" if cfg.mode == "unfused" else "fused"
        pipe = Pipeline(backbone, cfg.mean, cfg.std, mode=mode, batch=cfg.batch)
        batch = pipe.tensor_batch
        for start_i in range(0, len(x), batch):
            raw, lbl = x[start_i : start_i + batch], y[start_i : start_i + batch]
            adm = gov.admit_batch(shapes, len(raw), fused=mode == "fused")
            inf = gov.admit_inference(shapes, len(raw), resident_batch=batch)
            reports["batch"].work = adm.work
            reports["inference"].work = inf.work
            # The pipeline fills the input tensor (phase "batch") and invokes (phase "inference");
            # the daemon does both in one Pipeline.run call.
            with measured("batch"):
                pipe.prepare(raw)
            with measured("inference"):
                pipe.invoke_only()
                emb = dequantize(
                    backbone.interpreter.get_tensor(backbone.embedding_index), backbone.embedding_quant
                )[: len(raw)].reshape(len(raw), -1)
                head.predict(emb)
            store.add(emb.astype(np.float32), lbl)
            del emb
        store.flush()

        adm = gov.admit_train(
            profile.training.chunk_size,
            profile.training.chunk_floor,
            dim=shapes.embedding_dim,
            classes=shapes.classes,
            batch_size=batch_size,
            num_examples=len(store),
        )
        reports["train"].work = adm.work
        reports["train"].deferred = adm.deferred
        if adm.deferred:
            return RoundReport(
                backbone.path.name,
                len(store),
                baseline,
                gov.cap_bytes,
                gov.peak_rss_bytes,
                reports,
                0,
                False,
                adm.reason,
            )
        with measured("train"):
            result = train_local(
                head,
                store,
                local_epochs=local_epochs,
                lr=lr,
                batch_size=batch_size,
                chunk_size=adm.work,
                clip_norm=profile.training.clip_norm,
                seed=profile.training.seed,
            )
        update = Update(
            round=1,
            base_version=head.version,
            device=profile.device.id,
            num_examples=result.num_examples,
            delta_W=result.delta_W,
            delta_b=result.delta_b,
            metrics=UpdateMetrics(result.loss, result.accuracy, result.train_s, gov.peak_rss_bytes),
            update_id=f"{profile.device.id}:1:{head.version}",
            compression=Compression(compression),
        )
        with measured("encode"):
            payload = encode_update(update)
        note = ""
        if broker is not None:
            note = _publish(broker, profile, payload, measured)
        # The coordinator's side (aggregate, encode the global head) is not the device's memory.
        new_W = (head.W + result.delta_W).astype(np.float32)
        new_b = (head.b + result.delta_b).astype(np.float32)
        gm_bytes = encode_global_model(GlobalModel(1, head.version + 1, backbone.sha256, new_W, new_b))
        del new_W, new_b
        limits = Limits(max_message_bytes=max(profile.broker.max_packet_bytes, 1 << 20))
        with measured("apply"):
            gm = decode_global_model(gm_bytes, limits=limits, expect_shape=head.shape)
            validate_head(gm.W, gm.b, head.shape)
            head = Head(gm.W, gm.b, gm.version)
            with open(state_dir / "global_head.npz", "wb") as f:
                np.savez(f, W=head.W, b=head.b, version=np.int64(head.version))
        completed = broker is None or note == ""
        return RoundReport(
            backbone.path.name,
            len(store),
            baseline,
            gov.cap_bytes,
            gov.peak_rss_bytes,
            reports,
            len(payload),
            completed,
            note,
        )


def _publish(
    url: str,
    profile: Profile,
    payload: bytes,
    measured: Callable[[str], contextlib.AbstractContextManager[None]],
) -> str:
    """Publish ``payload`` on ``update/<device>`` with QoS 1 inside phase ``publish``; '' or the error."""
    import asyncio

    from edgefl.errors import TransportError
    from edgefl.topics import Topics
    from edgefl.transport import MqttTransport
    from edgefl.validators import parse_broker_url

    _, host, port = parse_broker_url(url)
    topics = Topics(profile.broker.topic_prefix, profile.device.fleet)

    async def go() -> str:
        t = MqttTransport(host, port, f"edgefl-memreport-{profile.device.id}", protocol="3.1.1")
        try:
            await t.start(wait_s=10)
            with measured("publish"):
                await t.publish(topics.update(profile.device.id), payload, qos=1)
        except TransportError as exc:
            return f"publish failed: {exc}"
        finally:
            await t.stop()
        return ""

    return asyncio.run(go())


def format_report(rep: RoundReport) -> str:
    """The report as text: one row per phase, then its top allocation sites."""
    lines = [
        f"memory report: {rep.model}, {rep.samples} samples, cap {rep.cap_bytes / MIB:.1f} MiB, "
        f"RSS before the round {rep.baseline_rss_bytes / MIB:.1f} MiB, "
        f"round peak {rep.peak_rss_bytes / MIB:.1f} MiB"
        + ("" if rep.completed else f" (not completed: {rep.note})"),
        f"{'phase':<10} {'runs':>5} {'work':>5} {'RSS before':>11} {'RSS peak':>9} {'heap peak':>10}",
    ]
    for p in rep.phases.values():
        if p.runs == 0:
            lines.append(f"{p.phase:<10} {'-':>5}   {'deferred' if p.deferred else 'not run'}")
            continue
        heap = "-" if p.heap_peak_bytes is None else f"{p.heap_peak_bytes / MIB:.2f} MiB"
        lines.append(
            f"{p.phase:<10} {p.runs:>5} {p.work:>5} {p.rss_before_bytes / MIB:>7.1f} MiB "
            f"{p.peak_rss_bytes / MIB:>5.1f} MiB {heap:>10}"
        )
        for s in p.sites:
            lines.append(f"{'':<12}{s.size_bytes / 1024:>9.1f} KiB {s.count:>6} blocks  {s.where}")
    return "\n".join(lines)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``memory-report`` sub-command to an ``argparse`` sub-parsers object.

    Parameters
    ----------
    sub : argparse._SubParsersAction
        From ``ArgumentParser.add_subparsers``.

    Returns
    -------
    argparse.ArgumentParser
        The sub-command's parser (``func`` set to :func:`main`).
    """
    p: argparse.ArgumentParser = sub.add_parser(
        "memory-report", help="run one round in-process and print the peak memory of every phase"
    )
    p.add_argument("profile", help="TOML profile (see firmware_configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key")
    p.add_argument("--samples", type=int, default=512, help="samples classified before training")
    p.add_argument("--top", type=int, default=5, help="allocation sites per phase (default 5)")
    p.add_argument("--broker", default=None, help="mqtt://host:port to publish the update to")
    p.add_argument("--compression", default="none", help="update compression (none, float16, int8, ...)")
    p.add_argument("--no-tracemalloc", action="store_true", help="RSS only (no Python heap attribution)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Run ``edgefl memory-report``; exit code 0 when the round completed, 1 if not, 2 bad profile."""
    from edgefl.agent.config import load_profile
    from edgefl.errors import ConfigError

    overrides: dict[str, object] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"--set {item!r}: expected key=value", file=sys.stderr)
            return 2
        overrides[key.strip()] = value
    try:
        profile = load_profile(args.profile, overrides)
    except ConfigError as exc:
        print(f"edgefl: invalid profile {args.profile}:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rep = run_round(
        profile,
        samples=args.samples,
        trace=not args.no_tracemalloc,
        top=args.top,
        broker=args.broker,
        compression=args.compression,
    )
    print(format_report(rep))
    print(f"({time.perf_counter() - t0:.1f} s{', with tracemalloc' if not args.no_tracemalloc else ''})")
    if args.json:
        Path(args.json).write_text(json.dumps(rep.as_dict(), indent=2) + "\n")
    return 0 if rep.completed else 1
