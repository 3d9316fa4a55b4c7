"""Learning benchmark: accuracy per round and uplink bytes of federated head training, in-process.

No MQTT: the devices are simulated in one process, but each is the device core the daemon runs
(``edgefl.agent.core.DeviceCore``): its samples' embeddings in its ``EmbeddingStore`` (float16), every
round's RoundAnnouncement given as bytes to ``receive_round`` (local epochs, error feedback on every
compressed update, encoding, the outbox and the answered-round record: the Update bytes are counted
exactly) and every new global head as GlobalModel bytes to ``receive_global`` (decode, validate,
apply, persist). The coordinator decodes every payload with ``decode_update`` and aggregates with the
``edgefl.coordinator`` strategies, so what is measured is what the service would do, minus the
network. Device state lives on ``/dev/shm`` where it exists (fsync latency is not measured here).

Datasets: digits (embeddings of the shipped int8 digits CNN, ``models/digits_cnn_int8.tflite``, the
head starting from the model's factory head) and Japanese Vowels (``bench/vowels.py``: numpy
random-projection backbone, head starting from zero). Dirichlet label skew alpha 0.1 and 1.0 over
8 devices, 3 seeds (partition and training), means reported.

Run: ``.venv/bin/python -m bench.learning`` (writes ``docs/learning_<dataset>.png`` and prints the
markdown tables; ``--json out/learning.json`` keeps every curve).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import logging
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2
import numpy as np

from bench.partition import dirichlet_partition
from bench.vowels import N_CLASSES as VOWEL_CLASSES
from bench.vowels import load_vowels
from edgefl.agent.config import Profile, load_profile
from edgefl.agent.core import ApplyStatus, DeviceCore
from edgefl.agent.feedback import ErrorFeedback
from edgefl.agent.governor import Governor
from edgefl.agent.round import RoundStatus
from edgefl.agent.trainer import fit_head
from edgefl.coordinator.fedbuff import FedBuff
from edgefl.coordinator.privacy import DPFedAvg
from edgefl.coordinator.strategies import make_strategy
from edgefl.coordinator.strategy import Offer, Strategy, aggregate_checked
from edgefl.datasets import load_digits, split_digits
from edgefl.head import Head
from edgefl.types import F32, I64
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import GlobalModel, HeadLayout, encode_global_model
from edgefl.wire.rounds import RoundAnnouncement, Update, decode_update, encode_round
from tests.support.models import run_backbone

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PROFILE = ROOT / "firmware_configs" / "dev_x86.toml"
STATE_ROOT = "/dev/shm" if Path("/dev/shm").is_dir() else None
N_DEVICES = 8
SEEDS = (0, 1, 2)
TOPK = 0.1
SLOW = 5.0  # slow devices' training time, in units of a fast device's


@dataclass
class Task:
    """One dataset under one partition: device data, test set, start head, client settings."""

    name: str
    alpha: float
    seed: int
    W0: F32
    b0: F32
    dev_emb: list[F32]
    dev_y: list[I64]
    test_emb: F32
    test_y: I64
    lr: float
    local_epochs: int
    batch_size: int
    rounds: int

    def accuracy(self, W: F32, b: F32) -> float:
        return float(np.mean(np.argmax(self.test_emb @ W + b, axis=1) == self.test_y))


_DIGITS_CACHE: dict[str, tuple[F32, I64, F32, F32]] = {}


def digits_embeddings() -> tuple[F32, I64, F32, F32]:
    """Embed all digits once with the int8 model (float model if the int8 one is missing)."""
    if "e" in _DIGITS_CACHE:
        return _DIGITS_CACHE["e"]
    from edgefl.runtime import Backbone

    path = ROOT / "models" / "digits_cnn_int8.tflite"
    if not path.exists():
        path = ROOT / "models" / "digits_cnn_float32.tflite"
    bb = Backbone(path)
    x, y = load_digits()
    # the shipped profiles' normalisation for digits: mean 0, std 16
    q = bb.quantize_input((x.astype(np.float32) / np.float32(16.0)).astype(np.float32))
    emb = np.concatenate([run_backbone(bb, q[i : i + bb.batch])[0] for i in range(0, len(q), bb.batch)])
    W, b = bb.head_from_model()
    _DIGITS_CACHE["e"] = (emb.astype(np.float32), y, W, b)
    logging.info("digits embedded with %s: %s", path.name, emb.shape)
    return _DIGITS_CACHE["e"]


def make_task(dataset: str, alpha: float, seed: int, rounds: int) -> Task:
    if dataset == "digits":
        emb, y, W, b = digits_embeddings()
        split = split_digits(y)  # fixed split: test and the device pool
        pool = split.devices
        parts = dirichlet_partition(y[pool], N_DEVICES, alpha, seed)
        return Task(
            "digits",
            alpha,
            seed,
            W,
            b,
            [emb[pool[p]] for p in parts],
            [y[pool[p]] for p in parts],
            emb[split.test],
            y[split.test],
            lr=0.01,
            local_epochs=2,
            batch_size=32,
            rounds=rounds,
        )
    v = load_vowels(dim=512)
    parts = dirichlet_partition(v.train_y, N_DEVICES, alpha, seed)
    D = v.train_emb.shape[1]
    return Task(
        "vowels",
        alpha,
        seed,
        np.zeros((D, VOWEL_CLASSES), np.float32),
        np.zeros(VOWEL_CLASSES, np.float32),
        [v.train_emb[p] for p in parts],
        [v.train_y[p] for p in parts],
        v.test_emb,
        v.test_y,
        lr=0.05,
        local_epochs=2,
        batch_size=16,
        rounds=rounds,
    )


@dataclass
class Device:
    """A simulated device: the device core (store, error-feedback residual, outbox, head) and its size."""

    name: str
    core: DeviceCore
    n: int


@dataclass
class Run:
    """One configuration's result on one task."""

    label: str
    acc: list[float] = field(default_factory=list)  # test accuracy after each round (index 0 = start)
    times: list[float] = field(default_factory=list)  # simulated wall time of each point
    uplink_bytes: int = 0
    delta_bytes: int = 0  # the CBOR "delta" map alone (W and b sub-maps), without the message envelope
    updates: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _device_profile(name: str, seed: int, root: Path) -> Profile:
    return load_profile(
        PROFILE,
        {
            "device.id": name,
            "device.fleet": "bench",
            "device.state_dir": str(root / name),
            "model.path": str(ROOT / "models" / "digits_cnn_int8.tflite"),  # not loaded: no pipeline
            "training.chunk_size": "256",
            "training.seed": str(seed),
            # Dirichlet 0.1 leaves some devices fewer than the shipped 32 examples: they train anyway
            "training.min_examples": "1",
            "memory.cap_mb": "4096",
            "memory.min_system_available_mb": "0",
        },
    )


