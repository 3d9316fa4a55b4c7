"""Files the product reads back: the atomic writer and checksummed records with a fallback generation.

:func:`atomic_write` leaves the old or the new content after a power cut, never a mix; a *record*
also carries a SHA-256 checksum and a generation, and is written in turn in ``<name>`` and
``<name>.prev`` (:func:`write_record`): the older good one is read when the newest is torn or rotten.
The record layout: ``docs/operations.md``, "State and logs".

Source: POSIX ``rename(2)`` atomicity and ``fsync(2)`` of the containing directory (Pillai et al.,
"All File Systems Are Not Created Equal", OSDI 2014).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import struct
import threading
from pathlib import Path
from typing import Final

logger = logging.getLogger(__name__)

MAGIC: Final = b"EFLR"
FORMAT_VERSION: Final = 1
_HEADER: Final = struct.Struct("<4sB3xQQ")  # magic, version, reserved, generation, length
HEADER_BYTES: Final = _HEADER.size + 32


class RecordError(ValueError):
    """A record file is torn, corrupt or not a record; ``reason`` is a short label, ``detail`` says more.

    Reasons: ``"truncated"``, ``"bad_magic"``, ``"bad_version"``, ``"bad_length"``, ``"bad_checksum"``.
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


def _fsync_dir(directory: Path) -> None:
    # The rename is only durable once the directory entry is on disk.
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=256)
def sibling(path: Path, suffix: str) -> Path:
    """``<path><suffix>``, the same object for the same arguments (256 kept: pathlib interns new names)."""
    return path.with_name(path.name + suffix)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (``.tmp``, fsync, rename, fsync of the folder).

    One writer a path; OSError if the file system refuses (the temporary file is removed).
    """
    path = Path(path)
    tmp = sibling(path, ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def set_aside(path: Path, suffix: str) -> Path | None:
    """Rename a file the product cannot use to ``<name><suffix>`` (e.g. ``.corrupt``) durably; the new path.

    None when ``path`` does not exist; OSError if the rename fails otherwise.
    """
    target = path.with_name(path.name + suffix)
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return None
    _fsync_dir(path.parent)
    return target


def move_into(pairs: list[tuple[Path, Path]]) -> None:
    """Rename each ``(src, dst)`` over ``dst`` in turn (each atomic), then fsync ``dst``'s folder; OSError."""
    for src, dst in pairs:
        os.replace(src, dst)
    for folder in {dst.parent for _, dst in pairs}:
        _fsync_dir(folder)


def prev_path(path: Path) -> Path:
    """The second file of the record ``path``: ``<path>.prev``."""
    return sibling(Path(path), ".prev")


def encode_record(payload: bytes, generation: int = 0) -> bytes:
    """Frame ``payload`` as a checksummed record of ``generation`` (0 <= generation < 2**64)."""
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, generation, len(payload))
    digest = hashlib.sha256(header)
    digest.update(payload)
    return header + digest.digest() + bytes(payload)


def decode_record(data: bytes, *, padded: bool = False) -> tuple[int, bytes]:
    """Check a whole record file's ``data``; return its generation and payload.

    ``padded`` accepts zero bytes after the record (as :func:`write_record` pads); RecordError if the
    record is truncated, has other trailing bytes, a wrong magic or version, or a bad checksum.
    """
    if len(data) < HEADER_BYTES:
        raise RecordError("truncated", f"{len(data)} bytes, the header alone is {HEADER_BYTES}")
    magic, version, generation, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise RecordError("bad_magic", f"magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise RecordError("bad_version", f"format version {version}, expected {FORMAT_VERSION}")
    end = HEADER_BYTES + length
    if padded and len(data) > end and data.count(0, end) == len(data) - end:
        data = data[:end]
    if length != len(data) - HEADER_BYTES:
        reason = "truncated" if length > len(data) - HEADER_BYTES else "bad_length"
        raise RecordError(reason, f"header says {length} payload bytes, file has {len(data) - HEADER_BYTES}")
    digest = hashlib.sha256(data[: _HEADER.size])
    digest.update(data[HEADER_BYTES:])
    if digest.digest() != data[_HEADER.size : HEADER_BYTES]:
        raise RecordError("bad_checksum", "SHA-256 of header and payload does not match")
    return generation, bytes(data[HEADER_BYTES:])


def _read(path: Path) -> tuple[int, bytes] | None:
    """Generation and payload of the record at ``path``; None if missing; RecordError if bad."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return decode_record(data, padded=True)


def read_record(path: Path) -> bytes | None:
    """The payload of the newer good record of ``path`` and ``<path>.prev``, or None (nothing, or both bad).

    Falling back to the older one is logged as a warning naming the file and the reason.
    """
    slot = _Slot(Path(path))
    payload = slot.load()
    _remember(slot)
    return payload


def write_record(path: Path, payload: bytes) -> int:
    """Make ``payload`` the newest record of ``path`` durably, the newest good one untouched; its generation.

    Each write goes over the older of ``path`` and ``<path>.prev`` (zero-padded to 4 KiB blocks): a
    kill or power cut mid-write tears only that file, and :func:`read_record` takes the other. A
    file's first write in a process (and one after a failure, or after the file was replaced, resized
    or removed) is an :func:`atomic_write`; later ones overwrite it in place with one ``fdatasync``.
    One writer a path. Returns the generation written (the newest good one + 1, or 0); OSError if the
    file system refuses (the newest good record is kept).

    Source: double-buffered (ping-pong) metadata pages with a checksum and a generation, as in
    LMDB's two meta pages (H. Chu, "MDB: A Memory-Mapped Database and Backend for OpenLDAP", 2011);
    ``fdatasync(2)`` (POSIX.1-2008).
    """
    slot = _SLOTS.get(Path(path))
    if slot is None:
        slot = _Slot(Path(path))
        slot.load()
    _remember(slot)
    return slot.write(payload)


BLOCK_BYTES: Final = 4096
_MAX_SLOTS: Final = 64
_SLOTS: dict[Path, _Slot] = {}  # the records this process wrote or read, least recently used first
_SLOTS_LOCK = threading.Lock()


def _remember(slot: _Slot) -> None:
    """Keep ``slot`` as its record's, the newest used (the oldest forgotten past :data:`_MAX_SLOTS`)."""
    with _SLOTS_LOCK:
        _SLOTS.pop(slot.paths[0], None)
        _SLOTS[slot.paths[0]] = slot
        if len(_SLOTS) > _MAX_SLOTS:
            del _SLOTS[next(iter(_SLOTS))]


