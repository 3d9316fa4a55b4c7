"""The pending-label file: classified samples waiting for a late Label, kept across a restart.

A little-endian memory-mapped table by the store: a 32-byte header (``_HEADER`` and its CRC-32), then
``source.pending_max`` slots of :func:`slot_dtype` (``seq + 1``, 0 = free, written last; a CRC-32 of
the rest and ``seq``). A write survives a ``kill -9`` at once, a power cut after
:meth:`PendingFile.flush` (``msync``). A torn slot is counted, never restored.

Source: ISO-HDLC CRC-32 as ``zlib.crc32`` computes it (ITU-T V.42); ``mmap(2)``/``msync(2)`` (POSIX).
"""

from __future__ import annotations

import logging
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from edgefl.agent.store import allocate
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
    """The structured dtype of one slot for embeddings of size ``dim`` (``since``: Unix seconds)."""
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
    """A sample restored from the file: ``embedding`` float32 [D], ``age_s`` since parked (wall clock)."""

    id: str
    embedding: F32
    predicted: int
    age_s: float


def _slot_crc(row: np.ndarray, seq: int) -> int:
    """CRC-32 of a slot's fields after ``crc`` and of its ``seq``."""
    raw = row.tobytes()
    return zlib.crc32(seq.to_bytes(8, "little"), zlib.crc32(raw[12:]))


def _read_slots(rows: np.ndarray) -> tuple[list[tuple[int, int, Parked]], list[int], list[int]]:
    """The valid slots ``(seq, slot, Parked)`` oldest first, the invalid ones, and an id's older copies."""
    now = time.time()
    valid: list[tuple[int, int, Parked]] = []
    bad: list[int] = []
    for slot in np.flatnonzero(np.asarray(rows["seq"])).tolist():
        row = np.asarray(rows[slot : slot + 1])
        seq = int(row["seq"][0]) - 1
        n = int(row["id_len"][0])
        sample_id = bytes(row["id"][0])[:n].decode("ascii", "replace")
        emb = row["emb"][0].astype(np.float32)
        if (
            int(row["crc"][0]) == _slot_crc(row, seq)
            and 1 <= n <= ID_BYTES
            and SAMPLE_ID_RE.fullmatch(sample_id) is not None
            and bool(np.isfinite(emb).all())
        ):
            age_s = max(0.0, now - float(row["since"][0]))
            valid.append((seq, slot, Parked(sample_id, emb, int(row["predicted"][0]), age_s)))
        else:
            bad.append(slot)
    valid.sort(key=lambda t: t[0])
    newest = {p.id: slot for _, slot, p in valid}
    dups = [slot for _, slot, p in valid if newest[p.id] != slot]
    return [t for t in valid if newest[t[2].id] == t[1]], bad, dups


class PendingFile:
    """The pending-label file ``directory / PENDING_FILE`` of ``capacity`` slots for embeddings [``dim``].

    A file whose header fails its check, or for another ``dim`` or ``capacity``, is set aside as
    ``*.corrupt`` and a new one made; after a change of ``capacity`` alone its valid slots are carried
    over (the newest that fit). What was restored is in :attr:`restored`, oldest first. Raises
    ``ValueError`` if ``capacity`` or ``dim`` is not positive, ``OSError`` if it cannot be mapped.
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
        carried = self._old_rows() if self.path.exists() else []
        fresh = not self.path.exists()
        if fresh:
            directory.mkdir(parents=True, exist_ok=True)
            size = HEADER_BYTES + capacity * self._dtype.itemsize
            with self.path.open("wb") as fh:
                fh.write(self._header())
                fh.truncate(size)
            allocate(self.path, size)
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
        """Keep an existing file (ours), or carry its valid rows over and set it aside (logged)."""
        with self.path.open("rb") as fh:
            head = fh.read(HEADER_BYTES)
        file_size = self.path.stat().st_size
        size = HEADER_BYTES + self.capacity * self._dtype.itemsize
        if head == self._header() and file_size == size:
            return []  # ours: scanned once mapped
        why = "its header fails its check"
        rows: list[Parked] = []
        if len(head) == HEADER_BYTES and zlib.crc32(head[:-4]) == int.from_bytes(head[-4:], "little"):
            magic, dim, capacity, id_bytes = _HEADER.unpack(head[:-4])
            if magic == MAGIC and id_bytes == ID_BYTES and dim == self.dim:
                why = f"built for {capacity} slots, source.pending_max is {self.capacity}"
                whole = min(capacity, (file_size - HEADER_BYTES) // self._dtype.itemsize)
                if whole < capacity:
                    why = f"cut short: {whole} of its {capacity} slots are whole"
                with self.path.open("rb") as fh:
                    fh.seek(HEADER_BYTES)
                    raw = fh.read(whole * self._dtype.itemsize)
                old = np.frombuffer(raw, dtype=self._dtype, count=whole)
                valid, bad, _ = _read_slots(old)
                rows = [p for _, _, p in valid]
                self._count_lost(len(bad))
                if whole < capacity:
                    logger.warning(
                        "pending labels in %s: %d slot(s) lost with the file's missing tail (the "
                        "samples they held, if any, are lost)",
                        self.path.parent,
                        capacity - whole,
                    )
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
        """The valid slots of our map, oldest first; slots failing their check are freed and counted."""
        valid, bad, dups = _read_slots(self._rows)
        for slot in bad + dups:  # an id held twice keeps its newest slot
            self._rows["seq"][slot] = 0
        self._count_lost(len(bad))
        for seq, slot, p in valid:
            self._slot_of[p.id] = slot
            self._next_seq = max(self._next_seq, seq + 2)
        return [p for _, _, p in valid]

    def _count_lost(self, n: int) -> None:
        if n:
            self.lost_at_open += n
            logger.warning(
                "pending labels in %s: %d waiting sample(s) could not be recovered (torn or failing their "
                "checksum)",
                self.path.parent,
                n,
            )

    def __len__(self) -> int:
        """Samples held in the file now."""
        return len(self._slot_of)

    def park(self, sample_id: str, embedding: F32, predicted: int, since: float | None = None) -> None:
        """Write a waiting sample (``embedding`` float32 [D]) into a free slot, the caller freeing one.

        ``since``: Unix seconds it was parked (None: now). ``ValueError`` if no slot is free or the
        id (ASCII, 1..128 characters) or embedding does not fit.
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
