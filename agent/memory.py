"""Memory of the agent process: measurement from ``/proc``, the cap, and the governor that admits phases.

All figures are in bytes. Reading ``/proc/self/statm`` is cheap (one short read) and is used on hot
paths; ``/proc/self/status`` gives the kernel's peak RSS (``VmHWM``), ``/proc/self/smaps_rollup``
the proportional set size (PSS, shared pages divided among the processes mapping them).

The governor (:class:`Governor`) knows the cap (the profile's, lowered by a cgroup limit), measures
the exact peak RSS of each phase (``inference``, ``batch``, ``train``, ``encode``, ``publish``,
``apply``) by resetting the kernel's peak counter at the start of the phase, and admits each phase
with an estimate in bytes derived from the model and the work size (the ``estimate_*`` functions):
when ``rss + estimate > cap - reserve`` it halves the work down to a floor, then defers the phase.

Source: proc(5) (``statm``, ``status`` VmHWM, ``smaps_rollup``, ``clear_refs`` value 5 resets the
peak RSS, Linux >= 4.0), Documentation/admin-guide/cgroup-v2.rst (``memory.max``) and cgroup-v1
memory.rst (``memory.limit_in_bytes``), mallopt(3), malloc_trim(3).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import os
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np

from edgefl.wire.compression import delta_wire_bytes

logger = logging.getLogger(__name__)

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")

#: The phases of the agent, in the order of a round.
PHASES = ("batch", "inference", "train", "encode", "publish", "apply")
#: Phases that can wait for a later round (training and its upload). Inference (and its batch
#: preparation) cannot wait that long: it is shrunk to its floor, and refused only while even the
#: floor is over budget (the caller retries once memory frees).
DEFERRABLE = frozenset({"train", "encode", "publish", "personal"})
#: Phases held back while the system's MemAvailable is under the profile's threshold.
SYSTEM_GUARDED = frozenset({"train", "personal"})

# cgroup v1 reports "no limit" as a huge page-aligned number (PAGE_COUNTER_MAX * page size).
_V1_UNLIMITED = 1 << 62


# --- /proc readers ------------------------------------------------------------------------------
_OWN_FILES_LOCK = threading.Lock()
_own_fds: dict[str, tuple[int, tuple[int, int]]] = {}  # name -> (descriptor, (device, inode))
# what each kept file starts with: a descriptor whose number was closed and reused under us reads
# something else, and is dropped rather than trusted (statm starts with a digit)
_OWN_HEADS: Final = {"self/status": "Name:", "meminfo": "MemTotal:", "self/statm": ""}


def _forget_own_fds() -> None:
    """In a forked child (``os.register_at_fork``): the kept descriptors name the parent's files."""
    global _OWN_FILES_LOCK
    _OWN_FILES_LOCK = threading.Lock()  # another thread may have held the parent's at the fork
    for inherited, _ in _own_fds.values():
        with suppress(OSError):
            os.close(inherited)
    _own_fds.clear()


os.register_at_fork(after_in_child=_forget_own_fds)


def _own_fd(name: str, flags: int = os.O_RDONLY) -> tuple[int, tuple[int, int]]:
    """A descriptor kept open on ``/proc/<name>`` and the (device, inode) it had when opened.

    ``name`` is ``self/statm``, ``self/status``, ``meminfo`` or ``self/clear_refs``. A round reads
    these files a dozen times and resets the peak at every phase; opening, reading through a Python
    file object and closing each time cost 27-64 us here, a ``pread``/``write`` on a kept
    descriptor 1-12 us (the device's CPU per round). A forked child opens its own
    (:func:`_forget_own_fds`).

    Raises
    ------
    OSError
        If the file cannot be opened.
    """
    with _OWN_FILES_LOCK:
        kept = _own_fds.get(name)
        if kept is None:
            fd = os.open(f"/proc/{name}", flags | os.O_CLOEXEC)
            st = os.fstat(fd)
            kept = _own_fds[name] = (fd, (st.st_dev, st.st_ino))
        return kept


def _write_own(name: str, data: bytes) -> bool:
    """Write ``data`` through the kept descriptor on ``/proc/<name>``; whether it was written.

    False if the write failed or the descriptor no longer names that file (its number closed and
    reused under us: checked by an fstat, ~1 us, before writing).
    """
    try:
        fd, ident = _own_fd(name, os.O_WRONLY)
        st = os.fstat(fd)
        written = (st.st_dev, st.st_ino) == ident and os.write(fd, data) == len(data)
    except OSError:
        written = False
    if not written:
        _drop_own_fd(name)  # opened again next time; the caller falls back to a plain write
    return written


def _drop_own_fd(name: str) -> None:
    """Forget a kept descriptor that failed or reads another file, without closing it.

    Its number may belong to another part of the process by now: at worst one descriptor leaks
    (``O_CLOEXEC``).
    """
    with _OWN_FILES_LOCK:
        _own_fds.pop(name, None)


def _read_proc(proc: Path, pid: int | str | None, filename: str) -> str:
    """The text of ``<proc>/<pid>/<filename>`` (``<proc>/<filename>`` for pid None).

    This process's own ``statm``, ``status`` and ``meminfo`` under the real ``/proc`` are read with
    ``pread`` on a kept descriptor (:func:`_own_fd`), checked by their first bytes; any other path
    (another process, a test's fake ``/proc``), or a kept read that fails, is opened each time.

    Raises
    ------
    OSError
        If the file cannot be read.
    """
    name = filename if pid is None else f"self/{filename}"
    head = _OWN_HEADS.get(name) if proc == PROC and pid in ("self", None) else None
    if head is not None:
        try:
            text = os.pread(_own_fd(name)[0], 16384, 0).decode("ascii", "replace")
        except OSError:
            text = ""
        if text.startswith(head) and (head or text[:1].isdigit()):
            return text
        _drop_own_fd(name)  # opened again next time (or the plain read below says why it fails)
    path = proc / filename if pid is None else proc / str(pid) / filename
    return path.read_text()


