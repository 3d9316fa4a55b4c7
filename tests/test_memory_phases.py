"""Each phase's own high-water mark (``phase_rise``) beside the absolute phase peaks and the lifetime peak.

The device page shows both: phases that run on the same resident base have absolute peaks a few KiB
apart, while their rises above the RSS they started at tell them apart.
"""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest

from edgefl.agent import memstat
from edgefl.agent.governor import Governor
from edgefl.agent.memstat import MIB


def touch(nbytes: int, hold_s: float = 0.0) -> None:
    """Make ``nbytes`` of new anonymous memory resident for ``hold_s``, then give it back.

    An mmap of its own: never heap pages that were resident already, so the rise is all of it.
    """
    block = mmap.mmap(-1, nbytes)
    np.frombuffer(block, dtype=np.uint8)[:] = 1
    time.sleep(hold_s)  # the sampling fallback sees what lives long enough
    block.close()


def test_console_phase_rise_tells_phases_apart_and_keeps_the_lifetime_peak() -> None:
    gov = Governor(1 << 40, 0, 0)
    if gov.peak_method != "clear_refs":
        pytest.skip(f"/proc/self/clear_refs not writable here (peak method {gov.peak_method})")
    with gov.phase("warm"):
        pass
    with gov.phase("small"):
        touch(8 * MIB)
    with gov.phase("large"):
        touch(40 * MIB)
    with gov.phase("none"):
        pass
    rise = gov.status()["phase_rise"]
    assert 7 * MIB <= rise["small"] < 8 * MIB + 4 * MIB
    assert 39 * MIB <= rise["large"] < 40 * MIB + 4 * MIB
    assert 0 <= rise["none"] < 2 * MIB
    # the absolute peaks stay (lifetime, never hidden by the per-phase reset)
    assert gov.peak_rss_bytes >= gov.phase_peaks["large"] >= memstat.rss_bytes() + 30 * MIB


def test_console_phase_rise_keeps_the_largest_run() -> None:
    gov = Governor(1 << 40, 0, 0, peak_method="sampling", sample_interval_s=0.001)
    with gov.phase("train"):
        pass
    first = gov.phase_rise["train"]
    with gov.phase("train"):
        touch(24 * MIB, hold_s=0.05)
    with gov.phase("train"):
        pass
    assert gov.phase_rise["train"] >= max(first, 23 * MIB)
    assert gov.phase_last["train"] < gov.phase_peaks["train"]
