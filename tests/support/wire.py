"""Wire helpers for tests and benches (never shipped)."""

from __future__ import annotations

from typing import Final

import numpy as np

from edgefl.types import F32
from edgefl.wire.cbor import DEFAULT_LIMITS, NO_LIMITS, Limits, scan
from edgefl.wire.compression import Compression, compress_delta, decompress_delta
from edgefl.wire.reasons import Reason

__all__ = ["CHUNK_REASONS", "REASONS", "SIGNATURE_REASONS", "compressed_roundtrip", "global_model_version"]

#: Reasons the message decoders raise (``edgefl.wire`` messages, ``.compression``, ``.arrays``, ``.cbor``).
REASONS: Final = frozenset(
    {
        Reason.TOO_LARGE,
        Reason.BAD_CBOR,
        Reason.TOO_DEEP,
        Reason.TRAILING_BYTES,
        Reason.NOT_A_MAP,
        Reason.BAD_VERSION,
        Reason.NEWER_SCHEMA,
        Reason.WRONG_TYPE,
        Reason.UNKNOWN_KEY,
        Reason.MISSING_KEY,
        Reason.BAD_SHAPE,
        Reason.BAD_DTYPE,
        Reason.NOT_FINITE,
        Reason.BAD_INDICES,
        Reason.BAD_VALUE,
        Reason.BAD_LABEL,
    }
)
#: Reasons chunk decoding and reassembly (``edgefl.wire.chunking``) raise besides the message decoders'.
CHUNK_REASONS: Final = frozenset(
    {Reason.BAD_CHUNK, Reason.CHUNK_CONFLICT, Reason.BAD_CHECKSUM, Reason.TOO_LARGE}
)
#: Reasons signature verification (``edgefl.wire.signing``) raises.
SIGNATURE_REASONS: Final = frozenset({Reason.UNSIGNED, Reason.BAD_SIGNATURE})


def compressed_roundtrip(
    delta: F32,
    compression: Compression,
    *,
    topk_fraction: float = 0.1,
    rng: np.random.Generator | None = None,
) -> F32:
    """Return exactly what the coordinator will decode for ``delta`` (for error feedback).

    The device keeps ``residual = delta - compressed_roundtrip(delta, ...)`` and adds it to the next
    round's delta. With stochastic rounding (``rng``), pass a generator in the same state as the one
    given to :func:`encode_update` (e.g. two ``default_rng(seed)``), compressing W then b, so the
    draws match.

    Parameters
    ----------
    delta : float32 [...]
        Dense delta, finite.
    compression : Compression
        Wire encoding.
    topk_fraction : float
        Fraction kept by top-k.
    rng : numpy.random.Generator, optional
        Stochastic rounding for int8 layouts.

    Returns
    -------
    float32, same shape as ``delta``
        ``decompress_delta(compress_delta(delta, ...))``.

    Raises
    ------
    ValueError
        As :func:`compress_delta`.
    """
    x = np.asarray(delta, dtype=np.float32)
    sub = compress_delta(x, compression, topk_fraction=topk_fraction, rng=rng)
    return decompress_delta(sub, x.shape, limits=NO_LIMITS, compression=Compression(compression))


def global_model_version(payload: bytes, *, limits: Limits = DEFAULT_LIMITS) -> int | None:
    """A whole GlobalModel's ``version`` from its item headers (None if none), as a device reads it.

    DecodeError as :func:`~edgefl.wire.cbor.scan`.
    """
    version = scan(payload, limits).header.get("version")
    return version if type(version) is int else None