def rss_bytes(pid: int | str = "self", *, proc: Path = PROC) -> int:
    """Resident set size of a process, in bytes (``/proc/<pid>/statm`` field 2 x page size).

    Raises
    ------
    OSError
        If the process does not exist or ``/proc`` is unavailable.
    """
    fields = _read_proc(proc, pid, "statm").split()
    return int(fields[1]) * PAGE_BYTES


def _status_kb(pid: int | str, key: str, proc: Path = PROC) -> int:
    text = "\n" + _read_proc(proc, pid, "status")  # a key on the first line is found too
    at = text.find(f"\n{key}:")
    if at < 0:
        raise OSError(f"{proc}/{pid}/status has no {key}")
    end = text.find("\n", at + 1)
    return int(text[at + len(key) + 2 : end if end >= 0 else None].split()[0]) * 1024


def peak_rss_bytes(pid: int | str = "self", *, proc: Path = PROC) -> int:
    """Peak resident set size (``VmHWM``) of a process since start or the last peak reset, in bytes.

    Note that a :class:`Governor` resets this counter at the start of each phase: use
    :attr:`Governor.peak_rss_bytes` for the lifetime peak of a governed process.

    Raises
    ------
    OSError
        If the process does not exist or the kernel does not report ``VmHWM``.
    """
    return _status_kb(pid, "VmHWM", proc)


