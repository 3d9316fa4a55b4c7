"""Small asyncio helpers shared by the agent and the coordinator."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` seconds pass; never swallow a cancellation.

    ``asyncio.wait_for`` on Python 3.11 can lose a ``cancel()`` that arrives just as the awaited
    future completes (CPython gh-86296, fixed in 3.12 by re-implementing it on ``asyncio.timeout``):
    a loop around it then never stops and the process ignores SIGTERM. ``asyncio.timeout`` does not.

    Parameters
    ----------
    event : asyncio.Event
    timeout_s : float
        Seconds (> 0).

    Returns
    -------
    True if the event is set, False on timeout.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """Await ``aw`` for at most ``timeout_s`` seconds (``asyncio.timeout``; see :func:`wait_event`).

    Raises
    ------
    TimeoutError
        If ``aw`` did not finish in time.
    """
    async with asyncio.timeout(timeout_s):
        return await aw
