"""Site and root aggregators: one coordinator per site's broker, one root, joined by broker bridges.

A site sends its strategy's accumulator up as one signed Partial a round; the root folds verified,
de-duplicated partials. Both, and what survives which fault: ``docs/operations.md``, "Many sites".

Source: Bonawitz et al. 2019, "Towards Federated Learning at Scale: System Design", §4 (aggregators
and a master aggregator); the sums are McMahan et al. 2017, Algorithm 1, split by site.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cbor2
import numpy as np

from edgefl.coordinator.registry import sampled_log, shorten
from edgefl.coordinator.rounds import Round, RoundPhase
from edgefl.coordinator.service import ADOPT_WAIT_S, Coordinator
from edgefl.coordinator.strategy import SiteSums
from edgefl.errors import DecodeError, UpdateRejected
from edgefl.idtable import IdTable
from edgefl.mqtt_link import Message
from edgefl.records import read_record, write_record
from edgefl.wire.cbor import MessageType
from edgefl.wire.chunking import split_message
from edgefl.wire.partial import MAX_PARTIAL_UPDATES, Partial, decode_partial, encode_partial
from edgefl.wire.rounds import RoundAnnouncement
from edgefl.wire.signing import VerifyKey

logger = logging.getLogger(__name__)


ROOT_SEEN_UPDATE_IDS = 100_000
"""Update ids a root remembers across rounds with the site that first listed each (~10 MB of strings)."""

SEEN_PARTIALS = 10_000
"""(site, round, partial id) keys a root remembers to refuse a bridge's redelivery."""


