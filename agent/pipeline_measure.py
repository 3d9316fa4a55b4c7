"""Measure the unfused and fused pipeline per batch size on one model, and pick the fastest (mode, batch)."""

from __future__ import annotations

import resource
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgefl.agent.pipeline import DEFAULT_MARGIN, MODES, PREPROCESS_STAGES, Mode, Pipeline, random_raw
from edgefl.runtime import Backbone


@dataclass(frozen=True, slots=True)
class BatchMeasurement:
    """Medians for one batch size (throughput in samples/s, times in s per sample, peaks in bytes).

    ``*_samples_per_s``: end to end (:meth:`Pipeline.forward`), invoke alone (the ceiling), and
    ``*_run_*`` :meth:`Pipeline.run` (plus reading the outputs). ``preprocess_*``: everything before
    ``invoke``; its peak is the extra bytes numpy allocates (tracemalloc) for one batch, the fused
    one's scratch included (lookup tables not); its minor page faults per batch. ``stages_*``:
    median seconds per sample of every stage.
    """

    batch: int
    unfused_samples_per_s: float
    fused_samples_per_s: float
    invoke_only_samples_per_s: float
    preprocess_unfused_s_per_sample: float
    preprocess_fused_s_per_sample: float
    preprocess_unfused_peak_bytes: int
    preprocess_fused_peak_bytes: int
    preprocess_unfused_minor_faults: float
    preprocess_fused_minor_faults: float
    stages_unfused: dict[str, float]
    stages_fused: dict[str, float]
    unfused_run_samples_per_s: float = 0.0
    fused_run_samples_per_s: float = 0.0


def _minor_faults() -> int:
    return int(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)


def _peak_bytes(pipe: Pipeline, rows: np.ndarray) -> tuple[int, int]:
    """(tracemalloc peak extra bytes, minor page faults) of ``prepare(rows)`` after a warm call."""
    pipe.prepare(rows)
    scratch = 0 if pipe._scratch is None else int(pipe._scratch.nbytes)
    was = tracemalloc.is_tracing()
    if not was:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    f0 = _minor_faults()
    pipe.prepare(rows)
    faults = _minor_faults() - f0
    peak = tracemalloc.get_traced_memory()[1] - base
    if not was:
        tracemalloc.stop()
    return peak + scratch, faults


def _stage_medians(samples: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in (*PREPROCESS_STAGES, "invoke", "read") if any(k in s for s in samples)]
    return {k: float(np.median([s.get(k, 0.0) for s in samples])) for k in keys}


