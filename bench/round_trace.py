"""Where a round's milliseconds go: one traced edgefl run of ``bench.peer``'s job, phase by phase.

The same job as ``bench/peer.py``'s int8 variant (2 real agent processes behind the counting proxy, a
real mosquitto, the real ``Coordinator.run_round`` in this process), with timing wrappers around the
functions a round passes through: in each agent (``python -m bench.round_trace agent TRACE -- ARGS``
installs them, then runs ``edgefl.cli``) the paho thread's hops, the message handler, every worker
call (queued -> started -> done), ``receive_round``/``receive_global`` and their steps (training,
error feedback, signing, state writes, each ``fsync`` and ``fdatasync``), the publishes and their
PUBACKs, the status checks and the cyclic GC's collections; in the
coordinator the announcement, each update's arrival and ``publish_global``; the proxy adds when each
MQTT packet passed it. Wrappers add a few microseconds a call; nothing else differs from the product.

Run: ``.venv/bin/python -m bench.round_trace [--rounds 7] [--nodelay] [--json PATH]`` prints, per
phase, the median over rounds 2.. of its start and end in ms after ``run_round`` began, the CPU
each process used from a round's start to its aggregation (every thread's, ``schedstat``), the CPU
of each process's main thread and of its other threads over whole rounds (one round's start to the
next's), and one round's full timeline; a synchronous step's ``cpu=`` is its thread's own CPU time
and ``flt=`` its thread's minor page faults (fresh pages: a large temporary mapped and freed).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import functools
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

EVENTS: list[tuple[str, str, float, float, str]] = []  # (name, detail, start s, end s, thread)


def _rec(name: str, detail: str, t0: float, t1: float) -> None:
    EVENTS.append((name, detail, t0, t1, threading.current_thread().name))


def _faults() -> int:
    """Minor page faults of the calling thread so far (``getrusage(RUSAGE_THREAD)``)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _wrap(owner: Any, attr: str, name: str, detail: Callable[..., str] | None = None) -> None:
    """Replace ``owner.attr`` (sync or async) with a timed wrapper recording ``name``."""
    orig = getattr(owner, attr)
    if asyncio.iscoroutinefunction(orig):

        @functools.wraps(orig)
        async def awrapped(*a: Any, **k: Any) -> Any:
            t0 = time.time()
            try:
                return await orig(*a, **k)
            finally:
                _rec(name, detail(*a, **k) if detail else "", t0, time.time())

        setattr(owner, attr, awrapped)
    else:

        @functools.wraps(orig)
        def wrapped(*a: Any, **k: Any) -> Any:
            t0, c0, f0 = time.time(), time.thread_time(), _faults()
            try:
                return orig(*a, **k)
            finally:
                # the thread's own CPU time: what a call costs when it is not waiting for a core; and
                # its page faults (each one a fresh page: a large temporary mmap-ed and freed)
                cpu = f" cpu={1e3 * (time.thread_time() - c0):.2f} flt={_faults() - f0}"
                _rec(name, (detail(*a, **k) if detail else "") + cpu, t0, time.time())

        setattr(owner, attr, wrapped)


