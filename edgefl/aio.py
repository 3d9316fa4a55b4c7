"""Small asyncio helpers shared by the agent and the coordinator."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set (True) or ``timeout_s`` seconds pass (False); never lose a cancellation.

    ``asyncio.wait_for`` on Python 3.11 can lose a ``cancel()`` that arrives as the future completes
    (CPython gh-86296), and a loop around it then ignores SIGTERM; ``asyncio.timeout`` does not.
    """
    if event.is_set():
        return True  # as event.wait() would, without arming and cancelling a timer
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """Await ``aw`` for at most ``timeout_s`` seconds (TimeoutError), as :func:`wait_event` does."""
    async with asyncio.timeout(timeout_s):
        return await aw
