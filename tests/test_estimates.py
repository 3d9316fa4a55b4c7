"""The governor's admission decisions on real models: what each phase is estimated to add decides.

How close each estimate is to what the phase adds is a benchmark (``bench/memory.py --estimates``,
figures in docs/benchmarks.md); here, the decisions those estimates make: the 1280 x 19 float head (a
held-back model's shape, rebuilt from the shipped float32 MobileNet) trains every round under the
shipped 96 MiB profile with the dashboard on, and ``edgefl check-config`` says so too; a replay file
larger than the headroom is refused before it is read; the inference arena never takes the room the
smallest training run needs; ``check-config``'s training verdict is the governor's at the same RSS.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import MODELS, ROOT, TEST_STATUS_INTERVAL_S, Broker, next_status, wait_until
from test_memory import fake_proc, set_rss

from edgefl.agent import estimates
from edgefl.agent.config import load_profile
from edgefl.agent.governor import Governor
from edgefl.agent.memstat import MIB
from edgefl.agent.preflight import floor_bytes, store_bytes, training_warning
from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.datasets import npz_headers
from edgefl.launcher import launch_agent, stop_agents
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from tests.support.models import run_backbone, widen_head

SHIPPED = ROOT / "firmware_configs" / "gateway_aarch64_256mb_mobilenet.toml"
FLOAT_MOBILENET = MODELS / "mobilenet_v2_035_96_float32.tflite"


@pytest.fixture(scope="module")
def head19(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped float32 MobileNet with a 19-class float head (D = 1280, K = 19)."""
    path = tmp_path_factory.mktemp("models") / "mobilenet_head19.tflite"
    path.write_bytes(widen_head(FLOAT_MOBILENET, 19))
    return path


def test_memory_estimate_head19_model_is_the_shape_asked(head19: Path) -> None:
    bb = Backbone(head19)
    W, b = bb.head_from_model()
    assert W.shape == (1280, 19) and b.shape == (19,) and bb.embedding_dim == 1280
    x = np.random.default_rng(0).integers(0, 256, (2, *bb.sample_shape)).astype(bb.input_dtype)
    emb, y = run_backbone(bb, x)
    np.testing.assert_allclose(emb @ W + b, y, atol=1e-4)  # the head read back is the model's


def test_memory_estimate_replay_from_the_headers_only(tmp_path: Path) -> None:
    n = 9000  # digits-sized samples: 9000 x 8 x 8 x 1 float64 = 4.4 MiB
    x = np.random.default_rng(0).random((n, 8, 8, 1))
    y = np.arange(n, dtype=np.int16) % 10
    path = tmp_path / "replay.npz"
    np.savez(path, x=x, y=y)
    assert npz_headers(path) == {
        "x": ((n, 8, 8, 1), np.dtype("float64")),
        "y": ((n,), np.dtype("int16")),
    }
    # every array, numpy's 256 KiB read buffer, the labels' int64 copy the daemon makes
    assert estimates.estimate_replay_bytes(path) == x.nbytes + y.nbytes + (256 << 10) + n * 8
    small = tmp_path / "small.npz"
    np.savez(small, x=np.zeros(100, np.uint8))
    assert estimates.estimate_replay_bytes(small) == 100 + 100  # a buffer no larger than the member


def test_memory_estimate_replay_file_not_an_npz_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "samples.npz"
    bad.write_bytes(b"not a zip at all")
    with pytest.raises(ValueError, match=r"samples\.npz: not an \.npz file"):
        npz_headers(bad)


