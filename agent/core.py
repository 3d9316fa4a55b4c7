"""The device core: the one object every caller of the device drives, without a transport.

:class:`DeviceCore` owns the device's model state and does two jobs itself: **classify** (raw samples
to predictions, the labelled embeddings kept in the store) and **global bytes in -> applied** (verify,
decode, validate, swap, persist). Its parts: the round (``agent/round.py``), the personal head and
evaluation (``agent/personal.py``), the state and its files (``agent/state.py``). It opens no socket and
never awaits; refusals come back as results with a reason, never as exceptions. Not thread-safe: one
caller thread at a time (the daemon's single worker).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from edgefl import heap
from edgefl.agent import estimates
from edgefl.agent.config import Profile
from edgefl.agent.governor import Admission, Governor
from edgefl.agent.pipeline import Pipeline, choose
from edgefl.agent.round import RoundAnswering
from edgefl.agent.state import PhaseHook, ProgressHook
from edgefl.datasets import npz_headers
from edgefl.errors import BudgetExceeded, DecodeError, ModelError, UpdateRejected
from edgefl.head import Head, personal_columns, validate_head
from edgefl.records import write_record
from edgefl.runtime import Backbone
from edgefl.types import F32, I64
from edgefl.wire.cbor import MessageType, Scanned, scan
from edgefl.wire.global_model import (
    GlobalModel,
    decode_global_model,
    encode_global_model,
    resolve_global_head,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Classified:
    """What :meth:`DeviceCore.classify` produced for a batch of N samples.

    ``embeddings`` float32 [N, D]; ``predictions`` int64 [N] class indices; ``version`` of the global
    head that produced them; ``scores`` float32 [N], the probability of each predicted class
    (:meth:`Head.scores`); ``head`` ``"personal"`` or ``"global"``, the one that classified
    (:meth:`DeviceCore.serving_head`). :meth:`DeviceCore.observe` counts the samples it did not store:
    ``refused_labels`` (label outside ``0..K-1``, ``bad_label``) and ``refused_not_finite``
    (embedding not finite, ``not_finite``).
    """

    embeddings: F32
    predictions: I64
    version: int
    refused_labels: int = 0
    refused_not_finite: int = 0
    scores: F32 | None = None
    head: str = "global"


class ApplyStatus(StrEnum):
    """What became of a global head (:attr:`ApplyResult.status`)."""

    APPLIED = "applied"
    SAME_VERSION = "same_version"
    """The version already running (a retained re-delivery): nothing to do."""
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """The outcome of one GlobalModel message.

    ``version`` of the message's head and the ``round`` it closed (0 when it did not decode);
    ``reason`` for REFUSED: ``wrong_model``, ``not_newer``, ``not_finite``, ``bad_shape``,
    ``unsigned``, ``bad_signature``, another DecodeError reason, or ``failed`` (not persisted).
    """

    status: ApplyStatus
    version: int = 0
    round: int = 0
    reason: str = ""
    detail: str = ""


def check_model_fits(profile: Profile, backbone: Backbone) -> None:
    """Refuse a model the profile's samples do not fit.

    Raises
    ------
    ModelError
        If ``pipeline.mean``/``std`` have neither 1 nor the model's channel count of values, or the
        replay file's samples do not have the model's input shape (exit code 3 at start-up).
    """
    channels = backbone.sample_shape[-1] if backbone.sample_shape else 1
    n = len(profile.pipeline.mean)
    if n not in (1, channels):
        raise ModelError(
            str(profile.model.path),
            f"model input has {channels} channel(s); pipeline.mean/std have {n} values",
        )
    src = profile.source
    if src.kind == "replay" and src.path is not None:
        try:  # the header only: the samples are loaded once admitted (the daemon's replay)
            shape = npz_headers(src.path)["x"][0][1:]
        except (KeyError, ValueError) as exc:
            raise ModelError(
                str(profile.model.path), f"source.path {src.path}: no sample array x ({exc})"
            ) from exc
        if shape != backbone.sample_shape:
            raise ModelError(
                str(profile.model.path),
                f"model expects samples of shape {backbone.sample_shape}, "
                f"source.path {src.path} holds {shape}",
            )


class DeviceCore(RoundAnswering):
    """The device: classify, answer a round, apply a global head. No transport, no asyncio.

    Parameters
    ----------
    profile : Profile
    head : Head
        The head to start from (the model's factory head, version 0); a persisted global head of
        the same model replaces it.
    model_sha256 : str
        sha256 of the backbone ``.tflite`` (global heads for another model are refused).
    pipeline : Pipeline or None
        Preprocessing + interpreter; None for a core that only trains (:meth:`classify` raises).
    governor, state_dir, store_capacity : optional
        Default: one from ``profile.memory``, ``profile.device.state_dir`` (created if missing),
        ``profile.training.store_capacity``.
    phase : callable(str) -> context manager, optional
        Wraps each phase; default ``governor.phase`` (a replacement must call it itself).
    progress : callable(state, reason), optional
        Told ``("training", reason)`` when local training starts.

    Raises
    ------
    OSError
        If the state directory cannot be created.
    EdgeflError
        If a configured key file cannot be read.
    """

    def __init__(
        self,
        profile: Profile,
        head: Head,
        model_sha256: str,
        *,
        pipeline: Pipeline | None = None,
        governor: Governor | None = None,
        state_dir: Path | None = None,
        store_capacity: int | None = None,
        phase: PhaseHook | None = None,
        progress: ProgressHook | None = None,
    ) -> None:
        super().__init__(
            profile,
            head,
            model_sha256,
            governor=governor,
            state_dir=state_dir,
            store_capacity=store_capacity,
            phase=phase,
        )
        self.pipeline = pipeline
        self.shapes = estimates.model_shapes(pipeline.backbone) if pipeline is not None else None
        self._labelled = sum(len(s) for s in self.stores)
        self.redelivered = 0  # retained heads of the version held, skipped before decoding
        self._open_personal()
        self._open_rounds(progress)

    @classmethod
    def open(
        cls,
        profile: Profile,
        *,
        governor: Governor | None = None,
        state_dir: Path | None = None,
        store_capacity: int | None = None,
        phase: PhaseHook | None = None,
        progress: ProgressHook | None = None,
        pipeline_mode: str | None = None,
    ) -> DeviceCore:
        """Load the profile's model and build the core around it (what ``edgefl run`` does).

        ``pipeline_mode`` (``"fused"``, ``"unfused"``, ``"auto"``) overrides ``pipeline.mode``; the
        other options as :class:`DeviceCore`'s.

        Raises
        ------
        ModelError
            If the model cannot be loaded or does not fit the profile's samples.
        """
        backbone = Backbone(
            profile.model.path,
            num_threads=profile.model.num_threads,
            runtime=profile.model.runtime,
            embedding_tensor=profile.model.embedding_tensor,
        )
        check_model_fits(profile, backbone)
        directory = Path(state_dir if state_dir is not None else profile.device.state_dir)
        directory.mkdir(parents=True, exist_ok=True)
        pcfg = profile.pipeline
        mode, batch = pipeline_mode or pcfg.mode, pcfg.batch
        if mode == "auto":
            mode, batch = choose(
                backbone,
                pcfg.mean,
                pcfg.std,
                batches=(1, 4, 8, 16),
                cache_dir=directory,
                raw_dtype=pcfg.raw_dtype,
            )
            if backbone.stateful:
                backbone.reset_state()  # the measurement's invokes changed the model's state
        pipeline = Pipeline(
            backbone, pcfg.mean, pcfg.std, mode="unfused" if mode == "unfused" else "fused", batch=batch
        )
        W, b = backbone.head_from_model()
        return cls(
            profile,
            Head(W, b, 0),
            backbone.backbone_sha256,
            pipeline=pipeline,
            governor=governor,
            state_dir=directory,
            store_capacity=store_capacity,
            phase=phase,
            progress=progress,
        )

    @property
    def new_samples(self) -> int:
        """Labelled samples stored since the device last trained for a round (status ``new_samples``)."""
        return self.store.since_mark

    # --- classify ---------------------------------------------------------------------------------
    def classify(self, raw: np.ndarray) -> Classified:
        """Embed and classify raw samples [N, *sample_shape], N >= 1 (phase ``inference``).

        Raises
        ------
        ValueError
            If ``raw`` is empty or not of the model's sample shape.
        RuntimeError
            If this core has no pipeline.
        BudgetExceeded
            If the memory governor judges even one sample over budget: nothing was run (retry later).
        """
        if self.pipeline is None or self.shapes is None:
            raise RuntimeError("this DeviceCore has no pipeline (training only)")
        step = self._admit_inference(self.pipeline, self.shapes, len(raw))
        parts: list[F32] = []
        for s in range(0, len(raw), step):
            with self.phase("inference"):
                parts.append(self.pipeline.run(raw[s : s + step])[0])
        emb = parts[0] if len(parts) == 1 else np.concatenate(parts)
        head, kind = self.serving_head()  # one reference read: a swap between batches is atomic
        classes, scores = head.scores(emb)
        return Classified(emb, classes, head.version, scores=scores, head=kind)

    def _admit_inference(self, pipeline: Pipeline, shapes: estimates.ModelShapes, n: int) -> int:
        """Rows per invoke granted for ``n`` samples (asked again after freeing heap; else BudgetExceeded)."""
        gov = self.governor
        cfg = self.profile.training
        # a grown arena stays: it must leave the smallest training run room under cap - reserve
        train_floor = estimates.estimate_train_bytes(
            cfg.chunk_floor,
            shapes.embedding_dim,
            shapes.classes,
            max(1, len(self.store)),
            first_run=gov.phase_counts.get("train", 0) == 0,
            resident_rows=self.store.resident_rows,
        )

        def ask() -> Admission:
            return gov.admit_inference(
                shapes,
                n,
                resident_batch=pipeline.allocated_batch,
                prep=pipeline.mode,
                keep_bytes=train_floor,
            )

        adm = ask()
        if adm.deferred:
            gc.collect()
            heap.malloc_trim()
            adm = ask()
            if adm.deferred:
                raise BudgetExceeded("inference", adm.estimate_bytes, max(0, adm.budget_bytes))
        if adm.shrunk and adm.work < pipeline.tensor_batch:
            pipeline.set_tensor_batch(adm.work)
        elif not adm.shrunk and pipeline.tensor_batch < min(n, pipeline.batch):
            pipeline.set_tensor_batch(min(n, pipeline.batch))
        return adm.work

    def observe(self, raw: np.ndarray, labels: I64, labelled: np.ndarray | None = None) -> Classified:
        """Classify samples and keep the labelled ones' embeddings in the store (:meth:`keep`).

        ``raw`` [N, *sample_shape]; ``labels`` int64 [N], ``0 <= label < K`` (0/1 for K = 1), ignored
        where ``labelled`` (bool [N], default all) is False (live ingest: those wait for a late
        label). The result covers all N samples, ``refused_*`` counting the labelled ones the store
        refused. Raises as :meth:`classify`, and ValueError for labels not matching the samples.
        """
        out = self.classify(raw)
        if labelled is None:
            refused, not_finite = self.keep(out.embeddings, labels)
        elif labelled.any():
            refused, not_finite = self.keep(out.embeddings[labelled], labels[labelled])
        else:
            refused = not_finite = 0
        if refused or not_finite:
            return dataclasses.replace(out, refused_labels=refused, refused_not_finite=not_finite)
        return out

    def keep(self, embeddings: F32, labels: I64) -> tuple[int, int]:
        """Keep labelled embeddings: every n-th in the holdout (``training.holdout_every``), others stored.

        ``embeddings`` float32 [M, D], ``labels`` int64 [M] (``0 <= label < K``, 0/1 for K = 1; others
        are refused, ``bad_label``). Returns ``(refused_labels, refused_not_finite)``: samples not
        stored for their label, and for a non-finite embedding.
        """
        every = self.profile.training.holdout_every
        if len(labels):
            self.personal_columns |= personal_columns(labels, self.head.shape[1])
        before = sum(s.refused_not_finite for s in self.stores)
        if self.holdout is None or not every:
            refused = self.store.add(embeddings, labels)
        else:
            # every n-th labelled sample is held out of training, for federated evaluation
            held = (self._labelled + np.arange(len(labels))) % every == every - 1
            self._labelled += len(labels)
            refused = self.store.add(embeddings[~held], labels[~held])
            if held.any():
                refused += self.holdout.add(embeddings[held], labels[held])
        after = sum(s.refused_not_finite for s in self.stores)
        # a full disk: the failed flush waits for retry_persist rather than failing at every batch
        if self._unflushed() >= self.profile.training.flush_every and "store" not in self._unsaved:
            self.flush()
        return refused, after - before

    # --- global heads -----------------------------------------------------------------------------
    def receive_global(self, payload: bytes) -> ApplyResult:
        """Global bytes in: verify, decode, validate, apply and persist a GlobalModel (phase ``apply``).

        ``payload``: the whole message (reassembled if it came in chunks). REFUSED with the reason for
        bad bytes, or for an unusable head: ``wrong_model``, ``bad_shape``/``not_finite`` (values, or
        logits on a few stored embeddings), ``not_newer`` (older than the running head or
        :attr:`seen_version`). A head that cannot be written still runs (:attr:`degraded`, retried by
        :meth:`retry_persist`).
        """
        held = self.head
        message: bytes | Scanned = payload
        try:
            # scanned once: the version read here, the signature checked and the head decoded from it
            message = scan(payload, self.limits)
            version = message.header.get("version")
        except DecodeError:
            version = None  # the checks below name the problem, signature first
        if type(version) is int and version == held.version:
            # the retained head again (a reconnect): nothing to verify, decode or apply
            self.redelivered += 1
            return ApplyResult(ApplyStatus.SAME_VERSION, version)
        try:
            with self.phase("apply"):
                gm = decode_global_model(
                    self._verified(message, MessageType.GLOBAL_MODEL),
                    limits=self.limits,
                    expect_shape=held.shape,
                )
                # a compressed head or a delta from the held version becomes a float32 head here
                gm = resolve_global_head(gm, held.version, held.W, held.b)
                return self._apply(gm)
        except DecodeError as exc:
            return ApplyResult(ApplyStatus.REFUSED, reason=exc.reason, detail=exc.detail)

    def _apply(self, gm: GlobalModel) -> ApplyResult:
        """Validate a decoded global head, persist it and swap it in atomically."""
        try:
            if gm.model_sha256 != self.model_sha256:
                raise UpdateRejected(
                    "wrong_model",
                    f"global head for model {gm.model_sha256[:12]}, "
                    f"this backbone is {self.model_sha256[:12]}",
                )
            validate_head(gm.W, gm.b, self.head.shape)
            if gm.version < self.head.version:
                raise UpdateRejected(
                    "not_newer", f"global version {gm.version} <= current {self.head.version}"
                )
            if gm.version < self.seen_version:
                raise UpdateRejected(
                    "not_newer",
                    f"global version {gm.version} is older than version {self.seen_version} "
                    "announced by a signed round (a rollback)",
                )
            # the outputs on a few stored embeddings must be finite too (a huge finite head can overflow)
            probe = next(self.store.chunks(8), None)
            if probe is not None and not np.isfinite(probe[0] @ gm.W + gm.b).all():
                raise UpdateRejected("not_finite", "global head gives non-finite logits on stored embeddings")
        except UpdateRejected as exc:
            return ApplyResult(ApplyStatus.REFUSED, gm.version, gm.round, exc.reason, exc.detail)
        new = Head(gm.W, gm.b, gm.version)
        # a head that cannot be written (a full disk) still runs: the retained head is delivered
        # again after a restart, and the write is retried once there is room
        self._persist("head", lambda: write_record(self.head_path, encode_global_model(gm)), behind=True)
        self.head = new
        self._tie_personal()
        self.evaluate()
        logger.info("applied global head version %d (round %d)", gm.version, gm.round)
        return ApplyResult(ApplyStatus.APPLIED, gm.version, gm.round)
