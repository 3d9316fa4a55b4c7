from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import INT8_MODEL, Broker, wait_until

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.optimisers import FedAvgM
from edgefl.coordinator.privacy import (
    DPFedAvg,
    PrivacyLedger,
    PrivateSum,
    clip_update,
    ledger_epsilon,
)
from edgefl.coordinator.service import Coordinator
from edgefl.coordinator.strategies import make_strategy
from edgefl.coordinator.strategy import Offer, aggregate_checked
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.wire.rounds import Update, UpdateMetrics, encode_update
from tests.support.privacy import dp_epsilon


def test_clip_update_by_hand() -> None:
    W = np.array([[3.0]], np.float32)
    b = np.array([4.0], np.float32)
    cW, cb, norm = clip_update(W, b, 1.0)
    assert norm == 5.0
    np.testing.assert_allclose(cW, [[0.6]], rtol=1e-6)
    np.testing.assert_allclose(cb, [0.8], rtol=1e-6)
    # below the bound: unchanged
    cW, cb, norm = clip_update(W, b, 10.0)
    np.testing.assert_array_equal(cW, W)
    np.testing.assert_array_equal(cb, b)
    with pytest.raises(ValueError):
        clip_update(W, b, 0.0)
    with pytest.raises(ValueError):
        clip_update(np.array([[np.nan]], np.float32), b, 1.0)


def test_private_sum_without_noise_is_clipped_sum_over_expected_clients() -> None:
    s = PrivateSum((1, 1), clip_norm=1.0)
    s.add(np.array([[3.0]], np.float32), np.array([4.0], np.float32))   # clipped to (0.6, 0.8)
    s.add(np.array([[0.5]], np.float32), np.array([0.0], np.float32))   # kept
    assert (s.count, s.clipped) == (2, 1)
    W, b = s.noisy_mean(0.0, expected_clients=4.0, rng=np.random.default_rng(0))
    np.testing.assert_allclose(W, [[(0.6 + 0.5) / 4]], rtol=1e-6)
    np.testing.assert_allclose(b, [0.8 / 4], rtol=1e-6)
    with pytest.raises(ValueError):
        s.add(np.zeros((2, 1), np.float32), np.zeros(1, np.float32))


