"""`edgefl memory-report`'s round (`edgefl.agent.memreport.run_round`): inputs admitted as the daemon's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import DEV_PROFILE, INT8_MODEL

from edgefl.agent.config import load_profile
from edgefl.agent.estimates import estimate_replay_bytes
from edgefl.agent.governor import Governor
from edgefl.agent.memreport import run_round
from edgefl.agent.memstat import MIB, rss_bytes


def test_memory_report_replay_over_the_headroom_is_refused_before_it_is_loaded(tmp_path: Path) -> None:
    # 640k digits-sized samples: 40 MiB of uint8 and 5 MiB of labels, over the 16 MiB left under the cap
    n = 640_000
    replay = tmp_path / "replay.npz"
    np.savez(replay, x=np.zeros((n, 8, 8, 1), np.uint8), y=np.zeros(n, np.int64))
    profile = load_profile(
        DEV_PROFILE,
        {
            "model.path": str(INT8_MODEL),
            "device.state_dir": str(tmp_path / "state"),
            "source.kind": "replay",
            "source.path": str(replay),
            "dashboard.enabled": "false",
            "memory.min_system_available_mb": "0",
            "training.holdout_every": "0",
        },
    )
    gov = Governor(rss_bytes() + 16 * MIB, 0, 0)
    rep = run_round(profile, samples=32, governor=gov, trace=False, state_dir=tmp_path / "state")
    adm = gov.admissions["replay"]
    assert adm.deferred and adm.estimate_bytes == estimate_replay_bytes(replay) > 45 * MIB
    # the round went on with random samples of the model's shape instead
    assert rep.phases["inference"].runs == 4 and rep.samples == 32
