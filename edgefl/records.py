"""Files the product reads back: the atomic writer and checksummed records with a fallback generation.

Gateways lose power mid-write. Every file written here goes through :func:`atomic_write` (temporary
file, ``fsync``, ``os.replace``, ``fsync`` of the directory), so a reader sees either the old or the
new content, never a mix, once the write returned. Flash storage and file systems still tear or rot
files (a write the kernel reordered, a bad block), so a *record* also carries a SHA-256 checksum and
the previous good generation is kept next to it (``<name>.prev``): a torn or corrupt newest file is
detected and ignored in favour of the last good one, with one clear log line.

Record layout (all integers little-endian)::

    offset  size  field
    0       4     magic b"EFLR"
    4       1     format version (1)
    5       3     reserved, zero
    8       8     generation (u64, +1 per write of this path)
    16      8     payload length in bytes (u64)
    24      32    SHA-256 of bytes 0..23 followed by the payload
    56      n     payload

A record file may be followed by zero bytes (``decode_record(padded=True)``, which the readers
here use): a :class:`RecordSlot` rewrites its two files in place, in whole 4 KiB blocks.

The device's outbox (:mod:`edgefl.agent.outbox`, through a :class:`RecordSlot`: one ``fdatasync``
between a round's training and its publish) and the coordinator's state are stored as records.

Source: POSIX ``rename(2)`` atomicity and ``fsync(2)`` of the containing directory (see also
"Files are hard", Pillai et al., OSDI 2014, "All File Systems Are Not Created Equal").
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
from pathlib import Path
from typing import Final

logger = logging.getLogger(__name__)

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "RecordError",
    "RecordSlot",
    "atomic_write",
    "decode_record",
    "encode_record",
    "prev_path",
    "read_record",
    "set_aside",
    "write_record",
]

MAGIC: Final = b"EFLR"
FORMAT_VERSION: Final = 1
_HEADER: Final = struct.Struct("<4sB3xQQ")  # magic, version, reserved, generation, length
HEADER_BYTES: Final = _HEADER.size + 32


class RecordError(ValueError):
    """A record file is torn, corrupt or not a record; ``reason`` is a short label.

    Parameters
    ----------
    reason : str
        ``"truncated"``, ``"bad_magic"``, ``"bad_version"``, ``"bad_length"`` or ``"bad_checksum"``.
    detail : str
        Human-readable explanation.
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


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably.

    Writes ``<path>.tmp``, fsyncs it, renames it over ``path`` and fsyncs the directory. After a crash
    at any point ``path`` holds either its old content or ``data``. One writer per path at a time.

    Parameters
    ----------
    path : Path
        Destination file; its directory must exist.
    data : bytes
        The new content.

    Raises
    ------
    OSError
        If the file system refuses the write (the temporary file is removed).

    Source: POSIX rename(2) (atomic replacement) and fsync(2).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
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
    """Rename a file the product cannot use to ``<name><suffix>`` (replacing an older one), durably.

    Parameters
    ----------
    path : Path
        The file; nothing happens when it does not exist.
    suffix : str
        Appended to the name, e.g. ``".corrupt"``.

    Returns
    -------
    Path or None
        The new path, or None when ``path`` did not exist.

    Raises
    ------
    OSError
        If the rename fails for another reason than a missing file.
    """
    target = path.with_name(path.name + suffix)
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return None
    _fsync_dir(path.parent)
    return target


def prev_path(path: Path) -> Path:
    """The previous good generation of ``path``: ``<path>.prev``."""
    path = Path(path)
    return path.with_name(path.name + ".prev")


def encode_record(payload: bytes, generation: int = 0) -> bytes:
    """Frame ``payload`` as a checksummed record (see the module docstring for the layout).

    Parameters
    ----------
    payload : bytes
        Any bytes.
    generation : int
        Write counter, 0 <= generation < 2**64.

    Returns
    -------
    bytes
        ``HEADER_BYTES + len(payload)`` bytes.
    """
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, generation, len(payload))
    digest = hashlib.sha256(header)
    digest.update(payload)
    return header + digest.digest() + bytes(payload)


