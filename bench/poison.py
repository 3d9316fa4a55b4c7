"""Poisoning benchmark, as shipped: one device of five attacks every round, answering first.

The coordinator is the shipped one: its strategy is built from the shipped
``firmware_configs/coordinator.toml`` by ``edgefl coordinator``'s own ``build_strategy`` (only
``strategy.name`` changes between rows: every bound, ``min_clients``, ``robustness.tolerate``,
learning rate and decay, epochs and rounds are the profile's), and a round closes as the service
closes it: at the service's ``Round.close_at`` accepted updates (``ceil(quorum x asked)`` of the
devices asked, or the profile's ``min_clients``, never below the strategy's ``min_updates``),
aggregated by ``aggregate_checked`` (a round below the strategy's
minimum is abandoned as ``too_few``). Five devices run the device core (``bench/learning.py``:
``EmbeddingStore`` → ``train_local`` → ``encode_update`` → ``decode_update``) on non-IID digits shards
(the shipped int8 CNN's embeddings, ``partition_non_iid``, ``primary_share = 0.5``). Each round every
device trains; the attacker (device 0) answers first, the four honest devices then answer at their
own pace (a new random order each round), and the round takes updates until it closes: round sizes
are what the profile makes of them, never "every device every round". The attacker sends instead
of its real delta (W and b as one vector):

* ``scale1000``: its real delta x 1000;  ``scale-10``: x -10;  ``signflip``: x -1;
* ``huge``: every value 3e38 (finite float32, near its maximum);
* ``alie``: "a little is enough" (Baruch, Baruch, Goldberg, NeurIPS 2019): ``mu - z sigma`` of the
  round's benign updates (full knowledge: every device's real delta), ``z = Phi^-1((n - s) / n)``,
  ``s = floor(n / 2 + 1) - m`` for ``n = 5`` devices, ``m = 1`` attacker;
* ``minmax``: AGR-agnostic Min-Max (Shejwalkar & Houmansadr, NDSS 2021, §IV-B): ``mu + gamma p`` with
  ``p = -mu / ||mu||`` (inverse unit vector) and the largest ``gamma`` whose distance to every benign
  update is at most the largest distance between two benign updates (bisection).

Run: ``.venv/bin/python -m bench.poison --json out/poison.json`` (prints markdown tables);
``--seeds 0 1 2 3 4 5`` runs every seed (partition and order of answering) in turn.
Writes ``{"profile": "shipped", "clean": {STRATEGY: accuracy}, "attacks": [{"strategy", "attack",
"final_accuracy", "clipped", "refused", "min_clients_seen", "abandoned"}], "min_clients_seen",
"default_strategy", "seed"}`` for the first seed; ``min_clients_seen`` is the fewest updates any
aggregated round had. With ``--seeds``, also ``"seeds": [SEED, ...]``, ``"per_seed": [{"seed",
"clean", "attacks", "min_clients_seen"}]`` (each as the top level's) and ``"worst_loss": {STRATEGY:
{SEED: loss}}`` (the largest ``clean - final_accuracy`` over the attacks, negative when every
attack ended above the clean run).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from bench.learning import STATE_ROOT, Task, client_update, deliver, digits_embeddings, make_devices
from edgefl.coordinator.profile import CoordinatorProfile, StrategyConfig, load_coordinator_profile
from edgefl.coordinator.rounds import Round
from edgefl.coordinator.runner import build_strategy
from edgefl.coordinator.strategy import Offer, Strategy, aggregate_checked
from edgefl.datasets import partition_non_iid, split_digits
from edgefl.errors import UpdateRejected
from edgefl.resources import shipped
from edgefl.types import F32
from edgefl.wire.compression import Compression

N_DEVICES = 5
ATTACKER = 0
DEFAULT_STRATEGY = StrategyConfig().name
"""The strategy of ``edgefl coordinator`` when none is named (``[strategy]`` ``name``'s default)."""
STRATEGIES = ("median", "trimmed-mean", "fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi")
"""Rows of the table: the shipped default first, then the FedAvg family with their default bounds."""

Attack = Callable[[F32, Sequence[F32]], F32]
"""(the attacker's real delta, every device's real delta, flattened W+b) → what it sends."""


def alie(own: F32, benign: Sequence[F32], n: int = N_DEVICES, m: int = 1) -> F32:
    """"A little is enough": ``mu - z sigma`` per coordinate over the benign updates.

    Parameters
    ----------
    own : float32 [P]
        Unused (the attack needs only the benign statistics).
    benign : sequence of float32 [P]
        The round's real deltas (W and b flattened).
    n, m : int
        Devices in the round and attackers among them.

    Returns
    -------
    float32 [P]

    Source: Baruch, Baruch, Goldberg 2019, "A Little Is Enough: Circumventing Defenses For
    Distributed Learning" (NeurIPS), Algorithm 3 (``z_max`` from ``s = floor(n/2 + 1) - m``).
    """
    x = np.stack([b.astype(np.float64) for b in benign])
    s = math.floor(n / 2 + 1) - m
    z = NormalDist().inv_cdf((n - s) / n)
    out: F32 = (x.mean(axis=0) - z * x.std(axis=0)).astype(np.float32)
    return out


def minmax(own: F32, benign: Sequence[F32]) -> F32:
    """AGR-agnostic Min-Max: ``mu + gamma p``, ``p = -mu/||mu||``, the largest ``gamma`` that keeps
    the update within the benign updates' largest pairwise distance of every benign update.

    Parameters
    ----------
    own : float32 [P]
        Unused.
    benign : sequence of float32 [P]
        The round's real deltas.

    Returns
    -------
    float32 [P]

    Source: Shejwalkar & Houmansadr 2021, "Manipulating the Byzantine: Optimizing Model Poisoning
    Attacks and Defenses for Federated Learning" (NDSS), §IV-B, eq. (4), with their bisection on gamma.
    """
    x = np.stack([b.astype(np.float64) for b in benign])
    mu = x.mean(axis=0)
    p = -mu / max(float(np.linalg.norm(mu)), 1e-30)
    limit = max(float(np.linalg.norm(a - b)) for a in x for b in x)

    def fits(gamma: float) -> bool:
        return bool(max(np.linalg.norm(x - (mu + gamma * p), axis=1)) <= limit)

    lo, hi = 0.0, 1.0
    while fits(hi) and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    out: F32 = (mu + lo * p).astype(np.float32)
    return out


ATTACKS: dict[str, Attack] = {
    "scale1000": lambda d, _: (d * np.float32(1000.0)).astype(np.float32),
    "scale-10": lambda d, _: (d * np.float32(-10.0)).astype(np.float32),
    "signflip": lambda d, _: (-d).astype(np.float32),
    "huge": lambda d, _: np.full_like(d, 3e38, dtype=np.float32),
    "alie": alie,
    "minmax": minmax,
}
"""Attack name → what device 0 sends instead of its real delta."""


def shipped_profile(strategy: str, **overrides: object) -> CoordinatorProfile:
    """The shipped ``coordinator.toml`` with ``strategy.name = strategy`` (and ``overrides``)."""
    sets: dict[str, object] = {"strategy.name": strategy, **overrides}
    return load_coordinator_profile(shipped("firmware_configs/coordinator.toml"), sets, check_files=False)


def poison_task(profile: CoordinatorProfile, seed: int = 0, primary_share: float = 0.5) -> Task:
    """The digits task: 5 devices, ``partition_non_iid``, the model's factory head, the profile's rounds.

    Parameters
    ----------
    profile : CoordinatorProfile
        Its ``[rounds]`` give the rounds, learning rate, epochs and batch size.
    seed : int
        Partition and training seed.
    primary_share : float
        Share of each class on its two owner devices.

    Returns
    -------
    bench.learning.Task
    """
    emb, y, W, b = digits_embeddings()
    split = split_digits(y)
    pool = split.devices
    parts = partition_non_iid(y[pool], N_DEVICES, seed=seed, primary_share=primary_share)
    r = profile.rounds
    return Task(
        "digits", primary_share, seed, W, b,
        [emb[pool[p]] for p in parts], [y[pool[p]] for p in parts],
        emb[split.test], y[split.test],
        lr=r.lr, local_epochs=r.local_epochs, batch_size=r.batch_size, rounds=bench_rounds(profile),
    )  # fmt: skip


SERVICE_ROUNDS = 8
"""Rounds run for a profile whose ``rounds.count`` is 0 (a service runs until stopped)."""


def bench_rounds(profile: CoordinatorProfile) -> int:
    """The rounds a poisoning run takes: the profile's ``rounds.count``, or :data:`SERVICE_ROUNDS`."""
    return profile.rounds.count or SERVICE_ROUNDS


@dataclass
class PoisonRun:
    """One run's result."""

    accuracy: float
    refused: Counter[str] = field(default_factory=Counter)
    clipped: int = 0
    sizes: list[int] = field(default_factory=list)
    abandoned: int = 0


def run_poisoned(
    task: Task,
    profile: CoordinatorProfile,
    attack: str | None,
    seed: int = 0,
    *,
    make: Callable[[], Strategy] | None = None,
) -> PoisonRun:
    """Run the profile's rounds with device 0 attacking first (or no one, ``attack=None``).

    Parameters
    ----------
    task : Task
        From :func:`poison_task` of the same profile.
    profile : CoordinatorProfile
        The coordinator's profile (its strategy built by ``build_strategy``).
    attack : str or None
        A key of ``ATTACKS``.
    seed : int
        Seed of the honest devices' order of answering.
    make : callable or None
        Builds the strategy instead of the profile's (``bench/newclass.py``'s candidate rules).

    Returns
    -------
    PoisonRun: final test accuracy, refusals by reason (offers, and ``head_<reason>`` for heads),
    updates clipped, the size of every aggregated round, rounds abandoned (``too_few``).
    """
    strategy = make() if make is not None else build_strategy(profile)
    rounds = profile.rounds
    order = np.random.default_rng(seed + 17)
    W, b = task.W0.copy(), task.b0.copy()
    D, K = int(W.shape[0]), int(W.shape[1])
    out = PoisonRun(math.nan)
    version = 0
    with tempfile.TemporaryDirectory(dir=STATE_ROOT) as tmp:
        devs = make_devices(task, Path(tmp))  # device cores: the shipped round (train, encode, outbox)
        for r in range(1, bench_rounds(profile) + 1):
            cfg = strategy.configure_round(r, (D, K))
            rtask = replace(task, lr=rounds.lr * rounds.lr_decay ** (r - 1))
            real = [client_update(rtask, dev, version, r, Compression.NONE, cfg.prox_mu)[0] for dev in devs]
            flat = [np.concatenate([u.delta_W.ravel(), u.delta_b]) for u in real]
            sends = list(flat)
            if attack is not None:
                sends[ATTACKER] = ATTACKS[attack](flat[ATTACKER], flat)
            honest = [i for i in range(N_DEVICES) if i != ATTACKER]
            arrivals = ([ATTACKER] if attack is not None else []) + list(order.permutation(honest))
            if attack is None:
                arrivals = list(order.permutation(N_DEVICES))
            # the service's Round: closes at ceil(quorum x asked), at least the strategy's minimum
            close_at = Round(
                r, version, (D, K), cfg.deadline_s, cfg.min_clients, online=frozenset(d.name for d in devs),
                quorum=rounds.quorum, min_updates=strategy.min_updates,
            ).close_at  # fmt: skip
            for i in arrivals:
                if strategy.accepted >= close_at:
                    break  # the round closed: later answers are refused as round_closed
                dW, db = sends[i][: D * K].reshape(D, K), sends[i][D * K :]
                try:
                    strategy.offer(Offer(devs[i].name, dW, db, real[i].num_examples))
                except UpdateRejected as exc:
                    out.refused[exc.reason] += 1
            accepted = strategy.accepted
            W, b, refusal = aggregate_checked(strategy, W, b)
            if refusal is not None:
                out.refused["head_" + refusal.reason] += 1
                out.abandoned += refusal.reason == "too_few"
            else:
                out.sizes.append(accepted)
                version += 1
                out.clipped += strategy.report().clipped
            deliver(task, devs, W, b, version, r)
    out.accuracy = task.accuracy(W, b)
    return out


def run_all(seed: int = 0, strategies: Sequence[str] = STRATEGIES) -> dict[str, Any]:
    """Every strategy clean and under every attack, on the shipped profile; the JSON of ``--json``."""
    clean: dict[str, float] = {}
    attacks: list[dict[str, Any]] = []
    seen: list[int] = []
    for name in strategies:
        profile = shipped_profile(name)
        task = poison_task(profile, seed)
        base = run_poisoned(task, profile, None, seed)
        clean[name] = base.accuracy
        seen += base.sizes
        logging.info("%s clean %.3f (rounds of %s)", name, base.accuracy, base.sizes)
        for attack in ATTACKS:
            run = run_poisoned(task, profile, attack, seed)
            seen += run.sizes
            attacks.append(
                {
                    "strategy": name,
                    "attack": attack,
                    "final_accuracy": run.accuracy,
                    "clipped": run.clipped,
                    "refused": dict(run.refused),
                    "min_clients_seen": min(run.sizes, default=0),
                    "abandoned": run.abandoned,
                }
            )
            logging.info(
                "%s %s %.3f clipped %d refused %s sizes %s",
                name, attack, run.accuracy, run.clipped, dict(run.refused), run.sizes,
            )  # fmt: skip
    return {
        "profile": "shipped",
        "clean": clean,
        "attacks": attacks,
        "min_clients_seen": min(seen, default=0),
        "default_strategy": DEFAULT_STRATEGY,
        "seed": seed,
    }


def worst_loss(doc: dict[str, Any]) -> dict[str, float]:
    """Per strategy, the largest ``clean - final_accuracy`` over the attacks of one seed's result."""
    return {
        n: max(c - x["final_accuracy"] for x in doc["attacks"] if x["strategy"] == n)
        for n, c in doc["clean"].items()
    }


def run_seeds(seeds: Sequence[int], strategies: Sequence[str] = STRATEGIES) -> dict[str, Any]:
    """:func:`run_all` for every seed: the first seed's result at the top level, every seed's beside it."""
    if not seeds:
        raise ValueError("run_seeds: no seed")
    runs = [run_all(s, strategies) for s in seeds]
    doc = dict(runs[0])
    doc["seeds"] = list(seeds)
    doc["per_seed"] = [{k: r[k] for k in ("seed", "clean", "attacks", "min_clients_seen")} for r in runs]
    doc["worst_loss"] = {n: {str(r["seed"]): worst_loss(r)[n] for r in runs} for n in runs[0]["clean"]}
    doc["min_clients_seen"] = min(r["min_clients_seen"] for r in runs)
    return doc


def markdown(doc: dict[str, Any]) -> str:
    """The result as markdown: strategy x attack, final accuracy (difference to clean) of the first
    seed, and with several seeds the worst loss of every strategy on each."""
    names = list(doc["clean"])
    lines = ["| strategy | clean | " + " | ".join(ATTACKS) + " |", "|---|---:|" + "---:|" * len(ATTACKS)]
    for n in names:
        c = doc["clean"][n]
        cells = []
        for a in ATTACKS:
            acc = next(x["final_accuracy"] for x in doc["attacks"] if x["strategy"] == n and x["attack"] == a)
            cells.append(f"{acc:.3f} ({acc - c:+.3f})")
        star = " (default)" if n == doc["default_strategy"] else ""
        lines.append(f"| {n}{star} | {c:.3f} | " + " | ".join(cells) + " |")
    if len(doc.get("seeds", [])) > 1:
        seeds = [str(s) for s in doc["seeds"]]
        lines += [
            "",
            "| worst loss | " + " | ".join(f"seed {s}" for s in seeds) + " | worst | clean (mean) |",
        ]
        lines.append("|---|" + "---:|" * (len(seeds) + 2))
        for n in names:
            loss = doc["worst_loss"][n]
            clean = sum(r["clean"][n] for r in doc["per_seed"]) / len(doc["per_seed"])
            cells = [f"{loss[s]:.3f}" for s in seeds]
            lines.append(f"| {n} | " + " | ".join(cells) + f" | {max(loss.values()):.3f} | {clean:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m bench.poison [--json PATH] [--seed N | --seeds N ...] [--strategy S]``."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="several seeds (replaces --seed)")
    p.add_argument("--strategy", action="append", choices=STRATEGIES, help="only these (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("edgefl").setLevel(logging.WARNING)  # the device cores log every head applied
    strategies = tuple(args.strategy) if args.strategy else STRATEGIES
    doc = run_seeds(args.seeds, strategies) if args.seeds else run_all(args.seed, strategies)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
