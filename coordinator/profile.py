"""Coordinator profiles: ``edgefl coordinator PROFILE``, one frozen dataclass per TOML table.

Tables: ``[broker]`` and ``[dashboard]`` (shared with device profiles and spelled the same, see
:mod:`edgefl.profiles`), ``[fleet]``, ``[model]``, ``[rounds]``, ``[strategy]``, ``[robustness]``,
``[privacy]``, ``[evaluation]``, ``[security]``, ``[files]``, ``[hierarchy]``. Validated like device
profiles: unknown tables and keys refused, every problem listed at once with its dotted key. The
shipped, commented example is ``firmware_configs/coordinator.toml``; command-line flags are overrides
on top of it.

This module reads files only: it never opens a socket and never imports LiteRT.
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np

from edgefl.errors import ConfigError
from edgefl.profiles import (
    BrokerConfig,
    Check,
    DashboardConfig,
    Problems,
    Schema,
    check,
    check_broker,
    check_dashboard,
    file_problem,
    output_file_problem,
    read_toml,
    sha256_file,
)
from edgefl.validators import check_device_id

__all__ = [
    "DP_WRAPS",
    "SCHEMA",
    "CoordinatorProfile",
    "EvaluationConfig",
    "FilesConfig",
    "FleetConfig",
    "HierarchyConfig",
    "ModelRef",
    "PrivacyConfig",
    "RobustnessConfig",
    "RoundsConfig",
    "SecurityRef",
    "StrategyConfig",
    "combination_problems",
    "is_coordinator_profile",
    "load_coordinator_profile",
]

logger = logging.getLogger(__name__)

#: The strategies the DP wrapper takes (the FedAvg family: a weighted mean whose sensitivity is bounded).
DP_WRAPS: Final = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi")


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """``[fleet]``: which fleet this coordinator runs.

    Parameters
    ----------
    name : str
        Fleet name, ``^[A-Za-z0-9_.-]{1,64}$``; topics live under ``<broker.topic_prefix>/<name>/``.
    max_devices : int
        Bound of the device registry (statuses kept), > 0; the oldest offline entries go first.
    device_expiry_s : float
        Seconds after which an offline or silent device's status is forgotten, > 0.
    """

    name: str = "default"
    max_devices: int = 10_000
    device_expiry_s: float = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class ModelRef:
    """``[model]``: the backbone every device must run (the global head belongs to it).

    Parameters
    ----------
    path : Path
        The ``.tflite`` file (absolute after loading). Required.
    sha256 : str or None
        Expected SHA-256 (64 hex digits), checked at load; devices reporting another are left out.
    """

    path: Path
    sha256: str | None = None


@dataclass(frozen=True, slots=True)
class RoundsConfig:
    """``[rounds]``: how many rounds, when they open, who takes part, and what devices are told to do.

    Parameters
    ----------
    count : int
        Rounds to run, >= 0. 0 (the default): a **service** that runs until stopped (SIGTERM), its
        rounds paced by ``interval_s`` and ``min_new_samples``. N > 0: a **job** of N rounds back to
        back (tests, demos, benches), which ignores the pacing keys and exits after round N.
    interval_s : float
        Service: least time between two round starts, seconds, >= 0.
    min_new_samples : int
        Service: a round opens only once the ready devices report at least this many labelled samples
        stored since their last round (the DeviceStatus ``new_samples`` field), >= 0 (0: no wait).
    min_clients : int
        Ready devices a service's round needs to open, and the fewest updates that close any round
        before its deadline, > 0. The strategy's own minimum applies on top.
    quorum : float
        Share of the devices asked (the ready devices, or the strategy's sample of them, and any that
        answer the retained announcement meanwhile) whose updates close a round before its deadline,
        in (0, 1]; 1.0: a round waits for every device it asked.
    expected_clients : int
        Ready devices to wait for before round 1 (0: do not wait), >= 0.
    wait_devices_s : float
        How long to wait for them, seconds, > 0.
    deadline_s : float
        Round deadline, seconds, > 0.
    local_epochs : int
        Client epochs per round, > 0.
    lr : float
        Client learning rate, > 0: the same every round by default (a fleet's data keeps changing;
        see ``docs/operations.md``, "Learning rate").
    lr_decay : float
        Factor on the client learning rate per round within an episode, in (0, 1]; an episode restarts
        at every round whose devices report new labelled samples (1.0, the default: constant).
    batch_size : int
        Client SGD batch size, > 0.
    compression : str
        Update compression devices use: none, float16, int8, topk, topk-int8.
    downlink : str
        Layout of the global head sent down (``docs/protocol.md``, "Head layouts"): float32 (read by
        every device), float16, or int8 with a scale per output unit (schema 3: devices of this
        release or later).
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
    """``[strategy]``: the aggregation rule and its parameters.

    Parameters
    ----------
    name : str
        fedavg, fedprox, fedavgm, fedadam, fedyogi, median, trimmed-mean or fedbuff.
    server_lr : float or None
        Server learning rate (FedAvgM, FedAdam, FedYogi), > 0; None: the strategy's default.
    server_momentum : float or None
        FedAvgM momentum in [0, 1); None: default.
    prox_mu : float or None
        FedProx proximal weight, >= 0; None: default.
    tau : float or None
        FedAdam/FedYogi adaptivity, > 0; None: default.
    trim_fraction : float or None
        Trimmed mean: fraction cut at each end, in [0, 0.5); None: default.
    max_updates : int or None
        Median / trimmed mean: most updates held per round, > 0; None: default.
    buffer_size : int or None
        FedBuff: updates per aggregation, > 0; None: default.
    max_staleness : int or None
        FedBuff: updates staler than this many versions are refused, >= 0; None: default.
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

    Parameters
    ----------
    tolerate : int
        Hostile devices every aggregated round must withstand, >= 0 (default 1). Each strategy
        derives the fewest updates it aggregates from it (trimmed mean: ``floor(trim_fraction n) >=
        tolerate``; median: ``2 tolerate + 1``; the FedAvg family: ``5 tolerate``); a round with
        fewer waits to its deadline, then is refused as ``too_few`` (``Strategy.min_updates``).
    norm_bound : float or None
        Fixed bound, > 0; None: adaptive (``adaptive_factor`` x the median honest-looking norm of
        the last rounds).
    adaptive_factor : float
        Multiple of that median used when ``norm_bound`` is None, >= 1 (default 1: the bound is the
        median itself, the target quantile 0.5 of Andrew et al. 2021).
    """

    tolerate: int = 1
    norm_bound: float | None = None
    adaptive_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class PrivacyConfig:
    """``[privacy]``: central differential privacy (clipping + Gaussian noise, McMahan et al. 2018).

    Parameters
    ----------
    enabled : bool
        Wrap the strategy in the DP wrapper.
    noise_multiplier : float
        Gaussian noise std as a multiple of ``clip_norm``, > 0.
    clip_norm : float
        Per-update L2 clip, > 0.
    delta : float
        Target delta of the (epsilon, delta) accountant, in (0, 1).
    expected_clients : float or None
        Fixed denominator of the noisy mean (expected updates per round, > 0); None: ``rounds.min_clients``.
    """

    enabled: bool = False
    noise_multiplier: float = 1.0
    clip_norm: float = 1.0
    delta: float = 1e-5
    expected_clients: float | None = None


