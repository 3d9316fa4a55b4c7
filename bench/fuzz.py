"""Fuzz the network-facing decoders, the chunk reassembler, signature checks and state records.

Every target takes attacker-controlled bytes; the only acceptable outcomes are a value or the
module's own rejection (``DecodeError``, ``RecordError``). Anything else is a **crash**; a single call
longer than ``--hang-s`` (interrupted by ``SIGALRM``) is a **hang**. Inputs are random bytes and
mutations of valid messages: bit flips, interesting bytes, CBOR length headers set to huge values,
insertions, deletions, truncations, splices, and structured mutations (a random value inside the
decoded CBOR tree replaced by another type, a huge or negative integer, NaN, a long string, deep
nesting) re-encoded with cbor2.

Run: ``.venv/bin/python -m bench.fuzz --seconds 600`` (prints a table; exit status 1 on any crash or
hang; crashing inputs are written to ``--out``). ``--atheris TARGET`` runs coverage-guided fuzzing
of one target with atheris (libFuzzer) instead, for ``--runs`` inputs.

Source: the mutation set follows AFL's deterministic stages (bit flips, interesting values,
havoc) in spirit; atheris: https://github.com/google/atheris.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import cbor2
import numpy as np

from edgefl.errors import DecodeError
from edgefl.records import RecordError, decode_record, encode_record
from edgefl.wire.chunking import Reassembler, decode_chunk, split_message
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import GlobalModel, decode_global_model, encode_global_model
from edgefl.wire.rounds import (
    RoundAnnouncement,
    Update,
    UpdateMetrics,
    decode_round,
    decode_update,
    encode_round,
    encode_update,
)
from edgefl.wire.signing import SigningKey, sign_message, verify_payload
from edgefl.wire.status import DeviceStatus, decode_status, encode_status

SHAPE = (16, 4)
KEY = SigningKey(bytes(range(32)))
EXPECTED: tuple[type[BaseException], ...] = (DecodeError, RecordError)


class Hang(Exception):
    """Raised by SIGALRM inside a call that ran longer than the hang budget."""


@dataclasses.dataclass
class Stats:
    runs: int = 0
    accepted: int = 0
    crashes: int = 0
    hangs: int = 0
    stalls: int = 0
    max_s: float = 0.0
    slowest: bytes = b""
    reasons: Counter[str] = dataclasses.field(default_factory=Counter)


# ---------------------------------------------------------------------------------------------------
# Seeds and targets


def seeds() -> list[bytes]:
    """Valid messages of every kind (and some chunk sets and records)."""
    rng = np.random.default_rng(0)
    W = rng.standard_normal(SHAPE).astype(np.float32)
    b = rng.standard_normal(SHAPE[1]).astype(np.float32)
    out = [
        encode_global_model(GlobalModel(1, 2, "ab" * 32, W, b)),
        sign_message(encode_global_model, GlobalModel(1, 2, "ab" * 32, W, b), KEY, fleet="f"),
        encode_round(RoundAnnouncement(3, 2, 30.0, 2, 0.1, 16, 2, ("dev-1", "dev-2"))),
        encode_round(RoundAnnouncement(3, 2, 30.0, 2, 0.1, 16, 2, 0.5, Compression.TOPK, 0.25, 0.01)),
        encode_status(DeviceStatus("dev-1", "online", {"round": 3, "reasons": ["a"], "rss": 1.5})),
    ]
    for mode in Compression:
        u = Update(3, 2, "dev-1", 10, W, b, UpdateMetrics(0.5, 0.9, 0.01, 1000), "dev-1:3:2", mode)
        out.append(encode_update(u, rng=np.random.default_rng(1), topk_fraction=0.25))
    out.append(sign_message(encode_update, u, KEY, fleet="f"))
    out.extend(split_message(out[0], "edgefl/f/global", 200, msg_id="g-2"))
    out.append(encode_record(out[2], 5))
    # deflated top-k masks: 4 kept, clustered at the start (a few bytes of deflate), and a larger
    # head whose int8 levels and mask both travel deflated
    clustered = np.zeros(SHAPE, np.float32)
    clustered.flat[:4] = [4.0, -3.0, 2.0, 1.5]
    metrics = UpdateMetrics(0.5, 0.9, 0.01, 1000)
    u = Update(3, 2, "dev-1", 10, clustered, b, metrics, "dev-1:3:3", Compression.TOPK)
    out.append(encode_update(u, topk_fraction=0.0625))
    wide = rng.standard_normal((64, 8)).astype(np.float32)
    u = Update(3, 2, "dev-1", 10, wide, wide[0], metrics, "dev-1:3:4", Compression.TOPK_INT8)
    out.append(encode_update(u, topk_fraction=0.1))
    return out


def _reassembler_target() -> Callable[[bytes], object]:
    clock = [0.0]
    r = Reassembler(
        max_sets=3,
        max_total_bytes=8192,
        max_message_bytes=4096,
        max_chunk_bytes=1024,
        expiry_s=5.0,
        clock=lambda: clock[0],
    )

    def feed(data: bytes) -> object:
        clock[0] += 0.25
        out = r.feed("edgefl/f/global", data)
        if len(r) > r.max_sets or r.reserved_bytes > r.max_total_bytes:
            raise AssertionError(f"reassembler bound broken: {len(r)} sets, {r.reserved_bytes} bytes")
        if out is not None:
            decode_global_model(out, expect_shape=SHAPE)  # a whole message goes on to the decoder
        return out

    return feed


def targets() -> dict[str, Callable[[bytes], object]]:
    """Name -> function of the attacker's bytes."""
    return {
        "global_model": lambda d: decode_global_model(d, expect_shape=SHAPE),
        "round": decode_round,
        "update": lambda d: decode_update(d, expect_shape=SHAPE),
        "update_any_shape": decode_update,
        "status": decode_status,
        "chunk": lambda d: decode_chunk(d, max_chunk_bytes=4096, max_message_bytes=1 << 16),
        "reassembler": _reassembler_target(),
        "signature": lambda d: verify_payload(d, KEY.verify_key, fleet="f", kind="global_model"),
        "record": decode_record,
    }


