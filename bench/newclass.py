"""New classes on one device against one poisoner in five: aggregation rules measured on both, in-process.

A fleet that runs for months must learn a class that one device starts seeing (``bench/soak.py``'s
goal: the global head's accuracy on test samples of the new classes >= 0.8 within 20 rounds of
their introduction) and must hold against one hostile device in five (``bench/poison.py``'s goal:
every attack within 0.03 of the clean run for the shipped default). A robust aggregate cannot tell
one device's novel class from one device's attack; this bench measures, for each candidate rule,
both sides on the same code: the novel device's new classes, and the worst poisoning loss.

**New classes** (the soak's schedule, without processes, kills or network): five device cores
(``edgefl.agent.core.DeviceCore``: the shipped round, trained by ``train_local`` on the device's
``EmbeddingStore``, encoded and decoded as on the wire), fed the digits embeddings of the shipped
int8 CNN as the soak feeds them: each device a non-IID shard of classes 0-7
(``partition_non_iid(primary_share = 0.9)``), :data:`PER_ROUND` labelled samples per device per
round (2 samples a second for the soak's ~4.4 s a round), five rounds' worth before the first.
After :data:`PRE_ROUNDS` rounds device 0 also sees classes 8 and 9 (each of its samples one of
them with probability 0.5, as in the soak). Every round every device answers (in a random order)
and the strategy aggregates with ``aggregate_checked``, from the model's factory head, with the
shipped profile's client settings (lr 0.05 constant, 2 epochs, batch 16, tolerate 1).
``accuracy_on_new``: the global head's accuracy on the test samples of 8 and 9, :data:`GOAL_ROUNDS`
rounds after the introduction (the soak's figure); ``rounds_to_learn``: rounds until it reaches
0.8 (None: not within :data:`POST_ROUNDS`); ``accuracy_old``: on the test samples of 0-7 at the end.

**Poisoning**: ``bench.poison.run_poisoned`` with the candidate in place of the profile's strategy
(the shipped ``coordinator.toml``, one attacker answering first: x1000, x -10, sign flip, 3e38,
ALIE, Min-Max), seeds 0 and 1: the largest loss against the same rule's clean run.

Candidates (:func:`candidates`), each after the shipped per-update norm bound
(``robustness.adaptive_factor`` x the fleet's history of median norms; ``outer`` in the table when a
row changes that factor):

* ``median`` (the shipped default), ``trimmed-mean``: Yin et al. 2018 (ICML), Definitions 1-2.
* ``fedavg xF``: the norm-bounded mean, bound F x the fleet's history of median norms: Sun et al.
  2019, "Can You Really Backdoor Federated Learning?" (norm difference clipping); F = 1 shipped.
* ``cc-trimmed``: centered clipping around the round's trimmed mean, ``c + mean_i clip(x_i - c,
  tau)``; ``cc-momentum``: centered clipping around the previous aggregate with server momentum
  beta (``v <- beta v; v <- v + mean_i clip(x_i - v, tau)``): Karimireddy, He, Jaggi 2021,
  "Learning from History for Byzantine Robust Optimization" (ICML), eq. (CC) and Algorithm 2.
  ``tau`` = factor x the lower of the median deviation of the last round and of this one.
* ``support``: trimmed mean per class column (``W[:, c]``, ``b[c]``), plus, in a column that at most
  ``tolerate`` devices support, each supporter's deviation from it at weight w (clipped to factor x
  the column's median deviation; unclipped when factor is 0). A device supports class c when its
  bias delta for c is positive: under softmax cross-entropy a device without samples of c can only
  push ``b[c]`` down (its gradient ``mean(p_c) > 0``), so this is what an update says about its
  labels; a device can lie, and a lie buys at most the clipped deviation in each column a round.
* ``uncontested``: trimmed mean, except in a class column the majority leaves alone (median over
  devices of the column's norm <= kappa x its median over columns), where every device's deviation
  from the trimmed mean enters at weight w (the restoring force: devices without class c push its
  column down only while it scores on their data).
* ``outlying``: trimmed mean, plus each device's column deviation that is at least ``ratio x`` the
  median over devices of the column's norm (a novel class is one device doing far more in a column
  than the rest; after the norm bound, a scaled or flipped update is not).

* ``gated``: validation-gated class columns (:class:`GatedRound`, after Zeno: Xie, Koyejo, Gupta
  2019, ICML), around the shipped median: the columns 1..``tolerate`` updates support (bias delta >
  0) form a candidate (the supporters' clipped column delta, times a server lr; added to the
  aggregate's, or replacing it) sent with the global head; each device votes per column (or on the
  whole candidate) on its own holdout (``training.holdout_every``; the devices then store through
  ``DeviceCore.keep`` as the agent does), accepting unless its accuracy drops by more than eps (or
  its cross-entropy rises by more); the votes ride on the next round's updates (one round of lag)
  and a column is kept when a strict majority of that round's voters accept it (the median vote).
  Poisoning: the attacker also votes with the test set as oracle (accepting exactly what hurts) and
  two attacks on the gate join bench.poison's: ``column`` (its whole update in the class column the
  honest devices support least, raising that class on typical samples, at the median honest norm)
  and ``creep`` (the same at a fifth). ``accuracy_on_new_one_liar``: device 4 voting so too.
  Variants: support from the classes each device declares (its store's), an item per supporter
  (up to ``tolerate + 1``), and the coordinator judging alone on its own labelled set (N samples of
  every class, the new ones included: Zeno's server-side validation), see :class:`Gate`.

Run: ``.venv/bin/python -m bench.newclass --json out/newclass.json`` (~7 minutes on a shared 2-core
host; ``--rule NAME`` and ``--seed N`` repeatable; ``--both`` adds :func:`fleet_attack`, the new-class
fleet with one hostile device; ``--set KEY=VALUE`` changes the shipped profile
for every rule, e.g. ``rounds.lr=0.1``). Writes ``{"goal": {...}, "settings": {...}, "rules": [{"rule",
"source", "accuracy_on_new": {SEED: x}, "rounds_to_learn": {SEED: n|null}, "accuracy_old": {SEED:
x}, "accuracy_on_new_mean": {SEED: x}, "curve": {SEED: [x, ...]}, "poison": {SEED: {"clean",
"worst_loss", "worst_attack"}}, "meets_both": bool}]}`` and prints a markdown table
(docs/benchmarks.md, "Soak"); gated rows add ``"accuracy_on_new_one_liar"`` and ``"columns_kept"``
(items kept / proposed) per seed, and ``--both`` adds ``"fleet_attack": {SEED: {"old_worst_loss",
"old_worst_attack", "on_new_lowest", "on_new_lowest_attack"}}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench import learning, poison
from bench.learning import STATE_ROOT, Task, digits_embeddings
from edgefl.agent.config import load_profile
from edgefl.agent.core import DeviceCore
from edgefl.agent.governor import Governor
from edgefl.agent.round import RoundStatus
from edgefl.coordinator.profile import CoordinatorProfile
from edgefl.coordinator.robust import trimmed_mean
from edgefl.coordinator.rounds import Round
from edgefl.coordinator.runner import build_strategy
from edgefl.coordinator.strategy import Offer, Strategy, aggregate_checked
from edgefl.datasets import partition_non_iid, split_digits
from edgefl.errors import UpdateRejected
from edgefl.head import Head
from edgefl.types import F32
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import GlobalModel, encode_global_model
from edgefl.wire.rounds import RoundAnnouncement, decode_update, encode_round

ROOT = Path(__file__).resolve().parent.parent
DEVICE_PROFILE = ROOT / "firmware_configs" / "dev_x86.toml"
NEW_CLASSES = (8, 9)
N_DEVICES = 5
NOVEL = 0
"""The device that starts seeing the new classes."""
PER_ROUND = 9
"""Labelled samples per device per round (the soak: 2 a second, a round every ~4.4 s)."""
PRE_ROUNDS = 30
POST_ROUNDS = 30
GOAL_ROUNDS = 20
GOAL_ACCURACY = 0.8
POISON_GOAL = 0.03
SEEDS = (0, 1)
F64 = npt.NDArray[np.float64]


# --- candidate rules: pure numpy on the round's stacked, norm-bounded updates -------------------------
def clip_rows(x: F64, tau: float) -> F64:
    """Each row of ``x`` scaled down to L2 norm at most ``tau``.

    Parameters
    ----------
    x : float64 [n, P]
    tau : float >= 0 (inf: unchanged)

    Returns
    -------
    float64 [n, P]
    """
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    out: F64 = x * np.minimum(1.0, tau / np.maximum(norms, 1e-300))
    return out


def centered_clip(x: F64, center: F64, tau: float) -> F64:
    """One step of centered clipping: ``center + mean_i clip(x_i - center, tau)``.

    Parameters
    ----------
    x : float64 [n, P]
        The round's updates (flattened W and b).
    center : float64 [P]
    tau : float >= 0

    Returns
    -------
    float64 [P]; one update moves it by at most ``tau / n`` from ``center``.

    Source: Karimireddy, He, Jaggi 2021, "Learning from History for Byzantine Robust Optimization"
    (ICML), eq. (CC) with one iteration.
    """
    out: F64 = center + clip_rows(x - center, tau).mean(axis=0)
    return out


def columns(x: F64, D: int, K: int) -> F64:
    """Flattened heads ``[n, D K + K]`` as class columns ``[n, D + 1, K]`` (``W[:, c]`` and ``b[c]``)."""
    n = x.shape[0]
    out: F64 = np.concatenate([x[:, : D * K].reshape(n, D, K), x[:, None, D * K :]], axis=1)
    return out


def flatten(cols: F64) -> F64:
    """Inverse of :func:`columns` for one head: ``[D + 1, K]`` -> ``[D K + K]``."""
    out: F64 = np.concatenate([cols[:-1].ravel(), cols[-1]])
    return out


def support_columns(x: F64, center: F64, D: int, K: int, tolerate: int, factor: float, w: float) -> F64:
    """Trimmed-mean ``center`` plus, per class column supported by 1..``tolerate`` devices, their deviation.

    Parameters
    ----------
    x : float64 [n, D K + K]
        The round's updates.
    center : float64 [D K + K]
        The round's trimmed mean.
    D, K : int
        Head shape.
    tolerate : int
        Most supporters a column may have to be treated as a minority's.
    factor : float >= 0
        Each supporter's column deviation is clipped to ``factor x`` the column's median deviation
        over devices (0: not clipped).
    w : float > 0
        Weight of the supporters' mean deviation.

    Returns
    -------
    float64 [D K + K]
    """
    cols = columns(x, D, K)
    c = columns(center[None], D, K)[0]
    out = c.copy()
    for k in range(K):
        sup = np.flatnonzero(cols[:, D, k] > 0)
        if 0 < len(sup) <= tolerate:
            dev = cols[:, :, k] - c[:, k]
            tau = factor * float(np.median(np.linalg.norm(dev, axis=1))) if factor > 0 else math.inf
            out[:, k] += w * clip_rows(dev[sup], tau).mean(axis=0)
    return flatten(out)


def uncontested_columns(x: F64, center: F64, D: int, K: int, kappa: float, w: float) -> F64:
    """Trimmed-mean ``center``, plus every deviation at weight ``w`` in columns the majority leaves alone.

    A column is left alone when the median over devices of its norm is at most ``kappa x`` the
    median of that figure over all columns.

    Returns
    -------
    float64 [D K + K]
    """
    cols = columns(x, D, K)
    c = columns(center[None], D, K)[0]
    m = np.median(np.linalg.norm(cols, axis=1), axis=0)  # [K]
    free = m <= kappa * float(np.median(m))
    out = c.copy()
    out[:, free] += w * (cols[:, :, free] - c[None, :, free]).sum(axis=0)
    return flatten(out)


def outlying_columns(x: F64, center: F64, D: int, K: int, ratio: float, w: float) -> F64:
    """Trimmed-mean ``center``, plus each device's column deviation that is at least ``ratio x`` the
    median over devices of that column's norm (one device doing far more in a class than the rest).

    Returns
    -------
    float64 [D K + K]
    """
    cols = columns(x, D, K)
    c = columns(center[None], D, K)[0]
    dev = cols - c[None]
    far = np.linalg.norm(dev, axis=1) >= ratio * np.median(np.linalg.norm(cols, axis=1), axis=0)  # [n, K]
    out = c + w * np.einsum("ndk,nk->dk", dev, far.astype(np.float64))
    return flatten(out)


class DeviationHistory:
    """``tau`` = factor x the lower median deviation of the last round and of this one (as ``NormBound``)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.last: float | None = None

    def tau(self, deviations: F64) -> float:
        """The round's ``tau`` from its deviations' norms ``[n]``; their clipped median joins the history."""
        now = float(np.median(deviations))
        tau = self.factor * (now if self.last is None else min(now, self.last))
        self.last = float(np.median(np.minimum(deviations, tau)))
        return tau


