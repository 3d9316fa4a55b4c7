"""``edgefl feed`` reports its own outcome: its labels' fate, refusals of its own samples only, a lost link.

Real agent processes (dev profile, raw-input int8 digits model: uint8 [8, 8, 1], K = 10) on a real
mosquitto; the device answers a refused Sample or Label with a Refusal naming its id on
``predictions/<device>``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import Broker, Link, start_ingest_agent, wait_until
from test_feed import feed_cmd, ready
from test_ingest import Gateway

from edgefl.datasets import load_digits
from edgefl.feed import FeedOptions, feed
from edgefl.profiles import BrokerConfig
from edgefl.wire.ingest import Sample

pytestmark = [pytest.mark.timeout(180), pytest.mark.broker, pytest.mark.subprocess]


def test_feed_reports_late_labels_the_device_refused(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    x, y = load_digits()
    np.savez(tmp_path / "d.npz", x=x[:8], y=y[:8])
    # a sample waits 1 s for its label; the labels come 3 s after their samples: too late for each
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-l", source__label_expiry_s="1"))
    ready(mosquitto, fleet, "dev-l")
    cmd = feed_cmd(mosquitto.url, fleet, "dev-l", tmp_path / "d.npz", "--label-delay", "3", "--wait", "60")
    done = subprocess.run(
        [*cmd, "--id-prefix", "s-", "--json", str(tmp_path / "l.json")], capture_output=True, text=True
    )
    assert done.returncode == 1, done.stdout + done.stderr  # every sample answered, every label refused
    assert (
        "fed 8 samples to dev-l" in done.stdout and "(0 labels inline, 8 late); 8 predictions" in done.stdout
    )
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("edgefl feed: device dev-l refused labels (unknown_sample 8): last: no sample s-")
    result = json.loads((tmp_path / "l.json").read_text())
    assert (result["labels_late"], result["labels_refused"], result["refused"]) == (
        8,
        8,
        {"unknown_sample": 8},
    )
    assert result["error"] == ""


def test_feed_counts_only_its_own_refusals_while_another_app_feeds_bad_samples(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    x, y = load_digits()
    n = 30
    np.savez(tmp_path / "good.npz", x=x[:n], y=y[:n])
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-b"))

    async def main() -> None:
        async with Gateway(mosquitto, fleet, "dev-b") as other:
            await other.ready()
            stop = asyncio.Event()

            async def bad_app() -> None:  # float32 samples of another shape, all along the feed
                i = 0
                while not stop.is_set():
                    await other.sample(Sample(f"other-{i}", np.zeros(64, np.float32), 1))
                    i += 1
                    await asyncio.sleep(0.02)

            task = asyncio.create_task(bad_app())
            await wait_until(lambda: len(other.refusals) >= 3, 30, "the other app's first refusals")
            opts = FeedOptions(
                BrokerConfig(url=mosquitto.url), fleet, "dev-b", tmp_path / "good.npz", rate_hz=20, wait_s=60
            )
            before = len(other.refusals)
            result = await feed(opts)
            during = len(other.refusals) - before
            stop.set()
            await task
            assert during >= 10  # the device refused the other app's samples all along the feed
            assert (result.samples_sent, result.predictions_received, result.refused) == (n, n, {})
            assert result.refused_detail == "" and result.labels_refused == 0
            # ... and told that app, naming each of its samples
            assert {r.reason for r in other.refusals} == {"bad_dtype"}
            assert all(r.id.startswith("other-") and r.of == "sample" for r in other.refusals)
            counted = lambda: other.status.get("rejected", {}).get("bad_dtype") == len(other.refusals)  # noqa: E731
            await wait_until(counted, 30, "the device's count of its refusals")

    asyncio.run(main())


def test_feed_reports_what_it_delivered_when_the_connection_is_lost(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    x, y = load_digits()
    np.savez(tmp_path / "many.npz", x=x[:400], y=y[:400])
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-d"))
    ready(mosquitto, fleet, "dev-d")
    link = Link(mosquitto.port)  # the feed's only way to the broker
    try:
        cmd = feed_cmd(f"mqtt://127.0.0.1:{link.port}", fleet, "dev-d", tmp_path / "many.npz")
        cmd = [*cmd[: cmd.index("--rate")], "--rate", "20", "--json", str(tmp_path / "d.json")]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        async def some_fed() -> None:
            async with Gateway(mosquitto, fleet, "dev-d") as gw:
                await wait_until(lambda: gw.status.get("samples_received", 0) >= 10, 60, "10 samples in")

        asyncio.run(some_fed())
        link.cut()
        out, err = proc.communicate(timeout=120)
    finally:
        link.close()
    assert proc.returncode == 4, out + err
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("fed ") and " samples to dev-d in " in summary, out
    result = json.loads((tmp_path / "d.json").read_text())
    assert 10 <= result["samples_sent"] < 400, result
    assert summary.startswith(f"fed {result['samples_sent']} samples"), (summary, result)
    assert result["error"] != "" and "retrying" not in result["error"]
    assert err.strip().splitlines()[-1] == (
        f"edgefl feed: stopped after {result['samples_sent']} samples: {result['error']}"
    )
