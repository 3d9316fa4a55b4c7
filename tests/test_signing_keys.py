"""Key settings take hex or PEM; a bad key is a profile problem naming the setting; ``edgefl keys``."""

from __future__ import annotations

import logging
import os
import tomllib
from pathlib import Path

import pytest
from conftest import DEV_PROFILE, ROOT

from edgefl.agent.config import load_profile
from edgefl.cli import main
from edgefl.coordinator.profile import load_coordinator_profile
from edgefl.errors import ConfigError
from edgefl.wire.signing import load_signing_key, parse_verify_key, public_pem, write_key_pair

COORDINATOR_PROFILE = ROOT / "firmware_configs" / "coordinator.toml"
SHIPPED_DEVICE_PROFILES = sorted(
    p for p in (ROOT / "firmware_configs").glob("*.toml") if p.stem != "coordinator"
)


def problems(exc: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return list(exc.value.problems)


def test_sign_keys_device_profile_takes_pem_and_hex(tmp_path: Path) -> None:
    private, public, key = write_key_pair(tmp_path, "gw-7")
    pem = public.read_text()
    state = {"device.state_dir": str(tmp_path / "state")}
    # a multi-line PEM block in the TOML file itself, as docs/security.md shows
    profile = tmp_path / "gw-7.toml"
    text = DEV_PROFILE.read_text().replace(
        "\n[security]\n",
        f'\n[security]\nsigning_key_file = "{private}"\ncoordinator_public_key = """\n{pem}"""\n',
    )
    profile.write_text(text.replace('"../models/', f'"{ROOT}/models/').replace('"../data/', f'"{ROOT}/data/'))
    loaded = load_profile(profile, state)
    assert loaded.security.coordinator_public_key is not None
    assert parse_verify_key(loaded.security.coordinator_public_key) == key.verify_key
    # the same key as 64 hex digits, and as PEM on one line, through --set
    for value in (key.verify_key.hex, " ".join(pem.split("\n"))):
        got = load_profile(DEV_PROFILE, {**state, "security.coordinator_public_key": value})
        assert parse_verify_key(got.security.coordinator_public_key or "") == key.verify_key


def test_sign_keys_device_profile_errors_name_the_setting(tmp_path: Path) -> None:
    private, public, key = write_key_pair(tmp_path, "gw-7")
    overrides = {
        "device.state_dir": str(tmp_path / "state"),
        "security.coordinator_public_key": private.read_text(),  # the private half, by mistake
        "security.signing_key_file": str(public),  # the public half, by mistake
    }
    with pytest.raises(ConfigError) as info:
        load_profile(DEV_PROFILE, overrides)
    got = problems(info)
    assert any(
        p.startswith("security.coordinator_public_key = ")
        and "a PRIVATE KEY where a public key belongs" in p
        for p in got
    ), got
    assert any(
        p.startswith("security.signing_key_file = ")
        and f"{public}: private key: a PUBLIC KEY where the private key belongs" in p
        for p in got
    ), got
    assert not any(key.seed.hex()[:16] in p for p in got)
    overrides["security.coordinator_public_key"] = key.verify_key.hex[:-2]
    with pytest.raises(ConfigError) as info:
        load_profile(DEV_PROFILE, overrides)
    assert any("62 hex digits; an Ed25519 key is 64" in p for p in problems(info)), problems(info)
    overrides["security.coordinator_public_key"] = str(public)  # the file's name instead of its key
    with pytest.raises(ConfigError) as info:
        load_profile(DEV_PROFILE, overrides)
    assert any(
        p.startswith("security.coordinator_public_key = ")
        and "this is a file's name: the setting holds the key itself (edgefl keys show FILE)" in p
        for p in problems(info)
    ), problems(info)


def test_sign_keys_permission_warning_only_for_a_private_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    private, public, _ = write_key_pair(tmp_path, "gw-7")
    public.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="edgefl.wire.signing"), pytest.raises(ValueError):
        load_signing_key(public)  # a public key given as the private one: an error, not a mode warning
    assert caplog.text == ""
    private.chmod(0o640)
    with caplog.at_level(logging.WARNING, logger="edgefl.wire.signing"):
        load_signing_key(private)
    assert "is accessible by group/others (mode 640); chmod 600 it" in caplog.text


