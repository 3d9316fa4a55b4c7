"""Estimates of the bytes each phase of a round adds to RSS, from the model's shapes and the work size.

The governor (``edgefl.agent.governor``) admits a phase when ``rss + estimate`` fits under the cap;
each term here is checked against what the phase adds in a real process (``bench/memory.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.datasets import npz_headers
from edgefl.wire.compression import update_wire_bytes


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What the memory estimates need to know about a model, per sample.

    ``sample_elems`` elements of one input sample (e.g. 96*96*3); ``input_itemsize`` bytes per input
    element (1 for int8/uint8, 4 for float32); ``activation_bytes`` the largest sum of intermediate
    tensors alive at once for one sample (the arena's lower bound); ``embedding_dim``, ``classes`` D
    and K; ``delegated`` the graph runs in XNNPACK, whose workspace is about the liveness bound.
    """

    sample_elems: int
    input_itemsize: int
    activation_bytes: int
    embedding_dim: int
    classes: int
    delegated: bool = False


def model_shapes(backbone: Any) -> ModelShapes:
    """Read :class:`ModelShapes` from a loaded ``edgefl.runtime.Backbone``.

    The activation figure is a liveness scan of the op list: a tensor is alive from the op that
    writes it to the last op that reads it; the largest per-op sum, divided by the allocated batch,
    is the per-sample figure (kernels' scratch buffers are covered by a factor in
    :func:`estimate_inference_bytes`).
    """
    interp = backbone.interpreter
    details = {int(d["index"]): d for d in interp.get_tensor_details()}
    batch = max(1, int(backbone.batch))

    def nbytes(index: int) -> int:
        d = details[index]
        return math.prod(max(1, int(dim)) for dim in d["shape"]) * int(np.dtype(d["dtype"]).itemsize)

    activation = 0
    try:
        # a delegated graph also lists its DELEGATE nodes (model inputs to outputs) after the ops they
        # replaced: they would keep every tensor alive across the whole graph
        ops = [op for op in interp._get_ops_details() if op["op_name"] != "DELEGATE"]
        written: set[int] = {int(backbone.input_index)}
        first: dict[int, int] = {int(backbone.input_index): 0}
        last: dict[int, int] = {}
        for k, op in enumerate(ops):
            for i in op["inputs"]:
                if int(i) in written:
                    last[int(i)] = k
            for o in op["outputs"]:
                written.add(int(o))
                first.setdefault(int(o), k)
                last[int(o)] = max(last.get(int(o), k), k)
        for k in range(len(ops)):
            alive = sum(nbytes(t) for t in written if first.get(t, 0) <= k <= last.get(t, 0))
            activation = max(activation, alive)
    except (AttributeError, KeyError, TypeError, ValueError):
        activation = sum(nbytes(int(d["index"])) for d in interp.get_output_details())
    sample_elems = math.prod(int(dim) for dim in backbone.input_shape[1:])
    try:
        classes = int(backbone.head_from_model()[0].shape[1])
    except Exception:  # any model without a known head: use the output width
        details = {int(d["index"]): d for d in interp.get_output_details()}
        classes = int(details[backbone.output_index]["shape"][-1])
    return ModelShapes(
        sample_elems=sample_elems,
        input_itemsize=int(backbone.input_dtype.itemsize),
        activation_bytes=math.ceil(activation / batch),
        embedding_dim=int(backbone.embedding_dim),
        classes=classes,
        delegated=bool(getattr(backbone, "delegated", False)),
    )


# Factors fitted to the measured peaks (bench/memory.py, tests/test_memory.py) with headroom:
# the arena is up to ~2x the liveness lower bound (im2col/accumulator scratch of int8 convs).
_ARENA_FACTOR = 2.0
# XNNPACK: MobileNet int8 at batch 32 measured 4.4 MiB for a 4.2 MiB liveness bound (tests/test_memory.py)
_DELEGATED_ARENA_FACTOR = 1.0
_TOPK_CODE_BYTES = 768 << 10  # first-call code pages of the top-k encoder (see estimate_encode_bytes)
# zlib's deflate state at level 9, 15-bit window: (1 << 17) + (1 << 17) bytes (zlib's zconf.h), for the
# int8 levels' deflate stage (edgefl.wire.compression, "qz")
_DEFLATE_STATE_BYTES = 256 << 10


def estimate_batch_bytes(shapes: ModelShapes, batch: int, *, fused: bool = False) -> int:
    """Heap bytes to prepare ``batch`` (>= 1) raw samples for the model (normalise, quantise).

    Unfused: the float32 copies of the batch alive at once (5 for quantised inputs, 3 for float
    inputs) plus the result. ``fused`` (the pipeline's mode): written in place into the input tensor
    through a one-sample float32 scratch.
    """
    elems = batch * shapes.sample_elems
    if fused:
        return shapes.sample_elems * 4  # one-sample float32 scratch
    copies = 5 if shapes.input_itemsize != 4 else 3  # quantised (integer) inputs: 5
    return elems * (4 * copies + shapes.input_itemsize)


