"""Profiles: TOML tables turned into frozen dataclasses, validated once at load (agent and coordinator).

Unknown tables and keys are refused, a missing table takes its defaults, and every problem (dotted
key, value, reason) is reported at once in one :class:`~edgefl.errors.ConfigError`. Relative paths
resolve against the profile's folder (``--set``: the working directory); secrets never appear in a
``repr``, an error or :meth:`Schema.to_dict`. Also the shared tables ``[broker]`` and ``[dashboard]``.
Source: TOML 1.0.0 (https://toml.io/en/v1.0.0), read with ``tomllib``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from edgefl.errors import ConfigError
from edgefl.tlsconf import make_ssl_context
from edgefl.validators import (
    MQTT_MAX_PACKET_BYTES,
    check_finite_float,
    check_qos,
    check_topic_prefix,
    is_loopback_host,
    parse_broker_url,
)

SECRET: Final = {"secret": True}
"""``field(metadata=SECRET)`` marks a value hidden from ``repr``, errors and :meth:`Schema.to_dict`."""
MASK: Final = "***"
MIN_TOKEN_CHARS: Final = 16
"""Shortest accepted ``dashboard.token``: a guessable token on a LAN-reachable dashboard is no token."""


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """``[broker]``: the MQTT connection (limits: ``docs/operations.md``, "Broker and dashboard limits").

    ``url`` is ``mqtt://host[:port]`` (1883) or ``mqtts://host[:port]`` (8883), ``tls`` True exactly
    for ``mqtts`` (derived when absent); ``topic_prefix`` the first topic levels (no wildcards, no
    leading ``$``); ``qos`` of device publishes 0..2; ``keepalive_s`` 1..65535 seconds;
    ``max_packet_bytes`` (sent) and ``max_incoming_packet_bytes`` (accepted) 1..268435455; ``protocol``
    ``auto`` tries 5, then 3.1.1; ``password`` (hidden from ``repr``) or ``password_file`` (its first
    line) require ``username``; ``ca_file``, ``client_cert``, ``client_key`` PEM files for TLS (cert and
    key together); ``alternates`` of ``url``'s scheme; ``auth_retries`` >= 1.
    """

    url: str = "mqtt://127.0.0.1:1883"
    topic_prefix: str = "edgefl"
    qos: int = 1
    keepalive_s: int = 30
    max_packet_bytes: int = 65_536
    max_incoming_packet_bytes: int = 1_048_576
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    username: str | None = None
    password: str | None = field(default=None, repr=False, metadata=SECRET)
    password_file: Path | None = None
    tls: bool = False
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    alternates: tuple[str, ...] = ()
    auth_retries: int = 3

    @property
    def alternate_addresses(self) -> list[tuple[str, int]]:
        """(host, port) of each of :attr:`alternates`, in order (raises ValueError on a bad URL)."""
        return [parse_broker_url(u)[1:] for u in self.alternates]

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
class DashboardConfig:
    """``[dashboard]``: the agent's HTTP page, JSON, SSE and ``/metrics``.

    ``host`` other than loopback requires ``token`` (at least 16 characters, no whitespace, hidden from
    ``repr``); ``port`` 0..65535 (0: a free one); ``header_timeout_s``/``body_timeout_s`` seconds a
    request's header block, then its body, may take (0.1..300); ``max_connections`` open at once
    (1..10000), ``max_connections_per_client`` from one address.
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = field(default=None, repr=False, metadata=SECRET)
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    max_connections: int = 128
    max_connections_per_client: int = 16


_Kind = Literal["str", "int", "float", "bool", "path", "floats", "strs", "choice"]
_KINDS: Final[dict[object, _Kind]] = {
    str: "str",
    int: "int",
    float: "float",
    bool: "bool",
    Path: "path",
    tuple[float, ...]: "floats",
    tuple[str, ...]: "strs",
}


@dataclass(frozen=True, slots=True)
class _FieldSpec:
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
        elif hint in _KINDS:
            kind = _KINDS[hint]
        else:  # pragma: no cover - guards future fields with an unsupported type
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported field type {hint!r}")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs[f.name] = _FieldSpec(
            kind=kind,
            optional=optional,
            required=required,
            choices=choices,
            secret=bool(f.metadata.get("secret", False)),
            default=None if required else f.default,
        )
    return specs


