"""Small reusable validators shared by the profile loader (``config.py``) and the wire codec.

Each validator takes a raw value, returns it normalised (and typed) when it is valid, and raises
``ValueError`` otherwise. The message never names the field: the caller prefixes it with the dotted key
and the value, so a profile problem reads ``memory.cap_mb = 0: must be > 0`` and a codec problem reads
``num_examples = 0: must be > 0``.
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

_MQTT_MAX_TOPIC_BYTES = 65_535  # UTF-8 encoded string length prefix is 2 bytes. Source: MQTT 5.0 §1.5.4.
_DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}
#: Most interpreter threads a profile or ``edgefl profile`` accepts (gateways have 1-8 cores).
MAX_THREADS = 64
#: Largest batch (samples per invoke) a profile, a pipeline or ``edgefl profile`` accepts.
MAX_BATCH = 4096


def check_device_id(value: object) -> str:
    """Check a device id (or fleet name): ``^[A-Za-z0-9_.-]{1,64}$``, and not ``.`` or ``..``.

    The id is one MQTT topic level (``status/<device>``) so it must not contain ``/``, ``+``, ``#``
    or ``$``; ids made only of dots are refused because the id may also name a file or directory.

    Parameters
    ----------
    value : object
        The candidate id.

    Returns
    -------
    str
        The id, unchanged.

    Raises
    ------
    ValueError
        If ``value`` is not a string or does not match the pattern.
    """
    if not isinstance(value, str):
        raise ValueError("must be a string")
    if DEVICE_ID_PATTERN.fullmatch(value) is None:
        raise ValueError("must be 1-64 characters from A-Z a-z 0-9 _ . -")
    if value in {".", ".."}:
        raise ValueError("must not be '.' or '..'")
    return value


def check_topic_prefix(value: object) -> str:
    """Check an MQTT topic prefix such as ``edgefl`` or ``acme/edgefl``.

    Parameters
    ----------
    value : object
        The candidate prefix; topics are built as ``<prefix>/<fleet>/<suffix>``.

    Returns
    -------
    str
        The prefix, unchanged.

    Raises
    ------
    ValueError
        If it is not a non-empty string, contains a wildcard (``+``, ``#``) or NUL, starts with ``$``
        (reserved for broker topics), starts or ends with ``/``, has an empty level, or is longer than
        an MQTT topic can be.

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
    """Check an MQTT QoS level.

    Parameters
    ----------
    value : object
        The candidate QoS.

    Returns
    -------
    int
        0, 1 or 2.

    Raises
    ------
    ValueError
        If it is not one of the integers 0, 1, 2 (``bool`` is refused).

    Source: MQTT 5.0 §4.3.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2):
        raise ValueError("must be 0, 1 or 2")
    return value


def check_positive_int(name: str, value: object) -> int:
    """Check a strictly positive integer (a count, a size in bytes, a capacity).

    Parameters
    ----------
    name : str
        The field name at the call site. It is not repeated in the message (the caller prefixes the
        message with the dotted key); it is attached to the exception as a note for tracebacks.
    value : object
        The candidate value.

    Returns
    -------
    int
        The value.

    Raises
    ------
    ValueError
        ``"must be an integer"`` if it is not an ``int`` (``bool`` is refused), ``"must be > 0"``
        otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        exc = ValueError("must be an integer")
    elif value <= 0:
        exc = ValueError("must be > 0")
    else:
        return value
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"while checking {name}")
    raise exc


def check_int_at_most(name: str, value: object, high: int) -> int:
    """Check an integer in ``1..high`` (a thread count, a batch size).

    Parameters
    ----------
    name : str
        The field name at the call site (see :func:`check_positive_int`).
    value : object
        The candidate value.
    high : int
        The largest value allowed.

    Returns
    -------
    int
        The value.

    Raises
    ------
    ValueError
        As :func:`check_positive_int`, or ``"must be <= high"``.
    """
    v = check_positive_int(name, value)
    if v > high:
        raise ValueError(f"must be <= {high}")
    return v


def check_finite_float(value: object) -> float:
    """Check a finite real number (``int`` or ``float``; not ``bool``, NaN or infinity).

    Parameters
    ----------
    value : object
        The candidate value.

    Returns
    -------
    float
        The value as a Python ``float``.

    Raises
    ------
    ValueError
        ``"must be a number"`` or ``"must be finite"``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError("must be finite")
    return result


def parse_broker_url(url: object) -> tuple[str, str, int]:
    """Parse a broker URL ``mqtt://host[:port]`` or ``mqtts://host[:port]``.

    The port defaults to 1883 for ``mqtt`` and 8883 for ``mqtts`` (the IANA ports). IPv6 hosts are
    written in brackets (``mqtt://[::1]:1883``) and returned without them, as paho-mqtt expects.
    Credentials in the URL are refused so that they never reach a log line or a ``repr``; they belong
    in ``broker.username`` / ``broker.password``.

    Parameters
    ----------
    url : object
        The candidate URL.

    Returns
    -------
    tuple[str, str, int]
        ``(scheme, host, port)``, scheme is ``"mqtt"`` or ``"mqtts"``, port in 1..65535.

    Raises
    ------
    ValueError
        If the scheme is not ``mqtt``/``mqtts``, the host is missing, the port is not in 1..65535, or
        the URL carries credentials, a path, a query or a fragment.

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
    """Tell whether a listen address is loopback-only (``localhost``, 127.0.0.0/8, ``::1``).

    No name resolution is done: any other host name, and ``""`` / ``0.0.0.0`` / ``::`` (all
    interfaces), count as reachable from the network.

    Parameters
    ----------
    host : str
        A host name or IP literal (IPv6 with or without brackets).

    Returns
    -------
    bool
        True if only the local machine can connect.
    """
    if host.lower() in {"localhost", "localhost."}:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