@dataclass(frozen=True, slots=True)
class EvaluationConfig:
    """``[evaluation]``: an optional central evaluation set; devices also report their own.

    Parameters
    ----------
    path : Path or None
        An ``.npz`` with ``x`` (raw samples in the model's raw input dtype and shape) and ``y`` (labels);
        None: the digits test split when the model is the shipped digits model, else no central set.
    mean, std : tuple[float, ...]
        Per-channel normalisation of ``x`` (as the devices' ``[pipeline]``).
    """

    path: Path | None = None
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)


@dataclass(frozen=True, slots=True)
class SecurityRef:
    """``[security]``: signing of global heads and round announcements, verification of updates.

    Parameters
    ----------
    signing_key_file : Path or None
        The coordinator's Ed25519 private key (64 hex digits or PEM).
    device_keys_dir : Path or None
        Folder of ``<device>.pub`` keys (64 hex digits or PEM, as ``edgefl keys generate`` writes);
        when set, every update must be signed by its device.
    """

    signing_key_file: Path | None = None
    device_keys_dir: Path | None = None


@dataclass(frozen=True, slots=True)
class FilesConfig:
    """``[files]``: where the coordinator keeps its state and logs.

    Parameters
    ----------
    state : Path or None
        State file (global head, version, round): resumed after a restart, saved every round.
    log : Path or None
        One JSON line per closed round is appended here.
    json : Path or None
        Summary written when the job ends (``rounds[]`` as the demo's JSON).
    """

    state: Path | None = None
    log: Path | None = None
    json: Path | None = None


