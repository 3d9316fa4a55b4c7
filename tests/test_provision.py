"""docs/operations.md's provisioning recipe, run as written: CA and broker certificate (openssl), accounts
and a per-fleet ACL (mosquitto_passwd), signing keys (edgefl keys), each machine's files; then a real
mosquitto with the documented configuration and those files, a signing coordinator, two signing agents
and three parallel gateway-app feeds, and the ACL's refusals."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TEST_STATUS_INTERVAL_S, Broker, start_mosquitto, stop_broker

from edgefl.datasets import load_digits, partition_non_iid, split_digits
from edgefl.launcher import free_port, launch_agent, stop_agents
from edgefl.wire.signing import load_signing_key, load_verify_keys

pytestmark = [pytest.mark.timeout(300), pytest.mark.broker, pytest.mark.subprocess]

DOC = ROOT / "docs" / "operations.md"
DEVICE_PROFILE = ROOT / "firmware_configs" / "dev_x86.toml"
COORDINATOR_PROFILE = ROOT / "firmware_configs" / "coordinator.toml"
FLEET, DEVICES, APPS = "plant-3", ("gw-7", "gw-8"), ("cam", "door")
# The only lines the test changes: where the broker is.
SITE = {"BROKER_DNS": "localhost", "BROKER_IP": "127.0.0.1"}


def provision_blocks(doc: str) -> list[str]:
    """The ``# provision:`` shell blocks of the doc, in order."""
    return re.findall(r"```sh\n(# provision: .*?)```", doc, flags=re.DOTALL)


def broker_conf(doc: str) -> str:
    """The doc's mosquitto configuration ("The broker (mosquitto)")."""
    m = re.search(r"```\n(# /etc/mosquitto/conf\.d/edgefl\.conf.*?)```", doc, flags=re.DOTALL)
    assert m is not None, "docs/operations.md lost its broker configuration block"
    return m.group(1)


