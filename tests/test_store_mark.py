"""The store's mark: how many held samples came after the last round, across a restart and a crash."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgefl.agent.store import EmbeddingStore
from edgefl.records import read_record


def rows(n: int, start: int = 0, dim: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """n samples numbered from ``start``: embedding row filled with the number, label number % 3."""
    seq = np.arange(start, start + n)
    return np.repeat(seq[:, None], dim, axis=1).astype(np.float32), (seq % 3).astype(np.int64)


def test_pacing_store_mark_counts_only_samples_after_it_across_a_restart(tmp_path: Path) -> None:
    s = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    s.add(*rows(10))
    assert (s.mark, s.since_mark, s.total) == (None, 10, 10)  # no mark: every held sample is new
    s.set_mark()
    s.add(*rows(3, start=10))
    assert s.since_mark == 3
    s.flush()
    assert json.loads(read_record(tmp_path / "store_meta.rec") or b"")["mark"] == 10
    s.add(*rows(2, start=13))
    del s  # a kill -9 after the flush: the mark and the 13 flushed samples are durable, the 2 recovered
    again = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    assert (len(again), again.mark, again.since_mark) == (15, 10, 5)
    # the ring wraps: never more new samples than held
    again.add(*rows(20, start=15))
    assert (len(again), again.total, again.since_mark) == (16, 35, 16)


def test_pacing_store_mark_ahead_of_what_was_recovered_moves_back(tmp_path: Path) -> None:
    s = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    s.add(*rows(6))
    s.set_mark()
    s.flush()
    del s
    (tmp_path / "store_rows.u64").write_bytes(
        bytes(16 * 16)
    )  # every row gone (a torn file): nothing recovered
    again = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    assert (len(again), again.mark, again.since_mark) == (0, 0, 0)
    again.add(*rows(2, start=6))
    assert again.since_mark == 2  # stored after the loss: new for the next round
