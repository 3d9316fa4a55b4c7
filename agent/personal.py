"""The personal head and federated evaluation: the device's own head beside the global one.

The personal head takes class-restricted Ditto steps toward the global head, on the round's own
batches or in a step of its own once the update is out (:meth:`PersonalHeads.personalise`);
:meth:`PersonalHeads.evaluate` scores both heads on the holdout store (never trained on) and
:meth:`PersonalHeads.serving_head` picks the one that classifies (:func:`personal_behind`).

Source: T. Li et al., "Ditto: Fair and Robust Federated Learning Through Personalization", ICML 2021.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import cbor2
import numpy as np

from edgefl.agent.governor import Admission
from edgefl.agent.state import DeviceState
from edgefl.agent.trainer import PersonalResult, PersonalStep, train_personal
from edgefl.errors import UpdateRejected
from edgefl.head import Head, personal_columns, validate_head
from edgefl.records import read_record, write_record
from edgefl.wire.rounds import RoundAnnouncement

logger = logging.getLogger(__name__)

PERSONAL_FILE = "personal_head.rec"
"""The personal head's record (CBOR ``v, fleet, model_sha256, version, shape, W, b, columns``)."""
PERSONAL_SEED_OFFSET = 0x5EED
"""Added to the round's shuffle seed for the personal step (its own sample order)."""


def personal_behind(only_global: int, only_personal: int) -> bool:
    """Whether the personal head is behind the global one on the holdout by more than chance.

    Behind when ``only_global - only_personal > sqrt(only_global + only_personal)``: more than one
    standard deviation of that difference were both heads equally good. ``only_global``,
    ``only_personal`` (ints >= 0): holdout samples only the global (resp. personal) head gets right.

    Source: McNemar's statistic for paired proportions, ``(b - c) / sqrt(b + c)`` (Q. McNemar,
    "Note on the sampling error of the difference between correlated proportions or
    percentages", Psychometrika 12(2), 1947), at one standard deviation.
    """
    diff = only_global - only_personal
    return diff > 0 and diff * diff > only_global + only_personal


