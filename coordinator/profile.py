"""Coordinator profiles: ``edgefl coordinator PROFILE``, one frozen dataclass per TOML table.

``[broker]`` and ``[dashboard]`` are shared with device profiles (:mod:`edgefl.profiles`), validated
alike; the commented example is ``firmware_configs/coordinator.toml``. No socket, no LiteRT.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from edgefl import profiles
from edgefl.datasets import npz_problem
from edgefl.errors import ConfigError
from edgefl.profiles import BrokerConfig, DashboardConfig, Problems, check
from edgefl.validators import check_device_id

#: The strategies the DP wrapper takes (the FedAvg family: a weighted mean whose sensitivity is bounded).
DP_WRAPS: Final = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi")


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """``[fleet]``: which fleet this coordinator runs.

    ``name``: device-id pattern, topics under ``<broker.topic_prefix>/<name>/``; ``max_devices`` > 0:
    statuses the device registry keeps; ``device_expiry_s`` > 0: a silent device is forgotten after it.
    """

    name: str = "default"
    max_devices: int = 10_000
    device_expiry_s: float = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class ModelRef:
    """``[model]``: the backbone every device must run (the global head belongs to it).

    ``path``: the ``.tflite`` file (required; absolute after loading); ``sha256``: its expected SHA-256
    (64 hex digits), checked at load.
    """

    path: Path
    sha256: str | None = None


@dataclass(frozen=True, slots=True)
class RoundsConfig:
    """``[rounds]``: how many rounds, when they open, who takes part, and what devices are told to do.

    ``count`` >= 0, ``interval_s`` >= 0 seconds, ``min_new_samples`` >= 0 (0: no wait), ``min_clients``
    > 0, ``quorum`` in (0, 1], ``deadline_s`` > 0: ``docs/operations.md`` ("Running for months").
    ``expected_clients`` >= 0: ready devices to wait for (up to ``wait_devices_s``) before round 1;
    ``local_epochs``, ``batch_size`` > 0; ``lr`` > 0 the client learning rate, times ``lr_decay`` in
    (0, 1] per round of an episode; ``compression`` of the updates (none, float16, int8, topk,
    topk-int8); ``downlink``: the global head's layout (float32, float16, int8; ``docs/protocol.md``).
    """

    count: int = 0
    interval_s: float = 60.0
    min_new_samples: int = 32
    min_clients: int = 2
    quorum: float = 1.0
    expected_clients: int = 0
    wait_devices_s: float = 120.0
    deadline_s: float = 60.0
    local_epochs: int = 2
    lr: float = 0.05
    lr_decay: float = 1.0
    batch_size: int = 16
    compression: Literal["none", "float16", "int8", "topk", "topk-int8"] = "none"
    downlink: Literal["float32", "float16", "int8"] = "float32"


@dataclass(frozen=True, slots=True)
class StrategyConfig:
    """``[strategy]``: the aggregation rule ``name`` and its own parameters (None: its default).

    server_lr > 0, server_momentum in [0, 1), prox_mu >= 0, tau > 0, trim_fraction in [0, 0.5),
    max_updates > 0, buffer_size > 0, max_staleness >= 0.
    """

    name: Literal[
        "fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "median", "trimmed-mean", "fedbuff"
    ] = "median"
    server_lr: float | None = None
    server_momentum: float | None = None
    prox_mu: float | None = None
    tau: float | None = None
    trim_fraction: float | None = None
    max_updates: int | None = None
    buffer_size: int | None = None
    max_staleness: int | None = None


@dataclass(frozen=True, slots=True)
class RobustnessConfig:
    """``[robustness]``: hostile devices a round withstands, and the bound on each update's L2 norm.

    ``tolerate`` >= 0: hostile devices every aggregated round withstands (``Strategy.min_updates``);
    ``norm_bound`` > 0, or None: ``adaptive_factor`` (>= 1) x the median honest-looking norm of the last
    rounds (1: the target quantile 0.5 of Andrew et al. 2021).
    """

    tolerate: int = 1
    norm_bound: float | None = None
    adaptive_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class PrivacyConfig:
    """``[privacy]``: central differential privacy (clipping + Gaussian noise, McMahan et al. 2018).

    ``enabled`` wraps the strategy; ``noise_multiplier`` > 0: noise std in units of ``clip_norm`` > 0,
    the per-update L2 clip; ``delta`` in (0, 1) of the accountant; ``expected_clients`` > 0: the noisy
    mean's fixed denominator (None: ``rounds.min_clients``).
    """

    enabled: bool = False
    noise_multiplier: float = 1.0
    clip_norm: float = 1.0
    delta: float = 1e-5
    expected_clients: float | None = None


@dataclass(frozen=True, slots=True)
class EvaluationConfig:
    """``[evaluation]``: an optional central evaluation set; devices also report their own.

    ``path``: an ``.npz`` of ``x`` (raw samples) and ``y`` (labels); None: the digits test split for the
    shipped digits model, else none. ``mean``, ``std``: per-channel normalisation (as ``[pipeline]``).
    """

    path: Path | None = None
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)


@dataclass(frozen=True, slots=True)
class SecurityRef:
    """``[security]``: signing of global heads and round announcements, verification of updates.

    ``signing_key_file``: the coordinator's Ed25519 private key (64 hex digits or PEM);
    ``device_keys_dir``: folder of ``<device>.pub`` keys, and every update must be signed by its device.
    """

    signing_key_file: Path | None = None
    device_keys_dir: Path | None = None


@dataclass(frozen=True, slots=True)
class FilesConfig:
    """``[files]``: the ``state`` resumed at a restart, the round ``log`` (JSON lines), the job's ``json``."""

    state: Path | None = None
    log: Path | None = None
    json: Path | None = None