def show(value: object, *, secret: bool = False) -> str:
    """Render a value for an error message, TOML-like (``true``, ``'text'``, ``[0.0, 1.0]``)."""
    if secret:
        return repr(MASK)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        return repr(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{...}"
    return repr(value)


def convert(spec: _FieldSpec, value: object, base_dir: Path, *, from_text: bool) -> object:
    """Type-check one value (coercing strings from a ``--set`` override); ValueError with the reason only."""
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
        # no resolve(): a systemd StateDirectory= with DynamicUser= is a symlink used by its public name
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
    if kind == "strs":
        return _strings(value, from_text=from_text)
    # floats: a TOML array of numbers, a single number, or "a,b,c" / "[a, b, c]" from the command line
    items: object = value
    if from_text and isinstance(value, str):
        text = _unbracket(value)
        try:
            items = [float(part) for part in text.split(",")] if text else []
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


def _unbracket(text: str) -> str:
    """A ``--set`` list without the brackets of the TOML array syntax it may be written in."""
    text = text.strip()
    return text[1:-1].strip() if text.startswith("[") and text.endswith("]") else text


def _strings(value: object, *, from_text: bool) -> tuple[str, ...]:
    """A TOML array of strings, or ``a,b`` / ``["a", "b"]`` from the command line (may be empty)."""
    if from_text and isinstance(value, str):
        text = _unbracket(value)
        return tuple(part.strip().strip("\"'") for part in text.split(",") if part.strip())
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError("must be an array of strings")
    return tuple(value)


class Problems:
    """Collects problems; drops follow-on problems about keys that already failed their type check."""

    def __init__(self, specs: Mapping[str, Mapping[str, _FieldSpec]]) -> None:
        self.specs = specs
        self.items: list[str] = []
        self.bad: set[str] = set()

    def add(self, key: str, value: object, reason: str, *, involves: tuple[str, ...] = ()) -> None:
        """Record ``key = value: reason`` unless ``key`` or a key it ``involves`` already failed."""
        if key in self.bad or any(k in self.bad for k in involves):
            return
        table, _, name = key.partition(".")
        spec = self.specs.get(table, {}).get(name)
        shown = show(value, secret=spec is not None and spec.secret and value is not None)
        self.items.append(f"{key} = {shown}: {reason}")
        self.bad.add(key)

    def between(self, key: str, value: float, lo: float, hi: float, unit: str = "") -> None:
        """Record ``key = value: must be between lo and hi`` (then ``unit``) unless ``lo <= value <= hi``."""
        if not lo <= value <= hi:
            self.add(key, value, f"must be between {lo} and {hi}{unit}")

    def positive(self, key: str, value: float | None) -> None:
        """Record ``key = value: must be > 0`` unless ``value`` is None or > 0."""
        if value is not None and not value > 0:
            self.add(key, value, "must be > 0")

    def not_negative(self, key: str, value: float | None) -> None:
        """Record ``key = value: must be >= 0`` unless ``value`` is None or >= 0."""
        if value is not None and not value >= 0:
            self.add(key, value, "must be >= 0")

    def note(self, message: str) -> None:
        """Record a problem that names no single key (an unknown table)."""
        self.items.append(message)


def check(problems: Problems, key: str, value: object, validator: Callable[[object], object]) -> None:
    """Run a validator of :mod:`edgefl.validators`; its ``ValueError`` becomes a problem of ``key``."""
    try:
        validator(value)
    except ValueError as exc:
        problems.add(key, value, str(exc))


def check_file(
    p: Problems,
    key: str,
    path: Path,
    raw: Mapping[str, object],
    more: Callable[[Path], str | None] | None = None,
) -> bool:
    """Problem of ``key`` (of table ``raw``) unless ``path`` is a file and ``more(path)`` None; True if ok."""
    given = raw.get(key.rpartition(".")[2])
    if path.is_file():
        problem = more(path) if more is not None else None
    else:
        where = "" if Path(str(given)).is_absolute() else f" (resolved to {str(path)!r})"
        problem = ("not a file" if path.exists() else "file not found") + where
    if problem is not None:
        p.add(key, given, problem)
    return problem is None


#: Kernel file systems: nothing the product writes belongs there.
PSEUDO_FS: Final = (Path("/proc"), Path("/sys"), Path("/dev"))


def output_file_problem(path: Path) -> str | None:
    """Why a file could not be created or replaced at ``path`` (to follow ``key = value:``), or None.

    Its folder must exist and be writable, and it must not be a folder, another kind of file, or on
    :data:`PSEUDO_FS`. Nothing is written (``stat`` and ``access(2)`` only).
    """
    resolved = path.resolve()
    if any(resolved == fs or fs in resolved.parents for fs in PSEUDO_FS):
        return "is on a pseudo file system (/proc, /sys, /dev)"
    if resolved.is_dir():
        return "is a folder (a file name is needed)"
    if resolved.exists() and not resolved.is_file():
        return "is not a regular file"
    folder = resolved.parent
    if not folder.exists():
        return f"its folder {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"its folder {folder} is not writable"
    if resolved.exists() and not os.access(resolved, os.W_OK):
        return "is not writable"
    return None


def sha256_file(path: Path) -> str:
    """SHA-256 of a file as 64 lowercase hex digits (raises ``OSError``)."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def check_model(p: Problems, c: Any, raw: Mapping[str, object], check_files: bool) -> None:
    """Check a ``[model]`` table's ``sha256`` (64 hex digits) and, with ``check_files``, its ``path``.

    ``c`` is either kind's model table (``path``, ``sha256``); the file's digest must match ``sha256``.
    """
    if c.sha256 is not None and (len(c.sha256) != 64 or any(ch not in "0123456789abcdef" for ch in c.sha256)):
        p.add("model.sha256", c.sha256, "must be 64 hexadecimal digits")
    if not check_files or not check_file(p, "model.path", c.path, raw):
        return
    if c.sha256 is not None and "model.sha256" not in p.bad:
        actual = sha256_file(c.path)
        if actual != c.sha256:
            why = f"does not match the file (its sha256 is {actual})"
            p.add("model.sha256", c.sha256, why, involves=("model.path",))


KeyKind = Literal["private", "public", "dir", "text"]
"""An Ed25519 key setting: the path of a private or a public key file, or of a folder of ``*.pub``; a key."""


def check_keys(
    p: Problems, c: object, table: str, raw: Mapping[str, object], kinds: Mapping[str, KeyKind]
) -> None:
    """Problems of ``table``'s key settings (``kinds``: name → kind): each path set must hold its keys.

    Keys are hex or PEM; then a note (once per profile) if one of these settings is set with no Ed25519
    library to use it.
    """
    from edgefl.wire.signing import library_problem, load_signing_key, load_verify_key, load_verify_keys

    loaders = {"private": load_signing_key, "public": load_verify_key, "dir": load_verify_keys}
    for name, kind in kinds.items():
        path, key = getattr(c, name), f"{table}.{name}"
        if path is None or kind == "text":
            continue
        if kind == "dir" and not path.is_dir():
            p.add(key, raw.get(name), "not a folder")
        elif kind == "dir" or check_file(p, key, path, raw):
            try:
                loaders[kind](path)
            except (OSError, ValueError) as exc:
                p.add(key, raw.get(name), str(exc))
    for name in kinds:
        why = library_problem(f"{table}.{name}") if getattr(c, name) is not None else None
        if why is not None and not any("edgefl[security]" in q for q in p.items):
            p.note(why)
            return


def check_broker(p: Problems, c: BrokerConfig, raw: Mapping[str, object], check_files: bool) -> None:
    """Check ``[broker]``: url, prefix, QoS, keep alive, packet limit, credentials, TLS files."""
    scheme: str | None = None
    try:
        scheme = parse_broker_url(c.url)[0]
    except ValueError as exc:
        p.add("broker.url", c.url, str(exc))
    check(p, "broker.topic_prefix", c.topic_prefix, check_topic_prefix)
    check(p, "broker.qos", c.qos, check_qos)
    p.between("broker.keepalive_s", c.keepalive_s, 1, 65_535)
    p.between("broker.max_packet_bytes", c.max_packet_bytes, 1, MQTT_MAX_PACKET_BYTES)
    p.between("broker.max_incoming_packet_bytes", c.max_incoming_packet_bytes, 1, MQTT_MAX_PACKET_BYTES)
    if c.auth_retries < 1:  # the parser made it an int
        p.add("broker.auth_retries", c.auth_retries, "must be an integer >= 1")
    if c.username is not None and not c.username:
        p.add("broker.username", c.username, "must not be empty")
    if c.password is not None and c.username is None:
        p.add("broker.password", c.password, "requires broker.username")
    if c.password_file is not None:
        if c.username is None:
            p.add("broker.password_file", raw.get("password_file"), "requires broker.username")
        elif c.password is not None:
            p.add("broker.password_file", raw.get("password_file"), "give broker.password or this, not both")
        elif check_files:
            check_file(p, "broker.password_file", c.password_file, raw)
    for i, alt in enumerate(c.alternates):
        try:
            alt_scheme = parse_broker_url(alt)[0]
        except ValueError as exc:
            p.add(f"broker.alternates[{i}]", alt, str(exc))
            continue
        if scheme is not None and alt_scheme != scheme:
            why = f"must use broker.url's scheme ({scheme}://): one TLS setting serves every node"
            p.add(f"broker.alternates[{i}]", alt, why, involves=("broker.url",))
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
            check_file(p, f"broker.{name}", path, raw)
    if (c.client_cert is None) != (c.client_key is None):
        given, missing = (
            ("client_cert", "client_key") if c.client_key is None else ("client_key", "client_cert")
        )
        p.add(f"broker.{given}", raw.get(given), f"requires broker.{missing}")
    tls_keys = ("broker.url", "broker.ca_file", "broker.client_cert", "broker.client_key")
    if check_files and tls and not any(key in p.bad for key in tls_keys):
        try:  # loaded as the connection will load them: a file that is there but not PEM fails here
            make_ssl_context(c.ca_file, c.client_cert, c.client_key)
        except ConfigError as exc:
            for problem in exc.problems:
                p.note(problem)


def check_dashboard(p: Problems, c: DashboardConfig, raw: Mapping[str, object], check_files: bool) -> None:
    """Check ``[dashboard]``: host, port, token (required off loopback), timeouts, connection caps."""
    if not c.host:
        p.add("dashboard.host", c.host, "must not be empty (use 0.0.0.0 to listen on all interfaces)")
    p.between("dashboard.port", c.port, 0, 65_535)
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
        p.between(f"dashboard.{name}", getattr(c, name), 0.1, 300, " seconds")
    p.between("dashboard.max_connections", c.max_connections, 1, 10_000)
    if not 1 <= c.max_connections_per_client <= c.max_connections:
        p.add(
            "dashboard.max_connections_per_client",
            c.max_connections_per_client,
            "must be between 1 and dashboard.max_connections",
            involves=("dashboard.max_connections",),
        )


Check = Callable[[Problems, Any, Mapping[str, object], bool], None]
"""A table's semantic check: ``(problems, config, raw table, check_files)``; adds problems, returns None."""


class Schema:
    """The tables of one kind of profile, their checks, and the parser that builds them.

    ``tables`` maps each table name, in file order, to its frozen dataclass and its semantic
    :data:`Check`; ``placeholders`` stand in for required keys that are missing or mistyped, so the
    rest of the table is still checked (``{"device.id": "_"}``).
    """

    def __init__(
        self, tables: Mapping[str, tuple[type[Any], Check]], placeholders: Mapping[str, object] | None = None
    ) -> None:
        self.tables = {name: cls for name, (cls, _) in tables.items()}
        self.checks = {name: check for name, (_, check) in tables.items()}
        self.placeholders = dict(placeholders or {})
        self.specs = {name: _field_specs(cls) for name, cls in self.tables.items()}

    def parse(
        self,
        data: Mapping[str, object],
        base_dir: Path,
        check_files: bool,
        overrides: Mapping[str, object],
    ) -> dict[str, Any]:
        """Build and validate every table: ``{table name: dataclass instance}``.

        ``data`` is ``{table: {key: value}}`` as ``tomllib`` returns it, its relative paths resolving
        against ``base_dir``; ``check_files`` checks that named input files exist; ``overrides``
        (``{"table.key": value}``) go on top, strings coerced to the field's type. ConfigError with every
        problem found.
        """
        problems = Problems(self.specs)
        tables: dict[str, dict[str, object]] = {}
        for name, value in data.items():
            if name not in self.tables:
                problems.note(
                    f"[{name}]: unknown table" if isinstance(value, Mapping) else f"{name}: unknown key"
                )
                continue
            if not isinstance(value, Mapping):
                problems.note(f"{name} = {show(value)}: must be a table")
                continue
            tables[name] = dict(value)

        # Overrides land on top of the TOML, and are remembered so string values get coerced.
        overridden: set[str] = set()
        for key, value in overrides.items():
            table, dot, name = key.partition(".")
            if not dot or not name:
                problems.note(f"{key}: override key must be 'table.key'")
            elif table not in self.tables:
                problems.note(f"{key}: unknown table [{table}]")
            elif name not in self.specs[table]:
                problems.note(f"{key}: unknown key")
            else:
                tables.setdefault(table, {})[name] = value
                overridden.add(key)

        built: dict[str, Any] = {}
        for table, cls in self.tables.items():
            raw = tables.get(table, {})
            specs = self.specs[table]
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
                        values[name] = self.placeholders[key]
                    elif spec.kind == "path" and spec.default is not None:
                        # A default path (device.state_dir) is relative to the profile like a written one.
                        values[name] = convert(spec, spec.default, base_dir, from_text=False)
                    continue
                # A relative path typed on the command line means the working directory, not the profile's.
                root = Path.cwd() if key in overridden else base_dir
                text = key in overridden and isinstance(raw[name], str)
                try:
                    values[name] = convert(spec, raw[name], root, from_text=text)
                except ValueError as exc:
                    problems.add(key, raw[name], str(exc))
                    if spec.required:
                        values[name] = self.placeholders[key]
            if issubclass(cls, BrokerConfig) and "tls" not in raw and isinstance(values.get("url"), str):
                # tls follows the scheme unless stated (and a stated tls must agree, see check_broker).
                with contextlib.suppress(ValueError):  # a bad url is reported by check_broker
                    values["tls"] = parse_broker_url(values["url"])[0] == "mqtts"
            if isinstance(values.get("sha256"), str):
                values["sha256"] = values["sha256"].lower()
            config = cls(**values)
            self.checks[table](problems, config, raw, check_files)
            built[table] = config

        if problems.items:
            raise ConfigError(problems.items)
        return built

    def to_dict(self, profile: object) -> dict[str, object]:
        """Render a profile as JSON-ready ``{table: {key: value}}`` in file order, secrets as ``"***"``.

        Without None values and with real secrets the result parses back to an equal profile.
        """
        out: dict[str, object] = {}
        for table in self.tables:
            config = getattr(profile, table)
            rendered: dict[str, object] = {}
            for name, spec in self.specs[table].items():
                value = getattr(config, name)
                if spec.secret and value is not None:
                    value = MASK
                elif isinstance(value, Path):
                    value = str(value)
                elif isinstance(value, tuple):
                    value = list(value)
                rendered[name] = value
            out[table] = rendered
        return out


def broker_password(broker: BrokerConfig) -> str | None:
    """``broker.password``, or the first line of ``broker.password_file`` (ConfigError if unreadable)."""
    if broker.password_file is None:
        return broker.password
    try:
        lines = broker.password_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            [f"broker.password_file = {str(broker.password_file)!r}: cannot read ({exc})"]
        ) from exc
    return lines[0] if lines else ""


