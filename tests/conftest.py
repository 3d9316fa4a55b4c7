"""Shared fixtures: a real mosquitto broker on 127.0.0.1, unique topic prefixes, the shipped models."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from edgefl.demo import free_port

__all__ = ["free_port"]  # the one free_port (tests, bench and the demo share it)

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
FLOAT_MODEL = MODELS / "digits_cnn_float32.tflite"
INT8_MODEL = MODELS / "digits_cnn_int8.tflite"
DEV_PROFILE = ROOT / "firmware_configs" / "dev_x86.toml"


async def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``cond`` every 20 ms for up to ``timeout_s``; AssertionError naming ``what`` if it stays false."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


#: Status interval of test agents (profile key status.interval_s): a wait for a fresh status is short.
TEST_STATUS_INTERVAL_S = "0.2"


async def next_status(coord: Any, device: str, timeout_s: float = 15.0) -> dict[str, Any]:
    """Wait until ``coord`` (a Coordinator) holds a status of ``device`` newer than the one it holds now.

    Each received status replaces the device's entry by a new dict, so identity tells a new one.
    """
    before = coord.state.devices.get(device)
    await wait_until(
        lambda: coord.state.devices.get(device) is not None and coord.state.devices.get(device) is not before,
        timeout_s,
        f"a new status from {device}",
    )
    return dict(coord.state.devices[device])


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
    """Start a mosquitto on 127.0.0.1 with a config written to ``tmp``; wait until it accepts connections."""
    port = port or free_port()
    conf = tmp / f"mosquitto-{port}.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        f"set_tcp_nodelay true\nlog_dest stderr\n{extra}\n"
    )
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


@pytest.fixture(scope="session")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One real mosquitto broker for the whole session, on a free 127.0.0.1 port."""
    b = start_mosquitto(tmp_path_factory.mktemp("mosquitto"))
    yield b
    stop_broker(b)


@pytest.fixture
def fleet() -> str:
    """A unique fleet name, so each test has its own topic space on the shared broker."""
    return f"t{uuid.uuid4().hex[:10]}"


def start_replay_agent(
    broker: Broker, fleet: str, tmp: Path, dev: str, x: Any, y: Any, **extra: str
) -> subprocess.Popen[bytes]:
    """Start a real agent process (dev profile, int8 model) replaying x, y; its log is tmp/<dev>.log."""
    import numpy as np

    from edgefl.demo import launch_agent

    np.savez(tmp / f"{dev}.npz", x=x, y=y)
    overrides = {
        "device.id": dev,
        "device.fleet": fleet,
        "device.state_dir": str(tmp / dev),
        "broker.url": broker.url,
        "source.kind": "replay",
        "source.path": str(tmp / f"{dev}.npz"),
        "model.path": str(INT8_MODEL),
        "dashboard.enabled": "false",
        "status.interval_s": TEST_STATUS_INTERVAL_S,
        **{k.replace("__", "."): v for k, v in extra.items()},
    }
    return launch_agent(DEV_PROFILE, overrides, tmp / f"{dev}.log")
