"""Memory the agent gives back to the kernel: glibc's free heap, and file pages it mapped but does not use.

glibc's malloc settings are here too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path
from typing import Any

_MADV_DONTNEED = 4
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@functools.cache
def _libc() -> Any | None:
    # glibc's soname first: find_library runs ``ldconfig -p`` in a child process (cached: once)
    for name in ("libc.so.6", None):
        try:
            lib = ctypes.CDLL(name if name is not None else ctypes.util.find_library("c"))
        except (OSError, TypeError):
            continue
        if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt"):
            return lib
    return None


def malloc_trim() -> bool:
    """Return free heap memory in glibc's arenas to the kernel: glibc's answer (False without glibc).

    Source: malloc_trim(3).
    """
    lib = _libc()
    return bool(lib.malloc_trim(0)) if lib is not None else False


def apply_hygiene(*, arena_max: int = 2, mmap_threshold_bytes: int | None = None) -> dict[str, bool]:
    """Set glibc malloc options that keep a small process small; which were applied (all False without glibc).

    ``arena_max`` caps the arenas not created yet; a fixed ``mmap_threshold_bytes`` keeps large numpy
    temporaries ``mmap``-ed, back to the kernel when freed (None: glibc's dynamic threshold).

    Source: mallopt(3) (M_ARENA_MAX, M_MMAP_THRESHOLD).
    """
    lib = _libc()
    if lib is None:
        return {"arena_max": False, "mmap_threshold": False}
    done = {"arena_max": bool(lib.mallopt(_M_ARENA_MAX, int(arena_max))), "mmap_threshold": False}
    if mmap_threshold_bytes is not None:
        done["mmap_threshold"] = bool(lib.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes)))
    return done


def readonly_file_rss(*, smaps: str = "/proc/self/smaps") -> dict[tuple[int, int], int]:
    """RSS in bytes of each clean, read-only, private file mapping of this process, by (start, end).

    The mappings :func:`release_file_pages` drops (code ``r-xp``, constants ``r--p``, ``Anonymous: 0
    kB``); empty where ``smaps`` cannot be read.

    Source: proc(5) (smaps: Rss, Anonymous).
    """
    try:
        text = Path(smaps).read_text()
    except OSError:
        return {}
    out: dict[tuple[int, int], int] = {}
    span: tuple[int, int] | None = None
    rss = 0
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            path = head[5] if len(head) == 6 else ""
            start, _, end = head[0].partition("-")
            readonly_file = head[1] in ("r-xp", "r--p") and path.startswith("/")
            span = (int(start, 16), int(end, 16)) if readonly_file else None
            rss = 0
        elif span is not None and head[0] == "Rss:":
            rss = int(head[1]) * 1024
        elif span is not None and head[0] == "Anonymous:":
            if int(head[1]) == 0 and rss > 0:
                out[span] = rss
            span = None
    return out


def release_file_pages(*, smaps: str = "/proc/self/smaps") -> dict[tuple[int, int], int]:
    """Unmap this process's clean, read-only, private file pages (:func:`readonly_file_rss`'s).

    The pages stay in the page cache and a later access maps them again (contents unchanged). Returns
    the ``Rss`` each dropped mapping held, by (start, end) (empty where unavailable).

    Source: madvise(2) (MADV_DONTNEED on a private file mapping: later accesses repopulate from the file).
    """
    lib = _libc()
    madvise = getattr(lib, "madvise", None) if lib is not None else None
    if madvise is None:
        return {}
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mapped = readonly_file_rss(smaps=smaps)
    dropped = {}
    for (start, end), rss in mapped.items():
        if madvise(start, end - start, _MADV_DONTNEED) == 0:
            dropped[(start, end)] = rss
    return dropped
