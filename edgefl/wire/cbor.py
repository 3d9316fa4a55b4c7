"""Bounded CBOR and the message envelope: what every decoder runs before it looks at a field.

The schema version, message kinds, :class:`Limits`, the allocation-free header scan and the field
readers every decoder shares; rules and bounds: ``docs/protocol.md`` ("Decoding"). Source: RFC 8949
(CBOR) §3 (encoding), §4.2.1 (deterministic encoding).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, TypeVar

import cbor2

from edgefl.errors import DecodeError
from edgefl.validators import check_device_id
from edgefl.wire.reasons import Reason

_Choice = TypeVar("_Choice", bound=StrEnum)

#: The schema every message is written in and the only one read (``docs/protocol.md``, "Versioning").
SCHEMA_VERSION: Final = 1

INT_MAX: Final = 2**63 - 1  # fits int64 everywhere downstream (JSON, Prometheus, numpy)
#: Tags a message may hold: 40 and the typed arrays ``edgefl.wire.arrays`` decodes (RFC 8746 §3.1.1, §2.1).
ALLOWED_TAGS: Final = frozenset({40, *range(64, 68), *range(69, 76), *range(77, 83), 84, 85, 86})


@dataclass(frozen=True, slots=True)
class Limits:
    """Decoding bounds, each checked before the memory it guards is allocated; ValueError if one is < 1.

    Each bound and its default: ``docs/protocol.md`` ("Decoding"); ``max_string_bytes`` also bounds a
    signature, ``max_items`` counts a typed array as one item.
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


#: The default bounds of the message decoders.
DEFAULT_LIMITS: Final = Limits()
#: For data the caller already holds (its own encoding): no bound but correctness.
NO_LIMITS: Final = Limits(
    max_message_bytes=2**62, max_depth=64, max_array_elements=2**62, max_string_bytes=2**62, max_items=2**62
)


class MessageType(StrEnum):
    """The ``"type"`` of a message."""

    GLOBAL_MODEL = "global_model"
    ROUND = "round"
    UPDATE = "update"
    DECLINE = "decline"
    STATUS = "status"
    CHUNK = "chunk"
    PARTIAL = "partial"
    SAMPLE = "sample"
    LABEL = "label"
    PREDICTION = "prediction"
    REFUSAL = "refusal"
    PRESENCE = "presence"


def cbor_head_bytes(argument: int) -> int:
    """Bytes of a CBOR item head (initial byte + argument) for an argument >= 0 (RFC 8949 §3)."""
    if argument < 24:
        return 1
    if argument < 2**8:
        return 2
    if argument < 2**16:
        return 3
    return 5 if argument < 2**32 else 9


def _head(major: int, argument: int) -> bytes:
    """The initial byte(s) of a CBOR data item: major type and argument (RFC 8949 §3)."""
    if argument < 24:
        return bytes([major << 5 | argument])
    width = cbor_head_bytes(argument) - 1
    info = {1: 24, 2: 25, 4: 26, 8: 27}[width]
    return bytes([major << 5 | info]) + argument.to_bytes(width, "big")


def dumps(obj: object) -> bytes:
    """Encode a message with CBOR's preferred serialization of floats; the key order is kept.

    A float takes the shortest of half, single and double precision that holds it exactly; map keys
    keep their order (``"signature"`` stays last); cbor2.CBOREncodeError for what cbor2 cannot encode.
    Source: RFC 8949 §4.1 (preferred serialization), §3.3 (floating-point numbers).
    """
    if type(obj) is float:
        return cbor2.dumps(obj, canonical=True)
    if type(obj) is dict:
        return _head(5, len(obj)) + b"".join(part for pair in obj.items() for part in map(dumps, pair))
    if type(obj) is list:
        return _head(4, len(obj)) + b"".join(dumps(item) for item in obj)
    return cbor2.dumps(obj)


def dump_message(kind: MessageType, fields: Mapping[str, object]) -> bytes:
    """Encode a message of type ``kind``: ``v``, ``type``, then ``fields`` in their order (:func:`dumps`)."""
    return dumps({"v": SCHEMA_VERSION, "type": kind.value, **fields})


def show(text: str) -> str:
    """Attacker-chosen text as it may appear in an error detail: at most 64 characters, printable."""
    short = text[:64]
    return short if short.isprintable() else ascii(short)


def _cbor2_strict() -> bool:
    """Whether this cbor2 takes max_depth, allow_indefinite and allow_duplicate_keys (6.x does, 5.x not)."""
    try:
        cbor2.loads(b"\xa0", max_depth=2, allow_indefinite=False, allow_duplicate_keys=False)
    except TypeError:
        return False
    return True