@dataclass(frozen=True, slots=True)
class HierarchyConfig:
    """``[hierarchy]``: this coordinator's place among many sites (``docs/operations.md``, "Many sites").

    Parameters
    ----------
    role : str
        ``flat`` (one coordinator: devices' updates in, global head out), ``site`` (an aggregator next
        to a site's broker: devices' updates in, one signed Partial a round up to the root; rounds and
        heads come down from the root over the broker bridge) or ``root`` (partials in, the server
        optimiser, norm bound and DP, the global head and rounds out).
    site : str or None
        The site id (device-id pattern), required when ``role = "site"``; topic ``partial/<site>``.
    expected_sites : int
        Root: partials that close a round before its deadline, >= 0 (0: ``rounds.min_clients``
        updates close it, as in a flat run).
    expected_devices : int
        Site: updates that close the site's partial before ``deadline - close_margin_s``, >= 0 (0: the
        devices online at the site when the round opens and selected by it; the deadline if none).
    close_margin_s : float
        Site: the partial closes this many seconds before the root's deadline, so it crosses the
        bridge in time, >= 0.
    site_keys_dir : Path or None
        Root: folder of ``<site>.pub`` keys; when set, every partial must be signed by its site.
    root_key_file : Path or None
        Site: the root's public key; when set, round announcements must be signed by it.
    allow_unsigned_sites : bool
        Root: start without ``site_keys_dir`` (anyone who can publish on ``partial/<site>`` then
        sets the global head; a loud warning at start). A root refuses to start without site keys
        unless this is true.
    site_devices : int
        Root: most devices one site has registered, > 0 (required for a root; 0 elsewhere); a
        partial claiming more updates is refused, so a site whose key was stolen weighs at most
        that many updates.
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


def _positive(p: Problems, key: str, value: float | None) -> None:
    if value is not None and not value > 0:
        p.add(key, value, "must be > 0")


def _check_fleet(p: Problems, c: FleetConfig, raw: Mapping[str, object], check_files: bool) -> None:
    check(p, "fleet.name", c.name, check_device_id)
    _positive(p, "fleet.max_devices", c.max_devices)
    _positive(p, "fleet.device_expiry_s", c.device_expiry_s)


def _check_model(p: Problems, c: ModelRef, raw: Mapping[str, object], check_files: bool) -> None:
    if c.sha256 is not None and (len(c.sha256) != 64 or any(ch not in "0123456789abcdef" for ch in c.sha256)):
        p.add("model.sha256", c.sha256, "must be 64 hexadecimal digits")
        return
    if not check_files:
        return
    problem = file_problem(c.path, raw.get("path"))
    if problem is not None:
        p.add("model.path", raw.get("path"), problem)
    elif c.sha256 is not None and sha256_file(c.path) != c.sha256:
        p.add("model.sha256", c.sha256, f"does not match {c.path.name} ({sha256_file(c.path)})")


def _check_rounds(p: Problems, c: RoundsConfig, raw: Mapping[str, object], check_files: bool) -> None:
    for name in ("min_clients", "local_epochs", "batch_size", "deadline_s", "lr", "wait_devices_s"):
        _positive(p, f"rounds.{name}", getattr(c, name))
    for name in ("count", "expected_clients", "min_new_samples", "interval_s"):
        if not getattr(c, name) >= 0:
            p.add(f"rounds.{name}", getattr(c, name), "must be >= 0")
    if not 0 < c.quorum <= 1:
        p.add("rounds.quorum", c.quorum, "must be in (0, 1]")
    if not 0 < c.lr_decay <= 1:
        p.add("rounds.lr_decay", c.lr_decay, "must be in (0, 1]")


def _check_strategy(p: Problems, c: StrategyConfig, raw: Mapping[str, object], check_files: bool) -> None:
    for name in ("server_lr", "tau", "buffer_size", "max_updates"):
        _positive(p, f"strategy.{name}", getattr(c, name))
    if c.server_momentum is not None and not 0 <= c.server_momentum < 1:
        p.add("strategy.server_momentum", c.server_momentum, "must be in [0, 1)")
    if c.prox_mu is not None and c.prox_mu < 0:
        p.add("strategy.prox_mu", c.prox_mu, "must be >= 0")
    if c.max_staleness is not None and c.max_staleness < 0:
        p.add("strategy.max_staleness", c.max_staleness, "must be >= 0")
    if c.trim_fraction is not None and not 0 <= c.trim_fraction < 0.5:
        p.add("strategy.trim_fraction", c.trim_fraction, "must be in [0, 0.5)")


def _check_robustness(p: Problems, c: RobustnessConfig, raw: Mapping[str, object], check_files: bool) -> None:
    _positive(p, "robustness.norm_bound", c.norm_bound)
    if isinstance(c.tolerate, bool) or not isinstance(c.tolerate, int) or c.tolerate < 0:
        p.add("robustness.tolerate", c.tolerate, "must be an integer >= 0")
    if not c.adaptive_factor >= 1:
        p.add("robustness.adaptive_factor", c.adaptive_factor, "must be >= 1")


def _check_privacy(p: Problems, c: PrivacyConfig, raw: Mapping[str, object], check_files: bool) -> None:
    _positive(p, "privacy.noise_multiplier", c.noise_multiplier)
    _positive(p, "privacy.clip_norm", c.clip_norm)
    if not 0 < c.delta < 1:
        p.add("privacy.delta", c.delta, "must be in (0, 1)")
    _positive(p, "privacy.expected_clients", c.expected_clients)


def _check_evaluation(p: Problems, c: EvaluationConfig, raw: Mapping[str, object], check_files: bool) -> None:
    if len(c.mean) != len(c.std) and 1 not in (len(c.mean), len(c.std)):
        p.add("evaluation.std", list(c.std), "must have the length of evaluation.mean (or 1)")
    if any(s <= 0 for s in c.std):
        p.add("evaluation.std", list(c.std), "must be > 0")
    if check_files and c.path is not None:
        problem = file_problem(c.path, raw.get("path")) or _npz_problem(c.path)
        if problem is not None:
            p.add("evaluation.path", raw.get("path"), problem)


def _npz_problem(path: Path) -> str | None:
    """Why ``path`` is not an ``.npz`` with arrays ``x`` and ``y`` of one length, or None.

    Reads the archive's directory and the two arrays' ``.npy`` headers only (NumPy format 1.0 and 2.0),
    never their data, and never unpickles.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            lengths = []
            for name in ("x", "y"):
                with archive.open(f"{name}.npy") as fh:
                    fmt = np.lib.format
                    major, _ = fmt.read_magic(fh)
                    read = fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0
                    shape, _, dtype = read(fh)
                    if dtype.hasobject:
                        return f"{name} holds Python objects (only numeric arrays are read)"
                    lengths.append(shape[0] if shape else -1)
    except KeyError as exc:
        return f"not an .npz with x and y (no {exc})"
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        return f"not an .npz with x and y ({exc})"
    if lengths[0] != lengths[1] or lengths[0] < 1:
        return f"x and y differ in length or are empty ({lengths[0]} and {lengths[1]} rows)"
    return None


