"""The coordinator service: announces rounds, collects updates, aggregates, publishes the global head.

One round loop (``run_round``) with two schedules, chosen by the strategy's ``RoundConfig.schedule``:
synchronous rounds (McMahan et al. 2017, Algorithm 1: updates for this round and base version,
closed at ``min_clients`` updates or the deadline) and buffered-asynchronous steps (Nguyen et al.
2022, FedBuff: updates from any earlier version, with their staleness, closed at ``buffer_size``
updates or the deadline). The global head and the round announcement are published retained (a
device that connects late catches up from them). Every accepted update goes to ``Strategy.offer``;
the aggregated head is validated against the agents' own bound (``edgefl.head.validate_head``)
before it is persisted or published: a head the agents would refuse is never sent, the round is
refused, the previous head kept, and the reason logged and recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2
import numpy as np

from edgefl.aio import wait_event
from edgefl.coordinator.rounds import (
    FleetPhase,
    FleetState,
    Pacing,
    Round,
    RoundPhase,
    collecting,
    replace_min_devices,
)
from edgefl.coordinator.strategy import Offer, RoundConfig, Schedule, Strategy, aggregate_checked
from edgefl.errors import DecodeError, TransportError, UpdateRejected
from edgefl.head import validate_head
from edgefl.mqtt_link import Message
from edgefl.records import read_record, write_record
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.types import F32
from edgefl.wire.cbor import Limits, MessageType, prescan
from edgefl.wire.chunking import Reassembler, is_chunk, split_message
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import GlobalModel, HeadLayout, decode_global_model, encode_global_model
from edgefl.wire.presence import read_new_samples
from edgefl.wire.rounds import (
    RoundAnnouncement,
    Update,
    decode_decline,
    decode_round,
    decode_update,
    encode_round,
)
from edgefl.wire.signing import SigningKey, VerifyKey, sign_message, verify_payload
from edgefl.wire.status import decode_status

logger = logging.getLogger(__name__)

PUBLISH_RETRY_S = 120.0
"""How long a coordinator publish waits out a broker outage before giving up (seconds)."""

HELD_UPDATES = 64
"""Updates held while a buffered step is published, offered to the next step (more are refused)."""

SEEN_UPDATE_IDS = 4096
"""Update ids remembered across rounds (a FedBuff step accepts updates of earlier rounds).

An id is ``<device>:<round>:<base_version>`` of the (verified) topic's device and only an accepted
update or decline enters the set, at most one per device per round: a device cannot fill it with
ids of others, and it holds the last ``4096 / devices-per-round`` rounds' ids."""


LOGGED_REFUSALS = 20
#: Devices outside the registry whose refusals and declines are counted one by one (the last ones).
STRANGERS_KEPT = 100
#: Devices the page's status document lists (``devices``; ``devices_total`` counts the registry).
PAGE_DEVICES = 100
#: Rounds of ``accuracy_history`` in the page's status document (the last ones).
PAGE_HISTORY = 500
#: Reasons of a per-device counter map in the page's document (the largest counts).
PAGE_REASONS = 8


def _interned(value: Any) -> Any:
    """``value`` (a decoded status's JSON-like fields) with its map keys and short strings interned.

    Every status a fleet sends repeats the same ~45 field names and the same backbone sha256; decoded,
    each is a fresh string. Interned, a registry entry costs about half (2.5 against 5.6 KiB for an
    agent's status, measured with tracemalloc), so ``fleet.max_devices`` statuses, honest or not,
    hold less of the coordinator's memory.
    """
    if isinstance(value, dict):
        return {sys.intern(str(k)): _interned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interned(v) for v in value]
    if isinstance(value, str) and len(value) <= 64:
        return sys.intern(value)
    return value


def _page_order(entry: Mapping[str, Any]) -> tuple[bool, bool, float, float]:
    """Sort key of a registry entry for the page's bounded device list (smallest first)."""
    rss, cap = entry.get("rss_bytes"), entry.get("cap_bytes")
    used = rss / cap if isinstance(rss, int | float) and isinstance(cap, int | float) and cap > 0 else 0.0
    seen = entry.get("seen_at")
    return (
        entry.get("state") == "offline",
        not entry.get("ready"),
        -float(used),
        -float(seen) if isinstance(seen, int | float) else 0.0,
    )


def _top_counts(counts: object) -> dict[str, Any]:
    """The ``PAGE_REASONS`` largest entries of a per-device counter map (a device's own is any JSON)."""
    if not isinstance(counts, dict):
        return {}
    numeric = [(str(k)[:64], v) for k, v in counts.items() if isinstance(v, int | float)]
    return dict(heapq.nlargest(PAGE_REASONS, numeric, key=lambda kv: kv[1]))


"""Refusals of one reason logged one by one before the log only names every 1000th."""

ADOPT_WAIT_S = 2.0
"""How long a coordinator without state waits for the fleet's retained round and head (seconds)."""

EARLY_UPDATES_MAX = 4096
"""Updates held for the next round before it opens (see ``Coordinator._early``)."""


PACING_RECHECK_S = 0.5
"""Least time between two checks of the pacing while a service waits (a fleet's statuses come in bursts:
each check reads every ready device's status)."""
WAIT_LOG_EVERY_S = 60.0
"""A waiting service logs a new kind of wait at once, and a count moving within it at most this often (s)."""

PERSIST_EVERY = 32
"""With a state file, the open round is written at least every this many messages (``Coordinator.pump``)."""

HISTORY_ROUNDS = 200
"""Closed rounds whose records are kept in memory and in the state file: a service runs for months, and
the round log (``files.log``) keeps them all."""

COUNTED_ROUNDS = 20
"""Closed rounds whose counted update ids are kept (the state file is written after every batch of
updates: 20 rounds of 200 devices' ids is ~80 kB)."""


DECLINE_SUFFIX = ":declined"
"""What a Decline's ``update_id`` adds to the update id of the round it refuses."""

LOGGED_DETAIL_CHARS = 80
"""A device's free-text ``detail`` is cut to this many characters in the coordinator's log."""