def env_args(path: Path, etc: Path) -> list[str]:
    """``--set`` items of an ``EDGEFL_ARGS="..."`` env file, ``/etc/edgefl`` moved to ``etc``."""
    m = re.fullmatch(r'EDGEFL_ARGS="(.*)"\n', path.read_text())
    assert m is not None, path.read_text()
    words = shlex.split(m.group(1).replace("/etc/edgefl", str(etc)))
    assert words[::2] == ["--set"] * (len(words) // 2), words
    return words[1::2]


@dataclass
class Provisioned:
    work: Path
    broker: Broker
    url: str


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provisioned]:
    """The recipe run once for the module (keys, passwords, ACL) and its broker: the tests only read them."""
    tmp_path = tmp_path_factory.mktemp("provisioned")
    for tool in ("openssl", "mosquitto_passwd"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    doc = DOC.read_text(encoding="utf-8")
    for attempt in range(3):  # the recipe writes the port into every file: a taken port means a new run
        port = free_port()
        base = tmp_path / f"try{attempt}"
        work, etc = base / "pki", base / "etc"
        work.mkdir(parents=True)
        script = "\n".join(provision_blocks(doc))
        for name, value in {**SITE, "BROKER_URL": f"mqtts://127.0.0.1:{port}"}.items():
            script, n = re.subn(rf"^{name}=.*$", f"{name}={value}", script, flags=re.MULTILINE)
            assert n == 1, name
        script = script.replace("/etc/mosquitto", str(etc / "mosquitto"))
        if os.geteuid() != 0:  # only root may give the files to mosquitto's group
            script = re.sub(r"^chgrp mosquitto .*$", "", script, flags=re.MULTILINE)
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run(
            ["sh", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        conf = broker_conf(doc).replace("/etc/mosquitto", str(etc / "mosquitto"))
        conf = re.sub(r"^listener 8883$", "", conf, flags=re.MULTILINE)  # the test's listener: 127.0.0.1:port
        conf += f"\npersistence_location {base}/\nuser root\n"  # root: the tmp folder is not mosquitto's
        try:
            broker = start_mosquitto(base, extra=conf, port=port)
            break
        except RuntimeError:  # another test worker took the port first
            if attempt == 2:
                raise
    try:
        yield Provisioned(work, broker, f"mqtts://127.0.0.1:{port}")
    finally:
        stop_broker(broker)


def test_provision_recipe_writes_every_file_owner_only(provisioned: Provisioned) -> None:
    work = provisioned.work
    cert = subprocess.run(
        ["openssl", "x509", "-in", str(work / "broker.pem"), "-noout", "-ext", "subjectAltName"],
        capture_output=True, text=True, check=True,
    ).stdout
    assert "DNS:localhost, IP Address:127.0.0.1" in cert
    for secret in ("ca.key", "broker.key", "coordinator.password", "keys/coordinator.key", "gw-7/signing.key",
                   "gw-7/broker.password", "gw-7/cam.password", "coordinator/coordinator.key"):
        assert (work / secret).stat().st_mode & 0o077 == 0, secret
    assert {p.name for p in (work / "keys").iterdir()} == {
        f"{n}.{ext}" for n in ("coordinator", *DEVICES) for ext in ("key", "pub")
    }
    ring = load_verify_keys(work / "coordinator" / "device-keys")
    assert ring == {d: load_signing_key(work / "keys" / f"{d}.key").verify_key for d in DEVICES}
    users = [line.split(":")[0] for line in (work / "edgefl.passwd").read_text().splitlines()]
    assert users == ["coordinator", "gw-7", "gw-7-cam", "gw-7-door", "gw-8", "gw-8-cam", "gw-8-door"]
    acl = (work / "edgefl.acl").read_text()
    assert "pattern" not in acl and "edgefl/+/" not in acl  # every entry names the fleet
    assert "user gw-7\ntopic write edgefl/plant-3/update/gw-7\n" in acl
    coordinator_hex = load_signing_key(work / "keys" / "coordinator.key").verify_key.hex
    args = env_args(work / "gw-7" / "agent.env", work / "gw-7")
    assert f"security.coordinator_public_key={coordinator_hex}" in args
    assert f"broker.url={provisioned.url}" in args


def _publish_outcomes(p: Provisioned, user: str, topics: list[str]) -> list[str]:
    """Publish QoS 1 on each topic as ``user`` (its provisioned password): "accepted" or "refused ..."."""
    from edgefl.errors import TransportError
    from edgefl.tlsconf import make_ssl_context
    from edgefl.transport import MqttTransport

    async def main() -> list[str]:
        tx = MqttTransport(
            "127.0.0.1", p.broker.port, user, protocol="5",
            tls_context=make_ssl_context(p.work / "ca.pem"), username=user,
            password=(p.work / f"{user}.password").read_text().strip(),
        )
        out = []
        await tx.start(wait_s=10)
        try:
            for topic in topics:
                try:
                    await tx.publish(topic, b"x", qos=1, timeout_s=5)
                    out.append("accepted")
                except TransportError as exc:
                    out.append(f"refused: {exc}")
        finally:
            await tx.stop()
        return out

    return asyncio.run(main())


def test_provision_acl_binds_each_account_to_its_own_topics_in_its_own_fleet(
    provisioned: Provisioned,
) -> None:
    got = _publish_outcomes(provisioned, "gw-7", [
        "edgefl/plant-3/update/gw-7", "edgefl/plant-3/update/gw-8", "edgefl/other/update/gw-7",
        "edgefl/plant-3/global", "edgefl/plant-3/samples/gw-7",
        # the fleet's lease: only the coordinator's account writes it (docs/security.md)
        "edgefl/plant-3/coordinator", "edgefl/plant-3/coordinator/holder",
    ])
    assert got[0] == "accepted"
    assert all(g.startswith("refused") for g in got[1:]), got
    app = _publish_outcomes(provisioned, "gw-7-cam", [
        "edgefl/plant-3/samples/gw-7", "edgefl/plant-3/labels/gw-7", "edgefl/plant-3/labels/gw-8",
        "edgefl/plant-3/update/gw-7", "edgefl/other/samples/gw-7", "edgefl/plant-3/coordinator",
    ])
    assert app[:2] == ["accepted", "accepted"]
    assert all(g.startswith("refused") for g in app[2:]), app


def test_provision_signed_round_over_tls_with_parallel_gateway_apps(
    provisioned: Provisioned, tmp_path: Path
) -> None:
    """Two agents and the coordinator configured only by the recipe's env files; three feeds in parallel."""
    work = provisioned.work
    agents = []
    for dev in DEVICES:
        sets = env_args(work / dev / "agent.env", work / dev)
        # the shipped profile's raw-input model (what the coordinator's profile names), fed over MQTT
        sets += [f"device.state_dir={tmp_path / dev / 'state'}", "source.kind=mqtt",
                 "dashboard.enabled=false", f"status.interval_s={TEST_STATUS_INTERVAL_S}",
                 # the feeds count every prediction: QoS 1 (the shipped QoS 0 may lose one on a loaded host)
                 "source.predictions_qos=1"]
        overrides = dict(item.split("=", 1) for item in sets)
        assert overrides["security.signing_key_file"] == str(work / dev / "signing.key")
        agents.append(launch_agent(DEVICE_PROFILE, overrides, tmp_path / f"{dev}.log"))
    x, y = load_digits()
    pool = split_digits(y).devices
    shards = [pool[rows] for rows in partition_non_iid(y[pool], len(DEVICES))]
    feeds = []
    try:
        for dev, rows in zip(DEVICES, shards, strict=True):
            # gw-7 is fed by two apps at once (each its own account: 2-4 s each at 30 Hz); gw-8 by one
            for app, part in zip(APPS, np.array_split(rows[:120], 2 if dev == "gw-7" else 1), strict=False):
                data = tmp_path / f"{dev}-{app}.npz"
                np.savez(data, x=x[part], y=y[part])
                cmd = [sys.executable, "-m", "edgefl.cli", "feed", "--broker", provisioned.url,
                       "--profile", str(tmp_path / f"{dev}-{app}.toml"), "--fleet", FLEET, "--device", dev,
                       "--data", str(data), "--rate", "30", "--wait", "60", "--id-prefix", f"{app}-"]
                profile = (work / dev / f"{app}.toml").read_text().replace("/etc/edgefl", str(work / dev))
                (tmp_path / f"{dev}-{app}.toml").write_text(profile)
                feeds.append((dev, app, len(part), subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        for dev, app, n, proc in feeds:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, (dev, app, out)
            assert f"{n} predictions" in out, (dev, app, out)
            print(dev, app, out.strip().splitlines()[-1])
        sets = env_args(work / "coordinator" / "coordinator.env", work / "coordinator")
        cmd = [sys.executable, "-m", "edgefl.cli", "coordinator", str(COORDINATOR_PROFILE)]
        # two devices: tolerate no hostile one (the shipped profile's one in five needs 5 updates)
        for item in [*sets, "robustness.tolerate=0", "rounds.count=1", "rounds.expected_clients=2",
                     "rounds.min_clients=2", "rounds.deadline_s=60"]:
            cmd += ["--set", item]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    finally:
        for *_, proc in feeds:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stop_agents(agents)
    print(done.stdout)  # docs/operations.md quotes such a run
    logs = "".join((tmp_path / f"{d}.log").read_text()[-1500:] for d in DEVICES)
    assert done.returncode == 0, done.stdout + done.stderr + logs
    assert f"coordinator of fleet {FLEET} at {provisioned.url}" in done.stdout, done.stdout
    rounds = [line for line in done.stdout.splitlines() if line.startswith("round 1")]
    assert len(rounds) == 1 and " 2/2 clients, refused: none" in rounds[0], done.stdout
    for word in ("bad_signature", "unsigned", "Not authorized", "not authorised"):
        assert word not in logs + done.stdout + done.stderr, word
