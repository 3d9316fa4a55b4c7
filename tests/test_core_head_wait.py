"""A device asked to train from a global head it does not hold yet: it answers once the head comes, or
declines the round (``no_head``) when half the round's deadline passed without it, never stays silent."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Broker, next_status_fields, start_replay_agent
from test_core import announcement, profile_for

from edgefl.agent.core import DeviceCore
from edgefl.agent.round import RoundStatus
from edgefl.datasets import load_digits
from edgefl.launcher import stop_agents
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.global_model import GlobalModel, encode_global_model
from edgefl.wire.rounds import Decline, decode_decline, encode_round
from edgefl.wire.status import decode_status


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits()
    return x[:64], y[:64].astype(np.int64)


def test_durable_device_without_the_rounds_head_declines_no_head_when_time_is_up(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    x, y = digits
    core = DeviceCore.open(profile_for(tmp_path))
    core.observe(x[:32], y[:32])
    t0 = time.monotonic()
    waiting = core.answer_round(announcement(8, base_version=7))  # deadline 60 s; the device has 0
    why = "round 8 uses version 7, device has 0"
    assert (waiting.status, waiting.detail) == (RoundStatus.WAITING_HEAD, why)
    early = core.retry_deferred(now_s=t0 + 10.0)  # before half the deadline: still waiting
    assert early is not None and early.status == RoundStatus.WAITING_HEAD
    late = core.retry_deferred(now_s=t0 + 31.0)  # 30 s from the first wait, not from the retry
    assert late is not None
    assert (late.status, late.reason, late.detail) == (RoundStatus.DECLINED, "no_head", why)
    assert late.entry is not None
    decline = decode_decline(late.entry.payload)
    assert (decline.round, decline.base_version, decline.reason) == (8, 7, "no_head")
    assert core.deferred is None and core.answered is not None and core.answered.round == 8


def test_durable_device_whose_head_comes_in_time_trains_and_never_declines(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    x, y = digits
    core = DeviceCore.open(profile_for(tmp_path))
    core.observe(x[:32], y[:32])
    assert core.answer_round(announcement(2, base_version=1)).status == RoundStatus.WAITING_HEAD
    gm = GlobalModel(1, 1, core.model_sha256, core.head.W.copy(), core.head.b.copy())
    core.receive_global(encode_global_model(gm))
    ready = core.take_ready_round()
    assert ready is not None and core.answer_round(ready).status == RoundStatus.TRAINED
    assert core.deferred is None  # nothing left to decline later
    assert core.retry_deferred(now_s=time.monotonic() + 3600.0) is None


@pytest.mark.broker
@pytest.mark.subprocess
def test_durable_agent_without_the_rounds_head_sends_a_no_head_decline(
    tmp_path: Path, mosquitto: Broker, fleet: str, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    """A real agent with samples is asked to train round 3 from version 2, which never comes: after half
    the round's deadline it declines the round on its update topic (reason ``no_head``), not silent."""
    x, y = digits
    topics = Topics("edgefl", fleet)

    reasons: list[str] = []  # the agent's status reasons while the round is open

    async def main() -> Decline:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        await t.start(wait_s=10)
        try:
            await t.subscribe(topics.status("dev-1"), 1)
            await t.subscribe(topics.update("dev-1"), 1)
            status: dict[str, Any] = {}
            while status.get("store_samples", 0) == 0:  # the agent has stored its replayed samples
                status = await asyncio.wait_for(next_status_fields(t), 30)
            ann = dataclasses.replace(announcement(3, base_version=2), deadline_s=4.0)
            await t.publish(topics.round, encode_round(ann), qos=1, retain=True)
            while True:
                msg = await asyncio.wait_for(t.queue.get(), 30)
                if msg.topic == topics.update("dev-1"):
                    return decode_decline(msg.payload)
                if msg.payload:
                    reasons.append(str(decode_status(msg.payload).fields.get("reason", "")))
        finally:
            await t.publish(topics.round, b"", qos=1, retain=True)
            await t.stop()

    agent = start_replay_agent(mosquitto, fleet, tmp_path, "dev-1", x, y)
    try:
        decline = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        stop_agents([agent])
    log = (tmp_path / "dev-1.log").read_text()
    assert (decline.round, decline.base_version, decline.reason) == (3, 2, "no_head"), log
    assert decline.detail == "round 3 uses version 2, device has 0", log
    assert "round 3 uses version 2, device has 0: waiting for its head" in reasons, reasons
    assert "round 3 declined (no_head): round 3 uses version 2, device has 0" in log, log
