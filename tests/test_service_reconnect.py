"""The coordinator after its broker comes back: what it owns retained is published again, /healthz tells.

Real ``edgefl coordinator`` and ``edgefl run`` processes on a mosquitto of the test's own (it is
stopped, killed and restarted), with persistence as ``docs/operations.md`` configures it.
"""

from __future__ import annotations

import signal
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port, restart_mosquitto, start_mosquitto, stop_broker
from test_service import start_coordinator, wait_for

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.history import RoundRecord
from edgefl.coordinator.roundlog import log_entry, round_line
from edgefl.coordinator.rounds import Round
from edgefl.coordinator.service import Coordinator
from edgefl.topics import Topics
from edgefl.transport import MqttTransport

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


def test_durable_round_names_the_devices_that_never_answered() -> None:
    """A round asks a, b, c (online at the opening) and d (selected); what it counted or was declined
    leaves the silent ones, sorted."""
    rnd = Round(4, 3, (4, 2), 30.0, 1, online=frozenset({"c", "a", "b"}))
    rnd.devices.append("a")
    rnd.update_ids.add("a:4:3")
    rnd.declined.append("c")
    assert rnd.silent() == ["b"]
    picked = Round(4, 3, (4, 2), 30.0, 1, selected=frozenset({"d", "b"}), online=frozenset({"a"}))
    assert picked.silent() == ["b", "d"]


def test_durable_round_line_names_the_silent_devices_the_first_ten() -> None:
    rec = RoundRecord(8, 1, float("nan"), 900.0, 30.0, asked=2)
    line = round_line(rec, 0, {}, {}, silent=["gw-2"])
    assert line == (
        "round 8: 1/2 clients, refused: none, accuracy n/a, 900 B/update, 30.00 s, no answer from gw-2"
    )
    many = [f"gw-{k:02d}" for k in range(12)]
    assert round_line(rec, 0, {}, {}, silent=many).endswith(
        "no answer from gw-00, gw-01, gw-02, gw-03, gw-04, gw-05, gw-06, gw-07, gw-08, gw-09 (+2 more)"
    )
    assert round_line(rec, 0, {}, {}).endswith("30.00 s")


def test_durable_round_log_and_page_record_the_silent_devices() -> None:
    """The round log's line and the page's round record name the devices asked that sent nothing."""
    W, b = np.zeros((4, 2), np.float32), np.zeros(2, np.float32)
    strategy = FedAvg()
    coord = Coordinator(
        MqttTransport("127.0.0.1", 1883, "never-started"), Topics("edgefl", "f"), W, b,
        model_sha256="0" * 64, strategy=strategy,
    )  # fmt: skip
    rnd = Round(1, 0, (4, 2), 30.0, 1, online=frozenset({"gw-1", "gw-2", "gw-3"}))
    rnd.devices.append("gw-1")
    rnd.update_ids.add("gw-1:1:0")
    rnd.close()
    coord.state.current = rnd
    rec = RoundRecord(1, 1, float("nan"), 900.0, 30.0, asked=3)
    coord.state.history.append(rec)
    entry = log_entry(coord, rec, strategy, {}, {})
    assert (entry["silent"], entry["silent_devices"]) == (["gw-2", "gw-3"], 2), entry
    coord.note_round_reasons(1, {}, {})
    (page,) = coord.dashboard_rounds()
    assert (page["silent"], page["silent_devices"], page["declined"]) == (["gw-2", "gw-3"], 2, {}), page
    assert log_entry(coord, RoundRecord(2, 0, float("nan"), 0.0, 1.0), strategy, {}, {})["silent"] == []
