"""A big backbone under the cap (issue 14 item 5): the batch shrinks to fit, the governor never runs work
it judged over budget, and a deferred round is retried when memory frees or declined to the coordinator.

The real 1280-wide float MobileNet (``models/mobilenet_v2_035_96_float32.tflite``), real agent
processes on the shipped 96 MiB profile (``firmware_configs/gateway_aarch64_256mb_mobilenet.toml``,
dashboard on), a real mosquitto and the real coordinator. The retry/decline rule is also checked on
the device core with a governor reading a fake ``/proc`` (RSS set by the test), where memory can be
made to free on cue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import MODELS, ROOT, TEST_STATUS_INTERVAL_S, Broker, next_status, wait_until
from test_memory import fake_proc, set_rss

from edgefl.agent.config import load_profile
from edgefl.agent.core import DeviceCore
from edgefl.agent.governor import Governor
from edgefl.agent.memstat import MIB
from edgefl.agent.round import RoundStatus
from edgefl.agent.store import EmbeddingStore
from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.head import Head
from edgefl.launcher import launch_agent, stop_agents
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.rounds import RoundAnnouncement, decode_decline

pytestmark = pytest.mark.timeout(180)

BIG_PROFILE = ROOT / "firmware_configs" / "gateway_aarch64_256mb_mobilenet.toml"
BIG_MODEL = MODELS / "mobilenet_v2_035_96_float32.tflite"


def _announcement(round_no: int, deadline_s: float = 10.0) -> RoundAnnouncement:
    return RoundAnnouncement(
        round=round_no,
        base_version=0,
        deadline_s=deadline_s,
        local_epochs=1,
        lr=0.05,
        batch_size=16,
        min_clients=1,
        selected=1.0,
    )


@pytest.mark.subprocess
def test_own_model_deferred_round_retried_when_memory_frees_else_declined(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, rss=95 * MIB)  # 1 MiB under the cap: nothing deferrable fits
    gov = Governor(96 * MIB, 8 * MIB, 0, proc=proc, cgroup_root=tmp_path / "none")
    profile = load_profile(
        BIG_PROFILE,
        {"device.id": "dev-1", "device.fleet": "f1", "device.state_dir": str(tmp_path / "state")},
    )
    D, K = 1280, 10
    rng = np.random.default_rng(0)
    core = DeviceCore(
        profile, Head(np.zeros((D, K), np.float32), np.zeros(K, np.float32), 0), "0" * 64, governor=gov
    )
    core.store.add(rng.standard_normal((64, D)).astype(np.float32), rng.integers(0, K, 64))

    first = core.answer_round(_announcement(1))
    assert first.status == RoundStatus.DEFERRED and first.reason.startswith("train: needs")
    assert core.deferred is not None and core.deferred.ann.round == 1
    since = core.deferred.since_s
    # still short of memory: retried, deferred again, the first deferral's time kept
    again = core.retry_deferred(now_s=since + 1.0)
    assert again is not None and again.status == RoundStatus.DEFERRED
    assert core.deferred.since_s == since and gov.deferrals["train"] == 2
    assert "train" not in gov.phase_counts  # work judged over budget never ran
    # memory frees: the next retry trains and keeps the update in the outbox
    set_rss(proc, 40 * MIB)
    trained = core.retry_deferred(now_s=since + 2.0)
    assert trained is not None and trained.status == RoundStatus.TRAINED
    assert trained.entry is not None and trained.entry.update_id == "dev-1:1:0"
    assert core.deferred is None and gov.phase_counts["train"] == 1

    # round 2 stays over budget: declined once half its 10 s deadline has passed
    set_rss(proc, 95 * MIB)
    assert core.answer_round(_announcement(2)).status == RoundStatus.DEFERRED
    since = core.deferred.since_s
    assert core.retry_deferred(now_s=since + 4.9).status == RoundStatus.DEFERRED  # type: ignore[union-attr]
    declined = core.retry_deferred(now_s=since + 5.0)
    assert declined is not None and declined.status == RoundStatus.DECLINED
    assert declined.reason == "over_budget" and declined.entry is not None
    msg = decode_decline(declined.entry.payload)
    assert (msg.round, msg.base_version, msg.device, msg.reason) == (2, 0, "dev-1", "over_budget")
    assert msg.update_id == "dev-1:2:0:declined" and msg.detail.startswith("train: needs")
    assert "dev-1:2:0:declined" in {e.update_id for e in core.outbox.pending()}  # re-sent until PUBACK
    assert core.answered is not None and core.answered.round == 2 and core.declined_total == 1
    assert core.answer_round(_announcement(2)).status == RoundStatus.ANSWERED  # never trained later

    # round 3 deferred, round 4 announced: round 3 is declined, not silently replaced
    assert core.answer_round(_announcement(3)).status == RoundStatus.DEFERRED
    assert core.answer_round(_announcement(4)).status == RoundStatus.DEFERRED
    superseded = core.take_declines()
    assert [(r.round, r.status, r.reason) for r in superseded] == [(3, RoundStatus.DECLINED, "over_budget")]
    assert core.deferred is not None and core.deferred.ann.round == 4 and core.declined_total == 2
    assert core.take_declines() == []
    # a newer global head arrives meanwhile: the retry refuses round 4 as stale once and forgets it
    core.head = Head(core.head.W, core.head.b, 1)
    set_rss(proc, 40 * MIB)
    stale = core.retry_deferred(now_s=core.deferred.since_s + 1.0)
    assert stale is not None and (stale.status, stale.reason) == (RoundStatus.REFUSED, "stale_round")
    assert core.deferred is None and core.retry_deferred() is None


def _frames(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = Backbone(BIG_MODEL).sample_shape
    return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8), rng.integers(0, 10, size=n)


def _start_big_agent(
    broker: Broker, fleet: str, tmp: Path, frames: int = 64, **overrides: str
) -> subprocess.Popen[bytes]:
    """A real agent on the shipped big-backbone profile (dashboard on, a free port), replaying ``frames``."""
    x, y = _frames(frames, seed=1)
    np.savez(tmp / "frames.npz", x=x, y=y)
    return launch_agent(
        BIG_PROFILE,
        {
            "device.id": "dev-1",
            "device.fleet": fleet,
            "device.state_dir": str(tmp / "dev-1"),
            "broker.url": broker.url,
            "source.kind": "replay",
            "source.path": str(tmp / "frames.npz"),
            "memory.min_system_available_mb": "0",
            "dashboard.port": "0",
            "status.interval_s": TEST_STATUS_INTERVAL_S,
            # every check publishes (the profile's 60 s heartbeat would hold back a status that only
            # moves memory figures, and the tests wait for a fresh one after the round)
            "status.heartbeat_s": TEST_STATUS_INTERVAL_S,
            **{k.replace("__", "."): v for k, v in overrides.items()},
        },
        tmp / "dev-1.log",
    )


async def _coordinator(broker: Broker, fleet: str, deadline_s: float) -> tuple[MqttTransport, Coordinator]:
    bb = Backbone(BIG_MODEL)
    W0, b0 = bb.head_from_model()
    t = MqttTransport(broker.host, broker.port, f"coord-{fleet}")
    await t.start(wait_s=10)
    coord = Coordinator(
        t,
        Topics("edgefl", fleet),
        W0,
        b0,
        model_sha256=bb.sha256,
        strategy=FedAvg(local_epochs=2, lr=0.05, batch_size=16, min_clients=1, deadline_s=deadline_s),
    )
    return t, coord


def test_own_model_big_backbone_batch_shrinks_to_fit_and_the_round_is_answered(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """Asked for 128 frames per invoke (~116 MiB of arena), the agent runs what fits under 96 MiB."""
    proc = _start_big_agent(mosquitto, fleet, tmp_path, 256, pipeline__batch="128")

    async def main() -> tuple[Any, dict[str, Any], dict[str, Any]]:
        t, coord = await _coordinator(mosquitto, fleet, deadline_s=30.0)
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            await coord.registry.wait_for_devices(1, timeout_s=90)
            record = await coord.run_round(1, selected=("dev-1",))
            version = 1 if record.clients else 0  # trained: its status says so once it has the new head
            await wait_until(
                lambda: (
                    coord.registry.devices["dev-1"].get("round") == 1
                    and coord.registry.devices["dev-1"].get("state") in ("waiting", "idle")
                    and coord.registry.devices["dev-1"].get("version") == version
                ),
                30,
                f"dev-1 done with round 1 at head version {version}",
            )
            return record, await next_status(coord, "dev-1"), coord.dashboard_status()
        finally:
            pump.cancel()
            await t.stop()

    try:
        record, status, page = asyncio.run(main())
    finally:
        stop_agents([proc])
    log = (tmp_path / "dev-1.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    assert status["cap_bytes"] == 96 * MIB and status["dashboard_url"].startswith("http://127.0.0.1:")
    pipe, adm = status["pipeline"], status["admissions"]["inference"]
    # the batch asked for never fits: halved until it does, and the interpreter never allocated 128
    assert pipe["batch"] == 128 and adm["requested_work"] == 128
    assert 1 <= adm["work"] < 128 and pipe["tensor_batch"] == adm["work"]
    assert pipe["allocated_batch"] < 128
    assert status["inferred_total"] == 256 and status["store_samples"] > 0
    # the round is answered: trained, or declined with a reason the coordinator records
    assert record.clients + record.declined == 1
    if record.declined:
        assert page["declined"] == {"over_budget": 1}
    else:
        assert status["version"] == 1 and status["declined_total"] == 0


@pytest.mark.long
def test_own_model_governor_refuses_over_budget_work_and_the_coordinator_records_the_decline(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """No room under cap - reserve: a replay file over the cap is refused before it is loaded, no
    training runs, the round is declined."""
    rng = np.random.default_rng(2)
    store = EmbeddingStore(tmp_path / "dev-1", 1024, 1280, num_classes=10)  # the profile's store
    store.add(rng.standard_normal((32, 1280)).astype(np.float32), rng.integers(0, 10, 32))
    store.flush()
    del store
    # The start-up check refuses a cap under the model's floor (the process with every page its imports,
    # the dashboard and the model mapped, the whole store, one sample's inference): a cap 1 MiB above
    # it passes, and a reserve that leaves 20 MiB under the cap (less than any agent's RSS) puts its
    # training over budget; its 3700-frame replay file (97.6 MiB) is over the cap itself.
    probe = _start_big_agent(mosquitto, fleet, tmp_path, memory__cap_mb="40")
    assert probe.wait(timeout=60) != 0
    found = re.search(r"under the model's floor of ([0-9.]+) MiB", (tmp_path / "dev-1.log").read_text())
    assert found is not None, (tmp_path / "dev-1.log").read_text()[-2000:]
    cap_mb = math.ceil(float(found.group(1))) + 1
    proc = _start_big_agent(
        mosquitto, fleet, tmp_path, 3700, memory__cap_mb=str(cap_mb), memory__reserve_mb=str(cap_mb - 20)
    )

    async def main() -> tuple[Any, dict[str, Any], dict[str, Any]]:
        t, coord = await _coordinator(mosquitto, fleet, deadline_s=4.0)
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            await wait_until(
                lambda: ((coord.registry.devices.get("dev-1") or {}).get("faults") or {}).get("replay", 0)
                >= 1,
                90,
                "dev-1 refusing its replay file over budget",
            )
            record = await coord.run_round(1, selected=("dev-1",))
            await wait_until(
                lambda: coord.registry.devices["dev-1"].get("declined_total") == 1, 30, "dev-1's decline"
            )
            return record, await next_status(coord, "dev-1"), coord.dashboard_status()
        finally:
            pump.cancel()
            await t.stop()

    try:
        record, status, page = asyncio.run(main())
    finally:
        stop_agents([proc])
    log = (tmp_path / "dev-1.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    # the governor refused the replay file before loading it (every input is admitted first) and the
    # round's training over budget, and ran neither
    assert status["cap_bytes"] == cap_mb * MIB
    assert status["faults"]["replay"] >= 1 and "BudgetExceeded: phase replay" in log
    assert status["deferrals"]["train"] >= 1
    assert "inference" not in status["phase_peaks"] and "train" not in status["phase_peaks"]
    assert status["inferred_total"] == 0 and status["pipeline"]["invokes"] == 0
    # the deferred round was declined to the coordinator, which counted and logged it
    assert (record.clients, record.declined) == (0, 1)
    assert page["declined"] == {"over_budget": 1}
    assert page["devices"]["dev-1"]["declined"] == {"over_budget": 1}
    assert status["declined_total"] == 1 and status["deferred_round"] is None
    assert status["rejected"] == {}


def test_own_model_decline_message_round_trip_and_malformed() -> None:
    from edgefl.errors import DecodeError
    from edgefl.wire.rounds import Decline, encode_decline
    from edgefl.wire.signing import generate_signing_key, sign_message, verify_payload

    msg = Decline(7, 3, "dev-1", "over_budget", "train: needs 3.0 MiB at 16\x00é", "dev-1:7:3:declined")
    out = decode_decline(encode_decline(msg))
    assert out == dataclasses.replace(msg, detail="train: needs 3.0 MiB at 16??")
    key = generate_signing_key()
    signed = sign_message(encode_decline, msg, key, fleet="f1")
    verify_payload(signed, key.verify_key, fleet="f1", kind="decline", device="dev-1")
    with pytest.raises(DecodeError) as exc:  # signed by dev-1, received on dev-2's topic
        verify_payload(signed, key.verify_key, fleet="f1", kind="decline", device="dev-2")
    assert exc.value.reason == "bad_signature"
    for bad, reason in [
        (dataclasses.replace(msg, reason="Over Budget"), "bad_value"),
        (dataclasses.replace(msg, update_id=""), "bad_value"),
        (dataclasses.replace(msg, device="../x"), "bad_value"),
    ]:
        with pytest.raises(DecodeError) as exc:
            decode_decline(encode_decline(bad))
        assert exc.value.reason == reason
    import cbor2

    obj = cbor2.loads(encode_decline(msg))
    obj["extra"] = 1
    with pytest.raises(DecodeError) as exc:
        decode_decline(cbor2.dumps(obj))
    assert exc.value.reason == "unknown_key"
    del obj["extra"], obj["reason"]
    with pytest.raises(DecodeError) as exc:
        decode_decline(cbor2.dumps(obj))
    assert exc.value.reason == "missing_key"
