"""What a writer of the devices' fleet topics (``global/#``, ``round``) can do to an agent's log.

Only the coordinator's account writes them under the ACL of ``docs/security.md``; a misconfigured ACL
or leaked coordinator credentials let anyone. A real agent process on the real mosquitto. Select with
``pytest -k hostile``.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest
from conftest import Broker, start_ingest_agent, wait_until
from test_ingest import Gateway

pytestmark = pytest.mark.timeout(120)


@pytest.mark.broker
@pytest.mark.subprocess
def test_hostile_refused_fleet_messages_log_sampled_lines_with_short_topics(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """50 junk messages on a 20,000-character ``global/...`` topic: all counted, 20 short log lines.

    Every refused head or round was logged with the whole topic, twice: 50 such messages wrote 50
    lines of 40 kB (a flood, a flood of log lines), where the coordinator and live ingest log the
    first 20 of a reason, then every 1000th, and cut topics to 200 characters.
    """
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-j"))
    topic = f"edgefl/{fleet}/global/{'9' * 20_000}"

    async def main() -> None:
        async with Gateway(mosquitto, fleet, "dev-j") as gw:
            await gw.ready()
            for _ in range(50):
                await gw.raw(topic, b"zz")
            await wait_until(lambda: gw.status.get("rejected", {}).get("bad_chunk") == 50, 30, "50 refused")

    asyncio.run(main())
    lines = [line for line in (tmp_path / "dev-j.log").read_text().splitlines() if "bad_chunk" in line]
    assert len(lines) == 20
    assert max(len(line) for line in lines) < 1000
