"""Dirichlet label-skew partitions of a labelled set, for the learning benchmark."""

from __future__ import annotations

import numpy as np

from edgefl.datasets import check_labels
from edgefl.types import I64


def dirichlet_partition(labels: I64, n_devices: int, alpha: float, seed: int = 0) -> list[I64]:
    """Partition samples over devices with Dirichlet label skew.

    For each class, proportions ``q ~ Dir(alpha * 1_n)`` are drawn and the class's shuffled samples
    are cut at ``floor(cumsum(q) * n_c)``. Small ``alpha`` (0.1) gives each device few classes, large
    ``alpha`` (100) approaches an IID split. Devices left empty then receive one random sample each
    from the currently largest device, so every device has at least one sample.

    Parameters
    ----------
    labels : int64 [N]
        Class label of every sample to partition.
    n_devices : int
        Number of devices, 1..N.
    alpha : float
        Dirichlet concentration, > 0.
    seed : int
        Seed of ``numpy.random.default_rng``; same inputs and seed give the same partition.

    Returns
    -------
    list[int64 [n_d]]
        ``n_devices`` sorted, non-empty index arrays INTO ``labels``, disjoint and covering ``range(N)``.

    Raises
    ------
    ValueError
        Bad ``labels``, ``n_devices`` outside 1..N, or ``alpha <= 0``.

    Source: T.-M. H. Hsu, H. Qi, M. Brown, "Measuring the Effects of Non-Identical Data Distribution
    for Federated Visual Classification", arXiv:1909.06335 (2019) §3; cutting as in Li et al.,
    "Federated Learning on Non-IID Data Silos: An Experimental Study", ICDE 2022 (NIID-Bench).
    """
    y = check_labels(labels)
    if not 1 <= n_devices <= y.size:
        raise ValueError(f"n_devices = {n_devices}: must be in 1..{y.size} (the number of samples)")
    if not alpha > 0.0:
        raise ValueError(f"alpha = {alpha}: must be > 0")
    rng = np.random.default_rng(seed)
    assignment = np.empty(y.size, dtype=np.int64)
    for cls in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == cls))
        q = rng.dirichlet(np.full(n_devices, alpha))
        cuts = (np.cumsum(q)[:-1] * idx.size).astype(np.int64)
        for device, chunk in enumerate(np.split(idx, cuts)):
            assignment[chunk] = device
    counts = np.bincount(assignment, minlength=n_devices)
    for empty in np.flatnonzero(counts == 0):
        device = int(empty)
        donor = int(np.argmax(counts))
        moved = int(rng.choice(np.flatnonzero(assignment == donor)))
        assignment[moved] = device
        counts[donor] -= 1
        counts[device] += 1
    return [np.flatnonzero(assignment == d).astype(np.int64) for d in range(n_devices)]
