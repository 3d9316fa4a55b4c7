"""The fleet page's round archive under many readers (``coordinator/roundarchive.py``): the round log is
read off the event loop, once for any number of requests at the same time, and again only when it changes;
the page's ``/api/rounds`` served from it by a real dashboard."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_dashboard_browser import ThreadedDashboard
from test_roundarchive import write_log

from edgefl.coordinator import roundarchive
from edgefl.coordinator.roundarchive import RoundArchive
from edgefl.dashboard.app import DashboardState


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The round logs read from now on, one entry a read (each read takes the log's tail first)."""
    reads: list[Path] = []
    real = roundarchive.read_tail

    def read_tail(f: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(Path(f.name))
        return real(f, *args, **kwargs)

    monkeypatch.setattr(roundarchive, "read_tail", read_tail)
    return reads


def test_hostile_rounds_archive_read_once_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "rounds.jsonl"
    write_log(log, range(1, 3001))
    recent = [{"round": r, "accuracy": 0.9} for r in range(2951, 3001)]
    arch = RoundArchive(log, lambda: recent, tail_rounds=1000, sampled_rounds=200)
    reads = count_reads(monkeypatch)

    async def main() -> None:
        arch._lock.acquire()  # the log read (in its worker thread) cannot finish until released
        readers = asyncio.gather(*(arch.records_async() for _ in range(16)))
        ran = asyncio.Event()
        asyncio.get_running_loop().call_soon(ran.set)
        await ran.wait()  # the loop keeps running other work while the log is being read
        assert not readers.done()
        arch._lock.release()
        results = await readers
        assert reads == [log]  # 16 concurrent requests, one read
        assert all(r == results[0] for r in results)
        assert [r["round"] for r in results[0][-1000:]] == list(range(2001, 3001))
        assert await arch.records_async() is results[0]  # nothing changed: the very same list
        assert reads == [log]  # the log has not changed: the read is reused
        write_log(log, range(3001, 3002))
        recent.append({"round": 3001, "accuracy": 0.91})
        again = await arch.records_async()
        assert reads == [log, log] and again[-1]["round"] == 3001

    asyncio.run(main())


def test_hostile_rounds_api_many_clients_read_the_log_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "rounds.jsonl"
    write_log(log, range(1, 2001))
    arch = RoundArchive(log, lambda: [], tail_rounds=500, sampled_rounds=100)
    reads = count_reads(monkeypatch)
    state = DashboardState("coordinator", "f", lambda: {}, get_rounds=arch.records_async)
    server = ThreadedDashboard(state)

    def get(_: int) -> dict[str, Any]:
        with urllib.request.urlopen(server.url + "/api/rounds?after=1990&limit=5", timeout=30) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]

    try:
        with ThreadPoolExecutor(12) as pool:
            docs = list(pool.map(get, range(24)))
        assert list(state._pages) == [(1990, 5)]  # one response built, served 24 times
        write_log(log, range(2001, 2002))
        assert get(0)["last"] == 2001  # the log grew: read again, a new response
    finally:
        server.close()
    assert reads == [log, log]
    assert all(d == docs[0] for d in docs)
    assert [r["round"] for r in docs[0]["rounds"]] == [1991, 1992, 1993, 1994, 1995]
    assert docs[0]["last"] == 2000 and docs[0]["total"] == 600
