"""The wire format's names in one import: re-exports of :mod:`edgefl.wire.messages` and its helpers.

Code written before the split into ``cbor``, ``arrays``, ``compression``, ``messages`` and ``reasons``
imports from here (``from edgefl.wire.codec import encode_update``) and keeps working; new code may
import from the module that owns a name. Nothing is defined here. The specification is
``docs/protocol.md``.
"""

from __future__ import annotations

from edgefl.errors import DecodeError
from edgefl.wire.arrays import decode_array, encode_array
from edgefl.wire.cbor import SCHEMA_VERSION, Limits, MessageType
from edgefl.wire.compression import (
    CompressedDelta,
    Compression,
    compress_delta,
    compress_head_delta,
    compressed_roundtrip,
    decompress_delta,
    delta_wire_bytes,
    topk_count,
)
from edgefl.wire.messages import (
    DEVICE_ID_RE,
    MAX_BATCH_SIZE,
    MAX_CLIENTS,
    MAX_DEADLINE_S,
    MAX_LOCAL_EPOCHS,
    MAX_LR,
    MAX_PROX_MU,
    Decline,
    DeviceStatus,
    GlobalModel,
    RoundAnnouncement,
    Update,
    UpdateMetrics,
    decode_decline,
    decode_global_model,
    decode_round,
    decode_status,
    decode_update,
    encode_decline,
    encode_global_model,
    encode_round,
    encode_status,
    encode_update,
    is_valid_device_id,
    offline_status,
)
from edgefl.wire.reasons import REASONS, Reason

__all__ = [
    "DEVICE_ID_RE",
    "MAX_BATCH_SIZE",
    "MAX_CLIENTS",
    "MAX_DEADLINE_S",
    "MAX_LOCAL_EPOCHS",
    "MAX_LR",
    "MAX_PROX_MU",
    "REASONS",
    "SCHEMA_VERSION",
    "CompressedDelta",
    "Compression",
    "Decline",
    "DecodeError",
    "DeviceStatus",
    "GlobalModel",
    "Limits",
    "MessageType",
    "Reason",
    "RoundAnnouncement",
    "Update",
    "UpdateMetrics",
    "compress_delta",
    "compress_head_delta",
    "compressed_roundtrip",
    "decode_array",
    "decode_decline",
    "decode_global_model",
    "decode_round",
    "decode_status",
    "decode_update",
    "decompress_delta",
    "delta_wire_bytes",
    "encode_array",
    "encode_decline",
    "encode_global_model",
    "encode_round",
    "encode_status",
    "encode_update",
    "is_valid_device_id",
    "offline_status",
    "topk_count",
]
