"""Build, verify and describe the shipped .tflite models (needs the ``build`` extra: tensorflow-cpu).

Never needed by ``make demo`` or ``make test``: the .tflite files it writes are committed. Run it in a
separate venv::

    python3 -m venv .venv-build
    .venv-build/bin/pip install tensorflow-cpu numpy ai-edge-litert
    .venv-build/bin/python tools/build_models.py [--out models] [--seed 0] [--only digits|mobilenet]

Models
------
- ``digits_cnn_{float32,int8}.tflite``: a small CNN for the 8x8 UCI digits. Backbone trained with a
  10-class head on the *public* split; then the *factory head* (the last Dense) is refitted with the
  backbone frozen on the public samples of ``FACTORY_CLASSES`` only. Input = raw / 16.
- ``mobilenet_v2_035_96_{float32,int8}.tflite``: MobileNetV2 (alpha 0.35, 96x96x3), random seeded
  weights, global average pooling, Dense 10. A MobileNet-class backbone for runtime and memory
  benchmarks (its accuracy means nothing). Input = raw / 127.5 - 1.
- ``*_int8_rawin.tflite`` (``RAW_INPUT``): the int8 models with the normalisation folded into the input
  quantisation: a uint8 input whose (scale, zero point) make the raw frame itself the model input, so
  the agent's preprocessing is a copy. The converter's ``inference_input_type=tf.uint8`` puts a
  QUANTIZE op (uint8 -> the int8 input of the int8 model) first; :func:`fold_input_quantisation` then
  sets the uint8 tensor's quantisation. Everything after that QUANTIZE op is the int8 model.

Both end in a FULLY_CONNECTED op whose input is the embedding and whose output is the logits (no
softmax). Every input has a dynamic batch (shape_signature [-1, ...]): LiteRT's ``resize_tensor_input``
plus ``allocate_tensors`` runs B samples per ``invoke()``. Variables are frozen to constants before
conversion. After writing, every model is run with LiteRT (``ai_edge_litert``), the batch resize is
checked against batch 1, and the numbers of ``models/README.md`` are printed.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from edgefl.datasets import (  # noqa: E402  (the repo root must be on sys.path first)
    FACTORY_CLASSES,
    DigitsSplit,
    load_digits,
    split_digits,
)
from edgefl.types import F32, I8, I64, U8  # noqa: E402

logger = logging.getLogger(__name__)

N_CLASSES = 10
DIGITS_CONV2_CHANNELS = 32
FACTORY_HEAD_L2 = 5e-2
DIGITS_EMBEDDING_D = 4 * 4 * DIGITS_CONV2_CHANNELS  # the flattened conv2 output after one 2x2 pooling
MOBILENET_SIDE = 96
MOBILENET_ALPHA = 0.35
DIGITS_EPOCHS = 120
FACTORY_HEAD_EPOCHS = 300
BATCH_SIZE = 32
REPRESENTATIVE_FRAMES = 200
BN_FRAMES = 64
#: Raw-input variants: int8 model -> (file, uint8 input scale, zero point) with real = scale * (raw - zp).
#: digits: raw 0..16, x = raw / 16 exactly (scale 1/16, zero point 0); the QUANTIZE op requantises to
#: the int8 model's input (1/255, -128). MobileNet: x = raw / 127.5 - 1 needs zero point 127.5, not an
#: integer; 127 (the converter's own choice for a uint8 input, = int8 zero point -1 + 128) gives
#: real = (raw - 127) / 127.5 = x + 1/255, half an input step high, and the QUANTIZE op is then an exact
#: shift q8 = raw - 128 (all 256 raw values distinct, none clipped).
RAW_INPUT = {
    "digits_cnn_int8.tflite": ("digits_cnn_int8_rawin.tflite", 1.0 / 16.0, 0),
    "mobilenet_v2_035_96_int8.tflite": ("mobilenet_v2_035_96_int8_rawin.tflite", 1.0 / 127.5, 127),
}


# --- numpy helpers (no tensorflow) -------------------------------------------------------------------


def digits_input(raw: U8) -> F32:
    """Normalise raw digits for the digits CNN.

    Parameters
    ----------
    raw : uint8 [N, 8, 8, 1]
        Pixel values 0..16.

    Returns
    -------
    float32 [N, 8, 8, 1]
        ``raw / 16``, in [0, 1].
    """
    return (raw.astype(np.float32) / np.float32(16.0)).astype(np.float32)


def random_frames(n: int, seed: int) -> U8:
    """Generate seeded random camera-like frames for MobileNet calibration and checks.

    Parameters
    ----------
    n : int
        Number of frames.
    seed : int
        Seed of ``numpy.random.default_rng``.

    Returns
    -------
    uint8 [n, 96, 96, 3]
        Uniform random pixels 0..255.
    """
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, MOBILENET_SIDE, MOBILENET_SIDE, 3), dtype=np.uint8)


def mobilenet_input(raw: U8) -> F32:
    """Normalise raw RGB frames for MobileNetV2.

    Parameters
    ----------
    raw : uint8 [N, 96, 96, 3]
        Pixel values 0..255.

    Returns
    -------
    float32 [N, 96, 96, 3]
        ``raw / 127.5 - 1``, in [-1, 1] (``tf.keras.applications.mobilenet_v2.preprocess_input``).
    """
    return (raw.astype(np.float32) / np.float32(127.5) - np.float32(1.0)).astype(np.float32)


def fit_softmax_head(
    emb: F32, labels: I64, n_classes: int, steps: int = 3000, l2: float = 1e-4
) -> tuple[F32, F32]:
    """Fit a softmax-regression head centrally by full-batch gradient descent.

    The step size is ``1 / L`` with ``L = 0.5 * lambda_max(X^T X / N) + l2`` (with a bias column), an
    upper bound of the Lipschitz constant of the cross-entropy gradient, so no tuning is needed.

    Parameters
    ----------
    emb : float32 [N, D]
        Embeddings.
    labels : int64 [N]
        Class labels 0..n_classes-1.
    n_classes : int
        K.
    steps : int
        Gradient steps.
    l2 : float
        Weight decay on W (not b).

    Returns
    -------
    W : float32 [D, K]
    b : float32 [K]

    Source: Böhning, "Multinomial logistic regression algorithm", Ann. Inst. Stat. Math. 44 (1992)
    (the Hessian bound 0.5 * X^T X).
    """
    x = np.concatenate([emb.astype(np.float64), np.ones((emb.shape[0], 1))], axis=1)
    onehot = np.eye(n_classes)[labels]
    lipschitz = 0.5 * float(np.linalg.eigvalsh(x.T @ x / x.shape[0]).max()) + l2
    lr = 1.0 / lipschitz
    wb = np.zeros((x.shape[1], n_classes))
    for _ in range(steps):
        z = x @ wb
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        grad = x.T @ (p - onehot) / x.shape[0]
        grad[:-1] += l2 * wb[:-1]
        wb -= lr * grad
    return wb[:-1].astype(np.float32), wb[-1].astype(np.float32)


def sha256_of(path: Path) -> str:
    """Return the hex SHA-256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- LiteRT verification (no tensorflow) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One model input/output/embedding tensor as LiteRT reports it.

    Attributes
    ----------
    name : str
    index : int
    shape : tuple[int, ...]
        The current shape (batch 1 until the input is resized).
    shape_signature : tuple[int, ...]
        The shape stored in the file; -1 marks a dynamic dimension (the batch).
    dtype : str
    scale : float
        Quantisation scale (0.0 for float tensors).
    zero_point : int
    """

    name: str
    index: int
    shape: tuple[int, ...]
    shape_signature: tuple[int, ...]
    dtype: str
    scale: float
    zero_point: int


@dataclass(frozen=True, slots=True)
class ModelCheck:
    """What running one .tflite file with LiteRT showed.

    Four interpreters run every sample: ``reference`` (BUILTIN_WITHOUT_DEFAULT_DELEGATES and
    ``experimental_preserve_all_tensors=True``: reference kernels, every tensor kept), ``no_delegate``
    (BUILTIN_WITHOUT_DEFAULT_DELEGATES), ``default`` (the default AUTO resolver, which applies XNNPACK)
    and ``default_preserved`` (AUTO with ``experimental_preserve_all_tensors=True``).

    Attributes
    ----------
    input : TensorInfo
    output : TensorInfo
    embedding : TensorInfo
        The input tensor of the last FULLY_CONNECTED op.
    fc_weight : TensorInfo
        Its weight tensor, [K, D] (the transpose of the head's W [D, K]).
    fc_bias : TensorInfo or None
        Its bias tensor [K] (int32 in int8 models), None when the op has none (index -1).
    ops : tuple[str, ...]
        Op names in execution order (read before ``allocate_tensors()``).
    ops_after_allocate : tuple[str, ...]
        ``_get_ops_details()`` op names of the default interpreter after ``allocate_tensors()``.
    embeddings : float32 [N, D]
        Dequantised embeddings read from ``reference``.
    logits : float32 [N, K]
        Dequantised model outputs of ``reference``.
    embedding_read : dict[str, float | str]
        Per other interpreter: max |embedding read with get_tensor after invoke() - reference| over all
        samples (dequantised units), or the error ``get_tensor`` raised.
    max_abs_logit_diff_default : float
        Max |default interpreter's output - reference output| (dequantised units).
    us_per_invoke : dict[str, float]
        Mean wall time of one ``invoke()`` (batch 1) of ``default`` and ``no_delegate``, microseconds.
    """

    input: TensorInfo
    output: TensorInfo
    embedding: TensorInfo
    fc_weight: TensorInfo
    fc_bias: TensorInfo | None
    ops: tuple[str, ...]
    ops_after_allocate: tuple[str, ...]
    embeddings: F32
    logits: F32
    embedding_read: dict[str, float | str]
    max_abs_logit_diff_default: float
    us_per_invoke: dict[str, float]


def _tensor_info(detail: dict[str, Any]) -> TensorInfo:
    scale, zero_point = detail["quantization"]
    return TensorInfo(
        name=str(detail["name"]),
        index=int(detail["index"]),
        shape=tuple(int(s) for s in detail["shape"]),
        shape_signature=tuple(int(s) for s in detail.get("shape_signature", detail["shape"])),
        dtype=np.dtype(detail["dtype"]).name,
        scale=float(scale),
        zero_point=int(zero_point),
    )


def _dequantise(values: np.ndarray[Any, Any], info: TensorInfo) -> F32:
    if info.scale == 0.0:
        return values.astype(np.float32)
    return ((values.astype(np.float32) - np.float32(info.zero_point)) * np.float32(info.scale)).astype(
        np.float32
    )


def _quantise_input(x: np.ndarray[Any, Any], info: TensorInfo) -> np.ndarray[Any, Any]:
    """Normalised float32 -> the input dtype; an array already of the input dtype (raw) is fed as is."""
    if x.dtype == np.dtype(info.dtype):
        return x
    if info.scale == 0.0:
        return x.astype(np.float32)
    limits = np.iinfo(np.dtype(info.dtype))
    q: np.ndarray[Any, Any] = np.round(x / np.float32(info.scale)) + info.zero_point
    out: I8 = np.clip(q, limits.min, limits.max).astype(info.dtype)
    return out


def _read_diff(interp: Any, index: int, info: TensorInfo, ref: F32, worst: float | str) -> float | str:
    """Read tensor ``index`` after invoke() and return the running max |diff| to ``ref``, or the error."""
    if isinstance(worst, str):
        return worst
    try:
        got = _dequantise(interp.get_tensor(index), info)
    except ValueError as exc:
        return f"get_tensor raises ValueError: {exc}"
    return max(worst, float(np.abs(got - ref).max()))


def check_model(path: Path, x: np.ndarray[Any, Any]) -> ModelCheck:
    """Run a .tflite model with LiteRT on every sample and read its embedding with four interpreters.

    Parameters
    ----------
    path : Path
        The .tflite file.
    x : float32 [N, ...], or [N, ...] of the input dtype
        Normalised inputs (quantised here with the model's input scale/zero point if int8), or raw
        inputs already of the input dtype (uint8 for the ``RAW_INPUT`` models), fed as they are.

    Returns
    -------
    ModelCheck

    Raises
    ------
    RuntimeError
        The last op is not FULLY_CONNECTED, or its output is not the model output.
    """
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    without = OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    interps = {
        "reference": Interpreter(
            model_path=str(path),
            experimental_op_resolver_type=without,
            experimental_preserve_all_tensors=True,
        ),
        "no_delegate": Interpreter(model_path=str(path), experimental_op_resolver_type=without),
        "default": Interpreter(model_path=str(path)),
        "default_preserved": Interpreter(model_path=str(path), experimental_preserve_all_tensors=True),
    }
    # Read the graph before allocate_tensors(): once XNNPACK is applied, _get_ops_details() also lists
    # the DELEGATE nodes that replaced the original ops (after them, so the last entry is a DELEGATE).
    ops = interps["default"]._get_ops_details()
    for interp in interps.values():
        interp.allocate_tensors()
    delegated = tuple(str(op["op_name"]) for op in interps["default"]._get_ops_details())
    last = ops[-1]
    if last["op_name"] != "FULLY_CONNECTED":
        raise RuntimeError(f"{path}: last op is {last['op_name']}, not FULLY_CONNECTED")
    ref_interp = interps["reference"]
    in_info = _tensor_info(ref_interp.get_input_details()[0])
    outputs = {int(d["index"]): d for d in ref_interp.get_output_details()}
    if int(last["outputs"][0]) not in outputs:
        raise RuntimeError(f"{path}: the last FULLY_CONNECTED does not write a model output")
    out_info = _tensor_info(outputs[int(last["outputs"][0])])
    emb_index = int(last["inputs"][0])
    details = {int(d["index"]): _tensor_info(d) for d in ref_interp.get_tensor_details()}
    emb_info = details[emb_index]
    fc_weight = details[int(last["inputs"][1])]
    bias_index = int(last["inputs"][2]) if len(last["inputs"]) > 2 else -1
    fc_bias = details[bias_index] if bias_index >= 0 else None

    embeddings, logits = [], []
    reads: dict[str, float | str] = {name: 0.0 for name in interps if name != "reference"}
    elapsed = dict.fromkeys(interps, 0.0)
    logit_diff = 0.0
    for sample in x:
        feed = _quantise_input(sample[None], in_info)
        for name, interp in interps.items():
            interp.set_tensor(in_info.index, feed)
            t0 = time.perf_counter()
            interp.invoke()
            elapsed[name] += time.perf_counter() - t0
        ref = _dequantise(ref_interp.get_tensor(emb_index), emb_info)
        for name in reads:
            reads[name] = _read_diff(interps[name], emb_index, emb_info, ref, reads[name])
        out = _dequantise(ref_interp.get_tensor(out_info.index), out_info)
        out_default = _dequantise(interps["default"].get_tensor(out_info.index), out_info)
        logit_diff = max(logit_diff, float(np.abs(out - out_default).max()))
        embeddings.append(ref[0])
        logits.append(out[0])
    n = max(1, len(x))
    return ModelCheck(
        input=in_info,
        output=out_info,
        embedding=emb_info,
        fc_weight=fc_weight,
        fc_bias=fc_bias,
        ops=tuple(str(op["op_name"]) for op in ops),
        ops_after_allocate=delegated,
        embeddings=np.stack(embeddings).astype(np.float32),
        logits=np.stack(logits).astype(np.float32),
        embedding_read=reads,
        max_abs_logit_diff_default=logit_diff,
        us_per_invoke={name: 1e6 * elapsed[name] / n for name in ("default", "no_delegate")},
    )


@dataclass(frozen=True, slots=True)
class BatchCheck:
    """What resizing the input batch of one .tflite file showed.

    Attributes
    ----------
    batch_sizes : tuple[int, ...]
        The batch sizes tried, in order, on one interpreter (``resize_tensor_input`` then
        ``allocate_tensors`` each time).
    max_abs_diff : dict[str, float]
        ``"output"`` and ``"embedding"``: max |batched row - batch-1 reference row| over all batch sizes
        and rows, dequantised units (0.0 means bit-exact for int8 tensors).
    max_scaled_diff : dict[str, float]
        The same, each row's |diff| divided by ``max(1, max |reference row|)``: what is compared with
        ``FLOAT_BATCH_TOLERANCE``.
    """

    batch_sizes: tuple[int, ...]
    max_abs_diff: dict[str, float]
    max_scaled_diff: dict[str, float]


BATCH_SIZES_CHECKED = (1, 3, 8, 64, 1)
# float32 rows may differ from batch 1 in the last bits (the reference kernels, presumably the
# FULLY_CONNECTED GEMM, take another path for batch > 1; not investigated further). Measured on the
# shipped files: <= 3.5e-5 absolute, <= 1.0e-6 of max(1, max |row|) (digits float32 embeddings reach 42).
FLOAT_BATCH_TOLERANCE = 1e-5


def check_batches(path: Path, x: np.ndarray[Any, Any], check: ModelCheck) -> BatchCheck:
    """Resize the input batch of a .tflite model and compare every row with the batch-1 results.

    One interpreter with the agent's resolver (``BUILTIN_WITHOUT_DEFAULT_DELEGATES``, so the embedding
    stays readable) is resized to each of ``BATCH_SIZES_CHECKED`` in turn. For batch ``b`` it is fed the
    samples ``arange(b) % N``, and its output and embedding rows are compared with ``check.logits`` and
    ``check.embeddings`` (the batch-1 reference run of ``check_model``). int8 rows must be bit-exact;
    float32 rows may differ by ``FLOAT_BATCH_TOLERANCE * max(1, max |reference row|)``.

    Parameters
    ----------
    path : Path
        The .tflite file.
    x : float32 [N, ...], or [N, ...] of the input dtype
        The inputs ``check`` was computed from (see :func:`check_model`).
    check : ModelCheck
        ``check_model(path, x)``.

    Returns
    -------
    BatchCheck

    Raises
    ------
    RuntimeError
        The input batch is not dynamic (shape_signature[0] != -1), or a row differs from the batch-1
        result: at all for int8 tensors, by more than the scaled ``FLOAT_BATCH_TOLERANCE`` for float32.
    """
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    if check.input.shape_signature[:1] != (-1,):
        raise RuntimeError(
            f"{path}: input shape_signature {list(check.input.shape_signature)} has no -1 batch"
        )
    interp = Interpreter(
        model_path=str(path), experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    )
    worst = {"output": 0.0, "embedding": 0.0}
    worst_scaled = dict(worst)
    for batch in BATCH_SIZES_CHECKED:
        rows = np.arange(batch) % len(x)
        interp.resize_tensor_input(check.input.index, [batch, *check.input.shape[1:]])
        interp.allocate_tensors()
        interp.set_tensor(check.input.index, _quantise_input(x[rows], check.input))
        interp.invoke()
        for role, info, ref in (
            ("output", check.output, check.logits),
            ("embedding", check.embedding, check.embeddings),
        ):
            got = _dequantise(interp.get_tensor(info.index), info)
            if got.shape != (batch, *ref.shape[1:]):
                raise RuntimeError(f"{path}: batch {batch}: {role} shape {got.shape}")
            row_diff = np.abs(got - ref[rows]).max(axis=1)
            row_scale = np.maximum(1.0, np.abs(ref[rows]).max(axis=1))
            scaled = float((row_diff / row_scale).max())
            tolerance = FLOAT_BATCH_TOLERANCE if info.scale == 0.0 else 0.0
            if scaled > tolerance:
                raise RuntimeError(
                    f"{path}: batch {batch}: {role} rows differ from batch 1 by {float(row_diff.max()):.6g}"
                    f" ({scaled:.3g} of max(1, max |row|))"
                )
            worst[role] = max(worst[role], float(row_diff.max()))
            worst_scaled[role] = max(worst_scaled[role], scaled)
    return BatchCheck(batch_sizes=BATCH_SIZES_CHECKED, max_abs_diff=worst, max_scaled_diff=worst_scaled)


def report_batches(batches: BatchCheck) -> None:
    """Print the facts of one model's batch resize check for the model card."""
    diffs = ", ".join(
        f"{role} {diff:.3g} ({batches.max_scaled_diff[role]:.3g} of max(1, max |row|))"
        for role, diff in batches.max_abs_diff.items()
    )
    print(
        f"   resize_tensor_input batches {list(batches.batch_sizes)} (BUILTIN_WITHOUT_DEFAULT_DELEGATES):"
        f" rows vs batch 1, max |diff| {diffs}"
    )


def report_model(path: Path, check: ModelCheck) -> None:
    """Print the facts of one model for the model card."""
    print(f"\n== {path.name}")
    print(f"   size_bytes {path.stat().st_size}  sha256 {sha256_of(path)}")
    print(f"   ops ({len(check.ops)}): {' '.join(check.ops)}")
    print(
        f"   ops listed after allocate_tensors (default interpreter): {len(check.ops_after_allocate)},"
        f" last {check.ops_after_allocate[-1]}, DELEGATE x{check.ops_after_allocate.count('DELEGATE')}"
    )
    roles = [("input", check.input), ("output", check.output), ("embedding", check.embedding)]
    roles += [("fc weight", check.fc_weight)] + ([("fc bias", check.fc_bias)] if check.fc_bias else [])
    for role, info in roles:
        print(
            f"   {role:9s} index={info.index} name={info.name!r} shape={list(info.shape)}"
            f" signature={list(info.shape_signature)} dtype={info.dtype}"
            f" scale={info.scale:.9g} zero_point={info.zero_point}"
        )
    finite = bool(np.isfinite(check.logits).all() and np.isfinite(check.embeddings).all())
    print(f"   finite logits and embeddings: {finite}")
    for name, read in check.embedding_read.items():
        shown = f"{read:.6g}" if isinstance(read, float) else read
        print(f"   embedding get_tensor after invoke(), {name}: max |diff| vs reference = {shown}")
    diff = check.max_abs_logit_diff_default
    print(f"   model output, default (XNNPACK) vs reference: max |diff| = {diff:.6g}")
    times = ", ".join(f"{name} {us:.1f} us" for name, us in check.us_per_invoke.items())
    print(f"   mean invoke() time, batch 1: {times}")


def report_raw_input(
    path: Path, raw: np.ndarray[Any, Any], normalise: Any, int8: ModelCheck, folded: ModelCheck
) -> None:
    """Print what folding the normalisation into the input quantisation changes (``RAW_INPUT``).

    Parameters
    ----------
    path : Path
        The raw-input .tflite file.
    raw : uint8 [N, ...]
        The raw samples ``folded`` was run on (``int8`` ran on ``normalise(raw)``).
    normalise : callable uint8 [N, ...] -> float32 [N, ...]
        The normalisation of this model family.
    int8, folded : ModelCheck
        The int8 model and its raw-input variant on the same samples.
    """
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    interp = Interpreter(
        model_path=str(path),
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        experimental_preserve_all_tensors=True,
    )
    first = interp._get_ops_details()[0]
    interp.allocate_tensors()
    every = np.resize(np.arange(256, dtype=np.uint8), (1, *folded.input.shape[1:]))
    interp.set_tensor(folded.input.index, every)
    interp.invoke()
    q8 = interp.get_tensor(int(first["outputs"][0])).astype(np.int32)
    expected = _quantise_input(normalise(every), int8.input).astype(np.int32)
    differ = q8 != expected
    values = np.arange(256)
    real = np.float32(folded.input.scale) * (values - folded.input.zero_point)
    shift = real - normalise(values.astype(np.uint8)).astype(np.float64)
    print(
        f"   {first['op_name']} op (input uint8 scale {folded.input.scale:.9g} zero point"
        f" {folded.input.zero_point}) on all 256 raw values vs the int8 model's input quantisation of the"
        f" normalised value: {int(np.unique(every[differ]).size)} of 256 values differ"
        + (f" (by {int(np.abs(q8 - expected).max())} LSB)" if differ.any() else "")
        + f"; real input - normalised value: {float(shift.min()):.6g} .. {float(shift.max()):.6g}"
    )
    agree = float(np.mean(int8.logits.argmax(axis=1) == folded.logits.argmax(axis=1)))
    print(
        f"   vs {len(raw)} samples of the int8 model: argmax agree {agree:.4f}, max |logits diff|"
        f" {float(np.abs(int8.logits - folded.logits).max()):.6g}, max |embedding diff|"
        f" {float(np.abs(int8.embeddings - folded.embeddings).max()):.6g}"
    )


def _digits_accuracies(check: ModelCheck, y: I64, split: DigitsSplit) -> None:
    pred = check.logits.argmax(axis=1)
    test = split.test
    factory_acc = float(np.mean(pred[test] == y[test]))
    in_factory = np.isin(y[test], FACTORY_CLASSES)
    factory_acc_known = float(np.mean(pred[test][in_factory] == y[test][in_factory]))
    w, b = fit_softmax_head(check.embeddings[split.devices], y[split.devices], N_CLASSES)
    central_pred = (check.embeddings[test] @ w + b).argmax(axis=1)
    central_acc = float(np.mean(central_pred == y[test]))
    w_pub, b_pub = fit_softmax_head(check.embeddings[split.public], y[split.public], N_CLASSES)
    public_acc = float(np.mean((check.embeddings[test] @ w_pub + b_pub).argmax(axis=1) == y[test]))
    print(f"   test accuracy, factory head (classes {FACTORY_CLASSES}), all 10 classes: {factory_acc:.4f}")
    print(f"   test accuracy, factory head, on test samples of classes 0-4 only: {factory_acc_known:.4f}")
    print(f"   test accuracy, softmax head fitted centrally on device-pool embeddings: {central_acc:.4f}")
    print(f"   (reference) softmax head fitted on public-split embeddings: {public_acc:.4f}")


def verify_digits(out: Path, seed: int) -> None:
    """Run the digits models with LiteRT and print their accuracies.

    Prints, per model: the factory model's test accuracy, and the test accuracy of a softmax head fitted
    centrally on the device pool's embeddings (read from the model). The raw-input model is fed the raw
    pixels (uint8 0..16) and compared with the int8 model.
    """
    x_raw, y = load_digits()
    split = split_digits(y, seed=seed)
    _print_split(y, split, seed)
    x = digits_input(x_raw)
    rawin = RAW_INPUT["digits_cnn_int8.tflite"][0]
    checks = {}
    for name, inputs in (
        ("digits_cnn_float32.tflite", x),
        ("digits_cnn_int8.tflite", x),
        (rawin, x_raw),
    ):
        path = out / name
        checks[name] = check = check_model(path, inputs)
        report_model(path, check)
        report_batches(check_batches(path, inputs, check))
        if name == rawin:
            report_raw_input(path, x_raw, digits_input, checks["digits_cnn_int8.tflite"], check)
        _digits_accuracies(check, y, split)


def verify_mobilenet(out: Path, seed: int) -> None:
    """Run the MobileNet models with LiteRT on seeded random frames and print agreement figures."""
    raw = random_frames(50, seed + 1)
    frames = mobilenet_input(raw)
    rawin = RAW_INPUT["mobilenet_v2_035_96_int8.tflite"][0]
    checks = {}
    for name, inputs in (
        ("mobilenet_v2_035_96_float32.tflite", frames),
        ("mobilenet_v2_035_96_int8.tflite", frames),
        (rawin, raw),
    ):
        path = out / name
        checks[name] = check_model(path, inputs)
        report_model(path, checks[name])
        report_batches(check_batches(path, inputs, checks[name]))
    f, int8 = checks["mobilenet_v2_035_96_float32.tflite"], checks["mobilenet_v2_035_96_int8.tflite"]
    report_raw_input(out / rawin, raw, mobilenet_input, int8, checks[rawin])
    for label, q in (("int8", int8), ("int8 raw input", checks[rawin])):
        agree = float(np.mean(f.logits.argmax(axis=1) == q.logits.argmax(axis=1)))
        print(
            f"\n   {label} vs float32 (reference kernels), {len(frames)} random frames:"
            f" argmax agree {agree:.2f}"
        )
        for what, a, b in (("embedding", f.embeddings, q.embeddings), ("logits", f.logits, q.logits)):
            # Centred on the float32 mean: random frames give nearly the same embedding, so the raw cosine
            # mostly measures the shared mean, not how well int8 keeps the frame-to-frame differences.
            cos, centred = _mean_cosine(a, b), _mean_cosine(a - a.mean(axis=0), b - a.mean(axis=0))
            print(f"   {what}: mean cosine {cos:.4f}, centred on the float32 mean {centred:.4f}")
    print(
        f"   float32: logits std {float(f.logits.std()):.4g} (across frames, per class "
        f"{float(f.logits.std(axis=0).mean()):.4g}), embedding std {float(f.embeddings.std()):.4g}"
    )


def _mean_cosine(a: F32, b: F32) -> float:
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12
    return float(np.mean(np.sum(a * b, axis=1) / norms))


def _print_split(y: I64, split: DigitsSplit, seed: int) -> None:
    print(f"\n== digits split (seed {seed}): N={y.size}")
    for part in ("test", "public", "devices"):
        idx = getattr(split, part)
        print(f"   {part:8s} {idx.size:5d}  per class {np.bincount(y[idx], minlength=N_CLASSES).tolist()}")


# --- tensorflow part --------------------------------------------------------------------------------


def _seed_everything(seed: int) -> Any:
    import tensorflow as tf

    tf.keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()
    return tf


def _frozen_concrete_function(model: Any, sample_shape: tuple[int, ...]) -> Any:
    """Trace ``model(x, training=False)`` for ``x`` of shape [None, *sample_shape] and fold its variables.

    The batch dimension is traced as None, so the converted model's input has shape_signature
    [-1, *sample_shape] and LiteRT's ``resize_tensor_input`` can change it. A converter fed a function
    that still reads variables can emit a model whose weights are never initialised (NaN outputs);
    freezing first removes that failure mode.
    """
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import (  # type: ignore[import-not-found]
        convert_variables_to_constants_v2,
    )

    @tf.function(input_signature=[tf.TensorSpec((None, *sample_shape), tf.float32, name="input")])  # type: ignore[misc,untyped-decorator]
    def serve(x: Any) -> Any:
        return model(x, training=False)

    return convert_variables_to_constants_v2(serve.get_concrete_function())


def _convert(frozen: Any, representative: F32 | None, input_type: str = "int8") -> bytes:
    """Convert to .tflite: float32 (no ``representative``), or full-integer int8 calibrated on it.

    ``input_type="uint8"`` (int8 models only) gives a uint8 input followed by a QUANTIZE op to the
    int8 model's input; the rest of the graph, calibration included, is that of the int8 model.
    """
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_concrete_functions([frozen])
    if representative is not None:

        def samples() -> Any:
            for sample in representative:
                yield [sample[None].astype(np.float32)]

        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = samples
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.inference_input_type = tf.uint8 if input_type == "uint8" else tf.int8
        converter.inference_output_type = tf.int8
    return bytes(converter.convert())


def fold_input_quantisation(blob: bytes, scale: float, zero_point: int) -> bytes:
    """Set the quantisation of a converted model's uint8 input so the raw frame is the model input.

    The model must start with the converter's QUANTIZE op (uint8 input -> int8): that op reads the
    input's scale and zero point at ``allocate_tensors()`` and requantises to the int8 tensor after
    it, so changing them changes only how raw values are read: ``real = scale * (raw - zero_point)``.

    Parameters
    ----------
    blob : bytes
        A .tflite model converted with ``_convert(..., input_type="uint8")``.
    scale : float
        Input scale (stored as float32).
    zero_point : int
        Input zero point, 0..255.

    Returns
    -------
    bytes
        The model with the new input quantisation (everything else unchanged).

    Raises
    ------
    RuntimeError
        If the input is not uint8 or is not consumed by a QUANTIZE op to int8.
    """
    from tensorflow.lite.python import schema_py_generated as schema
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.convert_bytearray_to_object(bytearray(blob))
    graph = model.subgraphs[0]
    index = int(graph.inputs[0])
    tensor = graph.tensors[index]
    first = graph.operators[0]
    opcode = model.operatorCodes[first.opcodeIndex]
    code = max(int(opcode.builtinCode), int(opcode.deprecatedBuiltinCode))
    out = graph.tensors[int(first.outputs[0])]
    if (
        tensor.type != schema.TensorType.UINT8
        or code != schema.BuiltinOperator.QUANTIZE
        or list(first.inputs) != [index]
        or out.type != schema.TensorType.INT8
    ):
        raise RuntimeError("fold_input_quantisation: expected a uint8 input read by a QUANTIZE op to int8")
    if not 0 <= zero_point <= 255:
        raise RuntimeError(f"fold_input_quantisation: zero point {zero_point} outside 0..255")
    tensor.quantization.scale = [float(np.float32(scale))]
    tensor.quantization.zeroPoint = [int(zero_point)]
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model))


