"""Expected connection failures read as one clear line with their cause, never a flood of tracebacks.

A real mosquitto TLS listener (the test PKI, password file): a plain ``mqtt://`` client, a client that
trusts another CA, a wrong password; and the coordinator's wait for its broker, which names the cause.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from conftest import PASSWORD, USER, Broker, Pki, wait_until
from test_tls import tls_broker  # noqa: F401

from edgefl.coordinator.runner import _connected_or_refused
from edgefl.errors import TransportError
from edgefl.tlsconf import make_ssl_context
from edgefl.transport import MqttTransport

pytestmark = [pytest.mark.timeout(120), pytest.mark.broker]


class Counting(MqttTransport):
    """The shipped transport, counting its connection attempts."""

    attempts = 0

    def _connect(self, client: Any) -> None:
        self.attempts += 1
        super()._connect(client)


def test_transport_errors_plain_client_on_a_tls_port_logs_one_line_with_the_hint(
    tls_broker: Broker,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        tx = Counting(
            tls_broker.host, tls_broker.port, "plain", username=USER, password=PASSWORD, reconnect_max_s=0.1
        )
        await tx.start(wait_s=None)
        try:
            await wait_until(lambda: tx.attempts >= 8, 60, "eight connection attempts")
        finally:
            await tx.stop()
        assert tx.thread_errors_total == 0
        assert tx.last_error is not None and "before any CONNACK" in tx.last_error

    with caplog.at_level(logging.DEBUG, logger="edgefl"):
        asyncio.run(main())
    records = [r for r in caplog.records if r.name.startswith("edgefl")]
    assert [r for r in records if r.levelno >= logging.ERROR or r.exc_info] == []
    hints = [r.getMessage() for r in records if "a TLS port needs mqtts://" in r.getMessage()]
    assert len(hints) == 1, hints
    where = f"{tls_broker.host}:{tls_broker.port}"
    assert f"broker {where} closed the connection before any CONNACK (MQTT 5 and 3.1.1)" in hints[0]
    assert [r for r in records if r.levelno == logging.WARNING and r.getMessage() not in hints] == []


def test_transport_errors_wrong_ca_names_the_certificate_failure(
    tls_broker: Broker,  # noqa: F811
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def client() -> MqttTransport:
        ctx = make_ssl_context(pki.other_ca)
        return MqttTransport(
            tls_broker.host, tls_broker.port, "wrong-ca", tls_context=ctx, username=USER, password=PASSWORD
        )

    async def start() -> str:
        tx = client()
        try:
            await tx.start(wait_s=2)
        except TransportError as exc:
            return str(exc)
        finally:
            await tx.stop()
        return "connected"

    async def coordinator_wait() -> str:
        tx = client()
        await tx.start(wait_s=None)
        try:
            await _connected_or_refused(tx, "mqtts://x", 2)
        except TransportError as exc:
            return str(exc)
        finally:
            await tx.stop()
        return "connected"

    with caplog.at_level(logging.DEBUG, logger="edgefl"):
        said = asyncio.run(start())
        assert said.startswith(
            f"no connection to broker {tls_broker.host}:{tls_broker.port} after 2 s (last: "
        )
        assert "certificate verify failed" in said, said
        said = asyncio.run(coordinator_wait())
    assert said.startswith("broker mqtts://x not reachable within 2 s: "), said
    assert "certificate verify failed" in said, said
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_transport_errors_wrong_password_is_named_at_once(
    tls_broker: Broker,  # noqa: F811
    pki: Pki,
) -> None:
    async def main() -> str:
        tx = MqttTransport(
            tls_broker.host,
            tls_broker.port,
            "wrong-password",
            tls_context=make_ssl_context(pki.ca),
            username=USER,
            password="not the password",
        )
        try:
            await tx.start(wait_s=60)  # the refusal ends the wait, not the 60 s
        except TransportError as exc:
            return str(exc)
        finally:
            await tx.stop()
        return "connected"

    said = asyncio.run(main())
    assert said.startswith(f"broker {tls_broker.host}:{tls_broker.port} refused the credentials ("), said
    assert said.endswith("check the username and password against the broker's password file")
