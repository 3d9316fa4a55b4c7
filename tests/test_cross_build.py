"""Tests of cross_build/: manylinux tag lists, marker evaluation, lock files, closure checks, the unit.

Fast and offline by default. The tests that need a real wheelhouse use the cached one under
``cache/wheelhouse/<target>/`` (made by ``python -m cross_build.wheelhouse --target T --out
cache/wheelhouse/T``) and skip when it is absent; with ``EDGEFL_NETWORK_TESTS=1`` they build it into a
temporary folder instead (downloads from the package index, ~10-30 s per target).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from cross_build import cli as wh_cli
from cross_build import lock as wh_lock
from cross_build import targets as wh_targets
from cross_build import wheelhouse as wh
from cross_build.lock import LockEntry
from cross_build.targets import WheelhouseError
from edgefl.profiles import sha256_file
from tests.support.lockfile import parse_lock

ROOT = Path(__file__).resolve().parents[1]
# the wheelhouse builds pip-wheel the checkout in its source tree: with test_packaging, on one worker
pytestmark = pytest.mark.xdist_group("wheel")

# The Debian 12 (CPython 3.11) flavours; the Python-specific tests name their Python.
AARCH64 = wh_targets.target_for("aarch64", "3.11")
AARCH64_313 = wh_targets.target_for("aarch64", "3.13")
ARMV7L = wh_targets.TARGETS["armv7l"]
X86_64 = wh_targets.target_for("x86_64", "3.11")

# edgefl's Requires-Dist as setuptools writes them from setup.cfg (install_requires + extras).
EDGEFL_REQUIRES = [
    'ai-edge-litert>=2.0; platform_machine != "armv7l"',
    "numpy>=1.24",
    "cbor2>=5.9",
    "paho-mqtt>=2.0",
    "aiohttp>=3.9",
    'tomli>=2.0; python_version < "3.11"',
    'amqtt>=0.11; extra == "demo"',
    'tflite-runtime>=2.14; extra == "tflite"',
    'numpy<2; extra == "tflite"',
    'PyNaCl>=1.5; extra == "security"',
]


# --- manylinux tags -----------------------------------------------------------------------------


def test_aarch64_tags_list_every_glibc_from_2_28_down_to_2_17() -> None:
    tags = wh_targets.manylinux_tags("aarch64", (2, 28))
    assert tags == [f"manylinux_2_{m}_aarch64" for m in range(28, 16, -1)] + ["manylinux2014_aarch64"]
    # ai-edge-litert 2.x is tagged only manylinux_2_27_aarch64: without it pip picks LiteRT 1.4.0.
    assert "manylinux_2_27_aarch64" in tags


def test_armv7l_tags_reach_tflite_runtime_2_34() -> None:
    tags = wh_targets.manylinux_tags("armv7l", (2, 36))
    assert tags[0] == "manylinux_2_36_armv7l"
    assert "manylinux_2_34_armv7l" in tags
    assert tags[-2:] == ["manylinux_2_17_armv7l", "manylinux2014_armv7l"]
    assert len(tags) == 36 - 17 + 1 + 1


def test_x86_64_tags_include_the_legacy_aliases_in_place() -> None:
    tags = wh_targets.manylinux_tags("x86_64", (2, 17))
    assert tags[:2] == ["manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    i = tags.index("manylinux_2_12_x86_64")
    assert tags[i + 1] == "manylinux2010_x86_64"
    assert tags[-2:] == ["manylinux_2_5_x86_64", "manylinux1_x86_64"]
    assert len(tags) == 17 - 5 + 1 + 3


@pytest.mark.parametrize(("machine", "glibc"), [("aarch64", (2, 16)), ("x86_64", (2, 4)), ("armv7l", (3, 0))])
def test_tags_reject_a_glibc_without_manylinux(machine: str, glibc: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="no manylinux tag"):
        wh_targets.manylinux_tags(machine, glibc)


@pytest.mark.parametrize(
    ("filename", "target", "ok"),
    [
        ("ai_edge_litert-2.3.0-cp311-cp311-manylinux_2_27_aarch64.whl", AARCH64, True),
        ("ai_edge_litert-2.3.0-cp311-cp311-manylinux_2_27_aarch64.whl", ARMV7L, False),
        ("tflite_runtime-2.14.0-cp311-cp311-manylinux_2_34_armv7l.whl", ARMV7L, True),
        # glibc 2.34 wheel on a glibc 2.28 aarch64 target: does not install.
        ("x-1.0-cp311-cp311-manylinux_2_34_aarch64.whl", AARCH64, False),
        ("protobuf-7.36.2-cp310-abi3-manylinux2014_aarch64.whl", AARCH64, True),
        ("x-1.0-cp312-abi3-manylinux2014_aarch64.whl", AARCH64, False),
        ("x-1.0-cp312-cp312-manylinux2014_aarch64.whl", AARCH64, False),
        ("paho_mqtt-2.2.0-py3-none-any.whl", ARMV7L, True),
        ("flatbuffers-25.12.19-py2.py3-none-any.whl", AARCH64, True),
        ("x-1.0-cp311-cp311-linux_aarch64.whl", AARCH64, False),
        ("x-1.0-cp311-cp311-musllinux_1_2_aarch64.whl", AARCH64, False),
        # The same wheels for a CPython 3.13 wheelhouse (Debian 13).
        ("ai_edge_litert-2.3.0-cp313-cp313-manylinux_2_27_aarch64.whl", AARCH64_313, True),
        ("ai_edge_litert-2.3.0-cp311-cp311-manylinux_2_27_aarch64.whl", AARCH64_313, False),
        ("ai_edge_litert-2.3.0-cp313-cp313-manylinux_2_27_aarch64.whl", AARCH64, False),
        ("protobuf-7.36.2-cp310-abi3-manylinux2014_aarch64.whl", AARCH64_313, True),
        ("x-1.0-cp313-abi3-manylinux2014_aarch64.whl", AARCH64_313, True),
        ("x-1.0-cp313-cp313t-manylinux2014_aarch64.whl", AARCH64_313, False),
        ("x-1.0-py313-none-any.whl", AARCH64_313, True),
        ("paho_mqtt-2.2.0-py3-none-any.whl", AARCH64_313, True),
    ],
)
def test_supported_wheel(filename: str, target: wh_targets.Target, ok: bool) -> None:
    assert wh_targets.supported_wheel(filename, target) is ok


# --- markers ------------------------------------------------------------------------------------


def _names(reqs: list[object]) -> list[str]:
    return [str(r) for r in reqs]


def test_armv7l_requirements_drop_litert_and_take_the_tflite_extra() -> None:
    reqs = wh_targets.applicable_requirements(EDGEFL_REQUIRES, ARMV7L, ARMV7L.extras)
    assert _names(list(reqs)) == [
        "numpy>=1.24", "cbor2>=5.9", "paho-mqtt>=2.0", "aiohttp>=3.9", "tflite-runtime>=2.14", "numpy<2",
        "PyNaCl>=1.5",
    ]


def test_aarch64_requirements_keep_litert_with_only_the_security_extra() -> None:
    reqs = wh_targets.applicable_requirements(EDGEFL_REQUIRES, AARCH64, AARCH64.extras)
    assert _names(list(reqs)) == ["ai-edge-litert>=2.0", "numpy>=1.24", "cbor2>=5.9", "paho-mqtt>=2.0",
                                  "aiohttp>=3.9", "PyNaCl>=1.5"]


def test_markers_use_the_target_not_the_build_machine() -> None:
    env = wh_targets.target_environment(ARMV7L)
    assert env["platform_machine"] == "armv7l"
    assert env["python_version"] == "3.11"
    assert env["sys_platform"] == "linux"
    env = wh_targets.target_environment(AARCH64_313)
    assert (env["python_version"], env["python_full_version"]) == ("3.13", "3.13.0")


# --- CPython per wheelhouse ---------------------------------------------------------------------


def test_wheelhouse_defaults_to_the_python_of_the_targets_debian_stable() -> None:
    # aarch64/x86_64: Debian 13 (CPython 3.13); armv7l: Debian 12 (3.11), its newest with a runtime.
    got = {name: wh_targets.target_for(name).python_version for name in wh_targets.TARGETS}
    assert got == {"aarch64": "3.13", "armv7l": "3.11", "x86_64": "3.13"}


@pytest.mark.parametrize(("python", "abi"), [("3.11", "cp311"), ("3.12", "cp312"), ("3.13", "cp313")])
def test_wheelhouse_target_for_python_tags_the_abi(python: str, abi: str) -> None:
    t = wh_targets.target_for("aarch64", python)
    assert (t.python_version, t.abi, t.platform) == (python, abi, f"{abi}-manylinux_2_28_aarch64")
    assert t.pins == wh_targets.TARGETS["aarch64"].pins  # only the Python changes


@pytest.mark.parametrize("python", ["3.12", "3.13"])
def test_wheelhouse_refuses_armv7l_without_a_runtime_up_front(
    python: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    why = wh_targets.refusal("armv7l", python)
    assert why is not None and "no TFLite runtime wheel exists for armv7l" in why and python in why
    with pytest.raises(WheelhouseError, match=r"tflite-runtime 2\.14\.0"):
        wh_targets.target_for("armv7l", python)
    out = tmp_path / "out"
    rc = wh.main(["--target", "armv7l", "--python", python, "--out", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"armv7l CPython {python}" in err and "stops at cp311" in err
    assert not out.exists()  # refused before anything is built or downloaded


def test_wheelhouse_build_refuses_a_refused_target_too(tmp_path: Path) -> None:
    import dataclasses

    t = dataclasses.replace(ARMV7L, python_version="3.13")
    with pytest.raises(WheelhouseError, match=r"armv7l CPython 3\.13"):
        wh.build_wheelhouse(t, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_wheelhouse_refusal_names_unknown_pythons_and_targets() -> None:
    assert wh_targets.refusal("aarch64", "3.13") is None
    assert wh_targets.refusal("armv7l", "3.11") is None
    assert wh_targets.refusal("aarch64", "3.10") == "unsupported CPython '3.10' (one of 3.11, 3.12, 3.13)"
    assert wh_targets.refusal("mips", "3.11") == "unknown target 'mips' (one of aarch64, armv7l, x86_64)"


# --- lock ---------------------------------------------------------------------------------------


def test_lock_round_trip_is_sorted_with_file_comments() -> None:
    entries = [
        LockEntry("numpy", "2.4.6", "b" * 64, "numpy-2.4.6-cp311-cp311-manylinux_2_27_aarch64.whl"),
        LockEntry("ai-edge-litert", "2.3.0", "a" * 64,
                     "ai_edge_litert-2.3.0-cp311-cp311-manylinux_2_27_aarch64.whl"),
    ]
    text = wh_lock.format_lock(entries, "edgefl wheelhouse for aarch64")
    assert text.splitlines() == [
        "# edgefl wheelhouse for aarch64",
        "# ai_edge_litert-2.3.0-cp311-cp311-manylinux_2_27_aarch64.whl",
        "ai-edge-litert==2.3.0 --hash=sha256:" + "a" * 64,
        "# numpy-2.4.6-cp311-cp311-manylinux_2_27_aarch64.whl",
        "numpy==2.4.6 --hash=sha256:" + "b" * 64,
    ]
    assert parse_lock(text) == sorted(entries, key=lambda e: e.name)


def test_parse_lock_names_the_bad_line() -> None:
    with pytest.raises(ValueError, match="line 3"):
        parse_lock("# header\nnumpy==1.0 --hash=sha256:" + "0" * 64 + "\nnumpy>=1.0\n")
    with pytest.raises(ValueError, match="line 1"):
        parse_lock("numpy==1.0 --hash=sha256:abc\n")  # not 64 hex digits


def test_expectations_catch_the_litert_1_4_fallback() -> None:
    lock = [LockEntry("ai-edge-litert", "1.4.0", "0" * 64), LockEntry("cbor2", "6.3.0", "1" * 64),
            LockEntry("pynacl", "1.6.2", "2" * 64)]
    with pytest.raises(WheelhouseError) as err:
        wh_lock.check_expectations(lock, AARCH64)
    assert err.value.name == "ai-edge-litert"
    assert err.value.platform == "cp311-manylinux_2_28_aarch64"
    assert "locked 1.4.0, expected ai-edge-litert>=2" in str(err.value)
    wh_lock.check_expectations([LockEntry("ai-edge-litert", "2.3.0", "0" * 64), *lock[1:]], AARCH64)


def test_expectations_catch_a_missing_distribution() -> None:
    with pytest.raises(WheelhouseError, match=r"tflite-runtime for cp311-manylinux_2_36_armv7l: missing"):
        wh_lock.check_expectations([LockEntry("cbor2", "5.9.0", "0" * 64)], ARMV7L)


# --- closure ------------------------------------------------------------------------------------


def _wheel(tmp: Path, filename: str, requires: list[str]) -> wh_lock.WheelInfo:
    """Write a minimal real wheel (METADATA only) and read it back through read_wheel."""
    name, version = filename.split("-")[:2]
    path = tmp / filename
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(meta) + "\n")
    return wh_lock.read_wheel(path)


def test_read_wheel_reads_requires_dist(tmp_path: Path) -> None:
    info = _wheel(tmp_path, "edgefl-0.1.0-py3-none-any.whl", EDGEFL_REQUIRES)
    assert (info.name, info.version) == ("edgefl", "0.1.0")
    assert info.requires_dist == tuple(EDGEFL_REQUIRES)


def test_read_wheel_rejects_a_non_wheel(tmp_path: Path) -> None:
    bad = tmp_path / "x-1.0-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(WheelhouseError, match="not a readable wheel"):
        wh_lock.read_wheel(bad)


def _armv7l_house(tmp: Path, *, with_aiohttp: bool = True) -> list[wh_lock.WheelInfo]:
    house = [
        _wheel(tmp, "edgefl-0.1.0-py3-none-any.whl", EDGEFL_REQUIRES),
        _wheel(tmp, "cbor2-5.9.0-py3-none-any.whl", []),
        _wheel(tmp, "paho_mqtt-2.2.0-py3-none-any.whl", []),
        _wheel(tmp, "tflite_runtime-2.14.0-cp311-cp311-manylinux_2_34_armv7l.whl", ["numpy>=1.23.2"]),
    ]
    if with_aiohttp:
        house.append(_wheel(tmp, "aiohttp-3.14.5-cp311-cp311-manylinux2014_armv7l.whl", []))
    return house


def test_closure_accepts_debian_numpy_on_armv7l(tmp_path: Path) -> None:
    wh_lock.check_closure(_armv7l_house(tmp_path), ARMV7L)


def test_wheelhouse_carries_the_signing_library_on_every_target() -> None:
    """PyNaCl (the security extra): a wheel on aarch64 and x86_64, Debian's python3-nacl on armv7l."""
    for target in (AARCH64, AARCH64_313, X86_64, ARMV7L):
        assert "security" in target.extras, target.name
        names = {r.name for r in wh_targets.applicable_requirements(EDGEFL_REQUIRES, target, target.extras)}
        assert "PyNaCl" in names, target.name
    assert "pynacl>=1.5" in AARCH64.expect and "pynacl>=1.5" in X86_64.expect
    assert ARMV7L.system_packages["pynacl"] == "1.5.0"  # Debian 12's python3-nacl
    assert ARMV7L.system_modules["nacl.signing"] == "python3-nacl"
    assert {"python3-nacl", "python3-cffi"} <= set(ARMV7L.debian_packages)