def _write_raw_input(out: Path, frozen: Any, representative: F32, int8_name: str) -> None:
    """Write the ``RAW_INPUT`` variant of ``int8_name`` (same calibration data as the int8 model)."""
    name, scale, zero_point = RAW_INPUT[int8_name]
    blob = _convert(frozen, representative, input_type="uint8")
    _write(out / name, fold_input_quantisation(blob, scale, zero_point))


def _write(path: Path, blob: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    print(f"wrote {path} ({len(blob)} bytes)")


def _batch_flatten(keras: Any, name: str) -> Any:
    """Return a Flatten layer that reshapes to [-1, prod(non-batch dims)].

    Keras 3's ``Flatten`` reshapes to ``(ops.shape(x)[0], prod)``: with a None batch that traces to
    SHAPE, STRIDED_SLICE, PACK before the RESHAPE, and with a batch of 1 to a constant [1, 512] that
    breaks ``resize_tensor_input``. A constant -1 batch keeps a single RESHAPE that LiteRT resizes. No
    weights, same values as ``Flatten``.
    """
    import math

    class BatchFlatten(keras.layers.Flatten):  # type: ignore[misc]
        def call(self, inputs: Any) -> Any:
            return keras.ops.reshape(inputs, (-1, math.prod(inputs.shape[1:])))

    return BatchFlatten(name=name)


def build_digits(out: Path, seed: int) -> None:
    """Train the digits CNN and factory head on the public split; write float32 and int8 .tflite files."""
    tf = _seed_everything(seed)
    keras = tf.keras
    x_raw, y = load_digits()
    split = split_digits(y, seed=seed)
    x = digits_input(x_raw)
    x_pub, y_pub = x[split.public], y[split.public]

    inputs = keras.Input(shape=(8, 8, 1), name="digits")
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(inputs)
    h = keras.layers.MaxPooling2D(2, name="pool")(h)
    h = keras.layers.Conv2D(DIGITS_CONV2_CHANNELS, 3, padding="same", activation="relu", name="conv2")(h)
    embedding = _batch_flatten(keras, "embedding")(h)  # [N, 4 * 4 * 32] = [N, DIGITS_EMBEDDING_D]
    head = keras.layers.Dense(N_CLASSES, name="logits")
    model = keras.Model(inputs, head(embedding), name="digits_cnn")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, metrics=["accuracy"])
    model.fit(x_pub, y_pub, epochs=DIGITS_EPOCHS, batch_size=BATCH_SIZE, shuffle=True, verbose=0)
    full_acc = float(np.mean(model.predict(x[split.test], verbose=0).argmax(axis=1) == y[split.test]))
    print(f"keras: backbone + 10-class head (public split, {DIGITS_EPOCHS} epochs): test acc {full_acc:.4f}")

    # Factory head: re-initialise the last Dense and fit it, backbone frozen, on classes 0-4 only.
    backbone = keras.Model(inputs, embedding, name="digits_backbone")
    factory = np.isin(y_pub, FACTORY_CLASSES)
    emb_factory = backbone.predict(x_pub[factory], verbose=0)
    head_only = keras.Sequential(
        [
            keras.Input(shape=(DIGITS_EMBEDDING_D,)),
            # L2 keeps the factory logits small (|logit| < ~20), so float32 sums over D = 512 stay
            # within 1e-5 of the model's own FC output, and fine-tuning starts from an unsaturated softmax
            keras.layers.Dense(
                N_CLASSES, name="factory_head", kernel_regularizer=keras.regularizers.L2(FACTORY_HEAD_L2)
            ),
        ]
    )
    head_only.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, metrics=["accuracy"])
    head_only.fit(emb_factory, y_pub[factory], epochs=FACTORY_HEAD_EPOCHS, batch_size=BATCH_SIZE, verbose=0)
    head.set_weights(head_only.layers[-1].get_weights())
    factory_acc = float(np.mean(model.predict(x[split.test], verbose=0).argmax(axis=1) == y[split.test]))
    print(f"keras: factory head (classes {FACTORY_CLASSES}, backbone frozen): test acc {factory_acc:.4f}")

    # output 0 = logits, output 1 = the embedding (readable when XNNPACK runs the graph)
    frozen = _frozen_concrete_function(keras.Model(inputs, [model.output, embedding]), (8, 8, 1))
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "digits_cnn_float32.tflite", _convert(frozen, None))
    _write(out / "digits_cnn_int8.tflite", _convert(frozen, x_pub))
    _write_raw_input(out, frozen, x_pub, "digits_cnn_int8.tflite")


