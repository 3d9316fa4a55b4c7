"""Hostile sizes and hostile clients against a real agent process and a real mosquitto (issue 15 items 2-4).

Select with ``pytest -k hostile``. A test asserts the agent's own contract (it survives, keeps
answering, its governor's measured peak RSS stays under its cap); machine figures go to
docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import resource
import selectors
import signal
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import DEV_PROFILE, INT8_MODEL, Broker, free_port, start_mosquitto, stop_broker, wait_until

from edgefl.launcher import launch_agent, stop_agents
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.global_model import GlobalModel, encode_global_model
from edgefl.wire.rounds import RoundAnnouncement, encode_round
from edgefl.wire.signing import SigningKey, sign_message
from edgefl.wire.status import decode_status

pytestmark = [pytest.mark.timeout(300), pytest.mark.subprocess]

HUNDRED_MB = 100 * 1000 * 1000


def _vm_hwm_bytes(pid: int) -> int:
    """The process's own peak RSS (``VmHWM`` in /proc/<pid>/status), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _agent(broker: Broker, fleet: str, tmp: Path, dev: str, **extra: str) -> Any:
    return launch_agent(
        DEV_PROFILE,
        {
            "device.id": dev,
            "device.fleet": fleet,
            "device.state_dir": str(tmp / dev),
            "broker.url": broker.url,
            "model.path": str(INT8_MODEL),
            "dashboard.enabled": "false",
            "status.interval_s": "0.2",
            **{k.replace("__", "."): v for k, v in extra.items()},
        },
        tmp / f"{dev}.log",
    )


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_hostile_100mb_messages_on_every_subscribed_topic_keep_rss_under_cap(
    tmp_path: Path, fleet: str, protocol: str
) -> None:
    """A 100 MB publish on each topic the agent subscribes to (global, a global chunk, round).

    MQTT 5: the agent announced its Maximum Packet Size, so mosquitto never sends them. 3.1.1: they
    arrive, and the agent's packet filter drops each before paho buffers it (acknowledged, counted).
    Either way the agent keeps running and answering, and its peak RSS stays under its cap.
    """
    broker = start_mosquitto(tmp_path, extra="message_size_limit 0\nmax_queued_bytes 0")
    dev = "dev-hostile"
    proc = _agent(broker, fleet, tmp_path, dev, broker__protocol=protocol)
    topics = Topics("edgefl", fleet)
    flood = [topics.global_model, topics.global_model + "/0001", topics.round]

    async def main() -> dict[str, Any]:
        t = MqttTransport(broker.host, broker.port, f"attacker-{fleet}")
        await t.start()
        latest: dict[str, Any] = {}
        try:
            await t.subscribe(topics.status(dev), 1)

            async def statuses() -> None:
                while True:
                    msg = await t.queue.get()
                    st = decode_status(msg.payload)
                    latest.update(st.fields, state=st.state)

            reader = asyncio.create_task(statuses())
            await wait_until(lambda: latest.get("state") == "idle", 60, "the agent idle")
            big = b"\xa5" * HUNDRED_MB
            for topic in flood:
                await t.publish(topic, big, qos=1, timeout_s=120)
            del big
            await t.publish(topics.round, b"\x00", qos=1)  # a marker after the flood: refused, counted
            await wait_until(lambda: sum(latest.get("rejected", {}).values()) >= 1, 120, "the marker refused")
            reader.cancel()
            return latest
        finally:
            await t.stop()

    try:
        status = asyncio.run(main())
        assert proc.poll() is None, "the agent died"
        hwm = _vm_hwm_bytes(proc.pid)
    finally:
        stop_agents([proc])
        stop_broker(broker)
    oversize = status["transport"]["oversize_dropped"]
    print(
        f"\nhostile 100 MB x {len(flood)} over MQTT {protocol}: agent peak RSS (governor) "
        f"{status['peak_rss_bytes'] / 2**20:.1f} MiB, VmHWM {hwm / 2**20:.1f} MiB, cap "
        f"{status['cap_bytes'] / 2**20:.0f} MiB, dropped by the agent's filter: {oversize}"
    )
    assert oversize == (len(flood) if protocol == "3.1.1" else 0)
    assert status["peak_rss_bytes"] < status["cap_bytes"]
    assert hwm < status["cap_bytes"]
    assert status["transport"]["thread_errors"] == 0 and status["transport"]["connects"] == 1
    log = (tmp_path / f"{dev}.log").read_text(errors="replace")
    assert "Traceback" not in log
    if protocol == "3.1.1":
        assert f"dropped a {HUNDRED_MB + 2 + len(topics.round) + 2 + 5}-byte message on {topics.round}" in log
    assert proc.returncode == -signal.SIGTERM or proc.returncode == 0


