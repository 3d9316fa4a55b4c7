"""The wire package as a whole: layout sizes, schema versions, the one Reason enum, header capture."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import cbor2
import numpy as np
import pytest

from edgefl.errors import DecodeError
from edgefl.wire import arrays, cbor, signing
from edgefl.wire.cbor import ALLOWED_TAGS, DEFAULT_LIMITS, SCHEMA_VERSION, scan
from edgefl.wire.chunking import is_chunk, split_message
from edgefl.wire.compression import (
    Compression,
    compress_delta,
    compress_head_delta,
    decompress_delta,
    delta_wire_bytes,
    update_wire_bytes,
)
from edgefl.wire.global_model import GlobalModel, decode_global_model, encode_global_model
from edgefl.wire.reasons import Reason
from edgefl.wire.rounds import (
    RoundAnnouncement,
    Update,
    UpdateMetrics,
    decode_round,
    decode_update,
    encode_round,
    encode_update,
)
from edgefl.wire.status import DeviceStatus, encode_status
from tests.support.source import SOURCE_GROUP, parse
from tests.support.wire import CHUNK_REASONS, REASONS, SIGNATURE_REASONS

WIRE = Path(__file__).resolve().parent.parent / "edgefl" / "wire"
SHA = "cd" * 32


def make_update(compression: Compression, shape: tuple[int, int] = (64, 10), seed: int = 0) -> Update:
    rng = np.random.default_rng(seed)
    return Update(
        round=3,
        base_version=2,
        device="dev-1",
        num_examples=12,
        delta_W=rng.standard_normal(shape).astype(np.float32),
        delta_b=rng.standard_normal(shape[1]).astype(np.float32),
        metrics=UpdateMetrics(0.5, 0.75, 0.01, 1 << 20),
        update_id="dev-1:3:2",
        compression=compression,
    )


# ----------------------------------------------------------------------------------------------
# Layout sizes: what the memory estimates budget is what the codec writes


@pytest.mark.parametrize("shape", [(1,), (7,), (300,), (64, 10), (512, 10), (3, 4, 5), (70_000,)])
@pytest.mark.parametrize("mode", list(Compression))
def test_delta_wire_bytes_matches_the_encoded_layout(shape: tuple[int, ...], mode: Compression) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    for fraction in (0.01, 0.1, 0.5):
        predicted = delta_wire_bytes(shape, mode, fraction)
        sub = compress_delta(x, mode, topk_fraction=fraction)
        # deflated int8 levels (qz) are only written when smaller, a mask when smaller than indices
        assert len(cbor2.dumps(sub)) <= predicted, (shape, mode, fraction)
        if "qz" not in sub and "mask" not in sub:
            assert len(cbor2.dumps(sub)) == predicted, (shape, mode, fraction)


def test_update_wire_bytes_is_the_two_layouts() -> None:
    for mode in Compression:
        u = make_update(mode, (32, 10))
        packed = compress_head_delta(u.delta_W, u.delta_b, mode)
        written = len(cbor2.dumps(packed.W)) + len(cbor2.dumps(packed.b))
        deflated = any(key in sub for sub in (packed.W, packed.b) for key in ("qz", "mask"))
        assert update_wire_bytes(32, 10, mode.value) >= written
        assert deflated or update_wire_bytes(32, 10, mode.value) == written
    assert update_wire_bytes(512, 10, "none") == delta_wire_bytes((512, 10), "none") + delta_wire_bytes(
        (10,), "none"
    )
    # map head, "values", tag 40, [shape, typed], shape [512, 10], tag 85, bytes head, bytes
    assert update_wire_bytes(512, 10, "none") == (1 + 7 + 2 + 1 + 5 + 2 + 3 + 20480) + (
        1 + 7 + 2 + 1 + 2 + 2 + 2 + 40
    )


def test_layout_size_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        delta_wire_bytes((4,), "zip")
    with pytest.raises(ValueError):
        delta_wire_bytes((4,), "topk", 0.0)


# ----------------------------------------------------------------------------------------------
# Versioning: one schema, written by every message; any other is refused


def test_schema_every_message_is_written_in_the_one_schema() -> None:
    gm = GlobalModel(1, 2, SHA, np.ones((4, 3), np.float32), np.zeros(3, np.float32))
    assert cbor2.loads(encode_global_model(gm))["v"] == SCHEMA_VERSION == 1
    assert cbor2.loads(encode_status(DeviceStatus("dev-1", "online", {})))["v"] == 1
    int8 = make_update(Compression.INT8)
    assert cbor2.loads(encode_update(int8))["v"] == 1
    signed = GlobalModel(1, 2, SHA, gm.W, gm.b, signature=b"s" * 64)
    assert cbor2.loads(encode_global_model(signed))["v"] == 1
    assert decode_global_model(encode_global_model(signed)).signature == b"s" * 64
    # top-k with 1 % kept out of 20,000: the deflated bitmask is smaller than indices or a plain mask
    sparse = make_update(Compression.TOPK, (2000, 10))
    payload = encode_update(sparse, topk_fraction=0.01)
    obj = cbor2.loads(payload)
    assert "mask" in obj["delta"]["W"] and obj["v"] == 1
    assert decode_update(payload, expect_shape=(2000, 10)).num_examples == 12
    obj["v"] = 0
    with pytest.raises(DecodeError) as info:
        decode_update(cbor2.dumps(obj))
    assert info.value.reason == "bad_version"


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 17, 2**32])
def test_newer_schema_is_refused_with_its_reason(version: int) -> None:
    ann = RoundAnnouncement(4, 3, 30.0, 2, 0.1, 16, 2, ("dev-1",))
    obj = cbor2.loads(encode_round(ann))
    obj["v"] = version
    with pytest.raises(DecodeError) as info:
        decode_round(cbor2.dumps(obj))
    assert info.value.reason == "newer_schema" and Reason("newer_schema") is Reason.NEWER_SCHEMA
    assert f"reads schema {SCHEMA_VERSION}" in info.value.detail


def test_chunks_keep_schema_1() -> None:
    parts = split_message(b"x" * 3000, "edgefl/f/global/0000", 600, msg_id="m")
    assert len(parts) > 1 and all(cbor2.loads(p)["v"] == 1 and is_chunk(p) for p in parts)


# ----------------------------------------------------------------------------------------------
# One Reason enum; no private imports across modules; the pre-scan's header capture


@SOURCE_GROUP
def test_every_refusal_reason_is_a_reason_member() -> None:
    members = set(Reason)
    assert members >= REASONS | CHUNK_REASONS | SIGNATURE_REASONS
    for path in WIRE.glob("*.py"):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "DecodeError":
                # every reason is spelled Reason.X (an IfExp of two Reason.X too)
                spelled = [n for n in ast.walk(node.args[0]) if isinstance(n, ast.Attribute)]
                assert spelled, (path.name, node.lineno)
                for attr in spelled:
                    assert getattr(attr.value, "id", "") == "Reason" and attr.attr in Reason.__members__


@SOURCE_GROUP
def test_every_reason_the_agent_and_coordinator_raise_is_a_reason_member() -> None:
    top = WIRE.parent.parent
    seen = set()
    for path in [
        *(top / "agent").glob("*.py"),
        *(top / "coordinator").glob("*.py"),
        *WIRE.parent.glob("*.py"),
    ]:
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
                "DecodeError",
                "UpdateRejected",
            ):
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant):
                    seen.add(first.value)
                    assert first.value in set(Reason), (path.name, node.lineno, first.value)
    assert {"bad_topic", "wrong_device", "not_newer", "stale_round"} <= seen


@SOURCE_GROUP
def test_no_module_imports_another_modules_private_names() -> None:
    roots = [WIRE, WIRE.parent.parent / "agent", WIRE.parent.parent / "coordinator", WIRE.parent]
    for root in roots:
        for path in root.glob("*.py"):
            for node in ast.walk(parse(path)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgefl"):
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    assert not private, (path, node.module, private)


def test_scan_tags_are_the_typed_array_tags() -> None:
    assert frozenset({arrays.TAG_NDARRAY, *arrays.TYPED_ARRAY_TAGS}) == ALLOWED_TAGS


def test_scan_captures_top_level_headers_only() -> None:
    payload = cbor2.dumps(
        {"v": 2, "type": "update", "round": 7, "nested": {"round": 9}, "base_version": 300, "device": "d-1"}
    )
    got = scan(payload, DEFAULT_LIMITS).header
    assert got == {"v": 2, "type": "update", "round": 7, "base_version": 300, "device": "d-1"}
    # negative or non-integer values are not captured (the signature check then refuses the message)
    assert scan(cbor2.dumps({"round": -1, "v": 1.5}), DEFAULT_LIMITS).header == {}
    with pytest.raises(DecodeError) as info:
        scan(payload + b"\x00", DEFAULT_LIMITS)
    assert info.value.reason == "trailing_bytes"


def test_scan_once_for_the_signature_check_and_the_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    key = signing.generate_signing_key()
    update = make_update(Compression.INT8)
    payload = signing.sign_message(encode_update, update, key, fleet="f")
    scans: list[int] = []
    walk = cbor._scan

    def counted(data: bytes, limits: cbor.Limits) -> dict[str, int | str]:
        scans.append(len(data))
        return walk(data, limits)

    monkeypatch.setattr(cbor, "_scan", counted)
    scanned = cbor.scan(payload, DEFAULT_LIMITS)
    assert scanned.header["type"] == "update" and scanned.header["round"] == update.round
    signing.verify_payload(scanned, key.verify_key, fleet="f", kind="update", device=update.device)
    assert decode_update(scanned).update_id == update.update_id
    assert scans == [len(payload)]  # one walk of the headers for both
    # under other limits the decoder walks it again, and refuses what those limits refuse
    with pytest.raises(DecodeError) as info:
        decode_update(scanned, limits=dataclasses.replace(DEFAULT_LIMITS, max_items=3))
    assert info.value.reason == "too_large" and len(scans) == 2
    # a forged signature over the scanned form is still refused
    forged = cbor.scan(payload[:-1] + bytes([payload[-1] ^ 1]), DEFAULT_LIMITS)
    with pytest.raises(DecodeError) as info:
        signing.verify_payload(forged, key.verify_key, fleet="f", kind="update", device=update.device)
    assert info.value.reason == "bad_signature"
    with pytest.raises(DecodeError) as info:
        cbor.scan(b"\x00" * (DEFAULT_LIMITS.max_message_bytes + 1), DEFAULT_LIMITS)
    assert info.value.reason == "too_large"


def test_compressed_delta_round_trips_and_matches_the_decoder() -> None:
    for mode in Compression:
        u = make_update(mode, (300, 7), seed=4)
        packed = compress_head_delta(u.delta_W, u.delta_b, mode, topk_fraction=0.05)
        got = decode_update(encode_update(u, compressed=packed), expect_shape=(300, 7))
        assert got.compression is mode
        np.testing.assert_array_equal(got.delta_W, packed.decoded_W)
        np.testing.assert_array_equal(got.delta_b, packed.decoded_b)
        if mode is Compression.NONE:
            np.testing.assert_array_equal(packed.decoded_W, u.delta_W)
    # the dense int8 decode the sender computes itself (no re-read of its bytes) is the decoder's,
    # bit for bit: an all-zero output unit (scale 0), values over 30 binary orders
    rng = np.random.default_rng(9)
    W = (rng.normal(size=(300, 7)) * 2.0 ** rng.integers(-20, 10, size=(300, 7))).astype(np.float32)
    W[:, 3] = 0.0
    packed = compress_head_delta(W, W[0], Compression.INT8)
    assert not packed.decoded_W[:, 3].any()
    for sub, dense, shape in ((packed.W, packed.decoded_W, W.shape), (packed.b, packed.decoded_b, (7,))):
        wire = decompress_delta(sub, shape, limits=DEFAULT_LIMITS, compression=Compression.INT8)
        assert wire.tobytes() == dense.tobytes()
    with pytest.raises(ValueError, match="NaN"):
        compress_head_delta(np.full((2, 2), np.nan, np.float32), np.zeros(2, np.float32), Compression.INT8)


def test_floats_take_their_shortest_exact_width_and_keys_keep_their_order() -> None:
    # RFC 8949 §4.1 preferred serialization: 60.0, 1.0 and 0.0 fit half precision, 0.05 does not
    assert cbor.dumps(60.0) == bytes.fromhex("f95380") and cbor.dumps(0.05) == cbor2.dumps(0.05)
    assert cbor.dumps(100000.0) == bytes.fromhex("fa47c35000")
    assert cbor.dumps(float("nan")) == bytes.fromhex("f97e00")
    nested = {"b": [1.5, "x", {"z": 0.1, "a": 2.0}], "a": -0.0, "signature": b"s"}
    out = cbor.dumps(nested)
    assert cbor2.loads(out) == nested and list(cbor2.loads(out)) == ["b", "a", "signature"]
    assert len(out) == len(cbor2.dumps(nested)) - 3 * 6  # 1.5, 2.0 and -0.0: 3 bytes instead of 9
    many = {f"k{i}": i for i in range(300)}  # a map head with a 2-byte argument
    assert cbor.dumps(many) == cbor2.dumps(many)

    key = signing.generate_signing_key()
    ann = RoundAnnouncement(4, 3, 60.0, 1, 0.05, 32, 2, 1.0, prox_mu=0.0)
    payload = signing.sign_message(encode_round, ann, key, fleet="f")
    signing.verify_payload(payload, key.verify_key, fleet="f", kind=cbor.MessageType.ROUND)
    back = decode_round(payload)
    assert (back.deadline_s, back.lr, back.selected, back.prox_mu) == (60.0, 0.05, 1.0, 0.0)
    plain = cbor2.dumps(cbor2.loads(payload))  # what cbor2's default (all doubles) would have sent
    assert len(plain) - len(payload) == 3 * 6  # deadline_s, selected and prox_mu
