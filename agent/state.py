"""Persistent device state: atomic writes, checksummed records with a fallback generation, the outbox.

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

The :class:`Outbox` keeps each update until the broker acknowledged it (PUBACK), persisted as a record,
so an update survives a reconnect or a restart and is re-sent with the same ``update_id`` (the
coordinator de-duplicates by it). It is bounded in bytes; updates of rounds that closed are dropped
with a reason.

Source: POSIX ``rename(2)`` atomicity and ``fsync(2)`` of the containing directory (see also
"Files are hard", Pillai et al., OSDI 2014, "All File Systems Are Not Created Equal").
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import cbor2

from agent.codec import _CBOR2_STRICT

logger = logging.getLogger(__name__)

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "Dropped",
    "Outbox",
    "OutboxEntry",
    "RecordError",
    "atomic_write",
    "decode_record",
    "encode_record",
    "prev_path",
    "read_record",
    "write_record",
]

MAGIC: Final = b"EFLR"
FORMAT_VERSION: Final = 1
_HEADER: Final = struct.Struct("<4sB3xQQ")  # magic, version, reserved, generation, length
HEADER_BYTES: Final = _HEADER.size + 32
_UPDATE_ID_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # as agent.codec's update_id


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


def decode_record(data: bytes) -> tuple[int, bytes]:
    """Check a record and return its generation and payload.

    Parameters
    ----------
    data : bytes
        The whole file content.

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
    return decode_record(data)


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
        The payload of ``path`` if it is a good record, else that of ``<path>.prev`` (logged as a
        warning naming the file and the reason), else None (nothing stored yet, or both bad: logged
        as an error).
    """
    path = Path(path)
    prev = prev_path(path)
    problem = "missing"
    try:
        newest = _read(path)
        if newest is not None:
            return newest[1]
    except (RecordError, OSError) as exc:
        problem = str(exc)
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
    return older[1]


# ---------------------------------------------------------------------------------------------------
# Outbox


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """One update waiting for its PUBACK.

    Parameters
    ----------
    update_id : str
        The update's ``update_id`` (re-sent unchanged, the coordinator de-duplicates by it).
    round : int
        Round the update answers, >= 0.
    payload : bytes
        The encoded (and signed) Update, exactly as published.
    sends : int
        Publish attempts so far (:meth:`Outbox.mark_sent`).
    """

    update_id: str
    round: int
    payload: bytes
    sends: int = 0


@dataclass(frozen=True, slots=True)
class Dropped:
    """An update the outbox gave up on.

    Parameters
    ----------
    update_id : str
    round : int
    reason : str
        ``"outbox_full"`` (evicted to make room, oldest first), ``"too_large"`` (larger than the
        whole outbox), ``"stale_round"`` (its round closed).
    """

    update_id: str
    round: int
    reason: str


class Outbox:
    """Updates kept until acknowledged, persisted as a record in the state directory.

    Parameters
    ----------
    path : Path
        Record file (e.g. ``<state_dir>/outbox.rec``); its directory is created if missing. What it
        holds is loaded at construction (a torn file falls back to the previous generation).
    max_bytes : int
        Bound on the sum of the kept payloads, bytes, >= 1.

    Raises
    ------
    ValueError
        If ``max_bytes < 1``.
    OSError
        If the state directory cannot be created.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes = {max_bytes}: must be >= 1")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._entries: list[OutboxEntry] = self._load()
        if self._entries:
            logger.info(
                "outbox %s: %d update(s) awaiting acknowledgement (%d bytes)",
                self.path,
                len(self._entries),
                self.total_bytes,
            )

    def _load(self) -> list[OutboxEntry]:
        data = read_record(self.path)
        if data is None:
            return []
        try:
            obj = (
                cbor2.loads(data, max_depth=4, allow_indefinite=False, allow_duplicate_keys=False)
                if _CBOR2_STRICT
                else cbor2.loads(data)  # cbor2 5.x (armv7l); the record's checksum vouches for it
            )
            if not isinstance(obj, dict) or obj.get("v") != 1 or not isinstance(obj.get("entries"), list):
                raise ValueError("not an outbox record")
            entries = []
            for item in obj["entries"]:
                if not isinstance(item, list) or len(item) != 4:
                    raise ValueError("bad entry")
                update_id, round_, payload, sends = item
                if (
                    type(update_id) is not str
                    or _UPDATE_ID_RE.fullmatch(update_id) is None
                    or type(round_) is not int
                    or round_ < 0
                    or type(payload) is not bytes
                    or type(sends) is not int
                    or sends < 0
                ):
                    raise ValueError("bad entry")
                entries.append(OutboxEntry(update_id, round_, payload, sends))
        except (cbor2.CBORDecodeError, ValueError, TypeError) as exc:
            # the checksum matched, so this is a format change, not corruption
            logger.error("outbox %s has an unknown layout (%s); starting empty", self.path, exc)
            return []
        return entries

    def _save(self) -> None:
        obj = {"v": 1, "entries": [[e.update_id, e.round, e.payload, e.sends] for e in self._entries]}
        write_record(self.path, cbor2.dumps(obj))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        """Sum of the kept payloads, bytes."""
        return sum(len(e.payload) for e in self._entries)

    def pending(self) -> list[OutboxEntry]:
        """Updates not yet acknowledged, oldest first (re-send them after a reconnect or restart)."""
        return list(self._entries)

    def add(self, update_id: str, round: int, payload: bytes) -> list[Dropped]:
        """Keep an update until :meth:`ack`; persisted before returning.

        Adding an ``update_id`` already kept is a no-op (the first payload stays: it may already be
        on the wire). Older updates are evicted, oldest first, until the new one fits.

        Parameters
        ----------
        update_id : str
            ``[A-Za-z0-9_.:-]{1,128}``.
        round : int
            Round the update answers, >= 0.
        payload : bytes
            The encoded update, exactly as it will be published.

        Returns
        -------
        list[Dropped]
            What was dropped (each also logged): evicted older updates (``outbox_full``), or the new
            one itself if it alone exceeds ``max_bytes`` (``too_large``, nothing else is touched).

        Raises
        ------
        ValueError
            If ``update_id`` or ``round`` is invalid.
        OSError
            If the outbox cannot be persisted.
        """
        if _UPDATE_ID_RE.fullmatch(update_id) is None:
            raise ValueError(f"update_id = {update_id!r:.80}: must match {_UPDATE_ID_RE.pattern}")
        if round < 0:
            raise ValueError(f"round = {round}: must be >= 0")
        if any(e.update_id == update_id for e in self._entries):
            return []
        if len(payload) > self.max_bytes:
            dropped = [Dropped(update_id, round, "too_large")]
            logger.warning(
                "outbox: update %s (round %d, %d bytes) is larger than the outbox (%d bytes); not kept",
                update_id,
                round,
                len(payload),
                self.max_bytes,
            )
            return dropped
        dropped = []
        total = self.total_bytes
        while self._entries and total + len(payload) > self.max_bytes:
            old = self._entries.pop(0)
            total -= len(old.payload)
            dropped.append(Dropped(old.update_id, old.round, "outbox_full"))
            logger.warning(
                "outbox full: dropped update %s (round %d, %d bytes) for %s",
                old.update_id,
                old.round,
                len(old.payload),
                update_id,
            )
        self._entries.append(OutboxEntry(update_id, round, bytes(payload)))
        self._save()
        return dropped

    def mark_sent(self, update_id: str) -> int:
        """Count one publish attempt of ``update_id`` (persisted); return its attempts, 0 if unknown."""
        for i, e in enumerate(self._entries):
            if e.update_id == update_id:
                self._entries[i] = replace(e, sends=e.sends + 1)
                self._save()
                return e.sends + 1
        return 0

    def ack(self, update_id: str) -> bool:
        """Forget ``update_id`` after its PUBACK; return whether it was kept (persisted)."""
        kept = [e for e in self._entries if e.update_id != update_id]
        if len(kept) == len(self._entries):
            return False
        self._entries = kept
        self._save()
        return True

    def drop_stale(self, current_round: int) -> list[Dropped]:
        """Drop updates for rounds before ``current_round`` (the coordinator refuses them anyway).

        Parameters
        ----------
        current_round : int
            The round now open.

        Returns
        -------
        list[Dropped]
            Each with reason ``stale_round`` (also logged); persisted if anything was dropped.
        """
        stale = [e for e in self._entries if e.round < current_round]
        if not stale:
            return []
        self._entries = [e for e in self._entries if e.round >= current_round]
        self._save()
        for e in stale:
            logger.info(
                "outbox: dropped update %s: round %d closed (now round %d)",
                e.update_id,
                e.round,
                current_round,
            )
        return [Dropped(e.update_id, e.round, "stale_round") for e in stale]