def model_sha256(task: Task) -> str:
    """A stand-in backbone hash per dataset (the cores and the global heads must agree)."""
    return hashlib.sha256(f"bench-{task.name}".encode()).hexdigest()


def make_devices(task: Task, root: Path) -> list[Device]:
    """One device core per device, its store filled with the device's embeddings."""
    gov = Governor(4096 << 20, 0, 0)
    devs = []
    for i, (e, y) in enumerate(zip(task.dev_emb, task.dev_y, strict=True)):
        name = f"dev{i}"
        core = DeviceCore(
            _device_profile(name, task.seed * 100_000 + i * 1000, root),
            Head(task.W0, task.b0, 0),
            model_sha256(task),
            governor=gov,
            store_capacity=max(len(y), 1),
        )
        core.store.add(e.astype(np.float32), y.astype(np.int64))
        devs.append(Device(name, core, len(y)))
    return devs


def deliver(
    task: Task,
    devs: Sequence[Device],
    W: F32,
    b: F32,
    version: int,
    round_no: int,
    *,
    layout: HeadLayout = HeadLayout.FLOAT32,
) -> None:
    """Give the devices a new global head as GlobalModel bytes (``receive_global``), in ``layout``."""
    payload = encode_global_model(
        GlobalModel(
            round_no, version, model_sha256(task), W.astype(np.float32), b.astype(np.float32), layout=layout
        )
    )
    for dev in devs:
        res = dev.core.receive_global(payload)
        if res.status == ApplyStatus.REFUSED:
            raise RuntimeError(
                f"{dev.name}: global head version {version} refused: {res.reason} {res.detail}"
            )


