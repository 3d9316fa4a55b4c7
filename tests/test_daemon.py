"""Loud agent failures: credentials the broker refuses, a dashboard port in use.

Real agent processes on a real mosquitto with a password file; the agent's own dashboard over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PASSWORD, USER, Broker, Pki, free_port, start_ingest_agent, start_mosquitto, stop_broker
from conftest import wait_until as wait_until_async

from edgefl.cli import EXIT_CREDENTIALS, EXIT_RUNTIME

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def authed_broker(tmp_path: Path, pki: Pki) -> Iterator[Broker]:
    """A mosquitto that takes only ``USER`` / ``PASSWORD`` (the test PKI's password file)."""
    broker = start_mosquitto(
        tmp_path, extra=f"allow_anonymous false\npassword_file {pki.passwd}\nuser root\n"
    )
    try:
        yield broker
    finally:
        stop_broker(broker)


def get(url: str) -> tuple[int, str]:
    """HTTP GET: (status, body); a refused connection is (0, "")."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


def wait_until(cond: object, timeout_s: float, what: str) -> None:
    asyncio.run(wait_until_async(cond, timeout_s, what))  # type: ignore[arg-type]


@pytest.mark.broker  # authed_broker: a mosquitto of its own
def test_loud_auth_refused_credentials_say_so_503_then_exit_5(
    authed_broker: Broker, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    wrong = {"broker__username": USER, "broker__password": "not the password", "dashboard__enabled": "true"}
    # many retries: the page and /healthz are read while it still tries
    patient = start_ingest_agent(
        authed_broker,
        fleet,
        tmp_path,
        "dev-p",
        dashboard__port=str(port),
        broker__auth_retries="1000",
        **wrong,
    )
    agents.append(patient)
    base = f"http://127.0.0.1:{port}"
    seen: dict[str, object] = {}

    def refused() -> bool:
        code, body = get(f"{base}/api/status")
        if code != 200:
            return False
        seen.update(json.loads(body)["status"])
        return seen.get("broker") == "refused: not authorized"

    wait_until(refused, 60, "the page saying the credentials are refused")
    assert seen["broker_connected"] is False and seen["health"] == "refused: not authorized"
    assert seen["reason"] == "refused: not authorized (broker.username / password)"
    assert get(f"{base}/healthz") == (503, "refused: not authorized\n")
    assert patient.poll() is None  # still trying: 1000 refusals allowed

    # three refusals in a row: exit 5, named, no traceback
    quick = start_ingest_agent(
        authed_broker, fleet, tmp_path, "dev-q", dashboard__port="0", broker__auth_retries="3", **wrong
    )
    assert quick.wait(120) == EXIT_CREDENTIALS == 5
    log = (tmp_path / "dev-q.log").read_text()
    assert "refused the credentials 3 times in a row" in log and "Traceback" not in log
    assert log.count("refused: not authorized: broker 127.0.0.1") == 2  # refusals 1 and 2 of 3

    # the right password: connected, healthy
    good = start_ingest_agent(
        authed_broker,
        fleet,
        tmp_path,
        "dev-g",
        dashboard__port=str(port2 := free_port()),
        broker__username=USER,
        broker__password=PASSWORD,
        dashboard__enabled="true",
    )
    agents.append(good)
    assert_connected_and_healthy(port2, "dev-g")


def test_loud_dashboard_port_in_use_is_a_clean_startup_error(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = start_ingest_agent(
            mosquitto, fleet, tmp_path, "dev-d", dashboard__enabled="true", dashboard__port=str(port)
        )
        code = proc.wait(120)
    log = (tmp_path / "dev-d.log").read_text()
    assert code == EXIT_RUNTIME == 4, log
    assert (
        f"edgefl: cannot start: dashboard cannot listen on 127.0.0.1:{port} (dashboard.host / dashboard.port)"
        in log
    )
    assert "Traceback" not in log


def assert_connected_and_healthy(port: int, device: str) -> None:
    """Wait until the agent's page on ``port`` says its broker is connected; its health is then "ok" and
    ``/healthz`` answers 200."""
    status: dict[str, object] = {}

    def connected() -> bool:
        code, body = get(f"http://127.0.0.1:{port}/api/status")
        if code == 200:
            status.update(json.loads(body)["status"])
        return status.get("broker") == "connected"

    wait_until(connected, 60, f"{device} connected")
    assert status["health"] == "ok"
    assert get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
