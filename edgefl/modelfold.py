"""Fold an input normalisation into an int8 model: a uint8 input and one QUANTIZE op in front.

For ``edgefl model prepare --mean M --std S --raw-dtype uint8``: the uint8 input's quantisation is
the normalisation (``scale = 1 / std``, zero point the mean) and the pipeline's fused step a copy.
With an integer mean it matches the table path but at half-way ties (LiteRT rounds half away from
zero, the table half to even: :class:`FoldReport` counts them); another mean is rounded
(:func:`choose_zero_point`). Needs LiteRT's schema and ``flatbuffers`` (not armv7).

Source: TFLite schema (``schema.fbs``: Tensor, Operator, QuantizeOptions); TensorFlow Lite 8-bit
quantization specification (``real = scale * (q - zero_point)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgefl.errors import ModelError

BUFFER_ALIGNMENT = 16  # bytes: what the TFLite converter gives constant buffers


@dataclass(frozen=True, slots=True)
class FoldReport:
    """What :func:`fold_input_normalisation` did.

    ``scale`` (``1 / std``) and ``zero_point`` of the uint8 input; ``mean_used`` the pipeline's mean (=
    ``zero_point``); ``shift_steps`` the shift from the requested normalisation in int8 input steps (0
    for an integer mean, at most 0.5); ``ties`` raw values requantised exactly half-way between two
    steps; ``clipped`` raw values that saturate.
    """

    scale: float
    zero_point: int
    mean_used: float
    shift_steps: float
    ties: int
    clipped: int


def _requantised(zp: int, std: float, s: float, z: int) -> tuple[np.ndarray, int]:
    """int8 values of raw 0..255 through the QUANTIZE op (half away from zero), and the tie count."""
    raw = np.arange(256, dtype=np.float64)
    v = (raw - zp) / (std * s)
    ties = int(np.count_nonzero(np.abs(v - np.trunc(v)) == 0.5))
    q = np.sign(v) * np.floor(np.abs(v) + 0.5) + z
    return np.clip(q, -128, 127), ties


def choose_zero_point(mean: float, std: float, s: float, z: int) -> int:
    """The uint8 zero point for ``mean`` (0..255, else ModelError).

    The mean itself when an integer, else its floor or ceiling, whichever keeps the most raw values
    distinct after requantising to the int8 input (the floor on a tie).
    """
    if not 0.0 <= mean <= 255.0:
        raise ModelError("--mean", f"mean {mean} outside 0..255: not a uint8 zero point")
    if float(mean).is_integer():
        return int(mean)
    lo, hi = math.floor(mean), math.ceil(mean)
    distinct = {zp: len(np.unique(_requantised(zp, std, s, z)[0])) for zp in (lo, hi)}
    return hi if distinct[hi] > distinct[lo] else lo


class _AlignedBuffer:
    """Packs a Buffer table with its bytes aligned to :data:`BUFFER_ALIGNMENT` (flatbuffers aligns to 1)."""

    def __init__(self, data: Any, offset: int, size: int) -> None:
        self.data = data
        self.offset = offset
        self.size = size

    def Pack(self, builder: Any) -> int:  # noqa: N802  (the flatbuffers object API's name)
        from ai_edge_litert import schema_py_generated as schema

        vec = None
        if self.data is not None:
            raw = np.asarray(self.data, dtype=np.uint8).tobytes()
            builder.StartVector(1, len(raw), BUFFER_ALIGNMENT)
            builder.head = builder.head - len(raw)
            builder.Bytes[builder.head : builder.head + len(raw)] = raw
            vec = builder.EndVector()
        schema.BufferStart(builder)
        if vec is not None:
            schema.BufferAddData(builder, vec)
        schema.BufferAddOffset(builder, self.offset)
        schema.BufferAddSize(builder, self.size)
        end: int = schema.BufferEnd(builder)
        return end


def fold_input_normalisation(
    buf: bytes, mean: float, std: float, *, raw_dtype: str = "uint8", path: str = "<model>"
) -> tuple[bytes, FoldReport]:
    """Give an int8-input model a uint8 input holding ``(raw - mean) / std``, through one QUANTIZE op.

    ``buf`` is the ``.tflite`` file, ``path`` names it in errors. Returns the new model (one tensor and
    one op added, indices and outputs unchanged) and a :class:`FoldReport`.

    Raises
    ------
    ModelError
        If the input is not int8, ``raw_dtype`` is not uint8, ``std <= 0`` or the mean is outside
        0..255, or the schema module is not importable.
    """
    if raw_dtype != "uint8":
        raise ModelError(path, f"--raw-dtype {raw_dtype}: only uint8 raw samples can be folded")
    if not std > 0 or not math.isfinite(std) or not math.isfinite(mean):
        raise ModelError(path, f"--std {std} / --mean {mean}: std must be > 0 and both finite")
    try:
        import flatbuffers  # type: ignore[import-untyped]
        from ai_edge_litert import schema_py_generated as schema
    except ImportError as exc:
        raise ModelError(
            path, f"folding needs ai-edge-litert's schema and flatbuffers ({exc}): run it on a dev machine"
        ) from exc
    model = schema.ModelT.InitFromPackedBuf(bytearray(buf), 0)
    graph = model.subgraphs[0]
    if len(graph.inputs) != 1:
        raise ModelError(path, f"expected 1 input, found {len(graph.inputs)}")
    old = int(graph.inputs[0])
    tin = graph.tensors[old]
    if tin.type != schema.TensorType.INT8 or tin.quantization is None or not tin.quantization.scale:
        raise ModelError(path, "the model input is not a quantised int8 tensor: nothing to fold")
    s = float(tin.quantization.scale[0])
    z = int(tin.quantization.zeroPoint[0])
    zp = choose_zero_point(mean, std, s, z)
    q, ties = _requantised(zp, std, s, z)
    report = FoldReport(
        scale=float(np.float32(1.0 / std)),
        zero_point=zp,
        mean_used=float(zp),
        shift_steps=abs(mean - zp) / (std * s),
        ties=ties,
        clipped=int(np.count_nonzero((q == -128) | (q == 127))),
    )

    model.buffers.append(schema.BufferT())
    new = schema.TensorT()
    new.shape = tin.shape
    new.shapeSignature = tin.shapeSignature
    new.type = schema.TensorType.UINT8
    new.buffer = len(model.buffers) - 1
    new.name = (tin.name or b"input") + b"_uint8"  # the object API keeps names as bytes
    new.quantization = schema.QuantizationParametersT()
    new.quantization.scale = [report.scale]
    new.quantization.zeroPoint = [zp]
    graph.tensors.append(new)
    index = len(graph.tensors) - 1

    quantize = schema.BuiltinOperator.QUANTIZE
    codes = [max(oc.builtinCode, oc.deprecatedBuiltinCode) for oc in model.operatorCodes]
    code = codes.index(quantize) if quantize in codes else None
    if code is None:
        oc = schema.OperatorCodeT()
        oc.builtinCode = quantize
        oc.deprecatedBuiltinCode = quantize
        oc.version = 1  # what the converter writes for a uint8 -> int8 QUANTIZE (models/*_rawin.tflite)
        model.operatorCodes.append(oc)
        code = len(model.operatorCodes) - 1
    op = schema.OperatorT()
    op.opcodeIndex = code
    op.inputs = [index]
    op.outputs = [old]
    op.builtinOptionsType = schema.BuiltinOptions.QuantizeOptions
    op.builtinOptions = schema.QuantizeOptionsT()
    graph.operators.insert(0, op)
    graph.inputs = [index]
    for sig in model.signatureDefs or []:
        if sig.subgraphIndex == 0:
            for t in sig.inputs or []:
                if t.tensorIndex == old:
                    t.tensorIndex = index
    model.buffers = [_AlignedBuffer(b.data, b.offset, b.size) for b in model.buffers]
    builder = flatbuffers.Builder(len(buf) + 4096)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output()), report
