"""TLS settings for the MQTT connection: an :class:`ssl.SSLContext` that verifies the broker.

The broker's certificate must chain to ``ca_file`` (or the system's store) and name the host dialled;
TLS 1.2 is the floor.

Source: Python ``ssl`` module (``create_default_context``: CERT_REQUIRED, check_hostname);
RFC 6125 §6 (server identity), RFC 5280 §4.2.1.6 (subjectAltName, iPAddress).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from edgefl.errors import ConfigError

if TYPE_CHECKING:  # profiles checks its TLS files with make_ssl_context
    from edgefl.profiles import BrokerConfig


def make_ssl_context(
    ca_file: Path | None = None, client_cert: Path | None = None, client_key: Path | None = None
) -> ssl.SSLContext:
    """A client TLS context: ``CERT_REQUIRED``, ``check_hostname``, minimum TLS 1.2.

    ``ca_file``: the CA bundle the broker certificate must chain to (None: the system store);
    ``client_cert``/``client_key``: a PEM client certificate and its unencrypted key, both or neither.
    ConfigError if a file is missing, unreadable, not PEM, or the key does not match the certificate,
    naming ``broker.ca_file`` / ``broker.client_cert`` / ``broker.client_key``.
    """
    problems: list[str] = []
    cause: BaseException | None = None
    if (client_cert is None) != (client_key is None):
        problems.append("broker.client_cert/broker.client_key: give both or neither")
    try:  # with cafile exactly that bundle is trusted; without, the system store is loaded
        ctx = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=str(ca_file) if ca_file is not None else None
        )
    except (OSError, ssl.SSLError) as exc:
        problems.append(f"broker.ca_file = {ca_file}: not a readable PEM CA bundle ({_why(exc)})")
        cause = exc
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    if client_cert is not None and client_key is not None:
        try:
            ctx.load_cert_chain(certfile=str(client_cert), keyfile=str(client_key))
        except (OSError, ssl.SSLError) as exc:
            problems.append(
                f"broker.client_cert = {client_cert}, broker.client_key = {client_key}: "
                f"unreadable, not PEM, or the key does not match the certificate ({_why(exc)})"
            )
            cause = cause or exc
    if problems:
        raise ConfigError(problems) from cause
    return ctx


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__


def ssl_context_for(broker: BrokerConfig) -> ssl.SSLContext | None:
    """The TLS context a profile's ``[broker]`` asks for, or None for ``mqtt://`` (ConfigError as above)."""
    if not broker.tls:
        return None
    return make_ssl_context(broker.ca_file, broker.client_cert, broker.client_key)