def _recalibrate_batchnorm(model: Any, frames: F32) -> None:
    """Set every BatchNormalization's moving statistics to those of one training-mode pass over ``frames``.

    With random (Glorot) weights and the default moving statistics (mean 0, variance 1), activations
    shrink layer after layer (embedding std ~3e-11 at the GAP output), so the int8 calibration is
    meaningless. With momentum 0, one training-mode pass writes each layer's batch statistics, computed
    on inputs already normalised by the layers before it, into its moving statistics.

    Source: the BN re-estimation of Li et al., "Revisiting Batch Normalization for Practical Domain
    Adaptation", ICLR workshop 2017 (AdaBN), applied to random frames.
    """
    import tensorflow as tf

    layers = [layer for layer in model.layers if isinstance(layer, tf.keras.layers.BatchNormalization)]
    saved = [layer.momentum for layer in layers]
    for layer in layers:
        layer.momentum = 0.0
    model(frames, training=True)
    for layer, momentum in zip(layers, saved, strict=True):
        layer.momentum = momentum


def build_mobilenet(out: Path, seed: int) -> None:
    """Build MobileNetV2 (alpha 0.35, 96x96) with random seeded weights; write float32 and int8 files."""
    tf = _seed_everything(seed)
    keras = tf.keras
    inputs = keras.Input(shape=(MOBILENET_SIDE, MOBILENET_SIDE, 3), name="frame")
    backbone = keras.applications.MobileNetV2(
        alpha=MOBILENET_ALPHA,
        input_shape=(MOBILENET_SIDE, MOBILENET_SIDE, 3),
        weights=None,
        include_top=False,
    )
    _recalibrate_batchnorm(backbone, mobilenet_input(random_frames(BN_FRAMES, seed + 2)))
    pooled = keras.layers.GlobalAveragePooling2D(name="embedding")(backbone(inputs, training=False))
    # A non-zero bias: the converter drops an all-zero bias, and the runtime reads (W, b) off this op.
    logits = keras.layers.Dense(
        N_CLASSES, name="logits", bias_initializer=keras.initializers.RandomNormal(stddev=0.1, seed=seed)
    )(pooled)
    model = keras.Model(inputs, logits, name="mobilenet_v2_035_96")
    print(
        f"keras: MobileNetV2 alpha={MOBILENET_ALPHA} {MOBILENET_SIDE}x{MOBILENET_SIDE}: "
        f"{model.count_params()} parameters, embedding D={pooled.shape[-1]}"
    )
    # output 0 = logits, output 1 = the embedding (readable when XNNPACK runs the graph)
    frozen = _frozen_concrete_function(
        keras.Model(inputs, [logits, pooled]), (MOBILENET_SIDE, MOBILENET_SIDE, 3)
    )
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "mobilenet_v2_035_96_float32.tflite", _convert(frozen, None))
    calibration = mobilenet_input(random_frames(REPRESENTATIVE_FRAMES, seed))
    _write(out / "mobilenet_v2_035_96_int8.tflite", _convert(frozen, calibration))
    _write_raw_input(out, frozen, calibration, "mobilenet_v2_035_96_int8.tflite")


