"""The daemon's status task: the retained DeviceStatus and the status page's document.

It also declares the fields and small hooks the daemon's tasks share.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from edgefl.agent.config import Profile
from edgefl.agent.core import DeviceCore
from edgefl.agent.ingest import LOGGED_REFUSALS, Ingest
from edgefl.agent.status import samples_level, status_news
from edgefl.aio import wait_event
from edgefl.errors import EdgeflError, TransportError
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.chunking import publish_packet_bytes
from edgefl.wire.status import DeviceStatus, encode_status

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

REFUSED_NOT_AUTHORIZED = "refused: not authorized"
"""What the status, the page and ``/healthz`` say while the broker refuses the agent's credentials."""
REFUSED_UNTRUSTED = "refused: broker certificate not trusted (certificate verify failed)"
"""What they say while the broker's TLS certificate fails verification (unknown CA, wrong name, expired)."""

COMPACT_STATUS_FIELDS = frozenset(
    {
        "model_sha256",
        "head_shape",
        "ts",
        "eval_version",
        "eval_accuracy",
        "personal_accuracy",
        "global_accuracy",
        "serving_head",
        "eval_count",
        "round",
        "version",
        "reason",
        "ready",
        "store_samples",
        "new_samples",
        "rss_bytes",
        "peak_rss_bytes",
        "cap_bytes",
        "pss_bytes",
        "system_available_bytes",
        "last_update_bytes",
        "rejected",
        "pid",
        "degraded",
        "samples_received",
        "labels_received",
        "predictions_published",
        "ingest_dropped",
    }
)
"""Status fields kept when the full status would exceed the broker's maximum packet size."""


class StatusPage(Protocol):
    """What the daemon needs of a status page (the CLI builds one from ``edgefl.dashboard``)."""

    async def start(self, status: Callable[[], dict[str, Any]]) -> str:
        """Start serving ``status()`` documents; return the page's URL."""

    def notify(self) -> None:
        """The status changed: push it to open pages."""

    async def stop(self) -> None:
        """Stop serving."""

    def counters(self) -> dict[str, int]:
        """Connections the page refused (over its caps) and closed (header or body timeout)."""


@dataclass
class AgentState:
    """Live figures of the agent (status message, dashboard)."""

    state: str = "idle"
    reason: str = ""
    round: int = 0
    local_accuracy: float = float("nan")
    inferred_total: int = 0
    correct_total: int = 0
    labelled_total: int = 0
    """Classified samples that had a label (the denominator of ``inference_accuracy``)."""
    stored_total: int = 0
    last_update_ts: float | None = None
    """Wall-clock time (Unix s) the last update was sent: with ``ts`` the page tells its age."""
    last_update_bytes: int = 0
    replay_done: bool = False
    ingest_ready: bool = False
    """Live ingest: subscribed to the samples and labels topics."""
    rejected: Counter[str] = field(default_factory=Counter)
    last_rejected: dict[str, str] = field(default_factory=dict)
    """The last live-ingest refusal: ``reason``, ``detail``, ``topic`` (a feed shows it)."""
    over_budget_batches: int = 0
    """Sample batches the memory governor refused to run (each retried once memory frees)."""
    faults: Counter[str] = field(default_factory=Counter)
    """Failures the daemon survived, by where: ``batch`` (a source batch), ``status`` (a status tick),
    ``round`` (a re-send, a waiting or deferred round), ``personal`` (a personal step)."""


