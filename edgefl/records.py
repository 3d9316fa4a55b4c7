"""Files the product reads back: the atomic writer and checksummed records with a fallback generation.

:func:`atomic_write` leaves the old or the new content after a power cut, never a mix; a *record*
also carries a SHA-256 checksum and keeps the previous good generation as ``<name>.prev``, read
when the newest is torn or rotten. The record layout: ``docs/operations.md``, "State and logs".

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
    """The previous good generation of ``path``: ``<path>.prev``."""
    return sibling(Path(path), ".prev")


def encode_record(payload: bytes, generation: int = 0) -> bytes:
    """Frame ``payload`` as a checksummed record of ``generation`` (0 <= generation < 2**64)."""
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, generation, len(payload))
    digest = hashlib.sha256(header)
    digest.update(payload)
    return header + digest.digest() + bytes(payload)


def decode_record(data: bytes, *, padded: bool = False) -> tuple[int, bytes]:
    """Check a whole record file's ``data``; return its generation and payload.

    ``padded`` accepts zero bytes after the record (a :class:`RecordSlot` file); RecordError if the
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


def write_record(path: Path, payload: bytes) -> int:
    """Write ``payload`` as the newest record at ``path``, keeping the previous good one as ``.prev``.

    The current file becomes ``<path>.prev`` only if it is a good record, hard-linked there first so
    ``path`` never goes missing (a rename where there are no hard links). Returns the generation
    written (the previous good one + 1, or 0); OSError if the file system refuses the write.
    """
    path = Path(path)
    prev = prev_path(path)
    generation = 0
    try:
        current = _read(path)
    except (RecordError, OSError) as exc:
        logger.warning(
            "state file %s is torn or corrupt (%s); keeping %s as the last good one", path, exc, prev.name
        )
        current = None
        with contextlib.suppress(RecordError, OSError):
            older = _read(prev)
            if older is not None:
                generation = older[0] + 1
    if current is not None:
        generation = current[0] + 1
        with contextlib.suppress(RecordError, OSError):
            older = _read(prev)
            if older is not None and older[0] >= generation:
                # written in place by a RecordSlot: the newest is .prev, keep it as the last good one
                atomic_write(path, encode_record(payload, older[0] + 1))
                return older[0] + 1
        staged = sibling(prev, ".tmp")
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
        try:
            os.link(path, staged)
            os.replace(staged, prev)
        except OSError:  # no hard links here: a rename leaves ``path`` missing until the write below
            os.replace(path, prev)
    atomic_write(path, encode_record(payload, generation))
    return generation


def read_record(path: Path) -> bytes | None:
    """The payload of the newer good record of ``path`` and ``<path>.prev``, or None (nothing, or both bad).

    Falling back to ``.prev`` is logged as a warning naming the file and the reason.
    """
    found = _newest(Path(path))
    return None if found is None else found[2]


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
        # a RecordSlot writes the two files in turn: .prev may be the newer one
        with contextlib.suppress(RecordError, OSError):
            other = _read(prev)
            if other is not None and other[0] > newest[0]:
                return (1, other[0], other[1])
        return (0, newest[0], newest[1])
    try:
        older = _read(prev)
    except (RecordError, OSError) as exc:
        if problem != "missing":
            logger.error(
                "state file %s is torn or corrupt (%s) and so is %s (%s); starting empty",
                path,
                problem,
                prev.name,
                exc,
            )
        else:
            logger.error("state file %s is torn or corrupt (%s); starting empty", prev, exc)
        return None
    if older is None:
        if problem != "missing":
            logger.error(
                "state file %s is torn or corrupt (%s), no previous generation; starting empty", path, problem
            )
        return None
    logger.warning(
        "state file %s is %s; using the previous good generation %s (generation %d)",
        path,
        "missing" if problem == "missing" else f"torn or corrupt ({problem})",
        prev.name,
        older[0],
    )
    return (1, older[0], older[1])


class RecordSlot:
    """A record rewritten in place, in turn in ``path`` and ``<path>.prev``: one ``fdatasync`` a write.

    Each write overwrites the older generation's file (zero-padded to 4 KiB blocks): a power cut
    mid-write leaves the newest good one readable. A file's first write in a process (and the one after
    a failure) is an :func:`atomic_write`. Reader: :func:`read_record`.

    Source: double-buffered (ping-pong) metadata pages with a checksum and a generation, as in
    LMDB's two meta pages (H. Chu, "MDB: A Memory-Mapped Database and Backend for OpenLDAP", 2011);
    ``fdatasync(2)`` (POSIX.1-2008).
    """

    BLOCK_BYTES: Final = 4096

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._slots = (self.path, prev_path(self.path))
        self._good: int | None = None  # which slot holds the newest good record
        self._generation = -1
        self._in_place = [False, False]  # replaced once by this process: safe to overwrite in place

    def read(self) -> bytes | None:
        """The newest good payload (as :func:`read_record`); notes which slot to write next."""
        found = _newest(self.path)
        if found is None:
            self._good, self._generation = None, -1
            return None
        self._good, self._generation = found[0], found[1]
        return found[2]

    def write(self, payload: bytes) -> int:
        """Make ``payload`` the newest record durably, the newest good one untouched; the generation written.

        OSError if the file system refuses (the next write replaces the slot this one may have torn).
        """
        target = 0 if self._good is None else 1 - self._good
        generation = self._generation + 1
        data = encode_record(payload, generation)
        path = self._slots[target]
        block = self.BLOCK_BYTES
        padded = -(-len(data) // block) * block
        if self._in_place[target]:
            try:
                fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                self._in_place[target] = False
        if not self._in_place[target]:
            atomic_write(path, data + bytes(padded - len(data)))
            self._in_place[target] = True
        else:
            try:
                size = os.fstat(fd).st_size
                if size > 4 * padded:  # a backlog's record was long: give the space back
                    os.ftruncate(fd, padded)
                    size = padded
                os.pwrite(fd, data + bytes(max(size, padded) - len(data)), 0)
                os.fdatasync(fd)
            except OSError:
                self._in_place[target] = False  # possibly torn: replaced whole next time
                raise
            finally:
                os.close(fd)
        self._good, self._generation = target, generation
        return generation