# ---------------------------------------------------------------------------------------------------
# Mutations

INTERESTING = [
    0x00,
    0x01,
    0x17,
    0x18,
    0x19,
    0x1A,
    0x1B,
    0x1F,
    0x3F,
    0x5B,
    0x7B,
    0x80,
    0x9B,
    0x9F,
    0xBB,
    0xBF,
    0xC0,
    0xD8,
    0xD9,
    0xF4,
    0xF5,
    0xF6,
    0xF7,
    0xF9,
    0xFA,
    0xFB,
    0xFF,
]


def _random_value(rnd: random.Random, depth: int = 0) -> Any:
    kind = rnd.randrange(12)
    if kind == 0:
        return rnd.choice([0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**64), 10**30])
    if kind == 1:
        return rnd.choice([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, 5e-324, 65504.0, 1e39])
    if kind == 2:
        return "x" * rnd.choice([0, 1, 64, 255, 256, 1000])
    if kind == 3:
        return bytes(rnd.getrandbits(8) for _ in range(rnd.choice([0, 1, 3, 64, 65])))
    if kind == 4:
        return rnd.choice([True, False, None])
    if kind == 5 and depth < 12:
        return [_random_value(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    if kind == 6 and depth < 12:
        return {
            rnd.choice(["W", "b", "v", "type", "x", "scale", "indices", "data"]): _random_value(
                rnd, depth + 1
            )
        }
    if kind == 7:
        shape = [rnd.choice([0, 1, 4, 16, 2**31]) for _ in range(rnd.randrange(0, 5))]
        tag = rnd.choice([64, 72, 84, 85, 86, 68, 83, 87, 90])
        return cbor2.CBORTag(40, [shape, cbor2.CBORTag(tag, bytes(rnd.choice([0, 3, 64, 256])))])
    if kind == 8:
        return cbor2.CBORTag(rnd.choice([0, 1, 2, 28, 29, 258, 55799]), rnd.choice([1, "x", b"\x01", [1]]))
    if kind == 9:
        nested: Any = 1
        for _ in range(rnd.choice([5, 20, 200])):
            nested = [nested]
        return nested
    return rnd.choice(["update", "global_model", "round", "chunk", "status", "none", "int8", "topk"])


def _mutate_tree(obj: Any, rnd: random.Random) -> Any:
    if isinstance(obj, dict) and obj:
        key = rnd.choice(list(obj))
        action = rnd.randrange(6)
        obj = dict(obj)
        if action == 0:
            del obj[key]
        elif action == 1:
            obj[rnd.choice(["extra", "W", "signature", "v", key + "x"])] = _random_value(rnd)
        elif action == 2:
            obj[key] = _random_value(rnd)
        else:
            obj[key] = _mutate_tree(obj[key], rnd)
        return obj
    if isinstance(obj, list) and obj:
        obj = list(obj)
        i = rnd.randrange(len(obj))
        obj[i] = _mutate_tree(obj[i], rnd) if rnd.random() < 0.6 else _random_value(rnd)
        return obj
    if isinstance(obj, cbor2.CBORTag):
        if rnd.random() < 0.5:
            return cbor2.CBORTag(obj.tag, _mutate_tree(obj.value, rnd))
        return cbor2.CBORTag(rnd.choice([40, 64, 72, 84, 85, 86, 68, 83]), obj.value)
    if isinstance(obj, bytes) and obj and rnd.random() < 0.7:
        cut = rnd.randrange(len(obj) + 1)
        return obj[:cut] + bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(3)))
    return _random_value(rnd)