def _check_security(p: Problems, c: SecurityRef, raw: Mapping[str, object], check_files: bool) -> None:
    if not check_files:
        return
    if c.signing_key_file is not None:
        _check_key_file(p, "security.signing_key_file", c.signing_key_file, raw, private=True)
    if c.device_keys_dir is not None:
        _check_key_dir(p, "security.device_keys_dir", c.device_keys_dir, raw)
    _check_library(p, c, ("signing_key_file", "device_keys_dir"), "security")


def _check_hierarchy(p: Problems, c: HierarchyConfig, raw: Mapping[str, object], check_files: bool) -> None:
    if c.role == "site" and c.site is None:
        p.add("hierarchy.site", None, "required when hierarchy.role = 'site'")
    if c.site is not None:
        check(p, "hierarchy.site", c.site, check_device_id)
    if c.expected_sites < 0:
        p.add("hierarchy.expected_sites", c.expected_sites, "must be >= 0")
    if c.expected_devices < 0:
        p.add("hierarchy.expected_devices", c.expected_devices, "must be >= 0")
    if c.site_devices < 0:
        p.add("hierarchy.site_devices", c.site_devices, "must be >= 0")
    if not c.close_margin_s >= 0:
        p.add("hierarchy.close_margin_s", c.close_margin_s, "must be >= 0")
    if c.role == "root" and c.site_devices == 0:
        why = "required when hierarchy.role = 'root': the most devices one site has (a site whose key"
        p.add("hierarchy.site_devices", 0, why + " was stolen may claim no more)")
    if c.role == "root" and c.site_keys_dir is None and not c.allow_unsigned_sites:
        why = "required when hierarchy.role = 'root' (or set hierarchy.allow_unsigned_sites = true)"
        p.add("hierarchy.site_keys_dir", None, why)
    if not check_files:
        return
    if c.site_keys_dir is not None:
        _check_key_dir(p, "hierarchy.site_keys_dir", c.site_keys_dir, raw)
    if c.root_key_file is not None:
        _check_key_file(p, "hierarchy.root_key_file", c.root_key_file, raw, private=False)
    _check_library(p, c, ("site_keys_dir", "root_key_file"), "hierarchy")


