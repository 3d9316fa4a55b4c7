"""Read a ``.tflite`` flatbuffer without TensorFlow, and add model outputs to it in place.

A minimal reader of the TFLite schema and one writer, :func:`set_outputs`, which leaves every other
byte where it was. Pure Python: it runs where only tflite-runtime exists (armv7l).

Source: FlatBuffers binary format (flatbuffers.dev, "Internals"); TFLite schema
``tensorflow/compiler/mlir/lite/schema/schema.fbs`` (its field order gives the vtable slots).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from typing import Any

from edgefl.errors import ModelError

ModelBytes = bytes | bytearray | mmap.mmap
"""A whole .tflite file in memory or memory-mapped."""

# TensorType (schema.fbs) -> numpy dtype name, for the types a classifier uses
TENSOR_TYPES: dict[int, str] = {
    0: "float32",
    1: "float16",
    2: "int32",
    3: "uint8",
    4: "int64",
    5: "string",
    6: "bool",
    7: "int16",
    9: "int8",
    10: "float64",
    13: "resource",
    14: "variant",
    15: "uint32",
    16: "uint16",
    17: "int4",
}

# BuiltinOperator codes (schema.fbs) edgefl looks for (any other op is named ``OP<code>``)
OP_NAMES: dict[int, str] = {
    6: "DEQUANTIZE",
    9: "FULLY_CONNECTED",
    14: "LOGISTIC",
    16: "LSTM",
    22: "RESHAPE",
    24: "RNN",
    25: "SOFTMAX",
    27: "SVDF",
    35: "UNIDIRECTIONAL_SEQUENCE_RNN",
    44: "UNIDIRECTIONAL_SEQUENCE_LSTM",
    52: "BIDIRECTIONAL_SEQUENCE_LSTM",
    114: "QUANTIZE",
    129: "CALL_ONCE",
    142: "VAR_HANDLE",
    143: "READ_VARIABLE",
    144: "ASSIGN_VARIABLE",
}
# Ops that keep state between invokes: resource variables, or kernels with variable tensors.
STATEFUL_OPS = frozenset(
    {"VAR_HANDLE", "READ_VARIABLE", "ASSIGN_VARIABLE", "CALL_ONCE", "SVDF", "LSTM", "RNN",
     "UNIDIRECTIONAL_SEQUENCE_LSTM", "UNIDIRECTIONAL_SEQUENCE_RNN", "BIDIRECTIONAL_SEQUENCE_LSTM"}
)  # fmt: skip
_PLACEHOLDER_FOR_GREATER_OP_CODES = 127


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of subgraph 0.

    ``dtype`` is a numpy dtype name (or ``resource``/``variant``/``type<N>``); ``shape_signature`` has
    -1 for dynamic dimensions (empty: as ``shape``); ``has_data``: a constant (its ``buffer`` holds bytes).
    """

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    shape_signature: tuple[int, ...]
    buffer: int
    has_data: bool
    scales: tuple[float, ...]
    zero_points: tuple[int, ...]
    is_variable: bool


@dataclass(frozen=True, slots=True)
class OpInfo:
    """One operator of subgraph 0, in execution order: its name and tensor indices (-1 = absent)."""

    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GraphInfo:
    """Subgraph 0 of a TFLite model (the one the interpreter runs).

    ``inputs``/``outputs`` are tensor indices; ``outputs_field`` is the byte position of
    ``SubGraph.outputs``'s uoffset in the file (for :func:`set_outputs`).
    """

    tensors: list[TensorInfo]
    ops: list[OpInfo]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    outputs_field: int = field(repr=False)


class _Reader:
    """Bounds-checked reads of flatbuffer tables and vectors from ``buf``."""

    def __init__(self, buf: ModelBytes) -> None:
        self.buf = buf

    def u32(self, pos: int) -> int:
        return int(self.scalar("I", pos))

    def scalar(self, fmt: str, pos: int) -> int | float:
        if pos < 0 or pos + struct.calcsize(fmt) > len(self.buf):
            raise ValueError(f"offset {pos} outside the file ({len(self.buf)} bytes)")
        value: int | float = struct.unpack_from("<" + fmt, self.buf, pos)[0]
        return value

    def field_pos(self, table: int, slot: int) -> int | None:
        """Position of a table's field (``slot`` = 4 + 2 * field id), or None when absent."""
        vtable = table - int(self.scalar("i", table))
        vt_size = int(self.scalar("H", vtable))
        if slot >= vt_size:
            return None
        off = int(self.scalar("H", vtable + slot))
        return table + off if off else None

    def get(self, table: int, slot: int, fmt: str, default: int | float = 0) -> int | float:
        pos = self.field_pos(table, slot)
        return default if pos is None else self.scalar(fmt, pos)

    def ref(self, table: int, slot: int) -> int | None:
        """Target of an offset field (table, vector or string), or None when absent."""
        pos = self.field_pos(table, slot)
        return None if pos is None else pos + self.u32(pos)

    def vector(self, table: int, slot: int) -> tuple[int, int]:
        """``(position of element 0, length)`` of a vector field; ``(0, 0)`` when absent."""
        vec = self.ref(table, slot)
        if vec is None:
            return 0, 0
        n = self.u32(vec)
        return vec + 4, n

    def numbers(self, table: int, slot: int, fmt: str = "i") -> tuple[Any, ...]:
        """A vector field of ``fmt`` scalars (ints or floats), ``()`` when absent."""
        start, n = self.vector(table, slot)
        if start + n * struct.calcsize(fmt) > len(self.buf):
            raise ValueError("vector runs past the end of the file")
        return struct.unpack_from(f"<{n}{fmt}", self.buf, start) if n else ()

    def tables(self, table: int, slot: int) -> list[int]:
        start, n = self.vector(table, slot)
        return [start + 4 * i + self.u32(start + 4 * i) for i in range(n)]

    def string(self, table: int, slot: int) -> str:
        pos = self.ref(table, slot)
        if pos is None:
            return ""
        n = self.u32(pos)
        return self.buf[pos + 4 : pos + 4 + n].decode("utf-8", errors="replace")


