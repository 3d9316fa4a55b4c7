"""The coordinator's round loop: announces rounds, collects updates, aggregates, publishes the global head.

One loop (``run_round``), two schedules chosen by ``RoundConfig.schedule``: synchronous rounds
(McMahan et al. 2017, Algorithm 1) and buffered-asynchronous steps (Nguyen et al. 2022, FedBuff).
Updates come in through the intake (:class:`~edgefl.coordinator.intake.Intake`); the head and the
announcement are published retained, and a head the agents would refuse is never sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack

import numpy as np

from edgefl.aio import wait_event
from edgefl.coordinator.history import (
    COUNTED_ROUNDS,
    HISTORY_ROUNDS,
    RoundRecord,
    federated_evaluation,
    page_record,
    personal_heads_summary,
)
from edgefl.coordinator.intake import Intake, IntakeOptions
from edgefl.coordinator.rounds import (
    FleetPhase,
    FleetState,
    Pacing,
    Round,
    RoundPhase,
    device_names,
)
from edgefl.coordinator.strategy import RoundConfig, Schedule, aggregate_checked
from edgefl.errors import BrokerRefused, TransportError
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.types import F32
from edgefl.wire.chunking import split_message
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import GlobalModel, HeadLayout, encode_global_model
from edgefl.wire.rounds import RoundAnnouncement, encode_round
from edgefl.wire.signing import sign_message

logger = logging.getLogger(__name__)

PUBLISH_RETRY_S = 120.0
"""How long a coordinator publish waits out a broker outage before giving up (seconds)."""

ADOPT_WAIT_S = 2.0
"""How long a coordinator without state waits for the fleet's retained round and head (seconds)."""

STATE_RETRY_S = 5.0
"""How often a closed round's refused state write (a full disk) is tried again (seconds)."""

PACING_RECHECK_S = 0.5
"""Least time between two checks of the pacing while a service waits (statuses come in bursts)."""
WAIT_LOG_EVERY_S = 60.0
"""A waiting service logs a new kind of wait at once, and a count moving within it at most this often (s)."""

#: Rounds of ``accuracy_history`` in the page's status document (the last ones).
PAGE_HISTORY = 500
#: Names of silent devices kept per round (page and round log); ``silent_devices`` counts them all.
SILENT_KEPT = 100


def round_reasons(
    refused: Mapping[str, int], declined: Mapping[str, int], silent: Sequence[str]
) -> dict[str, Any]:
    """A round's reasons as the page and the round log read them (a new dict each call).

    ``refused``, ``declined``: ``{reason: count}``; ``silent``: the devices asked that never answered,
    of which the first :data:`SILENT_KEPT` names are kept and ``silent_devices`` counts them all.
    """
    return {
        "refused": dict(refused),
        "declined": dict(declined),
        "silent": list(silent[:SILENT_KEPT]),
        "silent_devices": len(silent),
    }


