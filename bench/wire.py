"""Wire costs of one device round: compress once vs twice, and the signature check.

For a head delta of each size and layout, times (median CPU time of the process over ``--repeat``
interleaved runs: wall time on a shared, oversubscribed machine measures the scheduler) and traces
(tracemalloc peak) the two shipped ways to turn an error-feedback-corrected delta into Update bytes:

- *twice*: ``compressed_roundtrip`` of W and b (what the residual needs), then ``encode_update`` of the
  dense deltas, which compresses them again (the device's path before ``ErrorFeedback.compress``);
- *once*: ``compress_head_delta`` (wire form + decoded arrays), then ``encode_update(compressed=...)``.

Both give the same bytes (asserted). Then times ``sign_message`` and ``verify_payload`` of a signed
GlobalModel of the 1280 x 10 head (51 kB). No disk writes: the residual's fsync is not timed.

Run: ``.venv/bin/python -m bench.wire`` (prints markdown tables).
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from edgefl.wire.compression import Compression, compress_head_delta
from edgefl.wire.global_model import GlobalModel, encode_global_model
from edgefl.wire.rounds import Update, UpdateMetrics, encode_update
from edgefl.wire.signing import SigningKey, sign_message, verify_payload
from tests.support.wire import compressed_roundtrip

SHAPES = ((512, 10), (1280, 10))
MODES = (Compression.INT8, Compression.TOPK, Compression.TOPK_INT8)


def _peak(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def _ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def compression_table(repeat: int, topk_fraction: float) -> list[str]:
    rows = [
        "| head | layout | twice CPU ms | once CPU ms | twice peak KiB | once peak KiB | update bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        for mode in MODES:
            dW = rng.standard_normal(shape).astype(np.float32)
            db = rng.standard_normal(shape[1]).astype(np.float32)
            update = Update(1, 0, "dev-1", 100, dW, db, UpdateMetrics(0.5, 0.5, 0.1, 0), "dev-1:1:0", mode)

            def twice(u: Update = update, m: Compression = mode) -> bytes:
                compressed_roundtrip(u.delta_W, m, topk_fraction=topk_fraction)
                compressed_roundtrip(u.delta_b, m, topk_fraction=topk_fraction)
                return encode_update(u, topk_fraction=topk_fraction)

            def once(u: Update = update, m: Compression = mode) -> bytes:
                packed = compress_head_delta(u.delta_W, u.delta_b, m, topk_fraction=topk_fraction)
                return encode_update(u, compressed=packed)

            payload = once()
            if twice() != payload:
                raise AssertionError(f"{shape} {mode}: the two paths disagree")
            t_twice, t_once = [], []
            for _ in range(repeat):  # interleaved: load on a shared machine hits both alike
                t0 = time.process_time()
                twice()
                t1 = time.process_time()
                once()
                t2 = time.process_time()
                t_twice.append(t1 - t0)
                t_once.append(t2 - t1)
            rows.append(
                f"| {shape[0]} x {shape[1]} | {mode.value} | {_ms(t_twice):.2f} | {_ms(t_once):.2f} "
                f"| {_peak(twice) / 1024:.0f} | {_peak(once) / 1024:.0f} | {len(payload)} |"
            )
    return rows


def signature_table(repeat: int) -> list[str]:
    key = SigningKey(bytes(range(32)))
    rng = np.random.default_rng(1)
    head = GlobalModel(
        1, 2, "ab" * 32, rng.standard_normal((1280, 10)).astype(np.float32), np.zeros(10, np.float32)
    )
    payload = sign_message(encode_global_model, head, key, fleet="bench")
    vk = key.verify_key
    verify_payload(payload, vk, fleet="bench", kind="global_model")  # imports the backend
    t_sign, t_verify = [], []
    for _ in range(repeat):
        t0 = time.process_time()
        sign_message(encode_global_model, head, key, fleet="bench")
        t1 = time.process_time()
        verify_payload(payload, vk, fleet="bench", kind="global_model")
        t2 = time.process_time()
        t_sign.append(t1 - t0)
        t_verify.append(t2 - t1)
    return [
        "| message | bytes | encode + sign CPU ms | verify CPU ms |",
        "|---|---|---|---|",
        f"| signed GlobalModel 1280 x 10 | {len(payload)} | {_ms(t_sign):.2f} | {_ms(t_verify):.2f} |",
    ]


def main() -> None:
    """Print the two tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--topk-fraction", type=float, default=0.1)
    args = p.parse_args()
    print("\n".join(compression_table(args.repeat, args.topk_fraction)))
    print()
    print("\n".join(signature_table(args.repeat)))


if __name__ == "__main__":
    main()