def add_set_argument(parser: argparse.ArgumentParser, example: str) -> None:
    """Add the repeatable ``--set KEY=VALUE`` option (a profile key overridden), e.g. ``example``."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a profile key, e.g. --set {example} (repeatable)",
    )


def parse_sets(items: Sequence[str]) -> dict[str, object]:
    """``--set`` items as ``{"table.key": "value"}``; ConfigError listing each that is not ``key=value``."""
    out: dict[str, object] = {}
    bad = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            bad.append(f"--set {item!r}: expected key=value")
        out[key.strip()] = value
    if bad:
        raise ConfigError(bad)
    return out


def print_problems(title: str, problems: Sequence[str]) -> None:
    """Print ``title:`` then each problem indented on its own line, on stderr (a command's report)."""
    print(f"{title}:", file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)


def read_toml(path: Path | str) -> tuple[Path, dict[str, Any]]:
    """Read a TOML file: its absolute path and the parsed mapping (ConfigError naming the file)."""
    file = Path(path).absolute()
    try:
        text = file.read_bytes().decode("utf-8")
    except FileNotFoundError as exc:
        raise ConfigError([f"{file}: file not found"]) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{file}: cannot read ({exc})"]) from exc
    try:
        return file, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{file}: invalid TOML ({exc})"]) from exc