def _get(port: int, path: str, source: str) -> tuple[int, bytes]:
    """GET http://127.0.0.1:<port><path> from the local address ``source`` (another loopback address)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_hostile_1100_half_open_dashboard_connections(mosquitto: Broker, fleet: str, tmp_path: Path) -> None:
    """1,100 connections from one address that never finish their headers: the agent keeps running, its
    page answers another client at once, the half-open ones are closed (over the caps at accept, the
    admitted ones at the header deadline), and every one is counted."""
    port = free_port()
    dev = "dev-dash"
    proc = _agent(
        mosquitto,
        fleet,
        tmp_path,
        dev,
        dashboard__enabled="true",
        dashboard__port=str(port),
        dashboard__header_timeout_s="2",
        dashboard__max_connections="64",
        dashboard__max_connections_per_client="16",
    )
    held: list[socket.socket] = []
    # a gateway's usual descriptor limit: 1,100 connections held open would exceed it (EMFILE)
    resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (1024, 1024))
    try:
        deadline = time.monotonic() + 60
        while True:  # wait for the page to listen (an event: the first answer)
            try:
                if _get(port, "/healthz", "127.0.0.2")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "dashboard never came up"
            time.sleep(0.05)
        failed = 0
        for _ in range(1100):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never the empty line
                held.append(s)
            except OSError:
                failed += 1
        # another client is answered while the attacker's connections are held
        status, body = _get(port, "/api/status", "127.0.0.2")
        assert status == 200, body[:200]
        assert json.loads(body)["status"]["device"] == dev
        page_status, page = _get(port, "/", "127.0.0.2")
        assert page_status == 200 and b"<html" in page.lower()
        # every held connection gets closed by the agent
        with selectors.DefaultSelector() as sel:  # epoll: 1,100 descriptors are over select()'s 1024
            for s in held:
                sel.register(s, selectors.EVENT_READ)
            deadline = time.monotonic() + 30
            while sel.get_map():
                assert time.monotonic() < deadline, f"{len(sel.get_map())} half-open connections still open"
                for key, _ in sel.select(1.0):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(4096)
                    except ConnectionResetError:
                        data = b""
                    if not data:
                        sel.unregister(sock)
        status, body = _get(port, "/api/status", "127.0.0.2")
        counts = json.loads(body)["status"]["dashboard_connections"]
        assert proc.poll() is None, "the agent died"
    finally:
        for s in held:
            s.close()
        stop_agents([proc])
    print(f"\n1,100 half-open: {failed} connects failed, counts {counts}")
    assert counts["refused"] + counts["timed_out"] == len(held)
    assert counts["timed_out"] >= 16 and counts["refused"] >= 1100 - failed - 16 * 10
    log = (tmp_path / f"{dev}.log").read_text(errors="replace")
    assert "Traceback" not in log and "Too many open files" not in log


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_hostile_forgery_new_device_never_rolls_back_to_an_old_signed_head(
    mosquitto: Broker, fleet: str, tmp_path: Path, protocol: str
) -> None:
    """An old signed head (version 1) retained on ``global``, the current signed round (base 3) on
    ``round``: a device without state takes the round's base version as its floor before any head, so
    it refuses version 1 (``not_newer``, a rollback) and keeps the model's own head (version 0)."""
    key = SigningKey(bytes(range(32)))
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    topics = Topics("edgefl", fleet)
    old = GlobalModel(1, 1, bb.sha256, (W0 + np.float32(0.25)).astype(np.float32), b0)
    current = RoundAnnouncement(4, 3, 60.0, 1, 0.05, 16, 2, 1.0)
    dev = "dev-fresh"

    async def plant() -> None:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"old-coordinator-{fleet}")
        await t.start(wait_s=10)
        try:
            await t.publish(
                topics.global_model,
                sign_message(encode_global_model, old, key, fleet=fleet),
                qos=1,
                retain=True,
            )
            await t.publish(
                topics.round, sign_message(encode_round, current, key, fleet=fleet), qos=1, retain=True
            )
        finally:
            await t.stop()

    async def watch() -> dict[str, Any]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"watcher-{fleet}")
        await t.start(wait_s=10)
        latest: dict[str, Any] = {}
        try:
            await t.subscribe(topics.status(dev), 1)

            async def statuses() -> None:
                while True:
                    msg = await t.queue.get()
                    if msg.payload:
                        st = decode_status(msg.payload)
                        latest.update(st.fields, state=st.state)

            reader = asyncio.create_task(statuses())
            await wait_until(
                lambda: latest.get("rejected", {}).get("not_newer", 0) >= 1, 60, "the old head refused"
            )
            reader.cancel()
            return latest
        finally:
            await t.stop()

    asyncio.run(plant())
    proc = _agent(
        mosquitto,
        fleet,
        tmp_path,
        dev,
        broker__protocol=protocol,
        security__coordinator_public_key=key.verify_key.hex,
    )
    try:
        status = asyncio.run(watch())
        assert proc.poll() is None, "the agent died"
    finally:
        stop_agents([proc])
    assert status["version"] == 0, status
    log = (tmp_path / f"{dev}.log").read_text(errors="replace")
    assert "older than version 3 announced by a signed round (a rollback)" in log
