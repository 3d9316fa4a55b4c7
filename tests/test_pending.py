"""The pending-label file (agent/pending.py): samples waiting for a late label survive a restart.

The file on its own (kill -9 simulated by dropping the object without a flush: the page cache keeps
the writes), the ingest table restored from it, then real agent processes on a real mosquitto stopped
with SIGTERM and SIGKILL between a sample and its label.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import Broker, start_ingest_agent, wait_until
from test_ingest import Gateway

from edgefl.agent.ingest import Ingest
from edgefl.agent.pending import HEADER_BYTES, PENDING_FILE, PendingFile, slot_dtype
from edgefl.datasets import load_digits
from edgefl.errors import UpdateRejected
from edgefl.wire.ingest import Label, Sample

D = 8


def emb(i: int) -> np.ndarray:
    return np.arange(D, dtype=np.float32) * 0.25 + i  # exact in float16


def test_durable_pending_file_restores_parked_samples_oldest_first(tmp_path: Path) -> None:
    pf = PendingFile(tmp_path, 4, D)
    for i in range(4):
        pf.park(f"s{i}", emb(i), predicted=i % 3)
    pf.release("s1")  # labelled
    pf.park("s4", emb(4), predicted=1)  # takes s1's slot
    del pf  # a kill -9: no flush
    back = PendingFile(tmp_path, 4, D)
    assert [p.id for p in back.restored] == ["s0", "s2", "s3", "s4"]
    assert [p.predicted for p in back.restored] == [0, 2, 0, 1]
    np.testing.assert_array_equal(back.restored[3].embedding, emb(4))
    assert all(0 <= p.age_s < 60 for p in back.restored) and back.lost_at_open == 0
    assert len(back) == 4
    with pytest.raises(ValueError, match="full"):
        back.park("s5", emb(5), predicted=0)
    back.release("s0")
    back.park("s5", emb(5), predicted=0)
    back.flush()
    assert [p.id for p in PendingFile(tmp_path, 4, D).restored] == ["s2", "s3", "s4", "s5"]


def test_durable_pending_file_torn_slot_is_counted_not_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pf = PendingFile(tmp_path, 3, D)
    for i in range(3):
        pf.park(f"s{i}", emb(i), predicted=0)
    pf.flush()
    del pf
    size = slot_dtype(D).itemsize
    with (tmp_path / PENDING_FILE).open("r+b") as fh:  # a flipped bit in slot 1's embedding
        fh.seek(HEADER_BYTES + size + size - 3)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x10]))
    with caplog.at_level(logging.WARNING):
        back = PendingFile(tmp_path, 3, D)
    assert [p.id for p in back.restored] == ["s0", "s2"] and back.lost_at_open == 1
    assert "1 waiting sample(s) could not be recovered" in caplog.text
    back.park("s9", emb(9), predicted=0)  # the torn slot is free again
    assert len(back) == 3


def test_durable_pending_file_of_another_shape(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pf = PendingFile(tmp_path, 4, D)
    for i in range(4):
        pf.park(f"s{i}", emb(i), predicted=0)
    del pf
    with caplog.at_level(logging.WARNING):
        smaller = PendingFile(tmp_path, 2, D)  # source.pending_max lowered: the newest that fit stay
    assert [p.id for p in smaller.restored] == ["s2", "s3"]
    assert "built for 4 slots, source.pending_max is 2" in caplog.text
    assert [p.id for p in PendingFile(tmp_path, 2, D).restored] == ["s2", "s3"]
    other = PendingFile(tmp_path, 2, D + 1)  # another model: its embeddings are of no use
    assert other.restored == [] and (tmp_path / (PENDING_FILE + ".corrupt")).exists()


def test_durable_ingest_pending_table_survives_a_restart(tmp_path: Path) -> None:
    now = [100.0]
    ing = Ingest(4, 8, 10.0, clock=lambda: now[0], pending_file=PendingFile(tmp_path, 8, D))
    for i in range(3):
        ing.offer_sample(Sample(f"s{i}", np.zeros((1,), np.uint8)))
    for row in ing.take(3):
        ing.settle(row.id, emb(int(row.id[1])), predicted=7)
    ing.offer_label(Label("s0", 2))  # stored before the restart: not waiting any more
    assert ing.take_labelled() is not None and ing.pending == 2
    del ing

    now[0] = 5.0  # another process: another monotonic origin
    back = Ingest(4, 8, 10.0, clock=lambda: now[0], pending_file=PendingFile(tmp_path, 8, D))
    assert (back.pending, back.restored) == (2, 2)
    # the app sends s1 again after the restart (ids are remembered per process): classified again, it
    # takes the restored one's place (one entry, one slot)
    back.offer_sample(Sample("s1", np.zeros((1,), np.uint8)))
    (row,) = back.take(1)
    back.settle(row.id, emb(1), predicted=5)
    assert back.pending == 2
    back.offer_label(Label("s2", 4))
    got = back.take_labelled()
    assert got is not None
    np.testing.assert_array_equal(got[0], emb(2)[None])
    assert (got[1].tolist(), got[2].tolist()) == ([4], [7])
    with pytest.raises(UpdateRejected) as gone:
        back.offer_label(Label("s0", 2))
    assert gone.value.reason == "unknown_sample"
    assert [(p.id, p.predicted) for p in PendingFile(tmp_path, 8, D).restored] == [("s1", 5)]
    now[0] = 16.0  # label_expiry_s after s1 was parked again: it expires (the file lets it go too)
    assert back.expire() == 1 and back.counters.pending_expired == 1
    assert PendingFile(tmp_path, 8, D).restored == []


@pytest.mark.broker
@pytest.mark.subprocess
def test_durable_pending_labels_survive_sigterm_and_kill9(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """40 samples fed without labels, then a stop (SIGTERM for the first 20, SIGKILL for the next
    20) before their labels: restarted, the agent matches every label and stores every sample."""
    x, y = load_digits()
    extra = {"training__holdout_every": "0", "broker__session_expiry_s": "0"}  # labels sent once back

    def start() -> subprocess.Popen[bytes]:
        proc = start_ingest_agent(mosquitto, fleet, tmp_path, "dev-l", **extra)
        agents.append(proc)
        return proc

    async def run(ids: range, stop: str, stored_before: int) -> dict[str, object]:
        async with Gateway(mosquitto, fleet, "dev-l") as gw:
            proc = start()
            await gw.ready()
            for i in ids:
                await gw.sample(Sample(f"p{i}", x[i]))
            await gw.until(f"{len(ids)} waiting", pending_labels=len(ids), store_samples=stored_before)
            if stop == "term":
                proc.terminate()
            else:
                proc.kill()
            assert proc.wait(30) in (0, -9)
            await wait_until(lambda: gw.status.get("state") == "offline", 30, "the agent gone")
            gw.status = {}
            start()
            await gw.until("back with its waiting samples", ready=True, pending_labels=len(ids))
            for i in ids:
                await gw.label(f"p{i}", int(y[i]))
            want = stored_before + len(ids)
            return await gw.until(f"{want} stored", store_samples=want, labels_received=len(ids), rejected={})

    asyncio.run(run(range(20), "term", 0))
    agents[-1].terminate()
    agents[-1].wait(30)
    st = asyncio.run(run(range(20, 40), "kill", 20))
    assert (st["pending_labels"], st["stored_total"]) == (0, 20)


def test_durable_pending_file_cut_short_recovers_its_whole_slots(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pf = PendingFile(tmp_path, 4, D)
    for i in range(4):
        pf.park(f"s{i}", emb(i), predicted=i)
    del pf
    path = tmp_path / PENDING_FILE
    os.truncate(path, path.stat().st_size - 100)  # `truncate -s -100`: slot 3 is cut
    with caplog.at_level(logging.WARNING):
        back = PendingFile(tmp_path, 4, D)
    assert [(p.id, p.predicted) for p in back.restored] == [("s0", 0), ("s1", 1), ("s2", 2)]
    assert "cut short: 3 of its 4 slots are whole" in caplog.text
    assert "1 slot(s) lost with the file's missing tail" in caplog.text
    assert (tmp_path / (PENDING_FILE + ".corrupt")).exists()
    assert path.stat().st_size == HEADER_BYTES + 4 * slot_dtype(D).itemsize
    back.park("s9", emb(9), predicted=0)
    assert [p.id for p in PendingFile(tmp_path, 4, D).restored] == ["s0", "s1", "s2", "s9"]


def test_durable_pending_file_half_created_header_only_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    PendingFile(tmp_path, 4, D).park("s0", emb(0), predicted=0)
    path = tmp_path / PENDING_FILE
    os.truncate(path, HEADER_BYTES)  # a crash between writing the header and sizing the file
    with caplog.at_level(logging.WARNING):
        back = PendingFile(tmp_path, 4, D)
    assert back.restored == [] and len(back) == 0
    assert "cut short: 0 of its 4 slots are whole" in caplog.text
    assert "4 slot(s) lost with the file's missing tail" in caplog.text
    back.park("s1", emb(1), predicted=2)
    assert [p.id for p in PendingFile(tmp_path, 4, D).restored] == ["s1"]


def test_hostile_pending_file_duplicate_ids_keep_the_newest_slot(tmp_path: Path) -> None:
    pf = PendingFile(tmp_path, 4, D)
    pf.park("dup", emb(1), predicted=1)
    pf.park("other", emb(2), predicted=2)
    pf.flush()
    del pf
    path = tmp_path / PENDING_FILE
    size = slot_dtype(D).itemsize
    raw = bytearray(path.read_bytes())
    slot0 = raw[HEADER_BYTES : HEADER_BYTES + size]
    # a second, valid copy of slot 0 in slot 2 with a newer seq (CRC recomputed)
    row = np.frombuffer(bytes(slot0), dtype=slot_dtype(D)).copy()
    row["predicted"] = 7
    seq = 5
    body = row.tobytes()
    row["crc"] = zlib.crc32(seq.to_bytes(8, "little"), zlib.crc32(body[12:]))
    row["seq"] = seq + 1
    raw[HEADER_BYTES + 2 * size : HEADER_BYTES + 3 * size] = row.tobytes()
    path.write_bytes(bytes(raw))
    back = PendingFile(tmp_path, 4, D)
    assert [(p.id, p.predicted) for p in back.restored] == [("other", 2), ("dup", 7)]
    assert len(back) == 2
    back.release("dup")  # the extra copy was freed too: nothing of "dup" comes back
    for i in range(3):
        back.park(f"n{i}", emb(i), predicted=0)  # 3 free slots: the old copy's slot is one
    assert sorted(p.id for p in PendingFile(tmp_path, 4, D).restored) == ["n0", "n1", "n2", "other"]


def test_durable_agent_starts_on_a_pending_file_cut_short(
    mosquitto: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    """A real agent killed with 10 samples waiting; its pending file then loses its last 100 bytes
    (``truncate -s -100``): it starts, with the 10 waiting samples. Killed again and cut to its header
    (a crash while the file was made): it starts with none."""
    x, _ = load_digits()
    extra = {"training__holdout_every": "0", "broker__session_expiry_s": "0"}
    path = tmp_path / "dev-t" / PENDING_FILE

    def start() -> subprocess.Popen[bytes]:
        proc = start_ingest_agent(mosquitto, fleet, tmp_path, "dev-t", **extra)
        agents.append(proc)
        return proc

    async def main() -> None:
        async with Gateway(mosquitto, fleet, "dev-t") as gw:
            proc = start()
            await gw.ready()
            for i in range(10):
                await gw.sample(Sample(f"t{i}", x[i]))
            await gw.until("10 waiting", pending_labels=10)
            proc.kill()
            assert proc.wait(30) == -9
            await wait_until(lambda: gw.status.get("state") == "offline", 30, "the agent gone")
            os.truncate(path, path.stat().st_size - 100)
            gw.status = {}
            proc = start()
            await gw.until("back with its waiting samples", ready=True, pending_labels=10)
            assert proc.poll() is None
            proc.kill()
            assert proc.wait(30) == -9
            await wait_until(lambda: gw.status.get("state") == "offline", 30, "the agent gone again")
            os.truncate(path, HEADER_BYTES)
            gw.status = {}
            proc = start()
            await gw.until("back with nothing waiting", ready=True, pending_labels=0)
            assert proc.poll() is None

    asyncio.run(main())
    log = (tmp_path / "dev-t.log").read_text()
    assert "cut short:" in log and "set aside as *.corrupt" in log and "Traceback" not in log, log
