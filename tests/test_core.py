"""The device core (agent/core.py, round.py, state.py): round bytes in -> signed outbox entry out,
global bytes in -> applied, exactly once across restarts; and the real daemon process not answering a
round twice after a kill -9.

Real parts: the int8 digits model through LiteRT, the digits data, state files on disk, and (for the
daemon test) a real agent process and the session's mosquitto.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
from conftest import DEV_PROFILE, INT8_MODEL, Broker, start_replay_agent

from edgefl.agent.config import Profile, load_profile
from edgefl.agent.core import ApplyStatus, DeviceCore
from edgefl.agent.round import RoundStatus
from edgefl.agent.state import OUTBOX_FILE
from edgefl.datasets import load_digits
from edgefl.launcher import stop_agents
from edgefl.records import read_record
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import GlobalModel, encode_global_model
from edgefl.wire.rounds import RoundAnnouncement, decode_update, encode_round
from edgefl.wire.signing import generate_signing_key, sign_message, verify_payload
from edgefl.wire.status import decode_status
from tests.support.wire import compressed_roundtrip

pytestmark = pytest.mark.timeout(180)


def profile_for(tmp: Path, fleet: str = "f1", **extra: str) -> Profile:
    """The dev profile on the int8 digits model, its state in ``tmp/state``, a cap the test process fits."""
    return load_profile(
        DEV_PROFILE,
        {
            "device.id": "dev-1",
            "device.fleet": fleet,
            "device.state_dir": str(tmp / "state"),
            "model.path": str(INT8_MODEL),
            "memory.cap_mb": "4096",
            "memory.min_system_available_mb": "0",
            "dashboard.enabled": "false",
            "training.holdout_every": "0",  # every sample trains (the holdout has its own test)
            "training.min_examples": "1",  # small stores train (the minimum has its own test: test_ingest)
            **extra,
        },
    )


def announcement(round_no: int, base_version: int = 0, **kw: Any) -> RoundAnnouncement:
    return RoundAnnouncement(
        round=round_no,
        base_version=base_version,
        deadline_s=60.0,
        local_epochs=kw.pop("local_epochs", 2),
        lr=0.05,
        batch_size=16,
        min_clients=1,
        selected=kw.pop("selected", 1.0),
        **kw,
    )


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits()
    return x[:160], y[:160].astype(np.int64)


def test_core_round_bytes_to_signed_outbox_entry_with_error_feedback(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    key = generate_signing_key()
    key_file = tmp_path / "dev.key"
    key_file.write_text(key.seed.hex())
    key_file.chmod(0o600)
    core = DeviceCore.open(profile_for(tmp_path, **{"security.signing_key_file": str(key_file)}))
    x, y = digits
    out = core.observe(x[:24], y[:24])
    assert out.embeddings.shape == (24, core.head.shape[0]) and out.predictions.shape == (24,)
    assert out.version == 0 and len(core.store) == 24

    ann = announcement(1, compression=Compression.TOPK_INT8, topk_fraction=0.1)
    res = core.receive_round(encode_round(ann))
    assert res.status == RoundStatus.TRAINED, res
    assert res.entry is not None and res.local is not None
    assert res.entry.update_id == "dev-1:1:0" and res.update_bytes == len(res.entry.payload)
    verify_payload(res.entry.payload, key.verify_key, fleet="f1", kind="update", device="dev-1")  # device key
    upd = decode_update(res.entry.payload, expect_shape=core.head.shape)
    assert (upd.round, upd.base_version, upd.device, upd.num_examples) == (1, 0, "dev-1", 24)
    # error feedback: what went on the wire is the compressed delta, what it dropped is the residual
    sent = upd.delta_W
    kept = core.feedback.residual_W
    assert np.count_nonzero(kept) > 0
    np.testing.assert_allclose(sent + kept, res.local.delta_W, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(
        sent, compressed_roundtrip(res.local.delta_W, Compression.TOPK_INT8, topk_fraction=0.1)
    )
    # kept in the outbox until its PUBACK, and the round recorded as answered
    assert [e.update_id for e in core.outbox.pending()] == ["dev-1:1:0"]
    assert core.answered is not None and core.answered.round == 1
    assert core.acknowledged("dev-1:1:0") and not core.outbox.pending()


def test_exactly_once_core_across_restarts(tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = digits
    core = DeviceCore.open(profile_for(tmp_path))
    core.observe(x[:16], y[:16])
    assert core.answer_round(announcement(1)).status == RoundStatus.TRAINED
    assert core.answer_round(announcement(1)).status == RoundStatus.ANSWERED
    # the answered round is recorded by the write that keeps its update (one atomic write, issue 17)
    kept = cbor2.loads(read_record(tmp_path / "state" / OUTBOX_FILE) or b"")
    assert kept["answered"] == {"v": 1, "fleet": "f1", "round": 1, "update_id": "dev-1:1:0"}
    assert [e[0] for e in kept["entries"]] == ["dev-1:1:0"]
    core.flush()  # as the daemon does at shutdown

    again = DeviceCore.open(profile_for(tmp_path))  # a restart on the same state directory
    assert again.answered is not None and again.answered.round == 1
    res = again.receive_round(encode_round(announcement(1)))
    assert res.status == RoundStatus.ANSWERED and res.entry is None
    assert [e.update_id for e in again.outbox.pending()] == ["dev-1:1:0"]  # still owed, never re-made
    assert again.answer_round(announcement(2)).status == RoundStatus.TRAINED

    # the record belongs to its fleet: the same state directory in another fleet starts fresh
    other = DeviceCore.open(profile_for(tmp_path, fleet="f2"))
    assert other.answered is None


def test_exactly_once_answered_round_survives_the_outbox_ack_and_restart(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    """The answered round lives in the outbox record: the write after the PUBACK (outbox now empty)
    keeps it, so a restart after the answer still does not train or send that round again."""
    x, y = digits
    core = DeviceCore.open(profile_for(tmp_path))
    core.observe(x[:16], y[:16])
    res = core.answer_round(announcement(1))
    assert res.status == RoundStatus.TRAINED and res.entry is not None
    assert core.acknowledged(res.entry.update_id) and not core.outbox.pending()
    assert core.to_resend(2) == ([], [])  # a later round opened: nothing stale, nothing to send

    again = DeviceCore.open(profile_for(tmp_path))
    assert again.answered is not None and (again.answered.round, again.answered.update_id) == (1, "dev-1:1:0")
    assert again.receive_round(encode_round(announcement(1))).status == RoundStatus.ANSWERED
    assert again.outbox.pending() == []  # nothing re-made, nothing to re-send
    declined = again.decline(announcement(2), "over_budget", "test")  # a Decline answers a round too
    assert declined.status == RoundStatus.DECLINED
    third = DeviceCore.open(profile_for(tmp_path))
    assert third.answered is not None and third.answered.round == 2
    assert third.answer_round(announcement(2)).status == RoundStatus.ANSWERED


def test_core_global_bytes_applied_persisted_and_refusals(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    x, y = digits
    coord = generate_signing_key()
    prof = profile_for(
        tmp_path,
        **{"security.coordinator_public_key": coord.verify_key.hex, "security.require_signatures": "true"},
    )
    core = DeviceCore.open(prof)
    core.observe(x[:8], y[:8])
    W, b = core.head.W + np.float32(0.01), core.head.b.copy()
    gm = GlobalModel(1, 1, core.model_sha256, W, b)

    unsigned = core.receive_global(encode_global_model(gm))
    assert (unsigned.status, unsigned.reason) == (ApplyStatus.REFUSED, "unsigned")
    applied = core.receive_global(sign_message(encode_global_model, gm, coord, fleet="f1"))
    assert (applied.status, applied.version) == (ApplyStatus.APPLIED, 1)
    np.testing.assert_array_equal(core.head.W, W)
    same = core.receive_global(sign_message(encode_global_model, gm, coord, fleet="f1"))
    assert same.status == ApplyStatus.SAME_VERSION
    older = GlobalModel(1, 0, core.model_sha256, W, b)
    refused = core.receive_global(sign_message(encode_global_model, older, coord, fleet="f1"))
    assert (refused.status, refused.reason) == (ApplyStatus.REFUSED, "not_newer")
    other = GlobalModel(2, 2, "0" * 64, W, b)
    refused = core.receive_global(sign_message(encode_global_model, other, coord, fleet="f1"))
    assert (refused.status, refused.reason) == (ApplyStatus.REFUSED, "wrong_model")
    garbage = core.receive_global(b"\xff\x00garbage")
    assert garbage.status == ApplyStatus.REFUSED and garbage.reason
    assert core.head.version == 1

    assert core.flush()  # the head is written behind, as the daemon flushes once idle
    restarted = DeviceCore.open(prof)
    assert restarted.head.version == 1
    np.testing.assert_array_equal(restarted.head.W, W)


def test_exactly_once_ack_is_written_by_the_flush_and_a_restart_sends_nothing_again(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    """The outbox write after a PUBACK is made by the next flush: then a restart owes nothing and does
    not train the round again; before the PUBACK a restart owes the same bytes once."""
    x, y = digits
    prof = profile_for(tmp_path)
    core = DeviceCore.open(prof)
    core.observe(x[:16], y[:16])
    first = core.answer_round(announcement(1))
    assert first.status == RoundStatus.TRAINED and first.entry is not None

    crashed = DeviceCore.open(prof)  # killed before the PUBACK: the same bytes are owed once
    assert [e.update_id for e in crashed.outbox.pending()] == ["dev-1:1:0"]
    assert crashed.outbox.pending()[0].payload == first.entry.payload
    assert crashed.answer_round(announcement(1)).status == RoundStatus.ANSWERED

    assert core.acknowledged("dev-1:1:0") and not core.outbox.pending()
    assert core.flush()
    again = DeviceCore.open(prof)
    assert again.outbox.pending() == [] and again.answered is not None and again.answered.round == 1
    assert again.answer_round(announcement(1)).status == RoundStatus.ANSWERED


def test_error_feedback_residual_goes_with_the_update_and_survives_a_restart(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    """The residual a compressed answer leaves is kept by the outbox write that keeps the update (no
    separate fsync'd file before the publish) and by every later write: a restart before or after the
    PUBACK comes back with that residual (nothing sent twice, nothing dropped)."""
    x, y = digits
    prof = profile_for(tmp_path)
    core = DeviceCore.open(prof)
    core.observe(x[:16], y[:16])
    res = core.answer_round(announcement(1, compression=Compression.INT8))
    assert res.status == RoundStatus.TRAINED
    kept_W = core.feedback.residual_W.copy()
    assert np.count_nonzero(kept_W) > 0 and core.feedback.round == 1
    record = cbor2.loads(read_record(tmp_path / "state" / OUTBOX_FILE) or b"")
    assert isinstance(record.get("residual"), bytes)

    crashed = DeviceCore.open(prof)  # killed before the PUBACK: the outbox record's copy is taken
    np.testing.assert_array_equal(crashed.feedback.residual_W, kept_W)
    assert crashed.feedback.round == 1

    assert core.acknowledged("dev-1:1:0") and core.flush()
    record = cbor2.loads(read_record(tmp_path / "state" / OUTBOX_FILE) or b"")
    assert isinstance(record.get("residual"), bytes)
    again = DeviceCore.open(prof)
    np.testing.assert_array_equal(again.feedback.residual_W, kept_W)
    assert again.feedback.round == 1 and again.outbox.pending() == []


def test_core_round_waits_for_its_head_and_for_samples(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    x, y = digits
    core = DeviceCore.open(profile_for(tmp_path))
    assert core.answer_round(announcement(1, selected=("dev-9",))).status == RoundStatus.NOT_SELECTED
    # an empty store declines at once (no_samples) rather than holding the round to its deadline
    empty = core.answer_round(announcement(1))
    assert (empty.status, empty.reason, empty.detail) == (
        RoundStatus.DECLINED,
        "no_samples",
        "no labelled samples stored",
    )
    assert empty.entry is not None and core.take_ready_round() is None
    core.observe(x[:8], y[:8])
    assert core.take_ready_round() is None  # declined, not held

    res = core.answer_round(announcement(2, base_version=1))
    assert res.status == RoundStatus.WAITING_HEAD and core.take_ready_round() is None
    gm = GlobalModel(1, 1, core.model_sha256, core.head.W.copy(), core.head.b.copy())
    assert core.receive_global(encode_global_model(gm)).status == ApplyStatus.APPLIED
    ready = core.take_ready_round()
    assert ready is not None and ready.round == 2
    assert core.answer_round(ready).status == RoundStatus.TRAINED
    stale = core.answer_round(announcement(3, base_version=0))
    assert (stale.status, stale.reason) == (RoundStatus.REFUSED, "stale_round")


def test_core_fault_unwritable_outbox_is_a_refusal_not_a_crash(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    x, y = digits
    core = DeviceCore.open(profile_for(tmp_path))
    core.observe(x[:8], y[:8])
    core.outbox.path.mkdir()  # the record cannot be replaced: an OSError as on a full or broken disk
    res = core.answer_round(announcement(1))
    assert (res.status, res.reason) == (RoundStatus.REFUSED, "failed") and res.entry is None
    assert core.answered is None  # not answered: a later announcement may try again
    core.outbox.path.rmdir()
    assert core.answer_round(announcement(1)).status == RoundStatus.TRAINED


# --- the real daemon --------------------------------------------------------------------------------
async def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


def test_exactly_once_restarted_agent_does_not_train_or_send_an_answered_round(
    mosquitto: Broker, fleet: str, tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    """A real agent answers round 1, is killed -9 and restarted on its state: the retained round 1 is
    delivered again and not trained or sent again; round 2 is answered as usual."""
    x, y = digits
    topics = Topics("edgefl", fleet)
    updates: list[str] = []
    status: dict[str, Any] = {}

    def start() -> Any:
        return start_replay_agent(mosquitto, fleet, tmp_path, "dev-1", x[:64], y[:64])

    async def main() -> None:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"monitor-{fleet}")
        await t.start(wait_s=10)

        async def listen() -> None:
            while True:
                msg = await t.queue.get()
                if msg.topic == topics.update("dev-1"):
                    updates.append(decode_update(msg.payload).update_id)
                elif msg.topic == topics.status("dev-1") and msg.payload:
                    st = decode_status(msg.payload)
                    status.clear()
                    status.update(st.fields, state=st.state)

        pump = asyncio.create_task(listen())
        procs = [start()]
        try:
            await t.subscribe(topics.update("dev-1"), 1)
            await t.subscribe(topics.status("dev-1"), 1)
            await t.publish(topics.round, encode_round(announcement(1)), qos=1, retain=True)
            # at least once: the outbox may send an entry again before its PUBACK is recorded (the
            # coordinator de-duplicates by update_id); what must not happen is a send after the restart
            await wait_until(lambda: "dev-1:1:0" in updates, 60, "dev-1's update for round 1")
            await wait_until(lambda: status.get("state") == "waiting", 10, "dev-1 done with round 1")
            # killed after the PUBACK was recorded: an entry still in the outbox is re-sent on purpose
            await wait_until(lambda: status.get("outbox_pending") == 0, 30, "dev-1's outbox acknowledged")
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(timeout=10)
            status.clear()
            sent_before_restart = len(updates)

            procs.append(start())  # same state directory; the retained round 1 is delivered again
            await wait_until(
                lambda: (
                    status.get("round") == 1
                    and bool(status.get("ready"))
                    and status.get("pid") == procs[1].pid
                ),
                60,
                "the restarted dev-1 seeing round 1",
            )
            # a later round is still answered; an update re-sent for round 1 would have come first
            await t.publish(topics.round, encode_round(announcement(2)), qos=1, retain=True)
            await wait_until(lambda: "dev-1:2:0" in updates, 60, "dev-1's update for round 2")
            assert set(updates[:sent_before_restart]) == {"dev-1:1:0"}, updates
            assert updates[sent_before_restart:] == ["dev-1:2:0"], updates  # round 1 not sent again
            assert status.get("rejected") == {}, status
        finally:
            stop_agents(procs)
            await t.publish(topics.round, b"", qos=1, retain=True)
            pump.cancel()
            await t.stop()

    asyncio.run(main())
    log = (tmp_path / "dev-1.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]


def test_memory_report_round_is_the_core_round(mosquitto: Broker, tmp_path: Path) -> None:
    """``edgefl memory-report`` measures the shipped path: a signed update via the outbox, head persisted."""
    from edgefl.agent.memreport import run_round

    key = generate_signing_key()
    key_file = tmp_path / "dev.key"
    key_file.write_text(key.seed.hex())
    key_file.chmod(0o600)
    prof = profile_for(tmp_path, **{"security.signing_key_file": str(key_file)})
    rep = run_round(prof, samples=32, trace=False, state_dir=tmp_path / "state", broker=mosquitto.url)
    assert rep.completed, rep.note
    assert {p: r.runs for p, r in rep.phases.items()} == {
        "inference": 4,
        "train": 1,
        "encode": 1,
        "publish": 1,
        "apply": 1,  # verify, decode, validate, persist: one phase
    }
    again = DeviceCore.open(prof)  # what the round left on disk
    assert again.answered is not None and again.answered.round == 1
    assert again.outbox.pending() == []  # published and acknowledged
    assert again.head.version == 1 and rep.update_bytes > 0


def test_core_holdout_is_kept_out_of_training_and_evaluates_each_new_head(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    """Federated evaluation: every 10th labelled sample goes to the holdout store, never to training;
    a new global head is evaluated on it (its accuracy is the head's own on those samples)."""
    x, y = digits
    core = DeviceCore.open(profile_for(tmp_path, **{"training.holdout_every": "10"}))
    core.observe(x[:40], y[:40])
    assert core.holdout is not None and (len(core.store), len(core.holdout)) == (36, 4)
    held = np.arange(40) % 10 == 9
    ev = core.evaluate()
    assert ev is not None and (ev.version, ev.count) == (0, 4)
    emb = core.classify(x[:40][held]).embeddings
    assert ev.accuracy == float(np.mean(core.head.predict(emb) == y[:40][held]))
    W = core.head.W + np.float32(0.01)
    applied = core.receive_global(encode_global_model(GlobalModel(1, 1, core.model_sha256, W, core.head.b)))
    assert applied.status == ApplyStatus.APPLIED
    assert core.evaluation is not None and (core.evaluation.version, core.evaluation.count) == (1, 4)


def test_core_fault_unwritable_head_file_degrades_then_recovers(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    # before: a head file that could not be written refused the head ("failed"); now it runs from
    # memory, the core says why it is degraded, and the write is retried until it succeeds
    x, y = digits
    core = DeviceCore.open(profile_for(tmp_path))
    core.observe(x[:8], y[:8])
    core.head_path.mkdir()  # the record cannot be replaced: an OSError as on a broken disk
    gm = GlobalModel(1, 1, core.model_sha256, core.head.W * 2, core.head.b.copy())
    assert core.receive_global(encode_global_model(gm)).status == ApplyStatus.APPLIED
    assert core.flush() is False  # the head is written behind: its write fails here
    assert core.head.version == 1 and core.write_failures == 1
    assert core.degraded == "cannot write state: Is a directory"
    assert core.retry_persist() is False and core.write_failures == 2
    core.head_path.rmdir()
    assert core.retry_persist() is True and core.degraded == ""
    restarted = DeviceCore.open(profile_for(tmp_path))
    assert restarted.head.version == 1  # persisted once there was room


@pytest.mark.subprocess
def test_latency_fresh_update_kept_with_its_first_send_counted(
    tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    """The write that keeps a trained update also counts its first publish attempt (no second
    atomic write between training and the publish); a re-send still counts, and the count persists."""
    from edgefl import heap
    from edgefl.agent.outbox import Outbox

    core = DeviceCore.open(profile_for(tmp_path))
    x, y = digits
    core.observe(x[:24], y[:24])
    res = core.receive_round(encode_round(announcement(1)))
    assert res.status == RoundStatus.TRAINED and res.entry is not None
    assert [(e.update_id, e.sends) for e in core.outbox.pending()] == [("dev-1:1:0", 1)]
    on_disk = Outbox(core.outbox.path, core.outbox.max_bytes)
    assert [(e.update_id, e.sends) for e in on_disk.pending()] == [("dev-1:1:0", 1)]
    assert core.mark_sent("dev-1:1:0") == 2  # a re-send after a reconnect
    # after one re-send the outbox stops offering it (max_sends = 2): as before, two attempts
    assert core.to_resend(1) == ([], [])
    # malloc_trim after every round finds the C library once (find_library runs ldconfig -p)
    heap.malloc_trim()
    heap.malloc_trim()
    assert heap._libc.cache_info().misses <= 1 and heap._libc.cache_info().hits >= 1
