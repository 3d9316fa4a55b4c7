"""Client-level differential privacy at the coordinator (central DP): clip each update, add Gaussian noise.

``DPFedAvg`` wraps a FedAvg-family strategy; ``ledger_epsilon`` accounts the privacy loss with the
optional ``dp-accounting`` library (``docs/security.md``, "Differential privacy").

Source: McMahan, Ramage, Talwar, Zhang 2018, "Learning Differentially Private Recurrent Language
Models" (ICLR), Algorithm 1; Abadi et al. 2016 (clipping); Mironov 2017 (Renyi DP).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from edgefl.coordinator.fedavg import FedAvg, RunningWeightedSum
from edgefl.coordinator.normbound import clip_factor, scale_delta, update_norm
from edgefl.coordinator.strategies import ROUND_SETTINGS
from edgefl.coordinator.strategy import Offer, RoundConfig, RoundReport, SiteSums, Strategy, array_from
from edgefl.types import F32


def clip_update(delta_W: F32, delta_b: F32, clip_norm: float) -> tuple[F32, F32, float]:
    """Scale an update down so that the L2 norm of ``(delta_W, delta_b)`` is at most ``clip_norm``.

    ``delta_W`` float32 [D, K], ``delta_b`` float32 [K], ``clip_norm`` C > 0. Returns (clipped_W,
    clipped_b, the norm before clipping); ValueError if ``clip_norm <= 0`` or the update is not finite.

    Source: Abadi et al. 2016, "Deep Learning with Differential Privacy", Algorithm 1 (clip step).
    """
    if clip_norm <= 0:
        raise ValueError(f"clip_norm = {clip_norm}: must be > 0")
    norm = update_norm(delta_W, delta_b)
    if not math.isfinite(norm):
        raise ValueError("clip_update: update is not finite")
    f = clip_factor(norm, clip_norm)
    return scale_delta(delta_W, f), scale_delta(delta_b, f), norm


class PrivateSum:
    """Streaming DP-FedAvg aggregate of one round: clipped updates summed as they arrive, noise at the end.

    ``shape`` (D, K); ``clip_norm`` C > 0, the bound on each update's joint L2 norm.

    Source: McMahan et al. 2018, Algorithm 1.
    """

    def __init__(self, shape: tuple[int, int], clip_norm: float) -> None:
        if clip_norm <= 0:
            raise ValueError(f"clip_norm = {clip_norm}: must be > 0")
        self.shape = shape
        self.clip_norm = clip_norm
        self._sum_W = RunningWeightedSum(shape)
        self._sum_b = RunningWeightedSum((shape[1],))
        self.count = 0
        self.clipped = 0

    def add(self, delta_W: F32, delta_b: F32) -> float:
        """Clip one update (float32 [D, K], [K]) into the sum; its norm before clipping (ValueError: bad)."""
        if delta_W.shape != self.shape or delta_b.shape != (self.shape[1],):
            raise ValueError(f"PrivateSum: delta {delta_W.shape}/{delta_b.shape}, head {self.shape}")
        cW, cb, norm = clip_update(delta_W, delta_b, self.clip_norm)
        self._sum_W.add(cW, 1)
        self._sum_b.add(cb, 1)
        self.count += 1
        self.clipped += int(norm > self.clip_norm)
        return norm

    def add_sum(self, sum_W: npt.NDArray[np.float64], sum_b: npt.NDArray[np.float64], count: int) -> None:
        """Fold a site's sum of ``count`` clipped updates in (root); ValueError on a bad shape or count."""
        if sum_W.shape != self.shape or sum_b.shape != (self.shape[1],) or count < 1:
            raise ValueError(f"PrivateSum: sums {sum_W.shape}/{sum_b.shape} of {count}, head {self.shape}")
        self._sum_W.add_sum(sum_W, count)
        self._sum_b.add_sum(sum_b, count)
        self.count += count

    def sums(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Copies of the float64 sums of clipped updates (W [D, K], b [K])."""
        return self._sum_W.sum, self._sum_b.sum

    def noisy_mean(
        self, noise_multiplier: float, expected_clients: float, rng: np.random.Generator
    ) -> tuple[F32, F32]:
        """``(sum + N(0, (z C)^2 I)) / expected_clients``: float32 (mean_dW [D, K], mean_db [K]).

        ``noise_multiplier`` z >= 0 (0: clipping only); ``expected_clients`` > 0; ValueError otherwise.
        """
        if noise_multiplier < 0 or expected_clients <= 0:
            raise ValueError(f"noise_multiplier = {noise_multiplier}, expected_clients = {expected_clients}")
        sd = noise_multiplier * self.clip_norm
        W, b = self.sums()
        W = (W + rng.normal(0.0, sd, W.shape)) / expected_clients
        b = (b + rng.normal(0.0, sd, b.shape)) / expected_clients
        return W.astype(np.float32), b.astype(np.float32)


def ledger_epsilon(runs: Sequence[tuple[float, float, int]], delta: float) -> float:
    """Client-level epsilon at ``delta`` of DP-FedAvg rounds whose settings may have changed at restarts.

    ``runs``: ``(noise_multiplier z >= 0, sampling_rate q in (0, 1], rounds >= 0)`` of consecutive
    rounds with the same settings (q: the chance a device takes part in a round); ``delta`` in (0, 1).
    Returns the RDP accountant's epsilon (as Opacus and TF Privacy) of their composition (0.0 without
    rounds, inf when a run had no noise). Raises ValueError on out-of-range values, ImportError
    without ``dp-accounting``.

    Source: Mironov 2017 (RDP); Mironov, Talwar, Zhang 2019 (RDP of the sampled Gaussian); Google
    ``dp-accounting`` (a ``ComposedDpEvent`` of PoissonSampledDpEvent of a GaussianDpEvent per run).
    """
    if not 0 < delta < 1:
        raise ValueError(f"privacy accountant: delta = {delta}: must be in (0, 1)")
    for z, q, n in runs:
        if z < 0 or not 0 < q <= 1 or n < 0:
            raise ValueError(f"privacy accountant: noise_multiplier={z}, sampling_rate={q}, rounds={n}")
    live = [(z, q, n) for z, q, n in runs if n > 0]
    if not live:
        return 0.0
    if any(z == 0 for z, _, _ in live):
        return math.inf
    return _account(live, delta)


def _account(runs: Sequence[tuple[float, float, int]], delta: float) -> float:
    """Epsilon at ``delta`` of the runs ``(z, q, rounds)`` of a Poisson-sampled Gaussian, composed."""
    import dp_accounting  # type: ignore[import-untyped, import-not-found, unused-ignore]

    events = [
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), n
        )
        for z, q, n in runs
    ]
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events))
    return float(acc.get_epsilon(delta))


class PrivacyLedger:
    """The DP rounds run: durable, so epsilon survives restarts (and never goes down when settings change).

    ``runs``: ``(noise_multiplier, sampling_rate, rounds)`` of consecutive rounds with the same settings.
    """

    def __init__(self) -> None:
        self.runs: list[tuple[float, float, int]] = []

    def add(self, noise_multiplier: float, sampling_rate: float) -> None:
        """Count one more aggregated round of these settings."""
        if self.runs and self.runs[-1][:2] == (noise_multiplier, sampling_rate):
            z, q, n = self.runs[-1]
            self.runs[-1] = (z, q, n + 1)
        else:
            self.runs.append((noise_multiplier, sampling_rate, 1))

    def epsilon(self, delta: float) -> float:
        """Epsilon of every round run, at ``delta`` (``ledger_epsilon``)."""
        return ledger_epsilon(self.runs, delta)

    def snapshot(self) -> list[list[float]]:
        """The runs as CBOR-able lists."""
        return [[z, q, n] for z, q, n in self.runs]

    def restore(self, runs: Sequence[Sequence[float]]) -> None:
        """Put back a :meth:`snapshot`; ValueError if an entry is not ``[z >= 0, 0 < q <= 1, n >= 0]``."""
        out = []
        for z, q, n in runs:
            if not (float(z) >= 0 and 0 < float(q) <= 1 and int(n) >= 0):
                raise ValueError(f"privacy ledger entry {[z, q, n]}: need z >= 0, 0 < q <= 1, rounds >= 0")
            out.append((float(z), float(q), int(n)))
        self.runs = out


class DPFedAvg(Strategy):
    """Central DP around a FedAvg-family strategy: fixed clipping, Gaussian noise, the inner server step.

    Updates are clipped to ``clip_norm`` C > 0 and summed unweighted (``PrivateSum``); ``aggregate``
    adds noise of sd ``noise_multiplier`` z >= 0 times C, divides by ``expected_clients`` > 0 and applies
    the ``inner`` strategy's server step. Every aggregated round counts towards epsilon at ``delta``
    (a refused one too); ``sampling_rate`` q defaults to ``inner.fraction``, ``rng`` to an OS seed.
    ValueError if ``inner`` is not of the FedAvg family (no sensitivity bound of C / n), or on
    out-of-range arguments.

    Source: McMahan, Ramage, Talwar, Zhang 2018, Algorithm 1 (DP-FedAvg, fixed denominator);
    as Flower's ``DifferentialPrivacyServerSideFixedClipping`` wraps a strategy.
    """

    def __init__(
        self,
        inner: Strategy,
        *,
        clip_norm: float,
        noise_multiplier: float,
        expected_clients: float,
        delta: float = 1e-5,
        sampling_rate: float | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        if not isinstance(inner, FedAvg):
            raise ValueError(f"DP wraps fedavg, fedprox, fedavgm, fedadam or fedyogi, not {inner.name}")
        if noise_multiplier < 0 or expected_clients <= 0 or not 0 < delta < 1:
            raise ValueError(
                f"noise_multiplier = {noise_multiplier}, expected_clients = {expected_clients}, "
                f"delta = {delta}: need >= 0, > 0, in (0, 1)"
            )
        inherited = (*ROUND_SETTINGS, "server_lr", "fraction", "seed", "tolerate")  # the clip norm is its own
        super().__init__(clip_norm=clip_norm, **{name: getattr(inner, name) for name in inherited})
        self.inner: FedAvg = inner
        self.name = f"dp-{inner.name}"
        self.server_state = inner.server_state  # one dict: refuse() restores the inner's state
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.expected_clients = expected_clients
        self.delta = delta
        self.sampling_rate = inner.fraction if sampling_rate is None else sampling_rate
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"sampling_rate = {self.sampling_rate}: must be in (0, 1]")
        self.rng = rng if rng is not None else np.random.default_rng()
        self.ledger = PrivacyLedger()

    def durable_state(self) -> dict[str, Any]:
        """The inner state and the privacy ledger (``PrivacyLedger``): epsilon survives restarts."""
        return {**super().durable_state(), "dp": self.ledger.snapshot()}

    def restore_durable(self, doc: Mapping[str, Any]) -> None:
        """Put back :meth:`durable_state` (the ledger's rounds count towards epsilon from now on)."""
        super().restore_durable(doc)
        self.ledger.restore(doc.get("dp", []))

    def round_config(self, round_no: int) -> RoundConfig:
        """The inner strategy's settings."""
        return self.inner.round_config(round_no)

    def _begin(self, shape: tuple[int, int]) -> None:
        self._sum = PrivateSum(shape, self.clip_norm)

    def _fold(self, update: Offer) -> None:
        self._sum.add(update.delta_W, update.delta_b)

    def _site_sums(self) -> SiteSums:
        # unweighted sum of clipped updates: the weight is the update count (noise is the root's)
        W, b = self._sum.sums()
        return SiteSums("sum", W, b, float(self._sum.count), self._sum.count, self._sum.clipped)

    def _fold_sums(self, sums: SiteSums) -> None:
        self._sum.add_sum(sums.W, sums.b, sums.count)

    def _snapshot(self) -> dict[str, Any]:
        W, b = self._sum.sums()
        return {"W": W.tobytes(), "b": b.tobytes(), "count": self._sum.count, "clipped": self._sum.clipped}

    def _restore(self, acc: dict[str, Any], shape: tuple[int, int]) -> None:
        if int(acc["count"]) > 0:
            W, b = array_from(acc["W"], np.float64, shape), array_from(acc["b"], np.float64, shape[1])
            self._sum.add_sum(W, b, int(acc["count"]))
            self._sum.clipped = int(acc["clipped"])

    def _aggregate(self, W: F32, b: F32) -> tuple[F32, F32]:
        mean_dW, mean_db = self._sum.noisy_mean(self.noise_multiplier, self.expected_clients, self.rng)
        self.ledger.add(self.noise_multiplier, self.sampling_rate)
        return self.inner.step(W, b, mean_dW, mean_db)

    def epsilon(self) -> float:
        """Epsilon spent by every round aggregated, restarts included, at ``delta`` (``ledger_epsilon``)."""
        return self.ledger.epsilon(self.delta)

    def report(self) -> RoundReport:
        """Clipping figures plus epsilon at ``delta``."""
        base = super().report()
        return replace(base, epsilon=self.epsilon(), delta=self.delta)
