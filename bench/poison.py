"""Poisoning benchmark: one of five devices sends a malicious update every round; final test accuracy.

Five simulated devices on the real digits data (embeddings of the shipped int8 CNN), non-IID shards
(``partition_non_iid`` with ``primary_share = 0.5``: half of each class on its two owners), 10 rounds.
Each device runs the device code path of ``bench/learning.py`` (``EmbeddingStore`` → ``train_local``
→ ``encode_update`` → ``decode_update``); the coordinator side is the service's: ``configure_round``,
``Strategy.offer`` (refusals counted), ``aggregate_checked`` (a head the agents would refuse is not
adopted). Device 0 replaces its decoded delta by:

* ``scale1000``: its real delta x 1000;  ``scale-10``: x -10;  ``signflip``: x -1;
* ``huge``: every value 3e38 (finite float32, near its maximum).

Run: ``.venv/bin/python -m bench.poison --json out/poison.json`` (prints a markdown table).
Writes ``{"clean": {STRATEGY: accuracy}, "attacks": [{"strategy", "attack", "final_accuracy"}]}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.learning import (
    STATE_ROOT,
    STRATEGY_KW,
    Task,
    client_update,
    deliver,
    digits_embeddings,
    make_devices,
)
from edgefl.coordinator.strategy import (
    DEFAULT_STRATEGY,
    STRATEGY_NAMES,
    Offer,
    aggregate_checked,
    make_strategy,
)
from edgefl.datasets import partition_non_iid, split_digits
from edgefl.errors import UpdateRejected
from edgefl.types import F32
from edgefl.wire.compression import Compression

N_DEVICES = 5
ROUNDS = 10
LR, LR_DECAY = 0.05, 0.8

ATTACKS: dict[str, Callable[[F32], F32]] = {
    "scale1000": lambda d: (d * np.float32(1000.0)).astype(np.float32),
    "scale-10": lambda d: (d * np.float32(-10.0)).astype(np.float32),
    "signflip": lambda d: (-d).astype(np.float32),
    "huge": lambda d: np.full_like(d, 3e38, dtype=np.float32),
}
"""Attack name → what device 0 sends instead of its real delta (W and b alike)."""

STRATEGY_SETTINGS: dict[str, dict[str, Any]] = {
    **STRATEGY_KW,
    "median": {},
    "trimmed-mean": {"trim_fraction": 0.2},
    "fedbuff": {"buffer_size": N_DEVICES},
}
"""Per-strategy settings (the learning benchmark's where it has them)."""


def poison_task(seed: int = 0, primary_share: float = 0.5) -> Task:
    """The digits task of this benchmark: 5 devices, ``partition_non_iid``, the model's factory head.

    Parameters
    ----------
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
    return Task(
        "digits", primary_share, seed, W, b,
        [emb[pool[p]] for p in parts], [y[pool[p]] for p in parts],
        emb[split.test], y[split.test],
        lr=LR, local_epochs=2, batch_size=16, rounds=ROUNDS,
    )  # fmt: skip


def run_poisoned(
    task: Task, strategy_name: str, attack: str | None, **overrides: Any
) -> tuple[float, Counter[str], int]:
    """Train ``task.rounds`` rounds with device 0 attacking (or no one, ``attack=None``).

    Parameters
    ----------
    task : Task
    strategy_name : str
        One of ``STRATEGY_NAMES`` (with ``STRATEGY_SETTINGS``; ``overrides`` on top).
    attack : str or None
        A key of ``ATTACKS``.

    Returns
    -------
    (final test accuracy, refusals by reason (offers and refused heads), updates clipped)
    """
    kw = {**STRATEGY_SETTINGS.get(strategy_name, {}), **overrides}
    strategy = make_strategy(
        strategy_name,
        local_epochs=task.local_epochs,
        lr=LR,
        batch_size=task.batch_size,
        min_clients=N_DEVICES,
        **kw,
    )
    W, b = task.W0.copy(), task.b0.copy()
    shape = (int(W.shape[0]), int(W.shape[1]))
    refused: Counter[str] = Counter()
    clipped = 0
    version = 0
    with tempfile.TemporaryDirectory(dir=STATE_ROOT) as tmp:
        devs = make_devices(task, Path(tmp))  # device cores: the shipped round (train, encode, outbox)
        for r in range(1, task.rounds + 1):
            cfg = strategy.configure_round(r, shape)
            rtask = replace(task, lr=LR * LR_DECAY ** (r - 1))
            for i, dev in enumerate(devs):
                upd, _, _ = client_update(rtask, dev, version, r, Compression.NONE, cfg.prox_mu)
                dW, db = upd.delta_W, upd.delta_b
                if attack is not None and i == 0:
                    dW, db = ATTACKS[attack](dW), ATTACKS[attack](db)
                try:
                    strategy.offer(Offer(dev.name, dW, db, upd.num_examples))
                except UpdateRejected as exc:
                    refused[exc.reason] += 1
            if strategy.accepted == 0:
                continue
            W, b, refusal = aggregate_checked(strategy, W, b)
            if refusal is not None:
                refused["head_" + refusal.reason] += 1
            else:
                version += 1
                deliver(task, devs, W, b, version, r)
            clipped += strategy.report().clipped
    return task.accuracy(W, b), refused, clipped


def run_all(seed: int = 0, strategies: tuple[str, ...] = STRATEGY_NAMES) -> dict[str, Any]:
    """Every strategy clean and under every attack; the JSON document of ``--json``."""
    task = poison_task(seed)
    clean: dict[str, float] = {}
    attacks: list[dict[str, Any]] = []
    for name in strategies:
        clean[name], _, clipped = run_poisoned(task, name, None)
        logging.info("%s clean %.3f (%d clipped)", name, clean[name], clipped)
        for attack in ATTACKS:
            acc, refused, clipped = run_poisoned(task, name, attack)
            attacks.append(
                {
                    "strategy": name,
                    "attack": attack,
                    "final_accuracy": acc,
                    "clipped": clipped,
                    "refused": dict(refused),
                }
            )
            logging.info("%s %s %.3f clipped %d refused %s", name, attack, acc, clipped, dict(refused))
    return {"clean": clean, "attacks": attacks, "default_strategy": DEFAULT_STRATEGY, "seed": seed}


def markdown(doc: dict[str, Any]) -> str:
    """The result as a markdown table: strategy x attack, final accuracy (difference to clean)."""
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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m bench.poison [--json PATH] [--seed N] [--strategy NAME ...]``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", action="append", choices=STRATEGY_NAMES, help="only these (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    doc = run_all(args.seed, tuple(args.strategy) if args.strategy else STRATEGY_NAMES)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