def read_graph(buf: ModelBytes, path: str = "<model>") -> GraphInfo:
    """Parse subgraph 0 of a whole ``.tflite`` file (``path`` names it in errors).

    ModelError if the bytes are not a TFLite model (no ``TFL3`` identifier) or an offset points outside.
    """
    if len(buf) < 8 or buf[4:8] != b"TFL3":
        raise ModelError(path, "not a TFLite flatbuffer (no TFL3 file identifier)")
    r = _Reader(buf)
    try:
        model = r.u32(0)
        codes: list[str] = []
        for oc in r.tables(model, 6):
            code = max(int(r.get(oc, 4, "b")), int(r.get(oc, 10, "i")))
            if code == _PLACEHOLDER_FOR_GREATER_OP_CODES:
                code = int(r.get(oc, 10, "i"))
            custom = r.string(oc, 6)
            codes.append(custom if custom else OP_NAMES.get(code, f"OP{code}"))
        buffers = r.tables(model, 12)
        subgraphs = r.tables(model, 8)
        if not subgraphs:
            raise ModelError(path, "the model has no subgraph")
        sg = subgraphs[0]
        tensors: list[TensorInfo] = []
        for i, t in enumerate(r.tables(sg, 4)):
            buffer = int(r.get(t, 8, "I"))
            has_data = False
            if 0 < buffer < len(buffers):
                _, n = r.vector(buffers[buffer], 4)
                has_data = n > 0 or int(r.get(buffers[buffer], 6, "Q")) > 1
            q = r.ref(t, 12)
            ttype = int(r.get(t, 6, "b"))
            tensors.append(
                TensorInfo(
                    index=i,
                    name=r.string(t, 10),
                    dtype=TENSOR_TYPES.get(ttype, f"type{ttype}"),
                    shape=r.numbers(t, 4),
                    shape_signature=r.numbers(t, 18),
                    buffer=buffer,
                    has_data=has_data,
                    scales=r.numbers(q, 8, "f") if q is not None else (),
                    zero_points=r.numbers(q, 10, "q") if q is not None else (),
                    is_variable=bool(r.get(t, 14, "B")),
                )
            )
        ops: list[OpInfo] = []
        for op in r.tables(sg, 10):
            idx = int(r.get(op, 4, "I"))
            if idx >= len(codes):
                raise ModelError(path, f"operator code index {idx} out of range")
            ops.append(OpInfo(codes[idx], r.numbers(op, 6), r.numbers(op, 8)))
        outputs_field = r.field_pos(sg, 8)
        if outputs_field is None:
            raise ModelError(path, "subgraph 0 has no outputs vector")
        return GraphInfo(
            tensors=tensors,
            ops=ops,
            inputs=r.numbers(sg, 6),
            outputs=r.numbers(sg, 8),
            outputs_field=outputs_field,
        )
    except (ValueError, struct.error, IndexError) as exc:
        raise ModelError(path, f"corrupt flatbuffer: {exc}") from exc


def add_outputs(buf: ModelBytes, extra: list[int], path: str = "<model>") -> bytes:
    """The model with tensors ``extra`` (those not outputs yet) appended to subgraph 0's outputs.

    The original outputs come first, unchanged; ModelError as :func:`set_outputs`.
    """
    graph = read_graph(buf, path)
    new = [i for i in dict.fromkeys(extra) if i not in graph.outputs]
    return set_outputs(buf, list(graph.outputs) + new, path) if new else bytes(buf)


