"""A stateful streaming int8 model (resource variables, logistic head, K = 1) through the real stack."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import MODELS, Broker, start_replay_agent

from edgefl.launcher import stop_agents
from edgefl.runtime import Backbone
from tests.support.models import activate, logits_range, run_backbone

STREAMING = MODELS / "test" / "streaming_kws_int8.tflite"
EMBEDDING = 18  # the last FULLY_CONNECTED's input in that file (tools/build_models.py build_streaming)


def _frames(n: int, seed: int) -> np.ndarray:
    """Standard-normal feature windows float32 [n, 3, 40]: the distribution the model was calibrated on."""
    return np.random.default_rng(seed).standard_normal((n, 3, 40)).astype(np.float32)


def _reference(path: Path) -> Any:
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    it = Interpreter(
        model_path=str(path),
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        experimental_preserve_all_tensors=True,
    )
    it.allocate_tensors()
    return it


def test_streaming_model_is_inspected_as_stateful_logistic() -> None:
    bb = Backbone(STREAMING)
    assert bb.stateful and {"VAR_HANDLE", "READ_VARIABLE", "ASSIGN_VARIABLE"} <= set(bb.stateful_ops)
    assert bb.head_activation == "logistic" and not bb.resizable and bb.batch == 1
    assert not bb.embedding_output and bb.embedding_index == EMBEDDING and bb.embedding_dim == 16
    assert bb.output_quant.scale == pytest.approx(1 / 256) and bb.output_quant.zero_point == 0  # uint8
    W, b = bb.head_from_model()
    assert W.shape == (16, 1) and b.shape == (1,)


@pytest.mark.parametrize("xnnpack", [False, True])
def test_streaming_frames_carry_state_in_order(xnnpack: bool) -> None:
    frames = _frames(12, 1)
    bb = Backbone(STREAMING, xnnpack=xnnpack)
    q = bb.quantize_input(frames)
    emb, out = run_backbone(bb, q)  # 12 frames, one invoke each, in order, through one interpreter
    ref = _reference(STREAMING)
    for i in range(len(q)):
        ref.set_tensor(ref.get_input_details()[0]["index"], q[i : i + 1])
        ref.invoke()
        expect = (ref.get_tensor(EMBEDDING).astype(np.float32) - bb.embedding_quant.zero_point) * np.float32(
            bb.embedding_quant.scale
        )
        # XNNPACK's int8 kernels may round an embedding entry to the neighbouring step
        tol = bb.embedding_quant.scale * 1.0001 if xnnpack else 0.0
        assert np.abs(emb[i] - expect[0]).max() <= tol, i
        y = ref.get_tensor(ref.get_output_details()[0]["index"]).astype(np.float32) * np.float32(1 / 256)
        assert abs(float(out[i, 0]) - float(y[0, 0])) <= (1 / 256 if xnnpack else 0.0), i
    # the state matters: frame 5 alone (fresh state) embeds differently from frame 5 after 0..4
    alone, _ = run_backbone(Backbone(STREAMING, xnnpack=xnnpack), q[5:6])
    assert np.abs(alone[0] - emb[5]).max() > 10 * bb.embedding_quant.scale
    bb.reset_state()  # the initial state again (what the agent does after measuring the pipeline)
    again, _ = run_backbone(bb, q[5:6])
    np.testing.assert_array_equal(again, alone)


def test_streaming_logistic_head_within_one_output_step() -> None:
    bb = Backbone(STREAMING)
    W, b = bb.head_from_model()
    emb, out = run_backbone(bb, bb.quantize_input(_frames(64, 2)))
    lo, hi = logits_range(bb) or (-np.inf, np.inf)  # the model's FC output saturates there
    head = activate(np.clip(emb @ W + b, lo, hi).astype(np.float32), "logistic")
    assert np.abs(head - out).max() <= bb.output_quant.scale  # one uint8 output step
    # the prediction is the model's own decision (p > 0.5), not a softmax over one class
    from edgefl.head import Head

    pred = Head(W, b).predict(emb)
    assert set(np.unique(pred)) <= {0, 1}
    np.testing.assert_array_equal(
        pred[np.abs(out[:, 0] - 0.5) > 2 / 256], (out[:, 0] > 0.5)[np.abs(out[:, 0] - 0.5) > 2 / 256]
    )


@pytest.mark.timeout(180)
def test_streaming_agent_trains_logistic_rounds_with_labels_0_1(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    from edgefl.coordinator.fedavg import FedAvg
    from edgefl.coordinator.service import Coordinator
    from edgefl.topics import Topics
    from edgefl.transport import MqttTransport

    x = _frames(96, 3)
    bb = Backbone(STREAMING)
    W0, b0 = bb.head_from_model()
    logits = run_backbone(Backbone(STREAMING), bb.quantize_input(x))[1]
    y = logits[:, 0] > 0.5  # labels 0/1 from the model itself
    labels = y.astype(np.int64)
    labels[:3] = 5  # not a class of a K = 1 head: refused when stored, counted
    proc = start_replay_agent(
        mosquitto,
        fleet,
        tmp_path,
        "kws-1",
        x,
        labels,
        model__path=str(STREAMING),
        pipeline__raw_dtype="float32",
        pipeline__mean="0.0",
        pipeline__std="1.0",
        pipeline__batch="1",
    )

    async def main() -> dict[str, Any]:
        topics = Topics("edgefl", fleet)
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        await t.start(wait_s=10)
        coord = Coordinator(
            t,
            topics,
            W0,
            b0,
            model_sha256=bb.sha256,
            strategy=FedAvg(local_epochs=2, lr=0.1, batch_size=8, min_clients=1, deadline_s=60),
        )
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            await coord.registry.wait_for_devices(1, timeout_s=60)
            for r in (1, 2):
                assert (await coord.run_round(r)).clients == 1
            await asyncio.sleep(2.5)  # a status publish interval
            return dict(coord.registry.devices["kws-1"])
        finally:
            pump.cancel()
            await t.stop()

    try:
        status = asyncio.run(main())
        assert proc.poll() is None, "the agent died"
        assert status["rejected"].get("bad_label", 0) == 3, status["rejected"]
    finally:
        stop_agents([proc])
        print((tmp_path / "kws-1.log").read_text(errors="replace")[-3000:])


def test_streaming_intermediate_embedding_is_overwritten_so_it_is_prepared() -> None:
    # Why the agent never reads an intermediate: LiteRT's arena reuses the FC input's buffer for a
    # later tensor (LOGISTIC, QUANTIZE), so after invoke() it holds something else.
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    plain = Interpreter(
        model_path=str(STREAMING),
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
    )
    plain.allocate_tensors()
    ref = _reference(STREAMING)
    bb = Backbone(STREAMING, xnnpack=False)
    q = bb.quantize_input(_frames(20, 4))
    emb, _ = run_backbone(bb, q)
    overwritten = 0
    for i in range(len(q)):
        for it in (plain, ref):
            it.set_tensor(it.get_input_details()[0]["index"], q[i : i + 1])
            it.invoke()
        truth = ref.get_tensor(EMBEDDING)
        overwritten += int(not np.array_equal(plain.get_tensor(EMBEDDING), truth))
        expect = (truth.astype(np.float32) - bb.embedding_quant.zero_point) * np.float32(
            bb.embedding_quant.scale
        )
        np.testing.assert_array_equal(emb[i], expect[0])  # the prepared output is the true embedding
    assert overwritten > len(q) // 2
