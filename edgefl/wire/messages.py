"""The messages: one dataclass per message type and its paired ``encode_x``/``decode_x``.

Owns GlobalModel, RoundAnnouncement, Update (+ UpdateMetrics), Decline and DeviceStatus, the live-ingest
messages Sample, Label and Prediction, their fields' bounds
and the schema version each encoding carries. Every field, type, bound, topic, QoS and retained flag
is specified in ``docs/protocol.md``; decoding is bounded by :mod:`edgefl.wire.cbor`, arrays are
:mod:`edgefl.wire.arrays`, update deltas :mod:`edgefl.wire.compression`.

Source: RFC 8949 (CBOR); RFC 8746 (typed arrays).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Final

import numpy as np
import numpy.typing as npt

from edgefl.errors import DecodeError
from edgefl.types import F32
from edgefl.validators import DEVICE_ID_PATTERN, check_device_id
from edgefl.wire.arrays import decode_array, encode_array
from edgefl.wire.cbor import (
    DEFAULT_LIMITS,
    DEFLATE_SCHEMA_VERSION,
    HEAD_LAYOUT_SCHEMA_VERSION,
    INT_MAX,
    MIN_SCHEMA_VERSION,
    SIGNED_SCHEMA_VERSION,
    Limits,
    MessageType,
    check_keys,
    dumps,
    load_message,
    prescan,
    read_device_id,
    read_float,
    read_int,
    read_signature,
    read_text,
    show,
)
from edgefl.wire.compression import (
    CompressedDelta,
    Compression,
    compress_delta,
    decompress_delta,
    read_compression,
)
from edgefl.wire.reasons import Reason

__all__ = [
    "DEVICE_ID_RE",
    "MAX_BATCH_SIZE",
    "MAX_CLIENTS",
    "MAX_DEADLINE_S",
    "MAX_LOCAL_EPOCHS",
    "MAX_LR",
    "MAX_PARTIAL_UPDATES",
    "MAX_PROX_MU",
    "PARTIAL_COMBINES",
    "SAMPLE_ID_RE",
    "UPDATE_ID_RE",
    "Decline",
    "DeviceStatus",
    "GlobalModel",
    "HeadLayout",
    "Label",
    "Partial",
    "Prediction",
    "RoundAnnouncement",
    "Sample",
    "Update",
    "UpdateMetrics",
    "decode_decline",
    "decode_global_model",
    "decode_label",
    "decode_partial",
    "decode_prediction",
    "decode_round",
    "decode_sample",
    "decode_status",
    "decode_update",
    "encode_decline",
    "encode_global_model",
    "encode_label",
    "encode_partial",
    "encode_prediction",
    "encode_round",
    "encode_sample",
    "encode_status",
    "encode_update",
    "global_model_version",
    "is_valid_device_id",
    "offline_status",
    "resolve_global_head",
]

# Bounds on a RoundAnnouncement's training settings: a device must not be told to train for 2^62
# epochs or with a step that overflows float32 (both were seen to hang or crash an agent).
MAX_DEADLINE_S: Final = 86_400.0
MAX_LOCAL_EPOCHS: Final = 1_000
MAX_LR: Final = 10.0
MAX_BATCH_SIZE: Final = 65_536
MAX_CLIENTS: Final = 1_000_000
MAX_PROX_MU: Final = 1_000.0
#: Most update ids one Partial covers (a site of a few hundred devices sends a few hundred).
MAX_PARTIAL_UPDATES: Final = 16_000
#: How a Partial's ``W``/``b`` combine at the root: weighted sums are added; a robust rule's site
#: estimates are combined by the rule's root step (``docs/operations.md``, "Many sites").
PARTIAL_COMBINES: Final = ("sum", "median", "trimmed-mean")

#: Device ids (MQTT topic levels, file names, Prometheus labels); ``.`` and ``..`` are also refused.
DEVICE_ID_RE: Final = DEVICE_ID_PATTERN
#: Update ids: often "<device>:<round>:<n>" or a UUID, hence the colon and the longer bound.
UPDATE_ID_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
#: Sample ids (chosen by the gateway app: a counter, a UUID, "<camera>:<frame>"...).
SAMPLE_ID_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
#: Raw sample dtypes a Sample's ``x`` may have (the profile's ``pipeline.raw_dtype`` picks one).
RAW_DTYPES: Final = frozenset({"uint8", "int16", "float32"})
_STATE_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,32}")
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
_REASON_RE: Final = re.compile(r"[a-z0-9_]{1,32}")
_DETAIL_RE: Final = re.compile(r"[\x20-\x7e]{0,200}")
_LAYOUT_RE: Final = re.compile(r"[a-z0-9]{1,16}")
_LAYOUT_RE_PARTIAL: Final = re.compile(r"[a-z-]{1,16}")


def _written_version(signature: bytes, uses_rice: bool = False, uses_deflate: bool = False) -> int:
    # the lowest schema that describes the message (docs/protocol.md, "Versioning")
    if uses_deflate:
        return DEFLATE_SCHEMA_VERSION
    return SIGNED_SCHEMA_VERSION if signature or uses_rice else MIN_SCHEMA_VERSION


def _deflated(*subs: Mapping[str, object]) -> bool:
    return any("qz" in sub for sub in subs)


class HeadLayout(StrEnum):
    """How a GlobalModel's head travels down (``docs/protocol.md``, "GlobalModel", "Head layouts").

    ``float32`` is the schema-1 head of bare arrays; ``float16`` and ``int8`` (a scale per output
    unit) are the update delta layouts of the same names applied to the head (or to its delta from
    ``base_version``). Source: Jacob et al. 2018 (per-channel int8).
    """

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    INT8 = "int8"


_HEAD_COMPRESSION: Final = {
    HeadLayout.FLOAT32: Compression.NONE,
    HeadLayout.FLOAT16: Compression.FLOAT16,
    HeadLayout.INT8: Compression.INT8,
}


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
    layout : HeadLayout
        How W and b travel (float32 by default: the schema-1 head). Encoding a lossy layout
        quantises; decoding gives back the dense float32 values the wire carried.
    base_version : int or None
        When set, W and b are the delta ``head(version) - head(base_version)``: a device holding
        ``base_version`` adds them to its head (:func:`resolve_global_head`).
    """

    round: int
    version: int
    model_sha256: str
    W: F32
    b: F32
    signature: bytes = b""
    layout: HeadLayout = HeadLayout.FLOAT32
    base_version: int | None = None


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
    eval_accuracy : float or None
        Accuracy in [0, 1] of the base head (``base_version``) on the device's holdout, never trained
        on (federated evaluation; schema 4). None: no holdout. It travels with the update so the
        device's status need not be published for it.
    eval_count : int
        Holdout samples behind ``eval_accuracy``, >= 1 when it is set.
    """

    loss: float
    accuracy: float
    train_s: float
    peak_rss_bytes: int
    eval_accuracy: float | None = None
    eval_count: int = 0


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
class Decline:
    """A device's refusal of a round it was asked to train (topic ``update/<device>``, QoS 1).

    Sent instead of an Update when the device cannot answer the round (e.g. the memory governor
    judged training over budget until the round's deadline drew near), so the coordinator counts and
    logs the refusal instead of seeing a silent device. Specified in ``docs/protocol.md`` ("Decline").

    Parameters
    ----------
    round : int
        The round refused.
    base_version : int
        The round's base version.
    device : str
        Sender (must equal the topic's ``<device>``).
    reason : str
        A :class:`~edgefl.wire.reasons.Reason` value, ``[a-z0-9_]{1,32}`` (e.g. ``over_budget``).
    detail : str
        Human-readable explanation, at most 200 printable ASCII characters (longer ones are cut).
    update_id : str
        De-duplication id, ``<device>:<round>:<base_version>:declined``.
    signature : bytes
        Ed25519 signature (signed like an Update, kind ``decline``), or empty.
    """

    round: int
    base_version: int
    device: str
    reason: str
    detail: str
    update_id: str
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


def _check_head_shapes(w: F32, b: F32, where: str, expect_shape: tuple[int, int] | None) -> None:
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


def encode_global_model(msg: GlobalModel) -> bytes:
    """Encode a :class:`GlobalModel`.

    Parameters
    ----------
    msg : GlobalModel
        W float32 [D, K], b float32 [K], finite; ``layout`` and ``base_version`` choose the head's
        wire form (``docs/protocol.md``, "Head layouts").

    Returns
    -------
    bytes
        ``{"v", "type": "global_model", "round", "version", "model_sha256", "head": {"W", "b"},
        "signature"}``; a float32 full head is written as schema 1 (2 when signed) with bare
        arrays; any other head as schema 3 with ``"layout"`` (and ``"base_version"``) before
        ``"head"``, whose ``W``/``b`` are delta-layout sub-maps.

    Raises
    ------
    ValueError
        If W or b is not finite in a compressed layout (as :func:`compress_delta`).
    """
    layout = HeadLayout(msg.layout)
    obj: dict[str, object] = {
        "v": _written_version(msg.signature),
        "type": MessageType.GLOBAL_MODEL.value,
        "round": int(msg.round),
        "version": int(msg.version),
        "model_sha256": msg.model_sha256,
    }
    w, b = np.asarray(msg.W, dtype=np.float32), np.asarray(msg.b, dtype=np.float32)
    if layout is HeadLayout.FLOAT32 and msg.base_version is None:
        obj["head"] = {"W": encode_array(w), "b": encode_array(b)}
    else:
        obj["v"] = HEAD_LAYOUT_SCHEMA_VERSION
        obj["layout"] = layout.value
        if msg.base_version is not None:
            obj["base_version"] = int(msg.base_version)
        mode = _HEAD_COMPRESSION[layout]
        sub_W, sub_b = compress_delta(w, mode), compress_delta(b, mode)
        if _deflated(sub_W, sub_b):
            obj["v"] = DEFLATE_SCHEMA_VERSION
        obj["head"] = {"W": sub_W, "b": sub_b}
    obj["signature"] = bytes(msg.signature)
    return dumps(obj)


def decode_global_model(
    payload: bytes, *, limits: Limits = DEFAULT_LIMITS, expect_shape: tuple[int, int] | None = None
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
        The reasons of ``docs/protocol.md`` ("Refusals"); ``signature`` is optional on the wire.
    """
    obj = load_message(payload, limits, MessageType.GLOBAL_MODEL)
    check_keys(
        obj,
        "",
        ("v", "type", "round", "version", "model_sha256", "head"),
        ("signature", "layout", "base_version"),
    )
    round_, version = read_int(obj, "round", ""), read_int(obj, "version", "")
    model_sha256 = read_text(obj, "model_sha256", "", _SHA256_RE)
    signature = read_signature(obj, limits)
    head = check_keys(obj["head"], "head", ("W", "b"))
    layout, base_version = HeadLayout.FLOAT32, None
    if "layout" in obj or "base_version" in obj:
        if "layout" not in obj:
            raise DecodeError(Reason.MISSING_KEY, "layout: required with base_version")
        schema = read_int(obj, "v", "")  # already checked by load_message: an int in range
        if schema < HEAD_LAYOUT_SCHEMA_VERSION:
            raise DecodeError(
                Reason.BAD_VERSION, f"v = {schema}: a head layout needs schema {HEAD_LAYOUT_SCHEMA_VERSION}"
            )
        raw = read_text(obj, "layout", "", _LAYOUT_RE)
        try:
            layout = HeadLayout(raw)
        except ValueError as exc:
            raise DecodeError(Reason.BAD_VALUE, f"layout = {show(raw)}: unknown head layout") from exc
        if "base_version" in obj:
            base_version = read_int(obj, "base_version", "")
            if base_version >= version:
                raise DecodeError(
                    Reason.BAD_VALUE, f"base_version {base_version} must be below version {version}"
                )
        mode = _HEAD_COMPRESSION[layout]
        want_w = tuple(expect_shape) if expect_shape is not None else None
        w = decompress_delta(head["W"], want_w, limits=limits, compression=mode, name="head.W")
        want_b = (expect_shape[1],) if expect_shape is not None else None
        b = decompress_delta(head["b"], want_b, limits=limits, compression=mode, name="head.b")
    else:
        f32 = frozenset({"float32"})
        w = decode_array(head["W"], limits=limits, dtypes=f32, name="head.W")
        b = decode_array(head["b"], limits=limits, dtypes=f32, name="head.b")
    _check_head_shapes(w, b, "head", expect_shape)
    return GlobalModel(
        round=round_,
        version=version,
        model_sha256=model_sha256,
        W=w,
        b=b,
        signature=signature,
        layout=layout,
        base_version=base_version,
    )


def resolve_global_head(gm: GlobalModel, held_version: int, held_W: F32, held_b: F32) -> GlobalModel:
    """Turn a decoded GlobalModel into the full float32 head a device applies and stores.

    Parameters
    ----------
    gm : GlobalModel
        As :func:`decode_global_model` returned it.
    held_version : int
        Version of the head the device holds.
    held_W, held_b : float32 [D, K], float32 [K]
        That head.

    Returns
    -------
    GlobalModel
        ``layout = float32``, ``base_version = None``; W, b the full head (``held + delta`` for a
        delta head, summed in float32), round, version, sha256 and signature as received.

    Raises
    ------
    DecodeError
        ``stale_base`` (a delta from a version the device does not hold: it takes the retained full
        head instead), ``bad_shape`` (delta and held head differ), ``not_finite`` (the sum overflows).
    """
    if gm.base_version is None:
        return replace(gm, layout=HeadLayout.FLOAT32)
    if gm.base_version != held_version:
        raise DecodeError(
            Reason.STALE_BASE, f"head delta from version {gm.base_version}, this device holds {held_version}"
        )
    if gm.W.shape != held_W.shape or gm.b.shape != held_b.shape:
        raise DecodeError(
            Reason.BAD_SHAPE, f"head delta of shape {list(gm.W.shape)}, held {list(held_W.shape)}"
        )
    with np.errstate(over="ignore"):
        w = (held_W.astype(np.float32) + gm.W).astype(np.float32)
        b = (held_b.astype(np.float32) + gm.b).astype(np.float32)
    if not (bool(np.isfinite(w).all()) and bool(np.isfinite(b).all())):
        raise DecodeError(Reason.NOT_FINITE, "head delta plus held head: NaN or infinity")
    return replace(gm, W=w, b=b, layout=HeadLayout.FLOAT32, base_version=None)


def global_model_version(payload: bytes, *, limits: Limits = DEFAULT_LIMITS) -> int | None:
    """Read a GlobalModel's ``version`` from its item headers, without decoding it.

    The cheap check that lets a device skip a retained head it already holds (no array is built).

    Parameters
    ----------
    payload : bytes
        A GlobalModel payload (whole, not a chunk).
    limits : Limits
        Bounds for the header walk.

    Returns
    -------
    int or None
        The version, or None when the headers hold no unsigned ``version`` (the full decode then
        names the problem).

    Raises
    ------
    DecodeError
        ``too_large`` (payload over ``limits.max_message_bytes``), else as
        :func:`edgefl.wire.cbor.prescan` (malformed or oversized CBOR).
    """
    if len(payload) > limits.max_message_bytes:
        raise DecodeError(Reason.TOO_LARGE, f"{len(payload)} bytes > {limits.max_message_bytes}")
    version = prescan(payload, limits, ("version",)).get("version")
    return version if type(version) is int else None


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
    return dumps(
        {
            "v": _written_version(msg.signature),
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


def decode_round(payload: bytes, *, limits: Limits = DEFAULT_LIMITS) -> RoundAnnouncement:
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
        The reasons of ``docs/protocol.md`` ("Refusals"); ``bad_value`` for out-of-range
        numbers, a duplicate or invalid device id in ``selected``.
    """
    obj = load_message(payload, limits, MessageType.ROUND)
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
    check_keys(obj, "", required, ("compression", "topk_fraction", "prox_mu", "signature"))
    raw_selected = obj["selected"]
    selected: tuple[str, ...] | float
    if isinstance(raw_selected, list):
        selected = tuple(read_device_id(device, f"selected[{i}]") for i, device in enumerate(raw_selected))
        if len(set(selected)) != len(selected):
            raise DecodeError(Reason.BAD_VALUE, "selected: duplicate device ids")
    else:
        selected = read_float(obj, "selected", "", 0.0, 1.0, lo_open=True)
    return RoundAnnouncement(
        round=read_int(obj, "round", ""),
        base_version=read_int(obj, "base_version", ""),
        deadline_s=read_float(obj, "deadline_s", "", 0.0, MAX_DEADLINE_S, lo_open=True),
        local_epochs=read_int(obj, "local_epochs", "", 1, MAX_LOCAL_EPOCHS),
        lr=read_float(obj, "lr", "", 0.0, MAX_LR, lo_open=True),
        batch_size=read_int(obj, "batch_size", "", 1, MAX_BATCH_SIZE),
        min_clients=read_int(obj, "min_clients", "", 1, MAX_CLIENTS),
        selected=selected,
        compression=read_compression(obj, "compression") if "compression" in obj else Compression.NONE,
        topk_fraction=(
            read_float(obj, "topk_fraction", "", 0.0, 1.0, lo_open=True) if "topk_fraction" in obj else 0.1
        ),
        prox_mu=read_float(obj, "prox_mu", "", 0.0, MAX_PROX_MU) if "prox_mu" in obj else 0.0,
        signature=read_signature(obj, limits),
    )


def encode_update(
    msg: Update,
    *,
    rng: np.random.Generator | None = None,
    topk_fraction: float = 0.1,
    compressed: CompressedDelta | None = None,
) -> bytes:
    """Encode an :class:`Update`, compressing its deltas per ``msg.compression`` (or taking them compressed).

    Parameters
    ----------
    msg : Update
        delta_W float32 [D, K], delta_b float32 [K], finite.
    rng : numpy.random.Generator, optional
        Stochastic rounding for int8 layouts (W is compressed before b).
    topk_fraction : float
        Fraction kept by ``topk``/``topk-int8`` (the round's ``topk_fraction``).
    compressed : CompressedDelta, optional
        The deltas already compressed (by error feedback, :func:`compress_head_delta`): written as
        they are, so compression runs once; ``rng`` and ``topk_fraction`` are then unused and
        ``msg.delta_W``/``msg.delta_b`` are not read. The result is byte for byte what encoding
        the same dense deltas here gives.

    Returns
    -------
    bytes
        ``{"v", "type": "update", "round", "base_version", "device", "num_examples",
        "compression", "delta": {"W": sub-map, "b": sub-map}, "metrics": {"loss", "accuracy",
        "train_s", "peak_rss_bytes" [, "eval_accuracy", "eval_count"]}, "update_id", "signature"}``;
        schema 4 with deflated int8 levels or an evaluation.

    Raises
    ------
    ValueError
        As :func:`edgefl.wire.compression.compress_delta` (non-finite delta, bad fraction), or
        ``compressed`` is in another layout than ``msg.compression``.
    """
    mode = Compression(msg.compression)
    if compressed is None:  # W before b: the order stochastic rounding draws in (as compress_head_delta)
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
    new = _deflated(sub_W, sub_b) or bool(evaluation)  # both schema 4
    return dumps(
        {
            "v": _written_version(msg.signature, "rice" in sub_W or "rice" in sub_b, new),
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
                **evaluation,
            },
            "update_id": msg.update_id,
            "signature": bytes(msg.signature),
        }
    )


def decode_update(
    payload: bytes, *, limits: Limits = DEFAULT_LIMITS, expect_shape: tuple[int, int] | None = None
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
        The reasons of ``docs/protocol.md`` ("Refusals"); ``bad_value`` for ``num_examples < 1``,
        accuracy outside [0, 1], negative ``train_s``/``peak_rss_bytes``, invalid ids.
    """
    obj = load_message(payload, limits, MessageType.UPDATE)
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
    check_keys(obj, "", required, ("signature",))
    mode = read_compression(obj, "compression")
    delta = check_keys(obj["delta"], "delta", ("W", "b"))
    want_w = tuple(expect_shape) if expect_shape is not None else None
    delta_w = decompress_delta(delta["W"], want_w, limits=limits, compression=mode, name="delta.W")
    want_b = (expect_shape[1],) if expect_shape is not None else None
    delta_b = decompress_delta(delta["b"], want_b, limits=limits, compression=mode, name="delta.b")
    _check_head_shapes(delta_w, delta_b, "delta", expect_shape)
    metrics = check_keys(
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
        eval_accuracy = read_float(metrics, "eval_accuracy", "metrics", 0.0, 1.0)
        eval_count = read_int(metrics, "eval_count", "metrics", 1)
    return Update(
        round=read_int(obj, "round", ""),
        base_version=read_int(obj, "base_version", ""),
        device=read_device_id(obj["device"], "device"),
        num_examples=read_int(obj, "num_examples", "", 1),
        delta_W=delta_w,
        delta_b=delta_b,
        metrics=UpdateMetrics(
            loss=read_float(metrics, "loss", "metrics"),
            accuracy=read_float(metrics, "accuracy", "metrics", 0.0, 1.0),
            train_s=read_float(metrics, "train_s", "metrics", 0.0),
            peak_rss_bytes=read_int(metrics, "peak_rss_bytes", "metrics"),
            eval_accuracy=eval_accuracy,
            eval_count=eval_count,
        ),
        update_id=read_text(obj, "update_id", "", UPDATE_ID_RE),
        compression=mode,
        signature=read_signature(obj, limits),
    )


def encode_decline(msg: Decline) -> bytes:
    """Encode a :class:`Decline`.

    Parameters
    ----------
    msg : Decline
        ``detail`` is written as printable ASCII (anything else becomes ``?``), cut to 200 characters.

    Returns
    -------
    bytes
        ``{"v", "type": "decline", "round", "base_version", "device", "reason", "detail",
        "update_id", "signature"}`` (``v`` = 2 when signed, else 1).
    """
    detail = "".join(c if " " <= c <= "~" else "?" for c in msg.detail)[:200]
    return dumps(
        {
            "v": _written_version(msg.signature),
            "type": MessageType.DECLINE.value,
            "round": int(msg.round),
            "base_version": int(msg.base_version),
            "device": msg.device,
            "reason": str(msg.reason),
            "detail": detail,
            "update_id": msg.update_id,
            "signature": bytes(msg.signature),
        }
    )


def decode_decline(payload: bytes, *, limits: Limits = DEFAULT_LIMITS) -> Decline:
    """Decode and validate a :class:`Decline`.

    Parameters
    ----------
    payload : bytes
        The MQTT payload (topic ``update/<device>``).
    limits : Limits
        Decoding bounds.

    Returns
    -------
    Decline

    Raises
    ------
    DecodeError
        The reasons of ``docs/protocol.md`` ("Refusals"); ``bad_value`` for a reason, detail or
        update id outside its pattern.
    """
    obj = load_message(payload, limits, MessageType.DECLINE)
    check_keys(
        obj,
        "",
        ("v", "type", "round", "base_version", "device", "reason", "detail", "update_id"),
        ("signature",),
    )
    return Decline(
        round=read_int(obj, "round", ""),
        base_version=read_int(obj, "base_version", ""),
        device=read_device_id(obj["device"], "device"),
        reason=read_text(obj, "reason", "", _REASON_RE),
        detail=read_text(obj, "detail", "", _DETAIL_RE),
        update_id=read_text(obj, "update_id", "", UPDATE_ID_RE),
        signature=read_signature(obj, limits),
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
    return dumps(
        {
            "v": MIN_SCHEMA_VERSION,
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
        if abs(value) > INT_MAX:
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
    return {str(key): _json_like(item, f"{name}.{show(str(key))}") for key, item in value.items()}


def decode_status(payload: bytes, *, limits: Limits = DEFAULT_LIMITS) -> DeviceStatus:
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
        The reasons of ``docs/protocol.md`` ("Refusals"); ``wrong_type`` for byte strings or
        tags inside ``fields``, ``not_finite`` for NaN/infinity.
    """
    obj = load_message(payload, limits, MessageType.STATUS)
    check_keys(obj, "", ("v", "type", "device", "state"), ("fields",))
    return DeviceStatus(
        device=read_device_id(obj["device"], "device"),
        state=read_text(obj, "state", "", _STATE_RE),
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
            "v": _written_version(msg.signature),
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
    payload: bytes, *, limits: Limits = DEFAULT_LIMITS, expect_shape: tuple[int, int] | None = None
) -> Partial:
    """Decode and validate a :class:`Partial`.

    Parameters
    ----------
    payload : bytes
        The MQTT payload.
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
    _check_head_shapes(w, b, "partial", expect_shape)
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


# --- live ingest: samples and labels in, predictions out (docs/protocol.md, "Sample") -------------------
@dataclass(frozen=True, slots=True)
class Sample:
    """One raw sample from a gateway app (topic ``samples/<device>``, not retained).

    Parameters
    ----------
    id : str
        The app's id of the sample, ``[A-Za-z0-9_.:-]{1,128}``; a late :class:`Label` names it.
    x : ndarray [*sample_shape] of the device's raw dtype (uint8, int16 or float32)
        The sample as the sensor gave it, before normalisation (the profile's ``pipeline.raw_dtype``
        and the model's sample shape, e.g. uint8 [8, 8, 1]).
    label : int or None
        The class, when the app knows it already (``0 <= label < K``; 0/1 for a K = 1 head).
    ts : float or None
        When the sample was taken, seconds since the Unix epoch.
    """

    id: str
    x: np.ndarray
    label: int | None = None
    ts: float | None = None


@dataclass(frozen=True, slots=True)
class Label:
    """The label of an earlier sample (topic ``labels/<device>``, not retained).

    Parameters
    ----------
    id : str
        The :attr:`Sample.id` it labels.
    label : int
        The class, ``0 <= label < K`` (0/1 for a K = 1 head).
    ts : float or None
        When the label was given, seconds since the Unix epoch.
    """

    id: str
    label: int
    ts: float | None = None


PREDICTION_HEADS: Final = frozenset({"personal", "global"})
"""The values of a Prediction's optional ``head`` key."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """The device's classification of one sample (topic ``predictions/<device>``, not retained).

    Parameters
    ----------
    id : str
        The :attr:`Sample.id`.
    cls : int
        Predicted class (``"class"`` on the wire): argmax of the head's logits, or ``logit > 0`` for a
        K = 1 head.
    score : float
        Probability of that class in [0, 1] (softmax, or the sigmoid for K = 1).
    version : int
        The global head version that classified it.
    latency_s : float
        Seconds from the sample's arrival at the device to its classification (queueing included).
    head : "personal" | "global" | None
        Which of the device's heads classified it (optional key ``"head"``; None: not said, as
        devices before personal heads send). ``version`` is the global version the head came from
        (for a personal head: the global head it was last pulled toward).
    """

    id: str
    cls: int
    score: float
    version: int
    latency_s: float
    head: str | None = None


def _label_bound(num_classes: int | None) -> int:
    # labels a head with K outputs learns: 0..K-1, and 0/1 for a K = 1 (logistic) head
    if num_classes is None:
        return INT_MAX
    return 2 if num_classes == 1 else num_classes


def _read_label(obj: Mapping[str, object], num_classes: int | None) -> int:
    label = read_int(obj, "label", "", 0, INT_MAX)
    bound = _label_bound(num_classes)
    if label >= bound:
        raise DecodeError(Reason.BAD_LABEL, f"label = {label}: must be in [0, {bound}) for K = {num_classes}")
    return label


def _read_ts(obj: Mapping[str, object]) -> float | None:
    return read_float(obj, "ts", "", 0.0) if "ts" in obj else None


def encode_sample(msg: Sample) -> bytes:
    """Encode a :class:`Sample`.

    Parameters
    ----------
    msg : Sample
        ``x`` of 1 to 4 dimensions, uint8, int16 or float32 (finite).

    Returns
    -------
    bytes
        ``{"v": 1, "type": "sample", "id", "x", "label"?, "ts"?}`` (optional keys only when set).

    Raises
    ------
    ValueError
        If ``x`` has another dtype or more than 4 dimensions.
    """
    x = np.asarray(msg.x)
    if x.dtype.name not in RAW_DTYPES or not 1 <= x.ndim <= 4:
        raise ValueError(f"sample x: {x.dtype} {list(x.shape)}; expected uint8/int16/float32, 1 to 4 dims")
    obj: dict[str, object] = {
        "v": MIN_SCHEMA_VERSION,
        "type": MessageType.SAMPLE.value,
        "id": msg.id,
        "x": encode_array(np.ascontiguousarray(x)),
    }
    if msg.label is not None:
        obj["label"] = int(msg.label)
    if msg.ts is not None:
        obj["ts"] = float(msg.ts)
    return dumps(obj)


def decode_sample(
    payload: bytes,
    *,
    limits: Limits = DEFAULT_LIMITS,
    sample_shape: tuple[int, ...] | None = None,
    dtype: str | None = None,
    num_classes: int | None = None,
) -> Sample:
    """Decode and validate a :class:`Sample` against the device's model.

    Parameters
    ----------
    payload : bytes
        The MQTT payload.
    limits : Limits
        Decoding bounds.
    sample_shape : tuple[int, ...], optional
        The model's sample shape; ``x`` must have exactly it (no batch dimension).
    dtype : str, optional
        The device's raw dtype (``pipeline.raw_dtype``); ``x`` must be it. Without it, any of
        uint8, int16, float32.
    num_classes : int, optional
        K of the head: ``label`` must be in [0, K) (0/1 when K = 1).

    Returns
    -------
    Sample
        ``x`` writable, owned, native byte order.

    Raises
    ------
    DecodeError
        The reasons of ``docs/protocol.md`` ("Refusals"): ``bad_shape`` and ``bad_dtype`` for an ``x``
        that is not the model's, ``bad_label`` for a label outside [0, K), ``bad_value`` for a bad id.
    """
    obj = load_message(payload, limits, MessageType.SAMPLE)
    check_keys(obj, "", ("v", "type", "id", "x"), ("label", "ts"))
    sample_id = read_text(obj, "id", "", SAMPLE_ID_RE)
    dtypes = frozenset({dtype}) if dtype is not None else RAW_DTYPES
    x = decode_array(obj["x"], limits=limits, dtypes=dtypes, name="x")
    if sample_shape is not None and tuple(x.shape) != tuple(sample_shape):
        raise DecodeError(
            Reason.BAD_SHAPE, f"x: shape {list(x.shape)}, this model takes samples of {list(sample_shape)}"
        )
    label = _read_label(obj, num_classes) if "label" in obj else None
    return Sample(id=sample_id, x=x, label=label, ts=_read_ts(obj))


def encode_label(msg: Label) -> bytes:
    """Encode a :class:`Label`: ``{"v": 1, "type": "label", "id", "label", "ts"?}``.

    Parameters
    ----------
    msg : Label

    Returns
    -------
    bytes
    """
    obj: dict[str, object] = {
        "v": MIN_SCHEMA_VERSION,
        "type": MessageType.LABEL.value,
        "id": msg.id,
        "label": int(msg.label),
    }
    if msg.ts is not None:
        obj["ts"] = float(msg.ts)
    return dumps(obj)


def decode_label(payload: bytes, *, limits: Limits = DEFAULT_LIMITS, num_classes: int | None = None) -> Label:
    """Decode and validate a :class:`Label`.

    Parameters
    ----------
    payload : bytes
        The MQTT payload.
    limits : Limits
        Decoding bounds.
    num_classes : int, optional
        K of the head: ``label`` must be in [0, K) (0/1 when K = 1).

    Returns
    -------
    Label

    Raises
    ------
    DecodeError
        The reasons of ``docs/protocol.md`` ("Refusals"); ``bad_label`` for a label outside [0, K).
    """
    obj = load_message(payload, limits, MessageType.LABEL)
    check_keys(obj, "", ("v", "type", "id", "label"), ("ts",))
    return Label(
        id=read_text(obj, "id", "", SAMPLE_ID_RE), label=_read_label(obj, num_classes), ts=_read_ts(obj)
    )


def encode_prediction(msg: Prediction) -> bytes:
    """Encode a :class:`Prediction`.

    Parameters
    ----------
    msg : Prediction

    Returns
    -------
    bytes
        ``{"v": 1, "type": "prediction", "id", "class", "score", "version", "latency_s"[, "head"]}``.

    Raises
    ------
    ValueError
        If ``head`` is set to something other than ``"personal"`` or ``"global"``.
    """
    obj: dict[str, object] = {
        "v": MIN_SCHEMA_VERSION,
        "type": MessageType.PREDICTION.value,
        "id": msg.id,
        "class": int(msg.cls),
        "score": float(msg.score),
        "version": int(msg.version),
        "latency_s": float(msg.latency_s),
    }
    if msg.head is not None:
        if msg.head not in PREDICTION_HEADS:
            raise ValueError(f"Prediction.head = {msg.head!r}: expected one of {sorted(PREDICTION_HEADS)}")
        obj["head"] = msg.head
    return dumps(obj)


def decode_prediction(payload: bytes, *, limits: Limits = DEFAULT_LIMITS) -> Prediction:
    """Decode and validate a :class:`Prediction` (what a gateway app reads).

    Parameters
    ----------
    payload : bytes
        The MQTT payload.
    limits : Limits
        Decoding bounds.

    Returns
    -------
    Prediction

    Raises
    ------
    DecodeError
        The reasons of ``docs/protocol.md`` ("Refusals"); ``bad_value`` for a score outside [0, 1] or a
        negative latency.
    """
    obj = load_message(payload, limits, MessageType.PREDICTION)
    check_keys(obj, "", ("v", "type", "id", "class", "score", "version", "latency_s"), ("head",))
    head: str | None = None
    if "head" in obj:
        value = obj["head"]
        if not isinstance(value, str):
            raise DecodeError(Reason.WRONG_TYPE, f"head: expected text, got {type(value).__name__}")
        if value not in PREDICTION_HEADS:
            raise DecodeError(Reason.BAD_VALUE, f"head = {show(value)}: expected personal or global")
        head = value
    return Prediction(
        id=read_text(obj, "id", "", SAMPLE_ID_RE),
        cls=read_int(obj, "class", ""),
        score=read_float(obj, "score", "", 0.0, 1.0),
        version=read_int(obj, "version", ""),
        latency_s=read_float(obj, "latency_s", "", 0.0),
        head=head,
    )
