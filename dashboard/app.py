"""The dashboard: one aiohttp app serving an HTML page, JSON, Server-Sent Events and Prometheus metrics.

The agent and the coordinator each serve it with their own :class:`DashboardState`; the routes are
``docs/operations.md``, "The dashboard's routes". With a ``token`` every route requires ``Authorization:
Bearer <token>`` or HTTP Basic with the token as password; without one only loopback ``Host`` headers
are served (421 otherwise: DNS rebinding). Every response carries a CSP without inline script.

Source: HTML Living Standard §9.2 (server-sent events); Prometheus text exposition format;
RFC 6750 §2.1 (bearer token); RFC 7617 (Basic).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import bisect
import contextlib
import hmac
import inspect
import json
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from aiohttp import hdrs, web
from multidict import CIMultiDict

from edgefl.dashboard.connections import GuardedSite, RequestLog
from edgefl.dashboard.metrics import StatusCollector, finite_number
from edgefl.errors import ConfigError
from edgefl.validators import is_loopback_host

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

logger = logging.getLogger(__name__)

STATIC_DIR: Final = Path(__file__).resolve().parent / "static"
KEEPALIVE_S = 15.0
"""Seconds between SSE comment lines when nothing changes (keeps proxies from closing the stream)."""
WRITE_TIMEOUT_S = 10.0
"""A stream whose client does not take an event within this many seconds is dropped."""
SSE_RETRY_MS = 2000
"""Reconnect delay the browser is told to use after a stream ends."""
FINAL_WRITE_TIMEOUT_S = 1.0
"""At shutdown, each open stream gets this long to take the final status."""
MAX_ROUNDS_PAGE = 5000
"""Round records served by one ``/api/rounds`` response at most."""
MAX_HISTORY_DEVICES = 64
"""Devices whose RSS the coordinator page's memory history keeps (the first seen, by name)."""
MAX_CACHED_PAGES = 16
"""``/api/rounds`` responses kept per version of the records (distinct ``after``/``limit`` pairs)."""
RoundsSource = Callable[[], Sequence[Mapping[str, Any]] | Awaitable[Sequence[Mapping[str, Any]]]]
"""``DashboardState.get_rounds``: the round records, or an awaitable of them."""

_STATIC_TYPES: Final = {
    "app.js": "text/javascript",
    "style.css": "text/css",
    "favicon.svg": "image/svg+xml",
}
_PAGES: Final = {"device": "device.html", "coordinator": "coordinator.html"}
"""Each kind's ``<main>`` and footer, put into ``index.html`` (the head and header both pages share)."""
_SECURITY_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(slots=True)
class DashboardState:
    """What the agent or the coordinator hands to the dashboard.

    ``kind`` ("device" or "coordinator"): which page and metrics; ``title``: the page header's.
    ``get_status()``: the current status (keys: ``docs/operations.md``; any may be missing or None),
    called on the event loop at most once per ``push_interval_s`` (s) and per request: cheap, never
    blocking. ``get_rounds()``: a coordinator's round records, oldest first: a list, or an awaitable of
    one (the same list object while unchanged: each page's response is then reused). ``token``: bearer
    token, required by :func:`serve` off loopback. RSS history: every ``history_interval_s`` (s),
    ``history_len`` samples. At most ``max_streams`` SSE streams (503 beyond), ``max_connections``
    open connections (``max_connections_per_client`` from one IP); a request's header block and body
    must each arrive within ``header_timeout_s`` / ``body_timeout_s``. ValueError for another kind or a
    number <= 0.
    """

    kind: Literal["device", "coordinator"]
    title: str
    get_status: Callable[[], Mapping[str, Any]]
    token: str | None = field(default=None, repr=False)
    push_interval_s: float = 1.0
    history_interval_s: float = 2.0
    history_len: int = 150
    get_rounds: RoundsSource | None = None
    max_streams: int = 16
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    max_connections: int = 128
    max_connections_per_client: int = 16
    connections_refused_total: int = field(default=0, init=False)
    connections_timed_out_total: int = field(default=0, init=False)
    bad_requests_total: int = field(default=0, init=False)
    _listeners: list[Callable[[], None]] = field(default_factory=list, init=False, repr=False)
    # /api/rounds bodies by (after, limit), of the records object an awaitable get_rounds gave last
    _pages: dict[object, str] = field(default_factory=dict, init=False, repr=False)
    _pages_of: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in _PAGES:
            raise ValueError(f"kind = {self.kind!r}: must be 'device' or 'coordinator'")
        for f in fields(self):
            if f.init and f.type in ("float", "int") and not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} = {getattr(self, f.name)!r}: must be > 0")

    def notify(self) -> None:
        """Tell open pages that the status changed (call on the event-loop thread; cheap, idempotent)."""
        for listener in self._listeners:
            listener()