#: Whether the installed cbor2 enforces depth, definite lengths and unique keys itself (6.x).
CBOR2_STRICT: Final = _cbor2_strict()


def strict_loads(data: bytes, max_depth: int) -> object:
    """``cbor2.loads`` of one item, refusing indefinite lengths, duplicate keys, depth > ``max_depth``.

    Where cbor2 can (6.x): for bytes the product wrote itself; network bytes go through :func:`load`.
    Raises cbor2.CBORDecodeError or ValueError.
    """
    if CBOR2_STRICT:
        return cbor2.loads(data, max_depth=max_depth, allow_indefinite=False, allow_duplicate_keys=False)
    return cbor2.loads(data)  # cbor2 5.x (armv7l)


@dataclass(frozen=True, slots=True)
class Scanned:
    """A message whose item headers :func:`scan` walked and found sound: pass it on instead of its bytes.

    ``data`` the message, ``limits`` the bounds it was scanned under (a decoder given others scans
    again), ``header`` every top-level unsigned-integer or text value by key (``v``, ``round``...).
    """

    data: bytes
    limits: Limits
    header: Mapping[str, int | str]


def scan(payload: bytes, limits: Limits) -> Scanned:
    """Check a received message's size and walk its CBOR item headers once, building no object.

    Step 2 of ``docs/protocol.md`` ("Decoding"); the result carries the top-level values a signature
    check needs. DecodeError ``wrong_type``, ``too_large``, ``bad_cbor``, ``too_deep``, ``bad_value``
    (long text), ``trailing_bytes``.
    Source: RFC 8949 §3 (initial byte, argument), §3.2 (indefinite lengths), §3.3 (simple values).
    """
    data = _payload_bytes(payload, limits)
    return Scanned(data, limits, _scan(data, limits))


def _payload_bytes(payload: object, limits: Limits) -> bytes:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise DecodeError(Reason.WRONG_TYPE, f"payload is {type(payload).__name__}, not bytes")
    if len(payload) > limits.max_message_bytes:
        raise DecodeError(Reason.TOO_LARGE, f"{len(payload)} bytes > {limits.max_message_bytes}")
    return bytes(payload)


def _scan(data: bytes, limits: Limits) -> dict[str, int | str]:
    """:func:`scan`'s walk: every top-level map value that is an unsigned int or text."""
    found: dict[str, int | str] = {}
    top_key = b""
    size = len(data)
    pos = 0
    items = 0
    max_items, max_depth = limits.max_items, limits.max_depth
    max_string, max_elements = limits.max_string_bytes, limits.max_array_elements
    left: list[int] = []  # children still expected by each open container
    keysets: list[set[bytes] | None] = []  # text keys seen in each open map (None: an array or a tag)
    while True:
        if pos >= size:
            raise DecodeError(Reason.BAD_CBOR, f"truncated at byte {pos}")
        initial = data[pos]
        pos += 1
        major = initial >> 5
        info = initial & 0x1F
        if info < 24:
            arg = info
        elif info < 28:
            width = 1 << (info - 24)
            if width > size - pos:
                raise DecodeError(Reason.BAD_CBOR, f"truncated header at byte {pos - 1}")
            arg = int.from_bytes(data[pos : pos + width], "big")
            pos += width
        elif info == 31:
            raise DecodeError(Reason.BAD_CBOR, f"indefinite length or break at byte {pos - 1}")
        else:
            raise DecodeError(Reason.BAD_CBOR, f"reserved additional information at byte {pos - 1}")
        items += 1
        if items > max_items:
            raise DecodeError(Reason.TOO_LARGE, f"more than {max_items} data items")
        if major == 2 or major == 3:
            if arg > size - pos:
                raise DecodeError(
                    Reason.BAD_CBOR, f"string of {arg} bytes at byte {pos - 1} runs past the end"
                )
            if major == 3 and arg > max_string:
                raise DecodeError(Reason.BAD_VALUE, f"text string of {arg} bytes > {max_string}")
        if left:
            keys = keysets[-1]
            if keys is not None and not left[-1] & 1:  # a map key: an even count of children left
                if major != 3:
                    raise DecodeError(Reason.WRONG_TYPE, f"map key at byte {pos - 1} is not a text string")
                key = data[pos : pos + arg]
                if key in keys:  # checked here, not by cbor2: cbor2 5.x has no allow_duplicate_keys
                    raise DecodeError(
                        Reason.BAD_CBOR, f"duplicate map key {show(key.decode('utf-8', 'replace'))}"
                    )
                keys.add(key)
                if len(left) == 1:
                    top_key = key
                pos += arg
                left[-1] -= 1  # a key never completes its map
                continue
            if keys is not None and len(left) == 1 and (major == 0 or major == 3):
                # a value of the top-level map (a key that is not UTF-8 is refused by cbor2 later;
                # here it only must not raise)
                value = arg if major == 0 else data[pos : pos + arg].decode("utf-8", "replace")
                found[top_key.decode("utf-8", "replace")] = value
        if major == 2 or major == 3:
            pos += arg
        elif major == 4 or major == 5:
            if arg > max_elements:
                raise DecodeError(Reason.TOO_LARGE, f"container of {arg} elements > {max_elements}")
            children = arg if major == 4 else 2 * arg
            if children > size - pos:  # every child takes at least one byte
                raise DecodeError(Reason.BAD_CBOR, f"container of {arg} elements runs past the end")
            if len(left) + 1 > max_depth:
                raise DecodeError(Reason.TOO_DEEP, f"nesting deeper than {max_depth}")
            if children:
                left.append(children)
                keysets.append(set() if major == 5 else None)
                continue
        elif major == 6:
            if arg not in ALLOWED_TAGS:
                raise DecodeError(Reason.BAD_CBOR, f"unsupported tag {arg}")
            if len(left) + 1 > max_depth:
                raise DecodeError(Reason.TOO_DEEP, f"nesting deeper than {max_depth}")
            left.append(1)
            keysets.append(None)
            continue
        elif major == 7 and info not in (20, 21, 22, 25, 26, 27):  # false, true, null, floats
            raise DecodeError(Reason.BAD_CBOR, f"unsupported simple value at byte {pos - 1}")
        # one item is complete: close every container it completes
        while left:
            left[-1] -= 1
            if left[-1]:
                break
            left.pop()
            keysets.pop()
        else:
            break
    if pos != size:
        raise DecodeError(Reason.TRAILING_BYTES, f"{size - pos} bytes after the message")
    return found