class Candidate(Strategy):
    """A candidate rule behind the shipped ``Strategy`` interface (checks, norm bound, ``min_updates``).

    The round's norm-bounded updates are kept (O(n model)) and ``rule(self, X)`` combines them,
    ``X`` float64 ``[n, D K + K]``; the FedAvg family's ``min_updates`` (5 for tolerate 1). A rule
    keeps what it needs from round to round (momentum, deviation history) in ``carried``.
    """

    name = "candidate"

    def __init__(self, rule: Callable[[Candidate, F64], F64], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rule = rule
        self.carried: dict[str, Any] = {}
        self._kept: list[F64] = []

    def _begin(self, shape: tuple[int, int]) -> None:
        self._kept = []

    def _fold(self, update: Offer) -> None:
        self._kept.append(np.concatenate([update.delta_W.ravel(), update.delta_b]).astype(np.float64))

    def _aggregate(self, W: F32, b: F32) -> tuple[F32, F32]:
        d = self.rule(self, np.stack(self._kept))
        D, K = W.shape
        W1: F32 = (W + d[: D * K].reshape(D, K)).astype(np.float32)
        b1: F32 = (b + d[D * K :]).astype(np.float32)
        return W1, b1


def _trimmed(s: Candidate, x: F64) -> F64:
    return trimmed_mean(list(x.astype(np.float32)), 0.2).astype(np.float64)


def cc_trimmed(factor: float) -> Callable[[Candidate, F64], F64]:
    """Centered clipping around the round's trimmed mean, ``tau`` from :class:`DeviationHistory`."""

    def rule(s: Candidate, x: F64) -> F64:
        c = _trimmed(s, x)
        hist = s.carried.setdefault("tau", DeviationHistory(factor))
        return centered_clip(x, c, hist.tau(np.linalg.norm(x - c, axis=1)))

    return rule


def cc_momentum(factor: float, beta: float) -> Callable[[Candidate, F64], F64]:
    """Centered clipping around the previous aggregate times ``beta`` (server momentum)."""

    def rule(s: Candidate, x: F64) -> F64:
        v = beta * s.carried.get("v", np.zeros(x.shape[1]))
        hist = s.carried.setdefault("tau", DeviationHistory(factor))
        v = centered_clip(x, v, hist.tau(np.linalg.norm(x - v, axis=1)))
        s.carried["v"] = v
        return v

    return rule


def support(factor: float, w: float, shape: tuple[int, int]) -> Callable[[Candidate, F64], F64]:
    """:func:`support_columns` around the round's trimmed mean."""

    def rule(s: Candidate, x: F64) -> F64:
        return support_columns(x, _trimmed(s, x), shape[0], shape[1], s.tolerate, factor, w)

    return rule


def uncontested(kappa: float, w: float, shape: tuple[int, int]) -> Callable[[Candidate, F64], F64]:
    """:func:`uncontested_columns` around the round's trimmed mean."""

    def rule(s: Candidate, x: F64) -> F64:
        return uncontested_columns(x, _trimmed(s, x), shape[0], shape[1], kappa, w)

    return rule


def outlying(ratio: float, w: float, shape: tuple[int, int]) -> Callable[[Candidate, F64], F64]:
    """:func:`outlying_columns` around the round's trimmed mean."""

    def rule(s: Candidate, x: F64) -> F64:
        return outlying_columns(x, _trimmed(s, x), shape[0], shape[1], ratio, w)

    return rule


# --- validation-gated class columns: the devices vote on a candidate, one round later --------------
@dataclass(frozen=True)
class Gate:
    """Settings of a validation-gated rule (:class:`GatedRound`).

    Attributes
    ----------
    eps : float >= 0
        A device accepts a candidate column unless its holdout accuracy drops by more than ``eps``.
    clip : float > 0
        Each supporter's column delta is clipped to ``clip x`` the round's norm bound.
    server_lr : float > 0
        Weight of the supporters' mean clipped column delta.
    replace : bool
        False: the column delta is added to the aggregate's; True: it replaces it (the candidate is
        the supporters' column delta minus the aggregate's).
    per_column : bool
        True: one vote per candidate column (a bit mask); False: one vote on the whole candidate.
    metric : str
        ``"accuracy"``: accept unless the holdout accuracy drops by more than ``eps``; ``"loss"``:
        unless the holdout's mean cross-entropy (nats) rises by more than ``eps``.
    holdout_every : int
        The devices' ``training.holdout_every`` (20 shipped: every 20th labelled sample held out).
    support : str
        Which updates support class ``c``: ``"bias"``, those whose bias delta for ``c`` is > 0;
        ``"declared"``, those whose device declares labelled samples of ``c`` (the classes its
        store has seen, ``DeviceCore.personal_columns``; a hostile device declares what it likes).
    per_supporter : bool
        False: a column 1..``tolerate`` updates support gets one item, their mean clipped delta.
        True: a column 1..``tolerate + 1`` updates support gets one item per supporter, voted on
        apart (so a hostile device that claims the class adds an item but cannot stop the other).
    server_per_class : int
        0: the devices vote. N > 0: the coordinator alone judges each item on its own labelled set
        of N samples of every class, new ones included (Zeno's server-side validation; with
        ``eps`` < 0 an item must raise that set's accuracy), still one round late.
    """

    eps: float = 0.01
    clip: float = 1.0
    server_lr: float = 1.0
    replace: bool = False
    per_column: bool = True
    metric: str = "accuracy"
    holdout_every: int = 20
    support: str = "bias"
    per_supporter: bool = False
    server_per_class: int = 0


def server_set(
    pool: npt.NDArray[np.int64], y: npt.NDArray[np.int64], per_class: int, seed: int
) -> npt.NDArray[np.int64]:
    """Indices of ``per_class`` labelled samples of every class in ``pool``: the coordinator's own set."""
    rng = np.random.default_rng(seed + 99)
    return np.concatenate(
        [rng.choice(pool[y[pool] == c], per_class, replace=False) for c in np.unique(y[pool])]
    )


def holdout_of(core: DeviceCore) -> tuple[F32, npt.NDArray[np.int64]]:
    """The device core's holdout (``training.holdout_every``) as float32 [M, D] and int64 [M]."""
    parts = list(core.holdout.chunks(1024)) if core.holdout is not None else []
    if not parts:
        return np.zeros((0, core.head.shape[0]), np.float32), np.zeros(0, np.int64)
    return np.concatenate([e for e, _ in parts]), np.concatenate([y for _, y in parts])


def head_accuracy(x: F32, y: npt.NDArray[np.int64], W: F64 | F32, b: F64 | F32) -> float:
    """Fraction of ``x`` [M, D] that ``argmax(x W + b)`` classifies as ``y`` [M] (nan when M = 0)."""
    if len(y) == 0:
        return math.nan
    return float(np.mean(np.argmax(x @ W + b, axis=1) == y))


def head_loss(x: F32, y: npt.NDArray[np.int64], W: F64 | F32, b: F64 | F32) -> float:
    """Mean softmax cross-entropy (nats) of ``x W + b`` against ``y`` (nan when M = 0)."""
    if len(y) == 0:
        return math.nan
    z = (x @ W + b).astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=1))
    return float(np.mean(lse - z[np.arange(len(y)), y]))


