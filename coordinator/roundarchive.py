"""The fleet page's long round history: the round log read back, its tail whole and the rest sampled.

:class:`RoundArchive` serves ``/api/rounds`` from the round log (``files.log``, never trimmed) and the
coordinator's in-memory records, with bounded memory and response whatever the log's length
(``docs/operations.md``, "The dashboard's routes").
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Final

logger = logging.getLogger(__name__)

TAIL_ROUNDS: Final = 1000
"""Rounds at the end of the log served whole (the fleet page's largest window but "all")."""

SAMPLED_ROUNDS: Final = 1000
"""Rounds served from the rest of the log, evenly spaced (the page draws "all" from them)."""

TAIL_BYTES_MAX: Final = 4 << 20
"""Most bytes read from the end of the log for its tail (long ``update_ids`` lines: fewer rounds whole)."""

_BLOCK: Final = 64 << 10

REASON_KEYS: Final = ("refused", "declined", "silent", "silent_devices")
"""A round's reasons, kept in memory only by the process that closed it (the round log has them)."""

#: A log line's keys the page reads, copied as they are (``docs/operations.md``, "The round log").
PAGE_KEYS: Final = (
    "round",
    "time",
    "asked",
    "counted",
    "accuracy",
    "fed_accuracy",
    "fed_worst_decile",
    "fed_devices",
    "update_bytes_mean",
    "duration_s",
    "lr",
    "new_samples",
    "round_refused",
    "refused",
    "declined",
    "silent",
    "silent_devices",
    "clipped",
    "epsilon",
    "delta",
)


def page_entry(line: bytes) -> dict[str, Any] | None:
    """One round log line as the fleet page's round record (None: not a round's line).

    The log's ``declined`` is ``{reason: n}``; ``declined_devices`` (the page's count) is their sum.
    """
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("round"), int) or isinstance(doc["round"], bool):
        return None
    entry = {k: doc[k] for k in PAGE_KEYS if k in doc}
    declined = doc.get("declined")
    if isinstance(declined, dict):
        entry["declined_devices"] = sum(v for v in declined.values() if isinstance(v, int))
    return entry


def read_tail(
    f: BinaryIO, size: int, rounds: int, max_bytes: int = TAIL_BYTES_MAX
) -> tuple[list[bytes], int]:
    """The last ``rounds`` whole lines of a file of ``size`` bytes, reading at most ``max_bytes`` back.

    Returns ``(lines, start)``: the lines oldest first (without their newline; an unterminated last
    line left out) and the offset where the first one begins (``size`` when none).
    """
    pos, chunks, newlines = size, [], 0
    while pos > 0 and newlines <= rounds and size - pos < max_bytes:
        step = min(_BLOCK, pos, max_bytes - (size - pos))
        pos -= step
        f.seek(pos)
        chunk = f.read(step)
        chunks.append(chunk)
        newlines += chunk.count(b"\n")
    buf = b"".join(reversed(chunks))
    buf = buf[: buf.rfind(b"\n") + 1]  # a line still being written is not a round yet
    if pos > 0:  # the first piece may be the end of a line begun before ``pos``: left to the sample
        cut = buf.find(b"\n") + 1
        buf, pos = buf[cut:], pos + cut
    lines = buf.split(b"\n")[:-1]
    if len(lines) > rounds:
        skip = len(lines) - rounds
        pos += sum(len(line) + 1 for line in lines[:skip])
        lines = lines[skip:]
    return lines, pos if lines else size


def read_sample(f: BinaryIO, end: int, points: int) -> list[bytes]:
    """One whole line at each of ``points`` evenly spaced offsets of the file's first ``end`` bytes.

    The line read at an offset is the first one that begins at or after it (and before ``end``);
    lines met twice are kept once. Returns them oldest first.
    """
    out: list[bytes] = []
    last = -1
    for k in range(points):
        off = end * k // points
        f.seek(max(0, off - 1))
        if off > 0:
            f.readline()  # the rest of the line the offset falls in (or the newline just before it)
        at = f.tell()
        if at >= end or at <= last:
            continue
        line = f.readline()
        if not line.endswith(b"\n"):
            break
        out.append(line[:-1])
        last = at
    return out


