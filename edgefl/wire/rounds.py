"""The round messages: the announcement that opens a round and a device's answer (an update or a decline).

Field by field, with every bound: ``docs/protocol.md`` ("RoundAnnouncement", "Update", "Decline").
Source: RFC 8949 (CBOR); RFC 8746 (typed arrays).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import numpy as np

from edgefl.errors import DecodeError
from edgefl.types import F32
from edgefl.wire import cbor
from edgefl.wire.compression import CompressedDelta, Compression, compress_delta, decompress_head
from edgefl.wire.reasons import Reason

# Bounds on a RoundAnnouncement's training settings (no 2^62 epochs, no step that overflows float32).
MAX_DEADLINE_S: Final = 86_400.0
MAX_LOCAL_EPOCHS: Final = 1_000
MAX_LR: Final = 10.0
MAX_BATCH_SIZE: Final = 65_536
MAX_CLIENTS: Final = 1_000_000
MAX_PROX_MU: Final = 1_000.0
#: Update ids: often "<device>:<round>:<n>" or a UUID, hence the colon and the longer bound.
UPDATE_ID_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_REASON_RE: Final = re.compile(r"[a-z0-9_]{1,32}")
_DETAIL_RE: Final = re.compile(r"[\x20-\x7e]{0,200}")


@dataclass(frozen=True, slots=True)
class RoundAnnouncement:
    """A round opened by the coordinator (topic ``round``, retained); fields: ``docs/protocol.md``.

    Source: Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020 (FedProx).
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
    """Training metrics sent with an update; fields and units: ``docs/protocol.md`` ("Update")."""

    loss: float
    accuracy: float
    train_s: float
    peak_rss_bytes: int
    eval_accuracy: float | None = None
    eval_count: int = 0


