"""A broker certificate the agent does not trust is a loud failure (agent/daemon.py, agent/reporter.py).

A real TLS mosquitto (the test PKI), real agent processes given the wrong CA or the right one; their
status page and ``/healthz`` over HTTP, their exit code and log.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    PASSWORD,
    USER,
    Broker,
    Pki,
    free_port,
    start_ingest_agent,
    start_mosquitto,
    stop_broker,
    tls_conf,
)
from test_daemon import assert_connected_and_healthy, get, wait_until

from edgefl.cli import EXIT_CREDENTIALS

pytestmark = [pytest.mark.broker, pytest.mark.subprocess, pytest.mark.timeout(180)]

UNTRUSTED = "refused: broker certificate not trusted (certificate verify failed)"


@pytest.fixture
def tls_broker(pki: Pki, tmp_path: Path) -> Iterator[Broker]:
    """A TLS mosquitto with the test PKI's broker certificate (for 127.0.0.1) and password file."""
    b = start_mosquitto(
        tmp_path, extra=tls_conf(pki, pki.server_cert, pki.server_key, require_certificate=False)
    )
    try:
        yield b
    finally:
        stop_broker(b)


def _agent(
    broker: Broker, fleet: str, tmp: Path, dev: str, ca: Path, **extra: str
) -> subprocess.Popen[bytes]:
    return start_ingest_agent(
        broker,
        fleet,
        tmp,
        dev,
        broker__url=f"mqtts://127.0.0.1:{broker.port}",
        broker__ca_file=str(ca),
        broker__username=USER,
        broker__password=PASSWORD,
        **extra,
    )


def test_provision_untrusted_broker_certificate_says_so_503_then_exit_5(
    tls_broker: Broker, pki: Pki, fleet: str, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    patient = _agent(
        tls_broker,
        fleet,
        tmp_path,
        "dev-p",
        pki.other_ca,
        dashboard__enabled="true",
        dashboard__port=str(port),
        broker__auth_retries="1000",  # the page and /healthz are read while it still tries
    )
    agents.append(patient)
    base = f"http://127.0.0.1:{port}"
    seen: dict[str, object] = {}

    def refused() -> bool:
        code, body = get(f"{base}/api/status")
        if code == 200:
            seen.update(json.loads(body)["status"])
        return seen.get("broker") == UNTRUSTED

    wait_until(refused, 60, "the page saying the broker's certificate is not trusted")
    assert seen["broker_connected"] is False and seen["health"] == UNTRUSTED
    assert seen["reason"] == f"{UNTRUSTED}: self-signed certificate in certificate chain (broker.ca_file)"
    assert get(f"{base}/healthz") == (503, f"{UNTRUSTED}\n")
    assert patient.poll() is None  # still trying: 1000 refusals allowed

    # three in a row: exit 5 (the unit does not restart it), named, no traceback
    quick = _agent(tls_broker, fleet, tmp_path, "dev-q", pki.other_ca, broker__auth_retries="3")
    assert quick.wait(120) == EXIT_CREDENTIALS == 5
    log = (tmp_path / "dev-q.log").read_text()
    assert "Traceback" not in log
    assert (
        f"edgefl: broker 127.0.0.1:{tls_broker.port}: its TLS certificate was not trusted 3 times in a row "
        "(self-signed certificate in certificate chain): check broker.ca_file" in log
    )
    line = f"{UNTRUSTED}: broker 127.0.0.1:{tls_broker.port}: its certificate is not trusted"
    assert log.count(line) == 2  # refusals 1 and 2 of 3 at ERROR

    # the right CA: connected and healthy
    port2 = free_port()
    good = _agent(
        tls_broker, fleet, tmp_path, "dev-g", pki.ca, dashboard__enabled="true", dashboard__port=str(port2)
    )
    agents.append(good)
    assert_connected_and_healthy(port2, "dev-g")


def test_provision_broker_certificate_for_another_host_is_not_trusted(
    pki: Pki, tmp_path: Path, fleet: str
) -> None:
    """The right CA, but a certificate whose subjectAltName names another address: refused the same way."""
    (tmp_path / "wrong").mkdir()
    wrong_name = start_mosquitto(
        tmp_path / "wrong",
        extra=tls_conf(pki, pki.wrong_name_cert, pki.wrong_name_key, require_certificate=False),
    )
    try:
        proc = _agent(wrong_name, fleet, tmp_path, "dev-n", pki.ca, broker__auth_retries="2")
        assert proc.wait(120) == EXIT_CREDENTIALS
    finally:
        stop_broker(wrong_name)
    log = (tmp_path / "dev-n.log").read_text()
    assert (
        "its TLS certificate was not trusted 2 times in a row "
        "(IP address mismatch, certificate is not valid for '127.0.0.1'.)" in log
    ), log[-2000:]
    assert "Traceback" not in log
