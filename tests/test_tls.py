"""MQTT over TLS with a password file: mosquitto with certificates generated here (``cryptography``)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PASSWORD, USER, Broker, Pki, read_mqtt_packet, start_mosquitto, stop_broker, tls_conf

from edgefl.errors import ConfigError, TransportError
from edgefl.mqtt_socket import remaining_length
from edgefl.profiles import BrokerConfig
from edgefl.tlsconf import make_ssl_context, ssl_context_for
from edgefl.transport import MqttTransport

UNTRUSTED = {
    "self-signed certificate in certificate chain",
    "self signed certificate in certificate chain",
    "unable to get local issuer certificate",
}


@pytest.fixture(scope="module")
def tls_broker(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    b = start_mosquitto(
        tmp_path_factory.mktemp("tls"),
        extra=tls_conf(pki, pki.server_cert, pki.server_key, require_certificate=False),
    )
    yield b
    stop_broker(b)


@pytest.fixture(scope="module")
def mtls_broker(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    b = start_mosquitto(
        tmp_path_factory.mktemp("mtls"),
        extra=tls_conf(pki, pki.server_cert, pki.server_key, require_certificate=True),
    )
    yield b
    stop_broker(b)


def connect(
    broker: Broker, ctx: ssl.SSLContext, *, username: str = USER, password: str = PASSWORD, wait_s: float = 10
) -> bool:
    """Connect through the agent's transport; publish one QoS 1 message when connected."""

    async def main() -> bool:
        tx = MqttTransport(
            broker.host,
            broker.port,
            f"tls-{uuid.uuid4().hex[:8]}",
            tls_context=ctx,
            username=username,
            password=password,
        )
        try:
            await tx.start(wait_s=wait_s)
            await tx.publish(f"edgefl/t{uuid.uuid4().hex[:8]}/status/dev-1", b"hello", qos=1, timeout_s=5)
            return True
        except TransportError:
            return False
        finally:
            await tx.stop()

    return asyncio.run(main())


def handshake_error(broker: Broker, ctx: ssl.SSLContext, *, read: bool = False) -> str | None:
    """The TLS handshake alone, with the same context: None if it succeeds, else the reason.

    With ``read``, also wait briefly for the server's first bytes: under TLS 1.3 a server refuses a
    missing client certificate with an alert after the client considers the handshake done.
    """
    try:
        with (
            socket.create_connection((broker.host, broker.port), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname=broker.host) as tls,
        ):
            if read:
                tls.settimeout(1.0)
                try:
                    tls.recv(1)
                except TimeoutError:
                    return None  # the broker is waiting for our CONNECT: accepted
            return None
    except ssl.SSLCertVerificationError as exc:
        return str(exc.verify_message)
    except ssl.SSLError as exc:
        return str(exc.reason)
    except OSError as exc:
        return type(exc).__name__


def test_tls_context_verifies_the_server(pki: Pki) -> None:
    ctx = make_ssl_context(pki.ca)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert [c["subject"] for c in ctx.get_ca_certs()] == [((("commonName", "edgefl test CA"),),)]


def test_tls_with_password_connects(tls_broker: Broker, pki: Pki) -> None:
    assert connect(tls_broker, make_ssl_context(pki.ca))


def test_tls_wrong_ca_fails(tls_broker: Broker, pki: Pki) -> None:
    assert handshake_error(tls_broker, make_ssl_context(pki.ca)) is None
    # the chain is not trusted (wording depends on whether mosquitto sends its CA, and on OpenSSL)
    assert handshake_error(tls_broker, make_ssl_context(pki.other_ca)) in UNTRUSTED
    assert not connect(tls_broker, make_ssl_context(pki.other_ca), wait_s=2)


def test_tls_wrong_server_address_fails(pki: Pki, tmp_path: Path) -> None:
    # the certificate chains to the right CA but names 10.9.8.7: host name verification refuses it
    b = start_mosquitto(
        tmp_path, extra=tls_conf(pki, pki.wrong_name_cert, pki.wrong_name_key, require_certificate=False)
    )
    try:
        assert (
            handshake_error(b, make_ssl_context(pki.ca))
            == "IP address mismatch, certificate is not valid for '127.0.0.1'."
        )
        assert not connect(b, make_ssl_context(pki.ca), wait_s=2)
    finally:
        stop_broker(b)


def test_tls_wrong_password_fails(tls_broker: Broker, pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="edgefl.transport"):
        assert not connect(tls_broker, make_ssl_context(pki.ca), password="wrong", wait_s=2)
    assert "refused the connection: Not authorized" in caplog.text
    # a refusal is an answer in MQTT 5: the transport keeps it (it used to fall back to 3.1.1 for good)
    assert "trying MQTT 3.1.1" not in caplog.text
    assert caplog.text.count("refused the connection") == 1  # logged once, not at every retry
    assert PASSWORD not in caplog.text and "wrong" not in caplog.text.replace("wrong_", "")


def test_tls_client_certificate_required(mtls_broker: Broker, pki: Pki) -> None:
    assert connect(mtls_broker, make_ssl_context(pki.ca, pki.client_cert, pki.client_key))
    assert (
        handshake_error(mtls_broker, make_ssl_context(pki.ca, pki.client_cert, pki.client_key), read=True)
        is None
    )
    assert handshake_error(mtls_broker, make_ssl_context(pki.ca), read=True) in {
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "SSLV3_ALERT_HANDSHAKE_FAILURE",
    }
    assert not connect(mtls_broker, make_ssl_context(pki.ca), wait_s=2)


