"""What a coordinator writes of each closed round: its line on stdout and its JSON line in ``files.log``.

The log's keys are ``docs/operations.md``, "The round log".
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from edgefl.coordinator.hierarchy import RootCoordinator
from edgefl.coordinator.history import RoundRecord
from edgefl.coordinator.rounds import device_names
from edgefl.coordinator.service import Coordinator, round_reasons
from edgefl.coordinator.strategy import Strategy

logger = logging.getLogger(__name__)


def _by_reason(counts: Mapping[str, int]) -> str:
    """``"a 1, b 2"`` for ``{"a": 1, "b": 2}`` (sorted by reason), ``""`` when empty."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def plural(n: int, word: str) -> str:
    """``"1 device"``, ``"2 devices"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def empty_cause(refused: Mapping[str, int], declined: Mapping[str, int], online: int) -> str:
    """Why a round aggregated nothing: its declines and refusals by reason, and the devices online."""
    parts = []
    if declined:
        parts.append(f"declined: {_by_reason(declined)}")
    if refused:
        parts.append(f"refused: {_by_reason(refused)}")
    if not parts:
        parts.append("no update arrived")
    parts.append(f"{plural(online, 'device')} online")
    return "; ".join(parts)


def round_line(
    rec: RoundRecord,
    total: int,
    refused: Mapping[str, int],
    declined: Mapping[str, int] | None = None,
    per: str = "update",
    silent: Sequence[str] = (),
) -> str:
    """The line printed for a closed round: ``total`` rounds in all (0: until stopped), ``per`` what came in.

    ``refused``, ``declined``: counts by reason (:func:`counts_since`); ``silent``: ``Round.silent``.
    """
    why = _by_reason(refused) or "none"
    if declined:
        why += f", declined: {_by_reason(declined)}"
    acc = "n/a" if math.isnan(rec.accuracy) else f"{rec.accuracy:.3f}"
    extra = f", {rec.clipped} clipped" if rec.clipped else ""
    if rec.fed_devices:
        extra += (
            f", federated accuracy {rec.fed_accuracy:.3f} (worst decile {rec.fed_worst_decile:.3f}, "
            f"{plural(rec.fed_devices, 'device')})"
        )
    if not math.isnan(rec.epsilon):
        extra += f", privacy epsilon {rec.epsilon:.3g} at delta {rec.delta:g}"
    if rec.refused:
        extra += f", ROUND REFUSED ({rec.refused}): head kept"
    if silent:
        extra += f", no answer from {device_names(silent)}"
    # "N/M clients": N updates counted of the M devices asked, in every round and on the fleet page
    number = f"{rec.round}/{total}" if total else f"{rec.round}"
    return (
        f"round {number}: {rec.clients}/{rec.asked} clients, refused: {why}, accuracy {acc}, "
        f"{rec.update_bytes_mean:.0f} B/{per}, {rec.duration_s:.2f} s{extra}"
    )


def counts_since(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """The counts by reason ``now`` has more of than ``before`` (one round's refusals or declines)."""
    # str(): a reason label (a StrEnum) prints as its value, never as the enum's repr
    return {str(k): v - before.get(k, 0) for k, v in sorted(now.items()) if v > before.get(k, 0)}


def _round_entry(
    rec: RoundRecord,
    version: int,
    strategy: str,
    update_ids: list[str],
    refused: Mapping[str, int],
    declined: Mapping[str, int],
) -> dict[str, Any]:
    """The keys of a round log line that a round's record gives (NaN and unset figures as null)."""
    closed = rec.closed_unix if math.isfinite(rec.closed_unix) else time.time()
    return {
        "round": rec.round,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(closed)),
        "asked": rec.asked,
        "counted": rec.clients,
        "refused": dict(refused),
        "declined": dict(declined),
        "accuracy": None if math.isnan(rec.accuracy) else rec.accuracy,
        # the devices' holdouts (federated evaluation of the round's base head; null: none reported)
        "fed_accuracy": None if math.isnan(rec.fed_accuracy) else rec.fed_accuracy,
        "fed_worst_decile": None if math.isnan(rec.fed_worst_decile) else rec.fed_worst_decile,
        "fed_devices": rec.fed_devices,
        "update_bytes_mean": rec.update_bytes_mean,
        "duration_s": rec.duration_s,
        "update_ids": update_ids,
        "version": version,
        "strategy": strategy,
        "lr": rec.lr if math.isfinite(rec.lr) else None,
        "new_samples": rec.new_samples if rec.new_samples >= 0 else None,
        "round_refused": rec.refused or None,
    }


