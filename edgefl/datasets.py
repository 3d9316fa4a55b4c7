"""Data sets: the ``.npz`` sample files profiles name, and the demo's UCI handwritten digits (8x8).

An ``.npz`` holds ``x`` (raw samples) and ``y`` (labels). The digits' split: **test** (every accuracy
is measured on it), **public** (the model builder's: backbone and factory head) and **devices** (the
pool of the simulated fleet's shards).
"""

from __future__ import annotations

import gzip
import logging
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.resources import shipped
from edgefl.types import I64, U8

logger = logging.getLogger(__name__)

FACTORY_CLASSES: tuple[int, ...] = (0, 1, 2, 3, 4)
"""Classes the shipped (factory) head was trained on; devices must learn the others by federation."""

DIGITS_FILE = "digits.csv.gz"
N_CLASSES = 10
IMAGE_SIDE = 8
MAX_PIXEL = 16


def npz_headers(path: Path | str) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    """Array name (``"x"``, ``"y"``...) → (shape, dtype) of an ``.npz`` file, from the headers only.

    ValueError if it is not a zip of ``.npy`` members (``numpy.savez``) or a header numpy cannot read
    (named); OSError if the file cannot be read.

    Source: the NPY format (``numpy.lib.format``: magic string, version, header dict).
    """
    out: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}
    fmt = np.lib.format
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with zf.open(info) as fh:
                    version = fmt.read_magic(fh)
                    if version == (1, 0):
                        shape, _, dtype = fmt.read_array_header_1_0(fh)
                    elif version == (2, 0):
                        shape, _, dtype = fmt.read_array_header_2_0(fh)
                    else:
                        raise ValueError(f"{info.filename}: NPY version {version} not read")
                out[info.filename[: -len(".npy")]] = (tuple(int(d) for d in shape), np.dtype(dtype))
    except zipfile.BadZipFile as exc:
        raise ValueError(f"{path}: not an .npz file ({exc})") from exc
    return out


def npz_problem(path: Path) -> str | None:
    """Why ``path`` is not an ``.npz`` of numeric ``x`` and ``y`` with as many rows (>= 1), or None.

    From the headers only (:func:`npz_headers`); the reason follows ``key = value:`` in a profile error.
    """
    try:
        arrays = npz_headers(path)
    except (OSError, ValueError) as exc:
        return f"not an .npz archive ({exc.__cause__ or exc})"
    missing = [name for name in ("x", "y") if name not in arrays]
    if missing:
        return "the .npz has no array " + " or ".join(repr(m) for m in missing)
    for name in ("x", "y"):
        if arrays[name][1].hasobject:
            return f"{name} holds Python objects (only numeric arrays are read)"
    rows = [shape[0] if shape else -1 for shape, _ in (arrays["x"], arrays["y"])]
    if rows[0] != rows[1] or rows[0] < 1:
        return f"x and y differ in length or are empty ({rows[0]} and {rows[1]} rows)"
    return None


def load_xy(path: Path | str) -> tuple[np.ndarray, I64]:
    """Load an ``.npz`` sample file: ``x`` as stored [N, ...], ``y`` as int64 [N].

    Raises OSError, KeyError (no ``x`` or ``y``) or ValueError (not an ``.npz``, object arrays).
    """
    with np.load(path, allow_pickle=False) as data:
        return np.asarray(data["x"]), np.asarray(data["y"]).astype(np.int64)


def digits_dir() -> Path:
    """The directory holding ``digits.csv.gz``: ``$EDGEFL_DATA_DIR`` if set, else the shipped copy."""
    env = os.environ.get("EDGEFL_DATA_DIR")
    if env:
        return Path(env)
    return shipped("data/sklearn_digits")


def load_digits(path: Path | None = None) -> tuple[U8, I64]:
    """Load the 1797 UCI handwritten digits from ``path`` (the file or its folder; None: :func:`digits_dir`).

    Returns ``x`` uint8 [N, 8, 8, 1] (pixels 0..16), ``y`` int64 [N] (0..9). FileNotFoundError; ValueError
    for a file that is not 65 comma-separated integer columns in those ranges.

    Source: E. Alpaydin, C. Kaynak, "Optical Recognition of Handwritten Digits", UCI ML Repository
    (1998), test part, as ``sklearn/datasets/data/digits.csv.gz`` (scikit-learn 1.9.1).
    """
    file = digits_dir() if path is None else Path(path)
    if file.is_dir():
        file = file / DIGITS_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"digits dataset not found at {file} (set EDGEFL_DATA_DIR to the directory holding {DIGITS_FILE})"
        )
    try:
        with gzip.open(file, "rt", encoding="ascii") as fh:
            table = np.loadtxt(fh, delimiter=",", dtype=np.float64, ndmin=2)
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"{file}: not a gzip-compressed CSV of numbers: {exc}") from exc
    n_cols = IMAGE_SIDE * IMAGE_SIDE + 1
    if table.shape[1] != n_cols or table.shape[0] == 0:
        raise ValueError(f"{file}: expected rows of {n_cols} columns, got an array of shape {table.shape}")
    if not np.array_equal(table, np.round(table)):
        raise ValueError(f"{file}: non-integer values")
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > MAX_PIXEL:
        raise ValueError(f"{file}: pixel values outside 0..{MAX_PIXEL}")
    if labels.min() < 0 or labels.max() >= N_CLASSES:
        raise ValueError(f"{file}: labels outside 0..{N_CLASSES - 1}")
    x = pixels.astype(np.uint8).reshape(-1, IMAGE_SIDE, IMAGE_SIDE, 1)
    y = labels.astype(np.int64)
    logger.debug("loaded %d digits from %s", y.size, file)
    return x, y


