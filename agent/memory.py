"""Memory measurement of the agent process, read from ``/proc`` (Linux).

All figures are in bytes. Reading ``/proc/self/statm`` is cheap (one short read) and is used on hot
paths; ``/proc/self/status`` gives the kernel's peak RSS (``VmHWM``).

Source: proc(5), Linux man-pages.
"""

from __future__ import annotations

import os
from pathlib import Path

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process, in bytes (``/proc/<pid>/statm`` field 2 x page size).

    Raises
    ------
    OSError
        If the process does not exist or ``/proc`` is unavailable.
    """
    fields = Path(f"/proc/{pid}/statm").read_text().split()
    return int(fields[1]) * PAGE_BYTES


def _status_kb(pid: int | str, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/{pid}/status has no {key}")


def peak_rss_bytes(pid: int | str = "self") -> int:
    """Peak resident set size (``VmHWM``) of a process since start or the last peak reset, in bytes.

    Raises
    ------
    OSError
        If the process does not exist or the kernel does not report ``VmHWM``.
    """
    return _status_kb(pid, "VmHWM")


def pss_bytes(pid: int | str = "self") -> int | None:
    """Proportional set size from ``/proc/<pid>/smaps_rollup`` in bytes, or None where not readable."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def system_available_bytes() -> int:
    """The system's ``MemAvailable`` from ``/proc/meminfo``, in bytes.

    Raises
    ------
    OSError
        If ``/proc/meminfo`` has no ``MemAvailable`` line (kernels before 3.14).
    """
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")