@dataclass(frozen=True, slots=True)
class HierarchyConfig:
    """``[hierarchy]``: this coordinator's place among many sites (``docs/operations.md``, "Many sites").

    ``role``: ``flat`` (one coordinator), ``site`` (devices' updates in, one signed Partial a round up)
    or ``root`` (partials in, the global head and rounds out); each key's effect is in the docs. A site:
    ``site`` id (device-id pattern, required), ``expected_devices`` >= 0, ``close_margin_s`` >= 0
    seconds, ``root_key_file``. A root: ``expected_sites`` >= 0; ``site_keys_dir`` (folder of
    ``<site>.pub``), without it ``allow_unsigned_sites`` must be set; ``site_devices`` > 0 (required).
    """

    role: Literal["flat", "site", "root"] = "flat"
    site: str | None = None
    expected_sites: int = 0
    expected_devices: int = 0
    close_margin_s: float = 2.0
    site_keys_dir: Path | None = None
    root_key_file: Path | None = None
    allow_unsigned_sites: bool = False
    site_devices: int = 0


@dataclass(frozen=True, slots=True)
class CoordinatorProfile:
    """A whole coordinator profile; one value object per TOML table (see the module docstring)."""

    path: Path
    broker: BrokerConfig
    fleet: FleetConfig
    model: ModelRef
    rounds: RoundsConfig
    strategy: StrategyConfig
    robustness: RobustnessConfig
    privacy: PrivacyConfig
    evaluation: EvaluationConfig
    dashboard: DashboardConfig
    security: SecurityRef
    files: FilesConfig = field(default_factory=FilesConfig)
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)


def _check_fleet(p: Problems, c: FleetConfig, raw: Mapping[str, object], check_files: bool) -> None:
    check(p, "fleet.name", c.name, check_device_id)
    p.positive("fleet.max_devices", c.max_devices)
    p.positive("fleet.device_expiry_s", c.device_expiry_s)


def _check_rounds(p: Problems, c: RoundsConfig, raw: Mapping[str, object], check_files: bool) -> None:
    for name in ("min_clients", "local_epochs", "batch_size", "deadline_s", "lr", "wait_devices_s"):
        p.positive(f"rounds.{name}", getattr(c, name))
    for name in ("count", "expected_clients", "min_new_samples", "interval_s"):
        p.not_negative(f"rounds.{name}", getattr(c, name))
    if not 0 < c.quorum <= 1:
        p.add("rounds.quorum", c.quorum, "must be in (0, 1]")
    if not 0 < c.lr_decay <= 1:
        p.add("rounds.lr_decay", c.lr_decay, "must be in (0, 1]")


def _check_strategy(p: Problems, c: StrategyConfig, raw: Mapping[str, object], check_files: bool) -> None:
    for name in ("server_lr", "tau", "buffer_size", "max_updates"):
        p.positive(f"strategy.{name}", getattr(c, name))
    if c.server_momentum is not None and not 0 <= c.server_momentum < 1:
        p.add("strategy.server_momentum", c.server_momentum, "must be in [0, 1)")
    p.not_negative("strategy.prox_mu", c.prox_mu)
    p.not_negative("strategy.max_staleness", c.max_staleness)
    if c.trim_fraction is not None and not 0 <= c.trim_fraction < 0.5:
        p.add("strategy.trim_fraction", c.trim_fraction, "must be in [0, 0.5)")


def _check_robustness(p: Problems, c: RobustnessConfig, raw: Mapping[str, object], check_files: bool) -> None:
    p.positive("robustness.norm_bound", c.norm_bound)
    if c.tolerate < 0:  # the parser made it an int
        p.add("robustness.tolerate", c.tolerate, "must be an integer >= 0")
    if not c.adaptive_factor >= 1:
        p.add("robustness.adaptive_factor", c.adaptive_factor, "must be >= 1")


def _check_privacy(p: Problems, c: PrivacyConfig, raw: Mapping[str, object], check_files: bool) -> None:
    p.positive("privacy.noise_multiplier", c.noise_multiplier)
    p.positive("privacy.clip_norm", c.clip_norm)
    if not 0 < c.delta < 1:
        p.add("privacy.delta", c.delta, "must be in (0, 1)")
    p.positive("privacy.expected_clients", c.expected_clients)


