"""The fleet's device registry: the latest status of each device, bounded, with its refusals and model."""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from edgefl.aio import wait_event
from edgefl.errors import DecodeError, UpdateRejected
from edgefl.wire.cbor import Limits
from edgefl.wire.status import decode_status, read_new_samples

logger = logging.getLogger(__name__)

LOGGED_REFUSALS = 20
"""Refusals of one reason logged one by one before the log only names every 1000th."""
LOGGED_DETAIL_CHARS = 80
"""A device's free-text ``detail`` is cut to this many characters in the coordinator's log."""
#: Devices outside the registry whose refusals and declines are counted one by one (the last ones).
STRANGERS_KEPT = 100
#: Devices the page's status document lists (``devices``; ``devices_total`` counts the registry).
PAGE_DEVICES = 100
#: Reasons of a per-device counter map in the page's document (the largest counts).
PAGE_REASONS = 8
#: Rows of devices' own refusals in the page's "rejected" box (the largest counts).
PAGE_REFUSALS = 20
#: Reasons of a device's own ``rejected`` map kept with its status (the largest counts; an agent has ~50).
REASONS_KEPT = 64
#: Distinct short strings of statuses shared at once (:func:`_interned`); the table starts over when full.
STRINGS_KEPT = 4096
_strings: dict[str, str] = {}