def _check_key_file(p: Problems, key: str, path: Path, raw: Mapping[str, object], *, private: bool) -> None:
    """Problem of ``key`` unless ``path`` holds an Ed25519 private (or public) key, hex or PEM."""
    from edgefl.wire.signing import load_signing_key, load_verify_key

    name = key.rpartition(".")[2]
    problem = file_problem(path, raw.get(name))
    if problem is None:
        try:
            (load_signing_key if private else load_verify_key)(path)
        except (OSError, ValueError) as exc:
            problem = str(exc)
    if problem is not None:
        p.add(key, raw.get(name), problem)


def _check_key_dir(p: Problems, key: str, path: Path, raw: Mapping[str, object]) -> None:
    """Problem of ``key`` unless ``path`` is a folder whose ``*.pub`` files all hold public keys."""
    from edgefl.wire.signing import load_verify_keys

    name = key.rpartition(".")[2]
    if not path.is_dir():
        p.add(key, raw.get(name), "not a folder")
        return
    try:
        load_verify_keys(path)
    except (OSError, ValueError) as exc:
        p.add(key, raw.get(name), str(exc))


def _check_library(p: Problems, c: object, names: tuple[str, ...], table: str) -> None:
    """Note (once per profile) a configured key with no Ed25519 library to use it."""
    from edgefl.wire.signing import library_problem

    for name in names:
        why = library_problem(f"{table}.{name}") if getattr(c, name) is not None else None
        if why is not None and not any("edgefl[security]" in q for q in p.items):
            p.note(why)
            return