def _set_length(data: bytearray, rnd: random.Random) -> None:
    # rewrite one header into "major type M, 8-byte argument" with a huge value
    i = rnd.randrange(len(data))
    major = data[i] & 0xE0
    huge = rnd.choice([2**32, 2**60, 2**64 - 1, len(data), len(data) + 1])
    data[i : i + 1] = bytes([major | 27]) + huge.to_bytes(8, "big")


def mutate(data: bytes, pool: list[bytes], rnd: random.Random) -> bytes:
    """One mutated input from ``data`` (``pool`` gives splice partners)."""
    if rnd.random() < 0.2:
        try:
            tree = cbor2.loads(data)
            return cbor2.dumps(_mutate_tree(tree, rnd))
        except Exception:
            pass
    buf = bytearray(data)
    for _ in range(1 + int(rnd.expovariate(0.7))):
        if not buf:
            buf.extend(rnd.getrandbits(8).to_bytes(1, "big"))
        op = rnd.randrange(9)
        i = rnd.randrange(len(buf))
        if op == 0:
            buf[i] ^= 1 << rnd.randrange(8)
        elif op == 1:
            buf[i] = rnd.choice(INTERESTING)
        elif op == 2:
            _set_length(buf, rnd)
        elif op == 3:
            del buf[i : i + rnd.randrange(1, 16)]
        elif op == 4:
            buf[i:i] = bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(1, 16)))
        elif op == 5:
            del buf[rnd.randrange(len(buf) + 1) :]
        elif op == 6:
            other = rnd.choice(pool)
            j = rnd.randrange(len(other) + 1)
            buf[i:] = other[j:]
        elif op == 7:
            j = rnd.randrange(len(buf))
            buf[i:i] = buf[j : j + rnd.randrange(1, 64)]
        else:
            buf[i : i + 4] = rnd.choice([b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x7f\xff\xff\xff"])
    return bytes(buf)


# ---------------------------------------------------------------------------------------------------
# Driver


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise Hang()


def run(
    seconds: float,
    *,
    seed: int = 0,
    hang_s: float = 1.0,
    only: list[str] | None = None,
    out: Path | None = None,
    max_runs: int | None = None,
) -> dict[str, Stats]:
    """Fuzz every target round-robin for ``seconds`` (or ``max_runs`` inputs per target).

    Parameters
    ----------
    seconds : float
        Wall-clock budget, seconds.
    seed : int
        Seed of the input generator (a run is reproducible given seed and run count).
    hang_s : float
        A call longer than this is interrupted and counted as a hang, seconds.
    only : list[str], optional
        Target names to fuzz (default all).
    out : Path, optional
        Directory for crashing and hanging inputs.
    max_runs : int, optional
        Stop each target after this many inputs.

    Returns
    -------
    dict[str, Stats]
        Per target: runs, accepted, rejected reasons, crashes, hangs, slowest call (s).
    """
    rnd = random.Random(seed)
    all_targets = targets()
    names = only or list(all_targets)
    pool = seeds()
    stats = {name: Stats() for name in names}
    use_alarm = hasattr(signal, "setitimer")
    old = signal.signal(signal.SIGALRM, _alarm) if use_alarm else None
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for name in names:
                st = stats[name]
                if max_runs is not None and st.runs >= max_runs:
                    continue
                r = rnd.random()
                if r < 0.05:
                    data = bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(64)))
                elif r < 0.10:
                    data = rnd.choice(pool)
                else:
                    data = mutate(rnd.choice(pool), pool, rnd)
                st.runs += 1
                t0 = time.perf_counter()
                try:
                    _call(all_targets[name], data, hang_s if use_alarm else 0.0)
                    st.accepted += 1
                except EXPECTED as exc:
                    st.reasons[getattr(exc, "reason", type(exc).__name__)] += 1
                except Hang:
                    # a loaded machine can stall any call once: a hang must be slow twice in a row
                    # (the stateful reassembler target is not retried: its second call differs)
                    if name == "reassembler" or _slow_again(all_targets[name], data, hang_s):
                        st.hangs += 1
                        _save(out, name, "hang", st.hangs, data)
                    else:
                        st.stalls += 1
                except Exception as exc:
                    st.crashes += 1
                    if st.crashes <= 3:
                        print(f"CRASH {name}: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
                    _save(out, name, "crash", st.crashes, data)
                took = time.perf_counter() - t0
                if took > st.max_s:
                    st.max_s, st.slowest = took, data
            if max_runs is not None and all(s.runs >= max_runs for s in stats.values()):
                break
    finally:
        if use_alarm and old is not None:
            signal.signal(signal.SIGALRM, old)
    return stats


def _call(fn: Callable[[bytes], object], data: bytes, hang_s: float) -> None:
    if hang_s > 0:
        signal.setitimer(signal.ITIMER_REAL, hang_s)
    try:
        fn(data)
    finally:
        if hang_s > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)