def test_tls_plain_client_cannot_use_the_tls_listener(
    tls_broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> bool:
        tx = MqttTransport(tls_broker.host, tls_broker.port, "plain", username=USER, password=PASSWORD)
        try:
            await tx.start(wait_s=4)
            return True
        except TransportError:
            return False
        finally:
            await tx.stop()

    with caplog.at_level(logging.INFO, logger="edgefl.transport"):
        assert not asyncio.run(main())
    # the log names the likely cause instead of "does not speak MQTT 5" and silence
    assert "does not speak MQTT 5" not in caplog.text
    assert "closed the connection before any CONNACK (MQTT 5 and 3.1.1)" in caplog.text, caplog.text
    assert "a TLS port needs mqtts://" in caplog.text


def test_tls_bad_files_are_config_errors(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        make_ssl_context(tmp_path / "missing.pem")
    assert info.value.problems[0].startswith(f"broker.ca_file = {tmp_path / 'missing.pem'}: ")
    with pytest.raises(ConfigError, match="key does not match"):
        make_ssl_context(pki.ca, pki.client_cert, pki.server_key)
    with pytest.raises(ConfigError, match="both or neither"):
        make_ssl_context(pki.ca, pki.client_cert, None)
    not_pem = tmp_path / "junk.pem"
    not_pem.write_text("junk")
    with pytest.raises(ConfigError, match=r"broker\.ca_file"):
        make_ssl_context(not_pem)


def test_tls_context_from_profile_broker_table(pki: Pki) -> None:
    assert ssl_context_for(BrokerConfig(url="mqtt://127.0.0.1:1883")) is None
    ctx = ssl_context_for(
        BrokerConfig(
            url="mqtts://127.0.0.1:8883",
            tls=True,
            ca_file=pki.ca,
            client_cert=pki.client_cert,
            client_key=pki.client_key,
        )
    )
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED


def test_tls_record_holding_several_packets_is_read_whole_without_more_bytes(pki: Pki) -> None:
    """A TLS record carrying a SUBACK and three PUBLISH packets: all three messages arrive at once.

    paho reads one packet at a time; the rest of the record waits already decrypted in the ``ssl``
    module (``SSLSocket.pending``), where the event loop's reader cannot see it, and no more bytes
    come (the server here waits). The transport reads on while bytes are pending; without that the
    messages would wait for the next keep-alive (30 s).
    """
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(pki.server_cert, pki.server_key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    done = threading.Event()
    payloads = [b"first", b"second" * 50, b"third"]

    def serve() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            assert read_mqtt_packet(tls)[0] >> 4 == 1  # CONNECT
            tls.sendall(b"\x20\x02\x00\x00")  # CONNACK, accepted (MQTT 3.1.1 §3.2)
            first, body = read_mqtt_packet(tls)
            assert first >> 4 == 8  # SUBSCRIBE
            publishes = b"".join(
                b"\x30" + remaining_length(2 + 9 + len(p)) + (9).to_bytes(2, "big") + b"burst/one" + p
                for p in payloads
            )
            tls.sendall(b"\x90\x03" + body[:2] + b"\x01" + publishes)  # one write: one TLS record
            done.wait(10)

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    async def main() -> list[bytes]:
        ctx = make_ssl_context(pki.ca)
        t = MqttTransport("127.0.0.1", port, "tls-burst", protocol="3.1.1", tls_context=ctx)
        await t.subscribe("burst/one", 1)  # sent with the CONNECT's acknowledgement
        try:
            await t.start(wait_s=5)
            return [(await asyncio.wait_for(t.queue.get(), 3)).payload for _ in payloads]
        finally:
            done.set()
            await t.stop(timeout_s=1)

    try:
        assert asyncio.run(main()) == payloads
    finally:
        done.set()
        server.join(5)
        listener.close()


def test_stop_during_a_slow_tls_handshake_closes_the_connection_it_was_making(pki: Pki) -> None:
    """``stop()`` while the connect thread waits for the server: the socket it opens is closed.

    The thread cannot be interrupted; before, its connection stayed open once it finished (CONNECT
    sent, nobody reading: a client holding our id until the broker's keep-alive ran out).
    """
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(pki.server_cert, pki.server_key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen: list[str] = []
    accepted, stopped = threading.Event(), threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        accepted.set()
        stopped.wait(10)  # the client's connect thread waits in the handshake until stop() returned
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            seen.append("connect" if read_mqtt_packet(tls)[0] >> 4 == 1 else "other")
            tls.settimeout(5)
            try:
                seen.append("closed" if tls.recv(1) == b"" else "data")
            except (ssl.SSLEOFError, ConnectionResetError):
                seen.append("closed")
            except TimeoutError:
                seen.append("still open")

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    async def main() -> None:
        t = MqttTransport("127.0.0.1", port, "slow-tls", tls_context=make_ssl_context(pki.ca))
        await t.start(wait_s=None)
        assert await asyncio.to_thread(accepted.wait, 10)
        await t.stop(timeout_s=1)
        stopped.set()
        await asyncio.to_thread(server.join, 15)

    try:
        asyncio.run(main())
        assert seen == ["connect", "closed"]
    finally:
        listener.close()

