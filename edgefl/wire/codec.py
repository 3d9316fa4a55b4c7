"""The wire format: CBOR messages with RFC 8746 typed arrays, paired encoders and bounded decoders.

Every message is a CBOR map with text keys, ``"v"`` (schema version) and ``"type"`` first. Arrays travel
as a tag-40 multi-dimensional array (row-major) wrapping ``[shape, typed array]``, where the typed array
is an RFC 8746 tag on a little-endian byte string, so any CBOR decoder can read them::

    40([[2, 2], 85(h'0000803f...')])      # float32 [2, 2]

Decoding anything from the network is bounded and validated. In order:

1. the payload size is checked against ``Limits.max_message_bytes``;
2. a header-only pre-scan (no allocation, pure arithmetic on the bytes) rejects what cbor2 would
   otherwise turn into memory: declared lengths larger than the bytes left (a length prefix of 2**60
   fails there), more than ``Limits.max_items`` data items (4 MB of empty arrays would otherwise
   become ~260 MB of Python lists), nesting deeper than ``Limits.max_depth``, indefinite lengths,
   tags other than 40 and the RFC 8746 typed arrays (cbor2 would decode datetimes, bignums, sets and
   shared references), non-text map keys, long text strings, and trailing bytes;
3. cbor2 decodes the now-bounded payload (``allow_duplicate_keys=False``, ``allow_indefinite=False``);
4. each message's fields are checked: known keys only, every required key present, exact types
   (``bool`` is not ``int``), ranges, shapes and dtypes against the model, finite values only.

Failures raise :class:`edgefl.errors.DecodeError` whose ``reason`` is one of :data:`REASONS` (used as
the ``rejected_total{reason}`` label) and whose ``detail`` names the dotted field.

Update deltas are compressed per array (see :func:`compress_delta`): ``none`` (float32),
``float16``, ``int8`` (per-output-unit scales), ``topk`` and ``topk-int8`` (sparse; positions as
indices, a bitmask or Golomb-Rice coded gaps, whichever is smallest). The dataclasses
always hold dense float32 deltas; compression only changes the wire. Error feedback lives on the
device: it keeps ``delta - compressed_roundtrip(delta, ...)`` as a residual for the next round.

Source: RFC 8949 (CBOR); RFC 8746 §2 (typed arrays), §3.1.1 (tag 40).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction
from typing import Any, Final

import cbor2
import numpy as np
import numpy.typing as npt

from edgefl.errors import DecodeError
from edgefl.types import F32, I64
from edgefl.validators import DEVICE_ID_PATTERN, check_device_id

logger = logging.getLogger(__name__)

__all__ = [
    "DEVICE_ID_RE",
    "REASONS",
    "SCHEMA_VERSION",
    "Compression",
    "DecodeError",
    "DeviceStatus",
    "GlobalModel",
    "Limits",
    "MessageType",
    "RoundAnnouncement",
    "Update",
    "UpdateMetrics",
    "compress_delta",
    "compressed_roundtrip",
    "decode_array",
    "decode_global_model",
    "decode_round",
    "decode_status",
    "decode_update",
    "decompress_delta",
    "encode_array",
    "encode_global_model",
    "encode_round",
    "encode_status",
    "encode_update",
    "is_valid_device_id",
    "offline_status",
    "topk_count",
]

SCHEMA_VERSION: Final = 1

# Bounds on a RoundAnnouncement's training settings: a device must not be told to train for 2^62
# epochs or with a step that overflows float32 (both were seen to hang or crash an agent).
MAX_DEADLINE_S: Final = 86_400.0
MAX_LOCAL_EPOCHS: Final = 1_000
MAX_LR: Final = 10.0
MAX_BATCH_SIZE: Final = 65_536
MAX_CLIENTS: Final = 1_000_000
MAX_PROX_MU: Final = 1_000.0

#: Every ``DecodeError.reason`` this module raises (Prometheus label values).
REASONS: Final = frozenset(
    {
        "too_large",
        "bad_cbor",
        "too_deep",
        "trailing_bytes",
        "not_a_map",
        "bad_version",
        "wrong_type",
        "unknown_key",
        "missing_key",
        "bad_shape",
        "bad_dtype",
        "not_finite",
        "bad_indices",
        "bad_value",
    }
)

#: Device ids (MQTT topic levels, file names, Prometheus labels); ``.`` and ``..`` are also refused.
DEVICE_ID_RE: Final = DEVICE_ID_PATTERN
# update ids are often "<device>:<round>:<n>" or a UUID, hence the colon and the longer bound
_UPDATE_ID_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_STATE_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,32}")
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")

_INT_MAX: Final = 2**63 - 1  # fits int64 everywhere downstream (JSON, Prometheus, numpy)
_MAX_NDIM: Final = 4
_TAG_NDARRAY: Final = 40
_FLOAT16_MAX: Final = float(np.finfo(np.float16).max)
# Rice parameters 0..15: remainders fit uint16; mean gaps above 2**15 mean so few kept entries that
# uint32 indices are smaller anyway
_RICE_MAX_K: Final = 15

# RFC 8746 §2.1 typed-array tags -> numpy wire dtype. float128 (83, 87) has no portable numpy type
# and 68 (uint8 clamped) has no different meaning for a receiver, so they are not accepted.
_TYPED_ARRAY_TAGS: Final[Mapping[int, np.dtype[Any]]] = {
    tag: np.dtype(code)
    for tag, code in {
        64: "u1",
        65: ">u2",
        66: ">u4",
        67: ">u8",
        69: "<u2",
        70: "<u4",
        71: "<u8",
        72: "i1",
        73: ">i2",
        74: ">i4",
        75: ">i8",
        77: "<i2",
        78: "<i4",
        79: "<i8",
        80: ">f2",
        81: ">f4",
        82: ">f8",
        84: "<f2",
        85: "<f4",
        86: "<f8",
    }.items()
}
# what we emit: always little-endian (RFC 8746 tags 64, 69-71, 72, 77-79, 84-86)
_ENCODE_TAGS: Final[Mapping[str, int]] = {
    "uint8": 64,
    "uint16": 69,
    "uint32": 70,
    "uint64": 71,
    "int8": 72,
    "int16": 77,
    "int32": 78,
    "int64": 79,
    "float16": 84,
    "float32": 85,
    "float64": 86,
}
_ALLOWED_TAGS: Final = frozenset({_TAG_NDARRAY, *_TYPED_ARRAY_TAGS})


class MessageType(StrEnum):
    """The ``"type"`` of a message."""

    GLOBAL_MODEL = "global_model"
    ROUND = "round"
    UPDATE = "update"
    STATUS = "status"
    CHUNK = "chunk"


class Compression(StrEnum):
    """How an update's delta arrays are encoded on the wire (see :func:`compress_delta`)."""

    NONE = "none"
    FLOAT16 = "float16"
    INT8 = "int8"
    TOPK = "topk"
    TOPK_INT8 = "topk-int8"


@dataclass(frozen=True, slots=True)
class Limits:
    """Decoding bounds; all are checked before the corresponding memory is allocated.

    Parameters
    ----------
    max_message_bytes : int
        Largest accepted payload, bytes (checked before parsing).
    max_depth : int
        Deepest nesting of arrays, maps and tags (an update with an int8 delta needs 6, one with
        Rice-coded top-k positions 7).
    max_array_elements : int
        Largest element count of one array (typed or CBOR array, or map pairs).
    max_string_bytes : int
        Longest text string, UTF-8 bytes; also bounds ``signature`` byte strings.
    max_items : int
        Most CBOR data items in one message. Bounds the Python objects a payload can expand to
        (a typed array counts as one item whatever its size).

    Raises
    ------
    ValueError
        If a bound is < 1.
    """

    max_message_bytes: int = 4 * 1024 * 1024
    max_depth: int = 8
    max_array_elements: int = 4 * 1024 * 1024
    max_string_bytes: int = 256
    max_items: int = 16_384

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_depth", "max_array_elements", "max_string_bytes", "max_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} = {getattr(self, name)}: must be >= 1")


