"""Preprocessing unfused vs fused, and invoke alone, on the shipped models at batch 1 and 8.

The models: the four of ``models/README.md`` and the two raw-input int8 variants (``*_rawin``: the
normalisation folded into a uint8 input quantisation, so the fused step is a copy).

Each figure is a median of ``--repeats`` interleaved runs in this one process
(:func:`edgefl.agent.pipeline_measure.measure`): one batch of seeded random uint8 frames through the unfused
pipeline, the fused pipeline, then ``invoke`` alone with the input in place (the ceiling). End to end
= preprocess + invoke (``Pipeline.forward``); "run" figures add reading and dequantising the outputs
(``Pipeline.run``, the same code in both modes). Models run as the agent runs them: with XNNPACK
(their embedding is a model output, ``Backbone.delegated``).
Preprocessing = every stage before ``invoke``; its peak extra bytes are tracemalloc's peak for one
batch (numpy allocations), the page faults are the thread's minor faults for that batch.

The unfused cost depends heavily on the state of glibc's heap: batch-sized float32 temporaries above
the mmap threshold are fresh ``mmap`` pages every batch (page faults: "cold"), while after glibc has
raised its dynamic threshold they are reused heap memory ("warm"). Both are measured, with the
threshold pinned by ``mallopt(M_MMAP_THRESHOLD)`` (128 KiB: cold, as ``heap.apply_hygiene`` with a
fixed threshold leaves it; 64 MiB: warm).

Run: ``.venv/bin/python -m bench.pipeline`` (prints a markdown table; ``--json PATH``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from edgefl.agent.pipeline import Pipeline
from edgefl.agent.pipeline_measure import BatchMeasurement, decide, measure
from edgefl.runtime import Backbone

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "digits_cnn_float32": ((0.0,), (16.0,)),
    "digits_cnn_int8": ((0.0,), (16.0,)),
    "mobilenet_v2_035_96_float32": ((127.5,), (127.5,)),
    "mobilenet_v2_035_96_int8": ((127.5,), (127.5,)),
    # the raw-input models read raw as scale * (raw - zero point): digits 1/16, 0; MobileNet 1/127.5, 127
    "digits_cnn_int8_rawin": ((0.0,), (16.0,)),
    "mobilenet_v2_035_96_int8_rawin": ((127.0,), (127.5,)),
}
HEAPS = {"cold": 128 * 1024, "warm": 64 * 1024 * 1024}
_M_MMAP_THRESHOLD = -3


def pin_mmap_threshold(nbytes: int) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)`` (glibc); False where it is not available."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(lib.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):
        return False


def stage_ratio(r: BatchMeasurement) -> float:
    """Invoke-only / (fused preprocess + invoke) from per-stage medians (invoke pooled over both modes).

    The whole-run medians of the three configurations are taken from different runs, so a burst of
    load on a shared machine moves one ratio by more than the whole preprocessing; the per-stage
    medians (what :func:`edgefl.agent.pipeline_measure.decide` compares) are less noisy.
    """
    invoke = (r.stages_fused.get("invoke", 0.0) + r.stages_unfused.get("invoke", 0.0)) / 2.0
    return invoke / (r.preprocess_fused_s_per_sample + invoke)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--heaps", default="cold,warm")
    ap.add_argument("--json", default=None, metavar="PATH")
    a = ap.parse_args()
    batches = tuple(int(b) for b in a.batches.split(","))
    results = []
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")
    print(
        "| model | heap | batch | unfused /s | fused /s | invoke-only /s | fused/unfused | fused/invoke "
        "| preprocess unfused us/sample | fused us/sample | pre ratio | peak unfused B | peak fused B "
        "| faults unfused | step | stage-based fused/invoke | run fused/unfused | chosen |"
    )
    print("|" + "---|" * 18)
    for heap in a.heaps.split(","):
        pinned = pin_mmap_threshold(HEAPS[heap])
        for name in a.models.split(","):
            mean, std = MODELS[name]
            bb = Backbone(ROOT / "models" / f"{name}.tflite")
            step = Pipeline(bb, mean, std, mode="fused", batch=1).fused_step("uint8")
            rows = measure(bb, mean, std, batches=batches, raw_dtype="uint8", repeats=a.repeats)
            chosen = decide(rows)
            for r in rows:
                print(
                    f"| {name} | {heap} | {r.batch}{'' if bb.resizable else ' (x1)'} "
                    f"| {r.unfused_samples_per_s:.0f} | {r.fused_samples_per_s:.0f} "
                    f"| {r.invoke_only_samples_per_s:.0f} "
                    f"| {r.fused_samples_per_s / r.unfused_samples_per_s:.2f} "
                    f"| {r.fused_samples_per_s / r.invoke_only_samples_per_s:.2f} "
                    f"| {r.preprocess_unfused_s_per_sample * 1e6:.1f} "
                    f"| {r.preprocess_fused_s_per_sample * 1e6:.1f} "
                    f"| {r.preprocess_unfused_s_per_sample / r.preprocess_fused_s_per_sample:.1f} "
                    f"| {r.preprocess_unfused_peak_bytes:,} | {r.preprocess_fused_peak_bytes:,} "
                    f"| {r.preprocess_unfused_minor_faults:.0f} | {step} | {stage_ratio(r):.3f} "
                    f"| {r.fused_run_samples_per_s / r.unfused_run_samples_per_s:.2f} "
                    f"| {chosen[0]} {chosen[1]} |",
                    flush=True,
                )
            results.append(
                {
                    "model": name,
                    "heap": heap,
                    "mmap_threshold_pinned": pinned,
                    "resizable": bb.resizable,
                    "fused_step": step,
                    "stage_based_fused_over_invoke": [stage_ratio(r) for r in rows],
                    "chosen": {"mode": chosen[0], "batch": chosen[1]},
                    "batches": [asdict(r) for r in rows],
                }
            )
    if a.json:
        meta = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "repeats": a.repeats,
        }
        Path(a.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
