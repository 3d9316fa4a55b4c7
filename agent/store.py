"""Bounded store of recent labelled embeddings, kept in memory-mapped files rather than the heap.

Embeddings are stored as float16 (half the bytes of float32; the head is trained in float32 chunks
read back from the map), labels as int16. The store is a ring: when full, the oldest sample is
overwritten, so its size is fixed at ``capacity * (2 * D + 2)`` bytes of file-backed pages that the
kernel can drop under pressure.

Integrity: the metadata (capacity, D, count, ring head and the SHA-256 of the
label file) is a checksummed record (:mod:`edgefl.records`) written by :meth:`EmbeddingStore.flush`.
At open the metadata must be sane (``count <= capacity``, head in range, files of the right size),
the label file must match its checksum, its labels must lie in ``0..K-1`` and the stored embeddings
must be finite; otherwise the files are set aside (renamed ``<name>.corrupt``) and the store starts
empty, with one log line. Non-finite embeddings (or ones that overflow float16) are refused by
:meth:`EmbeddingStore.add`, counted in ``refused_not_finite``. A store not flushed since its last
change (a kill -9 or power cut mid-replay) fails the checksum and is rebuilt the same way: it is a
cache of recent samples, and a wrong label costs more than a lost one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from edgefl.head import check_labels, label_range
from edgefl.records import prev_path, read_record, set_aside, write_record
from edgefl.types import F32, I64

logger = logging.getLogger(__name__)

EMB_FILE = "store_emb.f16"
LBL_FILE = "store_lbl.i16"
META_FILE = "store_meta.rec"
"""Checksummed record of the store's metadata (JSON map, see :meth:`EmbeddingStore.flush`)."""
LEGACY_META_FILE = "store_meta.json"
"""Metadata of stores written before the checksums: read once (sanity-checked), then replaced."""
CORRUPT_SUFFIX = ".corrupt"
_SCAN_ROWS = 256  # embeddings checked for finiteness per block at open (bounded heap)
_HALF_MASK = np.int32(0x8FFFE000 - (1 << 32))  # float32 sign bit + a half's 15 bits, shifted by 13
_HALF_SCALE = np.float32(2.0**112)  # 2**(127 - 15): float16's exponent bias -> float32's


def half_bits_to_float32(half_bits: np.ndarray, out: F32) -> F32:
    """Convert finite float16 values, given as their int16 bit patterns, to float32 in ``out``.

    numpy's own float16 -> float32 cast goes element by element through a scalar routine on
    builds without an F16C/FP16 SIMD path (``X86_V2`` baseline wheels: ~3 ns a value, the largest
    cost of a round's local training). This is four vectorised integer/float passes,
    exactly equal to ``astype(np.float32)`` for every finite half, zeros and subnormals included:
    the sign-extended 16 bits shifted left by 13 put the sign at bit 31 (after masking) and the
    exponent and mantissa in float32's fields with float16's bias; multiplying by 2**112 rebiases
    the exponent (exact: a power of two, and a subnormal half becomes a normal float32).
    Infinities and NaNs are NOT converted correctly: the store never holds them (refused by
    :meth:`EmbeddingStore.add`, checked at open).

    Parameters
    ----------
    half_bits : int16 [...]
        float16 values viewed as int16.
    out : float32, same shape, C-contiguous
        Written in place and returned.

    Returns
    -------
    float32 [...]
        ``out``.

    Source: IEEE 754-2008 binary16/binary32 layouts; the rebias-by-multiplication conversion is
    F. Giesen, "Half to float done quic", 2012 (``half_to_float_fast``).
    """
    bits = out.view(np.int32)
    np.copyto(bits, half_bits, casting="unsafe")  # sign-extends: bits 15..31 = the sign
    np.left_shift(bits, 13, out=bits)
    np.bitwise_and(bits, _HALF_MASK, out=bits)
    np.multiply(out, _HALF_SCALE, out=out)
    return out


