"""End to end: a coordinator and 2 real agent processes over a real mosquitto, on the real model and data."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import INT8_MODEL, Broker, start_replay_agent, wait_until

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.datasets import load_digits, partition_non_iid, split_digits
from edgefl.evaluation import accuracy, embed_all
from edgefl.launcher import stop_agents
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.global_model import GlobalModel, encode_global_model

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def two_agents(mosquitto: Broker, fleet: str, tmp_path: Path) -> Iterator[tuple[list[Any], dict[str, Any]]]:
    x, y = load_digits()
    split = split_digits(y)
    pool = split.devices
    shards = [pool[s] for s in partition_non_iid(y[pool], 2)]
    procs = []
    for k, shard in enumerate(shards):
        dev = f"dev-{k + 1}"
        procs.append(
            start_replay_agent(
                mosquitto, fleet, tmp_path, dev, x[shard], y[shard], training__store_capacity="1024"
            )
        )
    ctx = {"x": x, "y": y, "split": split, "tmp": tmp_path}
    try:
        yield procs, ctx
    finally:
        stop_agents(procs)
        for k in range(len(procs)):
            print((tmp_path / f"dev-{k + 1}.log").read_text(errors="replace")[-3000:])


def test_e2e_accuracy_rises_and_bad_input_is_counted(
    mosquitto: Broker, fleet: str, two_agents: tuple[list[Any], dict[str, Any]]
) -> None:
    procs, ctx = two_agents
    x, y, split = ctx["x"], ctx["y"], ctx["split"]
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    emb_test = embed_all(bb, x[split.test], (0.0,), (16.0,))
    y_test = y[split.test]
    baseline = accuracy(W0, b0, emb_test, y_test)

    async def main() -> tuple[list[float], dict[str, Any], int]:
        topics = Topics("edgefl", fleet)
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        await t.start(wait_s=10)
        coord = Coordinator(
            t,
            topics,
            W0,
            b0,
            model_sha256=bb.sha256,
            strategy=FedAvg(local_epochs=2, lr=0.05, batch_size=16, min_clients=2, deadline_s=60),
            lr_decay=0.8,
            evaluate=lambda W, b: accuracy(W, b, emb_test, y_test),
        )
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            await coord.registry.wait_for_devices(2, timeout_s=90)
            accs = [(await coord.run_round(r)).accuracy for r in (1, 2, 3)]
            assert all(h.clients == 2 for h in coord.state.history)
            # Hostile input on the agents' topics: garbage, a wrong-shaped head, a NaN head, an old version.
            good_version = coord.state.version
            bad_W = np.full((5, 10), 0.1, np.float32)
            nan_W = W0.copy()
            nan_W[0, 0] = np.nan
            for payload in (
                b"\xff\x00garbage",
                encode_global_model(GlobalModel(9, good_version + 1, bb.sha256, bad_W, b0)),
                encode_global_model(GlobalModel(9, good_version + 2, "0" * 64, W0, b0)),
                encode_global_model(GlobalModel(2, 1, bb.sha256, W0, b0)),
                encode_global_model(GlobalModel(9, good_version + 3, bb.sha256, nan_W, b0)),
            ):
                await t.publish(topics.global_model, payload, qos=1, retain=False)
            # the retained global must still be the good one for late joiners
            await coord.publish_global(3)
            # agents keep working: a 4th round still gets both updates
            rec = await coord.run_round(4)
            assert rec.clients == 2
            await wait_until(  # statuses (every 0.2 s: status.interval_s) once both applied the last head
                lambda: all(
                    coord.registry.devices[d].get("version") == coord.state.version
                    for d in ("dev-1", "dev-2")
                ),
                15,
                "both agents' statuses at the last version",
            )
            return accs, coord.registry.devices, coord.state.version
        finally:
            pump.cancel()
            await t.stop()

    accs, devices, version = asyncio.run(main())
    assert baseline < 0.55
    assert accs[-1] > baseline + 0.25, (baseline, accs)
    assert accs[-1] >= accs[0] - 0.02, accs
    assert not any(math.isnan(a) for a in accs)
    assert all(p.poll() is None for p in procs), "an agent died"
    for dev in ("dev-1", "dev-2"):
        st = devices[dev]
        rejected = st["rejected"]
        assert rejected.get("bad_cbor", 0) >= 1, rejected
        assert rejected.get("bad_shape", 0) >= 1, rejected
        assert rejected.get("wrong_model", 0) >= 1, rejected
        assert rejected.get("not_newer", 0) >= 1, rejected
        assert rejected.get("not_finite", 0) >= 1, rejected
        assert st["version"] == version
        assert st["peak_rss_bytes"] <= st["cap_bytes"]
