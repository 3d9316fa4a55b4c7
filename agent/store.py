"""Bounded store of recent labelled embeddings, kept in memory-mapped files rather than the heap.

A ring of float16 embeddings, int16 labels and row records (:data:`ROWS_FILE`; sample ``seq`` lives
in slot ``seq % capacity``). At open the newest contiguous run of rows whose CRCs check is recovered;
insane metadata, a label outside ``0..K-1`` or a non-finite embedding sets the files aside
(``<name>.corrupt``); a store found with another capacity keeps its newest samples.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from edgefl.head import check_labels, label_range
from edgefl.records import move_into, prev_path, read_record, set_aside, write_record
from edgefl.types import F32, I64

logger = logging.getLogger(__name__)

EMB_FILE = "store_emb.f16"
LBL_FILE = "store_lbl.i16"
ROWS_FILE = "store_rows.u64"
"""Row records: ``uint64 [capacity, 2]`` little-endian, ``seq + 1`` and a CRC-32 of embedding, label, seq."""
META_FILE = "store_meta.rec"
"""Checksummed record of the store's metadata (JSON map, see :meth:`EmbeddingStore.flush`)."""
CORRUPT_SUFFIX = ".corrupt"
RESIZE_DIR = ".resize"
"""Sub-folder where a store is rebuilt for a new capacity before its files replace the old ones."""
_SCAN_ROWS = 256  # embeddings checked for finiteness per block at open (bounded heap)
_HALF_MASK = np.int32(0x8FFFE000 - (1 << 32))  # float32 sign bit + a half's 15 bits, shifted by 13
_HALF_SCALE = np.float32(2.0**112)  # 2**(127 - 15): float16's exponent bias -> float32's


def half_bits_to_float32(half_bits: np.ndarray, out: F32) -> F32:
    """Convert finite float16 values, as int16 bit patterns [...], to float32 in ``out`` (returned).

    Exactly ``astype(np.float32)`` for every finite half, not for infinities and NaNs; ``out``: same
    shape, C-contiguous. (numpy's own cast is a scalar loop without F16C.)

    Source: IEEE 754-2008 binary16/binary32; F. Giesen, "Half to float done quic", 2012.
    """
    bits = out.view(np.int32)
    np.copyto(bits, half_bits, casting="unsafe")  # sign-extends: bits 15..31 = the sign
    np.left_shift(bits, 13, out=bits)
    np.bitwise_and(bits, _HALF_MASK, out=bits)
    np.multiply(out, _HALF_SCALE, out=out)
    return out


def _size(path: Path) -> int:
    """Bytes of ``path``, -1 if it does not exist."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def _describe(path: Path, size: int) -> str:
    """Why ``path`` does not fit: "missing" or "has N bytes, expected M"."""
    actual = _size(path)
    return "missing" if actual < 0 else f"has {actual} bytes, expected {size}"


def allocate(path: Path, size: int) -> None:
    """Give a sparse file its blocks now (a write into a hole of a full disk is SIGBUS); ``ENOSPC`` raises."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # file systems without it: as before
            raise
    finally:
        os.close(fd)


