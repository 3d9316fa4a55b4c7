"""A short chaos run for CI (bench/chaos.py runs the full one and records it in docs/benchmarks.md)."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest

from bench.chaos import ChaosPlan, Fault, run_chaos

pytestmark = pytest.mark.timeout(240)


def test_chaos_short(tmp_path: Path) -> None:
    """3 agents, 8 rounds: dev-2 killed -9 twice (mid-train, mid-publish) and restarted, the broker
    restarted once, the coordinator killed -9 and restarted once; against a fault-free run."""
    deadline_s = 6.0
    faults = (
        Fault(2, "mid-train", "dev-2"),
        Fault(3, "broker"),
        Fault(5, "mid-publish", "dev-2"),
        Fault(6, "coordinator"),
    )
    reference = run_chaos(ChaosPlan(3, 8, (), deadline_s, seed=0), tmp_path / "reference")
    chaos = run_chaos(ChaosPlan(3, 8, faults, deadline_s, seed=0), tmp_path / "chaos")
    print("reference", reference)
    print("chaos", chaos)
    for name in ("reference", "chaos"):
        print(f"--- {name}/coordinator.log\n" + (tmp_path / name / "coordinator.log").read_text()[-3000:])

    assert reference.rounds_logged == 8 and reference.rounds_full == 8, reference
    assert reference.counted_once and reference.updates_counted == 24
    # the faults happened
    assert [k.planned for k in chaos.kills] == ["mid-train", "mid-publish"]
    assert chaos.kills[1].hit.startswith("mid-publish"), chaos.kills
    assert chaos.broker_restarts == 1 and chaos.coordinator_restarts == 1
    assert chaos.agent_exits["dev-2"][:2] == [-signal.SIGKILL, -signal.SIGKILL]
    # every closed round counted each contributing update exactly once
    assert chaos.coordinator_exit == 0
    assert chaos.rounds_logged == 8, chaos
    assert chaos.counted_once, (
        chaos.duplicate_in_round,
        chaos.counted_in_two_rounds,
        chaos.wrong_round_ids,
        chaos.round_logged_twice,
    )
    assert chaos.updates_counted >= 3 * 8 - 3 * 3, chaos.updates_counted  # at most 3 rounds lose updates
    # no agent's state is corrupt, all took the final head, all under their cap
    assert chaos.corrupt_records == []
    assert set(chaos.agent_versions.values()) == {chaos.final_version}, chaos.agent_versions
    assert chaos.under_cap and len(chaos.peak_rss_bytes) == 3, (chaos.peak_rss_bytes, chaos.cap_bytes)
    assert all(rc == 0 for rcs in chaos.agent_exits.values() for rc in rcs[-1:]), chaos.agent_exits
    assert not math.isnan(chaos.final_accuracy)
    assert chaos.final_accuracy >= reference.final_accuracy - 0.05, (chaos.accuracies, reference.accuracies)