STREAM_FRAMES = 3  # feature frames per invoke
STREAM_FEATURES = 40  # e.g. log-mel bins
STREAM_CONTEXT = 2  # earlier frames kept in the model's state
STREAM_HIDDEN = 32
STREAM_EMBEDDING_D = 16
STREAM_NAME = "test/streaming_kws_int8.tflite"


def build_streaming(out: Path, seed: int) -> None:
    """Build the streaming keyword-spotter test model: int8, resource variables, a logistic head.

    Input int8 [1, 3, 40] (three feature frames); a resource variable holds the previous two frames
    (VAR_HANDLE, READ_VARIABLE, ASSIGN_VARIABLE in the graph), so each invoke sees five frames and the
    output depends on the frames before it. Two FULLY_CONNECTED layers (ReLU) give the embedding
    (D = 16); the head is FULLY_CONNECTED (K = 1) -> LOGISTIC -> QUANTIZE to a uint8 [1, 1] output.
    Random seeded weights, calibrated on standard-normal features (the same distribution the tests
    feed it). The embedding is not a model output: the agent must prepare it (issue 14).
    """
    tf = _seed_everything(seed)
    rng = np.random.default_rng(seed + 5)
    width = (STREAM_CONTEXT + STREAM_FRAMES) * STREAM_FEATURES

    def dense(n_in: int, n_out: int) -> tuple[Any, Any]:
        w = rng.normal(0.0, 1.0 / np.sqrt(n_in), (n_in, n_out)).astype(np.float32)
        return tf.constant(w), tf.constant(rng.normal(0.0, 0.1, n_out).astype(np.float32))

    class Streaming(tf.Module):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.context = tf.Variable(
                tf.zeros([1, STREAM_CONTEXT, STREAM_FEATURES]), trainable=False, name="context"
            )
            self.w1, self.b1 = dense(width, STREAM_HIDDEN)
            self.w2, self.b2 = dense(STREAM_HIDDEN, STREAM_EMBEDDING_D)
            self.w3, self.b3 = dense(STREAM_EMBEDDING_D, 1)

        @tf.function(input_signature=[tf.TensorSpec([1, STREAM_FRAMES, STREAM_FEATURES], tf.float32)])  # type: ignore[misc,untyped-decorator]
        def __call__(self, x: Any) -> Any:
            frames = tf.concat([self.context, x], axis=1)
            self.context.assign(frames[:, -STREAM_CONTEXT:, :])
            h = tf.nn.relu(tf.matmul(tf.reshape(frames, [1, width]), self.w1) + self.b1)
            embedding = tf.nn.relu(tf.matmul(h, self.w2) + self.b2)
            return tf.sigmoid(tf.matmul(embedding, self.w3) + self.b3)

    module = Streaming()
    converter = tf.lite.TFLiteConverter.from_concrete_functions(
        [module.__call__.get_concrete_function()], module
    )
    converter.experimental_enable_resource_variables = True
    calibration = streaming_frames(REPRESENTATIVE_FRAMES, seed)

    def samples() -> Any:
        for frame in calibration:
            yield [frame[None]]

    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = samples
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = tf.int8
    converter.inference_output_type = tf.uint8
    (out / "test").mkdir(parents=True, exist_ok=True)
    _write(out / STREAM_NAME, bytes(converter.convert()))


