"""``edgefl profile MODEL``: time every preprocessing stage both ways, per batch size, and pick one.

Prints the measurements of :func:`~edgefl.agent.pipeline_measure.measure` as a table, the choice of
:func:`~edgefl.agent.pipeline_measure.decide` (the rule ``pipeline.mode = "auto"`` uses) and the
per-stage times of the chosen batch; ``--json PATH`` writes the figures: ``{"model": file name,
"chosen": {"mode", "batch"}, "batches": [every field of a BatchMeasurement, per batch size],
"model_info": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from edgefl.agent.pipeline import DEFAULT_MARGIN, KERNEL_TRIALS, Pipeline
from edgefl.agent.pipeline_measure import BatchMeasurement, decide, measure
from edgefl.errors import ModelError
from edgefl.records import atomic_write
from edgefl.runtime import Backbone
from edgefl.validators import MAX_BATCH, MAX_THREADS

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_MODEL = 3


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers") from exc


def _bounded_int(low: int, high: int) -> Any:
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from exc
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value}: must be in {low}..{high}")
        return value

    return parse


def _batches(text: str) -> tuple[int, ...]:
    """Comma-separated batch sizes, each in ``1..MAX_BATCH``."""
    return tuple(_bounded_int(1, MAX_BATCH)(v) for v in text.split(","))


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from exc
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number >= 0")
    return value


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``profile`` sub-command to ``sub`` (``add_subparsers``); its ``func`` is :func:`main`."""
    p: argparse.ArgumentParser = sub.add_parser(
        "profile",
        help="time preprocessing unfused vs fused per batch size and pick the fastest",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("model", help="the .tflite model")
    p.add_argument(
        "--input-dtype",
        default="uint8",
        choices=("uint8", "int8", "int16", "float32"),
        help="dtype of the raw samples fed to the pipeline (default uint8)",
    )
    p.add_argument(
        "--batch",
        type=_batches,
        default=(1, 4, 8, 16),
        help=f"batch sizes, 1..{MAX_BATCH} (default 1,4,8,16)",
    )
    p.add_argument(
        "--mean",
        type=_floats,
        default=(0.0,),
        help="per-channel mean of model input = (raw - mean) / std, as the profile's pipeline.mean "
        "(default 0; digits models 0, MobileNet 127.5, MobileNet raw-input 127)",
    )
    p.add_argument(
        "--std",
        type=_floats,
        default=(1.0,),
        help="per-channel std (default 1; digits models 16, MobileNet 127.5)",
    )
    p.add_argument(
        "--repeats", type=_bounded_int(1, 1000), default=15, help="timed runs per configuration (default 15)"
    )
    p.add_argument(
        "--threads", type=_bounded_int(1, MAX_THREADS), default=1, help="interpreter threads (default 1)"
    )
    p.add_argument(
        "--margin",
        type=_margin,
        default=DEFAULT_MARGIN,
        help="fraction by which fused must beat unfused on the stages that differ to be chosen "
        f"(noise guard, default {DEFAULT_MARGIN})",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=main)
    return p


def format_table(rows: list[BatchMeasurement]) -> str:
    """A fixed-width table of the measurements (one line per batch size)."""
    head = (
        f"{'batch':>5} {'unfused/s':>10} {'fused/s':>10} {'invoke/s':>10} {'fused/unf':>9} "
        f"{'fused/inv':>9} {'pre unf us':>10} {'pre fus us':>10} {'pre x':>6} {'peak unf B':>11} "
        f"{'peak fus B':>11} {'faults unf':>10} {'run unf/s':>9} {'run fus/s':>9}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.batch:>5} {r.unfused_samples_per_s:>10.1f} {r.fused_samples_per_s:>10.1f} "
            f"{r.invoke_only_samples_per_s:>10.1f} "
            f"{r.fused_samples_per_s / r.unfused_samples_per_s:>9.2f} "
            f"{r.fused_samples_per_s / r.invoke_only_samples_per_s:>9.2f} "
            f"{r.preprocess_unfused_s_per_sample * 1e6:>10.1f} "
            f"{r.preprocess_fused_s_per_sample * 1e6:>10.1f} "
            f"{r.preprocess_unfused_s_per_sample / max(r.preprocess_fused_s_per_sample, 1e-12):>6.1f} "
            f"{r.preprocess_unfused_peak_bytes:>11,} {r.preprocess_fused_peak_bytes:>11,} "
            f"{r.preprocess_unfused_minor_faults:>10.0f} "
            f"{r.unfused_run_samples_per_s:>9.1f} {r.fused_run_samples_per_s:>9.1f}"
        )
    return "\n".join([*lines, *LEGEND])


#: What each column of :func:`format_table` means (printed under the table).
LEGEND = (
    "  unfused/s, fused/s: samples/s end to end (preprocess + invoke); invoke/s: invoke alone with the",
    "    input already in place (the ceiling). fused/unf, fused/inv: their ratios (higher is better).",
    "  pre unf/fus us: microseconds per sample of everything before invoke; pre x: unfused / fused.",
    "  peak unf/fus B: peak extra bytes of numpy arrays while preprocessing one batch (tracemalloc).",
    "  faults unf: minor page faults per batch of unfused preprocessing (fresh pages for temporaries).",
    "  run unf/fus: samples/s of Pipeline.run, which also reads and dequantises the outputs.",
    "  fused step: copy (raw frames are the model input), table (a lookup of every raw value) or",
    "    in_place (the normalisation written straight into the tensor). Stages: unfused = cast,",
    "    normalise, quantise (a no-op cast for float32 models), set_tensor; fused = fill; both invoke",
    "    and read (dequantise embedding and logits). fused/inv can exceed 1.00 by noise between runs.",
)


def format_stages(r: BatchMeasurement) -> str:
    """Per-stage medians (us per sample) of one batch size, unfused then fused."""
    out = [f"stages at batch {r.batch} (median us per sample):"]
    for mode, stages in (("unfused", r.stages_unfused), ("fused", r.stages_fused)):
        out.append(f"  {mode:>7}: " + "  ".join(f"{k} {v * 1e6:.1f}" for k, v in stages.items()))
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    """Run ``edgefl profile``; returns the exit code (0 ok, 2 bad arguments, 3 model error)."""
    if args.json:
        target = Path(args.json)
        if target.is_dir() or not target.parent.is_dir():
            print(f"edgefl profile: --json {args.json}: not a writable file path (missing directory?)")
            return EXIT_USAGE
    try:
        bb = Backbone(Path(args.model), num_threads=args.threads)
        fused = Pipeline(bb, args.mean, args.std, mode="fused", batch=1)
    except ModelError as exc:
        print(f"edgefl profile: model error: {exc}")
        return EXIT_MODEL
    except ValueError as exc:
        print(f"edgefl profile: {exc}")
        return EXIT_USAGE
    q = bb.input_quant
    print(
        f"{bb.path.name}: input {bb.input_dtype} [N, {', '.join(map(str, bb.sample_shape))}]"
        + (f" scale {q.scale:.9g} zero point {q.zero_point}" if q.scale else "")
        + f"; batch {'resizable' if bb.resizable else f'fixed at {bb.input_shape[0]}'}"
        + f"; {'XNNPACK' if bb.delegated else 'built-in kernels'}; embedding D = {bb.embedding_dim}"
        + f"; raw {args.input_dtype}, fused step: {fused.fused_step(args.input_dtype)}"
    )
    rows = measure(
        bb, args.mean, args.std, batches=args.batch, raw_dtype=args.input_dtype, repeats=args.repeats
    )
    chosen = decide(rows, margin=args.margin)
    print(format_table(rows))
    best = next(r for r in rows if r.batch == chosen[1])
    print(format_stages(best))
    for dtype, kernels in fused.kernel_seconds.items():
        timed = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in kernels.items())
        print(f"fused step for raw {dtype}, one sample, best of {KERNEL_TRIALS} trials: {timed}")
    print(
        f"chosen: {chosen[0]}, batch {chosen[1]} (medians of {args.repeats} interleaved runs in one "
        "process; compare figures of one run only)"
    )
    if args.json:
        doc = {
            "model": bb.path.name,
            "chosen": {"mode": chosen[0], "batch": chosen[1]},
            "batches": [asdict(r) for r in rows],
            "model_info": {
                "input_dtype": str(bb.input_dtype),
                "embedding_dim": bb.embedding_dim,
                "xnnpack": bb.delegated,
                "fused_step": fused.fused_step(args.input_dtype),
                "fused_kernel_seconds_per_sample": fused.kernel_seconds,
            },
        }
        try:
            atomic_write(Path(args.json), (json.dumps(doc, indent=2) + "\n").encode())
        except OSError as exc:
            print(f"edgefl profile: cannot write --json {args.json}: {exc}")
            return EXIT_USAGE
    return EXIT_OK
