"""The pending-label file: classified samples waiting for a late Label, kept across a restart.

A memory-mapped table of ``capacity`` (= ``source.pending_max``) fixed-size slots beside the store,
``pending_labels.tab``, mirroring the ingest's pending table (``agent/ingest.py``): a parked sample is
written into a free slot, a labelled, expired or evicted one is freed by zeroing its ``seq``. A write
lands in the page cache at once, so a ``kill -9`` or an OOM kill loses nothing; :meth:`PendingFile.flush`
(``msync``), run with every flush of the store and at a clean stop, makes it survive a power cut too.

Layout (little-endian): a 32-byte header ``b"EFLPEND1"``, ``u32 D``, ``u32 capacity``, ``u32 id
bytes``, 8 reserved bytes and ``u32`` CRC-32 of the 28 bytes before it; then ``capacity`` slots of
``seq + 1`` (u64, 0 = free), CRC-32 (u32) of the rest of the slot and ``seq``, predicted class (i32),
parked at (f64 Unix seconds), id length (u8), id (128 bytes) and the embedding (float16 [D]). The seq
is written last: a slot caught half-way fails its check at open and is counted, never restored.

Source: ISO-HDLC CRC-32 as ``zlib.crc32`` computes it (ITU-T V.42); ``mmap(2)``/``msync(2)`` (POSIX).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from edgefl.records import set_aside
from edgefl.types import F32
from edgefl.wire.ingest import SAMPLE_ID_RE

logger = logging.getLogger(__name__)

PENDING_FILE: Final = "pending_labels.tab"
MAGIC: Final = b"EFLPEND1"
ID_BYTES: Final = 128
"""Longest sample id (``SAMPLE_ID_RE``: 1..128 ASCII characters)."""
_HEADER: Final = struct.Struct("<8sIII8x")  # magic, D, capacity, id bytes, reserved
HEADER_BYTES: Final = _HEADER.size + 4


def slot_dtype(dim: int) -> np.dtype[np.void]:
    """The structured dtype of one slot for embeddings of size ``dim`` (module docstring)."""
    return np.dtype(
        [
            ("seq", "<u8"),
            ("crc", "<u4"),
            ("predicted", "<i4"),
            ("since", "<f8"),
            ("id_len", "u1"),
            ("id", f"S{ID_BYTES}"),
            ("emb", "<f2", (dim,)),
        ]
    )


@dataclass(frozen=True, slots=True)
class Parked:
    """A sample restored from the file.

    ``id``; ``embedding`` float32 [D]; ``predicted`` class; ``age_s`` seconds since it was parked
    (wall clock, >= 0).
    """

    id: str
    embedding: F32
    predicted: int
    age_s: float


def _slot_crc(row: np.ndarray, seq: int) -> int:
    """CRC-32 of a slot's fields after ``crc`` and of its ``seq``."""
    raw = row.tobytes()
    return zlib.crc32(seq.to_bytes(8, "little"), zlib.crc32(raw[12:]))