def _identity(path: Path) -> tuple[int, int] | None:
    """Inode and size of ``path``, None if missing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size


class _Slot:
    """What this process knows of a record's two files: which holds the newest, which it wrote itself."""

    def __init__(self, path: Path) -> None:
        self.paths = (path, prev_path(path))
        self.good: int | None = None  # 0: path, 1: .prev holds the newest good record
        self.generation = -1
        self.seen: list[tuple[int, int] | None] = [None, None]  # (inode, size) of each file when last seen
        self.in_place = [False, False]  # this process replaced the file: safe to overwrite in place

    def load(self) -> bytes | None:
        """Read both files: the newest good payload; each file's next write replaces it whole."""
        self.seen = [_identity(p) for p in self.paths]
        found = _newest(self.paths[0])
        self.good, self.generation = (None, -1) if found is None else (found[0], found[1])
        self.in_place = [False, False]
        return None if found is None else found[2]

    def write(self, payload: bytes) -> int:
        """:func:`write_record`'s write."""
        if self.good is not None and _identity(self.paths[self.good]) != self.seen[self.good]:
            self.load()  # someone else replaced, resized or removed the newest: read again
        target = 0 if self.good is None else 1 - self.good
        generation = self.generation + 1
        data = encode_record(payload, generation)
        path = self.paths[target]
        padded = -(-len(data) // BLOCK_BYTES) * BLOCK_BYTES
        in_place, self.in_place[target] = self.in_place[target], False  # possibly torn until it returns
        seen = self.seen[target]
        if not in_place or seen is None or _identity(path) != seen:
            atomic_write(path, data + bytes(padded - len(data)))
        else:
            fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                size = seen[1]
                if size > 4 * padded:  # a backlog's record was long: give the space back
                    os.ftruncate(fd, padded)
                    size = padded
                os.pwrite(fd, data + bytes(max(size, padded) - len(data)), 0)
                os.fdatasync(fd)
            finally:
                os.close(fd)
        self.seen[target], self.in_place[target] = _identity(path), True
        self.good, self.generation = target, generation
        return generation


def _start_empty(what: str, *bad: Path) -> None:
    """Log ``state file <what>``; set the ``bad`` files aside as ``*.corrupt`` (kept, not overwritten).

    A file the rename fails for (a folder in its place over an older ``*.corrupt`` file) is named in
    the line with the error.
    """
    stuck = ""
    for p in bad:
        try:
            set_aside(p, ".corrupt")
        except OSError as exc:  # not renamed: the next write replaces it, as before
            stuck += f", except {p.name} ({exc}: move it away by hand)"
    logger.error("state file %s; set aside as *.corrupt%s, starting empty", what, stuck)


def _newest(path: Path) -> tuple[int, int, bytes] | None:
    """Slot (0: ``path``, 1: ``.prev``), generation and payload of the newest good record, or None; logs."""
    prev = prev_path(path)
    problem = "missing"
    newest = None
    try:
        newest = _read(path)
    except (RecordError, OSError) as exc:
        problem = str(exc)
    if newest is not None:
        try:  # the two files are written in turn: .prev may be the newer one
            other = _read(prev)
        except (RecordError, OSError) as exc:
            other = None
            logger.warning(
                "state file %s is torn or corrupt (%s); using %s (generation %d)",
                prev,
                exc,
                path.name,
                newest[0],
            )
        if other is not None and other[0] > newest[0]:
            return (1, other[0], other[1])
        return (0, newest[0], newest[1])
    try:
        older = _read(prev)
    except (RecordError, OSError) as exc:
        _start_empty(
            f"{prev} is torn or corrupt ({exc})"
            if problem == "missing"
            else f"{path} is torn or corrupt ({problem}) and so is {prev.name} ({exc})",
            path,
            prev,
        )
        return None
    if older is None:
        if problem != "missing":
            _start_empty(f"{path} is torn or corrupt ({problem}), no previous generation", path)
        return None
    logger.warning(
        "state file %s is %s; using the previous good generation %s (generation %d)",
        path,
        "missing" if problem == "missing" else f"torn or corrupt ({problem})",
        prev.name,
        older[0],
    )
    return (1, older[0], older[1])
