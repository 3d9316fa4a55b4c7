"""Live-ingest messages (edgefl/wire/ingest.py): one refusal reason for any label out of range."""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.errors import DecodeError
from edgefl.wire.cbor import MessageType, dump_message
from edgefl.wire.ingest import Label, Sample, decode_label, decode_sample, encode_label, encode_sample

SHAPE = (8, 8, 1)


def _refusal(fn: object) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        fn()  # type: ignore[operator]
    return info.value


@pytest.mark.parametrize("label", [-1, -7, 10, 12, -(2**63), 2**63 - 1])
def test_label_out_of_range_is_bad_label_naming_the_range(label: int) -> None:
    exc = _refusal(lambda: decode_label(encode_label(Label("s-1", label)), num_classes=10))
    assert exc.reason == "bad_label"
    assert exc.detail == f"label = {label}: must be in 0..9 (the model's K = 10 classes)"
    x = np.zeros(SHAPE, dtype=np.uint8)
    exc = _refusal(
        lambda: decode_sample(
            encode_sample(Sample("s-1", x, label)), sample_shape=SHAPE, dtype="uint8", num_classes=10
        )
    )
    assert (exc.reason, exc.detail) == (
        "bad_label",
        f"label = {label}: must be in 0..9 (the model's K = 10 classes)",
    )


def test_label_range_of_a_logistic_head_and_without_a_model() -> None:
    exc = _refusal(lambda: decode_label(encode_label(Label("s", -1)), num_classes=1))
    assert (exc.reason, exc.detail) == ("bad_label", "label = -1: must be in 0..1 (a K = 1 (logistic) head)")
    assert decode_label(encode_label(Label("s", 1)), num_classes=1).label == 1
    assert decode_label(encode_label(Label("s", 0)), num_classes=10).label == 0
    assert decode_label(encode_label(Label("s", 9)), num_classes=10).label == 9
    exc = _refusal(lambda: decode_label(encode_label(Label("s", -3))))
    assert (exc.reason, exc.detail) == ("bad_label", "label = -3: must be a class number >= 0")
    # beyond 64 bits CBOR needs a bignum tag, which the bounded decoder refuses before any field check
    assert (
        _refusal(lambda: decode_label(encode_label(Label("s", -(2**70))), num_classes=10)).reason
        == "bad_cbor"
    )


def test_label_of_another_type_is_wrong_type() -> None:
    for value in (True, 1.0, "3"):
        payload = dump_message(MessageType.LABEL, {"id": "s", "label": value})
        exc = _refusal(lambda p=payload: decode_label(p, num_classes=10))
        assert exc.reason == "wrong_type", value