def test_memory_estimate_inference_arena_leaves_the_training_room(tmp_path: Path, head19: Path) -> None:
    shapes = estimates.model_shapes(Backbone(head19))
    train = estimates.estimate_train_bytes(16, 1280, 19, 1024, resident_rows=1024)
    proc = fake_proc(tmp_path, rss=0)
    gov = Governor(96 * MIB, 4 * MIB, 0, proc=proc, cgroup_root=tmp_path / "none")
    arena8 = estimates.estimate_inference_bytes(shapes, 8, resident_batch=1)
    # a grown arena stays for good: it may not take the reserve (a call may, for what it frees after)
    set_rss(proc, 96 * MIB - arena8 - 1 * MIB)
    assert gov.admit_inference(shapes, 8, resident_batch=1).work < 8
    # batch 8 fits under the cap less the reserve, but would leave the smallest training no room
    set_rss(proc, 92 * MIB - arena8 - train // 2)
    plain = gov.admit_inference(shapes, 8, resident_batch=1)
    assert plain.work == 8 and not plain.deferred
    kept = gov.admit_inference(shapes, 8, resident_batch=1, keep_bytes=train)
    assert 1 <= kept.work < 8 and not kept.deferred
    assert gov.rss_bytes() + kept.estimate_bytes + 4 * MIB + train <= 96 * MIB
    # one sample grows nothing: it is never refused for the room it leaves
    set_rss(proc, 95 * MIB)
    assert gov.admit_inference(shapes, 1, resident_batch=1, keep_bytes=train).work == 1


@pytest.mark.parametrize("margin_mb", [-1, 1])
def test_memory_estimate_check_config_training_verdict_is_the_governors(
    tmp_path: Path, head19: Path, margin_mb: int
) -> None:
    bb = Backbone(head19)
    shapes = estimates.model_shapes(bb)
    baseline = 70 * MIB  # the process with the agent, the dashboard and the model loaded
    probe = load_profile(SHIPPED, {"model.path": str(head19), "device.state_dir": str(tmp_path / "s")})
    need = floor_bytes(probe, shapes, baseline, training=True)
    cap_mb = -(-(need + probe.memory.reserve_mb * MIB) // MIB) + margin_mb
    profile = load_profile(
        SHIPPED,
        {"model.path": str(head19), "device.state_dir": str(tmp_path / "s"), "memory.cap_mb": str(cap_mb)},
    )
    warned = training_warning(profile, shapes, baseline) is not None
    # the agent after start-up: the baseline, a full store, one sample's inference; then the first
    # training run at the smallest chunk over that store, as the device core asks for it
    cfg = profile.training
    proc = fake_proc(tmp_path, rss=0)
    set_rss(
        proc,
        baseline
        + store_bytes(cfg.store_capacity, 1280, cfg.holdout_every)
        + estimates.estimate_inference_bytes(shapes, 1),
    )
    reserve = profile.memory.reserve_mb * MIB
    gov = Governor(profile.cap_bytes, reserve, 0, proc=proc, cgroup_root=tmp_path / "none")
    adm = gov.admit_train(
        cfg.chunk_floor,
        cfg.chunk_floor,
        dim=1280,
        classes=19,
        batch_size=cfg.chunk_floor,
        num_examples=cfg.store_capacity,
        resident_rows=cfg.store_capacity,
    )
    assert warned == adm.deferred == (margin_mb < 0)


def _check_config(profile: Path, overrides: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "edgefl.cli", "check-config", str(profile)]
    for key, val in overrides.items():
        cmd += ["--set", f"{key}={val}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _agent(broker: Broker, fleet: str, tmp: Path, model: Path, frames: int, **extra: str) -> Any:
    bb = Backbone(model)
    classes = int(bb.head_from_model()[0].shape[1])
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(frames, *bb.sample_shape), dtype=np.uint8)
    np.savez(tmp / "frames.npz", x=x, y=rng.integers(0, classes, size=frames))
    overrides = {
        "model.path": str(model),
        "device.id": "dev-1",
        "device.fleet": fleet,
        "device.state_dir": str(tmp / "dev-1"),
        "broker.url": broker.url,
        "source.kind": "replay",
        "source.path": str(tmp / "frames.npz"),
        "memory.min_system_available_mb": "0",
        "dashboard.port": "0",
        "status.interval_s": TEST_STATUS_INTERVAL_S,
        "status.heartbeat_s": TEST_STATUS_INTERVAL_S,
        **extra,
    }
    return launch_agent(SHIPPED, overrides, tmp / "dev-1.log"), overrides


async def _fleet_coordinator(broker: Broker, fleet: str, model: Path) -> tuple[MqttTransport, Coordinator]:
    bb = Backbone(model)
    W0, b0 = bb.head_from_model()
    t = MqttTransport(broker.host, broker.port, f"coord-{fleet}")
    await t.start(wait_s=10)
    strategy = FedAvg(local_epochs=2, lr=0.05, batch_size=16, min_clients=1, deadline_s=30.0)
    return t, Coordinator(t, Topics("edgefl", fleet), W0, b0, model_sha256=bb.sha256, strategy=strategy)


@pytest.mark.broker
@pytest.mark.subprocess
@pytest.mark.timeout(240)
def test_memory_estimate_head19_trains_every_round_under_the_shipped_profile(
    mosquitto: Broker, fleet: str, tmp_path: Path, head19: Path
) -> None:
    proc, overrides = _agent(mosquitto, fleet, tmp_path, head19, 64)
    rounds = 3

    async def main() -> tuple[list[Any], dict[str, Any]]:
        t, coord = await _fleet_coordinator(mosquitto, fleet, head19)
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            await coord.registry.wait_for_devices(1, timeout_s=120)
            records = [await coord.run_round(r, selected=("dev-1",)) for r in range(1, rounds + 1)]
            applied = lambda: coord.registry.devices["dev-1"].get("version") == rounds  # noqa: E731
            await wait_until(applied, 30, "dev-1 applied the last head")
            return records, await next_status(coord, "dev-1")
        finally:
            pump.cancel()
            await t.stop()

    try:
        records, status = asyncio.run(main())
    finally:
        stop_agents([proc])
    log = (tmp_path / "dev-1.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    assert status["cap_bytes"] == 96 * MIB and status["dashboard_url"].startswith("http://127.0.0.1:")
    assert status["head_shape"] == [1280, 19]
    # every round trained, none deferred or declined: the estimates admitted training each time
    assert [(r.clients, r.declined) for r in records] == [(1, 0)] * rounds
    assert status["deferrals"] == {} and status["declined_total"] == 0
    assert not status["admissions"]["train"]["deferred"]
    # and the start-up check says the same of this profile: no problem, no "rounds defer" warning
    checked = _check_config(SHIPPED, overrides)
    assert checked.returncode == 0, checked.stderr
    assert "rounds defer" not in checked.stderr


@pytest.mark.broker
@pytest.mark.subprocess
@pytest.mark.timeout(180)
def test_memory_estimate_replay_larger_than_the_headroom_is_refused_before_it_is_read(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    # 3700 frames of 96 x 96 x 3 = 97.6 MiB: more than the shipped 96 MiB cap, let alone its headroom
    frames = 3700
    proc, _ = _agent(mosquitto, fleet, tmp_path, FLOAT_MOBILENET, frames)

    async def main() -> dict[str, Any]:
        t, coord = await _fleet_coordinator(mosquitto, fleet, FLOAT_MOBILENET)
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            def refused() -> bool:
                status = coord.registry.devices.get("dev-1") or {}
                return int((status.get("faults") or {}).get("replay", 0)) >= 1

            await wait_until(refused, 90, "dev-1 refusing its replay file")
            return await next_status(coord, "dev-1")
        finally:
            pump.cancel()
            await t.stop()

    try:
        status = asyncio.run(main())
        assert proc.poll() is None  # refused, counted, and the agent carries on
    finally:
        stop_agents([proc])
    log = (tmp_path / "dev-1.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    assert "BudgetExceeded: phase replay" in log
    adm = status["admissions"]["replay"]
    assert adm["deferred"] and adm["estimate_bytes"] > frames * 96 * 96 * 3
    # never loaded: the agent's lifetime peak stayed under its cap, and nothing was classified
    assert status["peak_rss_bytes"] < status["cap_bytes"] == 96 * MIB
    assert status["inferred_total"] == 0 and status["store_samples"] == 0
