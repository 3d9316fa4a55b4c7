"""The agent's persistent MQTT session (agent/daemon.py, ``broker.session_expiry_s``): what is published
to a device while its agent restarts reaches it when it is back, once.

Real mosquitto, real agent processes (dev profile, raw-input int8 model, real LiteRT), killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import Broker, start_ingest_agent, wait_until
from test_ingest import Gateway

from edgefl.datasets import load_digits
from edgefl.wire.ingest import Sample
from edgefl.wire.rounds import RoundAnnouncement, encode_round

pytestmark = [pytest.mark.broker, pytest.mark.subprocess]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()  # SIGKILL: no clean stop, the broker publishes the will
    proc.wait(10)


def test_durable_session_delivers_what_came_while_the_agent_was_down(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """``dev-s`` (default session, 3600 s) is killed; 20 labelled samples and two rounds are published
    while it is down. Back, it classifies and stores the 20 (none twice) and answers only the newer round
    (the older one is closed). ``dev-c`` (``broker.session_expiry_s = 0``, a clean session) gets none of
    them: without a session the broker drops what is addressed to an offline agent.
    """
    x, y = load_digits()
    extra = {"training__min_examples": "4", "training__holdout_every": "0"}
    setups = {"dev-s": {}, "dev-c": {"broker__session_expiry_s": "0"}}

    def start(dev: str) -> subprocess.Popen[bytes]:
        proc = start_ingest_agent(mosquitto, fleet, tmp_path, dev, **extra, **setups[dev])
        agents.append(proc)
        return proc

    async def run(dev: str) -> dict[str, Any]:
        async with Gateway(mosquitto, fleet, dev) as gw:
            proc = start(dev)
            await gw.ready()
            for i in range(10):
                await gw.sample(Sample(f"{dev}-a{i}", x[i], int(y[i])))
            await gw.until("10 stored", stored_total=10, store_samples=10)
            _kill(proc)
            await wait_until(lambda: gw.status.get("state") == "offline", 30, f"{dev}'s will")
            for i in range(20):
                await gw.sample(Sample(f"{dev}-b{i}", x[10 + i], int(y[10 + i])))
            for r in (1, 2):
                ann = RoundAnnouncement(r, 0, 600.0, 1, 0.05, 8, 1, ("dev-s",))
                await gw.t.publish(gw.topics.round, encode_round(ann), qos=1, retain=True)
            gw.status = {}
            start(dev)
            await gw.ready()
            # a marker sent once it is back: the broker delivers in order, so whatever it queued came first
            await gw.sample(Sample(f"{dev}-marker", x[30], int(y[30])))
            await wait_until(lambda: f"{dev}-marker" in gw.predictions, 30, f"{dev}'s marker prediction")
            if dev == "dev-s":
                await wait_until(lambda: 2 in [u.round for u in gw.updates], 60, "round 2's update")
            want = 31 if dev == "dev-s" else 11
            st = await gw.until(f"{want} stored", store_samples=want, stored_total=want - 10)
            return {"status": st, "updates": [u.round for u in gw.updates], "predicted": set(gw.predictions)}

    kept = asyncio.run(run("dev-s"))
    st = kept["status"]
    assert (st["samples_received"], st["store_samples"], st["rejected"]) == (21, 31, {})
    assert kept["predicted"] == {
        f"dev-s-{k}" for k in [*(f"a{i}" for i in range(10)), *(f"b{i}" for i in range(20)), "marker"]
    }
    assert kept["updates"] == [2]  # round 1 was closed by round 2: never trained

    lost = asyncio.run(run("dev-c"))
    st = lost["status"]
    assert (st["samples_received"], st["store_samples"], st["rejected"]) == (1, 11, {})
    assert not any(k.startswith("dev-c-b") for k in lost["predicted"])
    assert lost["updates"] == []


def test_durable_session_backlog_beyond_the_transport_queue(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """600 samples queued at the broker while the agent is down (more than its 256-message transport
    queue: the broker's flow control holds the rest): back, it subscribes and classifies all 600, and
    publishes every prediction (the backlog comes right after CONNACK, before the renewed SUBACKs)."""
    x, _ = load_digits()
    n = 600

    async def run() -> dict[str, Any]:
        async with Gateway(mosquitto, fleet, "dev-b") as gw:
            proc = start_ingest_agent(mosquitto, fleet, tmp_path, "dev-b", source__queue_max="1024")
            agents.append(proc)
            await gw.ready()
            _kill(proc)
            await wait_until(lambda: gw.status.get("state") == "offline", 30, "the will")
            for i in range(n):
                await gw.sample(Sample(f"b{i}", x[i % len(x)]))
            gw.status = {}
            agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-b", source__queue_max="1024"))
            await wait_until(lambda: len(gw.predictions) == n, 120, f"{n} predictions")
            return await gw.until("all received", samples_received=n, predictions_published=n, ready=True)

    st = asyncio.run(run())
    assert (st["ingest_dropped"], st["rejected"], st["transport"]["queue_dropped"]) == (0, {}, 0)
    assert st["predictions_failed"] == 0


def test_durable_session_drops_the_last_runs_topics_after_a_fleet_change(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """The same device (client id, state folder) moved to another fleet: its session no longer
    delivers the old fleet's samples (without the cleanup they would come, refused as bad_topic)."""
    x, _ = load_digits()
    moved = f"{fleet}b"

    async def run() -> dict[str, Any]:
        async with Gateway(mosquitto, fleet, "dev-m") as old, Gateway(mosquitto, moved, "dev-m") as new:
            proc = start_ingest_agent(mosquitto, fleet, tmp_path, "dev-m")
            agents.append(proc)
            await old.ready()
            proc.terminate()
            assert proc.wait(30) == 0
            agents.append(start_ingest_agent(mosquitto, moved, tmp_path, "dev-m"))
            await new.ready()
            await old.sample(Sample("stale", x[0]))  # the old fleet's topic: nobody subscribes now
            await new.sample(Sample("fresh", x[1]))
            await wait_until(lambda: "fresh" in new.predictions, 30, "the new fleet's prediction")
            return await new.until("one sample received", samples_received=1)

    st = asyncio.run(run())
    assert st["rejected"] == {}
