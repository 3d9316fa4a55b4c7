"""The ingest queue's bytes (agent/ingest.py ``queued_bytes``), counted in the agent's byte bound on what it
received and has not handled (``source.queue_max_bytes``), and that key's validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgefl.agent.config import parse_profile
from edgefl.agent.ingest import Ingest
from edgefl.errors import ConfigError
from edgefl.wire.ingest import Sample


def test_ingest_bytes_follow_the_queue_through_offer_drop_and_take() -> None:
    """Queued bytes are the queued arrays' ``nbytes``: added at offer, removed at drop-oldest and take."""
    ing = Ingest(queue_max=3, pending_max=0, label_expiry_s=10.0)
    sizes = [100, 200, 300, 400]
    for i, n in enumerate(sizes):
        ing.offer_sample(Sample(f"s{i}", np.zeros(n, dtype=np.uint8)))
    assert ing.queued_bytes == 200 + 300 + 400 and ing.counters.ingest_dropped == 1
    rows = ing.take(2)
    assert [r.id for r in rows] == ["s1", "s2"] and ing.queued_bytes == 400
    ing.offer_sample(Sample("f", np.zeros((4, 5), dtype=np.float32)))
    assert ing.queued_bytes == 400 + 80
    ing.take(10)
    assert ing.queued_bytes == 0


@pytest.mark.parametrize("value", [0, 65_535, 67_108_865, -1])
def test_ingest_bytes_queue_max_bytes_out_of_range_is_refused(value: int, tmp_path: Path) -> None:
    data = {"device": {"id": "dev-1"}, "model": {"path": "m.tflite"}, "source": {"queue_max_bytes": value}}
    with pytest.raises(ConfigError) as info:
        parse_profile(data, tmp_path, check_files=False)
    assert [p for p in info.value.problems if p.startswith("source.queue_max_bytes")] == [
        f"source.queue_max_bytes = {value}: must be between 65536 and 67108864 bytes"
    ]


def test_ingest_bytes_queue_max_bytes_default_and_override(tmp_path: Path) -> None:
    data = {"device": {"id": "dev-1"}, "model": {"path": "m.tflite"}}
    assert parse_profile(data, tmp_path, check_files=False).source.queue_max_bytes == 4 * 2**20
    p = parse_profile(data, tmp_path, check_files=False, overrides={"source.queue_max_bytes": "65536"})
    assert p.source.queue_max_bytes == 65_536
