"""The installed distribution: one import name (``edgefl``) and defaults that work outside a checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

# pip builds in the source tree (build/): one worker builds edgefl's wheels (make test's --dist loadgroup)
pytestmark = pytest.mark.xdist_group("wheel")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (whl,) = out.glob("edgefl-*.whl")
    return whl


def test_wheel_claims_only_the_edgefl_import_name(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert z.read(top_level).decode().split() == ["edgefl"]
    assert top == {"edgefl"}
    for shipped in (
        "edgefl/models/digits_cnn_int8_rawin.tflite",
        "edgefl/firmware_configs/dev_x86.toml",
        "edgefl/data/sklearn_digits/digits.csv.gz",
        "edgefl/dashboard/static/index.html",
        "edgefl/agent/daemon.py",
        "edgefl/coordinator/service.py",
        "edgefl/wire/rounds.py",
    ):
        assert shipped in names, shipped
    # build-machine tools and the benches' data stay in the checkout
    assert [n for n in names if n.startswith(("edgefl/cross_build/", "edgefl/data/japanese_vowels/"))] == []
    assert "edgefl/models/build.py" not in names and "edgefl/tools/build_models.py" not in names


def test_unpacked_wheel_defaults_work_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    probe = (
        "import edgefl, edgefl.cli\n"
        "from edgefl.resources import shipped\n"
        "from edgefl.datasets import load_digits\n"
        "print(edgefl.__file__)\n"
        "print(shipped('models/digits_cnn_int8_rawin.tflite').is_file(),"
        " shipped('firmware_configs/dev_x86.toml').is_file(), len(load_digits()[1]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    where, found = done.stdout.splitlines()
    assert where.startswith(str(site)), where
    assert found == "True True 1797"
    helped = subprocess.run(
        [sys.executable, "-m", "edgefl.cli", "coordinator", "--help"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert helped.returncode == 0, helped.stderr
    # argparse wraps the help text: compare without whitespace (the path has none)
    shipped_profile = site / "edgefl" / "firmware_configs" / "coordinator.toml"
    assert str(shipped_profile) in "".join(helped.stdout.split())
    checked = subprocess.run(
        [sys.executable, "-m", "edgefl.cli", "check-config", str(shipped_profile)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stderr  # its model path resolves inside the wheel
