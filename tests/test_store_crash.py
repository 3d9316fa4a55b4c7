"""The store's capacity change survives a ``kill -9`` at every step of moving the rebuilt files in.

A profile whose ``store.capacity`` changed rebuilds the store under ``.resize/`` and renames its files
over the old ones one by one. A process killed (SIGKILL, a real kill of a real process) between two of
those renames left a store whose files disagreed with its metadata: the next open set the whole store
aside and started empty, a ``kill -9`` wiping the device's samples.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edgefl.agent.store import RESIZE_DIR, EmbeddingStore

pytestmark = pytest.mark.timeout(120)

OLD, NEW, DIM, K = 64, 32, 8, 10
ROUNDS, BATCH = 10, 20  # 200 samples stored in a ring of 64, flushed after each batch

# a child that opens the store at the new capacity and kills itself with SIGKILL right after the
# resize's rename number argv[2] (the renames of files under .resize/: the rebuilt metadata's own
# atomic write, then the moves of the embeddings, labels, rows and metadata)
_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from edgefl.agent.store import EmbeddingStore
    done, real = 0, os.replace
    def replace(src, dst):
        global done
        real(src, dst)
        if ".resize" in str(src):
            done += 1
            if done == int(sys.argv[2]):
                os.kill(os.getpid(), signal.SIGKILL)
    os.replace = replace
    EmbeddingStore(Path(sys.argv[1]), {new}, {dim}, {k})
    """
).format(new=NEW, dim=DIM, k=K)


def _fill(directory: Path) -> None:
    store = EmbeddingStore(directory, OLD, DIM, K)
    rng = np.random.default_rng(0)
    for i in range(ROUNDS):
        emb = rng.standard_normal((BATCH, DIM)).astype(np.float32)
        store.add(emb, (np.arange(BATCH, dtype=np.int64) + i) % K)
        store.flush()


def _contents(store: EmbeddingStore) -> tuple[np.ndarray, np.ndarray]:
    emb, lbl = np.empty((len(store), DIM), np.float32), np.empty(len(store), np.int64)
    store.read(np.arange(len(store), dtype=np.int64), emb, lbl)
    return emb, lbl


@pytest.mark.subprocess
@pytest.mark.parametrize("kill_after", [1, 2, 3, 4, 5])
def test_durable_store_resize_killed_mid_move_keeps_the_newest_samples(
    tmp_path: Path, kill_after: int
) -> None:
    expected_dir, killed_dir = tmp_path / "expected", tmp_path / "killed"
    _fill(expected_dir)
    _fill(killed_dir)
    expected = EmbeddingStore(expected_dir, NEW, DIM, K)  # the resize no kill interrupted
    want_emb, want_lbl = _contents(expected)
    assert len(expected) == NEW

    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(killed_dir), str(kill_after)], capture_output=True, text=True
    )
    assert child.returncode == -9, child.stderr  # really killed part-way

    store = EmbeddingStore(killed_dir, NEW, DIM, K)
    assert len(store) == NEW
    emb, lbl = _contents(store)
    np.testing.assert_array_equal(lbl, want_lbl)
    np.testing.assert_array_equal(emb, want_emb)
    assert not (killed_dir / RESIZE_DIR).exists()
    assert not list(killed_dir.glob("*.corrupt"))


def test_durable_store_torn_metadata_says_so_once_and_keeps_the_samples(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Both metadata files torn: one line names them; the rows' checksums give the samples back."""
    _fill(tmp_path)
    for name in ("store_meta.rec", "store_meta.rec.prev"):
        path = tmp_path / name
        path.write_bytes(path.read_bytes()[:37])  # cut inside the header
    with caplog.at_level("WARNING"):
        store = EmbeddingStore(tmp_path, OLD, DIM, K)
    named = [r for r in caplog.records if "store_meta.rec" in r.getMessage()]
    assert len(named) == 1, [r.getMessage() for r in named]
    assert "torn or corrupt" in named[0].getMessage()
    assert (len(store), store.total) == (OLD, ROUNDS * BATCH)
    # the samples stay in place; only the two torn metadata files are kept aside for a look
    kept = sorted(p.name for p in tmp_path.glob("*.corrupt"))
    assert kept == ["store_meta.rec.corrupt", "store_meta.rec.prev.corrupt"]
