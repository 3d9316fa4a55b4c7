"""The live-ingest messages: samples and labels a gateway app sends in, the predictions a device sends out.

Sample, Label, Prediction and Refusal (IngestRefusal), none retained; field by field:
``docs/protocol.md`` ("Live ingest"). Source: RFC 8949 (CBOR); RFC 8746 (typed arrays).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np

from edgefl.errors import DecodeError
from edgefl.wire import cbor
from edgefl.wire.arrays import decode_array, encode_array
from edgefl.wire.reasons import Reason

#: Sample ids (chosen by the gateway app: a counter, a UUID, "<camera>:<frame>"...).
SAMPLE_ID_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
#: Raw sample dtypes a Sample's ``x`` may have (the profile's ``pipeline.raw_dtype`` picks one).
RAW_DTYPES: Final = frozenset({"uint8", "int16", "float32"})


@dataclass(frozen=True, slots=True)
class Sample:
    """One raw sample from a gateway app (topic ``samples/<device>``, not retained).

    ``x`` [*sample_shape] in the device's ``pipeline.raw_dtype``; fields: ``docs/protocol.md`` ("Sample").
    """

    id: str
    x: np.ndarray
    label: int | None = None
    ts: float | None = None


@dataclass(frozen=True, slots=True)
class Label:
    """The label of the earlier sample ``id`` (topic ``labels/<device>``); ``ts`` Unix seconds."""

    id: str
    label: int
    ts: float | None = None


#: The values of a Prediction's optional ``head`` key.
PREDICTION_HEAD_RE: Final = re.compile("personal|global")


@dataclass(frozen=True, slots=True)
class Prediction:
    """The device's classification of one sample (topic ``predictions/<device>``, not retained).

    ``cls`` is ``"class"`` on the wire; fields: ``docs/protocol.md`` ("Prediction").
    """

    id: str
    cls: int
    score: float
    version: int
    latency_s: float
    head: str | None = None


#: The values of a Refusal's ``of`` key.
REFUSED_OF_RE: Final = re.compile("sample|label")
REASON_RE: Final = re.compile(r"[a-z_]{1,32}")
DETAIL_CHARS: Final = 200  # a Refusal's ``detail`` is cut to this many characters
DETAIL_RE: Final = re.compile(rf".{{0,{DETAIL_CHARS}}}", re.DOTALL)


@dataclass(frozen=True, slots=True)
class IngestRefusal:
    """A Refusal: the device refused an app's Sample or Label ``id`` (``predictions/<device>``, not retained).

    Fields: ``docs/protocol.md`` ("Refusal").
    """

    id: str
    of: str
    reason: str
    detail: str = ""


def _read_label(obj: Mapping[str, object], num_classes: int | None) -> int:
    """``obj["label"]``: a class the head learns, 0..K-1 (0/1 for K = 1); ``bad_label``, ``wrong_type``."""
    label = obj["label"]
    if type(label) is not int:  # bool is an int subclass: refused here on purpose
        raise DecodeError(Reason.WRONG_TYPE, f"label: expected an integer, got {type(label).__name__}")
    shown = str(label) if abs(label) < 10**20 else "huge"
    if num_classes is None:
        if not 0 <= label <= cbor.INT_MAX:
            raise DecodeError(Reason.BAD_LABEL, f"label = {shown}: must be a class number >= 0")
        return label
    bound = 2 if num_classes == 1 else num_classes
    if not 0 <= label < bound:
        what = "a K = 1 (logistic) head" if num_classes == 1 else f"the model's K = {num_classes} classes"
        raise DecodeError(Reason.BAD_LABEL, f"label = {shown}: must be in 0..{bound - 1} ({what})")
    return label


def _read_ts(obj: Mapping[str, object]) -> float | None:
    return cbor.read_float(obj, "ts", "", 0.0) if "ts" in obj else None


def encode_sample(msg: Sample) -> bytes:
    """Encode a :class:`Sample`; ValueError unless ``x`` is uint8, int16 or float32 of 1 to 4 dimensions."""
    x = np.asarray(msg.x)
    if x.dtype.name not in RAW_DTYPES or not 1 <= x.ndim <= 4:
        raise ValueError(f"sample x: {x.dtype} {list(x.shape)}; expected uint8/int16/float32, 1 to 4 dims")
    obj: dict[str, object] = {"id": msg.id, "x": encode_array(np.ascontiguousarray(x))}
    if msg.label is not None:
        obj["label"] = int(msg.label)
    if msg.ts is not None:
        obj["ts"] = float(msg.ts)
    return cbor.dump_message(cbor.MessageType.SAMPLE, obj)


def decode_sample(
    payload: bytes,
    *,
    limits: cbor.Limits = cbor.DEFAULT_LIMITS,
    sample_shape: tuple[int, ...] | None = None,
    dtype: str | None = None,
    num_classes: int | None = None,
) -> Sample:
    """Decode and validate a :class:`Sample` against the device's model.

    ``x`` must have ``sample_shape`` and ``dtype`` when given (else any raw dtype) and comes writable,
    owned, native order; ``label`` must be in [0, K) for ``num_classes`` K (0/1 when K = 1). DecodeError:
    ``bad_shape``/``bad_dtype`` for an ``x`` not the model's, ``bad_label``, ``bad_value`` for a bad id.
    """
    obj = cbor.load_message(payload, limits, cbor.MessageType.SAMPLE, ("id", "x"), ("label", "ts"))
    sample_id = cbor.read_text(obj, "id", "", SAMPLE_ID_RE)
    dtypes = frozenset({dtype}) if dtype is not None else RAW_DTYPES
    x = decode_array(obj["x"], limits=limits, dtypes=dtypes, name="x")
    if sample_shape is not None and tuple(x.shape) != tuple(sample_shape):
        raise DecodeError(
            Reason.BAD_SHAPE, f"x: shape {list(x.shape)}, this model takes samples of {list(sample_shape)}"
        )
    label = _read_label(obj, num_classes) if "label" in obj else None
    return Sample(id=sample_id, x=x, label=label, ts=_read_ts(obj))


def encode_label(msg: Label) -> bytes:
    """Encode a :class:`Label`."""
    obj: dict[str, object] = {"id": msg.id, "label": int(msg.label)}
    if msg.ts is not None:
        obj["ts"] = float(msg.ts)
    return cbor.dump_message(cbor.MessageType.LABEL, obj)


def decode_label(
    payload: bytes, *, limits: cbor.Limits = cbor.DEFAULT_LIMITS, num_classes: int | None = None
) -> Label:
    """Decode and validate a :class:`Label`: ``bad_label`` outside [0, K) (``num_classes``; 0/1 if K = 1)."""
    obj = cbor.load_message(payload, limits, cbor.MessageType.LABEL, ("id", "label"), ("ts",))
    return Label(
        id=cbor.read_text(obj, "id", "", SAMPLE_ID_RE), label=_read_label(obj, num_classes), ts=_read_ts(obj)
    )


def encode_prediction(msg: Prediction) -> bytes:
    """Encode a :class:`Prediction`; ValueError if ``head`` is not None, ``"personal"`` or ``"global"``."""
    obj: dict[str, object] = {
        "id": msg.id,
        "class": int(msg.cls),
        "score": float(msg.score),
        "version": int(msg.version),
        "latency_s": float(msg.latency_s),
    }
    if msg.head is not None:
        if PREDICTION_HEAD_RE.fullmatch(msg.head) is None:
            raise ValueError(f"Prediction.head = {msg.head!r}: expected {PREDICTION_HEAD_RE.pattern}")
        obj["head"] = msg.head
    return cbor.dump_message(cbor.MessageType.PREDICTION, obj)


def decode_prediction(payload: bytes, *, limits: cbor.Limits = cbor.DEFAULT_LIMITS) -> Prediction:
    """Decode and validate a :class:`Prediction` (what a gateway app reads).

    DecodeError: the reasons of ``docs/protocol.md`` ("Refusals"); ``bad_value`` for a score outside
    [0, 1] or a negative latency.
    """
    keys = ("id", "class", "score", "version", "latency_s")
    obj = cbor.load_message(payload, limits, cbor.MessageType.PREDICTION, keys, ("head",))
    return Prediction(
        id=cbor.read_text(obj, "id", "", SAMPLE_ID_RE),
        cls=cbor.read_int(obj, "class", ""),
        score=cbor.read_float(obj, "score", "", 0.0, 1.0),
        version=cbor.read_int(obj, "version", ""),
        latency_s=cbor.read_float(obj, "latency_s", "", 0.0),
        head=cbor.read_text(obj, "head", "", PREDICTION_HEAD_RE) if "head" in obj else None,
    )


def encode_refusal(msg: IngestRefusal) -> bytes:
    """Encode an :class:`IngestRefusal` (``detail`` cut to :data:`DETAIL_CHARS`); ValueError: bad ``of``."""
    if REFUSED_OF_RE.fullmatch(msg.of) is None:
        raise ValueError(f"IngestRefusal.of = {msg.of!r}: expected {REFUSED_OF_RE.pattern}")
    detail = msg.detail[:DETAIL_CHARS].encode("utf-8")[: cbor.DEFAULT_LIMITS.max_string_bytes]
    obj: dict[str, object] = {
        "id": msg.id,
        "of": msg.of,
        "reason": str(msg.reason),
        "detail": detail.decode("utf-8", "ignore"),
    }
    return cbor.dump_message(cbor.MessageType.REFUSAL, obj)


def decode_refusal(payload: bytes, *, limits: cbor.Limits = cbor.DEFAULT_LIMITS) -> IngestRefusal:
    """Decode and validate an :class:`IngestRefusal`: ``bad_value`` for a bad ``of`` or ``reason``."""
    obj = cbor.load_message(payload, limits, cbor.MessageType.REFUSAL, ("id", "of", "reason"), ("detail",))
    return IngestRefusal(
        id=cbor.read_text(obj, "id", "", SAMPLE_ID_RE),
        of=cbor.read_text(obj, "of", "", REFUSED_OF_RE),
        reason=cbor.read_text(obj, "reason", "", REASON_RE),
        detail=cbor.read_text(obj, "detail", "", DETAIL_RE) if "detail" in obj else "",
    )


def decode_answer(payload: bytes, *, limits: cbor.Limits = cbor.DEFAULT_LIMITS) -> Prediction | IngestRefusal:
    """Decode a Prediction or a Refusal from ``predictions/<device>``: DecodeError as each decoder."""
    scanned = cbor.scan(payload, limits)
    if scanned.header.get("type") == cbor.MessageType.REFUSAL.value:
        return decode_refusal(payload, limits=limits)
    return decode_prediction(payload, limits=limits)


def ingest_id(payload: bytes, limits: cbor.Limits = cbor.DEFAULT_LIMITS) -> str | None:
    """The ``id`` of a Sample or Label payload, if its CBOR can be read and the id is valid, else None.

    For naming a refused message to its app: a bounded cbor.scan, no array decoded.
    """
    try:
        header = cbor.scan(payload, limits).header
    except DecodeError:
        return None
    if header.get("type") not in (cbor.MessageType.SAMPLE.value, cbor.MessageType.LABEL.value):
        return None
    value = header.get("id")
    return value if isinstance(value, str) and SAMPLE_ID_RE.fullmatch(value) else None