def streaming_frames(n: int, seed: int) -> F32:
    """``n`` standard-normal feature windows float32 [n, 3, 40] (the streaming model's input range)."""
    rng = np.random.default_rng(seed + 6)
    return rng.standard_normal((n, STREAM_FRAMES, STREAM_FEATURES)).astype(np.float32)


def verify_streaming(out: Path, seed: int) -> None:
    """Print the streaming model's ops and its head-vs-model difference over 64 frames in order."""
    from edgefl.runtime import Backbone
    from tests.support.models import activate, logits_range, run_backbone

    bb = Backbone(out / STREAM_NAME, xnnpack=False)
    W, b = bb.head_from_model()
    emb, y = run_backbone(bb, bb.quantize_input(streaming_frames(64, seed + 1)))
    lo, hi = logits_range(bb) or (-np.inf, np.inf)  # where the model's int8 FC output saturates
    diff = float(
        np.abs(activate(np.clip(emb @ W + b, lo, hi).astype(np.float32), bb.head_activation) - y).max()
    )
    ops = sorted({op.name for op in bb.graph.ops})
    print(
        f"{STREAM_NAME}: stateful ops {bb.stateful_ops}, D={bb.embedding_dim}, K={W.shape[1]}, "
        f"activation {bb.head_activation}, ops {ops}; logits saturate at {lo:.3g}..{hi:.3g}; "
        f"head (clipped there) vs model max |diff| {diff:.3g} "
        f"({diff / bb.output_quant.scale:.2f} output steps)"
    )


