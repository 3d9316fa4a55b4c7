"""``edgefl check-config`` loads a profile's TLS files as the connection will: a CA file that is there but
not PEM, or a client key that does not match its certificate, is named (exit 1), for device and
coordinator profiles alike; good files pass."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import _ca, _leaf, _write

from edgefl import cli
from edgefl.errors import ConfigError
from edgefl.profiles import BrokerConfig, Problems, check_broker

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ROOT / "firmware_configs" / "gateway_armv7_512mb.toml"  # its model is not loaded on x86: quick
COORDINATOR = ROOT / "firmware_configs" / "coordinator.toml"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tls-files")
    ca = _ca("edgefl test CA")
    _write(d / "ca.pem", ca[0])
    _write(d / "client.pem", *_leaf("dev-1", ca))
    _write(d / "other.pem", *_leaf("dev-2", ca))
    (d / "junk.pem").write_text("this is not a certificate\n")
    return {
        "ca": d / "ca.pem",
        "junk": d / "junk.pem",
        "cert": d / "client.pem",
        "key": d / "client.key",
        "other_key": d / "other.key",
    }


def check(broker: BrokerConfig, raw: dict[str, object]) -> list[str]:
    problems = Problems({})
    check_broker(problems, broker, raw, True)
    return problems.items


def test_profiles_tls_a_ca_file_that_is_not_pem_is_named(files: dict[str, Path]) -> None:
    url = "mqtts://broker.lan:8883"
    assert check(BrokerConfig(url=url, tls=True, ca_file=files["ca"]), {"url": url}) == []
    problems = check(BrokerConfig(url=url, tls=True, ca_file=files["junk"]), {"url": url})
    assert len(problems) == 1 and problems[0].startswith(
        f"broker.ca_file = {files['junk']}: not a readable PEM CA bundle ("
    ), problems
    # a missing file is named once, as before (not also as unreadable PEM)
    missing = files["ca"].parent / "missing.pem"
    problems = check(BrokerConfig(url=url, tls=True, ca_file=missing), {"url": url, "ca_file": str(missing)})
    assert problems == [f"broker.ca_file = '{missing}': file not found"]
    # nothing is loaded when the files are not checked (a profile read for another machine)
    p = Problems({})
    check_broker(p, BrokerConfig(url=url, tls=True, ca_file=files["junk"]), {"url": url}, False)
    assert p.items == []


def test_profiles_tls_a_client_key_not_matching_its_certificate_is_named(files: dict[str, Path]) -> None:
    url = "mqtts://broker.lan:8883"
    good = BrokerConfig(
        url=url, tls=True, ca_file=files["ca"], client_cert=files["cert"], client_key=files["key"]
    )
    assert check(good, {"url": url}) == []
    bad = BrokerConfig(
        url=url, tls=True, ca_file=files["ca"], client_cert=files["cert"], client_key=files["other_key"]
    )
    problems = check(bad, {"url": url})
    assert len(problems) == 1 and "the key does not match the certificate" in problems[0], problems
    assert problems[0].startswith(
        f"broker.client_cert = {files['cert']}, broker.client_key = {files['other_key']}"
    )


@pytest.mark.parametrize("profile", [DEVICE, COORDINATOR], ids=["device", "coordinator"])
def test_profiles_tls_check_config_refuses_what_the_run_would(
    profile: Path, files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    sets = ["--set", "broker.url=mqtts://broker.lan:8883", "--set", f"broker.ca_file={files['junk']}"]
    assert cli.main(["check-config", str(profile), *sets]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert f"broker.ca_file = {files['junk']}: not a readable PEM CA bundle (" in err, err
    sets[-1] = f"broker.ca_file={files['ca']}"
    assert cli.main(["check-config", str(profile), *sets]) == cli.EXIT_OK, capsys.readouterr().err


def test_profiles_tls_make_ssl_context_problems_name_the_keys(files: dict[str, Path]) -> None:
    from edgefl.tlsconf import make_ssl_context

    with pytest.raises(ConfigError) as info:
        make_ssl_context(files["junk"], files["cert"], files["other_key"])
    assert [p.split(" = ")[0] for p in info.value.problems] == ["broker.ca_file", "broker.client_cert"]
