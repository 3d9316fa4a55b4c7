"""bench.peer's bookkeeping: one change per variant, start-to-start cycles, CPU of every thread, the ratios.

No Flower and no network here: the variants, the cycle arithmetic and the JSON ratios on values one
can follow by hand, and the per-thread CPU reader on this very process.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from typing import Any

import pytest

from bench import peer


def test_peer_bench_each_variant_changes_one_thing_of_int8() -> None:
    base = next(v for v in peer.VARIANTS if v.name == "int8")
    assert base.dashboard and base.personal and not base.broker_nodelay  # as shipped
    for v in peer.VARIANTS:
        if v is base:
            continue
        changed = [
            f.name
            for f in dataclasses.fields(v)
            if f.name != "name" and getattr(v, f.name) != getattr(base, f.name)
        ]
        # the wire is one change (uplink and downlink together), everything else one field
        one = (["broker_nodelay"], ["dashboard"], ["personal"], ["uplink"], ["uplink", "downlink"])
        assert changed in one, (
            v.name,
            changed,
        )
    nodelay = next(v for v in peer.VARIANTS if v.name == "int8_nodelay")
    assert nodelay.dashboard  # the nodelay variant keeps the dashboard on


def test_peer_bench_cycle_is_start_to_start_of_rounds_2_to_4() -> None:
    starts = {1: 0.0, 2: 1.0, 3: 3.0, 4: 6.0, 5: 10.0}
    assert peer.per_cycle(starts) == [2.0, 3.0, 4.0]


def test_peer_bench_task_cpu_counts_every_thread() -> None:
    burned, release = threading.Event(), threading.Event()
    spent: list[float] = []

    def burn() -> None:
        t0 = time.thread_time()
        x = 0
        while time.thread_time() - t0 < 0.2:  # 0.2 s of this thread's CPU, however long it takes
            x += 1
        spent.append(time.thread_time() - t0)
        burned.set()
        release.wait(60)  # alive (listed in /proc/<pid>/task) until read

    before = peer.task_cpu_s(os.getpid())
    worker = threading.Thread(target=burn)
    worker.start()
    assert burned.wait(60)
    during = peer.task_cpu_s(os.getpid())
    release.set()
    worker.join()
    # the worker's CPU is in the sum (seconds, not ticks or nanoseconds)
    assert spent[0] - 0.01 <= during - before < 10.0


def _run(system: str, variant: str | None, **over: Any) -> dict[str, Any]:
    run = {
        "system": system,
        "bytes_per_round": [1000.0, 1000.0],
        "up_per_round": [500.0, 500.0],
        "round_ms": 10.0,
        "cycle_ms": 20.0,
        "cpu_ms_per_round_device": [4.0, 4.0],
        "cpu_ms_per_round_server": 2.0,
        "peak_rss_kib": [100_000, 100_000],
        "accuracy": 0.9,
    }
    if variant is not None:
        run["variant"] = variant
        run["cpu_ms_per_round_broker"] = 0.5
    run.update(over)
    return run


def test_peer_bench_summary_keeps_the_old_ratios_and_adds_the_like_for_like_ones() -> None:
    runs = [_run("flower", None)]
    for v in peer.VARIANTS:
        runs.append(_run("edgefl", v.name, peak_rss_kib=[60_000, 60_000]))
    runs[-1] = _run("edgefl", "int8_no_dashboard", peak_rss_kib=[45_000, 45_000])
    runs[1] = _run(
        "edgefl", "int8", cycle_ms=30.0, cpu_ms_per_round_device=[8.0, 6.0], cpu_ms_per_round_server=3.0
    )
    runs[-2] = _run("edgefl", "int8_no_personal", cycle_ms=24.0, cpu_ms_per_round_device=[5.0, 5.0])
    ratios = peer.summarize(runs)["ratios"]
    assert {
        "bytes_total_float32_d512",
        "bytes_total_int8_d512",
        "bytes_total_topk_int8_d512",
        "round_ms_default_broker",
        "round_ms_nodelay_broker",
        "peak_rss_dashboard_on_d512",
    } <= set(ratios)
    assert ratios["cycle_ms_default_broker"] == pytest.approx(1.5)
    assert ratios["cpu_ms_per_round_device"] == pytest.approx(7.0 / 4.0)  # median of the two clients
    assert ratios["cpu_ms_per_round_server"] == pytest.approx(1.5)
    assert ratios["peak_rss_like_for_like_d512"] == pytest.approx(0.45)
    assert ratios["peak_rss_dashboard_on_d512"] == pytest.approx(1.0)
    # the personal heads off (work Flower's client does not do): ratios of their own, the headline is int8
    assert ratios["cpu_ms_per_round_device_no_personal"] == pytest.approx(5.0 / 4.0)
    assert ratios["cycle_ms_no_personal"] == pytest.approx(1.2)


def test_peer_bench_cycle_split_adds_up_to_the_cycle() -> None:
    """Start -> first update -> last update -> aggregated -> next start, per round (rounds 2-4)."""
    starts = {r: 10.0 * r for r in range(1, 7)}
    update_at = {r: [10.0 * r + 4.0, 10.0 * r + 3.0] for r in range(1, 6)}
    agg_at = {r: 10.0 * r + 4.5 for r in range(1, 6)}
    split = peer.cycle_split(starts, update_at, agg_at)
    assert split == pytest.approx(
        {"to_first_update": 3000.0, "to_last_update": 1000.0, "to_aggregate": 500.0, "to_next_start": 5500.0}
    )
    assert sum(split.values()) == pytest.approx(1e3 * statistics.median(peer.per_cycle(starts)))
