"""Device profiles: a TOML file turned into frozen dataclasses, validated once at load.

One dataclass per TOML table (``[device]``, ``[model]``, ``[pipeline]``, ``[broker]``, ``[memory]``,
``[training]``, ``[source]``, ``[dashboard]``). Unknown tables and keys are refused; a missing table
takes its defaults; ``device.id`` and ``model.path`` are required. Every problem is collected and
reported at once in one :class:`~edgefl.errors.ConfigError`, each naming the dotted key, the value and
the reason (``memory.cap_mb = 0: must be > 0``).

Relative paths (``model.path``, ``device.state_dir``, ``source.path``, the TLS files) resolve against
the directory of the profile file. Secrets (``broker.password``, ``dashboard.token``) never appear in a
``repr``, an error message or :func:`profile_to_dict`.

This module reads files only: it never opens a socket and never imports LiteRT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import tomllib
import types
import typing
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from edgefl.errors import ConfigError
from edgefl.validators import (
    MAX_BATCH,
    MAX_THREADS,
    MQTT_MAX_PACKET_BYTES,
    check_device_id,
    check_finite_float,
    check_int_at_most,
    check_positive_int,
    check_qos,
    check_topic_prefix,
    is_loopback_host,
    parse_broker_url,
)

__all__ = [
    "BrokerConfig",
    "DashboardConfig",
    "DeviceConfig",
    "MemoryConfig",
    "ModelConfig",
    "PipelineConfig",
    "Profile",
    "SourceConfig",
    "TrainingConfig",
    "load_profile",
    "parse_profile",
    "profile_to_dict",
]

logger = logging.getLogger(__name__)

_SECRET = {"secret": True}
_MASK = "***"
MIN_TOKEN_CHARS = 16
"""Shortest accepted ``dashboard.token``: a guessable token on a LAN-reachable dashboard is no token."""


# --------------------------------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """``[device]``: who this agent is and where it keeps its state.

    Parameters
    ----------
    id : str
        Device id, ``^[A-Za-z0-9_.-]{1,64}$``; one MQTT topic level (``status/<id>``). Required.
    fleet : str
        Fleet name, same pattern; topics live under ``<topic_prefix>/<fleet>/``.
    state_dir : Path
        Directory for the embedding store, outbox and head versions (absolute after loading).
    """

    id: str
    fleet: str = "default"
    state_dir: Path = Path("state")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """``[model]``: the frozen TFLite backbone.

    Parameters
    ----------
    path : Path
        The ``.tflite`` file (absolute after loading). Required.
    embedding_tensor : str or None
        Name of the tensor read as the embedding; None means the input of the last FULLY_CONNECTED op.
    num_threads : int
        Interpreter threads, > 0.
    runtime : {"auto", "litert", "tflite"}
        Which interpreter package to use; ``auto`` tries ``ai-edge-litert`` then ``tflite-runtime``.
    sha256 : str or None
        Expected SHA-256 of the file (64 lowercase hex digits); checked at load when files are checked.
    """

    path: Path
    embedding_tensor: str | None = None
    num_threads: int = 1
    runtime: Literal["auto", "litert", "tflite"] = "auto"
    sha256: str | None = None


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """``[pipeline]``: raw samples to model input.

    The model input is ``(raw - mean) / std`` per channel, then quantised with the input tensor's
    scale and zero point (folded into one affine map when ``mode`` is ``fused``).

    Parameters
    ----------
    mode : {"fused", "unfused", "auto"}
        ``auto`` lets ``edgefl profile`` pick the faster path per model.
    batch : int
        Samples per interpreter invocation, > 0.
    raw_dtype : {"uint8", "int16", "float32"}
        dtype of the raw samples handed to the pipeline.
    mean, std : tuple[float, ...]
        Per-channel normalisation, same length, finite, ``std > 0``; length 1 broadcasts.
    """

    mode: Literal["fused", "unfused", "auto"] = "fused"
    batch: int = 8
    raw_dtype: Literal["uint8", "int16", "float32"] = "uint8"
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """``[broker]``: the MQTT connection.

    Parameters
    ----------
    url : str
        ``mqtt://host[:port]`` (default port 1883) or ``mqtts://host[:port]`` (default 8883).
    topic_prefix : str
        First topic levels, e.g. ``edgefl``; no wildcards, no leading ``$``.
    qos : int
        QoS of device publishes, 0, 1 or 2.
    keepalive_s : int
        MQTT keep alive in seconds, 1..65535 (0, "disabled", would stop the broker from ever
        publishing our last will).
    max_packet_bytes : int
        Largest packet we send, 1..268435455 bytes. The limit in force is the smaller of this and the
        broker's CONNACK Maximum Packet Size (MQTT 5 only: a 3.1.1 broker never says its limit, and
        drops a client over an oversize packet); larger messages go out in chunks. Default 65,536:
        under the common hardened broker limits (mosquitto ``max_packet_size`` 65536, AWS IoT 128 KB).
    max_incoming_packet_bytes : int
        Largest packet we accept, 1..268435455 bytes: announced in CONNECT (MQTT 5 Maximum Packet Size)
        and enforced on every protocol before the packet is buffered (a larger PUBLISH is dropped and
        counted). Default 1 MiB: above the coordinator's 256 KiB head chunks, far under the RAM cap.
    protocol : {"auto", "5", "3.1.1"}
        MQTT version; ``auto`` tries 5 and falls back to 3.1.1.
    username, password : str or None
        Credentials; ``password`` requires ``username`` and is hidden from ``repr``.
    tls : bool
        True exactly when the URL scheme is ``mqtts`` (derived from it when the key is absent).
    ca_file, client_cert, client_key : Path or None
        PEM files for TLS (absolute after loading); cert and key come together; all require TLS.
    """

    url: str = "mqtt://127.0.0.1:1883"
    topic_prefix: str = "edgefl"
    qos: int = 1
    keepalive_s: int = 30
    max_packet_bytes: int = 65_536
    max_incoming_packet_bytes: int = 1_048_576
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    username: str | None = None
    password: str | None = field(default=None, repr=False, metadata=_SECRET)
    tls: bool = False
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None

    @property
    def scheme(self) -> str:
        """``"mqtt"`` or ``"mqtts"``."""
        return parse_broker_url(self.url)[0]

    @property
    def host(self) -> str:
        """Broker host name or IP address (IPv6 without brackets)."""
        return parse_broker_url(self.url)[1]

    @property
    def port(self) -> int:
        """Broker TCP port."""
        return parse_broker_url(self.url)[2]


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """``[memory]``: the RAM slice the agent may use.

    Parameters
    ----------
    cap_mb : int
        The cap in MiB (the governor also honours a lower cgroup ``memory.max``), > ``reserve_mb``.
    reserve_mb : int
        Headroom in MiB kept free under the cap for allocations the governor does not estimate, > 0.
    min_system_available_mb : int
        Defer training while the system's MemAvailable is below this (MiB), >= 0; 0 disables.
    """

    cap_mb: int = 96
    reserve_mb: int = 8
    min_system_available_mb: int = 32


@dataclass(frozen=True, slots=True)
class TrainingConfig:
    """``[training]``: the embedding store and local training of the head.

    Parameters
    ----------
    store_capacity : int
        Embeddings kept in the ring store, > 0.
    chunk_size : int
        Embeddings per training chunk at full budget, > 0.
    chunk_floor : int
        Smallest chunk the governor may shrink to before deferring training, 0 < floor <= chunk_size.
    clip_norm : float or None
        L2 clipping norm of the update delta, > 0; None disables clipping.
    seed : int
        Seed of the local shuffling RNG, >= 0.
    """

    store_capacity: int = 4096
    chunk_size: int = 256
    chunk_floor: int = 16
    clip_norm: float | None = None
    seed: int = 0


@dataclass(frozen=True, slots=True)
class SourceConfig:
    """``[source]``: where local samples come from (besides MQTT/HTTP ingest).

    Parameters
    ----------
    kind : {"none", "replay"}
        ``replay`` reads an ``.npz`` holding ``x`` (raw samples) and ``y`` (labels).
    path : Path or None
        The ``.npz`` file (absolute after loading); required when ``kind = "replay"``.
    rate_hz : float
        Samples per second, >= 0; 0 means as fast as possible.
    loop : bool
        Start again at the first sample after the last.
    """

    kind: Literal["none", "replay"] = "none"
    path: Path | None = None
    rate_hz: float = 0.0
    loop: bool = False


@dataclass(frozen=True, slots=True)
class DashboardConfig:
    """``[dashboard]``: the agent's HTTP page, JSON, SSE and ``/metrics``.

    Parameters
    ----------
    enabled : bool
        Serve the dashboard.
    host : str
        Listen address. Anything but loopback (``127.0.0.0/8``, ``::1``, ``localhost``) requires
        ``token``.
    port : int
        TCP port, 0..65535; 0 picks a free port.
    token : str or None
        Bearer token, at least 16 characters, no whitespace; hidden from ``repr``.
    header_timeout_s, body_timeout_s : float
        Seconds a request's header block, then its body, may take to arrive (0.1..300); a slower or
        half-open connection is closed.
    max_connections : int
        Open connections at once (1..10000); more are closed at accept. Keep it under the process's
        file-descriptor limit (``ulimit -n``, often 1024) minus what the agent itself uses.
    max_connections_per_client : int
        Open connections at once from one client IP address, 1..max_connections.
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = field(default=None, repr=False, metadata=_SECRET)
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    max_connections: int = 128
    max_connections_per_client: int = 16


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """``[security]``: message signatures (Ed25519) and the persistent outbox.

    Parameters
    ----------
    signing_key_file : Path or None
        This device's Ed25519 private key (64 hex digits or PEM); its updates are signed with it.
        The key is read once at start-up and never logged.
    coordinator_public_key : str or None
        The coordinator's Ed25519 public key, 64 hex digits; GlobalModel and RoundAnnouncement
        messages must carry a valid signature by it when set.
    require_signatures : bool
        Refuse unsigned messages (needs ``coordinator_public_key``).
    outbox_max_bytes : int
        Bound of the persistent outbox of unacknowledged updates, in bytes (> 0).
    """

    signing_key_file: Path | None = None
    coordinator_public_key: str | None = field(default=None, repr=False)
    require_signatures: bool = False
    outbox_max_bytes: int = 1024 * 1024