def _slow_again(fn: Callable[[bytes], object], data: bytes, hang_s: float) -> bool:
    try:
        _call(fn, data, hang_s)
    except Hang:
        return True
    except Exception:
        return False
    return False


def _save(out: Path | None, name: str, kind: str, n: int, data: bytes) -> None:
    if out is None or n > 20:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-{kind}-{n}.bin").write_bytes(data)


def table(stats: dict[str, Stats]) -> str:
    """A markdown table of the results."""
    rows = [
        "| target | inputs | accepted | rejected | crashes | hangs | slowest (ms) | top reasons |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, st in stats.items():
        top = ", ".join(f"{r} {n}" for r, n in st.reasons.most_common(4))
        rows.append(
            f"| {name} | {st.runs} | {st.accepted} | {sum(st.reasons.values())} | {st.crashes} | "
            f"{st.hangs} | {st.max_s * 1e3:.1f} | {top} |"
        )
    return "\n".join(rows)


def run_atheris(target: str, runs: int) -> None:
    """Coverage-guided fuzzing of one target with atheris (exits the process when done)."""
    import atheris  # type: ignore[import-untyped]

    fn = targets()[target]

    def one(data: bytes) -> None:
        with contextlib.suppress(*EXPECTED):
            fn(data)

    corpus = Path(f"/tmp/edgefl-fuzz-corpus-{target}")
    corpus.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(seeds()):
        (corpus / f"seed-{i}").write_bytes(s)
    atheris.instrument_all()
    atheris.Setup([sys.argv[0], f"-runs={runs}", "-timeout=2", "-rss_limit_mb=1024", str(corpus)], one)
    atheris.Fuzz()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang-s", type=float, default=1.0)
    p.add_argument("--targets", nargs="*", default=None, choices=list(targets()))
    p.add_argument("--out", type=Path, default=Path("out/fuzz"))
    p.add_argument("--atheris", choices=list(targets()), default=None)
    p.add_argument("--runs", type=int, default=200_000)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # rejections are expected by the thousand: no log lines
    if args.atheris:
        run_atheris(args.atheris, args.runs)
        return 0
    t0 = time.monotonic()
    stats = run(args.seconds, seed=args.seed, hang_s=args.hang_s, only=args.targets, out=args.out)
    print(f"fuzz: {time.monotonic() - t0:.0f} s, seed {args.seed}, hang budget {args.hang_s} s per call\n")
    print(table(stats))
    crashes = sum(s.crashes for s in stats.values())
    hangs = sum(s.hangs for s in stats.values())
    stalls = sum(s.stalls for s in stats.values())
    print(
        f"\ncrashes = {crashes}, hangs = {hangs}, inputs = {sum(s.runs for s in stats.values())}"
        f" (calls over {args.hang_s} s once but not on a retry: {stalls})"
    )
    return 1 if crashes or hangs else 0


if __name__ == "__main__":
    sys.exit(main())
