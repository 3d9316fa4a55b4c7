"""The coordinator's central evaluation: which models get the digits test split by default."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgefl.coordinator.profile import load_coordinator_profile
from edgefl.datasets import load_digits, split_digits
from edgefl.evaluation import central_evaluation
from edgefl.resources import shipped
from edgefl.runtime import Backbone
from tests.support.models import widen_head

PROFILE = shipped("firmware_configs/coordinator.toml")


def test_evaluation_shipped_digits_model_is_scored_on_the_digits_test_split() -> None:
    profile = load_coordinator_profile(PROFILE)
    backbone = Backbone(profile.model.path)
    evaluate = central_evaluation(profile, backbone)
    assert evaluate is not None
    _, y = load_digits()
    test = y[split_digits(y).test]
    d = backbone.embedding_dim
    # a zero head predicts class 0 for every sample: its accuracy is the share of 0s in the test split
    zero = evaluate(np.zeros((d, 10), np.float32), np.zeros(10, np.float32))
    assert zero == float(np.mean(test == 0))
    assert 0.05 < zero < 0.15


def test_evaluation_own_model_with_digits_shaped_input_is_not_scored_on_digits(tmp_path: Path) -> None:
    own = tmp_path / "own.tflite"  # 8 x 8 x 1 input like the digits models, but not one of them
    own.write_bytes(widen_head(shipped("models/digits_cnn_float32.tflite"), 12))
    profile = load_coordinator_profile(PROFILE, {"model.path": str(own)})
    backbone = Backbone(own)
    assert backbone.sample_shape == (8, 8, 1)
    assert central_evaluation(profile, backbone) is None
