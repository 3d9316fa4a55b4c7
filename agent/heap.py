"""glibc's heap in a small process: malloc settings at start-up, freed heap returned to the kernel.

Source: mallopt(3), malloc_trim(3).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@functools.cache
def _libc() -> Any | None:
    # cached: find_library runs ``ldconfig -p`` in a child process, and malloc_trim runs after
    # every round (a fork and exec on the round's path: seen with strace)
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


def malloc_trim() -> bool:
    """Return free heap memory at the top and in the middle of glibc's arenas to the kernel.

    Returns
    -------
    bool
        glibc's answer (True: some memory was released); False also where the C library is not
        glibc (musl has no ``malloc_trim``).

    Source: malloc_trim(3).
    """
    lib = _libc()
    return bool(lib.malloc_trim(0)) if lib is not None else False


def apply_hygiene(*, arena_max: int = 2, mmap_threshold_bytes: int | None = None) -> dict[str, bool]:
    """Set glibc malloc options that keep a small process small.

    ``MALLOC_ARENA_MAX`` only takes effect through the environment at start-up (``edgefl/cli.py``
    sets it, with one BLAS thread, before numpy loads); ``mallopt(M_ARENA_MAX)`` does the same for
    arenas not created yet. A fixed ``M_MMAP_THRESHOLD`` stops glibc from raising the threshold
    after each large free, so large numpy temporaries stay ``mmap``-ed and go back to the kernel
    when freed instead of staying in the heap.

    Parameters
    ----------
    arena_max : int
        Maximum number of malloc arenas (threads share them beyond this).
    mmap_threshold_bytes : int, optional
        Fixed mmap threshold (e.g. 131072); None leaves glibc's dynamic threshold.

    Returns
    -------
    dict[str, bool]
        Which settings were applied (``arena_max``, ``mmap_threshold``); all False without glibc.

    Source: mallopt(3) (M_ARENA_MAX, M_MMAP_THRESHOLD).
    """
    lib = _libc()
    if lib is None:
        return {"arena_max": False, "mmap_threshold": False}
    done = {"arena_max": bool(lib.mallopt(_M_ARENA_MAX, int(arena_max)))}
    done["mmap_threshold"] = (
        bool(lib.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes)))
        if mmap_threshold_bytes is not None
        else False
    )
    return done
