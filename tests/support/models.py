"""Model files the tests and benches build from the shipped ones, and the head-vs-model comparison.

:func:`widen_head` builds a classifier with a wider head; :func:`activate` and :func:`logits_range`
compare a float head with the model's own output; :func:`run_backbone` invokes a loaded model on
model input directly (the agent goes through ``edgefl.agent.pipeline.Pipeline``).

A held-back model's shape is rebuilt here from a shipped backbone rather than shipped: the head of a
shipped model (its last FULLY_CONNECTED op: weights ``[K, D]``, bias ``[K]``, output ``[-1, K]``) is
replaced by a seeded random head of ``classes`` outputs; every other tensor, op and buffer is the
original's. E.g. the MobileNetV2-0.35-96 float32 backbone with 19 classes is a 1280 x 19 float head
(the shape of a third-party model with 19 classes).

Needs LiteRT's generated schema (``ai_edge_litert.schema_py_generated``) and ``flatbuffers``, both
installed with ai-edge-litert.

Source: TFLite schema (``schema.fbs``: Model, SubGraph, Tensor, Buffer, Operator).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgefl import modelfile
from edgefl.head import sigmoid, softmax
from edgefl.types import F32

if TYPE_CHECKING:
    from edgefl.runtime import Backbone, Quant

FULLY_CONNECTED = 9


def widen_head(model: Path, classes: int, *, seed: int = 0) -> bytes:
    """The ``.tflite`` bytes of ``model`` with its float32 head replaced by one of ``classes`` outputs.

    Parameters
    ----------
    model : Path
        A float32 classifier whose last op is FULLY_CONNECTED (weights, bias) -> the model's output.
    classes : int
        K of the new head, >= 1.
    seed : int
        Seed of the new weights (normal, std 1/sqrt(D)) and bias (normal, std 0.1).

    Returns
    -------
    bytes
        The new model file.

    Raises
    ------
    ValueError
        If the last op is not a float32 FULLY_CONNECTED with constant weights and bias.
    """
    import flatbuffers  # type: ignore[import-untyped]
    from ai_edge_litert import schema_py_generated as schema

    m = schema.ModelT.InitFromPackedBuf(model.read_bytes(), 0)
    g = m.subgraphs[0]
    op = g.operators[-1]
    code = m.operatorCodes[op.opcodeIndex]
    if max(code.builtinCode, code.deprecatedBuiltinCode) != FULLY_CONNECTED or len(op.inputs) != 3:
        raise ValueError(f"{model}: the last op is not FULLY_CONNECTED(x, W, b)")
    w_t, b_t, out_t = (g.tensors[int(i)] for i in (op.inputs[1], op.inputs[2], op.outputs[0]))
    if any(t.type != 0 for t in (w_t, b_t, out_t)):
        raise ValueError(f"{model}: the head is not float32")
    dim = int(w_t.shape[1])
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0, 1.0 / np.sqrt(dim), (classes, dim)).astype("<f4")
    b = rng.normal(0.0, 0.1, classes).astype("<f4")
    for t, arr in ((w_t, w), (b_t, b)):
        t.shape = np.array(arr.shape, np.int32)
        m.buffers[t.buffer].data = np.frombuffer(arr.tobytes(), np.uint8)
    out_t.shape = np.array([1, classes], np.int32)
    out_t.shapeSignature = np.array([-1, classes], np.int32)
    builder = flatbuffers.Builder(1 << 20)
    builder.Finish(m.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def activate(logits: F32, activation: str) -> F32:
    """The model's own activation (``"softmax"``, ``"logistic"``, ``"none"``) on head logits float32 [N, K].

    ValueError for another activation name.
    """
    if activation == "softmax":
        return softmax(logits.copy())
    if activation == "logistic":
        return sigmoid(logits)
    if activation == "none":
        return logits
    raise ValueError(f"activation {activation!r}: expected softmax, logistic or none")


def logits_range(bb: Backbone) -> tuple[float, float] | None:
    """The real range ``bb``'s own FC output can hold (its int8 saturation), or None (float).

    A float head goes on past it, so head-vs-model comparisons clip to it first.
    """
    fc = modelfile.head_fc(bb.graph) if bb.head_weights_index is not None else None
    if fc is None:
        return None
    t = bb.graph.tensors[bb.graph.ops[fc].outputs[0]]
    if not t.scales or t.dtype not in ("int8", "uint8"):
        return None
    info = np.iinfo(np.dtype(t.dtype))
    s, z = t.scales[0], t.zero_points[0]
    return (info.min - z) * s, (info.max - z) * s


def dequantize(q: np.ndarray, quant: Quant) -> F32:
    """``scale * (q - zero_point)`` of an integer tensor as float32 (a float tensor as float32 unchanged).

    Source: TensorFlow Lite 8-bit quantization spec (tensorflow.org/lite/performance/quantization_spec).
    """
    if quant.scale == 0.0 or q.dtype == np.float32:
        return q.astype(np.float32, copy=False)
    out: F32 = ((q.astype(np.float32) - np.float32(quant.zero_point)) * np.float32(quant.scale)).astype(
        np.float32
    )
    return out


def resize_backbone(bb: Backbone, batch: int) -> None:
    """Resize ``bb``'s input to ``batch`` >= 1 samples (else ValueError) and re-allocate (views go stale)."""
    if batch < 1:
        raise ValueError(f"batch {batch} must be >= 1")
    with bb.claim():
        if batch == bb.batch:
            return
        bb.interpreter.resize_tensor_input(bb.input_index, [batch, *bb.sample_shape])
        bb.interpreter.allocate_tensors()
        bb.batch = batch


def run_backbone(bb: Backbone, model_input: np.ndarray) -> tuple[F32, F32]:
    """Invoke ``bb`` on one batch [N, *sample_shape] in the input dtype (else ValueError).

    Returns the embeddings float32 [N, D] and the model's own logits float32 [N, K], dequantised.
    """
    n = int(model_input.shape[0])
    if tuple(model_input.shape[1:]) != bb.sample_shape or model_input.dtype != bb.input_dtype:
        raise ValueError(
            f"input {model_input.shape} {model_input.dtype}, model expects [N, {bb.sample_shape}] "
            f"{bb.input_dtype}"
        )
    if not bb.resizable and n != bb.batch:
        parts = [run_backbone(bb, model_input[i : i + 1]) for i in range(n)] if bb.batch == 1 else None
        if parts is None:
            raise ValueError(f"model batch is fixed at {bb.batch}; got {n} samples")
        return (
            np.concatenate([p[0] for p in parts]).astype(np.float32),
            np.concatenate([p[1] for p in parts]).astype(np.float32),
        )
    with bb.claim():
        resize_backbone(bb, n)
        bb.interpreter.set_tensor(bb.input_index, model_input)
        bb.interpreter.invoke()
        emb = dequantize(bb.interpreter.get_tensor(bb.embedding_index), bb.embedding_quant)
        logits = dequantize(bb.interpreter.get_tensor(bb.output_index), bb.output_quant)
    return emb.reshape(n, -1), logits.reshape(n, -1)