def pss_bytes(pid: int | str = "self", *, proc: Path = PROC) -> int | None:
    """Proportional set size from ``/proc/<pid>/smaps_rollup`` in bytes, or None where not readable."""
    try:
        for line in (proc / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def system_available_bytes(*, proc: Path = PROC) -> int:
    """The system's ``MemAvailable`` from ``/proc/meminfo``, in bytes.

    Raises
    ------
    OSError
        If ``/proc/meminfo`` has no ``MemAvailable`` line (kernels before 3.14).
    """
    text = "\n" + _read_proc(proc, None, "meminfo")
    at = text.find("\nMemAvailable:")
    if at < 0:
        raise OSError(f"{proc}/meminfo has no MemAvailable")
    end = text.find("\n", at + 1)
    return int(text[at + 14 : end if end >= 0 else None].split()[0]) * 1024


def reset_peak(*, proc: Path = PROC) -> bool:
    """Reset the process's peak RSS (``VmHWM``) to its current RSS; False where the kernel refuses.

    Source: proc(5), ``/proc/<pid>/clear_refs``: writing 5 resets the peak resident set size.
    """
    if proc == PROC and _write_own("self/clear_refs", b"5"):
        return True
    try:
        with open(proc / "self" / "clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --- cgroup limit -------------------------------------------------------------------------------
def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _V1_UNLIMITED or value <= 0 else value


def _min_up(mount: Path, rel: str, filename: str) -> int | None:
    """Lowest limit on the path from the process's cgroup up to the mount's root (ancestors apply too)."""
    rel = rel.strip("/")
    parts = rel.split("/") if rel else []
    found: list[int] = []
    # In a cgroup namespace (containers) /proc/self/cgroup says "/" while the mount is the cgroup
    # itself; when the full path is missing, fall back to the mount root alone.
    if not (mount / rel).is_dir():
        parts = []
    for depth in range(len(parts), -1, -1):
        limit = _read_limit(mount.joinpath(*parts[:depth]) / filename)
        if limit is not None:
            found.append(limit)
    return min(found) if found else None


def cgroup_memory_limit_bytes(
    *, proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT, pid: int | str = "self"
) -> int | None:
    """The memory limit the kernel enforces on a process's cgroup, in bytes, or None when unlimited.

    Reads ``/proc/<pid>/cgroup``; for cgroup v2 (line ``0::/path``) the ``memory.max`` of the cgroup
    and each ancestor under ``cgroup_root`` (or ``cgroup_root/unified`` on hybrid hosts); for
    cgroup v1 (line ``N:...memory...:/path``) ``memory.limit_in_bytes`` under ``cgroup_root/memory``.
    The lowest limit found on either hierarchy wins.

    Parameters
    ----------
    proc : Path
        The proc file system (a fake tree in tests).
    cgroup_root : Path
        Where the cgroup file systems are mounted.
    pid : int or "self"

    Returns
    -------
    int or None
        Bytes; None when no limit is set (``max``, the v1 "unlimited" value) or nothing is readable.

    Source: Documentation/admin-guide/cgroup-v2.rst (memory.max); cgroup-v1/memory.rst
    (memory.limit_in_bytes, hierarchical accounting).
    """
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hier == "0" and controllers == "":
            for mount in (cgroup_root, cgroup_root / "unified"):
                if (mount / "cgroup.controllers").exists():
                    v2 = _min_up(mount, rel, "memory.max")
                    if v2 is not None:
                        limits.append(v2)
                    break
        elif "memory" in controllers.split(","):
            v1 = _min_up(cgroup_root / "memory", rel, "memory.limit_in_bytes")
            if v1 is not None:
                limits.append(v1)
    return min(limits) if limits else None


# --- estimates ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What the memory estimates need to know about a model, per sample.

    Attributes
    ----------
    sample_elems : int
        Elements of one model input sample (e.g. 96*96*3).
    input_itemsize : int
        Bytes per input element (1 for int8/uint8, 4 for float32).
    activation_bytes : int
        Largest sum of intermediate tensors alive at once while the graph runs, for one sample
        (a lower bound of the interpreter's arena per sample; see :func:`model_shapes`).
    embedding_dim : int
        D.
    classes : int
        K.
    delegated : bool
        The interpreter runs the graph in XNNPACK, which plans its own workspace to about the
        liveness bound (no im2col scratch): :func:`estimate_inference_bytes` uses factor 1, not 2.
    """

    sample_elems: int
    input_itemsize: int
    activation_bytes: int
    embedding_dim: int
    classes: int
    delegated: bool = False

    @property
    def quantized_input(self) -> bool:
        """Whether inputs are quantised (integer) rather than float32."""
        return self.input_itemsize != 4


def model_shapes(backbone: Any) -> ModelShapes:
    """Read :class:`ModelShapes` from a loaded ``edgefl.runtime.Backbone``.

    The activation figure is a liveness scan of the op list: a tensor is alive from the op that
    writes it to the last op that reads it; the largest per-op sum, divided by the allocated batch,
    is the per-sample figure. TFLite's arena planner packs tensors with this lower bound in mind, and
    some kernels add scratch buffers (im2col, int32 accumulators), which :func:`estimate_inference_bytes`
    covers with a factor.

    Parameters
    ----------
    backbone : edgefl.runtime.Backbone
        Uses ``interpreter``, ``input_index``, ``input_shape``, ``input_dtype``, ``batch``,
        ``embedding_dim`` and ``head_from_model`` (or ``output`` shape when the head is unknown).

    Returns
    -------
    ModelShapes
    """
    interp = backbone.interpreter
    details = {int(d["index"]): d for d in interp.get_tensor_details()}
    batch = max(1, int(backbone.batch))

    def nbytes(index: int) -> int:
        d = details[index]
        n = 1
        for dim in d["shape"]:
            n *= max(1, int(dim))
        return n * int(np.dtype(d["dtype"]).itemsize)

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
    sample_elems = 1
    for dim in backbone.input_shape[1:]:
        sample_elems *= int(dim)
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
_FIXED_BYTES = 256 << 10  # small Python objects, page rounding
_TOPK_CODE_BYTES = 768 << 10  # first-call code pages of the top-k encoder (see estimate_encode_bytes)
# zlib's deflate state at level 9, 15-bit window: (1 << 17) + (1 << 17) bytes (zlib's zconf.h), for the
# int8 levels' deflate stage (edgefl.wire.compression, "qz")
_DEFLATE_STATE_BYTES = 256 << 10
# The first run of a phase faults in the code pages of the library paths it uses (numpy's sort and
# BLAS kernels, LiteRT's kernels for a new shape): measured 1.5 MiB of RssFile for training.
FIRST_RUN_BYTES = 2 << 20
# Training's own first-run allowance, measured (tests/test_memory_estimates.py): the first
# train_local in an agent that has run inference maps in numpy's BLAS and sort code, +0.9-1.0 MiB of
# RssFile on x86-64 (digits int8, MobileNet int8 and float32 backbones alike), and little heap.
TRAIN_FIRST_RUN_BYTES = 896 << 10


def estimate_batch_bytes(shapes: ModelShapes, batch: int, *, fused: bool = False) -> int:
    """Heap bytes to prepare one batch of raw samples for the model (normalise, quantise).

    Unfused (``edgefl.agent.daemon.preprocess``): float32 copies of the batch alive at once (raw as
    float32, minus mean, over std, the quantisation temporaries), about 5 for quantised inputs and
    3 for float inputs, plus the result. Fused (``edgefl.agent.pipeline``): written in place into the
    interpreter's input tensor (already resident), through a one-sample float32 scratch.

    Parameters
    ----------
    shapes : ModelShapes
    batch : int
        Samples in the batch (>= 1).
    fused : bool

    Returns
    -------
    int
        Bytes.
    """
    elems = batch * shapes.sample_elems
    if fused:
        return shapes.sample_elems * 4 + _FIXED_BYTES  # one-sample float32 scratch
    copies = 5 if shapes.quantized_input else 3
    return elems * (4 * copies + shapes.input_itemsize) + _FIXED_BYTES


def estimate_inference_bytes(
    shapes: ModelShapes, batch: int, *, resident_batch: int = 0, first_run: bool = True
) -> int:
    """Bytes one interpreter call on ``batch`` samples may add to RSS.

    The interpreter's arena grows with the batch and keeps its size when the batch shrinks again,
    so only the part beyond the largest batch already run (``resident_batch``) is new memory; the
    outputs (embedding and logits read back and dequantised to float32) are new every call.

    Parameters
    ----------
    shapes : ModelShapes
    batch : int
        Samples per call (>= 1).
    resident_batch : int
        Largest batch the interpreter has already allocated (0 = none known).
    first_run : bool
        Add :data:`FIRST_RUN_BYTES` for code pages faulted in by the first call.

    Returns
    -------
    int
        Bytes.
    """
    grow = max(0, batch - resident_batch)
    factor = _DELEGATED_ARENA_FACTOR if shapes.delegated else _ARENA_FACTOR
    arena = int(factor * shapes.activation_bytes * grow) + grow * shapes.sample_elems * (
        shapes.input_itemsize
    )
    outputs = batch * (shapes.embedding_dim + shapes.classes) * (4 + 4 + 1)
    return arena + outputs + _FIXED_BYTES + (FIRST_RUN_BYTES if first_run else 0)


def estimate_train_bytes(
    chunk: int,
    dim: int,
    classes: int,
    batch_size: int,
    num_examples: int,
    *,
    first_run: bool = True,
    resident_rows: int = 0,
) -> int:
    """Bytes ``edgefl.agent.trainer.train_local`` may add to RSS with a given chunk size.

    Terms, each checked against what a run adds (``tests/test_memory_estimates.py``, real LiteRT
    backbones, 25 %): the one float32 chunk buffer the trainer reuses, the float16 gather it is read
    from, the labels (int64 buffer, int16 gather) and the chunk's slot order and shuffle (int64
    each); four ``[D, K]`` float32 arrays alive at the peak (working copy, gradient, delta, final
    head; the batch's own arrays are ``[batch, K]`` and come out of freed heap); the per-epoch
    permutation of ``num_examples`` (``Shuffler``: uint64 keys, a temporary, the int64 order); the
    store's mapped pages of the samples this process has not touched yet (they become resident as
    they are read: file-backed, counted as RSS, reclaimable); and on the first run the code pages
    training maps in (:data:`TRAIN_FIRST_RUN_BYTES`, measured).

    Parameters
    ----------
    chunk : int
        Samples per chunk read from the store.
    dim, classes : int
        D and K.
    batch_size : int
        Samples per SGD step.
    num_examples : int
        Samples in the store.
    first_run : bool
        Add :data:`TRAIN_FIRST_RUN_BYTES` for code pages faulted in by the first call.
    resident_rows : int
        Stored samples whose pages this process already has mapped
        (``EmbeddingStore.resident_rows``: the samples it stored or read); 0 counts every one.

    Returns
    -------
    int
        Bytes.
    """
    head_bytes = 4 * (dim * classes + classes) * 4
    first = TRAIN_FIRST_RUN_BYTES if first_run else 0
    return _store_read_bytes(chunk, dim, num_examples, resident_rows) + head_bytes + first


def _store_read_bytes(chunk: int, dim: int, num_examples: int, resident_rows: int) -> int:
    """Bytes a training pass over the store adds for reading it: chunk buffers, shuffle, mapped pages.

    The float32 chunk buffer and the float16 gather it is read from, the labels (int64 buffer,
    int16 gather), the chunk's slot order and shuffle (int64 each); the per-epoch permutation of
    ``num_examples`` (uint64 keys, a temporary, the int64 order); and the mapped pages (float16
    rows plus int16 label) of the samples this process has not touched yet.

    Parameters
    ----------
    chunk : int
        Samples per chunk read from the store (capped at ``num_examples``, at least 1).
    dim : int
        Embedding width D.
    num_examples : int
        Samples in the store.
    resident_rows : int
        Stored samples whose pages this process already has mapped; 0 counts every one.

    Returns
    -------
    int
        Bytes.
    """
    chunk = min(chunk, max(1, num_examples))
    chunk_bytes = chunk * (dim * (4 + 2) + 8 + 2 + 8 + 8)
    order_bytes = num_examples * 8 * 3
    mapped = max(0, num_examples - max(0, resident_rows)) * (2 * dim + 2)
    return chunk_bytes + order_bytes + mapped


def personal_head_bytes(dim: int, classes: int) -> int:
    """Bytes of one float32 head ``W [D, K]`` plus ``b [K]``: the personal head a device keeps resident."""
    return (dim * classes + classes) * 4


def estimate_personal_bytes(
    chunk: int,
    dim: int,
    classes: int,
    batch_size: int,
    num_examples: int,
    *,
    first_run: bool = True,
    resident_rows: int = 0,
) -> int:
    """Bytes ``edgefl.agent.trainer.train_personal`` may add to RSS with a given chunk size.

    The personal head itself (created from the global head on the first step; trained in place
    after) and its gradient: two ``[D, K]`` heads, against :func:`estimate_train_bytes`' six; then
    the same chunk, batch, shuffle and mapped-page terms as local training, which the personal
    step reads the same way (the mapped pages only of samples this process has not touched:
    ``resident_rows``, as :func:`estimate_train_bytes`; local training has just read them all).

    Parameters
    ----------
    chunk : int
        Samples per chunk read from the store.
    dim, classes : int
        D and K.
    batch_size : int
        Samples per SGD step.
    num_examples : int
        Samples in the store.
    first_run : bool
        Add :data:`FIRST_RUN_BYTES` for code pages faulted in by the first call.
    resident_rows : int
        Stored samples whose pages this process already has mapped; 0 counts every one.

    Returns
    -------
    int
        Bytes.
    """
    step_bytes = min(batch_size, chunk, max(1, num_examples)) * (dim * 4 + classes * 4 * 4)
    head_bytes = 2 * personal_head_bytes(dim, classes)
    first = FIRST_RUN_BYTES if first_run else 0
    read_bytes = _store_read_bytes(chunk, dim, num_examples, resident_rows)
    return read_bytes + step_bytes + head_bytes + _FIXED_BYTES + first


def wire_bytes(dim: int, classes: int, compression: str, topk_fraction: float = 0.1) -> int:
    """Bytes of an encoded Update's deltas on the wire: the two layouts' CBOR sizes.

    Exact for ``none``/``float16``/``int8``, an upper bound for the top-k layouts
    (:func:`edgefl.wire.compression.delta_wire_bytes`).
    """
    return delta_wire_bytes((dim, classes), compression, topk_fraction) + delta_wire_bytes(
        (classes,), compression, topk_fraction
    )


def estimate_encode_bytes(dim: int, classes: int, compression: str, topk_fraction: float = 0.1) -> int:
    """Bytes ``edgefl.wire.rounds.encode_update`` may add to RSS.

    The dense delta's float32 temporaries (finite check, clip or scale, absolute values), the int64
    partition of top-k and the code pages its first call touches (partition, packbits: ~1 MiB of
    RSS in a fresh process for 67 KiB of tracemalloc peak at D=512, K=10), the payload three times
    (typed-array bytes, the CBOR buffer and the returned ``bytes``), and for the int8 and top-k
    layouts zlib's deflate state (256 KiB: int8 levels and top-k masks are deflated) and for int8
    the levels once more.

    Parameters
    ----------
    dim, classes : int
        D and K.
    compression : str
        An ``edgefl.wire.compression.Compression`` value.
    topk_fraction : float

    Returns
    -------
    int
        Bytes.
    """
    n = dim * classes + classes
    sparse = compression.startswith("topk")
    temps = n * 4 * 2 + (n * 8 * 2 + _TOPK_CODE_BYTES if sparse else 0)
    if "int8" in compression or sparse:
        temps += _DEFLATE_STATE_BYTES + (n if "int8" in compression else 0)
    return temps + 3 * wire_bytes(dim, classes, compression, topk_fraction) + _FIXED_BYTES


def estimate_apply_bytes(dim: int, classes: int) -> int:
    """Bytes decoding and applying a GlobalModel may add to RSS.

    The payload, the decoded CBOR byte strings, the float32 arrays and their finite check, the new
    head and the ``.npz`` written to the state directory.
    """
    return 6 * (dim * classes + classes) * 4 + _FIXED_BYTES


_NPY_READ_CHUNK_BYTES = 1 << 18  # numpy.lib.format.read_array's buffer when reading from a zip member


def npz_headers(path: Path | str) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    """Shape and dtype of every array of an ``.npz`` file, read from the headers only (no data).

    Parameters
    ----------
    path : Path or str
        An ``.npz`` written by ``numpy.savez`` / ``savez_compressed``.

    Returns
    -------
    dict
        Array name (``"x"``, ``"y"``...) → (shape, dtype).

    Raises
    ------
    ValueError
        Not a zip of ``.npy`` members, or a header numpy cannot read (named in the message).
    OSError
        The file cannot be read.

    Source: the NPY format (``numpy.lib.format``: magic string, version, header dict).
    """
    out: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}
    fmt = np.lib.format
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with zf.open(info) as fh:
                    version = fmt.read_magic(fh)
                    if version == (1, 0):
                        shape, _, dtype = fmt.read_array_header_1_0(fh)
                    elif version == (2, 0):
                        shape, _, dtype = fmt.read_array_header_2_0(fh)
                    else:
                        raise ValueError(f"{info.filename}: NPY version {version} not read")
                out[info.filename[: -len(".npy")]] = (tuple(int(d) for d in shape), np.dtype(dtype))
    except zipfile.BadZipFile as exc:
        raise ValueError(f"{path}: not an .npz file ({exc})") from exc
    return out


def estimate_replay_bytes(path: Path | str) -> int:
    """Bytes loading a replay file (``source.path``: ``x`` samples, ``y`` labels) adds to RSS.

    Every array of the file as loaded (``numpy.load`` reads a member into a new array through a
    256 KiB buffer), plus the labels' int64 copy the daemon makes; computed from the headers
    (:func:`npz_headers`), before anything is loaded.

    Raises
    ------
    ValueError, OSError
        As :func:`npz_headers`.
    """
    arrays = npz_headers(path)
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in arrays.values())
    if "y" in arrays:
        total += math.prod(arrays["y"][0]) * 8
    return total + _NPY_READ_CHUNK_BYTES + _FIXED_BYTES


# --- the governor -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Admission:
    """The governor's answer to one phase's request.

    Attributes
    ----------
    phase : str
        One of :data:`PHASES` (others allowed).
    work : int
        Granted work size (samples per batch or per chunk); the requested size, or halved down
        to ``floor``.
    requested_work : int
        The size asked for.
    estimate_bytes : int
        Estimated bytes at ``work``.
    budget_bytes : int
        ``cap - reserve - rss`` at the time of the request (``cap - rss`` for a phase that cannot
        wait, which may use the reserve); may be negative.
    rss_bytes : int
        RSS at the time of the request.
    deferred : bool
        True: do not run the phase now (over budget even at its floor, or a :data:`SYSTEM_GUARDED`
        phase while the system is short of memory).
    reason : str
        Empty when admitted as asked; otherwise why the work was shrunk or deferred.
    at_s : float
        ``time.time()`` of the decision.
    """

    phase: str
    work: int
    requested_work: int
    estimate_bytes: int
    budget_bytes: int
    rss_bytes: int
    deferred: bool
    reason: str
    at_s: float

    @property
    def shrunk(self) -> bool:
        """Whether less work than asked was granted."""
        return self.work < self.requested_work

    def as_dict(self) -> dict[str, Any]:
        """JSON-like form (status message, dashboard): every field by name.

        Built field by field: ``dataclasses.asdict`` deep-copies through its generic recursion, ~40 us
        an admission, and a device's status check reads every phase's (a round's CPU).
        """
        return {f: getattr(self, f) for f in _ADMISSION_FIELDS}


_ADMISSION_FIELDS: Final = tuple(f.name for f in fields(Admission))

PeakMethod = Literal["auto", "clear_refs", "sampling"]


class Governor:
    """Knows the cap, measures each phase's peak RSS, and admits phases under ``cap - reserve``.

    Parameters
    ----------
    cap_bytes : int
        The profile's cap (``memory.cap_mb`` in bytes), > 0.
    reserve_bytes : int
        Headroom kept free under the cap for what the estimates do not cover, >= 0.
    min_system_available_bytes : int
        Defer :data:`SYSTEM_GUARDED` phases while ``MemAvailable`` is below this; 0 disables.
    proc : Path
        The proc file system (fake trees in tests).
    cgroup_root : Path
        Where the cgroup file systems are mounted.
    peak_method : "auto" | "clear_refs" | "sampling"
        How phase peaks are measured: "auto" resets ``VmHWM`` through ``clear_refs`` and falls back
        to sampling RSS from a thread where the kernel refuses the write.
    sample_interval_s : float
        Period of the sampling fallback.

    Raises
    ------
    ValueError
        If ``cap_bytes`` is not positive or the other sizes are negative.

    Attributes
    ----------
    cap_bytes : int
        ``min(profile cap, cgroup limit)``.
    profile_cap_bytes, cgroup_limit_bytes : int, int or None
    phase_peaks : dict[str, int]
        Largest peak RSS seen in each phase, bytes (absolute RSS, not a delta).
    phase_last : dict[str, int]
        Peak RSS of the latest run of each phase, bytes.
    phase_rise : dict[str, int]
        Largest rise of a phase's peak RSS above the RSS at its start, bytes: the phase's own
        high-water mark, which tells phases apart when they all run on the same resident base.

    Notes
    -----
    Resetting ``VmHWM`` means the process's ``VmHWM`` alone no longer tells its lifetime peak:
    :attr:`peak_rss_bytes` folds in every reading taken before each reset. Phases may overlap
    (several threads): a phase only resets the counter when no other phase is running; an
    overlapping phase then reports the peak since the earliest running phase began (an upper bound).
    """

    def __init__(
        self,
        cap_bytes: int,
        reserve_bytes: int,
        min_system_available_bytes: int,
        *,
        proc: Path = PROC,
        cgroup_root: Path = CGROUP_ROOT,
        peak_method: PeakMethod = "auto",
        sample_interval_s: float = 0.002,
    ) -> None:
        if cap_bytes <= 0 or reserve_bytes < 0 or min_system_available_bytes < 0:
            raise ValueError(
                f"Governor: cap_bytes={cap_bytes} must be > 0, reserve_bytes={reserve_bytes} and "
                f"min_system_available_bytes={min_system_available_bytes} >= 0"
            )
        self.proc = proc
        self.profile_cap_bytes = cap_bytes
        self.cgroup_limit_bytes = cgroup_memory_limit_bytes(proc=proc, cgroup_root=cgroup_root)
        self.cap_bytes = min(cap_bytes, self.cgroup_limit_bytes or cap_bytes)
        self.reserve_bytes = reserve_bytes
        self.min_system_available_bytes = min_system_available_bytes
        self.sample_interval_s = sample_interval_s
        self.phase_peaks: dict[str, int] = {}
        self.phase_last: dict[str, int] = {}
        self.phase_rise: dict[str, int] = {}
        self.phase_counts: dict[str, int] = {}
        self.max_work: dict[str, int] = {}
        self.admissions: dict[str, Admission] = {}
        self.deferrals: dict[str, int] = {}
        self.last_deferral: Admission | None = None
        self._lock = threading.Lock()
        self._active = 0
        self._peak = 0
        if peak_method == "sampling":
            self.peak_method: PeakMethod = "sampling"
        elif reset_peak(proc=proc):
            self.peak_method = "clear_refs"
        elif peak_method == "clear_refs":
            raise ValueError(f"Governor: {proc}/self/clear_refs is not writable")
        else:
            logger.info("cannot reset VmHWM through clear_refs; phase peaks are sampled")
            self.peak_method = "sampling"
        self._peak = self._read_peak()
        if self.cgroup_limit_bytes is not None and self.cgroup_limit_bytes < cap_bytes:
            logger.info(
                "memory cap %.1f MiB (cgroup limit; profile says %.1f MiB)",
                self.cap_bytes / MIB,
                cap_bytes / MIB,
            )

    # --- measurement -----------------------------------------------------------------------
    def rss_bytes(self) -> int:
        """Current RSS in bytes (``statm``)."""
        return rss_bytes(proc=self.proc)

    def _read_peak(self) -> int:
        try:
            return peak_rss_bytes(proc=self.proc)
        except OSError:
            return self.rss_bytes()

    @property
    def peak_rss_bytes(self) -> int:
        """Lifetime peak RSS of the process in bytes, across every peak reset."""
        value = self._read_peak()
        with self._lock:
            self._peak = max(self._peak, value)
            return self._peak

    def system_available_bytes(self) -> int | None:
        """``MemAvailable`` in bytes, or None where the kernel does not report it."""
        try:
            return system_available_bytes(proc=self.proc)
        except OSError:
            return None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the peak RSS of the enclosed block as phase ``name``.

        On exit, ``phase_last[name]`` is the block's peak RSS and ``phase_peaks[name]`` the largest
        ever seen; :attr:`peak_rss_bytes` includes it. ``phase_rise[name]`` is the largest
        ``peak - rss at entry`` seen (the phase's own growth; 0 when it grew nothing).

        Parameters
        ----------
        name : str
            A phase name (see :data:`PHASES`).
        """
        sampler: _Sampler | None = None
        start = self.rss_bytes()
        with self._lock:
            self._active += 1
            if self.peak_method == "clear_refs" and self._active == 1:
                self._peak = max(self._peak, self._read_peak())
                if not reset_peak(proc=self.proc):
                    self.peak_method = "sampling"
        if self.peak_method == "sampling":
            sampler = _Sampler(self.proc, self.sample_interval_s)
            sampler.start()
        try:
            yield
        finally:
            peak = sampler.stop() if sampler is not None else self._read_peak()
            with self._lock:
                self._active -= 1
                self._peak = max(self._peak, peak)
                self.phase_last[name] = peak
                self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), peak)
                self.phase_rise[name] = max(self.phase_rise.get(name, 0), peak - start)
                self.phase_counts[name] = self.phase_counts.get(name, 0) + 1

    # --- admission ---------------------------------------------------------------------------
    def admit(
        self,
        phase: str,
        estimate: Callable[[int], int],
        work: int,
        floor: int,
        *,
        deferrable: bool | None = None,
    ) -> Admission:
        """Decide how much of a phase may run now.

        While ``rss + estimate(work) > cap - reserve`` and ``work > floor``, halve ``work`` (never
        below ``floor``); a phase that cannot wait (not :data:`DEFERRABLE`: inference) may use the
        reserve, so its test is ``rss + estimate(work) > cap``. If it still does not fit, the phase
        is not to run: ``deferred`` is True (a deferrable phase waits for a later round; another,
        e.g. inference, is refused for now and its caller retries once memory frees), and the reason
        says which. A
        :data:`SYSTEM_GUARDED` phase is also deferred while the system's ``MemAvailable`` is under
        ``min_system_available_bytes``.

        Parameters
        ----------
        phase : str
            Phase name.
        estimate : callable(int) -> int
            Bytes the phase needs for a given work size (one of the ``estimate_*`` functions).
        work : int
            Work size asked for (samples), >= 1.
        floor : int
            Smallest work size worth running, 1 <= floor (clamped to ``work``).
        deferrable : bool, optional
            Override of ``phase in DEFERRABLE`` (only changes the reason's wording).

        Returns
        -------
        Admission
            Also kept in ``admissions[phase]``; a deferral increments ``deferrals[phase]``.
        """
        work = max(1, int(work))
        floor = max(1, min(int(floor), work))
        can_defer = phase in DEFERRABLE if deferrable is None else deferrable
        rss = self.rss_bytes()
        # the reserve is kept for the phases that cannot wait (inference): they may use it, never the cap
        budget = self.cap_bytes - (self.reserve_bytes if can_defer else 0) - rss
        granted = work
        need = int(estimate(granted))
        while need > budget and granted > floor:
            granted = max(floor, granted // 2)
            need = int(estimate(granted))
        deferred = False
        reason = ""
        if need > budget:
            # work judged over budget is never run: a deferrable phase waits for a later round, any
            # other is refused for now (the caller frees what it can, retries, or counts the refusal)
            deferred = True
            if can_defer:
                reason = (
                    f"{phase}: needs {need / MIB:.1f} MiB at {granted}, "
                    f"{max(0, budget) / MIB:.1f} MiB left under cap - reserve"
                )
            else:
                reason = (
                    f"{phase}: over budget at floor {granted} ({need / MIB:.1f} MiB > "
                    f"{budget / MIB:.1f} MiB left under the cap); not run"
                )
        elif granted < work:
            reason = f"{phase}: shrunk {work} -> {granted} to fit {budget / MIB:.1f} MiB"
        if not deferred and phase in SYSTEM_GUARDED and self.min_system_available_bytes > 0:
            available = self.system_available_bytes()
            if available is not None and available < self.min_system_available_bytes:
                deferred = True
                reason = (
                    f"{phase}: system MemAvailable {available / MIB:.0f} MiB < "
                    f"{self.min_system_available_bytes / MIB:.0f} MiB"
                )
        decision = Admission(phase, granted, work, need, budget, rss, deferred, reason, time.time())
        with self._lock:
            self.admissions[phase] = decision
            if deferred:
                self.deferrals[phase] = self.deferrals.get(phase, 0) + 1
                self.last_deferral = decision
            else:
                self.max_work[phase] = max(self.max_work.get(phase, 0), granted)
        if reason:
            logger.info("memory governor: %s", reason)
        return decision

    def admit_batch(self, shapes: ModelShapes, batch: int, *, fused: bool = False) -> Admission:
        """Admit batch preparation of ``batch`` samples (floor 1; refused when even 1 is over budget)."""
        return self.admit("batch", lambda n: estimate_batch_bytes(shapes, n, fused=fused), batch, 1)

    def admit_inference(
        self,
        shapes: ModelShapes,
        batch: int,
        *,
        resident_batch: int | None = None,
        prep: Literal["fused", "unfused"] | None = None,
    ) -> Admission:
        """Admit an interpreter call on ``batch`` samples (floor 1; refused when even 1 is over budget).

        Parameters
        ----------
        shapes : ModelShapes
        batch : int
            Samples asked for.
        resident_batch : int, optional
            Batch the interpreter's arena is already allocated for (``Pipeline.tensor_batch``);
            default: the largest batch admitted so far.
        prep : "fused" | "unfused", optional
            Count the batch preparation too (when one call does both, as ``Pipeline.run``).

        Returns
        -------
        Admission
        """
        resident = self.max_work.get("inference", 0) if resident_batch is None else resident_batch
        first = self.phase_counts.get("inference", 0) == 0

        def need(n: int) -> int:
            total = estimate_inference_bytes(shapes, n, resident_batch=resident, first_run=first)
            if prep is not None:
                total += estimate_batch_bytes(shapes, n, fused=prep == "fused") - _FIXED_BYTES
            return total

        return self.admit("inference", need, batch, 1)

    def admit_train(
        self,
        chunk: int,
        floor: int,
        *,
        dim: int,
        classes: int,
        batch_size: int,
        num_examples: int,
        resident_rows: int = 0,
    ) -> Admission:
        """Admit local training with ``chunk`` samples per store chunk (halved down to ``floor``).

        ``resident_rows``: stored samples already mapped in (``EmbeddingStore.resident_rows``).
        """
        first = self.phase_counts.get("train", 0) == 0

        def need(n: int) -> int:
            return estimate_train_bytes(
                n, dim, classes, batch_size, num_examples, first_run=first, resident_rows=resident_rows
            )

        return self.admit("train", need, chunk, floor)

    def admit_personal(
        self,
        chunk: int,
        floor: int,
        *,
        dim: int,
        classes: int,
        batch_size: int,
        num_examples: int,
        resident_rows: int = 0,
    ) -> Admission:
        """Admit a personal-head step with ``chunk`` samples per store chunk (halved down to ``floor``).

        Counted as :func:`estimate_personal_bytes`: one extra head plus its gradient beside the
        chunk buffers; deferred (the step waits for the next round) when even ``floor`` is over budget.
        ``resident_rows``: stored samples already mapped in (``EmbeddingStore.resident_rows``).
        """
        first = self.phase_counts.get("personal", 0) == 0

        def need(n: int) -> int:
            return estimate_personal_bytes(
                n, dim, classes, batch_size, num_examples, first_run=first, resident_rows=resident_rows
            )

        return self.admit("personal", need, chunk, floor)

    # --- report ------------------------------------------------------------------------------
    def status(self, measure: bool = True) -> dict[str, Any]:
        """JSON-like memory figures for the status message and the dashboard.

        Parameters
        ----------
        measure : bool
            False leaves out the figures read from ``/proc`` (``rss_bytes``, ``pss_bytes``,
            ``peak_rss_bytes``, ``system_available_bytes``): reading ``smaps_rollup`` takes
            milliseconds on a loaded gateway, and the daemon's check for news, run at every state
            change of a round on the event loop, needs none of them (round latency).

        Returns
        -------
        dict
            ``cap_bytes``, ``profile_cap_bytes``, ``cgroup_limit_bytes``, ``reserve_bytes``,
            ``rss_bytes``, ``pss_bytes`` (None where unreadable), ``peak_rss_bytes`` (lifetime),
            ``system_available_bytes``, ``min_system_available_bytes``, ``peak_method``,
            ``phase_peaks`` {phase: bytes}, ``phase_last`` {phase: bytes}, ``phase_rise`` {phase:
            bytes} (each phase's own rise above its starting RSS), ``admissions``
            {phase: Admission as dict}, ``deferrals`` {phase: count}, ``last_deferral`` (dict or None).
        """
        peak = self.peak_rss_bytes if measure else 0
        with self._lock:
            measured = (
                {
                    "rss_bytes": self.rss_bytes(),
                    "pss_bytes": pss_bytes(proc=self.proc),
                    "peak_rss_bytes": peak,
                    "system_available_bytes": self.system_available_bytes(),
                }
                if measure
                else {}
            )
            return {
                "cap_bytes": self.cap_bytes,
                "profile_cap_bytes": self.profile_cap_bytes,
                "cgroup_limit_bytes": self.cgroup_limit_bytes,
                "reserve_bytes": self.reserve_bytes,
                **measured,
                "min_system_available_bytes": self.min_system_available_bytes,
                "peak_method": self.peak_method,
                "phase_peaks": dict(self.phase_peaks),
                "phase_last": dict(self.phase_last),
                "phase_rise": dict(self.phase_rise),
                "admissions": {k: v.as_dict() for k, v in self.admissions.items()},
                "deferrals": dict(self.deferrals),
                "last_deferral": self.last_deferral.as_dict() if self.last_deferral else None,
            }


class _Sampler:
    """Fallback peak measurement: a thread reading RSS every ``interval_s`` (misses short spikes)."""

    def __init__(self, proc: Path, interval_s: float) -> None:
        self.proc = proc
        self.interval_s = interval_s
        self.peak = rss_bytes(proc=proc)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edgefl-rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes(proc=self.proc))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_bytes(proc=self.proc))


