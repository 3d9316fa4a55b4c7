"""Preprocessing unfused vs fused, and invoke alone, on the four shipped models at batch 1 and 8.

Each figure is a median of ``--repeats`` interleaved runs in this one process
(:func:`agent.pipeline.measure`): one batch of seeded random uint8 frames through the unfused
pipeline, the fused pipeline, then ``invoke`` alone with the input in place (the ceiling).
Preprocessing = every stage before ``invoke``; its peak extra bytes are tracemalloc's peak for one
batch (numpy allocations), the page faults are the thread's minor faults for that batch.

The unfused cost depends heavily on the state of glibc's heap: batch-sized float32 temporaries above
the mmap threshold are fresh ``mmap`` pages every batch (page faults: "cold"), while after glibc has
raised its dynamic threshold they are reused heap memory ("warm"). Both are measured, with the
threshold pinned by ``mallopt(M_MMAP_THRESHOLD)`` (128 KiB: cold, as ``memory.apply_hygiene`` with a
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

from agent.pipeline import decide, measure
from agent.runtime import Backbone

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "digits_cnn_float32": ((0.0,), (16.0,)),
    "digits_cnn_int8": ((0.0,), (16.0,)),
    "mobilenet_v2_035_96_float32": ((127.5,), (127.5,)),
    "mobilenet_v2_035_96_int8": ((127.5,), (127.5,)),
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
    print(
        "| model | heap | batch | unfused /s | fused /s | invoke-only /s | fused/unfused | fused/invoke "
        "| preprocess unfused us/sample | fused us/sample | pre ratio | peak unfused B | peak fused B "
        "| faults unfused | chosen |"
    )
    print("|" + "---|" * 15)
    for heap in a.heaps.split(","):
        pinned = pin_mmap_threshold(HEAPS[heap])
        for name in a.models.split(","):
            mean, std = MODELS[name]
            bb = Backbone(ROOT / "models" / f"{name}.tflite")
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
                    f"| {r.preprocess_unfused_minor_faults:.0f} | {chosen[0]} {chosen[1]} |",
                    flush=True,
                )
            results.append(
                {
                    "model": name,
                    "heap": heap,
                    "mmap_threshold_pinned": pinned,
                    "resizable": bb.resizable,
                    "chosen": {"mode": chosen[0], "batch": chosen[1]},
                    "batches": [asdict(r) for r in rows],
                }
            )
    if a.json:
        meta = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
        Path(a.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
