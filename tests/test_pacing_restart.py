"""A restarted coordinator paces as the one before it: the interval since the last round's opening
(from the state file's history) and no new-sample count a counted round already trained on.
"""

from __future__ import annotations

import time

import numpy as np

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.history import RoundRecord
from edgefl.coordinator.rounds import FleetPhase, Pacing
from edgefl.coordinator.service import Coordinator
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.status import DeviceStatus, encode_status


def _coordinator() -> Coordinator:
    W, b = np.zeros((4, 2), np.float32), np.zeros(2, np.float32)
    transport = MqttTransport("127.0.0.1", 1883, "never-started")
    transport.connected.set()
    return Coordinator(transport, Topics("edgefl", "f"), W, b, model_sha256="0" * 64, strategy=FedAvg())


def _status(coord: Coordinator, device: str, round_no: int, new_samples: int) -> None:
    fields = {"ready": True, "round": round_no, "new_samples": new_samples, "store_samples": 300}
    coord.registry.note_status(device, encode_status(DeviceStatus(device, "online", fields)))


def test_pacing_restart_keeps_the_interval_from_the_last_rounds_opening() -> None:
    coord = _coordinator()
    coord.pacing = Pacing(interval_s=60.0, min_new_samples=0, min_devices=1)
    _status(coord, "gw-1", 2, 10)
    assert coord.pacing_state().text == "opening round 1"  # nothing run yet: no interval to wait
    # the state file's last round opened 14 s ago (closed 10 s ago after 4 s)
    coord.state.round = 2
    coord.state.history = [RoundRecord(2, 1, 0.9, 1000.0, 4.0, closed_unix=time.time() - 10.0)]
    fs = coord.pacing_state()
    assert fs.state is FleetPhase.PAUSED and fs.next_round_in_s is not None, fs
    assert 45.0 <= fs.next_round_in_s <= 46.0 and fs.text == "paused: next round in 46 s", fs


def test_pacing_restart_a_retained_status_from_before_a_counted_round_reports_no_new_samples() -> None:
    coord = _coordinator()
    coord.pacing = Pacing(interval_s=0.0, min_new_samples=32, min_devices=2)
    _status(coord, "gw-1", 1, 56)  # retained before round 2, which counted both devices' updates
    _status(coord, "gw-2", 2, 40)  # published after its round-2 update: 40 stored since
    coord.registry.trained("gw-1", 2)
    coord.registry.trained("gw-2", 2)
    assert coord.registry.ready_new_samples() == {"gw-1": 0, "gw-2": 40}
    _status(coord, "gw-1", 2, 7)  # its next status: counted again
    assert coord.registry.ready_new_samples() == {"gw-1": 7, "gw-2": 40}
    coord.registry.forget("gw-1")
    assert "gw-1" not in coord.registry.trained_round