def log_entry(
    coord: Coordinator,
    rec: RoundRecord,
    strategy: Strategy,
    refused: Mapping[str, int],
    declined: Mapping[str, int],
) -> dict[str, Any]:
    """One closed round's line of ``files.log`` (``docs/operations.md``, "The round log")."""
    update_ids = coord.counted.get(rec.round, [])
    rnd = coord.state.current
    if not update_ids and rnd is not None and rnd.number == rec.round:
        update_ids = sorted(rnd.update_ids)  # an abandoned round's (too_few): the updates it counted
    entry = _round_entry(rec, coord.state.version, strategy.name, update_ids, refused, declined)
    # silent: asked, and nothing counted came from them (no update, no decline)
    entry.update(
        round_reasons(refused, declined, coord.silent_devices(rec.round)),
        refused_updates=dict(refused),
        clipped=rec.clipped,
        clipped_by_device=dict(strategy.clipped),  # since the start of this process
        norm_bound=rec.norm_bound if math.isfinite(rec.norm_bound) else None,
        epsilon=None if math.isnan(rec.epsilon) else rec.epsilon,
        delta=None if math.isnan(rec.delta) else rec.delta,
    )
    if isinstance(coord, RootCoordinator):  # since the start of this process (and update_bytes_mean kept)
        entry["partial_bytes_mean"] = rec.update_bytes_mean
        entry["partials"] = coord.partials_received
        entry["partial_bytes"] = coord.partial_bytes
        entry["duplicate_partials"] = coord.duplicates
    return entry


def append_log(log: Path, entries: Iterable[Mapping[str, Any]]) -> None:
    """Append ``entries`` to the round log ``log``, one JSON line each.

    A last line left without its newline (a kill or a full disk part-way through a write) is ended
    first, so the new lines stay whole and readable. OSError if the file system refuses: the log is
    cut back to its size before (none of ``entries`` written).
    """
    text = "".join(json.dumps(entry) + "\n" for entry in entries)
    with open(log, "ab+", buffering=0) as f:
        size = f.seek(0, os.SEEK_END)
        if size > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                logger.warning("round log %s: its last line is torn (no newline); ended it", log)
                text = "\n" + text
        data = memoryview(text.encode())
        try:
            while data:
                data = data[f.write(data) or 0 :]
        except OSError:
            with contextlib.suppress(OSError):
                f.truncate(size)
            raise


def log_missing_rounds(log: Path, coord: Coordinator, strategy: str) -> int:
    """Append the rounds the state file closed but ``log`` does not have (a kill in between); how many.

    Each line is rebuilt from the state's history, marked ``"recovered": true``. A line of ``log``
    that is not a round's JSON (torn, or rotten bytes that are not UTF-8) vouches for no round.
    """
    logged: set[int] = set()
    with contextlib.suppress(FileNotFoundError):
        for line in log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                logged.add(int(json.loads(line)["round"]))
    last = max(logged, default=0)
    missing = [h for h in coord.state.history if h.round > last]
    if not missing:
        return 0
    # the version each round published: the state's for the last, one less before each round that
    # published a head (a round with updates whose aggregate was not refused)
    versions: list[int] = []
    v = coord.state.version
    for rec in reversed(missing):
        versions.append(v)
        v -= int(rec.clients > 0 and not rec.refused)
    versions.reverse()
    entries = []
    for rec, version in zip(missing, versions, strict=True):
        # the refusals and declines by reason were not saved
        entries.append(_round_entry(rec, version, strategy, coord.counted.get(rec.round, []), {}, {}))
        entries[-1]["recovered"] = True
    append_log(log, entries)
    logger.warning("appended %d round(s) the log missed (closed and saved before a restart)", len(missing))
    return len(missing)
