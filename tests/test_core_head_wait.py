"""A device asked to train from a global head it does not hold yet: it answers once the head comes, or
declines the round (``no_head``) when half the round's deadline passed without it, never stays silent."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from test_core import announcement, profile_for

from edgefl.agent.core import DeviceCore
from edgefl.agent.round import RoundStatus
from edgefl.datasets import load_digits
from edgefl.wire.global_model import GlobalModel, encode_global_model
from edgefl.wire.rounds import decode_decline


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
