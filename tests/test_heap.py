"""Memory given back to the kernel: glibc's free heap and clean read-only file pages, measured."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
from pathlib import Path

import pytest

_RELEASE = r"""
import json, mmap, sys
import numpy as np
from edgefl import heap
from edgefl.agent import memstat
path = sys.argv[1]
with open(path, "r+b") as f:  # a private file mapping with one page written: it holds a private copy
    written = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
written[:5] = b"local"
x = np.arange(1000, dtype=np.float64)
before = memstat.rss_bytes()
released = sum(heap.release_file_pages().values())
after = memstat.rss_bytes()
print(json.dumps({
    "released": released, "dropped": before - after,
    "sum": float(x @ x), "written": bytes(written[:5]).decode(), "rest": bytes(written[5:9]).decode(),
}))
"""


@pytest.mark.subprocess
def test_memory_release_file_pages_drops_clean_library_pages_and_keeps_written_ones(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(b"xxxxxfile" + bytes(mmap.PAGESIZE * 2))
    proc = subprocess.run(
        [sys.executable, "-c", _RELEASE, str(data)], capture_output=True, text=True, timeout=60, check=True
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # numpy's, Python's and libc's code and constants were mapped: dropped, and RSS fell by as much
    # (within a reading's resolution: Linux's per-CPU RSS counters)
    assert out["released"] > 1 << 20
    assert out["dropped"] > out["released"] // 2
    # the code still runs (its pages come back from the page cache), and the page this process wrote
    # in a private mapping kept its own contents (that mapping holds a private copy: left alone)
    assert out["sum"] == sum(float(i * i) for i in range(1000))
    assert (out["written"], out["rest"]) == ("local", "file")


def test_memory_release_file_pages_without_smaps_is_zero(tmp_path: Path) -> None:
    from edgefl import heap

    assert heap.release_file_pages(smaps=str(tmp_path / "missing")) == {}
    assert heap.readonly_file_rss(smaps=str(tmp_path / "missing")) == {}
