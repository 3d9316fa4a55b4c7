"""Poisoning on six partitions: the shipped profile's goals hold on bench.poison's seeds 0-5.

One seed is one non-IID partition and one order of answering; a property that holds on two of them
and not on the others does not hold. These run the bench's own rounds (``bench/poison.py``), each
(strategy, seed, attack) once per worker (``tests/support/poison.py``: tests/test_poison.py's runs of
seed 0 and the JSON test's of seeds 0 and 1 are among them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.poison
from bench.poison import ATTACKS, DEFAULT_STRATEGY, main, poison_task, run_poisoned, shipped_profile
from tests.support import poison

pytestmark = [pytest.mark.timeout(600), pytest.mark.bench]  # make test runs them, make check does not
SEEDS = range(6)


def worst_loss(name: str, seed: int) -> tuple[float, str]:
    """The largest clean - attacked final accuracy over the attacks, and that attack."""
    clean = poison.run(name, seed, None).accuracy
    losses = {a: clean - poison.run(name, seed, a).accuracy for a in ATTACKS}
    attack = max(losses, key=lambda a: losses[a])
    return losses[attack], attack


@poison.group("median")
def test_poison_shipped_default_is_the_median_and_holds_003_on_six_seeds() -> None:
    assert DEFAULT_STRATEGY == "median"
    for seed in SEEDS:
        loss, attack = worst_loss(DEFAULT_STRATEGY, seed)
        assert loss <= 0.03, (seed, attack, loss)


FEDAVG_FAMILY = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi")


@pytest.mark.parametrize("name", [pytest.param(n, marks=poison.group(n)) for n in FEDAVG_FAMILY])
def test_poison_shipped_fedavg_family_holds_006_on_six_seeds(name: str) -> None:
    for seed in SEEDS:
        loss, attack = worst_loss(name, seed)
        assert loss <= 0.06, (name, seed, attack, loss)


@poison.group("median")
def test_poison_seeds_json_keeps_the_schema_and_adds_each_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--seeds 0 1``: the top level is seed 0's result as ``--seed 0`` writes it; ``per_seed`` holds
    both, ``worst_loss`` each seed's largest loss, ``min_clients_seen`` the fewest over both.

    Both commands take their runs from the worker's (``tests/support/poison.py``): what is compared is
    what each writes; that a run computed again gives the same result is checked on seed 0's clean run."""
    monkeypatch.setattr(bench.poison, "run_poisoned", poison.run_poisoned_once)
    out = tmp_path / "poison.json"
    assert main(["--seeds", "0", "1", "--strategy", "median", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    one = tmp_path / "one.json"
    assert main(["--seed", "0", "--strategy", "median", "--json", str(one)]) == 0
    first = json.loads(one.read_text())
    for key in ("profile", "clean", "attacks", "default_strategy", "seed"):
        assert doc[key] == first[key], key
    assert doc["profile"] == "shipped" and doc["seed"] == 0 and doc["seeds"] == [0, 1]
    assert [r["seed"] for r in doc["per_seed"]] == [0, 1]
    assert doc["per_seed"][0]["attacks"] == first["attacks"]
    for r in doc["per_seed"]:
        assert len(r["attacks"]) == len(ATTACKS) and r["min_clients_seen"] == 5
        want = max(r["clean"]["median"] - a["final_accuracy"] for a in r["attacks"])
        assert doc["worst_loss"]["median"][str(r["seed"])] == pytest.approx(want)
    assert doc["min_clients_seen"] == 5
    profile = shipped_profile("median")
    assert run_poisoned(poison_task(profile, 0), profile, None, 0).accuracy == first["clean"]["median"]
