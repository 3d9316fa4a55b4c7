"""Small reusable validators shared by the profile loaders and the wire codec.

Each takes a raw value, returns it normalised when valid, and raises ``ValueError`` otherwise with a
message that never names the field: the caller prefixes the dotted key and the value
(``memory.cap_mb = 0: must be > 0``).
"""

from __future__ import annotations

import ipaddress
import math
import re
from urllib.parse import urlsplit

DEVICE_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""Device ids and fleet names: they become one MQTT topic level and part of file names."""

MQTT_MAX_PACKET_BYTES = 268_435_455
"""Largest packet MQTT can frame (Remaining Length is a 4-byte variable integer). Source: MQTT 5.0 §1.5.5."""

MQTT_MAX_SESSION_EXPIRY_S = 4_294_967_295
"""Largest Session Expiry Interval in seconds (it means: never expires). Source: MQTT 5.0 §3.1.2.11.2."""

_MQTT_MAX_TOPIC_BYTES = 65_535  # UTF-8 encoded string length prefix is 2 bytes. Source: MQTT 5.0 §1.5.4.
_DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}
#: Most interpreter threads a profile or ``edgefl profile`` accepts (gateways have 1-8 cores).
MAX_THREADS = 64
#: Largest batch (samples per invoke) a profile, a pipeline or ``edgefl profile`` accepts.
MAX_BATCH = 4096


def check_device_id(value: object) -> str:
    """Check a device id (or fleet name): ``^[A-Za-z0-9_.-]{1,64}$``, not ``.`` or ``..``; ValueError."""
    if not isinstance(value, str):
        raise ValueError("must be a string")
    if DEVICE_ID_PATTERN.fullmatch(value) is None:
        raise ValueError("must be 1-64 characters from A-Z a-z 0-9 _ . -")
    if value in {".", ".."}:
        raise ValueError("must not be '.' or '..'")
    return value


def check_topic_prefix(value: object) -> str:
    """Check an MQTT topic prefix (``edgefl``, ``acme/edgefl``; topics are ``<prefix>/<fleet>/...``).

    ValueError if it is not a non-empty string, holds a wildcard or NUL, starts with ``$`` (broker
    topics), starts or ends with ``/``, has an empty level, or is longer than an MQTT topic can be.

    Source: MQTT 5.0 §4.7 (topic names, wildcards, ``$`` topics) and §1.5.4 (UTF-8 string length).
    """
    if not isinstance(value, str):
        raise ValueError("must be a string")
    if not value:
        raise ValueError("must not be empty")
    if "+" in value or "#" in value:
        raise ValueError("must not contain the MQTT wildcards '+' or '#'")
    if "\x00" in value:
        raise ValueError("must not contain NUL")
    if value.startswith("$"):
        raise ValueError("must not start with '$' (reserved for broker topics)")
    if value.startswith("/") or value.endswith("/"):
        raise ValueError("must not start or end with '/'")
    if "//" in value:
        raise ValueError("must not contain an empty topic level ('//')")
    if len(value.encode("utf-8")) > _MQTT_MAX_TOPIC_BYTES:
        raise ValueError(f"must be at most {_MQTT_MAX_TOPIC_BYTES} bytes in UTF-8")
    return value


def check_qos(value: object) -> int:
    """Check an MQTT QoS level (MQTT 5.0 §4.3): the integers 0, 1, 2 (``bool`` refused); ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2):
        raise ValueError("must be 0, 1 or 2")
    return value


def check_positive_int(name: str, value: object) -> int:
    """Check an integer > 0 (``bool`` refused): ValueError ``"must be an integer"`` or ``"must be > 0"``.

    ``name`` goes in a note of the ValueError (tracebacks), not in its message.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        exc = ValueError("must be an integer")
    elif value <= 0:
        exc = ValueError("must be > 0")
    else:
        return value
    exc.add_note(f"while checking {name}")
    raise exc


def check_int_at_most(name: str, value: object, high: int) -> int:
    """Check an integer in ``1..high`` (a thread count, a batch size), as :func:`check_positive_int`."""
    v = check_positive_int(name, value)
    if v > high:
        raise ValueError(f"must be <= {high}")
    return v


def check_finite_float(value: object) -> float:
    """A finite int or float as a float (not ``bool``); ValueError "must be a number" or "must be finite"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError("must be finite")
    return result


def parse_broker_url(url: object) -> tuple[str, str, int]:
    """Parse ``mqtt://host[:port]`` or ``mqtts://host[:port]`` into ``(scheme, host, port)``.

    The port defaults to 1883 / 8883; an IPv6 host is written in brackets and returned without them.
    ValueError for another scheme, no host, a port outside 1..65535, or credentials (they belong in
    ``broker.username`` / ``broker.password``, never in a log line), a path, a query or a fragment.

    Source: RFC 3986 §3 (URI syntax); IANA service names ``mqtt`` (1883) and ``secure-mqtt`` (8883).
    """
    if not isinstance(url, str):
        raise ValueError("must be a string")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise ValueError(f"is not a valid URL ({exc})") from exc
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError("must start with mqtt:// or mqtts://")
    if "@" in parts.netloc:
        raise ValueError("must not contain credentials; use broker.username and broker.password")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("must be mqtt://host:port or mqtts://host:port (no path, query or fragment)")
    host = parts.hostname
    if not host:
        raise ValueError("must name a host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError("port must be an integer between 1 and 65535") from exc
    if port is None:
        if parts.netloc.endswith(":"):
            raise ValueError("port must be an integer between 1 and 65535")
        port = _DEFAULT_PORTS[scheme]
    if not 1 <= port <= 65_535:
        raise ValueError("port must be an integer between 1 and 65535")
    return scheme, host, port


def is_loopback_host(host: str) -> bool:
    """Whether a listen address is loopback-only (``localhost``, 127.0.0.0/8, ``::1``), with no lookup."""
    if host.lower() in {"localhost", "localhost."}:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
