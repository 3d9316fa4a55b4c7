"""The global model message: the head the coordinator publishes (``global``, retained), applied by devices.

Also :func:`resolve_global_head` (a delta head onto the held one). Field by field:
``docs/protocol.md`` ("GlobalModel", "Head layouts"). Source: RFC 8949 (CBOR); RFC 8746 (typed arrays).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Final

import numpy as np

from edgefl.errors import DecodeError
from edgefl.types import F32
from edgefl.wire import cbor
from edgefl.wire.arrays import check_head_shapes, decode_array, encode_array
from edgefl.wire.compression import Compression, compress_delta, decompress_head
from edgefl.wire.reasons import Reason

_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")


class HeadLayout(StrEnum):
    """How a GlobalModel's head travels down (``docs/protocol.md``, "GlobalModel", "Head layouts").

    Source: Jacob et al. 2018 (per-channel int8).
    """

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    INT8 = "int8"


_HEAD_COMPRESSION: Final = {
    HeadLayout.FLOAT32: Compression.NONE,
    HeadLayout.FLOAT16: Compression.FLOAT16,
    HeadLayout.INT8: Compression.INT8,
}


@dataclass(frozen=True, slots=True)
class GlobalModel:
    """The global head published by the coordinator (topic ``global``, retained).

    ``W`` float32 [D, K] and ``b`` float32 [K] travel in ``layout`` (a lossy one quantises); with
    ``base_version`` they are the delta ``head(version) - head(base_version)``
    (:func:`resolve_global_head`). ``model_sha256`` names the backbone. ``docs/protocol.md``.
    """

    round: int
    version: int
    model_sha256: str
    W: F32
    b: F32
    signature: bytes = b""
    layout: HeadLayout = HeadLayout.FLOAT32
    base_version: int | None = None


def encode_global_model(msg: GlobalModel) -> bytes:
    """Encode a :class:`GlobalModel` (ValueError for a non-finite head in a compressed layout)."""
    layout = HeadLayout(msg.layout)
    obj: dict[str, object] = {
        "round": int(msg.round),
        "version": int(msg.version),
        "model_sha256": msg.model_sha256,
    }
    w, b = np.asarray(msg.W, dtype=np.float32), np.asarray(msg.b, dtype=np.float32)
    if layout is HeadLayout.FLOAT32 and msg.base_version is None:
        obj["head"] = {"W": encode_array(w), "b": encode_array(b)}
    else:
        obj["layout"] = layout.value
        if msg.base_version is not None:
            obj["base_version"] = int(msg.base_version)
        mode = _HEAD_COMPRESSION[layout]
        obj["head"] = {"W": compress_delta(w, mode), "b": compress_delta(b, mode)}
    obj["signature"] = bytes(msg.signature)
    return cbor.dump_message(cbor.MessageType.GLOBAL_MODEL, obj)


def decode_global_model(
    payload: bytes | cbor.Scanned,
    *,
    limits: cbor.Limits = cbor.DEFAULT_LIMITS,
    expect_shape: tuple[int, int] | None = None,
) -> GlobalModel:
    """Decode and validate a :class:`GlobalModel`, W and b float32 (writable, owned).

    ``payload`` may be its :func:`~edgefl.wire.cbor.scan`; with ``expect_shape`` (D, K) W must be
    [D, K] and b [K], without it W 2-D and b [W.shape[1]]. DecodeError: the reasons of
    ``docs/protocol.md`` ("Refusals").
    """
    required, optional = ("round", "version", "model_sha256", "head"), ("signature", "layout", "base_version")
    obj = cbor.load_message(payload, limits, cbor.MessageType.GLOBAL_MODEL, required, optional)
    version = cbor.read_int(obj, "version", "")
    head = cbor.check_keys(obj["head"], "head", ("W", "b"))
    layout, base_version = HeadLayout.FLOAT32, None
    if "layout" in obj or "base_version" in obj:
        if "layout" not in obj:
            raise DecodeError(Reason.MISSING_KEY, "layout: required with base_version")
        layout = cbor.read_choice(obj, "layout", HeadLayout)
        if "base_version" in obj:
            base_version = cbor.read_int(obj, "base_version", "")
            if base_version >= version:
                raise DecodeError(
                    Reason.BAD_VALUE, f"base_version {base_version} must be below version {version}"
                )
        mode = _HEAD_COMPRESSION[layout]
        w, b = decompress_head(head, expect_shape, limits=limits, compression=mode, name="head")
    else:
        f32 = frozenset({"float32"})
        w = decode_array(head["W"], limits=limits, dtypes=f32, name="head.W")
        b = decode_array(head["b"], limits=limits, dtypes=f32, name="head.b")
        check_head_shapes(w, b, "head", expect_shape)
    return GlobalModel(
        round=cbor.read_int(obj, "round", ""),
        version=version,
        model_sha256=cbor.read_text(obj, "model_sha256", "", _SHA256_RE),
        W=w,
        b=b,
        signature=cbor.read_signature(obj, limits),
        layout=layout,
        base_version=base_version,
    )


def resolve_global_head(gm: GlobalModel, held_version: int, held_W: F32, held_b: F32) -> GlobalModel:
    """Turn a decoded GlobalModel into the full float32 head a device applies and stores.

    ``held_W`` float32 [D, K] and ``held_b`` [K] are the head of ``held_version`` the device holds; a
    delta head is added to it in float32. DecodeError ``stale_base`` (a delta from another version: the
    device takes the retained full head instead), ``bad_shape``, ``not_finite`` (the sum overflows).
    """
    if gm.base_version is None:
        return replace(gm, layout=HeadLayout.FLOAT32)
    if gm.base_version != held_version:
        raise DecodeError(
            Reason.STALE_BASE, f"head delta from version {gm.base_version}, this device holds {held_version}"
        )
    if gm.W.shape != held_W.shape or gm.b.shape != held_b.shape:
        raise DecodeError(
            Reason.BAD_SHAPE, f"head delta of shape {list(gm.W.shape)}, held {list(held_W.shape)}"
        )
    with np.errstate(over="ignore"):
        w = (held_W.astype(np.float32) + gm.W).astype(np.float32)
        b = (held_b.astype(np.float32) + gm.b).astype(np.float32)
    if not (bool(np.isfinite(w).all()) and bool(np.isfinite(b).all())):
        raise DecodeError(Reason.NOT_FINITE, "head delta plus held head: NaN or infinity")
    return replace(gm, W=w, b=b, layout=HeadLayout.FLOAT32, base_version=None)
