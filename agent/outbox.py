"""The device's outbox: each update kept on disk until the broker acknowledged it (PUBACK).

An update survives a reconnect or a restart and is re-sent with the same ``update_id``; bounded in
bytes. The record (:func:`edgefl.records.write_record`) is a CBOR map ``{"v": 1, "entries":
[[update_id, round, payload, sends], ...], "answered": {...}, "residual": bytes}``: the last answered
round and the error-feedback residual (opaque here) are written with the update.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import cbor2

from edgefl.records import read_record, write_record
from edgefl.wire.cbor import strict_loads
from edgefl.wire.rounds import UPDATE_ID_RE

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Dropped:
    """An update the outbox gave up on.

    ``reason``: ``"outbox_full"`` (evicted to make room, oldest first), ``"too_large"`` (larger than
    the whole outbox) or ``"stale_round"`` (its round closed).
    """

    update_id: str
    round: int
    reason: str


@dataclass(frozen=True, slots=True)
class Answered:
    """The last round this device answered, kept in the outbox record's ``answered`` key.

    A CBOR map ``{"v": 1, "fleet": str, "round": int, "update_id": str}`` written with the round's
    update (or Decline); the device core ignores one for another fleet.
    """

    fleet: str
    round: int
    update_id: str


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """One update waiting for its PUBACK.

    ``update_id`` is re-sent unchanged (the coordinator de-duplicates by it); ``round`` >= 0;
    ``payload`` the encoded, signed Update as published; ``sends`` the publish attempts so far.
    """

    update_id: str
    round: int
    payload: bytes
    sends: int = 0


class Outbox:
    """Updates kept until acknowledged, persisted as a record in the state directory.

    ``path`` (e.g. ``<state_dir>/outbox.rec``; its folder is created) is loaded now, a torn file
    falling back to the previous generation; ``max_bytes`` >= 1 bounds the sum of the kept payloads
    (else ``ValueError``). ``OSError`` if the state directory cannot be created.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes = {max_bytes}: must be >= 1")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.answered: Answered | None = None
        """The last answered round (of any fleet), kept by every write; None if none or unreadable."""
        self.residual: bytes | None = None
        """The error-feedback residual of the last answer, kept by every write (``edgefl.agent.feedback``)."""
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
            obj = strict_loads(data, max_depth=4)  # on cbor2 5.x the record's checksum vouches for it
            if not isinstance(obj, dict) or obj.get("v") != 1 or not isinstance(obj.get("entries"), list):
                raise ValueError("not an outbox record")
            entries = []
            for item in obj["entries"]:
                if not isinstance(item, list) or len(item) != 4:
                    raise ValueError("bad entry")
                update_id, round_, payload, sends = item
                if (
                    type(update_id) is not str
                    or UPDATE_ID_RE.fullmatch(update_id) is None
                    or type(round_) is not int
                    or round_ < 0
                    or type(payload) is not bytes
                    or type(sends) is not int
                    or sends < 0
                ):
                    raise ValueError("bad entry")
                entries.append(OutboxEntry(update_id, round_, payload, sends))
            answered = obj.get("answered")
            if answered is not None and not isinstance(answered, dict):
                raise ValueError("bad answered-round map")
            residual = obj.get("residual")
            if residual is not None and type(residual) is not bytes:
                raise ValueError("bad residual")
        except (cbor2.CBORDecodeError, ValueError, TypeError) as exc:
            # the checksum matched, so this is a format change, not corruption
            logger.error("outbox %s has an unknown layout (%s); starting empty", self.path, exc)
            return []
        self.answered, self.residual = self._answered_of(answered), residual
        return entries

    def _answered_of(self, obj: dict[str, Any] | None) -> Answered | None:
        """The :class:`Answered` of a record's map (None, logged, if absent or of an unknown layout)."""
        if obj is None:
            return None
        fleet = round_no = update_id = None
        if obj.get("v") == 1:
            fleet, round_no, update_id = obj.get("fleet"), obj.get("round"), obj.get("update_id")
        if type(fleet) is not str or type(round_no) is not int or round_no < 0 or type(update_id) is not str:
            logger.error("outbox %s: the answered round has an unknown layout; ignored", self.path)
            return None
        return Answered(fleet, round_no, update_id)

    def save(self) -> None:
        """Persist the entries as they are in memory (``OSError`` if the file system refuses)."""
        obj: dict[str, Any] = {
            "v": 1,
            "entries": [[e.update_id, e.round, e.payload, e.sends] for e in self._entries],
        }
        if (a := self.answered) is not None:
            obj["answered"] = {"v": 1, "fleet": a.fleet, "round": a.round, "update_id": a.update_id}
        if self.residual is not None:
            obj["residual"] = self.residual
        write_record(self.path, cbor2.dumps(obj))

    def forget(self, update_id: str) -> bool:
        """Drop ``update_id`` from memory only (acknowledged, or not persisted); whether it was kept."""
        kept = [e for e in self._entries if e.update_id != update_id]
        found = len(kept) != len(self._entries)
        self._entries = kept
        return found

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        """Sum of the kept payloads, bytes."""
        return sum(len(e.payload) for e in self._entries)

    def pending(self) -> list[OutboxEntry]:
        """Updates not yet acknowledged, oldest first (re-send them after a reconnect or restart)."""
        return list(self._entries)

    def add(
        self,
        update_id: str,
        round: int,
        payload: bytes,
        sends: int = 0,
        answered: Answered | None = None,
    ) -> list[Dropped]:
        """Keep an update (fields as :class:`OutboxEntry`'s) until acknowledged; persisted before returning.

        An ``update_id`` already kept keeps its first payload (it may be on the wire). ``answered``:
        the new answered round (:attr:`answered`), persisted by the same write even when the
        update is not kept.

        Returns what was dropped (each logged): older updates evicted oldest first until the new one
        fits (``outbox_full``), or the new one alone if it exceeds ``max_bytes`` (``too_large``).
        ``ValueError`` if ``update_id`` or ``round`` is invalid, ``OSError`` if it cannot be persisted.
        """
        if UPDATE_ID_RE.fullmatch(update_id) is None:
            raise ValueError(f"update_id = {update_id!r:.80}: must match {UPDATE_ID_RE.pattern}")
        if round < 0:
            raise ValueError(f"round = {round}: must be >= 0")
        known = any(e.update_id == update_id for e in self._entries)
        if known or len(payload) > self.max_bytes:
            if not known:
                logger.warning(
                    "outbox: update %s (round %d, %d bytes) is larger than the outbox (%d bytes); not kept",
                    update_id,
                    round,
                    len(payload),
                    self.max_bytes,
                )
            if answered is not None:
                self._save_answered(answered)
            return [] if known else [Dropped(update_id, round, "too_large")]
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
        self._entries.append(OutboxEntry(update_id, round, bytes(payload), sends))
        self._save_answered(answered)
        return dropped

    def _save_answered(self, answered: Answered | None) -> None:
        """Save, with a new answered round if given; on failure the previous one stays (not answered)."""
        prior, self.answered = self.answered, self.answered if answered is None else answered
        try:
            self.save()
        except OSError:
            self.answered = prior
            raise

    def mark_sent(self, update_id: str) -> int:
        """Count one publish attempt of ``update_id`` (persisted in any case); its attempts, 0 if unknown."""
        sends = 0
        for i, e in enumerate(self._entries):
            if e.update_id == update_id:
                sends = e.sends + 1
                self._entries[i] = replace(e, sends=sends)
        self.save()
        return sends

    def drop_stale(self, current_round: int) -> list[Dropped]:
        """Drop (logged) updates of rounds before ``current_round``: ``stale_round`` each (persisted)."""
        stale = [e for e in self._entries if e.round < current_round]
        self._entries = [e for e in self._entries if e.round >= current_round]
        self.save()
        for e in stale:
            logger.info(
                "outbox: dropped update %s: round %d closed (now round %d)",
                e.update_id,
                e.round,
                current_round,
            )
        return [Dropped(e.update_id, e.round, "stale_round") for e in stale]