@dataclass(frozen=True, slots=True)
class Update:
    """A device's head update (topic ``update/<device>``); fields: ``docs/protocol.md`` ("Update").

    ``delta_W`` float32 [D, K] and ``delta_b`` float32 [K] are dense (local - global):
    ``compression`` only changes the wire.
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
class Decline:
    """A device's refusal of a round it was asked to train, sent instead of an Update.

    ``reason`` is a :class:`~edgefl.wire.reasons.Reason` value; fields: ``docs/protocol.md`` ("Decline").
    """

    round: int
    base_version: int
    device: str
    reason: str
    detail: str
    update_id: str
    signature: bytes = b""


def encode_round(msg: RoundAnnouncement) -> bytes:
    """Encode a :class:`RoundAnnouncement` (``docs/protocol.md``, "RoundAnnouncement")."""
    selected: object = (
        float(msg.selected) if isinstance(msg.selected, int | float) else [str(d) for d in msg.selected]
    )
    return cbor.dump_message(
        cbor.MessageType.ROUND,
        {
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
        },
    )


def decode_round(payload: bytes, *, limits: cbor.Limits = cbor.DEFAULT_LIMITS) -> RoundAnnouncement:
    """Decode and validate a :class:`RoundAnnouncement` (absent optional keys take their defaults).

    DecodeError: the reasons of ``docs/protocol.md`` ("Refusals"); ``bad_value`` for out-of-range
    numbers, a duplicate or invalid device id in ``selected``.
    """
    required = ("round", "base_version", "deadline_s", "local_epochs", "lr", "batch_size", "min_clients")
    optional = ("compression", "topk_fraction", "prox_mu", "signature")
    obj = cbor.load_message(payload, limits, cbor.MessageType.ROUND, (*required, "selected"), optional)
    raw_selected = obj["selected"]
    selected: tuple[str, ...] | float
    if isinstance(raw_selected, list):
        selected = tuple(
            cbor.read_device_id(device, f"selected[{i}]") for i, device in enumerate(raw_selected)
        )
        if len(set(selected)) != len(selected):
            raise DecodeError(Reason.BAD_VALUE, "selected: duplicate device ids")
    else:
        selected = cbor.read_float(obj, "selected", "", 0.0, 1.0, lo_open=True)
    compression = (
        cbor.read_choice(obj, "compression", Compression) if "compression" in obj else Compression.NONE
    )
    return RoundAnnouncement(
        round=cbor.read_int(obj, "round", ""),
        base_version=cbor.read_int(obj, "base_version", ""),
        deadline_s=cbor.read_float(obj, "deadline_s", "", 0.0, MAX_DEADLINE_S, lo_open=True),
        local_epochs=cbor.read_int(obj, "local_epochs", "", 1, MAX_LOCAL_EPOCHS),
        lr=cbor.read_float(obj, "lr", "", 0.0, MAX_LR, lo_open=True),
        batch_size=cbor.read_int(obj, "batch_size", "", 1, MAX_BATCH_SIZE),
        min_clients=cbor.read_int(obj, "min_clients", "", 1, MAX_CLIENTS),
        selected=selected,
        compression=compression,
        topk_fraction=(
            cbor.read_float(obj, "topk_fraction", "", 0.0, 1.0, lo_open=True)
            if "topk_fraction" in obj
            else 0.1
        ),
        prox_mu=cbor.read_float(obj, "prox_mu", "", 0.0, MAX_PROX_MU) if "prox_mu" in obj else 0.0,
        signature=cbor.read_signature(obj, limits),
    )


def encode_update(
    msg: Update,
    *,
    rng: np.random.Generator | None = None,
    topk_fraction: float = 0.1,
    compressed: CompressedDelta | None = None,
) -> bytes:
    """Encode an :class:`Update`, compressing its deltas per ``msg.compression`` (or taking them compressed).

    ``rng`` makes int8 rounding stochastic (W compressed before b); ``topk_fraction`` is the round's.
    ``compressed`` (from error feedback) is written as it is, ``rng``, ``topk_fraction`` and the
    message's deltas unused: the same bytes the dense deltas give. ValueError as
    :func:`~edgefl.wire.compression.compress_delta`, or for ``compressed`` in another layout.
    """
    mode = Compression(msg.compression)
    if compressed is None:  # W before b: the order stochastic rounding draws in
        sub_W = compress_delta(msg.delta_W, mode, topk_fraction=topk_fraction, rng=rng)
        sub_b = compress_delta(msg.delta_b, mode, topk_fraction=topk_fraction, rng=rng)
    elif compressed.compression is not mode:
        raise ValueError(f"compressed delta is {compressed.compression.value}, the update says {mode.value}")
    else:
        sub_W, sub_b = compressed.W, compressed.b
    delta = {"W": sub_W, "b": sub_b}
    evaluation: dict[str, object] = {}
    if msg.metrics.eval_accuracy is not None:
        evaluation = {
            "eval_accuracy": float(msg.metrics.eval_accuracy),
            "eval_count": int(msg.metrics.eval_count),
        }
    return cbor.dump_message(
        cbor.MessageType.UPDATE,
        {
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
                **evaluation,
            },
            "update_id": msg.update_id,
            "signature": bytes(msg.signature),
        },
    )


def decode_update(
    payload: bytes | cbor.Scanned,
    *,
    limits: cbor.Limits = cbor.DEFAULT_LIMITS,
    expect_shape: tuple[int, int] | None = None,
) -> Update:
    """Decode and validate an :class:`Update`, its deltas dense float32 (writable, owned).

    ``payload`` may be its :func:`~edgefl.wire.cbor.scan`; with ``expect_shape`` (D, K) the deltas
    must be [D, K] and [K], without it W 2-D and b [W.shape[1]]. DecodeError: the reasons of
    ``docs/protocol.md`` ("Refusals"), ``bad_value`` for a field out of its range.
    """
    required = ("round", "base_version", "device", "num_examples", "compression", "delta", "metrics")
    obj = cbor.load_message(
        payload, limits, cbor.MessageType.UPDATE, (*required, "update_id"), ("signature",)
    )
    mode = cbor.read_choice(obj, "compression", Compression)
    delta = cbor.check_keys(obj["delta"], "delta", ("W", "b"))
    delta_w, delta_b = decompress_head(delta, expect_shape, limits=limits, compression=mode, name="delta")
    metrics = cbor.check_keys(
        obj["metrics"],
        "metrics",
        ("loss", "accuracy", "train_s", "peak_rss_bytes"),
        ("eval_accuracy", "eval_count"),
    )
    eval_accuracy: float | None = None
    eval_count = 0
    if "eval_accuracy" in metrics or "eval_count" in metrics:
        if not ("eval_accuracy" in metrics and "eval_count" in metrics):
            raise DecodeError(Reason.MISSING_KEY, "metrics: eval_accuracy and eval_count go together")
        eval_accuracy = cbor.read_float(metrics, "eval_accuracy", "metrics", 0.0, 1.0)
        eval_count = cbor.read_int(metrics, "eval_count", "metrics", 1)
    return Update(
        round=cbor.read_int(obj, "round", ""),
        base_version=cbor.read_int(obj, "base_version", ""),
        device=cbor.read_device_id(obj["device"], "device"),
        num_examples=cbor.read_int(obj, "num_examples", "", 1),
        delta_W=delta_w,
        delta_b=delta_b,
        metrics=UpdateMetrics(
            loss=cbor.read_float(metrics, "loss", "metrics"),
            accuracy=cbor.read_float(metrics, "accuracy", "metrics", 0.0, 1.0),
            train_s=cbor.read_float(metrics, "train_s", "metrics", 0.0),
            peak_rss_bytes=cbor.read_int(metrics, "peak_rss_bytes", "metrics"),
            eval_accuracy=eval_accuracy,
            eval_count=eval_count,
        ),
        update_id=cbor.read_text(obj, "update_id", "", UPDATE_ID_RE),
        compression=mode,
        signature=cbor.read_signature(obj, limits),
    )


def encode_decline(msg: Decline) -> bytes:
    """Encode a :class:`Decline`, its ``detail`` as printable ASCII (others ``?``) cut to 200 characters."""
    detail = "".join(c if " " <= c <= "~" else "?" for c in msg.detail)[:200]
    return cbor.dump_message(
        cbor.MessageType.DECLINE,
        {
            "round": int(msg.round),
            "base_version": int(msg.base_version),
            "device": msg.device,
            "reason": str(msg.reason),
            "detail": detail,
            "update_id": msg.update_id,
            "signature": bytes(msg.signature),
        },
    )


def decode_decline(payload: bytes | cbor.Scanned, *, limits: cbor.Limits = cbor.DEFAULT_LIMITS) -> Decline:
    """Decode and validate a :class:`Decline` (``payload`` may be its :func:`~edgefl.wire.cbor.scan`).

    DecodeError: the reasons of ``docs/protocol.md`` ("Refusals"); ``bad_value`` for a reason, detail
    or update id outside its pattern.
    """
    required = ("round", "base_version", "device", "reason", "detail", "update_id")
    obj = cbor.load_message(payload, limits, cbor.MessageType.DECLINE, required, ("signature",))
    return Decline(
        round=cbor.read_int(obj, "round", ""),
        base_version=cbor.read_int(obj, "base_version", ""),
        device=cbor.read_device_id(obj["device"], "device"),
        reason=cbor.read_text(obj, "reason", "", _REASON_RE),
        detail=cbor.read_text(obj, "detail", "", _DETAIL_RE),
        update_id=cbor.read_text(obj, "update_id", "", UPDATE_ID_RE),
        signature=cbor.read_signature(obj, limits),
    )