def with_columns(W: F32, b: F32, items: F64, cols: Sequence[int], which: Sequence[int]) -> tuple[F32, F32]:
    """``W``, ``b`` plus the candidate items ``which`` (float32 copies).

    ``items`` float64 [n, D + 1]: item i adds ``items[i, :-1]`` to ``W[:, cols[i]]`` and
    ``items[i, -1]`` to ``b[cols[i]]``.
    """
    W1, b1 = W.astype(np.float64), b.astype(np.float64)
    for i in which:
        W1[:, cols[i]] += items[i, :-1]
        b1[cols[i]] += items[i, -1]
    return W1.astype(np.float32), b1.astype(np.float32)


def device_votes(
    x: F32, y: npt.NDArray[np.int64], W: F32, b: F32, items: F64, cols: Sequence[int], gate: Gate
) -> list[bool]:
    """An honest device's votes on a candidate: per item (or one for all, repeated), on its holdout.

    Accept unless the holdout accuracy with the item drops by more than ``gate.eps`` (or the mean
    cross-entropy rises by more, ``gate.metric = "loss"``); a device without a holdout rejects (it
    cannot vouch for anything). ``items``, ``cols``: as :func:`with_columns`.
    """
    groups = [[i] for i in range(len(cols))] if gate.per_column else [list(range(len(cols)))]
    if gate.metric == "loss":
        base = head_loss(x, y, W, b)
        ok = [head_loss(x, y, *with_columns(W, b, items, cols, g)) <= base + gate.eps for g in groups]
    else:
        base = head_accuracy(x, y, W, b)
        ok = [head_accuracy(x, y, *with_columns(W, b, items, cols, g)) >= base - gate.eps for g in groups]
    if math.isnan(base):
        return [False] * len(cols)
    return ok if gate.per_column else ok * len(cols)