def shorten(text: str, limit: int = LOGGED_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters (with an ellipsis when cut), for a log line."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check_update_id(update_id: str, device: str, round_no: int, base_version: int, suffix: str = "") -> None:
    """Check that an update's (or decline's) id is the one its device, round and base version give.

    The id is ``f"{device}:{round}:{base_version}"`` (a Decline adds ``DECLINE_SUFFIX``), with
    ``device`` the device of the topic it arrived on (verified by signature when keys are set): a
    device cannot spend another device's ids (``docs/protocol.md``, "Update ids").

    Raises
    ------
    UpdateRejected
        ``bad_value`` for any other id.
    """
    expected = f"{device}:{round_no}:{base_version}{suffix}"
    if update_id != expected:
        why = f"update id {shorten(update_id, 60)!r} on update/{device}: must be {expected!r}"
        raise UpdateRejected("bad_value", why)


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """Result of one closed round (the demo's ``rounds`` JSON entries).

    Attributes
    ----------
    round : int
    clients : int
        Updates aggregated.
    accuracy : float
        Test accuracy of the new global head (NaN when no evaluation function is set).
    update_bytes_mean : float
        Mean wire size of the aggregated updates, in bytes.
    duration_s : float
        Seconds from announcement to the new global head being published.
    clipped : int
        Updates scaled down by the strategy's norm bound.
    norm_bound : float
        The norm bound applied last in the round (inf when nothing arrived).
    epsilon : float
        DP epsilon spent so far at ``delta`` (NaN without DP).
    delta : float
        DP delta (NaN without DP).
    refused : str
        Why the aggregated head was not published ("" when it was, or nothing arrived).
    declined : int
        Devices that refused the round with a Decline message (e.g. ``over_budget``).
    fed_accuracy : float
        Federated evaluation of the round's base head: the devices' holdout accuracies weighted by
        their holdout counts (NaN when no device reported one for that version).
    fed_worst_decile : float
        Mean accuracy of the worst tenth of those devices (at least one).
    fed_devices : int
        Devices whose evaluation of the base head was counted.
    asked : int
        Devices asked to take part (the selection, or the devices ready at the opening).
    lr : float
        Client learning rate the round announced.
    closed_unix : float
        Unix time the round closed, seconds (NaN in records of older state files).
    new_samples : int
        New labelled samples the ready devices reported at the opening (-1: none reported).
    """

    round: int
    clients: int
    accuracy: float
    update_bytes_mean: float
    duration_s: float
    clipped: int = 0
    norm_bound: float = math.inf
    epsilon: float = math.nan
    delta: float = math.nan
    refused: str = ""
    declined: int = 0
    fed_accuracy: float = math.nan
    fed_worst_decile: float = math.nan
    fed_devices: int = 0
    asked: int = 0
    lr: float = math.nan
    closed_unix: float = math.nan
    new_samples: int = -1


def federated_evaluation(reports: Sequence[tuple[float, int]]) -> tuple[float, float, int]:
    """Combine the devices' evaluations of one head (federated evaluation, no central data).

    Parameters
    ----------
    reports : sequence of (accuracy in [0, 1], count > 0), one per device

    Returns
    -------
    (weighted mean accuracy, mean accuracy of the worst ceil(10 %) of devices, devices)
        NaN, NaN, 0 without reports.
    """
    usable = [(a, n) for a, n in reports if n > 0 and 0.0 <= a <= 1.0]
    if not usable:
        return math.nan, math.nan, 0
    total = sum(n for _, n in usable)
    mean = sum(a * n for a, n in usable) / total
    worst = sorted(a for a, _ in usable)[: max(1, math.ceil(len(usable) / 10))]
    return mean, sum(worst) / len(worst), len(usable)


def personal_heads_summary(devices: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The fleet's personal and global heads on the devices' holdouts, from their latest statuses.

    Parameters
    ----------
    devices : {device: status fields}
        Each may carry ``personal_accuracy``, ``global_accuracy`` (in [0, 1]) and ``eval_count``
        (holdout samples, the weight), ``serving_head``.

    Returns
    -------
    dict or None
        ``{"devices", "personal_mean", "personal_worst_decile", "global_mean", "global_worst_decile",
        "serving_personal"}``: means weighted by holdout samples, worst deciles as
        :func:`federated_evaluation` (mean of the worst ceil(10 %) of devices), and how many devices
        serve their personal head; None when no device reports both accuracies.
    """
    personal: list[tuple[float, int]] = []
    glob: list[tuple[float, int]] = []
    serving = 0
    for st in devices.values():
        p, g, n = st.get("personal_accuracy"), st.get("global_accuracy"), st.get("eval_count")
        if isinstance(p, int | float) and isinstance(g, int | float) and isinstance(n, int) and n > 0:
            personal.append((float(p), n))
            glob.append((float(g), n))
            serving += st.get("serving_head") == "personal"
    if not personal:
        return None
    pm, pw, count = federated_evaluation(personal)
    gm, gw, _ = federated_evaluation(glob)
    return {
        "devices": count,
        "personal_mean": pm,
        "personal_worst_decile": pw,
        "global_mean": gm,
        "global_worst_decile": gw,
        "serving_personal": serving,
    }


@dataclass
class CoordinatorState:
    """What the coordinator knows, for its dashboard and for the demo."""

    version: int = 0
    round: int = 0
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)
    rejected: Counter[str] = field(default_factory=Counter)
    refused_rounds: Counter[str] = field(default_factory=Counter)
    declined: Counter[str] = field(default_factory=Counter)
    """Rounds devices refused (Decline messages), by reason."""
    history: list[RoundRecord] = field(default_factory=list)
    current: Round | None = None


class Coordinator:
    """Runs synchronous rounds over MQTT.

    Parameters
    ----------
    transport : MqttTransport
        Started by the caller.
    topics : Topics
    W : float32 [D, K], b : float32 [K]
        Initial global head (version 0: the factory head).
    model_sha256 : str
        sha256 of the backbone .tflite the head belongs to (devices refuse a head for another backbone).
    strategy : Strategy
    evaluate : callable (W, b) -> accuracy, or None
        Test-set evaluation of a head (fraction 0..1).
    compression : Compression
        Update compression asked of the devices.
    downlink : HeadLayout
        Layout of the published global head (float32, float16, int8; ``docs/protocol.md``).
    limits : Limits
        Decoding bounds for incoming messages.
    signing_key : SigningKey or None
        Signs every GlobalModel and RoundAnnouncement (Ed25519) when set.
    device_keys : mapping device → VerifyKey, or None
        When set, an update must carry a valid signature by its device's key (unknown devices are refused).
    max_packet_bytes : int
        The broker's maximum packet size: a larger GlobalModel goes out as retained chunks on ``global/<i>``.
    max_devices : int
        Bound of the device registry (statuses kept, > 0): when full, expired and offline devices are
        dropped first; a new device is refused (``registry_full``) only when every entry is live.
    device_expiry_s : float
        A status older than this (seconds since it was received, or since its ``ts`` field) is forgotten.
    lr_decay : float
        Client learning-rate schedule within an episode: a round announces ``lr * lr_decay ** e``, ``e``
        the rounds since the episode began; an episode begins at the first round and at every round
        whose ready devices report new labelled samples (1.0, the default: constant). A fleet's data
        keeps changing, so its step must not vanish (``docs/operations.md``, "Learning rate").
    quorum : float in (0, 1] or None
        Share of the devices asked whose updates close a round early (``Round.close_at``); None:
        ``min_clients`` updates do.
    pacing : Pacing or None
        When :meth:`wait_to_open` opens the next round (None: at once).
    """

    def __init__(
        self,
        transport: MqttTransport,
        topics: Topics,
        W: F32,
        b: F32,
        *,
        model_sha256: str,
        strategy: Strategy,
        evaluate: Callable[[F32, F32], float] | None = None,
        compression: Compression = Compression.NONE,
        topk_fraction: float = 0.1,
        downlink: HeadLayout = HeadLayout.FLOAT32,
        limits: Limits | None = None,
        lr_decay: float = 1.0,
        signing_key: SigningKey | None = None,
        device_keys: Mapping[str, VerifyKey] | None = None,
        max_packet_bytes: int = 256 * 1024,
        max_devices: int = 10_000,
        device_expiry_s: float = 7 * 24 * 3600.0,
        quorum: float | None = None,
        pacing: Pacing | None = None,
    ) -> None:
        self.transport = transport
        self.topics = topics
        self.W = W.astype(np.float32)
        self.b = b.astype(np.float32)
        self.model_sha256 = model_sha256
        self.strategy = strategy
        self.evaluate = evaluate
        self.compression = compression
        self.topk_fraction = topk_fraction
        self.downlink = downlink
        self.limits = limits or Limits()
        self.lr_decay = lr_decay
        self.signing_key = signing_key
        self.device_keys = dict(device_keys) if device_keys is not None else None
        self.max_packet_bytes = max_packet_bytes
        self.reassembler = Reassembler(
            max_message_bytes=self.limits.max_message_bytes,
            max_chunk_bytes=max_packet_bytes,
            max_total_bytes=2 * self.limits.max_message_bytes,
        )
        self._global_chunks = 0
        self.state_path: Path | None = None  # set to persist state before each new global head
        self.counted: dict[int, list[str]] = {}  # round → update_ids aggregated (audit, chaos test)
        # Updates for the next round that arrive before it opens: after a restart, devices answer the
        # retained announcement of a round whose close was not saved, and the broker's persistent
        # session delivers their updates before the coordinator re-opens it. Bounded; offered at open.
        self._early: dict[str, tuple[Update, int]] = {}
        self.expected_sites = 0  # a root's partials that close a round (edgefl.coordinator.hierarchy)
        self.state = CoordinatorState()
        self.max_devices = max_devices
        self.device_expiry_s = device_expiry_s
        # device → why its model differs; only devices in the registry, forgotten with them (_forget)
        self.mismatched: dict[str, str] = {}
        self.mismatches_total = 0  # devices seen with another model (the log names the first ones)
        self.rejected_by_device: dict[str, Counter[str]] = {}
        self.declined_by_device: dict[str, Counter[str]] = {}
        self._strangers: dict[str, None] = {}  # devices counted above that the registry does not hold
        self.on_mismatch: Callable[[str, str], None] | None = None
        self._round_changed = asyncio.Event()
        self.on_change: Callable[[], None] | None = None
        self._dashboard_rounds: list[dict[str, Any]] = []
        self._round_reasons: dict[int, dict[str, dict[str, int]]] = {}  # round -> refused, declined
        self._seen_update_ids: dict[str, None] = {}  # insertion-ordered, bounded: see _remember
        self.max_seen_update_ids = SEEN_UPDATE_IDS
        self._held: list[tuple[Update, int]] = []  # arrived while a buffered step was being published
        self._status_changed = asyncio.Event()
        self._adopting = False
        self._adopt_round_seen = asyncio.Event()
        self._adopt_head_seen = asyncio.Event()
        self._adopted_round = 0
        self._adopted_head: GlobalModel | None = None
        self._adopt_chunks = Reassembler()
        self._announcement: tuple[int, bytes] | None = None  # (round, payload) of the last announcement
        self._reannounce_task: asyncio.Task[None] | None = None
        self.reannounced = 0  # announcements published again after a reconnect without our session
        self.quorum = quorum
        self.pacing = pacing or Pacing()
        self.finished = False  # a job's last round closed, or the service is stopping (fleet page)
        self.on_lease_message: Callable[[Message], None] | None = None  # the lease topic's messages
        self._last_start: float | None = None  # time.monotonic() of the last round's opening
        self._episode_start = 1  # the round the learning-rate episode began with
        self._dirty = False  # the open round changed since the state file was written (see pump)
        self._settled = 0  # the last round whose result is in the state file
        self._resume: dict[str, Any] | None = None  # the open round of the state file, until re-opened
        # update id -> (topic, payload) of updates held in _early or _held: acknowledged, so written
        # with the state (an update the broker acknowledged is never lost)
        self._unfolded: dict[str, tuple[str, bytes]] = {}
        self._round_lr = math.nan  # the client learning rate the open round announced
        self.state_loaded = False  # load_state found a state file

    @property
    def shape(self) -> tuple[int, int]:
        """Head shape (D, K)."""
        return (int(self.W.shape[0]), int(self.W.shape[1]))

    async def start(self, adopt_wait_s: float = ADOPT_WAIT_S) -> None:
        """Subscribe to updates and statuses, and publish the current global head (retained).

        A coordinator without state (version 0, round 0: first start, or its state file was lost)
        first adopts the fleet's round and head from the retained ``round`` and ``global`` messages,
        so devices that hold a later round are not answered with ``stale_round`` for rounds on end.
        The retained head is adopted only if it decodes with this head's shape, names this backbone's
        sha256 and, when a signing key is set, carries a valid signature by it. Then, after adopting
        or when the broker resumed an earlier session of this client, it unsubscribes from ``round``
        and ``global`` (its own messages would come back). The caller's :meth:`pump` must be running.

        Parameters
        ----------
        adopt_wait_s : float
            How long to wait for the retained messages (seconds); they arrive right after SUBACK.
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
        # From now on these subscriptions would only bring our own round and head back (a second copy
        # of every announcement and head through the broker, each read, ignored and acknowledged):
        # dropped after adopting, and whenever the broker resumed a session of ours (an earlier run
        # that adopted may have left them in it)
        if adopting or self.transport.session_present:
            for topic in (self.topics.round, self.topics.global_model + "/#", *self._dropped_topics()):
                try:
                    await self.transport.unsubscribe(topic)
                except TransportError as exc:  # harmless: the echoes are ignored, as before
                    logger.warning("unsubscribe from %s: %s", topic, exc)
        for topic in self._data_topics():
            await self.subscribe(topic)
        await self.publish_global(self.state.round)

    def _data_topics(self) -> list[str]:
        """The device-facing topics :meth:`start` subscribes to after the control topics."""
        return [self.topics.update("+"), self.topics.status("+")]

    def _dropped_topics(self) -> list[str]:
        """Topics an earlier session of this client may hold that this one must not receive."""
        return []

    async def subscribe(self, topic: str, budget_s: float = PUBLISH_RETRY_S) -> None:
        """Subscribe with QoS 1, retrying a late SUBACK with backoff (1, 2, 4 ... 16 s) for ``budget_s``.

        Under a flood of queued messages (a persistent session's subscriptions deliver them before
        any new SUBACK) a SUBACK can come later than the transport's 10 s: that is not a failure of
        the start (H16: exit 4 again and again during a junk flood on ``update/+``).

        Raises
        ------
        TransportError
            If the broker refused the subscription, or no SUBACK came within ``budget_s`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
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

    def _is_own_topic(self, topic: str) -> bool:
        base = self.topics.global_model
        return topic in (self.topics.round, base) or topic.startswith(base + "/")

    def _adopt(self, msg: Message) -> None:
        """Note a retained ``round`` or ``global`` message while adopting (see :meth:`start`).

        Raises
        ------
        DecodeError
            If the message does not decode or its signature does not verify.
        UpdateRejected
            ``wrong_model`` if the head belongs to another backbone.
        """
        if not self._adopting or not msg.payload:
            return  # our own retained publishes echoed back, or a cleared chunk
        if msg.topic == self.topics.round:
            if self.signing_key is not None:
                verify_payload(
                    msg.payload, self.signing_key.verify_key, fleet=self.topics.fleet, kind=MessageType.ROUND
                )
            ann = decode_round(msg.payload, limits=self.limits)
            self._adopted_round = max(self._adopted_round, ann.round)
            self._adopt_round_seen.set()
            return
        payload: bytes | None = msg.payload
        if is_chunk(msg.payload):
            payload = self._adopt_chunks.feed(self.topics.global_model, msg.payload)
        if payload is None:
            return
        if self.signing_key is not None:
            verify_payload(
                payload, self.signing_key.verify_key, fleet=self.topics.fleet, kind=MessageType.GLOBAL_MODEL
            )
        head = decode_global_model(payload, limits=self.limits, expect_shape=self.shape)
        if head.model_sha256 != self.model_sha256:
            raise UpdateRejected("wrong_model", "the retained global head belongs to another backbone")
        if self._adopted_head is None or head.version > self._adopted_head.version:
            self._adopted_head = head
        self._adopt_head_seen.set()

    def _apply_adopted(self) -> None:
        head = self._adopted_head
        if head is not None and head.version > 0:
            self.W, self.b = head.W.copy(), head.b.copy()
            self.state.version = head.version
        rounds = max(self._adopted_round, head.round if head is not None else 0)
        if rounds > 0 or head is not None:
            self.state.round = rounds
            logger.warning(
                "no state: adopted the fleet's round %d and head version %d from the retained messages",
                self.state.round,
                self.state.version,
            )

    def save_state(self, path: Path) -> None:
        """Persist the global head, version, round, recent history and the open round (atomic, checksummed).

        A coordinator restarted with the same state file resumes after its last closed round, and
        re-opens the round that was open, with every update it had accepted (the strategy's
        accumulator, the update ids) and the updates held for later: whatever the broker was told
        was received is in this file (see :meth:`pump`).
        """
        closed = self.state.current is None or self.state.current.number <= self._settled
        doc = {
            "v": 1,
            "round": self.state.round if closed else self.state.round - 1,
            "version": self.state.version,
            "W": self.W.tobytes(),
            "b": self.b.tobytes(),
            "shape": list(self.shape),
            "history": [list(dataclasses.astuple(h)) for h in self.state.history],
            "counted": {str(k): sorted(v) for k, v in self.counted.items()},
            "strategy": self.strategy.durable_state(),  # norm history, server optimiser, DP ledger
            "open": self._open_round_doc(),
            "unfolded": [[topic, payload] for topic, payload in self._unfolded.values()],
        }
        write_record(path, cbor2.dumps(doc))

    def _open_round_doc(self) -> dict[str, Any] | None:
        """The open round as the state file keeps it (None when no round is open, or its result is saved)."""
        rnd = self.state.current
        if rnd is None or rnd.number <= self._settled:
            return self._resume  # a resumed round not re-opened yet stays in the file
        return {
            "round": rnd.number,
            "base_version": rnd.base_version,
            "opened_unix": time.time() - (time.monotonic() - rnd.opened_at),
            "deadline_s": rnd.deadline_s,
            "selected": sorted(rnd.selected) if rnd.selected is not None else None,
            "online": sorted(rnd.online),
            "update_ids": sorted(rnd.update_ids),
            "devices": list(rnd.devices),
            "declined": list(rnd.declined),
            "sites": list(rnd.sites),
            "update_bytes": list(rnd.update_bytes),
            "lr": self._round_lr,
            "snapshot": self.strategy.snapshot() if self.strategy.accepted else None,
        }

    def load_state(self, path: Path) -> bool:
        """Resume from a state file written by :meth:`save_state` (False when there is none).

        Raises
        ------
        UpdateRejected
            ``bad_state`` when the file holds a head of another shape, or one the agents would refuse
            (non-finite, or a value beyond ``MAX_HEAD_ABS``).
        """
        data = read_record(path)
        if data is None:
            return False
        doc = cbor2.loads(data)
        if tuple(doc["shape"]) != self.shape:
            raise UpdateRejected(
                "bad_state", f"{path}: head shape {doc['shape']}, model has {list(self.shape)}"
            )
        W = np.frombuffer(doc["W"], dtype=np.float32).reshape(self.shape).copy()
        b = np.frombuffer(doc["b"], dtype=np.float32).copy()
        try:
            validate_head(W, b, self.shape)
        except UpdateRejected as exc:
            raise UpdateRejected("bad_state", f"{path}: the saved head would be refused ({exc})") from exc
        self.W, self.b = W, b
        self.state.round = int(doc["round"])
        self.state.version = int(doc["version"])
        self.state.history = [RoundRecord(*h) for h in doc["history"]]
        self.counted = {int(k): list(v) for k, v in doc.get("counted", {}).items()}
        try:
            self.strategy.restore_durable(doc.get("strategy", {}))
        except (ValueError, KeyError, TypeError) as exc:
            why = f"{path}: the strategy's saved state does not fit ({exc})"
            raise UpdateRejected("bad_state", why) from exc
        self._settled = self.state.round
        self.state_loaded = True
        for r in sorted(self.counted):  # an update counted before the restart is refused as a duplicate
            for update_id in self.counted[r]:
                self._remember(update_id)
        self._resume = doc.get("open")
        self._unfolded = {}
        for topic, payload in doc.get("unfolded", []):
            self.handle(Message(str(topic), bytes(payload), False))  # held again for their round
        self._record_unrecorded_round()
        logger.info("resumed at round %d, version %d from %s", self.state.round, self.state.version, path)
        return True

    def _record_unrecorded_round(self) -> None:
        """Rebuild the record of a round saved after aggregation but before its record.

        The state is written once the new head is aggregated (before it is published) and again when
        the round's record exists; a coordinator killed in between comes back with the round's counted
        update ids and head but no record, and would otherwise leave that round out of its history and
        log. The record is rebuilt from the counted ids and an evaluation of the saved head (which is
        that round's result); the update size and duration were not saved and read 0.
        """
        r = self.state.round
        if r not in self.counted or any(h.round == r for h in self.state.history):
            return
        accuracy = float("nan")
        if self.evaluate is not None:
            accuracy = float(self.evaluate(self.W, self.b))
        self.state.history.append(RoundRecord(r, len(self.counted[r]), accuracy, 0.0, 0.0))
        logger.warning("round %d was aggregated but not recorded before a restart: record rebuilt", r)

    async def publish_global(self, round_no: int) -> None:
        """Publish the current head as GlobalModel (QoS 1, retained) and wait for the PUBACK."""
        msg = GlobalModel(
            round_no, self.state.version, self.model_sha256, self.W, self.b, layout=self.downlink
        )
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
        """Publish (retained by default) with QoS 1, waiting out a broker outage for ``PUBLISH_RETRY_S``.

        Raises
        ------
        TransportError
            If the broker did not acknowledge within the retry budget.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PUBLISH_RETRY_S
        while True:
            try:
                await self.transport.publish(topic, payload, qos=1, retain=retain)
                return
            except TransportError:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise
                await wait_event(self.transport.connected, min(remaining, 5.0))
                await asyncio.sleep(0.05)

    def _persist(self) -> None:
        if self.state_path is not None:
            self.save_state(self.state_path)

    def _sign(self, encode: Callable[[Any], bytes], msg: Any) -> bytes:
        if self.signing_key is None:
            return encode(msg)
        return sign_message(encode, msg, self.signing_key, fleet=self.topics.fleet)

    async def pump(self) -> None:
        """Consume incoming messages forever (each handler is guarded), committing what they changed.

        With a state file and the transport's ``ack_on_commit`` (``edgefl coordinator`` sets both), an
        update, decline or partial is acknowledged to the broker (PUBACK) only once the state file
        holds it: the open round is written once the queue is drained, or every ``PERSIST_EVERY``
        messages under a flood (one write per batch, not one fsync per update), then
        ``MqttTransport.commit`` acknowledges every message taken so far. A coordinator killed in
        between gets them again from its persistent session, and its resumed round tells which it
        had. Messages that changed nothing (statuses, refusals) are acknowledged at once.

        ``Queue.get`` on a non-empty queue does not suspend: under a flood the loop would never run
        anything else (signals, the round's deadline, the page), so it yields every 32 messages.
        """
        handled = 0
        while True:
            msg = await self.transport.queue.get()
            self._handle_guarded(msg)
            handled += 1
            if self._dirty:
                batch_done = self.transport.queue.empty() or handled % PERSIST_EVERY == 0
                if batch_done and self._flush():
                    self.transport.commit()
            else:
                self.transport.commit()  # everything taken so far is written (or changed nothing)
            if handled % 32 == 0:
                await asyncio.sleep(0)

    def _handle_guarded(self, msg: Message) -> None:
        """:meth:`handle` (or a subclass's), with any fault it lets through counted as ``failed``.

        The pump then acknowledges the message like any refused one: a run of messages whose handling
        fails never stops the pump nor fills the broker's in-flight window (a peer never goes deaf).
        """
        try:
            self.handle(msg)
        except Exception as exc:
            self.state.rejected["failed"] += 1
            n = self.state.rejected["failed"]
            if n <= LOGGED_REFUSALS or n % 1000 == 0:
                logger.error(
                    "rejected message on %s (%d bytes): failed: handling raised %s: %s%s",
                    msg.topic,
                    len(msg.payload),
                    type(exc).__name__,
                    shorten(str(exc)),
                    f" ({n} failed so far)" if n > LOGGED_REFUSALS else "",
                )

    def _flush(self) -> bool:
        """Write what the messages handled since the last write changed (the open round, held updates).

        Returns False when the write failed (logged; nothing is acknowledged, the next batch tries again).
        """
        try:
            self._persist()
        except OSError as exc:
            logger.error("state not written (%s): updates stay unacknowledged until it is", exc)
            return False
        self._dirty = False
        return True

    def _resume_round(self, rnd: Round, doc: Mapping[str, Any]) -> None:
        """Put back the open round of the state file into ``rnd`` (just configured): its updates count."""
        rnd.opened_at = time.monotonic() - max(0.0, time.time() - float(doc["opened_unix"]))
        rnd.update_ids = set(doc["update_ids"])
        rnd.devices = list(doc["devices"])
        rnd.declined = list(doc["declined"])
        rnd.sites = list(doc["sites"])
        rnd.update_bytes = [int(n) for n in doc["update_bytes"]]
        if doc["snapshot"] is not None:
            self.strategy.restore(doc["snapshot"])
        for update_id in rnd.update_ids:
            self._remember(update_id)
        left = rnd.deadline_at - time.monotonic()
        logger.warning(
            "round %d resumed from the state file: %d updates, %d declines, %.0f s left",
            rnd.number,
            rnd.clients,
            len(rnd.declined),
            max(0.0, left),
        )

    @property
    def resuming(self) -> bool:
        """True while the state file's open round waits to be re-opened (it opens without pacing)."""
        return self._resume is not None

    def notify(self) -> None:
        """Tell the page that something changed (``on_change``)."""
        self._notify()

    def min_updates(self) -> int:
        """The fewest updates the strategy aggregates (``robustness.tolerate`` sets it).

        A round opens only once that many devices are ready, so it is not asked of too few and abandoned.
        """
        return max(1, self.strategy.min_updates)

    def handle(self, msg: Message) -> None:
        """Dispatch one message; a bad one is logged with topic, size and reason and counted, never raised."""
        if msg.topic == self.topics.coordinator:
            if self.on_lease_message is not None:
                self.on_lease_message(msg)
            return
        device = self.topics.device_of(msg.topic)
        try:
            if device is None and self._is_own_topic(msg.topic):
                self._adopt(msg)
                return
            if device is None:
                raise DecodeError("bad_topic", f"unexpected topic {msg.topic}")
            if msg.topic == self.topics.status(device):
                if not msg.payload:
                    self._forget(device)  # retained status cleared
                    return
                status = decode_status(msg.payload, limits=self.limits)
                read_new_samples(status.fields)  # a bad count refuses the status (bad_value, wrong_type)
                entry = _interned(status.fields)
                last = self.state.devices.get(device)
                if status.state == "offline" and not status.fields and last is not None:
                    # a last will says nothing else: keep the last figures the device reported (its
                    # memory, round, accuracies), shown as offline with their age, not blanked
                    entry = {**last, "ready": False, "offline_since": time.time()}
                entry["state"] = sys.intern(status.state)
                entry["seen_at"] = time.time()
                self._register(device, entry)
                self._status_changed.set()
                self._notify()
            else:
                self._handle_update(device, msg)
        except Exception as exc:
            # DecodeError/UpdateRejected carry their reason; anything else is the last line of defence
            # (a fault in handling): counted as ``failed`` so the pump never stops (a peer never deaf)
            known = isinstance(exc, (DecodeError, UpdateRejected))
            reason = exc.reason if isinstance(exc, (DecodeError, UpdateRejected)) else "failed"
            why = str(exc) if known else f"failed: handling raised {type(exc).__name__}: {exc}"
            self.state.rejected[reason] += 1
            if device is not None:
                self._count_by_device(self.rejected_by_device, device, reason)
            n = self.state.rejected[reason]
            # every refusal is counted; the log names the first ones of each reason, then every 1000th
            # (a flood of forged messages must not become a flood of log lines)
            if n <= LOGGED_REFUSALS or n % 1000 == 0:
                logger.warning(
                    "rejected message on %s (%d bytes): %s%s",
                    msg.topic,
                    len(msg.payload),
                    why,
                    f" ({n} {reason} so far)" if n > LOGGED_REFUSALS else "",
                )

    def _register(self, device: str, entry: dict[str, Any]) -> None:
        """Keep a device's status in the bounded registry and check its model's identity.

        Raises
        ------
        UpdateRejected
            ``registry_full`` when the registry holds ``max_devices`` live devices, ``expired`` for a
            status whose own timestamp ``ts`` (seconds since the epoch) is older than the expiry.
        """
        now = entry["seen_at"]
        ts = entry.get("ts")
        if isinstance(ts, (int, float)) and now - float(ts) > self.device_expiry_s:
            raise UpdateRejected("expired", f"status of {device} is {now - float(ts):.0f} s old")
        devices = self.state.devices
        if device not in devices and len(devices) >= self.max_devices:
            self._expire(now)
            if len(devices) >= self.max_devices:
                offline = [d for d, st in devices.items() if st.get("state") == "offline"]
                if not offline:
                    raise UpdateRejected(
                        "registry_full", f"{self.max_devices} devices known; {device} not kept"
                    )
                self._forget(min(offline, key=lambda d: float(devices[d].get("seen_at", 0.0))))
        devices[device] = entry
        sha = entry.get("model_sha256")
        if isinstance(sha, str) and sha != self.model_sha256:
            # an `edgefl model prepare` output carries its original's sha256: a difference is another model
            why = (
                f"backbone sha256 {sha[:12]}… differs from the coordinator's {self.model_sha256[:12]}…: "
                "another model (a `model prepare` output counts as its original)"
            )
            shape = entry.get("head_shape")
            if isinstance(shape, list) and shape != [int(n) for n in self.W.shape]:
                why += f"; head {shape}, the coordinator's {list(self.W.shape)}"
            if self.mismatched.get(device) != why:
                self.mismatched[device] = why  # only for a device in the registry: forgotten with it
                self.mismatches_total += 1
                n = self.mismatches_total
                # named one by one for the first ones, then every 1000th with the count (ghost statuses
                # naming another backbone must not become a flood of log lines)
                if n <= LOGGED_REFUSALS or n % 1000 == 0:
                    more = f" ({n} devices with another model so far)" if n > LOGGED_REFUSALS else ""
                    logger.warning(
                        "device %s runs another model: %s; left out of rounds%s", device, why, more
                    )
                    if self.on_mismatch is not None:
                        self.on_mismatch(device, why)
        else:
            self.mismatched.pop(device, None)

    def _count_by_device(self, table: dict[str, Counter[str]], device: str, reason: str) -> None:
        """Count ``reason`` for ``device`` in ``table`` (bounded).

        Kept for devices in the registry (forgotten with them, :meth:`_forget`) and for the last
        :data:`STRANGERS_KEPT` devices it does not hold (the oldest dropped).
        """
        if device not in table and device not in self.state.devices:
            self._strangers[device] = None
            while len(self._strangers) > STRANGERS_KEPT:
                old = next(iter(self._strangers))
                del self._strangers[old]
                if old not in self.state.devices:
                    self.rejected_by_device.pop(old, None)
                    self.declined_by_device.pop(old, None)
        table.setdefault(device, Counter())[reason] += 1

    def _forget(self, device: str) -> None:
        """Drop ``device`` from the registry and from every per-device record kept beside it."""
        self.state.devices.pop(device, None)
        self.mismatched.pop(device, None)
        self.rejected_by_device.pop(device, None)
        self.declined_by_device.pop(device, None)
        self.strategy.clipped.pop(device, None)

    def _expire(self, now: float) -> None:
        """Forget devices whose last status is older than ``device_expiry_s``."""
        for dev in [
            d
            for d, st in self.state.devices.items()
            if now - float(st.get("seen_at", now)) > self.device_expiry_s
        ]:
            self._forget(dev)

    def _handle_update(self, device: str, msg: Message) -> None:
        payload = msg.payload
        if is_chunk(payload):
            whole = self.reassembler.feed(msg.topic, payload)
            if whole is None:
                return
            payload = whole
        key = None
        if self.device_keys is not None:
            key = self.device_keys.get(device)
            if key is None:
                raise DecodeError("unknown_device", f"no public key for device {device}")
        kind = prescan(payload, self.limits, ("type",)).get("type")  # once: verify and dispatch use it
        if key is not None:
            verify_payload(
                payload,
                key,
                fleet=self.topics.fleet,
                kind=MessageType.DECLINE if kind == MessageType.DECLINE else MessageType.UPDATE,
                device=device,
                limits=self.limits,
            )
        if kind == MessageType.DECLINE:
            self._handle_decline(device, payload)
            return
        if device in self.mismatched:
            raise UpdateRejected("wrong_model", f"device {device}: {self.mismatched[device]}")
        update = decode_update(payload, limits=self.limits, expect_shape=self.shape)
        if update.device != device:
            raise UpdateRejected("wrong_device", f"update names device {update.device} on {msg.topic}")
        check_update_id(update.update_id, device, update.round, update.base_version)
        rnd = self.state.current
        if rnd is None or (rnd.check_round and rnd.phase is not RoundPhase.OPEN):
            if update.round == self.state.round + 1 and len(self._early) < EARLY_UPDATES_MAX:
                self._early[update.update_id] = (update, len(payload))
                self._unfolded[update.update_id] = (msg.topic, msg.payload)
                self._dirty = True
                logger.info("round %d: update from %s held until the round opens", update.round, device)
                return
            if rnd is None:
                raise UpdateRejected("no_round", "no round is open")
        buffer_full = rnd.phase is RoundPhase.CLOSED or rnd.complete()
        if not rnd.check_round and buffer_full and len(self._held) < HELD_UPDATES:
            # A buffered step is full or being published: the update counts in the next step (a
            # step aggregates exactly its buffer size, and FedBuff loses no device's work).
            self._held.append((update, len(payload)))
            self._unfolded[update.update_id] = (msg.topic, msg.payload)
            self._dirty = True
            logger.info("update %s held for the next buffered step", update.update_id)
            self._notify()
            return
        self._accept(rnd, update, len(payload))

    def _handle_decline(self, device: str, payload: bytes) -> None:
        """Count and log a device's refusal of the open round (a Decline on ``update/<device>``).

        A decline counts only for the open round and its base version, from a device selected for
        it, once per (device, round); its id must be ``<device>:<round>:<base_version>:declined``
        (so one device cannot spend another device's update ids). The log names the first
        ``LOGGED_REFUSALS`` declines of each reason, then every 1000th, ``detail`` cut to 80 chars.

        Raises
        ------
        DecodeError, UpdateRejected
            As for an update: ``wrong_device``, ``bad_value`` (another id), ``no_round``,
            ``round_closed``, ``stale_round``, ``stale_base``, ``not_selected``, ``duplicate``
            (a decline sent again, or from a device that already answered the round).
        """
        decline = decode_decline(payload, limits=self.limits)
        if decline.device != device:
            raise UpdateRejected("wrong_device", f"decline names device {decline.device} on update/{device}")
        check_update_id(decline.update_id, device, decline.round, decline.base_version, DECLINE_SUFFIX)
        rnd = self.state.current
        if rnd is None:
            raise UpdateRejected("no_round", "no round is open")
        if rnd.phase is not RoundPhase.OPEN:
            raise UpdateRejected("round_closed", f"round {rnd.number} is closed")
        if decline.round != rnd.number:
            raise UpdateRejected(
                "stale_round", f"decline for round {decline.round}, round {rnd.number} is open"
            )
        if decline.base_version != rnd.base_version:
            why = f"decline from version {decline.base_version}, round uses {rnd.base_version}"
            raise UpdateRejected("stale_base", why)
        if rnd.selected is not None and device not in rnd.selected:
            raise UpdateRejected("not_selected", f"device {device} not selected for round {rnd.number}")
        if rnd.has_answered(device) or decline.update_id in self._seen_update_ids:
            raise UpdateRejected("duplicate", f"{device} already answered round {rnd.number}")
        self._remember(decline.update_id)
        self.state.declined[decline.reason] += 1
        self._count_by_device(self.declined_by_device, device, decline.reason)
        rnd.declined.append(device)
        self._dirty = True
        n = self.state.declined[decline.reason]
        if n <= LOGGED_REFUSALS or n % 1000 == 0:
            logger.warning(
                "round %d: %s declined: %s (%s)%s",
                decline.round,
                device,
                decline.reason,
                shorten(decline.detail),
                f" ({n} {decline.reason} so far)" if n > LOGGED_REFUSALS else "",
            )
        self._round_changed.set()
        self._notify()

    def _accept(self, rnd: Round, update: Update, size_bytes: int) -> None:
        """Admit ``update`` to ``rnd``, offer it to the strategy and record it (raises ``UpdateRejected``)."""
        rnd.admit(update)
        if update.update_id in self._seen_update_ids:  # an earlier step's update, sent again
            raise UpdateRejected("duplicate", f"update {update.update_id} already counted")
        staleness = self.state.version - update.base_version
        if staleness < 0:
            raise UpdateRejected("stale_base", f"update from future version {update.base_version}")
        self.strategy.offer(
            Offer(update.device, update.delta_W, update.delta_b, update.num_examples, staleness)
        )
        rnd.record(update, size_bytes)
        self._remember(update.update_id)
        self._dirty = True
        # Devices no longer publish a status for their round's progress (agent/status.py):
        # the update says it, so the fleet registry takes the device's round, update size and its
        # evaluation of the base head (federated evaluation, read at the round's close) from it.
        entry = self.state.devices.get(update.device)
        if entry is not None:
            shown = entry.get("round")
            if not isinstance(shown, int) or shown < update.round:
                entry["round"] = update.round
            entry["last_update_bytes"] = size_bytes
            entry["new_samples"] = 0  # trained on: its next status says how many came since
            m = update.metrics
            if m.eval_accuracy is not None:
                entry.update(
                    eval_version=update.base_version, eval_accuracy=m.eval_accuracy, eval_count=m.eval_count
                )
        logger.info(
            "round %d: update from %s (%d examples, %d bytes, staleness %d)",
            rnd.number,
            update.device,
            update.num_examples,
            size_bytes,
            staleness,
        )
        self._round_changed.set()
        self._notify()

    def _remember(self, update_id: str) -> None:
        self._seen_update_ids[update_id] = None
        while len(self._seen_update_ids) > self.max_seen_update_ids:
            del self._seen_update_ids[next(iter(self._seen_update_ids))]

    def dashboard_status(self) -> dict[str, Any]:
        """The coordinator page's status document (see ``dashboard/app.py``), JSON-like."""
        rnd = self.state.current
        open_round = rnd is not None and rnd.phase.value == "open"
        devices = {}
        registry = self.state.devices
        # the page lists a bounded number of devices (online and ready first, the least memory
        # headroom first, then the most recently seen): a registry of thousands, or of ghosts, must
        # not make the document megabytes
        shown = heapq.nsmallest(PAGE_DEVICES, registry, key=lambda d: _page_order(registry[d]))
        for dev in shown:
            st = registry[dev]
            reason = st.get("reason")
            devices[dev] = {
                "state": st.get("state"),
                "online": st.get("state") != "offline",
                "rss_bytes": st.get("rss_bytes"),
                "cap_bytes": st.get("cap_bytes"),
                "peak_rss_bytes": st.get("peak_rss_bytes"),
                "last_round": st.get("round"),
                "reason": shorten(reason) if isinstance(reason, str) else "",
                "rejected": _top_counts(st.get("rejected")),
                "refused": _top_counts(self.rejected_by_device.get(dev)),
                "declined": _top_counts(self.declined_by_device.get(dev)),
                "model_mismatch": self.mismatched.get(dev),
                "clipped": self.strategy.clipped.get(dev, 0),
                # accuracies the device reports, each measured on its own holdout
                "personal_accuracy": st.get("personal_accuracy"),
                "global_accuracy": st.get("global_accuracy"),
                "eval_accuracy": st.get("eval_accuracy"),
                "serving_head": st.get("serving_head"),
            }
        return {
            "broker_connected": self.transport.connected.is_set(),
            "round": self.state.round,
            "state": "collecting" if open_round else ("idle" if not self.state.history else "aggregated"),
            "fleet_state": self.fleet_state().as_dict(),
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
            "devices_total": len(registry),
            "model_mismatches": {d: self.mismatched[d] for d in shown if d in self.mismatched},
            "model_mismatches_total": len(self.mismatched),
            "rejected": dict(self.state.rejected),
            "clipped": dict(self.strategy.clipped),
            "refused_rounds": dict(self.state.refused_rounds),
            "declined": dict(self.state.declined),
            "held_updates": len(self._held),
            "personal_heads": personal_heads_summary(self.state.devices),
            "epsilon": None
            if not self.state.history or math.isnan(self.state.history[-1].epsilon)
            else self.state.history[-1].epsilon,
        }

    def note_round_reasons(
        self, round_no: int, refused: Mapping[str, int], declined: Mapping[str, int]
    ) -> None:
        """Keep a closed round's refused updates and declines by reason for its record on the fleet page.

        Parameters
        ----------
        round_no : int
        refused, declined : {reason: count}
            What arrived between the round's opening and its close (the runner counts them).
        """
        reasons = {"refused": dict(refused), "declined": dict(declined)}
        self._round_reasons[round_no] = reasons
        for old in sorted(self._round_reasons)[:-HISTORY_ROUNDS]:
            del self._round_reasons[old]
        for record in reversed(self._dashboard_rounds):  # converted already: completed in place
            if record["round"] == round_no:
                record.update(reasons)
                break

    def _page_record(self, h: RoundRecord) -> dict[str, Any]:
        """One round's record as the fleet page reads it: the round log's keys where they exist."""
        record = dataclasses.asdict(h)
        record["round_refused"] = record.pop("refused") or None  # why the head was not published
        record["declined_devices"] = record.pop("declined")
        record["counted"] = h.clients
        record["time"] = (
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(h.closed_unix))
            if math.isfinite(h.closed_unix)
            else None
        )
        record.update(self._round_reasons.get(h.round, {}))
        return record

    def dashboard_rounds(self) -> list[dict[str, Any]]:
        """Every round record so far as JSON-like dicts, oldest first (the fleet page's ``/api/rounds``).

        Each is the :class:`RoundRecord` with the round log's keys (``time``, ``counted``,
        ``refused`` and ``declined`` {reason: n} once :meth:`note_round_reasons` gave them,
        ``round_refused``; ``declined_devices`` counts the devices that declined). Records already
        converted are kept while they still line up with the history (rounds appended, the oldest
        trimmed), so a page polling it costs a few comparisons.
        """
        history = self.state.history
        cached = self._dashboard_rounds
        if history and cached and cached[0]["round"] < history[0].round:  # the oldest were trimmed
            cached = [c for c in cached if c["round"] >= history[0].round]
        if len(cached) > len(history) or (cached and cached[-1]["round"] != history[len(cached) - 1].round):
            cached = []
        if len(cached) < len(history):
            cached = cached + [self._page_record(h) for h in history[len(cached) :]]
        self._dashboard_rounds = cached
        return cached

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def online_devices(self) -> list[str]:
        """Device ids whose retained status says they are up and ready (sorted)."""
        return sorted(
            d
            for d, s in self.state.devices.items()
            if s.get("ready") and s.get("state") != "offline" and d not in self.mismatched
        )

    def ready_new_samples(self) -> dict[str, int | None]:
        """The ready devices (:meth:`online_devices`) and the new labelled samples each reports (or None)."""
        out: dict[str, int | None] = {}
        for dev in self.online_devices():
            n = self.state.devices[dev].get("new_samples")
            out[dev] = n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None
        return out

    def pacing_state(self) -> FleetState:
        """Where the fleet stands before the next round (see :meth:`Pacing.check`)."""
        pacing = self.pacing
        if pacing.min_devices > 0:  # 0: a root, whose devices report to their sites
            pacing = replace_min_devices(pacing, self.min_updates())
        since = None if self._last_start is None else time.monotonic() - self._last_start
        return pacing.check(self.state.round, self.ready_new_samples(), since)

    def fleet_state(self) -> FleetState:
        """The fleet's state for its page: collecting, waiting for samples or devices, paused, finished...

        Every state carries the pacing's numbers (devices ready and needed, new samples); an open
        round adds its own (asked, counted, close_at).
        """
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
            st = collecting(rnd)
            return dataclasses.replace(
                paced, state=st.state, text=st.text, round=st.round, asked=st.asked, counted=st.counted,
                close_at=st.close_at, next_round_in_s=None,
            )  # fmt: skip
        return paced

    async def wait_to_open(self, stop: asyncio.Event) -> bool:
        """Wait until the pacing lets the next round open (devices, new samples, interval), or ``stop``.

        A new kind of wait is logged at once (``waiting: 12 of 200 new samples``, ``waiting for
        devices: 3 of 5 ready``), a count moving within it at most every :data:`WAIT_LOG_EVERY_S`; the
        fleet page shows it live.

        Returns
        -------
        True when the round may open, False when ``stop`` was set first.
        """
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
                self._notify()
            self._status_changed.clear()
            wake = st.next_round_in_s if st.state is FleetPhase.PAUSED else 60.0
            waiter = asyncio.ensure_future(self._status_changed.wait())
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

    async def wait_for_devices(self, n: int, timeout_s: float, key: str = "ready") -> list[str]:
        """Wait until ``n`` devices report a status whose field ``key`` is true.

        Returns
        -------
        The ready device ids.

        Raises
        ------
        TimeoutError
            If fewer than ``n`` are ready after ``timeout_s`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            ready = sorted(
                d for d, s in self.state.devices.items() if s.get(key) and s.get("state") != "offline"
            )
            if len(ready) >= n:
                return ready
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"only {len(ready)} of {n} devices ready after {timeout_s} s")
            self._status_changed.clear()
            await wait_event(self._status_changed, remaining)

    async def _announce(
        self, round_no: int, cfg: RoundConfig, selected: tuple[str, ...] | None = None
    ) -> None:
        """Publish the RoundAnnouncement of ``round_no`` (QoS 1, retained) and wait for its PUBACK.

        :meth:`run_round` runs it as a task and collects updates meanwhile (round latency).
        """
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
        self._announcement = (round_no, payload)
        await self._publish(self.topics.round, payload)

    def on_transport_connect(self) -> None:
        """Announce the open round again after a reconnect that found no session of ours at the broker.

        Called by the transport (its ``on_connect``) after every CONNACK, once the subscriptions are
        renewed. A broker that restarted without its state (no ``persistence``, a crash between saves,
        a new node) lost our session and the retained announcement with it; what was published on our
        subscriptions meanwhile (a site's partial the bridge forwarded before we were back, a device's
        update) was delivered to nobody. Publishing the same announcement (same bytes, retained) now,
        after our subscriptions are in place, restores it for later subscribers and makes a site that
        had closed the round send its partial again (:class:`~edgefl.coordinator.hierarchy.SiteAggregator`);
        a copy the root had already counted is refused as ``duplicate``. With the session present
        nothing was lost and nothing is published.
        """
        rnd, ann = self.state.current, self._announcement
        if self.transport.session_present or rnd is None or ann is None:
            return
        if rnd.phase is not RoundPhase.OPEN or ann[0] != rnd.number:
            return
        if self._reannounce_task is not None and not self._reannounce_task.done():
            return
        self._reannounce_task = asyncio.create_task(self._reannounce(*ann), name="coordinator-reannounce")

    async def _reannounce(self, round_no: int, payload: bytes) -> None:
        logger.warning(
            "round %d: the broker had no session of ours (it lost its state?): announcing the round again",
            round_no,
        )
        try:
            await self._publish(self.topics.round, payload)
        except TransportError as exc:
            logger.warning("round %d: announcement not published again: %s", round_no, exc)
            return
        self.reannounced += 1

    async def run_round(self, round_no: int, selected: tuple[str, ...] | None = None) -> RoundRecord:
        """Run round ``round_no``: announce, collect until complete or deadline, aggregate, check, publish.

        The strategy's ``RoundConfig.schedule`` picks the schedule: SYNC (updates for this round and
        base version; the round closes at ``min_clients`` or when every selected device answered) or
        BUFFERED (FedBuff: one server step; updates trained from any earlier version count with
        their staleness; the step closes at ``buffer_size`` updates). Both close at the deadline
        with what they have.

        Parameters
        ----------
        round_no : int
            The round (1-based).
        selected : tuple of str or None
            Devices asked to train (None: the strategy samples when its ``fraction < 1``, else all).

        Returns
        -------
        RoundRecord: ``clients = 0`` and the head unchanged when no update arrived; ``refused``
        names the reason when the aggregated head was not valid (the head is unchanged too).
        """
        cfg = self.strategy.configure_round(round_no, self.shape)
        t0 = time.monotonic()
        resume, self._resume = self._resume, None
        if resume is not None and int(resume["round"]) != round_no:
            logger.warning(
                "state file's open round %s is not round %d: not resumed", resume["round"], round_no
            )
            resume = None
        reports = [n for n in self.ready_new_samples().values() if n is not None]
        new_samples = sum(reports) if reports else -1
        online: frozenset[str] = frozenset()
        if resume is not None:
            selected = tuple(resume["selected"]) if resume["selected"] is not None else None
            online = frozenset(resume["online"])
            self._round_lr = float(resume["lr"])
        else:
            if selected is None and self.strategy.fraction < 1.0:
                selected = self.strategy.sample_clients(self.online_devices(), round_no) or None
            if not selected:
                online = frozenset(self.online_devices())
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
            min_updates=self.min_updates(),
        )
        if resume is not None:
            self._resume_round(rnd, resume)
        self.state.current = rnd
        self.state.round = round_no
        self._last_start = time.monotonic()
        early, self._early = self._early, {}
        for update, size in early.values():
            if update.round != round_no:
                self._unfolded.pop(update.update_id, None)
                continue
            try:
                self._accept(rnd, update, size)
            except UpdateRejected as exc:
                self.state.rejected[exc.reason] += 1
                logger.warning("round %d: held update from %s refused: %s", round_no, update.device, exc)
            self._unfolded.pop(update.update_id, None)
        held, self._held = self._held, []
        for i, (update, size_bytes) in enumerate(held):
            if rnd.complete():  # more held than one step takes: they wait for the next
                self._held = held[i:]
                break
            try:
                self._accept(rnd, update, size_bytes)
            except UpdateRejected as exc:
                self.state.rejected[exc.reason] += 1
                logger.warning("held update %s refused: %s", update.update_id, exc)
            self._unfolded.pop(update.update_id, None)
        self._flush()  # the round is in the state file before devices hear of it
        # collecting starts as the announcement leaves, not after its PUBACK: a failed announcement
        # (no PUBACK within PUBLISH_RETRY_S) still ends the round with its TransportError
        announce = asyncio.create_task(self._announce(round_no, cfg, selected))
        announce.add_done_callback(lambda _: self._round_changed.set())
        self._notify()
        loop = asyncio.get_running_loop()
        try:
            while not rnd.complete():
                if announce.done() and announce.exception() is not None:
                    break
                remaining = rnd.deadline_at - time.monotonic()
                if remaining <= 0:
                    logger.warning(
                        "round %d: deadline passed with %d of %d updates",
                        round_no,
                        rnd.clients,
                        cfg.min_clients,
                    )
                    break
                self._round_changed.clear()
                await wait_event(self._round_changed, remaining)
            await announce  # its PUBACK (long back in a round that completed), or its TransportError
        finally:
            if not announce.done():
                announce.cancel()
                await asyncio.gather(announce, return_exceptions=True)
        rnd.close()
        refused = ""
        self._settled = round_no  # from here on the state file holds the round's result, not the round
        if rnd.clients == 0:
            self._persist()
        else:
            self.W, self.b, refusal = aggregate_checked(self.strategy, self.W, self.b)
            if refusal is not None:
                self._persist()
                refused = refusal.reason
                self.state.refused_rounds[refused] += 1
                logger.error(
                    "round %d refused: %s (%s); keeping version %d",
                    round_no,
                    "abandoned" if refused == "too_few" else "the agents would refuse the aggregated head",
                    refusal,
                    self.state.version,
                )
            else:
                self.counted[round_no] = sorted(rnd.update_ids)
                self.state.version += 1
                self._persist()  # before publishing: a crash in between must not resume a version behind
                await self.publish_global(round_no)
        report = self.strategy.report()
        accuracy = float("nan")
        if self.evaluate is not None:
            W, b = self.W, self.b
            accuracy = await loop.run_in_executor(None, self.evaluate, W, b)
        fed = federated_evaluation(
            [
                (float(st["eval_accuracy"]), int(st["eval_count"]))
                for dev, st in self.state.devices.items()
                if st.get("eval_version") == rnd.base_version
                and isinstance(st.get("eval_accuracy"), (int, float))
                and isinstance(st.get("eval_count"), int)
                and dev not in self.mismatched
            ]
        )
        record = RoundRecord(
            round_no,
            rnd.clients,
            accuracy,
            float(np.mean(rnd.update_bytes)) if rnd.update_bytes else 0.0,
            time.monotonic() - t0,
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
        self.state.history.append(record)
        del self.state.history[:-HISTORY_ROUNDS]  # a service runs for months: memory and state stay bounded
        for old in sorted(self.counted)[:-COUNTED_ROUNDS]:
            del self.counted[old]
        self._notify()
        return record