def decode_record(data: bytes, *, padded: bool = False) -> tuple[int, bytes]:
    """Check a record and return its generation and payload.

    Parameters
    ----------
    data : bytes
        The whole file content.
    padded : bool
        Accept zero bytes after the record (a :class:`RecordSlot` file rewritten in place keeps its
        size; any other trailing byte is still ``bad_length``).

    Returns
    -------
    generation : int
    payload : bytes

    Raises
    ------
    RecordError
        If the record is truncated, has trailing bytes, a wrong magic/version or a bad checksum.
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

    The current file becomes ``<path>.prev`` only if it is itself a good record (a corrupt newest file
    never evicts the last good generation). It is hard-linked there first, so ``path`` never goes
    missing; file systems without hard links (FAT) fall back to a rename.

    Parameters
    ----------
    path : Path
        Record file; its directory must exist.
    payload : bytes
        The new content.

    Returns
    -------
    int
        The generation written (previous good generation + 1, or 0).

    Raises
    ------
    OSError
        If the file system refuses the write.
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
        staged = prev.with_name(prev.name + ".tmp")
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
    """Read the newest good record at ``path``, falling back to ``<path>.prev``.

    Parameters
    ----------
    path : Path
        Record file written by :func:`write_record`.

    Returns
    -------
    bytes or None
        The payload of the newer good record of ``path`` and ``<path>.prev`` by generation (the
        newer is ``path`` unless a :class:`RecordSlot` wrote them); when ``path`` is bad or missing,
        that of ``<path>.prev`` is logged as a warning naming the file and the reason; None when
        nothing is stored yet, or both are bad (logged as an error).
    """
    found = _newest(Path(path))
    return None if found is None else found[2]


def _newest(path: Path) -> tuple[int, int, bytes] | None:
    """Slot, generation and payload of the newest good record of ``path`` and its ``.prev``.

    Slot 0 is ``path``, 1 is ``.prev``; logs as :func:`read_record` says; None if neither is good.
    """
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

    :func:`write_record` costs a read of the current file, a hard link, a rename, a new file's
    ``fsync`` and the folder's ``fsync`` (two journal commits on ext4, 1-7 ms on a shared disk):
    too much for the one write between a device's training and its publish (round
    latency). Here each write overwrites the file holding the *older* generation, from offset 0,
    zero-padded to the file's size (whole 4 KiB blocks) and ``fdatasync``-ed: the blocks are already
    allocated and the size unchanged, so no metadata is journalled and no name changes. The newest
    good generation is never touched by a write, so a power cut mid-write leaves it readable
    (:func:`read_record` takes the newer good one of the two; the torn one fails its checksum).
    The first write of each file in a process replaces it with :func:`atomic_write` (a new file,
    the folder ``fsync``-ed: the name is durable, and a hard link left by :func:`write_record`
    never makes the two slots one file); so does the write after a failed one.

    Parameters
    ----------
    path : Path
        The record file; the same reader and names as :func:`write_record` (one writer per path).

    Source: double-buffered (ping-pong) metadata pages with a checksum and a generation, as in
    LMDB's two meta pages (H. Chu, "MDB: A Memory-Mapped Database and Backend for OpenLDAP", 2011);
    ``fdatasync(2)`` (POSIX.1-2008): data and only the metadata needed to read it back.
    """

    BLOCK_BYTES: Final = 4096

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._slots = (self.path, prev_path(self.path))
        self._good: int | None = None  # which slot holds the newest good record
        self._generation = -1
        self._in_place = [False, False]  # replaced once by this process: safe to overwrite in place

    def read(self) -> bytes | None:
        """The newest good payload (as :func:`read_record`), and which slot to write next.

        Returns
        -------
        bytes or None
        """
        found = _newest(self.path)
        if found is None:
            self._good, self._generation = None, -1
            return None
        self._good, self._generation = found[0], found[1]
        return found[2]

    def write(self, payload: bytes) -> int:
        """Make ``payload`` the newest record, durably, without touching the newest good one.

        Parameters
        ----------
        payload : bytes

        Returns
        -------
        int
            The generation written.

        Raises
        ------
        OSError
            If the file system refuses the write; the newest good record is unchanged, and the
            next write replaces the slot this one may have torn.
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
