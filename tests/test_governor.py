"""The governor's status reads PSS (smaps_rollup, the costly /proc read) at most every PSS_MAX_AGE_S."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefl.agent import governor as governor_module
from edgefl.agent.governor import Governor

MIB = 1 << 20


def _proc(root: Path, pss_kib: int) -> Path:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "self" / "statm").write_text("3000 1000 100 10 0 1000 0\n")
    (proc / "self" / "status").write_text("VmHWM:\t4000 kB\nVmRSS:\t4000 kB\n")
    (proc / "meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/\n")
    (proc / "self" / "clear_refs").write_text("")
    (proc / "self" / "smaps_rollup").write_text(f"Rss: 4000 kB\nPss: {pss_kib} kB\n")
    return proc


def test_memory_status_reads_pss_at_most_every_max_age(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = _proc(tmp_path, 2000)
    gov = Governor(96 * MIB, 8 * MIB, 0, proc=proc, cgroup_root=tmp_path / "cg")
    assert gov.status()["pss_bytes"] == 2000 * 1024
    (proc / "self" / "smaps_rollup").write_text("Rss: 4000 kB\nPss: 3000 kB\n")
    assert gov.status()["pss_bytes"] == 2000 * 1024  # within PSS_MAX_AGE_S: the last reading
    (proc / "self" / "smaps_rollup").unlink()
    assert gov.status()["pss_bytes"] == 2000 * 1024  # not even opened
    monkeypatch.setattr(governor_module, "PSS_MAX_AGE_S", 0.0)
    assert gov.status()["pss_bytes"] is None  # read again: unreadable now
    (proc / "self" / "smaps_rollup").write_text("Rss: 4000 kB\nPss: 3000 kB\n")
    assert gov.status()["pss_bytes"] == 3000 * 1024


def test_memory_probe_admission_keeps_and_counts_nothing(tmp_path: Path) -> None:
    """A probe tells whether work fits; only the real ask is kept (training with or without the
    personal head beside it is one decision, one deferral at most)."""
    proc = _proc(tmp_path, 2000)
    gov = Governor(16 * MIB, 8 * MIB, 0, proc=proc, cgroup_root=tmp_path / "cg")  # ~4 MiB under cap - reserve
    probe = gov.admit("train", lambda n: 20 * MIB, 4, 4, probe=True)
    assert probe.deferred and gov.deferrals == {} and gov.admissions == {} and gov.last_deferral is None
    real = gov.admit("train", lambda n: 20 * MIB, 4, 4)
    assert real.deferred and gov.deferrals == {"train": 1} and gov.admissions["train"] == real
