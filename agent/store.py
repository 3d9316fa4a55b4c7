"""Bounded store of recent labelled embeddings, kept in memory-mapped files rather than the heap.

Embeddings are stored as float16 (half the bytes of float32; the head is trained in float32 chunks
read back from the map), labels as int16. The store is a ring: when full, the oldest sample is
overwritten, so its size is fixed at ``capacity * (2 * D + 2)`` bytes of file-backed pages that the
kernel can drop under pressure.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from edgefl.head import check_labels, label_range
from edgefl.records import atomic_write
from edgefl.types import F32, I64

logger = logging.getLogger(__name__)


class EmbeddingStore:
    """Ring buffer of ``(embedding float16 [D], label int16)`` in memory-mapped files.

    Parameters
    ----------
    directory : Path
        Where the files ``store_emb.f16``, ``store_lbl.i16`` and ``store_meta.json`` live; created if missing.
    capacity : int
        Maximum number of samples kept (older ones are overwritten).
    dim : int
        Embedding size D.
    num_classes : int or None
        K of the head the store trains: labels outside ``0..K-1`` (``0..1`` when K = 1, a logistic
        head) are refused by :meth:`add` and counted in ``refused_labels``. None = not checked.

    Raises
    ------
    ValueError
        If ``capacity``, ``dim`` or ``num_classes`` is not positive.

    Notes
    -----
    A store whose metadata does not match ``capacity``/``dim`` (another model) is reset, with a log line.
    """

    def __init__(self, directory: Path, capacity: int, dim: int, num_classes: int | None = None) -> None:
        if capacity <= 0 or dim <= 0 or (num_classes is not None and num_classes <= 0):
            raise ValueError(
                f"EmbeddingStore: capacity {capacity}, dim {dim} and num_classes {num_classes} must be > 0"
            )
        self.num_classes = num_classes
        self.refused_labels = 0
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.capacity = capacity
        self.dim = dim
        self._meta_path = directory / "store_meta.json"
        count, head = self._read_meta()
        emb_path = directory / "store_emb.f16"
        lbl_path = directory / "store_lbl.i16"
        mode = "r+" if count >= 0 and emb_path.exists() and lbl_path.exists() else "w+"
        if mode == "w+":
            count, head = 0, 0
        self._emb = np.memmap(emb_path, dtype=np.float16, mode=mode, shape=(capacity, dim))  # type: ignore[call-overload]
        self._lbl = np.memmap(lbl_path, dtype=np.int16, mode=mode, shape=(capacity,))  # type: ignore[call-overload]
        self._count = count
        self._head = head

    def _read_meta(self) -> tuple[int, int]:
        try:
            meta = json.loads(self._meta_path.read_text())
            if meta.get("capacity") == self.capacity and meta.get("dim") == self.dim:
                return int(meta["count"]), int(meta["head"])
            logger.info("store in %s was built for another model shape; starting empty", self.directory)
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("store metadata %s unreadable (%s); starting empty", self._meta_path, exc)
        return -1, 0

    def __len__(self) -> int:
        """Number of samples currently held (<= capacity)."""
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes of the backing files (embeddings + labels)."""
        return self.capacity * (2 * self.dim + 2)

    def add(self, emb: F32, labels: I64) -> int:
        """Append a batch of labelled embeddings, overwriting the oldest when full.

        Samples whose label the head cannot learn (outside ``0..K-1``, or not 0/1 for K = 1) are
        refused: logged with reason ``bad_label``, counted in ``refused_labels``, not stored.

        Parameters
        ----------
        emb : float32 [N, D]
        labels : int64 [N], values in int16 range.

        Returns
        -------
        int
            How many samples were refused for their label.

        Raises
        ------
        ValueError
            If the shapes disagree with the store's D or with each other.
        """
        n = emb.shape[0]
        if emb.ndim != 2 or emb.shape[1] != self.dim or labels.shape != (n,):
            raise ValueError(f"store.add: emb {emb.shape}, labels {labels.shape}, store dim {self.dim}")
        refused = 0
        if self.num_classes is not None:
            ok = check_labels(labels, self.num_classes)
            refused = int(n - np.count_nonzero(ok))
            if refused:
                self.refused_labels += refused
                bad = sorted({int(v) for v in labels[~ok]})[:5]
                logger.warning(
                    "store: %d sample(s) refused (bad_label): labels %s outside 0..%d for K = %d",
                    refused,
                    bad,
                    label_range(self.num_classes) - 1,
                    self.num_classes,
                )
                emb, labels = emb[ok], labels[ok]
                n = emb.shape[0]
        for i in range(n):
            self._emb[self._head] = emb[i]
            self._lbl[self._head] = labels[i]
            self._head = (self._head + 1) % self.capacity
        self._count = min(self.capacity, self._count + n)
        return refused

    def chunks(self, chunk_size: int, order: I64 | None = None) -> Iterator[tuple[F32, I64]]:
        """Yield the stored samples as float32 chunks (one chunk's worth is in the heap at a time).

        Parameters
        ----------
        chunk_size : int
            Samples per chunk (>= 1).
        order : int64 [M] or None
            Which stored samples, in which order (e.g. a shuffle of ``range(len(self))``, or the
            first M samples); None = every sample in storage order.

        Yields
        ------
        emb : float32 [<=chunk_size, D]
        labels : int64 [<=chunk_size]
        """
        idx = np.arange(self._count, dtype=np.int64) if order is None else order
        for start in range(0, len(idx), chunk_size):
            sel = np.sort(idx[start : start + chunk_size])
            yield self._emb[sel].astype(np.float32), self._lbl[sel].astype(np.int64)

    def flush(self) -> None:
        """Write the maps and the metadata to disk (metadata with ``edgefl.records.atomic_write``)."""
        self._emb.flush()
        self._lbl.flush()
        meta = {"capacity": self.capacity, "dim": self.dim, "count": self._count, "head": self._head}
        atomic_write(self._meta_path, json.dumps(meta).encode())
