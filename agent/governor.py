"""The memory governor: knows the cap, measures each phase's peak RSS and admits phases under the cap.

A phase's peak is exact (the kernel's peak counter reset at its start); admission: :meth:`Governor.admit`
and ``docs/operations.md`` ("Memory: shrunk, refused, deferred, declined").

Source: proc(5) (``status`` VmHWM, ``clear_refs`` value 5 resets the peak RSS, Linux >= 4.0).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final, Literal

from edgefl.agent.estimates import (
    ModelShapes,
    estimate_batch_bytes,
    estimate_inference_bytes,
    estimate_personal_bytes,
    estimate_replay_bytes,
    estimate_train_bytes,
)
from edgefl.agent.memstat import (
    CGROUP_ROOT,
    MIB,
    PROC,
    cgroup_memory_limit_bytes,
    peak_rss_bytes,
    pss_bytes,
    reset_peak,
    rss_bytes,
    system_available_bytes,
)

logger = logging.getLogger(__name__)

#: The phases of the agent, in the order of a round (batch preparation runs inside inference).
PHASES = ("inference", "train", "encode", "publish", "apply")
#: Phases that can wait for a later round; inference cannot (shrunk to its floor, then refused).
DEFERRABLE = frozenset({"train", "encode", "publish", "personal"})
PSS_MAX_AGE_S: Final = 10.0
"""Seconds between two PSS reads of :meth:`Governor.status` (``smaps_rollup`` walks every mapping)."""
#: Phases held back while the system's MemAvailable is under the profile's threshold.
SYSTEM_GUARDED = frozenset({"train", "personal"})


@dataclass(frozen=True, slots=True)
class Admission:
    """The governor's answer to one phase's request.

    ``phase`` one of :data:`PHASES` (others allowed); ``work`` the granted size (samples per batch or
    chunk, halved down to the floor) of the ``requested_work``; ``estimate_bytes`` at ``work``;
    ``budget_bytes`` ``cap - reserve - rss`` at the request (``cap - rss`` for a phase that cannot
    wait), may be < 0; ``rss_bytes`` at the request; ``deferred`` True: do not run the phase now (over
    budget at its floor, or the system short of memory); ``reason`` empty when admitted as asked, else
    why the work was shrunk or deferred; ``at_s`` ``time.time()`` of the decision.
    """

    phase: str
    work: int
    requested_work: int
    estimate_bytes: int
    budget_bytes: int
    rss_bytes: int
    deferred: bool
    reason: str
    at_s: float

    @property
    def shrunk(self) -> bool:
        """Whether less work than asked was granted."""
        return self.work < self.requested_work

    def as_dict(self) -> dict[str, Any]:
        """JSON-like form (status message, dashboard): every field by name."""
        return {f: getattr(self, f) for f in _ADMISSION_FIELDS}


_ADMISSION_FIELDS: Final = tuple(f.name for f in fields(Admission))

PeakMethod = Literal["auto", "clear_refs", "sampling"]


class Governor:
    """Knows the cap, measures each phase's peak RSS, and admits phases under ``cap - reserve``.

    Parameters
    ----------
    cap_bytes : int
        The profile's cap (``memory.cap_mb`` in bytes), > 0; :attr:`cap_bytes` is then
        ``min(profile cap, cgroup limit)`` (both kept: ``profile_cap_bytes``, ``cgroup_limit_bytes``).
    reserve_bytes : int
        Headroom kept free under the cap for what the estimates do not cover, >= 0.
    min_system_available_bytes : int
        Defer :data:`SYSTEM_GUARDED` phases while ``MemAvailable`` is below this; 0 disables.
    proc, cgroup_root : Path
        Where the proc and cgroup file systems are mounted (fake trees in tests).
    peak_method : "auto" | "clear_refs" | "sampling"
        "auto" resets ``VmHWM`` through ``clear_refs`` and falls back to sampling RSS from a thread
        every ``sample_interval_s`` where the kernel refuses the write.

    Raises
    ------
    ValueError
        If ``cap_bytes`` is not positive or the other sizes are negative.

    Notes
    -----
    ``phase_peaks``, ``phase_last``: largest and latest peak RSS of each phase; ``phase_rise``: its
    largest rise above the RSS at its start (bytes). A phase resets ``VmHWM`` only when no other is
    running; an overlapping phase reports the peak since the earliest running phase began (an upper
    bound). :attr:`peak_rss_bytes` folds in every reading taken before each reset.
    """

    def __init__(
        self,
        cap_bytes: int,
        reserve_bytes: int,
        min_system_available_bytes: int,
        *,
        proc: Path = PROC,
        cgroup_root: Path = CGROUP_ROOT,
        peak_method: PeakMethod = "auto",
        sample_interval_s: float = 0.002,
    ) -> None:
        if cap_bytes <= 0 or reserve_bytes < 0 or min_system_available_bytes < 0:
            raise ValueError(
                f"Governor: cap_bytes={cap_bytes} must be > 0, reserve_bytes={reserve_bytes} and "
                f"min_system_available_bytes={min_system_available_bytes} >= 0"
            )
        self.proc = proc
        self.profile_cap_bytes = cap_bytes
        self.cgroup_limit_bytes = cgroup_memory_limit_bytes(proc=proc, cgroup_root=cgroup_root)
        self.cap_bytes = min(cap_bytes, self.cgroup_limit_bytes or cap_bytes)
        self.reserve_bytes = reserve_bytes
        self.min_system_available_bytes = min_system_available_bytes
        self.sample_interval_s = sample_interval_s
        self.phase_peaks: dict[str, int] = {}
        self.phase_last: dict[str, int] = {}
        self.phase_rise: dict[str, int] = {}
        self.phase_counts: dict[str, int] = {}
        self.max_work: dict[str, int] = {}
        self.admissions: dict[str, Admission] = {}
        self.deferrals: dict[str, int] = {}
        self.last_deferral: Admission | None = None
        self._pss: tuple[float, int | None] | None = None  # (time.monotonic(), bytes) of the last PSS read
        self._lock = threading.Lock()
        self._active = 0
        self._peak = self._read_peak()  # the process's peak before this governor, kept across resets
        if peak_method == "sampling":
            self.peak_method: PeakMethod = "sampling"
        elif reset_peak(proc=proc):
            self.peak_method = "clear_refs"
        elif peak_method == "clear_refs":
            raise ValueError(f"Governor: {proc}/self/clear_refs is not writable")
        else:
            logger.info("cannot reset VmHWM through clear_refs; phase peaks are sampled")
            self.peak_method = "sampling"
        self._peak = max(self._peak, self._read_peak())
        if self.cgroup_limit_bytes is not None and self.cgroup_limit_bytes < cap_bytes:
            logger.info(
                "memory cap %.1f MiB (cgroup limit; profile says %.1f MiB)",
                self.cap_bytes / MIB,
                cap_bytes / MIB,
            )

    # --- measurement -----------------------------------------------------------------------
    def rss_bytes(self) -> int:
        """Current RSS in bytes (``statm``)."""
        return rss_bytes(proc=self.proc)

    def _read_peak(self) -> int:
        try:
            return peak_rss_bytes(proc=self.proc)
        except OSError:
            return self.rss_bytes()

    @property
    def peak_rss_bytes(self) -> int:
        """Lifetime peak RSS of the process in bytes, across every peak reset."""
        value = self._read_peak()
        with self._lock:
            self._peak = max(self._peak, value)
            return self._peak

    def system_available_bytes(self) -> int | None:
        """``MemAvailable`` in bytes, or None where the kernel does not report it."""
        try:
            return system_available_bytes(proc=self.proc)
        except OSError:
            return None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the peak RSS of the block as phase ``name`` (one of :data:`PHASES`, others allowed)."""
        sampler: _Sampler | None = None
        start = self.rss_bytes()
        with self._lock:
            self._active += 1
            if self.peak_method == "clear_refs" and self._active == 1:
                self._peak = max(self._peak, self._read_peak())
                if not reset_peak(proc=self.proc):
                    self.peak_method = "sampling"
        if self.peak_method == "sampling":
            sampler = _Sampler(self.proc, self.sample_interval_s)
        try:
            yield
        finally:
            peak = sampler.stop() if sampler is not None else self._read_peak()
            with self._lock:
                self._active -= 1
                self._peak = max(self._peak, peak)
                self.phase_last[name] = peak
                self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), peak)
                self.phase_rise[name] = max(self.phase_rise.get(name, 0), peak - start)
                self.phase_counts[name] = self.phase_counts.get(name, 0) + 1

    # --- admission ---------------------------------------------------------------------------
    def admit(
        self,
        phase: str,
        estimate: Callable[[int], int],
        work: int,
        floor: int,
        *,
        keep: Callable[[int], int] | None = None,
        probe: bool = False,
    ) -> Admission:
        """Decide how much of a phase may run now.

        While ``rss + estimate(work) > cap - reserve`` and ``work > floor``, halve ``work`` (never
        below ``floor``); a phase that is not :data:`DEFERRABLE` may use the reserve (its test is
        ``rss + estimate(work) > cap``). If it still does not fit, ``deferred`` is True and the reason
        says why. A :data:`SYSTEM_GUARDED` phase is also deferred while ``MemAvailable`` is under
        ``min_system_available_bytes``.

        Parameters
        ----------
        estimate : callable(int) -> int
            Bytes the phase needs for a work size (samples; one of the ``estimate_*`` functions).
        work, floor : int
            Work size asked for, >= 1, and the smallest worth running, >= 1 (clamped to ``work``).
        keep : callable(int) -> int, optional
            Bytes that must stay free beside the estimate at a work size (not part of the estimate).
        probe : bool
            Only tell: nothing is kept, counted or logged (a caller choosing between two asks).

        Returns
        -------
        Admission
            Also kept in ``admissions[phase]``; a deferral increments ``deferrals[phase]``.
        """
        work = max(1, int(work))
        floor = max(1, min(int(floor), work))
        can_defer = phase in DEFERRABLE
        rss = self.rss_bytes()
        # the reserve is kept for the phases that cannot wait (inference): they may use it, never the cap
        budget = self.cap_bytes - (self.reserve_bytes if can_defer else 0) - rss
        granted = work

        def room(n: int) -> int:
            return budget - (keep(n) if keep is not None else 0)

        need = int(estimate(granted))
        while need > room(granted) and granted > floor:
            granted = max(floor, granted // 2)
            need = int(estimate(granted))
        deferred = False
        reason = ""
        if need > room(granted):
            # work judged over budget is never run: a deferrable phase waits for a later round, any
            # other is refused for now (the caller frees what it can, retries, or counts the refusal)
            deferred = True
            if can_defer:
                reason = (
                    f"{phase}: needs {need / MIB:.1f} MiB at {granted}, "
                    f"{max(0, budget) / MIB:.1f} MiB left under cap - reserve"
                )
            else:
                reason = (
                    f"{phase}: over budget at floor {granted} ({need / MIB:.1f} MiB > "
                    f"{budget / MIB:.1f} MiB left under the cap); not run"
                )
        elif granted < work:
            reason = f"{phase}: shrunk {work} -> {granted} to fit {budget / MIB:.1f} MiB"
        if not deferred and phase in SYSTEM_GUARDED and self.min_system_available_bytes > 0:
            available = self.system_available_bytes()
            if available is not None and available < self.min_system_available_bytes:
                deferred = True
                reason = (
                    f"{phase}: system MemAvailable {available / MIB:.0f} MiB < "
                    f"{self.min_system_available_bytes / MIB:.0f} MiB"
                )
        decision = Admission(phase, granted, work, need, budget, rss, deferred, reason, time.time())
        return decision if probe else self.keep(decision)

    def keep(self, decision: Admission) -> Admission:
        """Keep, count and log an admission as :meth:`admit` does (a probe the caller goes ahead with)."""
        phase = decision.phase
        with self._lock:
            self.admissions[phase] = decision
            if decision.deferred:
                self.deferrals[phase] = self.deferrals.get(phase, 0) + 1
                self.last_deferral = decision
            else:
                self.max_work[phase] = max(self.max_work.get(phase, 0), decision.work)
        if decision.reason:
            logger.info("memory governor: %s", decision.reason)
        return decision

    def admit_inference(
        self,
        shapes: ModelShapes,
        batch: int,
        *,
        resident_batch: int | None = None,
        prep: Literal["fused", "unfused"] | None = None,
        keep_bytes: int = 0,
    ) -> Admission:
        """Admit an interpreter call on ``batch`` samples (floor 1; refused when even 1 is over budget).

        A call may use the reserve, but a batch that grows the arena (kept for the process's life) is
        admitted only if it leaves the reserve and ``keep_bytes`` (the smallest training run) free
        under the cap, else it is shrunk. ``resident_batch``: the batch the arena is allocated for
        (``Pipeline.tensor_batch``; default the largest admitted so far); ``prep``: count the batch
        preparation too (one call does both, as ``Pipeline.run``).
        """
        resident = self.max_work.get("inference", 0) if resident_batch is None else resident_batch

        def need(n: int) -> int:
            total = estimate_inference_bytes(shapes, n, resident_batch=resident)
            if prep is not None:
                total += estimate_batch_bytes(shapes, n, fused=prep == "fused")
            return total

        def kept(n: int) -> int:
            # the model's load allocated the arena for one sample: one never grows it
            return self.reserve_bytes + keep_bytes if n > max(1, resident) else 0

        return self.admit("inference", need, batch, 1, keep=kept)

    def admit_train(
        self,
        chunk: int,
        floor: int,
        *,
        dim: int,
        classes: int,
        batch_size: int,
        num_examples: int,
        resident_rows: int = 0,
        personal: bool = False,
        probe: bool = False,
        phase: Literal["train", "personal"] = "train",
    ) -> Admission:
        """Admit a pass over the store with ``chunk`` samples per store chunk (halved down to ``floor``).

        ``phase="train"``: local training (:func:`estimate_train_bytes`); with ``personal`` the
        personal head trains alongside (``train_local``'s ``personal``), its head and gradient counted
        too. ``phase="personal"``: a personal-head step of its own (:func:`estimate_personal_bytes`).
        ``resident_rows``: stored samples already mapped in (``EmbeddingStore.resident_rows``).
        ``probe``: as :meth:`admit`'s (nothing kept or counted).
        """
        first = self.phase_counts.get("train", 0) == 0
        heads = 2 * (dim * classes + classes) * 4 if personal else 0

        def need(n: int) -> int:
            if phase == "personal":
                return estimate_personal_bytes(
                    n, dim, classes, batch_size, num_examples, resident_rows=resident_rows
                )
            return heads + estimate_train_bytes(
                n, dim, classes, num_examples, first_run=first, resident_rows=resident_rows
            )

        return self.admit(phase, need, chunk, floor, probe=probe)

    def admit_replay(self, path: Path) -> Admission:
        """Admit loading a replay file (``source.path``) whole; it cannot wait, so it may use the reserve.

        OSError, ValueError as :func:`~edgefl.agent.estimates.estimate_replay_bytes`.
        """
        need = estimate_replay_bytes(path)
        return self.admit("replay", lambda _: need, 1, 1)

    # --- report ------------------------------------------------------------------------------
    def _pss_bytes(self) -> int | None:
        """PSS in bytes (None where unreadable), read again once :data:`PSS_MAX_AGE_S` old."""
        now = time.monotonic()
        if self._pss is None or now - self._pss[0] >= PSS_MAX_AGE_S:
            self._pss = (now, pss_bytes(proc=self.proc))
        return self._pss[1]

    def status(self, measure: bool = True, figures: bool = True) -> dict[str, Any]:
        """JSON-like memory figures for the status message and the dashboard.

        Returns
        -------
        dict
            ``cap_bytes``, ``profile_cap_bytes``, ``cgroup_limit_bytes``, ``reserve_bytes``,
            ``rss_bytes``, ``pss_bytes`` (None where unreadable), ``peak_rss_bytes`` (lifetime),
            ``system_available_bytes``, ``min_system_available_bytes``, ``peak_method``,
            ``phase_peaks``, ``phase_last``, ``phase_rise`` {phase: bytes}, ``admissions``
            {phase: Admission as dict}, ``deferrals`` {phase: count}, ``last_deferral`` (dict or None).
            ``measure=False`` leaves out the four figures read from ``/proc`` (milliseconds to read;
            PSS is read at most every :data:`PSS_MAX_AGE_S`), ``figures=False`` the per-phase
            figures and the admissions, which change with every round.
        """
        peak = self.peak_rss_bytes if measure else 0
        with self._lock:
            out: dict[str, Any] = {
                "cap_bytes": self.cap_bytes,
                "profile_cap_bytes": self.profile_cap_bytes,
                "cgroup_limit_bytes": self.cgroup_limit_bytes,
                "reserve_bytes": self.reserve_bytes,
            }
            if measure:
                out["rss_bytes"] = self.rss_bytes()
                out["pss_bytes"] = self._pss_bytes()
                out["peak_rss_bytes"] = peak
                out["system_available_bytes"] = self.system_available_bytes()
            out["min_system_available_bytes"] = self.min_system_available_bytes
            out["peak_method"] = self.peak_method
            if figures:
                out["phase_peaks"] = dict(self.phase_peaks)
                out["phase_last"] = dict(self.phase_last)
                out["phase_rise"] = dict(self.phase_rise)
                out["admissions"] = {k: v.as_dict() for k, v in self.admissions.items()}
            out["deferrals"] = dict(self.deferrals)
            out["last_deferral"] = self.last_deferral.as_dict() if self.last_deferral else None
            return out


class _Sampler:
    """Fallback peak measurement from creation: a thread reading RSS every ``interval_s`` (misses spikes)."""

    def __init__(self, proc: Path, interval_s: float) -> None:
        self.proc = proc
        self.interval_s = interval_s
        self.peak = rss_bytes(proc=proc)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edgefl-rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes(proc=self.proc))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_bytes(proc=self.proc))