def test_noise_has_the_promised_standard_deviation() -> None:
    s = PrivateSum((400, 50), clip_norm=2.0)
    s.add(np.zeros((400, 50), np.float32), np.zeros(50, np.float32))
    W, _ = s.noisy_mean(1.5, expected_clients=3.0, rng=np.random.default_rng(1))
    # sd = z C / expected = 1.5 * 2 / 3 = 1.0 ; 20000 draws → sample sd within 2 %
    assert abs(float(W.std()) - 1.0) < 0.02
    assert abs(float(W.mean())) < 0.02


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of a mu-GDP mechanism (Balle & Wang 2018, Theorem 8), by bisection."""

    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    def delta_of(eps: float) -> float:
        return phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2)

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


def test_epsilon_matches_the_gaussian_mechanism_without_sampling() -> None:
    dp_accounting = pytest.importorskip("dp_accounting")
    z, rounds, delta = 2.0, 16, 1e-5
    # full participation: T Gaussian mechanisms of sd z compose to one with mu = sqrt(T) / z
    exact = _gaussian_epsilon(math.sqrt(rounds) / z, delta)
    # the PLD accountant (tight) finds the exact epsilon: the formula above is the right one
    pld = dp_accounting.pld.PLDAccountant()
    full = dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(z))
    pld.compose(dp_accounting.SelfComposedDpEvent(full, rounds))
    assert pld.get_epsilon(delta) == pytest.approx(exact, rel=0.02)
    rdp = dp_epsilon(z, 1.0, rounds, delta)
    # RDP is an upper bound, below the classic conversion min_a T a / (2 z^2) + log(1/delta) / (a - 1)
    orders = np.linspace(1.01, 200, 20000)
    classic = min(rounds * a / (2 * z * z) + math.log(1 / delta) / (a - 1) for a in orders)
    assert exact <= rdp <= classic + 1e-9


def test_epsilon_grows_with_rounds_and_falls_with_noise_and_sampling() -> None:
    pytest.importorskip("dp_accounting")
    base = dp_epsilon(1.0, 0.25, 50, 1e-5)
    assert dp_epsilon(1.0, 0.25, 100, 1e-5) > base
    assert dp_epsilon(2.0, 0.25, 50, 1e-5) < base
    assert dp_epsilon(1.0, 0.1, 50, 1e-5) < base
    assert dp_epsilon(1.0, 0.25, 0, 1e-5) == 0.0
    assert dp_epsilon(0.0, 0.25, 5, 1e-5) == math.inf
    with pytest.raises(ValueError):
        dp_epsilon(1.0, 0.0, 5, 1e-5)


def test_dp_wrapper_clips_sums_unweighted_adds_noise_and_steps_the_inner_strategy() -> None:
    """z = 0: the noisy mean is the clipped sum over expected_clients, fed to FedAvgM's server step."""
    inner = FedAvgM(server_momentum=0.5, local_epochs=3)
    dp = DPFedAvg(inner, clip_norm=1.0, noise_multiplier=0.0, expected_clients=4.0, delta=1e-5)
    assert dp.name == "dp-fedavgm" and dp.configure_round(1, (1, 1)).local_epochs == 3
    dp.offer(Offer("d0", np.array([[3.0]], np.float32), np.array([4.0], np.float32), 100))  # → (0.6, 0.8)
    dp.offer(Offer("d1", np.array([[0.5]], np.float32), np.array([0.0], np.float32), 1))
    W1, b1, refusal = aggregate_checked(dp, np.zeros((1, 1), np.float32), np.zeros(1, np.float32))
    assert refusal is None
    np.testing.assert_allclose(W1, [[(0.6 + 0.5) / 4]], rtol=1e-6)
    np.testing.assert_allclose(b1, [0.8 / 4], rtol=1e-6)
    assert dp.clipped == {"d0": 1} and "v_W" in inner.server_state
    rep = dp.report()
    assert rep.clipped == 1 and rep.norm_bound == 1.0 and rep.epsilon == math.inf and rep.delta == 1e-5


def test_dp_wrapper_reports_the_accountants_epsilon_each_round() -> None:
    dp = DPFedAvg(
        make_strategy("fedavg", fraction=0.5), clip_norm=1.0, noise_multiplier=1.0, expected_clients=2.0,
        delta=1e-5, rng=np.random.default_rng(0),
    )
    eps = []
    for r in (1, 2):
        dp.configure_round(r, (2, 2))
        dp.offer(Offer("d0", np.ones((2, 2), np.float32), np.ones(2, np.float32), 1))
        dp.aggregate(np.zeros((2, 2), np.float32), np.zeros(2, np.float32))
        eps.append(dp.report().epsilon)
    assert eps[0] == pytest.approx(dp_epsilon(1.0, 0.5, 1, 1e-5))
    assert eps[1] == pytest.approx(dp_epsilon(1.0, 0.5, 2, 1e-5)) and eps[1] > eps[0]


def test_dp_wraps_only_the_fedavg_family() -> None:
    for name in ("median", "trimmed-mean", "fedbuff"):
        with pytest.raises(ValueError, match="DP wraps fedavg"):
            DPFedAvg(make_strategy(name), clip_norm=1.0, noise_multiplier=1.0, expected_clients=2.0)


