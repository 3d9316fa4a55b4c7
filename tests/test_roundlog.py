"""The coordinator's round line counts in words that agree with the number ("1 device", "2 devices")."""

from __future__ import annotations

from edgefl.coordinator.history import RoundRecord
from edgefl.coordinator.roundlog import round_line


def test_roundlog_one_device_is_singular() -> None:
    one = RoundRecord(3, 1, 0.9, 100.0, 0.1, fed_accuracy=0.8, fed_worst_decile=0.8, fed_devices=1, asked=1)
    assert "(worst decile 0.800, 1 device)" in round_line(one, 0, {})
    two = RoundRecord(3, 2, 0.9, 100.0, 0.1, fed_accuracy=0.8, fed_worst_decile=0.7, fed_devices=2, asked=2)
    assert "(worst decile 0.700, 2 devices)" in round_line(two, 0, {})
