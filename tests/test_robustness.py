"""Stragglers, late joiners and callbacks that raise: the federation keeps going (issue 6)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import INT8_MODEL, Broker, start_replay_agent, wait_until

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.datasets import load_digits, partition_non_iid, split_digits
from edgefl.launcher import stop_agents
from edgefl.mqtt_link import Message
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.rounds import Update, UpdateMetrics, encode_update

pytestmark = pytest.mark.timeout(180)


def _agent(mosquitto: Broker, fleet: str, tmp_path: Path, dev: str, shard: np.ndarray) -> Any:
    x, y = load_digits()
    return start_replay_agent(mosquitto, fleet, tmp_path, dev, x[shard], y[shard])


def test_robust_rounds_with_a_straggler_and_a_late_joiner(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    _, y = load_digits()
    pool = split_digits(y).devices
    shards = [pool[s] for s in partition_non_iid(y[pool], 2)]
    procs = [_agent(mosquitto, fleet, tmp_path, "dev-1", shards[0])]
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    topics = Topics("edgefl", fleet)

    async def main() -> tuple[list[int], Coordinator, dict[str, Any]]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        late = MqttTransport(mosquitto.host, mosquitto.port, f"late-{fleet}")
        await t.start()
        await late.start()
        # min_clients 2 but only dev-1 is up: each round must close at its deadline, not stall
        strategy = FedAvg(local_epochs=2, lr=0.05, batch_size=16, min_clients=2, deadline_s=3.0)
        coord = Coordinator(t, topics, W0, b0, model_sha256=bb.sha256, strategy=strategy)
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            await coord.registry.wait_for_devices(1, timeout_s=60)
            clients = [(await coord.run_round(r)).clients for r in (1, 2)]
            # a straggler's update for round 1 arrives while round 3 is open: refused by round number
            run3 = asyncio.create_task(coord.run_round(3))
            await wait_until(lambda: coord.state.round == 3, 10, "round 3 open")
            stale = Update(
                1,
                0,
                "dev-9",
                50,
                np.zeros_like(W0),
                np.zeros_like(b0),
                UpdateMetrics(1.0, 0.5, 0.01, 1),
                "dev-9:1:0",
            )
            await late.publish(topics.update("dev-9"), encode_update(stale), qos=1)
            clients.append((await run3).clients)
            # a device that was away for 3 rounds joins: it catches up from the retained global head
            procs.append(_agent(mosquitto, fleet, tmp_path, "dev-2", shards[1]))
            await coord.registry.wait_for_devices(2, timeout_s=60)
            clients.append((await coord.run_round(4)).clients)
            await wait_until(  # statuses every 0.2 s in tests (status.interval_s)
                lambda: coord.registry.devices["dev-2"].get("version") == 4, 15, "dev-2's status at version 4"
            )
            return clients, coord, dict(coord.registry.devices["dev-2"])
        finally:
            pump.cancel()
            await late.stop()
            await t.stop()

    try:
        clients, coord, dev2 = asyncio.run(main())
    finally:
        stop_agents(procs)
    assert clients == [1, 1, 1, 2]
    assert coord.state.rejected["stale_round"] == 1
    assert coord.state.version == 4
    assert dev2["version"] == 4  # joined at version 3 (retained), trained on it, then applied 4
    assert [h.clients for h in coord.state.history] == [1, 1, 1, 2]  # no round stalled below min_clients


def test_robust_transport_survives_a_raising_callback(
    mosquitto: Broker, fleet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> tuple[list[bytes], int]:
        a = MqttTransport(mosquitto.host, mosquitto.port, f"a-{fleet}")
        b = MqttTransport(mosquitto.host, mosquitto.port, f"b-{fleet}")
        original = b._handle_message
        calls = {"n": 0}

        def flaky(conn: Any, mid: int, qos: int, msg: Message) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("handler bug")
            original(conn, mid, qos, msg)

        monkeypatch.setattr(b, "_handle_message", flaky)
        await a.start()
        await b.start()
        try:
            await b.subscribe(f"{fleet}/x", 1)  # returns after the SUBACK
            for payload in (b"1", b"2", b"3"):
                await a.publish(f"{fleet}/x", payload, qos=1)
            got = [(await asyncio.wait_for(b.queue.get(), 5)).payload for _ in range(2)]
            return got, b.refused_total  # a message whose handling raised: acknowledged, counted
        finally:
            await a.stop()
            await b.stop()

    got, errors = asyncio.run(main())
    assert got == [b"2", b"3"]  # the network loop went on after the first handler raised
    assert errors == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [("lr", 1e308), ("local_epochs", 2**62), ("batch_size", 2**62), ("deadline_s", 1e12), ("prox_mu", 1e9)],
)
def test_robust_round_settings_out_of_bounds_are_refused(field: str, value: float) -> None:
    from edgefl.errors import DecodeError
    from edgefl.wire.rounds import RoundAnnouncement, decode_round, encode_round

    fields: dict[str, Any] = {
        "round": 1,
        "base_version": 0,
        "deadline_s": 5.0,
        "local_epochs": 2,
        "lr": 0.05,
        "batch_size": 16,
        "min_clients": 1,
        "selected": 1.0,
    }
    fields[field] = value
    with pytest.raises(DecodeError, match="bad_value"):
        decode_round(encode_round(RoundAnnouncement(**fields)))


def test_robust_absurd_but_finite_head_is_refused() -> None:
    from edgefl.errors import UpdateRejected
    from edgefl.head import MAX_HEAD_ABS, validate_head

    W = np.full((4, 3), 3e38, np.float32)
    with pytest.raises(UpdateRejected, match="bad_value"):
        validate_head(W, np.zeros(3, np.float32), (4, 3))
    validate_head(np.full((4, 3), MAX_HEAD_ABS, np.float32), np.zeros(3, np.float32), (4, 3))


def test_robust_training_stops_at_its_time_budget(tmp_path: Path) -> None:
    import time

    from edgefl.agent.store import EmbeddingStore
    from edgefl.agent.trainer import train_local
    from edgefl.head import Head

    rng = np.random.default_rng(0)
    store = EmbeddingStore(tmp_path, capacity=512, dim=8)
    store.add(rng.normal(size=(512, 8)).astype(np.float32), rng.integers(0, 3, 512).astype(np.int64))
    head = Head(np.zeros((8, 3), np.float32), np.zeros(3, np.float32))
    t0 = time.perf_counter()
    res = train_local(
        head, store, local_epochs=1_000_000, lr=0.01, batch_size=4, chunk_size=64, time_budget_s=0.5
    )
    assert time.perf_counter() - t0 < 5.0
    assert res.num_examples == 512 and 0.0 <= res.accuracy <= 1.0


def test_shipped_round_below_the_minimum_waits_to_its_deadline_then_is_abandoned(
    mosquitto: Broker, fleet: str
) -> None:
    """Trimmed mean (beta 0.2) tolerating 1 of 5, ``min_clients = 2`` (the shipped profile's): two
    updates do not close the round (it announces ``min_clients = 5``); at the deadline the round is
    abandoned as ``too_few`` with nothing aggregated (version and head kept, no history committed)."""
    from edgefl.coordinator.robust import TrimmedMean
    from edgefl.wire.rounds import decode_round

    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    topics = Topics("edgefl", fleet)

    def update(dev: str) -> bytes:
        up = Update(1, 0, dev, 10, np.full_like(W0, -0.5 if dev == "evil" else 0.01), np.zeros_like(b0),
                    UpdateMetrics(0.1, 0.9, 0.01, 1), f"{dev}:1:0")  # fmt: skip
        return encode_update(up)

    async def main() -> tuple[Coordinator, Any, int]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        dev = MqttTransport(mosquitto.host, mosquitto.port, f"dev-{fleet}")
        await t.start(wait_s=10)
        await dev.start(wait_s=10)
        await dev.subscribe(topics.round, 1)
        strategy = TrimmedMean(trim_fraction=0.2, tolerate=1, min_clients=2, deadline_s=3.0)
        coord = Coordinator(t, topics, W0, b0, model_sha256=bb.sha256, strategy=strategy)
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start(adopt_wait_s=0.5)
            run1 = asyncio.create_task(coord.run_round(1))
            ann = None
            while ann is None:
                msg = await asyncio.wait_for(dev.queue.get(), 10)
                if msg.topic == topics.round and msg.payload:
                    ann = decode_round(msg.payload)
            for d in ("evil", "dev-1"):
                await dev.publish(topics.update(d), update(d), qos=1)
            record = await run1
            return coord, record, ann.min_clients
        finally:
            pump.cancel()
            await dev.stop()
            await t.stop()

    coord, record, announced = asyncio.run(main())
    assert announced == 5
    assert record.refused == "too_few" and record.clients == 2
    assert coord.state.version == 0 and dict(coord.state.refused_rounds) == {"too_few": 1}
    np.testing.assert_array_equal(coord.W, W0)
    assert len(coord.strategy.norm_bound.history) == 0
