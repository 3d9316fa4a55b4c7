"""Site and root aggregators as processes over real mosquitto bridges (``-k "site or bridge or hierarch"``).

Two site brokers are bridged to a root broker (``tests/conftest.py``, ``bridged_brokers``: the bridge
config is ``edgefl bridge-config``'s); each site runs ``edgefl coordinator --role site``, the root
``--role root``. The test plays the devices: it waits for the root's round announcement at each site
broker (bridged down), publishes signed, pre-encoded updates there, and reads the global head the root
publishes from the site brokers (bridged down again). Every head is compared with a flat FedAvg run
on the same updates, and every update id must be counted exactly once in the root's round log.
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
from conftest import (
    INT8_MODEL,
    ROOT,
    BridgedBrokers,
    Link,
    free_port,
    restart_mosquitto,
    start_bridged_brokers,
    start_replay_agent,
    stop_broker,
    wait_until,
)

from edgefl.coordinator.bridge import bridge_config
from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.strategy import Offer
from edgefl.datasets import load_digits, partition_non_iid, split_digits
from edgefl.records import read_record
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.types import F32
from edgefl.wire.global_model import decode_global_model
from edgefl.wire.partial import Partial, encode_partial
from edgefl.wire.rounds import Update, UpdateMetrics, decode_round, decode_update, encode_update
from edgefl.wire.signing import SigningKey, generate_signing_key, sign_message
from edgefl.wire.status import decode_status

SITES = {"site-a": ("a1", "a2", "a3"), "site-b": ("b1", "b2", "b3")}
NORM_BOUND = 5.0


@dataclass
class Keys:
    root: SigningKey
    sites: dict[str, SigningKey]
    devices: dict[str, SigningKey]
    folder: Path


def _keys(tmp: Path) -> Keys:
    k = Keys(generate_signing_key(), {}, {}, tmp)
    (tmp / "sites").mkdir()
    (tmp / "devices").mkdir()
    (tmp / "root.key").write_text(k.root.seed.hex())
    (tmp / "root.pub").write_text(k.root.verify_key.hex)
    for site, devices in SITES.items():
        k.sites[site] = generate_signing_key()
        (tmp / f"{site}.key").write_text(k.sites[site].seed.hex())
        (tmp / "sites" / f"{site}.pub").write_text(k.sites[site].verify_key.hex)
        for d in devices:
            k.devices[d] = generate_signing_key()
            (tmp / "devices" / f"{d}.pub").write_text(k.devices[d].verify_key.hex)
    return k


@dataclass
class Tier:
    """The processes of one hierarchy: a root and one site aggregator per site broker."""

    bb: BridgedBrokers
    fleet: str
    tmp: Path
    keys: Keys
    rounds: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    signed_devices: bool = True  # the sites verify updates (--device-keys); real agents here do not sign
    site_flags: tuple[str, ...] = ()
    root_flags: tuple[str, ...] = ()

    def _cmd(self, name: str) -> list[str]:
        common = [
            sys.executable, "-m", "edgefl.cli", "--log-level", "INFO", "coordinator",
            "--fleet", self.fleet, "--model", str(INT8_MODEL), "--rounds", str(self.rounds),
            "--strategy", "fedavg", "--clip-norm", str(NORM_BOUND), "--deadline", "45", "--tolerate", "0",
            "--log", str(self.tmp / f"{name}.jsonl"),
        ]  # fmt: skip
        if name == "root":
            return [
                *common, "--broker", self.bb.root.url, "--role", "root", "--expected-sites", "2",
                "--min-clients", "6", "--signing-key", str(self.tmp / "root.key"),
                "--set", f"hierarchy.site_keys_dir={self.tmp / 'sites'}", "--set", "hierarchy.site_devices=8",
                *self.root_flags,
            ]  # fmt: skip
        site = [
            *common, "--broker", self.bb.sites[name].url, "--role", "site", "--site", name,
            "--signing-key", str(self.tmp / f"{name}.key"), "--state", str(self.state(name)),
            "--set", f"hierarchy.root_key_file={self.tmp / 'root.pub'}", *self.site_flags,
        ]  # fmt: skip
        if not self.signed_devices:  # real agents: the site counts the devices online when a round opens
            return site
        return [*site, "--device-keys", str(self.tmp / "devices"), "--set", "hierarchy.expected_devices=3"]

    def start(self, name: str) -> None:
        out = open(self.tmp / f"{name}.out", "ab")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(self._cmd(name), cwd=ROOT, stdout=out, stderr=out)

    def state(self, site: str) -> Path:
        return self.tmp / f"{site}.state"

    def log(self, name: str) -> list[dict[str, Any]]:
        path = self.tmp / f"{name}.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.out").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def tier(bridged_brokers: BridgedBrokers, tmp_path: Path) -> Iterator[Tier]:
    t = Tier(bridged_brokers, f"h{uuid.uuid4().hex[:8]}", tmp_path, _keys(tmp_path), rounds=2)
    yield t
    t.stop()
    for link in bridged_brokers.links.values():
        link.restore()
    for name in t.procs:
        print(f"--- {name}\n{t.output(name)}")


class Devices:
    """The test's side: watchers on each site broker (round, global) and the devices' publisher."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.topics = Topics("edgefl", tier.fleet)
        self.rounds: dict[str, dict[int, int]] = {s: {} for s in SITES}  # site → round → base_version
        self.heads: dict[str, dict[int, tuple[F32, F32]]] = {s: {} for s in SITES}  # site → version → head
        self.transports: dict[str, MqttTransport] = {}
        self.sent: dict[int, list[Offer]] = {}
        self.ready: set[str] = set()  # devices whose status at their site broker says ready
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for site, broker in self.tier.bb.sites.items():
            t = MqttTransport("127.0.0.1", broker.port, f"devices-{site}-{uuid.uuid4().hex[:6]}")
            await t.start(wait_s=10)
            await t.subscribe(self.topics.round, 1)
            await t.subscribe(self.topics.global_model, 1)
            await t.subscribe(self.topics.status("+"), 1)
            await t.subscribe(self.topics.update("+"), 1)  # what real agents send, for the flat run
            self.transports[site] = t
            self._tasks.append(asyncio.create_task(self._watch(site, t)))

    async def _watch(self, site: str, t: MqttTransport) -> None:
        while True:
            msg = await t.queue.get()
            if not msg.payload:
                continue
            device = self.topics.device_of(msg.topic)
            if msg.topic == self.topics.round:
                ann = decode_round(msg.payload)
                self.rounds[site][ann.round] = ann.base_version
            elif device is not None and msg.topic == self.topics.status(device):
                if decode_status(msg.payload).fields.get("ready"):
                    self.ready.add(device)
            elif device is not None:
                u = decode_update(msg.payload)
                offers = self.sent.setdefault(u.round, [])
                if all(o.device != u.device for o in offers):
                    offers.append(Offer(u.device, u.delta_W, u.delta_b, u.num_examples))
            else:
                gm = decode_global_model(msg.payload)
                self.heads[site][gm.version] = (gm.W, gm.b)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for t in self.transports.values():
            await t.stop()

    async def announced(self, round_no: int, timeout_s: float = 40.0) -> int:
        """Wait until both site brokers hold the root's announcement of ``round_no``; its base version."""
        what = f"round {round_no} at every site"
        await wait_until(lambda: all(round_no in r for r in self.rounds.values()), timeout_s, what)
        return self.rounds["site-a"][round_no]

    async def head(self, version: int, timeout_s: float = 40.0) -> None:
        """Wait until both site brokers hold the global head ``version`` (bridged down from the root)."""
        what = f"head v{version} at every site"
        await wait_until(lambda: all(version in h for h in self.heads.values()), timeout_s, what)

    def update(self, device: str, round_no: int, base: int, shape: tuple[int, int]) -> tuple[Offer, bytes]:
        rng = np.random.default_rng([round_no, int(device[1:]), ord(device[0])])
        n = 40  # every device claims alike: a root weighs a site's updates at most at the median claim
        dW = rng.normal(0, 0.02, shape).astype(np.float32)
        db = rng.normal(0, 0.02, shape[1]).astype(np.float32)
        metrics = UpdateMetrics(0.5, 0.5, 0.1, 1000)
        upd = Update(round_no, base, device, n, dW, db, metrics, f"{device}:{round_no}:{base}")
        payload = sign_message(encode_update, upd, self.tier.keys.devices[device], fleet=self.tier.fleet)
        return Offer(device, dW, db, n), payload

    async def send(self, site: str, device: str, round_no: int, base: int) -> bytes:
        shape = self.heads["site-a"][0][0].shape
        _, payload = self.update(device, round_no, base, (int(shape[0]), int(shape[1])))
        await self.transports[site].publish(self.topics.update(device), payload, qos=1)  # _watch records it
        return payload

    def flat(self, rounds: int) -> tuple[F32, F32]:
        """FedAvg with the same norm bound on the same updates, in one process: what the root must publish."""
        W, b = self.heads["site-a"][0]
        st = FedAvg(clip_norm=NORM_BOUND)
        for r in range(1, rounds + 1):
            st.configure_round(r, (int(W.shape[0]), int(W.shape[1])))
            for o in self.sent[r]:
                st.offer(o)
            W, b = st.aggregate(W, b)
        return W, b


