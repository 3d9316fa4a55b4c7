"""What a device's retained status says, and when saying it again is news.

A status costs a few hundred bytes to 2 kB on a metered uplink; the daemon publishes one only when
:func:`status_news` changed (and on ``status.heartbeat_s``, and at every connect). Two kinds of field
are not news on their own:

- **volatile** figures (:data:`VOLATILE_STATUS_FIELDS`: memory, counters, timestamps) that move all
  the time;
- **round progress** (:data:`ROUND_PROGRESS_FIELDS` and the states in :data:`ROUND_STATES`): the
  coordinator learns a device's round, base version and update size from the update itself, so
  "training", "uploading", "waiting" and a new head version would cost four statuses a round
  (~6.8 kB at D = 512 in ``bench/peer.py``) and say nothing the coordinator does not see already.

What stays news: a state outside the round's routine (``deferred``, a failure...), any change of
``reason`` (a governor deferral, an undelivered update), readiness, refusals, faults, degradation,
the model's identity, the dashboard's address; and ``new_samples`` (labelled samples stored since the
last round, which paces a service coordinator's rounds) each time it rises past a power of two
(:func:`samples_level`: ~11 statuses between two rounds for 1,000 new samples, and the coordinator's
count is never below half the device's). Its drop to 0 when a round trains is no news: the
coordinator sees the update.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["ROUND_PROGRESS_FIELDS", "ROUND_STATES", "VOLATILE_STATUS_FIELDS", "samples_level", "status_news"]

VOLATILE_STATUS_FIELDS: Final = frozenset(
    {
        "rss_bytes",
        "pss_bytes",
        "peak_rss_bytes",
        "system_available_bytes",
        "min_system_available_bytes",
        "phase_peaks",
        "phase_last",
        "phase_rise",
        "admissions",
        "inferred_total",
        "inference_accuracy",
        "pipeline",
        "transport",
        "ts",
        # live ingest (agent/ingest.py): traffic figures; drops and expiries stay news
        "samples_received",
        "labels_received",
        "predictions_published",
        "predictions_failed",
        "ingest_queued",
        "pending_labels",
        "over_budget_batches",  # inference batches the governor refused; the state says "deferred"
    }
)
"""Status fields that move all the time: a change in them alone waits for ``status.heartbeat_s``."""

ROUND_PROGRESS_FIELDS: Final = frozenset(
    {
        "round",
        "version",
        "last_update_bytes",
        "last_update_ts",
        "outbox_pending",
        "store_samples",
        "holdout_samples",
        "new_samples",
        "eval_version",
        "eval_accuracy",
        "eval_count",
        "personal_accuracy",
        "global_accuracy",
        # which head serves follows the rounds: the first personal step switches it, and on a small
        # holdout the two heads' order can change from round to round (the log says each change)
        "serving_head",
        "personal_fallback",
    }
)
"""Fields a round moves on every device, visible to the coordinator through the update itself."""

ROUND_STATES: Final = frozenset({"idle", "training", "uploading", "waiting"})
"""The states a device passes through in every round: moving between them alone is not news."""


def status_news(state: str, fields: Mapping[str, Any]) -> str:
    """What a status says that is worth a publish, as a canonical string to compare with the last one.

    Parameters
    ----------
    state : str
        The status's state (``"idle"``, ``"training"``, ``"deferred"``...).
    fields : mapping
        The status fields (JSON-like), as ``Agent.status_fields`` builds them.

    Returns
    -------
    str
        Canonical JSON of the state (``"round"`` for any of :data:`ROUND_STATES`) and the fields
        other than :data:`VOLATILE_STATUS_FIELDS` and :data:`ROUND_PROGRESS_FIELDS`: two statuses
        with equal news differ only in figures the heartbeat carries.
    """
    quiet = VOLATILE_STATUS_FIELDS | ROUND_PROGRESS_FIELDS
    return json.dumps(
        ["round" if state in ROUND_STATES else state, {k: v for k, v in fields.items() if k not in quiet}],
        sort_keys=True,
        default=str,
    )


def samples_level(fields: Mapping[str, Any]) -> int:
    """The power of two ``new_samples`` has reached: ``n.bit_length()`` (0 for none or when absent).

    A status is news when this rises above the level of the last status published (the daemon keeps
    the lowest level seen since, so a drop to 0 after a round and a rise again is news again).
    """
    n = fields.get("new_samples")
    return n.bit_length() if isinstance(n, int) and n > 0 else 0