def test_closure_checks_debian_pynacl_on_armv7l(tmp_path: Path) -> None:
    without = dataclasses.replace(ARMV7L, system_packages={"numpy": "1.24.2"})
    with pytest.raises(WheelhouseError) as err:
        wh_lock.check_closure(_armv7l_house(tmp_path), without)
    assert (err.value.name, err.value.reason) == ("pynacl", "no wheel (required by edgefl 0.1.0)")


def test_closure_names_the_missing_dependency_and_platform(tmp_path: Path) -> None:
    with pytest.raises(WheelhouseError) as err:
        wh_lock.check_closure(_armv7l_house(tmp_path, with_aiohttp=False), ARMV7L)
    assert (err.value.name, err.value.platform) == ("aiohttp", "cp311-manylinux_2_36_armv7l")
    assert "required by edgefl 0.1.0" in err.value.reason


def test_closure_checks_the_system_package_version(tmp_path: Path) -> None:
    old_numpy = wh_targets.Target(name="armv7l", machine="armv7l", glibc=(2, 36), extras=("tflite",),
                          system_packages={"numpy": "1.22.0"})
    pattern = r"numpy for .*: 1\.22\.0 does not satisfy numpy>=1\.24 \(required by edgefl\)"
    with pytest.raises(WheelhouseError, match=pattern):
        wh_lock.check_closure(_armv7l_house(tmp_path), old_numpy)


