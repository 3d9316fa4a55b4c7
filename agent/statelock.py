"""One process per state folder: an exclusive ``flock`` on ``<state_dir>/agent.lock``.

The lock is held for the life of the process and dropped by the kernel however it exits, so a stale
lock file never blocks.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import IO

from edgefl.errors import EdgeflError

LOCK_FILE = "agent.lock"
"""Name of the lock file inside the state folder; it holds the owner's pid as decimal text."""


class StateDirBusy(EdgeflError):
    """Another live process holds the state folder's lock (``edgefl run`` exits 1, a config error).

    ``pid``: the one the holder wrote, None if it could not be read.
    """

    def __init__(self, state_dir: Path, pid: int | None, owner: str = "agent") -> None:
        who = f"pid {pid}" if pid is not None else "a process whose pid is unknown"
        hint = (
            "give each agent its own folder (device.state_dir, or a distinct device.id with the default "
            "state/<device.id>)"
            if owner == "agent"
            else f"one {owner} per state folder"
        )
        super().__init__(f"state folder {state_dir} is in use by another {owner} ({who}); {hint}")
        self.state_dir = state_dir
        self.pid = pid


def lock_state_dir(state_dir: Path, *, lock_file: str = LOCK_FILE, owner: str = "agent") -> IO[str]:
    """Take the exclusive lock of ``state_dir`` (created if missing) and write our pid into it.

    ``owner`` names the holder in the error (``"agent"``, ``"coordinator"``). Returns the open lock
    file: keep it for as long as the lock must be held (closing it releases it).

    Raises :class:`StateDirBusy` at once if another process holds the lock, ``OSError`` if the folder
    or the lock file cannot be created. Source: ``flock(2)`` (Linux man-pages), ``LOCK_EX | LOCK_NB``.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / lock_file
    handle = open(path, "a+", encoding="ascii")  # noqa: SIM115 - held for the process's life
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            handle.close()
            raise
        handle.seek(0)
        text = handle.read().strip()
        handle.close()
        raise StateDirBusy(state_dir, int(text) if text.isdecimal() else None, owner) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
