"""A device's ``new_samples`` (what paces the coordinator's rounds) after a restart: only the samples
stored since its last round, not its whole store.

Real parts: the int8 digits model through LiteRT, the digits data, the store's files on disk.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_core import announcement, profile_for

from edgefl.agent.core import DeviceCore
from edgefl.agent.round import RoundStatus
from edgefl.datasets import load_digits

pytestmark = pytest.mark.timeout(180)


def test_pacing_restarted_core_reports_only_samples_since_its_last_round(tmp_path: Path) -> None:
    x, y = load_digits()
    x, y = x[:64], y[:64].astype(np.int64)
    core = DeviceCore.open(profile_for(tmp_path))
    core.observe(x[:40], y[:40])
    assert core.new_samples == 40
    assert core.answer_round(announcement(1)).status == RoundStatus.TRAINED
    core.observe(x[40:52], y[40:52])
    assert core.new_samples == 12
    core.flush()  # the flush window passed (or a clean stop)
    core.observe(x[52:55], y[52:55])  # stored after the last flush: recovered from their rows
    del core  # a kill -9

    again = DeviceCore.open(profile_for(tmp_path))
    assert (len(again.store), again.new_samples) == (55, 15)  # not 55: the round trained on 40 of them
    assert again.answer_round(announcement(2)).status == RoundStatus.TRAINED
    assert again.new_samples == 0
    again.flush()
    del again
    third = DeviceCore.open(profile_for(tmp_path))
    assert (len(third.store), third.new_samples) == (55, 0)


def test_pacing_core_without_a_round_yet_reports_its_whole_store(tmp_path: Path) -> None:
    x, y = load_digits()
    core = DeviceCore.open(profile_for(tmp_path))
    core.observe(x[:20], y[:20].astype(np.int64))
    core.flush()
    del core
    assert DeviceCore.open(profile_for(tmp_path)).new_samples == 20
