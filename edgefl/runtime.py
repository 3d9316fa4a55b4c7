"""The TFLite model on the device: load it, find the embedding tensor, embed a batch.

LiteRT (or tflite-runtime) loads the model; the embedding is the input of the last FULLY_CONNECTED op.

This is the only module that imports the interpreter (STYLE.md rule 1): ``ai_edge_litert`` first,
``tflite_runtime`` as the fallback for gateways where LiteRT has no wheel (armv7l).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edgefl.errors import ModelError
from edgefl.types import F32

logger = logging.getLogger(__name__)

RuntimeName = Literal["auto", "litert", "tflite"]


def _interpreter_classes(runtime: RuntimeName) -> list[tuple[str, Any]]:
    """Importable interpreter classes in order of preference (lazy imports: each costs RSS)."""
    found: list[tuple[str, Any]] = []
    if runtime in ("auto", "litert"):
        try:
            from ai_edge_litert import interpreter as litert

            found.append(("litert", litert))
        except ImportError as exc:
            logger.info("LiteRT (ai-edge-litert) not importable: %s", exc)
    if runtime in ("auto", "tflite"):
        try:
            from tflite_runtime import interpreter as tflite

            found.append(("tflite", tflite))
        except ImportError as exc:
            # expected wherever LiteRT is installed; it only matters when nothing else loads
            (logger.debug if found else logger.info)("tflite-runtime not importable: %s", exc)
    return found


def runtime_available(runtime: RuntimeName) -> bool:
    """Whether a TFLite runtime that ``runtime`` ("auto", "litert", "tflite") allows imports here."""
    return bool(_interpreter_classes(runtime))


def open_interpreter(
    path: Path, *, num_threads: int = 1, runtime: RuntimeName = "auto", delegates: bool = False
) -> tuple[str, Any]:
    """Create and allocate an interpreter for ``path``, trying each available runtime in turn.

    A runtime counts as working only once it has built an interpreter for the model: tflite-runtime
    imports under numpy 2 and then fails when the interpreter is created, so importing is not enough.

    The model is given by path, not bytes: LiteRT then memory-maps the file, so no second copy of
    the model lives in the heap.

    ``delegates=False`` uses the built-in kernels without the default XNNPACK delegate: a delegated
    graph keeps its intermediate tensors inside the delegate, and ``get_tensor`` on an intermediate
    tensor then fails with "Tensor data is null". ``delegates=True`` applies XNNPACK (LiteRT's
    ``OpResolverType.BUILTIN``): only the model's outputs are readable after ``invoke()``.

    Parameters
    ----------
    path : Path
        The ``.tflite`` file.
    num_threads : int
        Interpreter threads (the profile's ``model.num_threads``).
    runtime : "auto" | "litert" | "tflite"
        Which runtime to use; "auto" prefers LiteRT.
    delegates : bool
        Apply the runtime's default delegate (XNNPACK on CPU).

    Returns
    -------
    (runtime name, allocated interpreter)

    Raises
    ------
    ModelError
        If the file is missing, no runtime is importable, or every runtime failed to load it
        (corrupt or unsupported model); the message names each runtime's error.
    """
    if not path.is_file():
        raise ModelError(str(path), "model file not found")
    classes = _interpreter_classes(runtime)
    if not classes:
        raise ModelError(
            str(path),
            f"no TFLite runtime importable for runtime={runtime!r} "
            "(install ai-edge-litert, or tflite-runtime with numpy<2)",
        )
    errors: list[str] = []
    for name, mod in classes:
        try:
            interp = mod.Interpreter(
                model_path=str(path),
                num_threads=num_threads,
                experimental_op_resolver_type=(
                    mod.OpResolverType.BUILTIN
                    if delegates
                    else mod.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
                ),
            )
            interp.allocate_tensors()
            return name, interp
        except (ValueError, RuntimeError, TypeError, AttributeError, ImportError) as exc:
            errors.append(f"{name}: {exc}")
    raise ModelError(str(path), "cannot load model: " + "; ".join(errors))


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks (never the whole file in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Quant:
    """Affine quantisation of a tensor: ``real = scale * (q - zero_point)``; scale 0 = not quantised."""

    scale: float
    zero_point: int


def _quant(detail: dict[str, Any]) -> Quant:
    scale, zp = detail.get("quantization", (0.0, 0))
    return Quant(float(scale), int(zp))


def dequantize(q: np.ndarray, quant: Quant) -> F32:
    """Dequantise an integer tensor (float tensors are returned as float32 unchanged).

    Parameters
    ----------
    q : int8/uint8/int32 array of any shape (or float32)
    quant : Quant

    Returns
    -------
    float32 array of the same shape: ``scale * (q - zero_point)``.

    Source: TensorFlow Lite 8-bit quantization specification
    (tensorflow.org/lite/performance/quantization_spec).
    """
    if quant.scale == 0.0 or q.dtype == np.float32:
        return q.astype(np.float32, copy=False)
    out: F32 = ((q.astype(np.float32) - np.float32(quant.zero_point)) * np.float32(quant.scale)).astype(
        np.float32
    )
    return out


class Backbone:
    """A loaded model split at its embedding tensor: the frozen backbone plus the shipped head.

    Parameters
    ----------
    path : Path
        The ``.tflite`` file.
    num_threads : int
        Interpreter threads.
    runtime : "auto" | "litert" | "tflite"
    embedding_tensor : str or None
        Name of the embedding tensor; None = the input of the model's last FULLY_CONNECTED op.
    xnnpack : bool or None
        Run with the XNNPACK delegate. None (default) = exactly when the embedding is one of the
        model's outputs (the models ``models/build.py`` writes export it as their second output), since
        a delegated graph's intermediate tensors cannot be read. ``delegated`` records the choice.

    Raises
    ------
    ModelError
        If the model cannot be loaded, has no FULLY_CONNECTED op (and no named tensor), or the named
        tensor does not exist.

    Notes
    -----
    After ``invoke()`` the embedding is read with ``get_tensor`` (a copy). Without XNNPACK it may be an
    intermediate tensor: it is the input of the graph's last op, whose arena buffer the output cannot
    overwrite, so it is intact after the call (checked against an interpreter with
    ``experimental_preserve_all_tensors`` in the tests). The logits are the output of the last
    FULLY_CONNECTED op (or the first output that is not the embedding). With XNNPACK, int8 kernels
    round differently from the built-in ones: 1 step on some digits embedding values, up to ~90 steps on
    the random-weight MobileNet int8 embedding, whose deep random layers amplify it (models/README.md).
    A model that loads but cannot run (damaged weights) is refused at construction by a trial invoke.
    One interpreter is used by one thread at a time: the daemon calls it from one executor thread.
    """

    def __init__(
        self,
        path: Path,
        *,
        num_threads: int = 1,
        runtime: RuntimeName = "auto",
        embedding_tensor: str | None = None,
        xnnpack: bool | None = None,
    ) -> None:
        self.path = path
        # Open with XNNPACK unless told not to: the shipped models export their embedding, so the
        # common case needs one interpreter; a model whose embedding is internal is reopened without.
        self.runtime_name, self.interpreter = open_interpreter(
            path, num_threads=num_threads, runtime=runtime, delegates=xnnpack is not False
        )
        self.sha256 = file_sha256(path)
        try:
            self._inspect(num_threads, runtime, embedding_tensor, xnnpack)
            self._trial_invoke()
        except (UnicodeDecodeError, ValueError, RuntimeError, KeyError, IndexError, TypeError) as exc:
            # a file that loads but whose metadata or graph is corrupt (names, shapes, missing buffers)
            raise ModelError(str(path), f"corrupt or unsupported model: {type(exc).__name__}: {exc}") from exc

    def _inspect(
        self, num_threads: int, runtime: RuntimeName, embedding_tensor: str | None, xnnpack: bool | None
    ) -> None:
        """Find the input, embedding and logits tensors; reopen without XNNPACK when it is not chosen."""
        path = self.path
        inputs = self.interpreter.get_input_details()
        outputs = self.interpreter.get_output_details()
        if len(inputs) != 1 or len(outputs) < 1:
            raise ModelError(str(path), f"expected 1 input tensor, found {len(inputs)}")
        self.input_index = int(inputs[0]["index"])
        self.input_shape: tuple[int, ...] = tuple(int(d) for d in inputs[0]["shape"])
        self.input_dtype = np.dtype(inputs[0]["dtype"])
        self.input_quant = _quant(inputs[0])
        self._fc_weights: int | None = None
        self._fc_bias: int | None = None
        self._fc_output: int | None = None
        self.embedding_index = self._find_embedding(embedding_tensor)
        output_indices = [int(d["index"]) for d in outputs]
        logits = [i for i in output_indices if i != self.embedding_index]
        self.output_index: int
        if self._fc_output is not None and self._fc_output in output_indices:
            self.output_index = self._fc_output
        elif logits:
            self.output_index = logits[0]
        else:
            raise ModelError(str(path), "the only model output is the embedding: no logits output")
        self.output_quant = _quant(next(d for d in outputs if int(d["index"]) == self.output_index))
        # Tensor indices are the flatbuffer's, the same in a delegated interpreter of the same file.
        embedding_is_output = self.embedding_index in output_indices
        if xnnpack and not embedding_is_output:
            raise ModelError(
                str(path),
                "xnnpack requested, but the embedding is not a model output (unreadable under XNNPACK)",
            )
        self.delegated = bool(xnnpack) if xnnpack is not None else embedding_is_output
        if xnnpack is None and not self.delegated:
            self.runtime_name, self.interpreter = open_interpreter(
                path, num_threads=num_threads, runtime=runtime, delegates=False
            )
        details = {int(d["index"]): d for d in self.interpreter.get_tensor_details()}
        emb = details[self.embedding_index]
        self.embedding_quant = _quant(emb)
        self.embedding_dim = int(emb["shape"][-1])
        self.batch = int(self.input_shape[0])
        self.resizable = self._probe_resize()

    def _trial_invoke(self) -> None:
        """Run the model once on zeros: a file whose weights are damaged can load and still not run.

        Raises
        ------
        RuntimeError, ValueError
            From LiteRT (e.g. "Input tensor 9 lacks data"); the caller turns them into ModelError.
        """
        shape = tuple(int(d) for d in self.interpreter.get_input_details()[0]["shape"])
        self.interpreter.set_tensor(self.input_index, np.zeros(shape, dtype=self.input_dtype))
        self.interpreter.invoke()
        self.interpreter.get_tensor(self.embedding_index)
        self.interpreter.get_tensor(self.output_index)

    def _probe_resize(self) -> bool:
        """Whether the input batch can be resized (a graph with a hard-coded RESHAPE cannot)."""
        fixed = self.batch
        try:
            self.interpreter.resize_tensor_input(self.input_index, [fixed + 1, *self.sample_shape])
            self.interpreter.allocate_tensors()
            ok = True
        except (RuntimeError, ValueError) as exc:
            logger.info("%s: input batch fixed at %d (%s)", self.path.name, fixed, str(exc).splitlines()[0])
            ok = False
        self.interpreter.resize_tensor_input(self.input_index, [fixed, *self.sample_shape])
        self.interpreter.allocate_tensors()
        return ok

    def _find_embedding(self, name: str | None) -> int:
        if name:
            for d in self.interpreter.get_tensor_details():
                if d["name"] == name:
                    return int(d["index"])
            raise ModelError(str(self.path), f"embedding tensor {name!r} not found in the model")
        try:
            ops = self.interpreter._get_ops_details()
        except AttributeError as exc:
            raise ModelError(str(self.path), "runtime cannot list ops; set model.embedding_tensor") from exc
        # a delegated interpreter lists the original ops, then the DELEGATE nodes that replaced them
        fcs = [op for op in ops if op["op_name"] == "FULLY_CONNECTED"]
        if not fcs:
            raise ModelError(
                str(self.path), "no FULLY_CONNECTED op: set model.embedding_tensor in the profile"
            )
        last = fcs[-1]
        ins = [int(i) for i in last["inputs"]]
        self._fc_weights = ins[1]
        self._fc_bias = ins[2] if len(ins) > 2 and ins[2] >= 0 else None
        self._fc_output = int(last["outputs"][0])
        return ins[0]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one model input sample (without the batch axis)."""
        return self.input_shape[1:]

    def head_from_model(self) -> tuple[F32, F32]:
        """The head shipped inside the model (its last FULLY_CONNECTED op), dequantised.

        Returns
        -------
        W : float32 [D, K]
            (TFLite stores FC weights as [K, D]; transposed here.)
        b : float32 [K]

        Raises
        ------
        ModelError
            If the embedding tensor was named in the profile (no FC op is known) or the weights
            cannot be read.
        """
        if self._fc_weights is None:
            raise ModelError(str(self.path), "the model's head is unknown when model.embedding_tensor is set")
        details = {int(d["index"]): d for d in self.interpreter.get_tensor_details()}
        wd = details[self._fc_weights]
        try:
            w = self.interpreter.get_tensor(self._fc_weights)
        except ValueError as exc:
            raise ModelError(str(self.path), f"cannot read head weights: {exc}") from exc
        wq = wd.get("quantization_parameters", {})
        scales = np.asarray(wq.get("scales", []), dtype=np.float32)
        zps = np.asarray(wq.get("zero_points", []), dtype=np.float32)
        if w.dtype != np.float32 and scales.size:
            # per-channel (axis 0 = output channel) or per-tensor weights
            W_kd = (w.astype(np.float32) - zps.reshape(-1, 1)) * scales.reshape(-1, 1)
        else:
            W_kd = w.astype(np.float32)
        K = W_kd.shape[0]
        if self._fc_bias is None:
            b = np.zeros(K, dtype=np.float32)
        else:
            bd = details[self._fc_bias]
            bq = self.interpreter.get_tensor(self._fc_bias)
            bscales = np.asarray(bd.get("quantization_parameters", {}).get("scales", []), dtype=np.float32)
            b = (
                bq.astype(np.float32) * bscales
                if bq.dtype != np.float32 and bscales.size
                else bq.astype(np.float32)
            )
        W: F32 = np.ascontiguousarray(W_kd.T, dtype=np.float32)
        return W, np.ascontiguousarray(b, dtype=np.float32)

    def resize(self, batch: int) -> None:
        """Resize the input to ``batch`` samples and re-allocate tensors (invalidates tensor views).

        Raises
        ------
        ValueError
            If ``batch < 1``.
        """
        if batch < 1:
            raise ValueError(f"batch {batch} must be >= 1")
        if batch == self.batch:
            return
        self.interpreter.resize_tensor_input(self.input_index, [batch, *self.sample_shape])
        self.interpreter.allocate_tensors()
        self.batch = batch

    def quantize_input(self, x: F32) -> np.ndarray:
        """Quantise a normalised float32 model input to the input tensor's dtype (round half to even, clip).

        Parameters
        ----------
        x : float32 [N, *sample_shape]

        Returns
        -------
        array [N, *sample_shape] of the input dtype (int8/uint8 quantised, or float32 as is).
        """
        if self.input_dtype == np.float32:
            return x.astype(np.float32, copy=False)
        info = np.iinfo(self.input_dtype)
        q = np.rint(x / np.float32(self.input_quant.scale)) + self.input_quant.zero_point
        out: np.ndarray = np.clip(q, info.min, info.max).astype(self.input_dtype)
        return out

    def run(self, model_input: np.ndarray) -> tuple[F32, F32]:
        """Invoke the model on one batch already in the input dtype.

        Parameters
        ----------
        model_input : [N, *sample_shape] of the input tensor's dtype, N >= 1

        Returns
        -------
        embeddings : float32 [N, D]
            The embedding tensor, dequantised.
        logits : float32 [N, K]
            The model's own output (with its shipped head), dequantised.

        Raises
        ------
        ValueError
            If the sample shape or dtype is not the model's.
        """
        n = int(model_input.shape[0])
        if tuple(model_input.shape[1:]) != self.sample_shape or model_input.dtype != self.input_dtype:
            raise ValueError(
                f"input {model_input.shape} {model_input.dtype}, model expects [N, {self.sample_shape}] "
                f"{self.input_dtype}"
            )
        if not self.resizable and n != self.batch:
            parts = [self.run(model_input[i : i + 1]) for i in range(n)] if self.batch == 1 else None
            if parts is None:
                raise ValueError(f"model batch is fixed at {self.batch}; got {n} samples")
            return (
                np.concatenate([p[0] for p in parts]).astype(np.float32),
                np.concatenate([p[1] for p in parts]).astype(np.float32),
            )
        self.resize(n)
        self.interpreter.set_tensor(self.input_index, model_input)
        self.interpreter.invoke()
        emb = dequantize(self.interpreter.get_tensor(self.embedding_index), self.embedding_quant)
        logits = dequantize(self.interpreter.get_tensor(self.output_index), self.output_quant)
        return emb.reshape(n, -1), logits.reshape(n, -1)
