from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from bench.partition import dirichlet_partition
from edgefl.datasets import (
    FACTORY_CLASSES,
    DigitsSplit,
    class_owners,
    digits_dir,
    load_digits,
    partition_non_iid,
    split_digits,
)
from edgefl.types import I64, U8


@pytest.fixture(scope="module")
def digits() -> tuple[U8, I64]:
    return load_digits()


@pytest.fixture(scope="module")
def split(digits: tuple[U8, I64]) -> DigitsSplit:
    return split_digits(digits[1], seed=0)


def _assert_partition(shards: list[I64], n: int) -> None:
    joined = np.concatenate(shards)
    assert joined.dtype == np.int64
    assert joined.size == n
    assert np.array_equal(np.sort(joined), np.arange(n))
    for shard in shards:
        assert np.array_equal(shard, np.sort(shard))


def _max_class_share(labels: I64, shards: list[I64]) -> float:
    """Mean over devices of the share of the device's most frequent class (1.0 = one class each)."""
    return float(np.mean([np.bincount(labels[s]).max() / s.size for s in shards]))


# --- load_digits -----------------------------------------------------------------------------------


def test_load_digits_shape_dtype_range(digits: tuple[U8, I64]) -> None:
    x, y = digits
    assert x.shape == (1797, 8, 8, 1)
    assert x.dtype == np.uint8
    assert y.shape == (1797,)
    assert y.dtype == np.int64
    assert x.min() == 0
    assert x.max() == 16
    assert np.array_equal(np.unique(y), np.arange(10))
    counts = np.bincount(y)
    assert counts.min() == 174
    assert counts.max() == 183
    # first row of the file, read independently of load_digits
    assert y[0] == 0
    assert x[0, 0, :, 0].tolist() == [0, 0, 5, 13, 9, 1, 0, 0]
    assert x[0, 1, :, 0].tolist() == [0, 0, 13, 15, 10, 15, 5, 0]


def test_digits_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EDGEFL_DATA_DIR", raising=False)
    assert (digits_dir() / "digits.csv.gz").is_file()
    monkeypatch.setenv("EDGEFL_DATA_DIR", str(tmp_path))
    assert digits_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="EDGEFL_DATA_DIR"):
        load_digits()


def test_load_digits_accepts_file_path(digits: tuple[U8, I64]) -> None:
    x, y = load_digits(digits_dir() / "digits.csv.gz")
    assert np.array_equal(x, digits[0])
    assert np.array_equal(y, digits[1])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("1,2,3\n", "65 columns"),
        (",".join(["0"] * 64 + ["10"]) + "\n", "labels outside"),
        (",".join(["17"] + ["0"] * 63 + ["1"]) + "\n", "pixel values outside"),
        (",".join(["0.5"] + ["0"] * 63 + ["1"]) + "\n", "non-integer"),
    ],
)
def test_load_digits_rejects_bad_file(tmp_path: Path, row: str, message: str) -> None:
    bad = tmp_path / "digits.csv.gz"
    with gzip.open(bad, "wt") as fh:
        fh.write(row)
    with pytest.raises(ValueError, match=message):
        load_digits(tmp_path)


def test_load_digits_rejects_non_gzip(tmp_path: Path) -> None:
    (tmp_path / "digits.csv.gz").write_text("0,1\n")
    with pytest.raises(ValueError, match="gzip"):
        load_digits(tmp_path)


# --- split_digits ----------------------------------------------------------------------------------


def test_split_disjoint_covering_sorted(digits: tuple[U8, I64], split: DigitsSplit) -> None:
    _assert_partition([split.test, split.public, split.devices], digits[1].size)


def test_split_counts(split: DigitsSplit) -> None:
    assert (split.test.size, split.public.size, split.devices.size) == (359, 359, 1079)


def test_split_test_fraction_and_stratified(digits: tuple[U8, I64], split: DigitsSplit) -> None:
    y = digits[1]
    assert abs(split.test.size / y.size - 0.2) <= 0.01
    per_class = np.bincount(y, minlength=10)
    test_per_class = np.bincount(y[split.test], minlength=10)
    assert np.all(np.abs(test_per_class - 0.2 * per_class) <= 1.0)
    rest_per_class = per_class - test_per_class
    public_per_class = np.bincount(y[split.public], minlength=10)
    assert np.all(np.abs(public_per_class - 0.25 * rest_per_class) <= 1.0)


def test_split_public_has_all_classes(digits: tuple[U8, I64], split: DigitsSplit) -> None:
    y = digits[1]
    assert np.array_equal(np.unique(y[split.public]), np.arange(10))
    assert set(FACTORY_CLASSES) <= set(np.unique(y[split.public]).tolist())


def test_split_deterministic_and_seed_dependent(digits: tuple[U8, I64], split: DigitsSplit) -> None:
    again = split_digits(digits[1], seed=0)
    assert np.array_equal(again.test, split.test)
    assert np.array_equal(again.public, split.public)
    other = split_digits(digits[1], seed=1)
    assert not np.array_equal(other.test, split.test)


