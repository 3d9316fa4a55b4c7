"""What a coordinator keeps of its rounds: the record of each closed round and the fleet's evaluations."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgefl.coordinator.rounds import Round

HISTORY_ROUNDS = 200
"""Closed rounds whose records are kept in memory and in the state file (the round log keeps them all)."""

COUNTED_ROUNDS = 20
"""Closed rounds whose counted update ids are kept (in the state file, written after every batch)."""


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """Result of one closed round (the demo's ``rounds`` JSON entries).

    ``clients``: updates aggregated; ``accuracy``: test accuracy of the new global head (NaN: no
    evaluation); ``update_bytes_mean``: mean wire size of the updates; ``duration_s``: seconds from the
    announcement to the new head; ``clipped``, ``norm_bound``, ``epsilon``, ``delta`` as ``RoundReport``;
    ``refused``: why the aggregate was not published ("" when it was, or nothing arrived); ``declined``
    and ``asked`` devices; ``fed_accuracy``, ``fed_worst_decile``, ``fed_devices``: the devices'
    holdout accuracies of the base head (``federated_evaluation``; NaN: none); ``lr``: the client
    learning rate announced; ``closed_unix``: Unix time it closed (NaN: not known); ``new_samples``:
    new labelled samples the ready devices reported at the opening (-1: none reported).
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

    ``reports``: ``(accuracy, count)`` per device, as each device claims them; a report with an
    accuracy outside [0, 1] (or NaN) or a count <= 0 is left out. Returns (the mean accuracy weighted
    by count, each count capped at the low median of the usable counts; the mean of the worst
    ceil(10 %) of devices; devices); NaN, NaN, 0 without usable reports (``docs/security.md``).

    Source: the capped user weights ``w_k = min(n_k / w_hat, 1)`` of McMahan et al. 2018, "Learning
    Differentially Private Recurrent Language Models" (ICLR), ``w_hat`` the low median of the counts.
    """
    usable = [(a, n) for a, n in reports if n > 0 and 0.0 <= a <= 1.0]
    if not usable:
        return math.nan, math.nan, 0
    cap = statistics.median_low(n for _, n in usable)
    weighted = [(a, min(n, cap)) for a, n in usable]
    total = sum(w for _, w in weighted)
    mean = sum(a * w for a, w in weighted) / total
    worst = sorted(a for a, _ in usable)[: max(1, math.ceil(len(usable) / 10))]
    return mean, sum(worst) / len(worst), len(usable)


def personal_heads_summary(devices: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The fleet's personal and global heads on the devices' holdouts, from their latest statuses.

    ``devices``: ``{device: status}`` with ``personal_accuracy``, ``global_accuracy``, ``eval_count``
    and ``serving_head``. Returns ``{"devices", "personal_mean", "personal_worst_decile", "global_mean",
    "global_worst_decile", "serving_personal"}`` (as :func:`federated_evaluation`), or None when no
    device reports both accuracies.
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
    """The round, the head's version and the counters a coordinator keeps, for its page and for the demo."""

    version: int = 0
    round: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    refused_rounds: Counter[str] = field(default_factory=Counter)
    declined: Counter[str] = field(default_factory=Counter)  # Decline messages by reason
    history: list[RoundRecord] = field(default_factory=list)
    current: Round | None = None


def page_record(h: RoundRecord, reasons: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """One round's record as the fleet page reads it: the round log's keys where they exist.

    ``reasons`` is the round's ``{"refused": {reason: n}, "declined": {reason: n}}`` (empty when not known).
    """
    record = dataclasses.asdict(h)
    record["round_refused"] = record.pop("refused") or None  # why the head was not published
    record["declined_devices"] = record.pop("declined")
    record["counted"] = record.pop("clients")  # the round log's name
    record["time"] = (
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(h.closed_unix))
        if math.isfinite(h.closed_unix)
        else None
    )
    record.update(reasons)
    return record
