"""The transport's broker address list (issue 16: a root coordinator on a clustered root broker)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import free_port, start_mosquitto, stop_broker, wait_until

import edgefl.transport as transport_mod
from edgefl.transport import MqttTransport


@pytest.fixture(autouse=True)
def _fast_reconnect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_mod, "RECONNECT_MIN_S", 0.05)
    monkeypatch.setattr(transport_mod, "RECONNECT_MAX_S", 0.3)


def test_transport_fails_over_to_the_next_broker_address(tmp_path: Path, fleet: str) -> None:
    """A lost broker: the next connection goes to the next address, the subscription comes along."""
    a, b = start_mosquitto(tmp_path), start_mosquitto(tmp_path)

    async def main() -> tuple[int, int, bytes]:
        t = MqttTransport(a.host, a.port, f"t-{fleet}", alternates=[(b.host, b.port)])
        try:
            await t.start(wait_s=10)
            first = t.port
            await t.subscribe(f"{fleet}/echo", 1)
            stop_broker(a)
            await wait_until(lambda: t.connected.is_set() and t.port == b.port, 15, "connected to b")
            await t.publish(f"{fleet}/echo", b"on b", qos=1)  # re-subscribed before "connected"
            msg = await asyncio.wait_for(t.queue.get(), 5)
            return first, t.port, msg.payload
        finally:
            await t.stop()

    try:
        assert asyncio.run(main()) == (a.port, b.port, b"on b")
    finally:
        stop_broker(b)
        stop_broker(a)


def test_transport_starts_on_the_next_address_when_the_first_is_down(tmp_path: Path, fleet: str) -> None:
    b = start_mosquitto(tmp_path)

    async def main() -> int:
        t = MqttTransport("127.0.0.1", free_port(), f"t-{fleet}", alternates=[(b.host, b.port)])
        try:
            await t.start(wait_s=10)
            return t.port
        finally:
            await t.stop()

    try:
        assert asyncio.run(main()) == b.port
    finally:
        stop_broker(b)
