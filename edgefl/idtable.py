"""The latest ids seen (samples, updates), in fixed arrays: a duplicate check whose memory never grows."""

from __future__ import annotations

import numpy as np


class IdTable:
    """The latest ``capacity`` (>= 1, else ValueError) ids in a fixed ring, optionally with a value and time.

    An id is kept as its 64-bit ``hash`` (SipHash, keyed per process): 8 bytes an entry (18 with
    ``values``: an int16 value and a float64 time, :meth:`get`), nothing allocated per id; two ids are
    mistaken for one another with a probability of about ``capacity / 2**64`` a lookup.
    """

    def __init__(self, capacity: int, *, values: bool = True) -> None:
        if capacity < 1:
            raise ValueError(f"IdTable: capacity {capacity} must be >= 1")
        self._hash = np.zeros(capacity, dtype=np.int64)  # 0: an empty slot
        self._value = np.zeros(capacity if values else 0, dtype=np.int16)
        self._since = np.zeros(capacity if values else 0, dtype=np.float64)
        self._next = 0

    @staticmethod
    def _key(item: str) -> int:
        h = hash(item)
        return h if h != 0 else 1

    def _find(self, item: str) -> int:
        """The slot holding ``item``, or -1."""
        found = np.flatnonzero(self._hash == self._key(item))
        return int(found[-1]) if len(found) else -1

    def __contains__(self, item: str) -> bool:
        return self._find(item) >= 0

    def __len__(self) -> int:
        return int(np.count_nonzero(self._hash))

    def add(self, item: str, value: int = 0, since: float = 0.0) -> None:
        """Store ``item`` (with ``value`` and ``since``) as the newest entry, dropping an older one of it."""
        old = self._find(item)
        if old >= 0:
            self._hash[old] = 0
        i = self._next
        self._hash[i] = self._key(item)
        if len(self._value):
            self._value[i] = value
            self._since[i] = since
        self._next = (i + 1) % len(self._hash)

    def get(self, item: str) -> tuple[int, float] | None:
        """``(value, since)`` of ``item``, or None when it is not held."""
        i = self._find(item)
        return None if i < 0 else (int(self._value[i]), float(self._since[i]))

    def set_value(self, item: str, value: int) -> None:
        """Change the value of a held ``item`` in place (its age unchanged); nothing if it is not held."""
        i = self._find(item)
        if i >= 0:
            self._value[i] = value

    def forget_until(self, limit: float) -> None:
        """Drop every entry whose time is ``<= limit``."""
        self._hash[(self._since <= limit) & (self._hash != 0)] = 0
