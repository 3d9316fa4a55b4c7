"""Site and root aggregators: the Partial message, and the hierarchy's maths against a flat run.

The processes over real bridged brokers are in ``tests/test_bridge.py``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import cbor2
import numpy as np
import pytest
from conftest import ROOT

from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.privacy import DPFedAvg
from edgefl.coordinator.profile import load_coordinator_profile
from edgefl.coordinator.robust import coordinate_median, trimmed_mean
from edgefl.coordinator.strategies import make_strategy
from edgefl.coordinator.strategy import Offer, SiteSums, Strategy
from edgefl.errors import ConfigError, DecodeError, UpdateRejected
from edgefl.resources import shipped
from edgefl.topics import Topics
from edgefl.types import F32
from edgefl.wire.arrays import encode_array
from edgefl.wire.cbor import MessageType
from edgefl.wire.partial import Partial, decode_partial, encode_partial
from edgefl.wire.signing import generate_signing_key, sign_message, verify_payload

SHAPE = (12, 4)


def _updates(n: int, seed: int, scale: float = 0.1) -> list[Offer]:
    rng = np.random.default_rng(seed)
    return [
        Offer(
            f"dev-{i}",
            (rng.normal(0, scale, SHAPE)).astype(np.float32),
            (rng.normal(0, scale, SHAPE[1])).astype(np.float32),
            int(rng.integers(5, 60)),
        )
        for i in range(n)
    ]


def _partial(site: str, round_no: int, sums: SiteSums, ids: Sequence[str]) -> Partial:
    return Partial(
        round=round_no,
        base_version=round_no - 1,
        site=site,
        partial_id=f"{site}:{round_no}",
        combine=sums.combine,
        count=sums.count,
        weight=sums.weight,
        clipped=sums.clipped,
        update_ids=tuple(ids),
        W=sums.W,
        b=sums.b,
    )


def _run(
    make: Callable[[], Strategy], rounds: int, sites: int, seed: int = 3
) -> tuple[tuple[F32, F32], tuple[F32, F32]]:
    """The same updates, ``rounds`` rounds: one flat strategy, and ``sites`` site strategies + a root.

    Each site's share travels through ``encode_partial``/``decode_partial`` as on the wire.
    """
    W0 = np.zeros(SHAPE, np.float32)
    b0 = np.zeros(SHAPE[1], np.float32)
    flat, root = make(), make()
    site_strategies = [make() for _ in range(sites)]
    Wf, bf, Wr, br = W0, b0, W0, b0
    for r in range(1, rounds + 1):
        ups = _updates(11, seed + r)
        flat.configure_round(r, SHAPE)
        for u in ups:
            flat.offer(u)
        Wf, bf = flat.aggregate(Wf, bf)
        root.configure_round(r, SHAPE)
        for s, st in enumerate(site_strategies):
            st.configure_round(r, SHAPE)
            mine = ups[s::sites]
            for u in mine:
                st.offer(u)
            wire = encode_partial(_partial(f"site-{s}", r, st.site_sums(), [f"{u.device}:{r}" for u in mine]))
            p = decode_partial(wire, expect_shape=SHAPE)
            root.offer_sums(SiteSums(p.combine, p.W, p.b, p.weight, p.count, p.clipped))
        Wr, br = root.aggregate(Wr, br)
        assert root.accepted == flat.accepted == len(ups)
    return (Wf, bf), (Wr, br)


def _assert_equal_heads(flat: tuple[F32, F32], hier: tuple[F32, F32]) -> None:
    # float64 sums added in another order: the float32 result may differ by its last bit at most
    np.testing.assert_array_max_ulp(hier[0], flat[0], maxulp=1)
    np.testing.assert_array_max_ulp(hier[1], flat[1], maxulp=1)
    assert float(np.abs(flat[0]).max()) > 0.01  # the rounds moved the head


def _strategy(name: str, **extra: Any) -> Callable[[], Strategy]:
    # a fixed norm bound (0.5) that clips some updates: the bound is the site's, per update
    return lambda: make_strategy(name, clip_norm=0.5, **extra)


def test_hierarch_equals_flat_fedavg() -> None:
    _assert_equal_heads(*_run(_strategy("fedavg", server_lr=1.0), rounds=3, sites=3))


def test_hierarch_equals_flat_fedprox() -> None:
    _assert_equal_heads(*_run(_strategy("fedprox", prox_mu=0.1), rounds=3, sites=3))


def test_hierarch_equals_flat_fedavgm() -> None:
    _assert_equal_heads(*_run(_strategy("fedavgm", server_momentum=0.9), rounds=3, sites=3))


def test_hierarch_equals_flat_fedadam() -> None:
    _assert_equal_heads(*_run(_strategy("fedadam", server_lr=0.05), rounds=3, sites=2))


def test_hierarch_equals_flat_fedyogi() -> None:
    _assert_equal_heads(*_run(_strategy("fedyogi", server_lr=0.05), rounds=3, sites=4))


def test_hierarch_equals_flat_dp_fedavg() -> None:
    """DP: sites sum clipped updates, the root adds the noise once: same noise seed, same head."""

    def make() -> Strategy:
        return DPFedAvg(
            FedAvg(clip_norm=0.3),
            clip_norm=0.3,
            noise_multiplier=0.5,
            expected_clients=11,
            rng=np.random.default_rng(9),
        )

    _assert_equal_heads(*_run(make, rounds=2, sites=3))


def test_hierarch_median_of_site_medians_stays_within_site_range() -> None:
    """Median over sites is not the flat median; both lie between the smallest and largest site median."""
    ups = _updates(30, 11)
    sites = [ups[s::3] for s in range(3)]
    site_meds = [coordinate_median([u.delta_W for u in site]) for site in sites]
    hier = coordinate_median([m.astype(np.float64) for m in site_meds])  # the root weighs sites alike
    flat = coordinate_median([u.delta_W for u in ups])
    lo, hi = np.min(site_meds, axis=0), np.max(site_meds, axis=0)
    assert np.all(flat >= lo) and np.all(flat <= hi)
    assert np.all(hier >= lo) and np.all(hier <= hi)
    assert not np.array_equal(hier, flat)  # not equal, as docs/operations.md says
    assert float(np.abs(hier - flat).max()) <= float((hi - lo).max())


@pytest.mark.parametrize("name", ["median", "trimmed-mean"])
def test_hierarch_robust_rules_run_per_site(name: str) -> None:
    """Robust rules: each site exports its own estimate; the root combines them (not equal to flat)."""
    extra = {"trim_fraction": 0.2} if name == "trimmed-mean" else {}
    (Wf, _), (Wr, _) = _run(lambda: make_strategy(name, clip_norm=100.0, **extra), 1, 3)  # no clipping
    assert np.all(np.isfinite(Wr))
    ups = _updates(11, 4)
    if name == "trimmed-mean":
        per_site = [trimmed_mean([u.delta_W for u in ups[s::3]], 0.2) for s in range(3)]
    else:
        per_site = [coordinate_median([u.delta_W for u in ups[s::3]]) for s in range(3)]
    # the root's head stays within the site estimates' range (server_lr 1, start 0)
    assert np.all(Wr >= np.min(per_site, axis=0) - 1e-6) and np.all(Wr <= np.max(per_site, axis=0) + 1e-6)
    assert not np.array_equal(Wr, Wf)


def test_hierarch_root_refuses_a_partial_beyond_the_norm_bound() -> None:
    st = make_strategy("fedavg", clip_norm=0.5)
    st.configure_round(1, SHAPE)
    big = np.full(SHAPE, 1.0)
    with pytest.raises(UpdateRejected) as err:
        st.offer_sums(SiteSums("sum", big * 10, np.zeros(SHAPE[1]), 10.0, 1, 0))  # mean norm ~6.9
    assert err.value.reason == "bad_value"
    with pytest.raises(UpdateRejected) as err:
        st.offer_sums(SiteSums("median", big * 0.01, np.zeros(SHAPE[1]), 10.0, 1, 0))
    assert err.value.reason == "bad_value"  # a median share offered to FedAvg
    assert st.accepted == 0


def test_site_partial_roundtrip_and_signature_binds_the_site() -> None:
    rng = np.random.default_rng(0)
    p = Partial(
        round=4,
        base_version=3,
        site="site-a",
        partial_id="site-a:4",
        combine="sum",
        count=2,
        weight=35.0,
        clipped=1,
        update_ids=("dev-1:4:1", "dev-2:4:1"),
        W=rng.normal(size=SHAPE),
        b=rng.normal(size=SHAPE[1]),
    )
    q = decode_partial(encode_partial(p), expect_shape=SHAPE)
    assert q.W.dtype == np.float64 and np.array_equal(q.W, p.W) and np.array_equal(q.b, p.b)
    assert replace(q, W=p.W, b=p.b) == p
    key = generate_signing_key()
    fleet = "f1"
    signed = sign_message(encode_partial, p, key, fleet=fleet)
    verify_payload(signed, key.verify_key, fleet=fleet, kind=MessageType.PARTIAL, device="site-a")
    with pytest.raises(DecodeError) as err:  # replayed as another site's partial
        verify_payload(signed, key.verify_key, fleet=fleet, kind=MessageType.PARTIAL, device="site-b")
    assert err.value.reason == "bad_signature"
    assert decode_partial(signed, expect_shape=SHAPE).signature == signed[-64:]
    empty = replace(p, count=0, weight=0.0, clipped=0, update_ids=(), W=np.zeros(SHAPE), b=np.zeros(SHAPE[1]))
    assert decode_partial(encode_partial(empty), expect_shape=SHAPE).count == 0  # "this site had nothing"
    assert Topics("edgefl", fleet).partial("site-a") == "edgefl/f1/partial/site-a"
    assert Topics("edgefl", fleet).site_of("edgefl/f1/partial/site-a") == "site-a"
    assert Topics("edgefl", fleet).site_of("edgefl/f1/update/site-a") is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"combine": "mean"}, "bad_value"),
        ({"update_ids": ("a", "a")}, "bad_value"),
        ({"count": 3}, "bad_value"),
        ({"weight": 0.0}, "bad_value"),
        ({"count": 0, "update_ids": (), "weight": 0.0, "W": np.ones(SHAPE)}, "bad_value"),
        ({"count": 0, "update_ids": ()}, "bad_value"),
        ({"clipped": 5}, "bad_value"),
        ({"W": np.zeros((3, 4))}, "bad_shape"),
        ({"W": np.zeros(SHAPE, np.float32)}, "bad_dtype"),
        ({"b": np.array([np.nan, 0, 0, 0])}, "not_finite"),
        ({"site": "../x"}, "bad_value"),
    ],
)
def test_site_partial_malformed_is_refused(change: dict[str, Any], reason: str) -> None:
    zeros_W, zeros_b = np.zeros(SHAPE), np.zeros(SHAPE[1])
    p = Partial(4, 3, "site-a", "site-a:4", "sum", 2, 35.0, 0, ("u1", "u2"), zeros_W, zeros_b)
    p = replace(p, **change)
    if "W" in change and change["W"].dtype == np.float32:
        doc = cbor2.loads(encode_partial(replace(p, W=np.zeros(SHAPE))))
        doc["W"] = encode_array(np.zeros(SHAPE, np.float32))
        payload = cbor2.dumps(doc)
    else:
        payload = encode_partial(p)
    with pytest.raises(DecodeError) as err:
        decode_partial(payload, expect_shape=SHAPE)
    assert err.value.reason == reason


def test_site_profile_keys_are_validated_like_the_others() -> None:
    profile = shipped("firmware_configs/coordinator.toml")
    site = load_coordinator_profile(profile, {"hierarchy.role": "site", "hierarchy.site": "lyon"})
    assert (site.hierarchy.role, site.hierarchy.site, site.hierarchy.close_margin_s) == ("site", "lyon", 2.0)
    with pytest.raises(ConfigError) as err:
        load_coordinator_profile(
            profile,
            {"hierarchy.role": "site", "hierarchy.expected_sites": "-1", "hierarchy.close_margin_s": "-2"},
        )
    assert err.value.problems == [
        "hierarchy.site = None: required when hierarchy.role = 'site'",
        "hierarchy.expected_sites = -1: must be >= 0",
        "hierarchy.close_margin_s = -2.0: must be >= 0",
    ]
    with pytest.raises(ConfigError) as err:
        load_coordinator_profile(profile, {"hierarchy.role": "middle"})
    assert err.value.problems[0].startswith("hierarchy.role = 'middle'")


@pytest.mark.subprocess
def test_site_role_refuses_fedbuff_at_start() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "edgefl.cli", "coordinator", "--role", "site", "--site", "s1",
         "--strategy", "fedbuff"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 1
    assert "hierarchy.role = 'site': fedbuff runs flat only" in r.stderr
