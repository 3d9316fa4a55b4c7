"""Coordinator presence: the fleet's lease, a running coordinator's retained and heartbeated claim.

Field by field: ``docs/protocol.md`` ("Presence").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from edgefl.wire import cbor

_INSTANCE_RE: Final = re.compile(r"[0-9a-f]{8,64}")
_HOST_RE: Final = re.compile(r"[\x21-\x7e]{1,255}")
MAX_HEARTBEAT_S: Final = 3600.0


@dataclass(frozen=True, slots=True)
class Presence:
    """A running coordinator's claim on its fleet (retained on ``<prefix>/<fleet>/coordinator``).

    Fields: ``docs/protocol.md`` ("Presence"); ``sent`` 0.0: not stamped; ``signature`` ``b""``: unsigned.
    """

    instance: str
    host: str
    pid: int
    started: float
    seq: int
    heartbeat_s: float
    sent: float = 0.0
    signature: bytes = b""


def encode_presence(msg: Presence) -> bytes:
    """Encode a :class:`Presence`: ``sent`` when stamped (> 0), ``signature`` last when not empty."""
    fields: dict[str, object] = {
        "instance": msg.instance,
        "host": msg.host,
        "pid": msg.pid,
        "started": float(msg.started),
        "seq": msg.seq,
        "heartbeat_s": float(msg.heartbeat_s),
    }
    if msg.sent > 0:
        fields["sent"] = float(msg.sent)
    if msg.signature:
        fields["signature"] = bytes(msg.signature)
    return cbor.dump_message(cbor.MessageType.PRESENCE, fields)


def decode_presence(payload: bytes, *, limits: cbor.Limits = cbor.DEFAULT_LIMITS) -> Presence:
    """Decode and validate a :class:`Presence` (DecodeError: the reasons of ``docs/protocol.md``)."""
    keys = ("instance", "host", "pid", "started", "seq", "heartbeat_s")
    obj = cbor.load_message(payload, limits, cbor.MessageType.PRESENCE, keys, ("sent", "signature"))
    return Presence(
        instance=cbor.read_text(obj, "instance", "", _INSTANCE_RE),
        host=cbor.read_text(obj, "host", "", _HOST_RE),
        pid=cbor.read_int(obj, "pid", ""),
        started=cbor.read_float(obj, "started", "", 0.0),
        seq=cbor.read_int(obj, "seq", ""),
        heartbeat_s=cbor.read_float(obj, "heartbeat_s", "", 0.0, MAX_HEARTBEAT_S, lo_open=True),
        sent=cbor.read_float(obj, "sent", "", 0.0) if "sent" in obj else 0.0,
        signature=cbor.read_signature(obj, limits),
    )