SOFTMAX_FEATURES = 8
SOFTMAX_D = 16
SOFTMAX_K = 4
SOFTMAX_NAMES = ("test/softmax_mlp_float32.tflite", "test/softmax_mlp_int8.tflite")


def build_softmax(out: Path, seed: int) -> None:
    """Build the softmax-head test models: float32 and int8, ``Dense(16, relu) -> Dense(4) -> softmax``.

    Input [N, 8] (dynamic batch), the embedding (D = 16) is internal (not a model output), the head is
    FULLY_CONNECTED (K = 4) -> SOFTMAX: the shape of a third-party classifier that outputs
    probabilities. Random seeded weights; the int8 file is calibrated on standard-normal features.
    """
    tf = _seed_everything(seed)
    keras = tf.keras
    inputs = keras.Input(shape=(SOFTMAX_FEATURES,), name="features")
    embedding = keras.layers.Dense(SOFTMAX_D, activation="relu", name="embedding")(inputs)
    probs = keras.layers.Dense(
        SOFTMAX_K,
        activation="softmax",
        name="probs",
        bias_initializer=keras.initializers.RandomNormal(stddev=0.1, seed=seed),
    )(embedding)
    frozen = _frozen_concrete_function(keras.Model(inputs, probs), (SOFTMAX_FEATURES,))
    (out / "test").mkdir(parents=True, exist_ok=True)
    _write(out / SOFTMAX_NAMES[0], _convert(frozen, None))
    calibration = np.random.default_rng(seed + 7).standard_normal((REPRESENTATIVE_FRAMES, SOFTMAX_FEATURES))
    _write(out / SOFTMAX_NAMES[1], _convert(frozen, calibration.astype(np.float32)))


