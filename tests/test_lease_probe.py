"""The lease probe against a busy broker: a backlog in the coordinator's session never hides the holder's
presence, and a broker restart is never taken for another client on the coordinator's account.

Real mosquitto brokers; a real ``edgefl coordinator`` process for the backlog.
"""

from __future__ import annotations

import asyncio
import functools
import signal
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from conftest import Broker, restart_mosquitto, start_mosquitto, stop_broker, wait_until
from paho.mqtt.enums import CallbackAPIVersion
from test_lease import ACCOUNT, first_coordinator, read_log, start_coordinator, wait_for_log

from edgefl.coordinator.lease import PROBE_RECEIVE_MAX
from edgefl.transport import TAKEOVER_LOSSES, MqttTransport

pytestmark = [pytest.mark.timeout(180), pytest.mark.broker]


def publish_statuses(port: int, fleet: str, n: int) -> None:
    """``n`` QoS 1 statuses from a device account, each acknowledged by the broker."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="dev-flood", protocol=mqtt.MQTTv5)
    client.username_pw_set("dev-flood")
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        for i in range(n):
            client.publish(f"edgefl/{fleet}/status/dev-{i % 7}", b"\xa0", qos=1).wait_for_publish(10)
    finally:
        client.loop_stop()
        client.disconnect()


@pytest.mark.subprocess
def test_lease_probe_reads_the_holder_behind_a_backlog_of_300_statuses(tmp_path: Path, fleet: str) -> None:
    """The coordinator is killed; 300 statuses queue for its persistent session (more than the
    Receive Maximum a probe that acknowledges nothing can take); its restart is handed that session and
    still reads the holder topic at once, naming its own previous instance: taken over at once."""
    broker = start_mosquitto(tmp_path, "use_username_as_clientid true\nmax_queued_messages 2000")
    try:
        first, mine, state = first_coordinator(tmp_path, broker, fleet)
        first.kill()
        first.wait(timeout=30)
        publish_statuses(broker.port, fleet, 300)
        second = start_coordinator(tmp_path, "b", broker, fleet, ACCOUNT, f"files.state={state}")
        try:
            wait_for_log(tmp_path, "b", "before round 1", second, 60)
            out = read_log(tmp_path, "b")
            info = "INFO edgefl.coordinator.lease: the broker gave the lease probe the session of instance "
            assert info + mine.instance[:8] in out, out
            assert "waiting for its coordinator's presence" not in out, out
        finally:
            second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0, read_log(tmp_path, "b")
    finally:
        stop_broker(broker)


@pytest.mark.parametrize("receive_maximum", [PROBE_RECEIVE_MAX, 0])
def test_lease_probe_receive_maximum_leaves_room_for_the_holder(
    mosquitto: Broker, fleet: str, receive_maximum: int
) -> None:
    """A session's backlog of 300 QoS 1 statuses, never acknowledged (as a probe leaves it): with the probe's
    Receive Maximum it fills 64 of the 256 queue slots and a QoS 0 retained presence still arrives; with the
    queue's own (256) the backlog fills the queue and the presence is dropped."""
    cid, holder = f"{fleet}-probe", f"edgefl/{fleet}/coordinator/holder"

    def transport() -> MqttTransport:
        return MqttTransport(
            mosquitto.host,
            mosquitto.port,
            cid,
            protocol="5",
            session_expiry_s=60,
            ack_on_commit=True,
            receive_maximum=receive_maximum,
        )

    async def main() -> tuple[int, int, bytes | None]:
        t = transport()
        await t.subscribe(f"edgefl/{fleet}/status/+", 1)
        await t.start(wait_s=10)
        await t.stop()
        await asyncio.to_thread(publish_statuses, mosquitto.port, fleet, 300)
        await asyncio.to_thread(publish_retained, mosquitto.port, holder, b"presence")
        t = transport()
        await t.start(wait_s=10)
        try:
            await wait_until(lambda: t.queue.qsize() == min(t.receive_maximum, 256), 10, "the backlog")
            await t.subscribe(holder, 0)
            await wait_until(lambda: t.queue.qsize() > t.receive_maximum or t.dropped_total > 0, 10, "it")
            got = [t.queue.get_nowait() for _ in range(t.queue.qsize())]
            return len(got), t.dropped_total, next((m.payload for m in got if m.topic == holder), None)
        finally:
            await t.stop()

    queued, dropped, presence = asyncio.run(main())
    if receive_maximum:
        assert (queued, dropped, presence) == (PROBE_RECEIVE_MAX + 1, 0, b"presence")
    else:
        assert (queued, dropped, presence) == (256, 1, None)


def publish_retained(port: int, topic: str, payload: bytes) -> None:
    """One retained QoS 1 message, acknowledged by the broker."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="holder", protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        client.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
    finally:
        client.loop_stop()
        client.disconnect()


def test_lease_broker_restart_soon_after_connack_is_no_sure_takeover(tmp_path: Path) -> None:
    """Broker restarts within seconds of CONNACK (closes without a reason, as mosquitto's takeover) are
    counted as possible takeovers only: the broker was unreachable between them. Another live client
    with the same client id, taking the session again and again while the broker is up, is a sure one."""
    broker = start_mosquitto(tmp_path)

    async def main() -> None:
        nonlocal broker
        t = MqttTransport(broker.host, broker.port, "coord-restart", protocol="5", reconnect_max_s=0.5)
        await t.start(wait_s=10)
        try:
            for _ in range(TAKEOVER_LOSSES):  # restarts in a row, each soon after the CONNACK
                failures = t.connect_failures_total
                stop_broker(broker)
                await wait(functools.partial(failed_since, t, failures))  # the broker is gone a while
                broker = restart_mosquitto(broker)
                await wait(t.connected.is_set)
            assert t.takeovers_total == TAKEOVER_LOSSES and t.sure_takeovers_total == 0
            other = MqttTransport(
                broker.host, broker.port, "coord-restart", protocol="5", reconnect_max_s=0.5
            )
            await other.start(wait_s=10)  # the same client id: the two take the session in turns
            try:
                await wait(lambda: t.sure_takeovers_total > 0)
            finally:
                await other.stop()
        finally:
            await t.stop()

    try:
        asyncio.run(main())
    finally:
        stop_broker(broker)


def failed_since(t: MqttTransport, failures: int) -> bool:
    return t.connect_failures_total > failures


async def wait(cond: Callable[[], bool], timeout_s: float = 60) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.02)
