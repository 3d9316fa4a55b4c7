"""Reading the process's memory from the kernel: RSS, peak RSS, PSS, MemAvailable and the cgroup limit.

Source: proc(5) (``statm``, ``status`` VmHWM, ``smaps_rollup``, ``clear_refs`` value 5 resets the
peak RSS, Linux >= 4.0), Documentation/admin-guide/cgroup-v2.rst (``memory.max``) and cgroup-v1
memory.rst (``memory.limit_in_bytes``).
"""

from __future__ import annotations

import os
from pathlib import Path

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# cgroup v1 reports "no limit" as a huge page-aligned number (PAGE_COUNTER_MAX * page size).
_V1_UNLIMITED = 1 << 62


# --- /proc readers ------------------------------------------------------------------------------
def _read_proc(proc: Path, pid: int | str | None, filename: str) -> str:
    """The text of ``<proc>/[<pid>/]<filename>`` (each file read here is under 4 KiB), or OSError."""
    # one read on a raw descriptor: half of Path.read_text's CPU (the governor reads 4 a classified batch)
    fd = os.open(
        f"{proc}/{filename}" if pid is None else f"{proc}/{pid}/{filename}", os.O_RDONLY | os.O_CLOEXEC
    )
    try:
        return os.read(fd, 1 << 16).decode("ascii", "replace")
    finally:
        os.close(fd)


def rss_bytes(pid: int | str = "self", *, proc: Path = PROC) -> int:
    """Resident set size of a process, in bytes (``/proc/<pid>/statm`` field 2 x page size).

    OSError if the process does not exist or ``/proc`` is unavailable.
    """
    fields = _read_proc(proc, pid, "statm").split()
    return int(fields[1]) * PAGE_BYTES


def _kb_field(proc: Path, pid: int | str | None, filename: str, key: str) -> int:
    """Bytes of the ``key:   N kB`` line of ``<proc>/[<pid>/]<filename>``; OSError if there is none."""
    text = "\n" + _read_proc(proc, pid, filename)  # a key on the first line is found too
    at = text.find(f"\n{key}:")
    if at < 0:
        raise OSError(f"{proc if pid is None else proc / str(pid)}/{filename} has no {key}")
    end = text.find("\n", at + 1)
    return int(text[at + len(key) + 2 : end if end >= 0 else None].split()[0]) * 1024


def peak_rss_bytes(pid: int | str = "self", *, proc: Path = PROC) -> int:
    """Peak RSS (``VmHWM``) of a process since start or the last reset, bytes (``Governor``: lifetime).

    OSError if the process does not exist or the kernel does not report ``VmHWM``.
    """
    return _kb_field(proc, pid, "status", "VmHWM")


def pss_bytes(pid: int | str = "self", *, proc: Path = PROC) -> int | None:
    """Proportional set size from ``/proc/<pid>/smaps_rollup`` in bytes, or None where not readable."""
    try:
        return _kb_field(proc, pid, "smaps_rollup", "Pss")
    except OSError:
        return None


def system_available_bytes(*, proc: Path = PROC) -> int:
    """The system's ``MemAvailable`` from ``/proc/meminfo``, in bytes.

    OSError if ``/proc/meminfo`` has no ``MemAvailable`` line (kernels before 3.14).
    """
    return _kb_field(proc, None, "meminfo", "MemAvailable")


def reset_peak(*, proc: Path = PROC) -> bool:
    """Reset the process's peak RSS (``VmHWM``) to its current RSS; False where the kernel refuses.

    Source: proc(5), ``/proc/<pid>/clear_refs``: writing 5 resets the peak resident set size.
    """
    try:
        fd = os.open(f"{proc}/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
        try:
            return os.write(fd, b"5") == 1
        finally:
            os.close(fd)
    except OSError:
        return False


# --- cgroup limit -------------------------------------------------------------------------------
def _read_limit(path: Path) -> int | None:
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):  # unreadable, empty, or "max" (v2's no limit)
        return None
    return None if value >= _V1_UNLIMITED or value <= 0 else value


def _min_up(mount: Path, rel: str, filename: str) -> int | None:
    """Lowest limit on the path from the process's cgroup up to the mount's root (ancestors apply too)."""
    rel = rel.strip("/")
    parts = rel.split("/") if rel else []
    found: list[int] = []
    # In a cgroup namespace (containers) /proc/self/cgroup says "/" while the mount is the cgroup
    # itself; when the full path is missing, fall back to the mount root alone.
    if not (mount / rel).is_dir():
        parts = []
    for depth in range(len(parts), -1, -1):
        limit = _read_limit(mount.joinpath(*parts[:depth]) / filename)
        if limit is not None:
            found.append(limit)
    return min(found) if found else None


def cgroup_memory_limit_bytes(
    *, proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT, pid: int | str = "self"
) -> int | None:
    """The memory limit the kernel enforces on a process's cgroup, in bytes, or None when unlimited.

    The lowest ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1) of the process's cgroup and its
    ancestors, on either hierarchy; None also when nothing is readable (``proc``, ``cgroup_root``:
    where those file systems are mounted).

    Source: Documentation/admin-guide/cgroup-v2.rst (memory.max); cgroup-v1/memory.rst
    (memory.limit_in_bytes, hierarchical accounting).
    """
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hier == "0" and controllers == "":
            for mount in (cgroup_root, cgroup_root / "unified"):
                if (mount / "cgroup.controllers").exists():
                    v2 = _min_up(mount, rel, "memory.max")
                    if v2 is not None:
                        limits.append(v2)
                    break
        elif "memory" in controllers.split(","):
            v1 = _min_up(cgroup_root / "memory", rel, "memory.limit_in_bytes")
            if v1 is not None:
                limits.append(v1)
    return min(limits) if limits else None
