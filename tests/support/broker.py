"""One mosquitto launcher for tests and benches: a real broker on a free 127.0.0.1 port.

``tests/conftest.py`` starts one per test session (per worker under pytest-xdist) with it; the benches
that need a broker (``bench/``) start theirs the same way. The demo embeds amqtt instead (``make demo``
needs no mosquitto binary).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from edgefl.launcher import free_port

__all__ = ["Broker", "mosquitto_path", "restart_mosquitto", "start_mosquitto", "stop_broker"]


def mosquitto_path() -> str:
    path = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )
    if path is None:
        raise RuntimeError("mosquitto not installed: run .ci/run (apt-get install mosquitto)")
    return path


@dataclass
class Broker:
    host: str
    port: int
    proc: subprocess.Popen[bytes]
    conf: Path

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"


def start_mosquitto(tmp: Path, extra: str = "", port: int | None = None) -> Broker:
    """Start a mosquitto on 127.0.0.1 with a config written to ``tmp``; wait until it accepts connections.

    Without ``port``, a free one; if another process (a parallel test worker) takes it first, the broker
    starts again on another (three tries). A broker with ``persistence true`` in ``extra`` run as root keeps
    root's rights (``user root``): mosquitto's own user cannot write under the tests' 0700 folders, and its
    state (sessions, queued messages) was silently lost at every restart.
    """
    if os.geteuid() == 0 and "persistence true" in extra and "\nuser " not in f"\n{extra}":
        extra += "\nuser root"
    for attempt in range(3):
        chosen = port or free_port()
        conf = tmp / f"mosquitto-{chosen}.conf"
        conf.write_text(
            f"listener {chosen} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            f"set_tcp_nodelay true\nlog_dest stderr\n{extra}\n"
        )
        try:
            return _run_mosquitto(tmp, conf, chosen)
        except RuntimeError:
            if port is not None or attempt == 2:
                raise
    raise AssertionError("unreachable")


def restart_mosquitto(b: Broker) -> Broker:
    """Start a stopped broker again: the same configuration file, the same port (its log appended)."""
    return _run_mosquitto(b.conf.parent, b.conf, b.port)


def _run_mosquitto(tmp: Path, conf: Path, port: int) -> Broker:
    log = open(tmp / f"mosquitto-{port}.log", "ab")  # noqa: SIM115 - lives as long as the broker
    proc = subprocess.Popen([mosquitto_path(), "-c", str(conf)], stdout=log, stderr=log)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"mosquitto exited with {proc.returncode}: {(tmp / f'mosquitto-{port}.log').read_text()}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return Broker("127.0.0.1", port, proc, conf)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("mosquitto did not start listening within 10 s")


def stop_broker(b: Broker) -> None:
    b.proc.terminate()
    try:
        b.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        b.proc.kill()
        b.proc.wait()
