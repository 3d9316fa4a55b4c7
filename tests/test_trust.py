"""The coordinator's trust in update ids, declines and site partials (the H16 attacker findings).

Real mosquitto, real coordinator, forged messages signed by a valid device key.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from conftest import INT8_MODEL, Broker, wait_until

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.hierarchy import RootCoordinator
from edgefl.coordinator.profile import load_coordinator_profile
from edgefl.coordinator.service import Coordinator
from edgefl.coordinator.strategies import make_strategy
from edgefl.coordinator.strategy import MAX_UPDATE_EXAMPLES, Offer, SiteSums
from edgefl.errors import ConfigError, UpdateRejected
from edgefl.resources import shipped
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.types import F32
from edgefl.wire.partial import Partial, encode_partial
from edgefl.wire.rounds import Decline, Update, UpdateMetrics, encode_decline, encode_update
from edgefl.wire.signing import generate_signing_key, sign_message

pytestmark = pytest.mark.timeout(120)


def test_trust_declines_cannot_squat_another_devices_update_ids(
    mosquitto: Broker, fleet: str, tmp_path: Path
) -> None:
    """dev-1, with its own valid key, declines with dev-2's update ids (the H16 trial): refused as
    ``bad_value``; a decline of another round, or of an unselected device, is refused too; dev-2's
    real update then counts and the round closes with both devices' answers."""
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    keys = {d: generate_signing_key() for d in ("dev-1", "dev-2", "dev-3")}
    topics = Topics("edgefl", fleet)

    def decline(dev: str, rnd: int, base: int, uid: str) -> bytes:
        msg = Decline(rnd, base, dev, "over_budget", "x" * 200, uid)
        return sign_message(encode_decline, msg, keys[dev], fleet=fleet)

    def update(dev: str, rnd: int, base: int) -> bytes:
        up = Update(rnd, base, dev, 10, np.full_like(W0, 0.01), np.zeros_like(b0),
                    UpdateMetrics(0.1, 0.9, 0.01, 1), f"{dev}:{rnd}:{base}")  # fmt: skip
        return sign_message(encode_update, up, keys[dev], fleet=fleet)

    async def main() -> tuple[Coordinator, int, int]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        dev = MqttTransport(mosquitto.host, mosquitto.port, f"dev-{fleet}")
        await t.start(wait_s=10)
        await dev.start(wait_s=10)
        strategy = FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=2, deadline_s=30)
        coord = Coordinator(
            t, topics, W0, b0, model_sha256=bb.sha256, strategy=strategy,
            device_keys={d: k.verify_key for d, k in keys.items()},
        )  # fmt: skip
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            run1 = asyncio.create_task(coord.run_round(1, selected=("dev-1", "dev-2")))
            await wait_until(lambda: coord.state.round == 1, 10, "round 1 open")
            forged = [
                decline("dev-1", r, r - 1, f"dev-2:{r}:{r - 1}")
                for r in (1, 2, 3)  # dev-2's ids
            ] + [
                decline("dev-1", 1, 0, "dev-1:1:0"),  # its own update id, without the suffix
                decline("dev-1", 2, 1, "dev-1:2:1:declined"),  # a round not open
                decline("dev-1", 1, 5, "dev-1:1:5:declined"),  # another base version
                decline("dev-3", 1, 0, "dev-3:1:0:declined"),  # not selected
            ]
            for p in forged:
                await dev.publish(topics.update("dev-1" if b"dev-1" in p else "dev-3"), p, qos=1)
            want = {"bad_value": 4, "stale_round": 1, "stale_base": 1, "not_selected": 1}
            await wait_until(lambda: dict(coord.state.rejected) == want, 10, "forged declines refused")
            await dev.publish(topics.update("dev-2"), update("dev-2", 1, 0), qos=1)
            await dev.publish(topics.update("dev-1"), decline("dev-1", 1, 0, "dev-1:1:0:declined"), qos=1)
            record = await run1
            # the re-send arrives after both answers closed the round (sent once it is closed: sent
            # right after the first, it could reach a loaded coordinator before run_round closed it)
            await dev.publish(topics.update("dev-1"), decline("dev-1", 1, 0, "dev-1:1:0:declined"), qos=1)
            await wait_until(lambda: coord.state.rejected["round_closed"] == 1, 10, "the re-sent decline")
            return coord, record.clients, record.declined
        finally:
            pump.cancel()
            await dev.stop()
            await t.stop()

    coord, clients, declined = asyncio.run(main())
    assert (clients, declined) == (1, 1)  # dev-2's update counted, dev-1's own decline once
    assert coord.counted[1] == ["dev-2:1:0"]
    assert dict(coord.state.declined) == {"over_budget": 1}
    assert dict(coord.state.rejected) == {
        "bad_value": 4, "stale_round": 1, "stale_base": 1, "not_selected": 1, "round_closed": 1
    }  # fmt: skip