def test_sign_keys_coordinator_profile_checks_every_key_file_and_folder(tmp_path: Path) -> None:
    private, _, coordinator = write_key_pair(tmp_path / "coord", "coordinator")
    devices = tmp_path / "device-keys"
    for dev in ("gw-1", "gw-2"):
        write_key_pair(devices, dev)
    (devices / "gw-2.key").unlink()  # only public keys belong in the coordinator's folder
    ok = load_coordinator_profile(
        COORDINATOR_PROFILE,
        {"security.signing_key_file": str(private), "security.device_keys_dir": str(devices)},
    )
    assert ok.security.signing_key_file is not None
    assert load_signing_key(ok.security.signing_key_file) == coordinator
    (devices / "gw-3.pub").write_text(private.read_text())  # a private key under a .pub name
    site_keys = tmp_path / "site-keys"
    site_keys.mkdir()
    (site_keys / "lyon.pub").write_text("ssh-ed25519 AAAA lyon\n")
    with pytest.raises(ConfigError) as info:
        load_coordinator_profile(
            COORDINATOR_PROFILE,
            {
                "security.signing_key_file": str(devices / "gw-1.pub"),
                "security.device_keys_dir": str(devices),
                "hierarchy.role": "root",
                "hierarchy.site_keys_dir": str(site_keys),
            },
        )
    got = problems(info)
    expected = [
        ("security.signing_key_file = ", "gw-1.pub: private key: a PUBLIC KEY where the private key belongs"),
        ("security.device_keys_dir = ", "gw-3.pub: public key: a PRIVATE KEY where a public key belongs"),
        ("hierarchy.site_keys_dir = ", "lyon.pub: public key: expected 64 hex digits or a PEM block"),
    ]
    for start, why in expected:
        assert any(p.startswith(start) and why in p for p in got), (start, got)
    with pytest.raises(ConfigError) as info:
        load_coordinator_profile(
            COORDINATOR_PROFILE, {"hierarchy.role": "site", "hierarchy.site": "lyon",
                                  "hierarchy.root_key_file": str(private)}
        )
    assert any(
        p.startswith("hierarchy.root_key_file = ") and "a PRIVATE KEY where a public key belongs" in p
        for p in problems(info)
    ), problems(info)


def test_sign_keys_cli_generate_and_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "keys"
    assert main(["keys", "generate", "--out", str(out), "--name", "gw-7"]) == 0
    printed = capsys.readouterr().out.splitlines()
    key = load_signing_key(out / "gw-7.key")
    assert printed == [
        f"private key: {out / 'gw-7.key'} (PKCS #8 PEM, mode 0600: security.signing_key_file)",
        f"public key:  {out / 'gw-7.pub'} (PEM: a device_keys_dir / site_keys_dir entry, or root_key_file)",
        "public key (hex; a coordinator's goes in the devices' security.coordinator_public_key): "
        + key.verify_key.hex,
    ]
    assert (out / "gw-7.key").stat().st_mode & 0o777 == 0o600
    # show: the public key of either file, in both forms
    for name in ("gw-7.key", "gw-7.pub"):
        assert main(["keys", "show", str(out / name)]) == 0
        assert capsys.readouterr().out == key.verify_key.hex + "\n" + public_pem(key.verify_key)
    # never replaces a key; a file that holds no key is named, its content never printed
    before = (out / "gw-7.key").read_bytes()
    assert main(["keys", "generate", "--out", str(out), "--name", "gw-7"]) == 1
    assert "gw-7.key exists: not replaced" in capsys.readouterr().err
    assert (out / "gw-7.key").read_bytes() == before
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    assert main(["keys", "show", str(junk)]) == 1
    err = capsys.readouterr().err
    assert err == f"edgefl keys: {junk}: not an Ed25519 key: a PEM 'CERTIFICATE' block; expected " \
                  "'PRIVATE KEY' or 'PUBLIC KEY' (PKCS #8 / SPKI, RFC 8410)\n"


@pytest.mark.parametrize("profile", SHIPPED_DEVICE_PROFILES, ids=lambda p: p.stem)
def test_sign_keys_every_shipped_device_profile_shows_the_security_table(profile: Path) -> None:
    text = profile.read_text()
    assert "[security]" in text.splitlines(), profile.name
    assert "security" not in tomllib.loads(text) or not tomllib.loads(text)["security"]  # commented out
    section = text[text.index("[security]") :]
    for shown in ("# signing_key_file = ", "# coordinator_public_key = ", "BEGIN PUBLIC KEY", "edgefl keys"):
        assert shown in section, (profile.name, shown)


def test_provision_key_files_are_bounded_before_they_are_read(tmp_path: Path) -> None:
    """A huge file or a special one (/dev/zero) named as a key is refused before it is read."""
    from edgefl.wire.signing import MAX_KEY_FILE_BYTES, load_signing_key, load_verify_key

    big = tmp_path / "big.key"
    big.write_text("a" * (MAX_KEY_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="not a key file"):
        load_signing_key(big)
    with pytest.raises(ValueError, match="not a regular file"):
        load_verify_key(Path("/dev/zero"))
    fifo = tmp_path / "fifo.pub"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        load_verify_key(fifo)  # opened without blocking, refused without a read