class StatusReporter:
    """The status task, and the fields and hooks the daemon's tasks share (the base of ``Agent``).

    Raises ``ModelError`` if the profile's model cannot be loaded (:meth:`DeviceCore.open`).
    """

    ingest: Ingest | None

    def __init__(self, profile: Profile, status_page: StatusPage | None) -> None:
        self.profile = profile
        self.device = profile.device.id
        self.topics = Topics(profile.broker.topic_prefix, profile.device.fleet)
        self.state = AgentState()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.core = DeviceCore.open(profile, progress=self._progress)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgefl-worker")
        self.transport: MqttTransport | None = None
        self.stop_event = asyncio.Event()  # correctness: SIGTERM/SIGINT stop the daemon
        self.status_page = status_page
        self.dashboard_url = ""
        self._round_wake = asyncio.Event()  # correctness: a message or an ask wakes the one round task
        self._round_asks: set[str] = set()  # what other tasks asked the round task (_wake_rounds)
        self._acked: list[str] = []  # PUBACKed updates the core is told of with the next worker call
        self._status_dirty = asyncio.Event()  # correctness: a change wakes the status task (news goes out)
        # performance (round latency, docs/benchmarks.md "Hygiene"): the status is checked once no round
        # or global message is in hand, or at once after a (re)connect
        self._status_go = asyncio.Event()
        self._status_go.set()
        # correctness: after a (re)connect the next status check publishes (the broker may hold the will)
        self._status_connected = False
        self._last_said, self._last_at = "", -math.inf  # what the last published status said, and when
        self._last_level = 0  # samples_level of the last status published, lowered as it drops
        self._rate_window: deque[tuple[float, int]] = deque(maxlen=32)

    def _progress(self, state: str, reason: str) -> None:
        """The core's progress hook (worker thread): hop to the loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._set_state, state, reason)

    async def _work(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the worker thread, after the PUBACKs noted since the last call."""
        acked, self._acked = self._acked, []
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._acknowledge_then, acked, fn, args)

    def _acknowledge_then(self, acked: list[str], fn: Callable[..., _T], args: tuple[Any, ...]) -> _T:
        """Worker thread: tell the core of each acknowledged update, then run ``fn(*args)``."""
        for update_id in acked:
            self.core.acknowledged(update_id)
        return fn(*args)

    def _wake_rounds(self, ask: str) -> None:
        """Ask the round task for ``ask``: ``ready`` (a waiting round may be answerable), ``resend``."""
        self._round_asks.add(ask)
        self._round_wake.set()

    def _fault(self, where: str, what: str, exc: BaseException) -> None:
        """Count and log (one line, its reason) a failure the daemon survives."""
        self.state.faults[where] += 1
        logger.error("%s: %s failed: %s: %s", where, what, type(exc).__name__, exc)
        self._changed()

    def _count_rejected(self, reason: str) -> str | None:
        """Count a refusal; its log line's suffix, None past the first few (then every 1000th is logged)."""
        self.state.rejected[reason] += 1
        n = self.state.rejected[reason]
        if n > LOGGED_REFUSALS and n % 1000:
            return None
        return f" ({n} {reason} so far)" if n > LOGGED_REFUSALS else ""

    def _reject(self, reason: str, what: str, detail: str) -> None:
        more = self._count_rejected(reason)  # a flood of refusals is not a flood of log lines
        if more is not None:
            logger.warning("rejected %s: %s: %s%s", what, reason, detail, more)
        self._changed()

    def _changed(self) -> None:
        """Mark the status as changed: republish it and push it to open status pages."""
        self._status_dirty.set()
        if self.status_page is not None:
            self.status_page.notify()

    def packet_limit(self) -> int:
        """The largest MQTT packet we may send: the profile's limit, or the broker's (CONNACK) if smaller."""
        ours = self.profile.broker.max_packet_bytes
        broker = self.transport.broker_max_packet_bytes if self.transport is not None else None
        return min(ours, broker or ours)

    def _set_state(self, state: str, reason: str = "") -> None:
        self.state.state = state
        self.state.reason = reason
        self._changed()

    # --- status -------------------------------------------------------------------------------
    def status_fields(self, measure: bool = True, *, volatile: bool = True) -> dict[str, Any]:
        """The DeviceStatus fields (JSON-like); ``measure=False`` leaves out the ``/proc`` figures.

        ``volatile=False`` also leaves out the figures that are never news (``pipeline``, ...).
        """
        s = self.state
        core = self.core
        pipeline = core.pipeline
        assert pipeline is not None
        broker = self.broker_state()
        return {
            "round": s.round,
            "version": core.head.version,
            "reason": self._reason(broker),
            "broker": broker,
            # a refusal (credentials, broker certificate) makes /healthz answer 503
            "health": broker if broker in (REFUSED_NOT_AUTHORIZED, REFUSED_UNTRUSTED) else "ok",
            "degraded": core.degraded,
            "write_failures": core.write_failures,
            "ready": s.replay_done or s.ingest_ready,
            "store_samples": len(core.store),
            "holdout_samples": len(core.holdout) if core.holdout is not None else 0,
            "new_samples": core.new_samples,  # labelled samples stored since the last round (paces rounds)
            "stored_total": s.stored_total,  # labelled samples stored (store and holdout) since start
            "inferred_total": s.inferred_total,
            "inference_accuracy": (s.correct_total / s.labelled_total) if s.labelled_total else None,
            "last_update_bytes": s.last_update_bytes,
            "last_update_ts": s.last_update_ts,
            "redelivered_total": core.redelivered,
            # updates a restart would send again: not yet acknowledged (PUBACK)
            "outbox_pending": core.outbox_pending,
            **self.ingest_fields(),
            "deferred_round": core.deferred.ann.round if core.deferred is not None else None,
            "declined_total": core.declined_total,  # rounds refused to the coordinator (Decline)
            "over_budget_batches": s.over_budget_batches,  # inference refused by the governor
            **core.governor.status(measure=measure, figures=volatile),
            "rejected": dict(s.rejected),
            "last_rejected": dict(s.last_rejected),
            "faults": dict(s.faults),
            "pipeline_mode": pipeline.mode,
            **({"pipeline": pipeline.counters()} if volatile else {}),
            # model identity: the coordinator leaves a device with another backbone out of rounds
            "model_sha256": core.model_sha256,
            "head_shape": list(core.head.shape),
            "ts": round(time.time(), 3),
            # federated evaluation of the current head on the holdout (never trained on)
            **(
                {
                    "eval_version": core.evaluation.version,
                    "eval_accuracy": core.evaluation.accuracy,
                    "eval_count": core.evaluation.count,
                }
                if core.evaluation is not None
                else {}
            ),
            # the personal head beside the global one (same holdout), and which one serves predictions
            **self.personal_fields(),
            "pid": os.getpid(),
            "dashboard_url": self.dashboard_url,
            **(
                {"transport": self.transport.counters() if self.transport is not None else {}}
                if volatile
                else {}
            ),
            **(
                {"dashboard_connections": self.status_page.counters()}
                if self.status_page is not None and self.dashboard_url
                else {}
            ),
        }

    def broker_state(self) -> str:
        """``connected``, a refusal (:data:`REFUSED_NOT_AUTHORIZED`, ...), ``lost`` or ``connecting``."""
        t = self.transport
        if t is None:
            return "connecting"
        if t.connected.is_set():
            return "connected"
        if t.certificate_refused:
            return REFUSED_UNTRUSTED
        if t.credentials_refused:
            return REFUSED_NOT_AUTHORIZED
        return "lost" if t.ever_connected else "connecting"

    def _reason(self, broker: str) -> str:
        """The status's ``reason``: the refusal ``broker`` (:meth:`broker_state`) names, else the state's."""
        if broker == REFUSED_NOT_AUTHORIZED:
            return f"{REFUSED_NOT_AUTHORIZED} (broker.username / password)"
        if broker == REFUSED_UNTRUSTED:
            assert self.transport is not None
            return f"{REFUSED_UNTRUSTED}: {self.transport.last_tls_refusal} (broker.ca_file)"
        return f"degraded: {self.core.degraded}" if self.core.degraded else self.state.reason

    def personal_fields(self) -> dict[str, Any]:
        """``serving_head``, ``personal_fallback`` and, once evaluated, the two heads' accuracies."""
        core = self.core
        out: dict[str, Any] = {
            "serving_head": core.serving_head()[1],
            "personal_fallback": core.personal_fallback,
        }
        pe, ge = core.personal_evaluation, core.evaluation
        if pe is not None and ge is not None:
            out["personal_accuracy"] = pe.accuracy
            out["global_accuracy"] = ge.accuracy
        return out

    def ingest_fields(self) -> dict[str, int]:
        """The live ingest's counters and levels (``{}`` unless ``source.kind = "mqtt"``)."""
        if self.ingest is None:
            return {}
        c = self.ingest.counters
        return {
            "samples_received": c.samples_received,
            "labels_received": c.labels_received,
            "predictions_published": c.predictions_published,
            "predictions_failed": c.predictions_failed,
            "ingest_dropped": c.ingest_dropped,
            "ingest_queued": len(self.ingest),
            "pending_labels": self.ingest.pending,
            "conflicts_stored": c.conflicts_stored,
            "pending_expired": c.pending_expired,
            "pending_evicted": c.pending_evicted,
        }

    def inference_rate(self) -> float:
        """Samples classified per second over the last few batches (0.0 when idle)."""
        w = self._rate_window
        if len(w) < 2 or time.monotonic() - w[-1][0] > 5.0:
            return 0.0
        (t0, n0), (t1, n1) = w[0], w[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def dashboard_status(self) -> dict[str, Any]:
        """The device page's status document (see ``dashboard/app.py``): the status fields plus live ones."""
        fields = self.status_fields()
        fields.update(
            device=self.device,
            state=self.state.state,
            local_accuracy=None
            if self.state.local_accuracy != self.state.local_accuracy
            else self.state.local_accuracy,
            inference_rate=self.inference_rate(),
            broker_connected=self.transport is not None and self.transport.connected.is_set(),
        )
        return fields

    async def status_loop(self) -> None:
        """Publish the retained status when it says something new, and at least every ``status.heartbeat_s``.

        Also at every (re)connect (the broker may hold the "offline" will); while the core is degraded
        each check retries the writes.
        """
        assert self.transport is not None
        cfg = self.profile.status
        heartbeat_s = cfg.interval_s if cfg.heartbeat_s is None else cfg.heartbeat_s
        while True:
            await wait_event(self._status_dirty, cfg.interval_s)
            # a round marks the status changed at each step: checked once its messages are handled,
            # never later than one interval, at once after a (re)connect
            await wait_event(self._status_go, cfg.interval_s)
            self._status_dirty.clear()
            try:
                await self._status_tick(heartbeat_s)
            except (ValueError, ArithmeticError, OSError, EdgeflError) as exc:
                self._fault("status", "status tick", exc)  # e.g. EMFILE: the next tick tries again

    async def _status_tick(self, heartbeat_s: float) -> None:
        """Retry unsaved state if degraded, then publish the retained status if it has news (connected)."""
        assert self.transport is not None
        if self.core.degraded:  # a full disk: write what waits once there is room again
            await self._work(self.core.retry_persist)
            if not self.core.degraded:
                self._changed()
        if not self.transport.connected.is_set():
            self._last_said = ""  # publish again once connected
            return
        topic = self.topics.status(self.device)
        # round progress and volatile figures are not news; the /proc reads wait until a publish
        quick = self.status_fields(measure=False, volatile=False)
        said = status_news(self.state.state, quick)
        if self._status_connected:
            self._status_connected, self._last_said = False, ""
        level = samples_level(quick)
        self._last_level = min(self._last_level, level)  # trained on: the next rise is news again
        if (
            said == self._last_said
            and level <= self._last_level
            and time.monotonic() - self._last_at < heartbeat_s
        ):
            return
        fields = self.status_fields()
        payload = encode_status(DeviceStatus(self.device, self.state.state, fields))
        if publish_packet_bytes(topic, len(payload)) > self.packet_limit():
            # A retained status is one message: under a small broker packet limit, send the essentials.
            fields = {k: v for k, v in fields.items() if k in COMPACT_STATUS_FIELDS}
            payload = encode_status(DeviceStatus(self.device, self.state.state, fields))
        try:
            await self.transport.publish(topic, payload, qos=1, retain=True)
        except TransportError as exc:
            logger.debug("status not published: %s", exc)
            self._last_said = ""  # try again at the next check
            return
        self._last_said, self._last_at, self._last_level = said, time.monotonic(), level