def head_switch_message(
    behind: bool, personal_right: int, global_right: int, total: int, only_global: int, only_personal: int
) -> str:
    """The log line of a switch between the personal and the global head (:func:`personal_behind`).

    ``behind``: the personal head is now behind, else no longer; ``personal_right``, ``global_right``:
    holdout samples each head gets right, of ``total`` > 0; the rest as :func:`personal_behind`'s.
    """
    acc_p, acc_g = personal_right / total, global_right / total
    if behind:
        return (
            f"personal head behind the global head on the holdout ({acc_p:.3f} < {acc_g:.3f}, "
            f"{total} samples): predictions use the global head"
        )
    return (
        f"personal head no longer behind the global head on the holdout (personal {acc_p:.3f}, global "
        f"{acc_g:.3f}, {total} samples; of the samples they disagree on the global head alone is right "
        f"on {only_global}, the personal head alone on {only_personal}: no lead beyond chance): "
        "predictions use the personal head"
    )


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Federated evaluation of one head (its ``version``) on the device's holdout (never trained on).

    ``accuracy``: the fraction of the ``count`` holdout samples evaluated it classifies right, 0..1.
    """

    version: int
    accuracy: float
    count: int


class _EvalBuffers:
    """Fixed-size buffers of :meth:`PersonalHeads.evaluate` (no array takes the holdout's length)."""

    def __init__(self, rows: int, dim: int, classes: int) -> None:
        self.rows: np.ndarray = np.arange(rows, dtype=np.int64)
        self.emb: np.ndarray = np.empty((rows, dim), np.float32)
        self.lbl: np.ndarray = np.empty(rows, np.int64)
        self.z: np.ndarray = np.empty((rows, classes), np.float32)
        self.pred: np.ndarray = np.empty(rows, np.intp)
        self.right: np.ndarray = np.empty(rows, bool)
        self.right_p: np.ndarray = np.empty(rows, bool)
        self.only: np.ndarray = np.empty(rows, bool)

    def right_of(self, head: Head, m: int, out: np.ndarray) -> np.ndarray:
        """Whether ``head`` classifies the first ``m`` samples right: a bool [m] view of ``out``."""
        z, pred, right = self.z[:m], self.pred[:m], out[:m]
        np.matmul(self.emb[:m], head.W, out=z)
        z += head.b
        if z.shape[1] == 1:
            np.greater(z[:, 0], 0, out=right)
            np.copyto(pred, right)
        else:
            np.argmax(z, axis=1, out=pred)
        np.equal(pred, self.lbl[:m], out=right)
        return right


class PersonalHeads(DeviceState):
    """The personal head, its classes, and the evaluation of both heads on the holdout (a core part)."""

    def _open_personal(self) -> None:
        """Set the personal fields: the head and its classes restored from their record (else the store's)."""
        D, K = self.head.shape
        self.evaluation: Evaluation | None = None
        self.personal: Head | None = None
        """The personal head (None until the first personal step; :meth:`personalise`)."""
        self.personal_columns: np.ndarray = np.zeros(K, dtype=bool)
        """bool [K]: the classes this device has had a label for (the columns it personalises)."""
        self.personal_evaluation: Evaluation | None = None
        """The personal head's accuracy on the holdout (:meth:`evaluate`)."""
        self.personal_fallback = False
        """The personal head did worse than the global head on the holdout: predictions use the global."""
        self.personal_deferred = 0
        """Personal steps the memory governor deferred (each waits for the next round)."""
        self._personal_due: RoundAnnouncement | None = None  # a round trained, its personal step not yet
        # a personal step taken with the round's training, not yet evaluated
        self._personal_done: PersonalResult | None = None
        data = read_record(self.personal_path)
        if data is not None:
            try:
                obj = cbor2.loads(data)
                if not isinstance(obj, dict) or obj.get("v") != 1:
                    raise ValueError("not a personal-head record")
                if obj.get("fleet") != self.fleet or obj.get("model_sha256") != self.model_sha256:
                    raise ValueError("for another fleet or model")
                version, shape = obj.get("version"), obj.get("shape")
                raw_W, raw_b, raw_c = obj.get("W"), obj.get("b"), obj.get("columns")
                if type(version) is not int or version < 0 or shape != [D, K]:
                    raise ValueError(f"version {version!r}, shape {shape!r}: expected shape {[D, K]}")
                if not (isinstance(raw_W, bytes) and isinstance(raw_b, bytes) and isinstance(raw_c, bytes)):
                    raise ValueError("W, b and columns must be byte strings")
                if len(raw_W) != D * K * 4 or len(raw_b) != K * 4 or len(raw_c) != K:
                    raise ValueError("array sizes do not match the shape")
                W = np.frombuffer(raw_W, dtype="<f4").reshape(D, K).astype(np.float32)
                b = np.frombuffer(raw_b, dtype="<f4").astype(np.float32)
                validate_head(W, b, (D, K))
                self.personal = Head(W, b, version)
                self.personal_columns = np.frombuffer(raw_c, dtype=np.uint8) != 0
                self._tie_personal()
                logger.info(
                    "restored personal head (pulled toward version %d, %d of %d classes personal) from %s",
                    version,
                    int(self.personal_columns.sum()),
                    K,
                    self.personal_path,
                )
                return
            except (cbor2.CBORDecodeError, ValueError, TypeError, UpdateRejected) as exc:
                logger.warning(
                    "stored personal head %s unusable (%s); a new one is trained", self.personal_path, exc
                )
        for st in self.stores:
            for _, lbl in st.chunks(1024):
                self.personal_columns |= personal_columns(lbl, K)

    def serving_head(self) -> tuple[Head, str]:
        """The head that classifies and its kind: ``"personal"`` once there, unless behind; ``"global"``."""
        personal = self.personal
        if personal is None or self.personal_fallback or not self.profile.personal.enabled:
            return self.head, "global"
        return personal, "personal"

    def evaluate(self) -> Evaluation | None:
        """Accuracy of the current head on the holdout (federated evaluation), kept in :attr:`evaluation`.

        The holdout is read ``training.chunk_size`` samples at a time (memory independent of its
        size); the personal head is scored too (:func:`personal_behind`). None when it is off or empty.
        """
        self._personal_done = None  # a personal step taken with the round's training: evaluated here
        holdout = self.holdout
        if holdout is None or len(holdout) == 0:
            return None
        head = self.head
        personal = self.personal
        n = len(holdout)
        rows = self.profile.training.chunk_size
        buf = _EvalBuffers(rows, *head.shape)
        correct = correct_p = only_global = only_personal = 0
        for start in range(0, n, rows):
            m = min(rows, n - start)
            holdout.read(buf.rows[:m], buf.emb[:m], buf.lbl[:m])
            buf.rows += rows  # the next chunk's rows
            right = buf.right_of(head, m, buf.right)
            correct += int(np.count_nonzero(right))
            if personal is not None:
                right_p = buf.right_of(personal, m, buf.right_p)
                correct_p += int(np.count_nonzero(right_p))
                only = buf.only[:m]
                only_global += int(np.count_nonzero(np.greater(right, right_p, out=only)))
                only_personal += int(np.count_nonzero(np.greater(right_p, right, out=only)))
        total = n
        self.evaluation = Evaluation(head.version, correct / total, total)
        if personal is not None:
            self.personal_evaluation = Evaluation(personal.version, correct_p / total, total)
            behind = personal_behind(only_global, only_personal)
            if behind != self.personal_fallback:
                logger.log(
                    logging.WARNING if behind else logging.INFO,
                    "%s",
                    head_switch_message(behind, correct_p, correct, total, only_global, only_personal),
                )
            self.personal_fallback = behind
        return self.evaluation

    @property
    def personal_path(self) -> Path:
        """The persisted personal head (:data:`PERSONAL_FILE`)."""
        return self.state_dir / PERSONAL_FILE

    @property
    def personal_step_due(self) -> bool:
        """A round was trained without its personal step (not taken along): the step waits."""
        return self._personal_due is not None

    @property
    def personal_due(self) -> bool:
        """A round was trained and its personal step (or the evaluation of one taken with it) waits."""
        return self._personal_due is not None or self._personal_done is not None

    def _adopt_personal(self, W: np.ndarray, b: np.ndarray, version: int, result: PersonalResult) -> bool:
        """Keep and persist a trained personal head, to be evaluated; False (dropped) if not finite."""
        if not (np.isfinite(W).all() and np.isfinite(b).all()):
            logger.warning("personal step gave non-finite values; the next starts again from the global head")
            self.personal = None
            return False
        self.personal = Head(W, b, version)
        self._persist("personal", self._save_personal, behind=True)
        self._personal_done = result
        return True

    def _tie_personal(self) -> None:
        """Set the personal head's columns of never-labelled classes to the global head's (in place)."""
        personal = self.personal
        if personal is None or self.personal_columns.all():
            return
        tied = ~self.personal_columns
        personal.W[:, tied] = self.head.W[:, tied]
        personal.b[tied] = self.head.b[tied]

    def _save_personal(self) -> None:
        """Write the personal head, its classes and version (the one atomic, checksummed writer)."""
        personal = self.personal
        if personal is None:
            return
        payload = {
            "v": 1,
            "fleet": self.fleet,
            "model_sha256": self.model_sha256,
            "version": personal.version,
            "shape": list(personal.shape),
            "W": personal.W.astype("<f4").tobytes(),
            "b": personal.b.astype("<f4").tobytes(),
            "columns": self.personal_columns.astype(np.uint8).tobytes(),
        }
        write_record(self.personal_path, cbor2.dumps(payload))

    def _admit_pass(
        self,
        ann: RoundAnnouncement,
        phase: Literal["train", "personal"],
        personal: bool = False,
        probe: bool = False,
    ) -> Admission:
        """The governor's grant for a pass over the store in ``ann``'s batches (``Governor.admit_train``)."""
        cfg = self.profile.training
        D, K = self.head.shape
        return self.governor.admit_train(
            cfg.chunk_size,
            cfg.chunk_floor,
            dim=D,
            classes=K,
            batch_size=ann.batch_size,
            num_examples=len(self.store),
            resident_rows=self.store.resident_rows,
            personal=personal,
            probe=probe,
            phase=phase,
        )

    def _personal_step(self, ann: RoundAnnouncement) -> PersonalStep:
        """The personal step for ``ann``'s batches: the personal head (or a copy of the global) to train."""
        pcfg = self.profile.personal
        current = self.personal
        W, b = (self.head.W.copy(), self.head.b.copy()) if current is None else (current.W, current.b)
        return PersonalStep(
            W, b, self.personal_columns.copy(), pcfg.prox_lambda, pcfg.lr_scale * ann.lr, pcfg.absent_alpha
        )

    def personalise(self) -> PersonalResult | None:
        """The personal step of the last trained round: class-restricted Ditto steps, persisted, evaluated.

        A step the round's training took along is only evaluated here; otherwise it runs now
        (:func:`edgefl.agent.trainer.train_personal`, phase ``personal``). Nothing sent changes. None
        when no step is due, personal heads are off, the store is empty or the governor deferred the
        step (:attr:`personal_deferred` counts it; the next round tries again).
        """
        ann = self._personal_due
        self._personal_due = None
        cfg = self.profile.personal
        if ann is None and self._personal_done is not None:
            done = self._personal_done  # taken with the round's training: evaluate it
            self.evaluate()
            return done
        if ann is None or not cfg.enabled or len(self.store) == 0:
            return None
        tcfg = self.profile.training
        glob = self.head
        adm = self._admit_pass(ann, "personal")
        if adm.deferred:
            self.personal_deferred += 1
            return None
        # trained in place: the personal head's arrays are only read by this (single) caller thread
        step = self._personal_step(ann)
        with self.phase("personal"):
            result = train_personal(
                step.W,
                step.b,
                glob,
                self.store,
                step.columns,
                lam=step.lam,
                epochs=cfg.epochs or ann.local_epochs,
                lr=step.lr,
                absent_alpha=step.absent_alpha,
                batch_size=ann.batch_size,
                chunk_size=adm.work,
                seed=tcfg.seed + ann.round + PERSONAL_SEED_OFFSET,
                time_budget_s=ann.deadline_s,
            )
        if self._adopt_personal(step.W, step.b, glob.version, result):
            self.evaluate()
        return result
