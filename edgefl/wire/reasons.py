"""One ``Reason`` for every refusal of a message: the ``reason`` of ``DecodeError``/``UpdateRejected``.

The values are the ``rejected_total{reason}`` label values on the dashboards and ``/metrics``. A
``Reason`` is a ``str`` (``StrEnum``), so counters keyed by the plain string and by the member are the
same key. The meaning of each value is listed in ``docs/protocol.md`` ("Refusals").
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why a message was refused (decoding, chunk reassembly, signature check, round bookkeeping)."""

    # bounded CBOR and the message envelope (edgefl.wire.cbor)
    TOO_LARGE = "too_large"
    BAD_CBOR = "bad_cbor"
    TOO_DEEP = "too_deep"
    TRAILING_BYTES = "trailing_bytes"
    NOT_A_MAP = "not_a_map"
    BAD_VERSION = "bad_version"
    NEWER_SCHEMA = "newer_schema"
    WRONG_TYPE = "wrong_type"
    UNKNOWN_KEY = "unknown_key"
    MISSING_KEY = "missing_key"
    # field values, typed arrays, compressed layouts
    BAD_SHAPE = "bad_shape"
    BAD_DTYPE = "bad_dtype"
    NOT_FINITE = "not_finite"
    BAD_INDICES = "bad_indices"
    BAD_VALUE = "bad_value"
    # chunks (edgefl.wire.chunking)
    BAD_CHUNK = "bad_chunk"
    CHUNK_CONFLICT = "chunk_conflict"
    BAD_CHECKSUM = "bad_checksum"
    # signatures (edgefl.wire.signing)
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    UNKNOWN_DEVICE = "unknown_device"
    # where and when a valid message arrived (coordinator and device bookkeeping; UpdateRejected)
    BAD_TOPIC = "bad_topic"
    WRONG_DEVICE = "wrong_device"
    NO_ROUND = "no_round"
    ROUND_CLOSED = "round_closed"
    DUPLICATE = "duplicate"
    STALE_BASE = "stale_base"
    TOO_STALE = "too_stale"
    NO_EXAMPLES = "no_examples"
    STALE_ROUND = "stale_round"
    NOT_SELECTED = "not_selected"
    TOO_MANY = "too_many"
    TOO_FEW = "too_few"
    # live ingest at the device
    BAD_LABEL = "bad_label"
    UNKNOWN_SAMPLE = "unknown_sample"
    LABEL_CONFLICT = "label_conflict"
    # a device's Decline of a round
    OVER_BUDGET = "over_budget"
    TOO_FEW_EXAMPLES = "too_few_examples"
    NO_SAMPLES = "no_samples"
    NO_HEAD = "no_head"
    # the coordinator's device registry, a global head the device cannot use, an unusable state file
    REGISTRY_FULL = "registry_full"
    EXPIRED = "expired"
    WRONG_MODEL = "wrong_model"
    NOT_NEWER = "not_newer"
    BAD_STATE = "bad_state"
