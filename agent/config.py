"""Device profiles: ``edgefl run PROFILE``, one frozen dataclass per TOML table, validated once at load.

Parsed and checked as :mod:`edgefl.profiles` says (every problem at once, each naming its dotted key);
``device.id`` and ``model.path`` are required. The commented example is ``firmware_configs/dev_x86.toml``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal

from edgefl import profiles
from edgefl.datasets import npz_problem
from edgefl.profiles import BrokerConfig, DashboardConfig, Problems, check
from edgefl.validators import (
    MAX_BATCH,
    MAX_THREADS,
    MQTT_MAX_SESSION_EXPIRY_S,
    check_device_id,
    check_int_at_most,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """``[device]``: who this agent is and where it keeps its state.

    ``id`` (required) ``^[A-Za-z0-9_.-]{1,64}$``, one MQTT topic level (``status/<id>``); ``fleet`` the
    same pattern, topics live under ``<topic_prefix>/<fleet>/``; ``state_dir`` the folder of the
    embedding store, outbox and heads (absolute after loading), unset ``state/<id>`` next to the
    profile, so devices sharing a profile never share a folder.
    """

    id: str
    fleet: str = "default"
    state_dir: Path = Path("state")


@dataclass(frozen=True, slots=True)
class AgentBrokerConfig(BrokerConfig):
    """``[broker]`` of a device profile: the shared MQTT keys and the agent's persistent session.

    Shared keys: :class:`~edgefl.profiles.BrokerConfig`. ``session_expiry_s``: seconds the broker keeps
    the agent's MQTT session while it is away, 0 (a clean session at every connect)..4294967295 (never
    expires); MQTT 5.0 §3.1.2.11; ``docs/operations.md``.
    """

    session_expiry_s: int = 3600


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """``[model]``: the frozen TFLite backbone.

    ``path`` (required) the ``.tflite`` file (absolute after loading); ``embedding_tensor`` the tensor
    read as the embedding, None: the input of the last FULLY_CONNECTED op; ``num_threads`` interpreter
    threads, > 0; ``runtime`` the interpreter package, ``auto`` tries ``ai-edge-litert`` then
    ``tflite-runtime``; ``sha256`` the file's expected SHA-256 (64 hex digits), checked at load when
    files are checked.
    """

    path: Path
    embedding_tensor: str | None = None
    num_threads: int = 1
    runtime: Literal["auto", "litert", "tflite"] = "auto"
    sha256: str | None = None


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """``[pipeline]``: raw samples to model input, ``(raw - mean) / std`` per channel, then quantised.

    ``mode`` ``auto`` lets ``edgefl profile`` pick the faster path per model; ``batch`` samples per
    interpreter invocation, > 0; ``raw_dtype`` the raw samples' dtype; ``mean``, ``std`` per-channel
    normalisation, same length, finite, ``std > 0``, length 1 broadcasts.
    """

    mode: Literal["fused", "unfused", "auto"] = "fused"
    batch: int = 8
    raw_dtype: Literal["uint8", "int16", "float32"] = "uint8"
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """``[memory]``: the RAM slice the agent may use, in MiB.

    ``cap_mb`` the cap (a lower cgroup ``memory.max`` wins), > ``reserve_mb``; ``reserve_mb`` headroom
    kept free under the cap for allocations the governor does not estimate, > 0;
    ``min_system_available_mb`` defer training while the system's MemAvailable is below it, >= 0 (0: off).
    """

    cap_mb: int = 96
    reserve_mb: int = 8
    min_system_available_mb: int = 32


@dataclass(frozen=True, slots=True)
class TrainingConfig:
    """``[training]``: the embedding store and local training of the head.

    ``store_capacity`` embeddings kept in the ring store, > 0; ``chunk_size`` embeddings per training
    chunk at full budget, > 0; ``chunk_floor`` the smallest chunk the governor may shrink to before
    deferring training, 0 < floor <= chunk_size; ``clip_norm`` L2 clipping norm of the update delta,
    > 0 (None: no clipping); ``seed`` of the local shuffles, >= 0; ``holdout_every`` 0 (off) or n >= 2:
    every n-th labelled sample goes to a holdout store (capacity ``store_capacity // n``, at least 16)
    on which each new global head is evaluated; ``min_examples`` 1..store_capacity, ``flush_interval_s``
    seconds > 0, ``flush_every`` samples >= 1: ``docs/operations.md``.
    """

    store_capacity: int = 4096
    chunk_size: int = 256
    chunk_floor: int = 16
    clip_norm: float | None = None
    seed: int = 0
    holdout_every: int = 20
    min_examples: int = 32
    flush_interval_s: float = 5.0
    flush_every: int = 64


@dataclass(frozen=True, slots=True)
class PersonalConfig:
    """``[personal]``: the device's personal head, trained beside the global one (``agent/personal.py``).

    ``enabled`` train and serve it; ``prox_lambda`` Ditto's lambda (pull toward the global head),
    0..1000, 0: no pull; ``epochs`` passes over the store per round, 0..100, 0: the round's
    ``local_epochs``; ``lr_scale`` its SGD learning rate as a multiple of the round's ``lr``, (0, 10];
    ``absent_alpha`` FedRS's alpha, 0..1, the factor on the logits of the classes this device never
    had a label for (0: a constant 0 logit; 1: plain softmax).

    Source: Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
    Personalization", ICML 2021; X.-C. Li, D.-C. Zhan, "FedRS: Federated Learning with Restricted
    Softmax for Label Distribution Non-IID Data", KDD 2021.
    """

    enabled: bool = True
    prox_lambda: float = 0.0
    epochs: int = 0
    lr_scale: float = 1.6
    absent_alpha: float = 0.0


@dataclass(frozen=True, slots=True)
class SourceConfig:
    """``[source]``: where local samples come from.

    ``kind``: ``mqtt`` live ingest of Sample and Label messages, a Prediction published per sample
    (``docs/protocol.md``, "Live ingest"); ``replay`` the ``.npz`` at ``path`` (required; absolute
    after loading) holding ``x`` (raw samples) and ``y`` (labels), ``rate_hz`` samples a second (>= 0;
    0: as fast as possible), from the first again after the last if ``loop``; ``none`` only what the
    store already holds. ``queue_max_bytes`` (every kind) 65,536..67,108,864 (``docs/operations.md``).
    MQTT (each bound's effect: ``docs/protocol.md``, "What the device does with them"): ``queue_max``
    1..65536 samples; ``pending_max`` 0..1,000,000 samples, 0 refuses every late label;
    ``label_expiry_s`` (0, 86400] seconds; ``samples_qos`` of the subscriptions to ``samples/<device>``
    (0 or 1; labels always 1); ``predictions_qos`` 0 or 1.
    """

    kind: Literal["none", "replay", "mqtt"] = "none"
    path: Path | None = None
    rate_hz: float = 0.0
    loop: bool = False
    queue_max: int = 256
    queue_max_bytes: int = 4_194_304
    pending_max: int = 1024
    label_expiry_s: float = 300.0
    samples_qos: int = 1
    predictions_qos: int = 0


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """``[security]``: message signatures (Ed25519) and the persistent outbox.

    ``signing_key_file`` this device's private key (64 hex digits or PEM), its updates signed with it;
    ``coordinator_public_key`` (64 hex digits or PEM): when set, every GlobalModel and
    RoundAnnouncement must carry a valid signature by it (``docs/security.md``);
    ``require_signatures`` refuse unsigned messages, needs (and is implied by)
    ``coordinator_public_key``; ``outbox_max_bytes`` bound of the persistent outbox of unacknowledged
    updates, > 0.
    """

    signing_key_file: Path | None = None
    coordinator_public_key: str | None = field(default=None, repr=False)
    require_signatures: bool = False
    outbox_max_bytes: int = 1024 * 1024


@dataclass(frozen=True, slots=True)
class StatusConfig:
    """``[status]``: the retained status message, in seconds (what goes out when: ``docs/operations.md``).

    ``interval_s`` how often it is checked, 0.05..3600; ``heartbeat_s`` the longest time between two
    publishes, interval_s..86400 (unset: interval_s).
    """

    interval_s: float = 2.0
    heartbeat_s: float | None = None


@dataclass(frozen=True, slots=True)
class Profile:
    """A whole device profile: one value object per TOML table.

    ``path``: the profile file (absolute), or ``Path("<inline>")`` when parsed from a mapping without one.
    """

    path: Path
    device: DeviceConfig
    model: ModelConfig
    pipeline: PipelineConfig
    broker: AgentBrokerConfig
    memory: MemoryConfig
    training: TrainingConfig
    source: SourceConfig
    dashboard: DashboardConfig
    security: SecurityConfig = field(default_factory=SecurityConfig)
    status: StatusConfig = field(default_factory=StatusConfig)
    personal: PersonalConfig = field(default_factory=PersonalConfig)

    @property
    def cap_bytes(self) -> int:
        """The profile's memory cap in bytes (``memory.cap_mb * 1024 * 1024``)."""
        return self.memory.cap_mb * 1024 * 1024


# --- semantic checks, one per table, run on typed values ---------------------------------------------
def _check_device(p: Problems, c: DeviceConfig, raw: Mapping[str, object], check_files: bool) -> None:
    check(p, "device.id", c.id, check_device_id)
    check(p, "device.fleet", c.fleet, check_device_id)


def _check_model(p: Problems, c: ModelConfig, raw: Mapping[str, object], check_files: bool) -> None:
    if c.embedding_tensor is not None and not c.embedding_tensor:
        p.add("model.embedding_tensor", c.embedding_tensor, "must not be empty")
    check(p, "model.num_threads", c.num_threads, lambda v: check_int_at_most("num_threads", v, MAX_THREADS))
    profiles.check_model(p, c, raw, check_files)


def _check_pipeline(p: Problems, c: PipelineConfig, raw: Mapping[str, object], check_files: bool) -> None:
    check(p, "pipeline.batch", c.batch, lambda v: check_int_at_most("batch", v, MAX_BATCH))
    if any(s <= 0.0 for s in c.std):
        p.add("pipeline.std", c.std, "every value must be > 0")
    if len(c.mean) != len(c.std):
        p.add(
            "pipeline.mean",
            c.mean,
            f"must have as many values as pipeline.std ({len(c.std)})",
            involves=("pipeline.std",),
        )


def _check_memory(p: Problems, c: MemoryConfig, raw: Mapping[str, object], check_files: bool) -> None:
    p.positive("memory.cap_mb", c.cap_mb)
    p.positive("memory.reserve_mb", c.reserve_mb)
    if c.reserve_mb >= c.cap_mb:
        p.add(
            "memory.reserve_mb",
            c.reserve_mb,
            f"must be < memory.cap_mb ({c.cap_mb})",
            involves=("memory.cap_mb",),
        )
    p.not_negative("memory.min_system_available_mb", c.min_system_available_mb)


def _check_training(p: Problems, c: TrainingConfig, raw: Mapping[str, object], check_files: bool) -> None:
    for name in ("store_capacity", "chunk_size", "chunk_floor"):
        p.positive(f"training.{name}", getattr(c, name))
    if c.chunk_floor > c.chunk_size:
        p.add(
            "training.chunk_floor",
            c.chunk_floor,
            f"must be <= training.chunk_size ({c.chunk_size})",
            involves=("training.chunk_size",),
        )
    p.positive("training.clip_norm", c.clip_norm)
    p.not_negative("training.seed", c.seed)
    if c.holdout_every < 0 or c.holdout_every == 1:
        p.add("training.holdout_every", c.holdout_every, "must be 0 (no holdout) or >= 2")
    if not c.flush_interval_s > 0.0:  # the parser refused inf
        p.add("training.flush_interval_s", c.flush_interval_s, "must be a finite number of seconds > 0")
    if c.flush_every < 1:  # the parser made every int field an int
        p.add("training.flush_every", c.flush_every, "must be an integer >= 1")
    if c.min_examples < 1:
        p.add("training.min_examples", c.min_examples, "must be an integer >= 1")
    elif c.min_examples > c.store_capacity:
        p.add(
            "training.min_examples",
            c.min_examples,
            f"must be <= training.store_capacity ({c.store_capacity}): the store never holds more",
            involves=("training.store_capacity",),
        )


def _check_broker(p: Problems, c: AgentBrokerConfig, raw: Mapping[str, object], check_files: bool) -> None:
    profiles.check_broker(p, c, raw, check_files)
    p.between("broker.session_expiry_s", c.session_expiry_s, 0, MQTT_MAX_SESSION_EXPIRY_S, " seconds")


def _check_source(p: Problems, c: SourceConfig, raw: Mapping[str, object], check_files: bool) -> None:
    p.not_negative("source.rate_hz", c.rate_hz)
    p.between("source.queue_max", c.queue_max, 1, 65_536, " samples")
    p.between("source.queue_max_bytes", c.queue_max_bytes, 65_536, 67_108_864, " bytes")
    p.between("source.pending_max", c.pending_max, 0, 1_000_000, " samples")
    if not 0.0 < c.label_expiry_s <= 86_400.0:
        p.add("source.label_expiry_s", c.label_expiry_s, "must be > 0 and at most 86400 seconds")
    for key, qos in (("samples_qos", c.samples_qos), ("predictions_qos", c.predictions_qos)):
        if qos not in (0, 1):
            p.add(f"source.{key}", qos, "must be 0 or 1")
    if c.kind != "replay":
        return
    if c.path is None:
        if "source.path" not in p.bad:
            p.note("source.path: required when source.kind = 'replay'")
        return
    if check_files:
        profiles.check_file(p, "source.path", c.path, raw, npz_problem)


def _check_security(p: Problems, c: SecurityConfig, raw: Mapping[str, object], check_files: bool) -> None:
    from edgefl.wire.signing import parse_verify_key

    key = c.coordinator_public_key
    if key is not None:
        try:
            parse_verify_key(key)
        except ValueError as exc:
            reason = f"not an Ed25519 {exc}"
            if "\n" not in key and Path(key.strip()).is_file():
                reason += "; this is a file's name: the setting holds the key itself (edgefl keys show FILE)"
            p.add("security.coordinator_public_key", key, reason)
    if c.require_signatures and key is None:
        p.add(
            "security.require_signatures",
            True,
            "needs security.coordinator_public_key",
            involves=("security.coordinator_public_key",),
        )
    p.positive("security.outbox_max_bytes", c.outbox_max_bytes)
    if check_files:
        kinds: dict[str, profiles.KeyKind] = {"signing_key_file": "private", "coordinator_public_key": "text"}
        profiles.check_keys(p, c, "security", raw, kinds)


def _check_status(p: Problems, c: StatusConfig, raw: Mapping[str, object], check_files: bool) -> None:
    p.between("status.interval_s", c.interval_s, 0.05, 3600, " seconds")
    if c.heartbeat_s is not None and not c.interval_s <= c.heartbeat_s <= 86_400:
        p.add("status.heartbeat_s", c.heartbeat_s, "must be between status.interval_s and 86400 seconds")


def _check_personal(p: Problems, c: PersonalConfig, raw: Mapping[str, object], check_files: bool) -> None:
    p.between("personal.prox_lambda", c.prox_lambda, 0, 1000)
    if not 0 <= c.epochs <= 100:
        p.add("personal.epochs", c.epochs, "must be an integer between 0 and 100 (0: the round's)")
    if not 0.0 < c.lr_scale <= 10.0:
        p.add("personal.lr_scale", c.lr_scale, "must be > 0 and <= 10 (a multiple of the round's lr)")
    if not 0.0 <= c.absent_alpha <= 1.0:
        p.add("personal.absent_alpha", c.absent_alpha, "must be between 0 and 1 (1: plain softmax)")


_TABLES: Final[dict[str, tuple[type[Any], profiles.Check]]] = {
    "device": (DeviceConfig, _check_device),
    "model": (ModelConfig, _check_model),
    "pipeline": (PipelineConfig, _check_pipeline),
    "broker": (AgentBrokerConfig, _check_broker),
    "memory": (MemoryConfig, _check_memory),
    "training": (TrainingConfig, _check_training),
    "source": (SourceConfig, _check_source),
    "dashboard": (DashboardConfig, profiles.check_dashboard),
    "security": (SecurityConfig, _check_security),
    "status": (StatusConfig, _check_status),
    "personal": (PersonalConfig, _check_personal),
}
SCHEMA: Final = profiles.Schema(_TABLES, {"device.id": "_", "model.path": Path("_")})
"""The device profile's tables, checks and parser."""


def parse_profile(
    data: Mapping[str, object],
    base_dir: Path,
    *,
    path: Path | None = None,
    check_files: bool = True,
    overrides: Mapping[str, object] | None = None,
) -> Profile:
    """Build and validate a profile (paths absolute) from an already-parsed TOML mapping.

    ``data``, ``base_dir``, ``check_files``, ``overrides`` as :meth:`edgefl.profiles.Schema.parse`'s
    (``check_files`` False for a profile written for another machine); ``path`` is recorded in
    :attr:`Profile.path`. ConfigError with every problem found, e.g. ``["memory.cap_mb = 0: must be > 0",
    "[bogus]: unknown table"]``.
    """
    overrides = overrides or {}
    built = SCHEMA.parse(data, base_dir, check_files, overrides)
    device_table = data.get("device")
    given = isinstance(device_table, Mapping) and "state_dir" in device_table
    if not given and "device.state_dir" not in overrides:
        device: DeviceConfig = built["device"]
        built["device"] = replace(device, state_dir=device.state_dir / device.id)
    return Profile(path=path if path is not None else Path("<inline>"), **built)


def load_profile(
    path: Path | str,
    overrides: Mapping[str, object] | None = None,
    *,
    check_files: bool = True,
) -> Profile:
    """Read a TOML profile (relative paths inside it resolve against its folder), apply overrides, validate.

    ``overrides``: dotted keys set on top of the file, e.g. ``{"device.id": "dev-2"}``, string values
    (from ``--set key=value``) coerced to the field's type (``"0.5,0.5"`` to a tuple of floats, ``""``
    to None), a relative path resolving against the working directory; ``check_files`` as
    :func:`parse_profile`'s. ConfigError if the file cannot be read, is not TOML, or the profile is
    invalid (all problems at once).
    """
    file, data = profiles.read_toml(path)
    profile = parse_profile(data, file.parent, path=file, check_files=check_files, overrides=overrides)
    logger.debug("loaded profile %s for device %s", file, profile.device.id)
    return profile


def profile_to_dict(p: Profile) -> dict[str, object]:
    """Render a profile as JSON-ready ``{table: {key: value}}`` (:meth:`edgefl.profiles.Schema.to_dict`)."""
    return SCHEMA.to_dict(p)