@pytest.mark.parametrize(("test_fraction", "public_fraction"), [(0.0, 0.25), (0.2, 1.0)])
def test_split_rejects_bad_fraction(
    digits: tuple[U8, I64], test_fraction: float, public_fraction: float
) -> None:
    with pytest.raises(ValueError, match="must be in"):
        split_digits(digits[1], test_fraction=test_fraction, public_fraction=public_fraction)


# --- partition_non_iid -----------------------------------------------------------------------------


def test_class_owners() -> None:
    assert class_owners(10, 4) == [[0], [1], [2], [3], [0], [1], [2], [3], [0], [1]]
    owners = class_owners(10, 25)
    assert owners[0] == [0, 10, 20]
    assert owners[9] == [9, 19]
    assert sorted(d for o in owners for d in o) == list(range(25))


def test_partition_non_iid_n4(digits: tuple[U8, I64], split: DigitsSplit) -> None:
    labels = digits[1][split.devices]
    shards = partition_non_iid(labels, 4, seed=0)
    _assert_partition(shards, labels.size)
    for shard in shards:
        counts = np.sort(np.bincount(labels[shard], minlength=10))[::-1]
        assert counts[:3].sum() / shard.size >= 0.8
    # device 0 owns classes 0, 4, 8: 90 % of each of them is on device 0
    for cls in (0, 4, 8):
        n_cls = int(np.sum(labels == cls))
        on_0 = int(np.sum(labels[shards[0]] == cls))
        assert on_0 == round(0.9 * n_cls)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 10, 11, 16, 32])
def test_partition_non_iid_sizes(digits: tuple[U8, I64], split: DigitsSplit, n: int) -> None:
    labels = digits[1][split.devices]
    shards = partition_non_iid(labels, n, seed=3)
    assert len(shards) == n
    _assert_partition(shards, labels.size)
    assert min(s.size for s in shards) > 0
    owners = class_owners(10, n)
    for device, shard in enumerate(shards):
        owned = [c for c in range(10) if device in owners[c]]
        owned_share = np.isin(labels[shard], owned).mean()
        # 90 % of each owned class lands here; the 10 % leak of the other classes is spread thin
        assert owned_share >= (1.0 if n == 1 else 0.8)


def test_partition_non_iid_deterministic(digits: tuple[U8, I64], split: DigitsSplit) -> None:
    labels = digits[1][split.devices]
    a = partition_non_iid(labels, 6, seed=7)
    b = partition_non_iid(labels, 6, seed=7)
    c = partition_non_iid(labels, 6, seed=8)
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c, strict=True))


def test_partition_non_iid_primary_share_one_is_pure(digits: tuple[U8, I64], split: DigitsSplit) -> None:
    labels = digits[1][split.devices]
    shards = partition_non_iid(labels, 5, seed=0, primary_share=1.0)
    for device, shard in enumerate(shards):
        assert set(np.unique(labels[shard]).tolist()) == {device, device + 5}


@pytest.mark.parametrize(("n", "share"), [(0, 0.9), (5, 1.5), (5, -0.1)])
def test_partition_non_iid_rejects(n: int, share: float) -> None:
    with pytest.raises(ValueError):
        partition_non_iid(np.arange(10, dtype=np.int64), n, primary_share=share)


# --- dirichlet_partition ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 4, 10, 32])
def test_dirichlet_covering_nonempty(digits: tuple[U8, I64], split: DigitsSplit, n: int) -> None:
    labels = digits[1][split.devices]
    shards = dirichlet_partition(labels, n, alpha=0.1, seed=0)
    assert len(shards) == n
    _assert_partition(shards, labels.size)
    assert min(s.size for s in shards) >= 1


def test_dirichlet_alpha_effect(digits: tuple[U8, I64], split: DigitsSplit) -> None:
    """Skew measure: mean over devices of the top class's share of the device's samples."""
    labels = digits[1][split.devices]
    skewed = _max_class_share(labels, dirichlet_partition(labels, 10, alpha=0.1, seed=0))
    near_iid = _max_class_share(labels, dirichlet_partition(labels, 10, alpha=100.0, seed=0))
    # IID would give ~0.1 (10 balanced classes); one class per device would give 1.0
    assert skewed > 0.4
    assert near_iid < 0.2
    assert skewed > 3 * near_iid


def test_dirichlet_deterministic(digits: tuple[U8, I64], split: DigitsSplit) -> None:
    labels = digits[1][split.devices]
    a = dirichlet_partition(labels, 8, alpha=0.5, seed=2)
    b = dirichlet_partition(labels, 8, alpha=0.5, seed=2)
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))


def test_dirichlet_fills_empty_devices() -> None:
    labels = np.zeros(40, dtype=np.int64)
    shards = dirichlet_partition(labels, 40, alpha=0.01, seed=0)
    assert [s.size for s in shards] == [1] * 40
    _assert_partition(shards, 40)


@pytest.mark.parametrize(("n", "alpha"), [(0, 1.0), (11, 1.0), (5, 0.0)])
def test_dirichlet_rejects(n: int, alpha: float) -> None:
    with pytest.raises(ValueError):
        dirichlet_partition(np.arange(10, dtype=np.int64), n, alpha=alpha)