@dataclass(frozen=True, slots=True)
class StatusConfig:
    """``[status]``: the retained status message.

    Parameters
    ----------
    interval_s : float
        Longest time between two status publishes, seconds, 0.05..3600 (a change publishes at once).
    """

    interval_s: float = 2.0


@dataclass(frozen=True, slots=True)
class Profile:
    """A whole device profile.

    Parameters
    ----------
    path : Path
        The profile file (absolute), or ``Path("<inline>")`` when parsed from a mapping without one.
    device, model, pipeline, broker, memory, training, source, dashboard, security, status
        One value object per TOML table.
    """

    path: Path
    device: DeviceConfig
    model: ModelConfig
    pipeline: PipelineConfig
    broker: BrokerConfig
    memory: MemoryConfig
    training: TrainingConfig
    source: SourceConfig
    dashboard: DashboardConfig
    security: SecurityConfig = field(default_factory=SecurityConfig)
    status: StatusConfig = field(default_factory=StatusConfig)

    @property
    def cap_bytes(self) -> int:
        """The profile's memory cap in bytes (``memory.cap_mb * 1024 * 1024``)."""
        return self.memory.cap_mb * 1024 * 1024


_TABLES: dict[str, type[Any]] = {
    "device": DeviceConfig,
    "model": ModelConfig,
    "pipeline": PipelineConfig,
    "broker": BrokerConfig,
    "memory": MemoryConfig,
    "training": TrainingConfig,
    "source": SourceConfig,
    "dashboard": DashboardConfig,
    "security": SecurityConfig,
    "status": StatusConfig,
}