def client_update(
    task: Task,
    dev: Device,
    version: int,
    round_no: int,
    compression: Compression,
    prox_mu: float,
    *,
    feedback: bool = True,
) -> tuple[Update, int, int]:
    """The device answers a round (train, error feedback, encode, outbox); the coordinator decodes it.

    ``feedback=False`` is an ablation off the shipped path: the device's residual is discarded before
    the round, so nothing dropped earlier is sent later.

    Returns (decoded update, message bytes, bytes of the delta map alone).
    """
    if not feedback:
        fb = dev.core.feedback
        dev.core.feedback = ErrorFeedback(fb.shape, fb.model_sha256)
    ann = RoundAnnouncement(
        round=round_no,
        base_version=version,
        deadline_s=3600.0,
        local_epochs=task.local_epochs,
        lr=task.lr,
        batch_size=task.batch_size,
        min_clients=1,
        selected=1.0,
        compression=compression,
        topk_fraction=TOPK,
        prox_mu=prox_mu,
    )
    res = dev.core.receive_round(encode_round(ann))
    if res.status != RoundStatus.TRAINED or res.entry is None:
        raise RuntimeError(f"{dev.name} round {round_no}: {res.status} {res.reason} {res.detail}")
    payload = res.entry.payload
    dev.core.acknowledged(res.entry.update_id)  # as after its PUBACK
    delta_bytes = len(cbor2.dumps(cbor2.loads(payload)["delta"]))
    decoded = decode_update(payload, expect_shape=(int(task.W0.shape[0]), int(task.W0.shape[1])))
    return decoded, len(payload), delta_bytes


def device_times(seed: int, slow: Sequence[int]) -> Callable[[int], float]:
    """Training time of device i (one fast round = 1.0), with 10 % log-normal jitter per run."""
    rng = np.random.default_rng(1000 + seed)

    def t(i: int) -> float:
        return (SLOW if i in slow else 1.0) * float(np.exp(rng.normal(0.0, 0.1)))

    return t


def run_sync(
    task: Task,
    strategy: Strategy,
    compression: Compression = Compression.NONE,
    *,
    feedback: bool = True,
    label: str = "",
    slow: Sequence[int] = (),
    dp: tuple[float, float] | None = None,
    downlink: HeadLayout = HeadLayout.FLOAT32,
) -> Run:
    """Synchronous rounds, every device every round; ``dp = (clip_norm, noise_multiplier)`` for central DP.

    ``downlink``: the devices receive each global head in that layout (their cores decode it, as the
    agents do), the coordinator keeps its float32 head, as ``Coordinator.publish_global`` does; the
    accuracy is the coordinator's head's.
    """
    run = Run(label or strategy.name)
    W, b = task.W0.copy(), task.b0.copy()
    run.acc.append(task.accuracy(W, b))
    run.times.append(0.0)
    clock = device_times(task.seed, slow)
    now = 0.0
    if dp is not None:
        strategy = DPFedAvg(
            strategy,
            clip_norm=dp[0],
            noise_multiplier=dp[1],
            expected_clients=float(len(task.dev_y)),
            delta=1e-3,
            rng=np.random.default_rng(7 + task.seed),
        )
    clipped = 0
    with tempfile.TemporaryDirectory(dir=STATE_ROOT) as tmp:
        devs = make_devices(task, Path(tmp))
        for r in range(1, task.rounds + 1):
            cfg = strategy.configure_round(r, (int(W.shape[0]), int(W.shape[1])))
            for dev in devs:
                upd, nbytes, dbytes = client_update(
                    task, dev, r - 1, r, compression, cfg.prox_mu, feedback=feedback
                )
                run.uplink_bytes += nbytes
                run.delta_bytes += dbytes
                run.updates += 1
                strategy.offer(Offer(upd.device, upd.delta_W, upd.delta_b, upd.num_examples))
            W, b, _ = aggregate_checked(strategy, W, b)
            W, b = W.astype(np.float32), b.astype(np.float32)
            clipped += strategy.report().clipped
            deliver(task, devs, W, b, r, r, layout=downlink)
            now += max(clock(i) for i in range(len(devs)))
            run.acc.append(task.accuracy(W, b))
            run.times.append(now)
    run.extra["clipped_fraction"] = clipped / max(run.updates, 1)
    if dp is not None:
        run.extra["epsilon"] = strategy.report().epsilon
    return run


