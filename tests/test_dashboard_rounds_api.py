"""``/api/rounds``: a page size below 1 is a 400 naming it, never one record; above the most, the most."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from edgefl.dashboard.app import MAX_ROUNDS_PAGE, DashboardState, create_app


def test_dashboard_rounds_api_limit_below_one_is_refused_with_its_reason() -> None:
    records = [{"round": r, "clients": 1} for r in range(1, 11)]

    async def body() -> list[tuple[int, Any]]:
        state = DashboardState("coordinator", "f", lambda: {}, get_rounds=lambda: records)
        runner = web.AppRunner(create_app(state))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        out = []
        try:
            async with aiohttp.ClientSession() as http:
                for q in ("limit=-1", "limit=0", "limit=3", f"limit={MAX_ROUNDS_PAGE + 1}"):
                    async with http.get(f"http://127.0.0.1:{port}/api/rounds?{q}") as r:
                        out.append((r.status, await r.json() if r.status == 200 else await r.text()))
        finally:
            await runner.cleanup()
        return out

    (c1, t1), (c0, t0), (c3, d3), (cmax, dmax) = asyncio.run(body())
    assert (c1, t1) == (400, f"limit = -1: must be >= 1 (records a page, at most {MAX_ROUNDS_PAGE})\n")
    assert (c0, t0) == (400, f"limit = 0: must be >= 1 (records a page, at most {MAX_ROUNDS_PAGE})\n")
    assert c3 == 200 and [r["round"] for r in d3["rounds"]] == [1, 2, 3]
    assert cmax == 200 and len(dmax["rounds"]) == 10
