"""``edgefl memory-report PROFILE``: one full round in-process, with the peak memory of every phase.

The round is the device core the daemon runs (:class:`edgefl.agent.core.DeviceCore`), without the
daemon around it (:func:`run_round`). Beside each phase's RSS peak the report prints, unless disabled,
the peak of the Python heap and its top allocation sites (:mod:`tracemalloc`); the difference between
the two columns is what the interpreter allocates in C++ (its tensor arena).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.agent.config import Profile
from edgefl.agent.governor import PHASES, Governor
from edgefl.agent.memstat import MIB, rss_bytes
from edgefl.datasets import load_xy
from edgefl.errors import BudgetExceeded
from edgefl.profiles import add_set_argument, parse_sets, print_problems

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Site:
    """One allocation site of the Python heap at (near) a phase's peak: ``file:line``, bytes, blocks."""

    where: str
    size_bytes: int
    count: int


@dataclass
class PhaseReport:
    """Memory of one phase in a round, in bytes.

    ``runs`` how many times the phase ran (``inference`` once per batch); ``peak_rss_bytes`` its
    largest peak RSS (kernel ``VmHWM`` after a reset); ``rss_before_bytes`` RSS just before its first
    run; ``heap_peak_bytes`` peak of the Python heap above its level at the phase start
    (tracemalloc), with the top allocation ``sites`` near it; ``work`` the work size the governor
    granted (batch, chunk) at the last run, 0 where not admitted.
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


class _HeapWatch:
    """Peak of the Python heap in a block, with a snapshot taken whenever it is 5 % above the best seen."""

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


def _load_samples(
    profile: Profile, gov: Governor, sample_shape: tuple[int, ...], classes: int, n: int
) -> tuple[Any, Any]:
    src = profile.source
    if src.kind == "replay" and src.path is not None:
        adm = gov.admit_replay(src.path)  # before it is loaded, as the daemon's replay
        if adm.deferred:
            need = adm.estimate_bytes
            logger.warning("replay samples %s over budget (%d bytes): random samples", src.path, need)
            return _synthetic(sample_shape, n, classes, profile.training.seed)
        x, y = load_xy(src.path)
        if tuple(x.shape[1:]) == sample_shape:
            return x[:n], y[:n]
        logger.warning("replay samples %s do not fit the model %s: random samples", x.shape[1:], sample_shape)
    return _synthetic(sample_shape, n, classes, profile.training.seed)


def run_round(
    profile: Profile,
    *,
    samples: int = 512,
    governor: Governor | None = None,
    trace: bool = True,
    top: int = 5,
    broker: str | None = None,
    state_dir: Path | None = None,
    compression: str = "none",
) -> RoundReport:
    """Run one full round of the device core in this process and measure each phase.

    ``samples`` classified into the store (phase ``inference``), a RoundAnnouncement answered
    (``train``, ``encode``; 2 local epochs at lr 0.1, batches of 16, ``compression`` an
    ``edgefl.wire.compression.Compression`` value), the update published to ``broker``
    (``mqtt://host:port``, QoS 1; None skips ``publish``), and a GlobalModel applied (``apply``), each
    through :class:`edgefl.agent.core.DeviceCore` built from the ``profile`` (model, batch, chunk
    size, keys, cap) in ``state_dir`` (default a temporary folder); ``governor`` default: one from
    ``profile.memory``. ``trace`` runs :mod:`tracemalloc` (heap peaks and ``top`` sites per phase;
    costs time and some memory).
    """
    from edgefl.agent.core import ApplyStatus, DeviceCore
    from edgefl.agent.round import RoundStatus
    from edgefl.wire.compression import Compression
    from edgefl.wire.global_model import GlobalModel, encode_global_model
    from edgefl.wire.rounds import RoundAnnouncement, encode_round

    baseline = governor.rss_bytes() if governor is not None else rss_bytes()
    reports: dict[str, PhaseReport] = {p: PhaseReport(p) for p in PHASES}
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
        with gov.phase(name), watch.watch() if watch is not None else contextlib.nullcontext():
            yield
        rep.runs += 1
        rep.peak_rss_bytes = max(rep.peak_rss_bytes, gov.phase_last[name])
        admission = gov.admissions.get(name)
        if admission is not None:
            rep.work = admission.work
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
        core = DeviceCore.open(
            profile,
            governor=governor,
            state_dir=state_dir,
            store_capacity=max(profile.training.store_capacity, samples),
            phase=measured,
            pipeline_mode="unfused" if profile.pipeline.mode == "unfused" else "fused",
        )
        assert core.pipeline is not None and core.shapes is not None
        gov = core.governor  # the one each phase is measured by (``measured``)
        model_name = core.pipeline.backbone.path.name
        x, y = _load_samples(profile, gov, core.pipeline.backbone.sample_shape, core.shapes.classes, samples)
        batch = core.pipeline.batch

        def report(size: int, note: str) -> RoundReport:
            n, peak = len(core.store), gov.peak_rss_bytes
            return RoundReport(model_name, n, baseline, gov.cap_bytes, peak, reports, size, not note, note)

        try:
            for start_i in range(0, len(x), batch):
                core.observe(x[start_i : start_i + batch], y[start_i : start_i + batch])
        except BudgetExceeded as exc:  # the governor ran no inference it judged over budget
            return report(0, f"inference not run: {exc}")
        core.flush()

        # the coordinator's side (announce, aggregate, encode the global head) is not the device's memory
        round_no = core.answered.round + 1 if core.answered is not None else 1
        ann = RoundAnnouncement(
            round=round_no,
            base_version=core.head.version,
            deadline_s=600.0,
            local_epochs=2,
            lr=0.1,
            batch_size=16,
            min_clients=1,
            selected=1.0,
            compression=Compression(compression),
        )
        result = core.receive_round(encode_round(ann))
        if result.status != RoundStatus.TRAINED or result.entry is None or result.local is None:
            reports["train"].deferred = result.status == RoundStatus.DEFERRED
            admission = gov.admissions.get("train")
            reports["train"].work = admission.work if admission is not None else 0
            return report(0, f"round {result.status}: {result.reason} {result.detail}".strip())
        entry, local, update_bytes = result.entry, result.local, result.update_bytes
        note = ""
        if broker is not None:
            note = _publish(broker, profile, entry.payload, measured)
            if not note:
                core.acknowledged(entry.update_id)
        head = core.head
        gm_bytes = encode_global_model(
            GlobalModel(
                round_no,
                head.version + 1,
                core.model_sha256,
                (head.W + local.delta_W).astype(np.float32),
                (head.b + local.delta_b).astype(np.float32),
            )
        )
        del entry, local, result
        applied = core.receive_global(gm_bytes)
        core.flush()  # the writes left behind, as the daemon makes them once idle
        if applied.status != ApplyStatus.APPLIED and not note:
            note = f"global head {applied.status}: {applied.reason} {applied.detail}".strip()
        return report(update_bytes, note)


def _publish(
    url: str,
    profile: Profile,
    payload: bytes,
    measured: Callable[[str], contextlib.AbstractContextManager[None]],
) -> str:
    """Publish ``payload`` on ``update/<device>`` (QoS 1, chunked) in phase ``publish``; '' or the error."""
    import asyncio

    from edgefl.errors import TransportError
    from edgefl.topics import Topics
    from edgefl.transport import MqttTransport
    from edgefl.validators import parse_broker_url
    from edgefl.wire.chunking import split_message

    _, host, port = parse_broker_url(url)
    topic = Topics(profile.broker.topic_prefix, profile.device.fleet).update(profile.device.id)

    async def go() -> str:
        t = MqttTransport(
            host,
            port,
            f"edgefl-memreport-{profile.device.id}",
            protocol="3.1.1",
            max_packet_bytes=profile.broker.max_packet_bytes,
        )
        try:
            await t.start(wait_s=10)
            with measured("publish"):
                for part in split_message(payload, topic, t.packet_limit(), msg_id="memreport"):
                    await t.publish(topic, part, qos=1)
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
    """Add the ``memory-report`` sub-command to ``sub`` (``add_subparsers``); its ``func`` is :func:`main`."""
    p: argparse.ArgumentParser = sub.add_parser(
        "memory-report", help="run one round in-process and print the peak memory of every phase"
    )
    p.add_argument("profile", help="TOML profile (see firmware_configs/)")
    add_set_argument(p, "memory.cap_mb=64")
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

    try:
        profile = load_profile(args.profile, parse_sets(args.set))
    except ConfigError as exc:
        print_problems(f"edgefl: invalid profile {args.profile}", exc.problems)
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
        Path(args.json).write_text(json.dumps(asdict(rep), indent=2) + "\n")
    return 0 if rep.completed else 1
