"""The real LiteRT interpreter on the shipped models: the head split reproduces the full model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import FLOAT_MODEL, INT8_MODEL, MODELS

from edgefl.datasets import load_digits, split_digits
from edgefl.errors import ModelError
from edgefl.profiles import sha256_file
from edgefl.runtime import Backbone
from tests.support.models import dequantize, run_backbone


@pytest.fixture(scope="module")
def digits_test_split() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits()
    split = split_digits(y)
    return x[split.test], y[split.test]


def _embed(bb: Backbone, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xf = (x.astype(np.float32) / np.float32(16.0)).astype(np.float32)
    return run_backbone(bb, bb.quantize_input(xf))


def test_float_head_reproduces_model_output(digits_test_split: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = digits_test_split
    bb = Backbone(FLOAT_MODEL)
    W, b = bb.head_from_model()
    assert W.shape == (bb.embedding_dim, 10) and b.shape == (10,)
    emb, logits = _embed(bb, x)
    assert bb.delegated  # the embedding is the model's second output: XNNPACK runs
    # float32 sums of D = 512 products in another order (XNNPACK): a few ulp of the largest logit
    np.testing.assert_allclose(emb @ W + b, logits, atol=1e-5)
    # the factory head knows digits 0-4 only: about half the test set
    acc = float(np.mean(logits.argmax(axis=1) == y))
    assert 0.40 < acc < 0.55


@pytest.mark.parametrize("xnnpack", [False, True])
def test_int8_head_within_half_a_quantisation_step(
    digits_test_split: tuple[np.ndarray, np.ndarray], xnnpack: bool
) -> None:
    x, _ = digits_test_split
    bb = Backbone(INT8_MODEL, xnnpack=xnnpack)
    assert bb.input_dtype == np.int8 and bb.delegated == xnnpack
    assert bb.embedding_quant.scale > 0
    W, b = bb.head_from_model()
    emb, logits = _embed(bb, x)
    step, zp = bb.output_quant.scale, bb.output_quant.zero_point
    # int8 products are exact in float32; the model rounds once to its output step and saturates there
    head = np.clip(emb @ W + b, (-128 - zp) * step, (127 - zp) * step)
    diff = np.abs(head - logits)
    assert diff.max() <= 0.5001 * step, f"max diff {diff.max()} > half an output step {step}"


def test_embedding_read_after_invoke_matches_preserve_all_tensors(
    digits_test_split: tuple[np.ndarray, np.ndarray],
) -> None:
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    x, _ = digits_test_split
    bb = Backbone(INT8_MODEL, xnnpack=False)  # the embedding as the built-in kernels leave it
    delegated = Backbone(INT8_MODEL)
    assert delegated.delegated and not bb.delegated
    ref = Interpreter(
        model_path=str(INT8_MODEL),
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        experimental_preserve_all_tensors=True,
    )
    ref.allocate_tensors()
    inp = ref.get_input_details()[0]
    for i in range(5):
        q = bb.quantize_input((x[i : i + 1].astype(np.float32) / np.float32(16.0)).astype(np.float32))
        emb, _ = run_backbone(bb, q)
        ref.set_tensor(inp["index"], q)
        ref.invoke()
        expect = dequantize(ref.get_tensor(bb.embedding_index), bb.embedding_quant)
        np.testing.assert_array_equal(emb, expect.reshape(1, -1))
        # XNNPACK's int8 kernels may round an embedding entry to the neighbouring step
        emb_x, _ = run_backbone(delegated, q)
        assert np.abs(emb_x - emb).max() <= bb.embedding_quant.scale * 1.0001


def test_sha256_and_shapes() -> None:
    bb = Backbone(INT8_MODEL)
    assert bb.sha256 == sha256_file(INT8_MODEL)
    assert len(bb.sha256) == 64
    assert bb.sample_shape == (8, 8, 1)
    with pytest.raises(ValueError, match="model expects"):
        run_backbone(bb, np.zeros((1, 8, 8, 1), np.float32))


def test_corrupt_and_missing_model_give_model_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tflite"
    bad.write_bytes(INT8_MODEL.read_bytes()[:500])
    with pytest.raises(ModelError, match="cannot load model"):
        Backbone(bad)
    junk = tmp_path / "junk.tflite"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelError):
        Backbone(junk)
    with pytest.raises(ModelError, match="not found"):
        Backbone(tmp_path / "missing.tflite")
    with pytest.raises(ModelError, match="not found in the model"):
        Backbone(INT8_MODEL, embedding_tensor="no_such_tensor")


def test_a_tensor_name_that_is_not_utf8_gives_model_error(tmp_path: Path) -> None:
    blob = bytearray(FLOAT_MODEL.read_bytes())
    pos = blob.find(b"Identity_1")  # the embedding output's name
    assert pos > 0
    blob[pos + 1] = 0xCC  # an invalid UTF-8 continuation byte
    bad = tmp_path / "bad_name.tflite"
    bad.write_bytes(bytes(blob))
    with pytest.raises(ModelError, match="UnicodeDecodeError"):
        Backbone(bad)


def test_a_model_that_loads_but_cannot_run_gives_model_error(tmp_path: Path) -> None:
    # 8 bytes of the MobileNet int8 file changed (found by a random-mutation run): LiteRT builds the
    # interpreter, and every invoke() then fails with "Input tensor 9 lacks data"
    src = MODELS / "mobilenet_v2_035_96_int8.tflite"
    changes = [(202, 0o102), (1948, 0o277), (2569, 0o337), (3735, 0o125), (134827, 0o41), (392961, 0o222)]
    blob = bytearray(src.read_bytes())
    for offset, byte in [*changes, (537819, 0o201), (609321, 0o112)]:
        blob[offset - 1] = byte
    bad = tmp_path / "lacks_data.tflite"
    bad.write_bytes(bytes(blob))
    with pytest.raises(ModelError, match="lacks data"):
        Backbone(bad)


def test_prepare_an_internal_embedding_in_memory_or_refuse_naming_the_command() -> None:
    from ai_edge_litert.interpreter import Interpreter

    probe = Interpreter(model_path=str(INT8_MODEL))
    names = {d["index"]: d["name"] for d in probe.get_tensor_details()}
    reshape = next(op for op in probe._get_ops_details() if op["op_name"] == "RESHAPE")
    inner = names[int(reshape["inputs"][0])]  # conv2's activation [N, 4, 4, 32]: not a model output
    bb = Backbone(INT8_MODEL, embedding_tensor=inner)  # added as an output in memory
    assert not bb.embedding_output and bb.delegated and bb.embedding_dim == 32
    assert bb.sha256 == sha256_file(INT8_MODEL)  # global heads stay bound to the user's file
    zeros = np.zeros((2, *bb.sample_shape), dtype=bb.input_dtype)
    emb, logits = run_backbone(bb, zeros)  # readable under XNNPACK
    assert emb.shape == (2, 4 * 4 * bb.embedding_dim) and logits.shape == (2, 10)
    with pytest.raises(ModelError, match="edgefl model prepare MODEL --out OUT"):
        Backbone(INT8_MODEL, embedding_tensor=inner, prepare=False)


@pytest.mark.subprocess
def test_own_model_numpy_2_with_tflite_runtime_stops_naming_numpy_lt_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    from conftest import DEV_PROFILE

    assert int(np.__version__.split(".")[0]) >= 2  # the test venv runs numpy 2
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgefl.cli",
            "run",
            str(DEV_PROFILE),
            "--set",
            "model.runtime=tflite",
            "--set",
            "dashboard.enabled=false",
            "--set",
            f"device.state_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "numpy<2" in lines[0] and lines[0].startswith("edgefl: model error:"), lines
    assert "SystemError" not in proc.stderr and "Traceback" not in proc.stderr
