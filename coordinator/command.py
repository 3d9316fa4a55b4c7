"""``edgefl coordinator [PROFILE] [--set key=value ...]``: the command line of the coordinator service.

Flags override the profile; :func:`main` turns what stopped the service into an exit code (each with
its cause in ``docs/operations.md``, "The coordinator").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from edgefl.coordinator.lease import AccountInUse, LeaseHeld
from edgefl.coordinator.profile import CoordinatorProfile, load_coordinator_profile
from edgefl.coordinator.runner import (
    EXIT_FAULT,
    EXIT_INVALID,
    EXIT_LEASE,
    EXIT_MODEL,
    EXIT_RUNTIME,
    AccessRefused,
    Evaluation,
    PageServer,
    run,
    strategy_problems,
)
from edgefl.errors import ConfigError, CredentialsRefused, ModelError, TransportError
from edgefl.profiles import add_set_argument, parse_sets, print_problems

logger = logging.getLogger(__name__)

StateLock = Callable[[Path], object]
"""Locks a state file for as long as the returned object lives (raises ``LeaseHeld`` when held)."""

#: ``--flag`` → profile key: the flags are overrides of the profile (``--set`` spells any key).
FLAG_KEYS: Final = {
    "broker": "broker.url",
    "prefix": "broker.topic_prefix",
    "max_packet_bytes": "broker.max_packet_bytes",
    "fleet": "fleet.name",
    "model": "model.path",
    "rounds": "rounds.count",
    "interval": "rounds.interval_s",
    "min_new_samples": "rounds.min_new_samples",
    "quorum": "rounds.quorum",
    "min_clients": "rounds.min_clients",
    "deadline": "rounds.deadline_s",
    "wait_devices": "rounds.expected_clients",
    "local_epochs": "rounds.local_epochs",
    "lr": "rounds.lr",
    "lr_decay": "rounds.lr_decay",
    "batch_size": "rounds.batch_size",
    "compression": "rounds.compression",
    "downlink": "rounds.downlink",
    "strategy": "strategy.name",
    "state": "files.state",
    "log": "files.log",
    "json": "files.json",
    "signing_key": "security.signing_key_file",
    "device_keys": "security.device_keys_dir",
    "clip_norm": "robustness.norm_bound",
    "clip_multiplier": "robustness.adaptive_factor",
    "tolerate": "robustness.tolerate",
    "trim_fraction": "strategy.trim_fraction",
    "max_updates": "strategy.max_updates",
    "buffer_size": "strategy.buffer_size",
    "max_staleness": "strategy.max_staleness",
    "dp_noise_multiplier": "privacy.noise_multiplier",
    "dp_clip_norm": "privacy.clip_norm",
    "dp_delta": "privacy.delta",
    "dp_expected_clients": "privacy.expected_clients",
    "role": "hierarchy.role",
    "site": "hierarchy.site",
    "expected_sites": "hierarchy.expected_sites",
}


#: What the flags whose name differs from their profile key's mean (the help puts the key after it).
FLAG_MEANING: Final = {
    "wait_devices": "wait for this many devices to be ready before round 1 (up to rounds.wait_devices_s) "
    "and expect as many clients a round; ",
    "clip_norm": "bound on each update's L2 norm at the coordinator (not the devices' training.clip_norm); ",
    "tolerate": "hostile devices every aggregated round withstands (sets each strategy's fewest "
    "updates a round); ",
}


#: What stopped :func:`main`, in order: the exception types, the words before the error, the exit code.
_FAILURES: Final[tuple[tuple[type[Exception] | tuple[type[Exception], ...], str, int], ...]] = (
    (LeaseHeld, "", EXIT_LEASE),
    (OSError, "cannot start: ", EXIT_RUNTIME),  # the state file's folder or lock cannot be created
    (ModelError, "model error: ", EXIT_MODEL),
    ((CredentialsRefused, AccessRefused, AccountInUse), "cannot start: ", EXIT_INVALID),
    ((ConfigError, TransportError), "cannot start: ", EXIT_RUNTIME),
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``coordinator`` sub-command to argparse sub-parsers; returns its parser (``func``: main).

    PROFILE defaults to the shipped ``firmware_configs/coordinator.toml``; each flag of :data:`FLAG_KEYS`
    is a ``--set`` of one key.
    """
    from edgefl.resources import shipped

    p: argparse.ArgumentParser = sub.add_parser(
        "coordinator",
        help="run the coordinator of a fleet",
        description="Run federated rounds for one fleet over MQTT, as a coordinator profile says; flags "
        "override the profile's keys. Exit codes: 0 done or stopped, 1 invalid profile, or credentials or "
        "the fleet's topics refused by the broker (its ACL), 2 usage "
        "(a bad flag or --set), 3 model error, 4 start-up error (broker unreachable, fleet page port in "
        "use), 5 a round aggregated nothing, 6 another coordinator runs this fleet, 75 a fault stopped it.",
    )
    p.add_argument(
        "profile",
        nargs="?",
        default=str(shipped("firmware_configs/coordinator.toml")),
        help="coordinator TOML profile (default: %(default)s)",
    )
    add_set_argument(p, "rounds.count=20")
    for flag, key in FLAG_KEYS.items():
        what = FLAG_MEANING.get(flag, "")
        p.add_argument(
            "--" + flag.replace("_", "-"),
            default=None,
            metavar="VALUE",
            help=f"{what}same as --set {key}=VALUE",
        )
    p.set_defaults(func=main)
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, object]:
    """The profile overrides a command line asks for: ``--set`` items, then the flags of :data:`FLAG_KEYS`.

    Raises ConfigError if a ``--set`` item is not ``key=value``.
    """
    out = parse_sets(args.set)
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is not None:
            out[key] = value
    if getattr(args, "dp_noise_multiplier", None) is not None:
        out["privacy.enabled"] = "true"  # the noise flag turns central DP on
    return out


def load_checked(path: str, overrides: Mapping[str, object]) -> tuple[CoordinatorProfile, list[str]]:
    """The profile at ``path`` with ``overrides``, and why no strategy accepts it (empty: one does).

    Raises ConfigError with every problem of the profile itself.
    """
    profile = load_coordinator_profile(path, overrides)
    return profile, strategy_problems(profile)


def main(
    args: argparse.Namespace,
    evaluation: Evaluation | None = None,
    page: PageServer | None = None,
    lock: StateLock | None = None,
) -> int:
    """Run the coordinator of the parsed command line until its rounds closed or SIGTERM; the exit code.

    From the composition root (``edgefl.cli``): ``evaluation`` builds the central evaluation, ``page``
    serves the fleet page, ``lock`` locks ``files.state`` for this process's life.
    """
    try:
        profile, problems = load_checked(args.profile, overrides_from(args))
    except ConfigError as exc:
        problems = exc.problems
    if problems:
        print_problems(f"edgefl coordinator: invalid profile {args.profile}", problems)
        return EXIT_INVALID
    held: object = None
    try:
        if lock is not None and profile.files.state is not None:
            held = lock(profile.files.state)  # kept until this function returns
        return asyncio.run(run(profile, evaluation, page))
    except Exception as exc:
        for kinds, what, code in _FAILURES:
            if isinstance(exc, kinds):
                print(f"edgefl coordinator: {what}{exc}", file=sys.stderr)
                return code
        # a bug or a fault nobody foresaw: restarted (exit 1 would not be)
        logger.error("coordinator stopped by an unexpected error (exit %d)", EXIT_FAULT, exc_info=exc)
        print(f"edgefl coordinator: stopped by a fault: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAULT
    finally:
        del held  # the lock is released with its file (or the process's end)