def holdout_capacity(store_capacity: int, every: int) -> int:
    """Samples the holdout store keeps: ``store_capacity // every``, at least 16 (0 when ``every`` is 0)."""
    return max(16, store_capacity // every) if every else 0


def store_file_bytes(capacity: int, dim: int) -> int:
    """Bytes of a store's files: a float16 [D] embedding, an int16 label and a 16-byte row record a slot."""
    return capacity * (2 * dim + 2 + 16)


class StoreCorrupt(ValueError):
    """The store's files disagree with their metadata or checksum (internal: the store is set aside)."""


class EmbeddingStore:
    """Ring buffer of ``(embedding float16 [D], label int16)`` in memory-mapped files.

    Parameters
    ----------
    directory : Path
        Where the ``store_*`` files live; created if missing.
    capacity : int
        Maximum number of samples kept (older ones are overwritten).
    dim : int
        Embedding size D; a store found for another D is reset (a WARNING with its count).
    num_classes : int or None
        K of the head: labels outside ``0..K-1`` (``0..1`` when K = 1) are refused by :meth:`add`
        and counted in ``refused_labels``. None = not checked.

    Raises ``ValueError`` if ``capacity``, ``dim`` or ``num_classes`` is not positive, ``OSError`` if
    the files cannot be created or allocated (``ENOSPC``: no room for the store).
    """

    def __init__(self, directory: Path, capacity: int, dim: int, num_classes: int | None = None) -> None:
        if capacity <= 0 or dim <= 0 or (num_classes is not None and num_classes <= 0):
            raise ValueError(
                f"EmbeddingStore: capacity {capacity}, dim {dim} and num_classes {num_classes} must be > 0"
            )
        self.num_classes = num_classes
        self.refused_labels = 0
        self.refused_not_finite = 0
        self.recovered_after_flush = 0
        """Samples found at open that were stored after the last flush (their rows checked)."""
        self.lost_at_open = 0
        """Samples the metadata or the rows vouched for that could not be recovered at open."""
        self.unflushed = 0
        """Samples stored since the last :meth:`flush` (not yet durable against a power cut)."""
        self.unflushed_since: float | None = None
        """``time.monotonic()`` of the oldest unflushed sample's store (None when all are flushed)."""
        self.mark: int | None = None
        """:attr:`total` when :meth:`set_mark` was last called (persisted by :meth:`flush`); None: never."""
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.capacity = capacity
        self.dim = dim
        self._meta_path = directory / META_FILE
        emb_path, lbl_path, rows_path = directory / EMB_FILE, directory / LBL_FILE, directory / ROWS_FILE
        sizes = ((emb_path, capacity * dim * 2), (lbl_path, capacity * 2), (rows_path, capacity * 16))
        if _finish_resize(directory):
            logger.warning("store in %s: finished a capacity change a stop interrupted", directory)
        data = read_record(self._meta_path)  # read (and a torn record logged) once
        old_capacity = _other_capacity(data, capacity, dim)
        if old_capacity is not None:
            _resize(directory, old_capacity, capacity, dim, num_classes)
            data = read_record(self._meta_path)
        meta: dict[str, object] | None = None
        mode = "w+"
        try:
            meta = self._read_meta(data)
            if not self._other_shape and all(_size(p) == n for p, n in sizes):
                if meta is not None:
                    self._check_meta(meta)
                mode = "r+"
            elif meta is not None:
                bad = [f"{p.name} {_describe(p, n)}" for p, n in sizes if _size(p) != n]
                raise StoreCorrupt(", ".join(bad))
        except StoreCorrupt as exc:
            self._set_aside(str(exc))
            meta, mode = None, "w+"
        self._map(mode)
        self._count = self._head = self._total = 0
        try:
            if mode == "r+":
                self._recover(meta)
                mark = meta.get("mark") if meta is not None else None
                # a mark ahead of what was recovered (samples lost): what comes from here on is new
                self.mark = min(mark, self._total) if type(mark) is int and mark >= 0 else None
        except StoreCorrupt as exc:
            self._count = self._head = self._total = 0
            self._unmap()
            self._set_aside(str(exc))
            self._map("w+")

    def _map(self, mode: str) -> None:
        """Map the three files (``"r+"``: as found, ``"w+"``: new and zero) and give them their blocks."""
        d, cap, dim = self.directory, self.capacity, self.dim
        self._emb = np.memmap(d / EMB_FILE, dtype=np.float16, mode=mode, shape=(cap, dim))  # type: ignore[call-overload]
        self._lbl = np.memmap(d / LBL_FILE, dtype=np.int16, mode=mode, shape=(cap,))  # type: ignore[call-overload]
        self._rows = np.memmap(d / ROWS_FILE, dtype="<u8", mode=mode, shape=(cap, 2))  # type: ignore[call-overload]
        for name, size in ((EMB_FILE, cap * dim * 2), (LBL_FILE, cap * 2), (ROWS_FILE, cap * 16)):
            allocate(d / name, size)
        # plain ndarray views of the maps: indexing a memmap wraps every result in a memmap object
        self._emb_bits: np.ndarray = np.asarray(self._emb).view(np.int16)
        self._lbl_raw: np.ndarray = np.asarray(self._lbl)
        self._rows_raw: np.ndarray = np.asarray(self._rows)
        # slots this process wrote or read through the maps since they were made: their pages are
        # resident (counted in RSS); the others become resident when read (see resident_rows)
        self._touched = np.zeros(cap, dtype=bool)

    def _unmap(self) -> None:
        """Drop the maps (before their files are renamed)."""
        del self._emb_bits, self._lbl_raw, self._rows_raw, self._emb, self._lbl, self._rows

    def _read_meta(self, data: bytes | None) -> dict[str, object] | None:
        """The metadata map of the record payload ``data``; None: none or another shape (``_other_shape``)."""
        self._other_shape = False
        if data is None:
            return None
        try:
            meta = json.loads(data)
            if not isinstance(meta, dict):
                raise TypeError("not a map")
        except (ValueError, TypeError) as exc:
            raise StoreCorrupt(f"metadata unreadable: {exc}") from exc
        if meta.get("capacity") != self.capacity or meta.get("dim") != self.dim:
            logger.warning(
                "store in %s was built for embeddings of D = %s (this model: D = %d): its %s sample(s) "
                "cannot train this model; starting empty",
                self.directory,
                meta.get("dim"),
                self.dim,
                meta.get("count"),
            )
            self._other_shape = True
            return None
        return meta

    def _check_meta(self, meta: dict[str, object]) -> None:
        """Sanity of the metadata's ``count``, ``head`` and ``total`` (StoreCorrupt)."""
        count, head = meta.get("count"), meta.get("head")
        cap = self.capacity
        if type(count) is not int or type(head) is not int:
            raise StoreCorrupt(f"count {count!r} / head {head!r} are not integers")
        if not 0 <= count <= cap:
            raise StoreCorrupt(f"count = {count}: must be in 0..capacity {cap}")
        if not 0 <= head < cap:
            raise StoreCorrupt(f"head = {head}: out of range for count {count}, capacity {cap}")
        total = meta.get("total")
        if type(total) is not int or total < count or total % cap != head:
            raise StoreCorrupt(f"total = {total!r}: does not agree with head {head}, capacity {cap}")

    def _crc(self, slot: int, seq: int) -> int:
        """CRC-32 (``zlib.crc32``, ITU-T V.42) of the slot's embedding bits, label and ``seq``."""
        crc = zlib.crc32(np.ascontiguousarray(self._emb_bits[slot], dtype="<i2").tobytes())
        crc = zlib.crc32(np.ascontiguousarray(self._lbl_raw[slot : slot + 1], dtype="<i2").tobytes(), crc)
        return zlib.crc32(seq.to_bytes(8, "little"), crc)

    def _row_ok(self, slot: int, seq: int) -> bool:
        row = self._rows_raw[slot]
        return int(row[0]) == seq + 1 and int(row[1]) == self._crc(slot, seq)

    def _recover(self, meta: dict[str, object] | None) -> None:
        """Find the newest contiguous run of rows whose CRCs check; log what was found and lost."""
        cap = self.capacity
        seqs = self._rows_raw[:, 0]
        written = seqs != 0
        meta_total = int(meta["total"]) if meta is not None else 0  # type: ignore[call-overload]
        meta_count = int(meta["count"]) if meta is not None else 0  # type: ignore[call-overload]
        if not written.any() and meta_total == 0:
            return
        # The newest sample anything vouches for: the metadata's, or a newer row that checks out (its CRC
        # covers its seq, and sample seq lives in slot seq % capacity). A row that does not (a flipped
        # bit, a torn write) cannot vouch: one rogue seq must not outrank the metadata and every good row.
        top = meta_total - 1
        for slot in np.flatnonzero(seqs > meta_total)[np.argsort(-seqs[seqs > meta_total], kind="stable")]:
            seq = int(seqs[slot]) - 1
            if seq % cap == int(slot) and self._row_ok(int(slot), seq):
                top = seq
                break
        newest = top
        while newest >= max(0, top - cap + 1) and not self._row_ok(newest % cap, newest):
            newest -= 1
        if newest < max(0, top - cap + 1):
            total, count = 0, 0
        else:
            total, count = newest + 1, 1
            while count < min(cap, total) and self._row_ok((total - count - 1) % cap, total - count - 1):
                count += 1
        # what something vouched for: rows naming a live seq, and the metadata's flushed samples
        live_lo = max(0, top + 1 - cap)
        claimed = int(np.count_nonzero(written & (seqs >= live_lo + 1)))
        vouched = max(0, meta_total - max(meta_total - meta_count, live_lo))
        kept = max(0, min(total, meta_total) - max(total - count, meta_total - meta_count, live_lo))
        self.lost_at_open = max(claimed - count, vouched - kept, 0)
        self.recovered_after_flush = max(0, total - max(meta_total, total - count))
        self._count, self._head, self._total = count, total % cap, total
        stale = written & ~self._live_mask()
        self._rows_raw[stale] = 0  # rows outside the run never come back as samples
        self._check_content()
        if self.lost_at_open:
            logger.warning(
                "store in %s: %d sample(s) could not be recovered (torn or failing their checksum); "
                "%d recovered",
                self.directory,
                self.lost_at_open,
                count,
            )
        if self.recovered_after_flush:  # a crash (a clean stop flushes): worth a line at WARNING
            logger.warning(
                "store in %s: not closed cleanly; %d sample(s) stored after the last flush recovered "
                "(%d in all)",
                self.directory,
                self.recovered_after_flush,
                count,
            )

    def _live_mask(self) -> np.ndarray:
        """The slots holding the stored samples: bool [capacity]."""
        cap = self.capacity
        mask = np.zeros(cap, dtype=bool)
        first = (self._head - self._count) % cap
        slots = (np.arange(self._count) + first) % cap
        mask[slots] = True
        return mask

    def _slots(self, rows: I64) -> I64:
        """Storage slots of logical rows ``0..len-1`` (the identity unless recovery dropped the oldest)."""
        first = (self._head - self._count) % self.capacity
        if first == 0 or self._count == self.capacity:
            return rows
        return (rows + first) % self.capacity

    def _check_content(self) -> None:
        """Labels in ``0..K-1`` and finite embeddings in the stored samples, or StoreCorrupt."""
        live = np.flatnonzero(self._live_mask())
        if self.num_classes is not None and len(live):
            lbl = self._lbl_raw[live]
            ok = check_labels(lbl, self.num_classes)
            if not ok.all():
                bad = int(lbl[~ok][0])
                raise StoreCorrupt(f"label {bad} outside 0..{label_range(self.num_classes) - 1}")
        for s in range(0, len(live), _SCAN_ROWS):
            if not np.isfinite(self._emb[live[s : s + _SCAN_ROWS]]).all():
                raise StoreCorrupt(f"{EMB_FILE} holds non-finite values")

    def _set_aside(self, reason: str) -> None:
        """Rename the store's files to ``<name>.corrupt`` (replacing older ones) and log one line."""
        names = (EMB_FILE, LBL_FILE, ROWS_FILE, META_FILE, prev_path(Path(META_FILE)).name)
        for name in names:
            set_aside(self.directory / name, CORRUPT_SUFFIX)
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
    def total(self) -> int:
        """Samples ever stored in this store (the next sample's ``seq``), kept across restarts."""
        return self._total

    @property
    def since_mark(self) -> int:
        """Samples held now that were stored after the last :meth:`set_mark` (all of them without a mark)."""
        if self.mark is None:
            return self._count
        return max(0, min(self._count, self._total - self.mark))

    def set_mark(self) -> None:
        """Remember :attr:`total` as the mark (what a round trained on); the next :meth:`flush` keeps it."""
        self.mark = self._total

    @property
    def resident_rows(self) -> int:
        """Stored slots this process has written or read through the maps (their pages count in RSS)."""
        return int(np.count_nonzero(self._touched))

    def add(self, emb: F32, labels: I64) -> int:
        """Append ``emb`` float32 [N, D] with ``labels`` int64 [N] (int16 range), overwriting the oldest.

        Samples whose label the head cannot learn are refused (``refused_labels``), and so are those
        whose embedding is not finite in float16 (``refused_not_finite``). Returns how many were
        refused for their label; ``ValueError`` if the shapes disagree with D or with each other.
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
            slot = self._head
            self._rows_raw[slot, 0] = 0  # the slot's old sample is gone from here on
            self._emb[slot] = emb16[i]
            self._touched[slot] = True
            self._lbl[slot] = labels[i]
            # the seq last: a row caught half-way (old seq, new CRC) fails its check at open
            self._rows_raw[slot, 1] = self._crc(slot, self._total)
            self._rows_raw[slot, 0] = self._total + 1
            self._total += 1
            self._head = (slot + 1) % self.capacity
            self._count = min(self.capacity, self._count + 1)
        if n:
            self.unflushed += n
            if self.unflushed_since is None:
                self.unflushed_since = time.monotonic()
        return refused

    def chunks(self, chunk_size: int) -> Iterator[tuple[F32, I64]]:
        """Yield ``(emb float32 [<=chunk_size, D], labels int64 [<=chunk_size])`` of the stored samples.

        All of them in storage order; one chunk's worth is in the heap at a time.
        """
        for start in range(0, self._count, chunk_size):
            sel = np.arange(start, min(start + chunk_size, self._count), dtype=np.int64)
            emb = np.empty((len(sel), self.dim), np.float32)
            lbl = np.empty(len(sel), np.int64)
            self.read(sel, emb, lbl)
            yield emb, lbl

    def read(self, rows: I64, emb_out: F32, lbl_out: I64) -> None:
        """Read stored samples ``rows`` (int64 [M] in ``0..len(self)-1``, any order) into caller buffers.

        ``emb_out`` float32 [M, D] (C-contiguous) and ``lbl_out`` int64 [M] receive row i = ``rows[i]``
        in one float16 gather; ``ValueError`` if their shapes do not match ``rows`` and D.
        """
        m = len(rows)
        if emb_out.shape != (m, self.dim) or lbl_out.shape != (m,):
            raise ValueError(
                f"store.read: {m} rows into emb {emb_out.shape} and labels {lbl_out.shape}, D = {self.dim}"
            )
        slots = self._slots(rows)
        self._touched[slots] = True
        half_bits_to_float32(self._emb_bits[slots], emb_out)
        np.copyto(lbl_out, self._lbl_raw[slots], casting="unsafe")

    def flush(self) -> None:
        """Write the maps back (``msync``), then the metadata: every stored sample survives a power cut.

        The metadata record is the JSON map ``{"v": 2, "capacity", "dim", "count", "head", "total"}``
        (and ``"mark"`` once set). ``OSError`` if the file system refuses (still :attr:`unflushed`).
        """
        self._emb.flush()
        self._lbl.flush()
        self._rows.flush()
        meta = {
            "v": 2,
            "capacity": self.capacity,
            "dim": self.dim,
            "count": self._count,
            "head": self._head,
            "total": self._total,
        }
        if self.mark is not None:
            meta["mark"] = self.mark
        write_record(self._meta_path, json.dumps(meta).encode())
        self.unflushed, self.unflushed_since = 0, None

    def flush_due(self, every: int, interval_s: float, now: float | None = None) -> bool:
        """Whether ``every`` samples are unflushed, or the oldest ``interval_s`` old (``now``: monotonic)."""
        if not self.unflushed:
            return False
        if self.unflushed >= every:
            return True
        since = self.unflushed_since
        return since is not None and (time.monotonic() if now is None else now) - since >= interval_s


def _other_capacity(data: bytes | None, capacity: int, dim: int) -> int | None:
    """The capacity of the store with metadata ``data`` if built for this ``dim`` and another, else None."""
    try:
        meta = json.loads(data) if data is not None else None
    except ValueError:
        return None  # the store's own open says it is corrupt
    if not isinstance(meta, dict) or meta.get("dim") != dim:
        return None
    old = meta.get("capacity")
    return old if type(old) is int and old > 0 and old != capacity else None


def _finish_resize(directory: Path) -> bool:
    """Move a store rebuilt under :data:`RESIZE_DIR` into ``directory``, or drop an unfinished rebuild.

    The rebuilt metadata record is written last and moved last of the three data files: while it is in
    the sub-folder the rebuild is complete, and the files still there replace the old ones (a kill
    part-way through the moves is finished here at the next open); without it the old files are whole.
    Returns whether rebuilt files were moved in; OSError if a rename fails.
    """
    tmp = directory / RESIZE_DIR
    if not tmp.is_dir():
        return False
    meta_prev = prev_path(Path(META_FILE)).name  # the meta record's newest may be in either of its files
    complete = (tmp / META_FILE).exists()
    if complete:
        (directory / meta_prev).unlink(missing_ok=True)
        names = [EMB_FILE, LBL_FILE, ROWS_FILE, META_FILE, meta_prev]
        move_into([(tmp / name, directory / name) for name in names if (tmp / name).exists()])
    shutil.rmtree(tmp, ignore_errors=True)
    return complete


def _resize(directory: Path, old_capacity: int, capacity: int, dim: int, num_classes: int | None) -> None:
    """Rebuild the store for ``capacity`` under :data:`RESIZE_DIR`, keeping its newest samples and mark."""
    old = EmbeddingStore(directory, old_capacity, dim, num_classes)
    n = len(old)
    keep = min(n, capacity)
    tmp = directory / RESIZE_DIR
    shutil.rmtree(tmp, ignore_errors=True)
    new = EmbeddingStore(tmp, capacity, dim, num_classes)
    for start in range(n - keep, n, _SCAN_ROWS):
        rows = np.arange(start, min(start + _SCAN_ROWS, n), dtype=np.int64)  # oldest first
        if n == old_capacity:  # a full ring's rows are its slots: the oldest sits at the head
            rows = (rows + old._head) % old_capacity
        emb, lbl = np.empty((len(rows), dim), np.float32), np.empty(len(rows), np.int64)
        old.read(rows, emb, lbl)
        new.add(emb, lbl)
    if old.mark is not None:
        new.mark = max(0, keep - old.since_mark)
    new.flush()  # from here on the rebuilt store is complete: a kill is finished by the next open
    old._unmap()
    new._unmap()
    _finish_resize(directory)
    log = logger.warning if keep < n else logger.info
    log(
        "store in %s: capacity %d -> %d: kept the newest %d of %d sample(s)",
        directory,
        old_capacity,
        capacity,
        keep,
        n,
    )
