"""The coordinator service's run: connect, take the fleet's lease, resume, run rounds until done or stopped.

The lease is checked before anything is written or published; each round prints one line and logs one
JSON line (:mod:`edgefl.coordinator.roundlog`); a site sends one partial per round of its root instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import signal
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final, TypeVar

from edgefl import heap
from edgefl.aio import within
from edgefl.coordinator.hierarchy import RootCoordinator, SiteAggregator, SiteRecord
from edgefl.coordinator.history import HISTORY_ROUNDS, RoundRecord
from edgefl.coordinator.lease import (
    PROBE_RECEIVE_MAX,
    Lease,
    PresenceTrust,
    instance_path,
    new_instance,
    previous_instance,
    previous_stopped_cleanly,
    probe_lease,
    record_instance,
)
from edgefl.coordinator.privacy import DPFedAvg
from edgefl.coordinator.profile import CoordinatorProfile
from edgefl.coordinator.roundarchive import RoundArchive
from edgefl.coordinator.roundlog import (
    append_log,
    counts_since,
    empty_cause,
    log_entry,
    log_missing_rounds,
    plural,
    round_line,
)
from edgefl.coordinator.rounds import Pacing
from edgefl.coordinator.service import Coordinator
from edgefl.coordinator.strategies import strategy_from_tables
from edgefl.coordinator.strategy import Strategy
from edgefl.errors import BrokerRefused, ConfigError, CredentialsRefused, TransportError, UpdateRejected
from edgefl.profiles import DashboardConfig
from edgefl.records import atomic_write
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.types import F32
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import HeadLayout
from edgefl.wire.signing import load_signing_key, load_verify_key, load_verify_keys

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Exit codes of ``edgefl coordinator`` (:mod:`edgefl.coordinator.command` says what each means).
EXIT_OK: Final = 0
EXIT_INVALID: Final = 1
EXIT_MODEL: Final = 3
EXIT_RUNTIME: Final = 4
EXIT_EMPTY_ROUND: Final = 5
EXIT_LEASE: Final = 6
EXIT_FAULT: Final = 75

CONNECT_WAIT_S: Final = 60.0
"""How long the coordinator waits for its broker at start-up before it gives up (exit 4), seconds."""

COORDINATOR_RECONNECT_MAX_S: Final = 5.0
"""Cap of the coordinator's reconnect back-off, seconds (one client may retry sooner than a fleet's 30 s)."""

COORDINATOR_HELD_BYTES: Final = 16 << 20
"""Payload bytes received and not yet handled at which the coordinator stops reading its broker."""


def build_strategy(profile: CoordinatorProfile) -> Strategy:
    """The strategy a profile names: its parameters, the norm bound, and the DP wrapper when enabled.

    Raises ValueError on a bad combination (DP around median, trimmed mean or FedBuff) or out-of-range
    values, TypeError for a key the strategy does not take.
    """
    st, rounds, dp = profile.strategy, profile.rounds, profile.privacy
    strategy = strategy_from_tables(st.name, rounds, st, profile.robustness)
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
    """Why :func:`build_strategy` refuses ``profile``, each line naming its dotted key; empty if it builds."""
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
    [
        DashboardConfig,
        str,
        Callable[[], Mapping[str, Any]],
        Callable[[], Sequence[Mapping[str, Any]] | Awaitable[Sequence[Mapping[str, Any]]]],
    ],
    Awaitable[tuple[Callable[[], Awaitable[None]], int]],
]
"""Serves the fleet page (the CLI's): ``(dashboard, title, get_status, get_rounds) -> (stop, port)``."""


class AccessRefused(TransportError):
    """At start-up the broker refused a publish or subscription of the coordinator's own (an ACL's 0x87).

    Exit 1, not restarted: ``detail`` names the broker, the account, the topic and the ACL line it needs.
    """


def _access_refused(exc: BrokerRefused, where: str, username: str | None, topics: Topics) -> AccessRefused:
    account = repr(username) if username else "(anonymous)"
    return AccessRefused(
        f"broker {where} refused account {account}: {exc.detail}; the broker's ACL must give it "
        f"'topic readwrite {topics.base}/#' (docs/operations.md, \"Fleet guide\")"
    )


async def _connected_or_refused(transport: MqttTransport, where: str, timeout_s: float) -> None:
    """Wait for the connection: CredentialsRefused (exit 1) or TransportError after ``timeout_s`` (exit 4)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not transport.connected.is_set():
        if transport.credentials_refused:
            raise CredentialsRefused(
                f"broker {where} refused our credentials ({transport.last_refusal}): check [broker] "
                "username and password_file against the broker's password file and ACL",
                transport.auth_refusals,
            )
        left = end - loop.time()
        if left <= 0:
            last = f": {transport.last_error}" if transport.last_error else ""
            raise TransportError(f"broker {where} not reachable within {timeout_s:.0f} s{last}")
        with contextlib.suppress(TimeoutError):
            await within(transport.connected.wait(), min(0.2, left))


async def run(
    profile: CoordinatorProfile, evaluation: Evaluation | None = None, page: PageServer | None = None
) -> int:
    """Run the job a coordinator profile describes until its rounds are done or SIGTERM; the exit code.

    ``evaluation`` builds the central evaluation of each new head (None: none); ``page`` serves the
    fleet page when ``[dashboard]`` is enabled. SIGTERM/SIGINT at any moment stop it (0). Raises
    ModelError (the backbone), ConfigError (a key, TLS or evaluation file), CredentialsRefused,
    AccessRefused (the ACL refused the fleet's topics at start-up), AccountInUse (another live client
    has its account), LeaseHeld, TransportError (no broker within :data:`CONNECT_WAIT_S`).
    """
    # SIGTERM/SIGINT from the first moment: a stop during start-up (model, connect, lease probe) ends
    # it with 0 (a signal that comes while the model loads is handled once it is loaded)
    stop = asyncio.Event()
    stopping_at: list[Callable[[], str]] = [lambda: "during start-up"]

    def stop_on(sig: signal.Signals) -> None:
        if not stop.is_set():
            logger.info("%s: stopping %s", sig.name, stopping_at[0]())
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop_on, sig)
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

    def transport_for(cid: str, probe: bool = False) -> MqttTransport:
        return MqttTransport.for_broker(
            broker,
            cid,
            # A persistent session: updates published while the coordinator restarts wait for it
            session_expiry_s=3600,
            # an update is acknowledged once the state file holds it: a SIGKILL loses none
            ack_on_commit=probe or files.state is not None,
            # one client, not a fleet: back within ~5 s of its broker (a root's partials wait for it)
            reconnect_max_s=COORDINATOR_RECONNECT_MAX_S,
            # a flood of large messages from one account waits at the broker, not in our memory
            max_held_bytes=COORDINATOR_HELD_BYTES,
            will=Lease.will(topics.coordinator) if leased and not probe else None,
            receive_maximum=PROBE_RECEIVE_MAX if probe else 0,
        )

    sec = profile.security
    signing_key = load_signing_key(sec.signing_key_file) if sec.signing_key_file else None
    # the composition root holds the state file's lock: its previous instance is gone
    previous: str | None = None
    previous_stopped = False  # it recorded its clean stop: "resuming", not "taken over"
    if files.state is not None and leased:
        previous, previous_stopped = previous_instance(files.state), previous_stopped_cleanly(files.state)
    # with the coordinator's key, only presences it signed count (a forged one never stops a coordinator)
    trust = PresenceTrust(fleet, signing_key.verify_key if signing_key else None, previous)
    stale = None
    if leased:  # before anything is published or written: is a live coordinator running this fleet?
        probe = transport_for(f"{client_id}-probe-{instance[:8]}", probe=True)
        probing = await _unless_stopped(
            probe_lease(
                probe,
                topics.coordinator,
                f"fleet {fleet} on broker {where}",
                lambda t: _connected_or_refused(t, where, CONNECT_WAIT_S),
                previous,
                topics.coordinator_holder,
                trust,
                previous_stopped=previous_stopped,
            ),
            stop,
        )
        if probing is None:  # stopped while probing: nothing was published or written
            return EXIT_OK
        try:
            stale = probing.result()
        except BrokerRefused as exc:
            raise _access_refused(exc, where, broker.username, topics) from exc
        if files.state is not None:
            try:
                record_instance(files.state, instance)  # the next start knows this one's lease as its own
            except OSError as exc:  # a full disk: the rounds wait for room, not the start
                logger.warning(
                    "%s not written (%s): after a crash the next start waits for this lease to go stale",
                    instance_path(files.state),
                    exc,
                )
    transport = transport_for(client_id)
    st = profile.strategy
    strategy = build_strategy(profile)  # main() refused a profile it does not build (strategy_problems)
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
    if sec.device_keys_dir is None and hier.role != "root":
        logger.warning(
            "device updates are not signed (no security.device_keys_dir): the broker's accounts and ACL "
            "are all that binds a device to update/<device> (docs/security.md); give device keys"
        )
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
        signing_key=signing_key,
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

    coord.registry.on_mismatch = mismatch
    lease: Lease | None = None  # a site has none: one site aggregator per site broker
    rounds_page: Callable[[], Any] = coord.dashboard_rounds
    if isinstance(coord, SiteAggregator):
        transport.on_connect_cb = coord.on_transport_connect
        title = f"site {coord.site}"
        span = f"rounds 1-{rounds.count}" if rounds.count else "the root's rounds until stopped"
        print(f"{title} of fleet {fleet} at {where}: {span}", flush=True)
    else:
        title = f"fleet {fleet}"
        if not trust.signed:
            logger.warning(
                "the fleet's lease is not signed (no security.signing_key_file): anyone who may publish on "
                "%s can stop this coordinator; the broker's ACL must keep it to the coordinator's account "
                "(docs/security.md)",
                topics.coordinator,
            )
        coord.state.rejected.update(trust.refused)  # presences the probe refused
        lease = held = Lease(
            transport,
            topics.coordinator,
            instance,
            holder_topic=topics.coordinator_holder,
            signing_key=signing_key,
            trust=trust,
            seen=stale,
        )
        held.on_lost = stop.set
        coord.on_lease_message = held.handle

        def connected() -> None:
            if not held.lost.is_set():  # lost: stopping, the fleet's head and round are another's now
                coord.on_transport_connect()  # our head and round again (the broker may hold older ones)
            held.on_connect()  # our presence again (the broker may have lost it, or a will cleared it)

        transport.on_connect_cb = connected

        def running_at() -> str:
            rnd = coord.state.current
            if rnd is None or rnd.phase.value != "open":
                state = "no round open"
            else:
                state = "saving the open round for the next start" if files.state else "no state file"
            return f"at round {coord.state.round} ({state})"

        stopping_at[0] = running_at
        sites = hier.expected_sites or "any number of"
        role = "" if hier.role == "flat" else f" ({hier.role} of {sites} sites)"
        if rounds.count > 0:
            what = f"{plural(rounds.count, 'round')} of {st.name}"
        else:
            what = (
                f"rounds of {st.name} until stopped, at most one every {rounds.interval_s:g} s, each once "
                f"the ready devices report {rounds.min_new_samples} new samples"
            )
        print(f"coordinator{role} of {title} at {where}: {what}, {strategy.tolerance()}", flush=True)
        if files.log is not None:  # the page's rounds beyond the last HISTORY_ROUNDS come from the round log
            rounds_page = RoundArchive(files.log, coord.dashboard_rounds).records_async
    stop_page = await _serve_page(page, profile.dashboard, title, coord.dashboard_status, rounds_page)
    records: list[RoundRecord] = []
    empty: list[str] = []
    unsaved = ""  # why the state file could not be saved at the stop (exit 75)
    pump: asyncio.Task[None] | None = None
    holding: asyncio.Task[None] | None = None
    started = False  # start-up done: the state is saved and the lease cleared at the stop

    async def start_up() -> None:
        nonlocal holding
        await _connected_or_refused(transport, where, CONNECT_WAIT_S)
        if lease is not None:
            holding = asyncio.create_task(lease.hold())
        await coord.start()
        if lease is not None:
            # watch the lease while running: a live coordinator that took the fleet first makes this one
            # stop (exit 6), a cleared lease is published again (the transport renews it after a reconnect)
            await transport.subscribe(topics.coordinator, 1)

    try:
        if files.state is not None and leased:  # a site reads its own record in start()
            try:
                coord.load_state(files.state)
            except UpdateRejected as exc:
                raise ConfigError([f"files.state = {str(files.state)!r}: {exc}"]) from exc
            coord.state_path = files.state
            if files.log is not None:
                try:
                    log_missing_rounds(files.log, coord, strategy.name)
                except OSError as exc:  # a full disk: the next start appends them
                    logger.error("round log %s: the rounds it missed not appended (%s)", files.log, exc)
        elif profile.privacy.enabled and leased:
            why = "privacy.enabled without files.state: the privacy accountant starts again at every start"
            print(f"warning: {why}", flush=True)
            logger.warning("%s", why)
        await transport.start(wait_s=None)
        pump = asyncio.create_task(coord.pump())
        booting = await _unless_stopped(start_up(), stop)  # SIGTERM while connecting: exit 0
        if booting is not None:
            try:
                booting.result()
            except UpdateRejected as exc:  # a site's record of another site or head shape
                raise ConfigError([f"files.state = {str(files.state)!r}: {exc}"]) from exc
            except BrokerRefused as exc:  # an ACL without the fleet's topics: exit 1, not restarted
                raise _access_refused(exc, where, broker.username, topics) from exc
            started = True
        if isinstance(coord, SiteAggregator):
            if started:
                await _site_rounds(coord, files.log, rounds.count, stop)
        else:
            await _fleet_rounds(coord, profile, strategy, stop, records, empty)
    finally:
        await _cancel(pump)
        await _cancel(holding)
        await coord.stop_republishing()
        path = coord.state_path  # files.state at a flat or root coordinator, None at a site
        if started and path is not None and lease is not None and not lease.lost.is_set():
            try:
                coord.save_state(path)  # an open round, as it stands: resumed at the restart
            except OSError as exc:
                unsaved = f"state file {path} not saved at the stop ({exc})"
                logger.error("%s: the next start resumes its last saved generation", unsaved)
        if holding is not None and lease is not None and not lease.lost.is_set() and not lease.refused:
            await lease.release()
        await transport.stop()
        if stop_page is not None:
            await stop_page()
    if unsaved:
        print(f"edgefl coordinator: {unsaved}", file=sys.stderr)
        return EXIT_FAULT
    if lease is None:  # a site: no lease, no summary
        return EXIT_OK
    if lease.lost.is_set():
        print(
            f"edgefl coordinator: another coordinator runs this fleet ({lease.lost_to}): stopped",
            file=sys.stderr,
        )
        return EXIT_LEASE
    if files.state is not None and leased:  # a clean stop: the next start says so, rather than "taken over"
        try:
            record_instance(files.state, instance, stopped=True)
        except OSError as exc:
            logger.warning("%s: clean stop not recorded (%s)", instance_path(files.state), exc)
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
    """When the next round opens: a job's at once, a root's by ``rounds.interval_s``, else by all three."""
    rounds = profile.rounds
    if rounds.count > 0:
        return Pacing(0.0, 0, 1)
    if profile.hierarchy.role == "root":
        return Pacing(rounds.interval_s, 0, 0)
    return Pacing(rounds.interval_s, rounds.min_new_samples, rounds.min_clients)


async def _serve_page(
    page: PageServer | None,
    dash: DashboardConfig,
    title: str,
    status: Callable[[], Mapping[str, Any]],
    rounds_page: Callable[[], Any],
) -> Callable[[], Awaitable[None]] | None:
    """Serve the page of ``title`` when ``[dashboard]`` is enabled; its stop (None: not served)."""
    if page is None or not dash.enabled:
        return None
    kind = title.split()[0]  # fleet or site
    try:
        stop_page, port = await page(dash, title, status, rounds_page)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ConfigError(
            [f"dashboard.port = {dash.port}: cannot serve the {kind} page on {dash.host} ({why})"]
        ) from exc
    print(f"{kind} page: http://{dash.host}:{port}/", flush=True)
    return stop_page


async def _fleet_rounds(
    coord: Coordinator,
    profile: CoordinatorProfile,
    strategy: Strategy,
    stop: asyncio.Event,
    records: list[RoundRecord],
    empty: list[str],
) -> None:
    """A flat or root coordinator's rounds until done or stopped, adding to ``records`` and ``empty``."""
    rounds, files, fleet = profile.rounds, profile.files, profile.fleet.name
    job = rounds.count > 0  # N rounds back to back; 0: a service, paced
    unlogged: list[dict[str, Any]] = []  # closed rounds' log lines waiting for a saved state file
    failed = [0, 0]  # state saves and log appends refused in a row (a full disk)
    if not stop.is_set() and job and coord.state.round >= rounds.count:
        print(
            f"nothing to do: fleet {fleet} is at round {coord.state.round} of {rounds.count} "
            "(raise rounds.count or use a new fleet.name)",
            flush=True,
        )
    elif not stop.is_set() and rounds.expected_clients:  # wait for them before round 1, for so long at most
        n, wait_s = rounds.expected_clients, rounds.wait_devices_s
        waiting = await _unless_stopped(coord.registry.wait_for_devices(n, timeout_s=wait_s, key=None), stop)
        try:
            if waiting is not None:  # else SIGTERM while waiting for the devices
                waiting.result()
        except TimeoutError as exc:
            print(f"{exc}; starting the rounds anyway", flush=True)
            logger.warning("%s; starting the rounds anyway", exc)
    while not stop.is_set() and not (job and coord.state.round >= rounds.count):
        if not job and not coord.resuming and not await coord.wait_to_open(stop):
            break
        r = coord.state.round + 1
        refused_before = Counter(coord.state.rejected)
        declined_before = Counter(coord.state.declined)
        runner = await _unless_stopped(coord.run_round(r), stop)
        if runner is None:  # stopped: the open round stays in the state file, resumed at restart
            break
        rec = runner.result()
        records.append(rec)
        del records[:-HISTORY_ROUNDS]  # the summary keeps the last rounds; the round log has them all
        refused_round = counts_since(coord.state.rejected, refused_before)
        declined_round = counts_since(coord.state.declined, declined_before)
        coord.note_round_reasons(rec.round, refused_round, declined_round)
        saved = files.state is None or _save_closed(coord, files.state, rec.round, failed)
        # at the root the messages in are the sites' partials (~41 kB for 512x10 float64 sums)
        per = "partial" if isinstance(coord, RootCoordinator) else "update"
        silent = coord.silent_devices(rec.round)
        line = round_line(rec, rounds.count, refused_round, declined_round, per, silent)
        print(line, flush=True)
        logger.info("%s", line)
        if rec.clients == 0 and job:
            why = empty_cause(refused_round, declined_round, len(coord.registry.online_devices()))
            empty.append(f"round {rec.round} aggregated nothing ({why})")
        elif rec.refused == "too_few" and job:  # abandoned: fewer updates than tolerate needs
            need = f"{strategy.name} needs {strategy.min_updates}"
            why = f"{rec.clients} updates, {need}: {strategy.tolerance()}"
            empty.append(f"round {rec.round} aggregated nothing (abandoned: {why})")
        if files.log is not None:
            unlogged.append(log_entry(coord, rec, strategy, refused_round, declined_round))
            # a round is logged once its state file says it closed: a restart never closes it again
            if saved and _log_rounds(files.log, unlogged, failed):
                unlogged.clear()
            elif len(unlogged) > UNLOGGED_KEPT:
                logger.error("round log: round %d's line dropped (disk full)", unlogged.pop(0)["round"])
        # the round's freed heap (decoded updates, aggregation temporaries, the state document) goes
        # back to the kernel: a service's RSS stays its live data, not the sum of its rounds' free gaps
        heap.malloc_trim()
    coord.finished = True
    coord.notify()


UNLOGGED_KEPT: Final = 1000
"""Closed rounds' log lines kept while the disk refuses them (~1 kB each); older ones are dropped."""


def _save_closed(coord: Coordinator, path: Path, round_no: int, failed: list[int]) -> bool:
    """Save the state file after round ``round_no`` closed; False when the disk refused it.

    ``failed``: ``[state, log]`` write failures in a row, counted here (logged at the first and when
    writing works again).
    """
    try:
        coord.save_state(path)
    except OSError as exc:  # a full disk: the rounds go on, a restart resumes the last saved generation
        failed[0] += 1
        if failed[0] == 1:
            logger.error(
                "round %d: state file %s not written (%s); the rounds go on, their round log lines wait "
                "for a save",
                round_no,
                path,
                exc,
            )
        return False
    if failed[0]:
        logger.warning("state file %s written again after %d failed save(s)", path, failed[0])
        failed[0] = 0
    return True


def _log_rounds(log: Path, entries: list[dict[str, Any]], failed: list[int]) -> bool:
    """Append ``entries`` to the round log; False when the disk refused them (nothing appended).

    ``failed`` as :func:`_save_closed`'s.
    """
    try:
        append_log(log, entries)
    except OSError as exc:
        failed[1] += 1
        if failed[1] == 1:
            logger.error("round log %s not written (%s): its lines are kept for the next round", log, exc)
        return False
    if failed[1]:
        logger.warning("round log %s written again after %d failed append(s)", log, failed[1])
        failed[1] = 0
    return True


async def _site_rounds(site: SiteAggregator, log: Path | None, count: int, stop: asyncio.Event) -> None:
    """A site's rounds: one partial per round the root announces, up to round ``count`` (0: until stopped).

    It ends once the root published that round's head, or on SIGTERM. One line per round on stdout and
    one JSON line in ``log`` (``round``, ``site``, ``updates``, ``partial_bytes``, ``duration_s``,
    ``update_ids``, ``refused_updates``).
    """
    last_round = count or sys.maxsize
    print(
        f"site {site.site}: ready, waiting for the root's round {site.closed_round + 1} "
        f"(last round closed here: {site.closed_round or 'none'})",
        flush=True,
    )
    while not stop.is_set():
        refused_before = Counter(site.state.rejected)
        runner = await _unless_stopped(_next_site_round(site, last_round), stop)
        if runner is None:
            break
        rec = runner.result()
        if rec is None:  # the root published the head of the last round
            break
        refused_round = counts_since(site.state.rejected, refused_before)
        print(
            f"site {site.site} round {rec.round}: {rec.updates} updates, {rec.partial_bytes} bytes up, "
            f"{rec.duration_s:.2f} s, refused: {refused_round or 'none'}",
            flush=True,
        )
        if log is not None:
            append_log(log, [{**asdict(rec), "site": site.site, "refused_updates": refused_round}])


async def _cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> asyncio.Task[T] | None:
    """Run ``work`` until it ends (its finished task) or ``stop`` is set first (cancelled: None)."""
    task = asyncio.create_task(work)
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not task.done():
        await _cancel(task)
        return None
    return task


async def _next_site_round(site: SiteAggregator, last_round: int) -> SiteRecord | None:
    ann = await site.next_round(last_round)
    return None if ann is None else await site.run_site_round(ann)
