"""``edgefl coordinator [PROFILE] [--set key=value ...]``: the coordinator as a long-running process.

Its settings come from a coordinator profile (:mod:`edgefl.coordinator.profile`; the shipped example
is ``firmware_configs/coordinator.toml``); flags are overrides on top of it. It connects as the profile
says (``mqtts://`` always verifies the broker; credentials from the profile), resumes from its state
file after a restart, prints one line per round on stdout, appends one JSON line per closed round to
``files.log``, writes a summary to ``files.json``, and evaluates each new head on a central set when
there is one (``[evaluation]``, or the digits test split for the shipped digits model).

Exit codes: 0 every round aggregated; 1 invalid profile, or the broker refused its credentials; 3 the
model could not be loaded; 4 a runtime error at start-up (broker unreachable, bad key file); 5 the
job ended with a round that aggregated nothing (the reason is the last line on stderr).
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
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

from edgefl.aio import within
from edgefl.coordinator.hierarchy import RootCoordinator, SiteAggregator, SiteRecord
from edgefl.coordinator.privacy import DPFedAvg
from edgefl.coordinator.profile import CoordinatorProfile, load_coordinator_profile
from edgefl.coordinator.service import Coordinator, RoundRecord
from edgefl.coordinator.strategy import Strategy, make_strategy
from edgefl.errors import ConfigError, ModelError, TransportError, UpdateRejected
from edgefl.profiles import DashboardConfig, broker_password
from edgefl.records import atomic_write
from edgefl.runtime import Backbone
from edgefl.tlsconf import ssl_context_for
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.types import F32
from edgefl.wire.compression import Compression
from edgefl.wire.messages import HeadLayout
from edgefl.wire.signing import load_signing_key, load_verify_key, load_verify_keys

logger = logging.getLogger(__name__)


EXIT_OK: Final = 0
EXIT_INVALID: Final = 1
EXIT_MODEL: Final = 3
EXIT_RUNTIME: Final = 4
EXIT_EMPTY_ROUND: Final = 5

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
    "clip_norm": "bound on each update's L2 norm at the coordinator (not the devices' "
    "training.clip_norm); ",
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
        "(a bad flag or --set), 3 model error, 4 start-up error, 5 a round aggregated nothing.",
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


Evaluation = Callable[[CoordinatorProfile, Backbone], Callable[[F32, F32], float] | None]
"""Builds the central evaluation of a head for a profile and backbone (None: no central set)."""

PageServer = Callable[
    [DashboardConfig, str, Callable[[], Mapping[str, Any]]],
    Awaitable[tuple[Callable[[], Awaitable[None]], int]],
]
"""Serves the fleet page: ``(dashboard config, title, get_status) -> (stop, port)``; given by the CLI."""


def main(
    args: argparse.Namespace, evaluation: Evaluation | None = None, page: PageServer | None = None
) -> int:
    """Run the coordinator until the profile's rounds closed or SIGTERM; returns the exit code.

    Parameters
    ----------
    args : the parsed command line (see :func:`add_parser`)
    evaluation : builds the central evaluation; given by the composition root (``edgefl.cli``)
    page : serves the fleet page when ``dashboard.enabled``; given by the composition root
    """
    try:
        profile = load_coordinator_profile(args.profile, overrides_from(args))
    except ConfigError as exc:
        print(f"edgefl coordinator: invalid profile {args.profile}:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_INVALID
    try:
        strategy = build_strategy(profile)  # a combination no strategy accepts is a profile problem
        if profile.hierarchy.role != "flat" and profile.strategy.name == "fedbuff":
            raise ValueError(f"hierarchy.role = {profile.hierarchy.role!r}: fedbuff runs flat only")
        del strategy
    except ValueError as exc:
        print(f"edgefl coordinator: invalid profile {args.profile}:", file=sys.stderr)
        print(f"  [strategy]/[privacy]: {exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        return asyncio.run(run(profile, evaluation, page))
    except ModelError as exc:
        print(f"edgefl coordinator: model error: {exc}", file=sys.stderr)
        return EXIT_MODEL
    except CredentialsRefused as exc:
        print(f"edgefl coordinator: cannot start: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except (ConfigError, TransportError) as exc:
        print(f"edgefl coordinator: cannot start: {exc}", file=sys.stderr)
        return EXIT_RUNTIME


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
            entry = {
                "round": rec.round,
                "clients": rec.clients,
                "accuracy": None if math.isnan(rec.accuracy) else rec.accuracy,
                "update_bytes_mean": rec.update_bytes_mean,
                "duration_s": rec.duration_s,
                "update_ids": coord.counted.get(rec.round, []),
                "version": version,
                "strategy": strategy,
                "refused": rec.refused or None,
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
    expected: int,
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
    return (
        f"round {rec.round}/{total}: {rec.clients}/{expected} clients, refused: {why}, accuracy {acc}, "
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
    # A persistent session: updates published while the coordinator restarts wait for it at the broker.
    transport = MqttTransport(
        broker.host,
        broker.port,
        client_id,
        protocol=broker.protocol,
        keepalive_s=broker.keepalive_s,
        username=broker.username,
        password=broker_password(broker),
        tls_context=ssl_context_for(broker),
        max_packet_bytes=broker.max_packet_bytes,
        max_incoming_packet_bytes=broker.max_incoming_packet_bytes,
        session_expiry_s=3600,
        alternates=broker.alternate_addresses,  # the other nodes of a clustered broker, tried in turn
        # a site acknowledges an update once its round record holds it: a SIGKILL loses none
        ack_on_commit=hier.role == "site" and files.state is not None,
        # one client, not a fleet: back within ~5 s of its broker (a root's partials wait for it)
        reconnect_max_s=COORDINATOR_RECONNECT_MAX_S,
    )
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
                Topics(broker.topic_prefix, fleet).partial("+"),
            )
        role_kwargs = {
            "site_keys": load_verify_keys(hier.site_keys_dir) if hier.site_keys_dir else None,
            "expected_sites": hier.expected_sites,
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
    coord = cls(
        transport,
        Topics(broker.topic_prefix, fleet),
        W0,
        b0,
        model_sha256=backbone.sha256,
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
        **role_kwargs,
    )

    def mismatch(device: str, why: str) -> None:
        print(f"device {device} runs another model ({why}): left out of rounds", flush=True)

    coord.on_mismatch = mismatch
    transport.on_connect_cb = coord.on_transport_connect  # a broker that lost our session: announce again
    if isinstance(coord, SiteAggregator):
        return await _run_site(coord, profile, transport, page)
    if files.state is not None:
        try:
            coord.load_state(files.state)
        except UpdateRejected as exc:
            raise ConfigError([f"files.state = {str(files.state)!r}: {exc}"]) from exc
        coord.state_path = files.state
        if files.log is not None:
            _log_missing_rounds(files.log, coord, strategy.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    where = f"{broker.scheme}://{broker.host}:{broker.port}"
    role = "" if hier.role == "flat" else f" ({hier.role} of {hier.expected_sites or 'any number of'} sites)"
    print(
        f"coordinator{role} of fleet {fleet} at {where}: {_plural(rounds.count, 'round')} of {st.name}",
        flush=True,
    )
    stop_page: Callable[[], Awaitable[None]] | None = None
    if page is not None and profile.dashboard.enabled:
        stop_page, port = await page(profile.dashboard, f"fleet {fleet}", coord.dashboard_status)
        print(f"fleet page: http://{profile.dashboard.host}:{port}/", flush=True)
    await transport.start(wait_s=None)
    pump = asyncio.create_task(coord.pump())
    records: list[RoundRecord] = []
    empty: list[str] = []
    try:
        await _connected_or_refused(transport, where, 60.0)
        await coord.start()
        expected = max(rounds.expected_clients, rounds.min_clients)
        if coord.state.round >= rounds.count:
            print(
                f"nothing to do: fleet {fleet} is at round {coord.state.round} of {rounds.count} "
                "(raise rounds.count or use a new fleet.name)",
                flush=True,
            )
        elif rounds.expected_clients:
            waiting = asyncio.create_task(
                coord.wait_for_devices(rounds.expected_clients, timeout_s=rounds.wait_devices_s)
            )
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({waiting, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not waiting.done():  # SIGTERM while waiting for the devices
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
            else:
                try:
                    waiting.result()
                except TimeoutError as exc:
                    print(f"{exc}; starting the rounds anyway", flush=True)
                    logger.warning("%s; starting the rounds anyway", exc)
        while coord.state.round < rounds.count and not stop.is_set():
            r = coord.state.round + 1
            refused_before = Counter(coord.state.rejected)
            declined_before = Counter(coord.state.declined)
            runner = asyncio.create_task(coord.run_round(r))
            stopper = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if runner not in done:
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner
                break
            rec = runner.result()
            records.append(rec)
            refused = Counter(coord.state.rejected)
            refused.subtract(refused_before)
            refused_round = {k: v for k, v in refused.items() if v > 0}
            declined = Counter(coord.state.declined)
            declined.subtract(declined_before)
            declined_round = {k: v for k, v in declined.items() if v > 0}
            if files.state is not None:
                coord.save_state(files.state)
            # at the root the messages in are the sites' partials (~41 kB for 512x10 float64 sums)
            per = "partial" if isinstance(coord, RootCoordinator) else "update"
            line = _round_line(rec, rounds.count, expected, refused_round, declined_round, per)
            print(line, flush=True)
            logger.info("%s", line)
            if rec.clients == 0:
                why = _empty_cause(refused_round, declined_round, len(coord.online_devices()))
                empty.append(f"round {rec.round} aggregated nothing ({why})")
            if files.log is not None:
                entry = {
                    "round": rec.round,
                    "clients": rec.clients,
                    "accuracy": rec.accuracy,
                    "update_bytes_mean": rec.update_bytes_mean,
                    "duration_s": rec.duration_s,
                    "refused_updates": refused_round,
                    "update_ids": coord.counted.get(rec.round, []),
                    "version": coord.state.version,
                    "strategy": strategy.name,
                    "clipped": rec.clipped,
                    "clipped_by_device": dict(strategy.clipped),  # since the start of this process
                    "norm_bound": rec.norm_bound if math.isfinite(rec.norm_bound) else None,
                    "epsilon": None if math.isnan(rec.epsilon) else rec.epsilon,
                    "delta": None if math.isnan(rec.delta) else rec.delta,
                    "refused": rec.refused or None,
                }
                if isinstance(coord, RootCoordinator):  # since the start of this process
                    # update_bytes_mean is kept (same key as a flat run); at the root it is this
                    entry["partial_bytes_mean"] = rec.update_bytes_mean
                    entry["partials"] = coord.partials_received
                    entry["partial_bytes"] = coord.partial_bytes
                    entry["duplicate_partials"] = coord.duplicates
                with open(files.log, "a") as f:
                    f.write(json.dumps(entry) + "\n")
    finally:
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
        await transport.stop()
        if stop_page is not None:
            await stop_page()
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
    print(f"site {site.site} of fleet {profile.fleet.name} at {where}: rounds 1-{rounds.count}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    stop_page: Callable[[], Awaitable[None]] | None = None
    if page is not None and profile.dashboard.enabled:
        stop_page, port = await page(profile.dashboard, f"site {site.site}", site.dashboard_status)
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
            runner = asyncio.create_task(_next_site_round(site, rounds.count))
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
            refused_round = {k: v for k, v in refused.items() if v > 0}
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