def liar_votes(
    x: F32, y: npt.NDArray[np.int64], W: F32, b: F32, items: F64, cols: Sequence[int], gate: Gate
) -> list[bool]:
    """A hostile device's votes, with the test set as oracle: accept exactly what lowers its accuracy."""
    base = head_accuracy(x, y, W, b)
    groups = [[i] for i in range(len(cols))] if gate.per_column else [list(range(len(cols)))]
    bad = [head_accuracy(x, y, *with_columns(W, b, items, cols, g)) < base for g in groups]
    return bad if gate.per_column else bad * len(cols)


class GatedRound:
    """The coordinator's side of a gated rule around the shipped strategy (one per run).

    Each round the shipped strategy aggregates as shipped (``aggregate_checked``); its norm-bounded
    updates are kept too. From them a *candidate* is formed, items of class columns ``c`` (``W[:, c]``
    and ``b[c]``): in a column that 1..``tolerate`` updates support (``gate.support``), the
    supporters' mean column delta, each clipped to ``gate.clip x`` the round's norm bound, times
    ``gate.server_lr`` (minus the aggregate's column with ``gate.replace``); with
    ``gate.per_supporter``, 1..``tolerate + 1`` supporters and one item each. The candidate goes out
    with the new global head; the devices evaluate it on their holdouts and their votes ride on the
    next round's updates; when that round closes, each item a strict majority of the round's voters
    accept (the median vote) is added to the new aggregate. Source: Zeno (Xie, Koyejo, Gupta 2019,
    "Zeno: Distributed Stochastic Gradient Descent with Suspicion-based Fault-tolerance", ICML), with
    the validation done by the devices on their own holdouts and a median over their votes.
    """

    def __init__(self, strategy: Strategy, gate: Gate, shape: tuple[int, int]) -> None:
        self.strategy = strategy
        self.gate = gate
        self.D, self.K = shape
        self.kept: list[F64] = []
        self.kept_claims: list[npt.NDArray[np.bool_]] = []
        self.kept_bias_claims: list[bool] = []
        self.claims: dict[str, npt.NDArray[np.bool_]] = {}
        self.claim_all: set[str] = set()
        """Devices that claim every class, whatever their update says (a liar denying the candidate)."""
        self.pending: F64 | None = None
        self.cols: list[int] = []
        self.proposed = 0
        self.kept_columns = 0
        fold = strategy._fold

        def keep(update: Offer) -> None:
            self.kept.append(np.concatenate([update.delta_W.ravel(), update.delta_b]).astype(np.float64))
            claims = self.claims.get(update.device, np.zeros(self.K, bool))
            self.kept_claims.append(np.ones(self.K, bool) if update.device in self.claim_all else claims)
            self.kept_bias_claims.append(update.device in self.claim_all)
            fold(update)

        strategy._fold = keep  # type: ignore[method-assign]

    def configure_round(self, r: int) -> Any:
        """Begin round ``r`` on the shipped strategy."""
        self.kept, self.kept_claims, self.kept_bias_claims, self.claims = [], [], [], {}
        return self.strategy.configure_round(r, (self.D, self.K))

    def declare(self, device: str, classes: npt.NDArray[np.bool_]) -> None:
        """The classes ``device``'s update of this round declares (bool [K]; ``support = "declared"``)."""
        self.claims[device] = np.asarray(classes, bool).copy()

    def close(self, W: F32, b: F32, votes: Sequence[Sequence[bool]]) -> tuple[F32, F32, Any]:
        """Aggregate (shipped), keep the pending columns the voters accept, form the next candidate.

        ``votes``: one list per accepted update, a bool per item (:attr:`pending`, :attr:`cols`).
        """
        W1, b1, refused = aggregate_checked(self.strategy, W, b)
        if refused is not None:
            self.pending, self.cols = None, []
            return W1, b1, refused
        dW, db = W1 - W, b1 - b  # the shipped aggregate's step, before any candidate column
        if self.pending is not None and votes:
            yes = np.sum(np.asarray(votes, dtype=np.int64), axis=0)
            take = [i for i, n in enumerate(yes) if 2 * int(n) > len(votes)]
            if take:
                Wc, bc = with_columns(W1, b1, self.pending, self.cols, take)
                if np.isfinite(Wc).all() and np.isfinite(bc).all():
                    W1, b1 = Wc, bc
                    self.kept_columns += len(take)
        self.propose(dW, db)
        return W1, b1, None

    def propose(self, dW: F32, db: F32) -> None:
        """The candidate of the round's kept updates around the aggregate's delta ``dW``, ``db``."""
        self.pending, self.cols = None, []
        if not self.kept:
            return
        x = np.stack(self.kept)
        cols = columns(x, self.D, self.K)
        agg = np.concatenate([dW.astype(np.float64), db.astype(np.float64)[None]])
        bound = self.strategy.report().norm_bound
        if not math.isfinite(bound):
            bound = float(np.median(np.linalg.norm(x, axis=1)))
        tau = self.gate.clip * bound
        limit = self.strategy.tolerate + (1 if self.gate.per_supporter else 0)
        items: list[F64] = []
        if self.gate.support == "declared":
            claims = np.stack(self.kept_claims)
        else:
            claims = (cols[:, self.D, :] > 0) | np.asarray(self.kept_bias_claims)[:, None]
        for k in range(self.K):
            sup = np.flatnonzero(claims[:, k])
            if not 0 < len(sup) <= limit:
                continue
            clipped = clip_rows(cols[sup, :, k], tau)
            for d in clipped if self.gate.per_supporter else clipped.mean(axis=0)[None]:
                items.append(self.gate.server_lr * (d - agg[:, k] if self.gate.replace else d))
                self.cols.append(k)
        if self.cols:
            self.pending = np.stack(items)
            self.proposed += len(self.cols)