class RoundArchive:
    """The fleet page's rounds: the round log's history before the in-memory records, then those.

    ``log``: the round log (``files.log``; missing or unreadable: the in-memory records only);
    ``recent()``: the coordinator's in-memory page records, oldest first (``Coordinator.dashboard_rounds``).
    """

    def __init__(
        self,
        log: Path,
        recent: Callable[[], Sequence[Mapping[str, Any]]],
        tail_rounds: int = TAIL_ROUNDS,
        sampled_rounds: int = SAMPLED_ROUNDS,
    ) -> None:
        self.log = log
        self.recent = recent
        self.tail_rounds = tail_rounds
        self.sampled_rounds = sampled_rounds
        self._lock = threading.Lock()
        self._cached: tuple[tuple[int, int, int], list[dict[str, Any]]] | None = None
        self._joined: tuple[list[dict[str, Any]], object, int, list[Mapping[str, Any]]] | None = None
        self._flight: tuple[tuple[int, int, int] | None, asyncio.Future[list[dict[str, Any]]]] | None = None

    def _log_key(self) -> tuple[int, int, int] | None:
        """The log's (inode, size, mtime ns), None when it cannot be stat'ed."""
        try:
            st = os.stat(self.log)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _older(self) -> list[dict[str, Any]]:
        """The log's page entries (sampled, then the tail), oldest first; reused while it is unchanged."""
        with self._lock:
            key = self._log_key()
            if key is not None and self._cached is not None and self._cached[0] == key:
                return self._cached[1]
            older: list[dict[str, Any]] = []
            try:
                with open(self.log, "rb") as f:
                    st = os.fstat(f.fileno())
                    size = st.st_size
                    tail, start = read_tail(f, size, self.tail_rounds)
                    sampled = read_sample(f, start, self.sampled_rounds) if start > 0 else []
            except OSError as exc:
                if not isinstance(exc, FileNotFoundError):
                    logger.warning("round log %s not read for the fleet page: %s", self.log, exc)
                self._cached = None
                return older
            for line in sampled:
                entry = page_entry(line)
                if entry is not None:
                    entry["sampled"] = True
                    older.append(entry)
            older.extend(e for line in tail if (e := page_entry(line)) is not None)
            # keyed by what was read: a line appended meanwhile makes the next request read again
            self._cached = ((st.st_ino, size, st.st_mtime_ns), older)
            return older

    @staticmethod
    def _join(older: list[dict[str, Any]], recent: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        first = recent[0].get("round") if recent else None
        if isinstance(first, int):
            # the rounds before this process's start are in memory without their refusals, declines
            # and silent devices (the state file does not keep them): the log's line has them
            logged = {e["round"]: e for e in older if e["round"] >= first}
            recent = [
                {**{k: logged[r["round"]][k] for k in REASON_KEYS if k in logged[r["round"]]}, **r}
                if "refused" not in r and r.get("round") in logged
                else r
                for r in recent
            ]
            older = [e for e in older if e["round"] < first]
        return _increasing([*older, *recent])

    async def records_async(self) -> list[Mapping[str, Any]]:
        """The page's round records, oldest first, strictly increasing rounds (the latest history's).

        The log's last ``tail_rounds`` whole, ``sampled_rounds`` evenly spaced before them (marked
        ``"sampled": true``), then the in-memory records (a log line of their rounds is left to them).
        The log is read in a worker thread, once for concurrent callers; the in-memory records are taken
        on the loop; while neither the log nor the in-memory list (same object, same length) changed,
        the same list object is returned.
        """
        key = self._log_key()
        cached = self._cached
        if key is not None and cached is not None and cached[0] == key:
            older = cached[1]
        else:
            flight = self._flight
            if flight is None or flight[0] != key or flight[1].done():
                fut = asyncio.ensure_future(asyncio.to_thread(self._older))
                flight = self._flight = (key, fut)
            older = await asyncio.shield(flight[1])
        recent = self.recent()
        joined = self._joined
        if joined is not None and joined[0] is older and joined[1] is recent and joined[2] == len(recent):
            return joined[3]  # the same list object while nothing changed (the page's responses are reused)
        out = self._join(older, list(recent))
        self._joined = (older, recent, len(recent), out)
        return out


def _increasing(records: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The newest records whose rounds increase strictly (a round twice keeps its later line).

    Rounds of an earlier history (a log that outlived its state file) end the run.
    """
    out: list[Mapping[str, Any]] = []
    for rec in reversed(records):
        r = rec.get("round")
        if not isinstance(r, int):
            continue
        if out and r >= out[-1]["round"]:
            if r == out[-1]["round"]:
                continue  # the same round again, older: the later line stays
            break  # an earlier history
        out.append(rec)
    out.reverse()
    return out
