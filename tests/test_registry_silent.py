"""A device asked in a round that neither answered nor declined is not waited for, nor believed for pacing.

Fast tier (no broker): the registry's ``note_silent``/``heard``, ``waited_devices`` and
``ready_new_samples`` with the round and pacing logic they feed. Select with ``pytest -k hostile``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from edgefl.coordinator.registry import DeviceRegistry
from edgefl.coordinator.rounds import FleetPhase, Pacing, Round
from edgefl.wire.cbor import Limits
from edgefl.wire.rounds import Update, UpdateMetrics
from edgefl.wire.status import DeviceStatus, encode_status

HONEST = ("gw-1", "gw-2", "gw-3", "gw-4")


def _registry() -> DeviceRegistry:
    return DeviceRegistry(model_sha256="0" * 64, head_shape=(8, 4), clipped=Counter(), limits=Limits())


def _status(reg: DeviceRegistry, device: str, new_samples: int) -> None:
    fields = {"ready": True, "store_samples": 100, "new_samples": new_samples}
    reg.note_status(device, encode_status(DeviceStatus(device, "online", fields)))


def _update(device: str, round_no: int) -> Update:
    return Update(
        device=device,
        round=round_no,
        base_version=0,
        update_id=f"{device}:{round_no}:0",
        num_examples=10,
        delta_W=np.zeros((8, 4), np.float32),
        delta_b=np.zeros(4, np.float32),
        metrics=UpdateMetrics(loss=0.5, accuracy=0.9, train_s=1.0, peak_rss_bytes=1 << 20),
    )


def _fleet(hostile_claim: int = 1_000_000) -> DeviceRegistry:
    reg = _registry()
    for dev in HONEST:
        _status(reg, dev, 0)  # nothing new on the honest devices
    _status(reg, "gw-10", hostile_claim)
    return reg


def test_hostile_silent_device_is_not_waited_for_after_a_round_it_let_pass() -> None:
    reg = _fleet()
    assert reg.waited_devices() == sorted([*HONEST, "gw-10"])
    first = Round(1, 0, (8, 4), 60.0, 2, online=frozenset(reg.waited_devices()), quorum=1.0)
    for dev in HONEST:
        first.record(_update(dev, 1), 100)
        reg.trained(dev, 1)
    assert not first.complete()  # quorum 1.0 of 5 asked: round 1 waits its deadline for gw-10
    assert first.silent() == ["gw-10"]
    reg.note_silent(first.silent(), 1)
    assert reg.unanswered == {"gw-10": 1}
    assert reg.waited_devices() == sorted(HONEST)
    assert "gw-10" in reg.online_devices()  # still ready: it may send an update, which counts
    second = Round(2, 1, (8, 4), 60.0, 2, online=frozenset(reg.waited_devices()), quorum=1.0)
    assert second.close_at == 4
    for dev in HONEST:
        second.record(_update(dev, 2), 100)
    assert second.complete()  # closes at the 4 honest updates, without gw-10
    assert second.silent() == []


def test_hostile_silent_claim_of_new_samples_opens_no_round() -> None:
    reg = _fleet()
    pacing = Pacing(interval_s=60.0, min_new_samples=32, min_devices=3)
    assert pacing.check(1, reg.ready_new_samples(), 120.0).state is FleetPhase.PAUSED  # believed at first
    reg.note_silent(["gw-10"], 1)
    assert reg.ready_new_samples()["gw-10"] == 0
    st = pacing.check(1, reg.ready_new_samples(), 120.0)
    assert st.state is FleetPhase.WAITING_SAMPLES
    assert (st.ready, st.new_samples) == (5, 0)
    _status(reg, "gw-2", 40)  # an honest device has new data: the round opens as before
    st = pacing.check(1, reg.ready_new_samples(), 120.0)
    assert (st.state, st.new_samples) == (FleetPhase.PAUSED, 40)


def test_hostile_silent_device_is_waited_for_again_once_it_answers_or_declines() -> None:
    reg = _fleet()
    reg.note_silent(["gw-10", "gw-3"], 4)  # gw-3 was restarting during round 4
    assert reg.waited_devices() == ["gw-1", "gw-2", "gw-4"]
    reg.trained("gw-3", 5)  # its update of round 5 counted
    assert reg.waited_devices() == ["gw-1", "gw-2", "gw-3", "gw-4"]
    reg.heard("gw-10")  # a decline is an answer too
    assert reg.waited_devices() == sorted([*HONEST, "gw-10"])
    assert reg.ready_new_samples()["gw-10"] == 1_000_000
    assert reg.unanswered == {}


def test_hostile_silent_whole_fleet_still_gets_rounds() -> None:
    reg = _fleet(hostile_claim=0)
    _status(reg, "gw-1", 50)
    reg.note_silent([*HONEST, "gw-10"], 3)  # everyone restarted during round 3
    assert reg.waited_devices() == sorted([*HONEST, "gw-10"])  # no device to prefer: all of them
    assert reg.ready_new_samples()["gw-1"] == 50
    pacing = Pacing(interval_s=60.0, min_new_samples=32, min_devices=3)
    assert pacing.check(3, reg.ready_new_samples(), 120.0).state is FleetPhase.PAUSED


def test_hostile_silent_mark_is_bounded_by_the_registry() -> None:
    reg = _fleet()
    reg.note_silent(["ghost-1", "ghost-2", "gw-10"], 1)  # devices it does not hold are not kept
    assert reg.unanswered == {"gw-10": 1}
    reg.note_silent(["gw-10"], 2)
    assert reg.unanswered == {"gw-10": 1}  # the first round it let pass
    reg.forget("gw-10")
    assert reg.unanswered == {}
