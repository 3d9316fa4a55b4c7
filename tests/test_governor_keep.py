"""Governor.keep: a probe the caller goes ahead with is kept as the admission, counted as admit counts it."""

from __future__ import annotations

from pathlib import Path

from edgefl.agent.governor import Governor

MIB = 1 << 20


def _proc(root: Path) -> Path:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "self" / "statm").write_text("3000 1000 100 10 0 1000 0\n")  # RSS 1000 pages
    (proc / "self" / "status").write_text("VmHWM:\t4000 kB\nVmRSS:\t4000 kB\n")
    (proc / "meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/\n")
    (proc / "self" / "clear_refs").write_text("")
    return proc


def test_memory_keep_probe_is_the_admission_a_real_ask_would_make(tmp_path: Path) -> None:
    """A probe that fits, kept, is recorded exactly as the same ask without ``probe`` records it
    (admissions, the largest work granted); a deferred probe kept counts one deferral."""
    proc = _proc(tmp_path)
    gov = Governor(96 * MIB, 8 * MIB, 0, proc=proc, cgroup_root=tmp_path / "cg")
    probe = gov.admit("train", lambda n: n * MIB, 64, 16, probe=True)
    assert not probe.deferred and gov.admissions == {} and gov.max_work == {}
    assert gov.keep(probe) is probe
    assert gov.admissions == {"train": probe} and gov.max_work == {"train": 64} and gov.deferrals == {}
    twin = Governor(96 * MIB, 8 * MIB, 0, proc=proc, cgroup_root=tmp_path / "cg")
    real = twin.admit("train", lambda n: n * MIB, 64, 16)
    assert (real.work, real.estimate_bytes, real.deferred, real.reason) == (64, 64 * MIB, False, "")
    assert twin.max_work == gov.max_work

    over = gov.admit("encode", lambda n: 200 * MIB, 1, 1, probe=True)
    assert over.deferred and gov.deferrals == {}
    gov.keep(over)
    assert gov.deferrals == {"encode": 1} and gov.last_deferral is over and "encode" not in gov.max_work