def _said(tier: Tier, name: str, line: str) -> bool:
    return line in tier.output(name)


async def watch_and_start_tiers(tier: Tier) -> Devices:
    """The devices' side watching both site brokers, then both site aggregators and the root started."""
    dev = Devices(tier)
    await dev.start()
    for name in ("site-a", "site-b", "root"):
        tier.start(name)
    for site in SITES:  # subscribed at their brokers: an update sent before that would find no one
        said = f"site {site}: ready"
        await wait_until(functools.partial(_said, tier, site, said), 60, f"{site} ready")
    return dev


def _assert_head(dev: Devices, version: int) -> None:
    W, b = dev.flat(version)
    for site in SITES:
        np.testing.assert_array_max_ulp(dev.heads[site][version][0], W, maxulp=1)
        np.testing.assert_array_max_ulp(dev.heads[site][version][1], b, maxulp=1)


def _assert_counted_once(tier: Tier, rounds: int) -> None:
    lines = tier.log("root")
    assert [ln["round"] for ln in lines] == list(range(1, rounds + 1))
    counted = [u for ln in lines for u in ln["update_ids"]]
    expected = [f"{d}:{r}:{r - 1}" for r in range(1, rounds + 1) for devs in SITES.values() for d in devs]
    assert sorted(counted) == sorted(expected)  # every update once: none lost, none twice
    assert [ln["counted"] for ln in lines] == [6] * rounds


