"""A prepared model is the same backbone as its original: for devices and the coordinator alike.

``edgefl model prepare`` records the original's SHA-256 after the flatbuffer; the backbone identity on
the wire (``model_sha256``) is that digest. Real .tflite files, real LiteRT, a real agent and coordinator.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import INT8_MODEL, MODELS, Broker, start_replay_agent
from test_modelfile import _without_embedding_output
from test_runner import run_coordinator

from edgefl import modelfile
from edgefl.cli import main
from edgefl.datasets import load_digits
from edgefl.launcher import stop_agents
from edgefl.profiles import sha256_file
from edgefl.runtime import Backbone
from tests.support.models import run_backbone

pytestmark = pytest.mark.timeout(240)


def test_prepare_backbone_identity_is_the_originals(tmp_path: Path) -> None:
    own, _, _ = _without_embedding_output(INT8_MODEL, tmp_path)
    prepared, twice, folded = tmp_path / "p.tflite", tmp_path / "pp.tflite", tmp_path / "f.tflite"
    assert main(["model", "prepare", str(own), "--out", str(prepared)]) == 0
    assert main(["model", "prepare", str(prepared), "--out", str(twice)]) == 0
    fold = ["--mean", "0", "--std", "16", "--raw-dtype", "uint8"]
    assert main(["model", "prepare", str(INT8_MODEL), *fold, "--out", str(folded)]) == 0
    original = Backbone(own)
    assert original.backbone_sha256 == original.sha256 == sha256_file(own)  # no trailer: its own digest
    p = Backbone(prepared)
    assert p.sha256 != original.sha256 and p.backbone_sha256 == original.sha256
    assert modelfile.read_origin(prepared.read_bytes()) == original.sha256
    assert Backbone(twice).backbone_sha256 == original.sha256  # the first original, not the prepared one
    assert len(twice.read_bytes()) == len(prepared.read_bytes())  # one trailer, not two
    assert Backbone(folded).backbone_sha256 == sha256_file(INT8_MODEL)
    assert Backbone(MODELS / "digits_cnn_float32.tflite").backbone_sha256 != original.sha256
    assert main(["model", "inspect", str(prepared), "--json", str(tmp_path / "i.json")]) == 0
    info = json.loads((tmp_path / "i.json").read_text())
    assert (info["sha256"], info["backbone_sha256"]) == (p.sha256, original.sha256)
    # the prepared model computes what its original computes (the trailer is never read by LiteRT)
    x = np.random.default_rng(3).integers(-128, 128, (4, *original.sample_shape)).astype(np.int8)
    np.testing.assert_array_equal(run_backbone(original, x)[0], run_backbone(p, x)[0])


def test_prepare_device_on_the_prepared_model_trains_for_a_coordinator_on_the_original(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    prepared = tmp_path / "prepared.tflite"
    assert main(["model", "prepare", str(INT8_MODEL), "--out", str(prepared)]) == 0
    assert sha256_file(prepared) != sha256_file(INT8_MODEL)
    x, y = load_digits()
    agent = start_replay_agent(
        mosquitto, fleet, tmp_path, "dev-p", x[:300], y[:300], model__path=str(prepared)
    )
    try:
        done = run_coordinator(
            tmp_path,
            f"broker.url={mosquitto.url}",
            f"fleet.name={fleet}",
            f"model.path={INT8_MODEL}",
            "rounds.count=1",
            "rounds.expected_clients=1",
            "rounds.min_clients=1",
            "rounds.deadline_s=60",
        )
    finally:
        stop_agents([agent])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "runs another model" not in done.stdout + done.stderr
    assert " 1/1 clients, refused: none" in done.stdout, done.stdout
