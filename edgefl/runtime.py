"""The TFLite model on the device: load it, find the embedding tensor and the head.

The only module that imports the interpreter: ``ai_edge_litert``, or ``tflite_runtime`` where LiteRT
has no wheel (armv7l).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import mmap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edgefl import modelfile
from edgefl.errors import EdgeflError, ModelError
from edgefl.profiles import sha256_file
from edgefl.types import F32

logger = logging.getLogger(__name__)

RuntimeName = Literal["auto", "litert", "tflite"]


def numpy_too_new_for_tflite_runtime() -> str | None:
    """Why tflite-runtime cannot run here (its wheels need numpy 1.x: a ``SystemError`` under 2), or None."""
    major = int(np.__version__.split(".")[0])
    if major < 2:
        return None
    return (
        f"tflite-runtime needs numpy<2, numpy {np.__version__} is installed: "
        "pip install 'numpy<2' (the `tflite` extra pins it), or use ai-edge-litert"
    )


def _interpreter_classes(runtime: RuntimeName) -> tuple[list[tuple[str, Any]], list[str]]:
    """Importable interpreter classes in order of preference, and why a requested runtime was not used."""
    found: list[tuple[str, Any]] = []
    notes: list[str] = []
    if runtime in ("auto", "litert"):
        try:
            from ai_edge_litert import interpreter as litert

            found.append(("litert", litert))
        except ImportError as exc:
            logger.debug("LiteRT (ai-edge-litert) not importable: %s", exc)  # in the refusal if none loads
            notes.append(f"ai-edge-litert not importable ({exc})")
    if runtime in ("auto", "tflite"):
        too_new = numpy_too_new_for_tflite_runtime()
        if too_new is not None and importlib.util.find_spec("tflite_runtime") is not None:
            notes.append(too_new)
        else:
            try:
                from tflite_runtime import interpreter as tflite

                found.append(("tflite", tflite))
            except ImportError as exc:
                # expected wherever LiteRT is installed; named in the refusal when nothing else loads
                logger.debug("tflite-runtime not importable: %s", exc)
                notes.append(f"tflite-runtime not importable ({exc})")
    return found, notes


def runtime_available(runtime: RuntimeName) -> bool:
    """Whether a TFLite runtime that ``runtime`` ("auto", "litert", "tflite") allows imports here."""
    return bool(_interpreter_classes(runtime)[0])


def open_interpreter(
    path: Path,
    *,
    num_threads: int = 1,
    runtime: RuntimeName = "auto",
    delegates: bool = False,
    content: bytes | None = None,
) -> tuple[str, Any]:
    """Create and allocate an interpreter for ``path``: (runtime name, interpreter), each runtime in turn.

    ``runtime`` "auto" prefers LiteRT; ``delegates`` applies XNNPACK (then only the model's outputs are
    readable after ``invoke()``); ``content``: the model's bytes when they differ from the file's (else
    LiteRT maps the file). ModelError if the file is missing, no runtime is importable, or every runtime
    failed to build an interpreter (each one's error named).
    """
    if content is None and not path.is_file():
        raise ModelError(str(path), "model file not found")
    classes, notes = _interpreter_classes(runtime)
    if not classes:
        install = " (install ai-edge-litert, or tflite-runtime with numpy<2)"
        hint = "" if any("numpy<2" in n for n in notes) else install
        raise ModelError(
            str(path), f"no TFLite runtime usable for runtime={runtime!r}: {'; '.join(notes)}{hint}"
        )
    errors: list[str] = []
    source = {"model_path": str(path)} if content is None else {"model_content": content}
    for name, mod in classes:
        try:
            kinds = mod.OpResolverType
            ops = kinds.BUILTIN if delegates else kinds.BUILTIN_WITHOUT_DEFAULT_DELEGATES
            interp = mod.Interpreter(**source, num_threads=num_threads, experimental_op_resolver_type=ops)
            interp.allocate_tensors()
            return name, interp
        except (ValueError, RuntimeError, TypeError, AttributeError, ImportError, SystemError) as exc:
            # SystemError: a runtime built against another numpy ABI (see numpy_too_new_for_tflite_runtime)
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    raise ModelError(str(path), "cannot load model: " + "; ".join(errors))


@dataclass(frozen=True, slots=True)
class Quant:
    """Affine quantisation of a tensor: ``real = scale * (q - zero_point)``; scale 0 = not quantised."""

    scale: float
    zero_point: int


def _quant(detail: dict[str, Any]) -> Quant:
    scale, zp = detail.get("quantization", (0.0, 0))
    return Quant(float(scale), int(zp))


PREPARE_HINT = "edgefl model prepare MODEL --out OUT"


INVOKE_WAIT_S = 30.0
"""How long a second thread waits for a busy interpreter before :class:`InterpreterBusy` (seconds)."""


class InterpreterBusy(EdgeflError):
    """A second thread waited too long for the ``model``'s interpreter the thread ``holder`` is using."""

    def __init__(self, model: str, holder: str) -> None:
        self.model = model
        self.holder = holder
        super().__init__(
            f"{model}: interpreter in use by thread {holder!r}; one interpreter runs one invoke at a time "
            "(run inference on the agent's worker thread)"
        )


class Backbone:
    """A loaded model split at its embedding tensor: the frozen backbone plus the shipped head.

    ``embedding_tensor`` names the embedding (None: the input of the last FULLY_CONNECTED op);
    ``xnnpack`` None (default) runs with XNNPACK (``delegated`` says); ``prepare`` adds the embedding as
    a model output in memory when it is not one (``embedding_output`` False), False refuses such a model
    with a message naming ``edgefl model prepare``. ModelError if the model cannot be loaded or run (a trial
    invoke), has no FULLY_CONNECTED op (and no named tensor), the named tensor does not exist, or
    (``prepare=False``) the embedding is not an output.

    The embedding is read from a model output (the arena reuses an intermediate's buffer), the logits
    from the output the head feeds (through ``head_activation``). A stateful model keeps its batch and
    runs its samples one by one, in order; one thread at a time uses the interpreter (:meth:`claim`).
    """

    def __init__(
        self,
        path: Path,
        *,
        num_threads: int = 1,
        runtime: RuntimeName = "auto",
        embedding_tensor: str | None = None,
        xnnpack: bool | None = None,
        prepare: bool = True,
    ) -> None:
        self.path = path
        if not path.is_file():
            raise ModelError(str(path), "model file not found")
        self.sha256 = sha256_file(path)
        # one guard on every invoke path: two threads on one interpreter give silently wrong outputs
        self._lock = threading.RLock()
        self._holder = ""
        try:
            # parsed through a read-only map: only the tables' pages become resident, never the weights
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                self.backbone_sha256 = modelfile.read_origin(mapped) or self.sha256
                """The backbone's identity on the wire (``model_sha256``): the original model's SHA-256
                for an ``edgefl model prepare`` output (its outputs, or folded input, do not make it
                another backbone), else the file's own :attr:`sha256`."""
                content = self._inspect(mapped, embedding_tensor, prepare)
            self.delegated = xnnpack is not False
            self.runtime_name, self.interpreter = open_interpreter(
                path, num_threads=num_threads, runtime=runtime, delegates=self.delegated, content=content
            )
            self._reopen = (num_threads, runtime, content)
            self._read_details()
            self._trial_invoke()
            if self.stateful:
                self.reset_state()  # start from the model's initial state, not the trial invoke's
        except (UnicodeDecodeError, ValueError, RuntimeError, KeyError, IndexError, TypeError) as exc:
            # a file that loads but whose metadata or graph is corrupt (names, shapes, missing buffers)
            raise ModelError(str(path), f"corrupt or unsupported model: {type(exc).__name__}: {exc}") from exc

    def _inspect(
        self, buf: modelfile.ModelBytes, embedding_tensor: str | None, prepare: bool
    ) -> bytes | None:
        """Find the tensors; the model bytes to load when the embedding was added as an output, else None."""
        path = str(self.path)
        try:
            graph = modelfile.read_graph(buf, path)
        except ModelError as exc:
            # let the runtime name its own error for what it cannot load at all
            open_interpreter(self.path)
            raise exc
        self.graph = graph
        if len(graph.inputs) != 1 or not graph.outputs:
            raise ModelError(path, f"expected 1 input tensor, found {len(graph.inputs)}")
        fc = modelfile.head_fc(graph)
        # the head's FC weights [K, D] (tensor index); None when the profile names the embedding
        self.head_weights_index: int | None = None
        self._fc_bias: int | None = None
        self.head_activation = "none"
        if embedding_tensor:
            self.embedding_index = modelfile.find_tensor(graph, embedding_tensor, path)
        elif fc is None:
            raise ModelError(path, "no FULLY_CONNECTED op: set model.embedding_tensor in the profile")
        else:
            ins = graph.ops[fc].inputs
            self.embedding_index = ins[0]
            self.head_weights_index = ins[1]
            self._fc_bias = ins[2] if len(ins) > 2 and ins[2] >= 0 else None
            self.head_activation = modelfile.head_activation(graph, fc)
        self.stateful_ops = modelfile.stateful_ops(graph)
        self.stateful = bool(self.stateful_ops)
        others = [i for i in graph.outputs if i != self.embedding_index]
        if not others:
            raise ModelError(path, "the only model output is the embedding: no logits output")
        head_out = modelfile.head_output(graph, fc) if fc is not None and not embedding_tensor else -1
        self.output_index = head_out if head_out in graph.outputs else others[0]
        self.embedding_output = self.embedding_index in graph.outputs
        if self.embedding_output:
            return None
        if not prepare:
            name = graph.tensors[self.embedding_index].name
            raise ModelError(
                path,
                f"the embedding (tensor {self.embedding_index} {name!r}) is not a model output, so the "
                f"interpreter may reuse its buffer: run `{PREPARE_HINT}` and use OUT",
            )
        logger.info(
            "%s: embedding tensor %d is not a model output; added as one in memory (`%s` writes such a file)",
            self.path.name,
            self.embedding_index,
            PREPARE_HINT,
        )
        return modelfile.add_outputs(buf, [self.embedding_index], path)

    @contextlib.contextmanager
    def claim(self, timeout_s: float = INVOKE_WAIT_S) -> Iterator[None]:
        """Hold the interpreter for the calling thread: ``with backbone.claim(): ...`` (re-entrant).

        Raises :class:`InterpreterBusy` on entry if another thread held it for ``timeout_s`` seconds.
        """
        if not self._lock.acquire(timeout=timeout_s):
            raise InterpreterBusy(self.path.name, self._holder)
        self._holder = threading.current_thread().name
        try:
            yield
        finally:
            self._lock.release()

    def reset_state(self) -> None:
        """Give a stateful model its initial state again: a new ``interpreter`` (holders read it again).

        ModelError if the model can no longer be loaded.
        """
        with self.claim():
            num_threads, runtime, content = self._reopen
            self.runtime_name, self.interpreter = open_interpreter(
                self.path, num_threads=num_threads, runtime=runtime, delegates=self.delegated, content=content
            )
            self.batch = int(self.input_shape[0])

    def _read_details(self) -> None:
        """Shapes, dtypes and quantisation from the interpreter; probe whether the batch resizes."""
        inputs = self.interpreter.get_input_details()
        self.input_index = int(inputs[0]["index"])
        self.input_shape: tuple[int, ...] = tuple(int(d) for d in inputs[0]["shape"])
        self.input_dtype = np.dtype(inputs[0]["dtype"])
        self.input_quant = _quant(inputs[0])
        self.interpreter.get_tensor_details()  # every name decodes (a corrupt one raises here)
        outputs = {int(d["index"]): d for d in self.interpreter.get_output_details()}
        self.output_quant = _quant(outputs[self.output_index])
        emb = outputs[self.embedding_index]
        self.embedding_quant = _quant(emb)
        self.embedding_dim = int(emb["shape"][-1])
        self.batch = int(self.input_shape[0])
        # a stateful model keeps its batch: its state has the batch's shape
        self.resizable = False if self.stateful else self._probe_resize()

    def _trial_invoke(self) -> None:
        """Run the model once on zeros: damaged weights can load and still not run (LiteRT raises)."""
        with self.claim():
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

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one model input sample (without the batch axis)."""
        return self.input_shape[1:]

    def head_from_model(self) -> tuple[F32, F32]:
        """The model's own head (its last FULLY_CONNECTED op), dequantised: W float32 [D, K], b float32 [K].

        ModelError if the embedding tensor was named in the profile (no FC op known) or unreadable weights.
        """
        if self.head_weights_index is None:
            raise ModelError(str(self.path), "the model's head is unknown when model.embedding_tensor is set")
        bias = self._fc_bias
        with self.claim():
            details = {int(d["index"]): d for d in self.interpreter.get_tensor_details()}
            try:
                w = self.interpreter.get_tensor(self.head_weights_index)
            except ValueError as exc:
                raise ModelError(str(self.path), f"cannot read head weights: {exc}") from exc
            bq = None if bias is None else self.interpreter.get_tensor(bias)
        wq = details[self.head_weights_index].get("quantization_parameters", {})
        scales = np.asarray(wq.get("scales", []), dtype=np.float32)
        zps = np.asarray(wq.get("zero_points", []), dtype=np.float32)
        if w.dtype != np.float32 and scales.size:
            # per-channel (axis 0 = output channel) or per-tensor weights
            W_kd = (w.astype(np.float32) - zps.reshape(-1, 1)) * scales.reshape(-1, 1)
        else:
            W_kd = w.astype(np.float32)
        K = W_kd.shape[0]
        if bias is None or bq is None:
            b = np.zeros(K, dtype=np.float32)
        else:
            bd = details[bias]
            bscales = np.asarray(bd.get("quantization_parameters", {}).get("scales", []), dtype=np.float32)
            b = bq.astype(np.float32)
            if bq.dtype != np.float32 and bscales.size:
                b = b * bscales
        W: F32 = np.ascontiguousarray(W_kd.T, dtype=np.float32)
        return W, np.ascontiguousarray(b, dtype=np.float32)

    def quantize_input(self, x: F32) -> np.ndarray:
        """Quantise a normalised float32 input [N, *sample_shape] to the input dtype (half to even, clip)."""
        if self.input_dtype == np.float32:
            return x.astype(np.float32, copy=False)
        info = np.iinfo(self.input_dtype)
        q = np.rint(x / np.float32(self.input_quant.scale)) + self.input_quant.zero_point
        out: np.ndarray = np.clip(q, info.min, info.max).astype(self.input_dtype)
        return out
