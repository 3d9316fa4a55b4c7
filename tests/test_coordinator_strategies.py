"""The standalone coordinator (``edgefl coordinator``) with FedBuff and with central DP, against a real
mosquitto and real agent processes; and the service's buffered schedule on crafted stale updates.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import INT8_MODEL, ROOT, Broker, start_replay_agent

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.fedbuff import FedBuff, staleness_weight
from edgefl.coordinator.service import Coordinator
from edgefl.datasets import load_digits, partition_non_iid, split_digits
from edgefl.errors import UpdateRejected
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.global_model import GlobalModel, decode_global_model
from edgefl.wire.rounds import Update, UpdateMetrics, encode_update

pytestmark = pytest.mark.timeout(300)


def run_coordinator(
    broker: Broker, fleet: str, tmp: Path, n_agents: int, *flags: str
) -> list[dict[str, Any]]:
    """``n_agents`` agents on non-IID digits shards and one ``edgefl coordinator`` process with ``flags``;
    returns the coordinator's ``--log`` lines (it must exit 0)."""
    x, y = load_digits()
    pool = split_digits(y).devices
    shards = partition_non_iid(y[pool], n_agents)
    agents = [
        start_replay_agent(broker, fleet, tmp, f"dev-{k}", x[pool[s]], y[pool[s]])
        for k, s in enumerate(shards)
    ]
    log = tmp / "rounds.jsonl"
    cmd = [
        sys.executable, "-m", "edgefl.cli", "--log-level", "INFO", "coordinator",
        "--broker", broker.url, "--fleet", fleet, "--model", str(INT8_MODEL),
        "--wait-devices", str(n_agents), "--deadline", "60", "--log", str(log), "--tolerate", "0", *flags,
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    finally:
        for a in agents:
            a.terminate()
        for a in agents:
            a.wait(timeout=15)
    print(proc.stdout[-3000:], proc.stderr[-6000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_coordinator_fedbuff_runs_buffered_steps_with_real_agents(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """3 agents, ``--strategy fedbuff --buffer-size 2 --min-clients 3``: every step closes at 2 updates
    (a synchronous round would wait for 3), each step publishes a new version."""
    lines = run_coordinator(
        mosquitto, fleet, tmp_path, 3,
        "--strategy", "fedbuff", "--buffer-size", "2", "--min-clients", "3", "--rounds", "3",
    )  # fmt: skip
    assert [ln["round"] for ln in lines] == [1, 2, 3]
    assert all(ln["strategy"] == "fedbuff" for ln in lines)
    assert [ln["counted"] for ln in lines] == [2, 2, 2]
    assert [ln["version"] for ln in lines] == [1, 2, 3]
    # it learns: the third step's head beats the first's (its level after 3 steps depends on which
    # updates came first, and on the fleet's norm bound)
    assert lines[-1]["accuracy"] > lines[0]["accuracy"]
    assert all(ln["round_refused"] is None and ln["epsilon"] is None for ln in lines)


def test_coordinator_dp_reports_epsilon_every_round_with_real_agents(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    lines = run_coordinator(
        mosquitto, fleet, tmp_path, 2,
        "--strategy", "fedavg", "--min-clients", "2", "--rounds", "2",
        "--dp-noise-multiplier", "1.0", "--dp-clip-norm", "1.0", "--dp-delta", "1e-5",
    )  # fmt: skip
    assert [ln["strategy"] for ln in lines] == ["dp-fedavg", "dp-fedavg"]
    assert [ln["counted"] for ln in lines] == [2, 2]
    eps = [ln["epsilon"] for ln in lines]
    assert 0 < eps[0] < eps[1] and all(ln["delta"] == 1e-5 for ln in lines)
    assert all(ln["norm_bound"] == 1.0 for ln in lines)
    assert lines[-1]["clipped_by_device"].keys() <= {"dev-0", "dev-1"}


@pytest.mark.subprocess
def test_coordinator_refuses_dp_around_a_robust_strategy() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "edgefl.cli", "coordinator",
         "--strategy", "median", "--dp-noise-multiplier", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1  # an invalid profile (the flags are profile overrides)
    assert "DP wraps fedavg, fedprox, fedavgm, fedadam or fedyogi, not median" in proc.stderr


def test_coordinator_buffered_step_takes_a_stale_update_weighted_by_staleness(
    mosquitto: Broker, fleet: str
) -> None:
    """The service's buffered schedule on crafted updates over the real broker: after one step (version 1),
    an update trained from version 0 that arrives between the steps is held and counts in step 2,
    weighted by s(1) = 1/sqrt(2)."""
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    D, K = W0.shape

    def update(dev: str, rnd: int, base: int, value: float) -> bytes:
        return encode_update(
            Update(rnd, base, dev, 10, np.full((D, K), value, np.float32), np.zeros(K, np.float32),
                   UpdateMetrics(0.1, 0.9, 0.01, 1), f"{dev}:{rnd}:{base}")
        )  # fmt: skip

    async def main() -> tuple[Coordinator, list[int]]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        dev = MqttTransport(mosquitto.host, mosquitto.port, f"dev-{fleet}")
        await t.start(wait_s=10)
        await dev.start(wait_s=10)
        strategy = FedBuff(buffer_size=2, clip_norm=1e6, deadline_s=30)
        coord = Coordinator(t, Topics("edgefl", fleet), W0, b0, model_sha256=bb.sha256, strategy=strategy)
        changed = asyncio.Event()
        coord.on_change = changed.set
        pump = asyncio.create_task(coord.pump())
        topics = coord.topics

        async def opened(n: int) -> None:  # the service notifies after announcing a round
            while coord.state.current is None or coord.state.current.number != n:
                changed.clear()
                await asyncio.wait_for(changed.wait(), 30)

        try:
            await coord.start()
            step1 = asyncio.create_task(coord.run_round(1))
            await opened(1)
            await dev.publish(topics.update("a"), update("a", 1, 0, 0.01), qos=1)
            await dev.publish(topics.update("b"), update("b", 1, 0, 0.01), qos=1)
            rec1 = await step1
            # between two steps: held, then offered to step 2 with staleness 1
            await dev.publish(topics.update("c"), update("c", 1, 0, 0.02), qos=1)  # stale: base 0
            while coord.dashboard_status()["held_updates"] != 1:
                changed.clear()
                await asyncio.wait_for(changed.wait(), 30)
            step2 = asyncio.create_task(coord.run_round(2))
            await opened(2)
            await dev.publish(topics.update("a"), update("a", 2, 1, 0.02), qos=1)
            rec2 = await step2
            return coord, [rec1.clients, rec2.clients]
        finally:
            pump.cancel()
            await dev.stop()
            await t.stop()

    coord, clients = asyncio.run(main())
    assert clients == [2, 2]
    assert coord.state.version == 2
    # step 1: +0.01; step 2: (s(1) * 0.02 + s(0) * 0.02) / 2
    expect = W0 + np.float32(0.01) + np.float32((staleness_weight(1) * 0.02 + 0.02) / 2)
    np.testing.assert_allclose(coord.W, expect, rtol=1e-5, atol=1e-6)
    assert coord.counted[2] == ["a:2:1", "c:1:0"]


def test_coordinator_refuses_a_round_whose_head_the_agents_would_refuse(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """An update that passes the norm bound (a loose fixed bound) but moves the head beyond MAX_HEAD_ABS:
    the round is refused, nothing is persisted or published, the head stays at version 0; the next
    good round publishes version 1. A state file holding a bad head is refused at start-up."""
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    D, K = W0.shape
    state = tmp_path / "coordinator.rec"

    def update(rnd: int, value: float) -> bytes:
        return encode_update(
            Update(rnd, 0, "a", 10, np.full((D, K), value, np.float32), np.zeros(K, np.float32),
                   UpdateMetrics(0.1, 0.9, 0.01, 1), f"a:{rnd}:0")
        )  # fmt: skip

    async def main() -> tuple[Coordinator, list[Any], list[GlobalModel]]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        dev = MqttTransport(mosquitto.host, mosquitto.port, f"dev-{fleet}")
        await t.start(wait_s=10)
        await dev.start(wait_s=10)
        strategy = FedAvg(clip_norm=1e9, min_clients=1, deadline_s=30)
        coord = Coordinator(t, Topics("edgefl", fleet), W0, b0, model_sha256=bb.sha256, strategy=strategy)
        coord.state_path = state
        changed = asyncio.Event()
        coord.on_change = changed.set
        pump = asyncio.create_task(coord.pump())
        topics = coord.topics
        await dev.subscribe(topics.global_model, 1)
        heads: list[GlobalModel] = []

        async def opened(n: int) -> None:
            while coord.state.current is None or coord.state.current.number != n:
                changed.clear()
                await asyncio.wait_for(changed.wait(), 30)

        try:
            await coord.start()
            heads.append(decode_global_model((await asyncio.wait_for(dev.queue.get(), 10)).payload))
            records = []
            for rnd, value in ((1, 5e4), (2, 0.01)):
                task = asyncio.create_task(coord.run_round(rnd))
                await opened(rnd)
                await dev.publish(topics.update("a"), update(rnd, value), qos=1)
                records.append(await task)
                if rnd == 1:  # the open round's updates were persisted (acknowledged on commit), no head
                    saved = Coordinator(
                        None, topics, W0, b0, model_sha256=bb.sha256, strategy=FedAvg()  # type: ignore[arg-type]
                    )
                    saved.load_state(state)
                    assert saved.state.version == 0 and np.array_equal(saved.W, W0)
            heads.append(decode_global_model((await asyncio.wait_for(dev.queue.get(), 10)).payload))
            return coord, records, heads
        finally:
            pump.cancel()
            await dev.stop()
            await t.stop()

    coord, records, heads = asyncio.run(main())
    assert [r.refused for r in records] == ["bad_value", ""]
    assert [r.clients for r in records] == [1, 1]
    assert coord.state.refused_rounds == {"bad_value": 1}
    assert [h.version for h in heads] == [0, 1]  # the refused round published nothing
    np.testing.assert_allclose(heads[1].W, W0 + np.float32(0.01), rtol=1e-6)
    assert coord.state.version == 1 and coord.counted == {2: ["a:2:0"]}
    assert state.exists()

    # a state file with a head the agents would refuse (an older coordinator could write one)
    other = Coordinator(
        None, Topics("edgefl", fleet), W0, b0, model_sha256=bb.sha256, strategy=FedAvg()  # type: ignore[arg-type]
    )
    other.W = np.full_like(W0, np.inf)
    other.save_state(tmp_path / "bad.rec")
    fresh = Coordinator(
        None, Topics("edgefl", fleet), W0, b0, model_sha256=bb.sha256, strategy=FedAvg()  # type: ignore[arg-type]
    )
    with pytest.raises(UpdateRejected) as e:
        fresh.load_state(tmp_path / "bad.rec")
    assert e.value.reason == "bad_state" and "not_finite" in str(e.value)