def test_closure_rejects_a_wheel_for_another_platform(tmp_path: Path) -> None:
    house = _armv7l_house(tmp_path)
    house.append(_wheel(tmp_path, "yarl-1.25.1-cp311-cp311-manylinux2014_aarch64.whl", []))
    with pytest.raises(WheelhouseError, match=r"yarl for .*armv7l: .* does not install on the target"):
        wh_lock.check_closure(house, ARMV7L)


# --- systemd unit -------------------------------------------------------------------------------


def _unit_values(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


@pytest.mark.parametrize("stem", ["gateway_aarch64_256mb", "gateway_armv7_512mb", "rpi4"])
def test_unit_takes_its_memory_limits_from_the_profile(stem: str) -> None:
    profile = ROOT / "firmware_configs" / f"{stem}.toml"
    memory = tomllib.loads(profile.read_text(encoding="utf-8"))["memory"]
    v = _unit_values(wh.render_unit(profile, "/opt/edgefl"))
    assert v["MemoryMax"] == f"{memory['cap_mb']}M"
    assert v["MemoryHigh"] == f"{memory['cap_mb'] - memory['reserve_mb']}M"
    assert v["MemorySwapMax"] == "0"
    assert v["StateDirectory"] == "edgefl"
    assert v["ExecStart"] == (f"/opt/edgefl/current/venv/bin/edgefl run /opt/edgefl/current/firmware_configs/"
                              f"{stem}.toml $EDGEFL_ARGS")
    assert (v["Restart"], v["User"], v["ProtectSystem"], v["NoNewPrivileges"]) == (
        "on-failure", "edgefl", "strict", "yes")


def test_units_run_python_optimised_with_its_bytecode_precompiled() -> None:
    """H17 item 3: PYTHONOPTIMIZE=2 (-OO, ~3 MiB less RSS); install.sh compiles that bytecode."""
    agent = _unit_values(wh.render_unit(ROOT / "firmware_configs" / "gateway_aarch64_256mb_mobilenet.toml"))
    unit = ROOT / "cross_build" / "edgefl-coordinator.service"
    coordinator = _unit_values(unit.read_text(encoding="utf-8"))
    expected = ["PYTHONUNBUFFERED=1", "MALLOC_ARENA_MAX=2", "PYTHONOPTIMIZE=2"]
    assert coordinator["Environment"].split() == expected
    # the agent's unit also fixes glibc's mmap threshold (issue 17: a freed large block goes back to
    # the kernel instead of raising the threshold; the agent sets the same with mallopt)
    assert agent["Environment"].split() == [*expected[:2], "MALLOC_MMAP_THRESHOLD_=131072", expected[2]]
    install = (ROOT / "cross_build" / "install.sh").read_text(encoding="utf-8")
    assert '"$RELEASE/venv/bin/python" -m compileall -q -o 2 "$RELEASE/venv/lib"' in install


def test_unit_for_the_256mb_gateway_caps_at_96_mb() -> None:
    v = _unit_values(wh.render_unit(ROOT / "firmware_configs" / "gateway_aarch64_256mb.toml"))
    assert (v["MemoryMax"], v["MemoryHigh"]) == ("96M", "88M")


def test_unit_refuses_a_state_dir_outside_var_lib() -> None:
    # dev_x86 keeps its state next to the profile: ProtectSystem=strict would make it read-only.
    with pytest.raises(WheelhouseError, match="must be under /var/lib"):
        wh.render_unit(ROOT / "firmware_configs" / "dev_x86.toml")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.subprocess
def test_rendered_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: give it a prefix with one.
    prefix = tmp_path / "opt"
    exe = prefix / "current" / "venv" / "bin" / "edgefl"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (prefix / "current" / "firmware_configs").mkdir()
    unit = tmp_path / "edgefl-agent.service"
    unit.write_text(wh.render_unit(ROOT / "firmware_configs" / "gateway_aarch64_256mb.toml", str(prefix)))
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    stderr = proc.stderr
    if _systemd_version() < 254:  # the restart backoff's keys came in systemd 254; older ones skip them
        stderr = "\n".join(
            ln for ln in stderr.splitlines()
            if not re.search(r"Unknown key '(RestartSteps|RestartMaxDelaySec)' in section \[Service\]", ln)
        )
    assert "edgefl-agent.service" not in stderr, proc.stderr


def _systemd_version() -> int:
    out = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True, check=False).stdout
    m = re.match(r"systemd (\d+)", out)
    return int(m.group(1)) if m else 0