# --- hygiene ------------------------------------------------------------------------------------
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@functools.cache
def _libc() -> Any | None:
    # cached: find_library runs ``ldconfig -p`` in a child process, and malloc_trim runs after
    # every round (a fork and exec on the round's path: seen with strace)
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


def malloc_trim() -> bool:
    """Return free heap memory at the top and in the middle of glibc's arenas to the kernel.

    Returns
    -------
    bool
        glibc's answer (True: some memory was released); False also where the C library is not
        glibc (musl has no ``malloc_trim``).

    Source: malloc_trim(3).
    """
    lib = _libc()
    return bool(lib.malloc_trim(0)) if lib is not None else False


def apply_hygiene(*, arena_max: int = 2, mmap_threshold_bytes: int | None = None) -> dict[str, bool]:
    """Set glibc malloc options that keep a small process small.

    ``MALLOC_ARENA_MAX`` only takes effect through the environment at start-up (``edgefl/cli.py``
    sets it, with one BLAS thread, before numpy loads); ``mallopt(M_ARENA_MAX)`` does the same for
    arenas not created yet. A fixed ``M_MMAP_THRESHOLD`` stops glibc from raising the threshold
    after each large free, so large numpy temporaries stay ``mmap``-ed and go back to the kernel
    when freed instead of staying in the heap.

    Parameters
    ----------
    arena_max : int
        Maximum number of malloc arenas (threads share them beyond this).
    mmap_threshold_bytes : int, optional
        Fixed mmap threshold (e.g. 131072); None leaves glibc's dynamic threshold.

    Returns
    -------
    dict[str, bool]
        Which settings were applied (``arena_max``, ``mmap_threshold``); all False without glibc.

    Source: mallopt(3) (M_ARENA_MAX, M_MMAP_THRESHOLD).
    """
    lib = _libc()
    if lib is None:
        return {"arena_max": False, "mmap_threshold": False}
    done = {"arena_max": bool(lib.mallopt(_M_ARENA_MAX, int(arena_max)))}
    done["mmap_threshold"] = (
        bool(lib.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes)))
        if mmap_threshold_bytes is not None
        else False
    )
    return done
