"""The soak bench's RSS slope (bench/soak.py): fitted to the resting level, so a round's transient peak
is not growth and a steady rise is measured in full."""

from __future__ import annotations

import pytest

from bench.soak import Lifetime, _growth_mib_per_hour, _lives_summary, _resting, _steady_growth

MIB = 1 << 20


def life(started: float, minutes: float, per_hour_mib: float, spike_every: int = 0) -> Lifetime:
    """RSS every 5 s from ``started``: 30 MiB rising ``per_hour_mib``; every ``spike_every``-th +2 MiB."""
    out = Lifetime(pid=1, started=started)
    for k in range(int(minutes * 12)):
        t = started + 5.0 * k
        rss = 30 * MIB + per_hour_mib * MIB * (t - started) / 3600
        if spike_every and k % spike_every == 3:
            rss += 2 * MIB  # a round's training, freed by the next sample
        out.rss.append((t, int(rss)))
        out.total.append((t, int(rss)))
    return out


def test_soak_rss_slope_ignores_round_peaks_and_measures_a_steady_rise() -> None:
    flat = [life(0.0, 8, 0.0, spike_every=5), life(1000.0, 12, 0.0, spike_every=5)]
    assert _growth_mib_per_hour(flat) == pytest.approx(0.0, abs=1e-6)
    rising = [life(0.0, 8, 2.0, spike_every=5), life(1000.0, 12, 2.0, spike_every=5)]
    assert _growth_mib_per_hour(rising) == pytest.approx(2.0, abs=0.05)
    # a lifetime shorter than the warm-up plus three windows gives no slope
    assert _growth_mib_per_hour([life(0.0, 1.5, 5.0)]) is None
    # settled: only what is older than 10 minutes counts (here only the 12-minute lifetime's tail)
    late = [life(0.0, 8, 50.0), life(1000.0, 14, 0.0)]
    assert _growth_mib_per_hour(late, warmup_s=600.0) == pytest.approx(0.0, abs=1e-6)
    assert _lives_summary(late) == {"measured": 2, "steady": 0, "longest_minutes": 13.9}


def test_soak_rss_steady_state_counts_only_long_lifetimes_after_their_warmup() -> None:
    # a fleet restarted every few minutes: each short lifetime is all warm-up (+6 MiB/h), one lived 25 min
    # with a warm-up rise over its first 5 minutes, then flat
    short = [life(3000.0 * k, 3, 6.0) for k in range(1, 6)]
    long = life(0.0, 25, 0.0)
    long.rss = [(t, r + int(min(t, 300.0) / 300.0 * MIB)) for t, r in long.rss]
    assert _growth_mib_per_hour(short) == pytest.approx(6.0, abs=0.05)  # their warm-up, read as growth
    assert _steady_growth([*short, long]) == pytest.approx(0.0, abs=1e-6)
    assert _steady_growth(short) is None  # no lifetime long enough: no steady state to speak of
    leaking = life(0.0, 25, 1.5)
    assert _steady_growth([*short, leaking]) == pytest.approx(1.5, abs=0.05)
    assert _lives_summary([*short, long]) == {"measured": 6, "steady": 1, "longest_minutes": 24.9}


def test_soak_rss_resting_level_is_each_window_lowest() -> None:
    pts = [(0.0, 5), (10.0, 3), (20.0, 9), (30.0, 7), (40.0, 8), (50.0, 6), (60.0, 1)]
    assert _resting(pts, 30.0) == [(10.0, 3), (50.0, 6)]  # the last window (60 s alone) is under half full
