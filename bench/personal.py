"""Personal heads on natural-client data: local-only, FedAvg and the device's personal head, per device.

Each device is the shipped device core (:class:`edgefl.agent.core.DeviceCore`, opened from a profile
with the set's LiteRT backbone ``models/natural/natural_*_float32.tflite``): its training samples go through
``observe`` (LiteRT embedding, store and holdout), every round's announcement through
``receive_round`` (local training, encoding, outbox) and every global head through
``receive_global``; the personal step is ``DeviceCore.personalise``. The coordinator's side is the
shipped FedAvg strategy (``edgefl.coordinator.fedavg``) over the decoded updates. Two runs per
setting on the same seed: personal heads off (FedAvg: what every device predicts with is the
global head) and on (what serves the device's predictions: its personal head, or the global head
while the personal one is behind on the holdout). Their Update bytes are compared round by round.
Local-only: a head trained on the device's stored samples alone (``fit_head``, as many epochs as
the federated runs' rounds x local epochs), from the backbone's factory head.

Accuracy is per device on its own test samples (never stored); ``worst_decile`` is the mean of the
worst tenth of devices (at least one); each setting's figures are the averages over ``--seeds`` runs
(3: training shuffles and, for ``half``, the classes kept). ``extra_bytes_per_round`` compares every
Update of the two runs, byte for byte but for its training time and peak RSS (the figures two runs
never share); ``extra_ram_bytes_per_device`` is the personal head a device keeps plus the gradient its
step allocates (the class mask and the loss's logit scale add 5K bytes); ``personal_pass_ratio`` is
the personal steps' time over the local training's, summed over every device and round: a step
taken with the round's training (the default) costs what that training takes more with personal
heads on than off (the same rounds, seed and data), a step of its own its own time.

Settings: HAPT split by session (train on the first, test on the second) and by bout (a user's
bouts of each activity alternate between train and test), all labels and half of the classes
labelled per device (the device's test covers every class); the Deterding vowels (a speaker's first
four repetitions train, the last two test), all and half labelled; the Japanese vowels (listeners,
every third utterance tests).

Run: ``.venv/bin/python -m bench.personal --json out/personal.json`` (``--only hapt:session:all``,
``--only vowels-deterding``: those settings alone; ``--set personal.KEY=VALUE``: other defaults).

Source: Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021; Li and Zhan, "FedRS: Federated Learning with Restricted Softmax for
Label Distribution Non-IID Data", KDD 2021; McMahan et al. 2017 (FedAvg).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.natural_clients import NaturalSet, load_natural
from edgefl.agent.config import Profile, load_profile
from edgefl.agent.core import ApplyStatus, DeviceCore
from edgefl.agent.governor import Governor
from edgefl.agent.round import RoundStatus
from edgefl.agent.trainer import fit_head
from edgefl.coordinator.fedavg import FedAvg
from edgefl.coordinator.strategy import Offer, aggregate_checked
from edgefl.types import F32, I64
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import GlobalModel, encode_global_model
from edgefl.wire.rounds import RoundAnnouncement, decode_update, encode_round, encode_update

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "firmware_configs" / "dev_x86.toml"
STATE_ROOT = "/dev/shm" if Path("/dev/shm").is_dir() else None
SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("hapt", "session", "all"),
    ("hapt", "session", "half"),
    ("hapt", "bout", "all"),
    ("vowels-deterding", "speaker", "all"),
    ("vowels-deterding", "speaker", "half"),
    ("vowels-japanese", "speaker", "all"),
)
ROUNDS = 20
LOCAL_EPOCHS = 2
LR = 0.05
BATCH = 16
HOLDOUT_EVERY = 5
"""Every 5th stored sample is held out (the profile's default is 20): the devices hold 35-90
training samples, and the fallback needs a holdout of more than one or two."""

logger = logging.getLogger(__name__)


def model_path(name: str) -> Path:
    """The set's backbone (``tools/build_models.py --only natural``)."""
    return ROOT / "models" / "natural" / f"natural_{name.replace('-', '_')}_float32.tflite"


@dataclass
class DeviceData:
    """One device's samples: raw features [n, F] float32 and labels int64 [n], train and test."""

    x_train: F32
    y_train: I64
    x_test: F32
    y_test: I64


def split(ds: NaturalSet, how: str, labels: str, seed: int) -> list[DeviceData]:
    """Each device's train and test samples under split ``how`` and labelling ``labels``.

    ``half``: a seeded half of the classes (rounded up) keep their labels in the device's training
    samples (the others are not stored); the test keeps every class.
    """
    rng = np.random.default_rng(seed)
    out = []
    for c in ds.devices():
        mine = ds.client == c
        if how == "session":
            train = mine & (ds.session == 0)
        elif how == "bout":
            train = mine.copy()
            for k in range(ds.num_classes):
                bouts = np.unique((ds.session * 10_000 + ds.bout)[mine & (ds.y == k)])
                test_bouts = bouts[1::2]
                train &= ~((ds.y == k) & np.isin(ds.session * 10_000 + ds.bout, test_bouts))
        elif ds.name == "vowels-deterding":
            train = mine & (ds.bout < 4)
        else:
            train = mine & (ds.bout % 3 != 2)
        test = mine & ~train
        if labels == "half":
            present = np.unique(ds.y[train])
            kept = rng.choice(present, size=math.ceil(len(present) / 2), replace=False)
            train &= np.isin(ds.y, kept)
        if train.sum() == 0 or test.sum() == 0:
            continue
        out.append(DeviceData(ds.x[train], ds.y[train], ds.x[test], ds.y[test]))
    return out


PERSONAL_OVERRIDES: dict[str, str] = {}
"""``personal.*`` profile keys set by ``--set`` (to choose the defaults); empty: the profile's defaults."""


def device_profile(name: str, dataset: str, root: Path, seed: int, personal: bool) -> Profile:
    """The bench device's profile: the shipped x86 profile with the set's backbone and float features."""
    return load_profile(
        PROFILE,
        {
            "device.id": name,
            "device.fleet": "bench",
            "device.state_dir": str(root / name),
            "model.path": str(model_path(dataset)),
            "pipeline.raw_dtype": "float32",
            "pipeline.std": "1.0",
            "pipeline.mode": "unfused",
            "training.seed": str(seed),
            "training.min_examples": "1",
            "training.holdout_every": str(HOLDOUT_EVERY),
            "memory.cap_mb": "4096",
            "memory.min_system_available_mb": "0",
            "personal.enabled": "true" if personal else "false",
            **PERSONAL_OVERRIDES,
        },
    )


@dataclass
class RunResult:
    """One federated run: per-device test accuracy of the serving head, update bytes, timings."""

    accuracy: list[float]
    global_accuracy: list[float]
    update_bytes: list[int] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    train_s: float = 0.0
    personal_s: float = 0.0
    extra_ram_bytes: int = 0
    fallbacks: int = 0


def run_federated(
    dataset: str, devs: Sequence[DeviceData], seed: int, rounds: int, personal: bool
) -> RunResult:
    """``rounds`` synchronous FedAvg rounds over the devices' cores; accuracy of what serves at the end."""
    gov = Governor(4096 << 20, 0, 0)
    strategy = FedAvg(local_epochs=LOCAL_EPOCHS, lr=LR, batch_size=BATCH, min_clients=1, deadline_s=3600)
    out = RunResult([], [])
    with tempfile.TemporaryDirectory(dir=STATE_ROOT) as tmp:
        cores = []
        for i, d in enumerate(devs):
            core = DeviceCore.open(
                device_profile(f"dev{i}", dataset, Path(tmp), seed * 1000 + i, personal),
                governor=gov,
                store_capacity=max(len(d.y_train), 16),
            )
            core.observe(d.x_train, d.y_train)
            cores.append(core)
        W, b = cores[0].head.W.copy(), cores[0].head.b.copy()
        sha = cores[0].model_sha256
        for r in range(1, rounds + 1):
            cfg = strategy.configure_round(r, (int(W.shape[0]), int(W.shape[1])))
            ann = RoundAnnouncement(
                round=r,
                base_version=r - 1,
                deadline_s=3600.0,
                local_epochs=cfg.local_epochs,
                lr=cfg.lr,
                batch_size=cfg.batch_size,
                min_clients=1,
                selected=1.0,
                compression=Compression.NONE,
            )
            payload = encode_round(ann)
            for core in cores:
                res = core.receive_round(payload)
                if res.status != RoundStatus.TRAINED or res.entry is None or res.local is None:
                    raise RuntimeError(f"round {r}: {res.status} {res.reason} {res.detail}")
                core.acknowledged(res.entry.update_id)
                out.train_s += res.local.train_s
                upd = decode_update(res.entry.payload, expect_shape=(int(W.shape[0]), int(W.shape[1])))
                # the update's bytes but for the two figures that differ from run to run (its training
                # time and the process's peak RSS): the runs with and without personal heads compare
                fixed = encode_update(
                    dataclasses.replace(
                        upd, metrics=dataclasses.replace(upd.metrics, train_s=0.0, peak_rss_bytes=0)
                    )
                )
                out.update_bytes.append(len(fixed))
                out.payloads.append(fixed)
                strategy.offer(Offer(upd.device, upd.delta_W, upd.delta_b, upd.num_examples))
                step = core.personalise()  # what the daemon runs once the update is out
                if step is not None:
                    out.personal_s += step.train_s
            W, b, _ = aggregate_checked(strategy, W, b)
            W, b = W.astype(np.float32), b.astype(np.float32)
            gm = encode_global_model(GlobalModel(r, r, sha, W, b))
            for core in cores:
                if core.receive_global(gm).status == ApplyStatus.REFUSED:
                    raise RuntimeError(f"round {r}: global head refused")
        for core, d in zip(cores, devs, strict=True):
            got = core.classify(d.x_test)
            out.accuracy.append(float(np.mean(got.predictions == d.y_test)))
            out.global_accuracy.append(float(np.mean(core.head.predict(got.embeddings) == d.y_test)))
            out.fallbacks += int(core.personal_fallback)
            if core.personal is not None:
                # resident: the personal head; during its step: its gradient, one more head
                head_bytes = core.personal.W.nbytes + core.personal.b.nbytes
                out.extra_ram_bytes = max(out.extra_ram_bytes, 2 * head_bytes)
        for core in cores:
            core.flush()
    return out


def run_local_only(dataset: str, devs: Sequence[DeviceData], seed: int, rounds: int) -> list[float]:
    """Each device alone: a head fitted on its stored samples' embeddings, from the factory head."""
    accs = []
    with tempfile.TemporaryDirectory(dir=STATE_ROOT) as tmp:
        for i, d in enumerate(devs):
            core = DeviceCore.open(
                device_profile(f"dev{i}", dataset, Path(tmp), seed * 1000 + i, False),
                governor=Governor(4096 << 20, 0, 0),
                store_capacity=max(len(d.y_train), 16),
            )
            core.observe(d.x_train, d.y_train)
            parts = list(core.store.chunks(4096))
            emb = np.concatenate([p[0] for p in parts])
            lbl = np.concatenate([p[1] for p in parts])
            epochs = rounds * LOCAL_EPOCHS
            W, b = fit_head(core.head.W, core.head.b, emb, lbl, epochs=epochs, lr=LR, batch_size=BATCH)
            test_emb = core.classify(d.x_test).embeddings
            accs.append(float(np.mean(np.argmax(test_emb @ W + b, axis=1) == d.y_test)))
    return accs


def summary(accs: Sequence[float]) -> dict[str, float]:
    """``{"mean", "worst_decile"}``: the mean, and the mean of the worst tenth (at least one device)."""
    a = np.sort(np.asarray(accs, dtype=np.float64))
    k = max(1, math.ceil(len(a) / 10))
    return {"mean": round(float(a.mean()), 4), "worst_decile": round(float(a[:k].mean()), 4)}


def _mean_summary(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """The seeds' ``{"mean", "worst_decile"}`` averaged key by key."""
    return {k: round(float(np.mean([p[k] for p in parts])), 4) for k in ("mean", "worst_decile")}


def run(
    seeds: Sequence[int] = (0, 1, 2),
    settings: Sequence[tuple[str, str, str]] = SETTINGS,
    rounds: int = ROUNDS,
) -> dict[str, Any]:
    """Every setting under each seed (training shuffles and, for ``half``, the labelled classes).

    A setting's ``mean`` and ``worst_decile`` are the averages over the seeds of each run's figures
    (one seed's devices number a few dozen at most: a run's worst decile is two or three devices).
    """
    rows = []
    extra_bytes = 0
    mismatched = 0
    total_rounds = 0
    train_s = personal_s = 0.0
    extra_ram = 0
    for dataset, how, labels in settings:
        ds = load_natural(dataset)
        parts: dict[str, list[dict[str, float]]] = {"local_only": [], "fedavg": [], "personal": []}
        fallbacks = 0
        n_devices = 0
        for seed in seeds:
            devs = split(ds, how, labels, seed)
            n_devices = len(devs)
            off = run_federated(dataset, devs, seed, rounds, personal=False)
            on = run_federated(dataset, devs, seed, rounds, personal=True)
            local = run_local_only(dataset, devs, seed, rounds)
            extra_bytes += sum(on.update_bytes) - sum(off.update_bytes)
            mismatched += sum(a != b for a, b in zip(on.payloads, off.payloads, strict=True))
            total_rounds += rounds
            train_s += off.train_s
            personal_s += on.personal_s + (on.train_s - off.train_s)
            extra_ram = max(extra_ram, on.extra_ram_bytes)
            fallbacks += on.fallbacks
            parts["local_only"].append(summary(local))
            parts["fedavg"].append(summary(off.accuracy))
            parts["personal"].append(summary(on.accuracy))
        row: dict[str, Any] = {"dataset": dataset, "split": how, "labels": labels, "devices": n_devices}
        row.update({k: _mean_summary(v) for k, v in parts.items()})
        print(json.dumps(row), f"fallbacks {fallbacks}, updates differing {mismatched}", flush=True)
        rows.append(row)
    return {
        "settings": rows,
        "extra_bytes_per_round": extra_bytes / max(total_rounds, 1),
        "extra_ram_bytes_per_device": extra_ram,
        "personal_pass_ratio": round(personal_s / train_s, 3) if train_s > 0 else None,
    }


def _matches(setting: tuple[str, str, str], pattern: str) -> bool:
    """Whether ``dataset[:split[:labels]]`` names ``setting`` (the parts given must all match)."""
    parts = pattern.split(":")
    return len(parts) <= 3 and all(p == s for p, s in zip(parts, setting, strict=False))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; ``--json PATH`` writes the result document."""
    ap = argparse.ArgumentParser(prog="python -m bench.personal", description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--seeds", type=int, default=3, help="runs per setting (seeds 0..N-1), averaged")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"federated rounds (default {ROUNDS})")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="DATASET[:SPLIT[:LABELS]]",
        help="run only the matching settings (e.g. hapt:session:all, vowels-deterding); repeatable",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a personal.* profile key for every device (e.g. personal.prox_lambda=0.5)",
    )
    args = ap.parse_args(argv)
    for item in args.set:
        key, _, value = item.partition("=")
        if not key.startswith("personal."):
            ap.error(f"--set {item}: only personal.* keys")
        PERSONAL_OVERRIDES[key] = value
    logging.basicConfig(level=logging.ERROR)
    settings = SETTINGS
    if args.only:
        settings = tuple(s for s in SETTINGS if any(_matches(s, o) for o in args.only))
        if not settings:
            ap.error(f"--only {args.only}: no such setting (known: {[':'.join(s) for s in SETTINGS]})")
    result = run(tuple(range(args.seeds)), settings, rounds=args.rounds)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
