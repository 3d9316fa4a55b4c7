"""Bound the dashboard's connections at the socket: how many are open, and how long a request may take.

aiohttp's server has no deadline for a request's headers or body and no cap on open connections:
:class:`GuardedSite` serves an aiohttp runner through :class:`ConnectionGuard`, which adds both.

Source: RFC 9112 §2.1 (message format: the header block ends with an empty line), §6.2
(``Content-Length``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

if TYPE_CHECKING:
    from edgefl.dashboard.app import DashboardState

logger = logging.getLogger(__name__)

_HEADER_END = b"\r\n\r\n"
_MAX_HEADER_BYTES = 32_768  # scanned for the end of the header block; aiohttp refuses larger ones itself


#: Seconds after its accept during which a connection without a whole header block is not evicted.
EVICT_MIN_AGE_S = 0.1


def _log_due(n: int) -> bool:
    """Whether the ``n``-th refusal is logged: the 1st, 10th, 100th, 1000th and every 10,000th."""
    return n in (1, 10, 100, 1000) or n % 10_000 == 0


class _Pool:
    """One listening site's open connections by client (``""``: all) and, oldest first, its unproven ones."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}
        self.unproven: dict[ConnectionGuard, None] = {}

    def victim(self, client: str | None, now: float) -> ConnectionGuard | None:
        """The oldest unproven connection (of ``client``, or of anyone) waiting longer than the grace."""
        for conn in self.unproven:
            if now - conn.waiting_since < EVICT_MIN_AGE_S:
                return None  # the rest are younger still
            if client is None or conn.client == client:
                return conn
        return None


class ConnectionGuard(asyncio.Protocol):
    """Wrap aiohttp's per-connection protocol: caps on open connections (in all, per client), deadlines.

    A connection whose header block or ``Content-Length`` body does not arrive in time is closed. At a
    cap, a newcomer takes the place of the oldest connection without a whole header block (older than
    :data:`EVICT_MIN_AGE_S`); one answering or idling between requests is never closed for another.
    """

    _IDLE, _HEAD, _BODY = range(3)

    def __init__(self, inner: asyncio.Protocol, state: DashboardState, pool: _Pool) -> None:
        self.inner = inner
        self.state = state
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.admitted = False  # events go to aiohttp's protocol
        self.counted = False  # holds a place in the pool's counts
        self.waiting_since = 0.0
        self.phase = self._HEAD
        self.head = bytearray()
        self.body_left = 0
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit the connection under the caps (or make room, or abort it) and start its header deadline."""
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        st, pool = self.state, self.pool
        self.waiting_since = time.monotonic()
        if not self._room():
            st.connections_refused_total += 1
            if _log_due(st.connections_refused_total):
                logger.warning(
                    "dashboard: connection from %s refused (%d open, %d from it; %d refused so far)",
                    self.client,
                    pool.open.get("", 0),
                    pool.open.get(self.client, 0),
                    st.connections_refused_total,
                )
            transport.abort()
            return
        self.admitted = self.counted = True
        pool.open[""] = pool.open.get("", 0) + 1
        pool.open[self.client] = pool.open.get(self.client, 0) + 1
        pool.unproven[self] = None
        self._arm(st.header_timeout_s)
        self.inner.connection_made(transport)

    def _room(self) -> bool:
        """Whether this connection fits under the caps, closing an older unproven one if that makes room."""
        st, pool = self.state, self.pool
        for client, cap in ((self.client, st.max_connections_per_client), (None, st.max_connections)):
            if pool.open.get(client or "", 0) < cap:
                continue
            victim = pool.victim(client, self.waiting_since)
            if victim is None:
                return False
            victim.evict()
        return True

    def evict(self) -> None:
        """Close this (unproven) connection to make room for a newcomer; counted as refused."""
        self.state.connections_refused_total += 1
        logger.debug("dashboard: %s sent no request in time, closed for a newcomer", self.client)
        self._uncount()
        if self.transport is not None:
            self.transport.abort()

    def _uncount(self) -> None:
        if not self.counted:
            return
        self.counted = False
        self.pool.unproven.pop(self, None)
        for key in ("", self.client):
            left = self.pool.open.get(key, 1) - 1
            if left > 0:
                self.pool.open[key] = left
            else:
                self.pool.open.pop(key, None)

    def _arm(self, seconds: float | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = None
        if seconds is not None:
            self.timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self.state.connections_timed_out_total += 1
        logger.debug("dashboard: %s too slow (%s), closed", self.client, "body" if self.phase else "headers")
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        """Advance the header/body deadlines over ``data``, then hand it to aiohttp."""
        if not self.admitted:
            return
        self._scan(data)
        self.inner.data_received(data)

    def _scan(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.phase == self._BODY:
                n = min(self.body_left, len(view))
                self.body_left -= n
                view = view[n:]
                if self.body_left == 0:
                    self.phase = self._IDLE
                    self._arm(None)
            elif self.phase == self._IDLE:
                self.phase = self._HEAD  # the first byte of the next request
                self._arm(self.state.header_timeout_s)
                if self.counted:  # until its header block is whole, it may make room for a newcomer
                    self.waiting_since = time.monotonic()
                    self.pool.unproven[self] = None
            else:
                room = _MAX_HEADER_BYTES - len(self.head)
                if room <= 0:
                    return  # an oversized header block: aiohttp answers it; the header deadline still runs
                before = len(self.head)
                self.head += view[:room]
                end = self.head.find(_HEADER_END, max(0, before - 3))
                if end < 0:
                    view = view[room:]
                    continue
                view = view[end + len(_HEADER_END) - before :]
                self.pool.unproven.pop(self, None)  # a whole request: not closed for a newcomer
                self.body_left = _content_length(bytes(self.head[:end]))
                self.head.clear()
                self.phase = self._BODY if self.body_left else self._IDLE
                self._arm(self.state.body_timeout_s if self.body_left else None)

    def eof_received(self) -> bool | None:
        """Pass the end of input to aiohttp (an aborted connection has none)."""
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the deadline, release the connection's place under the caps, tell aiohttp."""
        self._arm(None)
        self._uncount()
        if not self.admitted:
            return
        self.admitted = False
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        """Pass write flow control to aiohttp."""
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        """Pass write flow control to aiohttp."""
        self.inner.resume_writing()


