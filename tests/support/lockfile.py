"""Read a wheelhouse's ``requirements.lock`` back as ``cross_build.lock.format_lock`` wrote it."""

from __future__ import annotations

import re

from packaging.utils import canonicalize_name

from cross_build.lock import LockEntry

_LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s+--hash=sha256:([0-9a-f]{64})$")


def parse_lock(text: str) -> list[LockEntry]:
    """Parse ``requirements.lock``: the entries in file order.

    ValueError, naming the line number, for a line that is neither blank, a comment, nor
    ``name==version --hash=sha256:<64 hex>``.
    """
    out: list[LockEntry] = []
    last_comment = ""
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            last_comment = line[1:].strip()
            continue
        m = _LOCK_LINE.match(line)
        if m is None:
            raise ValueError(
                f"requirements.lock line {i}: expected name==version --hash=sha256:<hex>: {line!r}"
            )
        filename = last_comment if last_comment.endswith(".whl") else ""
        out.append(LockEntry(str(canonicalize_name(m.group(1))), m.group(2), m.group(3), filename))
        last_comment = ""
    return out