def verify_softmax(out: Path, seed: int) -> None:
    """Print the softmax test models' head-vs-model difference on 256 standard-normal inputs."""
    from edgefl.runtime import Backbone
    from tests.support.models import activate, logits_range, run_backbone

    x = np.random.default_rng(seed + 8).standard_normal((256, SOFTMAX_FEATURES)).astype(np.float32)
    for name in SOFTMAX_NAMES:
        bb = Backbone(out / name, xnnpack=False)
        W, b = bb.head_from_model()
        emb, y = run_backbone(bb, bb.quantize_input(x))
        lo, hi = logits_range(bb) or (-np.inf, np.inf)
        diff = float(
            np.abs(activate(np.clip(emb @ W + b, lo, hi).astype(np.float32), bb.head_activation) - y).max()
        )
        step = f" ({diff / bb.output_quant.scale:.2f} output steps)" if bb.output_quant.scale else ""
        print(f"{name}: D={bb.embedding_dim}, K={W.shape[1]}, activation {bb.head_activation}; "
              f"head vs model max |diff| {diff:.3g}{step}")  # fmt: skip


NATURAL_HIDDEN = 64
"""Width of the natural-client backbones' two ReLU layers (the embedding is the second: D = 64)."""
NATURAL_EPOCHS = 300


