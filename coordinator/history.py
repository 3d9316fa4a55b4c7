"""What a coordinator keeps of its rounds: the record of each closed round and the fleet's evaluations.

:class:`RoundRecord` is one closed round (the state file's history, the round log's line, the demo's JSON);
:class:`CoordinatorState` is the round, version and counters the service and its page read;
:func:`federated_evaluation` and :func:`personal_heads_summary` combine the devices' own evaluations
(no central data). :func:`page_record` is a record as the fleet page reads it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgefl.coordinator.rounds import Round

HISTORY_ROUNDS = 200
"""Closed rounds whose records are kept in memory and in the state file: a service runs for months, and
the round log (``files.log``) keeps them all."""

COUNTED_ROUNDS = 20
"""Closed rounds whose counted update ids are kept (the state file is written after every batch of
updates: 20 rounds of 200 devices' ids is ~80 kB)."""


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
    """The round, the head's version and the counters a coordinator keeps, for its page and for the demo."""

    version: int = 0
    round: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    refused_rounds: Counter[str] = field(default_factory=Counter)
    declined: Counter[str] = field(default_factory=Counter)
    """Rounds devices refused (Decline messages), by reason."""
    history: list[RoundRecord] = field(default_factory=list)
    current: Round | None = None


def page_record(h: RoundRecord, reasons: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """One round's record as the fleet page reads it: the round log's keys where they exist.

    ``reasons`` is the round's ``{"refused": {reason: n}, "declined": {reason: n}}`` (empty when not known).
    """
    record = dataclasses.asdict(h)
    record["round_refused"] = record.pop("refused") or None  # why the head was not published
    record["declined_devices"] = record.pop("declined")
    record["counted"] = h.clients
    record["time"] = (
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(h.closed_unix))
        if math.isfinite(h.closed_unix)
        else None
    )
    record.update(reasons)
    return record
