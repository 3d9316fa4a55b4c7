"""The dashboard's server under hostile clients: oversized headers counted, a share kept for requests.

Select with ``pytest -k hostile``. Real sockets on 127.0.0.1: the page served in-process through
:func:`edgefl.dashboard.app.serve`, and a real agent process for the slowloris flood.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import time
from pathlib import Path

import pytest
from conftest import DEV_PROFILE, INT8_MODEL, Broker, free_port

from edgefl.dashboard.app import DashboardState, serve
from edgefl.launcher import launch_agent, stop_agents

pytestmark = pytest.mark.timeout(240)


def test_hostile_oversized_request_headers_are_counted_not_traced(caplog: pytest.LogCaptureFixture) -> None:
    """12 requests with a 20 kB header line: each answered 4xx and counted; one log line for the 1st and
    the 10th, no traceback; the page still answers."""
    caplog.set_level(logging.DEBUG)
    state = DashboardState("device", "dev-x", lambda: {"device": "dev-x"})

    async def request(port: int, raw: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # the server closes after a bad request
        writer.close()
        return answer

    async def main() -> tuple[list[bytes], bytes]:
        runner, port = await serve(state)
        try:
            big = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
            answers = [await request(port, big) for _ in range(12)]
            ok = await request(port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return answers, ok
        finally:
            await runner.cleanup()

    answers, ok = asyncio.run(main())
    assert all(a.split(b" ", 2)[1] in (b"400", b"431") for a in answers), answers[0][:80]
    assert ok.startswith(b"HTTP/1.1 200")
    assert state.bad_requests_total == 12
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    lines = [r.getMessage() for r in caplog.records if "bad request" in r.getMessage()]
    assert len(lines) == 2 and lines[0].endswith("(1 so far)") and lines[1].endswith("(10 so far)"), lines


def _healthz(port: int) -> int:
    """GET /healthz from 127.0.0.1 (the flood's own address); the status, or 0 if refused or reset."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()


def _answered(port: int, tries: int = 20) -> int:
    """Attempts (<= ``tries``, 0.1 s apart) until /healthz answers 200; AssertionError if it never does."""
    for attempt in range(1, tries + 1):
        if _healthz(port) == 200:
            return attempt
        time.sleep(0.1)
    raise AssertionError(f"/healthz not answered in {tries} attempts")


def test_hostile_slowloris_from_the_same_address_leaves_healthz_answered(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """1,100 half-open connections from 127.0.0.1, the address a legitimate /healthz also comes from
    (a reverse proxy, a local health check): /healthz is answered during and after the flood within a
    bounded number of attempts. The header deadline (60 s) never fires in the test: the half-open
    connections are closed to make room for newer ones, each counted as refused."""
    port = free_port()
    dev = "dev-slow"
    proc = launch_agent(
        DEV_PROFILE,
        {
            "device.id": dev,
            "device.fleet": fleet,
            "device.state_dir": str(tmp_path / dev),
            "broker.url": mosquitto.url,
            "model.path": str(INT8_MODEL),
            "dashboard.enabled": "true",
            "dashboard.port": str(port),
            "dashboard.header_timeout_s": "60",
            "dashboard.max_connections": "64",
            "dashboard.max_connections_per_client": "16",
            "status.interval_s": "0.2",
        },
        tmp_path / f"{dev}.log",
    )
    held: list[socket.socket] = []
    attempts: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while _healthz(port) != 200:  # wait for the page (an event: its first answer)
            assert proc.poll() is None and time.monotonic() < deadline, "dashboard never came up"
            time.sleep(0.05)
        for i in range(1, 1101):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never the empty line
                held.append(s)
            except OSError:
                pass
            if i % 275 == 0:
                attempts.append(_answered(port))  # during the flood
        attempts.append(_answered(port))  # with the flood's newest connections held
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/api/status")
        counts = json.loads(conn.getresponse().read())["status"]["dashboard_connections"]
        conn.close()
        assert proc.poll() is None, "the agent died"
    finally:
        for s in held:
            s.close()
        stop_agents([proc])
    print(f"\nslowloris from the same address: /healthz attempts {attempts}, counts {counts}")
    assert len(attempts) == 5
    assert counts["timed_out"] == 0
    assert counts["refused"] >= 1100 - 16 - 5  # each newcomer closed an older half-open one
    log = (tmp_path / f"{dev}.log").read_text(errors="replace")
    assert "Traceback" not in log
