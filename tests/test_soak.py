"""A short soak (bench/soak.py): the shipped profiles, real agents, coordinator and mosquitto, kills of
each kind; nothing acknowledged is lost or counted twice, a kill loses no more than the flush window,
and a second coordinator for the fleet is refused with exit 6 while the first runs on."""

from __future__ import annotations

import argparse
import asyncio
import shutil
from pathlib import Path

import pytest

from bench.soak import Soak

pytestmark = [pytest.mark.subprocess, pytest.mark.broker, pytest.mark.timeout(300)]


@pytest.mark.long
@pytest.mark.skipif(shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(),
                    reason="mosquitto not installed (apt-get install mosquitto)")  # fmt: skip
def test_soak_short_run_loses_nothing_acknowledged(tmp_path: Path) -> None:
    args = argparse.Namespace(
        minutes=0.75, devices=5, seed=3, rate=3.0, interval_s=2.0, min_new_samples=8,
        agent_kills=1, coordinator_kills=1, broker_kills=1, coordinator_set=[],
    )  # fmt: skip
    res = asyncio.run(Soak(args, tmp_path).run())
    assert res["agent_kills"] == 1 and res["coordinator_kills"] == 1 and res["broker_restarts"] == 1
    assert res["rounds"] >= 2 and res["updates_counted"] >= 5, res
    assert res["updates_lost"] == 0, res["lost"]
    assert res["double_counted"] == 0
    assert res["samples_fed"] > 0
    assert res["samples_lost_max_per_kill"] <= res["flush_window_samples"] == 64
    assert res["second_coordinator_refused"] is True, res["second_coordinators"]
