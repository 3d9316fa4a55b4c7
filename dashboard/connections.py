"""Bound the dashboard's connections at the socket: how many are open, and how long a request may take.

aiohttp's server has an idle keep-alive timeout but no deadline for a request's headers or body, and no
cap on open connections. :class:`GuardedSite` serves an aiohttp runner through :class:`ConnectionGuard`,
which closes a connection over :attr:`~edgefl.dashboard.app.DashboardState.max_connections` (or the
per-client cap) at once, and one whose header block or body does not arrive in time.

Source: RFC 9112 §2.1 (message format: the header block ends with an empty line), §6.2
(``Content-Length``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from edgefl.dashboard.app import DashboardState

logger = logging.getLogger(__name__)

_HEADER_END = b"\r\n\r\n"
_MAX_HEADER_BYTES = 32_768  # scanned for the end of the header block; aiohttp refuses larger ones itself


class ConnectionGuard(asyncio.Protocol):
    """Wrap aiohttp's per-connection protocol: connection caps and header/body deadlines.

    aiohttp's server has an idle keep-alive timeout but no deadline for a request's headers or body, so
    1,100 half-open connections used to hold 1,100 file descriptors for ever (``EMFILE``). This wrapper
    closes a connection over :attr:`DashboardState.max_connections` (or the per-client cap) at once,
    and one whose header block (up to its empty line, RFC 9112 §2.1) or ``Content-Length`` body does not
    arrive in time. Every other event goes to aiohttp's protocol unchanged.
    """

    _IDLE, _HEAD, _BODY = range(3)

    def __init__(self, inner: asyncio.Protocol, state: DashboardState, open_: dict[str, int]) -> None:
        self.inner = inner
        self.state = state
        self.open = open_  # client address -> open connections; key "" holds the total
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.admitted = False
        self.phase = self._HEAD
        self.head = bytearray()
        self.body_left = 0
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit the connection under the caps (or abort it) and start its header deadline."""
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        st = self.state
        if self.open.get("", 0) >= st.max_connections or self.open.get(self.client, 0) >= (
            st.max_connections_per_client
        ):
            st.connections_refused_total += 1
            if (
                st.connections_refused_total in (1, 10, 100, 1000)
                or st.connections_refused_total % 10_000 == 0
            ):
                logger.warning(
                    "dashboard: connection from %s refused (%d open, %d from it; %d refused so far)",
                    self.client,
                    self.open.get("", 0),
                    self.open.get(self.client, 0),
                    st.connections_refused_total,
                )
            transport.abort()
            return
        self.admitted = True
        self.open[""] = self.open.get("", 0) + 1
        self.open[self.client] = self.open.get(self.client, 0) + 1
        self._arm(st.header_timeout_s)
        self.inner.connection_made(transport)

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
        if not self.admitted:
            return
        self.admitted = False
        for key in ("", self.client):
            left = self.open.get(key, 1) - 1
            if left > 0:
                self.open[key] = left
            else:
                self.open.pop(key, None)
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


class GuardedSite(web.TCPSite):
    """``web.TCPSite`` whose connections pass through :class:`ConnectionGuard` (aiohttp 3.x)."""

    def __init__(self, runner: web.AppRunner, state: DashboardState, host: str, port: int) -> None:
        super().__init__(runner, host, port)
        self._state = state
        self._open: dict[str, int] = {}

    async def start(self) -> None:
        """Listen on the site's address with every connection wrapped in :class:`ConnectionGuard`."""
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None

        def factory() -> asyncio.Protocol:
            return ConnectionGuard(server(), self._state, self._open)

        self._server = await asyncio.get_running_loop().create_server(
            factory, self._host, self._port, backlog=self._backlog, reuse_address=self._reuse_address
        )
