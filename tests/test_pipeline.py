"""The preprocessing pipeline on the real shipped models: fused == unfused, view and thread hazards, auto."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import MODELS

from edgefl.agent.pipeline import Pipeline, cache_path, choose, random_raw
from edgefl.agent.pipeline_measure import BatchMeasurement, decide, measure
from edgefl.datasets import load_digits
from edgefl.head import Head
from edgefl.runtime import Backbone, InterpreterBusy
from tests.support.models import resize_backbone, run_backbone

DIGITS = ((0.0,), (16.0,))
CAMERA = ((127.5,), (127.5,))
#: The raw-input MobileNet reads raw frames as (raw - 127) / 127.5 (models/README.md): zero point 127.
CAMERA_RAWIN = ((127.0,), (127.5,))
MODEL_NORM = {
    "digits_cnn_float32": DIGITS,
    "digits_cnn_int8": DIGITS,
    "digits_cnn_int8_rawin": DIGITS,
    "mobilenet_v2_035_96_float32": CAMERA,
    "mobilenet_v2_035_96_int8": CAMERA,
    "mobilenet_v2_035_96_int8_rawin": CAMERA_RAWIN,
}


@pytest.fixture(scope="module", params=sorted(MODEL_NORM))
def model(request: pytest.FixtureRequest) -> tuple[Backbone, tuple[float, ...], tuple[float, ...]]:
    name = str(request.param)
    mean, std = MODEL_NORM[name]
    return Backbone(MODELS / f"{name}.tflite"), mean, std


def preprocess(raw: np.ndarray, bb: Backbone, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """The reference: the simple path the daemon used before the pipeline (agent/daemon.py@8462e9c)."""
    x = (raw.astype(np.float32) - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return bb.quantize_input(x.astype(np.float32))


def _input_tensor(pipe: Pipeline, rows: np.ndarray) -> np.ndarray:
    pipe.prepare(rows)
    return np.asarray(pipe.backbone.interpreter.get_tensor(pipe.backbone.input_index))


def _raw_cases(bb: Backbone) -> dict[str, np.ndarray]:
    """Random and edge raw samples of every raw dtype, including values that must clip (not wrap)."""
    shape = (4, *bb.sample_shape)
    edges_u8 = np.zeros(shape, np.uint8)
    edges_u8[0], edges_u8[1], edges_u8[2] = 0, 255, 17  # 17+ is out of the digits range 0..16
    edges_u8[3] = np.arange(edges_u8[3].size).reshape(bb.sample_shape) % 256
    edges_f32 = np.zeros(shape, np.float32)
    edges_f32[0], edges_f32[1], edges_f32[2] = -1e6, 1e6, 127.5  # far outside: clip; 127.5: a tie
    edges_f32[3] = np.linspace(-300, 300, edges_f32[3].size).reshape(bb.sample_shape)
    edges_i16 = np.zeros(shape, np.int16)
    edges_i16[0], edges_i16[1] = -32768, 32767
    edges_i16[2] = np.arange(edges_i16[2].size).reshape(bb.sample_shape) - 300
    return {
        "uint8 random": random_raw(shape, "uint8", seed=1),
        "uint8 edges": edges_u8,
        "int16 random": random_raw(shape, "int16", seed=2),
        "int16 edges": edges_i16,
        "float32 random": random_raw(shape, "float32", seed=3),
        "float32 edges": edges_f32,
    }


def test_fused_and_unfused_write_identical_tensors(
    model: tuple[Backbone, tuple[float, ...], tuple[float, ...]],
) -> None:
    bb, mean, std = model
    fused = Pipeline(bb, mean, std, mode="fused", batch=4)
    unfused = Pipeline(bb, mean, std, mode="unfused", batch=4)
    tb = fused.tensor_batch
    for case, raw in _raw_cases(bb).items():
        expected = preprocess(raw, bb, mean, std)  # the daemon's current path
        for g0 in range(0, len(raw), tb):
            rows = raw[g0 : g0 + tb]
            t_fused = _input_tensor(fused, rows)
            t_unfused = _input_tensor(unfused, rows)
            assert t_fused.dtype == bb.input_dtype
            # bit-identical in every dtype (float32 too, although 1e-6 would be allowed)
            assert np.array_equal(t_fused, t_unfused), case
            assert np.array_equal(t_fused[: len(rows)], expected[g0 : g0 + len(rows)]), case
    if bb.input_dtype != np.float32:
        info = np.iinfo(bb.input_dtype)
        big = _raw_cases(bb)["float32 edges"][:2]
        t = _input_tensor(fused, big[:tb])
        assert int(t[0].max()) == info.min  # -1e6 clips to the minimum, does not wrap
        if tb > 1:
            assert int(t[1].min()) == info.max


def test_table_covers_every_8bit_value_exactly() -> None:
    bb = Backbone(MODELS / "mobilenet_v2_035_96_int8.tflite")
    fused = Pipeline(bb, *CAMERA, mode="fused", batch=1)
    assert fused.fused_step("uint8") == "table" and fused.fused_step("int8") == "table"
    for dtype in ("uint8", "int8"):
        values = np.arange(256, dtype=np.uint8).view(dtype)
        raw = np.resize(values, (1, *bb.sample_shape))  # every value, repeated over the frame
        got = _input_tensor(fused, raw)
        assert np.array_equal(got, preprocess(raw, bb, *CAMERA))
    # every one of the 65,536 pairs of adjacent raw bytes, in 5 frames (a batch of 5)
    pairs = np.resize(np.arange(1 << 16, dtype=np.uint16).view(np.uint8), (5, *bb.sample_shape))
    five = Pipeline(bb, *CAMERA, mode="fused", batch=5)
    assert np.array_equal(_input_tensor(five, pairs), preprocess(pairs, bb, *CAMERA))
    # raw 0 normalises to -1.0 -> rint(-127.5) - 1 = -129: must clip to -128 (half to even, then clip)
    zero = _input_tensor(fused, np.zeros((1, *bb.sample_shape), np.uint8))
    assert int(zero.max()) == -128


@pytest.mark.parametrize("name", ["mobilenet_v2_035_96_float32", "digits_cnn_float32"])
def test_float32_models_keep_the_faster_fused_kernel_and_both_are_exact(name: str) -> None:
    bb = Backbone(MODELS / f"{name}.tflite")
    mean, std = MODEL_NORM[name]
    fused = Pipeline(bb, mean, std, mode="fused", batch=4)
    step = fused.fused_step("uint8")  # builds the table and times it against the arithmetic
    timed = fused.kernel_seconds["uint8"]
    assert set(timed) == {"table", "in_place"} and all(0 < t < 1 for t in timed.values())
    assert step == ("table" if timed["table"] < timed["in_place"] else "in_place")
    # whichever was kept, the tensor is the unfused one; and both kernels write the same bits
    raw = random_raw((4, *bb.sample_shape), "uint8", seed=3)
    assert np.array_equal(_input_tensor(fused, raw), preprocess(raw, bb, mean, std))
    unfused = Pipeline(bb, mean, std, mode="unfused", batch=4)
    assert np.array_equal(_input_tensor(unfused, raw), preprocess(raw, bb, mean, std))
    levels = np.arange(256, dtype=np.float32)
    table_values = ((levels - np.float32(mean[0])) / np.float32(std[0])).astype(np.float32)
    by_arithmetic = np.empty(raw.shape, np.float32)
    fused._write_float(by_arithmetic, raw)  # the in-place kernel, into a scratch array
    assert np.array_equal(by_arithmetic, table_values[raw])


def test_per_channel_normalisation_fused_equals_unfused() -> None:
    bb = Backbone(MODELS / "mobilenet_v2_035_96_int8.tflite")
    mean, std = (123.7, 116.3, 103.5), (58.4, 57.1, 57.4)  # ImageNet-style per-channel statistics
    fused = Pipeline(bb, mean, std, mode="fused", batch=2)
    unfused = Pipeline(bb, mean, std, mode="unfused", batch=2)
    raw = random_raw((2, *bb.sample_shape), "uint8", seed=9)
    assert fused.fused_step("uint8") == "table"
    assert np.array_equal(_input_tensor(fused, raw), _input_tensor(unfused, raw))
    assert np.array_equal(_input_tensor(fused, raw), preprocess(raw, bb, mean, std))


def test_real_digits_through_both_paths_match_the_backbone() -> None:
    x, _ = load_digits()
    raw = x[:37]
    for name in ("digits_cnn_int8", "digits_cnn_float32"):
        bb = Backbone(MODELS / f"{name}.tflite")
        ref_emb, ref_logits = run_backbone(bb, preprocess(raw, bb, *DIGITS))
        for mode in ("fused", "unfused"):
            emb, logits = Pipeline(bb, *DIGITS, mode=mode, batch=8).run(raw)
            assert emb.shape == (37, bb.embedding_dim) and logits.shape == (37, 10)
            if bb.input_dtype == np.float32:
                # float kernels take another path for batches > 1: last-bit rounding (models/README.md)
                np.testing.assert_allclose(
                    emb, ref_emb, rtol=0, atol=1e-6 * max(1.0, float(np.abs(ref_emb).max()))
                )
                np.testing.assert_allclose(
                    logits, ref_logits, rtol=0, atol=1e-6 * max(1.0, float(np.abs(ref_logits).max()))
                )
            else:
                assert np.array_equal(emb, ref_emb) and np.array_equal(logits, ref_logits)


@pytest.mark.parametrize(
    ("name", "norm"), [("digits_cnn_int8_rawin", DIGITS), ("mobilenet_v2_035_96_int8_rawin", CAMERA_RAWIN)]
)
def test_folded_models_take_the_copy_step(
    name: str, norm: tuple[tuple[float, ...], tuple[float, ...]]
) -> None:
    bb = Backbone(MODELS / f"{name}.tflite")
    assert bb.input_dtype == np.uint8 and bb.resizable
    fused = Pipeline(bb, *norm, mode="fused", batch=4)
    unfused = Pipeline(bb, *norm, mode="unfused", batch=4)
    assert fused.fused_step("uint8") == "copy"
    # any other raw dtype (or normalisation) is not the identity: a table or the in-place arithmetic
    assert fused.fused_step("int8") == "table" and fused.fused_step("int16") == "table"
    assert fused.fused_step("float32") == "in_place"
    every = np.resize(np.arange(256, dtype=np.uint8), (3, *bb.sample_shape))  # partial batch: 3 of 4
    for raw in (random_raw((4, *bb.sample_shape), "uint8", seed=5), every):
        t = _input_tensor(fused, raw)
        assert np.array_equal(t[: len(raw)], raw)  # the raw frame is the model input
        assert np.array_equal(t, _input_tensor(unfused, raw))  # bit-exact vs the unfused stages
    assert (_input_tensor(fused, every)[3] == bb.input_quant.zero_point).all()  # pad row
    emb_f, logits_f = fused.run(every)
    emb_u, logits_u = unfused.run(every)
    assert np.array_equal(emb_f, emb_u) and np.array_equal(logits_f, logits_u)
    c = fused.counters()
    assert c["fused_step"] == "copy" and list(c["stages"]) == ["fill", "invoke", "read"]
    # no allocation in the copy step: far below one float32 sample
    r = measure(bb, *norm, batches=(4,), repeats=1)[0]
    assert r.preprocess_fused_peak_bytes < 1024 < r.preprocess_unfused_peak_bytes, r
    # the normalisation the int8 model uses (127.5) is not this model's: the step is a table there
    if name.startswith("mobilenet"):
        assert Pipeline(bb, *CAMERA, mode="fused", batch=1).fused_step("uint8") == "table"
    # the int8 models themselves never copy: their input is int8
    int8 = Backbone(MODELS / f"{name.removesuffix('_rawin')}.tflite")
    assert (
        Pipeline(int8, *(DIGITS if name.startswith("digits") else CAMERA), mode="fused", batch=1).fused_step(
            "uint8"
        )
        == "table"
    )


def test_folded_digits_model_equals_the_int8_model_on_real_digits() -> None:
    # tools/build_models.py folds raw / 16 into the input quantisation (uint8, scale 1/16, zero point 0); its
    # QUANTIZE op gives the int8 model's input exactly, so every output is bit-identical
    raw = load_digits()[0]
    folded = Backbone(MODELS / "digits_cnn_int8_rawin.tflite")
    int8 = Backbone(MODELS / "digits_cnn_int8.tflite")
    emb_ref, logits_ref = Pipeline(int8, *DIGITS, mode="unfused", batch=64).run(raw)
    for mode in ("fused", "unfused"):
        pipe = Pipeline(folded, *DIGITS, mode=mode, batch=64)
        emb, logits = pipe.run(raw)
        assert np.array_equal(emb, emb_ref) and np.array_equal(logits, logits_ref), mode
    # the last, partial group runs at its real size (a resizable model): nothing padded (H17 item 5)
    assert pipe.counters()["padded_rows"] == 0
    assert pipe.counters()["invokes"] == -(-len(raw) // 64)


def test_partial_batches_are_padded_and_never_reported() -> None:
    bb = Backbone(MODELS / "mobilenet_v2_035_96_int8.tflite")
    assert bb.resizable
    raw = random_raw((11, *bb.sample_shape), "uint8", seed=4)
    one = Pipeline(bb, *CAMERA, mode="unfused", batch=1)
    ref_emb, ref_logits = one.run(raw)
    for mode in ("fused", "unfused"):
        pipe = Pipeline(bb, *CAMERA, mode=mode, batch=4)
        emb, logits = pipe.run(raw)
        assert emb.shape == (11, bb.embedding_dim) and logits.shape == (11, 10)
        # int8 kernels: each row of a batch is computed exactly as alone
        assert np.array_equal(emb, ref_emb) and np.array_equal(logits, ref_logits)
        c = pipe.counters()
        # 4 + 4 + 3: the last group runs at 3 rows (resizable model, H17 item 5), nothing padded
        assert (c["samples"], c["invokes"], c["padded_rows"]) == (11, 3, 0)
        assert pipe.allocated_batch == 4 and pipe.tensor_batch == 4
        # prepare() pads (as a fixed-batch model runs): the pad row holds the normalised zero (the
        # input zero point), not stale samples
        tensor = _input_tensor(pipe, raw[:3])
        assert (tensor[3] == bb.input_quant.zero_point).all()


def test_counters_name_every_stage() -> None:
    bb = Backbone(MODELS / "digits_cnn_int8.tflite")
    raw = load_digits()[0][:5]
    fused = Pipeline(bb, *DIGITS, mode="fused", batch=1)
    unfused = Pipeline(bb, *DIGITS, mode="unfused", batch=1)
    fused.run(raw)
    unfused.run(raw)
    cf, cu = fused.counters(), unfused.counters()
    assert list(cf["stages"]) == ["fill", "invoke", "read"] and cf["fused_step"] == "table"
    assert list(cu["stages"]) == ["cast", "normalise", "quantise", "set_tensor", "invoke", "read"]
    assert cf["stages"]["fill"]["calls"] == 5 and cf["samples"] == 5
    assert all(v["total_s"] > 0 for v in cu["stages"].values())
    fused.reset_counters()
    assert fused.counters()["samples"] == 0 and fused.counters()["stages"] == {}


# --- hazards -------------------------------------------------------------------------------------------
def test_litert_refuses_invoke_while_a_view_is_alive() -> None:
    """The hazard itself (what the pipeline must avoid), on the real interpreter."""
    bb = Backbone(MODELS / "digits_cnn_int8.tflite")
    view = bb.interpreter.tensor(bb.input_index)()
    with pytest.raises(RuntimeError, match="reference to internal data"):
        bb.interpreter.invoke()
    del view
    bb.interpreter.invoke()


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_no_view_survives_a_run(mode: str) -> None:
    bb = Backbone(MODELS / "mobilenet_v2_035_96_int8.tflite")
    pipe = Pipeline(bb, *CAMERA, mode=mode, batch=2)  # type: ignore[arg-type]
    pipe.run(random_raw((3, *bb.sample_shape), "uint8"))
    # each of these raises if any numpy view of an internal tensor is alive
    bb.interpreter.invoke()
    bb.interpreter.resize_tensor_input(bb.input_index, [5, *bb.sample_shape])
    bb.interpreter.allocate_tensors()
    assert int(bb.interpreter.get_input_details()[0]["shape"][0]) == 5


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_a_kept_exception_from_a_failed_write_does_not_block_the_interpreter(mode: str) -> None:
    bb = Backbone(MODELS / "mobilenet_v2_035_96_int8.tflite")
    pipe = Pipeline(bb, *CAMERA, mode=mode, batch=2)  # type: ignore[arg-type]
    bad = np.zeros((3, *bb.sample_shape), np.float32)
    bad[1, 5, 5, 1] = np.nan  # NaN cannot be cast to int8: raises mid-write under errstate
    kept: list[BaseException] = []
    with np.errstate(invalid="raise"):
        try:
            pipe.run(bad)
        except FloatingPointError as exc:
            kept.append(exc)  # the exception and its traceback stay alive
    assert len(kept) == 1 and kept[0].__traceback__ is not None
    good = random_raw((3, *bb.sample_shape), "uint8", seed=5)
    emb, _ = pipe.run(good)
    ref, _ = Pipeline(bb, *CAMERA, mode="unfused", batch=1).run(good)
    assert np.array_equal(emb, ref)
    bb.interpreter.allocate_tensors()


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_views_are_taken_afresh_after_any_resize(mode: str) -> None:
    bb = Backbone(MODELS / "mobilenet_v2_035_96_int8.tflite")
    raw = random_raw((8, *bb.sample_shape), "uint8", seed=6)
    ref, _ = Pipeline(bb, *CAMERA, mode="unfused", batch=1).run(raw)
    a = Pipeline(bb, *CAMERA, mode=mode, batch=8)  # type: ignore[arg-type]
    b = Pipeline(bb, *CAMERA, mode=mode, batch=3)  # type: ignore[arg-type]
    assert np.array_equal(a.run(raw)[0], ref)
    assert np.array_equal(b.run(raw)[0], ref)  # resized to 3 by another pipeline
    assert np.array_equal(a.run(raw)[0], ref)
    # resized behind the backbone's back (bb.batch is now stale)
    bb.interpreter.resize_tensor_input(bb.input_index, [5, *bb.sample_shape])
    bb.interpreter.allocate_tensors()
    assert np.array_equal(a.run(raw)[0], ref)
    resize_backbone(bb, 2)
    assert np.array_equal(a.run(raw)[0], ref)


def test_fault_one_interpreter_runs_one_invoke_at_a_time() -> None:
    """The guard inside Backbone: a second thread waits while another holds the interpreter, gets
    InterpreterBusy naming the holder if that takes too long, and is re-entrant in the holder."""
    bb = Backbone(MODELS / "digits_cnn_int8.tflite")
    pipe = Pipeline(bb, *DIGITS, mode="fused", batch=1)
    raw = load_digits()[0][:3]
    ref = pipe.run(raw)[0]
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with bb.claim():
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold, name="other-worker")
    t.start()
    try:
        assert held.wait(10)
        with pytest.raises(InterpreterBusy, match="other-worker"), bb.claim(timeout_s=0.2):
            pass
        # another interpreter is free to use meanwhile
        other = Backbone(MODELS / "digits_cnn_int8.tflite")
        assert np.array_equal(Pipeline(other, *DIGITS, mode="fused", batch=1).run(raw)[0], ref)
        waiting: list[np.ndarray] = []
        waiter = threading.Thread(target=lambda: waiting.append(pipe.run(raw)[0]))
        waiter.start()  # waits for the holder ...
        waiter.join(0.3)
        assert waiter.is_alive() and waiting == []
    finally:
        release.set()
        t.join(10)
    waiter.join(10)  # ... and runs once it let go
    assert len(waiting) == 1 and np.array_equal(waiting[0], ref)
    with bb.claim():
        assert np.array_equal(pipe.run(raw)[0], ref)  # re-entrant in the holding thread


def test_fault_two_threads_on_one_backbone_get_the_sequential_outputs() -> None:
    """Two threads calling Backbone.run and a pipeline on one interpreter at full rate: every output
    equals the one-thread result (without the guard 242 of 6,938 were wrong, issue 15)."""
    bb = Backbone(MODELS / "digits_cnn_int8.tflite")
    x = load_digits()[0][:200]
    pipe = Pipeline(bb, *DIGITS, mode="fused", batch=4)
    ref = pipe.run(x)[0]
    model_input = bb.quantize_input((x.astype(np.float32) - 0.0) / 16.0)
    ref_direct = run_backbone(bb, model_input[:8])[0]
    bad: list[str] = []

    def via_pipeline() -> None:
        for _ in range(20):
            if not np.array_equal(pipe.run(x)[0], ref):
                bad.append("pipeline")

    def via_backbone() -> None:
        for _ in range(200):
            if not np.array_equal(run_backbone(bb, model_input[:8])[0], ref_direct):
                bad.append("backbone")

    threads = [threading.Thread(target=via_pipeline), threading.Thread(target=via_backbone)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert bad == []


def test_head_swaps_under_full_rate_inference_never_mix_versions() -> None:
    """Inference at full rate on a worker thread while the head is swapped 100 times and the pipeline
    mode is re-chosen; the worker reads the head once per batch, as ``Agent.classify`` does."""
    bb = Backbone(MODELS / "digits_cnn_int8.tflite")
    x = load_digits()[0]
    W0, b0 = bb.head_from_model()
    rng = np.random.default_rng(0)
    heads = {0: Head(W0, b0, 0)}
    for v in range(1, 101):
        heads[v] = Head(
            (W0 + rng.standard_normal(W0.shape).astype(np.float32)).astype(np.float32),
            (b0 + rng.standard_normal(b0.shape).astype(np.float32)).astype(np.float32),
            v,
        )
    pipes = {m: Pipeline(bb, *DIGITS, mode=m, batch=8) for m in ("fused", "unfused")}

    class Holder:
        head = heads[0]
        pipeline = pipes["fused"]

    holder = Holder()
    stop = threading.Event()
    records: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            start = 0
            while not stop.is_set():
                raw = x[start : start + 8]
                emb, _ = holder.pipeline.run(raw)  # one pipeline reference per batch
                head = holder.head  # one head reference per batch, like Agent.classify
                records.append((start, head.version, emb, head.predict(emb), head.logits(emb)))
                start = (start + 8) % (len(x) - 8)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    try:
        for v in range(1, 101):
            n = len(records)
            while len(records) < n + 2 and t.is_alive():
                threading.Event().wait(0.0005)
            holder.head = heads[v]
            if v % 10 == 0:  # the mode is re-chosen: the next batch uses the other pipeline
                holder.pipeline = pipes["unfused" if holder.pipeline.mode == "fused" else "fused"]
    finally:
        stop.set()
        t.join(30)
    assert errors == []
    versions = {r[1] for r in records}
    assert len(versions) >= 90 and len(records) > 200
    ref = Pipeline(Backbone(MODELS / "digits_cnn_int8.tflite"), *DIGITS, mode="unfused", batch=8)
    for start, version, emb, pred, logits in records:
        emb_again, _ = ref.run(x[start : start + 8])
        head = heads[version]
        assert np.array_equal(emb, emb_again)  # the returned embedding was never overwritten
        assert np.array_equal(pred, head.predict(emb_again))
        assert np.array_equal(logits, head.logits(emb_again))


# --- the automatic choice ----------------------------------------------------------------------------
def _row(batch: int, pre_unfused_s: float, pre_fused_s: float, invoke_s: float) -> BatchMeasurement:
    """A measurement by hand: seconds per sample of preprocessing (each mode) and of invoke."""
    stages = {"invoke": invoke_s, "read": 1e-6}
    return BatchMeasurement(
        batch,
        1 / (pre_unfused_s + invoke_s),
        1 / (pre_fused_s + invoke_s),
        1 / invoke_s,
        pre_unfused_s,
        pre_fused_s,
        100,
        10,
        0.0,
        0.0,
        dict(stages),
        dict(stages),
    )


def test_decide_keeps_unfused_where_fusion_does_not_measure_faster() -> None:
    # fusion slower at every batch: unfused, at the cheapest batch
    assert decide([_row(1, 10e-6, 12e-6, 50e-6), _row(8, 10e-6, 20e-6, 30e-6)]) == ("unfused", 8)
    # fusion faster at batch 1 only, but batch 8 unfused is cheaper overall
    assert decide([_row(1, 10e-6, 2e-6, 50e-6), _row(8, 10e-6, 11e-6, 30e-6)]) == ("unfused", 8)
    assert decide([_row(1, 10e-6, 2e-6, 50e-6), _row(8, 10e-6, 2e-6, 30e-6)]) == ("fused", 8)
    # within the noise margin (10 %): not worth the fused path
    assert decide([_row(8, 10e-6, 9.5e-6, 30e-6)]) == ("unfused", 8)
    with pytest.raises(ValueError):
        decide([])


def test_choose_measures_caches_and_keeps_unfused_when_fusion_cannot_win(tmp_path: Path) -> None:
    bb = Backbone(MODELS / "digits_cnn_int8.tflite")
    # fused would have to be 100x faster than unfused: it cannot win, auto must keep unfused
    mode, batch = choose(bb, *DIGITS, batches=(1, 4), cache_dir=tmp_path, repeats=3, margin=100.0)
    assert mode == "unfused" and batch in (1, 4)
    path = cache_path(tmp_path, bb.sha256)
    data = json.loads(path.read_text())
    assert data["chosen"] == {"mode": mode, "batch": batch}
    assert [r["batch"] for r in data["batches"]] == [1, 4]
    assert data["key"]["model_sha256"] == bb.sha256
    # a restart reads the decision instead of measuring (proved by a decision no measurement gives)
    data["chosen"] = {"mode": "fused", "batch": 4}
    path.write_text(json.dumps(data))
    assert choose(bb, *DIGITS, batches=(1, 4), cache_dir=tmp_path, repeats=3, margin=100.0) == ("fused", 4)
    # other parameters (here the normalisation) are measured again and replace the file
    assert choose(bb, (0.0,), (8.0,), batches=(1, 4), cache_dir=tmp_path, repeats=3, margin=100.0)[0] == (
        "unfused"
    )
    assert json.loads(path.read_text())["key"]["std"] == [8.0]
    # a corrupt file is measured again
    path.write_text("{not json")
    assert choose(bb, *DIGITS, batches=(1,), cache_dir=tmp_path, repeats=3, margin=100.0) == ("unfused", 1)


def test_measure_reports_both_modes_and_fused_preprocessing_allocates_less() -> None:
    """Which mode is faster is a benchmark (bench/pipeline.py); here only what is deterministic:
    every stage is timed in both modes, and fused preprocessing of a batch of 8 camera frames allocates
    no batch-sized float32 copy while unfused allocates at least one (tracemalloc peaks)."""
    bb = Backbone(MODELS / "mobilenet_v2_035_96_int8.tflite")
    rows = measure(bb, *CAMERA, batches=(8,), repeats=3)
    assert [r.batch for r in rows] == [8]
    r = rows[0]
    assert {"invoke"} <= set(r.stages_fused) and {"invoke"} <= set(r.stages_unfused), rows
    assert decide(rows)[1] == 8
    assert r.preprocess_fused_peak_bytes <= 96 * 96 * 3 * 4 < r.preprocess_unfused_peak_bytes, rows


def test_pipeline_rejects_bad_arguments() -> None:
    bb = Backbone(MODELS / "digits_cnn_int8.tflite")
    with pytest.raises(ValueError, match="mode"):
        Pipeline(bb, *DIGITS, mode="auto", batch=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch"):
        Pipeline(bb, *DIGITS, mode="fused", batch=0)
    with pytest.raises(ValueError, match="std"):
        Pipeline(bb, (0.0,), (0.0,), mode="fused", batch=1)
    with pytest.raises(ValueError, match="mean"):
        Pipeline(bb, (0.0, 1.0), (1.0,), mode="fused", batch=1)
    pipe = Pipeline(bb, *DIGITS, mode="fused", batch=1)
    with pytest.raises(ValueError, match="expects"):
        pipe.run(np.zeros((2, 8, 8, 3), np.uint8))
    with pytest.raises(ValueError, match="expects"):
        pipe.run(np.zeros((0, 8, 8, 1), np.uint8))


def test_profile_command_prints_a_table_and_writes_the_json_contract(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from edgefl.agent import profiler

    parser = argparse.ArgumentParser()
    profiler.add_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "profile.json"
    model = str(MODELS / "digits_cnn_int8.tflite")
    argv = ["profile", model, "--std", "16", "--batch", "1,2", "--repeats", "3", "--json", str(out)]
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "fused step: table" in text and "chosen:" in text and "pre unf us" in text
    data = json.loads(out.read_text())
    assert data["model"] == "digits_cnn_int8.tflite"
    assert data["chosen"]["mode"] in ("fused", "unfused") and data["chosen"]["batch"] in (1, 2)
    contract = {
        "batch": int,
        "unfused_samples_per_s": float,
        "fused_samples_per_s": float,
        "invoke_only_samples_per_s": float,
        "preprocess_unfused_s_per_sample": float,
        "preprocess_fused_s_per_sample": float,
        "preprocess_unfused_peak_bytes": int,
        "preprocess_fused_peak_bytes": int,
    }
    assert [b["batch"] for b in data["batches"]] == [1, 2]
    for b in data["batches"]:
        for key, kind in contract.items():
            assert isinstance(b[key], kind) and b[key] > 0, key
    info = data["model_info"]
    assert (info["input_dtype"], info["embedding_dim"], info["xnnpack"], info["fused_step"]) == (
        "int8",
        512,
        True,
        "table",
    )
    bad = parser.parse_args(["profile", str(tmp_path / "missing.tflite")])
    assert bad.func(bad) == 3
    unwritable = parser.parse_args(["profile", model, "--json", str(tmp_path / "no" / "dir.json")])
    assert unwritable.func(unwritable) == 2
    assert "not a writable file path" in capsys.readouterr().out
    for flag, value in (("--batch", "4097"), ("--threads", "65"), ("--margin", "nan"), ("--margin", "-1")):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["profile", model, flag, value])
        assert exit_info.value.code == 2
        assert "must be" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [">u2", ">i2", "<u2"])
def test_non_native_byte_order_raw_samples_through_a_float32_model(dtype: str) -> None:
    bb = Backbone(MODELS / "digits_cnn_float32.tflite")
    raw = random_raw((3, *bb.sample_shape), dtype, seed=5)
    assert raw.dtype == np.dtype(dtype)
    fused = Pipeline(bb, *DIGITS, mode="fused", batch=3)
    assert fused.fused_step(dtype) in ("table", "in_place")
    assert np.array_equal(_input_tensor(fused, raw), preprocess(raw, bb, *DIGITS))


def test_live_single_samples_run_unpadded_on_a_resizable_model() -> None:
    """H17 item 5: at a low live rate each sample comes alone; it runs as a 1-row invoke, not padded to 8."""
    raw = load_digits()[0][:20]
    bb = Backbone(MODELS / "digits_cnn_int8_rawin.tflite")
    assert bb.resizable
    ref_emb, ref_logits = Pipeline(bb, *DIGITS, mode="fused", batch=8).run(raw)
    pipe = Pipeline(bb, *DIGITS, mode="fused", batch=8)
    pipe.run(raw[:8])  # one full batch first: the arena is allocated for 8
    got = [pipe.run(raw[i : i + 1]) for i in range(8, 20)]  # then one at a time, as at 20 Hz
    assert np.array_equal(np.concatenate([e for e, _ in got]), ref_emb[8:])
    assert np.array_equal(np.concatenate([lg for _, lg in got]), ref_logits[8:])
    c = pipe.counters()
    assert (c["samples"], c["invokes"], c["padded_rows"]) == (20, 13, 0)
    assert (pipe.tensor_batch, pipe.allocated_batch) == (8, 8)
