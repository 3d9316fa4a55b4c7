"""The demo's embedded broker (amqtt 0.12): its connect-handler race is contained, and its clients recover.

amqtt sends a connecting client the retained messages of every subscription in its table, iterating
that table across the sends; a client subscribing to a new topic filter meanwhile makes the connect
handler raise ``RuntimeError: dictionary changed size during iteration``. Here that race is provoked
on the real embedded broker (in process, 127.0.0.1): nothing reaches the loop's previous exception
handler (no traceback), and the clients still get their messages through.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from conftest import wait_until

from edgefl.demo import _embedded_broker, contain_broker_faults
from edgefl.errors import TransportError
from edgefl.launcher import free_port
from edgefl.transport import MqttTransport

pytestmark = [pytest.mark.timeout(120), pytest.mark.broker]


def test_demo_broker_connect_race_is_contained_and_clients_recover() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        reached: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: reached.append(context))
        port = free_port()
        broker = await _embedded_broker(port)
        contained = contain_broker_faults(loop)  # a second time: still one handler's worth
        clients: list[MqttTransport] = []

        async def client(name: str) -> MqttTransport:
            t = MqttTransport("127.0.0.1", port, name, protocol="3.1.1", reconnect_max_s=0.5)
            await t.start(wait_s=10)
            clients.append(t)
            return t

        try:
            owner = await client("owner")
            for i in range(20):  # retained messages under subscribed filters: what a connect sends
                await owner.subscribe(f"t/old/{i}", 1)
                await owner.publish(f"t/old/{i}", b"x", qos=1, retain=True)
            stop = asyncio.Event()

            async def subscribe_new_filters() -> None:
                sub = await client("subscriber")
                i = 0
                while not stop.is_set():
                    with contextlib.suppress(TransportError):  # its own connect may be the one dropped
                        await sub.subscribe(f"t/new/{i}", 1)
                    i += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(subscribe_new_filters())
            for j in range(60):  # connect until the race has happened at least once
                late = await client(f"late-{j}")
                with contextlib.suppress(TransportError):  # this connection may be the one dropped
                    await late.subscribe(f"t/late/{j}", 1)
                if contained():
                    break
            stop.set()
            await task
            assert contained() >= 1
            # the client whose connection the broker dropped reconnects and gets its messages
            await wait_until(lambda: late.connected.is_set(), 30, "the last client connected again")
            await late.subscribe("t/check", 1)
            await owner.publish("t/check", b"hello", qos=1)
            msg = await asyncio.wait_for(late.queue.get(), 30)
            while msg.topic != "t/check":  # retained messages amqtt sends at each connect come first
                msg = await asyncio.wait_for(late.queue.get(), 30)
            assert msg.payload == b"hello"
        finally:
            for t in clients:
                await t.stop()
            await broker.shutdown()
        assert reached == []
        # an exception from anywhere else still reaches the previous handler
        loop.call_exception_handler({"message": "elsewhere", "exception": ValueError("not amqtt")})
        assert [c["message"] for c in reached] == ["elsewhere"]

    asyncio.run(main())
