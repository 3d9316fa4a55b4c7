"""Soak run: a fleet on the shipped profiles for minutes to hours, fed live, with kills of every kind.

Processes, all real: mosquitto (persistence on, as the Debian package runs it), ``edgefl coordinator``
on ``firmware_configs/coordinator.toml`` (``rounds.count = 0``: a service, paced) and N agents
(``edgefl run`` on ``firmware_configs/dev_x86.toml``, live MQTT ingest). A feeder publishes labelled
digits samples to every device, as a gateway app would (``samples/<device>``, QoS 1), each device a
non-IID shard of classes 0-7. A third into the run one device starts seeing classes 8 and 9, which no
device had seen: the fleet must learn them from that one device.

Faults, at random moments (seeded): ``kill -9`` of an agent (restarted 0.5-3 s later on its state
folder), of the coordinator (restarted 1 s later on its state) and of the broker (restarted 1-3 s later
on its persistence file). Once, half-way, a second coordinator is started on the same profile: it must
exit with code 6 ("another coordinator runs this fleet") and leave the first one unharmed.

Settings the bench changes from the shipped profiles (and why): broker URL, fleet name and state/log
paths (one run's own folder); ``rounds.interval_s`` and ``rounds.min_new_samples`` (so that a run of
minutes holds tens of rounds, ``--interval-s``, ``--min-new-samples``); the agents' dashboards are off
(N pages on one machine measure nothing here). The feeder pauses a device's feed while that device is
down (a gateway app's samples for a dead agent are the broker session's business, not the store's):
what a kill loses is then exactly what the store had not made durable.

What is measured (the JSON, ``--json PATH``):

- ``updates_acknowledged``: updates a device logged as sent (its broker's PUBACK came back);
  ``updates_counted``: update ids in the coordinator's ``rounds.jsonl``; ``updates_lost``: acknowledged
  and never counted, excluding those the coordinator refused for a stated reason that is not a crash
  (late, or ``round_closed``: the round had closed), those of rounds it abandoned with a reason
  (both listed) and those of the round still open at the end, saved in its state file
  (``updates_saved_open``: a restarted coordinator resumes that round and counts them);
  ``double_counted``: ids counted more than once.
- ``samples_fed``; ``samples_lost_max_per_kill``: for each agent kill, samples acknowledged to that
  device during the killed lifetime (less the last 0.3 s, still in flight) minus the store rows that
  lifetime added and the restarted agent recovered (its first status's ``store_samples`` and
  ``holdout_samples``);
  ``flush_window_samples``: ``training.flush_every`` of the profile in force.
- ``new_classes``: ``introduced_round``, ``rounds_to_learn`` (rounds until the global head's accuracy on
  test samples of the new classes reaches 0.8; null if never), ``accuracy_on_new`` (20 rounds after the
  introduction, or at the end).
- ``rss_growth_mib_per_hour``: growth in the steady state of a process that lives long, MiB per hour:
  ``agents_max`` (the worst agent) and ``coordinator``. Measured on anonymous RSS (``RssAnon``: heap,
  stacks, the interpreter's own memory; a leak shows there), sampled every 5 s from ``/proc``; each
  lifetime's resting level (the lowest sample of every 30 s: a round's transient peak, freed within
  seconds, is not growth) after its first :data:`STEADY_WARMUP_S` (imports, the first rounds,
  the allocators' high-water marks), least-squares slope pooled over the lifetimes of that role
  that were measured for at least :data:`STEADY_MIN_S` after it (each its own intercept). A process
  killed within minutes has no steady state: its slope would be its warm-up. So one agent (the last
  device, ``--witness-agents``) is never killed, and the others take every agent kill; the
  coordinator's figure needs a run with ``--coordinator-kills 0`` (null when no lifetime of the role
  lived long enough). ``rss_growth_method`` states these settings and which lifetimes counted.
  ``rss_total_growth_mib_per_hour`` is the same of ``VmRSS``, which also counts the file-backed pages
  of the agents' memory-mapped stores: those grow with every sample stored until the ring is full
  (``training.store_capacity`` rows), by design. ``rss_warmup_growth_mib_per_hour``: the slope pooled
  over every lifetime after its first 60 s, warm-up included (what a fleet restarted every few minutes
  shows; not growth). ``rss_lifetimes``: per role, the lifetimes measured, those long enough for the
  steady state, and the longest one (minutes).
- ``second_coordinator_refused``: every second coordinator exited 6 and the first kept running.

``--probe-dir DIR`` runs each agent and coordinator through :mod:`bench.rss_probe`'s sampler (a thread in
the process appending ``RssAnon`` and glibc's ``mallinfo2`` to ``DIR/<device>.jsonl`` or
``DIR/<state folder>.jsonl`` every 30 s, each line with its pid): where a growth is, heap in use, free or
mmapped; ``--probe-coordinator td`` adds tracemalloc to the coordinator's and dumps each snapshot beside
it. The product is the same.

Run: ``python -m bench.soak --minutes 8 --devices 5 --json out/soak.json``; docs/benchmarks.md
("Soak") records a 30-minute run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2
import numpy as np

from edgefl.datasets import load_digits, partition_non_iid, split_digits
from edgefl.head import Head
from edgefl.profiles import read_toml
from edgefl.records import read_record
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.global_model import decode_global_model, resolve_global_head
from edgefl.wire.ingest import Sample, encode_sample
from edgefl.wire.rounds import decode_round
from edgefl.wire.status import decode_status

ROOT = Path(__file__).resolve().parent.parent
DEVICE_PROFILE = ROOT / "firmware_configs" / "dev_x86.toml"
COORDINATOR_PROFILE = ROOT / "firmware_configs" / "coordinator.toml"
NEW_CLASSES = (8, 9)
EXIT_ANOTHER_COORDINATOR = 6
WARMUP_S = 60.0
STEADY_WARMUP_S = 300.0
"""Seconds of a lifetime left out of the steady-state RSS slope (module docstring)."""
STEADY_MIN_S = 900.0
"""Seconds a lifetime must be measured after :data:`STEADY_WARMUP_S` to count in the steady-state slope."""
REST_WINDOW_S = 30.0
IN_FLIGHT_S = 0.3


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mosquitto() -> str:
    path = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )
    if path is None:
        raise SystemExit("bench.soak needs mosquitto: apt-get install mosquitto")
    return path


class Broker:
    """mosquitto on 127.0.0.1:``port`` with persistence in ``workdir``, as a packaged broker runs."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir, self.port = workdir, port
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(
            f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {workdir}/\nautosave_interval 60\nlog_dest stderr\n"
            # as root, mosquitto's own user cannot write under a 0700 folder: its state was lost at restarts
            + ("user root\n" if os.geteuid() == 0 else "")
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start mosquitto and wait until it listens (10 s at most)."""
        with open(self.workdir / "mosquitto.log", "ab") as log:
            self.proc = subprocess.Popen([_mosquitto(), "-c", str(self.conf)], stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return
            time.sleep(0.05)
        raise RuntimeError("mosquitto did not listen within 10 s")

    def kill(self) -> None:
        """``kill -9`` (what it had not saved is lost, as after an OOM kill)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM (mosquitto saves its persistence file) and wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Lifetime:
    """One process's life: when it started, its RSS samples ``(t, bytes)``: anonymous and total."""

    pid: int
    started: float
    rss: list[tuple[float, int]] = field(default_factory=list)
    total: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class DeviceFeed:
    """The feeder's view of one device."""

    x: np.ndarray
    y: np.ndarray
    new_x: np.ndarray | None = None
    up: bool = False
    pos: int = 0
    acks: list[float] = field(default_factory=list)  # monotonic time of every acknowledged sample
    lifetime_start: float = 0.0
    rows_at_start: int | None = None
    pending_kill: float | None = None  # when it was killed, until its restart is accounted


class Soak:
    """One soak run in ``workdir``: processes, feeder, monitor, faults and the figures they give."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.rng = random.Random(args.seed)
        self.fleet = f"soak{args.seed}"
        self.topics = Topics("edgefl", self.fleet)
        self.port = free_port()
        self.broker = Broker(workdir, self.port)
        self.url = f"mqtt://127.0.0.1:{self.port}"
        self.devices = [f"dev-{k + 1}" for k in range(args.devices)]
        # never killed: their lifetimes give the agents' steady-state RSS (the last devices; not the first,
        # which sees the new classes)
        n_witness = min(int(getattr(args, "witness_agents", 1)), max(0, len(self.devices) - 1))
        self.witnesses = self.devices[len(self.devices) - n_witness :] if n_witness else []
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.lifetimes: dict[str, list[Lifetime]] = {}
        self.log_offset: dict[str, int] = {}
        self.feeds: dict[str, DeviceFeed] = {}
        self.status: dict[str, dict[str, Any]] = {}
        self.status_seen = asyncio.Event()
        self.round = 0
        self.heads: list[tuple[int, int, float, float]] = []  # (round, version, acc_new, acc_all)
        self._head: tuple[int, np.ndarray, np.ndarray] | None = None  # (version, W, b) held
        self.introduced_round: int | None = None
        self.kills: dict[str, int] = {"agent": 0, "coordinator": 0, "broker": 0}
        self.lost_per_kill: list[int] = []
        self.second: list[dict[str, Any]] = []
        self.samples_fed = 0
        _, profile = read_toml(DEVICE_PROFILE)
        training = profile.get("training", {})
        self.flush_every = int(training.get("flush_every", 64))
        self._prepare_data()

    # --- data -------------------------------------------------------------------------------------
    def _prepare_data(self) -> None:
        x, y = load_digits()
        split = split_digits(y, seed=self.args.seed)
        pool = split.devices
        old = pool[y[pool] < min(NEW_CLASSES)]
        new = pool[np.isin(y[pool], NEW_CLASSES)]
        shards = partition_non_iid(y[old], len(self.devices), seed=self.args.seed)
        for dev, shard in zip(self.devices, shards, strict=True):
            self.feeds[dev] = DeviceFeed(x[old[shard]], y[old[shard]])
        self.feeds[self.devices[0]].new_x = new
        self._x, self._y = x, y
        test = split.test
        _, profile = read_toml(DEVICE_PROFILE)
        model = (DEVICE_PROFILE.parent / profile["model"]["path"]).resolve()
        self.model = model
        backbone = Backbone(model, num_threads=1)
        from edgefl.agent.pipeline import Pipeline

        pipe = profile["pipeline"]
        emb = Pipeline(backbone, tuple(pipe["mean"]), tuple(pipe["std"]), mode="unfused", batch=1).run(
            x[test]
        )[0]
        self.test_emb, self.test_y = emb, y[test]

    def _next_sample(self, dev: str, now: float, introduce_at: float) -> tuple[np.ndarray, int]:
        f = self.feeds[dev]
        if f.new_x is not None and now >= introduce_at and self.rng.random() < 0.5:
            i = int(self.rng.choice(f.new_x))
            return self._x[i], int(self._y[i])
        i = f.pos % len(f.y)
        f.pos += 1
        return f.x[i], int(f.y[i])

    # --- processes --------------------------------------------------------------------------------
    def _track(self, role: str, proc: subprocess.Popen[bytes]) -> None:
        self.lifetimes.setdefault(role, []).append(Lifetime(proc.pid, time.monotonic()))

    def start_agent(self, dev: str) -> None:
        """Start ``edgefl run`` for ``dev`` on the shipped x86 profile and its own state folder."""
        sets = {
            "device.id": dev,
            "device.fleet": self.fleet,
            "device.state_dir": str(self.workdir / dev),
            "broker.url": self.url,
            "training.seed": str(self.args.seed),
            "dashboard.enabled": "false",
        }
        cmd = [sys.executable, "-OO", "-m", "edgefl.cli", "--log-level", "INFO", "run", str(DEVICE_PROFILE)]
        probe = getattr(self.args, "probe_dir", None)
        if probe is not None:  # the same command through bench.rss_probe's sampler (its heap every 30 s)
            cmd[3:4] = [
                "bench.rss_probe",
                "wrap",
                str(Path(probe).resolve() / f"{dev}.jsonl"),
                "30",
                "-",
                "--",
            ]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        log_path = self.workdir / f"{dev}.log"
        self.log_offset[dev] = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.agents[dev] = proc
        self._track(dev, proc)

    def coordinator_cmd(self, state_dir: Path) -> list[str]:
        """``edgefl coordinator`` on the shipped profile, with the bench's changes (module docstring)."""
        sets = {
            "broker.url": self.url,
            "fleet.name": self.fleet,
            "files.state": str(state_dir / "state.rec"),
            "files.log": str(state_dir / "rounds.jsonl"),
            "rounds.interval_s": str(self.args.interval_s),
            "rounds.min_new_samples": str(self.args.min_new_samples),
        }
        for item in self.args.coordinator_set:
            key, _, value = item.partition("=")
            sets[key] = value
        cmd = [sys.executable, "-OO", "-m", "edgefl.cli", "--log-level", "INFO", "coordinator"]
        probe = getattr(self.args, "probe_dir", None)
        if probe is not None:  # the same command through bench.rss_probe's sampler, as the agents'
            flags = getattr(self.args, "probe_coordinator", "-")
            out = Path(probe).resolve() / f"{state_dir.name}.jsonl"
            cmd[3:4] = ["bench.rss_probe", "wrap", str(out), "30", flags, "--"]
        cmd.append(str(COORDINATOR_PROFILE))
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        return cmd

    def start_coordinator(self) -> None:
        """Start the fleet's coordinator on its state folder."""
        state = self.workdir / "coordinator"
        state.mkdir(exist_ok=True)
        with open(self.workdir / "coordinator.log", "ab") as log:
            self.coordinator = subprocess.Popen(
                self.coordinator_cmd(state), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
            )
        self._track("coordinator", self.coordinator)

    async def try_second_coordinator(self, same_state: bool) -> None:
        """Start a second coordinator for the fleet; record its exit code and the first one's fate."""
        state = (
            self.workdir / "coordinator" if same_state else self.workdir / f"coordinator-b{len(self.second)}"
        )
        state.mkdir(exist_ok=True)
        first = self.coordinator
        before = _lines(self.workdir / "coordinator" / "rounds.jsonl")
        with open(self.workdir / f"second-{len(self.second)}.log", "wb") as log:
            p = subprocess.Popen(self.coordinator_cmd(state), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        t0 = time.monotonic()
        while p.poll() is None and time.monotonic() - t0 < 30:
            await asyncio.sleep(0.1)
        if p.poll() is None:
            p.kill()
            p.wait()
        after = _lines(self.workdir / "coordinator" / "rounds.jsonl")
        rounds_before = [json.loads(line).get("round") for line in before]
        self.second.append(
            {
                "same_state_folder": same_state,
                "exit": p.returncode,
                "seconds": round(time.monotonic() - t0, 2),
                "first_alive": first is not None and first.poll() is None and first is self.coordinator,
                "records_intact": after[: len(before)] == before
                and len(set(rounds_before)) == len(rounds_before),
                # its own lock file aside (taken before it asks the broker), nothing in its folder
                "wrote_nothing": same_state or not [f for f in state.iterdir() if f.suffix != ".lock"],
            }
        )

    def kill_agent(self, dev: str) -> None:
        """``kill -9`` an agent and account the samples its store had not made durable."""
        f = self.feeds[dev]
        f.up = False
        t_kill = time.monotonic()
        self.agents[dev].kill()
        self.agents[dev].wait()
        self.kills["agent"] += 1
        f.pending_kill = t_kill

    # --- monitor ----------------------------------------------------------------------------------
    def handle(self, topic: str, payload: bytes) -> None:
        """A message the monitor follows: round announcements, global heads, device statuses."""
        if not payload:
            return
        with contextlib.suppress(Exception):  # the monitor observes; a message it cannot read is not its job
            if topic == self.topics.round:
                self.round = max(self.round, decode_round(payload).round)
            elif topic == self.topics.global_model:
                g = decode_global_model(payload)
                if self._head is not None:
                    g = resolve_global_head(g, self._head[0], self._head[1], self._head[2])
                elif g.base_version is not None:
                    return  # a delta before any full head: the retained full head comes next
                self._head = (g.version, np.asarray(g.W, np.float32), np.asarray(g.b, np.float32))
                if not self.heads or self.heads[-1][1] != g.version:
                    W, b = self._head[1], self._head[2]
                    pred = Head(W, b).predict(self.test_emb)
                    new = np.isin(self.test_y, NEW_CLASSES)
                    acc_new = float(np.mean(pred[new] == self.test_y[new]))
                    acc_all = float(np.mean(pred == self.test_y))
                    self.heads.append((g.round, g.version, acc_new, acc_all))
            else:
                dev = self.topics.device_of(topic)
                if dev is not None and topic == self.topics.status(dev):
                    st = decode_status(payload)
                    fields = dict(st.fields)
                    fields["state"] = st.state
                    fields["_t"] = time.monotonic()
                    self.status[dev] = fields
                    self.status_seen.set()

    # --- the run ----------------------------------------------------------------------------------
    async def feeder(self, t: MqttTransport, t0: float, t_end: float) -> None:
        """Publish one labelled sample per device every ``1 / rate`` seconds while the device is up."""
        period = 1.0 / self.args.rate
        introduce_at = t0 + (t_end - t0) / 3
        seq = 0
        while time.monotonic() < t_end:
            tick = time.monotonic()
            if self.introduced_round is None and tick >= introduce_at:
                self.introduced_round = self.round
            for dev in self.devices:
                f = self.feeds[dev]
                if not f.up:
                    continue
                x, label = self._next_sample(dev, tick, introduce_at)
                seq += 1
                payload = encode_sample(Sample(f"s{seq}", np.ascontiguousarray(x), label, time.time()))
                with contextlib.suppress(Exception):  # broker down: that sample is not fed
                    await t.publish(self.topics.samples(dev), payload, qos=1, timeout_s=2.0)
                    f.acks.append(time.monotonic())
                    self.samples_fed += 1
            await asyncio.sleep(max(0.0, period - (time.monotonic() - tick)))

    async def watch_agents(self) -> None:
        """Mark a device up again once its restarted agent's first status is seen; account the kill."""
        while True:
            await asyncio.sleep(0.1)
            for dev in self.devices:
                f = self.feeds[dev]
                proc = self.agents.get(dev)
                if f.up or proc is None or proc.poll() is not None:
                    continue
                st = self.status.get(dev)
                life = self.lifetimes[dev][-1]
                if st is None or st["_t"] < life.started or st.get("state") == "offline":
                    continue
                rows = st.get("store_samples")
                if not isinstance(rows, int):
                    continue
                rows += int(st.get("holdout_samples", 0))  # every n-th labelled sample is held out
                if f.pending_kill is not None and f.rows_at_start is not None:
                    fed = sum(1 for a in f.acks if f.lifetime_start <= a < f.pending_kill - IN_FLIGHT_S)
                    self.lost_per_kill.append(max(0, fed - (rows - f.rows_at_start)))
                    f.pending_kill = None
                f.rows_at_start, f.lifetime_start, f.up = rows, time.monotonic(), True

    async def sample_rss(self) -> None:
        """RSS of every live agent and coordinator process, every 5 s (``/proc/<pid>/status``)."""
        while True:
            now = time.monotonic()
            for lives in self.lifetimes.values():
                life = lives[-1]
                rss = _rss_bytes(life.pid)
                if rss is not None:
                    life.rss.append((now, rss[0]))
                    life.total.append((now, rss[1]))
            await asyncio.sleep(5.0)

    def plan(self, t0: float, duration: float) -> list[tuple[float, str]]:
        """Fault times: each kind's count spread at random over the run (not in its first 30 s)."""
        a = self.args
        out: list[tuple[float, str]] = []
        for kind, n in (
            ("agent", a.agent_kills),
            ("coordinator", a.coordinator_kills),
            ("broker", a.broker_kills),
        ):
            slot = (duration - 30.0) / max(1, n)
            out += [(t0 + 30.0 + slot * (i + self.rng.random()), kind) for i in range(n)]
        out.append((t0 + duration / 2, "second-coordinator"))
        out.append((t0 + duration / 2 + 20.0, "second-coordinator-other-state"))
        return sorted(out)

    async def run(self) -> dict[str, Any]:
        """Run the soak; return its figures (module docstring)."""
        a = self.args
        duration = a.minutes * 60.0
        self.broker.start()
        monitor = MqttTransport("127.0.0.1", self.port, f"soak-monitor-{self.fleet}")
        feeder_t = MqttTransport("127.0.0.1", self.port, f"soak-feeder-{self.fleet}")
        tasks: list[asyncio.Task[Any]] = []
        try:
            await monitor.start(wait_s=10)
            await feeder_t.start(wait_s=10)
            for topic in (self.topics.round, self.topics.global_model, self.topics.status("+")):
                await monitor.subscribe(topic, 1)

            async def pump() -> None:
                while True:
                    msg = await monitor.queue.get()
                    self.handle(msg.topic, msg.payload)

            for dev in self.devices:
                self.start_agent(dev)
            self.start_coordinator()
            t0 = time.monotonic()
            t_end = t0 + duration
            tasks = [
                asyncio.create_task(pump()),
                asyncio.create_task(self.watch_agents()),
                asyncio.create_task(self.sample_rss()),
                asyncio.create_task(self.supervise()),
            ]
            feed = asyncio.create_task(self.feeder(feeder_t, t0, t_end))
            tasks.append(feed)
            for when, kind in self.plan(t0, duration):
                await asyncio.sleep(max(0.0, when - time.monotonic()))
                await self.fault(kind)
            await feed
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self.stop_all()
            await monitor.stop()
            await feeder_t.stop()
            self.broker.stop()
        return self.figures()

    async def supervise(self) -> None:
        """Restart what died on its own, as systemd's ``Restart=on-failure`` would (counted)."""
        while True:
            await asyncio.sleep(0.5)
            c = self.coordinator
            if c is not None and c.poll() is not None and c.returncode not in (0, -signal.SIGKILL):
                await asyncio.sleep(1.0)
                if self.coordinator is c:
                    self.start_coordinator()

    async def fault(self, kind: str) -> None:
        """Carry out one planned fault."""
        if kind == "agent":
            killable = [d for d in self.devices if d not in self.witnesses] or self.devices
            up = [d for d in killable if self.feeds[d].up] or killable
            dev = self.rng.choice(up)
            self.kill_agent(dev)
            await asyncio.sleep(self.rng.uniform(0.5, 3.0))
            self.start_agent(dev)
        elif kind == "coordinator":
            assert self.coordinator is not None
            self.coordinator.kill()
            self.coordinator.wait()
            self.kills["coordinator"] += 1
            await asyncio.sleep(1.0)
            self.start_coordinator()
        elif kind == "broker":
            self.broker.kill()
            self.kills["broker"] += 1
            await asyncio.sleep(self.rng.uniform(1.0, 3.0))
            self.broker.start()
        elif kind.startswith("second-coordinator"):
            await self.try_second_coordinator(same_state=kind == "second-coordinator")

    def stop_all(self) -> None:
        """SIGTERM every agent; once the coordinator has closed the rounds their acknowledged updates are
        for (20 s at most: updates still in the broker's queue at the end are neither lost nor counted
        yet), SIGTERM it; SIGKILL what is still there after 15 s."""
        _stop(list(self.agents.values()))
        if self.coordinator is None or self.coordinator.poll() is not None:
            return
        give_up = time.monotonic() + 20.0
        while time.monotonic() < give_up and self._acknowledged_round() > self._closed_round():
            time.sleep(0.2)
        _stop([self.coordinator])

    def _acknowledged_round(self) -> int:
        """The latest round any device logged an acknowledged update for (0: none)."""
        rounds = [
            int(r)
            for dev in self.devices
            for r in re.findall(r"round (\d+): sent update", _read(self.workdir / f"{dev}.log"))
        ]
        return max(rounds, default=0)

    def _closed_round(self) -> int:
        """The latest round in the coordinator's round log (0: none)."""
        lines = [json.loads(s) for s in _lines(self.workdir / "coordinator" / "rounds.jsonl")]
        return max((int(line.get("round", 0)) for line in lines), default=0)

    # --- figures ----------------------------------------------------------------------------------
    def figures(self) -> dict[str, Any]:
        """The JSON of the run (module docstring)."""
        lines = [json.loads(s) for s in _lines(self.workdir / "coordinator" / "rounds.jsonl")]
        counted: dict[str, int] = {}
        for line in lines:
            for u in line.get("update_ids", []):
                counted[u] = counted.get(u, 0) + 1
        counted_keys = {_dev_round(u) for u in counted}
        acked: set[tuple[str, int]] = set()
        for dev in self.devices:
            text = _read(self.workdir / f"{dev}.log")
            acked |= {(dev, int(r)) for r in re.findall(r"round (\d+): sent update", text)}
        coord_log = _read(self.workdir / "coordinator.log")
        late = {
            (d, int(r)) for d, r in re.findall(r"update from (\S+) for round (\d+) refused: late", coord_log)
        } | {  # came after its round had closed (the devices it asked had answered): refused, with a reason
            (d, int(r))
            for d, r in re.findall(
                r"/update/(\S+) \(\d+ bytes\): round_closed: round (\d+) is closed", coord_log
            )
        }
        abandoned = {int(r) for r in re.findall(r"round (\d+) refused: abandoned", coord_log)}
        saved = _saved_open_round(self.workdir / "coordinator" / "state.rec")
        lost = sorted(
            k for k in acked - counted_keys if k not in late and k[1] not in abandoned and k not in saved
        )
        intro = self.introduced_round
        new: dict[str, Any] = {"introduced_round": intro, "rounds_to_learn": None, "accuracy_on_new": None}
        if intro is not None:
            after = [h for h in self.heads if h[0] >= intro]
            learned = [h for h in after if h[2] >= 0.8]
            if learned:
                new["rounds_to_learn"] = learned[0][0] - intro
            at = [h for h in after if h[0] <= intro + 20]
            if at:
                new["accuracy_on_new"] = round(at[-1][2], 4)
            new["accuracy_on_new_by_round"] = [[h[0], round(h[2], 3)] for h in after[::5]]

        def worst(values: list[float | None]) -> float | None:
            return max((g for g in values if g is not None), default=None)

        agent_lives = {d: self.lifetimes.get(d, []) for d in self.devices}
        coordinator_lives = self.lifetimes.get("coordinator", [])
        second_ok = bool(self.second) and all(
            s["exit"] == EXIT_ANOTHER_COORDINATOR
            and s["first_alive"]
            and s["records_intact"]
            and s["wrote_nothing"]
            for s in self.second
        )
        return {
            "minutes": self.args.minutes,
            "devices": len(self.devices),
            "seed": self.args.seed,
            "rounds": len({line.get("round") for line in lines}),
            "updates_acknowledged": len(acked),
            "updates_counted": sum(counted.values()),
            "updates_lost": len(lost),
            "lost": [f"{d}:{r}" for d, r in lost],
            "updates_saved_open": len(saved - counted_keys),
            "updates_refused_late": len(late),
            "rounds_abandoned": sorted(abandoned),
            "double_counted": sum(n - 1 for n in counted.values() if n > 1),
            "agent_kills": self.kills["agent"],
            "coordinator_kills": self.kills["coordinator"],
            "broker_restarts": self.kills["broker"],
            "samples_fed": self.samples_fed,
            "samples_lost_per_kill": self.lost_per_kill,
            "samples_lost_max_per_kill": max(self.lost_per_kill, default=0),
            "flush_window_samples": self.flush_every,
            "new_classes": new,
            "final_accuracy": round(self.heads[-1][3], 4) if self.heads else None,
            "rss_growth_mib_per_hour": {
                "agents_max": worst([_steady_growth(lives) for lives in agent_lives.values()]),
                "coordinator": _steady_growth(coordinator_lives),
            },
            "rss_growth_method": {
                "measure": "RssAnon, lowest sample of every 30 s",
                "warmup_s": STEADY_WARMUP_S,
                "min_steady_s": STEADY_MIN_S,
                "witness_agents": self.witnesses,
                "agents_counted": sorted(
                    f"{d}#{k}"
                    for d, lives in agent_lives.items()
                    for k, life in enumerate(lives)
                    if _steady_growth([life]) is not None
                ),
                "coordinator_counted": sum(
                    1 for life in coordinator_lives if _steady_growth([life]) is not None
                ),
            },
            "rss_total_growth_mib_per_hour": {
                "agents_max": worst([_steady_growth(lives, total=True) for lives in agent_lives.values()]),
                "coordinator": _steady_growth(coordinator_lives, total=True),
            },
            "rss_warmup_growth_mib_per_hour": {
                "agents_max": worst([_growth_mib_per_hour(lives) for lives in agent_lives.values()]),
                "coordinator": _growth_mib_per_hour(coordinator_lives),
            },
            "rss_lifetimes": {
                "agents": _lives_summary([life for lives in agent_lives.values() for life in lives]),
                "coordinator": _lives_summary(coordinator_lives),
            },
            "second_coordinator_refused": second_ok,
            "second_coordinators": self.second,
            "settings_changed": {
                "rounds.interval_s": self.args.interval_s,
                "rounds.min_new_samples": self.args.min_new_samples,
                "dashboard.enabled (agents)": False,
                **dict(item.partition("=")[::2] for item in self.args.coordinator_set),
            },
        }


def _lines(path: Path) -> list[str]:
    return [s for s in _read(path).splitlines() if s.strip()]


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM ``procs``, then SIGKILL each one still running after 15 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _saved_open_round(state: Path) -> set[tuple[str, int]]:
    """``(device, round)`` of the updates in the open round the coordinator saved at its stop (its state
    file's ``open.update_ids``): accepted and acknowledged, counted when a restarted coordinator resumes
    the round, so neither lost nor counted yet. Empty when no round was open or there is no state file."""
    data = read_record(state)
    if data is None:
        return set()
    opened = cbor2.loads(data).get("open") or {}
    return {_dev_round(u) for u in opened.get("update_ids", [])}


def _dev_round(update_id: str) -> tuple[str, int]:
    dev, rnd = update_id.split(":")[:2]
    return dev, int(rnd)


def _rss_bytes(pid: int) -> tuple[int, int] | None:
    """``(RssAnon, VmRSS)`` of ``pid`` in bytes, None once it is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return int(fields["RssAnon"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024
    except (OSError, ValueError, KeyError):
        return None


def _resting(pts: list[tuple[float, int]], window_s: float = REST_WINDOW_S) -> list[tuple[float, int]]:
    """The lowest sample of each ``window_s`` of ``pts`` (``(t, bytes)``, time order): the resting level."""
    out: list[tuple[float, int]] = []
    cur: list[tuple[float, int]] = []
    for p in pts:
        if cur and p[0] - cur[0][0] >= window_s:
            out.append(min(cur, key=lambda q: q[1]))
            cur = []
        cur.append(p)
    if cur and cur[-1][0] - cur[0][0] >= window_s / 2:  # a last window at least half full
        out.append(min(cur, key=lambda q: q[1]))
    return out


def _lives_summary(lives: list[Lifetime]) -> dict[str, Any]:
    """Lifetimes measured, those measured long enough for the steady-state slope, and the longest one
    (minutes, from the start to the last sample)."""
    spans = [life.rss[-1][0] - life.started for life in lives if life.rss]
    return {
        "measured": len(spans),
        "steady": sum(1 for s in spans if s >= STEADY_WARMUP_S + STEADY_MIN_S),
        "longest_minutes": round(max(spans, default=0.0) / 60, 1),
    }


def _growth_mib_per_hour(
    lives: list[Lifetime], *, total: bool = False, warmup_s: float = WARMUP_S, min_span_s: float = 0.0
) -> float | None:
    """Least-squares slope of the resting RSS pooled over lifetimes (each its own intercept), after
    ``warmup_s`` of each, over the lifetimes measured for at least ``min_span_s`` after it; MiB/h (None
    without enough samples)."""
    sxx = sxy = 0.0
    for life in lives:
        kept = [(t, r) for t, r in (life.total if total else life.rss) if t - life.started >= warmup_s]
        if not kept or kept[-1][0] - life.started < warmup_s + min_span_s:
            continue
        pts = _resting(kept)
        if len(pts) < 3:
            continue
        t = np.array([p[0] for p in pts])
        r = np.array([p[1] for p in pts], dtype=np.float64)
        t -= t.mean()
        sxx += float(t @ t)
        sxy += float(t @ (r - r.mean()))
    if sxx == 0:
        return None
    return round(sxy / sxx * 3600 / 2**20, 3)


def _steady_growth(lives: list[Lifetime], *, total: bool = False) -> float | None:
    """:func:`_growth_mib_per_hour` over the steady state (:data:`STEADY_WARMUP_S`, :data:`STEADY_MIN_S`)."""
    return _growth_mib_per_hour(lives, total=total, warmup_s=STEADY_WARMUP_S, min_span_s=STEADY_MIN_S)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.soak``: run, print and write the JSON (exit 0; the goals are read off it)."""
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--devices", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=2.0, help="labelled samples per second per device")
    p.add_argument(
        "--interval-s", type=float, default=4.0, help="rounds.interval_s (shipped: see the profile)"
    )
    p.add_argument("--min-new-samples", type=int, default=16, help="rounds.min_new_samples")
    p.add_argument("--agent-kills", type=int, default=None, help="default: one every two minutes")
    p.add_argument("--coordinator-kills", type=int, default=None, help="default: one every two minutes")
    p.add_argument("--broker-kills", type=int, default=None, help="default: one every two minutes")
    p.add_argument(
        "--witness-agents",
        type=int,
        default=1,
        help="agents never killed (the last devices): their steady-state RSS (default 1)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep the run's files here")
    p.add_argument(
        "--probe-dir",
        type=Path,
        default=None,
        help="agents and coordinators through bench.rss_probe's sampler: DIR/<dev>.jsonl, "
        "DIR/coordinator.jsonl, RssAnon and mallinfo2 every 30 s",
    )
    p.add_argument(
        "--probe-coordinator",
        default="-",
        metavar="FLAGS",
        help="the coordinator sampler's flags (bench.rss_probe wrap): t tracemalloc, d its snapshots, m maps",
    )
    p.add_argument(
        "--coordinator-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another change to the shipped coordinator profile (listed in the JSON's settings_changed)",
    )
    args = p.parse_args(argv)
    if args.probe_dir is not None:
        args.probe_dir.mkdir(parents=True, exist_ok=True)
    every_two = max(1, math.ceil(args.minutes / 2))
    for k in ("agent_kills", "coordinator_kills", "broker_kills"):
        if getattr(args, k) is None:
            setattr(args, k, every_two)
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgefl-soak-")))
        else:
            workdir = args.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(Soak(args, workdir).run())
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    sys.exit(main())
