"""agent/status.py's news_view: what status_news serialises, compared without serialising it."""

from __future__ import annotations

from typing import Any

from edgefl.agent.status import QUIET_STATUS_FIELDS, news_view, status_news

FIELDS: dict[str, Any] = {
    "round": 3,
    "version": 3,
    "reason": "",
    "ready": True,
    "rejected": {"bad_chunk": 1},
    "phase_peaks": {"train": 1},
    "transport": {"connects": 1},
    "model_sha256": "ab" * 32,
}


def test_status_news_view_equal_exactly_when_the_news_string_is() -> None:
    """Equal views give the same ``status_news`` string; a change in a news field changes both, a
    change in a quiet field (round progress, volatile counters) neither."""
    word, news = news_view("training", FIELDS)
    assert word == "round" and set(news) == {"reason", "ready", "rejected", "model_sha256"}
    assert not set(news) & QUIET_STATUS_FIELDS
    quiet = dict(FIELDS, round=4, version=4, phase_peaks={"train": 2}, transport={"connects": 2})
    assert news_view("waiting", quiet) == news_view("training", FIELDS)
    assert status_news("waiting", quiet) == status_news("training", FIELDS)
    loud = dict(FIELDS, rejected={"bad_chunk": 2})
    assert news_view("idle", loud) != news_view("idle", FIELDS)
    assert status_news("idle", loud) != status_news("idle", FIELDS)
    assert news_view("deferred", FIELDS) != news_view("idle", FIELDS)
    assert status_news("deferred", FIELDS) != status_news("idle", FIELDS)