def _content_length(head: bytes) -> int:
    """The ``Content-Length`` of a header block, 0 if absent or unreadable (aiohttp rejects it then)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return max(0, int(value.strip()))
            except ValueError:
                return 0
    return 0


class RequestLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server log for the dashboard: a request it cannot parse is one counted line, no traceback.

    Counted in :attr:`DashboardState.bad_requests_total`, logged now and then (aiohttp still answers it).
    Any other error keeps its traceback.
    """

    def __init__(self, state: DashboardState) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self.state = state

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        """Count a request aiohttp could not parse: one line, no traceback (anything else as usual)."""
        exc = exc_info if isinstance(exc_info, BaseException) else None
        if not isinstance(exc, HttpProcessingError):
            super().exception(msg, *args, exc_info=exc_info, **kwargs)
            return
        st = self.state
        st.bad_requests_total += 1
        n = st.bad_requests_total
        if _log_due(n):
            where = f" from {args[0]}" if args else ""
            logger.warning(
                "dashboard: bad request%s refused: %s %s (%d so far)",
                where,
                exc.code,
                exc.message.splitlines()[0][:120] if exc.message else type(exc).__name__,
                n,
            )


class GuardedSite(web.TCPSite):
    """``web.TCPSite`` whose connections pass through :class:`ConnectionGuard` (aiohttp 3.x)."""

    def __init__(self, runner: web.AppRunner, state: DashboardState, host: str, port: int) -> None:
        super().__init__(runner, host, port)
        self._state = state
        self._pool = _Pool()

    async def start(self) -> None:
        """Listen on the site's address with every connection wrapped in :class:`ConnectionGuard`."""
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None

        def factory() -> asyncio.Protocol:
            return ConnectionGuard(server(), self._state, self._pool)

        self._server = await asyncio.get_running_loop().create_server(
            factory, self._host, self._port, backlog=self._backlog, reuse_address=self._reuse_address
        )
