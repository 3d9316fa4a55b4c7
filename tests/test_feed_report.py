"""``edgefl feed``'s summary: what it says about samples that got no answer (``edgefl.feed._report``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefl.feed import FeedOptions, FeedResult, _report
from edgefl.profiles import BrokerConfig


def _options(tmp_path: Path) -> FeedOptions:
    return FeedOptions(
        broker=BrokerConfig(url="mqtt://127.0.0.1:1883"),
        fleet="plant-3",
        device="gw-9",
        data=tmp_path / "dev.npz",
        wait_s=10.0,
    )


def test_feed_report_unanswered_samples_name_a_restarting_device_and_wait(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 95 of 222 answered: the rest were queued for an agent killed mid-feed and restarted after --wait.
    result = FeedResult(
        samples_sent=222, labels_inline=222, labels_late=0, predictions_received=95, correct=36, seconds=21.1
    )
    code = _report(_options(tmp_path), result, None)
    err = capsys.readouterr().err
    assert code == 1
    assert "127 sample(s) got neither a prediction nor a refusal in 10 s" in err
    assert "down or restarting" in err
    assert "raise --wait" in err
    assert "dropped at the broker" in err


def test_feed_report_all_answered_says_nothing_unanswered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = FeedResult(
        samples_sent=323,
        labels_inline=0,
        labels_late=323,
        predictions_received=323,
        correct=185,
        seconds=31.5,
    )
    code = _report(_options(tmp_path), result, None)
    captured = capsys.readouterr()
    assert code == 0
    assert captured.err == ""
    assert captured.out.startswith(
        "fed 323 samples to gw-9 in 31.5 s (0 labels inline, 323 late); 323 predictions"
    )
