"""Tests of the compressed downlink (edgefl/wire/global_model.py head layouts) and of skipping redelivery."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
from conftest import INT8_MODEL, Broker, next_status_fields, start_replay_agent

from edgefl.datasets import load_digits
from edgefl.errors import DecodeError
from edgefl.records import read_record
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.types import F32
from edgefl.wire.arrays import encode_array
from edgefl.wire.cbor import DEFAULT_LIMITS, SCHEMA_VERSION
from edgefl.wire.compression import Compression, compress_delta, decompress_delta
from edgefl.wire.global_model import (
    GlobalModel,
    HeadLayout,
    decode_global_model,
    encode_global_model,
    resolve_global_head,
)
from edgefl.wire.signing import PLACEHOLDER, generate_signing_key, sign_message, verify_payload
from edgefl.wire.status import decode_status
from tests.support.wire import global_model_version

SHA = "cd" * 32
D, K = 512, 10


def make_head(seed: int = 0) -> tuple[F32, F32]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((D, K)) * 0.1).astype(np.float32)
    b = (rng.standard_normal(K) * 0.1).astype(np.float32)
    return w, b


def make_global(layout: HeadLayout, base_version: int | None = None, seed: int = 0) -> GlobalModel:
    w, b = make_head(seed)
    return GlobalModel(4, 7, SHA, w, b, layout=layout, base_version=base_version)


def reason_of(fn: Callable[[], object]) -> str:
    with pytest.raises(DecodeError) as info:
        fn()
    return str(info.value.reason)


@pytest.mark.parametrize(
    ("layout", "tolerance"),
    [(HeadLayout.FLOAT32, 0.0), (HeadLayout.FLOAT16, 1e-3), (HeadLayout.INT8, None)],
)
def test_downlink_round_trip_each_layout(layout: HeadLayout, tolerance: float | None) -> None:
    msg = make_global(layout)
    payload = encode_global_model(msg)
    got = decode_global_model(payload, expect_shape=(D, K))
    assert (got.round, got.version, got.model_sha256, got.layout) == (4, 7, SHA, layout)
    assert got.W.dtype == np.float32 and got.W.shape == (D, K) and got.b.shape == (K,)
    assert got.base_version is None
    if tolerance is None:  # int8: error at most half a step of each output unit's scale
        scale = np.abs(msg.W).max(axis=0) / 127
        assert np.all(np.abs(got.W - msg.W) <= scale / 2 + 1e-7)
        assert np.all(np.abs(got.b - msg.b) <= np.abs(msg.b).max() / 127 / 2 + 1e-7)
    else:
        np.testing.assert_allclose(got.W, msg.W, atol=tolerance, rtol=0)
    first = cbor2.loads(payload)
    assert first["v"] == SCHEMA_VERSION
    if layout is HeadLayout.FLOAT32:
        assert "layout" not in first  # bare arrays
    else:
        assert first["layout"] == layout.value


def test_downlink_sizes_int8_is_a_quarter_of_float32() -> None:
    sizes = {layout: len(encode_global_model(make_global(layout))) for layout in HeadLayout}
    assert sizes[HeadLayout.FLOAT32] == 20_680
    assert sizes[HeadLayout.FLOAT16] == 10_450
    # 5,120 int8 + 10 scales of W, 10 int8 + 1 scale of b: 5,380 bytes as plain typed arrays; the
    # int8 levels of this Gaussian head deflate to 5,067 (their entropy is ~7.2 bits, not 8)
    assert sizes[HeadLayout.INT8] == 5_067
    assert sizes[HeadLayout.INT8] / sizes[HeadLayout.FLOAT32] < 0.25


@pytest.mark.parametrize("layout", list(HeadLayout))
def test_downlink_delta_resolves_against_the_held_head(layout: HeadLayout) -> None:
    held_w, held_b = make_head(1)
    new_w, new_b = make_head(2)
    msg = GlobalModel(5, 9, SHA, new_w - held_w, new_b - held_b, layout=layout, base_version=8)
    got = decode_global_model(encode_global_model(msg), expect_shape=(D, K))
    assert got.base_version == 8 and got.layout is layout
    full = resolve_global_head(got, 8, held_w, held_b)
    assert full.base_version is None and full.layout is HeadLayout.FLOAT32 and full.version == 9
    atol = {HeadLayout.FLOAT32: 1e-6, HeadLayout.FLOAT16: 2e-3, HeadLayout.INT8: 3e-3}[layout]
    np.testing.assert_allclose(full.W, new_w, atol=atol, rtol=0)
    np.testing.assert_allclose(full.b, new_b, atol=atol, rtol=0)
    # the full head re-encodes as the bare float32 head the device persists
    assert "layout" not in cbor2.loads(encode_global_model(full))
    # a device holding another version refuses the delta and waits for the retained full head
    assert reason_of(lambda: resolve_global_head(got, 7, held_w, held_b)) == "stale_base"


def test_downlink_full_head_resolves_to_itself() -> None:
    got = decode_global_model(encode_global_model(make_global(HeadLayout.INT8)))
    held_w, held_b = make_head(3)
    full = resolve_global_head(got, 0, held_w, held_b)
    assert full.layout is HeadLayout.FLOAT32 and np.array_equal(full.W, got.W)


def test_downlink_delta_overflowing_the_held_head_is_refused() -> None:
    held_w, held_b = make_head(1)
    held_w[0, 0] = np.float32(3e38)
    delta_w = np.zeros((D, K), np.float32)
    delta_w[0, 0] = np.float32(3e38)
    msg = GlobalModel(5, 9, SHA, delta_w, np.zeros(K, np.float32), base_version=8)
    got = decode_global_model(encode_global_model(msg))
    assert reason_of(lambda: resolve_global_head(got, 8, held_w, held_b)) == "not_finite"


def test_downlink_signed_compressed_head_verifies() -> None:
    key = generate_signing_key()
    msg = make_global(HeadLayout.INT8)
    payload = sign_message(
        encode_global_model, dataclasses.replace(msg, signature=PLACEHOLDER), key, fleet="f1"
    )
    assert "qz" in cbor2.loads(payload)["head"]["W"]
    verify_payload(payload, key.verify_key, fleet="f1", kind="global_model")
    got = decode_global_model(payload, expect_shape=(D, K))
    assert got.layout is HeadLayout.INT8 and len(got.signature) == 64
    tampered = bytearray(payload)
    tampered[200] ^= 1
    assert reason_of(
        lambda: verify_payload(bytes(tampered), key.verify_key, fleet="f1", kind="global_model")
    ) == ("bad_signature")


I8, F16, F32L = HeadLayout.INT8, HeadLayout.FLOAT16, HeadLayout.FLOAT32


def _m(layout: HeadLayout, fn: Callable[[dict[str, Any]], None], base: int | None = None) -> bytes:
    obj = cbor2.loads(encode_global_model(make_global(layout, base)))
    fn(obj)
    return bytes(cbor2.dumps(obj))


def _set_scale(obj: dict[str, Any], values: list[float]) -> None:
    obj["head"]["W"]["scale"] = cbor2.CBORTag(
        40, [[len(values)], cbor2.CBORTag(85, np.asarray(values, "<f4").tobytes())]
    )


def _set_f16(obj: dict[str, Any], value: float) -> None:
    w = np.zeros((D, K), np.float16)
    w[3, 3] = value
    obj["head"]["W"]["values"] = cbor2.CBORTag(40, [[D, K], cbor2.CBORTag(84, w.astype("<f2").tobytes())])


def _deflate(raw: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    return packer.compress(raw) + packer.flush()


def _set_qz(obj: dict[str, Any], packed: bytes) -> None:
    obj["head"]["W"]["qz"] = [[D, K], packed]


def _plain_q() -> cbor2.CBORTag:
    return cbor2.CBORTag(40, [[D, K], cbor2.CBORTag(72, bytes(D * K))])


P = pytest.param


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        P(_m(I8, lambda o: _set_scale(o, [0.01] * (K - 1))), "bad_shape", id="scale_shape"),
        P(_m(I8, lambda o: _set_scale(o, [-0.01] * K)), "bad_value", id="negative_scale"),
        P(
            _m(I8, lambda o: _set_scale(o, [float("nan")] * K)),
            "not_finite",
            id="nan_scale",
        ),
        P(_m(I8, lambda o: _set_scale(o, [3e38] * K)), "not_finite", id="huge_scale"),
        P(_m(F16, lambda o: _set_f16(o, float("nan"))), "not_finite", id="nan_f16"),
        P(_m(F16, lambda o: _set_f16(o, float("inf"))), "not_finite", id="inf_f16"),
        P(
            _m(I8, lambda o: o["head"]["W"].update(qz=o["head"]["b"]["qz"])),
            "bad_shape",
            id="q_shape",
        ),
        P(_m(I8, lambda o: _set_qz(o, b"\xff" * 40)), "bad_value", id="qz_not_deflate"),
        P(_m(I8, lambda o: _set_qz(o, _deflate(bytes(D * K - 1)))), "bad_value", id="qz_short"),
        P(_m(I8, lambda o: _set_qz(o, _deflate(bytes(D * K + 1)))), "bad_value", id="qz_long"),
        P(_m(I8, lambda o: _set_qz(o, _deflate(bytes(10**7)))), "bad_value", id="qz_bomb"),
        P(_m(I8, lambda o: _set_qz(o, _deflate(bytes(D * K)) + b"\x00")), "bad_value", id="qz_trailing"),
        P(_m(I8, lambda o: _set_qz(o, _deflate(bytes(D * K))[:-3])), "bad_value", id="qz_truncated"),
        P(_m(I8, lambda o: o["head"]["W"].update(qz=[[D, K], "text"])), "wrong_type", id="qz_not_bytes"),
        P(_m(I8, lambda o: o["head"]["W"].update(qz=b"\x00")), "wrong_type", id="qz_not_pair"),
        P(_m(I8, lambda o: o["head"]["W"].update(qz=[[D, 0], b""])), "bad_shape", id="qz_zero_dim"),
        P(_m(I8, lambda o: o["head"]["W"].pop("qz")), "missing_key", id="neither_q_nor_qz"),
        P(_m(I8, lambda o: o["head"]["W"].update(q=_plain_q())), "bad_value", id="both_q_and_qz"),
        P(_m(I8, lambda o: o.update(layout="int4")), "bad_value", id="unknown_layout"),
        P(_m(I8, lambda o: o.update(layout=8)), "wrong_type", id="layout_not_text"),
        P(_m(I8, lambda o: o.update(layout="float16")), "bad_value", id="layout_mismatch"),
        P(_m(I8, lambda o: o.update(v=0)), "bad_version", id="schema_0"),
        P(_m(I8, lambda o: o.pop("layout"), base=3), "missing_key", id="base_no_layout"),
        P(
            _m(I8, lambda o: o.update(base_version=7), base=3),
            "bad_value",
            id="base_not_older",
        ),
        P(
            _m(F32L, lambda o: o.update(layout="float32")),
            "wrong_type",
            id="bare_array_as_layout",
        ),
        P(_m(I8, lambda o: o["head"]["W"].update(extra=1)), "unknown_key", id="extra_key"),
    ],
)
def test_downlink_malformed_is_refused(payload: bytes, reason: str) -> None:
    assert reason_of(lambda: decode_global_model(payload, expect_shape=(D, K))) == reason


def test_downlink_wrong_model_shape_is_refused() -> None:
    payload = encode_global_model(make_global(HeadLayout.INT8))
    assert reason_of(lambda: decode_global_model(payload, expect_shape=(D, K + 1))) == "bad_shape"


def test_redelivery_version_is_read_without_decoding() -> None:
    for layout in HeadLayout:
        assert global_model_version(encode_global_model(make_global(layout))) == 7
    assert global_model_version(cbor2.dumps({"v": 1, "type": "global_model"})) is None
    assert reason_of(lambda: global_model_version(b"\xa1\x61v")) == "bad_cbor"


# --- a real agent process on the real broker -----------------------------------------------------------
@pytest.mark.timeout(180)
def test_redelivery_and_downlink_layouts_on_a_real_agent(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """An agent applies an int8 head and a delta head, refuses a delta from a base it lacks, and skips
    the retained head of the version it holds (what every reconnect delivers) before decoding it."""
    x, y = load_digits()
    backbone = Backbone(INT8_MODEL)
    w0, b0 = backbone.head_from_model()
    proc = start_replay_agent(mosquitto, fleet, tmp_path, "dev-1", x[:64], y[:64])
    topics = Topics("edgefl", fleet)
    full = GlobalModel(1, 5, backbone.sha256, w0 * 0.5, b0, layout=HeadLayout.INT8)
    sent_w = decode_global_model(encode_global_model(full)).W
    delta = GlobalModel(2, 6, backbone.sha256, w0 * 0.25, b0 * 0.0, layout=HeadLayout.INT8, base_version=5)
    stale = dataclasses.replace(delta, version=8, base_version=7)

    async def main() -> dict[str, Any]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"peer-{fleet}")
        await t.start(wait_s=10)
        await t.subscribe(topics.status("dev-1"), 1)
        latest: dict[str, Any] = {}

        async def status_until(cond: Callable[[dict[str, Any]], bool], what: str) -> None:
            async with asyncio.timeout(90):
                while not (latest and cond(latest)):
                    msg = await t.queue.get()
                    if msg.payload:
                        st = decode_status(msg.payload)
                        latest.clear()
                        latest.update(st.fields, state=st.state)
            assert cond(latest), what

        try:
            await status_until(lambda st: st["state"] != "offline" and st.get("version") == 0, "agent online")
            payload = encode_global_model(full)
            await t.publish(topics.global_model, payload, qos=1, retain=True)
            await status_until(lambda st: st.get("version") == 5, "int8 head applied")
            assert latest["redelivered_total"] == 0
            await t.publish(topics.global_model, payload, qos=1, retain=True)  # as a reconnect delivers it
            await status_until(lambda st: st.get("redelivered_total") == 1, "redelivery skipped")
            await t.publish(topics.global_model, encode_global_model(stale), qos=1)
            await status_until(lambda st: st["rejected"].get("stale_base", 0) == 1, "stale delta refused")
            await t.publish(topics.global_model, encode_global_model(delta), qos=1)
            await status_until(lambda st: st.get("version") == 6, "delta head applied")
            assert latest["state"] != "offline" and set(latest["rejected"]) == {"stale_base"}
            return latest
        finally:
            await t.publish(topics.global_model, b"", qos=1, retain=True)
            await t.stop()

    try:
        asyncio.run(main())
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    # the agent persisted the full head it built (float32, version 6): int8 head + int8 delta
    record = read_record(tmp_path / "dev-1" / "global_head.rec")
    assert record is not None
    stored = decode_global_model(record)
    assert stored.version == 6 and stored.layout is HeadLayout.FLOAT32 and stored.base_version is None
    want = sent_w + decode_global_model(encode_global_model(delta)).W
    np.testing.assert_allclose(stored.W, want, atol=1e-6, rtol=0)


@pytest.mark.timeout(180)
def test_heartbeat_status_only_on_change_and_on_a_slow_heartbeat(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """Checked every 0.05 s, an idle agent whose memory figures move publishes only its 1 s heartbeat;
    a change (a redelivered head counted) publishes at once."""
    x, y = load_digits()
    backbone = Backbone(INT8_MODEL)
    w0, b0 = backbone.head_from_model()
    proc = start_replay_agent(
        mosquitto,
        fleet,
        tmp_path,
        "dev-1",
        x[:32],
        y[:32],
        status__interval_s="0.05",
        status__heartbeat_s="1.0",
    )
    topics = Topics("edgefl", fleet)
    payload = encode_global_model(GlobalModel(1, 5, backbone.sha256, w0, b0, layout=HeadLayout.FLOAT16))

    async def main() -> tuple[int, float]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"peer-{fleet}")
        await t.start(wait_s=10)
        await t.subscribe(topics.status("dev-1"), 1)

        async def next_fields() -> dict[str, Any]:
            return await next_status_fields(t)

        try:
            async with asyncio.timeout(90):
                while not ((f := await next_fields()).get("ready") and f["state"] == "idle"):
                    pass
                await t.publish(topics.global_model, payload, qos=1, retain=True)
                while (await next_fields()).get("version") != 5:
                    pass
            # 2.5 s of an idle agent: its RSS and counters move, its news does not
            window_end = asyncio.get_running_loop().time() + 2.5
            quiet = 0
            while (left := window_end - asyncio.get_running_loop().time()) > 0:
                try:
                    async with asyncio.timeout(left):
                        f = await next_fields()
                except TimeoutError:
                    break
                assert f["version"] == 5 and f["redelivered_total"] == 0, f
                quiet += 1
            t0 = asyncio.get_running_loop().time()
            await t.publish(topics.global_model, payload, qos=1, retain=True)  # news: one redelivery
            async with asyncio.timeout(30):
                while (await next_fields()).get("redelivered_total") != 1:
                    pass
            return quiet, asyncio.get_running_loop().time() - t0
        finally:
            await t.publish(topics.global_model, b"", qos=1, retain=True)
            await t.stop()

    try:
        quiet, _ = asyncio.run(main())
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    # every 0.05 s before the heartbeat key: ~50 statuses in 2.5 s; now the heartbeats alone
    assert 1 <= quiet <= 3, quiet


@contextlib.asynccontextmanager
async def coordinator_and_peer(
    broker: Broker, fleet: str
) -> AsyncIterator[tuple[MqttTransport, MqttTransport]]:
    """A coordinator's transport and a peer's, started; afterwards the retained head is cleared and
    both are stopped."""
    coord_t = MqttTransport(broker.host, broker.port, f"coord-{fleet}")
    peer = MqttTransport(broker.host, broker.port, f"peer-{fleet}")
    await coord_t.start(wait_s=10)
    await peer.start(wait_s=10)
    try:
        yield coord_t, peer
    finally:
        await peer.publish(Topics("edgefl", fleet).global_model, b"", qos=1, retain=True)
        await peer.stop()
        await coord_t.stop()


@pytest.mark.timeout(120)
def test_downlink_coordinator_publishes_its_profile_layout(mosquitto: Broker, fleet: str) -> None:
    """``[rounds] downlink = "int8"``: the retained global head goes out in that layout (5,062 bytes
    for a 512 x 10 head instead of 20,680), and the coordinator's own head stays float32."""
    from edgefl.coordinator.fedavg import FedAvg
    from edgefl.coordinator.profile import RoundsConfig
    from edgefl.coordinator.service import Coordinator

    assert RoundsConfig().downlink == "float32"  # the default every device reads
    w0, b0 = make_head(5)
    topics = Topics("edgefl", fleet)

    async def main() -> bytes:
        async with coordinator_and_peer(mosquitto, fleet) as (coord_t, peer):
            coord = Coordinator(
                coord_t,
                topics,
                w0,
                b0,
                model_sha256=SHA,
                strategy=FedAvg(min_clients=1, deadline_s=5.0),
                downlink=HeadLayout(RoundsConfig(downlink="int8").downlink),
            )
            await coord.start(adopt_wait_s=0.2)
            assert coord.W.dtype == np.float32 and np.array_equal(coord.W, w0)
            await peer.subscribe(topics.global_model, 1)
            async with asyncio.timeout(30):
                while not (msg := await peer.queue.get()).payload:
                    pass
            return msg.payload

    payload = asyncio.run(main())
    # 5,380 bytes with plain int8 levels, 5,062 with them deflated (qz)
    assert len(payload) == 5_062 and cbor2.loads(payload)["layout"] == "int8"
    got = decode_global_model(payload, expect_shape=(D, K))
    assert got.version == 0 and got.layout is HeadLayout.INT8
    np.testing.assert_allclose(got.W, w0, atol=float(np.abs(w0).max()) / 127 / 2 + 1e-7, rtol=0)