# --------------------------------------------------------------------------------------------------
# Field kinds, read once from the dataclass annotations so the classes stay the single source of truth
# --------------------------------------------------------------------------------------------------

_Kind = Literal["str", "int", "float", "bool", "path", "floats", "choice"]


@dataclass(frozen=True, slots=True)
class _FieldSpec:
    name: str
    kind: _Kind
    optional: bool
    required: bool
    choices: tuple[str, ...]
    secret: bool
    default: object


def _field_specs(cls: type[Any]) -> dict[str, _FieldSpec]:
    hints = typing.get_type_hints(cls)
    specs: dict[str, _FieldSpec] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        optional = False
        args = typing.get_args(hint)
        if isinstance(hint, types.UnionType) and type(None) in args:
            optional = True
            (hint,) = [a for a in args if a is not type(None)]
        choices: tuple[str, ...] = ()
        kind: _Kind
        if typing.get_origin(hint) is Literal:
            kind, choices = "choice", tuple(str(a) for a in typing.get_args(hint))
        elif hint == tuple[float, ...]:
            kind = "floats"
        elif hint is Path:
            kind = "path"
        elif hint is bool:
            kind = "bool"
        elif hint is int:
            kind = "int"
        elif hint is float:
            kind = "float"
        elif hint is str:
            kind = "str"
        else:  # pragma: no cover - guards future fields with an unsupported type
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported field type {hint!r}")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs[f.name] = _FieldSpec(
            name=f.name,
            kind=kind,
            optional=optional,
            required=required,
            choices=choices,
            secret=bool(f.metadata.get("secret", False)),
            default=None if required else f.default,
        )
    return specs


