"""The coordinator after its broker comes back: what it owns retained is published again, /healthz tells.

Real ``edgefl coordinator`` and ``edgefl run`` processes on a mosquitto of the test's own (it is
stopped, killed and restarted), with persistence as ``docs/operations.md`` configures it.
"""

from __future__ import annotations

import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, restart_mosquitto, start_mosquitto, stop_broker
from test_service import start_coordinator, wait_for

pytestmark = pytest.mark.timeout(300)


def _status(port: int) -> dict[str, object]:
    import json

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5) as r:
        doc: dict[str, object] = json.loads(r.read())["status"]
    return doc


def _healthz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.broker
@pytest.mark.subprocess
def test_durable_coordinator_healthz_503_while_the_broker_is_down(tmp_path: Path) -> None:
    """The coordinator's ``/healthz`` answers 200 ``ok`` with its broker, 503 ``broker unreachable:
    HOST:PORT`` (its status's ``health``) while the broker is stopped, and 200 again once it is back."""
    broker = start_mosquitto(tmp_path)
    port = free_port()
    coord = start_coordinator(
        tmp_path, "coordinator", broker, "healthz", "dashboard.enabled=true", f"dashboard.port={port}"
    )
    try:
        wait_for(lambda: _healthz(port) == (200, "ok\n"), 90, "healthz ok", [coord], tmp_path)
        assert _status(port)["health"] == "ok"
        stop_broker(broker)
        where = f"{broker.host}:{broker.port}"
        wait_for(lambda: _healthz(port)[0] == 503, 30, "healthz 503", [coord], tmp_path)
        assert _healthz(port) == (503, f"broker unreachable: {where}\n")
        st = _status(port)
        assert (st["health"], st["broker_connected"]) == (f"broker unreachable: {where}", False), st
        broker = restart_mosquitto(broker)
        wait_for(lambda: _healthz(port) == (200, "ok\n"), 60, "healthz ok again", [coord], tmp_path)
        coord.send_signal(signal.SIGTERM)
        assert coord.wait(timeout=30) == 0
    finally:
        if coord.poll() is None:
            coord.kill()
            coord.wait()
        stop_broker(broker)