@pytest.mark.timeout(120)
def test_redelivery_a_coordinator_that_adopted_no_longer_receives_its_own_round_and_head(
    mosquitto: Broker, fleet: str
) -> None:
    """A coordinator without state subscribes to the retained ``round`` and ``global`` to adopt them,
    then unsubscribes: its own announcements and heads are not delivered back to it (each was a
    second copy through the broker, decoded, ignored and acknowledged). Its queue after ``start``
    (which publishes the head) holds only a device's status sent after it."""
    from edgefl.coordinator.fedavg import FedAvg
    from edgefl.coordinator.service import Coordinator

    w0, b0 = make_head(5)
    topics = Topics("edgefl", fleet)

    async def main() -> None:
        async with coordinator_and_peer(mosquitto, fleet) as (coord_t, peer):
            coord = Coordinator(
                coord_t, topics, w0, b0, model_sha256=SHA, strategy=FedAvg(min_clients=1, deadline_s=5.0)
            )
            await coord.start(adopt_wait_s=0.2)  # no pump: what arrives stays in the queue
            assert coord_t.subscriptions == (topics.update("+"), topics.status("+"))
            await coord.publish_global(0)  # the head again, after the unsubscribe
            await peer.publish(topics.status("dev-x"), b"marker", qos=1)
            msg = await asyncio.wait_for(coord_t.queue.get(), 10)
            assert (msg.topic, msg.payload) == (topics.status("dev-x"), b"marker")
            assert coord_t.queue.empty()

    asyncio.run(main())


