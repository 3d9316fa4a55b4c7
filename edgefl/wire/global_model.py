"""The global model message: the head the coordinator publishes (``global``, retained), applied by devices.

Owns :class:`HeadLayout`, :class:`GlobalModel`, :func:`encode_global_model` / :func:`decode_global_model`,
:func:`resolve_global_head` (a delta head onto the held one) and :func:`global_model_version` (the
version read from the headers alone). Field by field: ``docs/protocol.md`` ("GlobalModel", "Head
layouts"); decoding is bounded by :mod:`edgefl.wire.cbor`, arrays are :mod:`edgefl.wire.arrays`, the
compressed layouts :mod:`edgefl.wire.compression`.

Source: RFC 8949 (CBOR); RFC 8746 (typed arrays).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Final

import numpy as np

from edgefl.errors import DecodeError
from edgefl.types import F32
from edgefl.wire.arrays import check_head_shapes, decode_array, encode_array
from edgefl.wire.cbor import (
    DEFAULT_LIMITS,
    SCHEMA_VERSION,
    Limits,
    MessageType,
    check_keys,
    dumps,
    load_message,
    read_int,
    read_signature,
    read_text,
    scan,
    show,
)
from edgefl.wire.compression import Compression, compress_delta, decompress_delta
from edgefl.wire.reasons import Reason

__all__ = [
    "GlobalModel",
    "HeadLayout",
    "decode_global_model",
    "encode_global_model",
    "global_model_version",
    "resolve_global_head",
]

_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
_LAYOUT_RE: Final = re.compile(r"[a-z0-9]{1,16}")

class HeadLayout(StrEnum):
    """How a GlobalModel's head travels down (``docs/protocol.md``, "GlobalModel", "Head layouts").

    ``float32`` is the head as bare arrays; ``float16`` and ``int8`` (a scale per output
    unit) are the update delta layouts of the same names applied to the head (or to its delta from
    ``base_version``). Source: Jacob et al. 2018 (per-channel int8).
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

    Parameters
    ----------
    round : int
        Round that produced this head (0 for the initial head).
    version : int
        Monotonic head version; updates name it as ``base_version``.
    model_sha256 : str
        SHA-256 of the backbone .tflite, 64 lowercase hex digits.
    W : float32 [D, K]
        Head weights.
    b : float32 [K]
        Head bias.
    signature : bytes
        Optional signature bytes (scheme defined by the caller), at most ``max_string_bytes``.
    layout : HeadLayout
        How W and b travel (float32 by default: bare arrays). Encoding a lossy layout
        quantises; decoding gives back the dense float32 values the wire carried.
    base_version : int or None
        When set, W and b are the delta ``head(version) - head(base_version)``: a device holding
        ``base_version`` adds them to its head (:func:`resolve_global_head`).
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
    """Encode a :class:`GlobalModel`.

    Parameters
    ----------
    msg : GlobalModel
        W float32 [D, K], b float32 [K], finite; ``layout`` and ``base_version`` choose the head's
        wire form (``docs/protocol.md``, "Head layouts").

    Returns
    -------
    bytes
        ``{"v", "type": "global_model", "round", "version", "model_sha256", "head": {"W", "b"},
        "signature"}``; a float32 full head is written with bare arrays; any other head with
        ``"layout"`` (and ``"base_version"``) before ``"head"``, whose ``W``/``b`` are delta-layout
        sub-maps.

    Raises
    ------
    ValueError
        If W or b is not finite in a compressed layout (as :func:`compress_delta`).
    """
    layout = HeadLayout(msg.layout)
    obj: dict[str, object] = {
        "v": SCHEMA_VERSION,
        "type": MessageType.GLOBAL_MODEL.value,
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
    return dumps(obj)


def decode_global_model(
    payload: bytes, *, limits: Limits = DEFAULT_LIMITS, expect_shape: tuple[int, int] | None = None
) -> GlobalModel:
    """Decode and validate a :class:`GlobalModel`.

    Parameters
    ----------
    payload : bytes
        The MQTT payload.
    limits : Limits
        Decoding bounds.
    expect_shape : tuple[int, int], optional
        (D, K) the local head has; W must be [D, K] and b [K]. Without it, W must be 2-D and b
        [W.shape[1]].

    Returns
    -------
    GlobalModel
        W, b float32, writable, owned.

    Raises
    ------
    DecodeError
        The reasons of ``docs/protocol.md`` ("Refusals"); ``signature`` is optional on the wire.
    """
    obj = load_message(payload, limits, MessageType.GLOBAL_MODEL)
    check_keys(
        obj,
        "",
        ("v", "type", "round", "version", "model_sha256", "head"),
        ("signature", "layout", "base_version"),
    )
    round_, version = read_int(obj, "round", ""), read_int(obj, "version", "")
    model_sha256 = read_text(obj, "model_sha256", "", _SHA256_RE)
    signature = read_signature(obj, limits)
    head = check_keys(obj["head"], "head", ("W", "b"))
    layout, base_version = HeadLayout.FLOAT32, None
    if "layout" in obj or "base_version" in obj:
        if "layout" not in obj:
            raise DecodeError(Reason.MISSING_KEY, "layout: required with base_version")
        raw = read_text(obj, "layout", "", _LAYOUT_RE)
        try:
            layout = HeadLayout(raw)
        except ValueError as exc:
            raise DecodeError(Reason.BAD_VALUE, f"layout = {show(raw)}: unknown head layout") from exc
        if "base_version" in obj:
            base_version = read_int(obj, "base_version", "")
            if base_version >= version:
                raise DecodeError(
                    Reason.BAD_VALUE, f"base_version {base_version} must be below version {version}"
                )
        mode = _HEAD_COMPRESSION[layout]
        want_w = tuple(expect_shape) if expect_shape is not None else None
        w = decompress_delta(head["W"], want_w, limits=limits, compression=mode, name="head.W")
        want_b = (expect_shape[1],) if expect_shape is not None else None
        b = decompress_delta(head["b"], want_b, limits=limits, compression=mode, name="head.b")
    else:
        f32 = frozenset({"float32"})
        w = decode_array(head["W"], limits=limits, dtypes=f32, name="head.W")
        b = decode_array(head["b"], limits=limits, dtypes=f32, name="head.b")
    check_head_shapes(w, b, "head", expect_shape)
    return GlobalModel(
        round=round_,
        version=version,
        model_sha256=model_sha256,
        W=w,
        b=b,
        signature=signature,
        layout=layout,
        base_version=base_version,
    )


def resolve_global_head(gm: GlobalModel, held_version: int, held_W: F32, held_b: F32) -> GlobalModel:
    """Turn a decoded GlobalModel into the full float32 head a device applies and stores.

    Parameters
    ----------
    gm : GlobalModel
        As :func:`decode_global_model` returned it.
    held_version : int
        Version of the head the device holds.
    held_W, held_b : float32 [D, K], float32 [K]
        That head.

    Returns
    -------
    GlobalModel
        ``layout = float32``, ``base_version = None``; W, b the full head (``held + delta`` for a
        delta head, summed in float32), round, version, sha256 and signature as received.

    Raises
    ------
    DecodeError
        ``stale_base`` (a delta from a version the device does not hold: it takes the retained full
        head instead), ``bad_shape`` (delta and held head differ), ``not_finite`` (the sum overflows).
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


def global_model_version(payload: bytes, *, limits: Limits = DEFAULT_LIMITS) -> int | None:
    """Read a GlobalModel's ``version`` from its item headers, without decoding it.

    The cheap check that lets a device skip a retained head it already holds (no array is built).

    Parameters
    ----------
    payload : bytes
        A GlobalModel payload (whole, not a chunk).
    limits : Limits
        Bounds for the header walk.

    Returns
    -------
    int or None
        The version, or None when the headers hold no unsigned ``version`` (the full decode then
        names the problem).

    Raises
    ------
    DecodeError
        ``too_large`` (payload over ``limits.max_message_bytes``), else as
        :func:`edgefl.wire.cbor.scan` (malformed or oversized CBOR).
    """
    version = scan(payload, limits).header.get("version")
    return version if type(version) is int else None
