"""The coordinator's central evaluation: a head's accuracy on a held-out set, through the device's pipeline.

``edgefl coordinator`` and ``edgefl demo`` pass it to the coordinator as a callable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from edgefl.datasets import load_digits, load_xy, split_digits
from edgefl.errors import ConfigError
from edgefl.head import Head
from edgefl.profiles import sha256_file
from edgefl.resources import shipped
from edgefl.runtime import Backbone
from edgefl.types import F32, I64

if TYPE_CHECKING:
    from edgefl.coordinator.profile import CoordinatorProfile


DIGITS_MODELS = ("digits_cnn_int8_rawin.tflite", "digits_cnn_int8.tflite", "digits_cnn_float32.tflite")
"""The shipped digits models (``models/``): the backbones scored on the digits test split by default."""


def is_shipped_digits(backbone: Backbone) -> bool:
    """Whether ``backbone`` is a shipped digits model or a ``model prepare`` output of one (by SHA-256)."""
    ids = {backbone.sha256, backbone.backbone_sha256}
    paths = (shipped(f"models/{name}") for name in DIGITS_MODELS)
    return any(path.is_file() and sha256_file(path) in ids for path in paths)


def embed_all(backbone: Backbone, x: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> F32:
    """Embeddings of raw samples ``x`` [N, *sample_shape] → float32 [N, D], through the unfused pipeline."""
    from edgefl.agent.pipeline import Pipeline

    return Pipeline(backbone, mean, std, mode="unfused", batch=1).run(x)[0]


def accuracy(W: F32, b: F32, emb: F32, y: I64) -> float:
    """Fraction of ``emb`` [N, D] whose argmax logit equals ``y`` [N]."""
    return float(np.mean(Head(W, b).predict(emb) == y))


def central_evaluation(profile: CoordinatorProfile, backbone: Backbone) -> Callable[[F32, F32], float] | None:
    """Accuracy in [0, 1] of a head (W float32 [D, K], b float32 [K]) on the profile's ``[evaluation]`` set.

    Without ``evaluation.path`` the shipped digits model is evaluated on the digits test split, any other
    model not at all (None: devices report their own evaluation). ConfigError if ``evaluation.path`` is
    not an ``.npz`` with ``x`` and ``y`` fitting the model.
    """
    ev = profile.evaluation
    if ev.path is not None:
        try:
            x, y = load_xy(ev.path)
        except (OSError, KeyError, ValueError) as exc:
            raise ConfigError(
                [f"evaluation.path = {str(ev.path)!r}: not an .npz with x and y ({exc})"]
            ) from exc
        if x.shape[1:] != backbone.sample_shape or len(x) != len(y):
            shapes = f"x {x.shape} / y {y.shape}"
            raise ConfigError([f"evaluation.path: {shapes} do not fit the samples {backbone.sample_shape}"])
        emb, labels = embed_all(backbone, x, ev.mean, ev.std), y
    elif is_shipped_digits(backbone):
        x, y = load_digits()
        test = split_digits(y).test
        emb, labels = embed_all(backbone, x[test], (0.0,), (16.0,)), y[test]
    else:
        return None

    def evaluate(W: F32, b: F32) -> float:
        return accuracy(W, b, emb, labels)

    return evaluate