# used where the caller already holds the data (compressed_roundtrip): no bound but correctness
_NO_LIMITS: Final = Limits(
    max_message_bytes=2**62, max_depth=64, max_array_elements=2**62, max_string_bytes=2**62, max_items=2**62
)


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
    """

    round: int
    version: int
    model_sha256: str
    W: F32
    b: F32
    signature: bytes = b""


@dataclass(frozen=True, slots=True)
class RoundAnnouncement:
    """A round opened by the coordinator (topic ``round``, retained).

    Parameters
    ----------
    round : int
        Round number, >= 0.
    base_version : int
        Global head version the devices must train from.
    deadline_s : float
        Seconds from the announcement until updates stop being accepted, > 0.
    local_epochs : int
        Local epochs over the device store, >= 1.
    lr : float
        SGD learning rate, > 0.
    batch_size : int
        Training batch size, >= 1.
    min_clients : int
        Updates needed to aggregate, >= 1.
    selected : tuple[str, ...] or float
        Device ids asked to train, or the fraction in (0, 1] of devices that should self-select.
    compression : Compression
        Delta compression the devices must use.
    topk_fraction : float
        Fraction in (0, 1] of entries kept by ``topk``/``topk-int8``.
    prox_mu : float
        FedProx proximal coefficient, >= 0 (0 is plain FedAvg). Source: Li et al. 2020, FedProx.
    signature : bytes
        Optional signature bytes.
    """

    round: int
    base_version: int
    deadline_s: float
    local_epochs: int
    lr: float
    batch_size: int
    min_clients: int
    selected: tuple[str, ...] | float
    compression: Compression = Compression.NONE
    topk_fraction: float = 0.1
    prox_mu: float = 0.0
    signature: bytes = b""


@dataclass(frozen=True, slots=True)
class UpdateMetrics:
    """Training metrics sent with an update.

    Parameters
    ----------
    loss : float
        Mean training loss of the last local epoch.
    accuracy : float
        Training accuracy in [0, 1].
    train_s : float
        Wall time of local training, seconds, >= 0.
    peak_rss_bytes : int
        Peak resident set size during training, bytes, >= 0.
    """

    loss: float
    accuracy: float
    train_s: float
    peak_rss_bytes: int


@dataclass(frozen=True, slots=True)
class Update:
    """A device's head update (topic ``update/<device>``).

    Parameters
    ----------
    round : int
        Round this update answers.
    base_version : int
        Global head version the delta was computed from.
    device : str
        Device id, matching :data:`DEVICE_ID_RE`.
    num_examples : int
        Training examples behind the delta (the FedAvg weight), >= 1.
    delta_W : float32 [D, K]
        Dense head-weight delta (local - global). Always dense here; ``compression`` only changes
        the wire, and after decoding it holds what the wire carried.
    delta_b : float32 [K]
        Dense bias delta.
    metrics : UpdateMetrics
        Training metrics.
    update_id : str
        Unique id for de-duplication, ``[A-Za-z0-9_.:-]{1,128}``.
    compression : Compression
        How the deltas are encoded on the wire.
    signature : bytes
        Optional signature bytes.
    """

    round: int
    base_version: int
    device: str
    num_examples: int
    delta_W: F32
    delta_b: F32
    metrics: UpdateMetrics
    update_id: str
    compression: Compression = Compression.NONE
    signature: bytes = b""


@dataclass(frozen=True, slots=True)
class DeviceStatus:
    """A device's status (topic ``status/<device>``, retained; the last will is state ``offline``).

    Parameters
    ----------
    device : str
        Device id, matching :data:`DEVICE_ID_RE`.
    state : str
        Short label, ``[A-Za-z0-9_.-]{1,32}``: ``"online"``, ``"offline"``, ``"idle"``,
        ``"training"``...
    fields : Mapping[str, object]
        Free-form JSON-like values (str, int, float, bool, None, list, dict with str keys): round,
        version, rss_bytes, cap_bytes, reasons... Bounded by :class:`Limits`; floats must be finite.
    """

    device: str
    state: str
    fields: Mapping[str, object] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------
# Generic bounded decoding


def _show(text: str) -> str:
    # details end up in logs: keep attacker-chosen text short and printable
    short = text[:64]
    return short if short.isprintable() else ascii(short)


def _cbor2_strict() -> bool:
    """Whether this cbor2 takes max_depth, allow_indefinite and allow_duplicate_keys (6.x does, 5.x not)."""
    try:
        cbor2.loads(b"\xa0", max_depth=2, allow_indefinite=False, allow_duplicate_keys=False)
    except TypeError:
        return False
    return True


_CBOR2_STRICT = _cbor2_strict()


def _prescan(data: bytes, limits: Limits) -> None:
    """Walk the CBOR item headers of ``data`` without building any object.

    Source: RFC 8949 §3 (initial byte, argument), §3.2 (indefinite lengths), §3.3 (simple values).
    """
    size = len(data)
    pos = 0
    items = 0
    remaining: list[int] = []  # children still expected by each open container
    in_map: list[bool] = []
    keys: list[set[bytes]] = []  # text keys seen in each open container (maps only)
    while True:
        if pos >= size:
            raise DecodeError("bad_cbor", f"truncated at byte {pos}")
        initial = data[pos]
        pos += 1
        major = initial >> 5
        info = initial & 0x1F
        if info < 24:
            arg = info
        elif info < 28:
            width = 1 << (info - 24)
            if width > size - pos:
                raise DecodeError("bad_cbor", f"truncated header at byte {pos - 1}")
            arg = int.from_bytes(data[pos : pos + width], "big")
            pos += width
        elif info == 31:
            raise DecodeError("bad_cbor", f"indefinite length or break at byte {pos - 1}")
        else:
            raise DecodeError("bad_cbor", f"reserved additional information at byte {pos - 1}")
        items += 1
        if items > limits.max_items:
            raise DecodeError("too_large", f"more than {limits.max_items} data items")
        is_key = bool(in_map) and in_map[-1] and remaining[-1] % 2 == 0
        if is_key and major != 3:
            raise DecodeError("wrong_type", f"map key at byte {pos - 1} is not a text string")
        children = 0
        if major in (2, 3):
            if arg > size - pos:
                raise DecodeError("bad_cbor", f"string of {arg} bytes at byte {pos - 1} runs past the end")
            if major == 3 and arg > limits.max_string_bytes:
                raise DecodeError("bad_value", f"text string of {arg} bytes > {limits.max_string_bytes}")
            if is_key:  # checked here, not by cbor2: cbor2 5.x has no allow_duplicate_keys
                key = data[pos : pos + arg]
                if key in keys[-1]:
                    raise DecodeError(
                        "bad_cbor", f"duplicate map key {_show(key.decode('utf-8', 'replace'))}"
                    )
                keys[-1].add(key)
            pos += arg
        elif major in (4, 5):
            if arg > limits.max_array_elements:
                raise DecodeError("too_large", f"container of {arg} elements > {limits.max_array_elements}")
            children = arg if major == 4 else 2 * arg
            if children > size - pos:  # every child takes at least one byte
                raise DecodeError("bad_cbor", f"container of {arg} elements runs past the end")
        elif major == 6:
            if arg not in _ALLOWED_TAGS:
                raise DecodeError("bad_cbor", f"unsupported tag {arg}")
            children = 1
        elif major == 7 and info not in (20, 21, 22, 25, 26, 27):  # false, true, null, floats
            raise DecodeError("bad_cbor", f"unsupported simple value at byte {pos - 1}")
        if major in (4, 5, 6):
            if len(remaining) + 1 > limits.max_depth:
                raise DecodeError("too_deep", f"nesting deeper than {limits.max_depth}")
            if children:
                remaining.append(children)
                in_map.append(major == 5)
                keys.append(set())
                continue
        # one item is complete: close every container it completes
        while remaining:
            remaining[-1] -= 1
            if remaining[-1]:
                break
            remaining.pop()
            in_map.pop()
            keys.pop()
        else:
            break
    if pos != size:
        raise DecodeError("trailing_bytes", f"{size - pos} bytes after the message")


def _load(payload: bytes, limits: Limits) -> object:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise DecodeError("wrong_type", f"payload is {type(payload).__name__}, not bytes")
    if len(payload) > limits.max_message_bytes:
        raise DecodeError("too_large", f"{len(payload)} bytes > {limits.max_message_bytes}")
    data = bytes(payload)
    _prescan(data, limits)
    try:
        if _CBOR2_STRICT:
            return cbor2.loads(
                data, max_depth=limits.max_depth, allow_indefinite=False, allow_duplicate_keys=False
            )
        return cbor2.loads(data)  # cbor2 5.x (pure Python on armv7l): the prescan enforced the same rules
    except (cbor2.CBORDecodeError, ValueError, TypeError, OverflowError) as exc:
        raise DecodeError("bad_cbor", str(exc)[:200]) from exc


def _message(payload: bytes, limits: Limits, kind: MessageType) -> dict[str, object]:
    obj = _load(payload, limits)
    if not isinstance(obj, dict):
        raise DecodeError("not_a_map", f"top level is {type(obj).__name__}")
    if "v" not in obj:
        raise DecodeError("missing_key", "v")
    version = obj["v"]
    if type(version) is not int or version != SCHEMA_VERSION:
        raise DecodeError("bad_version", f"v = {version!r:.20}, expected {SCHEMA_VERSION}")
    if "type" not in obj:
        raise DecodeError("missing_key", "type")
    if obj["type"] != kind.value:
        raise DecodeError("wrong_type", f"type = {obj['type']!r:.40}, expected {kind.value!r}")
    return obj


def _keys(
    obj: object, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Check that ``obj`` is a map with exactly the known keys; return it."""
    if not isinstance(obj, dict):
        raise DecodeError("wrong_type", f"{where or 'message'}: expected a map, got {type(obj).__name__}")
    prefix = f"{where}." if where else ""
    for key in obj:
        if key not in required and key not in optional:
            raise DecodeError("unknown_key", prefix + _show(str(key)))
    for key in required:
        if key not in obj:
            raise DecodeError("missing_key", prefix + key)
    return obj