class RootCoordinator(Coordinator):
    """The root of a hierarchy: a :class:`Coordinator` whose rounds take sites' partials.

    ``site_keys``: when set, every partial must be signed by its site's key; ``expected_sites``
    partials close a round early (0: ``min_clients`` updates do); ``site_devices``: most updates one
    partial may cover (0: ``MAX_PARTIAL_UPDATES``); the rest as :class:`Coordinator`. Without
    ``device_keys`` a root refuses device updates (``unsigned``).
    """

    def __init__(
        self,
        *args: Any,
        site_keys: Mapping[str, VerifyKey] | None = None,
        expected_sites: int = 0,
        site_devices: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.site_keys = dict(site_keys) if site_keys is not None else None
        self.expected_sites = expected_sites
        self.site_devices = site_devices or MAX_PARTIAL_UPDATES
        self.strategy.bound_site_weights()
        self._seen_update_ids = IdTable(ROOT_SEEN_UPDATE_IDS, values=False)
        self._seen_partials: dict[tuple[str, int, str], None] = {}
        self.partials_received = 0
        self.partial_bytes = 0
        self.duplicates = 0  # partials refused as duplicates (bridge redeliveries, a site's ids again)
        self._id_site: dict[str, str] = {}  # update id → the site that listed it first (bounded)
        self.overlapping_ids: Counter[str] = Counter()  # "<site>/<first site>" → ids listed by both
        self.overlaps = 0  # partials that listed ids another site listed first

    def _data_topics(self) -> list[str]:
        """``partial/+`` and the devices' statuses; ``update/+`` only with device keys to verify them."""
        topics = [self.topics.partial("+"), *super()._data_topics()]
        if self.device_keys is None:
            topics.remove(self.topics.update("+"))
        return topics

    def _dropped_topics(self) -> list[str]:
        """``update/+`` without device keys (a resumed session of an earlier run may hold it)."""
        return [self.topics.update("+")] if self.device_keys is None else []

    def _handle_update(self, device: str, msg: Message) -> None:
        """A device update at the root: verified with device keys, else refused (``unsigned``)."""
        if self.device_keys is None:
            why = "a root takes device updates only with security.device_keys_dir"
            raise DecodeError("unsigned", f"device update from {device}: {why}")
        super()._handle_update(device, msg)

    def handle(self, msg: Message) -> None:
        """Dispatch one message: partials here, anything else as a flat coordinator (never raises)."""
        site = self.topics.site_of(msg.topic)
        if site is None:
            super().handle(msg)
            return
        try:
            self._handle_partial(site, msg)
        except (DecodeError, UpdateRejected) as exc:
            if exc.reason == "duplicate":
                self.duplicates += 1
            self.refuse_message(msg, exc.reason, str(exc))

    def _handle_partial(self, site: str, msg: Message) -> None:
        self.partials_received += 1
        self.partial_bytes += len(msg.payload)
        payload = self._reassembled(msg)
        if payload is None:
            return
        scanned = self._signed(payload, self.site_keys, site, "site", MessageType.PARTIAL)
        p = decode_partial(scanned, limits=self.limits, expect_shape=self.shape)
        if p.site != site:
            raise UpdateRejected("wrong_device", f"partial names site {p.site} on {msg.topic}")
        seen = (site, p.round, p.partial_id)
        if seen in self._seen_partials:
            raise UpdateRejected("duplicate", f"partial {p.partial_id} of {site} already counted")
        rnd = self.state.current
        if rnd is None:
            raise UpdateRejected("no_round", "no round is open")
        rnd.admit_partial(site, p.round, p.base_version)
        if p.count > self.site_devices:
            why = f"partial of {site} covers {p.count} updates, a site may have {self.site_devices} devices"
            raise UpdateRejected("bad_value", why)
        tail = f":{p.round}:{p.base_version}"
        bad = next((u for u in p.update_ids if u.count(":") != 2 or not u.endswith(tail) or u == tail), None)
        if bad is not None:
            why = f"partial of {site} lists update id {shorten(bad, 60)!r}: ids are <device>{tail}"
            raise UpdateRejected("bad_value", why)
        owners = [self._id_site.get(u) for u in p.update_ids]
        again = sum(1 for o in owners if o == site)
        if again:
            raise UpdateRejected("duplicate", f"partial of {site} repeats {again} update ids counted before")
        others = Counter(o for o in owners if o is not None)
        if p.count > 0:  # an empty partial only says the site is done
            self.strategy.offer_sums(SiteSums(p.combine, p.W, p.b, p.weight, p.count, p.clipped))
        rnd.record_partial(site, p.update_ids, len(payload))
        self._dirty = True  # acknowledged once the state file holds it (``Coordinator.pump``)
        self._seen_partials[seen] = None
        while len(self._seen_partials) > SEEN_PARTIALS:
            del self._seen_partials[next(iter(self._seen_partials))]
        for u in p.update_ids:
            self._id_site.setdefault(u, site)
        while len(self._id_site) > ROOT_SEEN_UPDATE_IDS:
            del self._id_site[next(iter(self._id_site))]
        if others:
            # The root cannot know a site's devices: an id two sites list refuses neither partial (the
            # honest one may come second), only logged and counted; site weights are bounded anyway
            self.overlaps += 1
            for first, n in others.items():
                self.overlapping_ids[f"{site}/{first}"] += n
            more = sampled_log(self.overlaps, "overlapping partials")
            if more is not None:
                logger.warning(
                    "round %d: partial of %s lists %d update ids site(s) %s listed first; both counted%s",
                    rnd.number,
                    site,
                    sum(others.values()),
                    ", ".join(sorted(others)),
                    more,
                )
        logger.info("round %d: partial of %s (%d updates, %d bytes)", rnd.number, site, p.count, len(payload))
        self._round_changed.set()
        self.notify()


@dataclass(frozen=True, slots=True)
class SiteRecord:
    """One round at a site (stdout line, ``files.log``).

    ``updates``: covered by the partial (0: an empty partial); ``partial_bytes``: its size;
    ``duration_s``: seconds from the site opening the round to the partial's PUBACK.
    """

    round: int
    updates: int
    partial_bytes: int
    duration_s: float
    update_ids: tuple[str, ...]


class SiteAggregator(Coordinator):
    """A site's aggregator: devices' updates in, one signed Partial a round up (see the module docstring).

    ``site``: its id; ``root_key``: when set, announcements must be signed by the root;
    ``expected_devices`` updates close the partial early (0: the devices online at the opening); it
    closes ``close_margin_s`` before the root's deadline; ``site_state``: the round record written
    after each batch of updates; the rest as :class:`Coordinator` (``signing_key`` signs partials).
    """

    def __init__(
        self,
        *args: Any,
        site: str,
        root_key: VerifyKey | None = None,
        expected_devices: int = 0,
        close_margin_s: float = 2.0,
        site_state: Path | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.site = site
        self.root_key = root_key
        self.expected_devices = expected_devices
        self.close_margin_s = close_margin_s
        self.site_state = site_state
        self.closed_round = 0
        self._latest: RoundAnnouncement | None = None
        self._announced = asyncio.Event()
        self._unsent: bytes | None = None  # a closed round's partial not yet acknowledged by the broker
        self._sent: bytes | None = None  # the last partial sent: sent again when its round is announced again
        self._resend = False
        self.root_done_round = 0  # the newest round whose global head the root published (bridged down)
        self._opened_unix = 0.0

    # -- start, messages -----------------------------------------------------------------------------
    async def start(self, adopt_wait_s: float = ADOPT_WAIT_S) -> None:
        """Resume the site's state, subscribe (updates, statuses, the round) and re-send an unsent partial.

        The caller's :meth:`pump` must be running; ``adopt_wait_s`` is unused. Raises ``UpdateRejected``
        (``bad_state``) when the state file belongs to another site or head shape.
        """
        self._load_site_state()
        # control topics first (see Coordinator.subscribe); the root's heads say when it ends
        for topic in (self.topics.round, self.topics.global_model + "/#", *self._data_topics()):
            await self.subscribe(topic)
        if self._unsent is not None:
            logger.info("site %s: re-sending the partial of round %d", self.site, self.closed_round)
            await self._send(self._unsent)
            self._unsent, self._sent = None, self._unsent
            self._persist_site(None)

    def handle(self, msg: Message) -> None:
        """Dispatch one message: the root's round and head here, updates and statuses as usual."""
        if not self._is_own_topic(msg.topic):
            super().handle(msg)
            return
        if not msg.payload:
            return  # a cleared chunk topic, or the empty `global` of a chunked head
        try:
            if msg.topic != self.topics.round:
                self._on_head(msg)
                return
            ann = self._read_round(msg.payload, self.root_key)
        except (DecodeError, UpdateRejected) as exc:
            self.refuse_message(msg, exc.reason, str(exc))
            return
        if self._latest is None or ann.round > self._latest.round:
            self._latest = ann
            self._announced.set()
        elif ann.round == self.closed_round and self._sent is not None:
            # the round this site closed is announced again: a restarted root re-runs it, having lost
            # what it had folded in; a root that counted the partial refuses it as a duplicate
            self._resend = True
            self._announced.set()

    def _on_head(self, msg: Message) -> None:
        """Note the round of a GlobalModel the root published (whole or reassembled from its chunks)."""
        gm = self._read_head(msg.payload, self.root_key)
        if gm is not None and gm.round > self.root_done_round:
            self.root_done_round = gm.round
            self._announced.set()

    async def next_round(self, last_round: int) -> RoundAnnouncement | None:
        """Wait for an announced round later than the last one this site closed, up to ``last_round``.

        Meanwhile a partial is sent again when its round is announced again. Returns None once this site
        closed ``last_round`` and the root published its head.
        """
        while True:
            ann = self._latest
            if ann is not None and self.closed_round < ann.round <= last_round:
                return ann
            if self.closed_round >= last_round and self.root_done_round >= last_round:
                return None
            if self._resend and self._sent is not None:
                self._resend = False
                logger.info("site %s: round %d announced again: re-sent", self.site, self.closed_round)
                await self._send(self._sent)
                continue
            self._announced.clear()
            await self._announced.wait()

    # -- one round -------------------------------------------------------------------------------------
    async def run_site_round(self, ann: RoundAnnouncement) -> SiteRecord:
        """Collect the root's (verified) round ``ann`` at this site and send its partial (maybe empty)."""
        self.strategy.configure_round(ann.round, self.shape)
        resume = self._resume
        self._resume = None
        if resume is not None and (resume["round"], resume["base_version"]) != (ann.round, ann.base_version):
            resume = None
        self._opened_unix = float(resume["opened_unix"]) if resume is not None else time.time()
        elapsed = time.time() - self._opened_unix
        deadline_s = max(0.0, ann.deadline_s - self.close_margin_s - elapsed)
        selected = frozenset(ann.selected) if isinstance(ann.selected, tuple) else None
        online = [d for d in self.registry.online_devices() if selected is None or d in selected]
        expected = self.expected_devices or len(online) or MAX_PARTIAL_UPDATES
        rnd = Round(ann.round, ann.base_version, self.shape, deadline_s, expected, selected)
        rnd.opened_at = time.monotonic()
        if resume is not None:
            self.strategy.restore(resume["snapshot"])
            rnd.update_ids = set(resume["update_ids"])
            rnd.devices = list(resume["devices"])
            logger.info("site %s: resumed round %d with %d updates", self.site, ann.round, rnd.clients)
        self.state.current = rnd
        self.state.round = ann.round
        self.state.version = ann.base_version
        self._accept_early(rnd)
        self._persist_site(rnd)
        self.notify()
        await self._collect(rnd)
        rnd.close()
        self._dirty = False  # what the pump had not written yet goes into the closed record below
        t_close = time.monotonic()
        if rnd.clients == 0:  # an empty partial: the root need not wait for this site's deadline
            logger.warning("site %s: round %d closed without updates", self.site, ann.round)
            zeros = np.zeros(self.shape, np.float64), np.zeros(self.shape[1], np.float64)
            sums = SiteSums(self.strategy.combine, zeros[0], zeros[1], 0.0, 0, 0)
        else:
            sums = self.strategy.site_sums()
        ids = tuple(sorted(rnd.update_ids))
        partial = Partial(
            round=ann.round,
            base_version=ann.base_version,
            site=self.site,
            partial_id=f"{self.site}:{ann.round}",
            combine=sums.combine,
            count=len(ids),
            weight=sums.weight,
            clipped=sums.clipped,
            update_ids=ids,
            W=sums.W,
            b=sums.b,
        )
        payload = self._sign(encode_partial, partial)
        self.closed_round = ann.round
        self._unsent = payload
        self._persist_site(None)  # closed, partial kept: a crash before the PUBACK re-sends the same bytes
        self.transport.commit()  # the updates the pump had taken are in the partial now
        await self._send(payload)
        self._unsent, self._sent = None, payload
        self._persist_site(None)
        self.counted[ann.round] = list(ids)
        logger.info(
            "site %s: round %d partial of %d updates sent (%d bytes, %.2f s after closing)",
            self.site,
            ann.round,
            len(ids),
            len(payload),
            time.monotonic() - t_close,
        )
        return SiteRecord(ann.round, len(ids), len(payload), time.time() - self._opened_unix, ids)

    def _flush(self) -> bool:
        """Write the open round's record (the site's own file; see ``Coordinator.pump``)."""
        self._dirty = False
        rnd = self.state.current
        if rnd is not None and rnd.phase is RoundPhase.OPEN:  # a closed round is written by its close
            self._persist_site(rnd)
        return True

    async def _send(self, payload: bytes) -> None:
        """Publish a partial (QoS 1, not retained), waiting out a broker outage for ``PUBLISH_RETRY_S``."""
        topic = self.topics.partial(self.site)
        # larger than the packet limit (a big head, many update ids): chunks on the same topic
        limit = min(self.max_packet_bytes, self.transport.packet_limit())
        parts = split_message(payload, topic, limit, msg_id=f"partial-{self.site}-{self.closed_round}")
        for part in parts:
            await self._publish(topic, part, retain=False)

    # -- the site's record ----------------------------------------------------------------------------
    def _persist_site(self, rnd: Round | None) -> None:
        if self.site_state is None:
            return
        open_round = None
        if rnd is not None:
            open_round = {
                "round": rnd.number,
                "base_version": rnd.base_version,
                "opened_unix": self._opened_unix,
                "update_ids": sorted(rnd.update_ids),
                "devices": list(rnd.devices),
                "snapshot": self.strategy.snapshot(),
            }
        doc = {
            "v": 1,
            "site": self.site,
            "shape": list(self.shape),
            "closed_round": self.closed_round,
            "unsent": self._unsent,
            "sent": self._sent,
            "open": open_round,
        }
        write_record(self.site_state, cbor2.dumps(doc))

    def _load_site_state(self) -> None:
        if self.site_state is None:
            return
        data = read_record(self.site_state)
        if data is None:
            return
        doc = cbor2.loads(data)
        if doc.get("site") != self.site or tuple(doc.get("shape", ())) != self.shape:
            raise UpdateRejected(
                "bad_state", f"{self.site_state}: state of site {doc.get('site')!r}, shape {doc.get('shape')}"
            )
        self.closed_round = int(doc["closed_round"])
        self._unsent = doc.get("unsent")
        self._sent = doc.get("sent")
        self._resume = doc.get("open")
        logger.info(
            "site %s: resumed after round %d%s",
            self.site,
            self.closed_round,
            f", round {self._resume['round']} open" if self._resume else "",
        )
