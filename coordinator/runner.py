"""``edgefl coordinator [PROFILE] [--set key=value ...]``: the coordinator as a long-running service.

Its settings come from a coordinator profile (:mod:`edgefl.coordinator.profile`; the shipped example
is ``firmware_configs/coordinator.toml``); flags are overrides on top of it. It locks its state file
and checks the fleet's lease on the broker (:mod:`edgefl.coordinator.lease`) before it writes or
publishes anything, connects as the profile says (``mqtts://`` always verifies the broker;
credentials from the profile), resumes from its state file after a restart (the open round
included), prints one line per round on stdout, appends one JSON line per closed round to
``files.log``, writes a summary to ``files.json``, and evaluates each new head on a central set when
there is one (``[evaluation]``, or the digits test split for the shipped digits model).

With ``rounds.count = 0`` (the shipped default) it runs until SIGTERM/SIGINT, opening a round when
the pacing allows (``rounds.interval_s``, ``rounds.min_new_samples``, ready devices); a stop leaves
the open round in the state file (resumed at the restart) and exits 0. With ``rounds.count = N`` it
runs N rounds back to back and exits.

Exit codes: 0 done (or stopped); 1 invalid profile, or the broker refused its credentials; 3 the
model could not be loaded; 4 a runtime error at start-up (broker unreachable, bad key file, the fleet
page's port in use); 5 the job ended with a round that aggregated nothing (the reason is the last line
on stderr); 6 another coordinator runs this fleet (its state file is locked, or a live coordinator
holds the fleet's lease on the broker).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

from edgefl.aio import within
from edgefl.coordinator.hierarchy import RootCoordinator, SiteAggregator, SiteRecord
from edgefl.coordinator.lease import Lease, LeaseHeld, new_instance, probe_lease
from edgefl.coordinator.privacy import DPFedAvg
from edgefl.coordinator.profile import CoordinatorProfile, load_coordinator_profile
from edgefl.coordinator.rounds import Pacing
from edgefl.coordinator.service import HISTORY_ROUNDS, Coordinator, RoundRecord
from edgefl.coordinator.strategies import make_strategy
from edgefl.coordinator.strategy import Strategy
from edgefl.errors import ConfigError, ModelError, TransportError, UpdateRejected
from edgefl.profiles import DashboardConfig, broker_password
from edgefl.records import atomic_write
from edgefl.runtime import Backbone
from edgefl.tlsconf import ssl_context_for
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.types import F32
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import HeadLayout
from edgefl.wire.signing import load_signing_key, load_verify_key, load_verify_keys

logger = logging.getLogger(__name__)


EXIT_OK: Final = 0
EXIT_INVALID: Final = 1
EXIT_MODEL: Final = 3
EXIT_RUNTIME: Final = 4
EXIT_EMPTY_ROUND: Final = 5
EXIT_LEASE: Final = 6

StateLock = Callable[[Path], object]
"""Locks a state file for as long as the returned object lives (raises ``LeaseHeld`` when held)."""

COORDINATOR_RECONNECT_MAX_S: Final = 5.0
"""Cap of the coordinator's reconnect back-off, seconds (devices keep the transport's 30 s: a fleet must
not reconnect in lock-step; one coordinator may retry sooner, and a 60 s root outage closed its
round 25 s after the broker was back with 30 s)."""

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


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``coordinator`` sub-command to an ``argparse`` sub-parsers object.

    Returns
    -------
    argparse.ArgumentParser
        The sub-command's parser (``func`` set to :func:`main`).
    """
    from edgefl.resources import shipped

    p: argparse.ArgumentParser = sub.add_parser(
        "coordinator",
        help="run the coordinator of a fleet",
        description="Run federated rounds for one fleet over MQTT, as a coordinator profile says; flags "
        "override the profile's keys. Exit codes: 0 done, 1 invalid profile or credentials refused, 2 usage "
        "(a bad flag or --set), 3 model error, 4 start-up error (broker unreachable, fleet page port in "
        "use), 5 a round aggregated nothing, 6 another coordinator runs this fleet.",
    )
    p.add_argument(
        "profile",
        nargs="?",
        default=str(shipped("firmware_configs/coordinator.toml")),
        help="coordinator TOML profile (default: %(default)s)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a profile key, e.g. --set rounds.count=20 (repeatable)",
    )
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

    Raises
    ------
    ConfigError
        If a ``--set`` item is not ``key=value``.
    """
    out: dict[str, object] = {}
    bad = []
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            bad.append(f"--set {item!r}: expected key=value")
        out[key.strip()] = value
    if bad:
        raise ConfigError(bad)
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is not None:
            out[key] = value
    if getattr(args, "dp_noise_multiplier", None) is not None:
        out["privacy.enabled"] = "true"  # the noise flag turns central DP on
    return out


def build_strategy(profile: CoordinatorProfile) -> Strategy:
    """The strategy a profile names: its parameters, the norm bound, and the DP wrapper when enabled.

    Raises
    ------
    ValueError
        On a bad combination (DP around median, trimmed mean or FedBuff) or out-of-range values.
    """
    st, rounds, rob, dp = profile.strategy, profile.rounds, profile.robustness, profile.privacy
    own = {
        k: v
        for k, v in {
            "server_lr": st.server_lr,
            "server_momentum": st.server_momentum,
            "prox_mu": st.prox_mu,
            "tau": st.tau,
            "trim_fraction": st.trim_fraction,
            "max_updates": st.max_updates,
            "buffer_size": st.buffer_size,
            "max_staleness": st.max_staleness,
        }.items()
        if v is not None
    }
    strategy = make_strategy(
        st.name,
        local_epochs=rounds.local_epochs,
        lr=rounds.lr,
        batch_size=rounds.batch_size,
        min_clients=rounds.min_clients,
        deadline_s=rounds.deadline_s,
        clip_norm=rob.norm_bound,
        clip_multiplier=rob.adaptive_factor,
        tolerate=rob.tolerate,
        **own,
    )
    if not dp.enabled:
        return strategy
    return DPFedAvg(
        strategy,
        clip_norm=dp.clip_norm,
        noise_multiplier=dp.noise_multiplier,
        expected_clients=dp.expected_clients or float(rounds.min_clients),
        delta=dp.delta,
    )


#: The strategies' constructor arguments that another table's key sets (the rest are ``strategy.<name>``).
_ARGUMENT_KEYS: Final = {
    "clip_norm": "robustness.norm_bound",
    "clip_multiplier": "robustness.adaptive_factor",
}


def strategy_problems(profile: CoordinatorProfile) -> list[str]:
    """Why :func:`build_strategy` refuses ``profile``, each line naming its dotted key; empty if it builds.

    ``edgefl check-config`` and ``edgefl coordinator`` both ask (the coordinator before it connects),
    so a profile that one accepts the other runs. Building a strategy allocates nothing of the head.
    """
    name = profile.strategy.name
    try:
        build_strategy(profile)
    except TypeError as exc:  # an option the named strategy does not take (server_momentum for median)
        arg = str(exc).rpartition("argument ")[2].strip("'\" ")
        key = _ARGUMENT_KEYS.get(arg, f"strategy.{arg}")
        table, _, field_name = key.partition(".")
        value = getattr(getattr(profile, table), field_name, None)
        return [f"{key} = {value!r}: not an option of strategy.name = {name!r}"]
    except ValueError as exc:
        key = "privacy.enabled" if profile.privacy.enabled and "DP" in str(exc) else "strategy.name"
        value = "true" if key == "privacy.enabled" else repr(name)
        return [f"{key} = {value}: {exc}"]
    return []


Evaluation = Callable[[CoordinatorProfile, Backbone], Callable[[F32, F32], float] | None]
"""Builds the central evaluation of a head for a profile and backbone (None: no central set)."""

PageServer = Callable[
    [DashboardConfig, str, Callable[[], Mapping[str, Any]], Callable[[], Sequence[Mapping[str, Any]]]],
    Awaitable[tuple[Callable[[], Awaitable[None]], int]],
]
"""Serves the fleet page: ``(dashboard config, title, get_status, get_rounds) -> (stop, port)``; given by
the CLI."""


def main(
    args: argparse.Namespace,
    evaluation: Evaluation | None = None,
    page: PageServer | None = None,
    lock: StateLock | None = None,
) -> int:
    """Run the coordinator until the profile's rounds closed or SIGTERM; returns the exit code.

    Parameters
    ----------
    args : the parsed command line (see :func:`add_parser`)
    evaluation : builds the central evaluation; given by the composition root (``edgefl.cli``)
    page : serves the fleet page when ``dashboard.enabled``; given by the composition root
    lock : locks the state file (``files.state``, with a lock file beside it) for this process's life, raising
        :class:`~edgefl.coordinator.lease.LeaseHeld` when another process holds it; given by the
        composition root (the agents' ``flock``)
    """
    try:
        profile = load_coordinator_profile(args.profile, overrides_from(args))
    except ConfigError as exc:
        print(f"edgefl coordinator: invalid profile {args.profile}:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_INVALID
    problems = strategy_problems(profile)  # a combination no strategy accepts is a profile problem
    if problems:
        print(f"edgefl coordinator: invalid profile {args.profile}:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_INVALID
    held: object = None
    try:
        if lock is not None and profile.files.state is not None:
            held = lock(profile.files.state)  # kept until this function returns
        return asyncio.run(run(profile, evaluation, page))
    except LeaseHeld as exc:
        print(f"edgefl coordinator: {exc}", file=sys.stderr)
        return EXIT_LEASE
    except OSError as exc:  # the state file's folder or lock cannot be created
        print(f"edgefl coordinator: cannot start: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except ModelError as exc:
        print(f"edgefl coordinator: model error: {exc}", file=sys.stderr)
        return EXIT_MODEL
    except CredentialsRefused as exc:
        print(f"edgefl coordinator: cannot start: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except (ConfigError, TransportError) as exc:
        print(f"edgefl coordinator: cannot start: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        del held  # the lock is released with its file (or the process's end)


def _log_missing_rounds(log: Path, coord: Coordinator, strategy: str) -> int:
    """Append the rounds the state file closed but ``log`` does not have; returns how many.

    The state is saved before the round's line is appended, so a coordinator killed between the two
    (seen in the chaos test) comes back with a round the log never got. Its line is rebuilt from the
    state's history and counted update ids, marked ``"recovered": true``.
    """
    logged: set[int] = set()
    with contextlib.suppress(FileNotFoundError):
        for line in log.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                logged.add(int(json.loads(line)["round"]))
    last = max(logged, default=0)
    missing = [h for h in coord.state.history if h.round > last]
    if not missing:
        return 0
    # the version each round published: the state's for the last, one less before each round that
    # published a head (a round with updates whose aggregate was not refused)
    versions: list[int] = []
    v = coord.state.version
    for rec in reversed(missing):
        versions.append(v)
        v -= int(rec.clients > 0 and not rec.refused)
    versions.reverse()
    with open(log, "a") as f:
        for rec, version in zip(missing, versions, strict=True):
            closed = rec.closed_unix if math.isfinite(rec.closed_unix) else time.time()
            entry = {
                "round": rec.round,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(closed)),
                "asked": rec.asked,
                "counted": rec.clients,
                "refused": {},  # the refusals by reason were not saved
                "declined": {},
                "clients": rec.clients,
                "accuracy": None if math.isnan(rec.accuracy) else rec.accuracy,
                "update_bytes_mean": rec.update_bytes_mean,
                "duration_s": rec.duration_s,
                "update_ids": coord.counted.get(rec.round, []),
                "version": version,
                "strategy": strategy,
                "lr": rec.lr if math.isfinite(rec.lr) else None,
                "new_samples": rec.new_samples if rec.new_samples >= 0 else None,
                "round_refused": rec.refused or None,
                "recovered": True,
            }
            f.write(json.dumps(entry) + "\n")
    logger.warning("appended %d round(s) the log missed (closed and saved before a restart)", len(missing))
    return len(missing)


class CredentialsRefused(TransportError):
    """The broker refused the coordinator's username/password (CONNACK 0x86/0x87): a configuration error."""


async def _connected_or_refused(transport: MqttTransport, where: str, timeout_s: float) -> None:
    """Wait until ``transport`` is connected.

    Raises
    ------
    CredentialsRefused
        As soon as the broker refuses the credentials (retrying cannot help: exit 1, not restarted).
    TransportError
        If no connection is up within ``timeout_s`` seconds (exit 4: the service restarts it).
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not transport.connected.is_set():
        if transport.credentials_refused:
            raise CredentialsRefused(
                f"broker {where} refused our credentials ({transport.last_refusal}): check [broker] "
                "username and password_file against the broker's password file and ACL"
            )
        left = end - loop.time()
        if left <= 0:
            raise TransportError(f"broker {where} not reachable within {timeout_s:.0f} s")
        with contextlib.suppress(TimeoutError):
            await within(transport.connected.wait(), min(0.2, left))


def _by_reason(counts: Mapping[str, int]) -> str:
    """``"a 1, b 2"`` for ``{"a": 1, "b": 2}`` (sorted by reason), ``""`` when empty."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _empty_cause(refused: Mapping[str, int], declined: Mapping[str, int], online: int) -> str:
    """Why a round aggregated nothing: its declines and refusals by reason, and the devices online."""
    parts = []
    if declined:
        parts.append(f"declined: {_by_reason(declined)}")
    if refused:
        parts.append(f"refused: {_by_reason(refused)}")
    if not parts:
        parts.append("no update arrived")
    parts.append(f"{_plural(online, 'device')} online")
    return "; ".join(parts)


def _round_line(
    rec: RoundRecord,
    total: int,
    refused: Mapping[str, int],
    declined: Mapping[str, int] | None = None,
    per: str = "update",
) -> str:
    why = _by_reason(refused) or "none"
    if declined:
        why += f", declined: {_by_reason(declined)}"
    acc = "n/a" if math.isnan(rec.accuracy) else f"{rec.accuracy:.3f}"
    extra = f", {rec.clipped} clipped" if rec.clipped else ""
    if rec.fed_devices:
        extra += (
            f", federated accuracy {rec.fed_accuracy:.3f} (worst decile {rec.fed_worst_decile:.3f}, "
            f"{rec.fed_devices} devices)"
        )
    if not math.isnan(rec.epsilon):
        extra += f", privacy epsilon {rec.epsilon:.3g} at delta {rec.delta:g}"
    if rec.refused:
        extra += f", ROUND REFUSED ({rec.refused}): head kept"
    # "N/M clients": N updates counted of the M devices asked, in every round and on the fleet page
    number = f"{rec.round}/{total}" if total else f"{rec.round}"
    return (
        f"round {number}: {rec.clients}/{rec.asked} clients, refused: {why}, accuracy {acc}, "
        f"{rec.update_bytes_mean:.0f} B/{per}, {rec.duration_s:.2f} s{extra}"
    )


async def run(
    profile: CoordinatorProfile, evaluation: Evaluation | None = None, page: PageServer | None = None
) -> int:
    """Run the job a coordinator profile describes; returns the exit code (see the module docstring).

    ``evaluation`` builds the central evaluation of each new head (None: no central evaluation);
    ``page`` serves the fleet page when the profile's ``[dashboard]`` is enabled.

    Raises
    ------
    ModelError
        If the backbone cannot be loaded.
    ConfigError
        If a key, TLS or evaluation file cannot be used.
    CredentialsRefused
        If the broker refuses the profile's username/password.
    TransportError
        If the broker cannot be reached within 60 s.
    """
    backbone = Backbone(profile.model.path)
    W0, b0 = backbone.head_from_model()
    evaluate = evaluation(profile, backbone) if evaluation is not None else None
    broker, rounds, files = profile.broker, profile.rounds, profile.files
    fleet = profile.fleet.name
    hier = profile.hierarchy
    client_id = f"edgefl-site-{hier.site}-{fleet}" if hier.role == "site" else f"edgefl-coordinator-{fleet}"
    topics = Topics(broker.topic_prefix, fleet)
    where = f"{broker.scheme}://{broker.host}:{broker.port}"
    instance = new_instance()
    leased = hier.role != "site"  # one coordinator per fleet; a site is one per site broker

    def transport_for(cid: str, *, persistent: bool, probe: bool = False) -> MqttTransport:
        return MqttTransport(
            broker.host,
            broker.port,
            cid,
            protocol=broker.protocol,
            keepalive_s=broker.keepalive_s,
            username=broker.username,
            password=broker_password(broker),
            tls_context=ssl_context_for(broker),
            max_packet_bytes=broker.max_packet_bytes,
            max_incoming_packet_bytes=broker.max_incoming_packet_bytes,
            # A persistent session: updates published while the coordinator restarts wait for it
            session_expiry_s=3600 if persistent or probe else 0,
            alternates=broker.alternate_addresses,  # the other nodes of a clustered broker, tried in turn
            # an update is acknowledged once the state file holds it: a SIGKILL loses none
            ack_on_commit=probe or (persistent and files.state is not None),
            # one client, not a fleet: back within ~5 s of its broker (a root's partials wait for it)
            reconnect_max_s=COORDINATOR_RECONNECT_MAX_S,
            will=Lease.will(topics.coordinator) if persistent and leased else None,
        )

    if leased:  # before anything is published or written: is a live coordinator running this fleet?
        probe = transport_for(f"{client_id}-probe-{instance[:8]}", persistent=False, probe=True)
        await probe_lease(
            probe,
            topics.coordinator,
            f"fleet {fleet} on broker {where}",
            lambda t: _connected_or_refused(t, where, 60.0),
        )
    transport = transport_for(client_id, persistent=True)
    st = profile.strategy
    try:
        strategy = build_strategy(profile)
    except ValueError as exc:
        raise ConfigError([f"[strategy]/[privacy]: {exc}"]) from exc
    sec = profile.security
    role_kwargs: dict[str, Any] = {}
    cls: type[Coordinator] = Coordinator
    if hier.role == "root":
        cls = RootCoordinator
        if hier.site_keys_dir is None:  # the profile refuses this unless allow_unsigned_sites
            logger.warning(
                "hierarchy.allow_unsigned_sites = true: partials are NOT verified; anyone who can "
                "publish on %s sets the global head",
                topics.partial("+"),
            )
        role_kwargs = {
            "site_keys": load_verify_keys(hier.site_keys_dir) if hier.site_keys_dir else None,
            "expected_sites": hier.expected_sites,
            "site_devices": hier.site_devices,
        }
    elif hier.role == "site":
        cls = SiteAggregator
        role_kwargs = {
            "site": hier.site,
            "root_key": load_verify_key(hier.root_key_file) if hier.root_key_file else None,
            "expected_devices": hier.expected_devices,
            "close_margin_s": hier.close_margin_s,
            "site_state": files.state,
        }
    job = rounds.count > 0  # N rounds back to back; 0: a service, paced
    coord = cls(
        transport,
        topics,
        W0,
        b0,
        model_sha256=backbone.backbone_sha256,
        strategy=strategy,
        evaluate=evaluate,
        compression=Compression(rounds.compression),
        downlink=HeadLayout(rounds.downlink),
        lr_decay=rounds.lr_decay,
        signing_key=load_signing_key(sec.signing_key_file) if sec.signing_key_file else None,
        device_keys=load_verify_keys(sec.device_keys_dir) if sec.device_keys_dir else None,
        max_packet_bytes=broker.max_packet_bytes,
        max_devices=profile.fleet.max_devices,
        device_expiry_s=profile.fleet.device_expiry_s,
        quorum=rounds.quorum,
        pacing=pacing_for(profile),
        **role_kwargs,
    )

    def mismatch(device: str, why: str) -> None:
        print(f"device {device} runs another model ({why}): left out of rounds", flush=True)

    coord.on_mismatch = mismatch
    if isinstance(coord, SiteAggregator):
        transport.on_connect_cb = coord.on_transport_connect
        return await _run_site(coord, profile, transport, page)
    lease = Lease(transport, topics.coordinator, instance)
    stop = asyncio.Event()
    lease.on_lost = stop.set
    coord.on_lease_message = lease.handle

    def connected() -> None:
        coord.on_transport_connect()  # a broker that lost our session: announce again
        lease.on_connect()  # our presence again (the broker may have lost it, or a will cleared it)

    transport.on_connect_cb = connected
    loop = asyncio.get_running_loop()

    def stop_on(sig: signal.Signals) -> None:
        if not stop.is_set():
            state = "the open round saved, resumed at the next start" if files.state else "no state file"
            logger.info("%s: stopping at round %d (%s)", sig.name, coord.state.round, state)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop_on, sig)
    role = "" if hier.role == "flat" else f" ({hier.role} of {hier.expected_sites or 'any number of'} sites)"
    if job:
        what = f"{_plural(rounds.count, 'round')} of {st.name}"
    else:
        what = (
            f"rounds of {st.name} until stopped, at most one every {rounds.interval_s:g} s, each once the "
            f"ready devices report {rounds.min_new_samples} new samples"
        )
    print(f"coordinator{role} of fleet {fleet} at {where}: {what}, {strategy.tolerance()}", flush=True)
    stop_page: Callable[[], Awaitable[None]] | None = None
    if page is not None and profile.dashboard.enabled:
        dash = profile.dashboard
        try:
            stop_page, port = await page(
                dash, f"fleet {fleet}", coord.dashboard_status, coord.dashboard_rounds
            )
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise ConfigError(
                [f"dashboard.port = {dash.port}: cannot serve the fleet page on {dash.host} ({why})"]
            ) from exc
        print(f"fleet page: http://{profile.dashboard.host}:{port}/", flush=True)
    records: list[RoundRecord] = []
    empty: list[str] = []
    pump: asyncio.Task[None] | None = None
    holding: asyncio.Task[None] | None = None
    try:
        if files.state is not None:
            try:
                coord.load_state(files.state)
            except UpdateRejected as exc:
                raise ConfigError([f"files.state = {str(files.state)!r}: {exc}"]) from exc
            coord.state_path = files.state
            if files.log is not None:
                _log_missing_rounds(files.log, coord, strategy.name)
        elif profile.privacy.enabled:
            why = "privacy.enabled without files.state: the privacy accountant starts again at every start"
            print(f"warning: {why}", flush=True)
            logger.warning("%s", why)
        await transport.start(wait_s=None)
        pump = asyncio.create_task(coord.pump())
        await _connected_or_refused(transport, where, 60.0)
        holding = asyncio.create_task(lease.hold())
        await coord.start()
        # watch the lease while running: a live coordinator that took the fleet first makes this one
        # stop (exit 6), a cleared lease is published again (the transport renews it after a reconnect)
        await transport.subscribe(topics.coordinator, 1)
        if job and coord.state.round >= rounds.count:
            print(
                f"nothing to do: fleet {fleet} is at round {coord.state.round} of {rounds.count} "
                "(raise rounds.count or use a new fleet.name)",
                flush=True,
            )
        elif rounds.expected_clients:
            await _wait_for_expected(coord, rounds.expected_clients, rounds.wait_devices_s, stop)
        while not stop.is_set() and not (job and coord.state.round >= rounds.count):
            if not job and not coord.resuming and not await coord.wait_to_open(stop):
                break
            r = coord.state.round + 1
            refused_before = Counter(coord.state.rejected)
            declined_before = Counter(coord.state.declined)
            runner = asyncio.create_task(coord.run_round(r))
            stopper = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if runner not in done:  # stopped: the open round stays in the state file, resumed at restart
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner
                break
            rec = runner.result()
            records.append(rec)
            del records[:-HISTORY_ROUNDS]  # the summary keeps the last rounds; the round log has them all
            refused_round = _since(coord.state.rejected, refused_before)
            declined_round = _since(coord.state.declined, declined_before)
            coord.note_round_reasons(rec.round, refused_round, declined_round)
            if files.state is not None:
                coord.save_state(files.state)
            # at the root the messages in are the sites' partials (~41 kB for 512x10 float64 sums)
            per = "partial" if isinstance(coord, RootCoordinator) else "update"
            line = _round_line(rec, rounds.count, refused_round, declined_round, per)
            print(line, flush=True)
            logger.info("%s", line)
            if rec.clients == 0 and job:
                why = _empty_cause(refused_round, declined_round, len(coord.online_devices()))
                empty.append(f"round {rec.round} aggregated nothing ({why})")
            elif rec.refused == "too_few" and job:  # abandoned: fewer updates than tolerate needs
                need = f"{strategy.name} needs {strategy.min_updates}"
                why = f"{rec.clients} updates, {need}: {strategy.tolerance()}"
                empty.append(f"round {rec.round} aggregated nothing (abandoned: {why})")
            if files.log is not None:
                entry = _log_entry(coord, rec, strategy, refused_round, declined_round)
                with open(files.log, "a") as f:
                    f.write(json.dumps(entry) + "\n")
        coord.finished = True
        coord.notify()
    finally:
        if pump is not None:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        if holding is not None:
            holding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holding
        if files.state is not None and coord.state_path is not None and not lease.lost.is_set():
            with contextlib.suppress(OSError):
                coord.save_state(files.state)  # an open round, as it stands: resumed at the restart
        if not lease.lost.is_set():
            await lease.release()
        await transport.stop()
        if stop_page is not None:
            await stop_page()
    if lease.lost.is_set():
        print(
            f"edgefl coordinator: another coordinator runs this fleet ({lease.lost_to}): stopped",
            file=sys.stderr,
        )
        return EXIT_LEASE
    if files.json is not None:
        summary = {
            "fleet": fleet,
            "strategy": st.name,
            "rounds": [
                {
                    k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in asdict(rec).items()
                }
                for rec in records
            ],
            "refused": dict(coord.state.rejected),
            "empty_rounds": empty,
        }
        atomic_write(files.json, (json.dumps(summary, indent=2, allow_nan=False) + "\n").encode())
    if empty:
        print(
            f"edgefl coordinator: {len(empty)} round(s) aggregated nothing; first: {empty[0]}",
            file=sys.stderr,
        )
        return EXIT_EMPTY_ROUND
    return EXIT_OK


