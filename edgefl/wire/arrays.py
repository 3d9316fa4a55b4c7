"""RFC 8746 typed arrays: numpy arrays as tag 40 ``[shape, typed array]`` and back, checked before allocating.

Layout: ``docs/protocol.md`` ("Arrays"). Source: RFC 8746 §2.1 (typed arrays), §3.1.1 (tag 40).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import cbor2
import numpy as np
import numpy.typing as npt

from edgefl.errors import DecodeError
from edgefl.wire.cbor import ALLOWED_TAGS, Limits, cbor_head_bytes
from edgefl.wire.reasons import Reason

MAX_NDIM: Final = 4
TAG_NDARRAY: Final = 40


def _wire_dtype(tag: int) -> np.dtype[Any]:
    """RFC 8746 §2.1: typed-array tag ``0b010_f_s_e_ll`` (float, signed, little-endian, size) as a dtype."""
    kind = "f" if tag & 0x10 else "i" if tag & 0x08 else "u"
    size = (2 if kind == "f" else 1) << (tag & 0x03)
    return np.dtype(("<" if tag & 0x04 else ">") + kind + str(size))


# RFC 8746 §2.1 typed-array tags -> numpy wire dtype, for the tags ``cbor.ALLOWED_TAGS`` admits: float128
# (83, 87) has no portable numpy type and 68 (uint8 clamped) has no different meaning for a receiver.
TYPED_ARRAY_TAGS: Final[Mapping[int, np.dtype[Any]]] = {
    tag: _wire_dtype(tag) for tag in sorted(ALLOWED_TAGS - {TAG_NDARRAY})
}
# what we emit, by dtype: always little-endian (RFC 8746 tags 64, 69-71, 72, 77-79, 84-86)
_ENCODE_TAGS: Final[Mapping[np.dtype[Any], int]] = {
    dtype: tag for tag, dtype in TYPED_ARRAY_TAGS.items() if dtype.str[0] in "<|"
}
# RFC 8746 tag -> numpy dtype name, for the accepted-dtypes check without ``dtype.name``
_TAG_NAMES: Final[Mapping[int, str]] = {tag: dtype.name for tag, dtype in TYPED_ARRAY_TAGS.items()}


def encode_array(a: npt.NDArray[Any]) -> cbor2.CBORTag:
    """Wrap ``a`` (1 to 4 dims, u/int 8-64 or float 16-64) as ``40([shape, tag(little-endian bytes)])``.

    ValueError for another dtype or number of dimensions. Source: RFC 8746 §2.1, §3.1.1.
    """
    array = np.asarray(a)
    # looked up by dtype (hashed in C): ``dtype.name`` is computed in Python, ~8 us a call
    tag = _ENCODE_TAGS.get(array.dtype)
    if tag is None:
        little = array.dtype.newbyteorder("<")
        tag = _ENCODE_TAGS.get(little)
        if tag is None:
            raise ValueError(f"dtype {array.dtype} has no typed-array tag here")
        array = array.astype(little)  # a big-endian array, little-endian bytes
    if not 1 <= array.ndim <= MAX_NDIM:
        raise ValueError(f"arrays must have 1 to {MAX_NDIM} dimensions, got {array.ndim}")
    return cbor2.CBORTag(TAG_NDARRAY, [list(array.shape), cbor2.CBORTag(tag, array.tobytes())])


def read_shape(obj: object, name: str, limits: Limits) -> tuple[int, ...]:
    """A decoded shape (1-4 integers >= 1, product within ``limits``): wrong_type, bad_shape, too_large."""
    if not isinstance(obj, list | tuple):
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: shape is not an array")
    if not 1 <= len(obj) <= MAX_NDIM:
        raise DecodeError(Reason.BAD_SHAPE, f"{name}: {len(obj)} dimensions, expected 1 to {MAX_NDIM}")
    if any(type(dim) is not int for dim in obj):
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: shape entries must be integers")
    if any(dim < 1 for dim in obj):
        raise DecodeError(Reason.BAD_SHAPE, f"{name}: dimensions must be >= 1")
    if any(dim > limits.max_array_elements for dim in obj) or math.prod(obj) > limits.max_array_elements:
        raise DecodeError(Reason.TOO_LARGE, f"{name}: more than {limits.max_array_elements} elements")
    return tuple(obj)


def decode_array(
    obj: object, *, limits: Limits, dtypes: frozenset[str], name: str = "array"
) -> npt.NDArray[Any]:
    """Decode a tag-40 typed array, checking everything before allocating.

    ``dtypes`` are the accepted dtype names (big-endian tags of them too); ``name`` the field's dotted
    name in details. The result is writable, C-contiguous, owned, native byte order, finite for floats.
    DecodeError ``wrong_type``, ``bad_shape``, ``too_large``, ``bad_dtype``, ``not_finite``.
    Source: RFC 8746 §2.1, §3.1.1.
    """
    if not isinstance(obj, cbor2.CBORTag) or obj.tag != TAG_NDARRAY:
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: expected a tag-40 array")
    content = obj.value
    if not isinstance(content, list | tuple) or len(content) != 2:
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: tag 40 must hold [shape, typed array]")
    shape = read_shape(content[0], name, limits)
    typed = content[1]
    if not isinstance(typed, cbor2.CBORTag) or typed.tag not in TYPED_ARRAY_TAGS:
        raise DecodeError(Reason.BAD_DTYPE, f"{name}: elements are not an RFC 8746 typed array")
    wire_dtype = TYPED_ARRAY_TAGS[typed.tag]
    if _TAG_NAMES[typed.tag] not in dtypes:
        wanted = ", ".join(sorted(dtypes))
        raise DecodeError(Reason.BAD_DTYPE, f"{name}: {wire_dtype.name} (tag {typed.tag}), expected {wanted}")
    raw = typed.value
    if type(raw) is not bytes:
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: typed array must hold a byte string")
    count = math.prod(shape)
    if len(raw) != count * wire_dtype.itemsize:
        raise DecodeError(Reason.BAD_SHAPE, f"{name}: {len(raw)} bytes for {list(shape)} {wire_dtype.name}")
    native = wire_dtype.newbyteorder("=")
    array = np.frombuffer(raw, dtype=wire_dtype).reshape(shape).astype(native, order="C", copy=True)
    if array.dtype.kind == "f" and not bool(np.isfinite(array).all()):
        raise DecodeError(Reason.NOT_FINITE, f"{name}: contains NaN or infinity")
    return array


def array_cbor_bytes(count: int, itemsize: int) -> int:
    """CBOR bytes of :func:`encode_array` of a 1-D array of ``count`` items of ``itemsize`` bytes.

    Tag 40 (2 bytes), the 2-array head (1), the shape ``[count]`` (1 + head), the typed-array tag
    (2: tags 64..86 take one argument byte), the byte string head and the bytes.
    """
    nbytes = count * itemsize
    return 2 + 1 + 1 + cbor_head_bytes(count) + 2 + cbor_head_bytes(nbytes) + nbytes


def check_head_shapes(
    w: npt.NDArray[Any], b: npt.NDArray[Any], where: str, expect_shape: tuple[int, int] | None
) -> None:
    """Check a decoded head (or delta) pair of map ``where``: W [D, K], b [K], ``expect_shape`` if given.

    DecodeError ``bad_shape`` otherwise.
    """
    if expect_shape is not None:
        want_w, want_b = tuple(expect_shape), (expect_shape[1],)
    else:
        if w.ndim != 2:
            raise DecodeError(Reason.BAD_SHAPE, f"{where}.W: shape {list(w.shape)}, expected [D, K]")
        want_w, want_b = w.shape, (w.shape[1],)
    if w.shape != want_w:
        raise DecodeError(Reason.BAD_SHAPE, f"{where}.W: shape {list(w.shape)}, expected {list(want_w)}")
    if b.shape != want_b:
        raise DecodeError(Reason.BAD_SHAPE, f"{where}.b: shape {list(b.shape)}, expected {list(want_b)}")
