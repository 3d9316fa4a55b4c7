from __future__ import annotations

import numpy as np
import pytest

from edgefl.agent.feedback import ErrorFeedback
from edgefl.wire.compression import Compression
from edgefl.wire.rounds import Update, UpdateMetrics, decode_update, encode_update
from tests.support.wire import compressed_roundtrip


def test_topk_residual_by_hand_and_telescoping() -> None:
    fb = ErrorFeedback((2, 2), "sha")
    dW = np.array([[3.0, 1.0], [0.5, 2.0]], np.float32)
    db = np.array([0.0, -4.0], np.float32)
    cW, cb, _ = fb.compress(dW, db, Compression.TOPK, topk_fraction=0.25)
    np.testing.assert_array_equal(cb, db)
    # first round: nothing to compensate; top-1 of W keeps 3, of b keeps -4
    np.testing.assert_array_equal(cW, dW)
    sent = compressed_roundtrip(cW, Compression.TOPK, topk_fraction=0.25)
    np.testing.assert_array_equal(sent, [[3, 0], [0, 0]])
    np.testing.assert_array_equal(fb.residual_W, [[0.0, 1.0], [0.5, 2.0]])
    np.testing.assert_array_equal(fb.residual_b, [0.0, 0.0])
    # second round with a zero delta: the residual alone is sent, its largest entry (2) goes out
    zW, zb = np.zeros((2, 2), np.float32), np.zeros(2, np.float32)
    cW2, _, _ = fb.compress(zW, zb, Compression.TOPK, topk_fraction=0.25)
    np.testing.assert_array_equal(cW2, [[0.0, 1.0], [0.5, 2.0]])
    np.testing.assert_array_equal(fb.residual_W, [[0.0, 1.0], [0.5, 0.0]])


def test_sum_of_decoded_updates_equals_sum_of_deltas_minus_residual() -> None:
    rng = np.random.default_rng(1)
    fb = ErrorFeedback((30, 4))
    sent_W = np.zeros((30, 4), np.float64)
    total_W = np.zeros((30, 4), np.float64)
    for _ in range(12):
        dW = rng.normal(size=(30, 4)).astype(np.float32)
        db = rng.normal(size=4).astype(np.float32)
        cW, _, _ = fb.compress(dW, db, Compression.TOPK_INT8, topk_fraction=0.1)
        sent_W += compressed_roundtrip(cW, Compression.TOPK_INT8, topk_fraction=0.1)
        total_W += dW
    # Stich et al. 2018: what was sent plus what is held back is exactly what was produced
    np.testing.assert_allclose(sent_W + fb.residual_W, total_W, atol=1e-4)
    assert np.abs(fb.residual_W).sum() > 0


def test_int8_feedback_keeps_rounding_error() -> None:
    fb = ErrorFeedback((1, 2))
    dW = np.array([[1.0, 0.3]], np.float32)
    fb.compress(dW, np.zeros(2, np.float32), Compression.INT8)
    decoded = compressed_roundtrip(dW, Compression.INT8)
    np.testing.assert_array_equal(fb.residual_W, dW - decoded)
    with pytest.raises(ValueError):
        fb.compress(np.zeros((2, 2), np.float32), np.zeros(2, np.float32), Compression.INT8)


@pytest.mark.parametrize("mode", [m for m in Compression if m is not Compression.NONE])
def test_compress_once_is_bit_identical_to_encoding_the_corrected_delta(mode: Compression) -> None:
    rng = np.random.default_rng(3)
    once = ErrorFeedback((40, 6))
    twice = ErrorFeedback((40, 6))
    for _ in range(3):  # the residual carried between rounds must agree too
        dW = rng.normal(size=(40, 6)).astype(np.float32)
        db = rng.normal(size=6).astype(np.float32)
        cW, cb, packed = once.compress(dW, db, mode, topk_fraction=0.2)
        cW2, cb2, _ = twice.compress(dW, db, mode, topk_fraction=0.2)
        np.testing.assert_array_equal(cW, cW2)
        np.testing.assert_array_equal(cb, cb2)
        np.testing.assert_array_equal(once.residual_W, twice.residual_W)
        np.testing.assert_array_equal(once.residual_b, twice.residual_b)
        update = Update(1, 0, "dev-1", 9, cW, cb, UpdateMetrics(0.1, 0.5, 0.0, 0), "dev-1:1:0", mode)
        again = encode_update(update, topk_fraction=0.2)  # compresses a second time
        assert encode_update(update, compressed=packed) == again
        got = decode_update(again)
        np.testing.assert_array_equal(got.delta_W, packed.decoded_W)
        np.testing.assert_array_equal(got.delta_b, packed.decoded_b)
        np.testing.assert_array_equal(once.residual_W, cW - packed.decoded_W)


def test_compressed_delta_of_another_layout_is_refused() -> None:
    fb = ErrorFeedback((4, 2))
    _, _, packed = fb.compress(np.ones((4, 2), np.float32), np.ones(2, np.float32), Compression.INT8)
    update = Update(
        1, 0, "d", 1, np.ones((4, 2), np.float32), np.ones(2, np.float32),
        UpdateMetrics(0, 0, 0, 0), "d:1:0", Compression.TOPK,
    )
    with pytest.raises(ValueError, match="compressed delta is int8, the update says topk"):
        encode_update(update, compressed=packed)


def test_carried_residual_compact_form_reads_back() -> None:
    """The outbox's copy (``carry_bytes``: CBOR of RFC 8746 typed arrays) gives the same residual and
    round; a damaged copy, or one for another model or shape, is ignored."""
    fb = ErrorFeedback((3, 2), "sha-a")
    dW = np.array([[3.0, 1.0], [0.5, 2.0], [-1.0, 0.25]], np.float32)
    fb.compress(dW, np.array([1.0, -2.0], np.float32), Compression.TOPK, topk_fraction=0.25, round=4)
    carry = fb.carry_bytes()
    other = ErrorFeedback((3, 2), "sha-a")
    assert other.load_bytes(carry, "test")
    assert other.residual_W.tobytes() == fb.residual_W.tobytes()
    assert other.residual_b.tobytes() == fb.residual_b.tobytes() and other.round == 4
    fresh = ErrorFeedback((3, 2), "sha-a")
    assert not fresh.load_bytes(carry[:-3], "truncated")
    assert not fresh.load_bytes(b"not a residual", "garbage")
    assert not ErrorFeedback((3, 2), "sha-b").load_bytes(carry, "other model")
    assert not ErrorFeedback((2, 2), "sha-a").load_bytes(carry, "other shape")
    assert not fresh.residual_W.any() and fresh.round == -1
