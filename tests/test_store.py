"""The embedding store's durability: a crash loses at most the flush window, what is lost is counted.

Unit level on the store's files (a "crash" is dropping the store without a flush: the page cache keeps
what a ``kill -9`` keeps), then real agent processes on a real mosquitto, killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import Broker, start_ingest_agent, wait_until
from test_ingest import Gateway

from edgefl.agent.store import ROWS_FILE, EmbeddingStore
from edgefl.datasets import load_digits
from edgefl.records import read_record
from edgefl.wire.ingest import Sample
from edgefl.wire.rounds import Decline, RoundAnnouncement, encode_round

pytestmark = pytest.mark.timeout(180)


def rows(n: int, start: int = 0, dim: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """n samples numbered from ``start``: embedding row filled with the number, label number % 3."""
    seq = np.arange(start, start + n)
    return np.repeat(seq[:, None], dim, axis=1).astype(np.float32), (seq % 3).astype(np.int64)


def contents(s: EmbeddingStore) -> list[int]:
    """The sample numbers a store holds, in its logical order (oldest first)."""
    return [int(v) for e, _ in s.chunks(64) for v in e[:, 0]]


def test_durable_store_capacity_change_keeps_the_newest_samples_and_the_mark(tmp_path: Path) -> None:
    """A profile's ``training.store_capacity`` changed: the store keeps its newest samples (as many as
    fit) and what is new since the last round; only another embedding size D starts it empty."""
    s = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    s.add(*rows(8))
    s.set_mark()
    s.add(*rows(4, start=8))
    s.flush()
    del s
    small = EmbeddingStore(tmp_path, capacity=6, dim=4, num_classes=3)
    assert contents(small) == [6, 7, 8, 9, 10, 11]
    assert (small.since_mark, small.total) == (4, 6)
    assert not list(tmp_path.glob("*.corrupt"))  # nothing set aside
    assert not (tmp_path / ".resize").exists()
    small.add(*rows(2, start=12))  # the ring of 6 overwrites its oldest
    assert sorted(contents(small)) == [8, 9, 10, 11, 12, 13]  # a full ring: storage order
    small.flush()
    del small
    big = EmbeddingStore(tmp_path, capacity=32, dim=4, num_classes=3)  # copied oldest first
    assert (contents(big), big.since_mark) == ([8, 9, 10, 11, 12, 13], 6)
    assert np.concatenate([lab for _, lab in big.chunks(64)]).tolist() == [i % 3 for i in range(8, 14)]
    del big
    assert len(EmbeddingStore(tmp_path, capacity=32, dim=8, num_classes=3)) == 0


def test_durable_store_recovers_rows_written_after_the_last_flush(tmp_path: Path) -> None:
    s = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    s.add(*rows(10))
    s.flush()
    assert (s.unflushed, s.unflushed_since) == (0, None)
    s.add(*rows(5, start=10))
    assert s.unflushed == 5 and s.unflushed_since is not None
    del s  # a kill -9: no flush, the metadata still says 10
    meta = json.loads(read_record(tmp_path / "store_meta.rec") or b"")
    assert (meta["count"], meta["total"]) == (10, 10)
    again = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    assert (len(again), again.recovered_after_flush, again.lost_at_open) == (15, 5, 0)
    assert not list(tmp_path.glob("*.corrupt"))  # nothing set aside
    assert contents(again) == list(range(15))
    assert np.concatenate([lab for _, lab in again.chunks(64)]).tolist() == [i % 3 for i in range(15)]
    # never flushed at all (killed before the first flush): the rows alone bring the samples back
    fresh = EmbeddingStore(tmp_path / "new", capacity=16, dim=4, num_classes=3)
    fresh.add(*rows(3))
    del fresh
    assert not (tmp_path / "new" / "store_meta.rec").exists()
    assert contents(EmbeddingStore(tmp_path / "new", capacity=16, dim=4, num_classes=3)) == [0, 1, 2]


def test_durable_store_torn_row_in_a_full_ring_loses_one_sample_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = EmbeddingStore(tmp_path, capacity=8, dim=4, num_classes=3)
    s.add(*rows(10))
    s.flush()  # samples 2..9 vouched for by the metadata
    s.add(*rows(3, start=10))  # 10..12 overwrite 2..4: samples 5..12 held, ring head at slot 5
    assert contents(s) == [8, 9, 10, 11, 12, 5, 6, 7]  # a full ring reads in storage order
    del s
    # sample 13 caught half-way in slot 5 (sample 5's): the row cleared, the embedding half written
    rec = np.memmap(tmp_path / ROWS_FILE, dtype="<u8", mode="r+", shape=(8, 2))
    rec[5, 0] = 0
    rec.flush()
    del rec
    emb = np.memmap(tmp_path / "store_emb.f16", dtype=np.float16, mode="r+", shape=(8, 4))
    emb[5, :2] = 13
    emb.flush()
    del emb
    with caplog.at_level("INFO", logger="edgefl.agent.store"):
        again = EmbeddingStore(tmp_path, capacity=8, dim=4, num_classes=3)
    assert (len(again), again.lost_at_open, again.recovered_after_flush) == (7, 1, 3)
    assert contents(again) == [6, 7, 8, 9, 10, 11, 12]
    assert [r.message for r in caplog.records] == [
        f"store in {tmp_path}: 1 sample(s) could not be recovered (torn or failing their checksum); "
        "7 recovered",
        f"store in {tmp_path}: not closed cleanly; 3 sample(s) stored after the last flush recovered "
        "(7 in all)",
    ]
    # the ring carries on from there: the next sample takes slot 5, the oldest goes once it is full
    again.add(*rows(2, start=13))
    assert sorted(contents(again)) == list(range(7, 15))
    again.flush()
    assert sorted(contents(EmbeddingStore(tmp_path, capacity=8, dim=4, num_classes=3))) == list(range(7, 15))


def test_durable_store_rotten_row_in_the_middle_keeps_the_newer_run(tmp_path: Path) -> None:
    s = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    s.add(*rows(12))
    s.flush()
    del s
    emb = np.memmap(tmp_path / "store_emb.f16", dtype=np.float16, mode="r+", shape=(16, 4))
    emb[4, 3] = 99  # a bit of sample 4 rotted on the flash: its checksum no longer matches
    emb.flush()
    del emb
    again = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    assert (len(again), again.lost_at_open) == (7, 5)  # 5..11 kept; 0..4 are behind the bad row
    assert contents(again) == list(range(5, 12))


def test_durable_store_rogue_row_seq_cannot_outrank_the_metadata_and_good_rows(tmp_path: Path) -> None:
    """A row whose seq is wrong (a flipped bit, garbage in an unused slot) fails its own CRC: it vouches
    for nothing, so the store keeps what the metadata and the good rows hold."""
    s = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    s.add(*rows(12))
    s.flush()
    del s
    raw = np.memmap(tmp_path / ROWS_FILE, dtype="<u8", mode="r+", shape=(16, 2))
    raw[14, 0] = 2**40  # an unused slot claims a sample far in the future
    raw.flush()
    del raw
    again = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    assert contents(again) == list(range(12))  # nothing lost to the rogue row
    del again
    raw = np.memmap(tmp_path / ROWS_FILE, dtype="<u8", mode="r+", shape=(16, 2))
    raw[5, 0] ^= 1 << 33  # sample 5's seq flipped: that row is bad, the newer ones are not
    raw.flush()
    del raw
    third = EmbeddingStore(tmp_path, capacity=16, dim=4, num_classes=3)
    assert contents(third) == list(range(6, 12)) and third.lost_at_open >= 6


def test_durable_store_flush_is_due_by_count_or_by_age(tmp_path: Path) -> None:
    s = EmbeddingStore(tmp_path, capacity=64, dim=4)
    assert not s.flush_due(4, 5.0)
    s.add(*rows(3))
    t0 = s.unflushed_since
    assert t0 is not None
    assert not s.flush_due(4, 5.0, now=t0 + 4.9)
    assert s.flush_due(4, 5.0, now=t0 + 5.0)  # the oldest waited the interval
    s.add(*rows(1, start=3))
    assert s.unflushed_since == t0 and s.flush_due(4, 5.0, now=t0)  # 4 unflushed: at once
    s.flush()
    assert not s.flush_due(4, 5.0, now=t0 + 100)


def meta_total(state_dir: Path) -> int:
    data = read_record(state_dir / "store_meta.rec")
    return int(json.loads(data)["total"]) if data else 0


def test_durable_store_survives_kill9(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """40 labelled samples fed live (38 stored, 2 held out); SIGKILL; the restarted agent holds 38.

    ``dev-a`` flushes within 0.5 s: its metadata vouches for all 38 before the kill. ``dev-b`` never
    flushes before the kill (60 s, 64 samples): its rows alone bring the 38 back, and it says so.
    """
    x, y = load_digits()
    slow = {"training__flush_interval_s": "60", "training__flush_every": "64"}
    setups = {"dev-a": {"training__flush_interval_s": "0.5", "training__flush_every": "64"}, "dev-b": slow}

    async def feed(dev: str) -> dict[str, object]:
        async with Gateway(mosquitto, fleet, dev) as gw:
            await gw.ready()
            for i in range(40):
                await gw.sample(Sample(f"{dev}-{i}", x[i], int(y[i])))
            return await gw.until("40 labelled samples stored", stored_total=40, store_samples=38)

    for dev, extra in setups.items():
        agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, dev, **extra))
        asyncio.run(feed(dev))
    state = {dev: tmp_path / dev for dev in setups}
    asyncio.run(wait_until(lambda: meta_total(state["dev-a"]) == 38, 30, "dev-a's flush of 38 samples"))
    assert meta_total(state["dev-b"]) == 0  # nothing flushed yet: 60 s, 64 samples
    for proc in agents:
        proc.kill()  # SIGKILL: no shutdown, no final flush
        proc.wait(10)
    agents.clear()

    async def back(dev: str) -> dict[str, object]:
        async with Gateway(mosquitto, fleet, dev) as gw:
            return await gw.until(f"{dev} back with its store", ready=True, store_samples=38)

    for dev, extra in setups.items():
        agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, dev, **extra))
        assert asyncio.run(back(dev))["store_samples"] == 38
    log_b = (tmp_path / "dev-b.log").read_text()
    recovered = "not closed cleanly; {} sample(s) stored after the last flush recovered ({} in all)"
    assert f"store in {state['dev-b']}: {recovered.format(38, 38)}" in log_b
    assert f"store in {state['dev-b'] / 'holdout'}: {recovered.format(2, 2)}" in log_b
    for dev in setups:
        assert "could not be recovered" not in (tmp_path / f"{dev}.log").read_text()


def test_durable_empty_store_declines_the_round_at_once(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    agents.append(start_ingest_agent(mosquitto, fleet, tmp_path, "dev-e"))

    async def main() -> object:
        async with Gateway(mosquitto, fleet, "dev-e") as gw:
            await gw.ready()
            ann = RoundAnnouncement(1, 0, 600.0, 1, 0.05, 8, 1, ("dev-e",))
            await gw.t.publish(gw.topics.round, encode_round(ann), qos=1, retain=True)
            await wait_until(lambda: len(gw.updates) == 1, 30, "the device's answer")
            await gw.until("declined total 1", declined_total=1)
            return gw.updates[0]

    answer = asyncio.run(main())
    assert isinstance(answer, Decline)
    assert (answer.round, answer.device, answer.reason, answer.detail) == (
        1,
        "dev-e",
        "no_samples",
        "no labelled samples stored",
    )


def test_durable_profile_keys_have_their_defaults_and_are_checked() -> None:
    from conftest import DEV_PROFILE

    from edgefl.agent.config import load_profile
    from edgefl.errors import ConfigError

    p = load_profile(DEV_PROFILE, check_files=False)
    assert (p.training.flush_interval_s, p.training.flush_every, p.broker.auth_retries) == (5.0, 64, 3)
    bad = {"training.flush_every": "0", "training.flush_interval_s": "-1", "broker.auth_retries": "0"}
    with pytest.raises(ConfigError) as err:
        load_profile(DEV_PROFILE, bad, check_files=False)
    assert sorted(str(e) for e in err.value.problems) == [
        "broker.auth_retries = 0: must be an integer >= 1",
        "training.flush_every = 0: must be an integer >= 1",
        "training.flush_interval_s = -1.0: must be a finite number of seconds > 0",
    ]


def test_durable_core_flushes_every_flush_every_samples_without_waiting(tmp_path: Path) -> None:
    """The transport-free core flushes as soon as ``training.flush_every`` samples wait (no timer)."""
    from test_core import profile_for

    from edgefl.agent.core import DeviceCore

    x, y = load_digits()
    core = DeviceCore.open(profile_for(tmp_path, **{"training.flush_every": "16"}))
    state = tmp_path / "state"
    core.observe(x[:10], y[:10].astype(np.int64))
    assert meta_total(state) == 0 and core.store.unflushed == 10 and core.flush_due() is False
    core.observe(x[10:20], y[10:20].astype(np.int64))  # 20 >= 16: flushed at once, all 20
    assert (meta_total(state), core.store.unflushed, core.unflushed_since()) == (20, 0, None)
    core.observe(x[20:25], y[20:25].astype(np.int64))
    assert meta_total(state) == 20 and core.store.unflushed == 5
    assert core.flush() and meta_total(state) == 25