def run_fedbuff(task: Task, *, buffer_size: int, server_lr: float, slow: Sequence[int], until: float) -> Run:
    """FedBuff: devices train continuously from the newest global; a step per ``buffer_size`` updates."""
    run = Run(f"fedbuff K={buffer_size}")
    W, b = task.W0.copy(), task.b0.copy()
    version = 0
    run.acc.append(task.accuracy(W, b))
    run.times.append(0.0)
    clock = device_times(task.seed, slow)
    shape = (int(W.shape[0]), int(W.shape[1]))
    strategy = FedBuff(buffer_size=buffer_size, server_lr=server_lr, max_staleness=50)
    strategy.configure_round(1, shape)
    stale: list[int] = []
    with tempfile.TemporaryDirectory(dir=STATE_ROOT) as tmp:
        devs = make_devices(task, Path(tmp))
        # event queue: (finish time, device index, base version, job number); a device is given the
        # newest global head when it starts a job and answers a fresh round (the job's number) at its end
        events: list[tuple[float, int, int, int]] = []
        job = 0
        for i in range(len(devs)):
            heapq.heappush(events, (clock(i), i, version, job))
            job += 1
        while events:
            t, i, base_v, j = heapq.heappop(events)
            if t > until:
                break
            upd, nbytes, dbytes = client_update(task, devs[i], base_v, j + 1, Compression.NONE, 0.0)
            run.uplink_bytes += nbytes
            run.delta_bytes += dbytes
            run.updates += 1
            stale.append(version - base_v)
            strategy.offer(Offer(upd.device, upd.delta_W, upd.delta_b, upd.num_examples, version - base_v))
            if strategy.accepted >= buffer_size:
                W, b, _ = aggregate_checked(strategy, W, b)
                W, b = W.astype(np.float32), b.astype(np.float32)
                version += 1
                strategy.configure_round(version + 1, shape)
                run.acc.append(task.accuracy(W, b))
                run.times.append(t)
            deliver(task, devs[i : i + 1], W, b, version, job)
            heapq.heappush(events, (t + clock(i), i, version, job))
            job += 1
    run.extra["mean_staleness"] = float(np.mean(stale)) if stale else 0.0
    run.extra["server_steps"] = version
    return run


def central_and_local(task: Task) -> tuple[float, float]:
    """Upper bound (one head on all device data) and lower bound (each device alone, mean test accuracy)."""
    epochs = task.rounds * task.local_epochs
    emb = np.concatenate(task.dev_emb)
    y = np.concatenate(task.dev_y)
    W, b = fit_head(
        task.W0, task.b0, emb, y, epochs=epochs, lr=task.lr, batch_size=task.batch_size, seed=task.seed
    )
    central = task.accuracy(W, b)
    local = []
    for e, yy in zip(task.dev_emb, task.dev_y, strict=True):
        Wl, bl = fit_head(
            task.W0, task.b0, e, yy, epochs=epochs, lr=task.lr, batch_size=task.batch_size, seed=task.seed
        )
        local.append(task.accuracy(Wl, bl))
    return central, float(np.mean(local))


STRATEGY_KW: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"prox_mu": 1.0},
    "fedavgm": {"server_momentum": 0.9, "server_lr": 0.3},
    "fedadam": {"server_lr": 0.03, "tau": 1e-2},
    "fedyogi": {"server_lr": 0.03, "tau": 1e-2},
}
COMPRESSIONS: list[tuple[str, Compression, bool]] = [
    ("float32", Compression.NONE, False),
    ("float16", Compression.FLOAT16, True),
    ("int8", Compression.INT8, True),
    ("topk10%+int8 +EF", Compression.TOPK_INT8, True),
    ("topk10%+int8 no EF", Compression.TOPK_INT8, False),
]