def pacing_for(profile: CoordinatorProfile) -> Pacing:
    """When the next round opens (a job's at once; a root's by time only; a flat one's by all three).

    A root's devices report to their sites' brokers, not to it: it paces by ``rounds.interval_s``.
    """
    rounds = profile.rounds
    if rounds.count > 0:
        return Pacing(0.0, 0, 1)
    if profile.hierarchy.role == "root":
        return Pacing(rounds.interval_s, 0, 0)
    return Pacing(rounds.interval_s, rounds.min_new_samples, rounds.min_clients)


def _since(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """The counts by reason ``now`` has more of than ``before`` (one round's refusals or declines)."""
    # str(): a reason label (a StrEnum) prints as its value, never as the enum's repr
    return {str(k): v - before.get(k, 0) for k, v in sorted(now.items()) if v > before.get(k, 0)}


def _log_entry(
    coord: Coordinator,
    rec: RoundRecord,
    strategy: Strategy,
    refused: Mapping[str, int],
    declined: Mapping[str, int],
) -> dict[str, Any]:
    """One closed round's line of ``files.log`` (``docs/operations.md``, "The round log")."""
    closed = rec.closed_unix if math.isfinite(rec.closed_unix) else time.time()
    entry: dict[str, Any] = {
        "round": rec.round,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(closed)),
        "asked": rec.asked,
        "counted": rec.clients,
        "refused": dict(refused),
        "declined": dict(declined),
        "clients": rec.clients,
        "accuracy": rec.accuracy,
        "update_bytes_mean": rec.update_bytes_mean,
        "duration_s": rec.duration_s,
        "refused_updates": dict(refused),
        "update_ids": coord.counted.get(rec.round, []),
        "version": coord.state.version,
        "strategy": strategy.name,
        "lr": rec.lr if math.isfinite(rec.lr) else None,
        "new_samples": rec.new_samples if rec.new_samples >= 0 else None,
        "clipped": rec.clipped,
        "clipped_by_device": dict(strategy.clipped),  # since the start of this process
        "norm_bound": rec.norm_bound if math.isfinite(rec.norm_bound) else None,
        "epsilon": None if math.isnan(rec.epsilon) else rec.epsilon,
        "delta": None if math.isnan(rec.delta) else rec.delta,
        "round_refused": rec.refused or None,
    }
    if isinstance(coord, RootCoordinator):  # since the start of this process
        # update_bytes_mean is kept (same key as a flat run); at the root it is this
        entry["partial_bytes_mean"] = rec.update_bytes_mean
        entry["partials"] = coord.partials_received
        entry["partial_bytes"] = coord.partial_bytes
        entry["duplicate_partials"] = coord.duplicates
    return entry


