"""The device's writes left behind (``DeviceState._persist(behind=True)``, every caller alike): what
waits for ``flush``, what a restart before it sees, and the one write that must never wait.

Real parts: the int8 digits model through LiteRT, the digits data, the state files on disk.
"""

from __future__ import annotations

from pathlib import Path

import cbor2
import numpy as np
import pytest
from conftest import DEV_PROFILE, INT8_MODEL

from edgefl.agent.config import Profile, load_profile
from edgefl.agent.core import ApplyStatus, DeviceCore
from edgefl.agent.personal import PERSONAL_FILE
from edgefl.agent.round import RoundStatus
from edgefl.agent.state import OUTBOX_FILE
from edgefl.datasets import load_digits
from edgefl.records import read_record
from edgefl.wire.global_model import GlobalModel, encode_global_model
from edgefl.wire.rounds import RoundAnnouncement

pytestmark = pytest.mark.timeout(120)


def profile_for(tmp: Path, **extra: str) -> Profile:
    """The dev profile on the int8 digits model, its state in ``tmp/state``, a cap the test process fits."""
    return load_profile(
        DEV_PROFILE,
        {
            "device.id": "dev-1",
            "device.fleet": "f1",
            "device.state_dir": str(tmp / "state"),
            "model.path": str(INT8_MODEL),
            "memory.cap_mb": "4096",
            "memory.min_system_available_mb": "0",
            "dashboard.enabled": "false",
            "training.holdout_every": "0",
            "training.min_examples": "1",
            **extra,
        },
    )


def announcement(round_no: int) -> RoundAnnouncement:
    return RoundAnnouncement(round_no, 0, 60.0, 2, 0.05, 16, 1, 1.0)


def _outbox_ids(tmp: Path) -> list[str]:
    record = cbor2.loads(read_record(tmp / "state" / OUTBOX_FILE) or b"")
    return [e[0] for e in record["entries"]]


def test_durable_update_is_written_before_the_publish_and_the_rest_behind(tmp_path: Path) -> None:
    """The update is in the outbox record before ``answer_round`` returns; the PUBACK's removal and a
    new global head wait for ``flush`` (a restart before it: the retained head comes again,
    the acknowledged update is owed once more, and ``outbox_pending`` says so meanwhile)."""
    x, y = load_digits()
    prof = profile_for(tmp_path)
    core = DeviceCore.open(prof)
    core.observe(x[:32], y[:32].astype(np.int64))
    res = core.answer_round(announcement(1))
    assert res.status == RoundStatus.TRAINED and res.entry is not None
    assert _outbox_ids(tmp_path) == ["dev-1:1:0"]  # durable before the caller publishes it

    assert core.acknowledged("dev-1:1:0") and core.outbox.pending() == []
    assert core.outbox_pending == 1 and core.behind_since is not None
    assert _outbox_ids(tmp_path) == ["dev-1:1:0"]
    gm = GlobalModel(1, 1, core.model_sha256, core.head.W + np.float32(0.01), core.head.b.copy())
    assert core.receive_global(encode_global_model(gm)).status == ApplyStatus.APPLIED
    crashed = DeviceCore.open(prof)  # killed before the writes behind
    assert crashed.head.version == 0 and [e.update_id for e in crashed.outbox.pending()] == ["dev-1:1:0"]
    assert crashed.answer_round(announcement(1)).status == RoundStatus.ANSWERED  # never trained again

    assert core.flush()
    assert core.behind_since is None and core.outbox_pending == 0 and _outbox_ids(tmp_path) == []
    again = DeviceCore.open(prof)
    assert again.head.version == 1 and again.outbox.pending() == []
    np.testing.assert_array_equal(again.head.W, gm.W)


def test_durable_outbox_write_takes_the_acknowledgement_left_behind(tmp_path: Path) -> None:
    """The next round's outbox write holds the earlier PUBACK's removal: nothing of it waits any more."""
    x, y = load_digits()
    core = DeviceCore.open(profile_for(tmp_path, **{"personal.enabled": "false"}))
    core.observe(x[:32], y[:32].astype(np.int64))
    assert core.answer_round(announcement(1)).status == RoundStatus.TRAINED
    assert core.acknowledged("dev-1:1:0") and core.behind_since is not None
    assert core.answer_round(announcement(2)).status == RoundStatus.TRAINED
    assert _outbox_ids(tmp_path) == ["dev-1:2:0"] and core.outbox_pending == 1
    assert core.behind_since is None  # the one write left behind was the outbox's


def test_personal_head_trained_with_the_round_is_evaluated_then_written_behind(tmp_path: Path) -> None:
    """Personal heads on: the round's training takes the personal step; ``personalise`` (the daemon's
    call once the update is out) evaluates it and returns its steps; it is written behind."""
    x, y = load_digits()
    prof = profile_for(tmp_path, **{"training.holdout_every": "4"})
    core = DeviceCore.open(prof)
    core.observe(x[:64], y[:64].astype(np.int64))
    res = core.answer_round(announcement(1))
    assert res.status == RoundStatus.TRAINED and res.local is not None and res.local.personal is not None
    assert core.personal is not None and core.personal_due
    assert not (tmp_path / "state" / PERSONAL_FILE).exists()
    step = core.personalise()
    assert step is not None and step.steps == res.local.personal.steps == 2 * -(-48 // 16)
    assert not core.personal_due and not (tmp_path / "state" / PERSONAL_FILE).exists()
    assert core.personal_evaluation is not None and core.personal_evaluation.count == 16
    assert core.flush() and (tmp_path / "state" / PERSONAL_FILE).exists()
    restarted = DeviceCore.open(prof)
    assert restarted.personal is not None
    np.testing.assert_array_equal(restarted.personal.W, core.personal.W)
