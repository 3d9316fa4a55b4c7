"""Tests of agent/status.py: a status is published when it says something, not for a round's progress."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import INT8_MODEL, Broker, next_status_fields, start_replay_agent

from edgefl.agent.status import ROUND_STATES, status_news
from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.datasets import load_digits
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.rounds import Update, UpdateMetrics, decode_update, encode_update
from edgefl.wire.status import decode_status

FIELDS: dict[str, Any] = {
    "round": 3,
    "version": 3,
    "reason": "",
    "ready": True,
    "store_samples": 500,
    "last_update_bytes": 5435,
    "outbox_pending": 0,
    "eval_version": 3,
    "eval_accuracy": 0.9,
    "eval_count": 20,
    "rejected": {},
    "faults": {},
    "rss_bytes": 60_000_000,
    "ts": 1.0,
    "model_sha256": "ab" * 32,
}


def test_status_news_ignores_round_progress_and_volatile_figures() -> None:
    base = status_news("idle", FIELDS)
    progressed = dict(
        FIELDS,
        round=4,
        version=4,
        store_samples=532,
        last_update_bytes=5440,
        outbox_pending=1,
        eval_version=4,
        eval_accuracy=0.91,
        eval_count=21,
        rss_bytes=61_000_000,
        ts=2.0,
    )
    assert {"idle", "training", "uploading", "waiting"} == ROUND_STATES
    for state in ROUND_STATES:
        assert status_news(state, progressed) == base
    # news: a state outside the round's routine, a reason, readiness, a refusal, another model
    news = [
        status_news("deferred", FIELDS),
        status_news("idle", dict(FIELDS, reason="update not delivered yet")),
        status_news("training", dict(FIELDS, reason="training chunk 64 (memory)")),
        status_news("idle", dict(FIELDS, ready=False)),
        status_news("idle", dict(FIELDS, rejected={"bad_chunk": 1})),
        status_news("idle", dict(FIELDS, model_sha256="cd" * 32)),
    ]
    assert base not in news and len(set(news)) == len(news)


@pytest.mark.timeout(180)
def test_status_not_published_for_round_progress_the_coordinator_sees_it_in_the_update(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """Checked every 0.05 s with an hour's heartbeat, an agent answering 3 rounds publishes no status
    (it used to publish ~4 a round: training, uploading, waiting, new version); the coordinator's
    registry and fleet page still show the device's round and update size, taken from its updates."""
    x, y = load_digits()
    backbone = Backbone(INT8_MODEL)
    w0, b0 = backbone.head_from_model()
    proc = start_replay_agent(
        mosquitto,
        fleet,
        tmp_path,
        "dev-1",
        x[:96],
        y[:96],
        status__interval_s="0.05",
        status__heartbeat_s="3600",
    )
    topics = Topics("edgefl", fleet)

    async def main() -> tuple[list[str], dict[str, Any], dict[str, Any], list[int]]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        await t.start(wait_s=10)
        coord = Coordinator(
            t,
            topics,
            w0,
            b0,
            model_sha256=backbone.sha256,
            strategy=FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=1, deadline_s=60),
        )
        seen: list[str] = []
        handle = coord.handle

        def spy(msg: Any) -> None:  # the coordinator's own pump: note every status it is handed
            if msg.topic == topics.status("dev-1") and msg.payload:
                seen.append(decode_status(msg.payload).state)
            handle(msg)

        coord.handle = spy  # type: ignore[method-assign]
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            await coord.registry.wait_for_devices(1, timeout_s=90)
            # start-up news: the coordinator's own retained head (version 0, held already) counted as
            # a redelivery; wait for that status, then count from there
            await coord.registry.wait_for_devices(1, timeout_s=60, key="redelivered_total")
            seen.clear()
            sizes = []
            for r in (1, 2, 3):
                rec = await coord.run_round(r)
                assert rec.clients == 1
                # the device's evaluation of the base head came with its update, not a status
                assert rec.fed_devices == 1 and 0.0 <= rec.fed_accuracy <= 1.0, rec
                sizes.append(int(rec.update_bytes_mean))
            await asyncio.sleep(0.5)  # 10 status checks after the last head went out
            return seen, dict(coord.registry.devices["dev-1"]), coord.dashboard_status(), sizes
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            await t.stop()

    try:
        seen, entry, page, sizes = asyncio.run(main())
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert seen == []  # no status in 3 rounds: their progress is no news
    assert entry["round"] == 3 and entry["last_update_bytes"] == sizes[-1]
    assert entry["ready"] is True and entry["state"] == "idle"  # the last status said so
    assert page["devices"]["dev-1"]["last_round"] == 3 and page["devices"]["dev-1"]["online"] is True


@pytest.mark.timeout(180)
def test_status_redelivery_is_published_at_once(mosquitto: Broker, fleet: str, tmp_path: Path) -> None:
    """Checked only every 30 s, an agent still publishes a counted redelivery at once (it used to
    wait for the next state change, and landed in the next round's bytes)."""
    from edgefl.wire.global_model import GlobalModel, encode_global_model

    x, y = load_digits()
    backbone = Backbone(INT8_MODEL)
    w0, b0 = backbone.head_from_model()
    proc = start_replay_agent(
        mosquitto,
        fleet,
        tmp_path,
        "dev-1",
        x[:32],
        y[:32],
        status__interval_s="30",
        status__heartbeat_s="3600",
    )
    topics = Topics("edgefl", fleet)
    same = encode_global_model(GlobalModel(0, 0, backbone.sha256, w0, b0))  # the version it holds

    async def main() -> dict[str, Any]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"peer-{fleet}")
        await t.start(wait_s=10)
        await t.subscribe(topics.status("dev-1"), 1)

        try:
            async with asyncio.timeout(90):  # statuses until the agent is ready
                f = await next_status_fields(t)
                while not f.get("ready"):
                    f = await next_status_fields(t)
            await t.publish(topics.global_model, same, qos=1, retain=False)
            async with asyncio.timeout(10):  # well under status.interval_s: the redelivery's own status
                f = await next_status_fields(t)
                while f.get("redelivered_total") != 1:
                    f = await next_status_fields(t)
            return f
        finally:
            await t.stop()

    try:
        fields = asyncio.run(main())
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert fields["version"] == 0 and fields["state"] == "idle"


