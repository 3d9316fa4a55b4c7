"""Hostile sizes: a real agent's peak RSS while 100 MB publishes arrive on every topic it subscribes to.

Runs a fresh mosquitto (``message_size_limit 0``: no broker-side limit) and one agent (dev profile,
96 MiB cap) per configuration, publishes one 100 MB QoS 1 message on each subscribed topic (``global``,
a ``global/<i>`` chunk topic, ``round``), then a small marker the agent refuses (so every earlier
message has been handled), and reads the agent's own peak RSS (VmHWM) and its status counters.

Configurations: MQTT 3.1.1 and MQTT 5 with the default ``broker.max_incoming_packet_bytes`` (1 MiB),
and 3.1.1 with the limit at MQTT's maximum (what every agent did before the packet filter).

Usage: ``python -m bench.hostile [--write-docs]`` (needs mosquitto; 127.0.0.1 only).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from edgefl.launcher import free_port, launch_agent, stop_agents
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.status import decode_status
from tests.support.broker import start_mosquitto

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "firmware_configs" / "dev_x86.toml"
MODEL = ROOT / "models" / "digits_cnn_int8.tflite"
SIZE = 100 * 1000 * 1000
MIB = 1 << 20


def _vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _mosquitto(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    broker = start_mosquitto(tmp, "message_size_limit 0")
    return broker.proc, broker.port


async def _flood(port: int, fleet: str, dev: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    topics = Topics("edgefl", fleet)
    t = MqttTransport("127.0.0.1", port, f"attacker-{fleet}")
    await t.start()
    latest: dict[str, Any] = {}
    try:
        await t.subscribe(topics.status(dev), 1)

        async def until(cond: Any, timeout_s: float) -> bool:
            deadline = time.monotonic() + timeout_s
            while not cond():
                if time.monotonic() > deadline or proc.poll() is not None:
                    return False
                try:
                    msg = await asyncio.wait_for(t.queue.get(), 0.5)
                except TimeoutError:
                    continue
                st = decode_status(msg.payload)
                latest.update(st.fields, state=st.state)
            return True

        await until(lambda: latest.get("state") == "idle", 60)
        big = b"\xa5" * SIZE
        for topic in (topics.global_model, topics.global_model + "/0001", topics.round):
            await t.publish(topic, big, qos=1, timeout_s=120)
        del big
        await t.publish(topics.round, b"\x00", qos=1)
        handled = await until(lambda: sum(latest.get("rejected", {}).values()) >= 1, 120)
        return {**latest, "handled": handled}
    finally:
        await t.stop()


def run(protocol: str, incoming: int | None) -> dict[str, Any]:
    """One configuration: returns the agent's VmHWM (bytes), its cap, survival and its counters."""
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        broker, port = _mosquitto(tmp)
        fleet, dev = f"h{free_port()}", "dev-hostile"
        sets = {
            "device.id": dev,
            "device.fleet": fleet,
            "device.state_dir": str(tmp / "state"),
            "broker.url": f"mqtt://127.0.0.1:{port}",
            "broker.protocol": protocol,
            "model.path": str(MODEL),
            "dashboard.enabled": "false",
            "status.interval_s": "0.2",
        }
        if incoming is not None:
            sets["broker.max_incoming_packet_bytes"] = str(incoming)
        agent = launch_agent(PROFILE, sets, tmp / "agent.log")
        try:
            status = asyncio.run(_flood(port, fleet, dev, agent))
            alive = agent.poll() is None
            hwm = _vm_hwm(agent.pid) if alive else None
        finally:
            stop_agents([agent])
            broker.terminate()
            broker.wait(timeout=5)
        return {
            "protocol": protocol,
            "limit": incoming,
            "alive": alive,
            "handled": status.get("handled"),
            "vm_hwm_mib": None if hwm is None else hwm / MIB,
            "cap_mib": status.get("cap_bytes", 0) / MIB,
            "oversize_dropped": status.get("transport", {}).get("oversize_dropped"),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args()
    rows = [run("3.1.1", None), run("5", None), run("3.1.1", 268_435_455)]
    print(f"machine: {platform.machine()}, Python {platform.python_version()}")
    print(
        "| protocol | broker.max_incoming_packet_bytes | agent alive | peak RSS (VmHWM) | cap "
        "| dropped by filter |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        limit = "1,048,576 (default)" if r["limit"] is None else f"{r['limit']:,} (no filter)"
        hwm = "-" if r["vm_hwm_mib"] is None else f"{r['vm_hwm_mib']:.1f} MiB"
        cells = [r["protocol"], limit, r["alive"], hwm, f"{r['cap_mib']:.0f} MiB", r["oversize_dropped"]]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