def load(payload: bytes | Scanned, limits: Limits) -> object:
    """Decode one CBOR item from the network: size check, :func:`scan`, then strict cbor2.

    A ``payload`` scanned under the same ``limits`` is not scanned again. DecodeError with the reasons
    of :func:`scan`, ``bad_cbor`` for what cbor2 refuses (e.g. invalid UTF-8).
    """
    if isinstance(payload, Scanned) and payload.limits == limits:
        data = payload.data
    else:
        data = _payload_bytes(payload.data if isinstance(payload, Scanned) else payload, limits)
        _scan(data, limits)
    try:
        return strict_loads(data, limits.max_depth)  # on cbor2 5.x the scan enforced the same rules
    except (cbor2.CBORDecodeError, ValueError, TypeError, OverflowError) as exc:
        raise DecodeError(Reason.BAD_CBOR, str(exc)[:200]) from exc


def load_message(
    payload: bytes | Scanned,
    limits: Limits,
    kind: MessageType,
    required: tuple[str, ...],
    optional: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Decode a message's envelope and check its keys: steps 1-4 of ``docs/protocol.md`` ("Decoding").

    ``payload`` may be its :func:`scan`; ``required``/``optional`` are the keys beside ``v`` and
    ``type`` (:func:`check_keys`). Returns the decoded map, its values not read yet (``read_*`` do).
    DecodeError as :func:`load` and :func:`check_keys`; ``not_a_map``; ``bad_version`` (not an integer,
    or below :data:`SCHEMA_VERSION`); ``newer_schema``; ``wrong_type`` (another type).
    """
    obj = load(payload, limits)
    if not isinstance(obj, dict):
        raise DecodeError(Reason.NOT_A_MAP, f"top level is {type(obj).__name__}")
    if "v" not in obj:
        raise DecodeError(Reason.MISSING_KEY, "v")
    version = obj["v"]
    if type(version) is not int or version < SCHEMA_VERSION:
        raise DecodeError(Reason.BAD_VERSION, f"v = {version!r:.20}, expected {SCHEMA_VERSION}")
    if version > SCHEMA_VERSION:
        shown = str(version) if version < 10**20 else "huge"
        raise DecodeError(Reason.NEWER_SCHEMA, f"v = {shown}: this peer reads schema {SCHEMA_VERSION}")
    if "type" not in obj:
        raise DecodeError(Reason.MISSING_KEY, "type")
    if obj["type"] != kind.value:
        raise DecodeError(Reason.WRONG_TYPE, f"type = {obj['type']!r:.40}, expected {kind.value!r}")
    return check_keys(obj, "", ("v", "type", *required), optional)


def check_keys(
    obj: object, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Return ``obj`` if it is a map holding every ``required`` key and no key beyond ``optional``.

    ``where`` is the map's dotted name in details (``""``: the message); DecodeError ``wrong_type``,
    ``unknown_key`` or ``missing_key`` otherwise.
    """
    if not isinstance(obj, dict):
        raise DecodeError(
            Reason.WRONG_TYPE, f"{where or 'message'}: expected a map, got {type(obj).__name__}"
        )
    prefix = f"{where}." if where else ""
    for key in obj:
        if key not in required and key not in optional:
            raise DecodeError(Reason.UNKNOWN_KEY, prefix + show(str(key)))
    for key in required:
        if key not in obj:
            raise DecodeError(Reason.MISSING_KEY, prefix + key)
    return obj


def read_int(obj: Mapping[str, Any], key: str, where: str, lo: int = 0, hi: int = INT_MAX) -> int:
    """Read ``obj[key]`` as an integer in ``[lo, hi]`` (not a ``bool``): ``wrong_type``, ``bad_value``."""
    value = obj[key]
    name = f"{where}.{key}" if where else key
    if type(value) is not int:  # bool is an int subclass: rejected here on purpose
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        shown = str(value) if abs(value) < 10**20 else "huge"
        raise DecodeError(Reason.BAD_VALUE, f"{name} = {shown}: must be in [{lo}, {hi}]")
    return value


def read_float(
    obj: Mapping[str, Any],
    key: str,
    where: str,
    lo: float = -math.inf,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
) -> float:
    """Read ``obj[key]`` as a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); ints accepted.

    DecodeError ``wrong_type``, ``not_finite`` or ``bad_value`` (out of range, an integer above 2**53).
    """
    value = obj[key]
    name = f"{where}.{key}" if where else key
    # integers are accepted: many CBOR encoders write 30.0 as 30
    if type(value) is not float and type(value) is not int:
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: expected a number, got {type(value).__name__}")
    if type(value) is int and abs(value) > 2**53:
        raise DecodeError(Reason.BAD_VALUE, f"{name}: integer too large for a float")
    number = float(value)
    if not math.isfinite(number):
        raise DecodeError(Reason.NOT_FINITE, f"{name} = {number}")
    if number < lo or number > hi or (lo_open and number == lo):
        bracket = "(" if lo_open else "["
        raise DecodeError(Reason.BAD_VALUE, f"{name} = {number}: must be in {bracket}{lo}, {hi}]")
    return number


def read_text(obj: Mapping[str, Any], key: str, where: str, pattern: re.Pattern[str]) -> str:
    """Read ``obj[key]`` as text fully matching ``pattern``: ``wrong_type``, ``bad_value`` (64 shown)."""
    value = obj[key]
    name = f"{where}.{key}" if where else key
    if type(value) is not str:
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: expected a text string, got {type(value).__name__}")
    if pattern.fullmatch(value) is None:
        raise DecodeError(Reason.BAD_VALUE, f"{name} = {show(value)}: must match {pattern.pattern}")
    return value


def read_choice(obj: Mapping[str, Any], key: str, choices: type[_Choice]) -> _Choice:
    """Read ``obj[key]`` as a value of the text enum ``choices``; else ``wrong_type``, ``bad_value``."""
    value = obj[key]
    if type(value) is not str:
        raise DecodeError(Reason.WRONG_TYPE, f"{key}: expected a text string, got {type(value).__name__}")
    try:
        return choices(value)
    except ValueError as exc:
        known = ", ".join(c.value for c in choices)
        raise DecodeError(Reason.BAD_VALUE, f"{key} = {show(value)}: must be one of {known}") from exc


def read_device_id(value: object, name: str) -> str:
    """Return a decoded value if it is a device id (:func:`~edgefl.validators.check_device_id`).

    DecodeError ``wrong_type`` or ``bad_value`` otherwise.
    """
    if type(value) is not str:
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: expected a text string, got {type(value).__name__}")
    try:
        return check_device_id(value)
    except ValueError as exc:
        raise DecodeError(Reason.BAD_VALUE, f"{name} = {show(value)}: {exc}") from exc


def read_signature(obj: Mapping[str, Any], limits: Limits) -> bytes:
    """The message's optional ``"signature"`` bytes (``b""`` if absent), at most ``max_string_bytes``.

    DecodeError ``wrong_type`` or ``bad_value`` otherwise.
    """
    if "signature" not in obj:
        return b""
    value = obj["signature"]
    if type(value) is not bytes:
        raise DecodeError(Reason.WRONG_TYPE, f"signature: expected a byte string, got {type(value).__name__}")
    if len(value) > limits.max_string_bytes:
        raise DecodeError(Reason.BAD_VALUE, f"signature: {len(value)} bytes > {limits.max_string_bytes}")
    return value
