"""The partial message: one site's sum (or robust estimate) of its devices' updates, sent up to the root.

Owns :class:`Partial` (``partial/<site>``, QoS 1, not retained), :func:`encode_partial` /
:func:`decode_partial` and their bounds. Field by field: ``docs/protocol.md`` ("Partial"); decoding is
bounded by :mod:`edgefl.wire.cbor`.

Source: RFC 8949 (CBOR); RFC 8746 §2.1, §3.1.1 (float64 typed arrays).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from edgefl.errors import DecodeError
from edgefl.wire.arrays import check_head_shapes, decode_array, encode_array
from edgefl.wire.cbor import (
    DEFAULT_LIMITS,
    SCHEMA_VERSION,
    Limits,
    MessageType,
    Scanned,
    check_keys,
    dumps,
    load_message,
    read_device_id,
    read_float,
    read_int,
    read_signature,
    read_text,
    show,
)
from edgefl.wire.reasons import Reason
from edgefl.wire.rounds import UPDATE_ID_RE

__all__ = ["MAX_PARTIAL_UPDATES", "PARTIAL_COMBINES", "Partial", "decode_partial", "encode_partial"]

#: Most update ids one Partial covers (a site of a few hundred devices sends a few hundred).
MAX_PARTIAL_UPDATES: Final = 16_000
#: How a Partial's ``W``/``b`` combine at the root: weighted sums are added; a robust rule's site
#: estimates are combined by the rule's root step (``docs/operations.md``, "Many sites").
PARTIAL_COMBINES: Final = ("sum", "median", "trimmed-mean")
_LAYOUT_RE_PARTIAL: Final = re.compile(r"[a-z-]{1,16}")


@dataclass(frozen=True, slots=True)
class Partial:
    """One site's contribution to a round, sent up to the root (``partial/<site>``, QoS 1, not retained).

    Parameters
    ----------
    round : int
        The round it belongs to (the root's RoundAnnouncement).
    base_version : int
        The global version the round trains from.
    site : str
        Site id (the device-id pattern); the signature binds it (as an Update binds its device).
    partial_id : str
        De-duplication id, one per (site, round): ``"<site>:<round>"``; a bridge redelivery or a
        restarted site sends the same id again.
    combine : str
        ``"sum"``: ``W``/``b`` are weighted sums ``sum_k w_k * delta_k`` (after the norm bound) and
        ``weight = sum_k w_k``; ``"median"``/``"trimmed-mean"``: the site's robust estimate, covering
        ``weight`` updates.
    count : int >= 0
        Updates folded in (``len(update_ids)``); 0: the site had nothing this round (it says so, so the
        root need not wait for its deadline), with ``weight`` 0 and zero arrays.
    weight : float >= 0
        Total weight (example counts for the FedAvg family; the update count for DP and robust rules),
        > 0 exactly when ``count`` > 0.
    clipped : int >= 0
        Updates the site's norm bound scaled down.
    update_ids : tuple of str
        Every update id covered, unique.
    W : float64 [D, K]
    b : float64 [K]
    signature : bytes
        Ed25519 by the site's key (``docs/protocol.md``, "Signatures"); empty when unsigned.
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
    """Encode a :class:`Partial` (arrays as RFC 8746 float64 little-endian, tag 86 in tag 40).

    Parameters
    ----------
    msg : Partial
        ``W`` float64 [D, K], ``b`` float64 [K], finite.

    Returns
    -------
    bytes
        ``{"v", "type": "partial", "round", "base_version", "site", "partial_id", "combine",
        "count", "weight", "clipped", "update_ids", "W", "b", "signature"}``.

    Source: RFC 8746 §2.1 (tag 86), §3.1.1 (tag 40).
    """
    return dumps(
        {
            "v": SCHEMA_VERSION,
            "type": MessageType.PARTIAL.value,
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
        }
    )


def decode_partial(
    payload: bytes | Scanned, *, limits: Limits = DEFAULT_LIMITS, expect_shape: tuple[int, int] | None = None
) -> Partial:
    """Decode and validate a :class:`Partial`.

    Parameters
    ----------
    payload : bytes or Scanned
        The MQTT payload, or what :func:`edgefl.wire.cbor.scan` made of it (not scanned again).
    limits : Limits
        Decoding bounds (the update ids count as items: ``max_items`` bounds them too).
    expect_shape : tuple[int, int], optional
        (D, K) of the global head.

    Returns
    -------
    Partial
        float64 arrays (finite, owned).

    Raises
    ------
    DecodeError
        The reasons of ``docs/protocol.md`` ("Refusals"); ``bad_value`` for an unknown ``combine``,
        ``count`` different from the number of update ids, a duplicate or invalid update id, more
        than :data:`MAX_PARTIAL_UPDATES` ids, ``weight`` not > 0 exactly when ``count`` > 0, non-zero
        arrays in an empty partial, ``clipped > count``; ``bad_dtype``
        for arrays that are not float64.
    """
    obj = load_message(payload, limits, MessageType.PARTIAL)
    required = (
        "v",
        "type",
        "round",
        "base_version",
        "site",
        "partial_id",
        "combine",
        "count",
        "weight",
        "clipped",
        "update_ids",
        "W",
        "b",
    )
    check_keys(obj, "", required, ("signature",))
    combine = read_text(obj, "combine", "", _LAYOUT_RE_PARTIAL)
    if combine not in PARTIAL_COMBINES:
        choices = ", ".join(PARTIAL_COMBINES)
        raise DecodeError(Reason.BAD_VALUE, f"combine = {show(combine)}: must be one of {choices}")
    count = read_int(obj, "count", "", 0, MAX_PARTIAL_UPDATES)
    raw_ids = obj["update_ids"]
    if not isinstance(raw_ids, list):
        raise DecodeError(Reason.WRONG_TYPE, "update_ids: expected an array")
    if len(raw_ids) != count:
        raise DecodeError(Reason.BAD_VALUE, f"update_ids: {len(raw_ids)} ids, count = {count}")
    ids = tuple(read_text({"id": u}, "id", f"update_ids[{i}]", UPDATE_ID_RE) for i, u in enumerate(raw_ids))
    if len(set(ids)) != len(ids):
        raise DecodeError(Reason.BAD_VALUE, "update_ids: duplicate ids")
    w = decode_array(obj["W"], limits=limits, dtypes=frozenset({"float64"}), name="W")
    b = decode_array(obj["b"], limits=limits, dtypes=frozenset({"float64"}), name="b")
    check_head_shapes(w, b, "partial", expect_shape)
    clipped = read_int(obj, "clipped", "")
    if clipped > count:
        raise DecodeError(Reason.BAD_VALUE, f"clipped = {clipped} > count = {count}")
    weight = read_float(obj, "weight", "", 0.0)
    if (weight > 0) != (count > 0):
        why = f"weight = {weight} with count = {count}: must be > 0 exactly when count > 0"
        raise DecodeError(Reason.BAD_VALUE, why)
    if count == 0 and (np.any(w) or np.any(b)):
        raise DecodeError(Reason.BAD_VALUE, "an empty partial (count = 0) must carry zero arrays")
    return Partial(
        round=read_int(obj, "round", ""),
        base_version=read_int(obj, "base_version", ""),
        site=read_device_id(obj["site"], "site"),
        partial_id=read_text(obj, "partial_id", "", UPDATE_ID_RE),
        combine=combine,
        count=count,
        weight=weight,
        clipped=clipped,
        update_ids=ids,
        W=w,
        b=b,
        signature=read_signature(obj, limits),
    )
