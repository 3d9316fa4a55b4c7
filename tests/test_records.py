"""Tests of edgefl/records.py (atomic writes, checksummed records with fallback) and the outbox on it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import cbor2
import pytest

from edgefl.agent.outbox import Answered, Dropped, Outbox, OutboxEntry
from edgefl.records import (
    HEADER_BYTES,
    RecordError,
    atomic_write,
    decode_record,
    encode_record,
    prev_path,
    read_record,
    write_record,
)

ROOT = Path(__file__).resolve().parent.parent


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    p = tmp_path / "x.bin"
    atomic_write(p, b"one")
    atomic_write(p, b"two")
    assert p.read_bytes() == b"two"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["x.bin"]


def test_record_roundtrip_and_layout() -> None:
    rec = encode_record(b"hello", generation=7)
    assert len(rec) == HEADER_BYTES + 5 == 61
    assert rec[:4] == b"EFLR"
    assert decode_record(rec) == (7, b"hello")
    assert decode_record(encode_record(b"")) == (0, b"")


def test_write_record_keeps_previous_generation(tmp_path: Path) -> None:
    p = tmp_path / "head.rec"
    assert write_record(p, b"gen0") == 0
    assert write_record(p, b"gen1") == 1
    assert write_record(p, b"gen2") == 2
    assert read_record(p) == b"gen2"
    assert decode_record(prev_path(p).read_bytes(), padded=True) == (1, b"gen1")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["head.rec", "head.rec.prev"]


@pytest.mark.parametrize("writes", [2, 3])
def test_corrupt_torn_write_at_every_offset_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, writes: int
) -> None:
    """The newest (in ``.prev`` after 2 writes, in the file after 3) torn anywhere: the other is read."""
    p = tmp_path / "s.rec"
    for k in range(writes - 1):
        write_record(p, b"the last good state %d" % k)
    last_good = b"the last good state %d" % (writes - 2)
    payload = b"the newest state, about to be torn"
    write_record(p, payload)
    torn = prev_path(p) if writes == 2 else p
    newest = torn.read_bytes()
    for cut in range(HEADER_BYTES + len(payload)):
        torn.write_bytes(newest[:cut])
        with pytest.raises(RecordError):
            decode_record(newest[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="edgefl.records"):
            assert read_record(p) == last_good, cut
        assert "torn or corrupt" in caplog.text and "s.rec.prev" in caplog.text
        assert len(caplog.records) == 1
    torn.write_bytes(newest[: HEADER_BYTES + len(payload)])  # a cut in the zero padding: the record is whole
    assert read_record(p) == payload


def test_corrupt_torn_write_without_previous_returns_none(tmp_path: Path) -> None:
    p = tmp_path / "s.rec"
    write_record(p, b"only generation")
    whole = p.read_bytes()
    for cut in range(HEADER_BYTES + len(b"only generation")):
        p.write_bytes(whole[:cut])
        assert read_record(p) is None


def test_corrupt_bit_flip_anywhere_is_detected(tmp_path: Path) -> None:
    p = tmp_path / "s.rec"
    write_record(p, b"good")
    write_record(p, b"newer payload")  # into s.rec.prev
    newest = prev_path(p).read_bytes()[: HEADER_BYTES + len(b"newer payload")]
    for i in range(len(newest)):
        for bit in range(8):
            flipped = bytearray(newest)
            flipped[i] ^= 1 << bit
            with pytest.raises(RecordError):
                decode_record(bytes(flipped))
    flipped = bytearray(newest)
    flipped[-1] ^= 0x01
    prev_path(p).write_bytes(bytes(flipped))
    assert read_record(p) == b"good"


def test_corrupt_newest_does_not_evict_last_good(tmp_path: Path) -> None:
    p = tmp_path / "s.rec"
    write_record(p, b"good")
    write_record(p, b"newer")
    prev_path(p).write_bytes(b"garbage")  # the newest file (.prev) rots; the last good one is s.rec ("good")
    assert write_record(p, b"newest") == 1  # generation continues from the last good (0) + 1, over the rot
    assert read_record(p) == b"newest"
    assert decode_record(p.read_bytes(), padded=True) == (0, b"good")


def test_corrupt_both_generations_returns_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "s.rec"
    write_record(p, b"a")
    write_record(p, b"b")
    p.write_bytes(b"x")
    prev_path(p).write_bytes(b"y")
    with caplog.at_level(logging.ERROR, logger="edgefl.records"):
        assert read_record(p) is None
    assert "set aside as *.corrupt, starting empty" in caplog.text
    # kept for a look, not overwritten by the next write
    assert (tmp_path / "s.rec.corrupt").read_bytes() == b"x"
    assert (tmp_path / "s.rec.prev.corrupt").read_bytes() == b"y"
    assert write_record(p, b"c") == 0 and read_record(p) == b"c"


def test_corrupt_missing_newest_uses_previous(tmp_path: Path) -> None:
    p = tmp_path / "s.rec"
    write_record(p, b"a")
    write_record(p, b"b")  # into s.rec.prev
    kept = prev_path(p).read_bytes()
    prev_path(p).unlink()
    assert read_record(p) == b"a"
    prev_path(p).write_bytes(kept)
    p.unlink()
    assert read_record(p) == b"b"
    assert read_record(tmp_path / "never-written.rec") is None


@pytest.mark.subprocess
def test_corrupt_recovery_after_kill_mid_write(tmp_path: Path) -> None:
    """A child process writes generations in a loop and is SIGKILLed; the survivor reads a good record."""
    p = tmp_path / "s.rec"
    code = (
        "import sys\nfrom pathlib import Path\nfrom edgefl.records import write_record\n"
        "p = Path(sys.argv[1])\ni = 0\n"
        "while True:\n    write_record(p, (b'%08d' % i) * 4096)\n    i += 1\n"
        "    if i == 3: print('ready', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(p)], cwd=ROOT, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready"
    proc.kill()
    proc.wait()
    payload = read_record(p)
    assert payload is not None and len(payload) == 8 * 4096
    n = int(payload[:8])
    assert n >= 2 and payload == (b"%08d" % n) * 4096


# --- outbox ---------------------------------------------------------------------------------------


def test_outbox_persists_until_ack_and_survives_restart(tmp_path: Path) -> None:
    path = tmp_path / "state" / "outbox.rec"
    box = Outbox(path, max_bytes=1000)
    assert box.add("dev-1:3:2", 3, b"u3") == []
    assert box.add("dev-1:4:3", 4, b"u4-bytes") == []
    assert box.mark_sent("dev-1:3:2") == 1
    assert box.total_bytes == 10 and len(box) == 2
    # restart: a new Outbox on the same file sees both, same ids and payloads, in order
    again = Outbox(path, max_bytes=1000)
    assert again.pending() == [
        OutboxEntry("dev-1:3:2", 3, b"u3", 1),
        OutboxEntry("dev-1:4:3", 4, b"u4-bytes", 0),
    ]
    # a PUBACK, as the device core takes it: forgotten, the outbox written (behind, at its next flush)
    assert again.forget("dev-1:3:2") is True
    assert again.forget("dev-1:3:2") is False
    again.save()
    assert [e.update_id for e in Outbox(path, max_bytes=1000).pending()] == ["dev-1:4:3"]


def test_outbox_same_update_id_is_kept_once(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.rec", max_bytes=100)
    box.add("a:1", 1, b"first")
    assert box.add("a:1", 1, b"second") == []
    assert box.pending() == [OutboxEntry("a:1", 1, b"first", 0)]


def test_outbox_bounded_in_bytes_drops_oldest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    box = Outbox(tmp_path / "o.rec", max_bytes=25)
    assert box.add("u1", 1, b"x" * 10) == []
    assert box.add("u2", 2, b"y" * 10) == []
    with caplog.at_level(logging.WARNING, logger="edgefl.agent.outbox"):
        assert box.add("u3", 3, b"z" * 12) == [Dropped("u1", 1, "outbox_full")]
    assert "outbox full: dropped update u1" in caplog.text
    assert [e.update_id for e in box.pending()] == ["u2", "u3"] and box.total_bytes == 22
    assert box.add("u4", 4, b"w" * 25) == [Dropped("u2", 2, "outbox_full"), Dropped("u3", 3, "outbox_full")]
    assert box.add("big", 5, b"b" * 26) == [Dropped("big", 5, "too_large")]
    assert [e.update_id for e in box.pending()] == ["u4"]
    assert box.total_bytes <= 25


def test_outbox_drop_stale_rounds(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.rec", max_bytes=1000)
    for r in (3, 4, 5):
        box.add(f"d:{r}", r, b"p%d" % r)
    assert box.drop_stale(5) == [Dropped("d:3", 3, "stale_round"), Dropped("d:4", 4, "stale_round")]
    assert box.drop_stale(5) == []
    assert [e.round for e in Outbox(tmp_path / "o.rec", max_bytes=1000).pending()] == [5]


def test_outbox_rejects_bad_ids_and_bounds(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        Outbox(tmp_path / "o.rec", max_bytes=0)
    box = Outbox(tmp_path / "o.rec", max_bytes=10)
    with pytest.raises(ValueError, match="update_id"):
        box.add("has space", 1, b"x")
    with pytest.raises(ValueError, match="round"):
        box.add("ok", -1, b"x")


def test_outbox_corrupt_file_falls_back_to_previous_generation(tmp_path: Path) -> None:
    path = tmp_path / "o.rec"
    box = Outbox(path, max_bytes=1000)
    box.add("a", 1, b"A")
    box.add("b", 1, b"B")
    # written in place in turn (write_record): o.rec holds generation 0 (a), o.rec.prev generation 1 (a, b)
    assert decode_record(path.read_bytes(), padded=True)[0] == 0
    newest = prev_path(path)
    assert decode_record(newest.read_bytes(), padded=True)[0] == 1
    assert [e.update_id for e in Outbox(path, max_bytes=1000).pending()] == ["a", "b"]
    data = bytearray(newest.read_bytes())
    data[HEADER_BYTES] ^= 0xFF  # a payload byte of the newest generation
    newest.write_bytes(bytes(data))
    assert [e.update_id for e in Outbox(path, max_bytes=1000).pending()] == ["a"]


def test_outbox_unknown_layout_starts_empty(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "o.rec"
    write_record(path, b"\xa1\x61v\x02")  # a good record holding {"v": 2}
    with caplog.at_level(logging.ERROR, logger="edgefl.agent.outbox"):
        assert len(Outbox(path, max_bytes=10)) == 0
    assert "unknown layout" in caplog.text


def test_outbox_answered_round_goes_with_the_update_and_every_later_write(tmp_path: Path) -> None:
    """The answered-round map is written by the same write that keeps the update, and kept by every
    later write (send count, PUBACK, stale drop) and across a restart; a failed write leaves the
    previous one (the round is then not answered)."""
    path = tmp_path / "o.rec"
    a1 = Answered("f", 1, "d:1:0")
    box = Outbox(path, max_bytes=100)
    assert box.add("d:1:0", 1, b"u1", sends=1, answered=a1) == []
    assert decode_record(path.read_bytes(), padded=True)[0] == 0  # one write (generation 0) kept both
    assert Outbox(path, max_bytes=100).answered == a1
    box.mark_sent("d:1:0")
    box.forget("d:1:0")
    box.save()
    assert box.drop_stale(5) == []
    again = Outbox(path, max_bytes=100)
    assert (again.pending(), again.answered) == ([], a1)
    # an update too large to keep still records its round as answered; the same id again too
    a2 = Answered("f", 2, "d:2:0")
    assert again.add("d:2:0", 2, b"x" * 101, answered=a2) == [Dropped("d:2:0", 2, "too_large")]
    assert Outbox(path, max_bytes=100).answered == a2
    # a write that fails keeps the previous answered round, in memory and on disk
    a3 = Answered("f", 3, "d:3:0")
    tmps = [p.with_name(p.name + ".tmp") for p in (path, prev_path(path))]
    for tmp in tmps:
        tmp.mkdir()  # the atomic write's temporary file cannot be created (either slot): an OSError
    with pytest.raises(OSError):
        again.add("d:3:0", 3, b"u3", answered=a3)
    for tmp in tmps:
        tmp.rmdir()
    assert again.answered == a2 and Outbox(path, max_bytes=100).answered == a2


def test_outbox_record_with_a_bad_answered_map_is_an_unknown_layout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "o.rec"
    write_record(path, cbor2.dumps({"v": 1, "entries": [], "answered": [1, 2]}))
    with caplog.at_level(logging.ERROR, logger="edgefl.agent.outbox"):
        box = Outbox(path, max_bytes=10)
    assert (len(box), box.answered) == (0, None) and "unknown layout" in caplog.text


def test_outbox_write_is_durable_file_is_a_record(tmp_path: Path) -> None:
    path = tmp_path / "o.rec"
    Outbox(path, max_bytes=100).add("a", 0, b"payload")
    gen, payload = decode_record(path.read_bytes(), padded=True)
    assert gen == 0 and b"payload" in payload
    assert not any(f.name.endswith(".tmp") for f in tmp_path.iterdir())
    # zero-padded to whole 4 KiB blocks (later writes overwrite it in place)
    assert os.stat(path).st_size == 4096
    assert path.read_bytes()[HEADER_BYTES + len(payload) :] == bytes(4096 - HEADER_BYTES - len(payload))
    with pytest.raises(RecordError, match="bad_length"):  # padding is only accepted when asked for
        decode_record(path.read_bytes())


def test_one_atomic_writer_for_every_file_the_product_replaces() -> None:
    """``edgefl.records.atomic_write`` is the only place that renames a file into place (issue 12 item 5)."""
    from conftest import ROOT

    offenders = []
    for folder in ("agent", "coordinator", "dashboard", "edgefl", "cross_build"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "edgefl" / "records.py" or path.is_symlink():
                continue
            text = path.read_text()
            for needle in ("os.replace(", "os.rename(", ".rename(", "NamedTemporaryFile("):
                if needle in text:
                    offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert offenders == []


# --- records rewritten in place, in turn -----------------------------------------------------------------


def test_write_record_writes_in_turn_in_place_and_never_over_the_newest(tmp_path: Path) -> None:
    path, prev = tmp_path / "r.rec", prev_path(tmp_path / "r.rec")
    assert read_record(path) is None
    assert [write_record(path, b"g0"), write_record(path, b"g1")] == [0, 1]  # first of each file: atomic
    assert decode_record(path.read_bytes(), padded=True) == (0, b"g0")
    assert decode_record(prev.read_bytes(), padded=True) == (1, b"g1")
    inodes = (path.stat().st_ino, prev.stat().st_ino)
    assert write_record(path, b"g2-longer") == 2  # over the older one (r.rec), in place: same file, same size
    assert (path.stat().st_ino, prev.stat().st_ino) == inodes and path.stat().st_size == 4096
    assert decode_record(prev.read_bytes(), padded=True) == (1, b"g1")  # the newest before it, untouched
    assert read_record(path) == b"g2-longer"  # reads both again, as a new process would
    assert write_record(path, b"g3") == 3 and read_record(path) == b"g3"
    assert write_record(path, b"g4") == 4  # after a read: each file replaced whole once more
    assert decode_record(path.read_bytes(), padded=True) == (4, b"g4") and read_record(path) == b"g4"
    # a record longer than a block grows the file; a short one after it is zero-padded to its size
    assert write_record(path, bytes(range(256)) * 20) == 5 and prev.stat().st_size == 8192
    inode = prev.stat().st_ino
    assert write_record(path, b"g6") == 6 and write_record(path, b"g7") == 7
    assert prev.stat().st_size == 8192 and prev.stat().st_ino == inode and read_record(path) == b"g7"


def test_write_record_torn_write_leaves_the_newest_good_record(tmp_path: Path) -> None:
    """A power cut mid-write tears only the file being written: the reader takes the other one."""
    path = tmp_path / "r.rec"
    write_record(path, b"old")
    write_record(path, b"newest good")  # in r.rec.prev; the next write goes over r.rec
    torn = encode_record(b"the write the power cut tore", 2)
    with open(path, "r+b") as f:  # what an in-place write leaves when cut half-way
        f.write(torn[: len(torn) // 2])
    assert read_record(path) == b"newest good"
    assert write_record(path, b"next") == 2
    assert decode_record(path.read_bytes(), padded=True) == (2, b"next")


def test_write_record_breaks_a_hard_link_in_a_state_dir(tmp_path: Path) -> None:
    """The two names as one file (a hard link): a write in place would overwrite both. The first
    write of each name in a process replaces it."""
    path, prev = tmp_path / "r.rec", prev_path(tmp_path / "r.rec")
    write_record(path, b"only copy")
    os.link(path, prev)
    assert read_record(path) == b"only copy"
    write_record(path, b"next")  # into .prev (not newer than r.rec): a new file
    assert path.stat().st_ino != prev.stat().st_ino
    assert decode_record(path.read_bytes(), padded=True) == (0, b"only copy")
    assert read_record(path) == b"next"


def test_write_record_goes_on_from_a_state_dir_with_the_newest_in_either_file(tmp_path: Path) -> None:
    """Unpadded records, the newest in the file and the one before in ``.prev`` (or the reverse):
    the newest is read and the next write goes over the other one."""
    for newest, older in ((0, 1), (1, 0)):
        path = tmp_path / f"r{newest}.rec"
        files = (path, prev_path(path))
        atomic_write(files[newest], encode_record(b"g1", 1))
        atomic_write(files[older], encode_record(b"g0", 0))
        assert read_record(path) == b"g1"
        assert write_record(path, b"g2") == 2
        assert files[newest].read_bytes() == encode_record(b"g1", 1)
        assert decode_record(files[older].read_bytes(), padded=True) == (2, b"g2")
        assert read_record(path) == b"g2"


def test_write_record_rereads_a_record_replaced_by_another_writer(tmp_path: Path) -> None:
    """A file replaced or removed behind this process's back is read again before a write, so the
    newest good record on disk is never overwritten."""
    path, prev = tmp_path / "r.rec", prev_path(tmp_path / "r.rec")
    for k in range(4):
        write_record(path, b"g%d" % k)  # g3 newest, in r.rec.prev
    atomic_write(prev, encode_record(b"elsewhere", 9))  # another writer's newer generation
    assert write_record(path, b"g10") == 10
    assert decode_record(prev.read_bytes()) == (9, b"elsewhere") and read_record(path) == b"g10"
    path.unlink()  # the newest gone: .prev (9) is the newest good record, r.rec written whole
    assert write_record(path, b"g11") == 10 and read_record(path) == b"g11"
    assert decode_record(prev.read_bytes()) == (9, b"elsewhere")


def test_write_record_many_records_each_goes_on_in_turn(tmp_path: Path) -> None:
    """More records than a process keeps track of: a forgotten one is read again and goes on in turn."""
    paths = [tmp_path / f"r{k}.rec" for k in range(100)]
    for turn in range(3):
        for k, path in enumerate(paths):
            assert write_record(path, b"%d-%d" % (k, turn)) == turn
    for k, path in enumerate(paths):
        assert read_record(path) == b"%d-2" % k
        assert decode_record(prev_path(path).read_bytes(), padded=True) == (1, b"%d-1" % k)