STATE_KEY: Final = web.AppKey("dashboard_state", DashboardState)


def jsonable(value: Any) -> Any:
    """Copy a status value into plain JSON types (non-finite floats None, numpy scalars ``.item()``)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item):
        return jsonable(item())
    return str(value)


class _Hub:
    """The app's live part: one status publisher shared by every SSE stream, and the RSS history."""

    def __init__(self, state: DashboardState) -> None:
        self.state = state
        self.seq = 0
        self.frame = b""
        self.streams = 0
        self.closing = False
        # device name ("" for a device's own page) -> (monotonic s, rss bytes, cap bytes or -1)
        self.device_history: dict[str, deque[tuple[float, int, int]]] = {}
        self.registry: CollectorRegistry | None = None
        self._status_json = b""
        self._new_frame = asyncio.Event()
        self._wake = asyncio.Event()
        self._status_failed = False

    def wake(self) -> None:
        """A status changed: push it to open streams (without one there is nothing to push)."""
        if self.streams > 0:
            self._wake.set()

    def close(self) -> None:
        self.closing = True
        self._wake.set()
        self._new_frame.set()

    def status(self) -> Mapping[str, Any]:
        """Call ``get_status`` (the only place that does)."""
        status = self.state.get_status()
        if self._status_failed:
            self._status_failed = False
            logger.info("dashboard: status available again")
        return status

    def document(self) -> bytes:
        """Build the ``/api/status`` document as compact JSON bytes (raises what ``get_status`` raises)."""
        doc = {"kind": self.state.kind, "title": self.state.title, "status": jsonable(self.status())}
        return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()

    def refresh(self) -> None:
        """Build a new SSE frame if the status changed and wake the streams waiting for one."""
        try:
            body = self.document()
        except Exception:
            if not self._status_failed:
                self._status_failed = True
                logger.exception("dashboard: get_status failed; keeping the last status")
            return
        if body == self._status_json:
            return
        self._status_json = body
        self.seq += 1
        self.frame = b"id: %d\ndata: %s\n\n" % (self.seq, body)
        event, self._new_frame = self._new_frame, asyncio.Event()
        event.set()

    async def next_frame(self, seq: int, timeout_s: float) -> tuple[int, bytes]:
        """Wait until a frame newer than ``seq`` exists or ``timeout_s`` passes; return the latest."""
        if self.seq == seq and not self.closing:
            event = self._new_frame
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await event.wait()
        return self.seq, self.frame

    def sample_history(self) -> None:
        try:
            status = self.status()
        except Exception:
            return  # refresh() logs the failure
        now = time.monotonic()
        devices = {"": status} if self.state.kind == "device" else status.get("devices")
        if not isinstance(devices, Mapping):
            return
        for name, entry in devices.items():
            rss = finite_number(entry.get("rss_bytes")) if isinstance(entry, Mapping) else None
            if rss is None:
                continue
            series = self.device_history.get(str(name))
            if series is None:
                if len(self.device_history) >= MAX_HISTORY_DEVICES:
                    continue
                series = self.device_history[str(name)] = deque(maxlen=self.state.history_len)
            cap = finite_number(entry.get("cap_bytes"))
            series.append((now, int(rss), int(cap) if cap is not None else -1))

    async def run(self) -> None:
        """Sample the RSS history and, while streams are open, poll and push the status."""
        next_sample = time.monotonic()
        while not self.closing:
            now = time.monotonic()
            if now >= next_sample:
                self.sample_history()
                next_sample = now + self.state.history_interval_s
            self._wake.clear()
            if self.streams > 0:
                self.refresh()
            timeout_s = self.state.push_interval_s if self.streams > 0 else KEEPALIVE_S
            timeout_s = min(timeout_s, max(0.0, next_sample - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._wake.wait()


HUB_KEY: Final = web.AppKey("dashboard_hub", _Hub)


# --- access control and headers -------------------------------------------------------------------
def _authorized(header: str | None, token: str) -> bool:
    """Tell whether an ``Authorization`` header carries ``token`` (Bearer, or Basic password)."""
    if not header:
        return False
    scheme, _, credentials = header.partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer":
        offered = credentials.encode()
    elif scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(credentials, validate=True)
        except (binascii.Error, ValueError):
            return False
        offered = decoded.partition(b":")[2]
    else:
        return False
    return hmac.compare_digest(offered, token.encode())


def _host_name(host_header: str) -> str:
    """Return the name part of a ``Host`` header (``[::1]:8080`` -> ``::1``, ``a:80`` -> ``a``)."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


@web.middleware
async def _guard(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    token = request.app[STATE_KEY].token
    if token is None:
        # Browsers always send Host; a client without one reached the loopback socket directly.
        host = request.headers.get(hdrs.HOST, "")
        if host and not is_loopback_host(_host_name(host)):
            logger.debug("dashboard: refused Host %r from %s", host, request.remote)
            raise web.HTTPMisdirectedRequest(
                text="this dashboard serves loopback host names only; set dashboard.token to serve others\n"
            )
    elif not _authorized(request.headers.get("Authorization"), token):
        logger.debug("dashboard: 401 for %s %s from %s", request.method, request.path, request.remote)
        challenges = CIMultiDict(
            [
                ("WWW-Authenticate", 'Bearer realm="edgefl"'),
                ("WWW-Authenticate", 'Basic realm="edgefl", charset="UTF-8"'),
            ]
        )
        raise web.HTTPUnauthorized(headers=challenges, text="401: token required\n")
    response: web.StreamResponse = await handler(request)
    return response


async def _add_headers(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in _SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    response.headers[hdrs.SERVER] = "edgefl"  # not aiohttp's version string


# --- routes ---------------------------------------------------------------------------------------
async def _page(request: web.Request) -> web.Response:
    kind = request.app[STATE_KEY].kind
    shell = (STATIC_DIR / "index.html").read_text(encoding="utf-8").replace("@KIND@", kind)
    page = shell.replace("@MAIN@\n", (STATIC_DIR / _PAGES[kind]).read_text(encoding="utf-8"))
    return web.Response(text=page, content_type="text/html", charset="utf-8")


async def _static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    content_type = _STATIC_TYPES.get(name)
    if content_type is None:  # a fixed list: no directory walking, no listing
        raise web.HTTPNotFound()
    return web.Response(body=(STATIC_DIR / name).read_bytes(), content_type=content_type, charset="utf-8")


async def _status(request: web.Request) -> web.Response:
    try:
        body = request.app[HUB_KEY].document()
    except Exception as exc:
        logger.exception("dashboard: get_status failed")
        raise web.HTTPServiceUnavailable(text="status unavailable\n") from exc
    return web.Response(body=body, content_type="application/json")


async def _history(request: web.Request) -> web.Response:
    hub = request.app[HUB_KEY]
    now = time.monotonic()
    doc: dict[str, Any] = {"interval_s": hub.state.history_interval_s}
    if hub.state.kind == "device":
        doc["rss"] = [[round(now - t, 1), rss] for t, rss, _ in hub.device_history.get("", ())]
    else:
        doc["devices"] = {
            name: [[round(now - t, 1), rss, cap if cap >= 0 else None] for t, rss, cap in series]
            for name, series in hub.device_history.items()
        }
    return web.json_response(doc)


def _query_int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw) if len(raw) <= 18 else None  # a round number or a page size, never more digits
    except ValueError:
        value = None
    if value is None:
        raise web.HTTPBadRequest(text=f"{name} = {raw[:20]!r}: must be an integer of at most 18 digits\n")
    return value


async def _rounds(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    after = _query_int(request, "after", -1)
    limit = _query_int(request, "limit", MAX_ROUNDS_PAGE)
    if limit < 1:
        raise web.HTTPBadRequest(
            text=f"limit = {limit}: must be >= 1 (records a page, at most {MAX_ROUNDS_PAGE})\n"
        )
    limit = min(limit, MAX_ROUNDS_PAGE)
    got = state.get_rounds() if state.get_rounds is not None else ()
    if not inspect.isawaitable(got):
        return web.Response(text=_rounds_page(got, after, limit), content_type="application/json")
    records = await got
    if state._pages_of is not records:  # new records: the pages of the old ones are stale
        state._pages.clear()
        state._pages_of = records
    body = state._pages.get((after, limit))
    if body is None:
        body = _rounds_page(records, after, limit)
        if len(state._pages) < MAX_CACHED_PAGES:
            state._pages[(after, limit)] = body
    return web.Response(text=body, content_type="application/json")


def _rounds_page(records: Sequence[Mapping[str, Any]], after: int, limit: int) -> str:
    """The ``/api/rounds`` body: the first ``limit`` records of rounds above ``after``, the total and last."""
    # records are in round order: the first one after ``after`` by bisection
    lo = bisect.bisect_right(records, float(after), key=lambda r: finite_number(r.get("round")) or 0.0)
    page = records[lo : lo + limit]
    last = finite_number(records[-1].get("round")) if records else None
    doc = {"rounds": jsonable(list(page)), "total": len(records), "last": None if last is None else int(last)}
    return json.dumps(doc, allow_nan=False, separators=(",", ":"))


async def _events(request: web.Request) -> web.StreamResponse:
    hub = request.app[HUB_KEY]
    if hub.streams >= hub.state.max_streams:
        raise web.HTTPServiceUnavailable(text="too many event streams\n", headers={"Retry-After": "5"})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"})
    hub.streams += 1
    hub.wake()  # the publisher sleeps long while no stream is open
    try:
        await response.prepare(request)
        await response.write(b"retry: %d\n\n" % SSE_RETRY_MS)
        hub.refresh()
        seq = -1
        while True:
            new_seq, frame = await hub.next_frame(seq, KEEPALIVE_S)
            if request.transport is None or request.transport.is_closing():
                break
            if hub.closing:
                # the last status (a finished job, its final round) still reaches the open pages
                if new_seq != seq:
                    async with asyncio.timeout(FINAL_WRITE_TIMEOUT_S):
                        await response.write(frame)
                break
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await response.write(frame if new_seq != seq else b": keepalive\n\n")
            seq = new_seq
    except ConnectionError as exc:
        logger.debug("dashboard: event stream to %s ended: %r", request.remote, exc)
    except TimeoutError:
        # a client that stopped reading: drop the connection, or finishing the response would wait too
        logger.info("dashboard: event stream to %s stalled %.0f s; dropped", request.remote, WRITE_TIMEOUT_S)
        if request.transport is not None:
            request.transport.abort()
    finally:
        hub.streams -= 1
    return response


async def _metrics(request: web.Request) -> web.Response:
    hub = request.app[HUB_KEY]
    # prometheus_client (with http.server, wsgiref and urllib, about 1.8 MB RSS) loads on the first
    # scrape, so an agent nobody scrapes does not pay for it.
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    if hub.registry is None:
        hub.registry = CollectorRegistry(auto_describe=False)
        hub.registry.register(StatusCollector(hub.status, hub.state.kind, lambda: hub.streams))
    try:
        body = generate_latest(hub.registry)
    except Exception as exc:
        logger.exception("dashboard: metrics unavailable")
        raise web.HTTPServiceUnavailable(text="metrics unavailable\n") from exc
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    """``ok`` (200), or 503 with the status's ``health`` when it names a problem (unreadable status: 200)."""
    try:
        health = request.app[HUB_KEY].status().get("health", "ok")
    except Exception:
        health = "ok"
    if health != "ok":
        raise web.HTTPServiceUnavailable(text=f"{health}\n")
    return web.Response(text="ok\n")


# --- factory and server ---------------------------------------------------------------------------
def create_app(state: DashboardState) -> web.Application:
    """The dashboard of one agent or coordinator: read-only routes, the publisher in ``cleanup_ctx``.

    Serve it as a top-level application (:func:`serve`), not a sub-app: handler cancellation is a
    top-level option.
    """
    hub = _Hub(state)
    # handler_cancellation: aiohttp then cancels a handler as soon as its client disconnects, so an
    # SSE stream ends at once instead of at its next write.
    app = web.Application(
        middlewares=[_guard], handler_args={"handler_cancellation": True}, client_max_size=4096
    )
    app[STATE_KEY] = state
    app[HUB_KEY] = hub
    app.router.add_get("/", _page)
    app.router.add_get("/static/{name}", _static)
    app.router.add_get("/api/status", _status)
    app.router.add_get("/api/history", _history)
    app.router.add_get("/api/rounds", _rounds)
    app.router.add_get("/api/events", _events, allow_head=False)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.on_response_prepare.append(_add_headers)

    async def publisher(app: web.Application) -> AsyncIterator[None]:
        state._listeners.append(hub.wake)
        task = asyncio.create_task(hub.run(), name="dashboard-publisher")
        yield
        state._listeners.remove(hub.wake)
        hub.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def end_streams(app: web.Application) -> None:
        hub.refresh()  # the final status, sent to every open stream before it ends
        hub.close()  # open SSE handlers return, so the runner's shutdown does not wait for them

    app.cleanup_ctx.append(publisher)
    app.on_shutdown.append(end_streams)
    return app


async def serve(state: DashboardState, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Start the dashboard on ``host:port`` (0: a free port); returns the runner and the port bound.

    Stop it with ``await runner.cleanup()``. Raises ConfigError for a non-loopback ``host`` without
    ``state.token``, OSError if the address cannot be bound.
    """
    if not is_loopback_host(host) and not state.token:
        raise ConfigError([f"dashboard.host = {host!r}: a non-loopback host requires dashboard.token"])
    runner = web.AppRunner(create_app(state), access_log=None, shutdown_timeout=2.0, logger=RequestLog(state))
    await runner.setup()
    try:
        site = GuardedSite(runner, state, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = int(runner.addresses[0][1])
    shown = host if ":" not in host else f"[{host}]"
    logger.info("dashboard (%s) on http://%s:%d/", state.kind, shown, bound)
    return runner, bound
