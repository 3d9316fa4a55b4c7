"""The live-ingest messages: samples and labels a gateway app sends in, the predictions a device sends out.

Owns :class:`Sample` (``samples/<device>``), :class:`Label` (``labels/<device>``) and
:class:`Prediction` (``predictions/<device>``), none retained, with their paired ``encode_x`` /
``decode_x`` and bounds. Field by field: ``docs/protocol.md`` ("Sample"); decoding is bounded by
:mod:`edgefl.wire.cbor`, arrays are :mod:`edgefl.wire.arrays`.

Source: RFC 8949 (CBOR); RFC 8746 (typed arrays).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np

from edgefl.errors import DecodeError
from edgefl.wire.arrays import decode_array, encode_array
from edgefl.wire.cbor import (
    DEFAULT_LIMITS,
    INT_MAX,
    SCHEMA_VERSION,
    Limits,
    MessageType,
    check_keys,
    dumps,
    load_message,
    read_float,
    read_int,
    read_text,
    show,
)
from edgefl.wire.reasons import Reason

__all__ = [
    "PREDICTION_HEADS",
    "RAW_DTYPES",
    "SAMPLE_ID_RE",
    "Label",
    "Prediction",
    "Sample",
    "decode_label",
    "decode_prediction",
    "decode_sample",
    "encode_label",
    "encode_prediction",
    "encode_sample",
]

#: Sample ids (chosen by the gateway app: a counter, a UUID, "<camera>:<frame>"...).
SAMPLE_ID_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
#: Raw sample dtypes a Sample's ``x`` may have (the profile's ``pipeline.raw_dtype`` picks one).
RAW_DTYPES: Final = frozenset({"uint8", "int16", "float32"})


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
        "v": SCHEMA_VERSION,
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
        "v": SCHEMA_VERSION,
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
        "v": SCHEMA_VERSION,
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
