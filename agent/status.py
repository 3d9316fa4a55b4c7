"""What a device's retained status says, and when saying it again is news.

The daemon publishes a status when :func:`status_news` changed, on ``status.heartbeat_s`` and at
every connect; ``new_samples`` is news each time it rises past a power of two (:func:`samples_level`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

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


QUIET_STATUS_FIELDS: Final = VOLATILE_STATUS_FIELDS | ROUND_PROGRESS_FIELDS
"""The fields :func:`status_news` leaves out."""


def status_news(state: str, fields: Mapping[str, Any]) -> str:
    """What a status (``state``, JSON-like ``fields``) says that is worth a publish, as canonical JSON.

    The state word (``"round"`` for :data:`ROUND_STATES`) and the fields but :data:`QUIET_STATUS_FIELDS`:
    two statuses with equal news differ only in figures the heartbeat carries.
    """
    word = "round" if state in ROUND_STATES else state
    news = {k: v for k, v in fields.items() if k not in QUIET_STATUS_FIELDS}
    return json.dumps([word, news], sort_keys=True, default=str)


def samples_level(fields: Mapping[str, Any]) -> int:
    """The power of two ``new_samples`` has reached: ``n.bit_length()`` (0 for none or when absent)."""
    n = fields.get("new_samples")
    return n.bit_length() if isinstance(n, int) and n > 0 else 0
