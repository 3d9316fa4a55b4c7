"""Delta compression: each layout of an update's delta written once, its decoder, and its size on the wire.

Layouts ``none``, ``float16``, ``int8``, ``topk``, ``topk-int8``: ``docs/protocol.md`` ("Delta layouts");
the algorithms' sources: :func:`compress_delta`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

import cbor2
import numpy as np
import numpy.typing as npt

from edgefl.errors import DecodeError
from edgefl.types import F32
from edgefl.wire.arrays import (
    MAX_NDIM,
    array_cbor_bytes,
    check_head_shapes,
    decode_array,
    encode_array,
    read_shape,
)
from edgefl.wire.cbor import NO_LIMITS, Limits, cbor_head_bytes, check_keys
from edgefl.wire.reasons import Reason

_FLOAT16_MAX: Final = float(np.finfo(np.float16).max)
_DEFLATE_WBITS: Final = -15  # a raw stream: no zlib header or checksum


class Compression(StrEnum):
    """How an update's delta arrays are encoded on the wire (see :func:`compress_delta`)."""

    NONE = "none"
    FLOAT16 = "float16"
    INT8 = "int8"
    TOPK = "topk"
    TOPK_INT8 = "topk-int8"


def topk_count(size: int, fraction: float) -> int:
    """Entries top-k keeps of ``size``: ``ceil(fraction * size)``, in [min(1, size), size].

    ``fraction`` in (0, 1] (else ValueError) is read as the decimal it prints as: ``0.1`` of 30 is 3.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"topk fraction {fraction} must be in (0, 1]")
    num, den = _decimal_ratio(repr(float(fraction)))
    return min(size, -(-num * size // den))  # ceil, exact in integers


def _decimal_ratio(text: str) -> tuple[int, int]:
    """``repr`` of a finite float (``"0.1"``, ``"2.5e-07"``) as an exact ratio (``fractions`` costs RSS)."""
    mantissa, _, exponent = text.lower().partition("e")
    whole, _, decimals = mantissa.partition(".")
    num, den = int(whole + decimals), 10 ** len(decimals)
    shift = int(exponent or 0)
    return (num * 10**shift, den) if shift >= 0 else (num, den * 10**-shift)


def _quantise(x: F32, scale: F32, rng: np.random.Generator | None) -> npt.NDArray[np.int8]:
    # scale broadcasts over x's last axis; an all-zero slice has scale 0 and quantises to 0
    divisor = np.where(scale > 0, scale, np.float32(1.0))
    ratio = x / divisor
    # stochastic: floor(r + u), u ~ U[0, 1), so E[levels] = r and E[q * scale] = x (QSGD-style)
    levels = np.rint(ratio) if rng is None else np.floor(ratio + rng.random(ratio.shape, dtype=np.float32))
    return np.clip(levels, -127, 127).astype(np.int8)


def _dequantise(q: npt.NDArray[np.int8], scale: F32) -> F32:
    # the receiver's arithmetic, the one place it is written (error feedback uses it too)
    with np.errstate(over="ignore"):  # an absurd scale overflows to inf: the decoder rejects it
        dense: F32 = q.astype(np.float32) * scale
    return dense


def _int8_scale(x: F32) -> F32:
    # one scale per slice along the last axis (per output unit); a single scale for 1-D arrays
    magnitude = np.abs(x)
    peak = magnitude.reshape(-1, x.shape[-1]).max(axis=0) if x.ndim > 1 else magnitude.max(keepdims=True)
    scale: F32 = (peak / np.float32(127.0)).astype(np.float32)
    return scale


def _deflate(raw: bytes) -> bytes:
    """``raw`` as a raw deflate stream (RFC 1951, no zlib header), run-length matches only (``Z_RLE``)."""
    # run-length strategy: int8 levels and top-k masks have runs (zeros) and skewed byte frequencies,
    # no long repeats for LZ77's search (as small, 2-50x faster: docs/protocol.md)
    packer = zlib.compressobj(9, zlib.DEFLATED, _DEFLATE_WBITS, 8, zlib.Z_RLE)
    return packer.compress(raw) + packer.flush()


def _inflate(packed: object, count: int, name: str) -> bytes:
    """Inflate a raw deflate stream to exactly ``count`` bytes (never more than count + 1 come out)."""
    if type(packed) is not bytes:
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: expected a byte string, got {type(packed).__name__}")
    unpacker = zlib.decompressobj(_DEFLATE_WBITS)
    try:
        # never more than count + 1 bytes out, whatever the stream says (a deflate bomb stops here)
        raw = unpacker.decompress(packed, count)
        extra = b"" if unpacker.eof else unpacker.decompress(unpacker.unconsumed_tail, 1)
    except zlib.error as exc:
        raise DecodeError(Reason.BAD_VALUE, f"{name}: not a raw deflate stream ({exc})") from exc
    if len(raw) != count or extra or not unpacker.eof or unpacker.unused_data:
        got = f"{len(raw)}{'+' if extra else ''} bytes" + ("" if unpacker.eof else " (stream not ended)")
        raise DecodeError(Reason.BAD_VALUE, f"{name}: inflates to {got}, expected {count}")
    return raw


def _q_entry(q: npt.NDArray[np.int8]) -> dict[str, object]:
    """The levels as ``{"q": int8 typed array}``, or ``{"qz": [shape, raw deflate]}`` when smaller."""
    packed = _deflate(np.ascontiguousarray(q).tobytes())
    if _qz_cbor_bytes(q.shape, len(packed)) < _q_cbor_bytes(q.shape):
        return {"qz": [list(q.shape), packed]}
    return {"q": encode_array(q)}


def _q_cbor_bytes(shape: tuple[int, ...]) -> int:
    """CBOR bytes of the pair ``"q": encode_array(levels)`` for int8 levels of ``shape``."""
    return _text_cbor_bytes("q") + _ndarray_cbor_bytes(shape, 1)


def _qz_cbor_bytes(shape: tuple[int, ...], packed_bytes: int) -> int:
    """CBOR bytes of the pair ``"qz": [shape, deflated]`` (counted, not encoded)."""
    return (
        _text_cbor_bytes("qz") + 1 + _shape_cbor_bytes(shape) + cbor_head_bytes(packed_bytes) + packed_bytes
    )


def _shape_cbor_bytes(shape: tuple[int, ...]) -> int:
    return cbor_head_bytes(len(shape)) + sum(cbor_head_bytes(d) for d in shape)


def _read_q(sub: Mapping[str, Any], name: str, limits: Limits) -> npt.NDArray[np.int8]:
    """The levels of an int8 sub-map: exactly one of ``q`` and ``qz``, bounded."""
    present = [key for key in ("q", "qz") if key in sub]
    if len(present) != 1:
        raise DecodeError(
            Reason.MISSING_KEY if not present else Reason.BAD_VALUE, f"{name}: exactly one of q, qz"
        )
    if "q" in sub:
        return decode_array(sub["q"], limits=limits, dtypes=frozenset({"int8"}), name=f"{name}.q")
    obj = sub["qz"]
    if not isinstance(obj, list) or len(obj) != 2:
        raise DecodeError(Reason.WRONG_TYPE, f"{name}.qz: expected [shape, bytes]")
    shape = read_shape(obj[0], f"{name}.qz", limits)
    raw = _inflate(obj[1], math.prod(shape), f"{name}.qz")
    return np.frombuffer(raw, dtype=np.int8).reshape(shape).copy()


def _text_cbor_bytes(text: str) -> int:
    return cbor_head_bytes(len(text)) + len(text)  # map keys here are ASCII


def compress_delta(
    delta: F32,
    compression: Compression,
    *,
    topk_fraction: float = 0.1,
    rng: np.random.Generator | None = None,
) -> dict[str, object]:
    """Encode one finite delta float32 [...] (1-4 dims) as its wire sub-map (``docs/protocol.md``).

    ``rng``: stochastic int8 rounding (else to nearest). ValueError if ``delta`` is not finite, has 0
    or > 4 dimensions, is empty, or has more than 2**32 elements (top-k), or ``topk_fraction`` is
    outside (0, 1].
    Source: Alistarh et al. 2017, QSGD (stochastic rounding); Jacob et al. 2018 (per-channel int8);
    Aji & Heafield 2017 and Stich et al. 2018 (top-k sparsification with error feedback); RFC 1951
    (DEFLATE).
    """
    return _compress(delta, compression, topk_fraction, rng)[0]


def _compress(
    delta: F32, compression: Compression, topk_fraction: float, rng: np.random.Generator | None
) -> tuple[dict[str, object], F32 | None]:
    """:func:`compress_delta`, and for the dense int8 layout the values the receiver decodes (else None)."""
    x = np.ascontiguousarray(delta, dtype=np.float32)
    if not 1 <= x.ndim <= MAX_NDIM or x.size == 0:
        raise ValueError(f"delta must be a non-empty array of 1 to {MAX_NDIM} dimensions, got {x.shape}")
    if not bool(np.isfinite(x).all()):
        raise ValueError("delta contains NaN or infinity")
    mode = Compression(compression)
    if mode is Compression.NONE:
        return {"values": encode_array(x)}, None
    if mode is Compression.FLOAT16:
        return {"values": encode_array(np.clip(x, -_FLOAT16_MAX, _FLOAT16_MAX).astype(np.float16))}, None
    if mode is Compression.INT8:
        scale = _int8_scale(x)
        q = _quantise(x, scale, rng)
        return {**_q_entry(q), "scale": encode_array(scale)}, _dequantise(q, scale)
    flat = x.reshape(-1)
    size = flat.size
    if size > 2**32:
        raise ValueError(f"top-k indices are uint32: {size} elements is too many")
    k = topk_count(size, topk_fraction)
    kept = np.sort(np.argpartition(np.abs(flat), size - k)[size - k :])
    out: dict[str, object] = {"shape": list(x.shape)}
    index_dtype = np.uint16 if size <= 2**16 else np.uint32
    index_bytes = np.dtype(index_dtype).itemsize
    mask = np.zeros(size, dtype=np.bool_)
    mask[kept] = True
    packed_mask = np.packbits(mask, bitorder="little")
    deflated = _deflate(packed_mask.tobytes())
    indices_bytes = _text_cbor_bytes("indices") + array_cbor_bytes(k, index_bytes)
    if _text_cbor_bytes("mask") + cbor_head_bytes(len(deflated)) + len(deflated) < indices_bytes:
        out["mask"] = deflated
    else:
        out["indices"] = encode_array(kept.astype(index_dtype))
    values = flat[kept]
    if mode is Compression.TOPK:
        out["values"] = encode_array(values)
    else:
        scale = _int8_scale(values)
        out.update(_q_entry(_quantise(values, scale, rng)))
        out["scale"] = encode_array(scale)
    return out, None


def _kind_of(sub: Mapping[str, Any]) -> Compression:
    # infer the layout from its marker keys; check_keys() then rejects anything extra or missing
    if "shape" in sub:
        return Compression.TOPK_INT8 if "q" in sub or "qz" in sub else Compression.TOPK
    if "q" in sub or "qz" in sub or "scale" in sub:
        return Compression.INT8
    values = sub.get("values")
    content = values.value if isinstance(values, cbor2.CBORTag) else None
    if isinstance(content, list | tuple) and len(content) == 2:
        inner = content[1]
        if isinstance(inner, cbor2.CBORTag) and inner.tag in (80, 84):
            return Compression.FLOAT16
    return Compression.NONE


def _finite_or_raise(array: F32, name: str) -> F32:
    if not bool(np.isfinite(array).all()):
        raise DecodeError(Reason.NOT_FINITE, f"{name}: decodes to NaN or infinity")
    return array


def _scale(obj: object, name: str, expected: tuple[int, ...], limits: Limits) -> F32:
    scale: F32 = decode_array(obj, limits=limits, dtypes=frozenset({"float32"}), name=name)
    if scale.shape != expected:
        raise DecodeError(Reason.BAD_SHAPE, f"{name}: shape {list(scale.shape)}, expected {list(expected)}")
    if bool((scale < 0).any()):
        raise DecodeError(Reason.BAD_VALUE, f"{name}: scales must be >= 0")
    return scale


def decompress_delta(
    obj: object,
    shape: tuple[int, ...] | None,
    *,
    limits: Limits,
    compression: Compression | None = None,
    name: str = "delta",
) -> F32:
    """Decode one delta sub-map (see :func:`compress_delta`) into a dense float32 [shape].

    ``shape`` None accepts the wire's (bounded by ``limits``); with ``compression`` the layout must be
    that one; ``name`` is the field's dotted name in details. The array is writable, C-contiguous,
    owned and finite. DecodeError with the decoding reasons of ``docs/protocol.md`` ("Refusals"):
    ``bad_value`` for another layout, a negative scale or a bad deflate stream, ``bad_indices`` for
    top-k positions that break their rules.
    """
    if not isinstance(obj, dict):
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: expected a map, got {type(obj).__name__}")
    kind = _kind_of(obj)
    if compression is not None and kind is not compression:
        raise DecodeError(
            Reason.BAD_VALUE, f"{name}: encoded as {kind.value}, message says {compression.value}"
        )

    def check_shape(got: tuple[int, ...]) -> None:
        if shape is not None and got != tuple(shape):
            raise DecodeError(Reason.BAD_SHAPE, f"{name}: shape {list(got)}, expected {list(shape)}")

    if kind in (Compression.NONE, Compression.FLOAT16):
        sub = check_keys(obj, name, ("values",))
        dtype = "float32" if kind is Compression.NONE else "float16"
        values = decode_array(sub["values"], limits=limits, dtypes=frozenset({dtype}), name=f"{name}.values")
        check_shape(values.shape)
        return values.astype(np.float32, copy=False)
    if kind is Compression.INT8:
        sub = check_keys(obj, name, ("scale",), ("q", "qz"))
        q = _read_q(sub, name, limits)
        check_shape(q.shape)
        scale = _scale(sub["scale"], f"{name}.scale", (q.shape[-1],) if q.ndim > 1 else (1,), limits)
        return _finite_or_raise(_dequantise(q, scale), name)

    value_keys = ("values",) if kind is Compression.TOPK else ("scale",)
    position_keys = ("indices", "mask")
    q_keys = () if kind is Compression.TOPK else ("q", "qz")
    sub = check_keys(obj, name, ("shape", *value_keys), (*position_keys, *q_keys))
    full_shape = read_shape(sub["shape"], f"{name}.shape", limits)
    check_shape(full_shape)
    size = math.prod(full_shape)
    present = sum(key in sub for key in position_keys)
    if present != 1:
        raise DecodeError(
            Reason.MISSING_KEY if present == 0 else Reason.BAD_INDICES,
            f"{name}: exactly one of indices, mask",
        )
    if kind is Compression.TOPK:
        f32 = frozenset({"float32"})
        values = decode_array(sub["values"], limits=limits, dtypes=f32, name=f"{name}.values")
    else:
        q = _read_q(sub, name, limits)
        scale = _scale(sub["scale"], f"{name}.scale", (1,), limits)
        values = _dequantise(q, scale)
    if values.ndim != 1:
        raise DecodeError(Reason.BAD_INDICES, f"{name}: values of shape {list(values.shape)}, expected 1-D")
    if "indices" in sub:
        wire = decode_array(
            sub["indices"], limits=limits, dtypes=frozenset({"uint16", "uint32"}), name=f"{name}.indices"
        )
        if wire.ndim != 1:
            raise DecodeError(Reason.BAD_SHAPE, f"{name}.indices: must be 1-D")
        kept = wire.astype(np.int64)
        if kept.size and int(kept[-1]) >= size:
            raise DecodeError(Reason.BAD_INDICES, f"{name}.indices: index >= size {size}")
        if kept.size > 1 and not bool((np.diff(kept) > 0).all()):
            raise DecodeError(Reason.BAD_INDICES, f"{name}.indices: not strictly increasing")
    else:
        mask = np.frombuffer(_inflate(sub["mask"], (size + 7) // 8, f"{name}.mask"), dtype=np.uint8)
        if size % 8 and int(mask[-1]) >> (size % 8):
            raise DecodeError(Reason.BAD_INDICES, f"{name}.mask: padding bits set")
        kept = np.flatnonzero(np.unpackbits(mask, count=size, bitorder="little"))
    k = kept.size
    if values.shape != (k,):
        raise DecodeError(
            Reason.BAD_INDICES, f"{name}: {k} positions for values of shape {list(values.shape)}"
        )
    dense = np.zeros(full_shape, dtype=np.float32)
    dense.reshape(-1)[kept] = values  # a view of the C-contiguous array: writes into dense
    return _finite_or_raise(dense, name)


def decompress_head(
    sub: Mapping[str, Any],
    expect_shape: tuple[int, int] | None,
    *,
    limits: Limits,
    compression: Compression,
    name: str,
) -> tuple[F32, F32]:
    """Decode a head's (or head delta's) ``W`` and ``b`` sub-maps to float32 [D, K] and [K].

    With ``expect_shape`` (D, K) they must have it, without it W must be 2-D and b [W.shape[1]].
    DecodeError as :func:`decompress_delta` and :func:`~edgefl.wire.arrays.check_head_shapes`.
    """
    want_w = tuple(expect_shape) if expect_shape is not None else None
    w = decompress_delta(sub["W"], want_w, limits=limits, compression=compression, name=f"{name}.W")
    want_b = (expect_shape[1],) if expect_shape is not None else None
    b = decompress_delta(sub["b"], want_b, limits=limits, compression=compression, name=f"{name}.b")
    check_head_shapes(w, b, name, expect_shape)
    return w, b


@dataclass(frozen=True, slots=True)
class CompressedDelta:
    """An update's delta compressed once: the wire sub-maps and exactly what a receiver decodes.

    ``W``/``b`` are the sub-maps in layout ``compression`` (``encode_update(msg, compressed=...)``
    writes them as they are), ``decoded_W`` float32 [D, K] and ``decoded_b`` float32 [K] their
    decoding (error feedback keeps ``corrected - decoded``).
    """

    compression: Compression
    W: dict[str, object]
    b: dict[str, object]
    decoded_W: F32
    decoded_b: F32


def compress_head_delta(
    delta_W: F32,
    delta_b: F32,
    compression: Compression,
    *,
    topk_fraction: float = 0.1,
) -> CompressedDelta:
    """Compress a head delta (``delta_W`` float32 [D, K], then ``delta_b`` [K]) and decode it back.

    The other arguments and the ValueError are :func:`compress_delta`'s (int8 rounds to nearest); the
    result is bit for bit what ``encode_update`` writes for these deltas with the same arguments.
    """
    mode = Compression(compression)
    x_W = np.asarray(delta_W, dtype=np.float32)
    x_b = np.asarray(delta_b, dtype=np.float32)
    sub_W, dense_W = _compress(x_W, mode, topk_fraction, None)
    sub_b, dense_b = _compress(x_b, mode, topk_fraction, None)

    def decoded(sub: dict[str, object], dense: F32 | None, shape: tuple[int, ...], name: str) -> F32:
        # dense int8: the receiver's own dequantisation of the levels just made (no inflate and
        # re-read); the other layouts are decoded from their wire form
        if dense is not None:
            return _finite_or_raise(dense, name)
        return decompress_delta(sub, shape, limits=NO_LIMITS, compression=mode, name=name)

    return CompressedDelta(
        compression=mode,
        W=sub_W,
        b=sub_b,
        decoded_W=decoded(sub_W, dense_W, x_W.shape, "delta.W"),
        decoded_b=decoded(sub_b, dense_b, x_b.shape, "delta.b"),
    )


def _ndarray_cbor_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    # encode_array of an n-D array: array_cbor_bytes with the shape's list in place of [count]
    count = math.prod(shape)
    return array_cbor_bytes(count, itemsize) - 1 - cbor_head_bytes(count) + _shape_cbor_bytes(shape)


def delta_wire_bytes(
    shape: tuple[int, ...], compression: Compression | str, topk_fraction: float = 0.1
) -> int:
    """CBOR bytes of the sub-map :func:`compress_delta` writes for an array of ``shape`` (1-4 dims).

    Exact or an upper bound as ``docs/protocol.md`` ("Delta layouts") says. ValueError for an unknown
    ``compression`` or a ``topk_fraction`` outside (0, 1].
    """
    mode = Compression(compression)
    shape = tuple(int(d) for d in shape)
    size = math.prod(shape)
    if mode in (Compression.NONE, Compression.FLOAT16):
        itemsize = 4 if mode is Compression.NONE else 2
        return 1 + _text_cbor_bytes("values") + _ndarray_cbor_bytes(shape, itemsize)
    if mode is Compression.INT8:
        scales = shape[-1] if len(shape) > 1 else 1
        return 1 + _q_cbor_bytes(shape) + _text_cbor_bytes("scale") + array_cbor_bytes(scales, 4)
    k = topk_count(size, topk_fraction)
    shape_bytes = _text_cbor_bytes("shape") + _shape_cbor_bytes(shape)
    index_bytes = 2 if size <= 2**16 else 4
    mask_bytes = (size + 7) // 8
    # zlib's deflateBound: what deflate writes for bytes it cannot shrink (stored blocks), at most
    stored = mask_bytes + (mask_bytes >> 12) + (mask_bytes >> 14) + (mask_bytes >> 25) + 13
    positions = min(
        _text_cbor_bytes("indices") + array_cbor_bytes(k, index_bytes),
        _text_cbor_bytes("mask") + cbor_head_bytes(stored) + stored,
    )
    if mode is Compression.TOPK:
        return 1 + shape_bytes + positions + _text_cbor_bytes("values") + array_cbor_bytes(k, 4)
    values = (
        _text_cbor_bytes("q") + array_cbor_bytes(k, 1) + _text_cbor_bytes("scale") + array_cbor_bytes(1, 4)
    )
    return 1 + shape_bytes + positions + values


def update_wire_bytes(
    dim: int, classes: int, compression: Compression | str, topk_fraction: float = 0.1
) -> int:
    """CBOR bytes of an Update's ``delta_W [D, K]`` and ``delta_b [K]``: :func:`delta_wire_bytes` of each.

    ``dim``, ``classes``: D and K; the other parameters, the bytes returned (exact or an upper bound)
    and the ``ValueError`` raised are as :func:`delta_wire_bytes`'s.
    """
    return sum(delta_wire_bytes(shape, compression, topk_fraction) for shape in ((dim, classes), (classes,)))
