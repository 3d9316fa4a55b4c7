"""``edgefl feed`` in a provisioned fleet (docs/operations.md's recipe): as a gateway app, with the samples
checked against the device's profile, on the recipe's TLS broker, accounts and ACL; a wrong password is
named as such at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TEST_STATUS_INTERVAL_S
from test_provision import DEVICE_PROFILE, FLEET, Provisioned, env_args, provisioned  # noqa: F401

from edgefl.datasets import load_digits
from edgefl.launcher import launch_agent, stop_agents

pytestmark = [pytest.mark.timeout(300), pytest.mark.broker, pytest.mark.subprocess]


def feed(p: Provisioned, data: Path, *more: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "edgefl.cli",
        "feed",
        "--broker",
        p.url,
        "--fleet",
        FLEET,
        "--device",
        "gw-7",
    ]
    cmd += ["--data", str(data), "--rate", "0", "--wait", "60", *more]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_feed_provision_app_account_with_the_device_profile_check(
    provisioned: Provisioned,  # noqa: F811
    tmp_path: Path,
) -> None:
    etc = provisioned.work / "gw-7"  # what the recipe copies to gw-7's /etc/edgefl
    sets = env_args(etc / "agent.env", etc)
    sets += [f"device.state_dir={tmp_path / 'state'}", "source.kind=mqtt", "dashboard.enabled=false"]
    sets += [f"status.interval_s={TEST_STATUS_INTERVAL_S}", "source.predictions_qos=1"]
    agent = launch_agent(DEVICE_PROFILE, dict(item.split("=", 1) for item in sets), tmp_path / "gw-7.log")
    x, y = load_digits()
    np.savez(tmp_path / "good.npz", x=x[:20], y=y[:20])
    np.savez(tmp_path / "flat.npz", x=x[:20].reshape(20, 64), y=y[:20])
    app = tmp_path / "cam.toml"
    app.write_text((etc / "cam.toml").read_text().replace("/etc/edgefl", str(etc)))
    try:
        # the app's [broker] table connects; the device's profile checks the samples
        done = feed(
            provisioned, tmp_path / "good.npz", "--profile", str(app), "--check-profile", str(DEVICE_PROFILE)
        )
        assert done.returncode == 0, done.stdout + done.stderr + (tmp_path / "gw-7.log").read_text()[-2000:]
        assert "20 predictions" in done.stdout
        bad = feed(
            provisioned, tmp_path / "flat.npz", "--profile", str(app), "--check-profile", str(DEVICE_PROFILE)
        )
        assert bad.returncode == 2, bad.stdout + bad.stderr
        assert f"edgefl feed: {tmp_path / 'flat.npz'} does not fit device gw-7:" in bad.stderr
        assert "x: samples of shape [64], the device's model" in bad.stderr
        # or the device's own profile, the app's credentials set on top (as edgefl run takes --set)
        creds = [
            f"broker.ca_file={etc / 'ca.pem'}",
            "broker.username=gw-7-door",
            f"broker.password_file={etc / 'door.password'}",
        ]
        with_sets = feed(
            provisioned,
            tmp_path / "good.npz",
            "--profile",
            str(DEVICE_PROFILE),
            *(a for c in creds for a in ("--set", c)),
        )
        assert with_sets.returncode == 0, with_sets.stdout + with_sets.stderr
        assert "20 predictions" in with_sets.stdout
        # a wrong password: the broker's refusal, named, not a timeout
        (tmp_path / "wrong.password").write_text("not-the-password\n")
        wrong = feed(
            provisioned,
            tmp_path / "good.npz",
            "--profile",
            str(app),
            "--set",
            f"broker.password_file={tmp_path / 'wrong.password'}",
        )
        assert wrong.returncode == 4, wrong.stdout + wrong.stderr
        # one line says it: the feed's own (the transport's log line of the refusal is held back)
        said = [line for line in wrong.stderr.splitlines() if "TensorFlow Lite" not in line]
        assert len(said) == 1, wrong.stderr
        refused = f"credentials refused by broker 127.0.0.1:{provisioned.broker.port} (Not authorized): "
        assert said[0].startswith(f"edgefl feed: {refused}"), said
        assert "no connection" not in wrong.stderr
    finally:
        stop_agents([agent])
