"""Error feedback for compressed updates: what compression dropped is kept on the device and sent later.

Before compressing, the device adds its residual to the new delta; after compressing, the new
residual is ``corrected - decoded``, where ``decoded`` is exactly what the coordinator will see.
:meth:`ErrorFeedback.compress` compresses once (``edgefl.wire.compression.compress_head_delta``) and
hands the wire form on to ``encode_update(..., compressed=...)``. Nothing is lost, only delayed, which
is what lets top-k keep 10 % of the coordinates without hurting accuracy.

The residual lives in the device's state directory (``feedback_residual.npz``), written atomically
(temporary file, fsync, ``os.replace``) so it survives a restart or a power cut; a residual for
another head shape or another model is discarded.

Source: Stich, Cordonnier, Jaggi 2018, "Sparsified SGD with Memory" (NeurIPS), Algorithm 1;
Karimireddy et al. 2019 ("Error Feedback Fixes SignSGD").
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from edgefl.types import F32
from edgefl.wire.compression import CompressedDelta, Compression, compress_head_delta

logger = logging.getLogger(__name__)

RESIDUAL_FILE = "feedback_residual.npz"


class ErrorFeedback:
    """The device's residual ``(e_W, e_b)``, loaded from and saved to ``state_dir``.

    Parameters
    ----------
    state_dir : Path
        The device's state directory (created if missing).
    shape : (D, K)
        Head shape.
    model_sha256 : str
        sha256 of the backbone: a residual saved for another model is discarded.

    Attributes
    ----------
    residual_W : float32 [D, K]
    residual_b : float32 [K]
    """

    def __init__(self, state_dir: Path, shape: tuple[int, int], model_sha256: str = "") -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.shape = shape
        self.model_sha256 = model_sha256
        self.residual_W: F32 = np.zeros(shape, np.float32)
        self.residual_b: F32 = np.zeros(shape[1], np.float32)
        self._load()

    @property
    def path(self) -> Path:
        """File holding the residual."""
        return self.state_dir / RESIDUAL_FILE

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            with np.load(self.path) as data:
                W = np.asarray(data["W"], dtype=np.float32)
                b = np.asarray(data["b"], dtype=np.float32)
                sha = str(data["model_sha256"])
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("error-feedback residual %s unreadable (%s); starting from zero", self.path, exc)
            return
        if sha != self.model_sha256 or W.shape != self.shape or b.shape != (self.shape[1],):
            logger.info(
                "error-feedback residual %s is for another model or shape; starting from zero", self.path
            )
            return
        if not (np.isfinite(W).all() and np.isfinite(b).all()):
            logger.warning("error-feedback residual %s not finite; starting from zero", self.path)
            return
        self.residual_W, self.residual_b = W, b

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp.npz")
        with open(tmp, "wb") as f:
            np.savez(f, W=self.residual_W, b=self.residual_b, model_sha256=np.str_(self.model_sha256))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        # the rename itself is durable only once the directory entry is flushed
        fd = os.open(self.state_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def compensate(self, delta_W: F32, delta_b: F32) -> tuple[F32, F32]:
        """Add the residual to a fresh delta.

        Parameters
        ----------
        delta_W : float32 [D, K]
            This round's weight delta.
        delta_b : float32 [K]
            This round's bias delta.

        Returns
        -------
        (delta_W + e_W, delta_b + e_b), float32 (new arrays).

        Raises
        ------
        ValueError
            If the shapes are not the head's.
        """
        if delta_W.shape != self.shape or delta_b.shape != (self.shape[1],):
            raise ValueError(f"ErrorFeedback: delta {delta_W.shape}/{delta_b.shape}, head {self.shape}")
        return (delta_W + self.residual_W).astype(np.float32), (delta_b + self.residual_b).astype(np.float32)

    def record(self, corrected_W: F32, corrected_b: F32, decoded_W: F32, decoded_b: F32) -> None:
        """Keep what the wire dropped, ``corrected - decoded``, and save it atomically.

        Parameters
        ----------
        corrected_W : float32 [D, K]
            The compensated delta that was compressed.
        corrected_b : float32 [K]
            Its bias part.
        decoded_W : float32 [D, K]
            What the coordinator decodes (``compressed_roundtrip`` of ``corrected_W``).
        decoded_b : float32 [K]
            Its bias part.

        Raises
        ------
        OSError
            If the state directory cannot be written.
        """
        self.residual_W = (corrected_W - decoded_W).astype(np.float32)
        self.residual_b = (corrected_b - decoded_b).astype(np.float32)
        self._save()

    def reset(self) -> None:
        """Forget the residual (and delete its file)."""
        self.residual_W = np.zeros(self.shape, np.float32)
        self.residual_b = np.zeros(self.shape[1], np.float32)
        self.path.unlink(missing_ok=True)

    def compress(
        self,
        delta_W: F32,
        delta_b: F32,
        compression: Compression,
        *,
        topk_fraction: float = 0.1,
        seed: int | None = None,
    ) -> tuple[F32, F32, CompressedDelta]:
        """Compensate, compress once, record the new residual; return the wire form with it.

        Parameters
        ----------
        delta_W : float32 [D, K]
            This round's weight delta.
        delta_b : float32 [K]
            This round's bias delta.
        compression : Compression
            The round's compression.
        topk_fraction : float
            The round's top-k fraction.
        seed : int or None
            Seed of stochastic int8 rounding (None = deterministic rounding).

        Returns
        -------
        corrected_W : float32 [D, K]
            ``delta_W + e_W``, what was compressed (kept whole as residual if the send fails).
        corrected_b : float32 [K]
            Its bias part.
        compressed : CompressedDelta
            The wire sub-maps for ``encode_update(update, compressed=compressed)`` and what the
            coordinator decodes from them.

        Raises
        ------
        ValueError
            As ``compress_head_delta`` (non-finite delta, bad fraction) or wrong shapes.
        OSError
            If the residual cannot be saved.
        """
        cW, cb = self.compensate(delta_W, delta_b)
        rng = np.random.default_rng(seed) if seed is not None else None
        packed = compress_head_delta(cW, cb, compression, topk_fraction=topk_fraction, rng=rng)
        self.record(cW, cb, packed.decoded_W, packed.decoded_b)
        return cW, cb, packed

    def apply(
        self,
        delta_W: F32,
        delta_b: F32,
        compression: Compression,
        *,
        topk_fraction: float = 0.1,
        seed: int | None = None,
    ) -> tuple[F32, F32]:
        """Compensate, compress, record the new residual; return the corrected deltas only.

        For callers that encode the dense deltas themselves (``encode_update`` then compresses them
        a second time, to the same bytes); :meth:`compress` hands the wire form on instead. With
        stochastic int8 rounding, pass ``seed`` and encode with ``rng=np.random.default_rng(seed)``.

        Parameters
        ----------
        delta_W : float32 [D, K]
            This round's weight delta.
        delta_b : float32 [K]
            This round's bias delta.
        compression : Compression
            The round's compression.
        topk_fraction : float
            The round's top-k fraction.
        seed : int or None
            Seed of the stochastic rounding (None = the codec's deterministic rounding).

        Returns
        -------
        (corrected_W, corrected_b) : float32, to be encoded into the Update.

        Raises
        ------
        ValueError
            As :meth:`compress`.
        OSError
            If the residual cannot be saved.
        """
        cW, cb, _ = self.compress(delta_W, delta_b, compression, topk_fraction=topk_fraction, seed=seed)
        return cW, cb