def test_accountant_ledger_composes_runs_as_dp_accounting_does() -> None:
    """Runs of (z, q, rounds): one run is ``dp_epsilon``; two runs are their composition, computed
    here with dp_accounting's own events; a ledger merges equal consecutive rounds and restores."""
    import dp_accounting

    assert ledger_epsilon([(1.1, 1.0, 3)], 1e-5) == dp_epsilon(1.1, 1.0, 3, 1e-5)
    acc = dp_accounting.rdp.RdpAccountant()
    for z, n in ((1.1, 3), (1.5, 2)):
        acc.compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(z)), n
            )
        )
    assert ledger_epsilon([(1.1, 1.0, 3), (1.5, 1.0, 2)], 1e-5) == pytest.approx(acc.get_epsilon(1e-5))
    ledger = PrivacyLedger()
    for z in (1.1, 1.1, 1.1, 1.5, 1.5):
        ledger.add(z, 1.0)
    assert ledger.runs == [(1.1, 1.0, 3), (1.5, 1.0, 2)]  # 5 rounds: 3 at z = 1.1, then 2 at 1.5
    again = PrivacyLedger()
    again.restore(ledger.snapshot())
    assert again.runs == ledger.runs
    with pytest.raises(ValueError, match="privacy ledger entry"):
        again.restore([[1.0, 2.0, 1]])


def test_accountant_survives_coordinator_restarts(mosquitto: Broker, fleet: str, tmp_path: Path) -> None:
    """A DP coordinator on a real broker runs 2 rounds, is restarted from its state file (a new
    coordinator, transport and strategy) and runs 2 more, then restarted again with a larger noise
    multiplier for 1 more: epsilon after each round equals dp_accounting's for every round run so
    far (computed here from dp_accounting's events), and never goes down."""
    import dp_accounting

    bb = Backbone(INT8_MODEL)
    W0, b0 = bb.head_from_model()
    topics = Topics("edgefl", fleet)
    state = tmp_path / "state.rec"
    devices = ("dev-1", "dev-2")

    def update(dev: str, rnd: int, base: int) -> bytes:
        up = Update(rnd, base, dev, 10, np.full_like(W0, 0.001), np.zeros_like(b0),
                    UpdateMetrics(0.1, 0.9, 0.01, 1), f"{dev}:{rnd}:{base}")  # fmt: skip
        return encode_update(up)

    async def run(z: float, rounds: int, start: int) -> list[float]:
        t = MqttTransport(mosquitto.host, mosquitto.port, f"coord-{fleet}")
        dev = MqttTransport(mosquitto.host, mosquitto.port, f"dev-{fleet}")
        await t.start(wait_s=10)
        await dev.start(wait_s=10)
        inner = FedAvg(local_epochs=1, lr=0.05, batch_size=16, min_clients=2, deadline_s=30)
        dp = DPFedAvg(inner, clip_norm=1.0, noise_multiplier=z, expected_clients=2.0, delta=1e-5)
        coord = Coordinator(t, topics, W0, b0, model_sha256=bb.sha256, strategy=dp)
        resumed = coord.load_state(state)
        assert resumed == (start > 1)
        coord.state_path = state
        pump = asyncio.create_task(coord.pump())
        eps = []
        try:
            await coord.start(adopt_wait_s=0.5)
            for r in range(start, start + rounds):
                run_r = asyncio.create_task(coord.run_round(r, selected=devices))
                await wait_until(lambda r=r: coord.state.round == r, 10, f"round {r} open")  # type: ignore[misc]
                for d in devices:
                    await dev.publish(topics.update(d), update(d, r, coord.state.version), qos=1)
                rec = await run_r
                assert rec.clients == 2 and not rec.refused
                coord.save_state(state)  # as the runner does after every round
                eps.append(rec.epsilon)
        finally:
            pump.cancel()
            await dev.stop()
            await t.stop()
        return eps

    eps = asyncio.run(run(1.1, 2, 1)) + asyncio.run(run(1.1, 2, 3)) + asyncio.run(run(1.5, 1, 5))

    def truth(runs: list[tuple[float, int]]) -> float:
        acc = dp_accounting.rdp.RdpAccountant()
        for z, n in runs:
            event = dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(z))
            acc.compose(dp_accounting.SelfComposedDpEvent(event, n))
        return float(acc.get_epsilon(1e-5))

    want = [truth([(1.1, n)]) for n in (1, 2, 3, 4)] + [truth([(1.1, 4), (1.5, 1)])]
    assert eps == pytest.approx(want, rel=1e-9)
    assert all(b > a for a, b in itertools.pairwise(eps))