Factory = Callable[[], Strategy]


@dataclass(frozen=True)
class Rule:
    """A row of the table: its name, where it comes from, and how to build it."""

    name: str
    source: str
    make: Factory
    gate: Gate | None = None


def shipped_factory(name: str, sets: Mapping[str, object] | None = None, **more: object) -> Factory:
    """A shipped strategy as ``edgefl coordinator`` builds it from the shipped profile and ``sets``."""
    profile = poison.shipped_profile(name, **{**(sets or {}), **more})
    return lambda: build_strategy(profile)


def candidate_factory(
    rule: Callable[[Candidate, F64], F64],
    sets: Mapping[str, object] | None = None,
    outer: float | None = None,
) -> Factory:
    """A :class:`Candidate` on the shipped profile changed by ``sets``; ``outer``: its norm bound factor."""
    p = poison.shipped_profile("trimmed-mean", **(sets or {}))
    r, rob = p.rounds, p.robustness
    kwargs: dict[str, Any] = {
        "local_epochs": r.local_epochs, "lr": r.lr, "batch_size": r.batch_size,
        "min_clients": r.min_clients, "deadline_s": r.deadline_s, "clip_norm": rob.norm_bound,
        "clip_multiplier": rob.adaptive_factor if outer is None else outer, "tolerate": rob.tolerate,
    }  # fmt: skip
    return lambda: Candidate(rule, **kwargs)


def candidates(sets: Mapping[str, object] | None = None) -> list[Rule]:
    """Every rule of the table, the shipped default first; ``sets`` change the shipped profile."""
    shape = tuple(int(n) for n in digits_embeddings()[2].shape)
    D, K = shape[0], shape[1]
    yin, sun = "Yin et al. 2018", "Sun et al. 2019"
    cc = "Karimireddy et al. 2021"
    zeno = "Xie et al. 2019 (Zeno), devices vote"
    return [
        Rule("median (default)", yin, shipped_factory("median", sets)),
        Rule("trimmed-mean", yin, shipped_factory("trimmed-mean", sets)),
        Rule("fedavg x1", sun, shipped_factory("fedavg", sets)),
        Rule("fedavg x3", sun, shipped_factory("fedavg", sets, **{"robustness.adaptive_factor": 3.0})),
        Rule("fedavg x6", sun, shipped_factory("fedavg", sets, **{"robustness.adaptive_factor": 6.0})),
        Rule("fedavg x20", sun, shipped_factory("fedavg", sets, **{"robustness.adaptive_factor": 20.0})),
        Rule("cc-trimmed tau x1", cc, candidate_factory(cc_trimmed(1.0), sets)),
        Rule("cc-trimmed tau x4, outer x6", cc, candidate_factory(cc_trimmed(4.0), sets, 6.0)),
        Rule("cc-momentum tau x2, beta 0", cc, candidate_factory(cc_momentum(2.0, 0.0), sets)),
        Rule(
            "cc-momentum tau x4, beta 0.9, outer x6", cc, candidate_factory(cc_momentum(4.0, 0.9), sets, 6.0)
        ),
        Rule("support x1, w 1", "this bench", candidate_factory(support(1.0, 1.0, (D, K)), sets)),
        Rule("support unclipped, w 0.5", "this bench", candidate_factory(support(0.0, 0.5, (D, K)), sets)),
        Rule("support unclipped, w 1", "this bench", candidate_factory(support(0.0, 1.0, (D, K)), sets)),
        Rule(
            "uncontested kappa 0.45, w 1",
            "this bench",
            candidate_factory(uncontested(0.45, 1.0, (D, K)), sets),
        ),
        Rule("outlying ratio 3, w 1", "this bench", candidate_factory(outlying(3.0, 1.0, (D, K)), sets)),
        *(Rule(f"gated {name}", zeno, shipped_factory("median", sets), gate) for name, gate in GATES.items()),
    ]


GATES = {
    "per column, accuracy eps 0.01, add, lr 1": Gate(),
    "per column, accuracy eps 0.01, add, lr 2": Gate(server_lr=2.0),
    "per column, accuracy eps 0.01, add, lr 4": Gate(server_lr=4.0),
    "per column, accuracy eps 0.01, replace, lr 2": Gate(server_lr=2.0, replace=True),
    "per column, loss eps 0.005, add, lr 2": Gate(server_lr=2.0, metric="loss", eps=0.005),
    "whole candidate, accuracy eps 0.01, add, lr 2": Gate(server_lr=2.0, per_column=False),
    "per column, accuracy eps 0.01, add, lr 2, holdout every 5th": Gate(server_lr=2.0, holdout_every=5),
    "declared, per column, accuracy eps 0.01, add, lr 2": Gate(server_lr=2.0, support="declared"),
    "declared, per column, accuracy eps 0.01, add, lr 3": Gate(server_lr=3.0, support="declared"),
    "declared, per column, accuracy eps 0.01, replace, lr 1": Gate(replace=True, support="declared"),
    "declared, per supporter, accuracy eps 0.01, add, lr 2": Gate(
        server_lr=2.0, support="declared", per_supporter=True
    ),
    "per column, coordinator's 10 a class judge, loss eps 0, add, lr 2": Gate(
        server_lr=2.0, server_per_class=10, metric="loss", eps=0.0
    ),
    "declared, per supporter, coordinator's 10 a class judge, loss eps 0, add, lr 2": Gate(
        server_lr=2.0, support="declared", per_supporter=True, server_per_class=10, metric="loss", eps=0.0
    ),
}
"""The validation-gated rows (:class:`GatedRound` around the shipped median), by their variant."""


# --- the new-class run ------------------------------------------------------------------------------
def _device(
    name: str, seed: int, root: Path, W0: F32, b0: F32, gov: Governor, holdout_every: int = 20
) -> DeviceCore:
    profile = load_profile(
        DEVICE_PROFILE,
        {
            "device.id": name,
            "device.fleet": "bench",
            "device.state_dir": str(root / name),
            "model.path": str(ROOT / "models" / "digits_cnn_int8.tflite"),  # not loaded: no pipeline
            "training.chunk_size": "256",
            "training.seed": str(seed),
            "training.holdout_every": str(holdout_every),
            "memory.cap_mb": "4096",
            "memory.min_system_available_mb": "0",
        },
    )
    return DeviceCore(profile, Head(W0, b0, 0), "0" * 64, governor=gov)