def estimate_inference_bytes(shapes: ModelShapes, batch: int, *, resident_batch: int = 0) -> int:
    """Bytes one interpreter call on ``batch`` (>= 1) samples may add to RSS.

    The arena keeps its largest size, so only the part beyond ``resident_batch`` (the largest batch
    already allocated, 0 = none known) is new; the dequantised outputs are new every call.
    """
    grow = max(0, batch - resident_batch)
    factor = _DELEGATED_ARENA_FACTOR if shapes.delegated else _ARENA_FACTOR
    arena = int(factor * shapes.activation_bytes * grow) + grow * shapes.sample_elems * shapes.input_itemsize
    outputs = batch * (shapes.embedding_dim + shapes.classes) * (4 + 4 + 1)
    return arena + outputs


def estimate_train_bytes(
    chunk: int,
    dim: int,
    classes: int,
    num_examples: int,
    *,
    first_run: bool = True,
    resident_rows: int = 0,
) -> int:
    """Bytes ``edgefl.agent.trainer.train_local`` may add to RSS with ``chunk`` samples per store read.

    Terms, each checked against a real run (``bench/memory.py``): the float32 chunk buffer the trainer
    reuses, the float16 gather it is read from, the labels and the chunk's slot order and shuffle; the
    per-epoch permutation of ``num_examples`` (samples in the store); the store's pages not yet mapped
    (file-backed, reclaimable; ``resident_rows``: stored samples already mapped,
    ``EmbeddingStore.resident_rows``); and when ``first_run`` four ``[D, K]`` float32 heads alive at
    the peak (working copy, gradient, delta, final head); later rounds reuse the heap the previous
    round freed. ``dim``, ``classes``: D, K.
    """
    head_bytes = 4 * (dim * classes + classes) * 4 if first_run else 0
    return _store_read_bytes(chunk, dim, num_examples, resident_rows) + head_bytes


def _store_read_bytes(chunk: int, dim: int, num_examples: int, resident_rows: int) -> int:
    """Bytes a pass over the store adds: chunk buffers, the epoch's shuffle, pages not yet mapped."""
    chunk = min(chunk, max(1, num_examples))
    # float32 buffer + float16 gather per row; labels int64 + int16; slot order and shuffle int64
    chunk_bytes = chunk * (dim * (4 + 2) + 8 + 2 + 8 + 8)
    order_bytes = num_examples * 8 * 3  # the Shuffler's uint64 keys, a temporary, the int64 order
    mapped = max(0, num_examples - max(0, resident_rows)) * (2 * dim + 2)  # float16 row + int16 label
    return chunk_bytes + order_bytes + mapped


def estimate_personal_bytes(
    chunk: int,
    dim: int,
    classes: int,
    batch_size: int,
    num_examples: int,
    *,
    resident_rows: int = 0,
) -> int:
    """Bytes ``edgefl.agent.trainer.train_personal`` may add to RSS with a given chunk size.

    Two ``[D, K]`` heads (the personal head and its gradient, new on every step), one SGD step's
    temporaries, and the store read as in local training; ``batch_size``: samples per SGD step; the
    other arguments as :func:`estimate_train_bytes`'s.
    """
    step_bytes = min(batch_size, chunk, max(1, num_examples)) * (dim * 4 + classes * 4 * 4)
    head_bytes = 2 * (dim * classes + classes) * 4
    read_bytes = _store_read_bytes(chunk, dim, num_examples, resident_rows)
    return read_bytes + step_bytes + head_bytes


def estimate_encode_bytes(dim: int, classes: int, compression: str, topk_fraction: float = 0.1) -> int:
    """Bytes ``edgefl.wire.rounds.encode_update`` may add to RSS.

    The delta's float32 temporaries, top-k's int64 partition and first-call code pages, the payload
    twice (typed-array bytes and CBOR output), zlib's deflate state for the int8 and top-k layouts,
    and int8's levels once more.

    ``compression`` is an ``edgefl.wire.compression.Compression`` value, ``topk_fraction`` in (0, 1].
    """
    n = dim * classes + classes
    sparse = compression.startswith("topk")
    temps = n * 4 * 2 + (n * 8 * 2 + _TOPK_CODE_BYTES if sparse else 0)
    if "int8" in compression or sparse:
        temps += _DEFLATE_STATE_BYTES + (n if "int8" in compression else 0)
    return temps + 2 * update_wire_bytes(dim, classes, compression, topk_fraction)


_NPY_READ_CHUNK_BYTES = 1 << 18  # numpy.lib.format.read_array's buffer when reading from a zip member


def estimate_replay_bytes(path: Path | str) -> int:
    """Bytes loading a replay file (``source.path``: ``x`` samples, ``y`` labels) adds to RSS.

    Every array as loaded (through ``numpy.load``'s buffer of up to 256 KiB) plus the labels' int64
    copy, from the headers alone (ValueError, OSError: :func:`edgefl.datasets.npz_headers`).
    """
    arrays = npz_headers(path)
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in arrays.values()]
    total = sum(sizes) + min(_NPY_READ_CHUNK_BYTES, max(sizes, default=0))
    if "y" in arrays:
        total += math.prod(arrays["y"][0]) * 8
    return total