def _int(obj: Mapping[str, Any], key: str, where: str, lo: int = 0, hi: int = _INT_MAX) -> int:
    value = obj[key]
    name = f"{where}.{key}" if where else key
    if type(value) is not int:  # bool is an int subclass: rejected here on purpose
        raise DecodeError("wrong_type", f"{name}: expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        shown = str(value) if abs(value) < 10**20 else "huge"
        raise DecodeError("bad_value", f"{name} = {shown}: must be in [{lo}, {hi}]")
    return value


def _float(
    obj: Mapping[str, Any],
    key: str,
    where: str,
    lo: float = -math.inf,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
) -> float:
    value = obj[key]
    name = f"{where}.{key}" if where else key
    # integers are accepted: many CBOR encoders write 30.0 as 30
    if type(value) is not float and type(value) is not int:
        raise DecodeError("wrong_type", f"{name}: expected a number, got {type(value).__name__}")
    if type(value) is int and abs(value) > 2**53:
        raise DecodeError("bad_value", f"{name}: integer too large for a float")
    number = float(value)
    if not math.isfinite(number):
        raise DecodeError("not_finite", f"{name} = {number}")
    if number < lo or number > hi or (lo_open and number == lo):
        bracket = "(" if lo_open else "["
        raise DecodeError("bad_value", f"{name} = {number}: must be in {bracket}{lo}, {hi}]")
    return number


def _text(obj: Mapping[str, Any], key: str, where: str, pattern: re.Pattern[str]) -> str:
    value = obj[key]
    name = f"{where}.{key}" if where else key
    if type(value) is not str:
        raise DecodeError("wrong_type", f"{name}: expected a text string, got {type(value).__name__}")
    if pattern.fullmatch(value) is None:
        raise DecodeError("bad_value", f"{name} = {_show(value)}: must match {pattern.pattern}")
    return value


def _device_id(value: object, name: str) -> str:
    if type(value) is not str:
        raise DecodeError("wrong_type", f"{name}: expected a text string, got {type(value).__name__}")
    try:
        return check_device_id(value)
    except ValueError as exc:
        raise DecodeError("bad_value", f"{name} = {_show(value)}: {exc}") from exc


def _signature(obj: Mapping[str, Any], limits: Limits) -> bytes:
    if "signature" not in obj:
        return b""
    value = obj["signature"]
    if type(value) is not bytes:
        raise DecodeError("wrong_type", f"signature: expected a byte string, got {type(value).__name__}")
    if len(value) > limits.max_string_bytes:
        raise DecodeError("bad_value", f"signature: {len(value)} bytes > {limits.max_string_bytes}")
    return value


def _compression(obj: Mapping[str, Any], key: str) -> Compression:
    value = obj[key]
    if type(value) is not str:
        raise DecodeError("wrong_type", f"{key}: expected a text string, got {type(value).__name__}")
    try:
        return Compression(value)
    except ValueError as exc:
        raise DecodeError("bad_value", f"{key} = {_show(value)}: unknown compression") from exc


def is_valid_device_id(device: str) -> bool:
    """Tell whether ``device`` is a valid device id.

    Parameters
    ----------
    device : str
        Candidate id.

    Returns
    -------
    bool
        True if it matches ``[A-Za-z0-9_.-]{1,64}`` and is not ``.`` or ``..``
        (:func:`edgefl.validators.check_device_id`).
    """
    try:
        check_device_id(device)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------
# Arrays


def encode_array(a: npt.NDArray[Any]) -> cbor2.CBORTag:
    """Wrap an array as an RFC 8746 tag-40 row-major array of a little-endian typed array.

    Parameters
    ----------
    a : ndarray, 1 to 4 dimensions
        dtype one of uint8/16/32/64, int8/16/32/64, float16/32/64.

    Returns
    -------
    cbor2.CBORTag
        ``40([[d0, d1, ...], tag(bytes)])`` with the typed-array tag of the dtype (e.g. 85 for
        float32), bytes in C order, little-endian.

    Raises
    ------
    ValueError
        If the dtype is not supported or ``a`` has 0 or more than 4 dimensions.

    Source: RFC 8746 §2.1 (typed arrays), §3.1.1 (multi-dimensional arrays, tag 40).
    """
    array = np.asarray(a)
    tag = _ENCODE_TAGS.get(array.dtype.name)
    if tag is None:
        raise ValueError(f"dtype {array.dtype} has no typed-array tag here")
    if not 1 <= array.ndim <= _MAX_NDIM:
        raise ValueError(f"arrays must have 1 to {_MAX_NDIM} dimensions, got {array.ndim}")
    raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return cbor2.CBORTag(_TAG_NDARRAY, [list(array.shape), cbor2.CBORTag(tag, raw)])


def _shape(obj: object, name: str, limits: Limits) -> tuple[int, ...]:
    if not isinstance(obj, list | tuple):
        raise DecodeError("wrong_type", f"{name}: shape is not an array")
    if not 1 <= len(obj) <= _MAX_NDIM:
        raise DecodeError("bad_shape", f"{name}: {len(obj)} dimensions, expected 1 to {_MAX_NDIM}")
    if any(type(dim) is not int for dim in obj):
        raise DecodeError("wrong_type", f"{name}: shape entries must be integers")
    if any(dim < 1 for dim in obj):
        raise DecodeError("bad_shape", f"{name}: dimensions must be >= 1")
    if any(dim > limits.max_array_elements for dim in obj) or math.prod(obj) > limits.max_array_elements:
        raise DecodeError("too_large", f"{name}: more than {limits.max_array_elements} elements")
    return tuple(obj)


def decode_array(
    obj: object, *, limits: Limits, dtypes: frozenset[str], name: str = "array"
) -> npt.NDArray[Any]:
    """Decode a tag-40 typed array, checking everything before allocating.

    Parameters
    ----------
    obj : object
        What cbor2 decoded for the field.
    limits : Limits
        ``max_array_elements`` bounds ``prod(shape)``.
    dtypes : frozenset[str]
        Accepted numpy dtype names (``"float32"``, ``"int8"``...). Big-endian RFC 8746 tags are
        accepted too and converted.
    name : str
        Dotted field name used in error details.

    Returns
    -------
    ndarray
        A writable, C-contiguous array that owns its data, in native byte order, with the wire's
        shape. Float arrays are finite.

    Raises
    ------
    DecodeError
        ``wrong_type`` (not tag 40 / not ``[shape, typed array]``), ``bad_shape`` (element count
        differs from ``prod(shape)``, bad dimensions), ``too_large``, ``bad_dtype`` (typed-array
        tag not allowed for this field), ``not_finite``.

    Source: RFC 8746 §2.1, §3.1.1.
    """
    if not isinstance(obj, cbor2.CBORTag) or obj.tag != _TAG_NDARRAY:
        raise DecodeError("wrong_type", f"{name}: expected a tag-40 array")
    content = obj.value
    if not isinstance(content, list | tuple) or len(content) != 2:
        raise DecodeError("wrong_type", f"{name}: tag 40 must hold [shape, typed array]")
    shape = _shape(content[0], name, limits)
    typed = content[1]
    if not isinstance(typed, cbor2.CBORTag) or typed.tag not in _TYPED_ARRAY_TAGS:
        raise DecodeError("bad_dtype", f"{name}: elements are not an RFC 8746 typed array")
    wire_dtype = _TYPED_ARRAY_TAGS[typed.tag]
    if wire_dtype.name not in dtypes:
        wanted = ", ".join(sorted(dtypes))
        raise DecodeError("bad_dtype", f"{name}: {wire_dtype.name} (tag {typed.tag}), expected {wanted}")
    raw = typed.value
    if type(raw) is not bytes:
        raise DecodeError("wrong_type", f"{name}: typed array must hold a byte string")
    count = math.prod(shape)
    if len(raw) != count * wire_dtype.itemsize:
        raise DecodeError("bad_shape", f"{name}: {len(raw)} bytes for {list(shape)} {wire_dtype.name}")
    native = wire_dtype.newbyteorder("=")
    array = np.frombuffer(raw, dtype=wire_dtype).reshape(shape).astype(native, order="C", copy=True)
    if array.dtype.kind == "f" and not bool(np.isfinite(array).all()):
        raise DecodeError("not_finite", f"{name}: contains NaN or infinity")
    return array


# ---------------------------------------------------------------------------------------------------
# Delta compression


def topk_count(size: int, fraction: float) -> int:
    """Count the entries kept by top-k: ``k = ceil(fraction * size)``.

    Parameters
    ----------
    size : int
        Element count of the array, >= 0.
    fraction : float
        Fraction in (0, 1]. Read as the decimal it prints as, so ``0.1 * 30`` keeps 3, not 4.

    Returns
    -------
    int
        k in [min(1, size), size].

    Raises
    ------
    ValueError
        If ``fraction`` is not in (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"topk fraction {fraction} must be in (0, 1]")
    return min(size, math.ceil(Fraction(repr(float(fraction))) * size))


def _quantise(x: F32, scale: F32, rng: np.random.Generator | None) -> npt.NDArray[np.int8]:
    # scale broadcasts over x's last axis; an all-zero slice has scale 0 and quantises to 0
    divisor = np.where(scale > 0, scale, np.float32(1.0))
    ratio = x / divisor
    # stochastic: floor(r + u), u ~ U[0, 1), so E[levels] = r and E[q * scale] = x (QSGD-style)
    levels = np.rint(ratio) if rng is None else np.floor(ratio + rng.random(ratio.shape, dtype=np.float32))
    return np.clip(levels, -127, 127).astype(np.int8)


def _int8_scale(x: F32) -> F32:
    # one scale per slice along the last axis (per output unit); a single scale for 1-D arrays
    magnitude = np.abs(x)
    peak = magnitude.reshape(-1, x.shape[-1]).max(axis=0) if x.ndim > 1 else magnitude.max(keepdims=True)
    scale: F32 = (peak / np.float32(127.0)).astype(np.float32)
    return scale


def _cbor_head_bytes(argument: int) -> int:
    # bytes of a CBOR item head (initial byte + argument) for an argument >= 0 (RFC 8949 §3)
    if argument < 24:
        return 1
    if argument < 2**8:
        return 2
    if argument < 2**16:
        return 3
    return 5 if argument < 2**32 else 9


def _text_cbor_bytes(text: str) -> int:
    return _cbor_head_bytes(len(text)) + len(text)  # map keys here are ASCII


def _array_cbor_bytes(count: int, itemsize: int) -> int:
    # encode_array of a 1-D array: tag 40 (2), array(2) (1), [count] (1 + head), typed-array tag
    # (2: tags 64..86 take one argument byte), byte string head, the bytes
    nbytes = count * itemsize
    return 2 + 1 + 1 + _cbor_head_bytes(count) + 2 + _cbor_head_bytes(nbytes) + nbytes


def _rice_cbor_bytes(count: int, rice_k: int, quotient_bits: int) -> int:
    # "rice": {"k": k, "q": uint8 [ceil(q_bits/8)], "r": uint8 [ceil(count*k/8)] (absent if k = 0)}
    size = _text_cbor_bytes("rice") + 1 + _text_cbor_bytes("k") + _cbor_head_bytes(rice_k)
    size += _text_cbor_bytes("q") + _array_cbor_bytes((quotient_bits + 7) // 8, 1)
    if rice_k:
        size += _text_cbor_bytes("r") + _array_cbor_bytes((count * rice_k + 7) // 8, 1)
    return size


def _rice_parameter(gaps: I64) -> tuple[int, int]:
    """Pick the Rice parameter with the smallest encoded size; return (k, size in bytes).

    The unary stream of parameter k has ``sum(g >> k) + count`` bits and the remainders
    ``count * k`` bits; every k in [0, 15] is tried (16 vectorised passes) and ties go to the
    smallest k.
    """
    count = int(gaps.size)
    best_k, best_bytes = 0, -1
    for rice_k in range(_RICE_MAX_K + 1):
        quotient_bits = int(np.right_shift(gaps, rice_k).sum()) + count
        size = _rice_cbor_bytes(count, rice_k, quotient_bits)
        if best_bytes < 0 or size < best_bytes:
            best_k, best_bytes = rice_k, size
    return best_k, best_bytes


def _rice_encode(kept: I64, rice_k: int) -> dict[str, object]:
    """Golomb-Rice code the gaps between strictly increasing positions (layout: :func:`compress_delta`).

    Source: Golomb 1966, "Run-length encodings", IEEE Trans. Inf. Theory 12(3); Rice 1979.
    """
    gaps = np.diff(kept, prepend=-1) - 1
    quotients = np.right_shift(gaps, rice_k)
    # quotient q_i is q_i one bits then a zero (the terminator): terminator i sits at
    # sum_{j<=i}(q_j + 1) - 1; everything else in the stream is a one
    terminators = np.cumsum(quotients + 1) - 1
    unary = np.ones(int(terminators[-1]) + 1, dtype=np.uint8)
    unary[terminators] = 0
    out: dict[str, object] = {"k": rice_k, "q": encode_array(np.packbits(unary, bitorder="little"))}
    if rice_k:
        remainders = (gaps & ((1 << rice_k) - 1)).astype(np.uint16)
        planes = np.right_shift(remainders[:, None], np.arange(rice_k, dtype=np.uint16)) & 1
        out["r"] = encode_array(np.packbits(planes.astype(np.uint8).reshape(-1), bitorder="little"))
    return out


def compress_delta(
    delta: F32,
    compression: Compression,
    *,
    topk_fraction: float = 0.1,
    rng: np.random.Generator | None = None,
) -> dict[str, object]:
    """Encode one delta array as its wire sub-map.

    Layouts (every array a tag-40 typed array, see :func:`encode_array`):

    - ``none``: ``{"values": float32 [shape]}`` (exact).
    - ``float16``: ``{"values": float16 [shape]}``; values beyond ±65504 are clipped to it (the
      device's error-feedback residual keeps the excess) rather than sent as infinity.
    - ``int8``: ``{"q": int8 [shape], "scale": float32 [S]}`` with one scale per output unit: per
      slice along the last axis (``S = K`` for W [D, K]), ``S = 1`` for 1-D arrays.
      ``scale = max|x| / 127``, ``q = round(x / scale)``, decoded as ``q * scale``.
    - ``topk``: the ``k = ceil(fraction * size)`` largest-|x| entries of the flattened (C order)
      array: ``{"shape": [...], "indices": uint16|uint32 [k] (strictly increasing), "values":
      float32 [k]}``, or ``"mask": uint8 [ceil(size/8)]`` (bit i = byte i//8, bit i%8, LSB first)
      instead of ``"indices"`` when the mask is smaller (fraction > 1/16 with uint16 indices), or
      ``"rice"`` instead of either when its encoded size (key and value, in CBOR bytes) is
      strictly smaller than the one just chosen. Rice layout, for the positions ``p_0 < ... <
      p_{k-1}``: gaps ``g_i = p_i - p_{i-1} - 1`` (``p_{-1} = -1``), parameter ``m`` in [0, 15]
      (the ``m`` with the fewest bytes, smallest on ties), ``"rice": {"k": m, "q": uint8 [ceil(Q
      / 8)], "r": uint8 [ceil(k * m / 8)]}``. ``q`` is the unary code of the quotients ``g_i >>
      m``: for each i, ``g_i >> m`` one bits then a zero bit (the terminator), ``Q = sum(g_i >>
      m) + k`` bits in all, packed LSB first (stream bit j = byte j//8, bit j%8), zero padded.
      ``r`` holds the remainders ``g_i & (2**m - 1)``, m bits each, least significant bit first,
      in the same LSB-first packing, zero padded; ``"r"`` is absent when ``m = 0``. E.g.
      positions [0, 3, 4, 12] with m = 1: gaps [0, 2, 0, 7], quotients [0, 1, 0, 3] → bits
      0 10 0 1110 → ``q = [0x72]``; remainders [0, 0, 0, 1] → ``r = [0x08]``.
    - ``topk-int8``: as ``topk`` with ``"q": int8 [k], "scale": float32 [1]`` instead of
      ``"values"``.

    Rounding is to nearest by default: it is deterministic, so :func:`compressed_roundtrip` gives
    exactly what the coordinator decodes, and its error (≤ scale/2) is half the worst case of
    stochastic rounding; its bias is removed by the device's error feedback. With ``rng``,
    rounding is stochastic and unbiased (error ≤ scale), for use without error feedback.

    Parameters
    ----------
    delta : float32 [...], 1 to 4 dimensions
        Dense delta, finite.
    compression : Compression
        Wire encoding.
    topk_fraction : float
        Fraction in (0, 1] kept by ``topk``/``topk-int8``.
    rng : numpy.random.Generator, optional
        Enables stochastic rounding for ``int8``/``topk-int8``.

    Returns
    -------
    dict[str, object]
        The sub-map, ready for ``cbor2.dumps``.

    Raises
    ------
    ValueError
        If ``delta`` is not finite, has 0 or > 4 dimensions, is empty, or has more than 2**32
        elements (top-k), or ``topk_fraction`` is not in (0, 1].

    Source: Alistarh et al. 2017, QSGD (stochastic rounding); Jacob et al. 2018 (per-channel int8);
    Aji & Heafield 2017 and Stich et al. 2018 (top-k sparsification with error feedback); Golomb
    1966, "Run-length encodings", IEEE Trans. Inf. Theory 12(3), and Rice 1979 (Rice codes).
    """
    x = np.ascontiguousarray(delta, dtype=np.float32)
    if not 1 <= x.ndim <= _MAX_NDIM or x.size == 0:
        raise ValueError(f"delta must be a non-empty array of 1 to {_MAX_NDIM} dimensions, got {x.shape}")
    if not bool(np.isfinite(x).all()):
        raise ValueError("delta contains NaN or infinity")
    mode = Compression(compression)
    if mode is Compression.NONE:
        return {"values": encode_array(x)}
    if mode is Compression.FLOAT16:
        return {"values": encode_array(np.clip(x, -_FLOAT16_MAX, _FLOAT16_MAX).astype(np.float16))}
    if mode is Compression.INT8:
        scale = _int8_scale(x)
        return {"q": encode_array(_quantise(x, scale, rng)), "scale": encode_array(scale)}
    flat = x.reshape(-1)
    size = flat.size
    if size > 2**32:
        raise ValueError(f"top-k indices are uint32: {size} elements is too many")
    k = topk_count(size, topk_fraction)
    kept = np.sort(np.argpartition(np.abs(flat), size - k)[size - k :])
    out: dict[str, object] = {"shape": list(x.shape)}
    index_dtype = np.uint16 if size <= 2**16 else np.uint32
    index_bytes = np.dtype(index_dtype).itemsize
    mask_bytes = (size + 7) // 8
    use_mask = mask_bytes < k * index_bytes
    if use_mask:
        chosen_bytes = _text_cbor_bytes("mask") + _array_cbor_bytes(mask_bytes, 1)
    else:
        chosen_bytes = _text_cbor_bytes("indices") + _array_cbor_bytes(k, index_bytes)
    positions = kept.astype(np.int64)  # argpartition gives intp: int32 on armv7l
    rice_k, rice_bytes = _rice_parameter(np.diff(positions, prepend=-1) - 1)
    if rice_bytes < chosen_bytes:
        out["rice"] = _rice_encode(positions, rice_k)
    elif use_mask:
        mask = np.zeros(size, dtype=np.bool_)
        mask[kept] = True
        out["mask"] = encode_array(np.packbits(mask, bitorder="little"))
    else:
        out["indices"] = encode_array(kept.astype(index_dtype))
    values = flat[kept]
    if mode is Compression.TOPK:
        out["values"] = encode_array(values)
    else:
        scale = _int8_scale(values)
        out["q"] = encode_array(_quantise(values, scale, rng))
        out["scale"] = encode_array(scale)
    return out


def _kind_of(sub: Mapping[str, Any]) -> Compression:
    # infer the layout from its marker keys; _keys() then rejects anything extra or missing
    if "shape" in sub:
        return Compression.TOPK_INT8 if "q" in sub else Compression.TOPK
    if "q" in sub or "scale" in sub:
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
        raise DecodeError("not_finite", f"{name}: decodes to NaN or infinity")
    return array


def _scale(obj: object, name: str, expected: tuple[int, ...], limits: Limits) -> F32:
    scale: F32 = decode_array(obj, limits=limits, dtypes=frozenset({"float32"}), name=name)
    if scale.shape != expected:
        raise DecodeError("bad_shape", f"{name}: shape {list(scale.shape)}, expected {list(expected)}")
    if bool((scale < 0).any()):
        raise DecodeError("bad_value", f"{name}: scales must be >= 0")
    return scale


def _rice_decode(obj: object, count: int, size: int, limits: Limits, name: str) -> I64:
    """Decode Rice-coded positions (layout: :func:`compress_delta`), strictly and boundedly.

    Parameters
    ----------
    obj : object
        What cbor2 decoded for ``<name>.rice``.
    count : int
        Number of positions (the values' length), >= 1.
    size : int
        Element count of the dense array; every position must be < size.
    limits : Limits
        Decoding bounds for the two byte arrays.
    name : str
        Dotted field name of the rice map, used in error details.

    Returns
    -------
    int64 [count]
        Strictly increasing positions in [0, size).

    Raises
    ------
    DecodeError
        ``wrong_type``, ``unknown_key``, ``missing_key``, ``bad_dtype``, ``bad_shape`` (malformed
        fields), ``bad_indices`` (k outside [0, 15], ``q`` longer than ``ceil(size/8)`` bytes, too
        few terminators, bytes after the one holding the last terminator, one bits after it, ``r``
        not ``ceil(count*k/8)`` bytes or its padding set, ``r`` present with k = 0, positions
        >= size).

    Source: Golomb 1966, "Run-length encodings", IEEE Trans. Inf. Theory 12(3); Rice 1979.
    """
    sub = _keys(obj, name, ("k", "q"), ("r",))
    rice_k = sub["k"]
    if type(rice_k) is not int:
        raise DecodeError("wrong_type", f"{name}.k: expected an integer, got {type(rice_k).__name__}")
    if not 0 <= rice_k <= _RICE_MAX_K:
        shown = str(rice_k) if abs(rice_k) < 10**20 else "huge"
        raise DecodeError("bad_indices", f"{name}.k = {shown}: must be in [0, {_RICE_MAX_K}]")
    if count > size:
        raise DecodeError("bad_indices", f"{name}: {count} positions for {size} elements")
    u8 = frozenset({"uint8"})
    q = decode_array(sub["q"], limits=limits, dtypes=u8, name=f"{name}.q")
    if q.ndim != 1:
        raise DecodeError("bad_shape", f"{name}.q: must be 1-D")
    # a valid stream has sum(g >> k) + count <= sum(g) + count = last position + 1 <= size bits:
    # checked before unpacking, so the unpacked bits take at most size + 7 bytes
    if q.size > (size + 7) // 8:
        raise DecodeError("bad_indices", f"{name}.q: {q.size} bytes > {(size + 7) // 8} for size {size}")
    bits = np.unpackbits(q, bitorder="little")
    zeros = np.flatnonzero(bits == 0)
    if zeros.size < count:
        raise DecodeError("bad_indices", f"{name}.q: {zeros.size} terminators for {count} positions")
    last = int(zeros[count - 1])
    if last < 8 * (q.size - 1):
        raise DecodeError("bad_indices", f"{name}.q: bytes after the one holding the last terminator")
    if bool(bits[last + 1 :].any()):
        raise DecodeError("bad_indices", f"{name}.q: bits set after the last terminator")
    terminators: I64 = zeros[:count].astype(np.int64)
    quotients: I64 = np.subtract(np.diff(terminators, prepend=-1), 1, dtype=np.int64)
    if rice_k == 0:
        if "r" in sub:
            raise DecodeError("bad_indices", f"{name}.r: present with k = 0")
        gaps = quotients
    else:
        if "r" not in sub:
            raise DecodeError("missing_key", f"{name}.r")
        r = decode_array(sub["r"], limits=limits, dtypes=u8, name=f"{name}.r")
        r_bits = count * rice_k
        if r.shape != ((r_bits + 7) // 8,):
            raise DecodeError(
                "bad_indices", f"{name}.r: shape {list(r.shape)}, expected [{(r_bits + 7) // 8}]"
            )
        if r_bits % 8 and int(r[-1]) >> (r_bits % 8):
            raise DecodeError("bad_indices", f"{name}.r: padding bits set")
        planes = np.unpackbits(r, count=r_bits, bitorder="little").reshape(count, rice_k)
        remainders = planes @ np.left_shift(np.uint16(1), np.arange(rice_k, dtype=np.uint16))
        # sum(quotients) <= 8 * len(q) and remainders < 2**15: no int64 overflow below
        gaps = np.left_shift(quotients, rice_k) + remainders.astype(np.int64)
    positions: I64 = np.cumsum(gaps + 1, dtype=np.int64) - 1
    if int(positions[-1]) >= size:
        raise DecodeError("bad_indices", f"{name}: position {int(positions[-1])} >= size {size}")
    return positions


def decompress_delta(
    obj: object,
    shape: tuple[int, ...] | None,
    *,
    limits: Limits,
    compression: Compression | None = None,
    name: str = "delta",
) -> F32:
    """Decode one delta sub-map (see :func:`compress_delta`) into a dense float32 array.

    Parameters
    ----------
    obj : object
        What cbor2 decoded for the sub-map.
    shape : tuple[int, ...] or None
        Expected shape; None accepts the wire's shape (still bounded by ``limits``).
    limits : Limits
        Decoding bounds.
    compression : Compression, optional
        If given, the sub-map's layout must be this one.
    name : str
        Dotted field name used in error details.

    Returns
    -------
    float32 [shape]
        Dense, writable, C-contiguous, owned, finite.

    Raises
    ------
    DecodeError
        ``wrong_type``, ``unknown_key``, ``missing_key``, ``bad_value`` (layout differs from
        ``compression``, negative scale), ``bad_shape``, ``bad_dtype``, ``too_large``,
        ``not_finite``, ``bad_indices`` (out of range, not strictly increasing, mask padding set,
        count differs from the values, not exactly one of indices/mask/rice, malformed Rice
        streams: see :func:`_rice_decode`).
    """
    if not isinstance(obj, dict):
        raise DecodeError("wrong_type", f"{name}: expected a map, got {type(obj).__name__}")
    kind = _kind_of(obj)
    if compression is not None and kind is not compression:
        raise DecodeError("bad_value", f"{name}: encoded as {kind.value}, message says {compression.value}")

    def check_shape(got: tuple[int, ...]) -> None:
        if shape is not None and got != tuple(shape):
            raise DecodeError("bad_shape", f"{name}: shape {list(got)}, expected {list(shape)}")

    if kind in (Compression.NONE, Compression.FLOAT16):
        sub = _keys(obj, name, ("values",))
        dtype = "float32" if kind is Compression.NONE else "float16"
        values = decode_array(sub["values"], limits=limits, dtypes=frozenset({dtype}), name=f"{name}.values")
        check_shape(values.shape)
        return values.astype(np.float32, copy=False)
    if kind is Compression.INT8:
        sub = _keys(obj, name, ("q", "scale"))
        q = decode_array(sub["q"], limits=limits, dtypes=frozenset({"int8"}), name=f"{name}.q")
        check_shape(q.shape)
        scale = _scale(sub["scale"], f"{name}.scale", (q.shape[-1],) if q.ndim > 1 else (1,), limits)
        with np.errstate(over="ignore"):  # an absurd scale overflows to inf: rejected just below
            dense: F32 = q.astype(np.float32) * scale
        return _finite_or_raise(dense, name)

    value_keys = ("values",) if kind is Compression.TOPK else ("q", "scale")
    position_keys = ("indices", "mask", "rice")
    sub = _keys(obj, name, ("shape", *value_keys), position_keys)
    full_shape = _shape(sub["shape"], f"{name}.shape", limits)
    check_shape(full_shape)
    size = math.prod(full_shape)
    present = sum(key in sub for key in position_keys)
    if present != 1:
        raise DecodeError(
            "missing_key" if present == 0 else "bad_indices", f"{name}: exactly one of indices, mask, rice"
        )
    # the values come first: their length is the position count the Rice decoder needs
    if kind is Compression.TOPK:
        f32 = frozenset({"float32"})
        values = decode_array(sub["values"], limits=limits, dtypes=f32, name=f"{name}.values")
    else:
        q = decode_array(sub["q"], limits=limits, dtypes=frozenset({"int8"}), name=f"{name}.q")
        scale = _scale(sub["scale"], f"{name}.scale", (1,), limits)
        with np.errstate(over="ignore"):
            values = q.astype(np.float32) * scale
    if values.ndim != 1:
        raise DecodeError("bad_indices", f"{name}: values of shape {list(values.shape)}, expected 1-D")
    if "rice" in sub:
        kept = _rice_decode(sub["rice"], values.shape[0], size, limits, f"{name}.rice")
    elif "indices" in sub:
        wire = decode_array(
            sub["indices"], limits=limits, dtypes=frozenset({"uint16", "uint32"}), name=f"{name}.indices"
        )
        if wire.ndim != 1:
            raise DecodeError("bad_shape", f"{name}.indices: must be 1-D")
        kept = wire.astype(np.int64)
        if kept.size and int(kept[-1]) >= size:
            raise DecodeError("bad_indices", f"{name}.indices: index >= size {size}")
        if kept.size > 1 and not bool((np.diff(kept) > 0).all()):
            raise DecodeError("bad_indices", f"{name}.indices: not strictly increasing")
    else:
        mask = decode_array(sub["mask"], limits=limits, dtypes=frozenset({"uint8"}), name=f"{name}.mask")
        mask_bytes = (size + 7) // 8
        if mask.shape != (mask_bytes,):
            raise DecodeError("bad_shape", f"{name}.mask: shape {list(mask.shape)}, expected [{mask_bytes}]")
        if size % 8 and int(mask[-1]) >> (size % 8):
            raise DecodeError("bad_indices", f"{name}.mask: padding bits set")
        kept = np.flatnonzero(np.unpackbits(mask, count=size, bitorder="little"))
    k = kept.size
    if values.shape != (k,):
        raise DecodeError("bad_indices", f"{name}: {k} positions for values of shape {list(values.shape)}")
    dense = np.zeros(full_shape, dtype=np.float32)
    dense.reshape(-1)[kept] = values  # a view of the C-contiguous array: writes into dense
    return _finite_or_raise(dense, name)


def compressed_roundtrip(
    delta: F32,
    compression: Compression,
    *,
    topk_fraction: float = 0.1,
    rng: np.random.Generator | None = None,
) -> F32:
    """Return exactly what the coordinator will decode for ``delta`` (for error feedback).

    The device keeps ``residual = delta - compressed_roundtrip(delta, ...)`` and adds it to the next
    round's delta. With stochastic rounding (``rng``), pass a generator in the same state as the one
    given to :func:`encode_update` (e.g. two ``default_rng(seed)``), compressing W then b, so the
    draws match.

    Parameters
    ----------
    delta : float32 [...]
        Dense delta, finite.
    compression : Compression
        Wire encoding.
    topk_fraction : float
        Fraction kept by top-k.
    rng : numpy.random.Generator, optional
        Stochastic rounding for int8 layouts.

    Returns
    -------
    float32, same shape as ``delta``
        ``decompress_delta(compress_delta(delta, ...))``.

    Raises
    ------
    ValueError
        As :func:`compress_delta`.
    """
    x = np.asarray(delta, dtype=np.float32)
    sub = compress_delta(x, compression, topk_fraction=topk_fraction, rng=rng)
    return decompress_delta(sub, x.shape, limits=_NO_LIMITS, compression=Compression(compression))


# ---------------------------------------------------------------------------------------------------
# Messages


def _check_head_shapes(w: F32, b: F32, where: str, expect_shape: tuple[int, int] | None) -> None:
    if expect_shape is not None:
        want_w, want_b = tuple(expect_shape), (expect_shape[1],)
    else:
        if w.ndim != 2:
            raise DecodeError("bad_shape", f"{where}.W: shape {list(w.shape)}, expected [D, K]")
        want_w, want_b = w.shape, (w.shape[1],)
    if w.shape != want_w:
        raise DecodeError("bad_shape", f"{where}.W: shape {list(w.shape)}, expected {list(want_w)}")
    if b.shape != want_b:
        raise DecodeError("bad_shape", f"{where}.b: shape {list(b.shape)}, expected {list(want_b)}")


def encode_global_model(msg: GlobalModel) -> bytes:
    """Encode a :class:`GlobalModel`.

    Parameters
    ----------
    msg : GlobalModel
        W float32 [D, K], b float32 [K].

    Returns
    -------
    bytes
        ``{"v", "type": "global_model", "round", "version", "model_sha256", "head": {"W", "b"},
        "signature"}``.
    """
    return cbor2.dumps(
        {
            "v": SCHEMA_VERSION,
            "type": MessageType.GLOBAL_MODEL.value,
            "round": int(msg.round),
            "version": int(msg.version),
            "model_sha256": msg.model_sha256,
            "head": {
                "W": encode_array(np.asarray(msg.W, dtype=np.float32)),
                "b": encode_array(np.asarray(msg.b, dtype=np.float32)),
            },
            "signature": bytes(msg.signature),
        }
    )


def decode_global_model(
    payload: bytes, *, limits: Limits = Limits(), expect_shape: tuple[int, int] | None = None
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
        See the module docstring for the reasons; ``signature`` is optional on the wire.
    """
    obj = _message(payload, limits, MessageType.GLOBAL_MODEL)
    _keys(obj, "", ("v", "type", "round", "version", "model_sha256", "head"), ("signature",))
    round_, version = _int(obj, "round", ""), _int(obj, "version", "")
    model_sha256 = _text(obj, "model_sha256", "", _SHA256_RE)
    signature = _signature(obj, limits)
    head = _keys(obj["head"], "head", ("W", "b"))
    f32 = frozenset({"float32"})
    w = decode_array(head["W"], limits=limits, dtypes=f32, name="head.W")
    b = decode_array(head["b"], limits=limits, dtypes=f32, name="head.b")
    _check_head_shapes(w, b, "head", expect_shape)
    return GlobalModel(
        round=round_, version=version, model_sha256=model_sha256, W=w, b=b, signature=signature
    )


def encode_round(msg: RoundAnnouncement) -> bytes:
    """Encode a :class:`RoundAnnouncement`.

    Parameters
    ----------
    msg : RoundAnnouncement
        The round.

    Returns
    -------
    bytes
        ``{"v", "type": "round", "round", "base_version", "deadline_s", "local_epochs", "lr",
        "batch_size", "min_clients", "selected", "compression", "topk_fraction", "prox_mu",
        "signature"}``; ``selected`` is an array of device ids or a float fraction.
    """
    selected: object = (
        float(msg.selected) if isinstance(msg.selected, int | float) else [str(d) for d in msg.selected]
    )
    return cbor2.dumps(
        {
            "v": SCHEMA_VERSION,
            "type": MessageType.ROUND.value,
            "round": int(msg.round),
            "base_version": int(msg.base_version),
            "deadline_s": float(msg.deadline_s),
            "local_epochs": int(msg.local_epochs),
            "lr": float(msg.lr),
            "batch_size": int(msg.batch_size),
            "min_clients": int(msg.min_clients),
            "selected": selected,
            "compression": Compression(msg.compression).value,
            "topk_fraction": float(msg.topk_fraction),
            "prox_mu": float(msg.prox_mu),
            "signature": bytes(msg.signature),
        }
    )


def decode_round(payload: bytes, *, limits: Limits = Limits()) -> RoundAnnouncement:
    """Decode and validate a :class:`RoundAnnouncement`.

    Parameters
    ----------
    payload : bytes
        The MQTT payload.
    limits : Limits
        Decoding bounds.

    Returns
    -------
    RoundAnnouncement
        Keys with a dataclass default (``compression``, ``topk_fraction``, ``prox_mu``,
        ``signature``) may be absent on the wire and take that default.

    Raises
    ------
    DecodeError
        See the module docstring; ``bad_value`` for out-of-range numbers, a duplicate or invalid
        device id in ``selected``.
    """
    obj = _message(payload, limits, MessageType.ROUND)
    required = (
        "v",
        "type",
        "round",
        "base_version",
        "deadline_s",
        "local_epochs",
        "lr",
        "batch_size",
        "min_clients",
        "selected",
    )
    _keys(obj, "", required, ("compression", "topk_fraction", "prox_mu", "signature"))
    raw_selected = obj["selected"]
    selected: tuple[str, ...] | float
    if isinstance(raw_selected, list):
        selected = tuple(_device_id(device, f"selected[{i}]") for i, device in enumerate(raw_selected))
        if len(set(selected)) != len(selected):
            raise DecodeError("bad_value", "selected: duplicate device ids")
    else:
        selected = _float(obj, "selected", "", 0.0, 1.0, lo_open=True)
    return RoundAnnouncement(
        round=_int(obj, "round", ""),
        base_version=_int(obj, "base_version", ""),
        deadline_s=_float(obj, "deadline_s", "", 0.0, MAX_DEADLINE_S, lo_open=True),
        local_epochs=_int(obj, "local_epochs", "", 1, MAX_LOCAL_EPOCHS),
        lr=_float(obj, "lr", "", 0.0, MAX_LR, lo_open=True),
        batch_size=_int(obj, "batch_size", "", 1, MAX_BATCH_SIZE),
        min_clients=_int(obj, "min_clients", "", 1, MAX_CLIENTS),
        selected=selected,
        compression=_compression(obj, "compression") if "compression" in obj else Compression.NONE,
        topk_fraction=(
            _float(obj, "topk_fraction", "", 0.0, 1.0, lo_open=True) if "topk_fraction" in obj else 0.1
        ),
        prox_mu=_float(obj, "prox_mu", "", 0.0, MAX_PROX_MU) if "prox_mu" in obj else 0.0,
        signature=_signature(obj, limits),
    )


def encode_update(
    msg: Update, *, rng: np.random.Generator | None = None, topk_fraction: float = 0.1
) -> bytes:
    """Encode an :class:`Update`, compressing its deltas per ``msg.compression``.

    Parameters
    ----------
    msg : Update
        delta_W float32 [D, K], delta_b float32 [K], finite.
    rng : numpy.random.Generator, optional
        Stochastic rounding for int8 layouts (W is compressed before b).
    topk_fraction : float
        Fraction kept by ``topk``/``topk-int8`` (the round's ``topk_fraction``).

    Returns
    -------
    bytes
        ``{"v", "type": "update", "round", "base_version", "device", "num_examples",
        "compression", "delta": {"W": sub-map, "b": sub-map}, "metrics": {"loss", "accuracy",
        "train_s", "peak_rss_bytes"}, "update_id", "signature"}``.

    Raises
    ------
    ValueError
        As :func:`compress_delta` (non-finite delta, bad fraction).
    """
    mode = Compression(msg.compression)
    delta = {
        "W": compress_delta(msg.delta_W, mode, topk_fraction=topk_fraction, rng=rng),
        "b": compress_delta(msg.delta_b, mode, topk_fraction=topk_fraction, rng=rng),
    }
    return cbor2.dumps(
        {
            "v": SCHEMA_VERSION,
            "type": MessageType.UPDATE.value,
            "round": int(msg.round),
            "base_version": int(msg.base_version),
            "device": msg.device,
            "num_examples": int(msg.num_examples),
            "compression": mode.value,
            "delta": delta,
            "metrics": {
                "loss": float(msg.metrics.loss),
                "accuracy": float(msg.metrics.accuracy),
                "train_s": float(msg.metrics.train_s),
                "peak_rss_bytes": int(msg.metrics.peak_rss_bytes),
            },
            "update_id": msg.update_id,
            "signature": bytes(msg.signature),
        }
    )


def decode_update(
    payload: bytes, *, limits: Limits = Limits(), expect_shape: tuple[int, int] | None = None
) -> Update:
    """Decode and validate an :class:`Update`, decompressing its deltas to dense float32.

    Parameters
    ----------
    payload : bytes
        The MQTT payload.
    limits : Limits
        Decoding bounds.
    expect_shape : tuple[int, int], optional
        (D, K) of the global head; delta W must be [D, K] and b [K]. Without it, W must be 2-D and
        b [W.shape[1]].

    Returns
    -------
    Update
        Dense float32 deltas (writable, owned), ``compression`` as sent.

    Raises
    ------
    DecodeError
        See the module docstring; ``bad_value`` for ``num_examples < 1``, accuracy outside
        [0, 1], negative ``train_s``/``peak_rss_bytes``, invalid ids.
    """
    obj = _message(payload, limits, MessageType.UPDATE)
    required = (
        "v",
        "type",
        "round",
        "base_version",
        "device",
        "num_examples",
        "compression",
        "delta",
        "metrics",
        "update_id",
    )
    _keys(obj, "", required, ("signature",))
    mode = _compression(obj, "compression")
    delta = _keys(obj["delta"], "delta", ("W", "b"))
    want_w = tuple(expect_shape) if expect_shape is not None else None
    delta_w = decompress_delta(delta["W"], want_w, limits=limits, compression=mode, name="delta.W")
    want_b = (expect_shape[1],) if expect_shape is not None else None
    delta_b = decompress_delta(delta["b"], want_b, limits=limits, compression=mode, name="delta.b")
    _check_head_shapes(delta_w, delta_b, "delta", expect_shape)
    metrics = _keys(obj["metrics"], "metrics", ("loss", "accuracy", "train_s", "peak_rss_bytes"))
    return Update(
        round=_int(obj, "round", ""),
        base_version=_int(obj, "base_version", ""),
        device=_device_id(obj["device"], "device"),
        num_examples=_int(obj, "num_examples", "", 1),
        delta_W=delta_w,
        delta_b=delta_b,
        metrics=UpdateMetrics(
            loss=_float(metrics, "loss", "metrics"),
            accuracy=_float(metrics, "accuracy", "metrics", 0.0, 1.0),
            train_s=_float(metrics, "train_s", "metrics", 0.0),
            peak_rss_bytes=_int(metrics, "peak_rss_bytes", "metrics"),
        ),
        update_id=_text(obj, "update_id", "", _UPDATE_ID_RE),
        compression=mode,
        signature=_signature(obj, limits),
    )


def encode_status(msg: DeviceStatus) -> bytes:
    """Encode a :class:`DeviceStatus`.

    Parameters
    ----------
    msg : DeviceStatus
        ``fields`` must hold plain Python JSON-like values (no numpy scalars).

    Returns
    -------
    bytes
        ``{"v", "type": "status", "device", "state", "fields": {...}}``.

    Raises
    ------
    cbor2.CBOREncodeError
        If ``fields`` holds a value cbor2 cannot encode.
    """
    return cbor2.dumps(
        {
            "v": SCHEMA_VERSION,
            "type": MessageType.STATUS.value,
            "device": msg.device,
            "state": msg.state,
            "fields": dict(msg.fields),
        }
    )


def _json_like(value: object, name: str) -> object:
    # depth, string lengths, item counts and text keys are already bounded by the pre-scan
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        if abs(value) > _INT_MAX:
            raise DecodeError("bad_value", f"{name}: integer out of int64 range")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DecodeError("not_finite", f"{name} = {value}")
        return value
    if isinstance(value, list | tuple):
        return [_json_like(item, f"{name}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        return _json_map(value, name)
    raise DecodeError("wrong_type", f"{name}: {type(value).__name__} is not a JSON-like value")


def _json_map(value: object, name: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise DecodeError("wrong_type", f"{name}: expected a map, got {type(value).__name__}")
    return {str(key): _json_like(item, f"{name}.{_show(str(key))}") for key, item in value.items()}


def decode_status(payload: bytes, *, limits: Limits = Limits()) -> DeviceStatus:
    """Decode and validate a :class:`DeviceStatus`.

    Parameters
    ----------
    payload : bytes
        The MQTT payload (retained ``status/<device>`` messages included).
    limits : Limits
        Decoding bounds; they also bound ``fields``.

    Returns
    -------
    DeviceStatus
        ``fields`` as a fresh dict of plain Python values (arrays as lists); ``{}`` if absent.

    Raises
    ------
    DecodeError
        See the module docstring; ``wrong_type`` for byte strings or tags inside ``fields``,
        ``not_finite`` for NaN/infinity.
    """
    obj = _message(payload, limits, MessageType.STATUS)
    _keys(obj, "", ("v", "type", "device", "state"), ("fields",))
    return DeviceStatus(
        device=_device_id(obj["device"], "device"),
        state=_text(obj, "state", "", _STATE_RE),
        fields=_json_map(obj["fields"], "fields") if "fields" in obj else {},
    )


def offline_status(device: str) -> bytes:
    """Return the last-will payload of ``device``: a :class:`DeviceStatus` with state ``offline``.

    Parameters
    ----------
    device : str
        Device id.

    Returns
    -------
    bytes
        ``encode_status(DeviceStatus(device, "offline", {}))``.

    Raises
    ------
    ValueError
        If ``device`` is not a valid device id (the broker would publish it forever).
    """
    check_device_id(device)
    return encode_status(DeviceStatus(device=device, state="offline", fields={}))
