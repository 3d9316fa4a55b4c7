"""The ingest's id tables: a ring of hashed ids whose memory is fixed from the first sample."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from edgefl.agent.ingest import DISPUTED, RECENT_IDS, Ingest
from edgefl.errors import UpdateRejected
from edgefl.idtable import IdTable
from edgefl.wire.ingest import Label, Sample


def test_soak_id_table_is_a_ring_with_values_and_expiry() -> None:
    t = IdTable(3)
    for i, since in enumerate((1.0, 2.0, 3.0)):
        t.add(f"s{i}", i + 10, since)
    assert (len(t), "s0" in t, t.get("s2")) == (3, True, (12, 3.0))
    t.add("s3", 13, 4.0)  # full: the oldest (s0) goes
    assert ("s0" in t, t.get("s0"), len(t)) == (False, None, 3)
    t.add("s1", 21, 5.0)  # again: the older entry of s1 is dropped, the new one is the newest
    t.set_value("s2", DISPUTED)
    assert (t.get("s1"), t.get("s2"), len(t)) == ((21, 5.0), (DISPUTED, 3.0), 3)
    t.forget_until(4.0)  # s2 (3.0) and s3 (4.0) expire, s1 (5.0) stays
    assert (t.get("s2"), t.get("s3"), t.get("s1"), len(t)) == (None, None, (21, 5.0), 1)
    t.set_value("gone", 1)  # not held: nothing
    assert len(t) == 1
    ids = IdTable(2, values=False)
    ids.add("")  # the empty id (hash 0) is held too
    assert "" in ids and "x" not in ids
    with pytest.raises(ValueError, match="capacity 0"):
        IdTable(0)


def test_soak_ingest_holds_no_more_memory_after_many_ids() -> None:
    """Labelled samples by the thousand: the duplicate and conflict tables do not grow past the first."""
    now = [0.0]
    ing = Ingest(queue_max=8, pending_max=8, label_expiry_s=1e9, clock=lambda: now[0])
    x = np.zeros((8, 8, 1), np.uint8)

    def feed(start: int, n: int) -> None:
        for i in range(start, start + n):
            now[0] = float(i)
            ing.offer_sample(Sample(f"gateway-app-sample-{i:09d}", x, i % 10))
            for row in ing.take(8):
                ing.settle(row.id, np.zeros(4, np.float32), predicted=0)

    feed(0, 64)  # the tables' arrays, the queue and the classes' first allocations
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        feed(64, 3 * RECENT_IDS)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # with one dict entry per id (about 150 bytes each) the tables grew ~1 MiB over these samples
    assert grown < 16 << 10, grown
    # still a working duplicate and conflict check: the last RECENT_IDS ids are known, older ones not
    last = 64 + 3 * RECENT_IDS - 1
    with pytest.raises(UpdateRejected) as dup:
        ing.offer_sample(Sample(f"gateway-app-sample-{last:09d}", x, 1))
    assert dup.value.reason == "duplicate"
    with pytest.raises(UpdateRejected) as conflict:
        ing.offer_label(Label(f"gateway-app-sample-{last:09d}", (last % 10 + 1) % 10))
    assert conflict.value.reason == "label_conflict"
    ing.offer_sample(Sample(f"gateway-app-sample-{last - RECENT_IDS:09d}", x, 1))  # forgotten: taken again
