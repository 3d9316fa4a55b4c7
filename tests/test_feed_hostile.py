"""``edgefl feed`` against another app of the same device: it cannot guess the feed's sample ids, and
when it answers ids the feed uses (explicit ``--id-prefix`` ids) first, the feed reports the device's
``duplicate`` refusals instead of taking that app's predictions for its own.

A real agent process (dev profile, raw-input int8 digits model) on a real mosquitto; the other app
reads ``predictions/<device>`` and, from the first prediction of the feed's, publishes samples under
the ids it guesses come next.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import Broker, start_ingest_agent, wait_until
from test_ingest import Gateway

from edgefl.datasets import load_digits
from edgefl.feed import FeedOptions, FeedResult, feed
from edgefl.profiles import BrokerConfig
from edgefl.wire.ingest import Sample

pytestmark = [pytest.mark.timeout(180), pytest.mark.broker, pytest.mark.subprocess]

N = 10


def run_with_guesser(
    mosquitto: Broker, fleet: str, tmp_path: Path, device: str, id_prefix: str | None
) -> tuple[FeedResult, Gateway, list[str]]:
    """Feed N digits while another app publishes samples under the ids it guesses; returns the feed's
    result, the other app (what it saw on ``predictions/<device>``) and the ids it guessed."""
    x, y = load_digits()
    np.savez(tmp_path / "d.npz", x=x[:N], y=y[:N])

    guessed: list[str] = []

    async def main() -> tuple[FeedResult, Gateway, list[str]]:
        async with Gateway(mosquitto, fleet, device) as other:
            await other.ready()

            async def guess() -> None:  # <prefix><i> seen: the rest of the run, before the feed sends it
                await wait_until(lambda: bool(other.predictions), 60, "the feed's first prediction")
                first = next(iter(other.predictions))
                m = re.fullmatch(r"(.*?)(\d+)", first)
                if m is None:
                    return  # nothing to guess from
                for k in range(int(m[2]) + 3, N):
                    guessed.append(f"{m[1]}{k}")
                    await other.sample(Sample(guessed[-1], x[(k + 1) % N], None))

            guesser = asyncio.create_task(guess())
            opts = FeedOptions(
                BrokerConfig(url=mosquitto.url), fleet, device, tmp_path / "d.npz", rate_hz=2, wait_s=60,
                id_prefix=id_prefix,
            )  # fmt: skip
            result = await feed(opts)
            await guesser
            return result, other, guessed

    return asyncio.run(main())


def test_hostile_feed_sample_ids_cannot_be_guessed(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-g"))
    result, other, guessed = run_with_guesser(mosquitto, fleet, tmp_path, "dev-g", None)
    # every prediction the device published but for the guesser's own samples (a token that ends in
    # a digit is "guessed" on: those ids are new to the device, never the feed's)
    ids = [i for i in other.predictions if i not in guessed]
    assert len(ids) == N and all(re.fullmatch(r"[0-9a-f]{24}", i) for i in ids), ids
    assert len({i[:6] for i in ids}) == N  # no shared prefix, no counter
    assert other.refusals == []  # no sample of the feed was ever refused as a duplicate
    assert (result.samples_sent, result.predictions_received, result.refused) == (N, N, {})


def test_hostile_feed_reports_duplicate_refusals_of_its_own_ids(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-h"))
    result, other, _guessed = run_with_guesser(mosquitto, fleet, tmp_path, "dev-h", "s-")
    guessed = N - 3  # s-3 .. s-9, classified as the other app's samples before the feed sent them
    dups = [r.id for r in other.refusals if r.reason == "duplicate"]
    assert sorted(dups) == [f"s-{k}" for k in range(3, N)], other.refusals
    assert result.samples_sent == N
    assert result.predictions_received == N - guessed  # the other app's predictions are not its own
    assert result.refused == {"duplicate": guessed}