@pytest.mark.subprocess
def test_bridge_config_names_the_site_topics() -> None:
    text = bridge_config("site-a", "mqtt://10.0.0.1:1883", fleet="f1")
    assert "address 10.0.0.1:1883\n" in text
    assert "cleansession false\n" in text
    assert "topic f1/partial/site-a out 1 edgefl/ edgefl/\n" in text
    assert "topic f1/round in 1 edgefl/ edgefl/\n" in text
    assert "topic f1/global/# in 1 edgefl/ edgefl/\n" in text
    assert "restart_timeout 1 10\n" in text  # back within ~10 s of the root after an outage
    with pytest.raises(ValueError, match="base <= cap"):
        bridge_config("site-a", "mqtt://10.0.0.1:1883", restart_timeout_s=(5, 2))
    with pytest.raises(ValueError, match="ca-file"):
        bridge_config("site-a", "mqtts://root:8883")
    proc = subprocess.run(
        [sys.executable, "-m", "edgefl.cli", "bridge-config", "--site", "s1", "--root-url", "mqtt://r:1884"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0 and "address r:1884" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "edgefl.cli", "bridge-config", "--site", "s1", "--root-url", "mqtt://r:1884",
         "--restart-timeout", "2", "20"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0 and "restart_timeout 2 20\n" in proc.stdout


def test_bridge_hierarch_two_sites_equal_flat_and_late_partial_refused(tier: Tier) -> None:
    """2 sites x 3 devices, 2 rounds: the head at every site equals flat FedAvg; a partial of round 1
    arriving in round 2 is refused by its round number (``stale_round``)."""

    async def main() -> None:
        dev = await watch_and_start_tiers(tier)
        try:
            await dev.head(0)
            for r in (1, 2):
                base = await dev.announced(r)
                if r == 2:  # site-a's partial of round 1 once more, as a late site would send it
                    W0, b0 = dev.heads["site-a"][0]
                    zeros = (np.zeros(W0.shape), np.zeros(b0.shape))
                    late = Partial(1, 0, "site-a", "site-a:1:late", "sum", 1, 10.0, 0, ("late:1",), *zeros)
                    root = MqttTransport("127.0.0.1", tier.bb.root.port, f"late-{uuid.uuid4().hex[:6]}")
                    await root.start(wait_s=10)
                    payload = sign_message(encode_partial, late, tier.keys.sites["site-a"], fleet=tier.fleet)
                    await root.publish(dev.topics.partial("site-a"), payload, qos=1)
                    await root.stop()
                for site, devices in SITES.items():
                    for d in devices:
                        await dev.send(site, d, r, base)
                await dev.head(r)
                _assert_head(dev, r)
            # a device connecting to its site broker now finds the root's head and round retained there
            port = tier.bb.sites["site-b"].port
            newcomer = MqttTransport("127.0.0.1", port, f"new-dev-{uuid.uuid4().hex[:6]}")
            await newcomer.start(wait_s=10)
            await newcomer.subscribe(dev.topics.global_model, 1)
            msg = await asyncio.wait_for(newcomer.queue.get(), 10)
            assert msg.retain and decode_global_model(msg.payload).version == 2
            await newcomer.stop()
        finally:
            await dev.stop()

    asyncio.run(main())
    assert tier.procs["root"].wait(timeout=30) == 0
    _assert_counted_once(tier, 2)
    last = tier.log("root")[1]
    assert last["refused_updates"] == {"stale_round": 1}
    assert last["partials"] == 5 and last["duplicate_partials"] == 0  # 2 sites x 2 rounds + the late one


def test_site_uplink_cut_counts_each_update_once(tier: Tier) -> None:
    """site-a's uplink is cut while it closes round 1: its partial waits in the site broker's bridge queue
    and reaches the root when the link is back; every update id is counted once over 2 rounds."""

    async def main() -> None:
        dev = await watch_and_start_tiers(tier)
        try:
            await dev.head(0)
            base = await dev.announced(1)
            spy = MqttTransport("127.0.0.1", tier.bb.root.port, f"spy-{uuid.uuid4().hex[:6]}")
            await spy.start(wait_s=10)
            await spy.subscribe(dev.topics.partial("site-a"), 1)
            tier.bb.links["site-a"].cut()
            for site, devices in SITES.items():
                for d in devices:
                    await dev.send(site, d, 1, base)
            # site-a's partial is acknowledged by its own broker, the uplink still down
            await wait_until(lambda: len(tier.log("site-a")) == 1, 30, "site-a's partial of round 1")
            await asyncio.sleep(3.0)  # the outage itself: a head that must not come (nothing to wait for)
            assert 1 not in dev.heads["site-b"]  # the root waits for site-a
            tier.bb.links["site-a"].restore()
            await dev.head(1)
            _assert_head(dev, 1)
            # the partial as the bridge carried it, delivered once more (a redelivery after a lost PUBACK)
            partial = await asyncio.wait_for(spy.queue.get(), 10)
            await spy.publish(partial.topic, partial.payload, qos=1)
            await spy.stop()
            base = await dev.announced(2)
            for site, devices in SITES.items():
                for d in devices:
                    await dev.send(site, d, 2, base)
            await dev.head(2)
            _assert_head(dev, 2)
        finally:
            await dev.stop()

    asyncio.run(main())
    assert tier.procs["root"].wait(timeout=30) == 0
    _assert_counted_once(tier, 2)
    last = tier.log("root")[1]
    # the redelivered partial (and any the bridge itself sent twice) is refused: never counted
    assert last["duplicate_partials"] >= 1
    assert last["partials"] - last["duplicate_partials"] == 4


def test_site_restart_mid_round(tier: Tier) -> None:
    """site-b is killed (SIGKILL) after 2 of its 3 updates; meanwhile its third arrives and the first is
    sent again. Restarted on its state file it resumes the round: each update counted once, head = flat.
    The sites' packet limit is 2 KiB here: their partials travel in chunks."""
    tier.rounds = 1
    tier.site_flags = ("--max-packet-bytes", "2048")

    def site_b_counted() -> int:
        data = read_record(tier.state("site-b"))
        doc = cbor2.loads(data) if data is not None else {}
        return len(doc["open"]["update_ids"]) if doc.get("open") else 0

    async def main() -> None:
        dev = await watch_and_start_tiers(tier)
        try:
            await dev.head(0)
            base = await dev.announced(1)
            for d in SITES["site-a"]:
                await dev.send("site-a", d, 1, base)
            first = await dev.send("site-b", "b1", 1, base)
            await dev.send("site-b", "b2", 1, base)
            await wait_until(lambda: site_b_counted() == 2, 30, "site-b stored 2 updates")
            tier.procs["site-b"].send_signal(signal.SIGKILL)
            tier.procs["site-b"].wait(timeout=10)
            await dev.send("site-b", "b3", 1, base)
            await dev.transports["site-b"].publish(dev.topics.update("b1"), first, qos=1)  # b1 again
            tier.start("site-b")
            await dev.head(1)
            _assert_head(dev, 1)
        finally:
            await dev.stop()

    asyncio.run(main())
    assert tier.procs["root"].wait(timeout=30) == 0
    _assert_counted_once(tier, 1)
    site_b = tier.log("site-b")
    assert [ln["updates"] for ln in site_b] == [3]
    # b1 sent again, and whatever the killed site had committed but not yet acknowledged (the broker
    # delivers it again): refused as duplicates, never counted twice
    refused = site_b[0]["refused_updates"]
    assert set(refused) == {"duplicate"} and 1 <= refused["duplicate"] <= 3, refused
    assert site_b[0]["partial_bytes"] > 2048  # sent as chunks, reassembled by the root


def test_site_partial_resent_to_a_restarted_root(tier: Tier) -> None:
    """Round 2: the root folds both sites' partials, then is killed (SIGKILL) before it closes the round
    (it was told to wait for a third site). Restarted on its state file it announces round 2 again; the
    sites send their partials again, and each update is counted once."""
    port = free_port()
    page = ("--state", str(tier.tmp / "root.rec"), "--set", "dashboard.enabled=true",
            "--set", f"dashboard.port={port}")  # fmt: skip
    tier.root_flags = page

    def folded() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=2) as r:
                doc = json.loads(r.read())["status"]
        except OSError:
            return False
        return bool(doc["round"] == 2 and doc["updates_received"] == 6)

    def restart_root(*flags: str) -> None:
        tier.procs["root"].send_signal(signal.SIGKILL)
        tier.procs["root"].wait(timeout=10)
        tier.root_flags = (*page, *flags)
        tier.start("root")

    async def main() -> None:
        dev = await watch_and_start_tiers(tier)
        try:
            await dev.head(0)
            base = await dev.announced(1)
            for site, devices in SITES.items():
                for d in devices:
                    await dev.send(site, d, 1, base)
            await dev.head(1)
            restart_root("--expected-sites", "3")  # round 1 saved; round 2 will wait for a third site
            base = await dev.announced(2)
            for site, devices in SITES.items():
                for d in devices:
                    await dev.send(site, d, 2, base)
            await wait_until(folded, 40, "the root folded both partials of round 2")
            restart_root()  # loses the folded partials; expects 2 sites again
            await dev.head(2)
            _assert_head(dev, 2)
        finally:
            await dev.stop()

    asyncio.run(main())
    assert tier.procs["root"].wait(timeout=30) == 0
    lines = tier.log("root")
    assert [ln["round"] for ln in lines] == [1, 2]
    counted = sorted(u for ln in lines for u in ln["update_ids"])
    assert counted == sorted(f"{d}:{r}:{r - 1}" for r in (1, 2) for devs in SITES.values() for d in devs)


@pytest.mark.subprocess
def test_bridge_root_broker_back_without_state_gets_partials_again(tmp_path: Path) -> None:
    """The root broker dies and comes back without its state (sessions, retained messages) while both
    sites' partials of round 1 wait in their bridges. The bridges reconnect and forward them before the
    root coordinator is back: the fresh broker has no session of the root, so they reach nobody (the
    outcome of the 60 s root outage in docs/benchmarks.md). The root, back without its session, announces
    round 1 again; the sites send their partials again; each update is counted once."""
    (tmp_path / "brokers").mkdir()
    bb = start_bridged_brokers(tmp_path / "brokers", tuple(SITES))
    root_link = Link(bb.root.port)  # the root coordinator's own connection, which the test holds back
    tier = Tier(bb, f"h{uuid.uuid4().hex[:8]}", tmp_path, _keys(tmp_path), rounds=1)
    tier.root_flags = ("--broker", f"mqtt://127.0.0.1:{root_link.port}")

    async def main() -> None:
        dev = await watch_and_start_tiers(tier)
        try:
            await dev.head(0)
            base = await dev.announced(1)
            for link in (*bb.links.values(), root_link):
                link.cut()
            for site, devices in SITES.items():
                for d in devices:
                    await dev.send(site, d, 1, base)
            # each partial acknowledged by its own broker, queued in its bridge
            await wait_until(lambda: all(len(tier.log(s)) == 1 for s in SITES), 30, "both sites' partials")
            bb.root.proc.kill()
            bb.root.proc.wait(timeout=10)
            (tmp_path / "brokers" / "store-root" / "mosquitto.db").unlink(missing_ok=True)  # state lost
            bb.root = restart_mosquitto(bb.root)
            spy = MqttTransport("127.0.0.1", bb.root.port, f"spy-{uuid.uuid4().hex[:6]}")
            await spy.start(wait_s=10)
            await spy.subscribe(dev.topics.partial("+"), 1)
            for site in SITES:
                bb.links[site].restore()
            forwarded = {(await asyncio.wait_for(spy.queue.get(), 20)).topic for _ in SITES}
            assert forwarded == {dev.topics.partial(s) for s in SITES}  # at the root broker, to nobody else
            await spy.stop()
            assert 1 not in dev.heads["site-a"]
            root_link.restore()
            await dev.head(1, timeout_s=40)
            _assert_head(dev, 1)
        finally:
            await dev.stop()

    try:
        asyncio.run(main())
        assert tier.procs["root"].wait(timeout=30) == 0
        _assert_counted_once(tier, 1)
        line = tier.log("root")[0]
        assert line["partials"] - line["duplicate_partials"] == 2
        assert "announcing the round again" in tier.output("root")
    finally:
        tier.stop()
        for name in tier.procs:
            print(f"--- {name}\n{tier.output(name)}")
        root_link.close()
        for link in bb.links.values():
            link.close()
        for broker in (*bb.sites.values(), bb.root):
            stop_broker(broker)


def test_bridge_hierarch_real_agents_at_two_sites(bridged_brokers: BridgedBrokers, tmp_path: Path) -> None:
    """One real agent per site broker, 2 rounds: the agents train on the root's rounds and apply its heads
    (both bridged down); each head equals flat FedAvg on the updates the agents sent. The two shards
    are cut to the same size: the root weighs a site's updates at most at the median claim of the
    last round's partials, so sites claiming alike keep FedAvg's weights exactly."""
    tier = Tier(bridged_brokers, f"h{uuid.uuid4().hex[:8]}", tmp_path, _keys(tmp_path), rounds=2)
    tier.signed_devices = False
    x, y = load_digits()
    pool = split_digits(y).devices
    shards = partition_non_iid(y[pool], 2)
    shards = [shard[: min(len(sh) for sh in shards)] for shard in shards]
    agents = []

    async def main() -> None:
        dev = Devices(tier)
        await dev.start()
        tier.start("site-a")
        tier.start("site-b")
        for (site, broker), shard in zip(bridged_brokers.sites.items(), shards, strict=True):
            rows = pool[shard]
            agents.append(start_replay_agent(broker, tier.fleet, tmp_path, f"{site[-1]}1", x[rows], y[rows]))
        try:
            # the sites count the devices ready when a round opens: start the root once both are
            await wait_until(lambda: dev.ready >= {"a1", "b1"}, 60, "both agents ready")
            tier.start("root")
            await dev.head(2, timeout_s=60)
            for version in (1, 2):
                assert sorted(o.device for o in dev.sent[version]) == ["a1", "b1"]
                _assert_head(dev, version)
        finally:
            await dev.stop()

    try:
        asyncio.run(main())
        assert tier.procs["root"].wait(timeout=30) == 0
        lines = tier.log("root")
        assert [ln["counted"] for ln in lines] == [2, 2]
        assert [len(ln["update_ids"]) for ln in lines] == [2, 2]
        # at the root the bytes in are partials': labelled so on stdout, partial_bytes_mean in the log
        assert all(ln["partial_bytes_mean"] == ln["update_bytes_mean"] > 0 for ln in lines), lines
        assert " B/partial, " in tier.output("root") and " B/update" not in tier.output("root")
        assert "site-a: ready, waiting for the root's round 1 (last round closed here: none)" in tier.output(
            "site-a"
        )
    finally:
        tier.stop()
        for a in agents:
            a.terminate()
        for a in agents:
            a.wait(timeout=15)
        for name in tier.procs:
            print(f"--- {name}\n{tier.output(name)}")
