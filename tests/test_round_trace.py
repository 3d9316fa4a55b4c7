"""bench/round_trace.py: its probes wrap methods that exist (a rename in the product breaks the bench)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess


def test_round_trace_probes_find_every_method_they_wrap() -> None:
    """Installed in a child (they patch the modules for good): no AttributeError on any wrapped name."""
    code = (
        "from bench import round_trace as r\n"
        "r.install_agent_probes()\n"
        "r.install_coordinator_probes()\n"
        "print('installed')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["installed"]