def new_class_run(
    make: Factory,
    seed: int,
    profile: CoordinatorProfile,
    pre: int = PRE_ROUNDS,
    post: int = POST_ROUNDS,
    *,
    gate: Gate | None = None,
    liar: int | None = None,
    attack: str | None = None,
) -> dict[str, Any]:
    """One fleet of five device cores, device 0 seeing classes 8 and 9 after ``pre`` rounds.

    Parameters
    ----------
    make : callable
        Builds the strategy.
    seed : int
        Partition, feed and training seed.
    profile : CoordinatorProfile
        Its ``[rounds]`` give the client settings.
    pre, post : int
        Rounds before the introduction and after it (``post >= GOAL_ROUNDS``).
    gate : Gate or None
        A validation-gated rule around ``make``'s strategy (:class:`GatedRound`); the devices then
        keep their samples as the agent does (``DeviceCore.keep``: every ``training.holdout_every``-th
        in the holdout they vote on).
    liar : int or None
        With ``gate``: this device votes as :func:`liar_votes` and claims every class (its update
        stays honest): one hostile device denying the candidate.
    attack : str or None
        With ``liar``: its update is this attack's (a key of ``bench.poison.ATTACKS`` or
        :data:`GATE_ATTACKS`) instead of its real one: one hostile device in the new-class fleet.

    Returns
    -------
    dict: ``accuracy_on_new`` (after :data:`GOAL_ROUNDS` rounds), ``rounds_to_learn`` (or None),
    ``accuracy_old`` (classes 0-7, at the end), ``curve`` (accuracy on new every 5 rounds after the
    introduction), ``accuracy_on_new_mean`` (its mean from :data:`GOAL_ROUNDS` rounds after to the
    end), ``columns_kept`` (gated: candidate columns kept / proposed).

    Raises
    ------
    RuntimeError
        If a device does not train or a round is refused.
    """
    emb, y, W0, b0 = digits_embeddings()
    split = split_digits(y, seed=seed)
    pool = split.devices
    old = pool[y[pool] < min(NEW_CLASSES)]
    new = pool[np.isin(y[pool], NEW_CLASSES)]
    shards = [old[s] for s in partition_non_iid(y[old], N_DEVICES, seed=seed)]
    test_e, test_y = emb[split.test], y[split.test]
    is_new = np.isin(test_y, NEW_CLASSES)
    if gate is not None and gate.server_per_class:
        judge = server_set(pool, y, gate.server_per_class, seed)
        server_x, server_y = emb[judge], y[judge]
    rng = np.random.default_rng(seed + 5)
    strategy = make()
    rounds = profile.rounds
    W, b = W0.copy(), b0.copy()
    D, K = (int(n) for n in W.shape)
    gated = GatedRound(strategy, gate, (D, K)) if gate is not None else None
    attacks: dict[str, poison.Attack] = dict(poison.ATTACKS)
    mean_liar = emb[shards[liar if liar is not None else 0]].mean(axis=0)
    attacks.update(column=column_attack(1.0, D, K, mean_liar), creep=column_attack(0.2, D, K, mean_liar))
    if gated is not None and liar is not None:
        gated.claim_all.add(f"dev{liar}")
    every = gate.holdout_every if gate is not None else 20
    pos = [0] * N_DEVICES
    acc_new: list[float] = []
    gov = Governor(4096 << 20, 0, 0)
    with tempfile.TemporaryDirectory(dir=STATE_ROOT) as tmp:
        cores = [
            _device(f"dev{i}", seed * 100_000 + i * 1000, Path(tmp), W0, b0, gov, every)
            for i in range(N_DEVICES)
        ]
        for r in range(1, pre + post + 1):
            for i, core in enumerate(cores):
                ids = []
                for _ in range(PER_ROUND * (5 if r == 1 else 1)):  # min_examples (32) before round 1
                    if i == NOVEL and r > pre and rng.random() < 0.5:
                        ids.append(int(rng.choice(new)))
                    else:
                        ids.append(int(shards[i][pos[i] % len(shards[i])]))
                        pos[i] += 1
                if gated is None:
                    core.store.add(emb[ids].astype(np.float32), y[ids].astype(np.int64))
                else:
                    core.keep(emb[ids].astype(np.float32), y[ids].astype(np.int64))
            if gated is None:
                strategy.configure_round(r, (D, K))
            else:
                gated.configure_round(r)
            ann = RoundAnnouncement(
                round=r, base_version=r - 1, deadline_s=3600.0, local_epochs=rounds.local_epochs,
                lr=rounds.lr, batch_size=rounds.batch_size, min_clients=1, selected=1.0,
                compression=Compression.NONE,
            )  # fmt: skip
            updates = []
            for core in cores:
                res = core.receive_round(encode_round(ann))
                if res.status != RoundStatus.TRAINED or res.entry is None:
                    raise RuntimeError(f"{core.device} round {r}: {res.status} {res.reason}")
                core.acknowledged(res.entry.update_id)
                updates.append(decode_update(res.entry.payload, expect_shape=(D, K)))
            if attack is not None and liar is not None:
                flat = [np.concatenate([u.delta_W.ravel(), u.delta_b]) for u in updates]
                order = [liar] + [j for j in range(N_DEVICES) if j != liar]  # the attacker's own first
                sent = attacks[attack](flat[liar], [flat[j] for j in order])
                updates[liar] = dataclasses.replace(
                    updates[liar], delta_W=sent[: D * K].reshape(D, K), delta_b=sent[D * K :]
                )
            votes: list[list[bool]] = []
            for j in rng.permutation(N_DEVICES):
                u = updates[j]
                if gated is not None:
                    gated.declare(u.device, cores[j].personal_columns)
                try:
                    strategy.offer(Offer(u.device, u.delta_W, u.delta_b, u.num_examples))
                except UpdateRejected:
                    continue
                if (
                    gated is not None
                    and gated.pending is not None
                    and gate is not None
                    and not gate.server_per_class
                ):
                    # the device's vote on last round's candidate rides on this round's update
                    x, yy = (test_e, test_y) if j == liar else holdout_of(cores[j])
                    vote = liar_votes if j == liar else device_votes
                    votes.append(vote(x, yy, W, b, gated.pending, gated.cols, gate))
            if gated is None:
                W, b, refused = aggregate_checked(strategy, W, b)
            else:
                if gate is not None and gate.server_per_class and gated.pending is not None:
                    votes = [device_votes(server_x, server_y, W, b, gated.pending, gated.cols, gate)]
                W, b, refused = gated.close(W, b, votes)
            if refused is not None:
                raise RuntimeError(f"round {r} refused: {refused}")
            payload = encode_global_model(GlobalModel(r, r, "0" * 64, W, b))
            for core in cores:
                core.receive_global(payload)
            pred = np.argmax(test_e @ W + b, axis=1)
            acc_new.append(float(np.mean(pred[is_new] == test_y[is_new])))
    after = acc_new[pre:]
    learned = next((k + 1 for k, a in enumerate(after) if a >= GOAL_ACCURACY), None)
    pred = np.argmax(test_e @ W + b, axis=1)
    return {
        "accuracy_on_new": round(after[GOAL_ROUNDS - 1], 3),
        "accuracy_on_new_mean": round(float(np.mean(after[GOAL_ROUNDS - 1 :])), 3),
        "rounds_to_learn": learned,
        "accuracy_old": round(float(np.mean(pred[~is_new] == test_y[~is_new])), 3),
        "curve": [round(a, 2) for a in after[4::5]],
        "columns_kept": None if gated is None else f"{gated.kept_columns}/{gated.proposed}",
    }


