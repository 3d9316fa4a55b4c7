"""The user's own model: `edgefl model inspect` / `prepare` on real .tflite files, checked with LiteRT."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import INT8_MODEL, MODELS

from edgefl import modelfile
from edgefl.cli import main
from edgefl.errors import ModelError
from edgefl.runtime import Backbone
from tests.support.models import run_backbone

SHIPPED = sorted(MODELS.glob("*.tflite"))


def _interp(path: Path, xnnpack: bool) -> object:
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    it = Interpreter(
        model_path=str(path),
        experimental_op_resolver_type=(
            OpResolverType.BUILTIN if xnnpack else OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
        ),
    )
    it.allocate_tensors()
    return it


def _random_input(it: object, rng: np.random.Generator) -> np.ndarray:
    d = it.get_input_details()[0]  # type: ignore[attr-defined]
    shape, dtype = tuple(d["shape"]), np.dtype(d["dtype"])
    if dtype == np.float32:
        return rng.standard_normal(shape).astype(np.float32)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, size=shape).astype(dtype)


def _without_embedding_output(src: Path, tmp_path: Path) -> tuple[Path, int, int]:
    """A copy of a shipped model whose only output is the logits: the shape of a third-party model."""
    buf = src.read_bytes()
    graph = modelfile.read_graph(buf)
    fc = modelfile.head_fc(graph)
    assert fc is not None
    logits, emb = graph.ops[fc].outputs[0], graph.ops[fc].inputs[0]
    out = tmp_path / f"own_{src.name}"
    out.write_bytes(modelfile.set_outputs(buf, [logits]))
    return out, logits, emb


@pytest.mark.parametrize("model", SHIPPED, ids=lambda p: p.stem)
def test_inspect_json_on_every_shipped_model(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "inspect.json"
    assert main(["model", "inspect", str(model), "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    for key in ("input", "embedding_dim", "num_classes", "head_activation", "stateful",
                "embedding_output", "batch_resizable"):  # fmt: skip
        assert key in info, key
    digits = model.name.startswith("digits")
    assert info["embedding_dim"] == (512 if digits else 1280)
    assert info["num_classes"] == 10
    assert info["head_activation"] == "none"  # the shipped models end at the FC (logits)
    assert info["stateful"] is False and info["embedding_output"] is True and info["batch_resizable"] is True
    raw = "rawin" in model.name
    dtype = "uint8" if raw else ("float32" if "float32" in model.name else "int8")
    assert info["input"]["dtype"] == dtype
    assert info["input"]["shape"] == ([1, 8, 8, 1] if digits else [1, 96, 96, 3])
    assert info["head_weight_dtype"] == ("float32" if "float32" in model.name else "int8")
    per_batch = info["memory_bytes_per_batch"]
    assert per_batch["1"] < per_batch["8"] < per_batch["32"]


def test_inspect_reports_an_internal_embedding_and_a_missing_file(tmp_path: Path) -> None:
    own, _, emb = _without_embedding_output(INT8_MODEL, tmp_path)
    out = tmp_path / "own.json"
    assert main(["model", "inspect", str(own), "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    assert info["embedding_output"] is False and info["embedding_tensor"]["index"] == emb
    assert info["input"]["scale"] == pytest.approx(1 / 255) and info["input"]["zero_point"] == -128
    assert main(["model", "inspect", str(tmp_path / "missing.tflite")]) == 3


@pytest.mark.parametrize("xnnpack", [False, True])
@pytest.mark.parametrize("model", SHIPPED, ids=lambda p: p.stem)
def test_prepare_keeps_original_outputs_bit_for_bit(model: Path, xnnpack: bool, tmp_path: Path) -> None:
    own, logits, emb = _without_embedding_output(model, tmp_path)
    prepared = tmp_path / "prepared.tflite"
    assert main(["model", "prepare", str(own), "--out", str(prepared)]) == 0
    graph = modelfile.read_graph(prepared.read_bytes())
    assert graph.outputs == (logits, emb)  # the original output first, the embedding appended
    a, b = _interp(own, xnnpack), _interp(prepared, xnnpack)
    rng = np.random.default_rng(7)
    for _ in range(4):
        x = _random_input(a, rng)
        for it in (a, b):
            it.set_tensor(it.get_input_details()[0]["index"], x)  # type: ignore[attr-defined]
            it.invoke()  # type: ignore[attr-defined]
        ya = a.get_tensor(a.get_output_details()[0]["index"])  # type: ignore[attr-defined]
        yb = b.get_tensor(b.get_output_details()[0]["index"])  # type: ignore[attr-defined]
        assert ya.dtype == yb.dtype and np.array_equal(ya, yb)


def test_prepare_embedding_output_equals_the_preserved_intermediate(tmp_path: Path) -> None:
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    own, _, emb = _without_embedding_output(INT8_MODEL, tmp_path)
    ref = Interpreter(
        model_path=str(own),
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        experimental_preserve_all_tensors=True,
    )
    ref.allocate_tensors()
    bb = Backbone(own, xnnpack=False)  # prepared in memory: the embedding is a model output
    assert not bb.embedding_output and bb.embedding_index == emb
    rng = np.random.default_rng(3)
    for _ in range(5):
        x = rng.integers(-128, 128, size=(1, 8, 8, 1)).astype(np.int8)
        got, _ = run_backbone(bb, x)
        ref.set_tensor(ref.get_input_details()[0]["index"], x)
        ref.invoke()
        expect = (ref.get_tensor(emb).astype(np.float32) - bb.embedding_quant.zero_point) * np.float32(
            bb.embedding_quant.scale
        )
        np.testing.assert_array_equal(got, expect.reshape(1, -1))


def test_prepare_refuses_junk_and_an_unknown_tensor(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tflite"
    junk.write_bytes(b"\x00" * 64)
    assert main(["model", "prepare", str(junk), "--out", str(tmp_path / "o.tflite")]) == 3
    assert not (tmp_path / "o.tflite").exists()
    args = ["model", "prepare", str(INT8_MODEL), "--embedding-tensor", "nope", "--out", str(tmp_path / "o")]
    assert main(args) == 3
    with pytest.raises(ModelError, match="TFL3"):
        modelfile.read_graph(b"\x00" * 64)
    with pytest.raises(ModelError, match="not in subgraph 0"):
        modelfile.add_outputs(INT8_MODEL.read_bytes(), [10_000])


def test_own_model_without_embedding_output_is_prepared_at_start_up(tmp_path: Path) -> None:
    own, logits, emb = _without_embedding_output(MODELS / "digits_cnn_float32.tflite", tmp_path)
    bb = Backbone(own)
    assert not bb.embedding_output and bb.delegated  # prepared in memory, delegated
    assert bb.output_index == logits and bb.embedding_index == emb
    W, b = bb.head_from_model()
    x = np.random.default_rng(0).random((16, 8, 8, 1), dtype=np.float32)
    e, y = run_backbone(bb, x)
    np.testing.assert_allclose(e @ W + b, y, atol=1e-5)
    with pytest.raises(ModelError, match="edgefl model prepare"):
        Backbone(own, prepare=False)


def _pipeline_outputs(model: Path, mean: float, std: float, raw: np.ndarray) -> tuple[str, np.ndarray]:
    from edgefl.agent.pipeline import Pipeline

    p = Pipeline(Backbone(model), (mean,), (std,), mode="fused", batch=8)
    return p.fused_step("uint8"), p.run(raw)[1]


def test_prepare_folds_an_integer_mean_exactly(tmp_path: Path) -> None:
    from edgefl.datasets import load_digits

    out = tmp_path / "digits_folded.tflite"
    args = ["model", "prepare", str(INT8_MODEL), "--mean", "0", "--std", "16", "--raw-dtype", "uint8"]
    assert main([*args, "--out", str(out)]) == 0
    before, after = modelfile.read_graph(INT8_MODEL.read_bytes()), modelfile.read_graph(out.read_bytes())
    assert [op.name for op in after.ops] == ["QUANTIZE", *[op.name for op in before.ops]]  # one op added
    tin = after.tensors[after.inputs[0]]
    assert tin.dtype == "uint8" and tin.scales == (0.0625,) and tin.zero_points == (0,)
    assert after.outputs == before.outputs  # indices of the old tensors are unchanged
    x, _ = load_digits()  # uint8 0..16, all 1797 digits
    step_table, y_table = _pipeline_outputs(INT8_MODEL, 0.0, 16.0, x)
    step_copy, y_copy = _pipeline_outputs(out, 0.0, 16.0, x)
    assert (step_table, step_copy) == ("table", "copy")
    np.testing.assert_array_equal(y_copy, y_table)  # exact: the mean is an integer


def test_prepare_folds_a_half_integer_mean_within_half_an_input_step(tmp_path: Path) -> None:
    src = MODELS / "mobilenet_v2_035_96_int8.tflite"
    out = tmp_path / "mobilenet_folded.tflite"
    args = ["model", "prepare", str(src), "--mean", "127.5", "--std", "127.5", "--raw-dtype", "uint8"]
    assert main([*args, "--out", str(out)]) == 0
    graph = modelfile.read_graph(out.read_bytes())
    tin = graph.tensors[graph.inputs[0]]
    # zero point 127 (not 128, which would clip raw 0 and 1 together): every input half a step high
    assert tin.dtype == "uint8" and tin.zero_points == (127,)
    assert tin.scales[0] == pytest.approx(1 / 127.5)
    raw = np.random.default_rng(5).integers(0, 256, (8, 96, 96, 3)).astype(np.uint8)
    step, y = _pipeline_outputs(out, 127.0, 127.5, raw)
    assert step == "copy"
    # exactly the table path given the mean the fold could represent (127), and the converter's own
    # raw-input model (tools/build_models.py) bit for bit
    np.testing.assert_array_equal(y, _pipeline_outputs(src, 127.0, 127.5, raw)[1])
    np.testing.assert_array_equal(
        y, _pipeline_outputs(MODELS / "mobilenet_v2_035_96_int8_rawin.tflite", 127.0, 127.5, raw)[1]
    )


def test_prepare_fold_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "o.tflite")
    float_model = str(MODELS / "digits_cnn_float32.tflite")
    # a float-input model: a usage error (exit 2) with the hint, not a model error
    assert main(["model", "prepare", float_model, "--mean", "0", "--std", "16", "--out", out]) == 2
    assert (
        "has a float32 input: the fold applies to int8-input models; set pipeline.mean/std instead"
        in capsys.readouterr().err
    )
    assert main(["model", "prepare", str(INT8_MODEL), "--mean", "0", "--out", out]) == 2
    assert main(["model", "prepare", str(INT8_MODEL), "--mean", "300", "--std", "1", "--out", out]) == 3
    assert main(["model", "prepare", str(INT8_MODEL), "--mean", "0", "--std", "0", "--out", out]) == 3
    assert not Path(out).exists()