def run_setting(
    dataset: str, alpha: float, seed: int, rounds: int, dp: tuple[float, float] | None
) -> dict[str, Any]:
    task = make_task(dataset, alpha, seed, rounds)
    out: dict[str, Any] = {}
    for name, kw in STRATEGY_KW.items():
        out[name] = run_sync(task, make_strategy(name, **kw), label=name)
    for label, comp, fb in COMPRESSIONS[1:]:
        out[label] = run_sync(task, make_strategy("fedavg"), comp, feedback=fb, label=label)
    out["float32"] = out["fedavg"]
    slow = (0, 1)
    sync_slow = run_sync(task, make_strategy("fedavg"), label="sync (2 slow)", slow=slow)
    out["sync (2 slow)"] = sync_slow
    out["fedbuff"] = run_fedbuff(task, buffer_size=3, server_lr=1.0, slow=slow, until=sync_slow.times[-1])
    if dp is not None:
        out["fedavg+DP"] = run_sync(task, make_strategy("fedavg"), label="fedavg+DP", dp=dp)
    central, local = central_and_local(task)
    out["central"], out["local"] = central, local
    return out


DOWNLINKS: list[tuple[str, Compression, bool, HeadLayout]] = [
    ("float32 both ways", Compression.NONE, False, HeadLayout.FLOAT32),
    ("float32 up, float16 down", Compression.NONE, False, HeadLayout.FLOAT16),
    ("float32 up, int8 down", Compression.NONE, False, HeadLayout.INT8),
    ("int8 both ways", Compression.INT8, False, HeadLayout.INT8),
    ("topk10%+int8 +EF up, int8 down", Compression.TOPK_INT8, True, HeadLayout.INT8),
]


