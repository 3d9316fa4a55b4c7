"""``edgefl feed``'s arguments and sample file: every bad value is a usage error (exit 2) naming it.

In process, before any connection: no broker listens on the URL (exit 4 if the feed tried).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgefl.cli import main
from edgefl.feed import load_samples

NOWHERE = "mqtt://127.0.0.1:9"


def run_feed(capsys: pytest.CaptureFixture[str], data: Path, *more: str) -> tuple[int, str]:
    argv = ["feed", "--broker", NOWHERE, "--fleet", "f", "--device", "gw-7", "--data", str(data), *more]
    rc = main(argv)
    return rc, capsys.readouterr().err


@pytest.fixture
def digits(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    np.savez(path, x=rng.integers(0, 16, (20, 8, 8, 1), dtype=np.uint8), y=np.arange(20) % 10)
    return path


def test_feed_input_refuses_labels_that_are_not_whole_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.zeros((4, 8, 8, 1), np.uint8)
    np.savez(tmp_path / "half.npz", x=x, y=np.array([0.5, 1.5, 2.0, 3.0]))
    rc, err = run_feed(capsys, tmp_path / "half.npz")
    assert rc == 2
    assert err.strip() == (
        f"edgefl feed: {tmp_path / 'half.npz'}: y: 2 of 4 label(s) not whole numbers (e.g. 0.5, 1.5); "
        "labels are class indices"
    )
    # whole numbers stored as floats are the labels they say
    np.savez(tmp_path / "whole.npz", x=x, y=np.array([0.0, 1.0, 2.0, 3.0]))
    _, y = load_samples(tmp_path / "whole.npz")
    assert y.dtype == np.int64 and y.tolist() == [0, 1, 2, 3]
    np.savez(tmp_path / "nan.npz", x=x, y=np.array([0.0, np.nan, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"y: 1 of 4 label\(s\) not whole numbers \(e\.g\. nan\)"):
        load_samples(tmp_path / "nan.npz")


def test_feed_input_refuses_an_empty_file_and_a_file_that_is_not_npz(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 8, 8, 1), np.uint8), y=np.zeros(0, np.int64))
    rc, err = run_feed(capsys, tmp_path / "empty.npz")
    assert (rc, err.strip()) == (
        2,
        f"edgefl feed: {tmp_path / 'empty.npz'}: holds no samples (x [0, 8, 8, 1])",
    )
    (tmp_path / "notes.npz").write_text("x,y\n1,2\n")
    rc, err = run_feed(capsys, tmp_path / "notes.npz")
    assert rc == 2
    assert err.strip() == (
        f"edgefl feed: {tmp_path / 'notes.npz'}: not an .npz archive (numpy.savez writes one, with x and y)"
    )
    assert "allow_pickle" not in err
    np.save(tmp_path / "one.npy", np.zeros(3))
    rc, err = run_feed(capsys, tmp_path / "one.npy")
    assert rc == 2 and "not an .npz archive" in err
    rc, err = run_feed(capsys, tmp_path / "missing.npz")
    assert rc == 2 and err.startswith(f"edgefl feed: {tmp_path / 'missing.npz'}: cannot read (")


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (("--limit", "-5"), "--limit -5: must be >= 1 (the first N samples)"),
        (("--limit", "0"), "--limit 0: must be >= 1 (the first N samples)"),
        (("--wait", "-1"), "--wait -1: must be a finite number of seconds >= 0"),
        (("--rate", "-2"), "--rate -2: must be a finite number of samples per second >= 0"),
        (("--label-delay", "inf"), "--label-delay inf: must be a finite number of seconds >= 0"),
        (("--label-fraction", "1.5"), "--label-fraction 1.5: must be in [0, 1]"),
    ],
)
def test_feed_input_refuses_out_of_range_options_naming_them(
    digits: Path, capsys: pytest.CaptureFixture[str], more: tuple[str, ...], message: str
) -> None:
    rc, err = run_feed(capsys, digits, *more)
    assert (rc, err.strip()) == (2, f"edgefl feed: {message}")


def test_feed_input_names_the_option_of_a_bad_device_id(
    digits: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["feed", "--broker", NOWHERE, "--fleet", "f", "--device", "gw/7", "--data", str(digits)])
    err = capsys.readouterr().err
    assert (rc, err.strip()) == (
        2,
        "edgefl feed: --device 'gw/7': must be 1-64 characters from A-Z a-z 0-9 _ . -",
    )
    # every problem at once
    rc = main(["feed", "--broker", NOWHERE, "--fleet", "a b", "--device", "gw/7", "--data", str(digits)])
    err = capsys.readouterr().err
    assert rc == 2 and "--device 'gw/7'" in err and "--fleet 'a b'" in err


def test_feed_input_set_keys_outside_broker_need_a_device_profile(
    digits: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = run_feed(capsys, digits, "--set", "model.path=m.tflite")
    assert (rc, err.strip()) == (
        2,
        "edgefl feed: --set model.path: only broker.* keys apply without a device profile to check the "
        "samples against (--check-profile)",
    )
    rc, err = run_feed(capsys, digits, "--set", "broker.keepalive_s=0")
    assert rc == 2 and "broker.keepalive_s = 0" in err
    rc, err = run_feed(capsys, digits, "--set", "nokey")
    assert rc == 2 and "--set 'nokey': expected key=value" in err
