"""Start-up checks of what a valid profile still cannot run with on this machine.

``edgefl check-config`` and ``edgefl run`` call :func:`preflight` before the agent allocates anything:
a writable state folder, a packet limit with room for a chunk, an embedding store that fits the disk
and the cap, and a cap above the model's floor (:func:`floor_bytes`). Each problem names the dotted
key, its value and the figure it was compared with.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Final

import numpy as np

from edgefl.agent import estimates, memstat
from edgefl.agent.config import Profile
from edgefl.agent.ingest import RECENT_IDS
from edgefl.agent.store import EMB_FILE, holdout_capacity, store_file_bytes
from edgefl.profiles import PSEUDO_FS
from edgefl.validators import is_loopback_host

MIN_PACKET_BYTES: Final = 512
"""Smallest usable ``broker.max_packet_bytes`` (a chunk's header, topic and envelope take ~200 bytes)."""


def store_bytes(capacity: int, dim: int, holdout_every: int = 0) -> int:
    """Bytes of the embedding store's files, and the holdout store's when ``holdout_every`` > 0."""
    return store_file_bytes(capacity + holdout_capacity(capacity, holdout_every), dim)


def ingest_bytes(profile: Profile, shapes: estimates.ModelShapes) -> int:
    """RAM of the live ingest at its bounds (``source.kind = "mqtt"``; 0 otherwise), in bytes.

    ``source.queue_max`` raw samples (at most ``source.queue_max_bytes`` and one packet) +
    ``source.pending_max`` embeddings + the remembered ids, each with ~300 bytes of Python bookkeeping
    (an order of magnitude, not exact).
    """
    src = profile.source
    if src.kind != "mqtt":
        return 0
    per_object = 300
    raw = src.queue_max * (shapes.sample_elems * np.dtype(profile.pipeline.raw_dtype).itemsize + per_object)
    held = src.queue_max_bytes + profile.broker.max_incoming_packet_bytes  # the transport's byte bound
    raw = min(raw, held + src.queue_max * per_object)
    pending = src.pending_max * (4 * shapes.embedding_dim + per_object)
    return raw + pending + RECENT_IDS * 100


def floor_bytes(
    profile: Profile, shapes: estimates.ModelShapes, baseline_rss: int, *, training: bool = False
) -> int:
    """The least memory the agent needs with this model: a lower bound of its peak RSS, in bytes.

    ``baseline_rss`` (the RSS of a process that imported the agent and loaded the model, bytes), the
    store, the live ingest at its bounds and the smallest inference phase of the model's ``shapes``
    (:func:`edgefl.agent.estimates.model_shapes`); with ``training``, also the first training run at
    ``training.chunk_floor`` over a full store.
    """
    phase = estimates.estimate_inference_bytes(shapes, 1)
    if training:
        capacity = profile.training.store_capacity
        phase += estimates.estimate_train_bytes(
            profile.training.chunk_floor,
            shapes.embedding_dim,
            shapes.classes,
            capacity,
            first_run=True,
            resident_rows=capacity,
        )
    return (
        baseline_rss
        + store_bytes(profile.training.store_capacity, shapes.embedding_dim, profile.training.holdout_every)
        + ingest_bytes(profile, shapes)
        + phase
    )


def _existing_ancestor(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _state_dir_problem(state_dir: Path) -> str | None:
    resolved = state_dir.resolve()
    if any(resolved == fs or fs in resolved.parents for fs in PSEUDO_FS):
        return "is on a pseudo file system (/proc, /sys, /dev)"
    if state_dir.exists() and not state_dir.is_dir():
        return "is not a folder"
    base = _existing_ancestor(state_dir)
    if not base.is_dir():
        return f"cannot be created: {base} is not a folder"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"is not writable ({base})"
    return None


def training_warning(profile: Profile, shapes: estimates.ModelShapes, baseline_rss: int) -> str | None:
    """A warning when the cap lets the agent classify but training would always be deferred, or None."""
    need = floor_bytes(profile, shapes, baseline_rss, training=True)
    budget = profile.cap_bytes - profile.memory.reserve_mb * memstat.MIB
    if need <= budget:
        return None
    return (
        f"memory.cap_mb = {profile.memory.cap_mb}: training needs about {need / memstat.MIB:.1f} MiB "
        f"under the cap less reserve ({budget / memstat.MIB:.1f} MiB): rounds defer until memory frees"
    )


def broker_warnings(profile: Profile) -> list[str]:
    """Broker settings that run but that an operator most likely did not mean (warnings, not problems).

    Credentials over plain ``mqtt://`` to a host other than loopback (MQTT 5.0 §5.4.1: in clear
    text), and a username other than ``device.id`` (an ACL keyed on ``%u`` refuses the device's topics).
    """
    broker, out = profile.broker, []
    if broker.username is not None and not broker.tls and not is_loopback_host(broker.host):
        out.append(
            f"broker.url = {broker.url!r}: the broker password goes to {broker.host} in plain text; "
            "use mqtts:// (with broker.ca_file)"
        )
    if broker.username is not None and broker.username != profile.device.id:
        out.append(
            f"broker.username = {broker.username!r} is not device.id = {profile.device.id!r}: a broker ACL "
            "keyed on the username (%u, docs/security.md) refuses this device's update and status topics"
        )
    return out


def preflight(profile: Profile, shapes: estimates.ModelShapes | None, baseline_rss: int) -> list[str]:
    """Every reason this profile cannot run here (empty when it can).

    ``shapes`` of the profile's model once loaded (None skips the store and floor checks),
    ``baseline_rss`` as :func:`floor_bytes`'s. Problems as ``key = value: reason``
    (``memory.cap_mb = 2: under the model's floor of 66.1 MiB``).
    """
    problems: list[str] = []
    state_dir = profile.device.state_dir
    why = _state_dir_problem(state_dir)
    if why is not None:
        problems.append(f"device.state_dir = {str(state_dir)!r}: {why}")
    limit = profile.broker.max_packet_bytes
    if limit < MIN_PACKET_BYTES:
        problems.append(
            f"broker.max_packet_bytes = {limit}: must be >= {MIN_PACKET_BYTES} (room for a chunk)"
        )
    if shapes is None:
        return problems
    mib = memstat.MIB
    need = store_bytes(profile.training.store_capacity, shapes.embedding_dim, profile.training.holdout_every)
    cap = profile.cap_bytes
    budget = cap - profile.memory.reserve_mb * mib
    if why is None and not (state_dir / EMB_FILE).exists():
        free = shutil.disk_usage(_existing_ancestor(state_dir)).free
        if need > free:
            problems.append(
                f"training.store_capacity = {profile.training.store_capacity}: the store needs "
                f"{need / mib:.1f} MiB, the disk has {free / mib:.1f} MiB free"
            )
    floor = floor_bytes(profile, shapes, baseline_rss)
    live = ingest_bytes(profile, shapes)
    if need > budget:
        problems.append(
            f"training.store_capacity = {profile.training.store_capacity}: the store needs "
            f"{need / mib:.1f} MiB of memory (D = {shapes.embedding_dim}), over the cap less reserve "
            f"({budget / mib:.1f} MiB)"
        )
    elif floor > cap:
        problems.append(
            f"memory.cap_mb = {profile.memory.cap_mb}: under the model's floor of {floor / mib:.1f} MiB: "
            f"the process with the model {baseline_rss / mib:.1f} MiB, the store {need / mib:.1f} MiB, "
            f"the live ingest at its bounds {live / mib:.1f} MiB, the smallest inference "
            f"{(floor - baseline_rss - need - live) / mib:.1f} MiB"
        )
    return problems
