"""What a coordinator keeps of each closed round for its page and its state file stays small (service.py)."""

from __future__ import annotations

import tracemalloc

import numpy as np

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.history import HISTORY_ROUNDS, RoundRecord
from edgefl.coordinator.service import Coordinator
from edgefl.topics import Topics


def coordinator() -> Coordinator:
    W, b = np.zeros((4, 3), np.float32), np.zeros(3, np.float32)
    return Coordinator(None, Topics("edgefl", "f"), W, b, model_sha256="0" * 64, strategy=FedAvg())  # type: ignore[arg-type]


def record(r: int, rng: np.random.Generator) -> RoundRecord:
    """A round's record as run_round makes it: its own float objects, as a real round's are."""
    u = [float(x) for x in rng.random(6)]
    return RoundRecord(
        r, 5, u[0], 20792.6 + r, u[1], clipped=4, norm_bound=u[2], fed_accuracy=u[3], fed_worst_decile=u[4],
        fed_devices=5, asked=5, lr=0.05, closed_unix=1.8e9 + u[5], new_samples=25,
    )  # fmt: skip


def close(coord: Coordinator, rec: RoundRecord, refused: dict[str, int], declined: dict[str, int]) -> None:
    """What run_round and the runner keep of a closed round: its record, its reasons, the state file's row."""
    coord.keep_record(rec)
    coord.note_round_reasons(rec.round, refused, declined)
    coord._history_rows()


def test_soak_coordinator_quiet_round_reasons_read_back_as_kept() -> None:
    """A quiet round's reasons are not kept as containers, yet the page reads them as before: empty, each
    record its own dicts; a round with refusals or declines keeps and shows them."""
    coord = coordinator()
    rng = np.random.default_rng(0)
    for r in range(1, 7):
        refused = {"late": 2} if r == 3 else {}
        declined = {"no_samples": 1} if r == 5 else {}
        close(coord, record(r, rng), refused, declined)
    assert [r for r, kept in coord._round_reasons.items() if kept is not None] == [3, 5]
    page = coord.dashboard_rounds()
    assert [(p["round"], p["refused"], p["declined"]) for p in page] == [
        (1, {}, {}),
        (2, {}, {}),
        (3, {"late": 2}, {}),
        (4, {}, {}),
        (5, {}, {"no_samples": 1}),
        (6, {}, {}),
    ]
    assert all(p["silent"] == [] and p["silent_devices"] == 0 for p in page)
    page[0]["refused"]["late"] = 9  # the page's records are its own: another quiet round does not change
    assert page[1]["refused"] == {} and page[3]["refused"] == {}
    # a round noted after the page converted it is completed in place, quiet or not
    close(coord, record(7, rng), {}, {})
    coord.dashboard_rounds()
    coord.keep_record(record(8, rng))
    converted = coord.dashboard_rounds()[-1]
    coord.note_round_reasons(8, {"stale_round": 1}, {})
    assert converted["round"] == 8 and converted["refused"] == {"stale_round": 1}


def test_soak_coordinator_kept_round_costs_under_768_bytes() -> None:
    """The memory a kept quiet round adds (its record with its floats, the state file's row, its reasons'
    slot) stays under 768 B: 200 rounds under 150 KiB. A list row (~250 B) and four containers of reasons
    (~0.4 KiB) a round took it to ~950 B."""
    coord = coordinator()
    rng = np.random.default_rng(1)
    for r in range(1, 11):  # the containers' first sizes
        close(coord, record(r, rng), {}, {})
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for r in range(11, HISTORY_ROUNDS + 1):
            close(coord, record(r, rng), {}, {})
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    added = HISTORY_ROUNDS - 10
    assert [h.round for h in coord.state.history] == list(range(1, HISTORY_ROUNDS + 1))
    per_round = kept / added
    assert per_round < 768, f"{per_round:.0f} B a kept round"
