"""A configured key on a machine without the Ed25519 library (PyNaCl): refused at load, exit 1.

The machine without the library is made real in a subprocess: a ``sitecustomize`` on ``PYTHONPATH``
makes ``import nacl`` fail, as it would if PyNaCl were not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEV_PROFILE, ROOT

from edgefl.wire.signing import generate_signing_key

pytestmark = pytest.mark.subprocess  # every test here starts a process

BLOCKER = '''
import sys

class _NoEd25519:
    """Finder that refuses the Ed25519 libraries, like a machine without them."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "nacl":
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, _NoEd25519())
'''

HINT = "pip install 'edgefl[security]' (or apt-get install python3-nacl)"


@pytest.fixture()
def without_ed25519(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER, encoding="utf-8")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def edgefl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "edgefl.cli", "--log-level", "WARNING", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def hint_lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln.strip() for ln in r.stderr.splitlines() if HINT in ln]


def test_fault_agent_key_without_ed25519_library_is_a_config_error(
    tmp_path: Path, without_ed25519: dict[str, str]
) -> None:
    public = generate_signing_key().verify_key.raw.hex()
    sets = [
        "--set",
        f"security.coordinator_public_key={public}",
        "--set",
        f"device.state_dir={tmp_path / 's'}",
    ]
    sets += ["--set", "dashboard.enabled=false"]
    expected = [
        "security.coordinator_public_key: a key is configured but the Ed25519 library (PyNaCl) "
        f"cannot be imported; {HINT}"
    ]
    for command in ("check-config", "run"):
        r = edgefl(without_ed25519, command, str(DEV_PROFILE), *sets)
        assert r.returncode == 1, (command, r.stderr)
        assert hint_lines(r) == expected, (command, r.stderr)
        assert "Traceback" not in r.stderr
    # the same profile with the library present is fine (the blocker is what made the difference)
    ok = edgefl(dict(os.environ), "check-config", str(DEV_PROFILE), *sets)
    assert ok.returncode == 0, ok.stderr


def test_fault_coordinator_key_without_ed25519_library_is_a_config_error(
    tmp_path: Path, without_ed25519: dict[str, str]
) -> None:
    key = tmp_path / "coordinator.key"
    key.write_text(generate_signing_key().seed.hex() + "\n", encoding="ascii")
    key.chmod(0o600)
    expected = [
        "security.signing_key_file: a key is configured but the Ed25519 library (PyNaCl) "
        f"cannot be imported; {HINT}"
    ]
    r = edgefl(without_ed25519, "coordinator", "--signing-key", str(key), "--broker", "mqtt://127.0.0.1:9")
    assert r.returncode == 1, r.stderr
    assert hint_lines(r) == expected, r.stderr
    assert "Traceback" not in r.stderr
    profile = ROOT / "firmware_configs" / "coordinator.toml"
    r = edgefl(without_ed25519, "check-config", str(profile), "--set", f"security.signing_key_file={key}")
    assert r.returncode == 1, r.stderr
    assert hint_lines(r) == expected, r.stderr