class PendingFile:
    """The pending-label file of one device (see the module docstring).

    Parameters
    ----------
    directory : Path
        The state folder (the store's); the file is ``directory / PENDING_FILE``.
    capacity : int
        Slots (``source.pending_max``, >= 1).
    dim : int
        Embedding size D (>= 1).

    Raises
    ------
    ValueError
        If ``capacity`` or ``dim`` is not positive.
    OSError
        If the file cannot be created or mapped.

    Notes
    -----
    A file for another ``capacity`` or ``dim``, or whose header fails its check, is set aside as
    ``*.corrupt`` (another model's embeddings are of no use; a capacity change keeps what fits) —
    with a capacity change only, its valid slots are carried over first (the newest that fit).
    """

    def __init__(self, directory: Path, capacity: int, dim: int) -> None:
        if capacity < 1 or dim < 1:
            raise ValueError(f"PendingFile: capacity {capacity} and dim {dim} must be >= 1")
        self.path = directory / PENDING_FILE
        self.capacity = capacity
        self.dim = dim
        self.lost_at_open = 0
        """Slots that held a sample but failed their check at open (torn or rotten)."""
        self._dtype = slot_dtype(dim)
        carried: list[Parked] = []
        if self.path.exists():
            carried = self._old_rows()
        fresh = not self.path.exists()
        if fresh:
            directory.mkdir(parents=True, exist_ok=True)
            size = HEADER_BYTES + capacity * self._dtype.itemsize
            with self.path.open("wb") as fh:
                fh.write(self._header())
                fh.truncate(size)
                try:  # its blocks now: a write into a hole of a full disk would be SIGBUS
                    os.posix_fallocate(fh.fileno(), 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # file systems without it
                        raise
        self._rows = np.memmap(  # type: ignore[call-overload]
            self.path, dtype=self._dtype, mode="r+", offset=HEADER_BYTES, shape=(capacity,)
        )
        self._next_seq = 1
        self._slot_of: dict[str, int] = {}
        if fresh:
            self._free = list(range(capacity - 1, -1, -1))  # slot 0 first
            self.restored: list[Parked] = carried[-capacity:]
            for p in self.restored:
                self.park(p.id, p.embedding, p.predicted, time.time() - p.age_s)
        else:
            self.restored = self._scan()
            self._free = [i for i in range(capacity - 1, -1, -1) if int(self._rows["seq"][i]) == 0]

    def _header(self) -> bytes:
        head = _HEADER.pack(MAGIC, self.dim, self.capacity, ID_BYTES)
        return head + zlib.crc32(head).to_bytes(4, "little")

    def _old_rows(self) -> list[Parked]:
        """Check an existing file's header; keep it, or carry its rows over and set it aside."""
        with self.path.open("rb") as fh:
            head = fh.read(HEADER_BYTES)
        if (
            head == self._header()
            and self.path.stat().st_size == HEADER_BYTES + self.capacity * self._dtype.itemsize
        ):
            return []  # ours: scanned once mapped
        why = "its header fails its check"
        rows: list[Parked] = []
        if len(head) == HEADER_BYTES and zlib.crc32(head[:-4]) == int.from_bytes(head[-4:], "little"):
            magic, dim, capacity, id_bytes = _HEADER.unpack(head[:-4])
            if magic == MAGIC and id_bytes == ID_BYTES and dim == self.dim:
                why = f"built for {capacity} slots, source.pending_max is {self.capacity}"
                old = PendingFile.__new__(PendingFile)
                old.path, old.capacity, old.dim, old.lost_at_open = self.path, capacity, dim, 0
                old._dtype = self._dtype
                old._rows = np.memmap(  # type: ignore[call-overload]
                    self.path, dtype=self._dtype, mode="r", offset=HEADER_BYTES, shape=(capacity,)
                )
                rows = old._scan()
                self.lost_at_open = old.lost_at_open
                del old._rows
            elif magic == MAGIC:
                why = f"built for embeddings of D = {dim}, the model's D is {self.dim}"
        set_aside(self.path, ".corrupt")
        logger.warning(
            "pending labels in %s: %s; set aside as *.corrupt, %d waiting sample(s) carried over",
            self.path.parent,
            why,
            min(len(rows), self.capacity),
        )
        return rows

    def _scan(self) -> list[Parked]:
        """The valid slots, oldest first; freed slots whose check fails are zeroed and counted."""
        now = time.time()
        seqs = np.asarray(self._rows["seq"])
        out: list[tuple[int, Parked]] = []
        for slot in np.flatnonzero(seqs):
            row = self._rows[int(slot)]
            seq = int(row["seq"]) - 1
            n = int(row["id_len"])
            sample_id = bytes(row["id"])[:n].decode("ascii", "replace")
            emb = np.asarray(row["emb"], dtype=np.float32)
            ok = (
                int(row["crc"]) == _slot_crc(np.asarray(row).reshape(1), seq)
                and 1 <= n <= ID_BYTES
                and SAMPLE_ID_RE.fullmatch(sample_id) is not None
                and bool(np.isfinite(emb).all())
            )
            if not ok:
                self.lost_at_open += 1
                if self._rows.flags.writeable:
                    self._rows["seq"][int(slot)] = 0
                continue
            out.append(
                (seq, Parked(sample_id, emb, int(row["predicted"]), max(0.0, now - float(row["since"]))))
            )
            if self._rows.flags.writeable:
                self._slot_of[sample_id] = int(slot)
                self._next_seq = max(self._next_seq, seq + 2)
        if self.lost_at_open:
            logger.warning(
                "pending labels in %s: %d waiting sample(s) could not be recovered (torn or failing their "
                "checksum)",
                self.path.parent,
                self.lost_at_open,
            )
        out.sort(key=lambda t: t[0])
        return [p for _, p in out]

    def __len__(self) -> int:
        """Samples held in the file now."""
        return len(self._slot_of)

    def park(self, sample_id: str, embedding: F32, predicted: int, since: float | None = None) -> None:
        """Write a waiting sample into a free slot (the caller frees one first when all are taken).

        Parameters
        ----------
        sample_id : str
            ``SAMPLE_ID_RE`` (ASCII, 1..128 characters).
        embedding : float32 [D]
        predicted : int
        since : float or None
            Unix seconds it was parked (now when None).

        Raises
        ------
        ValueError
            If no slot is free, or the id or embedding does not fit.
        """
        if sample_id in self._slot_of:
            self.release(sample_id)
        if not self._free:
            raise ValueError(f"pending file full ({self.capacity} slots): free one first")
        raw = sample_id.encode("ascii")
        if not 1 <= len(raw) <= ID_BYTES or embedding.shape != (self.dim,):
            raise ValueError(
                f"pending file: id of {len(raw)} bytes, embedding {embedding.shape}, D = {self.dim}"
            )
        slot = self._free.pop()
        seq = self._next_seq
        self._next_seq += 1
        row = np.zeros(1, dtype=self._dtype)
        row["predicted"] = predicted
        row["since"] = time.time() if since is None else since
        row["id_len"] = len(raw)
        row["id"] = raw
        with np.errstate(over="ignore"):
            row["emb"][0] = embedding.astype(np.float16)
        row["crc"] = _slot_crc(row, seq)
        row["seq"] = 0
        self._rows[slot] = row[0]  # seq still 0: a torn write is a free slot
        self._rows["seq"][slot] = seq + 1
        self._slot_of[sample_id] = slot

    def release(self, sample_id: str) -> None:
        """Free the slot of ``sample_id`` (labelled, expired or evicted); unknown ids are ignored."""
        slot = self._slot_of.pop(sample_id, None)
        if slot is not None:
            self._rows["seq"][slot] = 0
            self._free.append(slot)

    def flush(self) -> None:
        """Write the map back (``msync``): what it holds survives a power cut. Raises ``OSError``."""
        self._rows.flush()
