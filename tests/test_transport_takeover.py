"""The transport names a session taken over by another client with its client id (real mosquitto)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from conftest import Broker, wait_until
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

import edgefl.transport as transport_mod
from edgefl.transport import MqttTransport

TAKEOVER_ERROR = "another client probably uses client id"


@pytest.mark.broker
@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_takeover_two_clients_with_one_client_id_are_named(
    mosquitto: Broker,
    fleet: str,
    protocol: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two processes sharing a client id (one account with ``use_username_as_clientid``) take over each
    other's session at every connect: each loss names the client id as a cause instead of paho's
    "Unspecified error", and after three quick losses in a row one ERROR says what happens."""
    monkeypatch.setattr(transport_mod, "RECONNECT_MIN_S", 0.05)
    monkeypatch.setattr(transport_mod, "RECONNECT_MAX_S", 0.2)
    caplog.set_level(logging.WARNING, logger="edgefl.transport")
    cid = f"{fleet}-shared"

    async def main() -> None:
        a = MqttTransport(mosquitto.host, mosquitto.port, cid, protocol=protocol)
        b = MqttTransport(mosquitto.host, mosquitto.port, cid, protocol=protocol)
        await a.start(wait_s=10)
        try:
            await b.start(wait_s=10)
            await wait_until(
                lambda: any(TAKEOVER_ERROR in r.getMessage() for r in caplog.records),
                20,
                "the takeover error",
            )
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())
    lost = [r.getMessage() for r in caplog.records if r.getMessage().startswith("broker lost")]
    assert lost, caplog.text
    assert all(f"client id {cid!r}" in m and "Unspecified" not in m for m in lost), lost
    errors = [r for r in caplog.records if TAKEOVER_ERROR in r.getMessage()]
    assert errors[0].levelno == logging.ERROR
    assert (
        f"client id {cid!r}" in errors[0].getMessage() and "one account per process" in errors[0].getMessage()
    )


def test_takeover_reason_of_a_broker_disconnect_is_named() -> None:
    """An MQTT 5 DISCONNECT 0x8E from the broker says "session taken over" with the client id; another
    broker reason is quoted as the broker's; paho's own stand-in for a closed socket lists the causes."""
    t = MqttTransport("127.0.0.1", 1, "gw-7-cam")
    taken = ReasonCode(PacketTypes.DISCONNECT, identifier=0x8E)
    assert (
        t._loss_reason(taken, True)
        == "session taken over: another client connected with client id 'gw-7-cam'"
    )
    quota = ReasonCode(PacketTypes.DISCONNECT, identifier=0x97)
    assert t._loss_reason(quota, True) == "the broker disconnected us: Quota exceeded"
    closed = ReasonCode(PacketTypes.DISCONNECT, "Unspecified error")
    assert t._loss_reason(closed, False).startswith("connection closed without a reason: the broker stopped")
    assert t._loss_reason("network loop failed: x", False) == "network loop failed: x"