def poison_worst(
    make: Factory, seed: int, sets: Mapping[str, object] | None = None, gate: Gate | None = None
) -> dict[str, Any]:
    """``bench.poison``'s clean run and every attack with the rule ``make`` builds; the worst loss.

    With ``gate``: :func:`gated_poisoned`, and :data:`GATE_ATTACKS` beside bench.poison's.
    """
    profile = poison.shipped_profile("trimmed-mean", **(sets or {}))  # its rounds; the strategy is ``make``'s
    task = poison.poison_task(profile, seed)

    def acc(attack: str | None) -> float:
        if gate is None:
            return poison.run_poisoned(task, profile, attack, seed, make=make).accuracy
        return gated_poisoned(task, profile, attack, seed, make, gate)

    clean = acc(None)
    loss = {a: clean - acc(a) for a in (*poison.ATTACKS, *(GATE_ATTACKS if gate is not None else ()))}
    worst = max(loss, key=lambda a: loss[a])
    return {"clean": round(clean, 3), "worst_loss": round(loss[worst], 3), "worst_attack": worst}


def column_attack(size: float, D: int, K: int, mean_embedding: F32) -> poison.Attack:
    """An attack on the gate: all of the update in one class column nobody else supports.

    The column of the class with the fewest honest supporters (then the most negative mean honest
    bias delta) gets ``size x`` the median honest update norm in the direction that raises that
    class's logit on typical samples (the attacker's mean embedding, and the bias); every other value
    is 0, so the attacker alone supports the column and the candidate carries it. ``size`` 1: as far
    as the norm bound lets it each round; small: a creep meant to pass every vote.
    """
    m = mean_embedding.astype(np.float64)
    v = np.concatenate([m / max(float(np.linalg.norm(m)), 1e-30), [1.0]])
    v /= np.linalg.norm(v)

    def attack(own: F32, benign: Sequence[F32]) -> F32:
        x = np.stack([u.astype(np.float64) for u in benign[1:]])  # the honest devices' real deltas
        bias = x[:, D * K :]
        c = int(np.lexsort((bias.mean(axis=0), (bias > 0).sum(axis=0)))[0])
        out = np.zeros((D + 1, K))
        out[:, c] = size * float(np.median(np.linalg.norm(x, axis=1))) * v
        return flatten(out).astype(np.float32)

    return attack


GATE_ATTACKS = ("column", "creep")
"""Attacks on the gate itself, beside bench.poison's: :func:`column_attack` at size 1 and 0.2."""


def gated_poisoned(
    task: Task, profile: CoordinatorProfile, attack: str | None, seed: int, make: Factory, gate: Gate
) -> float:
    """``bench.poison.run_poisoned`` for a gated rule; the final test accuracy.

    As there (the same task, arrival order, closing rule and attacks, device 0 answering first), but
    the devices keep their data as the agent does (``DeviceCore.keep``: every
    ``training.holdout_every``-th sample in the holdout they vote on), and device 0, when attacking,
    also votes as :func:`liar_votes` and sends :data:`GATE_ATTACKS` too.
    """
    strategy = make()
    rounds = profile.rounds
    order = np.random.default_rng(seed + 17)
    W, b = task.W0.copy(), task.b0.copy()
    D, K = int(W.shape[0]), int(W.shape[1])
    gated = GatedRound(strategy, gate, (D, K))
    attacks: dict[str, poison.Attack] = dict(poison.ATTACKS)
    mean0 = task.dev_emb[poison.ATTACKER].mean(axis=0)
    attacks.update(column=column_attack(1.0, D, K, mean0), creep=column_attack(0.2, D, K, mean0))
    if gate.server_per_class:
        emb, y = digits_embeddings()[:2]
        judge = server_set(split_digits(y).devices, y, gate.server_per_class, seed)
        server_x, server_y = emb[judge], y[judge]
    version = 0
    with tempfile.TemporaryDirectory(dir=STATE_ROOT) as tmp:
        devs = []
        gov = Governor(4096 << 20, 0, 0)
        for i, (e, y) in enumerate(zip(task.dev_emb, task.dev_y, strict=True)):
            name = f"dev{i}"
            profile_i = learning._device_profile(name, task.seed * 100_000 + i * 1000, Path(tmp))
            training = replace(profile_i.training, holdout_every=gate.holdout_every)
            core = DeviceCore(
                replace(profile_i, training=training),
                Head(task.W0, task.b0, 0), learning.model_sha256(task), governor=gov,
                store_capacity=max(len(y), 1),
            )  # fmt: skip
            core.keep(e.astype(np.float32), y.astype(np.int64))
            devs.append(learning.Device(name, core, len(y)))
        holdouts = [holdout_of(d.core) for d in devs]
        for r in range(1, poison.bench_rounds(profile) + 1):
            cfg = gated.configure_round(r)
            rtask = replace(task, lr=rounds.lr * rounds.lr_decay ** (r - 1))
            real = [
                learning.client_update(rtask, dev, version, r, Compression.NONE, cfg.prox_mu)[0]
                for dev in devs
            ]
            flat = [np.concatenate([u.delta_W.ravel(), u.delta_b]) for u in real]
            sends = list(flat)
            if attack is not None:
                sends[poison.ATTACKER] = attacks[attack](flat[poison.ATTACKER], flat)
            honest = [i for i in range(N_DEVICES) if i != poison.ATTACKER]
            arrivals = [poison.ATTACKER, *order.permutation(honest)]
            if attack is None:
                arrivals = list(order.permutation(N_DEVICES))
            close_at = Round(
                r, version, (D, K), cfg.deadline_s, cfg.min_clients, online=frozenset(d.name for d in devs),
                quorum=rounds.quorum, min_updates=strategy.min_updates,
            ).close_at  # fmt: skip
            votes: list[list[bool]] = []
            for i in arrivals:
                if strategy.accepted >= close_at:
                    break
                claims = devs[i].core.personal_columns
                if attack is not None and i == poison.ATTACKER:
                    # the classes too few honest devices declare: the columns its claim gets an item in
                    honest_claims = np.sum(
                        [d.core.personal_columns for d in devs if d is not devs[i]], axis=0
                    )
                    claims = honest_claims < strategy.tolerate + (1 if gate.per_supporter else 0)
                gated.declare(devs[i].name, claims)
                try:
                    dW, db = sends[i][: D * K].reshape(D, K), sends[i][D * K :]
                    strategy.offer(Offer(devs[i].name, dW, db, real[i].num_examples))
                except UpdateRejected:
                    continue
                if gated.pending is not None:
                    if attack is not None and i == poison.ATTACKER:
                        votes.append(
                            liar_votes(task.test_emb, task.test_y, W, b, gated.pending, gated.cols, gate)
                        )
                    else:
                        hx, hy = holdouts[i]
                        votes.append(device_votes(hx, hy, W, b, gated.pending, gated.cols, gate))
            if gate.server_per_class and gated.pending is not None:
                votes = [device_votes(server_x, server_y, W, b, gated.pending, gated.cols, gate)]
            W, b, refusal = gated.close(W, b, votes)
            if refusal is None:
                version += 1
            learning.deliver(task, devs, W, b, version, r)
            holdouts = [holdout_of(d.core) for d in devs]
    return task.accuracy(W, b)