def thread_cpu_ms(pid: int) -> dict[str, float]:
    """CPU time of process ``pid``'s main thread (``main``) and of its other threads (``others``) so
    far, in ms (``/proc/<pid>/task/*/schedstat``, field 1: ns on a CPU); threads that ended before
    the read are not counted."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            name = "main" if task.name == str(pid) else "others"
            out[name] = out.get(name, 0.0) + int((task / "schedstat").read_text().split()[0]) / 1e6
    return out


def process_cpu_ms(pid: int) -> float:
    """CPU time of every thread of process ``pid`` so far, in ms (``/proc/<pid>/task/*/schedstat``,
    field 1: ns on a CPU); threads that ended before the read are not counted."""
    return sum(thread_cpu_ms(pid).values())


def _topic_kind(topic: str) -> str:
    parts = topic.split("/")[2:]
    return parts[0] if parts else topic


def _probe_hops() -> None:
    """Record each hop from paho's network thread to the event loop (a message, a PUBACK)."""
    import edgefl.transport as transport

    orig_hop = transport.MqttTransport._hop

    def hop(self: Any, fn: Callable[..., None], *args: Any) -> None:
        detail = getattr(fn, "__name__", "?")
        for a in args:
            topic = getattr(a, "topic", None)
            if isinstance(topic, str):
                detail += " " + _topic_kind(topic)
        t = time.time()
        _rec("paho:hop", detail, t, t)
        orig_hop(self, fn, *args)

    transport.MqttTransport._hop = hop  # type: ignore[method-assign]


def _maybe_no_quickack() -> None:
    """``BENCH_NO_QUICKACK=1`` (``--no-quickack``): this process leaves delayed ACKs on, as before."""
    import edgefl.mqtt_socket as mqtt_socket

    if os.environ.get("BENCH_NO_QUICKACK"):
        mqtt_socket.TCP_QUICKACK = None


def _probe_gc() -> None:
    """Record each cyclic garbage collection (generation, ms) as ``gc`` events."""
    import gc

    started: list[float] = []

    def cb(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.time())
        elif started:
            t0 = started.pop()
            _rec("gc", f"gen{info.get('generation')}", t0, time.time())

    gc.callbacks.append(cb)


def install_agent_probes() -> None:
    """Timing wrappers in an agent process (see the module docstring)."""
    _maybe_no_quickack()
    _probe_gc()
    import edgefl.agent.control as control
    import edgefl.agent.core as core
    import edgefl.agent.feedback as feedback
    import edgefl.agent.outbox as outbox
    import edgefl.agent.reporter as reporter
    import edgefl.agent.round as round_
    import edgefl.records as records
    import edgefl.transport as transport
    from edgefl import heap
    from edgefl.agent import governor

    _wrap(os, "fsync", "fsync")
    _wrap(os, "fdatasync", "fdatasync")  # records.write_record's in-place writes
    _wrap(records, "atomic_write", "atomic_write", lambda path, data: Path(path).name)
    for attr in (
        "receive_global",
        "receive_round",
        "evaluate",
        "acknowledged",
    ):
        _wrap(core.DeviceCore, attr, attr)
    for attr in ("train_local", "sign_message", "decode_round", "encode_update"):
        _wrap(round_, attr, attr)
    for attr in ("decode_global_model", "encode_global_model"):
        _wrap(core, attr, attr)
    _wrap(core.DeviceCore, "_verified", "verify")
    _wrap(governor.Governor, "admit", "governor.admit")
    _wrap(governor, "reset_peak", "reset_peak")  # the name the governor calls
    _wrap(feedback.ErrorFeedback, "compress", "feedback.compress")
    _wrap(outbox.Outbox, "save", "outbox.save")
    _wrap(heap, "malloc_trim", "malloc_trim")
    _wrap(control.RoundTask, "handle", "handle", lambda self, msg: _topic_kind(msg.topic))
    _wrap(control.RoundTask, "_send_update", "send_update")
    _wrap(reporter.StatusReporter, "_status_tick", "status_tick")
    _wrap(
        transport.MqttTransport,
        "publish",
        "publish",
        lambda self, topic, payload, **k: _topic_kind(topic),
    )
    _wrap(
        transport.MqttTransport,
        "_handle_message",
        "on_loop:message",
        lambda self, conn, mid, qos, msg: _topic_kind(msg.topic),
    )
    _wrap(
        transport.MqttTransport,
        "_handle_puback",
        "on_loop:puback",
    )
    _probe_hops()
    orig_work = reporter.StatusReporter._work

    async def work(self: Any, fn: Callable[..., Any], *args: Any) -> Any:
        name = getattr(fn, "__name__", "?")
        t_sub = time.time()
        started: list[float] = []

        def run(*a: Any) -> Any:
            started.append(time.time())
            return fn(*a)

        try:
            return await orig_work(self, run, *args)
        finally:
            t_end = time.time()
            _rec("work:queued", name, t_sub, started[0] if started else t_end)
            _rec("work", name, t_sub, t_end)

    reporter.StatusReporter._work = work  # type: ignore[method-assign]


def _dump(path: str) -> None:
    with open(path, "w") as fh:
        json.dump(EVENTS, fh)


def agent_main(trace_path: str, cli_args: list[str]) -> int:
    """Run ``edgefl.cli`` with the probes installed; the events are written to ``trace_path`` at exit."""
    install_agent_probes()
    atexit.register(_dump, trace_path)
    from edgefl.cli import main

    return main(cli_args)


def install_coordinator_probes() -> None:
    """Wrap the coordinator's round steps (this process) with probes that record events."""
    from edgefl.coordinator import service
    from edgefl.coordinator.rounds import Round

    _wrap(service.Coordinator, "_announce", "coord:announce")
    _wrap(
        service.Coordinator,
        "handle",
        "coord:handle",
        lambda self, msg: _topic_kind(msg.topic) + " " + msg.topic.rsplit("/", 1)[-1],
    )
    _wrap(service.Coordinator, "run_round", "coord:run_round")
    _wrap(service, "aggregate_checked", "coord:aggregate_checked")
    _wrap(service.Coordinator, "_persist", "coord:persist")
    _wrap(Round, "close", "coord:round.close")
    _probe_hops()


# --- the traced run -----------------------------------------------------------------------------
def traced_run(rounds: int, nodelay: bool, work: Path, dashboard: bool = False) -> dict[str, Any]:
    """One run of ``bench.peer``'s int8 job with probes everywhere; the merged events."""
    import subprocess

    from bench import peer
    from bench.round_overhead import mosquitto
    from edgefl.launcher import stop_agents
    from edgefl.wire.compression import Compression
    from edgefl.wire.global_model import HeadLayout

    job = peer.make_job(work)
    v = peer.Variant("int8", Compression.INT8, HeadLayout.INT8, nodelay, False)
    peer.ROUNDS = rounds
    coord_events: list[tuple[str, str, float, float, str]] = EVENTS
    install_coordinator_probes()
    _probe_gc()
    _maybe_no_quickack()
    profile = peer.HERE.parent / "firmware_configs" / "dev_x86.toml"
    run_dir = Path(tempfile.mkdtemp(prefix="trace-", dir=work))
    traces = [run_dir / f"trace-{i}.json" for i in (1, 2)]
    with mosquitto(run_dir, "set_tcp_nodelay true" if nodelay else "set_tcp_nodelay false") as port:
        proxy = peer.Proxy(run_dir, {"c1": port, "c2": port}, mqtt=True)
        fleet = f"trace{os.getpid()}"
        procs = []
        for i in (1, 2):
            overrides = peer.agent_overrides(run_dir, proxy, fleet, job, i, dashboard=dashboard)
            cmd = [sys.executable, "-OO", "-m", "bench.round_trace", "agent", str(traces[i - 1]), "--"]
            cmd += ["--log-level", "WARNING", "run", str(profile)]
            for key, val in overrides.items():
                cmd += ["--set", f"{key}={val}"]
            with open(run_dir / f"dev-{i}.log", "ab") as log:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "MALLOC_ARENA_MAX": "2"},
                        cwd=peer.HERE.parent,
                    )
                )
        # CPU of each process from a round's start to its aggregation (the coordinator is this process)
        pids = {"coordinator": os.getpid(), "dev-1": procs[0].pid, "dev-2": procs[1].pid}
        cpu: dict[int, dict[str, float]] = {}
        threads: dict[int, dict[str, dict[str, float]]] = {}  # per thread, at each round's start
        timed = peer._TimedCoordinator
        orig_round, orig_publish = timed.run_round, timed.publish_global

        async def run_round(self: Any, round_no: int, *a: Any, **k: Any) -> Any:
            threads[round_no] = {who: thread_cpu_ms(pid) for who, pid in pids.items()}
            cpu[round_no] = {who: -process_cpu_ms(pid) for who, pid in pids.items()}
            return await orig_round(self, round_no, *a, **k)

        async def publish_global(self: Any, round_no: int) -> None:
            if round_no in cpu:
                cpu[round_no] = {who: ms + process_cpu_ms(pids[who]) for who, ms in cpu[round_no].items()}
            await orig_publish(self, round_no)

        timed.run_round, timed.publish_global = run_round, publish_global  # type: ignore[method-assign]
        try:
            starts, _, coord = asyncio.run(peer._edgefl_rounds(port, job, v, fleet))
        finally:
            timed.run_round, timed.publish_global = orig_round, orig_publish  # type: ignore[method-assign]
            stop_agents(procs)
            rows = proxy.stop()
    events = [("coord:" + e[0].removeprefix("coord:"), *e[1:]) for e in coord_events]
    per_agent = {f"dev-{i}": json.loads(traces[i - 1].read_text()) for i in (1, 2)}
    proxy_events = [(f"proxy:{way} {kind}", label, t, t, "proxy") for t, label, way, _n, kind in rows]
    return {
        "starts": starts,
        "agg_at": coord.agg_at,
        "coordinator": events,
        "agents": per_agent,
        "proxy": proxy_events,
        "cpu_ms": cpu,
        # CPU per thread over whole rounds (one round's start to the next's: the global head's
        # handling included), per process and thread name
        "thread_cpu_ms": {
            r: {
                who: {t: ms - threads[r][who].get(t, 0.0) for t, ms in threads[r + 1][who].items()}
                for who in threads[r]
            }
            for r in threads
            if r + 1 in threads
        },
        "loadavg": os.getloadavg(),
    }


KEY_PHASES = (
    # (label, where, event name, detail startswith)
    ("coord: announce (publish + PUBACK)", "coord", "coord:announce", ""),
    ("proxy: round PUBLISH -> client", "proxy", "proxy:down PUBLISH round", ""),
    ("agent: paho hop of the round", "agent", "paho:hop", "_handle_message round"),
    ("agent: handle(global)", "agent", "handle", "global"),
    ("agent: handle(round)", "agent", "handle", "round"),
    ("agent: worker queue wait (receive_round)", "agent", "work:queued", "receive_round"),
    ("agent: receive_round", "agent", "receive_round", ""),
    ("agent: train_local", "agent", "train_local", ""),
    ("agent: feedback.compress (+ residual write)", "agent", "feedback.compress", ""),
    ("agent: sign_message", "agent", "sign_message", ""),
    ("agent: outbox.save (update + answered round)", "agent", "outbox.save", ""),
    ("agent: of which fdatasync (outbox in place)", "agent", "fdatasync", ""),
    ("agent: publish update (+ PUBACK)", "agent", "publish", "update"),
    ("proxy: update PUBLISH <- client", "proxy", "proxy:up PUBLISH update", ""),
    ("coord: update handled", "coord", "coord:handle", "update"),
    ("agent: acknowledged (outbox write)", "agent", "acknowledged", ""),
    ("agent: malloc_trim", "agent", "malloc_trim", ""),
)


def summarize(doc: dict[str, Any], rounds: int) -> list[tuple[str, float, float, float]]:
    """Per key phase: median over rounds 2.. of (start ms, end ms, duration ms) after run_round began."""
    starts = {int(k): v for k, v in doc["starts"].items()}
    out = []
    for label, where, name, detail in KEY_PHASES:
        s_list, e_list, d_list = [], [], []
        for r in range(2, rounds + 1):
            t0, t1 = starts[r], starts[r + 1]
            if where == "coord":
                pools = [doc["coordinator"]]
            elif where == "proxy":
                pools = [doc["proxy"]]
            else:
                pools = list(doc["agents"].values())
            for pool in pools:
                for ev in pool:
                    if ev[0] == name and ev[1].startswith(detail) and t0 <= ev[2] < t1:
                        s_list.append(1e3 * (ev[2] - t0))
                        e_list.append(1e3 * (ev[3] - t0))
                        d_list.append(1e3 * (ev[3] - ev[2]))
                        break  # the first in this round (and pool)
        if s_list:
            out.append(
                (label, statistics.median(s_list), statistics.median(e_list), statistics.median(d_list))
            )
    return out


def timeline(doc: dict[str, Any], r: int) -> list[str]:
    """Every event of round ``r`` (ms after run_round began), sorted."""
    starts = {int(k): v for k, v in doc["starts"].items()}
    t0, t1 = starts[r], starts[r + 1]
    rows: list[tuple[float, str]] = []
    pools = [("coord", doc["coordinator"]), ("proxy", doc["proxy"])]
    pools += [(dev, evs) for dev, evs in doc["agents"].items()]
    for who, evs in pools:
        for name, detail, a, b, thread in evs:
            if t0 <= a < t1:
                rows.append(
                    (
                        a,
                        f"{1e3 * (a - t0):8.2f} {1e3 * (b - t0):8.2f} {1e3 * (b - a):7.2f}  "
                        f"{who:6} {thread[:14]:14} {name} {detail}",
                    )
                )
    agg = doc["agg_at"].get(str(r), doc["agg_at"].get(r))
    if agg is not None:
        rows.append((agg, f"{1e3 * (agg - t0):8.2f}                   coord  publish_global called"))
    return [line for _, line in sorted(rows)]


def main(argv: list[str] | None = None) -> int:
    """Command line: ``agent TRACE -- ARGS`` (internal) or the traced run."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "agent":
        return agent_main(argv[1], argv[3:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--nodelay", action="store_true", help="mosquitto with set_tcp_nodelay true")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--show-round", type=int, default=3)
    p.add_argument("--dashboard", action="store_true", help="the agents' status pages on (bench.peer's int8)")
    p.add_argument(
        "--no-quickack", action="store_true", help="TCP_QUICKACK off in agents, coordinator and proxy"
    )
    args = p.parse_args(argv)
    if args.no_quickack:
        os.environ["BENCH_NO_QUICKACK"] = "1"
    with tempfile.TemporaryDirectory(prefix="trace-") as tmp:
        doc = traced_run(args.rounds, args.nodelay, Path(tmp), args.dashboard)
    starts = {int(k): v for k, v in doc["starts"].items()}
    round_ms = [1e3 * (doc["agg_at"][r] - starts[r]) for r in range(2, args.rounds + 1)]
    print(
        f"load average {doc['loadavg']}; round start -> aggregation, rounds 2..: "
        + ", ".join(f"{x:.1f}" for x in round_ms)
        + f" ms (median {statistics.median(round_ms):.1f})"
    )
    print("\nphase (median over rounds 2.., both devices) | starts ms | ends ms | takes ms")
    for label, s, e, d in summarize(doc, args.rounds):
        print(f"{label:48} {s:8.1f} {e:8.1f} {d:8.2f}")
    rounds = [r for r in range(2, args.rounds + 1) if r in doc["cpu_ms"]]
    if rounds:
        print("\nCPU per round (start -> aggregation), median over rounds 2.., ms:")
        for who in doc["cpu_ms"][rounds[0]]:
            print(f"  {who:12} {statistics.median(doc['cpu_ms'][r][who] for r in rounds):7.2f}")
    cycles = [r for r in range(2, args.rounds) if r in doc["thread_cpu_ms"]]
    if cycles:
        print("\nCPU per whole round (a round's start to the next's) by thread, median, ms:")
        first = doc["thread_cpu_ms"][cycles[0]]
        for who in first:
            for t in first[who]:
                ms = statistics.median(doc["thread_cpu_ms"][r][who].get(t, 0.0) for r in cycles)
                if ms >= 0.05:
                    print(f"  {who:12} {t:16} {ms:7.2f}")
    print(f"\nround {args.show_round}: start ms, end ms, takes ms, who, thread, event")
    print("\n".join(timeline(doc, args.show_round)))
    if args.json is not None:
        args.json.write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