_SPECS: dict[str, dict[str, _FieldSpec]] = {name: _field_specs(cls) for name, cls in _TABLES.items()}


def _show(value: object, *, secret: bool = False) -> str:
    """Render a value for an error message, TOML-like (``true``, ``'text'``, ``[0.0, 1.0]``)."""
    if secret:
        return repr(_MASK)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        return repr(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{...}"
    return repr(value)


def _convert(spec: _FieldSpec, value: object, base_dir: Path, *, from_text: bool) -> object:
    """Type-check one value (coercing strings when it came from a ``--set key=value`` override).

    Raises
    ------
    ValueError
        With the reason only; the caller adds the dotted key and value.
    """
    if value is None or (from_text and spec.optional and value == ""):
        if spec.optional:
            return None
        raise ValueError("must be set")
    kind = spec.kind
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError("must be a string")
        return value
    if kind == "choice":
        if not isinstance(value, str) or value not in spec.choices:
            raise ValueError("must be one of " + ", ".join(repr(c) for c in spec.choices))
        return value
    if kind == "path":
        if not isinstance(value, (str, Path)):
            raise ValueError("must be a path string")
        if str(value) == "":
            raise ValueError("must not be empty")
        path = Path(value)
        # No resolve(): it would follow symlinks, and a systemd StateDirectory= with DynamicUser=
        # is a symlink into /var/lib/private that must be used by its public name.
        return path if path.is_absolute() else base_dir.absolute() / path
    if kind == "bool":
        if from_text and isinstance(value, str):
            text = value.strip().lower()
            if text in {"true", "false"}:
                return text == "true"
        if not isinstance(value, bool):
            raise ValueError("must be true or false")
        return value
    if kind == "int":
        if from_text and isinstance(value, str):
            try:
                return int(value.strip(), 10)
            except ValueError as exc:
                raise ValueError("must be an integer") from exc
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("must be an integer")
        return value
    if kind == "float":
        if from_text and isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError as exc:
                raise ValueError("must be a number") from exc
        return check_finite_float(value)
    # floats: a TOML array of numbers, a single number, or "a,b,c" from the command line
    items: object = value
    if from_text and isinstance(value, str):
        try:
            items = [float(part) for part in value.split(",")] if value.strip() else []
        except ValueError as exc:
            raise ValueError("must be a comma-separated list of numbers") from exc
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        items = [value]
    if not isinstance(items, (list, tuple)):
        raise ValueError("must be an array of numbers")
    if not items:
        raise ValueError("must not be empty")
    try:
        return tuple(check_finite_float(v) for v in items)
    except ValueError as exc:
        raise ValueError(f"must be an array of finite numbers ({exc})") from exc


# --------------------------------------------------------------------------------------------------
# Semantic checks, one per table, run on typed values
# --------------------------------------------------------------------------------------------------


class _Problems:
    """Collects problems; drops follow-on problems about keys that already failed their type check."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.bad: set[str] = set()

    def add(self, key: str, value: object, reason: str, *, involves: tuple[str, ...] = ()) -> None:
        if key in self.bad or any(k in self.bad for k in involves):
            return
        table, _, name = key.partition(".")
        spec = _SPECS.get(table, {}).get(name)
        shown = _show(value, secret=spec is not None and spec.secret and value is not None)
        self.items.append(f"{key} = {shown}: {reason}")
        self.bad.add(key)

    def note(self, message: str) -> None:
        self.items.append(message)


def _check(problems: _Problems, key: str, value: object, validator: Callable[[object], object]) -> None:
    try:
        validator(value)
    except ValueError as exc:
        problems.add(key, value, str(exc))


def _file_problem(path: Path, raw: object) -> str | None:
    """Return why ``path`` cannot be used as an input file, or None if it can."""
    if path.is_file():
        return None
    where = "" if Path(str(raw)).is_absolute() else f" (resolved to {str(path)!r})"
    return ("not a file" if path.exists() else "file not found") + where


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_device(p: _Problems, c: DeviceConfig, raw: Mapping[str, object], check_files: bool) -> None:
    _check(p, "device.id", c.id, check_device_id)
    _check(p, "device.fleet", c.fleet, check_device_id)


def _check_model(p: _Problems, c: ModelConfig, raw: Mapping[str, object], check_files: bool) -> None:
    if c.embedding_tensor is not None and not c.embedding_tensor:
        p.add("model.embedding_tensor", c.embedding_tensor, "must not be empty")
    _check(p, "model.num_threads", c.num_threads, lambda v: check_int_at_most("num_threads", v, MAX_THREADS))
    sha = c.sha256
    if sha is not None and (len(sha) != 64 or any(ch not in "0123456789abcdefABCDEF" for ch in sha)):
        p.add("model.sha256", sha, "must be 64 hexadecimal digits")
    if check_files:
        problem = _file_problem(c.path, raw.get("path"))
        if problem is not None:
            p.add("model.path", raw.get("path"), problem)
        elif sha is not None and "model.sha256" not in p.bad:
            actual = _sha256_file(c.path)
            if actual != sha.lower():
                p.add(
                    "model.sha256",
                    sha,
                    f"does not match the file (its sha256 is {actual})",
                    involves=("model.path",),
                )


def _check_pipeline(p: _Problems, c: PipelineConfig, raw: Mapping[str, object], check_files: bool) -> None:
    _check(p, "pipeline.batch", c.batch, lambda v: check_int_at_most("batch", v, MAX_BATCH))
    if any(s <= 0.0 for s in c.std):
        p.add("pipeline.std", c.std, "every value must be > 0")
    if len(c.mean) != len(c.std):
        p.add(
            "pipeline.mean",
            c.mean,
            f"must have as many values as pipeline.std ({len(c.std)})",
            involves=("pipeline.std",),
        )


def _check_broker(p: _Problems, c: BrokerConfig, raw: Mapping[str, object], check_files: bool) -> None:
    scheme: str | None = None
    try:
        scheme = parse_broker_url(c.url)[0]
    except ValueError as exc:
        p.add("broker.url", c.url, str(exc))
    _check(p, "broker.topic_prefix", c.topic_prefix, check_topic_prefix)
    _check(p, "broker.qos", c.qos, check_qos)
    if not 1 <= c.keepalive_s <= 65_535:
        p.add("broker.keepalive_s", c.keepalive_s, "must be between 1 and 65535")
    if not 1 <= c.max_packet_bytes <= MQTT_MAX_PACKET_BYTES:
        p.add("broker.max_packet_bytes", c.max_packet_bytes, f"must be between 1 and {MQTT_MAX_PACKET_BYTES}")
    if not 1 <= c.max_incoming_packet_bytes <= MQTT_MAX_PACKET_BYTES:
        p.add(
            "broker.max_incoming_packet_bytes",
            c.max_incoming_packet_bytes,
            f"must be between 1 and {MQTT_MAX_PACKET_BYTES}",
        )
    if c.username is not None and not c.username:
        p.add("broker.username", c.username, "must not be empty")
    if c.password is not None and c.username is None:
        p.add("broker.password", c.password, "requires broker.username")
    if scheme is not None and "tls" in raw and c.tls != (scheme == "mqtts"):
        p.add("broker.tls", c.tls, f"contradicts the {scheme}:// url (TLS is used exactly for mqtts://)")
    tls = scheme == "mqtts"
    for name in ("ca_file", "client_cert", "client_key"):
        path: Path | None = getattr(c, name)
        if path is None:
            continue
        if scheme is not None and not tls:
            p.add(f"broker.{name}", raw.get(name), "requires an mqtts:// url", involves=("broker.url",))
        elif check_files:
            problem = _file_problem(path, raw.get(name))
            if problem is not None:
                p.add(f"broker.{name}", raw.get(name), problem)
    if (c.client_cert is None) != (c.client_key is None):
        given, missing = (
            ("client_cert", "client_key") if c.client_key is None else ("client_key", "client_cert")
        )
        p.add(f"broker.{given}", raw.get(given), f"requires broker.{missing}")


def _check_memory(p: _Problems, c: MemoryConfig, raw: Mapping[str, object], check_files: bool) -> None:
    _check(p, "memory.cap_mb", c.cap_mb, lambda v: check_positive_int("cap_mb", v))
    _check(p, "memory.reserve_mb", c.reserve_mb, lambda v: check_positive_int("reserve_mb", v))
    if c.reserve_mb >= c.cap_mb:
        p.add(
            "memory.reserve_mb",
            c.reserve_mb,
            f"must be < memory.cap_mb ({c.cap_mb})",
            involves=("memory.cap_mb",),
        )
    if c.min_system_available_mb < 0:
        p.add("memory.min_system_available_mb", c.min_system_available_mb, "must be >= 0")


def _check_training(p: _Problems, c: TrainingConfig, raw: Mapping[str, object], check_files: bool) -> None:
    for name in ("store_capacity", "chunk_size", "chunk_floor"):
        value = getattr(c, name)
        try:
            check_positive_int(name, value)
        except ValueError as exc:
            p.add(f"training.{name}", value, str(exc))
    if c.chunk_floor > c.chunk_size:
        p.add(
            "training.chunk_floor",
            c.chunk_floor,
            f"must be <= training.chunk_size ({c.chunk_size})",
            involves=("training.chunk_size",),
        )
    if c.clip_norm is not None and c.clip_norm <= 0.0:
        p.add("training.clip_norm", c.clip_norm, "must be > 0")
    if c.seed < 0:
        p.add("training.seed", c.seed, "must be >= 0")


def _npz_problem(path: Path) -> str | None:
    """Return why ``path`` is not an ``.npz`` holding arrays ``x`` and ``y``, or None."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
    except (zipfile.BadZipFile, OSError) as exc:
        return f"not an .npz archive ({exc})"
    missing = [name for name in ("x", "y") if f"{name}.npy" not in names]
    if missing:
        return "the .npz has no array " + " or ".join(repr(m) for m in missing)
    return None


def _check_source(p: _Problems, c: SourceConfig, raw: Mapping[str, object], check_files: bool) -> None:
    if c.rate_hz < 0.0:
        p.add("source.rate_hz", c.rate_hz, "must be >= 0")
    if c.kind != "replay":
        return
    if c.path is None:
        if "source.path" not in p.bad:
            p.note("source.path: required when source.kind = 'replay'")
        return
    if check_files:
        problem = _file_problem(c.path, raw.get("path")) or _npz_problem(c.path)
        if problem is not None:
            p.add("source.path", raw.get("path"), problem)


def _check_dashboard(p: _Problems, c: DashboardConfig, raw: Mapping[str, object], check_files: bool) -> None:
    if not c.host:
        p.add("dashboard.host", c.host, "must not be empty (use 0.0.0.0 to listen on all interfaces)")
    if not 0 <= c.port <= 65_535:
        p.add("dashboard.port", c.port, "must be between 0 and 65535")
    if c.token is not None and (len(c.token) < MIN_TOKEN_CHARS or any(ch.isspace() for ch in c.token)):
        p.add("dashboard.token", c.token, f"must be at least {MIN_TOKEN_CHARS} characters without whitespace")
    # Checked even when the dashboard is disabled: the rule is simpler to state and to audit.
    if c.host and not is_loopback_host(c.host) and c.token is None:
        p.add(
            "dashboard.host",
            c.host,
            "a non-loopback host requires dashboard.token",
            involves=("dashboard.token",),
        )
    for name in ("header_timeout_s", "body_timeout_s"):
        if not 0.1 <= getattr(c, name) <= 300:
            p.add(f"dashboard.{name}", getattr(c, name), "must be between 0.1 and 300 seconds")
    if not 1 <= c.max_connections <= 10_000:
        p.add("dashboard.max_connections", c.max_connections, "must be between 1 and 10000")
    if not 1 <= c.max_connections_per_client <= c.max_connections:
        p.add(
            "dashboard.max_connections_per_client",
            c.max_connections_per_client,
            "must be between 1 and dashboard.max_connections",
            involves=("dashboard.max_connections",),
        )


def _check_security(p: _Problems, c: SecurityConfig, raw: Mapping[str, object], check_files: bool) -> None:
    key = c.coordinator_public_key
    if key is not None and (len(key) != 64 or any(ch not in "0123456789abcdefABCDEF" for ch in key)):
        p.add("security.coordinator_public_key", key, "must be 64 hexadecimal digits (an Ed25519 public key)")
    if c.require_signatures and key is None:
        p.add(
            "security.require_signatures",
            True,
            "needs security.coordinator_public_key",
            involves=("security.coordinator_public_key",),
        )
    if c.outbox_max_bytes <= 0:
        p.add("security.outbox_max_bytes", c.outbox_max_bytes, "must be > 0")
    if check_files and c.signing_key_file is not None:
        problem = _file_problem(c.signing_key_file, raw.get("signing_key_file"))
        if problem is not None:
            p.add("security.signing_key_file", raw.get("signing_key_file"), problem)


def _check_status(p: _Problems, c: StatusConfig, raw: Mapping[str, object], check_files: bool) -> None:
    if not 0.05 <= c.interval_s <= 3600:
        p.add("status.interval_s", c.interval_s, "must be between 0.05 and 3600 seconds")


_CHECKS: dict[str, Callable[[_Problems, Any, Mapping[str, object], bool], None]] = {
    "device": _check_device,
    "model": _check_model,
    "pipeline": _check_pipeline,
    "broker": _check_broker,
    "memory": _check_memory,
    "training": _check_training,
    "source": _check_source,
    "dashboard": _check_dashboard,
    "security": _check_security,
    "status": _check_status,
}

# Placeholders for required fields that are missing or mistyped, so the rest of the table is still
# checked; problems about these keys are suppressed by _Problems.bad.
_PLACEHOLDERS: dict[str, object] = {"device.id": "_", "model.path": Path("_")}


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def _parse(
    data: Mapping[str, object],
    base_dir: Path,
    path: Path | None,
    check_files: bool,
    overrides: Mapping[str, object],
) -> Profile:
    problems = _Problems()
    tables: dict[str, dict[str, object]] = {}
    for name, value in data.items():
        if name not in _TABLES:
            problems.note(
                f"[{name}]: unknown table" if isinstance(value, Mapping) else f"{name}: unknown key"
            )
            continue
        if not isinstance(value, Mapping):
            problems.note(f"{name} = {_show(value)}: must be a table")
            continue
        tables[name] = dict(value)

    # Overrides land on top of the TOML, and are remembered so string values get coerced.
    from_text: set[str] = set()
    overridden: set[str] = set()
    for key, value in overrides.items():
        table, dot, name = key.partition(".")
        if not dot or not name:
            problems.note(f"{key}: override key must be 'table.key'")
        elif table not in _TABLES:
            problems.note(f"{key}: unknown table [{table}]")
        elif name not in _SPECS[table]:
            problems.note(f"{key}: unknown key")
        else:
            tables.setdefault(table, {})[name] = value
            overridden.add(key)
            if isinstance(value, str):
                from_text.add(key)

    built: dict[str, Any] = {}
    for table, cls in _TABLES.items():
        raw = tables.get(table, {})
        specs = _SPECS[table]
        for name in raw:
            if name not in specs:
                problems.note(f"{table}.{name}: unknown key")
        values: dict[str, Any] = {}
        for name, spec in specs.items():
            key = f"{table}.{name}"
            if name not in raw:
                if spec.required:
                    problems.note(f"{key}: required")
                    problems.bad.add(key)
                    values[name] = _PLACEHOLDERS[key]
                elif spec.kind == "path" and spec.default is not None:
                    # A default path (device.state_dir) is relative to the profile like a written one.
                    values[name] = _convert(spec, spec.default, base_dir, from_text=False)
                continue
            # A relative path typed on the command line means the working directory, not the profile's.
            root = Path.cwd() if key in overridden else base_dir
            try:
                values[name] = _convert(spec, raw[name], root, from_text=key in from_text)
            except ValueError as exc:
                problems.add(key, raw[name], str(exc))
                if spec.required:
                    values[name] = _PLACEHOLDERS[key]
        if table == "broker" and "tls" not in raw and isinstance(values.get("url"), str):
            # tls follows the scheme unless stated (and a stated tls must agree, see _check_broker).
            with contextlib.suppress(ValueError):  # a bad url is reported by _check_broker
                values["tls"] = parse_broker_url(values["url"])[0] == "mqtts"
        if table == "model" and isinstance(values.get("sha256"), str):
            values["sha256"] = values["sha256"].lower()
        config = cls(**values)
        _CHECKS[table](problems, config, raw, check_files)
        built[table] = config

    if problems.items:
        raise ConfigError(problems.items)
    return Profile(path=path if path is not None else Path("<inline>"), **built)


def parse_profile(
    data: Mapping[str, object],
    base_dir: Path,
    *,
    path: Path | None = None,
    check_files: bool = True,
) -> Profile:
    """Build and validate a profile from an already-parsed TOML mapping.

    Parameters
    ----------
    data : Mapping[str, object]
        ``{table: {key: value}}`` as ``tomllib`` returns it.
    base_dir : Path
        Directory that relative paths resolve against (normally the profile file's directory).
    path : Path or None
        The profile file, recorded in :attr:`Profile.path`; ``Path("<inline>")`` when None.
    check_files : bool
        Check that ``model.path``, the TLS files and a replay ``source.path`` exist (and that
        ``model.sha256`` matches); False for profiles written for another machine.

    Returns
    -------
    Profile
        The validated profile, paths absolute.

    Raises
    ------
    ConfigError
        With every problem found, e.g. ``["memory.cap_mb = 0: must be > 0", "[bogus]: unknown table"]``.
    """
    return _parse(data, base_dir, path, check_files, {})


def load_profile(
    path: Path | str,
    overrides: Mapping[str, object] | None = None,
    *,
    check_files: bool = True,
) -> Profile:
    """Read a TOML profile, apply overrides, and validate it.

    Parameters
    ----------
    path : Path or str
        The ``.toml`` profile; relative paths inside it resolve against its directory.
    overrides : Mapping[str, object] or None
        Dotted keys set on top of the file before validation, e.g. ``{"device.id": "dev-2"}``.
        String values (from ``--set key=value``) are coerced to the field's type: ``"96"`` to int,
        ``"true"``/``"false"`` to bool, ``"0.5,0.5"`` to a tuple of floats, ``""`` to None for
        optional fields. Non-string values are type-checked as if they came from the TOML file.
        A relative path given here resolves against the current working directory (it was typed on
        a command line), unlike relative paths written in the profile.
    check_files : bool
        See :func:`parse_profile`.

    Returns
    -------
    Profile
        The validated profile.

    Raises
    ------
    ConfigError
        If the file cannot be read, is not TOML, or the profile is invalid (all problems at once).

    Source: TOML 1.0.0 (https://toml.io/en/v1.0.0), read with ``tomllib``.
    """
    file = Path(path).absolute()
    try:
        text = file.read_bytes().decode("utf-8")
    except FileNotFoundError as exc:
        raise ConfigError([f"{file}: file not found"]) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{file}: cannot read ({exc})"]) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{file}: invalid TOML ({exc})"]) from exc
    profile = _parse(data, file.parent, file, check_files, overrides or {})
    logger.debug("loaded profile %s for device %s", file, profile.device.id)
    return profile


def profile_to_dict(p: Profile) -> dict[str, object]:
    """Render a profile as ``{table: {key: value}}`` for display, secrets masked.

    Paths become strings, tuples become lists, unset optional values are None, and a set secret
    (``broker.password``, ``dashboard.token``) becomes ``"***"``. Without None values and with real
    secrets the result parses back to an equal profile with :func:`parse_profile`.

    Parameters
    ----------
    p : Profile
        The profile.

    Returns
    -------
    dict[str, object]
        JSON-serialisable; the keys are the table names in file order.
    """
    out: dict[str, object] = {}
    for table in _TABLES:
        config = getattr(p, table)
        rendered: dict[str, object] = {}
        for name, spec in _SPECS[table].items():
            value = getattr(config, name)
            if spec.secret and value is not None:
                value = _MASK
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            rendered[name] = value
        out[table] = rendered
    return out
