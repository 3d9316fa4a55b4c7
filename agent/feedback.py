"""Error feedback for compressed updates: what compression dropped is kept on the device and sent later.

Source: Stich, Cordonnier, Jaggi 2018, "Sparsified SGD with Memory" (NeurIPS), Algorithm 1;
Karimireddy et al. 2019 ("Error Feedback Fixes SignSGD").
"""

from __future__ import annotations

import logging

import cbor2
import numpy as np

from edgefl.errors import DecodeError
from edgefl.types import F32
from edgefl.wire.arrays import decode_array, encode_array
from edgefl.wire.cbor import DEFAULT_LIMITS
from edgefl.wire.compression import CompressedDelta, Compression, compress_head_delta

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """The device's residual ``corrected - decoded`` (float32 [D, K] and [K]), added to the next delta.

    ``shape``: the head's (D, K); ``model_sha256``: the backbone's (a residual kept for another
    model is discarded by :meth:`load_bytes`). The outbox record carries it across restarts.
    """

    def __init__(self, shape: tuple[int, int], model_sha256: str = "") -> None:
        self.shape = shape
        self.model_sha256 = model_sha256
        self.residual_W: F32 = np.zeros(shape, np.float32)
        self.residual_b: F32 = np.zeros(shape[1], np.float32)
        self.round = -1
        """The round whose compression left this residual (-1: none)."""

    def load_bytes(self, data: bytes, where: str) -> bool:
        """Take the residual from ``data`` (:meth:`carry_bytes`'s form); whether it was usable.

        A residual for another model or shape, non-finite, or unreadable is ignored (logged).
        """
        try:
            W, b, sha, round_no = _read_carry(data)
        except (ValueError, KeyError, DecodeError, cbor2.CBORDecodeError) as exc:
            logger.warning("error-feedback residual %s unreadable (%s); starting from zero", where, exc)
            return False
        if sha != self.model_sha256 or W.shape != self.shape or b.shape != (self.shape[1],):
            logger.info("error-feedback residual %s is for another model or shape; starting from zero", where)
            return False
        if not (np.isfinite(W).all() and np.isfinite(b).all()):
            logger.warning("error-feedback residual %s not finite; starting from zero", where)
            return False
        self.residual_W, self.residual_b, self.round = W, b, round_no
        return True

    def carry_bytes(self) -> bytes:
        """The residual as the outbox record carries it, a CBOR map (:meth:`load_bytes` reads it).

        ``{"W": float32 [D, K], "b": float32 [K], "model_sha256": str, "round": int}``, the arrays RFC
        8746 typed arrays (tag 40 over tag 85). Source: RFC 8949, RFC 8746 §2.1, §3.1.1.
        """
        return cbor2.dumps(
            {
                "W": encode_array(self.residual_W),
                "b": encode_array(self.residual_b),
                "model_sha256": self.model_sha256,
                "round": self.round,
            }
        )

    def compress(
        self,
        delta_W: F32,
        delta_b: F32,
        compression: Compression,
        *,
        topk_fraction: float = 0.1,
        round: int = -1,
    ) -> tuple[F32, F32, CompressedDelta]:
        """Compress ``delta + residual`` once (the round's settings), keep what it dropped as the residual.

        ``delta_W``, ``delta_b``: float32 [D, K], [K]; ``round``: the round it answers (:attr:`round`).

        Returns ``(corrected_W, corrected_b, compressed)``: ``delta + residual``, and the wire sub-maps
        for ``encode_update`` with what the coordinator decodes from them. ``ValueError`` as
        ``compress_head_delta`` (non-finite delta, bad fraction) or for wrong shapes.
        """
        if delta_W.shape != self.shape or delta_b.shape != (self.shape[1],):
            raise ValueError(f"ErrorFeedback: delta {delta_W.shape}/{delta_b.shape}, head {self.shape}")
        cW = (delta_W + self.residual_W).astype(np.float32)
        cb = (delta_b + self.residual_b).astype(np.float32)
        packed = compress_head_delta(cW, cb, compression, topk_fraction=topk_fraction)
        self.residual_W = (cW - packed.decoded_W).astype(np.float32)
        self.residual_b = (cb - packed.decoded_b).astype(np.float32)
        self.round = round
        return cW, cb, packed


def _read_carry(data: bytes) -> tuple[F32, F32, str, int]:
    """``(W, b, model_sha256, round)`` of :meth:`ErrorFeedback.carry_bytes`'s form (errors as decoded)."""
    obj = cbor2.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("not a residual record")
    if type(obj.get("model_sha256")) is not str or type(obj.get("round")) is not int:
        raise ValueError("residual record without its model or round")
    floats = frozenset({"float32"})
    W = decode_array(obj.get("W"), limits=DEFAULT_LIMITS, dtypes=floats, name="W")
    b = decode_array(obj.get("b"), limits=DEFAULT_LIMITS, dtypes=floats, name="b")
    return W, b, obj["model_sha256"], obj["round"]