def fleet_attack(rule: Rule, seed: int, profile: CoordinatorProfile) -> dict[str, Any]:
    """Both at once: the new-class fleet with device 4 hostile (every attack; it claims every class
    and votes as :func:`liar_votes`). The largest loss on classes 0-7 against the rule's clean run,
    and the lowest accuracy on 8 and 9 twenty rounds after their introduction, with their attacks."""
    clean = new_class_run(rule.make, seed, profile, gate=rule.gate)["accuracy_old"]
    runs = {
        a: new_class_run(rule.make, seed, profile, gate=rule.gate, liar=N_DEVICES - 1, attack=a)
        for a in (*poison.ATTACKS, *GATE_ATTACKS)
    }
    old = max(runs, key=lambda a: clean - runs[a]["accuracy_old"])
    new = min(runs, key=lambda a: runs[a]["accuracy_on_new"])
    return {
        "old_worst_loss": round(clean - runs[old]["accuracy_old"], 3), "old_worst_attack": old,
        "on_new_lowest": runs[new]["accuracy_on_new"], "on_new_lowest_attack": new,
    }  # fmt: skip


def run_all(
    rules: Sequence[Rule],
    seeds: Sequence[int] = SEEDS,
    sets: Mapping[str, object] | None = None,
    both: bool = False,
) -> dict[str, Any]:
    """Every rule on both goals (the shipped profile changed by ``sets``); the JSON of ``--json``.

    ``both``: also :func:`fleet_attack` (row key ``"fleet_attack"``: {SEED: {...}}).
    """
    profile = poison.shipped_profile("trimmed-mean", **(sets or {}))
    out = []
    for rule in rules:
        row: dict[str, Any] = {"rule": rule.name, "source": rule.source}
        new = {s: new_class_run(rule.make, s, profile, gate=rule.gate) for s in seeds}
        row["accuracy_on_new"] = {s: new[s]["accuracy_on_new"] for s in seeds}
        row["rounds_to_learn"] = {s: new[s]["rounds_to_learn"] for s in seeds}
        row["accuracy_old"] = {s: new[s]["accuracy_old"] for s in seeds}
        row["curve"] = {s: new[s]["curve"] for s in seeds}
        row["accuracy_on_new_mean"] = {s: new[s]["accuracy_on_new_mean"] for s in seeds}
        if rule.gate is not None:
            liar = {
                s: new_class_run(rule.make, s, profile, gate=rule.gate, liar=N_DEVICES - 1) for s in seeds
            }
            row["accuracy_on_new_one_liar"] = {s: liar[s]["accuracy_on_new"] for s in seeds}
            row["columns_kept"] = {s: new[s]["columns_kept"] for s in seeds}
        row["poison"] = {s: poison_worst(rule.make, s, sets, rule.gate) for s in seeds}
        if both:
            row["fleet_attack"] = {s: fleet_attack(rule, s, profile) for s in seeds}
        row["meets_both"] = all(row["accuracy_on_new"][s] >= GOAL_ACCURACY for s in seeds) and all(
            p["worst_loss"] <= POISON_GOAL for p in row["poison"].values()
        )
        logging.info("%s", json.dumps(row))
        out.append(row)
    goal = {"accuracy_on_new": GOAL_ACCURACY, "within_rounds": GOAL_ROUNDS, "poison_worst_loss": POISON_GOAL}
    settings = {
        "devices": N_DEVICES, "pre_rounds": PRE_ROUNDS, "post_rounds": POST_ROUNDS,
        "samples_per_round": PER_ROUND, "new_classes": list(NEW_CLASSES), "seeds": list(seeds),
        "profile_changes": dict(sets or {}),
    }  # fmt: skip
    return {"goal": goal, "settings": settings, "rules": out}


def markdown(doc: dict[str, Any]) -> str:
    """The table: accuracy on new at +20 rounds and worst poisoning loss, per seed."""
    seeds = doc["settings"]["seeds"]
    head = " | ".join(f"on new, s{s}" for s in seeds) + " | " + " | ".join(f"worst loss, s{s}" for s in seeds)
    lines = [f"| rule | {head} |", "|---|" + "---:|" * (2 * len(seeds))]
    for row in doc["rules"]:
        new = " | ".join(f"{row['accuracy_on_new'][s]:.2f}" for s in seeds)
        worst = " | ".join(
            f"{row['poison'][s]['worst_loss']:.3f} ({row['poison'][s]['worst_attack']})" for s in seeds
        )
        lines.append(f"| {row['rule']} | {new} | {worst} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.newclass [--json PATH] [--rule NAME ...] [--seed N ...] [--set KEY=VALUE ...]``."""
    p = argparse.ArgumentParser(prog="python -m bench.newclass", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--rule", action="append", help="only these rules, by name (repeatable)")
    p.add_argument("--seed", action="append", type=int, help="seeds (repeatable; default 0 and 1)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="change the shipped coordinator profile, e.g. rounds.lr=0.1 (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--both", action="store_true",
        help="also the new-class fleet with one hostile device (every attack), per rule and seed",
    )  # fmt: skip
    args = p.parse_args(argv)
    sets = dict(item.partition("=")[::2] for item in args.set)
    rules = {r.name: r for r in candidates(sets)}
    unknown = [n for n in args.rule or [] if n not in rules]
    if unknown:
        p.error(f"--rule {unknown[0]!r}: choose one of {', '.join(rules)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    logging.getLogger("edgefl").setLevel(logging.WARNING)  # the device cores log every head applied
    chosen = [rules[n] for n in args.rule] if args.rule else list(rules.values())
    doc = run_all(chosen, tuple(args.seed) if args.seed else SEEDS, sets, args.both)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