def test_status_evaluation_travels_in_the_update() -> None:
    """The base head's federated evaluation rides in the update's metrics , both keys or none."""
    import cbor2
    import numpy as np
    import pytest as _pytest

    from edgefl.errors import DecodeError

    w = np.full((4, 3), 0.01, np.float32)
    metrics = UpdateMetrics(0.5, 0.75, 0.01, 1 << 20, eval_accuracy=0.8, eval_count=20)
    upd = Update(3, 2, "dev-1", 12, w, np.zeros(3, np.float32), metrics, "dev-1:3:2")
    payload = encode_update(upd)
    obj = cbor2.loads(payload)
    assert obj["v"] == 1 and obj["metrics"]["eval_accuracy"] == 0.8 and obj["metrics"]["eval_count"] == 20
    got = decode_update(payload, expect_shape=(4, 3))
    assert (got.metrics.eval_accuracy, got.metrics.eval_count) == (0.8, 20)
    plain = encode_update(
        Update(3, 2, "dev-1", 12, w, np.zeros(3, np.float32), UpdateMetrics(0.5, 0.75, 0.01, 1), "u")
    )
    assert cbor2.loads(plain)["v"] == 1 and "eval_accuracy" not in cbor2.loads(plain)["metrics"]
    assert decode_update(plain).metrics.eval_accuracy is None
    changes: list[tuple[dict[str, Any], str]] = [
        ({"eval_count": None}, "missing_key"),  # None: the key removed
        ({"eval_accuracy": 1.5}, "bad_value"),
        ({"eval_count": 0}, "bad_value"),
        ({"eval_count": "20"}, "wrong_type"),
    ]
    for change, reason in changes:
        bad = cbor2.loads(payload)
        for key, value in change.items():
            if value is None:
                del bad["metrics"][key]
            else:
                bad["metrics"][key] = value
        with _pytest.raises(DecodeError) as info:
            decode_update(cbor2.dumps(bad))
        assert info.value.reason == reason, (info.value, reason)


def _training(fields: dict[str, Any]) -> bool:
    return fields.get("state") == "training"


@pytest.mark.subprocess
def test_status_after_a_reconnect_is_published_at_once_beside_a_long_round(tmp_path: Path) -> None:
    """A device's status check waits while a round is in hand (one check after the round, not three
    beside its training), except after a (re)connect: the broker may hold the "offline" will, and
    the coordinator leaves an offline device out of rounds. The broker restarts while the device
    trains a round of many epochs (status checked every 30 s): its status comes back, saying
    "training", while the round still trains."""
    from conftest import restart_mosquitto, start_mosquitto

    from edgefl.wire.compression import Compression
    from edgefl.wire.rounds import RoundAnnouncement, encode_round

    broker = start_mosquitto(tmp_path)
    fleet = "reconnect"
    x, y = load_digits()
    proc = start_replay_agent(
        broker, fleet, tmp_path, "dev-1", x[:1600], y[:1600],
        status__interval_s="30", status__heartbeat_s="3600",
    )
    topics = Topics("edgefl", fleet)
    ann = RoundAnnouncement(
        round=1, base_version=0, deadline_s=600.0, local_epochs=1000, lr=0.001, batch_size=8,
        min_clients=1, selected=1.0, compression=Compression.NONE, topk_fraction=0.1, prox_mu=0.0,
    )

    async def statuses_until(
        b: Broker, client: str, timeout_s: float, done: Callable[[dict[str, Any]], bool], announce: bool
    ) -> dict[str, Any]:
        """dev-1's statuses on ``b`` until ``done`` holds; then, with ``announce``, the round."""
        t = MqttTransport(b.host, b.port, f"{client}-{fleet}")
        await t.start(wait_s=10)
        await t.subscribe(topics.status("dev-1"), 1)
        try:
            async with asyncio.timeout(timeout_s):
                f = await next_status_fields(t)
                while not done(f):
                    f = await next_status_fields(t)
            if announce:
                await t.publish(topics.round, encode_round(ann), qos=1, retain=False)
                await asyncio.sleep(1.0)  # the device is training (1,000 epochs of 200 steps: 10 s or more)
            return f
        finally:
            await t.stop()

    try:
        asyncio.run(statuses_until(broker, "coord", 90, lambda f: bool(f.get("ready")), announce=True))
        broker.proc.terminate()
        broker.proc.wait(timeout=10)
        broker = restart_mosquitto(broker)  # no persistence: no will, no retained status left
        # within 20 s (statuses_until's timeout), while the round still trains
        training = asyncio.run(statuses_until(broker, "peer", 20, _training, False))
    finally:
        # killed: a SIGTERM waits for the training in hand (1,000 epochs), and this test is about the status
        proc.kill()
        proc.wait(timeout=60)
        broker.proc.terminate()
        broker.proc.wait(timeout=10)
    # published after the reconnect while the round was still training (before the fix: after the
    # round, or at the next 30 s check)
    assert training["state"] == "training"