def shorten(text: str, limit: int = LOGGED_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters (with an ellipsis when cut), for a log line."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def sampled_log(n: int, what: str) -> str | None:
    """Whether the ``n``-th event of a kind is logged, and the suffix its line ends with.

    The first ``LOGGED_REFUSALS`` of each kind are logged (suffix ``""``), then every 1000th (suffix
    ``" (n what so far)"``), so a flood of forged messages is not a flood of log lines; None: not logged.
    """
    if n <= LOGGED_REFUSALS:
        return ""
    return f" ({n} {what} so far)" if n % 1000 == 0 else None


def _interned(value: Any) -> Any:
    """A decoded status's fields with map keys and short strings shared (half the memory per entry).

    A bounded table of :data:`STRINGS_KEPT`, not ``sys.intern``: the strings are a device's choice, and
    interned strings are never freed on CPython 3.12.0-3.12.5 (python/cpython#113993).
    """
    if isinstance(value, dict):
        return {_interned(str(k)): _interned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interned(v) for v in value]
    if isinstance(value, str) and len(value) <= 64:
        if len(_strings) >= STRINGS_KEPT and value not in _strings:
            _strings.clear()
        return _strings.setdefault(value, value)
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


def _accuracy(value: object) -> float | None:
    """A device's claimed accuracy as the page shows it: a number in [0, 1], else None (shown "–")."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0:
        return float(value)
    return None


class DeviceRegistry:
    """The latest status of each device of a fleet (bounded), with what was refused and declined by device.

    A device whose status names another backbone than ``model_sha256`` is left out of rounds (its
    reason names ``head_shape`` (D, K) too). ``clipped``: the strategy's clipped updates by device (a
    forgotten device leaves it too); ``limits``: decoding bounds for statuses. At ``max_devices``,
    expired and offline devices are dropped first; a status older than ``expiry_s`` seconds (since it
    came, or since its ``ts``) is forgotten.
    """

    def __init__(
        self,
        *,
        model_sha256: str,
        head_shape: tuple[int, int],
        clipped: Counter[str],
        limits: Limits,
        max_devices: int = 10_000,
        expiry_s: float = 7 * 24 * 3600.0,
    ) -> None:
        self.model_sha256 = model_sha256
        self.head_shape = head_shape
        self.clipped = clipped
        self.limits = limits
        self.max_devices = max_devices
        self.expiry_s = expiry_s
        self.devices: dict[str, dict[str, Any]] = {}
        # device → why its model differs; only devices in the registry, forgotten with them (forget)
        self.mismatched: dict[str, str] = {}
        self.mismatches_total = 0  # devices seen with another model (the log names the first ones)
        self.rejected_by_device: dict[str, Counter[str]] = {}
        self.declined_by_device: dict[str, Counter[str]] = {}
        # device → the last round its update was counted in (a status from before it says stale
        # new-sample counts); seeded from the state file's counted rounds after a restart
        self.trained_round: dict[str, int] = {}
        self._strangers: dict[str, None] = {}  # devices counted above that the registry does not hold
        # device → the round it was asked in and sent nothing (see note_silent); registry devices only
        self.unanswered: dict[str, int] = {}
        self.on_mismatch: Callable[[str, str], None] | None = None
        self.changed = asyncio.Event()  # set by every status kept

    def note_status(self, device: str, payload: bytes) -> None:
        """Keep the status ``payload`` (not empty) of ``status/<device>`` and tell :attr:`changed`.

        Raises DecodeError or UpdateRejected for a status that does not decode, names another device
        (``wrong_device``), a bad new-sample count, or as :meth:`register`.
        """
        status = decode_status(payload, limits=self.limits)
        if status.device != device:
            raise DecodeError("wrong_device", f"status names device {status.device!r} on status/{device}")
        read_new_samples(status.fields)  # a bad count refuses the status (bad_value, wrong_type)
        entry = _interned(status.fields)
        counts = entry.get("rejected")
        if isinstance(counts, dict) and len(counts) > REASONS_KEPT:
            # read on every page refresh, for every device: a map of hundreds of invented reasons a
            # device would make each refresh cost seconds of the coordinator's loop
            counted = [(k, v) for k, v in counts.items() if type(v) is int and v > 0]
            entry["rejected"] = dict(heapq.nlargest(REASONS_KEPT, counted, key=lambda kv: kv[1]))
        last = self.devices.get(device)
        if status.state == "offline" and not status.fields and last is not None:
            # a last will says nothing else: keep the last figures the device reported (its
            # memory, round, accuracies), shown as offline with their age, not blanked
            entry = {**last, "ready": False, "offline_since": time.time()}
        entry["state"] = _interned(status.state)
        entry["seen_at"] = time.time()
        self.register(device, entry)
        self.changed.set()

    def register(self, device: str, entry: dict[str, Any]) -> None:
        """Keep a device's status in the bounded registry and check its model's identity.

        Raises UpdateRejected: ``registry_full`` when it holds ``max_devices`` live devices, ``expired``
        for a status whose own timestamp ``ts`` (seconds since the epoch) is older than the expiry.
        """
        now = entry["seen_at"]
        ts = entry.get("ts")
        if isinstance(ts, (int, float)) and now - float(ts) > self.expiry_s:
            raise UpdateRejected("expired", f"status of {device} is {now - float(ts):.0f} s old")
        devices = self.devices
        if device not in devices and len(devices) >= self.max_devices:
            self.expire(now)
            if len(devices) >= self.max_devices:
                offline = [d for d, st in devices.items() if st.get("state") == "offline"]
                if not offline:
                    raise UpdateRejected(
                        "registry_full", f"{self.max_devices} devices known; {device} not kept"
                    )
                self.forget(min(offline, key=lambda d: float(devices[d].get("seen_at", 0.0))))
        devices[device] = entry
        sha = entry.get("model_sha256")
        if isinstance(sha, str) and sha != self.model_sha256:
            # an `edgefl model prepare` output carries its original's sha256: a difference is another model
            why = (
                f"backbone sha256 {sha[:12]}…, the coordinator's {self.model_sha256[:12]}…; "
                "a `model prepare` output counts as its original"
            )
            shape = entry.get("head_shape")
            if isinstance(shape, list) and shape != list(self.head_shape):
                why += f"; head {shape}, the coordinator's {list(self.head_shape)}"
            if self.mismatched.get(device) != why:
                self.mismatched[device] = why  # only for a device in the registry: forgotten with it
                self.mismatches_total += 1
                more = sampled_log(self.mismatches_total, "devices with another model")
                if more is not None:
                    logger.warning(
                        "device %s runs another model: %s; left out of rounds%s", device, why, more
                    )
                    if self.on_mismatch is not None:
                        self.on_mismatch(device, why)
        else:
            self.mismatched.pop(device, None)

    def count_by_device(self, table: dict[str, Counter[str]], device: str, reason: str) -> None:
        """Count ``reason`` for ``device`` in ``table`` (registry devices, and ``STRANGERS_KEPT`` others)."""
        if device not in table and device not in self.devices:
            self._strangers[device] = None
            while len(self._strangers) > STRANGERS_KEPT:
                old = next(iter(self._strangers))
                del self._strangers[old]
                if old not in self.devices:
                    self.rejected_by_device.pop(old, None)
                    self.declined_by_device.pop(old, None)
        table.setdefault(device, Counter())[reason] += 1

    def forget(self, device: str, *, keep_silence: bool = False) -> None:
        """Drop ``device`` from the registry and from every per-device record kept beside it.

        ``keep_silence``: keep its :meth:`note_silent` mark (its account cleared its retained status:
        that must not make rounds wait for it again); at most ``max_devices`` more marks, oldest dropped.
        """
        self.devices.pop(device, None)
        self.mismatched.pop(device, None)
        self.rejected_by_device.pop(device, None)
        self.declined_by_device.pop(device, None)
        self.clipped.pop(device, None)
        self.trained_round.pop(device, None)
        if not keep_silence:
            self.unanswered.pop(device, None)
        elif len(self.unanswered) > 2 * self.max_devices:
            del self.unanswered[next(iter(self.unanswered))]

    def trained(self, device: str, round_no: int) -> None:
        """``device``'s update was counted in round ``round_no``: what its older statuses report is spent."""
        self.trained_round[device] = max(round_no, self.trained_round.get(device, 0))
        self.heard(device)

    def note_silent(self, devices: Iterable[str], round_no: int) -> None:
        """``devices`` were asked in round ``round_no`` and sent it neither an update counted nor a decline.

        Until each answers a round again (:meth:`heard`), :meth:`waited_devices` leaves it out and
        :meth:`ready_new_samples` counts its claimed new samples as 0 (``docs/security.md``, "Update ids,
        declines and sites"). Devices the registry does not hold are ignored (bounded by ``max_devices``).
        """
        for dev in devices:
            if dev in self.devices:
                self.unanswered.setdefault(dev, round_no)

    def heard(self, device: str) -> None:
        """``device`` answered: rounds wait for it again.

        An update counted, a decline, or its own late update; never a status (``docs/security.md``).
        """
        self.unanswered.pop(device, None)

    def waited_devices(self) -> list[str]:
        """The ready devices (:meth:`online_devices`) a round waits for: those not silent since asked.

        All of them when every ready device is in :attr:`unanswered` (``docs/security.md``, "Update
        ids, declines and sites").
        """
        return self._waited(self.online_devices())

    def _waited(self, ready: list[str]) -> list[str]:
        heard = [d for d in ready if d not in self.unanswered]
        return heard or ready

    def expire(self, now: float) -> None:
        """Forget devices whose last status is older than ``expiry_s``."""
        for dev in [
            d for d, st in self.devices.items() if now - float(st.get("seen_at", now)) > self.expiry_s
        ]:
            self.forget(dev)

    def online_devices(self) -> list[str]:
        """The ready devices (sorted): up, ready, on this backbone, and with labelled samples to train on.

        One reporting ``store_samples`` = 0 is not ready (``docs/protocol.md``, "DeviceStatus").
        """
        return sorted(
            d
            for d, s in self.devices.items()
            if s.get("ready")
            and s.get("state") != "offline"
            and d not in self.mismatched
            and s.get("store_samples") != 0
        )

    def ready_new_samples(self) -> dict[str, int | None]:
        """The ready devices (:meth:`online_devices`) and the new labelled samples each reports (or None).

        A status whose ``round`` is older than the device's last counted round (:meth:`trained`) reports
        samples that round trained on: 0. A device left out of :meth:`waited_devices` (asked, silent
        since) reports 0: its claim alone opens no round.
        """
        out: dict[str, int | None] = {}
        ready = self.online_devices()
        waited = set(self._waited(ready))
        for dev in ready:
            st = self.devices[dev]
            n = st.get("new_samples")
            out[dev] = n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None
            shown, trained = st.get("round"), self.trained_round.get(dev)
            stale = trained is not None and (not isinstance(shown, int) or shown < trained)
            if out[dev] is not None and stale:
                out[dev] = 0  # a status from before its last counted round (retained): trained on since
            if dev not in waited:
                out[dev] = 0  # asked and silent since: its claim is not believed until it answers
        return out

    async def wait_for_devices(self, n: int, timeout_s: float, key: str | None = "ready") -> list[str]:
        """Wait until ``n`` devices report a status whose field ``key`` is true; returns their ids.

        ``key`` None: ready to train as pacing counts them (:meth:`online_devices`). Raises
        TimeoutError if fewer than ``n`` are ready after ``timeout_s`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            ready = (
                self.online_devices()
                if key is None
                else sorted(d for d, s in self.devices.items() if s.get(key) and s.get("state") != "offline")
            )
            if len(ready) >= n:
                return ready
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"only {len(ready)} of {n} devices ready after {timeout_s} s")
            self.changed.clear()
            await wait_event(self.changed, remaining)

    def refusals(self, own: Mapping[str, int], limit: int = PAGE_REFUSALS) -> list[dict[str, Any]]:
        """Who refused what: rows ``{"by", "reason", "count", "detail"}``, largest counts first.

        ``own``: the coordinator's refusals by reason (``by`` ``"coordinator"``, all listed); then the
        ``limit`` largest of the devices' own (their statuses' ``rejected``), ``detail`` the device's
        last refusal in words when it has that reason (else ``""``).
        """
        rows = [
            {"by": "coordinator", "reason": str(reason), "count": n, "detail": ""}
            for reason, n in sorted(own.items(), key=lambda kv: -kv[1])
            if n > 0
        ]
        theirs = heapq.nlargest(
            limit,
            (
                (n, dev, str(reason))
                for dev, st in self.devices.items()
                if isinstance(counts := st.get("rejected"), dict)
                for reason, n in counts.items()
                if type(n) is int and n > 0
            ),
            key=lambda r: (r[0], r[1]),
        )
        for n, dev, reason in theirs:
            last = self.devices[dev].get("last_rejected")
            detail = last.get("detail") if isinstance(last, dict) and last.get("reason") == reason else None
            rows.append(
                {
                    "by": dev,
                    "reason": reason[:64],
                    "count": n,
                    "detail": shorten(detail) if isinstance(detail, str) else "",
                }
            )
        return rows

    def page_devices(self) -> dict[str, dict[str, Any]]:
        """The ``PAGE_DEVICES`` devices the page lists (ready, least headroom, latest first), JSON-like."""
        registry = self.devices
        devices = {}
        for dev in heapq.nsmallest(PAGE_DEVICES, registry, key=lambda d: _page_order(registry[d])):
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
                "clipped": self.clipped.get(dev, 0),
                # accuracies the device reports, each measured on its own holdout (invalid: None, "–")
                "personal_accuracy": _accuracy(st.get("personal_accuracy")),
                "global_accuracy": _accuracy(st.get("global_accuracy")),
                "eval_accuracy": _accuracy(st.get("eval_accuracy")),
                "serving_head": st.get("serving_head"),
            }
        return devices