def test_hierarch_robust_root_weighs_sites_alike_and_bounds_their_estimates() -> None:
    """A site with weight 1e300 and a huge trimmed-mean estimate (H16: it set the head alone) is one
    estimate of three, scaled to the norm bound: the head moves by at most bound / 3 from the honest
    sites' mean share."""
    shape = (12, 4)
    root = make_strategy("trimmed-mean", clip_norm=0.5, trim_fraction=0.2)
    root.configure_round(1, shape)
    honest = [np.full(shape, 0.01), np.full(shape, 0.03)]
    for est in honest:
        root.offer_sums(SiteSums("trimmed-mean", est, np.zeros(shape[1]), 3.0, 3, 0))
    root.offer_sums(SiteSums("trimmed-mean", np.full(shape, -5.0), np.zeros(shape[1]), 1e300, 16_000, 0))
    W, _ = root.aggregate(np.zeros(shape, np.float32), np.zeros(shape[1], np.float32))
    # equal weights: (0.01 + 0.03 + the forged estimate scaled to norm 0.5) / 3
    forged = -0.5 / np.sqrt(shape[0] * shape[1])
    np.testing.assert_allclose(W, np.full(shape, (0.01 + 0.03 + forged) / 3), rtol=1e-5)
    assert root.report().clipped == 1 and root.report().norm_bound == 0.5
    # the median over sites ignores the forged site's weight entirely: the median of three is honest
    med = make_strategy("median", clip_norm=0.5)
    med.configure_round(1, shape)
    for est in honest:
        med.offer_sums(SiteSums("median", est, np.zeros(shape[1]), 3.0, 3, 0))
    med.offer_sums(SiteSums("median", np.full(shape, 5.0), np.zeros(shape[1]), 1e300, 16_000, 0))
    W, _ = med.aggregate(np.zeros(shape, np.float32), np.zeros(shape[1], np.float32))
    np.testing.assert_allclose(W, np.full(shape, 0.03), rtol=1e-6)


def test_hierarch_adaptive_bound_at_the_root_is_the_lower_median_site_norm() -> None:
    shape = (2, 2)
    root = make_strategy("trimmed-mean")  # no fixed clip_norm
    root.configure_round(1, shape)
    for v in (0.1, 0.2, 1e6):
        root.offer_sums(SiteSums("trimmed-mean", np.full(shape, v), np.zeros(2), 3.0, 3, 0))
    W, _ = root.aggregate(np.zeros(shape, np.float32), np.zeros(2, np.float32))
    # lower median of the norms (0.2, 0.4, 2e6) is 0.4: the 1e6 site is scaled to 0.2 per coordinate
    np.testing.assert_allclose(W, np.full(shape, (0.1 + 0.2 + 0.2) / 3), rtol=1e-5)
    assert root.report().clipped == 1


