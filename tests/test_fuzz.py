"""Fuzzing with a fixed budget: decoders, chunk reassembly, signatures and records never crash or hang.

The longer run is ``python -m bench.fuzz --seconds 600`` (results in docs/security.md).
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
from collections.abc import Callable

import cbor2
import pytest
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgefl.errors import DecodeError
from edgefl.records import RecordError, decode_record
from edgefl.wire.chunking import Reassembler, decode_chunk
from edgefl.wire.global_model import decode_global_model
from edgefl.wire.rounds import decode_round, decode_update
from edgefl.wire.signing import verify_payload
from edgefl.wire.status import decode_status

if (
    str(ROOT) not in sys.path
):  # bench/ is not an installed package; `pytest` (unlike `python -m`) omits the cwd
    sys.path.insert(0, str(ROOT))
from bench.fuzz import KEY, SHAPE, mutate, run, seeds, targets

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_fuzz_fixed_budget_zero_crashes_zero_hangs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.CRITICAL):
        stats = run(4.0, seed=1234, hang_s=2.0, max_runs=1500)
    assert set(stats) == set(targets())
    for name, s in stats.items():
        assert s.crashes == 0, name
        assert s.hangs == 0, name
        assert s.runs >= 200, (name, s.runs)  # the budget really exercised every target
        assert sum(s.reasons.values()) > 0.5 * s.runs, name  # mostly rejections, as mutations should be


def test_fuzz_seeds_are_valid_messages() -> None:
    # the mutations start from real messages: each seed is accepted by at least one target
    t = targets()
    for i, s in enumerate(seeds()):
        ok = []
        for name, fn in t.items():
            if name == "reassembler":
                continue
            try:
                fn(s)
                ok.append(name)
            except (DecodeError, RecordError):
                pass
        assert ok, i


def test_fuzz_mutations_change_inputs() -> None:
    rnd = random.Random(0)
    pool = seeds()
    outs = {mutate(pool[0], pool, rnd) for _ in range(200)}
    assert len(outs) > 150 and pool[0] not in outs


def _only_decode_error(fn: Callable[[bytes], object], data: bytes) -> None:
    with contextlib.suppress(DecodeError, RecordError):
        fn(data)


@FAST
@given(st.binary(max_size=512))
def test_fuzz_hypothesis_raw_bytes(data: bytes) -> None:
    _only_decode_error(lambda d: decode_global_model(d, expect_shape=SHAPE), data)
    _only_decode_error(decode_round, data)
    _only_decode_error(lambda d: decode_update(d, expect_shape=SHAPE), data)
    _only_decode_error(decode_status, data)
    _only_decode_error(decode_chunk, data)
    _only_decode_error(lambda d: verify_payload(d, KEY.verify_key, fleet="f", kind="global_model"), data)
    _only_decode_error(decode_record, data)


CBOR_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=64),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=8,
)
KEYS = st.sampled_from(
    [
        "v",
        "type",
        "round",
        "version",
        "model_sha256",
        "head",
        "W",
        "b",
        "delta",
        "selected",
        "signature",
        "id",
        "index",
        "count",
        "size",
        "sha256",
        "data",
        "device",
        "state",
        "fields",
        "update_id",
        "metrics",
    ]
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["global_model", "round", "update", "status", "chunk"]),
    st.dictionaries(KEYS, CBOR_VALUES, max_size=12),
)
def test_fuzz_hypothesis_wellformed_maps(kind: str, fields: dict[str, object]) -> None:
    """Valid CBOR maps with the right type and plausible keys: deeper into the field checks."""
    payload = cbor2.dumps({"v": 1, "type": kind, **fields})
    decoders: dict[str, Callable[[bytes], object]] = {
        "global_model": lambda d: decode_global_model(d, expect_shape=SHAPE),
        "round": decode_round,
        "update": lambda d: decode_update(d, expect_shape=SHAPE),
        "status": decode_status,
        "chunk": decode_chunk,
    }
    _only_decode_error(decoders[kind], payload)


@FAST
@given(st.lists(st.binary(max_size=300), max_size=12))
def test_fuzz_hypothesis_reassembler_bounded(chunks: list[bytes]) -> None:
    r = Reassembler(max_sets=2, max_total_bytes=4096, max_message_bytes=2048, max_chunk_bytes=512)
    for c in chunks:
        _only_decode_error(lambda d: r.feed("k", d), c)
        assert len(r) <= 2 and r.reserved_bytes <= 4096