async def _wait_for_expected(coord: Coordinator, n: int, timeout_s: float, stop: asyncio.Event) -> None:
    """Wait for ``n`` ready devices before round 1 (``rounds.expected_clients``), ``timeout_s`` at most."""
    waiting = asyncio.create_task(coord.wait_for_devices(n, timeout_s=timeout_s))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiting, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not waiting.done():  # SIGTERM while waiting for the devices
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        return
    try:
        waiting.result()
    except TimeoutError as exc:
        print(f"{exc}; starting the rounds anyway", flush=True)
        logger.warning("%s; starting the rounds anyway", exc)


async def _run_site(
    site: SiteAggregator, profile: CoordinatorProfile, transport: MqttTransport, page: PageServer | None
) -> int:
    """The site role's job: one partial per round the root announces, up to round ``rounds.count``.

    It ends when the root published the head of that round (till then a partial is sent again when the
    root re-runs its round), or on SIGTERM.

    Prints ``site S round R: N updates, B bytes up, T s`` per round; appends one JSON line per round
    to ``files.log`` (``round``, ``site``, ``updates``, ``partial_bytes``, ``duration_s``,
    ``update_ids``, ``refused_updates``). Exit code 0, or 4 when the broker is unreachable.
    """
    broker, rounds, files = profile.broker, profile.rounds, profile.files
    where = f"{broker.scheme}://{broker.host}:{broker.port}"
    last_round = rounds.count or sys.maxsize  # 0: the root's rounds until stopped
    span = f"rounds 1-{rounds.count}" if rounds.count else "the root's rounds until stopped"
    print(f"site {site.site} of fleet {profile.fleet.name} at {where}: {span}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    stop_page: Callable[[], Awaitable[None]] | None = None
    if page is not None and profile.dashboard.enabled:
        stop_page, port = await page(
            profile.dashboard, f"site {site.site}", site.dashboard_status, site.dashboard_rounds
        )
        print(f"site page: http://{profile.dashboard.host}:{port}/", flush=True)
    await transport.start(wait_s=None)
    pump = asyncio.create_task(site.pump())
    try:
        try:
            await within(transport.connected.wait(), 60)
        except TimeoutError as exc:
            raise TransportError(f"broker {where} not reachable within 60 s") from exc
        try:
            await site.start()
        except UpdateRejected as exc:
            raise ConfigError([f"files.state = {str(files.state)!r}: {exc}"]) from exc
        print(
            f"site {site.site}: ready, waiting for the root's round {site.closed_round + 1} "
            f"(last round closed here: {site.closed_round or 'none'})",
            flush=True,
        )
        while not stop.is_set():
            refused_before = Counter(site.state.rejected)
            runner = asyncio.create_task(_next_site_round(site, last_round))
            stopper = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if runner not in done:
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner
                break
            rec = runner.result()
            if rec is None:  # the root published the head of the last round
                break
            refused = Counter(site.state.rejected)
            refused.subtract(refused_before)
            refused_round = {str(k): v for k, v in refused.items() if v > 0}  # labels as values, not reprs
            print(
                f"site {site.site} round {rec.round}: {rec.updates} updates, {rec.partial_bytes} bytes up, "
                f"{rec.duration_s:.2f} s, refused: {refused_round or 'none'}",
                flush=True,
            )
            if files.log is not None:
                entry = {
                    "round": rec.round,
                    "site": site.site,
                    "updates": rec.updates,
                    "partial_bytes": rec.partial_bytes,
                    "duration_s": rec.duration_s,
                    "update_ids": list(rec.update_ids),
                    "refused_updates": refused_round,
                }
                with open(files.log, "a") as f:
                    f.write(json.dumps(entry) + "\n")
    finally:
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
        await transport.stop()
        if stop_page is not None:
            await stop_page()
    return EXIT_OK


async def _next_site_round(site: SiteAggregator, last_round: int) -> SiteRecord | None:
    ann = await site.next_round(last_round)
    return None if ann is None else await site.run_site_round(ann)