def test_hierarch_sum_partial_weight_is_capped_per_update_and_a_norm_overflow_is_not_finite() -> None:
    shape = (3, 2)
    st = make_strategy("fedavg")
    st.configure_round(1, shape)
    small = np.full(shape, 0.01)
    for weight, count in ((1e300, 1), (MAX_UPDATE_EXAMPLES + 1.0, 1), (2 * MAX_UPDATE_EXAMPLES + 1.0, 2)):
        with pytest.raises(UpdateRejected) as err:
            st.offer_sums(SiteSums("sum", small, np.zeros(2), weight, count, 0))
        assert err.value.reason == "bad_value" and "examples" in str(err.value)
    st.offer_sums(SiteSums("sum", small * 2e6, np.zeros(2), 2e6, 2, 0))  # the cap itself is fine
    assert st.accepted == 2
    with pytest.raises(UpdateRejected) as err:  # its norm overflows float64: so no sum of partials can
        st.offer_sums(SiteSums("sum", np.full(shape, 1e155), np.zeros(2), 1e6, 1, 0))
    assert err.value.reason == "not_finite" and st.accepted == 2
    # a flat update claiming more examples than any device can hold
    with pytest.raises(UpdateRejected) as err:
        st.offer(
            Offer("dev-1", np.zeros(shape, np.float32), np.zeros(2, np.float32), MAX_UPDATE_EXAMPLES + 1)
        )
    assert err.value.reason == "bad_value"


def test_hierarch_root_refuses_to_start_without_site_keys_unless_allowed() -> None:
    profile = shipped("firmware_configs/coordinator.toml")
    with pytest.raises(ConfigError) as err:
        load_coordinator_profile(profile, {"hierarchy.role": "root"})
    assert err.value.problems == [
        "hierarchy.site_devices = 0: required when hierarchy.role = 'root': the most devices one site "
        "has (a site whose key was stolen may claim no more)",
        "hierarchy.site_keys_dir = None: required when hierarchy.role = 'root' "
        "(or set hierarchy.allow_unsigned_sites = true)",
    ]
    sets = {"hierarchy.role": "root", "hierarchy.allow_unsigned_sites": "true", "hierarchy.site_devices": "4"}
    ok = load_coordinator_profile(profile, sets)
    assert ok.hierarchy.allow_unsigned_sites is True


def test_hierarch_root_refuses_forged_site_partials_signed_by_a_valid_site_key(
    mosquitto: Broker, fleet: str
) -> None:
    """At a root, over a real broker: site-b (its own valid key) claims weight 1e300, then 2e6 for one
    update, then a future round's ids: each refused as ``bad_value``. Its partial listing site-a's id
    is counted, logged and counted as an overlap, and site-a's honest partial is not refused."""
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    D, K = W0.shape
    keys = {s: generate_signing_key() for s in ("site-a", "site-b")}
    topics = Topics("edgefl", fleet)
    v = 0.1 / np.sqrt(D * K)  # a per-update mean of norm 0.1, under the bound

    def partial(site: str, ids: list[str], weight: float, rnd: int = 1, pid: str = "") -> bytes:
        n = len(ids)
        msg = Partial(rnd, rnd - 1, site, pid or f"{site}:{rnd}:{weight}", "sum", n, weight, 0, tuple(ids),
                      np.full((D, K), v * weight), np.zeros(K))  # fmt: skip
        return sign_message(encode_partial, msg, keys[site], fleet=fleet)

    async def main() -> tuple[RootCoordinator, int]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"root-{fleet}")
        pub = MqttTransport(mosquitto.host, mosquitto.port, f"sites-{fleet}")
        await t.start(wait_s=10)
        await pub.start(wait_s=10)
        strategy = FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=2, deadline_s=30, clip_norm=0.5)
        root = RootCoordinator(
            t, topics, W0, b0, model_sha256=bb.sha256, strategy=strategy,
            site_keys={s: k.verify_key for s, k in keys.items()}, expected_sites=2,
        )  # fmt: skip
        pump = asyncio.create_task(root.pump())
        try:
            await root.start()
            run1 = asyncio.create_task(root.run_round(1))
            await wait_until(lambda: root.state.round == 1, 10, "round 1 open")
            await pub.publish(topics.partial("site-a"), partial("site-a", ["a1:1:0", "a2:1:0"], 40.0), qos=1)
            for forged in (
                partial("site-b", ["b1:1:0"], 1e300),
                partial("site-b", ["b1:1:0"], 2e6),
                partial("site-b", ["b1:2:1"], 10.0),  # a future round's id
            ):
                await pub.publish(topics.partial("site-b"), forged, qos=1)
            await wait_until(lambda: root.state.rejected["bad_value"] == 3, 10, "forged partials refused")
            await pub.publish(topics.partial("site-b"), partial("site-b", ["a1:1:0", "b1:1:0"], 20.0), qos=1)
            record = await run1
            return root, record.clients
        finally:
            pump.cancel()
            await pub.stop()
            await t.stop()

    root, clients = asyncio.run(main())
    assert dict(root.state.rejected) == {"bad_value": 3}
    assert root.overlapping_ids == {"site-b/site-a": 1} and root.overlaps == 1
    assert clients == 3  # a1, a2, b1: the id both sites listed counts once
    assert root.counted[1] == ["a1:1:0", "a2:1:0", "b1:1:0"]
    # FedAvg of the two honest shares: (40 v + 20 v) / 60 = v per coordinate, server_lr 1
    np.testing.assert_allclose(root.W - W0, np.full((D, K), v, np.float32), rtol=1e-4, atol=1e-7)


