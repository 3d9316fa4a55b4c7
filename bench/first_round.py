"""First-round bench: central accuracy after each of the first rounds against the samples a device holds.

How much a fleet's first round needs (``rounds.min_new_samples``): the shipped coordinator's settings
(``firmware_configs/coordinator.toml``: median tolerating one hostile device, lr 0.05, 2 local epochs,
batch 16) on 3 devices fed digits live, each round opening once every device holds ``N`` more samples
(in the order a feed sends them: its shard, shuffled). In-process, with the device core the daemon
runs (as ``bench/learning.py``); the head starts from the model's factory head (classes 0-4 only,
0.4875 on the test split). Partitions: ``partition_non_iid`` (each device mostly its own classes, as
the tests and docs feed them) and IID; 3 seeds each.

Run: ``.venv/bin/python -m bench.first_round [--json PATH]`` (prints a markdown table).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.learning import (
    STATE_ROOT,
    Device,
    Task,
    _device_profile,
    client_update,
    deliver,
    digits_embeddings,
    model_sha256,
)
from edgefl.agent.core import DeviceCore
from edgefl.agent.governor import Governor
from edgefl.coordinator.strategies import make_strategy
from edgefl.coordinator.strategy import Offer, aggregate_checked
from edgefl.datasets import partition_non_iid, split_digits
from edgefl.head import Head
from edgefl.wire.compression import Compression

DEVICES = 3
ROUNDS = 6
SEEDS = (0, 1, 2)
PER_ROUND = (11, 32, 64, 100, 200)  # new samples per device before each round (11: 32 over 3 devices)


def run(per_round: int, partition: str, seed: int) -> list[float]:
    """Central accuracy (0..1) at the start and after each of :data:`ROUNDS` rounds.

    ``per_round``: new samples each device stores before each round; ``partition``: ``"non-iid"``
    (``partition_non_iid``) or ``"iid"``; ``seed``: partition, feed order and training.
    """
    emb, y, W0, b0 = digits_embeddings()
    split = split_digits(y)
    pool = split.devices
    rng = np.random.default_rng(seed)
    if partition == "iid":
        order = rng.permutation(len(pool))
        parts = [np.sort(p) for p in np.array_split(order, DEVICES)]
    else:
        parts = partition_non_iid(y[pool], DEVICES, seed=seed)
    shards = [rng.permutation(pool[p]) for p in parts]  # the order a feed sends them
    task = Task(
        "digits", 0.0, seed, W0, b0, [], [], emb[split.test], y[split.test], lr=0.05, local_epochs=2,
        batch_size=16, rounds=ROUNDS,
    )  # fmt: skip
    strategy = make_strategy(
        "median", local_epochs=2, lr=0.05, batch_size=16, min_clients=2, deadline_s=60.0, tolerate=1
    )
    W, b = W0.copy(), b0.copy()
    acc = [task.accuracy(W, b)]
    gov = Governor(4096 << 20, 0, 0)
    with tempfile.TemporaryDirectory(dir=STATE_ROOT) as tmp:
        cores = [
            DeviceCore(
                _device_profile(f"dev{i}", seed * 1000 + i, Path(tmp)),
                Head(W0, b0, 0),
                model_sha256(task),
                governor=gov,
                store_capacity=4096,
            )
            for i in range(DEVICES)
        ]

        devs = [Device(f"dev{i}", core, 0) for i, core in enumerate(cores)]
        for r in range(1, ROUNDS + 1):
            for dev, shard in zip(devs, shards, strict=True):
                new = shard[dev.n : dev.n + per_round]
                if len(new):
                    dev.core.store.add(emb[new].astype(np.float32), y[new].astype(np.int64))
                    dev.n += len(new)
            strategy.configure_round(r, (int(W.shape[0]), int(W.shape[1])))
            for dev in devs:
                upd, _, _ = client_update(task, dev, r - 1, r, Compression.NONE, 0.0)
                strategy.offer(Offer(upd.device, upd.delta_W, upd.delta_b, upd.num_examples))
            W, b, _ = aggregate_checked(strategy, W, b)
            W, b = W.astype(np.float32), b.astype(np.float32)
            deliver(task, devs, W, b, r, r)
            acc.append(task.accuracy(W, b))
    return acc


def main(argv: Sequence[str] | None = None) -> int:
    """Run every partition x samples-per-round setting over :data:`SEEDS`; print the table (mean (min))."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    results: dict[str, list[list[float]]] = {}
    print("| partition | new samples a device before each round | start | " + " | ".join(
        f"round {r}" for r in range(1, ROUNDS + 1)) + " |")  # fmt: skip
    print("|---|---|---|" + "---|" * ROUNDS)
    for partition in ("non-iid", "iid"):
        for n in PER_ROUND:
            runs = [run(n, partition, s) for s in SEEDS]
            results[f"{partition}/{n}"] = runs
            mean = np.mean(np.array(runs), axis=0)
            lo = np.min(np.array(runs), axis=0)
            cells = " | ".join(f"{m:.3f} ({low:.3f})" for m, low in zip(mean, lo, strict=True))
            print(f"| {partition} | {n} | {cells} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
