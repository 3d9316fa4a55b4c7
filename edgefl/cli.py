"""The ``edgefl`` command: run the agent, check a profile, run the demo; the composition root.

Exit codes: the ``EXIT_*`` constants, each sub-command's ``--help`` and ``docs/operations.md``
("Faults and exit codes"). Logging handlers are configured here only (STYLE.md rule 10).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from edgefl.errors import ConfigError, CredentialsRefused, EdgeflError, ModelError, StartupError
from edgefl.profiles import add_set_argument, parse_sets, print_problems, read_toml

if TYPE_CHECKING:
    from edgefl.agent.config import Profile
    from edgefl.coordinator.profile import HierarchyConfig
    from edgefl.profiles import DashboardConfig

# One BLAS thread and two malloc arenas: on a small gateway each extra thread or arena costs RSS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MALLOC_ARENA_MAX", "2")
MMAP_THRESHOLD_BYTES = 128 << 10
"""glibc's default threshold, fixed: a freed large block (numpy temporaries) goes back to the kernel."""
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES))

logger = logging.getLogger("edgefl")

EXIT_OK = 0
EXIT_INVALID = 1
"""An invalid profile (``check-config``, ``run``), a state folder in use, or the demo's job failed."""
EXIT_USAGE = 2
EXIT_MODEL = 3
"""The model could not be loaded (missing, corrupt, or wrong shape)."""
EXIT_RUNTIME = 4
"""A start-up error (e.g. the dashboard's port in use); the shipped unit restarts it with a delay."""
EXIT_CREDENTIALS = 5
"""The broker refused the credentials, or its TLS certificate, ``broker.auth_retries`` times in a row."""
EXIT_TEMPFAIL = 75
"""A fault stopped the running agent (sysexits.h ``EX_TEMPFAIL``: try again later); restarted."""