def run_downlinks(datasets: Sequence[str], alphas: Sequence[float], seeds: int, rounds: int) -> str:
    """Final accuracy (mean over seeds) of FedAvg with each downlink layout: a markdown table."""
    lines = [
        "| dataset | alpha | " + " | ".join(label for label, *_ in DOWNLINKS) + " |",
        "|---|---|" + "---|" * len(DOWNLINKS),
    ]
    for dataset in datasets:
        for alpha in alphas:
            finals: dict[str, list[float]] = {label: [] for label, *_ in DOWNLINKS}
            for seed in range(seeds):
                task = make_task(dataset, alpha, seed, rounds)
                for label, comp, fb, down in DOWNLINKS:
                    run = run_sync(
                        task, make_strategy("fedavg"), comp, feedback=fb, label=label, downlink=down
                    )
                    finals[label].append(run.acc[-1])
            base = float(np.mean(finals[DOWNLINKS[0][0]]))
            cells = [f"{base:.3f}"] + [
                f"{np.mean(finals[label]):.3f} ({np.mean(finals[label]) - base:+.3f})"
                for label, *_ in DOWNLINKS[1:]
            ]
            lines.append(f"| {dataset} | {alpha} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rounds_to(acc: Sequence[float], target: float) -> float:
    for r, a in enumerate(acc):
        if a >= target:
            return float(r)
    return math.nan


def time_to(times: Sequence[float], acc: Sequence[float], target: float) -> float:
    for t, a in zip(times, acc, strict=True):
        if a >= target - 1e-12:
            return t
    return math.nan


def summarise(results: dict[tuple[str, float], list[dict[str, Any]]]) -> dict[str, Any]:
    """Means over seeds of final accuracy, bytes, rounds-to-target, time-to-target."""
    summary: dict[str, Any] = {}
    for (dataset, alpha), seeds in results.items():
        key = f"{dataset} a={alpha}"
        central = float(np.mean([s["central"] for s in seeds]))
        local = float(np.mean([s["local"] for s in seeds]))
        target = float(np.mean([s["fedavg"].acc[-1] for s in seeds]))
        rows: dict[str, Any] = {}
        labels = [k for k, v in seeds[0].items() if isinstance(v, Run)]
        for label in labels:
            runs: list[Run] = [s[label] for s in seeds]
            final = float(np.mean([r.acc[-1] for r in runs]))
            # per seed: rounds to reach that seed's FedAvg final accuracy
            rtt = [rounds_to(r.acc, s["fedavg"].acc[-1]) for r, s in zip(runs, seeds, strict=True)]
            rows[label] = {
                "final_acc": final,
                "final_acc_sd": float(np.std([r.acc[-1] for r in runs])),
                "uplink_bytes": float(np.mean([r.uplink_bytes for r in runs])),
                "bytes_per_update": float(np.mean([r.uplink_bytes / r.updates for r in runs])),
                "delta_bytes_per_update": float(np.mean([r.delta_bytes / r.updates for r in runs])),
                "rounds_to_target": float(np.mean(rtt)) if not any(math.isnan(x) for x in rtt) else math.nan,
                "reached": sum(not math.isnan(x) for x in rtt),
                "extra": {k: float(np.mean([r.extra[k] for r in runs])) for k in runs[0].extra},
            }
        # FedBuff vs synchronous (2 slow): time for FedBuff to reach the synchronous final accuracy
        tt = []
        for s in seeds:
            sync: Run = s["sync (2 slow)"]
            fb: Run = s["fedbuff"]
            tt.append(
                (
                    sync.times[-1],
                    time_to(fb.times, fb.acc, sync.acc[-1]),
                    time_to(sync.times, sync.acc, sync.acc[-1]),
                )
            )
        summary[key] = {
            "central": central,
            "local": local,
            "target": target,
            "rows": rows,
            "fedbuff_time": tt,
        }
    return summary


def mean_curve(runs: Sequence[Run]) -> tuple[np.ndarray, np.ndarray]:
    n = min(len(r.acc) for r in runs)
    return np.mean([r.times[:n] for r in runs], axis=0), np.mean([r.acc[:n] for r in runs], axis=0)


def plot(dataset: str, results: dict[tuple[str, float], list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = sorted(a for d, a in results if d == dataset)
    fig, axes = plt.subplots(len(alphas), 3, figsize=(16, 4.2 * len(alphas)), squeeze=False)
    for row, alpha in enumerate(alphas):
        seeds = results[(dataset, alpha)]
        central = float(np.mean([s["central"] for s in seeds]))
        local = float(np.mean([s["local"] for s in seeds]))
        ax = axes[row][0]
        for name in STRATEGY_KW:
            _, acc = mean_curve([s[name] for s in seeds])
            ax.plot(acc, label=name)
        ax.set_title(f"{dataset}, alpha={alpha}: strategies (float32 updates)")
        ax2 = axes[row][1]
        for label, _, _ in COMPRESSIONS:
            _, acc = mean_curve([s[label] for s in seeds])
            ax2.plot(acc, label=label)
        if "fedavg+DP" in seeds[0]:
            _, acc = mean_curve([s["fedavg+DP"] for s in seeds])
            ax2.plot(acc, label="fedavg + central DP", linestyle=":")
        ax2.set_title(f"{dataset}, alpha={alpha}: FedAvg update compression")
        for a in (ax, ax2):
            a.axhline(central, color="k", linestyle="--", linewidth=0.8, label="centralised")
            a.axhline(local, color="grey", linestyle=":", linewidth=0.8, label="local only")
            a.set_xlabel("round")
            a.set_ylabel("test accuracy")
            a.legend(fontsize=7, loc="lower right")
            a.grid(alpha=0.3)
        ax3 = axes[row][2]
        for label in ("sync (2 slow)", "fedbuff"):
            for k, s in enumerate(seeds):
                r: Run = s[label]
                ax3.step(
                    r.times,
                    r.acc,
                    where="post",
                    color="C0" if label != "fedbuff" else "C3",
                    alpha=0.8,
                    linewidth=1,
                    label=(label if label != "fedbuff" else "FedBuff K=3") if k == 0 else None,
                )
        ax3.set_title(f"{dataset}, alpha={alpha}: sync FedAvg vs FedBuff, 2 of 8 devices 5x slower")
        ax3.set_xlabel("simulated time (fast device's local training = 1)")
        ax3.set_ylabel("test accuracy")
        ax3.legend(fontsize=7, loc="lower right")
        ax3.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown(summary: dict[str, Any]) -> str:
    lines = []
    for key, s in summary.items():
        lines.append(
            f"\n#### {key}: centralised {100 * s['central']:.1f} %, local-only {100 * s['local']:.1f} %, "
            f"FedAvg final {100 * s['target']:.2f} %\n"
        )
        lines.append(
            "| configuration | final acc % (sd over seeds) | bytes / update (message) | x float32 "
            "| delta bytes / update | x float32 | total uplink kB | rounds to FedAvg's final acc |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        tt = s["fedbuff_time"]
        base = s["rows"]["float32"]["bytes_per_update"]
        dbase = s["rows"]["float32"]["delta_bytes_per_update"]
        for label, row in s["rows"].items():
            if label in ("float32", "sync (2 slow)"):
                continue
            rtt = "-" if math.isnan(row["rounds_to_target"]) else f"{row['rounds_to_target']:.1f}"
            if label == "fedbuff":  # its steps are not rounds: see the time line below
                rtt = "n/a"
            extra = ""
            if "epsilon" in row["extra"]:
                extra = f" (epsilon {row['extra']['epsilon']:.0f} at delta 1e-3)"
            lines.append(
                f"| {label}{extra} | {100 * row['final_acc']:.2f} ({100 * row['final_acc_sd']:.2f}) "
                f"| {row['bytes_per_update']:.0f} | {row['bytes_per_update'] / base:.3f} "
                f"| {row['delta_bytes_per_update']:.0f} | {row['delta_bytes_per_update'] / dbase:.3f} "
                f"| {row['uplink_bytes'] / 1e3:.0f} | {rtt} ({row['reached']}/{len(tt)}) |"
            )
        tt = s["fedbuff_time"]
        parts = [f"sync {a:.0f} / FedBuff {'never' if math.isnan(b) else f'{b:.0f}'}" for a, b, _ in tt]
        lines.append(f"\nTime to the synchronous run's final accuracy (per seed): {'; '.join(parts)}.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--datasets", default="digits,vowels")
    p.add_argument("--alphas", default="0.1,1.0")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--seeds", type=int, default=len(SEEDS))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, help="re-render tables and plots of a --json run")
    p.add_argument(
        "--dp", default="0.5,0.5", help="clip_norm,noise_multiplier of the central-DP run ('' = none)"
    )
    p.add_argument(
        "--downlinks",
        action="store_true",
        help="only compare the global head's downlink layouts (final accuracy)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("edgefl").setLevel(logging.WARNING)  # the cores' per-round lines
    if args.downlinks:
        alphas = [float(a) for a in args.alphas.split(",")]
        print(run_downlinks(args.datasets.split(","), alphas, args.seeds, args.rounds))
        return
    dp = tuple(float(x) for x in args.dp.split(",")) if args.dp else None
    results: dict[tuple[str, float], list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    if args.from_json is not None:
        for key, seeds in json.loads(args.from_json.read_text())["curves"].items():
            d, a = key.split(" a=")
            results[(d, float(a))] = [
                {k: (Run(**v) if isinstance(v, dict) else v) for k, v in s.items()} for s in seeds
            ]
    for dataset in args.datasets.split(",") if args.from_json is None else []:
        for alpha in (float(a) for a in args.alphas.split(",")):
            results[(dataset, alpha)] = [
                run_setting(dataset, alpha, seed, args.rounds, dp if dp is None else (dp[0], dp[1]))
                for seed in range(args.seeds)
            ]
            logging.info("%s alpha=%s done (%.0f s)", dataset, alpha, time.perf_counter() - t0)
    summary = summarise(results)
    print(markdown(summary))
    if args.json is not None and args.from_json is None:  # before the plots: a long run is never lost
        args.json.parent.mkdir(parents=True, exist_ok=True)
        curves = {
            f"{d} a={a}": [
                {k: (v.__dict__ if isinstance(v, Run) else v) for k, v in s.items()} for s in seeds
            ]
            for (d, a), seeds in results.items()
        }
        args.json.write_text(json.dumps({"summary": summary, "curves": curves}, default=float, indent=1))
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            logging.warning("matplotlib not installed: no plots (re-render later with --from-json)")
            return
        for dataset in args.datasets.split(","):
            plot(dataset, results, DOCS / f"learning_{dataset}.png")


if __name__ == "__main__":
    main()