def test_fault_unit_restarts_runtime_faults_with_backoff_never_config_errors() -> None:
    v = _unit_values(wh.render_unit(ROOT / "firmware_configs" / "gateway_aarch64_256mb.toml"))
    assert (v["Restart"], v["RestartPreventExitStatus"]) == ("on-failure", "1 2 3 5")
    assert (v["RestartSec"], v["RestartSteps"], v["RestartMaxDelaySec"]) == ("5s", "6", "5min")
    assert v["StartLimitIntervalSec"] == "0"
    from edgefl.cli import EXIT_CREDENTIALS, EXIT_RUNTIME, EXIT_TEMPFAIL

    assert (EXIT_RUNTIME, EXIT_TEMPFAIL) == (4, 75)  # both restarted: not in RestartPreventExitStatus
    assert EXIT_CREDENTIALS == 5  # a wrong password does not fix itself: in RestartPreventExitStatus


# --- CLI hook -----------------------------------------------------------------------------------


def test_wheelhouse_subcommand_parses() -> None:
    parser = argparse.ArgumentParser(prog="edgefl")
    sub = parser.add_subparsers(dest="command", required=True)
    wh_cli.add_wheelhouse_parser(sub)
    args = parser.parse_args(["wheelhouse", "--target", "armv7l", "--out", "/tmp/x"])
    got = (args.command, args.target, args.out, args.prefix, args.python)
    assert got == ("wheelhouse", "armv7l", "/tmp/x", "/opt/edgefl", None)
    assert args.func is wh_cli.run_wheelhouse
    args = parser.parse_args(["wheelhouse", "--target", "aarch64", "--python", "3.12", "--out", "/tmp/x"])
    assert args.python == "3.12"
    for bad in (["--target", "mips"], ["--target", "aarch64", "--python", "3.10"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["wheelhouse", *bad, "--out", "/tmp/x"])
        assert exc.value.code == 2


def test_cli_hook_knows_every_target_and_the_default_prefix() -> None:
    assert tuple(sorted(wh_targets.TARGETS)) == wh_cli.TARGET_NAMES
    assert wh_targets.PYTHONS == wh_cli.PYTHON_VERSIONS
    assert inspect.signature(wh.render_coordinator_unit).parameters["prefix"].default == wh_cli.DEFAULT_PREFIX


@pytest.mark.subprocess
def test_cli_hook_does_not_import_the_builder() -> None:
    # `edgefl --help` in a checkout loads cross_build.cli from beside edgefl/: not packaging nor the builder.
    code = ("import argparse, sys; from edgefl import cli; "
            "cli._add_checkout_parsers(argparse.ArgumentParser().add_subparsers()); "
            "print('cross_build.cli' in sys.modules, 'cross_build.wheelhouse' in sys.modules, "
            "'packaging.requirements' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "False"]


@pytest.mark.subprocess
def test_wheelhouse_build_failure_exits_1_with_the_name(tmp_path: Path) -> None:
    # An unknown repo path: pip wheel fails for edgefl, before any download.
    rc = wh.main(["--target", "aarch64", "--out", str(tmp_path / "out"), "--repo", str(tmp_path / "nope")])
    assert rc == 1


# --- install.sh (offline parts) -----------------------------------------------------------------


RUNNING_PYTHON = "{}.{}".format(*sys.version_info[:2])


def _fake_house(tmp: Path, machine: str, python: str = RUNNING_PYTHON) -> Path:
    house = tmp / "house"
    (house / "firmware_configs").mkdir(parents=True)
    shutil.copy2(ROOT / "cross_build" / "install.sh", house / "install.sh")
    shutil.copy2(ROOT / "firmware_configs" / "gateway_aarch64_256mb.toml", house / "firmware_configs")
    (house / "TARGET").write_text(
        f"target={machine}\nmachine={machine}\npython={python}\nglibc=2.28\nsystem_site_packages=0\n"
        "default_profile=gateway_aarch64_256mb\nprefix=/opt/edgefl\ndebian_packages=python3\n"
    )
    return house


# systemd is not a part we ship: a fake systemctl (and useradd/getent/userdel, so no real user is made)
# on PATH records every call in $FAKE_STATE/log and fails the sub-command named in $FAKE_FAIL; "pid1"
# answers is-system-running as systemctl does in a container where systemd is not PID 1.
_FAKE_SYSTEMCTL = """#!/bin/sh
echo "systemctl $*" >> "$FAKE_STATE/log"
case "$1" in
  is-system-running)
    if [ "${FAKE_FAIL:-}" = pid1 ]; then
      echo "System has not been booted with systemd as init system (PID 1). Can't operate." >&2
      echo offline; exit 1
    fi
    echo running; exit 0 ;;
  is-enabled) if [ -f "$FAKE_STATE/enabled" ]; then echo enabled; exit 0; fi; echo disabled; exit 1 ;;
  is-active) if [ -f "$FAKE_STATE/active" ]; then echo active; exit 0; fi; echo inactive; exit 3 ;;
esac
if [ "${FAKE_FAIL:-}" = "$1" ]; then echo "Failed to $1 edgefl-agent.service: fake failure" >&2; exit 1; fi
case "$1" in
  enable) touch "$FAKE_STATE/enabled" ;;
  disable) rm -f "$FAKE_STATE/enabled" ;;
  restart) touch "$FAKE_STATE/active" ;;
esac
"""
_FAKE_USER_TOOLS = {
    "getent": '#!/bin/sh\n[ -f "$FAKE_STATE/user-$2" ] && '
              'echo "$2:x:999:999::/var/lib/edgefl:/usr/sbin/nologin"\n',
    "useradd": '#!/bin/sh\necho "useradd $*" >> "$FAKE_STATE/log"\nfor a; do u=$a; done\n'
               'touch "$FAKE_STATE/user-$u"\n',
    "userdel": '#!/bin/sh\necho "userdel $*" >> "$FAKE_STATE/log"\nrm -f "$FAKE_STATE/user-$1"\n',
}


@dataclass
class FakeSystem:
    """A fake systemd + user database and a sysconfdir under tmp, for running install.sh."""

    root: Path
    state: Path
    etc: Path
    prefix: Path
    env: dict[str, str]

    @property
    def unit(self) -> Path:
        return self.etc / "systemd" / "system" / "edgefl-agent.service"

    @property
    def agent_env(self) -> Path:
        return self.etc / "edgefl" / "agent.env"

    def calls(self) -> list[str]:
        log = self.state / "log"
        return log.read_text().splitlines() if log.exists() else []

    def install(self, house: Path, *args: str, fail: str = "") -> subprocess.CompletedProcess[str]:
        (self.state / "log").unlink(missing_ok=True)
        return subprocess.run(
            ["sh", str(house / "install.sh"), "--prefix", str(self.prefix),
             "--python", sys.executable, *args],
            capture_output=True, text=True, check=False, env={**self.env, "FAKE_FAIL": fail},
        )


@pytest.fixture
def fake_system(tmp_path: Path) -> FakeSystem:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"systemctl": _FAKE_SYSTEMCTL, **_FAKE_USER_TOOLS}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_STATE": str(state),
           "EDGEFL_SYSCONFDIR": str(tmp_path / "etc")}
    return FakeSystem(tmp_path, state, tmp_path / "etc", tmp_path / "opt", env)