def set_outputs(buf: ModelBytes, outputs: list[int], path: str = "<model>") -> bytes:
    """The model with subgraph 0's outputs replaced by the tensor indices ``outputs`` (at least one).

    The new vector is appended at the end of the file (4-byte aligned) and the field re-pointed at it:
    every other byte stays where it was. ModelError if the file is not a TFLite model, an index is not
    a tensor of subgraph 0, or buffers live outside the flatbuffer (appended bytes would shift them).
    """
    graph = read_graph(buf, path)
    if not outputs:
        raise ModelError(path, "a model needs at least one output")
    for i in outputs:
        if not 0 <= i < len(graph.tensors):
            raise ModelError(path, f"tensor {i} is not in subgraph 0 ({len(graph.tensors)} tensors)")
    r = _Reader(buf)
    for b in r.tables(r.u32(0), 12):
        if int(r.get(b, 6, "Q")) > 1:
            raise ModelError(path, "buffers stored outside the flatbuffer are not supported")
    pad = (-len(buf)) % 4
    vec_pos = len(buf) + pad
    tail = b"\0" * pad + struct.pack(f"<I{len(outputs)}i", len(outputs), *outputs)
    out = bytearray(buf)
    struct.pack_into("<I", out, graph.outputs_field, vec_pos - graph.outputs_field)
    out += tail
    return bytes(out)


def head_fc(graph: GraphInfo) -> int | None:
    """Index in ``graph.ops`` of the head: the last FULLY_CONNECTED op, or None."""
    fcs = [k for k, op in enumerate(graph.ops) if op.name == "FULLY_CONNECTED"]
    return fcs[-1] if fcs else None


def head_activation(graph: GraphInfo, fc: int) -> str:
    """The activation applied to the head's output before the model's output.

    Follows the FC output through ops that do not change values beyond requantisation (QUANTIZE,
    DEQUANTIZE, RESHAPE) and returns ``"softmax"``, ``"logistic"`` or ``"none"``.
    """
    tensor = graph.ops[fc].outputs[0]
    for op in graph.ops[fc + 1 :]:
        if tensor not in op.inputs:
            continue
        if op.name == "SOFTMAX":
            return "softmax"
        if op.name == "LOGISTIC":
            return "logistic"
        if op.name in ("QUANTIZE", "DEQUANTIZE", "RESHAPE"):
            tensor = op.outputs[0]
            continue
        return "none"
    return "none"


def head_output(graph: GraphInfo, fc: int) -> int:
    """The model output fed by the head (its FC output, or the output after its activation)."""
    tensor = graph.ops[fc].outputs[0]
    if tensor in graph.outputs:
        return tensor
    for op in graph.ops[fc + 1 :]:
        if tensor in op.inputs and op.name in ("SOFTMAX", "LOGISTIC", "QUANTIZE", "DEQUANTIZE", "RESHAPE"):
            tensor = op.outputs[0]
            if tensor in graph.outputs:
                return tensor
    return tensor


def find_tensor(graph: GraphInfo, name: str, path: str) -> int:
    """Index of the tensor called ``name`` (the profile's ``model.embedding_tensor``); ModelError if none."""
    found = [t.index for t in graph.tensors if t.name == name]
    if not found:
        raise ModelError(path, f"embedding tensor {name!r} not found in the model")
    return found[0]


def stateful_ops(graph: GraphInfo) -> list[str]:
    """Names of the ops that carry state between invokes (sorted, unique)."""
    found = {op.name for op in graph.ops if op.name in STATEFUL_OPS}
    if any(t.is_variable for t in graph.tensors):
        found.add("variable tensors")
    return sorted(found)


# --- backbone identity ----------------------------------------------------------------------------
ORIGIN_MAGIC = b"EFLO"
_ORIGIN = struct.Struct("<4sI32s4s")  # magic, format version (1), SHA-256 of the original, magic
ORIGIN_TRAILER_BYTES = _ORIGIN.size
"""Bytes of the trailer ``edgefl model prepare`` appends: the original model's SHA-256 (44 bytes)."""


def read_origin(buf: ModelBytes) -> str | None:
    """The original model's SHA-256 (64 hex digits) recorded by ``edgefl model prepare``, or None.

    The trailer (the file's last :data:`ORIGIN_TRAILER_BYTES`, never read by a TFLite loader): ``b"EFLO"``,
    u32 version 1, the 32-byte digest, ``b"EFLO"``.
    """
    if len(buf) < ORIGIN_TRAILER_BYTES:
        return None
    magic, version, digest, end = _ORIGIN.unpack(bytes(buf[len(buf) - ORIGIN_TRAILER_BYTES :]))
    if magic != ORIGIN_MAGIC or end != ORIGIN_MAGIC or version != 1:
        return None
    return bytes(digest).hex()


def strip_origin(buf: ModelBytes) -> bytes:
    """The model without its origin trailer (``bytes(buf)`` when it has none)."""
    data = bytes(buf)
    return data[: len(data) - ORIGIN_TRAILER_BYTES] if read_origin(data) is not None else data


def with_origin(buf: ModelBytes, origin_sha256: str) -> bytes:
    """The prepared model with a trailer recording the original's ``origin_sha256`` (64 hex digits).

    4-byte aligned, an older trailer replaced; ValueError for another ``origin_sha256``.
    """
    digest = bytes.fromhex(origin_sha256)
    if len(digest) != 32:
        raise ValueError(f"origin_sha256 = {origin_sha256!r}: must be 64 hex digits")
    data = strip_origin(buf)
    pad = b"\0" * (-len(data) % 4)
    return data + pad + _ORIGIN.pack(ORIGIN_MAGIC, 1, digest, ORIGIN_MAGIC)