def _check_files(p: Problems, c: FilesConfig, raw: Mapping[str, object], check_files: bool) -> None:
    """Each output file must be writable where it is named (checked without writing anything)."""
    if not check_files:
        return
    for name in ("state", "log", "json"):
        path = getattr(c, name)
        problem = output_file_problem(path) if path is not None else None
        if problem is not None:
            p.add(f"files.{name}", raw.get(name, str(path)), problem)


def combination_problems(profile: CoordinatorProfile) -> list[str]:
    """Problems of keys that are valid alone but not together (each names its dotted key).

    FedBuff aggregates as updates arrive and has no site/root form; DP's noisy mean wraps the FedAvg
    family only (its sensitivity bound is a mean's), so a robust strategy under DP is refused here,
    before the strategy is built.

    Parameters
    ----------
    profile : CoordinatorProfile

    Returns
    -------
    list of str
        ``key = value: reason`` lines; empty when the combination can run.
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


_TABLES: Final[dict[str, type[Any]]] = {
    "broker": BrokerConfig,
    "fleet": FleetConfig,
    "model": ModelRef,
    "rounds": RoundsConfig,
    "strategy": StrategyConfig,
    "robustness": RobustnessConfig,
    "privacy": PrivacyConfig,
    "evaluation": EvaluationConfig,
    "dashboard": DashboardConfig,
    "security": SecurityRef,
    "files": FilesConfig,
    "hierarchy": HierarchyConfig,
}
_CHECKS: Final[dict[str, Check]] = {
    "broker": check_broker,
    "fleet": _check_fleet,
    "model": _check_model,
    "rounds": _check_rounds,
    "strategy": _check_strategy,
    "robustness": _check_robustness,
    "privacy": _check_privacy,
    "evaluation": _check_evaluation,
    "dashboard": check_dashboard,
    "security": _check_security,
    "files": _check_files,
    "hierarchy": _check_hierarchy,
}
SCHEMA: Final = Schema(_TABLES, _CHECKS, {"model.path": Path("_")})
"""The coordinator profile's tables, checks and parser."""

#: Tables only a coordinator profile has: how ``edgefl check-config`` tells the two kinds apart.
COORDINATOR_TABLES: Final = frozenset(
    {"fleet", "rounds", "strategy", "robustness", "privacy", "evaluation", "files", "hierarchy"}
)


def is_coordinator_profile(data: Mapping[str, object]) -> bool:
    """True when a parsed TOML mapping is a coordinator profile (it has a coordinator-only table)."""
    return any(name in COORDINATOR_TABLES for name in data)


def load_coordinator_profile(
    path: Path | str, overrides: Mapping[str, object] | None = None, *, check_files: bool = True
) -> CoordinatorProfile:
    """Read a coordinator TOML profile, apply ``--set`` overrides, validate it.

    Parameters
    ----------
    path : Path or str
        The ``.toml`` file; relative paths inside it resolve against its folder.
    overrides : Mapping[str, object] or None
        ``{"table.key": value}`` on top of the file (strings coerced; relative paths from the working
        directory).
    check_files : bool
        Check that the model, key and evaluation files exist and the model's sha256 matches, and that
        the output files (``[files]``) can be written where they are named (nothing is written).

    Returns
    -------
    CoordinatorProfile

    Raises
    ------
    ConfigError
        Every problem at once, e.g. ``["rounds.count = 0: must be > 0", "[bogus]: unknown table"]``.
    """
    file, data = read_toml(path)
    if "device" in data:
        raise ConfigError([f"{file}: a device profile (it has [device]); run it with 'edgefl run'"])
    built = SCHEMA.parse(data, file.parent, check_files, overrides or {})
    profile = CoordinatorProfile(path=file, **built)
    problems = combination_problems(profile)
    if problems:
        raise ConfigError(problems)
    return profile
