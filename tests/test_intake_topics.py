"""The coordinator's intake refuses a device id it would not accept on a topic, and a status naming another
device; the feed's reading of a device's counters survives forged values (select with ``-k hostile``)."""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.errors import DecodeError
from edgefl.mqtt_link import Message
from edgefl.topics import Topics
from edgefl.wire.cbor import MessageType, dump_message
from edgefl.wire.ingest import IngestRefusal, decode_answer, encode_refusal
from edgefl.wire.status import DeviceStatus, encode_status

TOPICS = Topics("edgefl", "f")


def coordinator() -> Coordinator:
    W, b = np.zeros((4, 3), np.float32), np.zeros(3, np.float32)
    return Coordinator(None, TOPICS, W, b, model_sha256="0" * 64, strategy=FedAvg())  # type: ignore[arg-type]


def test_hostile_device_id_on_a_topic_is_refused_and_never_kept() -> None:
    coord = coordinator()
    long_id = "g" * 65_000
    coord.handle(Message(TOPICS.status(long_id), encode_status(DeviceStatus("x", "online", {})), False))
    coord.handle(Message(TOPICS.update("bad id!"), b"\xa0", False))
    assert coord.state.rejected["bad_topic"] == 2
    assert coord.registry.devices == {}
    assert all(long_id not in counts for counts in (coord.registry.rejected_by_device,))
    assert coord.registry.rejected_by_device == {}


def test_hostile_status_naming_another_device_is_refused() -> None:
    coord = coordinator()
    coord.handle(Message(TOPICS.status("dev-1"), encode_status(DeviceStatus("dev-2", "online", {})), False))
    assert coord.state.rejected["wrong_device"] == 1
    assert "dev-1" not in coord.registry.devices and "dev-2" not in coord.registry.devices
    coord.handle(Message(TOPICS.status("dev-1"), encode_status(DeviceStatus("dev-1", "online", {})), False))
    assert "dev-1" in coord.registry.devices


def test_hostile_refusals_do_not_break_the_feeds_reading() -> None:
    good = IngestRefusal("s-1", "sample", "bad_shape", "x: shape [64]")
    assert decode_answer(encode_refusal(good)) == good
    forged = [
        dump_message(MessageType.REFUSAL, {"id": "s-1", "of": ["sample"], "reason": "bad_shape"}),
        dump_message(MessageType.REFUSAL, {"id": "s-1", "of": "sample", "reason": "Bad Shape!"}),
        dump_message(MessageType.REFUSAL, {"id": "s 1", "of": "sample", "reason": "bad_shape"}),
        dump_message(MessageType.REFUSAL, {"id": "s-1", "of": "sample", "reason": "x", "detail": 5}),
        dump_message(MessageType.REFUSAL, {"id": "s-1", "of": "sample", "reason": "x", "more": 1}),
    ]
    reasons = []
    for payload in forged:
        with pytest.raises(DecodeError) as info:
            decode_answer(payload)
        reasons.append(info.value.reason)
    assert reasons == ["wrong_type", "bad_value", "bad_value", "wrong_type", "unknown_key"]