def measure(
    backbone: Backbone,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    *,
    batches: Sequence[int] = (1, 4, 8, 16),
    raw_dtype: np.dtype[Any] | str = "uint8",
    repeats: int = 9,
    seed: int = 0,
) -> list[BatchMeasurement]:
    """Time unfused, fused and invoke-only per batch size (``batches``, each >= 1), interleaved.

    Each of ``repeats`` (>= 1, after 2 warm-ups) runs one batch of seeded random ``raw_dtype``
    samples through both pipelines and ``invoke`` alone, so a burst of load hits all three alike.
    Returns one :class:`BatchMeasurement` (medians) per batch size, in order. ``ValueError`` if a
    batch size or ``repeats`` is < 1 or mean/std do not fit the model; ``InterpreterBusy`` as ``run``.
    """
    if repeats < 1 or not batches or min(batches) < 1:
        raise ValueError(f"repeats {repeats} and batches {tuple(batches)} must be >= 1")
    out: list[BatchMeasurement] = []
    for b in batches:
        pipes = {m: Pipeline(backbone, mean, std, mode=m, batch=b) for m in MODES}
        raw = random_raw((b, *backbone.sample_shape), raw_dtype, seed)
        times: dict[str, list[float]] = {
            k: [] for k in ("unfused", "fused", "invoke", "unfused_run", "fused_run")
        }
        stages: dict[str, list[dict[str, float]]] = {"unfused": [], "fused": []}
        pre: dict[str, list[float]] = {"unfused": [], "fused": []}
        invokes = -(-b // pipes["fused"].tensor_batch)
        for r in range(repeats + 2):
            for mode in ("unfused", "fused"):
                p = pipes[mode]
                p.reset_counters()
                t0 = time.perf_counter()
                p.run(raw)
                dt = time.perf_counter() - t0
                c = p.counters()["stages"]  # of the run alone
                t0 = time.perf_counter()
                p.forward(raw)  # the same preprocessing and invoke, without the read
                forward_s = time.perf_counter() - t0
                if r >= 2:
                    times[mode + "_run"].append(dt)
                    times[mode].append(forward_s)
                    stages[mode].append({k: v["s_per_sample"] for k, v in c.items()})
                    pre[mode].append(sum(v["total_s"] for k, v in c.items() if k in PREPROCESS_STAGES) / b)
            t0 = time.perf_counter()
            pipes["fused"].invoke_only(invokes)
            if r >= 2:
                times["invoke"].append(time.perf_counter() - t0)
        rows = raw[: pipes["fused"].tensor_batch]
        peak_u, faults_u = _peak_bytes(pipes["unfused"], rows)
        peak_f, faults_f = _peak_bytes(pipes["fused"], rows)
        per_invoke = len(rows)
        out.append(
            BatchMeasurement(
                batch=b,
                unfused_samples_per_s=b / float(np.median(times["unfused"])),
                fused_samples_per_s=b / float(np.median(times["fused"])),
                invoke_only_samples_per_s=b / float(np.median(times["invoke"])),
                preprocess_unfused_s_per_sample=float(np.median(pre["unfused"])),
                preprocess_fused_s_per_sample=float(np.median(pre["fused"])),
                preprocess_unfused_peak_bytes=peak_u,
                preprocess_fused_peak_bytes=peak_f,
                preprocess_unfused_minor_faults=faults_u * b / per_invoke,
                preprocess_fused_minor_faults=faults_f * b / per_invoke,
                stages_unfused=_stage_medians(stages["unfused"]),
                stages_fused=_stage_medians(stages["fused"]),
                unfused_run_samples_per_s=b / float(np.median(times["unfused_run"])),
                fused_run_samples_per_s=b / float(np.median(times["fused_run"])),
            )
        )
    return out


def decide(rows: Sequence[BatchMeasurement], *, margin: float = DEFAULT_MARGIN) -> tuple[Mode, int]:
    """The fastest (mode, batch) of ``rows``; ``ValueError`` if there are none.

    ``invoke`` jitters by more than a large model's preprocessing, so a configuration costs its
    differing stages (preprocess and read) plus the invoke time pooled over both modes; fused counts
    only where its differing stages take under ``1 / (1 + margin)`` of the unfused ones.
    """
    if not rows:
        raise ValueError("decide: no measurements")
    best: tuple[float, Mode, int] | None = None
    for r in rows:
        if "invoke" in r.stages_fused and "invoke" in r.stages_unfused:
            invoke_s = (r.stages_fused["invoke"] + r.stages_unfused["invoke"]) / 2.0
        else:
            invoke_s = 1.0 / r.invoke_only_samples_per_s
        # the stages that differ between the modes: preprocessing and the read
        fused_s = r.preprocess_fused_s_per_sample + r.stages_fused.get("read", 0.0)
        unfused_s = r.preprocess_unfused_s_per_sample + r.stages_unfused.get("read", 0.0)
        cand: tuple[float, Mode, int] = (
            (fused_s + invoke_s, "fused", r.batch)
            if fused_s * (1.0 + margin) < unfused_s
            else (unfused_s + invoke_s, "unfused", r.batch)
        )
        if best is None or cand[0] < best[0]:
            best = cand
    assert best is not None
    return best[1], best[2]