class Coordinator(Intake):
    """Runs a fleet's rounds over MQTT: opens each as the pacing allows, announces, closes, aggregates it.

    ``compression`` asked of the devices (``topk_fraction``: the share top-k keeps); ``downlink``: the
    published head's layout (``docs/protocol.md``); a round announces ``lr * lr_decay ** e``, ``e`` the
    rounds since the episode began (``docs/operations.md``); ``quorum``: as ``Round.close_at``;
    ``pacing``: when :meth:`wait_to_open` opens the next round (None: at once). The rest as
    :class:`~edgefl.coordinator.intake.Intake`, whose ``signing_key`` also signs every GlobalModel and
    RoundAnnouncement (one above ``max_packet_bytes`` goes out as retained chunks).
    """

    def __init__(
        self,
        transport: MqttTransport,
        topics: Topics,
        W: F32,
        b: F32,
        *,
        compression: Compression = Compression.NONE,
        topk_fraction: float = 0.1,
        downlink: HeadLayout = HeadLayout.FLOAT32,
        lr_decay: float = 1.0,
        quorum: float | None = None,
        pacing: Pacing | None = None,
        **intake: Unpack[IntakeOptions],
    ) -> None:
        super().__init__(transport, topics, W, b, **intake)
        self.compression = compression
        self.topk_fraction = topk_fraction
        self.downlink = downlink
        self.lr_decay = lr_decay
        self._global_chunks = 0
        self.expected_sites = 0  # a root's partials that close a round (edgefl.coordinator.hierarchy)
        self._dashboard_rounds: list[dict[str, Any]] = []
        # round -> refused, declined, silent; None for a quiet round (:meth:`note_round_reasons`)
        self._round_reasons: dict[int, dict[str, Any] | None] = {}
        self._announcement: tuple[int, bytes] | None = None  # (round, payload) of the last announcement
        self._global_round = 0  # the round of the last GlobalModel published
        # one publisher at a time per retained topic: a republish after a reconnect never lands after,
        # and so over, a newer head or announcement
        self._global_lock = asyncio.Lock()
        self._round_lock = asyncio.Lock()
        self._started = False  # start() published the head: from now on a reconnect republishes it
        self._republish_due = False
        self._republish_task: asyncio.Task[None] | None = None
        self.quorum = quorum
        self.pacing = pacing or Pacing()
        self.finished = False  # a job's last round closed, or the service is stopping (fleet page)
        self._last_start: float | None = None  # time.monotonic() of the last round's opening
        self._episode_start = 1  # the round the learning-rate episode began with

    async def start(self, adopt_wait_s: float = ADOPT_WAIT_S) -> None:
        """Subscribe to updates and statuses, and publish the current global head (retained).

        Without state it first adopts the fleet's retained ``round`` and ``global`` (waiting
        ``adopt_wait_s``; the head only with this shape, backbone and signature). :meth:`pump` must run.
        """
        # a state file, even one written in round 1 (its open round), is this fleet's truth
        adopting = self.state.version == 0 and self.state.round == 0 and not self.state_loaded
        if adopting:
            self._adopting = True
            # control topics first: a flood on update/+ must not stand between us and their SUBACKs
            await self.subscribe(self.topics.round)
            await self.subscribe(self.topics.global_model + "/#")
            # both retained messages, or what came within the wait (a new fleet has neither)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(self._adopt_round_seen.wait(), self._adopt_head_seen.wait()), adopt_wait_s
                )
            self._adopting = False
            self._apply_adopted()
        # From now on these would only echo our own round and head: dropped after adopting, and when
        # the broker resumed a session of ours (an earlier run that adopted may have left them in it)
        if adopting or self.transport.session_present:
            for topic in (self.topics.round, self.topics.global_model + "/#", *self._dropped_topics()):
                try:
                    await self.transport.unsubscribe(topic)
                except TransportError as exc:  # harmless: the echoes are ignored, as before
                    logger.warning("unsubscribe from %s: %s", topic, exc)
        for topic in self._data_topics():
            await self.subscribe(topic)
        await self.publish_global(self.state.round)
        self._started = True

    def _data_topics(self) -> list[str]:
        """The device-facing topics :meth:`start` subscribes to after the control topics."""
        return [self.topics.update("+"), self.topics.status("+")]

    def _dropped_topics(self) -> list[str]:
        """Topics an earlier session of this client may hold that this one must not receive."""
        return []

    async def subscribe(self, topic: str) -> None:
        """Subscribe with QoS 1, retrying a late SUBACK (a flood delays it) for :data:`PUBLISH_RETRY_S`.

        Raises TransportError if the broker refused the subscription, or no SUBACK came in time.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PUBLISH_RETRY_S
        backoff = 1.0
        while True:
            try:
                await self.transport.subscribe(topic, 1)
                return
            except TransportError as exc:
                if "refused" in exc.detail or loop.time() + backoff >= deadline:
                    raise
                logger.warning("subscribe to %s: %s; retrying in %.0f s", topic, exc.detail, backoff)
                await asyncio.sleep(backoff)  # a backoff, not a wait for an event: the broker is busy
                backoff = min(2 * backoff, 16.0)

    async def wait_to_open(self, stop: asyncio.Event) -> bool:
        """Wait until the pacing lets the next round open (True), or ``stop`` is set (False)."""
        said = ""
        logged: tuple[FleetPhase | None, float] = (None, -math.inf)  # what was logged last, and when
        while not stop.is_set():
            st = self.pacing_state()
            if st.state is FleetPhase.PAUSED and not st.next_round_in_s:
                return True
            if st.text != said:
                now = time.monotonic()
                # a new kind of wait is logged at once; a count moving within it once a minute at most
                fresh = st.state is not logged[0] or now - logged[1] >= WAIT_LOG_EVERY_S
                if st.state is not FleetPhase.PAUSED and fresh:
                    logger.info("before round %d: %s", self.state.round + 1, st.text)
                    logged = (st.state, now)
                said = st.text
                self.notify()
            self.registry.changed.clear()
            wake = st.next_round_in_s if st.state is FleetPhase.PAUSED else 60.0
            waiter = asyncio.ensure_future(self.registry.changed.wait())
            stopper = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait(
                    {waiter, stopper}, timeout=max(0.05, wake or 0.05), return_when="FIRST_COMPLETED"
                )
                woke = waiter.done()
            finally:
                for t in (waiter, stopper):
                    t.cancel()
                await asyncio.gather(waiter, stopper, return_exceptions=True)
            if woke and not stop.is_set():  # a status changed: let a fleet's burst of them settle first
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), PACING_RECHECK_S)
        return False

    def pacing_state(self) -> FleetState:
        """Where the fleet stands before the next round (see :meth:`Pacing.check`)."""
        pacing = self.pacing
        if pacing.min_devices > 0:  # 0: a root; else as many ready devices as the strategy aggregates
            need = max(pacing.min_devices, self.strategy.min_updates)
            pacing = dataclasses.replace(pacing, min_devices=need)
        since = None if self._last_start is None else time.monotonic() - self._last_start
        last = self.state.history[-1] if self.state.history else None
        if since is None and last is not None and math.isfinite(last.closed_unix):
            # restarted: the last round opened duration_s before it closed (wall clock, state file)
            since = max(0.0, time.time() - (last.closed_unix - last.duration_s))
        return pacing.check(self.state.round, self.registry.ready_new_samples(), since)

    async def _persist_closed(self, round_no: int) -> None:
        """Write the closed round ``round_no`` to the state file before anything of it goes out.

        A refused write (a full disk) is logged once and tried again every :data:`STATE_RETRY_S`
        until it succeeds: the round's head waits, the coordinator keeps running (SIGTERM stops it).
        """
        failures = 0
        while True:
            try:
                self._persist()
            except OSError as exc:
                failures += 1
                if failures == 1:
                    logger.error(
                        "round %d: state file %s not written (%s); the round's result waits for it "
                        "(tried again every %g s)",
                        round_no,
                        self.state_path,
                        exc,
                        STATE_RETRY_S,
                    )
                await asyncio.sleep(STATE_RETRY_S)
                continue
            if failures:
                logger.warning("round %d: state file written after %d refused attempt(s)", round_no, failures)
            return

    async def run_round(self, round_no: int, selected: tuple[str, ...] | None = None) -> RoundRecord:
        """Run round ``round_no``: announce, collect until complete or deadline, aggregate, check, publish.

        ``selected``: devices asked (None: the strategy's sample when its ``fraction < 1``, else all).
        The record has ``clients = 0`` without updates, ``refused`` naming why an invalid head was kept.
        """
        cfg = self.strategy.configure_round(round_no, self.shape)
        resume, self._resume = self._resume, None
        if resume is not None and int(resume["round"]) != round_no:
            logger.warning(
                "state file's open round %s is not round %d: not resumed", resume["round"], round_no
            )
            resume = None
        reports = [n for n in self.registry.ready_new_samples().values() if n is not None]
        new_samples = sum(reports) if reports else -1
        online: frozenset[str] = frozenset()
        if resume is not None:
            selected = tuple(resume["selected"]) if resume["selected"] is not None else None
            online = frozenset(resume["online"])
            self._round_lr = float(resume["lr"])
        else:
            if selected is None and self.strategy.fraction < 1.0:
                selected = self.strategy.sample_clients(self.registry.online_devices(), round_no) or None
            if not selected:
                online = frozenset(self.registry.waited_devices())  # not those asked and silent since
            if new_samples > 0:
                self._episode_start = round_no  # new data: the learning-rate episode begins again
            self._round_lr = cfg.lr * self.lr_decay ** (round_no - self._episode_start)
        sync = cfg.schedule is Schedule.SYNC
        rnd = Round(
            round_no,
            self.state.version,
            self.shape,
            cfg.deadline_s,
            cfg.min_clients,
            frozenset(selected) if selected else None,
            check_round=sync,
            expected_sites=self.expected_sites,
            online=online,
            quorum=self.quorum if sync else None,
            min_updates=self.strategy.min_updates,
        )
        if resume is not None:
            self._resume_round(rnd, resume)
        self.state.current = rnd
        self.state.round = round_no
        self._last_start = time.monotonic()
        self._accept_early(rnd)
        held, self._held = self._held, []
        for i, (update, size_bytes) in enumerate(held):
            if rnd.complete():  # more held than one step takes: they wait for the next
                self._held = held[i:]
                break
            self._accept_held(rnd, update, size_bytes)
        self._flush()  # the round is in the state file before devices hear of it
        # collecting starts as the announcement leaves, not after its PUBACK: a failed announcement
        # (no PUBACK within PUBLISH_RETRY_S) still ends the round with its TransportError
        announce = asyncio.create_task(self._announce(round_no, cfg, selected))
        announce.add_done_callback(lambda _: self._round_changed.set())
        self.notify()
        loop = asyncio.get_running_loop()
        try:
            if not await self._collect(rnd, lambda: announce.done() and announce.exception() is not None):
                silent = rnd.silent()
                logger.warning(
                    "round %d: deadline passed with %d of %d updates%s",
                    round_no,
                    rnd.clients,
                    cfg.min_clients,
                    f"; no answer from {device_names(silent)}" if silent else "",
                )
            await announce  # its PUBACK (long back in a round that completed), or its TransportError
        finally:
            if not announce.done():
                announce.cancel()
                await asyncio.gather(announce, return_exceptions=True)
        rnd.close()
        if not rnd.complete():  # it waited its deadline for them: later rounds do not (registry.note_silent)
            self.registry.note_silent(rnd.silent(), round_no)
        self._settled = round_no  # from here on the state file holds the round's result, not the round
        refusal = None
        if rnd.clients > 0:
            self.W, self.b, refusal = aggregate_checked(self.strategy, self.W, self.b)
            if refusal is None:
                self.counted[round_no] = sorted(rnd.update_ids)
                self.state.version += 1
        # before publishing: a crash in between must not resume a version behind
        await self._persist_closed(round_no)
        refused = refusal.reason if refusal is not None else ""
        if refusal is not None:
            self.state.refused_rounds[refused] += 1
            logger.error(
                "round %d refused: %s (%s); keeping version %d",
                round_no,
                "abandoned" if refused == "too_few" else "the agents would refuse the aggregated head",
                refusal,
                self.state.version,
            )
        elif rnd.clients > 0:
            await self.publish_global(round_no)
        report = self.strategy.report()
        accuracy = float("nan")
        if self.evaluate is not None:
            W, b = self.W, self.b
            accuracy = await loop.run_in_executor(None, self.evaluate, W, b)
        fed = federated_evaluation(
            [
                (float(st["eval_accuracy"]), int(st["eval_count"]))
                for dev, st in self.registry.devices.items()
                if st.get("eval_version") == rnd.base_version
                and isinstance(st.get("eval_accuracy"), (int, float))
                and isinstance(st.get("eval_count"), int)
                and dev not in self.registry.mismatched
            ]
        )
        record = RoundRecord(
            round_no,
            rnd.clients,
            accuracy,
            float(np.mean(rnd.update_bytes)) if rnd.update_bytes else 0.0,
            time.monotonic() - rnd.opened_at,  # a resumed round's from its first opening (state file)
            clipped=report.clipped,
            norm_bound=report.norm_bound,
            epsilon=report.epsilon,
            delta=report.delta,
            refused=refused,
            declined=len(rnd.declined),
            fed_accuracy=fed[0],
            fed_worst_decile=fed[1],
            fed_devices=fed[2],
            asked=rnd.asked,
            lr=self._round_lr,
            closed_unix=time.time(),
            new_samples=new_samples,
        )
        self.keep_record(record)
        self.notify()
        return record

    def keep_record(self, record: RoundRecord) -> None:
        """Add a closed round's record to the history: the last :data:`HISTORY_ROUNDS` records are kept.

        And the counted update ids of the last :data:`COUNTED_ROUNDS` rounds (the round log keeps all).
        """
        self.state.history.append(record)
        del self.state.history[:-HISTORY_ROUNDS]
        for old in sorted(self.counted)[:-COUNTED_ROUNDS]:
            del self.counted[old]

    async def _announce(
        self, round_no: int, cfg: RoundConfig, selected: tuple[str, ...] | None = None
    ) -> None:
        """Publish the RoundAnnouncement of ``round_no`` (QoS 1, retained) and wait for its PUBACK."""
        ann = RoundAnnouncement(
            round=round_no,
            base_version=self.state.version,
            deadline_s=cfg.deadline_s,
            local_epochs=cfg.local_epochs,
            lr=self._round_lr,
            batch_size=cfg.batch_size,
            min_clients=cfg.min_clients,
            selected=tuple(selected) if selected else 1.0,
            compression=self.compression,
            topk_fraction=self.topk_fraction,
            prox_mu=cfg.prox_mu,
        )
        payload = self._sign(encode_round, ann)
        async with self._round_lock:
            self._announcement = (round_no, payload)
            await self._publish(self.topics.round, payload)

    async def publish_global(self, round_no: int) -> None:
        """Publish the current head as GlobalModel (QoS 1, retained) and wait for the PUBACK."""
        async with self._global_lock:
            await self._publish_global(round_no)

    async def _publish_global(self, round_no: int) -> None:
        msg = GlobalModel(
            round_no, self.state.version, self.model_sha256, self.W, self.b, layout=self.downlink
        )
        self._global_round = round_no
        payload = self._sign(encode_global_model, msg)
        base = self.topics.global_model
        # the smaller of the profile's limit and the broker's (MQTT 5 CONNACK Maximum Packet Size)
        limit = min(self.max_packet_bytes, self.transport.packet_limit())
        parts = split_message(payload, base + "/0000", limit, msg_id=f"global-{msg.version}")
        if len(parts) == 1:
            await self._publish(base, payload)
            stale = range(self._global_chunks)
        else:
            # One retained topic keeps one message: each chunk gets its own retained topic.
            for i, part in enumerate(parts):
                await self._publish(f"{base}/{i}", part)
            await self._publish(base, b"")
            stale = range(len(parts), self._global_chunks)
        for i in stale:  # clear chunks of an earlier, larger head
            await self._publish(f"{base}/{i}", b"")
        self._global_chunks = len(parts) if len(parts) > 1 else 0

    async def _publish(self, topic: str, payload: bytes, *, retain: bool = True) -> None:
        """Publish with QoS 1 (retained by default), waiting out an outage for ``PUBLISH_RETRY_S``.

        Raises BrokerRefused at once (an ACL's 0x87), TransportError without a PUBACK within that budget.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PUBLISH_RETRY_S
        while True:
            try:
                await self.transport.publish(topic, payload, qos=1, retain=retain)
                return
            except BrokerRefused:
                raise
            except TransportError:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise
                await wait_event(self.transport.connected, min(remaining, 5.0))
                await asyncio.sleep(0.05)

    def _sign(self, encode: Callable[[Any], bytes], msg: Any) -> bytes:
        if self.signing_key is None:
            return encode(msg)
        return sign_message(encode, msg, self.signing_key, fleet=self.topics.fleet)

    def on_transport_connect(self) -> None:
        """Publish the head and the last announcement (same bytes) again, after every CONNACK once started.

        The broker may hold older ones (restored from a snapshot) or none (``docs/operations.md``,
        "Broker restarts"); idempotent: the devices ignore a head or round they have.
        """
        if not self._started:
            return  # the first connect: start() publishes the head itself (after adopting the fleet's)
        self._republish_due = True
        if self._republish_task is None or self._republish_task.done():
            self._republish_task = asyncio.create_task(self._republish(), name="coordinator-republish")

    async def _republish(self) -> None:
        while self._republish_due:  # a reconnect while republishing: once more, on the new connection
            self._republish_due = False
            ann = self._announcement
            what = f"the global head (version {self.state.version})"
            if ann is not None:
                what += f" and round {ann[0]}'s announcement"
            if not self.transport.session_present:
                logger.warning(
                    "the broker had no session of ours (it lost its state?): publishing %s again%s",
                    what,
                    "" if ann is None else " (announcing the round again)",
                )
            else:
                logger.info("broker back: publishing %s again (it may have restored older ones)", what)
            try:
                async with self._global_lock:
                    await self._publish_global(self._global_round)
                async with self._round_lock:
                    ann = self._announcement  # the latest: a round may have opened meanwhile
                    if ann is not None:
                        await self._publish(self.topics.round, ann[1])
            except TransportError as exc:
                logger.warning("%s not published again: %s", what, exc)

    async def stop_republishing(self) -> None:
        """Cancel a republish still waiting for the broker (at the stop)."""
        task, self._republish_task = self._republish_task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def dashboard_status(self) -> dict[str, Any]:
        """The coordinator page's status document, JSON-like.

        ``health``: ``ok``, or ``broker unreachable: HOST:PORT`` (``/healthz`` answers 503 with it).
        """
        rnd = self.state.current
        open_round = rnd is not None and rnd.phase.value == "open"
        registry = self.registry
        devices = registry.page_devices()
        fleet = self.fleet_state()
        return {
            "broker_connected": self.transport.connected.is_set(),
            # what /healthz answers: ok, or the problem (503)
            "health": fleet.text if fleet.state is FleetPhase.BROKER_UNREACHABLE else "ok",
            "round": self.state.round,
            "state": "collecting" if open_round else ("idle" if not self.state.history else "aggregated"),
            "fleet_state": fleet.as_dict(),
            "updates_received": rnd.clients if rnd is not None else 0,
            "updates_expected": (rnd.asked or rnd.close_at) if rnd is not None else 0,
            "deadline_s_left": max(0.0, rnd.deadline_at - time.monotonic()) if open_round and rnd else None,
            "version": self.state.version,
            "strategy": self.strategy.name,
            "compression": str(self.compression),
            "accuracy_history": [
                {"round": h.round, "accuracy": None if h.accuracy != h.accuracy else h.accuracy}
                for h in self.state.history[-PAGE_HISTORY:]
            ],
            "rounds": self.dashboard_rounds()[-50:],  # the latest records, as /api/rounds has them
            "devices": devices,
            "devices_total": len(registry.devices),
            "model_mismatches": {d: registry.mismatched[d] for d in devices if d in registry.mismatched},
            "model_mismatches_total": len(registry.mismatched),
            "rejected": dict(self.state.rejected),
            "refusals": registry.refusals(self.state.rejected),  # the coordinator's and the devices'
            "clipped": dict(self.strategy.clipped),
            "refused_rounds": dict(self.state.refused_rounds),
            "declined": dict(self.state.declined),
            "held_updates": len(self._held),
            "personal_heads": personal_heads_summary(registry.devices),
            "epsilon": None
            if not self.state.history or math.isnan(self.state.history[-1].epsilon)
            else self.state.history[-1].epsilon,
        }

    def silent_devices(self, round_no: int) -> list[str]:
        """``Round.silent`` of round ``round_no`` if it is the current (or last closed) one, else ``[]``."""
        rnd = self.state.current
        return rnd.silent() if rnd is not None and rnd.number == round_no else []

    def note_round_reasons(
        self, round_no: int, refused: Mapping[str, int], declined: Mapping[str, int]
    ) -> None:
        """Keep a closed round's refused updates and declines ``{reason: count}`` for the fleet page.

        With them, its ``silent`` devices (at most :data:`SILENT_KEPT` names) and ``silent_devices``; a
        quiet round (nothing refused, declined or silent) is kept as None (a dict slot, not four containers).
        """
        silent = self.silent_devices(round_no)
        reasons = round_reasons(refused, declined, silent)
        self._round_reasons[round_no] = reasons if refused or declined or silent else None
        for old in sorted(self._round_reasons)[:-HISTORY_ROUNDS]:
            del self._round_reasons[old]
        for record in reversed(self._dashboard_rounds):  # converted already: completed in place
            if record["round"] == round_no:
                record.update(reasons)
                break

    def _reasons_of(self, round_no: int) -> dict[str, Any]:
        """Round ``round_no``'s kept reasons for the page: its own, fresh quiet ones, or ``{}`` if unknown."""
        if round_no not in self._round_reasons:
            return {}
        kept = self._round_reasons[round_no]
        return kept if kept is not None else round_reasons({}, {}, ())

    def dashboard_rounds(self) -> list[dict[str, Any]]:
        """The kept round records as :func:`~edgefl.coordinator.history.page_record` dicts, oldest first."""
        history = self.state.history
        cached = self._dashboard_rounds
        if history and cached and cached[0]["round"] < history[0].round:  # the oldest were trimmed
            cached = [c for c in cached if c["round"] >= history[0].round]
        if len(cached) > len(history) or (cached and cached[-1]["round"] != history[len(cached) - 1].round):
            cached = []
        if len(cached) < len(history):
            cached = cached + [page_record(h, self._reasons_of(h.round)) for h in history[len(cached) :]]
        self._dashboard_rounds = cached
        return cached

    def fleet_state(self) -> FleetState:
        """The fleet's state for its page (``FleetPhase``), with the pacing's and the open round's numbers."""
        paced = self.pacing_state()
        if self.finished:  # before the broker: a job that ended stops its transport before its page
            text = f"finished after round {self.state.round}"
            return dataclasses.replace(paced, state=FleetPhase.FINISHED, text=text, next_round_in_s=None)
        if not self.transport.connected.is_set():
            where = f"{self.transport.host}:{self.transport.port}"
            return dataclasses.replace(
                paced,
                state=FleetPhase.BROKER_UNREACHABLE,
                text=f"broker unreachable: {where}",
                next_round_in_s=None,
            )
        rnd = self.state.current
        if rnd is not None and rnd.phase is RoundPhase.OPEN:
            asked = rnd.asked or rnd.close_at
            return dataclasses.replace(
                paced, state=FleetPhase.COLLECTING, text=f"collecting {rnd.clients} of {asked}",
                round=rnd.number, asked=asked, counted=rnd.clients, close_at=rnd.close_at,
                next_round_in_s=None,
            )  # fmt: skip
        return paced