@dataclass(frozen=True, slots=True)
class DigitsSplit:
    """Disjoint, sorted index sets into the digits: ``test``, ``public``, ``devices`` (int64 [n] each)."""

    test: I64
    public: I64
    devices: I64


def check_labels(labels: I64) -> I64:
    """``labels`` as int64 [N]; ValueError if not a non-empty 1-D integer array."""
    arr = np.asarray(labels)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"labels must be a non-empty 1-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def split_digits(
    labels: I64, seed: int = 0, test_fraction: float = 0.2, public_fraction: float = 0.25
) -> DigitsSplit:
    """Split ``labels`` int64 [N] into test, public and device-pool parts, stratified by class.

    Per class (shuffled by ``seed``): ``round(n_c * test_fraction)`` to test, ``round(rest_c *
    public_fraction)`` to public, the rest to the pool; three disjoint sorted index arrays covering
    ``range(N)``. ValueError for bad labels or a fraction outside (0, 1).
    """
    y = check_labels(labels)
    for name, value in (("test_fraction", test_fraction), ("public_fraction", public_fraction)):
        if not 0.0 < value < 1.0:
            raise ValueError(f"{name} = {value}: must be in (0, 1)")
    rng = np.random.default_rng(seed)
    parts: tuple[list[I64], list[I64], list[I64]] = ([], [], [])
    for cls in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == cls)).astype(np.int64)
        n_test = round(idx.size * test_fraction)
        n_public = round((idx.size - n_test) * public_fraction)
        parts[0].append(idx[:n_test])
        parts[1].append(idx[n_test : n_test + n_public])
        parts[2].append(idx[n_test + n_public :])
    test, public, devices = (np.sort(np.concatenate(p)).astype(np.int64) for p in parts)
    return DigitsSplit(test=test, public=public, devices=devices)


def class_owners(n_classes: int, n_devices: int) -> list[list[int]]:
    """``owners[c]``: the sorted devices owning class rank ``c`` (for :func:`partition_non_iid`).

    Device ``d`` owns class rank ``d % n_classes`` when ``n_devices > n_classes``, else class rank
    ``c`` is owned by device ``c % n_devices``: every class has an owner, every device a class.
    """
    return [[d for d in range(n_devices) if d % n_classes == c % n_devices] for c in range(n_classes)]


def partition_non_iid(labels: I64, n_devices: int, seed: int = 0, primary_share: float = 0.9) -> list[I64]:
    """Partition ``labels`` int64 [N] over ``n_devices`` (1..N), each device mostly seeing its own classes.

    ``round(primary_share * n_c)`` of class ``c``'s shuffled samples are dealt round-robin to its owners
    (:func:`class_owners`), the rest to the other devices. Returns ``n_devices`` sorted index arrays into
    ``labels``, disjoint and covering ``range(N)``. ValueError for bad labels, ``n_devices`` or
    ``primary_share`` (in [0, 1]).

    Source: the "pathological non-IID" shards of McMahan et al., "Communication-Efficient Learning of
    Deep Networks from Decentralized Data", AISTATS 2017 §3, with a tunable leak (``primary_share``).
    """
    y = check_labels(labels)
    if not 1 <= n_devices <= y.size:
        raise ValueError(f"n_devices = {n_devices}: must be in 1..{y.size} (the number of samples)")
    if not 0.0 <= primary_share <= 1.0:
        raise ValueError(f"primary_share = {primary_share}: must be in [0, 1]")
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    owners = class_owners(classes.size, n_devices)
    assignment = np.empty(y.size, dtype=np.int64)
    deal = 0  # carries on across classes so the round-robin remainders spread evenly
    for rank, cls in enumerate(classes):
        idx = rng.permutation(np.flatnonzero(y == cls))
        own = np.asarray(owners[rank], dtype=np.int64)
        others = np.setdiff1d(np.arange(n_devices, dtype=np.int64), own)
        n_primary = idx.size if others.size == 0 else round(primary_share * idx.size)
        primary, rest = idx[:n_primary], idx[n_primary:]
        assignment[primary] = own[(deal + np.arange(primary.size)) % own.size]
        if rest.size:
            assignment[rest] = others[(deal + np.arange(rest.size)) % others.size]
        deal += idx.size
    return [np.flatnonzero(assignment == d).astype(np.int64) for d in range(n_devices)]
