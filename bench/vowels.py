"""Japanese Vowels (UCI; 9 speakers, 12 LPC cepstrum channels, 7-29 frames) as fixed-size embeddings.

The recordings have variable length, so each utterance is summarised per channel by its mean,
standard deviation, minimum and maximum over the frames (12 x 4 = 48 features), standardised with
the training split's statistics. The frozen "backbone" is a fixed random projection followed by a
ReLU (``relu(z @ R + c)``, R ~ N(0, 1/48), seed 0), computed in numpy, no TFLite: it plays the part
of the frozen feature extractor, and the head on top is the trainable last layer, as on a device.

Source: Kudo, Toyama, Shimbo 1999, "Multidimensional Curve Classification Using Passing-Through
Regions", Pattern Recognition Letters 20(11-13); files from sktime 1.2.0 (``.ts`` format of the
UEA/UCR archive), see data/japanese_vowels/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgefl.types import F32, I64

VOWELS_DIR = Path(__file__).resolve().parent.parent / "data" / "japanese_vowels"
N_CHANNELS = 12
N_CLASSES = 9
EMBEDDING_DIM = 128


def read_ts(path: Path) -> tuple[list[F32], I64]:
    """Parse a multivariate ``.ts`` file: one sample per line after ``@data``.

    Parameters
    ----------
    path : Path

    Returns
    -------
    series : list of float32 [T_i, 12] (variable T_i)
    labels : int64 [N], class index 0..8 (speaker 1..9 minus one)

    Raises
    ------
    ValueError
        If a line does not have 12 equal-length channels plus a label.
    """
    series: list[F32] = []
    labels: list[int] = []
    in_data = False
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.lower() == "@data":
            in_data = True
            continue
        if not in_data:
            continue
        *channels, label = line.split(":")
        if len(channels) != N_CHANNELS:
            raise ValueError(f"{path}: {len(channels)} channels, expected {N_CHANNELS}")
        rows = [np.array(c.split(","), dtype=np.float32) for c in channels]
        if len({r.size for r in rows}) != 1:
            raise ValueError(f"{path}: channels of unequal length")
        series.append(np.stack(rows, axis=1))
        labels.append(int(label) - 1)
    return series, np.array(labels, dtype=np.int64)


def summarise(series: list[F32]) -> F32:
    """Per-channel mean, std, min, max over the frames: float32 [N, 48]."""
    return np.stack([np.concatenate([s.mean(0), s.std(0), s.min(0), s.max(0)]) for s in series]).astype(
        np.float32
    )


@dataclass(frozen=True, slots=True)
class Vowels:
    """Embeddings of the official train and test splits.

    Attributes
    ----------
    train_emb : float32 [270, 128]
    train_y : int64 [270]
    test_emb : float32 [370, 128]
    test_y : int64 [370]
    """

    train_emb: F32
    train_y: I64
    test_emb: F32
    test_y: I64


def load_vowels(directory: Path = VOWELS_DIR, dim: int = EMBEDDING_DIM, seed: int = 0) -> Vowels:
    """Load both splits and embed them with the fixed random-projection backbone.

    Parameters
    ----------
    directory : Path
        Folder with ``JapaneseVowels_TRAIN.ts`` and ``JapaneseVowels_TEST.ts``.
    dim : int
        Embedding size D.
    seed : int
        Seed of the projection.

    Returns
    -------
    Vowels
    """
    tr_s, tr_y = read_ts(directory / "JapaneseVowels_TRAIN.ts")
    te_s, te_y = read_ts(directory / "JapaneseVowels_TEST.ts")
    tr, te = summarise(tr_s), summarise(te_s)
    mu, sd = tr.mean(0), tr.std(0) + 1e-6
    rng = np.random.default_rng(seed)
    R = rng.normal(0.0, 1.0 / np.sqrt(tr.shape[1]), (tr.shape[1], dim)).astype(np.float32)
    c = rng.normal(0.0, 0.1, dim).astype(np.float32)

    def embed(x: F32) -> F32:
        out: F32 = np.maximum((x - mu) / sd @ R + c, 0.0).astype(np.float32)
        return out

    return Vowels(embed(tr), tr_y, embed(te), te_y)
