"""The coordinator's intake: each message a fleet sends, checked, counted and kept before it is acknowledged.

Statuses go to the device registry; updates and declines into the open round (or held for the next
one). With a state file, :meth:`Intake.pump` acknowledges a message only once the state file holds
what it changed. :class:`~edgefl.coordinator.service.Coordinator` builds the round loop on top of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import operator
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Required, TypedDict, Unpack

import cbor2
import numpy as np

from edgefl.aio import wait_event
from edgefl.coordinator.history import CoordinatorState, RoundRecord
from edgefl.coordinator.registry import LOGGED_REFUSALS, DeviceRegistry, sampled_log, shorten
from edgefl.coordinator.rounds import Round, RoundPhase
from edgefl.coordinator.strategy import Offer, Strategy, array_from
from edgefl.errors import DecodeError, UpdateRejected
from edgefl.head import validate_head
from edgefl.idtable import IdTable
from edgefl.mqtt_link import Message
from edgefl.records import read_record, write_record
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.types import F32
from edgefl.validators import check_device_id
from edgefl.wire.cbor import Limits, MessageType, Scanned, scan
from edgefl.wire.chunking import Reassembler, is_chunk
from edgefl.wire.global_model import GlobalModel, decode_global_model
from edgefl.wire.reasons import Reason
from edgefl.wire.rounds import RoundAnnouncement, Update, decode_decline, decode_round, decode_update
from edgefl.wire.signing import SigningKey, VerifyKey, verify_payload

logger = logging.getLogger(__name__)

HELD_UPDATES = 64
"""Updates held while a buffered step is published, offered to the next step (more are refused)."""

SEEN_UPDATE_IDS = 4096
"""Accepted update and decline ids remembered across rounds, in a fixed 32 KiB ring of 64-bit hashes."""

EARLY_UPDATES_MAX = 4096
"""Updates held for the next round before it opens, one per device (see ``Intake._early``)."""

CHUNK_SETS = 256
"""Chunked messages in progress at once (one per sending device; the reassembler's bytes bound them too)."""

_RECORD_ROW = operator.attrgetter(*(f.name for f in dataclasses.fields(RoundRecord)))
"""A :class:`RoundRecord`'s state-file row: a tuple of its fields' own objects in order (no copies)."""

PERSIST_EVERY = 32
"""With a state file, the open round is written at least every this many messages (:meth:`Intake.pump`)."""

DECLINE_SUFFIX = ":declined"
"""What a Decline's ``update_id`` adds to the update id of the round it refuses."""


def check_update_id(update_id: str, device: str, round_no: int, base_version: int, suffix: str = "") -> None:
    """Check that an update's (or decline's) id is ``f"{device}:{round}:{base_version}{suffix}"``.

    ``device`` is the topic's (``docs/protocol.md``, "Update ids"). Raises ``UpdateRejected``
    (``bad_value``) for any other id.
    """
    expected = f"{device}:{round_no}:{base_version}{suffix}"
    if update_id != expected:
        why = f"update id {shorten(update_id, 60)!r} on update/{device}: must be {expected!r}"
        raise UpdateRejected("bad_value", why)


class IntakeOptions(TypedDict, total=False):
    """The keyword arguments of :class:`Intake` (and of the coordinators built on it)."""

    model_sha256: Required[str]
    strategy: Required[Strategy]
    evaluate: Callable[[F32, F32], float] | None
    limits: Limits | None
    signing_key: SigningKey | None
    device_keys: Mapping[str, VerifyKey] | None
    max_packet_bytes: int
    max_devices: int
    device_expiry_s: float


class Intake:
    """Takes in a fleet's messages (statuses, updates, declines, retained round and head) and keeps them.

    ``transport`` started by the caller; ``W`` float32 [D, K], ``b`` float32 [K]: the initial global
    head (version 0); ``model_sha256``: of the backbone .tflite it belongs to. ``evaluate(W, b)``: test
    accuracy 0..1 of a head, or None; ``limits``: decoding bounds (default ``Limits()``);
    ``signing_key``: a retained round or head is adopted only with its signature; ``device_keys``: when
    set, every update must be signed by its device's key; ``max_packet_bytes``: the broker's (chunks of
    a larger update are reassembled; 256 KiB); ``max_devices``, ``device_expiry_s``: the registry's
    bounds (10,000 devices, 7 days).
    """

    def __init__(
        self, transport: MqttTransport, topics: Topics, W: F32, b: F32, **opts: Unpack[IntakeOptions]
    ) -> None:
        self.transport = transport
        self.topics = topics
        self.W = W.astype(np.float32)
        self.b = b.astype(np.float32)
        self.model_sha256 = model_sha256 = opts["model_sha256"]
        self.strategy = strategy = opts["strategy"]
        self.evaluate = opts.get("evaluate")
        self.limits = opts.get("limits") or Limits()
        self.signing_key = opts.get("signing_key")
        device_keys = opts.get("device_keys")
        self.device_keys = dict(device_keys) if device_keys is not None else None
        self.max_packet_bytes = max_packet_bytes = opts.get("max_packet_bytes", 256 * 1024)
        self.reassembler = Reassembler(  # devices send at once: a set for each (its topic is its key)
            max_sets=CHUNK_SETS,
            max_message_bytes=self.limits.max_message_bytes,
            max_chunk_bytes=max_packet_bytes,
            max_total_bytes=2 * self.limits.max_message_bytes,
        )
        self.state_path: Path | None = None  # set to persist state before each new global head
        self.counted: dict[int, list[str]] = {}  # round → update_ids aggregated (audit, chaos test)
        # updates for the next round before it opens (after a restart, devices answer the retained
        # announcement of a round whose close was not saved); one per device, bounded, offered at its opening
        self._early: dict[str, tuple[Update, int]] = {}
        self.state = CoordinatorState()
        self.registry = DeviceRegistry(
            model_sha256=model_sha256,
            head_shape=self.shape,
            clipped=strategy.clipped,
            limits=self.limits,
            max_devices=opts.get("max_devices", 10_000),
            expiry_s=opts.get("device_expiry_s", 7 * 24 * 3600.0),
        )
        self._round_changed = asyncio.Event()
        self.on_change: Callable[[], None] | None = None
        self._seen_update_ids = IdTable(SEEN_UPDATE_IDS, values=False)  # fixed memory
        self._held: list[tuple[Update, int]] = []  # arrived while a buffered step was being published
        self._adopting = False
        self._adopt_round_seen = asyncio.Event()
        self._adopt_head_seen = asyncio.Event()
        self._adopted_round = 0
        self._adopted_head: GlobalModel | None = None
        self._head_chunks = Reassembler()  # a retained global head's chunks
        self.on_lease_message: Callable[[Message], None] | None = None  # the lease topic's messages
        self._dirty = False  # the open round changed since the state file was written (see pump)
        self._settled = 0  # the last round whose result is in the state file
        self._resume: dict[str, Any] | None = None  # the open round of the state file, until re-opened
        # update id -> (topic, payload) held in _early or _held: acknowledged, so in the state file
        self._unfolded: dict[str, tuple[str, bytes]] = {}
        self._history_doc: tuple[list[RoundRecord], list[tuple[Any, ...]]] = ([], [])  # records, their rows
        self._round_lr = math.nan  # the client learning rate the open round announced
        self.state_loaded = False  # load_state found a state file

    @property
    def shape(self) -> tuple[int, int]:
        """Head shape (D, K)."""
        return (int(self.W.shape[0]), int(self.W.shape[1]))

    async def pump(self) -> None:
        """Consume incoming messages forever (each handler is guarded), committing what they changed.

        With a state file, a message that changed the round is acknowledged (``MqttTransport.commit``)
        once the file holds it (written when the queue is drained or every ``PERSIST_EVERY`` messages).
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
        """:meth:`handle`, with any fault it lets through counted as ``failed`` (the pump never stops)."""
        try:
            self.handle(msg)
        except Exception as exc:
            why = f"failed: handling raised {type(exc).__name__}: {shorten(str(exc))}"
            self.refuse_message(msg, "failed", why, level=logging.ERROR)

    def handle(self, msg: Message) -> None:
        """Dispatch one message; a bad one is logged with topic, size and reason and counted, never raised."""
        if msg.topic == self.topics.coordinator:
            if self.on_lease_message is not None:
                try:
                    self.on_lease_message(msg)
                except DecodeError as exc:  # a forged, replayed or unreadable presence: never obeyed
                    self.refuse_message(msg, exc.reason, str(exc))
            return
        if msg.topic == self.topics.coordinator_holder:
            return  # read by a lease probe; one left unacknowledged in our session comes back here
        device = self.topics.device_of(msg.topic)
        try:
            if device is None and self._is_own_topic(msg.topic):
                self._adopt(msg)
                return
            if device is None:
                raise DecodeError("bad_topic", f"unexpected topic {msg.topic[:200]}")
            try:
                check_device_id(device)
            except ValueError as exc:
                device = None  # never a key of the per-device counters
                raise DecodeError("bad_topic", f"device id on the topic {exc}") from None
            if msg.topic == self.topics.status(device):
                if not msg.payload:
                    self.registry.forget(device, keep_silence=True)  # retained status cleared
                    return
                self.registry.note_status(device, msg.payload)
                self.notify()
            else:
                self._handle_update(device, msg)
        except (DecodeError, UpdateRejected) as exc:
            self.refuse_message(msg, exc.reason, str(exc), device)
        except Exception as exc:  # a fault in handling: counted as ``failed``, the pump never stops
            why = f"failed: handling raised {type(exc).__name__}: {exc}"
            self.refuse_message(msg, "failed", why, device)

    def refuse_message(
        self, msg: Message, reason: str, why: str, device: str | None = None, level: int = logging.WARNING
    ) -> None:
        """Count a refused message by ``reason`` (and ``device``), and log it as :func:`sampled_log` says."""
        self.state.rejected[reason] += 1
        if device is not None:
            self.registry.count_by_device(self.registry.rejected_by_device, device, reason)
        more = sampled_log(self.state.rejected[reason], reason)
        if more is not None:
            logger.log(
                level, "rejected message on %s (%d bytes): %s%s", msg.topic[:200], len(msg.payload), why, more
            )

    def _reassembled(self, msg: Message) -> bytes | None:
        """The message's payload, or a chunked one's whole payload at its last chunk (None before)."""
        if not is_chunk(msg.payload):
            return msg.payload
        return self.reassembler.feed(msg.topic, msg.payload)

    def _read_round(self, payload: bytes, key: VerifyKey | None) -> RoundAnnouncement:
        """A retained RoundAnnouncement, verified by ``key`` when set (raises ``DecodeError``)."""
        if key is not None:
            verify_payload(payload, key, fleet=self.topics.fleet, kind=MessageType.ROUND)
        return decode_round(payload, limits=self.limits)

    def _read_head(self, payload: bytes, key: VerifyKey | None) -> GlobalModel | None:
        """A retained GlobalModel or its chunk (None until the last), verified by ``key`` when set."""
        if is_chunk(payload):
            whole = self._head_chunks.feed(self.topics.global_model, payload)
            if whole is None:
                return None
            payload = whole
        if key is not None:
            kind = MessageType.GLOBAL_MODEL
            verify_payload(payload, key, fleet=self.topics.fleet, kind=kind, limits=self.limits)
        return decode_global_model(payload, limits=self.limits, expect_shape=self.shape)

    def _signed(
        self,
        payload: bytes,
        keys: Mapping[str, VerifyKey] | None,
        sender: str,
        what: str,
        kind: MessageType,
    ) -> Scanned:
        """``payload`` scanned once, verified as a ``kind`` (an update's Decline as one) when ``keys`` is set.

        Raises DecodeError (``unknown_device`` without a key for ``sender``, or as ``verify_payload``).
        """
        key = None
        if keys is not None:
            key = keys.get(sender)
            if key is None:
                raise DecodeError("unknown_device", f"no public key for {what} {sender}")
        scanned = scan(payload, self.limits)  # once: the signature check and the decoder take it
        if key is not None:
            if kind is MessageType.UPDATE and scanned.header.get("type") == MessageType.DECLINE:
                kind = MessageType.DECLINE
            fleet = self.topics.fleet
            verify_payload(scanned, key, fleet=fleet, kind=kind, device=sender, limits=self.limits)
        return scanned

    def _handle_update(self, device: str, msg: Message) -> None:
        payload = self._reassembled(msg)
        if payload is None:
            return
        scanned = self._signed(payload, self.device_keys, device, "device", MessageType.UPDATE)
        if scanned.header.get("type") == MessageType.DECLINE:
            self._handle_decline(device, scanned)
            return
        if device in self.registry.mismatched:
            raise UpdateRejected("wrong_model", f"device {device}: {self.registry.mismatched[device]}")
        update = decode_update(scanned, limits=self.limits, expect_shape=self.shape)
        if update.device != device:
            raise UpdateRejected("wrong_device", f"update names device {update.device} on {msg.topic}")
        check_update_id(update.update_id, device, update.round, update.base_version)
        if update.round >= self.state.round - 1:
            # its own update for this round or the last, even one too late to count: rounds wait for it
            self.registry.heard(device)
        rnd = self.state.current
        if rnd is None or (rnd.check_round and rnd.phase is not RoundPhase.OPEN):
            if update.round == self.state.round + 1 and len(self._early) < EARLY_UPDATES_MAX:
                held = self._early.get(device)
                if held is not None and held[0].update_id != update.update_id:
                    # a device answers a round once: others (each base version is another id) would
                    # let one device fill the coordinator's memory and state file
                    why = f"{device} already has update {held[0].update_id} held for round {update.round}"
                    raise UpdateRejected("duplicate", why)
                self._early[device] = (update, len(payload))
                self._unfolded[update.update_id] = (msg.topic, payload)
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
            self._unfolded[update.update_id] = (msg.topic, payload)
            self._dirty = True
            logger.info("update %s held for the next buffered step", update.update_id)
            self.notify()
            return
        self._accept(rnd, update, len(payload))

    def _handle_decline(self, device: str, payload: bytes | Scanned) -> None:
        """Count and log a device's Decline of the open round (refused as an update would be)."""
        decline = decode_decline(payload, limits=self.limits)
        if decline.device != device:
            raise UpdateRejected("wrong_device", f"decline names device {decline.device} on update/{device}")
        check_update_id(decline.update_id, device, decline.round, decline.base_version, DECLINE_SUFFIX)
        rnd = self.state.current
        if rnd is None:
            raise UpdateRejected("no_round", "no round is open")
        rnd.check_open("decline", device, decline.round, decline.base_version)
        if rnd.has_answered(device) or decline.update_id in self._seen_update_ids:
            raise UpdateRejected("duplicate", f"{device} already answered round {rnd.number}")
        self._seen_update_ids.add(decline.update_id)
        self.state.declined[decline.reason] += 1
        self.registry.count_by_device(self.registry.declined_by_device, device, decline.reason)
        rnd.declined.append(device)
        self.registry.heard(device)  # it answered: later rounds wait for it again
        if decline.reason == Reason.NO_SAMPLES:
            rnd.empty.append(device)  # nothing to train on: not among the devices the round asked
        self._dirty = True
        more = sampled_log(self.state.declined[decline.reason], decline.reason)
        if more is not None:
            detail = shorten(decline.detail)
            logger.warning(
                "round %d: %s declined: %s (%s)%s", decline.round, device, decline.reason, detail, more
            )
        self._round_changed.set()
        self.notify()

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
        self._seen_update_ids.add(update.update_id)
        self._dirty = True
        # the update carries the device's round, size and evaluation of the base head (read at the
        # round's close): the registry takes them from it
        self.registry.trained(update.device, update.round)
        entry = self.registry.devices.get(update.device)
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
        if rnd.clients <= LOGGED_REFUSALS or rnd.clients % 1000 == 0:  # a burst is not a burst of lines
            logger.info(
                "round %d: update from %s (%d examples, %d bytes, staleness %d)%s",
                rnd.number,
                update.device,
                update.num_examples,
                size_bytes,
                staleness,
                f" ({rnd.clients} counted; every 1000th logged)" if rnd.clients > LOGGED_REFUSALS else "",
            )
        self._round_changed.set()
        self.notify()

    async def _collect(self, rnd: Round, failed: Callable[[], bool] = lambda: False) -> bool:
        """Wait until ``rnd`` is complete or ``failed()`` (True), or its deadline passed (False)."""
        while not rnd.complete() and not failed():
            remaining = rnd.deadline_at - time.monotonic()
            if remaining <= 0:
                return False
            self._round_changed.clear()
            await wait_event(self._round_changed, remaining)
        return True

    def _accept_early(self, rnd: Round) -> None:
        """Offer ``rnd`` the updates that came for it before it opened (the others are dropped)."""
        early, self._early = self._early, {}
        for update, size_bytes in early.values():
            if update.round == rnd.number:
                self._accept_held(rnd, update, size_bytes)
            self._unfolded.pop(update.update_id, None)

    def _accept_held(self, rnd: Round, update: Update, size_bytes: int) -> None:
        """Offer ``rnd`` an update held for it; a refusal is counted and logged, never raised."""
        try:
            self._accept(rnd, update, size_bytes)
        except UpdateRejected as exc:
            self.state.rejected[exc.reason] += 1
            logger.warning("round %d: held update %s refused: %s", rnd.number, update.update_id, exc)
        self._unfolded.pop(update.update_id, None)

    def _is_own_topic(self, topic: str) -> bool:
        base = self.topics.global_model
        return topic in (self.topics.round, base) or topic.startswith(base + "/")

    def _adopt(self, msg: Message) -> None:
        """Note a retained ``round`` or ``global`` message while adopting (see ``Coordinator.start``)."""
        if not self._adopting or not msg.payload:
            return  # our own retained publishes echoed back, or a cleared chunk
        key = self.signing_key.verify_key if self.signing_key is not None else None
        if msg.topic == self.topics.round:
            ann = self._read_round(msg.payload, key)
            self._adopted_round = max(self._adopted_round, ann.round)
            self._adopt_round_seen.set()
            return
        head = self._read_head(msg.payload, key)
        if head is None:
            return
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

    def notify(self) -> None:
        """Tell the page that something changed (``on_change``)."""
        if self.on_change is not None:
            self.on_change()

    @property
    def resuming(self) -> bool:
        """True while the state file's open round waits to be re-opened (it opens without pacing)."""
        return self._resume is not None

    def _flush(self) -> bool:
        """Write what the messages handled since the last write changed; False when the write failed."""
        try:
            self._persist()
        except OSError as exc:
            logger.error("state not written (%s): updates stay unacknowledged until it is", exc)
            return False
        self._dirty = False
        return True

    def _persist(self) -> None:
        if self.state_path is not None:
            self.save_state(self.state_path)

    def save_state(self, path: Path) -> None:
        """Persist the global head, version, round, recent history and the open round (atomic, checksummed).

        A coordinator restarted with this file re-opens the round that was open, with every update it
        had accepted and the updates held for later.
        """
        closed = self.state.current is None or self.state.current.number <= self._settled
        doc = {
            "v": 1,
            "round": self.state.round if closed else self.state.round - 1,
            "version": self.state.version,
            "W": self.W.tobytes(),
            "b": self.b.tobytes(),
            "shape": list(self.shape),
            "history": self._history_rows(),
            "counted": {str(k): sorted(v) for k, v in self.counted.items()},
            "strategy": self.strategy.durable_state(),  # norm history, server optimiser, DP ledger
            "open": self._open_round_doc(),
            "unfolded": [[topic, payload] for topic, payload in self._unfolded.values()],
        }
        write_record(path, cbor2.dumps(doc))

    def _history_rows(self) -> list[tuple[Any, ...]]:
        """The history's state-file rows, cached: a row is built once, as the history grows at its end."""
        history = self.state.history
        records, rows = self._history_doc
        if len(records) == len(history) and all(a is b for a, b in zip(records, history, strict=True)):
            return rows
        start = next((k for k, h in enumerate(records) if history and h is history[0]), len(records))
        kept = len(records) - start
        if kept > len(history) or any(a is not b for a, b in zip(records[start:], history, strict=False)):
            start, kept = len(records), 0  # not a trim and append of the cached history: all again
        rows = rows[start:] + [_RECORD_ROW(h) for h in history[kept:]]
        self._history_doc = (list(history), rows)
        return rows

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
            "empty": list(rnd.empty),
            "sites": list(rnd.sites),
            "update_bytes": list(rnd.update_bytes),
            "lr": self._round_lr,
            "snapshot": self.strategy.snapshot() if self.strategy.accepted else None,
        }

    def load_state(self, path: Path) -> bool:
        """Resume from a state file written by :meth:`save_state` (False when there is none).

        Raises UpdateRejected (``bad_state``) when the file holds a head of another shape, or one the
        agents would refuse (non-finite, or a value beyond ``MAX_HEAD_ABS``).
        """
        data = read_record(path)
        if data is None:
            return False
        doc = cbor2.loads(data)
        if tuple(doc["shape"]) != self.shape:
            raise UpdateRejected(
                "bad_state", f"{path}: head shape {doc['shape']}, model has {list(self.shape)}"
            )
        W, b = array_from(doc["W"], np.float32, self.shape), array_from(doc["b"], np.float32, -1)
        try:
            validate_head(W, b, self.shape)
        except UpdateRejected as exc:
            raise UpdateRejected("bad_state", f"{path}: the saved head would be refused ({exc})") from exc
        self.W, self.b = W, b
        self.state.round = int(doc["round"])
        self.state.version = int(doc["version"])
        self.state.history = [RoundRecord(*h) for h in doc["history"]]
        self.counted = {int(k): list(v) for k, v in doc["counted"].items()}
        try:
            self.strategy.restore_durable(doc["strategy"])
        except (ValueError, KeyError, TypeError) as exc:
            why = f"{path}: the strategy's saved state does not fit ({exc})"
            raise UpdateRejected("bad_state", why) from exc
        self._settled = self.state.round
        self.state_loaded = True
        for r in sorted(self.counted):  # an update counted before the restart is refused as a duplicate
            for update_id in self.counted[r]:
                self._seen_update_ids.add(update_id)
                self.registry.trained(update_id.split(":", 1)[0], r)
        self._resume = doc["open"]
        self._unfolded = {}
        for topic, payload in doc["unfolded"]:
            self.handle(Message(str(topic), bytes(payload), False))  # held again for their round
        self._record_unrecorded_round()
        logger.info("resumed at round %d, version %d from %s", self.state.round, self.state.version, path)
        return True

    def _resume_round(self, rnd: Round, doc: Mapping[str, Any]) -> None:
        """Put back the open round of the state file into ``rnd`` (just configured): its updates count."""
        rnd.opened_at = time.monotonic() - max(0.0, time.time() - float(doc["opened_unix"]))
        rnd.update_ids = set(doc["update_ids"])
        rnd.devices = list(doc["devices"])
        rnd.declined = list(doc["declined"])
        rnd.empty = list(doc["empty"])
        rnd.sites = list(doc["sites"])
        rnd.update_bytes = [int(n) for n in doc["update_bytes"]]
        if doc["snapshot"] is not None:
            self.strategy.restore(doc["snapshot"])
        for update_id in rnd.update_ids:
            self._seen_update_ids.add(update_id)
        left = rnd.deadline_at - time.monotonic()
        logger.warning(
            "round %d resumed from the state file: %d updates, %d declines, %.0f s left",
            rnd.number,
            rnd.clients,
            len(rnd.declined),
            max(0.0, left),
        )

    def _record_unrecorded_round(self) -> None:
        """Rebuild the record of a round saved after aggregation but not recorded (sizes read 0)."""
        r = self.state.round
        if r not in self.counted or any(h.round == r for h in self.state.history):
            return
        accuracy = float("nan")
        if self.evaluate is not None:
            accuracy = float(self.evaluate(self.W, self.b))
        self.state.history.append(RoundRecord(r, len(self.counted[r]), accuracy, 0.0, 0.0))
        logger.warning("round %d was aggregated but not recorded before a restart: record rebuilt", r)