def _allocate(path: Path, size: int) -> None:
    """Give a sparse file its blocks now (``posix_fallocate``).

    A write into a hole of a memory-mapped file on a full file system is a ``SIGBUS``, which kills the
    process; allocated up front, the store's pages never need a new block, so a full disk later
    only stops the small record writes (which fail with ``ENOSPC`` and are handled).

    Raises
    ------
    OSError
        ``ENOSPC`` if the file system has no room for the store (at start-up).
    """
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # file systems without it: as before
            raise
    finally:
        os.close(fd)


class StoreCorrupt(ValueError):
    """The store's files disagree with their metadata or checksum (internal: the store is set aside)."""


class EmbeddingStore:
    """Ring buffer of ``(embedding float16 [D], label int16)`` in memory-mapped files.

    Parameters
    ----------
    directory : Path
        Where the files ``store_emb.f16``, ``store_lbl.i16`` and ``store_meta.rec`` live; created if missing.
    capacity : int
        Maximum number of samples kept (older ones are overwritten).
    dim : int
        Embedding size D.
    num_classes : int or None
        K of the head the store trains: labels outside ``0..K-1`` (``0..1`` when K = 1, a logistic
        head) are refused by :meth:`add` and counted in ``refused_labels``. None = not checked.

    Raises
    ------
    ValueError
        If ``capacity``, ``dim`` or ``num_classes`` is not positive.
    OSError
        If the files cannot be created or allocated (``ENOSPC``: no room for the store).

    Notes
    -----
    A store whose metadata does not match ``capacity``/``dim`` (another model) is reset, with a log
    line; a corrupt one is set aside (module docstring). ``set_aside`` tells which happened at open.
    """

    def __init__(self, directory: Path, capacity: int, dim: int, num_classes: int | None = None) -> None:
        if capacity <= 0 or dim <= 0 or (num_classes is not None and num_classes <= 0):
            raise ValueError(
                f"EmbeddingStore: capacity {capacity}, dim {dim} and num_classes {num_classes} must be > 0"
            )
        self.num_classes = num_classes
        self.refused_labels = 0
        self.refused_not_finite = 0
        self.set_aside = ""
        """Why the files found at open were set aside ("" if they were not)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.capacity = capacity
        self.dim = dim
        self._meta_path = directory / META_FILE
        emb_path, lbl_path = directory / EMB_FILE, directory / LBL_FILE
        count, head = 0, 0
        mode = "w+"
        try:
            meta = self._read_meta()
            if meta is not None:
                count, head = self._check(meta, emb_path, lbl_path)
                mode = "r+"
        except StoreCorrupt as exc:
            self._set_aside(str(exc))
            count, head = 0, 0
        self._emb = np.memmap(emb_path, dtype=np.float16, mode=mode, shape=(capacity, dim))  # type: ignore[call-overload]
        self._lbl = np.memmap(lbl_path, dtype=np.int16, mode=mode, shape=(capacity,))  # type: ignore[call-overload]
        for path, size in ((emb_path, capacity * dim * 2), (lbl_path, capacity * 2)):
            _allocate(path, size)
        # plain ndarray views of the maps: indexing a memmap wraps every result in a memmap object
        self._emb_bits: np.ndarray = np.asarray(self._emb).view(np.int16)
        self._lbl_raw: np.ndarray = np.asarray(self._lbl)
        self._count = count
        self._head = head

    def _read_meta(self) -> dict[str, object] | None:
        """The metadata map (record, else the legacy JSON file); None = start empty (no files, other shape).

        Raises
        ------
        StoreCorrupt
            If the metadata is unreadable.
        """
        legacy = self.directory / LEGACY_META_FILE
        data = read_record(self._meta_path)
        if data is None and legacy.exists():
            data = legacy.read_bytes()
            logger.info(
                "store in %s has metadata without a checksum (older version); checking it", self.directory
            )
        elif data is None:
            return None
        try:
            meta = json.loads(data)
            if not isinstance(meta, dict):
                raise TypeError("not a map")
        except (ValueError, TypeError) as exc:
            raise StoreCorrupt(f"metadata unreadable: {exc}") from exc
        if meta.get("capacity") != self.capacity or meta.get("dim") != self.dim:
            logger.info("store in %s was built for another model shape; starting empty", self.directory)
            return None
        return meta

    def _check(self, meta: dict[str, object], emb_path: Path, lbl_path: Path) -> tuple[int, int]:
        """Validate metadata against the files; return ``(count, head)``.

        Raises
        ------
        StoreCorrupt
            Naming the first problem found.
        """
        count, head = meta.get("count"), meta.get("head")
        cap = self.capacity
        if type(count) is not int or type(head) is not int:
            raise StoreCorrupt(f"count {count!r} / head {head!r} are not integers")
        if not 0 <= count <= cap:
            raise StoreCorrupt(f"count = {count}: must be in 0..capacity {cap}")
        if not 0 <= head < cap or (count < cap and head != count):
            raise StoreCorrupt(f"head = {head}: out of range for count {count}, capacity {cap}")
        for path, size in ((emb_path, cap * self.dim * 2), (lbl_path, cap * 2)):
            try:
                actual = path.stat().st_size
            except FileNotFoundError:
                raise StoreCorrupt(f"{path.name} missing") from None
            if actual != size:
                raise StoreCorrupt(f"{path.name} has {actual} bytes, expected {size}")
        lbl = np.memmap(lbl_path, dtype=np.int16, mode="r", shape=(cap,))  # type: ignore[call-overload]
        want = meta.get("labels_sha256")
        if want is not None or "v" in meta:  # a legacy JSON file has no checksum to compare
            got = hashlib.sha256(lbl.tobytes()).hexdigest()
            if got != want:
                raise StoreCorrupt(f"{lbl_path.name} does not match its checksum")
        if self.num_classes is not None and count:
            ok = check_labels(np.asarray(lbl[:count]), self.num_classes)
            if not ok.all():
                bad = int(np.asarray(lbl[:count])[~ok][0])
                raise StoreCorrupt(f"label {bad} outside 0..{label_range(self.num_classes) - 1}")
        del lbl
        emb = np.memmap(emb_path, dtype=np.float16, mode="r", shape=(cap, self.dim))  # type: ignore[call-overload]
        for s in range(0, count, _SCAN_ROWS):
            if not np.isfinite(emb[s : min(count, s + _SCAN_ROWS)]).all():
                raise StoreCorrupt(f"{emb_path.name} holds non-finite values")
        del emb
        return count, head

    def _set_aside(self, reason: str) -> None:
        """Rename the store's files to ``<name>.corrupt`` (replacing older ones) and log one line."""
        for name in (EMB_FILE, LBL_FILE, META_FILE, prev_path(Path(META_FILE)).name, LEGACY_META_FILE):
            set_aside(self.directory / name, CORRUPT_SUFFIX)
        self.set_aside = reason
        logger.error(
            "store in %s is corrupt (%s): set aside as *%s, starting empty",
            self.directory,
            reason,
            CORRUPT_SUFFIX,
        )

    def __len__(self) -> int:
        """Number of samples currently held (<= capacity)."""
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes of the backing files (embeddings + labels)."""
        return self.capacity * (2 * self.dim + 2)

    def add(self, emb: F32, labels: I64) -> int:
        """Append a batch of labelled embeddings, overwriting the oldest when full.

        Samples whose label the head cannot learn (outside ``0..K-1``, or not 0/1 for K = 1) are
        refused: logged with reason ``bad_label``, counted in ``refused_labels``, not stored. Samples
        whose embedding is not finite in float16 (NaN, inf, or beyond +-65504) are refused the same
        way, counted in ``refused_not_finite`` (a single one would make every round's delta NaN).

        Parameters
        ----------
        emb : float32 [N, D]
        labels : int64 [N], values in int16 range.

        Returns
        -------
        int
            How many samples were refused for their label.

        Raises
        ------
        ValueError
            If the shapes disagree with the store's D or with each other.
        """
        n = emb.shape[0]
        if emb.ndim != 2 or emb.shape[1] != self.dim or labels.shape != (n,):
            raise ValueError(f"store.add: emb {emb.shape}, labels {labels.shape}, store dim {self.dim}")
        refused = 0
        if self.num_classes is not None:
            ok = check_labels(labels, self.num_classes)
            refused = int(n - np.count_nonzero(ok))
            if refused:
                self.refused_labels += refused
                bad = sorted({int(v) for v in labels[~ok]})[:5]
                logger.warning(
                    "store: %d sample(s) refused (bad_label): labels %s outside 0..%d for K = %d",
                    refused,
                    bad,
                    label_range(self.num_classes) - 1,
                    self.num_classes,
                )
                emb, labels = emb[ok], labels[ok]
                n = emb.shape[0]
        with np.errstate(over="ignore"):  # beyond float16's range becomes inf: refused just below
            emb16 = emb.astype(np.float16)
        finite = np.isfinite(emb16).all(axis=1)
        if not finite.all():
            bad_n = int(n - np.count_nonzero(finite))
            self.refused_not_finite += bad_n
            logger.warning("store: %d sample(s) refused (not_finite): embedding not finite in float16", bad_n)
            emb16, labels = emb16[finite], labels[finite]
            n = emb16.shape[0]
        for i in range(n):
            self._emb[self._head] = emb16[i]
            self._lbl[self._head] = labels[i]
            self._head = (self._head + 1) % self.capacity
        self._count = min(self.capacity, self._count + n)
        return refused

    def chunks(self, chunk_size: int, order: I64 | None = None) -> Iterator[tuple[F32, I64]]:
        """Yield the stored samples as float32 chunks (one chunk's worth is in the heap at a time).

        Parameters
        ----------
        chunk_size : int
            Samples per chunk (>= 1).
        order : int64 [M] or None
            Which stored samples, in which order (e.g. a shuffle of ``range(len(self))``, or the
            first M samples); None = every sample in storage order.

        Yields
        ------
        emb : float32 [<=chunk_size, D]
        labels : int64 [<=chunk_size]
        """
        idx = np.arange(self._count, dtype=np.int64) if order is None else order
        for start in range(0, len(idx), chunk_size):
            sel = np.sort(idx[start : start + chunk_size])
            emb = np.empty((len(sel), self.dim), np.float32)
            lbl = np.empty(len(sel), np.int64)
            self.read(sel, emb, lbl)
            yield emb, lbl

    def read(self, rows: I64, emb_out: F32, lbl_out: I64) -> None:
        """Read stored samples ``rows``, in that order, into caller-owned buffers (no other heap).

        The one copy made is the float16 gather of the rows (``2 * len(rows) * D`` bytes, freed on
        return); the conversion to float32 is :func:`half_bits_to_float32`, exactly numpy's cast.

        Parameters
        ----------
        rows : int64 [M]
            Storage slots in ``0..len(self)-1``, any order (repeats allowed).
        emb_out : float32 [M, D], C-contiguous
            Receives the embeddings, row i = slot ``rows[i]``.
        lbl_out : int64 [M]
            Receives the labels.

        Raises
        ------
        ValueError
            If the buffers' shapes do not match ``rows`` and D.
        """
        m = len(rows)
        if emb_out.shape != (m, self.dim) or lbl_out.shape != (m,):
            raise ValueError(
                f"store.read: {m} rows into emb {emb_out.shape} and labels {lbl_out.shape}, D = {self.dim}"
            )
        half_bits_to_float32(self._emb_bits[rows], emb_out)
        np.copyto(lbl_out, self._lbl_raw[rows], casting="unsafe")

    def flush(self) -> None:
        """Write the maps, then the metadata with the label file's SHA-256 (a checksummed record).

        The record's payload is the JSON map ``{"v": 1, "capacity", "dim", "count", "head",
        "labels_sha256"}``; it is written atomically after the maps (``edgefl.records``).

        Raises
        ------
        OSError
            If the file system refuses the write (e.g. ``ENOSPC``); the maps stay usable.
        """
        self._emb.flush()
        self._lbl.flush()
        meta = {
            "v": 1,
            "capacity": self.capacity,
            "dim": self.dim,
            "count": self._count,
            "head": self._head,
            "labels_sha256": hashlib.sha256(self._lbl.tobytes()).hexdigest(),
        }
        write_record(self._meta_path, json.dumps(meta).encode())
        with contextlib.suppress(FileNotFoundError):
            (self.directory / LEGACY_META_FILE).unlink()
