"""The coordinator's start-up against a real mosquitto with accounts and an ACL: a fleet its account may
not use is refused at once with exit 1 (not restarted) naming the topic and the account; SIGTERM at
any moment of the start-up ends it with exit 0; two fleets' coordinators sharing one account (the
broker names clients after their account) are told so instead of taking each other's session."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import INT8_MODEL, ROOT, Broker, mosquitto_passwd_path, start_mosquitto, stop_broker
from test_service import wait_for

from edgefl.launcher import free_port

pytestmark = [pytest.mark.timeout(300), pytest.mark.broker, pytest.mark.subprocess]

PROFILE = ROOT / "firmware_configs" / "coordinator.toml"
PASSWORD = "s3cret-pw"
FLEET = "plant-3"
# coordinator: two fleets' topics (one account for two: what the docs warn against); coord9: an account
# the ACL gives nothing (a fleet left out of it)
ACL = f"""user coordinator
topic readwrite edgefl/{FLEET}/#
topic readwrite edgefl/plant-4/#

user coord9
topic read edgefl/nothing-here
"""


@pytest.fixture(scope="module")
def acl_mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    tmp = tmp_path_factory.mktemp("acl")
    passwd = tmp / "fleet.passwd"
    for k, user in enumerate(("coordinator", "coord9")):
        create = ["-c"] if k == 0 else []
        subprocess.run([mosquitto_passwd_path(), *create, "-b", str(passwd), user, PASSWORD], check=True)
    (tmp / "fleet.acl").write_text(ACL)
    conf = (
        f"allow_anonymous false\npassword_file {passwd}\nacl_file {tmp / 'fleet.acl'}\n"
        "use_username_as_clientid true\nuser root\n"  # root keeps read access to the test's files
    )
    broker = start_mosquitto(tmp, extra=conf)
    yield broker
    stop_broker(broker)


def coordinator(tmp: Path, name: str, url: str, user: str, fleet: str, *sets: str) -> subprocess.Popen[str]:
    """An ``edgefl coordinator`` process logging (INFO) to ``tmp/<name>.log``."""
    (tmp / "password").write_text(PASSWORD + "\n")
    (tmp / "password").chmod(0o600)
    cmd = [sys.executable, "-m", "edgefl.cli", "--log-level", "INFO", "coordinator", str(PROFILE)]
    cmd += ["--broker", url, "--fleet", fleet, "--model", str(INT8_MODEL)]
    for item in (f"broker.username={user}", f"broker.password_file={tmp / 'password'}", *sets):
        cmd += ["--set", item]
    log = open(tmp / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=tmp)


def test_provision_coordinator_account_the_acl_leaves_out_exits_1_naming_topic_and_account(
    tmp_path: Path, acl_mosquitto: Broker
) -> None:
    state = f"files.state={tmp_path / 's.rec'}"
    proc = coordinator(tmp_path, "coord9", acl_mosquitto.url, "coord9", "plant-9", state)
    try:
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "coord9.log").read_text()
    assert rc == 1, out  # a configuration error: the unit does not restart it
    last = out.strip().splitlines()[-1]
    assert last.startswith("edgefl coordinator: cannot start: broker " + acl_mosquitto.url), out
    assert "account 'coord9'" in last and "edgefl/plant-9/" in last and "Not authorized" in last, last
    assert "'topic readwrite edgefl/plant-9/#'" in last, last
    assert "Traceback" not in out, out


def test_provision_sigterm_while_connecting_at_start_up_exits_0(tmp_path: Path) -> None:
    """No broker listens: the coordinator keeps trying to connect; SIGTERM then stops it with 0."""
    url = f"mqtt://127.0.0.1:{free_port()}"
    state = f"files.state={tmp_path / 's.rec'}"
    proc = coordinator(tmp_path, "coordinator", url, "coordinator", FLEET, state)
    try:
        wait_for(lambda: "unreachable" in (tmp_path / "coordinator.log").read_text(), 60, "a connect try",
                 [proc], tmp_path)  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "coordinator.log").read_text()
    assert rc == 0, out
    assert "SIGTERM: stopping during start-up" in out, out
    assert not (tmp_path / "s.rec").exists()  # nothing was written


def test_lease_second_fleet_sharing_the_coordinator_account_is_refused_and_the_first_runs_on(
    tmp_path: Path, acl_mosquitto: Broker
) -> None:
    """plant-3's coordinator runs on account ``coordinator``; plant-4's is started on the same account.
    The broker (use_username_as_clientid) hands plant-4's lease probe plant-3's session, which plant-3
    takes back: plant-4 exits 1 naming the account, before it publishes anything, and plant-3 runs on."""
    first = coordinator(tmp_path, "plant-3", acl_mosquitto.url, "coordinator", FLEET, "rounds.deadline_s=5")
    try:
        wait_for(lambda: "coordinator of fleet plant-3" in (tmp_path / "plant-3.log").read_text(), 60,
                 "plant-3 running", [first], tmp_path)  # fmt: skip
        wait_for(lambda: "waiting for devices" in (tmp_path / "plant-3.log").read_text(), 60,
                 "plant-3 waiting for its devices", [first], tmp_path)  # fmt: skip
        second = coordinator(tmp_path, "plant-4", acl_mosquitto.url, "coordinator", "plant-4")
        rc = second.wait(timeout=120)
        out = (tmp_path / "plant-4.log").read_text()
        assert rc == 1, out
        last = out.strip().splitlines()[-1]
        assert last.startswith("edgefl coordinator: cannot start: fleet plant-4 on broker"), out
        assert "account 'coordinator' is in use by another live client" in last, last
        assert "coordinator of fleet plant-4" not in out, out  # refused before it started
        assert first.poll() is None  # plant-3 runs on
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
    finally:
        if first.poll() is None:
            first.kill()
    log = (tmp_path / "plant-3.log").read_text()
    assert "Traceback" not in log, log
    # what plant-3 lived through is said loudly, with the count
    said = "session taken over by another client with our client id 1 time(s) since start"
    assert said in log and "account 'coordinator' is in use elsewhere" in log, log
