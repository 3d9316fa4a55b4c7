"""Raw samples to model input, unfused or fused, batched into the interpreter; chosen by measurement.

**Unfused** runs the stages (cast to float32, :func:`normalise`, ``quantize_input``) as numpy
operations, then ``set_tensor``; **fused** writes each sample into a view of the input tensor in one
stage (``fill``), bit-identical. LiteRT refuses ``invoke()`` and resizing while a view of a tensor is
alive, so no view outlives the write. Mode and batch are measured (:func:`choose`), cached per model.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from edgefl.records import atomic_write
from edgefl.runtime import Backbone
from edgefl.types import F32
from edgefl.validators import MAX_BATCH

logger = logging.getLogger(__name__)

Mode = Literal["fused", "unfused"]
MODES: tuple[Mode, Mode] = ("fused", "unfused")

#: Stages that run before ``invoke`` (what "preprocessing" means in every measurement).
PREPROCESS_STAGES = ("cast", "normalise", "quantise", "stack", "set_tensor", "fill")
#: Raw values per table lookup call (its 64 KiB intp index copy stays under one sample).
TABLE_CHUNK_ELEMS = 8192
#: Largest lookup table built (bytes); a 16-bit raw into a float32 model per channel would exceed it.
TABLE_MAX_BYTES = 256 * 1024
#: Fused must beat unfused by this fraction on the stages that differ to be chosen (measurement noise).
DEFAULT_MARGIN = 0.10
#: Trials per kernel when a float32 model's fused step picks between the table and the arithmetic.
KERNEL_TRIALS = 5
CACHE_VERSION = 1

#: (tensor index, zero point, scale or None when not quantised)
_Output = tuple[int, np.float32, np.float32 | None]


# --- the stages (shared by both paths and by the lookup tables) -----------------------------------
def normalise(x: F32, mean: F32, std: F32) -> F32:
    """Stage ``normalise``: ``(x float32 [..., C] - mean) / std`` (float32 [C] or [1]), a new array."""
    out: F32 = ((x - mean) / std).astype(np.float32, copy=False)
    return out


def _channel_params(values: Sequence[float], name: str, channels: int) -> F32:
    arr = np.asarray(tuple(values), dtype=np.float32)
    if arr.ndim != 1 or arr.size not in (1, channels) or not np.isfinite(arr).all():
        raise ValueError(f"{name} {tuple(values)}: need 1 or {channels} finite values")
    return arr


@dataclass(frozen=True, slots=True)
class _Table:
    """Lookup table for integer raw samples: ``flat[u * C + c]`` or ``flat[u]`` (u = raw bits, unsigned)."""

    flat: np.ndarray
    index_dtype: np.dtype[Any]
    channels: int  # 1 when every channel maps alike
    channel_of: np.ndarray  # intp [chunk]: channel of each position of a chunk (per-channel tables)
    identity: bool  # raw dtype == input dtype and flat[u] == u: the fused step is a copy


class Pipeline:
    """Raw samples to (embeddings, logits) through one backbone, in a fixed mode and batch size.

    Parameters
    ----------
    backbone : Backbone
        The loaded model; its input is resized to ``batch`` when the model allows it.
    mean, std : tuple[float, ...]
        1 or C values (last axis): model input = ``(raw - mean) / std``.
    mode : "fused" | "unfused"
    batch : int
        Samples per ``invoke``, >= 1; a fixed-batch model runs it in ``tensor_batch`` invokes.

    Raises ``ValueError`` if ``mode``, ``batch``, ``mean`` or ``std`` is invalid.
    """

    def __init__(
        self,
        backbone: Backbone,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        *,
        mode: Mode,
        batch: int,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: must be 'fused' or 'unfused'")
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch {batch}: must be in 1..{MAX_BATCH}")
        self.backbone = backbone
        self.mode: Mode = mode
        self.batch = int(batch)
        self.sample_shape = backbone.sample_shape
        channels = self.sample_shape[-1] if self.sample_shape else 1
        self.mean = _channel_params(mean, "mean", channels)
        self.std = _channel_params(std, "std", channels)
        if (self.std <= 0).any():
            raise ValueError(f"std {tuple(std)}: every value must be > 0")
        self._channels = channels
        self._elems = int(np.prod(self.sample_shape))
        self._interp = backbone.interpreter
        self._in = backbone.input_index
        self.tensor_batch = self.batch if backbone.resizable else int(backbone.input_shape[0])
        #: Input rows of the group being run (fewer for a resizable model's last, partial group).
        self._size = self.tensor_batch
        #: The largest batch the interpreter's tensors were allocated for (its arena keeps that size).
        self.allocated_batch = int(backbone.batch)
        if not backbone.resizable and self.tensor_batch != self.batch:
            logger.info(
                "%s: input batch fixed at %d; batch %d runs as %d-sample invokes",
                backbone.path.name,
                self.tensor_batch,
                self.batch,
                self.tensor_batch,
            )
        outputs = {int(d["index"]): d for d in self._interp.get_output_details()}
        self.num_classes = int(outputs[backbone.output_index]["shape"][-1])
        e, o = backbone.embedding_quant, backbone.output_quant
        self._output_specs: tuple[_Output, _Output] = (  # the embedding's and the logits'
            (backbone.embedding_index, np.float32(e.zero_point), np.float32(e.scale) if e.scale else None),
            (backbone.output_index, np.float32(o.zero_point), np.float32(o.scale) if o.scale else None),
        )
        self._tables: dict[np.dtype[Any], _Table | None] = {}
        #: raw dtype name -> best seconds per tensor batch of each fused kernel tried (float32 models)
        self.kernel_seconds: dict[str, dict[str, float]] = {}
        self._built_for = (backbone.input_dtype, backbone.input_quant)
        self._scratch: F32 | None = None
        self._last_dtype = np.dtype(np.uint8)
        self._pad = self._pad_value()
        self.reset_counters()

    # --- observability -------------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Zero the counters and stage timings."""
        self._calls: dict[str, int] = {}
        self._seconds: dict[str, float] = {}
        self.samples_total = 0
        self.invokes_total = 0
        self.padded_rows_total = 0

    def _time(self, stage: str, t0: float) -> float:
        t1 = time.perf_counter()
        self._calls[stage] = self._calls.get(stage, 0) + 1
        self._seconds[stage] = self._seconds.get(stage, 0.0) + (t1 - t0)
        return t1

    def counters(self) -> dict[str, Any]:
        """Counters and per-stage timings since the last reset (JSON-ready).

        ``mode``, ``batch``, ``tensor_batch``, ``allocated_batch``, ``fused_step`` (of the last call's
        raw dtype, ``""`` unfused), ``samples``, ``invokes``, ``padded_rows``, ``stages``:
        ``{name: {"calls": int, "total_s": float, "s_per_sample": float}}`` in order.
        """
        n = max(self.samples_total, 1)
        order = [s for s in (*PREPROCESS_STAGES, "invoke", "read") if s in self._calls]
        return {
            "mode": self.mode,
            "batch": self.batch,
            "tensor_batch": self.tensor_batch,
            "allocated_batch": self.allocated_batch,
            "fused_step": self.fused_step(self._last_dtype) if self.mode == "fused" else "",
            "samples": self.samples_total,
            "invokes": self.invokes_total,
            "padded_rows": self.padded_rows_total,
            "stages": {
                s: {
                    "calls": self._calls[s],
                    "total_s": self._seconds[s],
                    "s_per_sample": self._seconds[s] / n,
                }
                for s in order
            },
        }

    def fused_step(self, raw_dtype: np.dtype[Any] | type | str = np.uint8) -> str:
        """How the fused step maps ``raw_dtype``: ``"copy"``, ``"table"`` (8/16-bit) or ``"in_place"``.

        The table runs the unfused stages on every raw value; a float32 model's is timed against the
        arithmetic, the faster kept.
        """
        table = self._table(np.dtype(raw_dtype))
        if table is None:
            return "in_place"
        return "copy" if table.identity else "table"

    # --- public entry points --------------------------------------------------------------------
    def run(self, raw: np.ndarray) -> tuple[F32, F32]:
        """Embed and score ``raw`` [N >= 1, *sample_shape] (int or float), ``tensor_batch`` rows an invoke.

        A last, partial group runs at its real size when the batch is resizable, else padded. Returns
        ``(embeddings float32 [N, D], logits float32 [N, K])``, dequantised. ``ValueError`` if ``raw``
        is empty or of another sample shape; ``InterpreterBusy`` if another thread uses the interpreter.
        """
        n = self._check(raw)
        emb = np.empty((n, self.backbone.embedding_dim), dtype=np.float32)
        logits = np.empty((n, self.num_classes), dtype=np.float32)
        self._invoke_groups(raw, n, (emb, logits))
        self.samples_total += n
        return emb, logits

    def forward(self, raw: np.ndarray) -> None:
        """:meth:`run` without reading the outputs (what profiling times as end to end); raises as it."""
        self._invoke_groups(raw, self._check(raw), None)

    def _invoke_groups(self, raw: np.ndarray, n: int, out: tuple[F32, F32] | None) -> None:
        """Load and invoke ``raw`` ``tensor_batch`` rows at a time; read, time and count into ``out``."""
        tb = self.tensor_batch
        with self.backbone.claim():
            for g0 in range(0, n, tb):
                rows = raw[g0 : g0 + tb]
                self._size = len(rows) if self.backbone.resizable else tb
                self._load(rows)
                if out is None:
                    self._interp.invoke()
                    continue
                t0 = time.perf_counter()
                self._interp.invoke()
                t0 = self._time("invoke", t0)
                self._read(out[0][g0 : g0 + len(rows)], out[1][g0 : g0 + len(rows)])
                self._time("read", t0)
                self.invokes_total += 1

    def prepare(self, rows: np.ndarray) -> None:
        """Preprocess 1..``tensor_batch`` rows into the input tensor without invoking; ValueError else."""
        if self._check(rows) > self.tensor_batch:
            raise ValueError(f"prepare: {len(rows)} rows > tensor batch {self.tensor_batch}")
        with self.backbone.claim():
            self._size = self.tensor_batch  # padded, as a fixed-batch model runs it
            self._load(rows)

    def invoke_only(self, times: int = 1) -> None:
        """Invoke ``times`` times on whatever is in the input tensor (the throughput ceiling)."""
        with self.backbone.claim():
            self._size = self.tensor_batch
            self._ensure_batch()
            for _ in range(times):
                self._interp.invoke()

    # --- internals ------------------------------------------------------------------------------
    def _check(self, raw: np.ndarray) -> int:
        if not isinstance(raw, np.ndarray) or raw.ndim != len(self.sample_shape) + 1:
            raise ValueError(f"raw must be an array [N, {self.sample_shape}]")
        if tuple(raw.shape[1:]) != self.sample_shape or raw.shape[0] < 1:
            raise ValueError(f"raw {raw.shape}: model expects [N >= 1, {self.sample_shape}]")
        if raw.dtype.kind not in "uif":
            raise ValueError(f"raw dtype {raw.dtype}: must be an integer or float dtype")
        return int(raw.shape[0])

    def _pad_value(self) -> float | int:
        """The input tensor value of a normalised zero (what pad rows hold)."""
        bb = self.backbone
        return 0.0 if bb.input_dtype == np.float32 else int(bb.input_quant.zero_point)

    def set_tensor_batch(self, n: int) -> None:
        """Run ``n`` rows per invoke from the next call on (the memory governor shrinks or restores it).

        ``1 <= n <=`` :attr:`batch`, else ValueError; ignored for a model whose batch is fixed.
        """
        if not 1 <= n <= self.batch:
            raise ValueError(f"tensor batch {n}: must be in 1..{self.batch}")
        if self.backbone.resizable:
            self.tensor_batch = self._size = int(n)

    def _ensure_batch(self) -> None:
        """Resize the input to the group's size when it is not (another user may have resized it)."""
        if int(self._interp.tensor(self._in)().shape[0]) != self._size:  # temporary view
            self._interp.resize_tensor_input(self._in, [self._size, *self.sample_shape])
            self._interp.allocate_tensors()
            self.backbone.batch = self._size
            self.allocated_batch = max(self.allocated_batch, self._size)

    def _load(self, rows: np.ndarray) -> None:
        """Everything before ``invoke`` for one group of ``m <= _size`` rows (padded up to ``_size``)."""
        if (self.backbone.input_dtype, self.backbone.input_quant) != self._built_for:
            self._tables.clear()
            self._built_for = (self.backbone.input_dtype, self.backbone.input_quant)
            self._pad = self._pad_value()
        m = int(rows.shape[0])
        self._last_dtype = rows.dtype
        if m < self._size:
            self.padded_rows_total += self._size - m
        if self.mode == "fused":
            t0 = time.perf_counter()
            self._fill(rows)
            self._time("fill", t0)
            return
        t0 = time.perf_counter()
        x: F32 = rows.astype(np.float32)
        t0 = self._time("cast", t0)
        x = normalise(x, self.mean, self.std)
        t0 = self._time("normalise", t0)
        q = self.backbone.quantize_input(x)
        t0 = self._time("quantise", t0)
        if m < self._size:
            pad = np.full((self._size - m, *self.sample_shape), self._pad, dtype=q.dtype)
            q = np.concatenate([q, pad])
            t0 = self._time("stack", t0)
        try:
            self._interp.set_tensor(self._in, q)
        except ValueError:
            self._ensure_batch()  # resized behind our back: resize and set again
            self._interp.set_tensor(self._in, q)
        self._time("set_tensor", t0)

    def _fill(self, rows: np.ndarray) -> None:
        """The fused step: write ``rows`` into rows ``0..m-1`` of the input tensor, pad the rest."""
        view: np.ndarray | None = self._interp.tensor(self._in)()
        try:
            if view is not None and view.shape[0] != self._size:
                view = None  # resized by someone else: drop the view, resize, take a fresh one
                self._ensure_batch()
                view = self._interp.tensor(self._in)()
            assert view is not None
            self._write(view, rows)
        except BaseException as exc:
            # The traceback's frames (_write's, numpy's) reference the view; an exception kept by a
            # caller would keep it alive and LiteRT would refuse every later invoke().
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            view = None

    def _write(self, view: np.ndarray, rows: np.ndarray) -> None:
        m = int(rows.shape[0])
        table = self._table(rows.dtype)
        if table is not None and table.identity:
            np.copyto(view[:m], rows, casting="no")
        elif table is not None:
            self._write_table(view, rows, table)
        elif self.backbone.input_dtype == np.float32:
            self._write_float(view[:m], rows)
        else:
            if self._scratch is None:
                self._scratch = np.empty(self.sample_shape, dtype=np.float32)
            for k in range(m):
                self._write_quantised(view[k], rows[k])
        if m < view.shape[0]:
            view[m:] = self._pad

    def _write_table(self, view: np.ndarray, rows: np.ndarray, table: _Table) -> None:
        """Look up rows ``0..m-1`` of ``view`` in ``table``, in chunks of at most 64 KiB of indices."""
        src = np.ascontiguousarray(rows).reshape(-1).view(table.index_dtype)
        dst = view.reshape(-1)
        total = int(rows.shape[0]) * self._elems
        c = table.channels
        chunk = len(table.channel_of) if c > 1 else TABLE_CHUNK_ELEMS
        for s in range(0, total, chunk):
            e = min(s + chunk, total)
            if c == 1:
                table.flat.take(src[s:e], out=dst[s:e], mode="clip")
            else:
                idx = src[s:e].astype(np.intp)
                idx *= c
                idx += table.channel_of[: e - s]
                np.take(table.flat, idx, out=dst[s:e], mode="clip")

    def _table_beats_arithmetic(self, table: _Table, raw_dtype: np.dtype[Any]) -> bool:
        """Time the lookup against the float32 arithmetic on one sample (best of trials); True if faster."""
        rows = random_raw((1, *self.sample_shape), raw_dtype)
        dst = np.empty(rows.shape, dtype=np.float32)
        best = {"table": float("inf"), "in_place": float("inf")}
        for _ in range(KERNEL_TRIALS):
            t0 = time.perf_counter()
            self._write_table(dst, rows, table)
            t1 = time.perf_counter()
            self._write_float(dst, rows)
            t2 = time.perf_counter()
            best["table"] = min(best["table"], t1 - t0)
            best["in_place"] = min(best["in_place"], t2 - t1)
        self.kernel_seconds[raw_dtype.name] = best
        return best["table"] < best["in_place"]

    def _write_float(self, dst: F32, rows: np.ndarray) -> None:
        """The stages' arithmetic for a float32 model, whole batch, into ``dst`` (bit-identical)."""
        np.subtract(rows, self.mean, out=dst, dtype=np.float32, casting="unsafe")
        np.divide(dst, self.std, out=dst)

    def _write_quantised(self, row: np.ndarray, raw: np.ndarray) -> None:
        """The unfused stages on one sample through the scratch, into ``row`` (bit-identical)."""
        s = self._scratch
        assert s is not None
        if raw.dtype == np.float32:
            np.subtract(raw, self.mean, out=s)
        else:
            np.copyto(s, raw, casting="unsafe")  # the cast stage first, as unfused does
            np.subtract(s, self.mean, out=s)
        np.divide(s, self.std, out=s)
        bb = self.backbone
        info = np.iinfo(bb.input_dtype)
        np.divide(s, np.float32(bb.input_quant.scale), out=s)
        np.rint(s, out=s)
        np.add(s, bb.input_quant.zero_point, out=s)
        np.clip(s, info.min, info.max, out=s)
        np.copyto(row, s, casting="unsafe")

    def _table(self, raw_dtype: np.dtype[Any]) -> _Table | None:
        """The lookup table for integer raw samples of 1 or 2 bytes (built once), else None."""
        if raw_dtype in self._tables:
            return self._tables[raw_dtype]
        table: _Table | None = None
        out_bytes = self.backbone.input_dtype.itemsize
        if raw_dtype.kind in "ui" and raw_dtype.itemsize <= 2:
            unsigned = np.dtype(f"u{raw_dtype.itemsize}")
            levels = 1 << (8 * raw_dtype.itemsize)
            per_channel = self.mean.size > 1 or self.std.size > 1
            c = self._channels if per_channel else 1
            if levels * c * out_bytes <= TABLE_MAX_BYTES:
                # every raw bit pattern, in unsigned order, through the unfused stages
                values = np.arange(levels, dtype=unsigned).view(raw_dtype)
                grid = np.repeat(values[:, None], c, axis=1)
                q = self.backbone.quantize_input(normalise(grid.astype(np.float32), self.mean, self.std))
                if per_channel and (q == q[:, :1]).all():
                    q, c = q[:, :1], 1
                # per-channel: index copy + channel pattern = 2 x 32 KiB, still under one sample
                chunk = max(c, TABLE_CHUNK_ELEMS // 2 // c * c) if c > 1 else 0
                channel_of = np.arange(chunk, dtype=np.intp) % c
                flat = np.ascontiguousarray(q.reshape(-1))
                identity = bool(
                    c == 1
                    and flat.dtype == raw_dtype
                    and np.array_equal(flat.view(unsigned), np.arange(levels, dtype=unsigned))
                )
                table = _Table(flat, unsigned, c, channel_of, identity)
                float_out = flat.dtype == np.float32
                if not identity and float_out and not self._table_beats_arithmetic(table, raw_dtype):
                    table = None  # the gather of 4-byte values measured slower than two passes
        self._tables[raw_dtype] = table
        return table

    def _read(self, emb: F32, logits: F32) -> None:
        """Dequantise the first ``len(emb)`` rows of the embedding and output into ``emb``/``logits``."""
        m = emb.shape[0]
        for (index, zero_point, scale), out in zip(self._output_specs, (emb, logits), strict=True):
            q = self._interp.get_tensor(index)  # a copy, not a view
            if q.shape[0] != m or q.ndim != 2:
                q = q.reshape(q.shape[0], -1)[:m]
            if scale is None:
                np.copyto(out, q, casting="unsafe")
            else:
                # dequantised in float32: (float32(q) - zero_point) * scale, the TFLite quantization spec
                np.subtract(q, zero_point, out=out, casting="unsafe")
                np.multiply(out, scale, out=out)


def random_raw(shape: tuple[int, ...], dtype: np.dtype[Any] | str, seed: int = 0) -> np.ndarray:
    """Seeded raw samples spanning the dtype's range (floats: normal, std 64), for measurements."""
    dt = np.dtype(dtype)
    native = dt.newbyteorder("=")  # numpy's generators draw native byte order only
    rng = np.random.default_rng(seed)
    if dt.kind in "ui":
        info = np.iinfo(native)
        drawn = rng.integers(int(info.min), int(info.max), size=shape, endpoint=True, dtype=native)
        return drawn.astype(dt)
    return (rng.standard_normal(shape) * 64.0).astype(dt)


# --- the automatic choice, cached per model -------------------------------------------------------
def cache_path(cache_dir: Path, model_sha256: str) -> Path:
    """Where :func:`choose` keeps its decision for one model: ``<cache_dir>/pipeline-<sha256>.json``."""
    return cache_dir / f"pipeline-{model_sha256}.json"


def choose(
    backbone: Backbone,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    *,
    batches: Sequence[int] = (1, 4, 8, 16),
    cache_dir: Path | None,
    raw_dtype: str = "uint8",
    repeats: int = 7,
    margin: float = DEFAULT_MARGIN,
) -> tuple[Mode, int]:
    """``pipeline.mode = "auto"``: measure and pick (mode, batch), cached per model sha256 on disk.

    A cache for other parameters, unreadable or of an older format, is measured again and replaced.
    Arguments and errors as :func:`~edgefl.agent.pipeline_measure.measure` and ``decide``;
    ``cache_dir`` is created, or None to measure every time.
    """
    key: dict[str, Any] = {
        "cache_version": CACHE_VERSION,
        "model_sha256": backbone.sha256,
        "runtime": backbone.runtime_name,
        "mean": [float(v) for v in mean],
        "std": [float(v) for v in std],
        "batches": [int(b) for b in batches],
        "raw_dtype": str(np.dtype(raw_dtype)),
    }
    path = cache_path(cache_dir, backbone.sha256) if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                mode, batch = data["chosen"]["mode"], int(data["chosen"]["batch"])
                if mode in MODES and batch in key["batches"]:
                    logger.info("%s: pipeline %s, batch %d (cached)", backbone.path.name, mode, batch)
                    return cast(Mode, mode), batch
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("pipeline cache %s unreadable (%s); measuring again", path, exc)
    from edgefl.agent.pipeline_measure import decide, measure  # it imports Pipeline from here

    rows = measure(backbone, mean, std, batches=batches, raw_dtype=raw_dtype, repeats=repeats)
    mode, batch = decide(rows, margin=margin)
    logger.info("%s: measured pipeline choice %s, batch %d", backbone.path.name, mode, batch)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"key": key, "chosen": {"mode": mode, "batch": batch}, "batches": [asdict(r) for r in rows]}
        atomic_write(path, json.dumps(doc, indent=1).encode())
    return mode, batch
