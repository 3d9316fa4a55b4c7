"""The fleet page's long round history (``coordinator/roundarchive.py``): the round log's tail whole, the
rest sampled, bounded whatever the log's length; and a real ``edgefl coordinator`` serving 5,000
logged rounds on its page's ``/api/rounds`` (beyond the 200 it keeps in memory)."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import Broker
from test_service import start_coordinator, wait_for

from edgefl.coordinator.roundarchive import RoundArchive, page_entry, read_sample, read_tail
from edgefl.launcher import free_port

pytestmark = pytest.mark.timeout(300)


def page_records(archive: RoundArchive) -> list[Any]:
    """The page's records, as the coordinator's page asks for them."""
    return asyncio.run(archive.records_async())


def write_log(path: Path, rounds: range, **extra: Any) -> None:
    with open(path, "a") as f:
        for r in rounds:
            line = {
                "round": r,
                "time": "2026-12-06T04:00:00Z",
                "asked": 3,
                "counted": 3,
                "accuracy": r / 10_000,
                "fed_accuracy": 0.5,
                "fed_worst_decile": 0.25,
                "fed_devices": 3,
                "refused": {},
                "declined": {"over_budget": 1},
                "update_ids": [f"gw-{k}:{r}:0" for k in range(3)],
                "version": r,
                "strategy": "median",
                **extra,
            }
            f.write(json.dumps(line) + "\n")


def test_pacing_history_tail_whole_and_the_rest_sampled(tmp_path: Path) -> None:
    log = tmp_path / "rounds.jsonl"
    write_log(log, range(1, 5001))
    recent = [{"round": r, "accuracy": 0.9, "refused": {}, "reasons": "memory"} for r in range(4801, 5001)]
    records = page_records(RoundArchive(log, lambda: recent, tail_rounds=1000, sampled_rounds=500))
    rounds = [r["round"] for r in records]
    assert rounds == sorted(set(rounds))  # strictly increasing
    assert rounds[-1000:] == list(range(4001, 5001))  # the page's "last 1000": every round
    assert records[-200:] == recent  # the in-memory records (with their reasons) win over the log
    sampled = records[:-1000]
    assert all(r["sampled"] is True for r in sampled) and "sampled" not in records[-1000]
    # "all": evenly spaced over rounds 1..4000 (lines are about the same length)
    assert 490 <= len(sampled) <= 500 and sampled[0]["round"] <= 2 and sampled[-1]["round"] > 3980
    gaps = [b["round"] - a["round"] for a, b in itertools.pairwise(sampled)]
    assert min(gaps) >= 7 and max(gaps) <= 9, (min(gaps), max(gaps))
    # a page record: the page's keys, no update ids, declines counted
    tail = records[-1001]
    assert tail["fed_accuracy"] == 0.5 and tail["declined_devices"] == 1 and "update_ids" not in tail


def test_pacing_history_of_a_short_log_and_of_none(tmp_path: Path) -> None:
    log = tmp_path / "rounds.jsonl"
    assert page_records(RoundArchive(log, lambda: [{"round": 1}])) == [{"round": 1}]  # no log yet
    write_log(log, range(1, 31))
    with open(log, "a") as f:
        f.write('{"round": 31, "acc')  # a line being written: not a round yet
    records = page_records(RoundArchive(log, list))
    assert [r["round"] for r in records] == list(range(1, 31)) and not any("sampled" in r for r in records)


def test_pacing_history_keeps_the_latest_history_and_a_round_logged_twice_once(tmp_path: Path) -> None:
    log = tmp_path / "rounds.jsonl"
    write_log(log, range(1, 101))  # an earlier history, before the state file was deleted
    write_log(log, range(1, 51))
    write_log(log, range(50, 61), recovered=True)  # round 50 logged again (recovered)
    records = page_records(RoundArchive(log, list))
    assert [r["round"] for r in records] == list(range(1, 61))


def test_pacing_history_reads_are_bounded(tmp_path: Path) -> None:
    """Lines of a big fleet (2,000 update ids each): the tail stops at its byte bound, the rest is sampled."""
    log = tmp_path / "rounds.jsonl"
    with open(log, "w") as f:
        for r in range(1, 401):
            f.write(json.dumps({"round": r, "update_ids": [f"gw-{k}:{r}:0" for k in range(2000)]}) + "\n")
    size = log.stat().st_size
    with open(log, "rb") as f:
        lines, start = read_tail(f, size, 1000, max_bytes=1 << 20)
        assert 0 < len(lines) < 100 and start > 0
        assert [page_entry(x)["round"] for x in lines] == list(range(401 - len(lines), 401))  # type: ignore[index]
        sample = read_sample(f, start, 50)
    assert 40 <= len(sample) <= 50
    records = page_records(RoundArchive(log, list))
    assert len(records) <= len(lines) + 1000 and records[-1]["round"] == 400


def test_pacing_history_beyond_200_rounds_on_a_real_coordinator_page(
    tmp_path: Path, mosquitto: Broker, fleet: str
) -> None:
    """A coordinator whose round log holds 5,000 rounds serves them on ``/api/rounds``: the last 1,000
    whole and the rest sampled (its memory keeps 200), in one bounded response."""
    log = tmp_path / "rounds.jsonl"
    write_log(log, range(1, 5001))
    port = free_port()
    coord = start_coordinator(
        tmp_path, "coordinator", mosquitto, fleet, f"files.log={log}", "dashboard.enabled=true",
        f"dashboard.port={port}",
    )  # fmt: skip

    def rounds() -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/rounds", timeout=10) as r:
            doc: dict[str, Any] = json.loads(r.read())
        return doc

    try:
        doc = wait_for(rounds, 90, "the fleet page", [coord], tmp_path)
    finally:
        coord.send_signal(signal.SIGTERM)
        assert coord.wait(timeout=30) == 0
    got = [r["round"] for r in doc["rounds"]]
    assert doc["last"] == 5000 and doc["total"] == len(got) and 1900 <= len(got) <= 2000, len(got)
    assert got[-1000:] == list(range(4001, 5001)) and got == sorted(set(got))
    assert doc["rounds"][0]["sampled"] is True and doc["rounds"][-1]["fed_accuracy"] == 0.5
