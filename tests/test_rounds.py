"""A round's bookkeeping: who answered is kept incrementally, with the same answers as the sets it replaced.

Every check is on values one can follow by hand; the sets are compared with the plain set algebra
(``set(devices) | set(declined) >= asked``) they stand for.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.coordinator.rounds import Round
from edgefl.errors import UpdateRejected
from edgefl.wire.rounds import Update, UpdateMetrics


def update(device: str, round_no: int = 1) -> Update:
    """A 4x2 update of ``device`` for round ``round_no`` from version 0."""
    return Update(
        round_no,
        0,
        device,
        10,
        np.zeros((4, 2), np.float32),
        np.zeros(2, np.float32),
        UpdateMetrics(0.5, 0.5, 0.1, 0),
        f"{device}:{round_no}:0",
    )


def test_rounds_incremental_answered_matches_the_set_algebra() -> None:
    selected = frozenset(f"d{i}" for i in range(6))
    r = Round(1, 0, (4, 2), 30.0, 100, selected)
    for i, dev in enumerate(["d0", "d1", "d2", "d3"]):
        u = update(dev)
        r.admit(u)
        r.record(u, 100)
        assert r.answered().of_selected == i + 1
        assert not r.complete()
    r.declined.append("d4")
    assert not r.complete()  # d5 has not answered
    assert r.has_answered("d4") and r.has_answered("d0") and not r.has_answered("d5")
    r.declined.append("d5")
    answered = set(r.devices) | set(r.declined)
    assert answered >= selected and r.complete()


def test_rounds_incremental_duplicate_device_refused_in_constant_time_set() -> None:
    r = Round(1, 0, (4, 2), 30.0, 100)
    u = update("dev-1")
    r.admit(u)
    r.record(u, 100)
    again = Update(1, 0, "dev-1", 10, u.delta_W, u.delta_b, u.metrics, "dev-1:1:0:again")
    with pytest.raises(UpdateRejected) as exc:
        r.admit(again)
    assert exc.value.reason == "duplicate"
    # a declined device is not a counted one: it is refused by the service's decline check instead
    r.declined.append("dev-2")
    r.admit(update("dev-2"))
    assert r.answered().counted == {"dev-1"}


def test_rounds_incremental_lists_replaced_whole_are_read_again() -> None:
    online = frozenset({"a", "b", "c"})
    r = Round(1, 0, (4, 2), 30.0, 2, online=online, quorum=1.0)
    r.devices.append("a")
    assert r.answered().of_online == 1
    r.devices = ["a", "b"]  # a resumed round: lists replaced whole
    r.update_ids = {"a:1:0", "b:1:0"}
    assert r.answered().of_online == 2 and not r.complete()
    r.declined = ["c", "x"]  # x was not online at the opening: it does not count towards "everybody"
    assert r.answered().of_online == 3 and r.answered().members == {"a", "b", "c", "x"}
    assert r.complete()


def test_rounds_incremental_asked_is_the_online_devices_and_every_answer() -> None:
    """Without a selection the devices asked are those online at the opening and any other that answered
    (update or decline), counted once: what ``close_at`` takes a quorum of."""
    r = Round(1, 0, (4, 2), 30.0, 1, online=frozenset({"a", "b", "c"}), quorum=0.5)
    assert (r.asked, r.close_at) == (3, 2)
    for dev in ("d", "a"):  # d was not online at the opening, a was
        u = update(dev)
        r.admit(u)
        r.record(u, 100)
    r.declined.append("e")
    r.declined.append("b")
    assert r.asked == len({"a", "b", "c"} | set(r.devices) | set(r.declined)) == 5
    assert r.close_at == 3 and not r.complete()
    u = update("c")
    r.admit(u)
    r.record(u, 100)
    assert r.asked == 5 and r.complete()
