"""Live ingest bookkeeping: the bounded sample queue (drop-oldest) and the table of samples awaiting a label.

Called from the daemon's event loop only: the queue, the samples in flight, the pending table and
the duplicate and conflict checks (rules: ``docs/protocol.md``, "Live ingest"), in bounded memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgefl.agent.pending import PendingFile
from edgefl.errors import UpdateRejected
from edgefl.idtable import IdTable
from edgefl.types import F32, I64
from edgefl.wire.ingest import IngestRefusal, Label, Sample
from edgefl.wire.reasons import Reason

RECENT_IDS = 4096
"""How many of the latest sample ids (and labelled ids) are remembered (``duplicate``, ``label_conflict``)."""

LOGGED_REFUSALS = 20
"""Refused samples/labels of one reason logged one by one; then only every 1000th, with the count."""

REFUSALS_MAX = 256
"""Refusals waiting to be published to the apps at most; beyond, the oldest is forgotten."""

DISPUTED = -1
"""The remembered label of a sample that got two different labels (never a valid class)."""


@dataclass(slots=True)
class Queued:
    """A received sample waiting to be classified: ``x`` [*sample_shape] of the raw dtype.

    ``label``: inline, or one that came on ``labels/<device>`` meanwhile; ``arrived_s``:
    ``time.monotonic()`` at receipt (a Prediction's ``latency_s`` counts from here).
    """

    id: str
    x: np.ndarray
    label: int | None
    arrived_s: float


@dataclass(slots=True)
class IngestCounters:
    """Monotonic counters of the live ingest (status fields of the same names)."""

    samples_received: int = 0
    """Samples accepted (decoded, of the model's shape and dtype, not a duplicate)."""
    labels_received: int = 0
    """Labels accepted: inline in a sample, or on ``labels/<device>`` for a queued or pending sample."""
    ingest_dropped: int = 0
    """Queued samples evicted unclassified by a newer one (the queue was full: drop-oldest)."""
    pending_expired: int = 0
    """Classified samples whose label did not come within ``label_expiry_s``."""
    pending_evicted: int = 0
    """Classified samples dropped from a full pending table before their label came."""
    predictions_published: int = 0
    """Predictions handed to the broker (QoS 1: acknowledged)."""
    predictions_failed: int = 0
    """Predictions not published (not connected, no PUBACK in time)."""
    conflicts_stored: int = 0
    """Disputed samples whose first label was already in the store (it stays: no removal)."""


class Ingest:
    """The ingest queue and the pending-label table of one device.

    At most ``queue_max`` (>= 1) samples are queued, the oldest dropped beyond; ``pending_max`` (>= 0)
    classified samples wait ``label_expiry_s`` (> 0, ``clock`` seconds) for a late label, mirrored in
    ``pending_file`` (its samples restored now, their age kept; None: RAM only). ``ValueError`` if a
    bound is out of range.
    """

    def __init__(
        self,
        queue_max: int,
        pending_max: int,
        label_expiry_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        pending_file: PendingFile | None = None,
    ) -> None:
        if queue_max < 1 or pending_max < 0 or not label_expiry_s > 0:
            raise ValueError(
                f"Ingest: queue_max {queue_max} >= 1, pending_max {pending_max} >= 0, "
                f"label_expiry_s {label_expiry_s} > 0"
            )
        self.queue_max = queue_max
        self.pending_max = pending_max
        self.label_expiry_s = label_expiry_s
        self.clock = clock
        self.counters = IngestCounters()
        self._queue: OrderedDict[str, Queued] = OrderedDict()
        self.queued_bytes = 0
        """Bytes of the queued samples' arrays (``x.nbytes``), counted in the transport's byte bound."""
        # id -> (embedding [D], since, predicted class)
        self._pending: OrderedDict[str, tuple[F32, float, int]] = OrderedDict()
        self._labelled: list[tuple[str, F32, int, int]] = []  # id, embedding [D], label, predicted
        # taken for classification, not settled yet: id -> [inline label, label that came meanwhile]
        self._inflight: dict[str, list[int | None]] = {}
        self._recent = IdTable(RECENT_IDS, values=False)
        # labelled lately: id -> (label, since); label DISPUTED once a conflicting one came
        self._answered = IdTable(RECENT_IDS)
        # queued or in-flight samples whose label was disputed: classified, never stored nor parked
        self._disputed: set[str] = set()
        self.pending_file = pending_file
        self.restored = 0
        """Pending samples restored from ``pending_file`` at start."""
        if pending_file is not None:
            now = self.clock()
            for p in pending_file.restored[-pending_max:] if pending_max else []:
                self._pending[p.id] = (p.embedding, now - p.age_s, p.predicted)
            self.restored = len(self._pending)
        #: Refusals of the apps' samples and labels, to publish on ``predictions/<device>`` (bounded).
        self.refusals: deque[IngestRefusal] = deque(maxlen=REFUSALS_MAX)

    def __len__(self) -> int:
        """Samples queued now."""
        return len(self._queue)

    @property
    def pending(self) -> int:
        """Classified samples waiting for a late label now."""
        return len(self._pending)

    def unclassified(self) -> int:
        """Samples received and not classified yet (queued or in flight): what a stop now drops."""
        return len(self._queue) + len(self._inflight)

    def has_work(self) -> bool:
        """Whether samples are queued or matched late labels wait to be stored."""
        return bool(self._queue) or bool(self._labelled)

    # --- in ---------------------------------------------------------------------------------------
    def offer_sample(self, sample: Sample) -> Queued | None:
        """Queue a checked sample; return the oldest if it was evicted (``ingest_dropped``), else None.

        Raises ``UpdateRejected`` ``duplicate`` if this id was received lately (a QoS 1 redelivery).
        """
        if sample.id in self._recent:
            raise UpdateRejected(Reason.DUPLICATE, f"sample {sample.id} already received")
        self._recent.add(sample.id)
        dropped = None
        if len(self._queue) >= self.queue_max:
            _, dropped = self._queue.popitem(last=False)
            self.queued_bytes -= dropped.x.nbytes
            self._disputed.discard(dropped.id)
            self.counters.ingest_dropped += 1
        self._queue[sample.id] = Queued(sample.id, sample.x, sample.label, self.clock())
        self.queued_bytes += sample.x.nbytes
        self.counters.samples_received += 1
        if sample.label is not None:
            self.counters.labels_received += 1
            self._answered.add(sample.id, sample.label, self.clock())
        return dropped

    def _dispute(self, sample_id: str) -> bool:
        """Drop a disputed sample's label wherever it is not stored yet; return whether it was stored."""
        self._answered.set_value(sample_id, DISPUTED)
        queued = self._queue.get(sample_id)
        slot = self._inflight.get(sample_id)
        if queued is not None:
            queued.label = None
            self._disputed.add(sample_id)
            return False
        if slot is not None and slot[0] is None:
            slot[1] = None
            self._disputed.add(sample_id)
            return False
        if slot is None:
            for i, row in enumerate(self._labelled):
                if row[0] == sample_id:
                    del self._labelled[i]
                    return False
        self.counters.conflicts_stored += 1  # its own label, stored as it is classified, or stored since
        return True

    def offer_label(self, label: Label) -> None:
        """Apply a late label (checked against K) to its sample: queued, in flight or pending.

        Raises ``UpdateRejected``: ``duplicate`` (this very label already), ``label_conflict``
        (labelled otherwise within ``label_expiry_s``, or disputed) or ``unknown_sample``.
        """
        self.expire()
        prior = self._answered.get(label.id)
        if prior is not None:
            if prior[0] == label.label:
                raise UpdateRejected(Reason.DUPLICATE, f"sample {label.id} is labelled {label.label} already")
            if prior[0] == DISPUTED:
                raise UpdateRejected(
                    Reason.LABEL_CONFLICT, f"sample {label.id} disputed already (two different labels came)"
                )
            stored = self._dispute(label.id)
            raise UpdateRejected(
                Reason.LABEL_CONFLICT,
                f"sample {label.id} labelled {prior[0]}, now {label.label}: "
                + ("its first label stays in the store" if stored else "neither label is stored"),
            )
        queued = self._queue.get(label.id)
        slot = self._inflight.get(label.id)
        if queued is not None:
            if queued.label is not None:
                raise UpdateRejected(Reason.DUPLICATE, f"sample {label.id} is labelled already")
            queued.label = label.label
        elif slot is not None:
            if slot[0] is not None or slot[1] is not None:
                raise UpdateRejected(Reason.DUPLICATE, f"sample {label.id} is labelled already")
            slot[1] = label.label
        else:
            entry = self._pending.pop(label.id, None)
            self._release(label.id)
            if entry is None:
                raise UpdateRejected(
                    Reason.UNKNOWN_SAMPLE,
                    f"no sample {label.id} waits for a label (never received, dropped, labelled or expired)",
                )
            self._labelled.append((label.id, entry[0], label.label, entry[2]))
        self._answered.add(label.id, label.label, self.clock())
        self.counters.labels_received += 1

    # --- out --------------------------------------------------------------------------------------
    def take(self, n: int) -> list[Queued]:
        """Remove and return the ``n`` oldest queued samples (fewer if fewer are queued), now in flight.

        Each must be settled (:meth:`settle`) once classified, or forgotten (:meth:`forget`).
        """
        out: list[Queued] = []
        while self._queue and len(out) < n:
            row = self._queue.popitem(last=False)[1]
            self.queued_bytes -= row.x.nbytes
            self._inflight[row.id] = [row.label, None]
            out.append(row)
        return out

    def settle(self, sample_id: str, embedding: F32, predicted: int) -> None:
        """Settle a taken sample once classified: its late label handed back, or parked to wait for one.

        ``embedding`` float32 [D]; ``predicted``: the class it was given (scored against its label).
        """
        slot = self._inflight.pop(sample_id, None)
        if slot is None or slot[0] is not None:
            return  # stored with its own label by the caller
        if sample_id in self._disputed:
            self._disputed.discard(sample_id)
            return  # its label was disputed: neither is kept
        if slot[1] is not None:
            self._labelled.append((sample_id, np.array(embedding, dtype=np.float32), slot[1], int(predicted)))
            return
        self._park(sample_id, embedding, predicted)

    def forget(self, rows: list[Queued]) -> None:
        """Taken samples whose classification failed: no longer in flight (a label for them is unknown)."""
        for row in rows:
            self._inflight.pop(row.id, None)
            self._disputed.discard(row.id)

    def _park(self, sample_id: str, embedding: F32, predicted: int) -> None:
        if self.pending_max == 0:
            return
        self._pending.pop(sample_id, None)  # a restored sample sent again after the restart: this one waits
        if len(self._pending) >= self.pending_max:
            self._release(self._pending.popitem(last=False)[0])
            self.counters.pending_evicted += 1
        self._pending[sample_id] = (np.array(embedding, dtype=np.float32), self.clock(), int(predicted))
        if self.pending_file is not None:
            self.pending_file.park(sample_id, self._pending[sample_id][0], int(predicted))

    def _release(self, sample_id: str) -> None:
        if self.pending_file is not None:
            self.pending_file.release(sample_id)

    def take_labelled(self) -> tuple[F32, I64, I64] | None:
        """Late-labelled samples matched since the last call, or None.

        ``(embeddings float32 [M, D], labels int64 [M], predicted int64 [M])``, ``predicted`` the
        class each was given when classified.
        """
        if not self._labelled:
            return None
        emb = np.stack([e for _, e, _, _ in self._labelled]).astype(np.float32, copy=False)
        labels = np.array([lbl for _, _, lbl, _ in self._labelled], dtype=np.int64)
        predicted = np.array([p for _, _, _, p in self._labelled], dtype=np.int64)
        self._labelled = []
        return emb, labels, predicted

    def expire(self) -> int:
        """Drop pending samples older than ``label_expiry_s``; return how many (``pending_expired``)."""
        limit = self.clock() - self.label_expiry_s
        n = 0
        while self._pending:
            since = next(iter(self._pending.values()))[1]
            if since > limit:
                break
            self._release(self._pending.popitem(last=False)[0])
            n += 1
        self.counters.pending_expired += n
        self._answered.forget_until(limit)
        return n