def natural_model_path(out: Path, name: str) -> Path:
    """``<out>/natural/natural_<name>_float32.tflite``: a natural-client set's backbone (not shipped)."""
    return out / "natural" / f"natural_{name.replace('-', '_')}_float32.tflite"


def build_natural(out: Path, seed: int) -> None:
    """Build one float32 backbone per natural-client set, from the model builder's clients only.

    ``features -> standardise (the builder's mean and std, folded in as constants) -> Dense(64, relu)
    -> Dense(64, relu) = embedding -> Dense(K)`` trained with Adam on the samples of the clients the
    set reserves for the model builder (``bench.natural_clients``: HAPT users 25-30, Deterding
    speakers 12-14, the Japanese vowels' train file); the devices' clients are never seen. The
    last Dense is the factory head the devices start from.
    """
    from bench.natural_clients import DATASETS, load_natural

    for name in DATASETS:
        tf = _seed_everything(seed)
        keras = tf.keras
        ds = load_natural(name)
        mask = ds.builder_mask()
        x, y = ds.x[mask], ds.y[mask]
        mu = x.mean(0).astype(np.float32)
        sd = (x.std(0) + 1e-3).astype(np.float32)
        inputs = keras.Input(shape=(x.shape[1],), name="features")
        z = keras.layers.Rescaling(1.0 / sd, offset=-mu / sd, name="standardise")(inputs)
        z = keras.layers.Dense(NATURAL_HIDDEN, activation="relu", name="hidden")(z)
        z = keras.layers.Dense(NATURAL_HIDDEN, activation="relu", name="embedding")(z)
        logits = keras.layers.Dense(ds.num_classes, name="head")(z)
        model = keras.Model(inputs, logits)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        hist = model.fit(x, y, epochs=NATURAL_EPOCHS, batch_size=BATCH_SIZE, verbose=0, shuffle=True)
        logger.info("%s: builder accuracy %.3f on %d samples", name, hist.history["accuracy"][-1], len(y))
        print(f"{name}: backbone trained on {len(y)} builder samples, train accuracy "
              f"{hist.history['accuracy'][-1]:.3f}")  # fmt: skip
        frozen = _frozen_concrete_function(model, (x.shape[1],))
        _write(natural_model_path(out, name), _convert(frozen, None))


def verify_natural(out: Path, seed: int) -> None:
    """Run each natural-client backbone with LiteRT: the factory head's accuracy on builder and devices."""
    from bench.natural_clients import DATASETS, load_natural
    from edgefl.runtime import Backbone
    from tests.support.models import run_backbone

    for name in DATASETS:
        ds = load_natural(name)
        path = natural_model_path(out, name)
        bb = Backbone(path, xnnpack=False)
        W, b = bb.head_from_model()
        emb, _ = run_backbone(bb, ds.x)
        pred = np.argmax(emb @ W + b, axis=1)
        mask = ds.builder_mask()
        print(f"{path.name}: D={bb.embedding_dim}, K={W.shape[1]}, {path.stat().st_size} bytes; factory head "
              f"accuracy builder {np.mean(pred[mask] == ds.y[mask]):.3f}, devices "
              f"{np.mean(pred[~mask] == ds.y[~mask]):.3f}; sha256 {sha256_of(path)[:12]}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, build the selected models, verify them with LiteRT and print the card numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=REPO / "models", help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, training and calibration")
    parser.add_argument(
        "--only",
        choices=("digits", "mobilenet", "streaming", "softmax", "natural"),
        help="build one model family only",
    )
    parser.add_argument(
        "--verify-only", action="store_true", help="do not build; run the existing files with LiteRT (no TF)"
    )
    args = parser.parse_args(argv)
    families = [args.only] if args.only else ["digits", "mobilenet", "streaming", "softmax", "natural"]
    builders = {
        "digits": build_digits,
        "mobilenet": build_mobilenet,
        "streaming": build_streaming,
        "softmax": build_softmax,
        "natural": build_natural,
    }
    verifiers = {
        "digits": verify_digits,
        "mobilenet": verify_mobilenet,
        "streaming": verify_streaming,
        "softmax": verify_softmax,
        "natural": verify_natural,
    }
    if not args.verify_only:
        for family in families:
            builders[family](args.out, args.seed)
        import tensorflow as tf

        print(f"\ntensorflow {tf.__version__}, python {sys.version.split()[0]}")
    import ai_edge_litert

    print(f"ai-edge-litert {getattr(ai_edge_litert, '__version__', '?')}, numpy {np.__version__}")
    for family in families:
        verifiers[family](args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
