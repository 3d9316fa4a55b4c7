"""The partial message: one site's sum (or robust estimate) of its devices' updates, sent up to the root.

Field by field, with every bound: ``docs/protocol.md`` ("Partial"). Source: RFC 8949 (CBOR); RFC 8746
§2.1, §3.1.1 (float64 typed arrays).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from edgefl.errors import DecodeError
from edgefl.wire import cbor
from edgefl.wire.arrays import check_head_shapes, decode_array, encode_array
from edgefl.wire.reasons import Reason
from edgefl.wire.rounds import UPDATE_ID_RE

#: Most update ids one Partial covers (a site of a few hundred devices sends a few hundred).
MAX_PARTIAL_UPDATES: Final = 16_000
#: How a Partial's ``W``/``b`` combine at the root (``docs/protocol.md``, "Partial").
_COMBINE_RE: Final = re.compile("sum|median|trimmed-mean")


@dataclass(frozen=True, slots=True)
class Partial:
    """One site's contribution to a round, sent up to the root (``partial/<site>``, QoS 1, not retained).

    ``W`` float64 [D, K] and ``b`` float64 [K] are, for ``combine = "sum"``, the weighted sums
    ``sum_k w_k * delta_k`` with ``weight = sum_k w_k``, else the site's robust estimate; ``count`` 0
    is a site with nothing this round. Every field: ``docs/protocol.md`` ("Partial").
    """

    round: int
    base_version: int
    site: str
    partial_id: str
    combine: str
    count: int
    weight: float
    clipped: int
    update_ids: tuple[str, ...]
    W: npt.NDArray[np.float64]
    b: npt.NDArray[np.float64]
    signature: bytes = b""


def encode_partial(msg: Partial) -> bytes:
    """Encode a :class:`Partial` (finite arrays as RFC 8746 float64 little-endian, tag 86 in tag 40).

    Source: RFC 8746 §2.1 (tag 86), §3.1.1 (tag 40).
    """
    return cbor.dump_message(
        cbor.MessageType.PARTIAL,
        {
            "round": int(msg.round),
            "base_version": int(msg.base_version),
            "site": msg.site,
            "partial_id": msg.partial_id,
            "combine": msg.combine,
            "count": int(msg.count),
            "weight": float(msg.weight),
            "clipped": int(msg.clipped),
            "update_ids": [str(u) for u in msg.update_ids],
            "W": encode_array(np.ascontiguousarray(msg.W, dtype=np.float64)),
            "b": encode_array(np.ascontiguousarray(msg.b, dtype=np.float64)),
            "signature": bytes(msg.signature),
        },
    )


def _read_update_ids(raw: object, count: int) -> tuple[str, ...]:
    """A Partial's ``update_ids``: ``count`` distinct update ids (``wrong_type``, ``bad_value``)."""
    if not isinstance(raw, list):
        raise DecodeError(Reason.WRONG_TYPE, "update_ids: expected an array")
    if len(raw) != count:
        raise DecodeError(Reason.BAD_VALUE, f"update_ids: {len(raw)} ids, count = {count}")
    ids = tuple(cbor.read_text({"id": u}, "id", f"update_ids[{i}]", UPDATE_ID_RE) for i, u in enumerate(raw))
    if len(set(ids)) != len(ids):
        raise DecodeError(Reason.BAD_VALUE, "update_ids: duplicate ids")
    return ids


def decode_partial(
    payload: bytes | cbor.Scanned,
    *,
    limits: cbor.Limits = cbor.DEFAULT_LIMITS,
    expect_shape: tuple[int, int] | None = None,
) -> Partial:
    """Decode and validate a :class:`Partial`, its arrays float64 (finite, owned).

    ``payload`` may be its :func:`~edgefl.wire.cbor.scan`; ``expect_shape`` is the global head's (D, K).
    DecodeError: the reasons of ``docs/protocol.md`` ("Refusals"), ``bad_value`` for a field breaking its
    bound there, ``bad_dtype`` for arrays that are not float64.
    """
    keys = ("round", "base_version", "site", "partial_id", "combine", "count", "weight", "clipped")
    obj = cbor.load_message(
        payload, limits, cbor.MessageType.PARTIAL, (*keys, "update_ids", "W", "b"), ("signature",)
    )
    combine = cbor.read_text(obj, "combine", "", _COMBINE_RE)
    count = cbor.read_int(obj, "count", "", 0, MAX_PARTIAL_UPDATES)
    w = decode_array(obj["W"], limits=limits, dtypes=frozenset({"float64"}), name="W")
    b = decode_array(obj["b"], limits=limits, dtypes=frozenset({"float64"}), name="b")
    check_head_shapes(w, b, "partial", expect_shape)
    clipped = cbor.read_int(obj, "clipped", "")
    if clipped > count:
        raise DecodeError(Reason.BAD_VALUE, f"clipped = {clipped} > count = {count}")
    weight = cbor.read_float(obj, "weight", "", 0.0)
    if (weight > 0) != (count > 0):
        why = f"weight = {weight} with count = {count}: must be > 0 exactly when count > 0"
        raise DecodeError(Reason.BAD_VALUE, why)
    if count == 0 and (np.any(w) or np.any(b)):
        raise DecodeError(Reason.BAD_VALUE, "an empty partial (count = 0) must carry zero arrays")
    return Partial(
        round=cbor.read_int(obj, "round", ""),
        base_version=cbor.read_int(obj, "base_version", ""),
        site=cbor.read_device_id(obj["site"], "site"),
        partial_id=cbor.read_text(obj, "partial_id", "", UPDATE_ID_RE),
        combine=combine,
        count=count,
        weight=weight,
        clipped=clipped,
        update_ids=_read_update_ids(obj["update_ids"], count),
        W=w,
        b=b,
        signature=cbor.read_signature(obj, limits),
    )