@pytest.mark.subprocess
def test_install_sh_refuses_another_machine_before_touching_anything(tmp_path: Path) -> None:
    house = _fake_house(tmp_path, "aarch64" if os.uname().machine != "aarch64" else "x86_64")
    prefix = tmp_path / "prefix"
    proc = subprocess.run(
        ["sh", str(house / "install.sh"), "--no-systemd", "--prefix", str(prefix),
         "--python", sys.executable],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 1
    assert "this wheelhouse is for" in proc.stderr and os.uname().machine in proc.stderr
    assert not prefix.exists()


@pytest.mark.subprocess
def test_install_sh_refuses_another_python_in_one_line_naming_both(tmp_path: Path) -> None:
    other = "3.13" if RUNNING_PYTHON != "3.13" else "3.12"
    house = _fake_house(tmp_path, os.uname().machine, python=other)
    prefix = tmp_path / "prefix"
    proc = subprocess.run(
        ["sh", str(house / "install.sh"), "--no-systemd", "--prefix", str(prefix),
         "--python", sys.executable],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"this wheelhouse is for CPython {other}" in lines[0]
    assert f"{sys.executable} is CPython {RUNNING_PYTHON}" in lines[0]
    assert f"--python {RUNNING_PYTHON}" in lines[0]  # how to build the matching one
    assert not prefix.exists()


@pytest.mark.subprocess
def test_install_sh_refuses_when_systemd_is_not_pid_1(tmp_path: Path, fake_system: FakeSystem) -> None:
    house = _fake_house(tmp_path, os.uname().machine)
    proc = fake_system.install(house, fail="pid1")
    assert proc.returncode == 1
    assert "systemd is not running here (systemctl is-system-running: offline" in proc.stderr
    assert "use --no-systemd" in proc.stderr
    # Refused before anything: no release, no user, no unit, no agent.env.
    assert not fake_system.prefix.exists() and not fake_system.etc.exists()
    assert fake_system.calls() == ["systemctl is-system-running"]


@pytest.mark.subprocess
def test_install_sh_rollback_needs_a_previous_release(tmp_path: Path) -> None:
    house = _fake_house(tmp_path, os.uname().machine)
    proc = subprocess.run(
        ["sh", str(house / "install.sh"), "--rollback", "--no-systemd", "--prefix", str(tmp_path / "p")],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 1
    assert "no " + str(tmp_path / "p") + "/previous" in proc.stderr


# --- real wheelhouses (cached, or built with EDGEFL_NETWORK_TESTS=1) ----------------------------


def _house(name: str, python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cached = ROOT / "cache" / "wheelhouse" / f"{name}-{python}"
    if (cached / "requirements.lock").is_file():
        return cached
    if os.environ.get("EDGEFL_NETWORK_TESTS") != "1":
        pytest.skip(f"no cached wheelhouse at {cached.relative_to(ROOT)} (EDGEFL_NETWORK_TESTS=1 builds one)")
    out = tmp_path_factory.mktemp(f"wheelhouse-{name}-{python}")
    wh.build_wheelhouse(wh_targets.target_for(name, python), out)
    return out


def _locked(house: Path) -> dict[str, LockEntry]:
    entries = parse_lock((house / "requirements.lock").read_text(encoding="utf-8"))
    return {e.name: e for e in entries}


def _check_hashes_and_tags(house: Path, target: wh_targets.Target) -> None:
    lock = _locked(house)
    files = sorted((house / "wheels").glob("*.whl"))
    assert len(files) == len(lock)
    for f in files:
        entry = next(e for e in lock.values() if e.filename == f.name)
        assert sha256_file(f) == entry.sha256, f.name
        assert wh_targets.supported_wheel(f.name, target), f.name


@pytest.mark.parametrize("python", ["3.11", "3.12", "3.13"])
def test_aarch64_wheelhouse_locks_litert_2(python: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    house = _house("aarch64", python, tmp_path_factory)
    target = wh_targets.target_for("aarch64", python)
    lock = _locked(house)
    assert int(lock["ai-edge-litert"].version.split(".")[0]) >= 2
    assert lock["ai-edge-litert"].filename.endswith(f"-{target.abi}-{target.abi}-manylinux_2_27_aarch64.whl")
    assert "tflite-runtime" not in lock
    assert {"edgefl", "numpy", "cbor2", "paho-mqtt", "aiohttp", "pynacl", "cffi"} <= set(lock)
    assert lock["pynacl"].filename.endswith("-abi3-manylinux_2_26_aarch64.manylinux_2_28_aarch64.whl")
    # Every CPython-specific wheel is for this Python: its own ABI or the stable ABI, never another cp3XX.
    for e in lock.values():
        for tag in parse_wheel_filename(e.filename)[3]:
            assert tag.abi in {target.abi, "abi3", "none"}, e.filename
    _check_hashes_and_tags(house, target)
    assert f"python={python}\n" in (house / "TARGET").read_text()
    assert (house / "systemd" / "gateway_aarch64_256mb.service").is_file()
    assert (house / "systemd" / "edgefl-coordinator.service").is_file()


def test_armv7l_wheelhouse_has_tflite_runtime_and_pure_cbor2(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    house = _house("armv7l", "3.11", tmp_path_factory)
    lock = _locked(house)
    assert lock["tflite-runtime"].version == "2.14.0"
    assert lock["cbor2"].filename == "cbor2-5.9.0-py3-none-any.whl"
    assert "numpy" not in lock  # Debian's python3-numpy, through --system-site-packages
    assert "pynacl" not in lock and "cffi" not in lock  # Debian's python3-nacl and python3-cffi
    assert "system_modules=numpy=python3-numpy nacl.signing=python3-nacl cffi=python3-cffi\n" in (
        house / "TARGET"
    ).read_text()
    assert "ai-edge-litert" not in lock
    with zipfile.ZipFile(house / "wheels" / lock["cbor2"].filename) as zf:
        assert not [n for n in zf.namelist() if n.endswith(".so")]
    _check_hashes_and_tags(house, ARMV7L)
    assert "system_site_packages=1" in (house / "TARGET").read_text()


# --- install.sh, all or nothing (a real wheelhouse for this machine and Python, a fake systemctl) -------


@pytest.fixture(scope="module")
def host_house(tmp_path_factory: pytest.TempPathFactory) -> Path:
    machine = os.uname().machine
    if machine not in wh_targets.TARGETS:
        pytest.skip(f"no wheelhouse target for this build machine ({machine})")
    return _house(machine, RUNNING_PYTHON, tmp_path_factory)


def _releases(prefix: Path) -> list[str]:
    return sorted(p.name for p in (prefix / "releases").iterdir())


@pytest.mark.parametrize("step", ["enable", "restart"])
def test_install_sh_first_install_undoes_everything_when_systemctl_fails(
    step: str, host_house: Path, fake_system: FakeSystem
) -> None:
    proc = fake_system.install(host_house, "--profile", "gateway_aarch64_256mb", fail=step)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"Failed to {step} edgefl-agent.service" in proc.stderr
    assert "install.sh: failed (exit 1), undone: release edgefl-" in proc.stderr
    # Nothing is left: no prefix, no unit, no agent.env, the user it created removed, unit not enabled.
    assert not fake_system.prefix.exists()
    assert not fake_system.unit.exists() and not (fake_system.etc / "edgefl").exists()
    calls = fake_system.calls()
    assert calls[0] == "systemctl is-system-running"
    assert "useradd --system --user-group --no-create-home --home-dir /var/lib/edgefl " \
           "--shell /usr/sbin/nologin edgefl" in calls
    assert calls[-1] == "userdel edgefl"
    assert not (fake_system.state / "user-edgefl").exists()
    assert not (fake_system.state / "enabled").exists()
    assert not (fake_system.state / "active").exists()


def test_install_sh_upgrade_keeps_the_running_release_when_restart_fails(
    host_house: Path, fake_system: FakeSystem
) -> None:
    first = fake_system.install(host_house, "--profile", "gateway_aarch64_256mb")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "install.sh: installed edgefl-" in first.stdout
    old = os.readlink(fake_system.prefix / "current")
    assert old.startswith("releases/edgefl-")
    assert fake_system.calls()[-2:] == ["systemctl enable edgefl-agent.service",
                                        "systemctl restart edgefl-agent.service"]
    old_unit = fake_system.unit.read_text()
    assert "MemoryMax=96M" in old_unit
    fake_system.agent_env.write_text('EDGEFL_ARGS="--set device.id=gw-0001"\n')

    # Another profile (another MemoryMax), and the restart fails.
    proc = fake_system.install(host_house, "--profile", "rpi4", fail="restart")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Failed to restart edgefl-agent.service" in proc.stderr
    assert f"current -> {old}, unit file restored" in proc.stderr
    assert os.readlink(fake_system.prefix / "current") == old
    assert not (fake_system.prefix / "previous").exists()
    assert _releases(fake_system.prefix) == [Path(old).name]
    assert fake_system.unit.read_text() == old_unit
    assert fake_system.agent_env.read_text() == 'EDGEFL_ARGS="--set device.id=gw-0001"\n'
    assert not list(fake_system.unit.parent.glob("*.edgefl-old"))
    calls = fake_system.calls()
    assert "useradd" not in " ".join(calls) and "userdel" not in " ".join(calls)  # the user existed
    # After the failed restart: reload the restored unit, restart the old release (which was active).
    i = calls.index("systemctl restart edgefl-agent.service")
    assert calls[i + 1:] == ["systemctl daemon-reload", "systemctl restart edgefl-agent.service"]
    assert (fake_system.state / "enabled").exists()  # it was enabled before: left enabled

    # The same upgrade with a working systemctl: current moves, previous is the old release.
    ok = fake_system.install(host_house, "--profile", "rpi4")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert os.readlink(fake_system.prefix / "previous") == old
    assert os.readlink(fake_system.prefix / "current") != old
    assert "MemoryMax=192M" in fake_system.unit.read_text()


def test_install_sh_release_signs_offline_with_the_wheelhouse_signing_library(
    host_house: Path, fake_system: FakeSystem, tmp_path: Path
) -> None:
    """The offline install carries PyNaCl: the release makes keys and a profile with them checks."""
    assert "pynacl" in _locked(host_house)
    proc = fake_system.install(host_house, "--profile", "gateway_aarch64_256mb", "--no-start")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    venv_bin = fake_system.prefix / "current" / "venv" / "bin"
    # the release's own Python, without this checkout or the test venv on its path
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = functools.partial(
        subprocess.run, capture_output=True, text=True, check=False, env=env, cwd=tmp_path
    )
    where = run(
        [str(venv_bin / "python"), "-c", "import nacl, edgefl; print(nacl.__file__, edgefl.__file__)"]
    )
    assert where.returncode == 0, where.stderr
    assert all(str(fake_system.prefix) in f for f in where.stdout.split()), where.stdout
    keys = run(
        [str(venv_bin / "edgefl"), "keys", "generate", "--out", str(tmp_path / "keys"), "--name", "gw-7"]
    )
    assert keys.returncode == 0, keys.stderr
    public = keys.stdout.strip().rsplit(" ", 1)[-1]
    assert re.fullmatch(r"[0-9a-f]{64}", public)
    signs = run([
        str(venv_bin / "python"), "-c",
        "import sys; from edgefl.wire.signing import load_signing_key, sign_message; "
        "from edgefl.wire.rounds import RoundAnnouncement, encode_round; "
        "k = load_signing_key(sys.argv[1]); "
        "m = RoundAnnouncement(1, 0, 30.0, 1, 0.1, 16, 1, ('gw-7',)); "
        "p = sign_message(encode_round, m, k, fleet='f'); "
        "print(k.verify_key.hex, len(p))",
        str(tmp_path / "keys" / "gw-7.key"),
    ])
    assert signs.returncode == 0, signs.stderr
    assert signs.stdout.split()[0] == public
    profile = fake_system.prefix / "current" / "firmware_configs" / "gateway_aarch64_256mb.toml"
    check = run([str(venv_bin / "edgefl"), "check-config", str(profile),
                 "--set", f"security.signing_key_file={tmp_path / 'keys' / 'gw-7.key'}",
                 "--set", f"security.coordinator_public_key={public}",
                 "--set", f"device.state_dir={tmp_path / 'state'}"])
    assert check.returncode == 0, check.stdout + check.stderr


# --- check_emulated.sh: the suite argument (refusals happen before any tool or download is needed) ----


@pytest.mark.subprocess
def test_emulated_install_check_refuses_armv7l_on_trixie_up_front() -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "cross_build" / "check_emulated.sh"), "armv7l", "trixie"],
        capture_output=True, text=True, check=False, env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("check_emulated.sh: refused: armv7l on trixie (Debian 13, CPython 3.13): ")
    assert "no TFLite runtime wheel exists for armv7l on CPython 3.13" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.subprocess
def test_emulated_install_check_names_an_unknown_suite() -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "cross_build" / "check_emulated.sh"), "aarch64", "sid"],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 2
    assert "unknown suite sid (bookworm or trixie)" in proc.stderr
