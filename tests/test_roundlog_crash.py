"""The round log after a torn append: the next closed round's line stays whole and readable.

A kill, a power cut or a full disk part-way through appending a round's line (a line longer than
one write: a round counting many update ids) leaves the log without its final newline. The next line
was appended right after the fragment, so the two made one unreadable line: that round was lost from
the log for good (the restart's recovery of missing rounds reads the log's last readable round).
"""

from __future__ import annotations

import json
from pathlib import Path

from edgefl.coordinator.history import RoundRecord
from edgefl.coordinator.roundlog import _round_entry, append_log


def _entry(round_no: int, ids: int) -> dict[str, object]:
    rec = RoundRecord(round_no, ids, 0.9, 2048.0, 1.5, asked=ids, closed_unix=1_800_000_000.0)
    return _round_entry(rec, round_no, "fedavg", [f"dev-{k}:{round_no}:0" for k in range(ids)], {}, {})


def test_durable_roundlog_append_after_a_torn_line_keeps_the_new_round(tmp_path: Path) -> None:
    log = tmp_path / "rounds.jsonl"
    append_log(log, [_entry(1, 3)])
    whole = json.dumps(_entry(2, 800)) + "\n"  # ~16 KiB: written in more than one write
    with open(log, "a") as f:
        f.write(whole[: len(whole) // 2])  # round 2's line torn half-way
    append_log(log, [_entry(2, 800), _entry(3, 2)])  # the restart logs round 2 again, then round 3

    readable = []
    for line in log.read_text().splitlines():
        try:
            readable.append(json.loads(line)["round"])
        except ValueError:
            continue
    assert readable == [1, 2, 3]
    assert log.read_text().endswith("\n")
    assert json.loads(log.read_text().splitlines()[-1])["update_ids"] == ["dev-0:3:0", "dev-1:3:0"]


def test_durable_roundlog_append_to_a_whole_log_adds_no_blank_line(tmp_path: Path) -> None:
    log = tmp_path / "rounds.jsonl"
    append_log(log, [_entry(1, 1)])
    append_log(log, [_entry(2, 1)])
    assert [json.loads(line)["round"] for line in log.read_text().split("\n")[:-1]] == [1, 2]
