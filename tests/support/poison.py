"""Test harness (never shipped): ``bench.poison``'s runs, each one computed once per test process.

A run (strategy, seed, attack) is deterministic: the same partition, device seeds and order of
answering give the same ``PoisonRun`` bit for bit. tests/test_poison.py, tests/test_poison_seeds.py
and ``--json``'s schema test assert different properties of the same runs (the default on seed 0,
every strategy on seeds 0-5, the JSON of seeds 0 and 1); their tests of one strategy share an
``xdist_group`` (:func:`group`) so that they run in one worker and each run is computed once there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from bench.learning import Task
from bench.poison import PoisonRun, poison_task, run_poisoned, shipped_profile
from edgefl.coordinator.profile import CoordinatorProfile
from edgefl.coordinator.strategy import Strategy


def group(strategy: str) -> pytest.MarkDecorator:
    """The ``xdist_group`` of every test that runs ``strategy``'s poisoning rounds."""
    return pytest.mark.xdist_group(f"poison-{strategy}")


@functools.cache
def task(strategy: str, seed: int) -> Task:
    """``poison_task(shipped_profile(strategy), seed)``, built once (callers must not modify it)."""
    return poison_task(shipped_profile(strategy), seed)


@functools.cache
def run(strategy: str, seed: int, attack: str | None) -> PoisonRun:
    """``run_poisoned`` on :func:`task` with the shipped profile of ``strategy``, computed once per process
    (callers must not modify the result)."""
    return run_poisoned(task(strategy, seed), shipped_profile(strategy), attack, seed)


def run_poisoned_once(
    task: Task,
    profile: CoordinatorProfile,
    attack: str | None,
    seed: int = 0,
    *,
    make: Callable[[], Strategy] | None = None,
) -> PoisonRun:
    """``bench.poison.run_poisoned`` for the bench's own calls (``run_all`` builds its task with
    ``poison_task(profile, seed)``): :func:`run` for a shipped profile's task of that seed, the real
    call for anything else."""
    name = profile.strategy.name
    if make is None and task.seed == seed and task.alpha == 0.5 and profile == shipped_profile(name):
        return run(name, seed, attack)
    return run_poisoned(task, profile, attack, seed, make=make)