def test_trust_coordinator_starts_during_a_junk_flood_and_logs_declines_throttled(
    mosquitto: Broker, fleet: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator's persistent session holds 3,000 junk messages on ``update/+`` when it starts
    (H16: ``no SUBACK ... within 10 s``, exit 4): it adopts, subscribes and runs a round; the junk is
    refused and counted with at most 20 + every 1000th log line; 30 declines log 20 lines, each
    ``detail`` cut to 80 characters."""
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    topics = Topics("edgefl", fleet)
    devices = tuple(f"dev-{i}" for i in range(30))

    async def main() -> tuple[Coordinator, int]:
        cid = f"coord-{fleet}"
        first = MqttTransport(mosquitto.host, mosquitto.port, cid, session_expiry_s=3600)
        await first.start(wait_s=10)
        await first.subscribe(topics.update("+"), 1)
        await first.stop()
        pub = MqttTransport(mosquitto.host, mosquitto.port, f"junk-{fleet}")
        await pub.start(wait_s=10)
        for i in range(3000):
            await pub.publish(topics.update(f"x{i % 50}"), b"\xff" * 64, qos=1)
        t = MqttTransport(mosquitto.host, mosquitto.port, cid, session_expiry_s=3600, queue_size=64)
        await t.start(wait_s=10)
        strategy = FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=30, deadline_s=30)
        coord = Coordinator(t, topics, W0, b0, model_sha256=bb.sha256, strategy=strategy)
        pump = asyncio.create_task(coord.pump())
        try:
            await coord.start()
            run1 = asyncio.create_task(coord.run_round(1, selected=devices))
            await wait_until(lambda: coord.state.round == 1, 10, "round 1 open")
            for d in devices:
                msg = Decline(1, 0, d, "over_budget", "y" * 200, f"{d}:1:0:declined")
                await pub.publish(topics.update(d), encode_decline(msg), qos=1)
            record = await run1
            return coord, record.declined
        finally:
            pump.cancel()
            await pub.stop()
            await t.stop()

    with caplog.at_level("WARNING"):
        coord, declined = asyncio.run(main())
    assert declined == 30 and dict(coord.state.declined) == {"over_budget": 30}
    junk = sum(coord.state.rejected.values())
    assert junk >= 1000  # mosquitto queues up to 1,000 messages for an offline session by default
    refusal_lines = [r for r in caplog.records if r.getMessage().startswith("rejected message")]
    assert len(refusal_lines) <= 20 + junk // 1000
    decline_lines = [r.getMessage() for r in caplog.records if " declined: over_budget" in r.getMessage()]
    assert len(decline_lines) == 20
    assert all("y" * 79 + "…" in m and "y" * 80 not in m for m in decline_lines)


def test_forgery_root_without_device_keys_takes_no_device_update(mosquitto: Broker, fleet: str) -> None:
    """A root with site keys and no device keys (as documented): it does not subscribe to ``update/+``;
    forged device updates queued for its persistent session from an earlier subscription are refused
    as ``unsigned``; the round counts only the site's partial (0 unsigned or unknown-device updates)."""
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    D, K = W0.shape
    key = generate_signing_key()
    topics = Topics("edgefl", fleet)
    v = 0.05 / np.sqrt(D * K)

    def forged(dev: str) -> bytes:
        up = Update(1, 0, dev, 1000, np.full_like(W0, -5.0), np.zeros_like(b0),
                    UpdateMetrics(0.1, 0.9, 0.01, 1), f"{dev}:1:0")  # fmt: skip
        return encode_update(up)

    async def main() -> tuple[RootCoordinator, int, list[str]]:
        cid = f"root-{fleet}"
        earlier = MqttTransport(mosquitto.host, mosquitto.port, cid, session_expiry_s=3600)
        await earlier.start(wait_s=10)
        await earlier.subscribe(topics.update("+"), 1)  # an older root's subscription, kept by the broker
        await earlier.stop()
        pub = MqttTransport(mosquitto.host, mosquitto.port, f"evil-{fleet}")
        await pub.start(wait_s=10)
        for dev in ("ghost-1", "ghost-2", "ghost-3"):
            await pub.publish(topics.update(dev), forged(dev), qos=1)
        t = MqttTransport(mosquitto.host, mosquitto.port, cid, session_expiry_s=3600)
        await t.start(wait_s=10)
        strategy = FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=1, deadline_s=30)
        root = RootCoordinator(
            t, topics, W0, b0, model_sha256=bb.sha256, strategy=strategy,
            site_keys={"site-a": key.verify_key}, expected_sites=1,
        )  # fmt: skip
        pump = asyncio.create_task(root.pump())
        try:
            assert topics.update("+") not in root._data_topics()
            await root.start(adopt_wait_s=0.5)
            await wait_until(lambda: root.state.rejected["unsigned"] == 3, 10, "queued forgeries refused")
            run1 = asyncio.create_task(root.run_round(1))
            await wait_until(lambda: root.state.round == 1, 10, "round 1 open")
            for dev in ("ghost-4", "ghost-5"):  # after the root's own subscriptions: never delivered
                await pub.publish(topics.update(dev), forged(dev), qos=1)
            msg = Partial(1, 0, "site-a", "site-a:1", "sum", 2, 20.0, 0, ("a1:1:0", "a2:1:0"),
                          np.full((D, K), v * 20.0), np.zeros(K))  # fmt: skip
            signed = sign_message(encode_partial, msg, key, fleet=fleet)
            await pub.publish(topics.partial("site-a"), signed, qos=1)
            record = await run1
            return root, record.clients, root.counted[1]
        finally:
            pump.cancel()
            await pub.stop()
            await t.stop()

    root, clients, counted = asyncio.run(main())
    assert dict(root.state.rejected) == {"unsigned": 3}  # the queued ones; the later two never arrived
    assert clients == 2 and counted == ["a1:1:0", "a2:1:0"]
    np.testing.assert_allclose(root.W - W0, np.full((D, K), v, np.float32), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", ["fedavg", "trimmed-mean"])
def test_trust_hostile_site_moves_the_root_by_at_most_its_devices_share(
    mosquitto: Broker, fleet: str, name: str
) -> None:
    """A root (adaptive bound) with three honest sites and one whose key was stolen, each with 2
    registered devices (``site_devices = 2``), over a real broker. Round 1: all honest (mean v, 10
    examples per update). Round 2: the thief claims 16,000 invented ids (refused, ``bad_value``), then
    2 updates of weight 2e6 whose mean is -100 v. Its devices' share is 2 of the round's 8 updates.

    FedAvg: its weight per update is cut to the last round's median (10), its mean to 2 x the last
    round's median mean norm (B = 2 v): the head moves by (3 x 20 v - 20 x 2 v) / 80 = 0.25 v, the
    thief's pull -0.5 v = 2/8 x B. Trimmed mean (sites weighed alike): its estimate is scaled to the
    lower median of the estimates' norms (B = v): (3 v - v) / 4 = 0.5 v, its pull -0.25 v = 2/8 x B.
    Either way the head is within its share of B + v of the honest sites' v, and the round counts
    the 8 updates it accepted."""
    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    D, K = W0.shape
    sites = ("site-a", "site-b", "site-c", "site-x")
    keys = {s: generate_signing_key() for s in sites}
    topics = Topics("edgefl", fleet)
    v = 0.05 / np.sqrt(D * K)
    combine = "sum" if name == "fedavg" else name

    def partial(site: str, rnd: int, ids: list[str], weight: float, mean: float, pid: str = "") -> bytes:
        n = len(ids)
        W = np.full((D, K), mean * weight if combine == "sum" else mean)
        msg = Partial(rnd, rnd - 1, site, pid or f"{site}:{rnd}", combine, n,
                      weight if combine == "sum" else float(n), 0, tuple(ids), W, np.zeros(K))  # fmt: skip
        return sign_message(encode_partial, msg, keys[site], fleet=fleet)

    async def main() -> tuple[RootCoordinator, list[int], F32]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"root-{fleet}")
        pub = MqttTransport(mosquitto.host, mosquitto.port, f"sites-{fleet}")
        await t.start(wait_s=10)
        await pub.start(wait_s=10)
        strategy = make_strategy(name, local_epochs=1, lr=0.05, batch_size=16, min_clients=1, deadline_s=30)
        root = RootCoordinator(
            t, topics, W0, b0, model_sha256=bb.sha256, strategy=strategy,
            site_keys={s: k.verify_key for s, k in keys.items()}, expected_sites=4, site_devices=2,
        )  # fmt: skip
        pump = asyncio.create_task(root.pump())
        clients = []
        W1 = W0
        try:
            await root.start(adopt_wait_s=0.5)
            for rnd in (1, 2):
                run = asyncio.create_task(root.run_round(rnd))
                opened = lambda rnd=rnd: root.state.round == rnd  # noqa: E731
                await wait_until(opened, 10, f"round {rnd} open")
                for s in sites[:3]:
                    ids = [f"{s}-d{i}:{rnd}:{rnd - 1}" for i in (1, 2)]
                    await pub.publish(topics.partial(s), partial(s, rnd, ids, 20.0, v), qos=1)
                x_ids = [f"x-d{i}:{rnd}:{rnd - 1}" for i in (1, 2)]
                if rnd == 1:
                    await pub.publish(topics.partial("site-x"), partial("site-x", 1, x_ids, 20.0, v), qos=1)
                else:
                    many = [f"x{i}:2:1" for i in range(16_000)]
                    to_x = topics.partial("site-x")
                    await pub.publish(to_x, partial("site-x", 2, many, 1e6, -v, "m"), qos=1)
                    await wait_until(lambda: root.state.rejected["bad_value"] == 1, 20, "16,000 ids refused")
                    await pub.publish(to_x, partial("site-x", 2, x_ids, 2e6, -100 * v), qos=1)
                record = await run
                clients.append(record.clients)
                if rnd == 1:
                    W1 = root.W.copy()
            return root, clients, W1
        finally:
            pump.cancel()
            await pub.stop()
            await t.stop()

    root, clients, W1 = asyncio.run(main())
    assert clients == [8, 8] and dict(root.state.rejected) == {"bad_value": 1}
    np.testing.assert_allclose(W1 - W0, np.full((D, K), v, np.float32), rtol=1e-4, atol=1e-7)
    share, bound = 2 / 8, (2 * v if name == "fedavg" else v)
    moved = float(np.mean(root.W - W1))
    assert moved == pytest.approx(0.25 * v if name == "fedavg" else 0.5 * v, rel=1e-3)
    assert abs(moved - v) <= share * (bound + v) * (1 + 1e-3)  # within its share of the honest v
    assert root.strategy.report().clipped == (2 if name == "fedavg" else 1)  # the thief's partial
