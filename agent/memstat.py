"""Reading the process's memory from the kernel: RSS, peak RSS, PSS, MemAvailable and the cgroup limit.

Source: proc(5) (``statm``, ``status`` VmHWM, ``smaps_rollup``, ``clear_refs`` value 5 resets the
peak RSS, Linux >= 4.0), Documentation/admin-guide/cgroup-v2.rst (``memory.max``) and cgroup-v1
memory.rst (``memory.limit_in_bytes``).
"""

from __future__ import annotations

import os
import threading
from contextlib import suppress
from pathlib import Path
from typing import Final

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# cgroup v1 reports "no limit" as a huge page-aligned number (PAGE_COUNTER_MAX * page size).
_V1_UNLIMITED = 1 << 62


# --- /proc readers ------------------------------------------------------------------------------
_OWN_FILES_LOCK = threading.Lock()
_own_fds: dict[str, tuple[int, tuple[int, int]]] = {}  # name -> (descriptor, (device, inode))
# what each kept file starts with: a descriptor whose number was closed and reused under us reads
# something else, and is dropped rather than trusted (statm starts with a digit)
_OWN_HEADS: Final = {"self/status": "Name:", "meminfo": "MemTotal:", "self/statm": ""}


def _forget_own_fds() -> None:
    """In a forked child (``os.register_at_fork``): the kept descriptors name the parent's files."""
    global _OWN_FILES_LOCK
    _OWN_FILES_LOCK = threading.Lock()  # another thread may have held the parent's at the fork
    for inherited, _ in _own_fds.values():
        with suppress(OSError):
            os.close(inherited)
    _own_fds.clear()


os.register_at_fork(after_in_child=_forget_own_fds)


def _own_fd(name: str, flags: int = os.O_RDONLY) -> tuple[int, tuple[int, int]]:
    """A descriptor kept open on ``/proc/<name>`` and its (device, inode); OSError if it cannot be opened."""
    with _OWN_FILES_LOCK:
        kept = _own_fds.get(name)
        if kept is None:
            fd = os.open(f"/proc/{name}", flags | os.O_CLOEXEC)
            st = os.fstat(fd)
            kept = _own_fds[name] = (fd, (st.st_dev, st.st_ino))
        return kept


def _write_own(name: str, data: bytes) -> bool:
    """Write ``data`` on the kept descriptor of ``/proc/<name>`` if it still names it; whether written."""
    try:
        fd, ident = _own_fd(name, os.O_WRONLY)
        st = os.fstat(fd)
        written = (st.st_dev, st.st_ino) == ident and os.write(fd, data) == len(data)
    except OSError:
        written = False
    if not written:
        _drop_own_fd(name)  # opened again next time; the caller falls back to a plain write
    return written


def _drop_own_fd(name: str) -> None:
    """Forget a kept descriptor that failed or reads another file, without closing it (it may be reused)."""
    with _OWN_FILES_LOCK:
        _own_fds.pop(name, None)


def _read_proc(proc: Path, pid: int | str | None, filename: str) -> str:
    """The text of ``<proc>/[<pid>/]<filename>``, or OSError (own files: on a kept descriptor)."""
    name = filename if pid is None else f"self/{filename}"
    # "is" first: a Path comparison costs more than the kept read it selects (a dozen a round)
    head = _OWN_HEADS.get(name) if (proc is PROC or proc == PROC) and pid in ("self", None) else None
    if head is not None:
        try:
            text = os.pread(_own_fd(name)[0], 16384, 0).decode("ascii", "replace")
        except OSError:
            text = ""
        if text.startswith(head) and (head or text[:1].isdigit()):
            return text
        _drop_own_fd(name)  # opened again next time (or the plain read below says why it fails)
    path = proc / filename if pid is None else proc / str(pid) / filename
    return path.read_text()


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
    if (proc is PROC or proc == PROC) and _write_own("self/clear_refs", b"5"):
        return True
    try:
        with open(proc / "self" / "clear_refs", "w") as f:
            f.write("5")
        return True
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