def _check_evaluation(p: Problems, c: EvaluationConfig, raw: Mapping[str, object], check_files: bool) -> None:
    if len(c.mean) != len(c.std) and 1 not in (len(c.mean), len(c.std)):
        p.add("evaluation.std", list(c.std), "must have the length of evaluation.mean (or 1)")
    if any(s <= 0 for s in c.std):
        p.add("evaluation.std", list(c.std), "must be > 0")
    if check_files and c.path is not None:
        profiles.check_file(p, "evaluation.path", c.path, raw, npz_problem)


def _check_security(p: Problems, c: SecurityRef, raw: Mapping[str, object], check_files: bool) -> None:
    if check_files:
        profiles.check_keys(p, c, "security", raw, {"signing_key_file": "private", "device_keys_dir": "dir"})


def _check_hierarchy(p: Problems, c: HierarchyConfig, raw: Mapping[str, object], check_files: bool) -> None:
    if c.role == "site" and c.site is None:
        p.add("hierarchy.site", None, "required when hierarchy.role = 'site'")
    if c.site is not None:
        check(p, "hierarchy.site", c.site, check_device_id)
    for name in ("expected_sites", "expected_devices", "site_devices", "close_margin_s"):
        p.not_negative(f"hierarchy.{name}", getattr(c, name))
    if c.role == "root" and c.site_devices == 0:
        why = "required when hierarchy.role = 'root': the most devices one site has (a site whose key"
        p.add("hierarchy.site_devices", 0, why + " was stolen may claim no more)")
    if c.role == "root" and c.site_keys_dir is None and not c.allow_unsigned_sites:
        why = "required when hierarchy.role = 'root' (or set hierarchy.allow_unsigned_sites = true)"
        p.add("hierarchy.site_keys_dir", None, why)
    if check_files:
        profiles.check_keys(p, c, "hierarchy", raw, {"site_keys_dir": "dir", "root_key_file": "public"})


def _check_files(p: Problems, c: FilesConfig, raw: Mapping[str, object], check_files: bool) -> None:
    if not check_files:
        return
    for name in ("state", "log", "json"):
        path = getattr(c, name)
        problem = profiles.output_file_problem(path) if path is not None else None
        if problem is not None:
            p.add(f"files.{name}", raw.get(name, str(path)), problem)


def combination_problems(profile: CoordinatorProfile) -> list[str]:
    """Problems of keys that are valid alone but not together: ``key = value: reason`` lines, or [].

    FedBuff has no site/root form; DP wraps the FedAvg family only.
    """
    problems = []
    st, role = profile.strategy.name, profile.hierarchy.role
    if st == "fedbuff" and role != "flat":
        problems.append(f"hierarchy.role = {role!r}: fedbuff runs flat only (strategy.name = 'fedbuff')")
    if profile.privacy.enabled and st not in DP_WRAPS:
        problems.append(
            f"privacy.enabled = true: DP wraps {', '.join(DP_WRAPS[:-1])} or {DP_WRAPS[-1]}, not {st} "
            "(strategy.name; or set privacy.enabled = false)"
        )
    return problems


_TABLES: Final[dict[str, tuple[type[Any], profiles.Check]]] = {
    "broker": (BrokerConfig, profiles.check_broker),
    "fleet": (FleetConfig, _check_fleet),
    "model": (ModelRef, profiles.check_model),
    "rounds": (RoundsConfig, _check_rounds),
    "strategy": (StrategyConfig, _check_strategy),
    "robustness": (RobustnessConfig, _check_robustness),
    "privacy": (PrivacyConfig, _check_privacy),
    "evaluation": (EvaluationConfig, _check_evaluation),
    "dashboard": (DashboardConfig, profiles.check_dashboard),
    "security": (SecurityRef, _check_security),
    "files": (FilesConfig, _check_files),
    "hierarchy": (HierarchyConfig, _check_hierarchy),
}
SCHEMA: Final = profiles.Schema(_TABLES, {"model.path": Path("_")})
"""The coordinator profile's tables, checks and parser."""


def is_coordinator_profile(data: Mapping[str, object]) -> bool:
    """True when a parsed TOML mapping is a coordinator profile (it has a coordinator-only table)."""
    return any(name in _TABLES and name not in ("broker", "model", "dashboard", "security") for name in data)


def load_coordinator_profile(
    path: Path | str, overrides: Mapping[str, object] | None = None, *, check_files: bool = True
) -> CoordinatorProfile:
    """Read a coordinator TOML profile, apply ``--set`` overrides (``{"table.key": value}``), validate it.

    Relative paths in the file resolve against its folder. ``check_files`` also checks the input files
    (model and its sha256, keys, evaluation set) and that the output files can be written (writing
    nothing). Raises ConfigError with every problem at once, e.g. ``["rounds.count = 0: must be > 0",
    "[bogus]: unknown table"]``.
    """
    file, data = profiles.read_toml(path)
    if "device" in data:
        raise ConfigError([f"{file}: a device profile (it has [device]); run it with 'edgefl run'"])
    built = SCHEMA.parse(data, file.parent, check_files, overrides or {})
    profile = CoordinatorProfile(path=file, **built)
    problems = combination_problems(profile)
    if problems:
        raise ConfigError(problems)
    return profile