def test_downlink_int8_level_maps_are_counted_to_the_byte() -> None:
    """The sizes that choose ``q`` or ``qz`` (counted, not encoded) are exactly cbor2's, for 1-D and
    2-D levels whose lengths cross CBOR's head-size steps (24, 256, 65,536)."""

    from edgefl.wire.compression import _q_cbor_bytes, _qz_cbor_bytes

    for shape in ((1,), (23,), (24,), (300,), (70_000,), (512, 10), (1280, 1000), (3, 300)):
        q = np.zeros(shape, np.int8)
        # a map of one pair: its 1-byte head, then the pair
        assert 1 + _q_cbor_bytes(shape) == len(cbor2.dumps({"q": encode_array(q)})), shape
        for packed in (0, 23, 24, 255, 256, 70_000):
            doc = {"qz": [list(shape), bytes(packed)]}
            assert 1 + _qz_cbor_bytes(shape, packed) == len(cbor2.dumps(doc)), (shape, packed)


@pytest.mark.parametrize("mode", [Compression.INT8, Compression.TOPK_INT8])
def test_downlink_deflated_int8_levels_are_lossless_and_used_only_when_smaller(mode: Compression) -> None:
    """``qz`` carries exactly the levels ``q`` would (same decoded floats), and only when it is smaller:
    a dense Gaussian delta (~7.2 bits a level), a sparse one (zeros deflate to almost nothing) and
    uniform noise (incompressible: stays ``q``)."""
    rng = np.random.default_rng(3)
    dense = (rng.standard_normal((D, K)) * 0.01).astype(np.float32)
    sparse = np.where(rng.random((D, K)) < 0.2, dense, 0).astype(np.float32)
    noise = rng.uniform(-1, 1, (D, K)).astype(np.float32)
    noise[0] = 1.0  # every unit's scale 1/127: levels uniform over [-127, 127]
    sizes = {}
    for name, x in (("dense", dense), ("sparse", sparse), ("noise", noise)):
        packed = compress_delta(x, mode)
        plain: dict[str, Any] = dict(packed)
        if "qz" in plain:  # the same levels as a plain typed array
            shape, deflated = plain.pop("qz")
            levels = np.frombuffer(zlib.decompress(deflated, -15), np.int8).reshape(shape)
            plain["q"] = encode_array(levels)
        assert "q" in plain and "qz" not in plain
        got = decompress_delta(packed, (D, K), limits=DEFAULT_LIMITS, compression=mode)
        want = decompress_delta(plain, (D, K), limits=DEFAULT_LIMITS, compression=mode)
        np.testing.assert_array_equal(got, want)  # lossless: the same levels
        sizes[name] = (len(cbor2.dumps(packed)), len(cbor2.dumps(plain)), "qz" in packed)
    assert all(packed <= plain for packed, plain, _ in sizes.values())
    if mode is Compression.INT8:
        assert sizes["dense"][2] and sizes["dense"][0] < 0.95 * sizes["dense"][1]
        assert sizes["sparse"][2] and sizes["sparse"][0] < 0.5 * sizes["sparse"][1]
        assert not sizes["noise"][2] and sizes["noise"][0] == sizes["noise"][1]
