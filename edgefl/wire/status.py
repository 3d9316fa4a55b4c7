"""The device status message: what a device says about itself on ``status/<device>`` (retained).

Free-form JSON-like fields, bounded, and the last will (:func:`offline_status`); field by field:
``docs/protocol.md`` ("DeviceStatus"). Source: RFC 8949 (CBOR).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from edgefl.errors import DecodeError
from edgefl.validators import check_device_id
from edgefl.wire import cbor
from edgefl.wire.reasons import Reason

_STATE_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,32}")

#: Most bytes and CBOR data items of a status, whatever the ``Limits`` (``docs/protocol.md``).
STATUS_MAX_BYTES: Final = 16 * 1024
STATUS_MAX_ITEMS: Final = 1024
#: The field that paces a service's rounds: labelled samples the device stored since its last round.
NEW_SAMPLES_FIELD: Final = "new_samples"


@dataclass(frozen=True, slots=True)
class DeviceStatus:
    """A device's status (topic ``status/<device>``, retained; the last will is state ``offline``).

    ``state`` is a short label (``"online"``, ``"training"``...), ``fields`` free-form JSON-like
    values with finite floats (``docs/protocol.md``, "DeviceStatus").
    """

    device: str
    state: str
    fields: Mapping[str, object] = field(default_factory=dict)


def encode_status(msg: DeviceStatus) -> bytes:
    """Encode a :class:`DeviceStatus` (plain Python values in ``fields``, else cbor2.CBOREncodeError)."""
    fields = {"device": msg.device, "state": msg.state, "fields": dict(msg.fields)}
    return cbor.dump_message(cbor.MessageType.STATUS, fields)


def _json_like(value: object, name: str) -> object:
    # depth, string lengths, item counts and text keys are already bounded by the pre-scan
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        if abs(value) > cbor.INT_MAX:
            raise DecodeError(Reason.BAD_VALUE, f"{name}: integer out of int64 range")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DecodeError(Reason.NOT_FINITE, f"{name} = {value}")
        return value
    if isinstance(value, list | tuple):
        return [_json_like(item, f"{name}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        return _json_map(value, name)
    raise DecodeError(Reason.WRONG_TYPE, f"{name}: {type(value).__name__} is not a JSON-like value")


def _json_map(value: object, name: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise DecodeError(Reason.WRONG_TYPE, f"{name}: expected a map, got {type(value).__name__}")
    return {str(key): _json_like(item, f"{name}.{cbor.show(str(key))}") for key, item in value.items()}


def decode_status(payload: bytes, *, limits: cbor.Limits = cbor.DEFAULT_LIMITS) -> DeviceStatus:
    """Decode and validate a :class:`DeviceStatus`, its ``fields`` a fresh dict of plain values (or ``{}``).

    DecodeError: the reasons of ``docs/protocol.md`` ("Refusals"); ``wrong_type`` for byte strings or
    tags inside ``fields``, ``not_finite`` for NaN/infinity; ``too_large`` for a payload over
    :data:`STATUS_MAX_BYTES` bytes or :data:`STATUS_MAX_ITEMS` items (whatever ``limits`` allows).
    """
    limits = dataclasses.replace(
        limits,
        max_message_bytes=min(limits.max_message_bytes, STATUS_MAX_BYTES),
        max_items=min(limits.max_items, STATUS_MAX_ITEMS),
        max_array_elements=min(limits.max_array_elements, STATUS_MAX_ITEMS),
    )
    obj = cbor.load_message(payload, limits, cbor.MessageType.STATUS, ("device", "state"), ("fields",))
    return DeviceStatus(
        device=cbor.read_device_id(obj["device"], "device"),
        state=cbor.read_text(obj, "state", "", _STATE_RE),
        fields=_json_map(obj["fields"], "fields") if "fields" in obj else {},
    )


def offline_status(device: str) -> bytes:
    """The last-will payload of ``device``: its status with state ``offline``; ValueError for a bad id."""
    check_device_id(device)
    return encode_status(DeviceStatus(device=device, state="offline", fields={}))


def read_new_samples(fields: Mapping[str, object]) -> int | None:
    """A DeviceStatus's ``fields["new_samples"]`` (None if absent); else ``wrong_type``, ``bad_value``."""
    if fields.get(NEW_SAMPLES_FIELD) is None:
        return None
    return cbor.read_int(fields, NEW_SAMPLES_FIELD, "fields")
