"""The fleet page's device rows show a device's claimed accuracy only when it is one (in [0, 1]).

Fast tier: ``DeviceRegistry.page_devices`` gives None (the page's "–") for 50.0, -7.0, NaN, strings.
Select with ``pytest -k hostile``.
"""

from __future__ import annotations

from collections import Counter

from edgefl.coordinator.registry import DeviceRegistry
from edgefl.wire.cbor import Limits
from edgefl.wire.status import DeviceStatus, encode_status


def test_hostile_page_row_shows_invalid_accuracies_as_none() -> None:
    reg = DeviceRegistry(model_sha256="0" * 64, head_shape=(8, 4), clipped=Counter(), limits=Limits())
    hostile = {"ready": True, "personal_accuracy": 50.0, "global_accuracy": -7.0, "eval_accuracy": "0.9"}
    reg.note_status("gw-10", encode_status(DeviceStatus("gw-10", "online", hostile)))
    honest = {"ready": True, "personal_accuracy": 0.93, "global_accuracy": 1, "eval_accuracy": 0.0}
    reg.note_status("gw-1", encode_status(DeviceStatus("gw-1", "online", honest)))
    rows = reg.page_devices()
    bad = rows["gw-10"]
    assert (bad["personal_accuracy"], bad["global_accuracy"], bad["eval_accuracy"]) == (None, None, None)
    good = rows["gw-1"]
    assert (good["personal_accuracy"], good["global_accuracy"], good["eval_accuracy"]) == (0.93, 1.0, 0.0)
    assert reg.devices["gw-10"]["personal_accuracy"] == 50.0  # the status is kept as sent; only the row
