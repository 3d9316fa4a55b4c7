"""The agent's byte bound on what it received and has not handled yet (``source.queue_max_bytes``).

A backlog of large junk samples queued at a real mosquitto for a persistent session while the real
agent process is down; back, the agent reads it no faster than it handles it, so its peak RSS stays
under its cap, and the legitimate samples published after the junk are classified. Select with
``pytest -k hostile``.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import start_ingest_agent, start_mosquitto, stop_broker, wait_until
from test_hostile import _vm_hwm_bytes
from test_ingest import Gateway

from edgefl.datasets import load_digits
from edgefl.launcher import stop_agents
from edgefl.wire.ingest import Sample

pytestmark = [pytest.mark.timeout(300), pytest.mark.broker, pytest.mark.subprocess]

JUNK = 1000  # x 250 KB = 250 MB: what one app account can queue (mosquitto's default per client)
JUNK_BYTES = 250_000
LEGIT = 5


@pytest.mark.long
@pytest.mark.parametrize("when", ["offline", "online"])
def test_hostile_backlog_of_large_samples_keeps_agent_peak_rss_under_cap(
    tmp_path: Path, fleet: str, when: str
) -> None:
    """1000 x 250 KB samples of the wrong shape (an app account's junk), then 5 digits samples.

    ``offline``: they wait at the broker while the agent is stopped, and come at its restart;
    ``online``: they are published to the running agent as fast as the broker takes them. The agent
    refuses each junk sample (counted with its reason), classifies the 5, and its peak RSS stays under
    the dev profile's cap (96 MiB): the governor's lifetime peak (``VmHWM`` read before each of its
    phase resets) and ``VmHWM`` at the end.
    """
    broker = start_mosquitto(tmp_path, extra="max_queued_messages 2000\nmax_queued_bytes 0")
    dev = "dev-bytes"
    x, y = load_digits()
    junk = np.zeros(JUNK_BYTES, dtype=np.uint8)
    procs: list[subprocess.Popen[bytes]] = []

    async def main() -> tuple[dict[str, Any], int]:
        async with Gateway(broker, fleet, dev) as gw:
            procs.append(start_ingest_agent(broker, fleet, tmp_path, dev))
            await gw.ready()
            if when == "offline":
                stop_agents(procs[-1:])  # a clean stop: the session (session_expiry_s 3600) stays
                await wait_until(lambda: gw.status.get("state") == "offline", 30, "the agent stopped")
            for first in range(0, JUNK, 50):  # 50 publishes in flight at once: a flood
                await asyncio.gather(
                    *(gw.sample(Sample(f"junk-{i}", junk)) for i in range(first, first + 50))
                )
            for i in range(LEGIT):
                await gw.sample(Sample(f"legit-{i}", x[i], int(y[i])))
            if when == "offline":
                gw.status = {}
                procs.append(start_ingest_agent(broker, fleet, tmp_path, dev))
            await wait_until(
                lambda: (
                    sum(gw.status.get("rejected", {}).values()) == JUNK
                    and gw.status.get("samples_received") == LEGIT
                    and len(gw.predictions) == LEGIT
                ),
                240,
                "the backlog handled",
            )
            assert procs[-1].poll() is None, "the agent died"
            return gw.status, _vm_hwm_bytes(procs[-1].pid)

    try:
        status, hwm = asyncio.run(main())
    finally:
        stop_agents(procs)
        stop_broker(broker)
    cap = status["cap_bytes"]
    print(
        f"\nhostile {when} backlog {JUNK} x {JUNK_BYTES} B: agent VmHWM {hwm / 2**20:.1f} MiB, governor peak "
        f"{status['peak_rss_bytes'] / 2**20:.1f} MiB, cap {cap / 2**20:.0f} MiB, "
        f"rejected {status['rejected']}"
    )
    assert cap == 96 * 2**20
    assert sum(status["rejected"].values()) == JUNK
    assert status["samples_received"] == LEGIT and status["ingest_dropped"] == 0
    assert status["transport"]["queue_dropped"] == 0 and status["transport"]["thread_errors"] == 0
    assert status["peak_rss_bytes"] < cap
    assert hwm < cap
    assert procs[-1].returncode in (0, -signal.SIGTERM)
    log = (tmp_path / f"{dev}.log").read_text(errors="replace")
    assert "Traceback" not in log