def _parse_sets(items: Sequence[str]) -> dict[str, object]:
    try:
        return parse_sets(items)
    except ConfigError as exc:  # a usage error (exit 2), not an invalid profile
        print("\n".join(f"edgefl: {problem}" for problem in exc.problems), file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from exc


def _setup_logging(level: str, device: str | None = None) -> None:
    fmt = "%(asctime)s %(levelname)s " + (f"[{device}] " if device else "") + "%(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt, stream=sys.stderr)


def _load_or_report(args: argparse.Namespace) -> Profile | None:
    """Load ``args.profile`` with the ``--set`` overrides, or print every problem and return None."""
    from edgefl.agent.config import load_profile

    try:
        return load_profile(args.profile, _parse_sets(args.set))
    except ConfigError as exc:
        print_problems(f"edgefl: invalid profile {args.profile}", exc.problems)
        return None


def _preflight(profile: Profile, *, warn_unloaded: bool = True) -> tuple[list[str], bool]:
    """What this profile cannot run with here (:func:`~edgefl.agent.preflight.preflight`); ModelError.

    Also whether the model was loaded: without the profile's runtime only the checks not about this
    machine run (``warn_unloaded``: say so).
    """
    import gc

    import edgefl.agent.daemon  # the agent's imports are part of its floor

    if profile.dashboard.enabled:
        import edgefl.dashboard.app  # noqa: F401 - so is the device page's server (DashboardPage)
    from edgefl import heap
    from edgefl.agent import estimates, memstat
    from edgefl.agent.preflight import broker_warnings, preflight, training_warning
    from edgefl.runtime import Backbone, runtime_available

    for note in broker_warnings(profile):
        print(f"edgefl: warning: {note}", file=sys.stderr)

    # The floor: the RSS with every page the imports and the model map. The imports' library pages are
    # dropped before the model loads (the process's peak otherwise), then counted back per mapping.
    dropped = heap.release_file_pages()
    if not runtime_available(profile.model.runtime):
        # a profile for another kind of gateway (tflite-runtime on armv7l): the rest is checked there
        problems = preflight(profile, None, 0)
        elsewhere = [p for p in problems if p.startswith("device.state_dir")]
        if warn_unloaded:  # `edgefl run` goes on to load the model and names why it cannot
            print(f"edgefl: warning: {_unchecked_here(profile, elsewhere)}", file=sys.stderr)
        return [p for p in problems if p not in elsewhere], False

    m = profile.model
    backbone = Backbone(
        m.path, num_threads=m.num_threads, runtime=m.runtime, embedding_tensor=m.embedding_tensor
    )
    shapes = estimates.model_shapes(backbone)
    mapped = heap.readonly_file_rss()
    rss = memstat.rss_bytes() + sum(max(0, held - mapped.get(span, 0)) for span, held in dropped.items())
    del backbone
    gc.collect()
    problems = preflight(profile, shapes, rss)
    warning = None if problems else training_warning(profile, shapes, rss)
    if warning is not None:
        print(f"edgefl: warning: {warning}", file=sys.stderr)
    return problems, True


def _unchecked_here(profile: Profile, elsewhere: Sequence[str]) -> str:
    """What a profile for another kind of gateway leaves unchecked on this machine, in one warning."""
    import platform

    m = profile.model
    runtime = {"tflite": "tflite-runtime", "litert": "ai-edge-litert"}.get(m.runtime, "a TFLite runtime")
    text = (
        f"model.runtime = {m.runtime!r}: {runtime} is not installed on this {platform.machine()} machine, "
        f"so model.path = {str(m.path)!r} was NOT loaded and these were NOT checked: the model itself "
        f"(it loads, its input and head shapes), the store's memory at its embedding size "
        f"(training.store_capacity = {profile.training.store_capacity}) and the memory floor under "
        f"memory.cap_mb = {profile.memory.cap_mb}"
    )
    if elsewhere:
        text += "; nor " + "; ".join(elsewhere)
    return text + ". Run `edgefl check-config` on the gateway itself (install.sh does) to check them."


def cmd_coordinator(main: Callable[..., int], args: argparse.Namespace, **parts: Any) -> int:
    """``edgefl coordinator``: set up the log (``--log-level``, on stderr), then run the coordinator."""
    _setup_logging(args.log_level)
    return main(args, **parts)


def lock_coordinator_state(state: Path) -> object:
    """Lock a coordinator's state file with the agents' ``flock`` (``<state>.lock``) for its life.

    LeaseHeld if another live process holds it (``edgefl coordinator`` exits 6); OSError if the folder
    or the lock file cannot be created.
    """
    from edgefl.agent.statelock import StateDirBusy, lock_state_dir
    from edgefl.coordinator.lease import LeaseHeld

    try:
        return lock_state_dir(state.parent, lock_file=f"{state.name}.lock", owner="coordinator")
    except StateDirBusy as exc:
        holder = f"pid {exc.pid}" if exc.pid is not None else "a process whose pid is unknown"
        raise LeaseHeld(f"state file {state}", holder) from exc


def cmd_run(args: argparse.Namespace) -> int:
    """``edgefl run PROFILE``: run the agent daemon until SIGTERM/SIGINT."""
    profile = _load_or_report(args)
    if profile is None:
        return EXIT_INVALID
    _setup_logging(args.log_level, profile.device.id)
    from edgefl import heap
    from edgefl.agent.daemon import Agent
    from edgefl.agent.statelock import StateDirBusy, lock_state_dir

    # arenas of threads not yet started (paho, worker, dashboard); a fixed mmap threshold
    heap.apply_hygiene(arena_max=2, mmap_threshold_bytes=MMAP_THRESHOLD_BYTES)

    try:
        problems, _ = _preflight(profile, warn_unloaded=False)
        if problems:
            print_problems(f"edgefl: profile {args.profile} cannot run here", problems)
            return EXIT_INVALID
        heap.release_file_pages()  # what the check mapped, before the agent loads its own model
        try:
            lock = lock_state_dir(profile.device.state_dir)  # held until this function returns
        except StateDirBusy as exc:
            print(f"edgefl: {exc}", file=sys.stderr)
            return EXIT_INVALID
        agent = Agent(profile, DashboardPage(profile) if profile.dashboard.enabled else None)
    except ModelError as exc:
        print(f"edgefl: model error: {exc}", file=sys.stderr)
        return EXIT_MODEL
    except EdgeflError as exc:
        print(f"edgefl: cannot start: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except OSError as exc:  # e.g. no room for the store (ENOSPC): may heal, so restarted
        print(f"edgefl: cannot start: {exc}", file=sys.stderr)
        return EXIT_TEMPFAIL
    try:
        asyncio.run(agent.run())
    except (Exception, BaseExceptionGroup) as group:  # the last line of defence: never a crash loop
        return _stopped_by(group)
    finally:
        lock.close()
    return EXIT_OK


_KNOWN_FAULTS = (OSError, MemoryError, ArithmeticError, ValueError)
"""Faults a running agent can meet (a disk, the RAM, bad numbers): one log line, no traceback."""


def _stopped_by(exc: BaseException) -> int:
    """The exit code for what stopped the agent: 5 refused credentials or certificate, 4 start-up, 75 a fault.

    A fault is logged (a known one in one line, else its traceback); ``KeyboardInterrupt``/``SystemExit``
    (also inside an ``ExceptionGroup``) re-raise.
    """
    leaves = _leaves(exc)
    for e in leaves:
        if isinstance(e, CredentialsRefused):
            logger.error("agent stopped (exit %d): %s", EXIT_CREDENTIALS, e)
            print(f"edgefl: {e}", file=sys.stderr)
            return EXIT_CREDENTIALS
    for e in leaves:
        if isinstance(e, StartupError):
            print(f"edgefl: cannot start: {e}", file=sys.stderr)
            return EXIT_RUNTIME
    for e in leaves:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise e
    for e in leaves:
        if isinstance(e, (EdgeflError, *_KNOWN_FAULTS)):
            logger.error("agent stopped by a fault (exit %d): %s: %s", EXIT_TEMPFAIL, type(e).__name__, e)
        else:
            logger.error("agent stopped by an unexpected error (exit %d)", EXIT_TEMPFAIL, exc_info=e)
    return EXIT_TEMPFAIL


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc`` (itself, or the leaves of an ``ExceptionGroup`` tree)."""
    leaves: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        else:
            leaves.append(e)
    return leaves


class DashboardPage:
    """The device's status page: ``edgefl.dashboard`` behind the daemon's ``StatusPage`` interface.

    Built here, so the device package never imports the dashboard (aiohttp only once the page starts).
    """

    def __init__(self, profile: Profile) -> None:
        self._config = profile.dashboard
        self._device = profile.device.id
        self._state: Any = None
        self._runner: Any = None

    async def start(self, status: Callable[[], dict[str, Any]]) -> str:
        """Serve ``status()`` on ``dashboard.host:port``; return the page's URL."""
        self._state, self._runner, port = await _serve(self._config, "device", self._device, status)
        return f"http://{self._config.host}:{port}/"

    def notify(self) -> None:
        """Push a changed status to open pages."""
        if self._state is not None:
            self._state.notify()

    async def stop(self) -> None:
        """Close the page's server."""
        if self._runner is not None:
            await self._runner.cleanup()

    def counters(self) -> dict[str, int]:
        """Connections the page refused (over its caps), closed (header or body timeout), bad requests."""
        if self._state is None:
            return {}
        return {
            "refused": self._state.connections_refused_total,
            "timed_out": self._state.connections_timed_out_total,
            "bad_requests": self._state.bad_requests_total,
        }


async def _serve(
    d: DashboardConfig, kind: Literal["device", "coordinator"], title: str, status: Any, **options: Any
) -> tuple[Any, Any, int]:
    """A ``DashboardState`` with the table's token, timeouts and caps, served: (state, runner, port)."""
    from edgefl.dashboard.app import DashboardState, serve

    names = ("token", "header_timeout_s", "body_timeout_s", "max_connections", "max_connections_per_client")
    state = DashboardState(kind, title, status, **options, **{name: getattr(d, name) for name in names})
    runner, port = await serve(state, d.host, d.port)
    return state, runner, port


def cmd_check_config(args: argparse.Namespace) -> int:
    """``edgefl check-config PROFILE``: validate a device or coordinator profile (exit 0, or 1 listing all).

    A profile with a coordinator-only table (``[rounds]``, ``[strategy]``...) is a coordinator profile.
    """
    try:
        _, data = read_toml(args.profile)
    except ConfigError as exc:
        print_problems(f"edgefl: invalid profile {args.profile}", exc.problems)
        return EXIT_INVALID
    from edgefl.coordinator.profile import SCHEMA, is_coordinator_profile

    if is_coordinator_profile(data):
        from edgefl.coordinator.command import load_checked
        from edgefl.coordinator.runner import build_strategy
        from edgefl.runtime import Backbone

        try:
            coordinator, problems = load_checked(args.profile, _parse_sets(args.set))
            try:  # the model loads as the coordinator loads it at start
                Backbone(coordinator.model.path).head_from_model()
            except ModelError as exc:
                problems.append(f"model.path = {str(coordinator.model.path)!r}: {exc}")
            if not problems:
                tolerance = build_strategy(coordinator).tolerance()
        except ValueError as exc:
            problems = [f"[strategy]/[robustness]/[privacy]: {exc}"]
        except ConfigError as exc:
            problems = exc.problems
        if problems:
            print_problems(f"edgefl: invalid coordinator profile {args.profile}", problems)
            return EXIT_INVALID
        n = coordinator.rounds.count
        name = coordinator.strategy.name
        rounds = f"{n} round{'' if n == 1 else 's'} of {name}" if n else f"rounds of {name} until stopped"
        print(
            f"{args.profile}: ok (coordinator of fleet {coordinator.fleet.name}, {rounds}, "
            f"role {_role(coordinator.hierarchy)}, {tolerance})"
        )
        if args.print:
            print(json.dumps(SCHEMA.to_dict(coordinator), indent=2, default=str))
        return EXIT_OK
    from edgefl.agent.config import profile_to_dict

    profile = _load_or_report(args)
    if profile is None:
        return EXIT_INVALID
    try:
        problems, loaded = _preflight(profile)
    except ModelError as exc:
        problems, loaded = [f"model.path = {str(profile.model.path)!r}: {exc}"], True
    if problems:
        print_problems(f"edgefl: profile {args.profile} cannot run here", problems)
        return EXIT_INVALID
    partial = "" if loaded else "; model not loaded here: see the warning"
    print(f"{args.profile}: ok (device {profile.device.id}, cap {profile.memory.cap_mb} MiB{partial})")
    if args.print:
        print(json.dumps(profile_to_dict(profile), indent=2, default=str))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """``edgefl demo``: embedded broker, coordinator and N agent processes on real data."""
    _setup_logging(args.log_level)
    from edgefl.demo import run_demo

    return run_demo(args)


def _add_checkout_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``edgefl wheelhouse`` from ``cross_build/`` (not in the wheel) beside a source checkout."""
    init = Path(__file__).resolve().parent.parent / "cross_build" / "__init__.py"
    if not init.is_file():
        return
    if "cross_build" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "cross_build", init, submodule_search_locations=[str(init.parent)]
        )
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["cross_build"] = module
        spec.loader.exec_module(module)
    importlib.import_module("cross_build.cli").add_wheelhouse_parser(sub)


def _command_word(words: Sequence[str]) -> str | None:
    """The sub-command named in ``words`` (the first word that is not an option or its value)."""
    it = iter(words)
    for word in it:
        if word == "--log-level":
            next(it, None)
        elif not word.startswith("-"):
            return word
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of the ``edgefl`` command for ``argv`` (None: ``sys.argv[1:]``).

    The ``coordinator`` sub-command is registered only when ``argv`` names it (or asks for help), the
    tools only when the command is not ``run`` (the agent does not import them).
    """
    from edgefl.resources import shipped

    p = argparse.ArgumentParser(
        prog="edgefl",
        description="edgefl: the federated-learning device agent, its coordinator and tools (run, "
        "check-config, demo, coordinator, profile, memory-report, model, feed, keys, wheelhouse, "
        "bridge-config).",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser(
        "run",
        help="run the device agent with a profile",
        description="Run the device agent until SIGTERM/SIGINT. Exit codes: 0 stopped; 1 invalid profile or "
        "state folder in use; 2 usage; 3 model cannot be loaded; 4 start-up error (e.g. dashboard port in "
        "use); 5 the broker refused the credentials, or its TLS certificate was not trusted, "
        "broker.auth_retries times in a row (not restarted); "
        "75 a fault stopped the running agent (restarted).",
    )
    r.add_argument("profile", help="TOML profile (see firmware_configs/)")
    add_set_argument(r, "device.id=gw-7")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser(
        "check-config",
        help="validate a profile (exit 0 valid, 1 invalid)",
        description="Validate a device or coordinator profile, and whether this machine can run it. Exit "
        "0: valid (a warning names what could not be checked here, e.g. a model for a runtime this "
        "machine lacks); 1: invalid, every problem listed.",
    )
    c.add_argument("profile", help="TOML profile (see firmware_configs/)")
    add_set_argument(c, "memory.cap_mb=64")
    c.add_argument("--print", action="store_true", help="print the resolved profile (secrets masked)")
    c.set_defaults(func=cmd_check_config)

    d = sub.add_parser("demo", help="run a federated job on the digits data with N agent processes")
    d.add_argument("--devices", type=int, default=4, help="agent processes (default 4)")
    d.add_argument("--rounds", type=int, default=10, help="federated rounds (default 10)")
    d.add_argument(
        "--broker", default=None, help="mqtt://host:port of an existing broker (default: embedded)"
    )
    d.add_argument("--json", dest="json_path", metavar="PATH", help="write the results as JSON")
    d.add_argument(
        "--profile",
        type=Path,
        default=shipped("firmware_configs/dev_x86.toml"),
        help="agent profile each device starts from (default firmware_configs/dev_x86.toml)",
    )
    d.add_argument("--model", type=Path, help="override the profile's model (.tflite)")
    d.add_argument("--local-epochs", type=int, default=2, help="local epochs per round (default 2)")
    d.add_argument("--lr", type=float, default=0.05, help="client learning rate of round 1")
    d.add_argument("--lr-decay", type=float, default=0.8, help="per-round factor on the client learning rate")
    d.add_argument("--batch-size", type=int, default=16, help="local SGD batch size (default 16)")
    d.add_argument(
        "--deadline", dest="deadline_s", type=float, default=60.0, help="round deadline in seconds"
    )
    d.add_argument("--seed", type=int, default=0, help="seed of the device shards and local shuffles")
    d.add_argument(
        "--strategy",
        default="fedavg",
        choices=("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "median", "trimmed-mean", "fedbuff"),
        help="aggregation strategy (default fedavg)",
    )
    d.add_argument(
        "--compression",
        default="none",
        choices=("none", "float16", "int8", "topk", "topk-int8"),
        help="update compression asked of the devices (default none)",
    )
    d.add_argument("--topk-fraction", type=float, default=0.1, help="kept fraction for top-k (default 0.1)")
    d.add_argument(
        "--hold",
        dest="hold_s",
        type=float,
        default=0.0,
        metavar="S",
        help="keep the dashboards up S seconds after the job",
    )
    d.add_argument("--workdir", type=Path, help="keep shards, profiles, logs and state here")
    d.add_argument(
        "--feed-rate",
        dest="feed_rate_hz",
        type=float,
        default=200.0,
        metavar="HZ",
        help="samples/s fed to each agent (0: all)",
    )
    d.add_argument(
        "--label-delay",
        dest="label_delay_s",
        type=float,
        default=0.0,
        metavar="S",
        help="0: labels inline in the samples (default); S > 0: each on labels/<device> S s after its sample",
    )
    d.set_defaults(func=cmd_demo)

    words = list(sys.argv[1:] if argv is None else argv)
    helping = "-h" in words or "--help" in words
    if _command_word(words) != "run" or helping:
        # the tools' modules (memory-report pulls in the coordinator): `edgefl run` leaves them unloaded
        from edgefl.agent import memreport, profiler

        profiler.add_parser(sub)
        memreport.add_parser(sub)
        from edgefl import feed, keys, modeltool

        modeltool.add_parser(sub)
        feed.add_parser(sub)
        keys.add_parser(sub)
        _add_checkout_parsers(sub)
        from edgefl.coordinator import bridge

        bridge.add_parser(sub)
    if "coordinator" in words or helping:
        # imported only when asked for: the agent process never runs it (~1 MiB of RSS saved)
        from edgefl.coordinator import command
        from edgefl.evaluation import central_evaluation

        command.add_parser(sub).set_defaults(
            func=functools.partial(
                cmd_coordinator,
                command.main,
                evaluation=central_evaluation,
                page=serve_coordinator_page,
                lock=lock_coordinator_state,
            )
        )
    return p


async def serve_coordinator_page(
    dashboard: DashboardConfig,
    title: str,
    get_status: Callable[[], Mapping[str, Any]],
    get_rounds: Callable[[], Sequence[Mapping[str, Any]] | Awaitable[Sequence[Mapping[str, Any]]]]
    | None = None,
) -> tuple[Callable[[], Awaitable[None]], int]:
    """Serve the standalone coordinator's fleet page (``edgefl coordinator`` with ``[dashboard]`` on).

    ``dashboard`` is the profile's table, ``title`` the page header, ``get_status`` and ``get_rounds``
    the coordinator's status document and round records. Returns an async stop function and the port
    bound. ConfigError for a non-loopback address without a token; OSError if the port cannot be bound.
    """
    # memory per device over the last 30 minutes (180 samples, 10 s apart)
    options = {"get_rounds": get_rounds, "history_interval_s": 10.0, "history_len": 180}
    _, runner, port = await _serve(dashboard, "coordinator", title, get_status, **options)
    return runner.cleanup, port


def _role(h: HierarchyConfig) -> str:
    """``flat``, ``site lyon`` or ``root of 20 sites`` for a coordinator's ``[hierarchy]``."""
    if h.role == "site":
        return f"site {h.site}"
    if h.role == "root":
        return f"root of {h.expected_sites or 'any number of'} sites"
    return "flat"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``edgefl`` console script; returns the exit code."""
    args = build_parser(argv).parse_args(argv)
    try:
        rc: int = args.func(args)
    except BrokenPipeError:  # output piped into a reader that stopped (e.g. | head)
        sys.stderr.close()
        return EXIT_OK
    return rc


if __name__ == "__main__":
    sys.exit(main())
