"""``edgefl feed``: publish a sample file to a device over MQTT, as a gateway's own app would.

A replay-format ``.npz`` goes out as Samples (and labels, inline or late), with the broker
connection the agent makes; the feed reports the predictions and what the device refused. Usage,
exit codes and messages: ``docs/operations.md``; the messages: ``docs/protocol.md`` ("Live ingest").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import heapq
import json
import logging
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.errors import DecodeError, EdgeflError, TransportError
from edgefl.head import check_labels, label_range
from edgefl.profiles import (
    BrokerConfig,
    Schema,
    add_set_argument,
    check_broker,
    parse_sets,
    print_problems,
    read_toml,
)
from edgefl.records import atomic_write
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.validators import check_device_id
from edgefl.wire.chunking import split_message
from edgefl.wire.ingest import (
    RAW_DTYPES,
    IngestRefusal,
    Label,
    Prediction,
    Sample,
    decode_answer,
    encode_label,
    encode_sample,
)
from edgefl.wire.status import decode_status

logger = logging.getLogger(__name__)

IN_FLIGHT = 64
"""QoS 1 publishes awaiting their PUBACK at once (as fast as the broker acknowledges, not one RTT each)."""
CONNECT_WAIT_S = 15.0
"""Seconds the feed waits for its connection (a refusal of its credentials ends it at once)."""


@dataclass(frozen=True, slots=True)
class FeedOptions:
    """What to feed where (``edgefl feed --help``).

    ``data``: an ``.npz`` with ``x`` [N, *sample_shape] and ``y`` int [N]; ``rate_hz`` samples per
    second (0: as fast as the broker takes them); ``label_fraction`` in [0, 1] labelled (chosen by
    ``seed``), inline or as a Label ``label_delay_s`` seconds later; ``qos`` of the Samples (Labels: 1);
    ``wait_s`` for the device's readiness and the missing predictions; sample ids ``<id_prefix><i>``
    (default: an unguessable 24-hex-digit token each); ``limit`` the first samples only.
    """

    broker: BrokerConfig
    fleet: str
    device: str
    data: Path
    rate_hz: float = 50.0
    label_fraction: float = 1.0
    label_delay_s: float = 0.0
    qos: int = 1
    wait_s: float = 10.0
    seed: int = 0
    id_prefix: str | None = None
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class FeedResult:
    """What one feed did (``--json`` writes it; the keys are a contract).

    ``samples_sent`` acknowledged by the broker (all unless ``error``); ``labels_inline``/``labels_late``
    labels in a Sample / as Label messages (acknowledged); ``predictions_received`` one per id (one
    before its sample was sent is another app's, not counted); ``correct`` against ``y``; ``seconds``
    from the first publish; ``latency_s_median``/``latency_s_p95`` of the device's ``latency_s`` (None
    without predictions); ``publish_s`` to the last acknowledged publish; ``refused`` by reason: the
    device's refusals of this feed's samples without a prediction, every ``duplicate`` sample (its
    prediction, if any, may be another app's: not counted) and late labels (a ``duplicate`` label is
    no refusal); ``labels_refused`` late labels refused; ``refused_detail`` the last refusal's detail;
    ``chunked`` samples sent in chunks; ``error`` why the feed stopped early ("" when it did not).
    """

    samples_sent: int
    labels_inline: int
    labels_late: int
    predictions_received: int
    correct: int
    seconds: float
    latency_s_median: float | None = None
    latency_s_p95: float | None = None
    publish_s: float | None = None
    refused: dict[str, int] = field(default_factory=dict)
    refused_detail: str = ""
    chunked: int = 0
    labels_refused: int = 0
    error: str = ""

    @property
    def accuracy(self) -> float | None:
        """``correct / predictions_received`` (None without predictions)."""
        return self.correct / self.predictions_received if self.predictions_received else None


def load_samples(path: Path, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read a replay-format ``.npz``: ``x`` [N, ...] raw (uint8, int16 or float32), ``y`` int64 [N], N >= 1.

    The first ``limit`` samples (None: all) of a file checked whole.

    ValueError naming the file and the problem: not an ``.npz`` archive, no ``x``/``y``, no samples,
    lengths that differ, an ``x`` no Sample can carry, or labels that are not integers (a float ``y``
    must hold whole numbers).
    """
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if magic != b"PK\x03\x04":  # every .npz is a zip archive (numpy.savez)
        raise ValueError(f"{path}: not an .npz archive (numpy.savez writes one, with x and y)")
    try:
        with np.load(path, allow_pickle=False) as data:
            x, y = np.asarray(data["x"]), np.asarray(data["y"])
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not an .npz holding x and y ({exc})") from exc
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
        raise ValueError(f"{path}: x {list(x.shape)} and y {list(y.shape)} do not match (x [N, ...], y [N])")
    if not len(x):
        raise ValueError(f"{path}: holds no samples (x {list(x.shape)})")
    if x.dtype.name not in RAW_DTYPES or x.ndim > 5:
        raise ValueError(
            f"{path}: x: {x.dtype} samples of {x.ndim - 1} dimensions; a Sample's x is uint8, int16 or "
            "float32 (the device's pipeline.raw_dtype) of 1 to 4 dimensions"
        )
    return x[:limit], _integer_labels(path, y)[:limit]


def _integer_labels(path: Path, y: np.ndarray) -> np.ndarray:
    """``y`` as int64, or ValueError naming the labels that are not whole numbers."""
    if y.dtype.kind in "iub":
        return y.astype(np.int64)
    if y.dtype.kind != "f":
        raise ValueError(f"{path}: y: dtype {y.dtype}, labels must be integers")
    bad = ~np.isfinite(y) | (y != np.round(y))
    if bad.any():
        shown = ", ".join(f"{v:g}" for v in y[bad][:3])
        raise ValueError(
            f"{path}: y: {int(bad.sum())} of {len(y)} label(s) not whole numbers (e.g. {shown}); "
            "labels are class indices"
        )
    return y.astype(np.int64)


@contextlib.contextmanager
def _connect_reported_once() -> Iterator[None]:
    """Hold back the transport's log lines while the feed connects: its error names what went wrong.

    ``MqttTransport.start`` raises a TransportError naming a refusal of the credentials or certificate,
    or the last error met before its wait ran out; the feed prints that as its one line. An agent's
    transport still logs each refusal (its log is where an operator looks for it).
    """
    transport_logger = logging.getLogger(MqttTransport.__module__)

    def quiet(record: logging.LogRecord) -> bool:
        return False

    transport_logger.addFilter(quiet)
    try:
        yield
    finally:
        transport_logger.removeFilter(quiet)


async def feed(opts: FeedOptions, *, transport: MqttTransport | None = None) -> FeedResult:
    """Publish the samples (and labels) of ``opts.data`` to a device and collect what became of them.

    Waits up to ``opts.wait_s`` for a Prediction or a Refusal of every sample and, with late labels,
    until each is refused or :data:`LABEL_STATUSES` device statuses came after the last. A connection
    lost while publishing ends the feed early (``FeedResult.error``). ``transport``: a started one to
    use (default: its own). ValueError for an unreadable data file; TransportError if the broker cannot
    be reached or refuses the credentials; ConfigError if TLS or password files cannot be read.
    """
    x, y = load_samples(opts.data, opts.limit)
    n = len(x)
    rng = np.random.default_rng(opts.seed)
    labelled = np.zeros(n, dtype=bool)
    labelled[rng.permutation(n)[: round(opts.label_fraction * n)]] = True
    if opts.id_prefix is not None:
        prefix = opts.id_prefix
        ids = [f"{prefix}{i}" for i in range(n)]
    else:  # unguessable: nobody answers (or labels) a sample before it is sent
        prefix = secrets.token_hex(3) + "-"
        ids = [secrets.token_hex(12) for _ in range(n)]
    index = {sid: i for i, sid in enumerate(ids)}
    topics = Topics(opts.broker.topic_prefix, opts.fleet)
    own = transport is None
    if transport is None:
        client_id = f"edgefl-feed-{opts.device}-{prefix.rstrip('-')}"
        transport = MqttTransport.for_broker(opts.broker, client_id, queue_size=max(256, 2 * n))
        try:
            with _connect_reported_once():
                await transport.start(wait_s=CONNECT_WAIT_S)
        except BaseException:
            await transport.stop()
            raise
    state = _Fate(n)
    device_ready = asyncio.Event()  # the device's status says it takes samples (its subscriptions are in)
    status_topic, answer_topic = topics.status(opts.device), topics.predictions(opts.device)

    async def collect() -> None:
        assert transport is not None
        while True:
            msg = await transport.queue.get()
            if msg.topic == status_topic:
                try:
                    st = decode_status(msg.payload)
                except DecodeError as exc:
                    logger.warning("status refused: %s", exc)
                    continue
                if st.state != "offline" and st.fields.get("ready") is True:
                    device_ready.set()
                state.status_came(st.fields)
                continue
            if msg.topic != answer_topic:
                continue
            try:
                answer = decode_answer(msg.payload)
            except DecodeError as exc:
                logger.warning("message on %s refused: %s", msg.topic, exc)
                continue
            i = index.get(answer.id)
            if i is not None:
                state.answer(i, answer)

    sem = asyncio.Semaphore(IN_FLIGHT)
    inflight: set[asyncio.Task[None]] = set()
    errors: list[TransportError] = []

    async def send(topic: str, payload: bytes, qos: int, acked: Callable[[], None] | None) -> None:
        assert transport is not None
        try:
            await transport.publish(topic, payload, qos=qos)
        except TransportError as exc:
            errors.append(exc)
        else:
            if acked is not None:
                acked()
        finally:
            sem.release()

    async def spawn(topic: str, payload: bytes, qos: int, acked: Callable[[], None] | None = None) -> None:
        if errors:
            raise errors[0]
        await sem.acquire()  # back-pressure: at most IN_FLIGHT unacknowledged publishes
        task = asyncio.create_task(send(topic, payload, qos, acked))
        inflight.add(task)
        task.add_done_callback(inflight.discard)

    collector = asyncio.create_task(collect())
    late: list[tuple[float, int]] = []  # (due monotonic, sample index), a heap
    chunked = 0
    error = ""
    publish_s: float | None = None
    t0 = time.monotonic()
    try:
        # the status first: the device's readiness, and later the fence of its label refusals
        await transport.subscribe(status_topic, 1)
        await transport.subscribe(answer_topic, 1)
        sample_topic, label_topic = topics.samples(opts.device), topics.labels(opts.device)
        try:
            await asyncio.wait_for(device_ready.wait(), opts.wait_s)
        except TimeoutError:
            logger.warning(
                "device %s has not said it is ready in %g s (its status on %s; or this account may not "
                "read it: check the ACL): samples sent before it subscribes are lost",
                opts.device,
                opts.wait_s,
                status_topic,
            )
        t0 = time.monotonic()

        async def wait_until(due: float) -> None:  # monotonic; sending each late label as it falls due
            while True:
                now = time.monotonic()
                while late and late[0][0] <= now:
                    _, i = heapq.heappop(late)
                    label = encode_label(Label(ids[i], int(y[i]), time.time()))
                    await spawn(label_topic, label, 1, functools.partial(state.label_sent, i))
                if now >= due:
                    return
                await asyncio.sleep((min(due, late[0][0]) if late else due) - now)

        try:
            for i in range(n):
                await wait_until(t0 + i / opts.rate_hz if opts.rate_hz > 0 else 0.0)
                with_label = bool(labelled[i]) and opts.label_delay_s <= 0
                sample = Sample(ids[i], x[i], int(y[i]) if with_label else None, time.time())
                parts = split_message(encode_sample(sample), sample_topic, transport.packet_limit())
                chunked += len(parts) > 1
                sent = functools.partial(state.sample_sent, with_label)
                state.out.add(i)
                for k, part in enumerate(parts):  # in order: the device reassembles a large sample
                    await spawn(sample_topic, part, opts.qos, sent if k == len(parts) - 1 else None)
                if labelled[i] and opts.label_delay_s > 0:
                    heapq.heappush(late, (time.monotonic() + opts.label_delay_s, i))
            while late:
                await wait_until(late[0][0])
            if inflight:
                await asyncio.gather(*inflight)
            if errors:
                raise errors[0]
            publish_s = time.monotonic() - t0
            state.all_sent()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(state.settled.wait(), opts.wait_s)
        except TransportError as exc:
            error = str(exc)
            logger.debug("feed stopped early: %s", exc)
    finally:
        collector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collector
        for task in list(inflight):
            task.cancel()
        if own:
            await transport.stop()
    return state.result(y, chunked, time.monotonic() - t0, publish_s, error)


LABEL_STATUSES = 2
"""Device statuses after the last late label's PUBACK before its fate is known (the 2nd follows it)."""


class _Fate:
    """What became of a feed's samples and late labels: acknowledged, answered, refused."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sent = self.inline = self.late = 0
        self.predicted: dict[int, Prediction] = {}
        self.out: set[int] = set()  # samples whose publish began: a prediction before is another app's
        self.refused_samples: dict[int, IngestRefusal] = {}
        self.refused_labels: dict[int, IngestRefusal] = {}
        self.labels_out: set[int] = set()  # late labels acknowledged by the broker
        self.last: IngestRefusal | None = None
        self.done_sending = False
        self.statuses_after = 0  # device statuses since everything was acknowledged
        self.handled = -1  # the device's labels taken + messages refused, in its last status (-1: unknown)
        self.handled_before = -1  # ... when the first late label went out
        self.settled = asyncio.Event()

    def sample_sent(self, with_label: bool) -> None:
        self.sent += 1
        self.inline += with_label

    def label_sent(self, i: int) -> None:
        if not self.labels_out:
            self.handled_before = self.handled
        self.late += 1
        self.labels_out.add(i)

    def all_sent(self) -> None:
        self.done_sending = True
        self.statuses_after = 0
        self._check()

    def status_came(self, fields: Mapping[str, Any]) -> None:
        self.statuses_after += 1
        self.handled = _handled(fields)
        self._check()

    def answer(self, i: int, answer: Prediction | IngestRefusal) -> None:
        if isinstance(answer, Prediction):
            dup = i in self.refused_samples and self.refused_samples[i].reason == "duplicate"
            if i in self.out and not dup:
                self.predicted.setdefault(i, answer)
        elif answer.of == "sample":
            self.refused_samples.setdefault(i, answer)
            self.last = answer
            if answer.reason == "duplicate":  # the device classified another sample of this id
                self.predicted.pop(i, None)
        elif answer.reason != "duplicate":  # the same label again: the first one was applied
            self.refused_labels.setdefault(i, answer)
            self.last = answer
        self._check()

    def _check(self) -> None:
        if not self.done_sending:
            return
        answered = set(self.predicted) | set(self.refused_samples)
        samples_done = len(answered) >= self.sent
        labels_done = (
            not self.labels_out
            or len(self.refused_labels) >= len(self.labels_out)
            or (  # ... and the status counts every label sent since the first late one, taken or refused
                self.statuses_after >= LABEL_STATUSES
                and (self.handled_before < 0 or self.handled >= self.handled_before + len(self.labels_out))
            )
        )
        if samples_done and labels_done:
            self.settled.set()

    def result(
        self, y: np.ndarray, chunked: int, seconds: float, publish_s: float | None, error: str
    ) -> FeedResult:
        unanswered = [r for i, r in self.refused_samples.items() if i not in self.predicted]
        refused = dict(collections.Counter(r.reason for r in [*unanswered, *self.refused_labels.values()]))
        lat = np.array([p.latency_s for p in self.predicted.values()], dtype=np.float64)
        return FeedResult(
            self.sent,
            self.inline,
            self.late,
            len(self.predicted),
            sum(int(p.cls == y[i]) for i, p in self.predicted.items()),
            seconds,
            float(np.median(lat)) if len(lat) else None,
            float(np.percentile(lat, 95)) if len(lat) else None,
            publish_s,
            refused,
            self.last.detail if self.last is not None and refused else "",
            chunked,
            len(self.refused_labels),
            error,
        )


def _handled(fields: Mapping[str, Any]) -> int:
    """A device status's ``labels_received`` plus its ``rejected`` counts (-1 if it has no such fields)."""
    taken, rejected = fields.get("labels_received"), fields.get("rejected")
    if not isinstance(taken, int) or not isinstance(rejected, dict):
        return -1
    return taken + sum(
        n for n in rejected.values() if isinstance(n, int) and not isinstance(n, bool) and n > 0
    )


def check_samples(
    profile_path: Path | str, x: np.ndarray, y: np.ndarray, overrides: dict[str, object] | None = None
) -> list[str]:
    """What the device of a profile would refuse in ``x`` [N, *sample_shape], ``y`` int [N], if anything.

    Its ``[model]`` and ``[pipeline]`` are read (``overrides`` ``{"table.key": value}`` on top, as
    ``--set``) and the model loaded (a file without ``[model]`` checks nothing); one line per problem,
    naming the data, the device's expectation and the profile key.
    ConfigError for an invalid profile, ModelError for a model that cannot be loaded.
    """
    from edgefl.agent.config import load_profile  # here: the profile and LiteRT only with --profile
    from edgefl.runtime import Backbone

    _, data = read_toml(profile_path)
    if "model" not in data:
        return []
    profile = load_profile(profile_path, overrides, check_files=False)
    m = profile.model
    bb = Backbone(m.path, num_threads=1, runtime=m.runtime, embedding_tensor=m.embedding_tensor)
    shape, k = bb.sample_shape, int(bb.head_from_model()[0].shape[1])
    dtype = profile.pipeline.raw_dtype
    problems = []
    if tuple(x.shape[1:]) != shape:
        frame = " (one frame: a streaming model's state carries the earlier ones)" if bb.stateful else ""
        problems.append(
            f"x: samples of shape {list(x.shape[1:])}, the device's model ({m.path.name}) takes samples "
            f"of {list(shape)}{frame}"
        )
    if x.dtype != np.dtype(dtype):
        problems.append(f"x: dtype {x.dtype}, the device takes {dtype} (pipeline.raw_dtype)")
    ok = check_labels(y, k)
    if not ok.all():
        bad = sorted({int(v) for v in y[~ok]})
        problems.append(
            f"y: {int((~ok).sum())} label(s) outside 0..{label_range(k) - 1} (the model's head has "
            f"K = {k} classes): {bad[:5]}{' ...' if len(bad) > 5 else ''}"
        )
    return problems


# --- the command ---------------------------------------------------------------------------------------
HELP = """\
Publish the samples of FILE.npz (x: raw samples in the device's raw dtype and sample shape, y: integer
labels; the replay file format) to one device over MQTT, as a gateway app would: each sample is a
Sample message on <prefix>/<fleet>/samples/<device> (QoS --qos), RATE per second. A seeded random
fraction P of the samples is labelled: with --label-delay 0 the label travels inline in its Sample;
with S > 0 it is sent as a Label message on labels/<device> (QoS 1) S seconds after its sample, and the
sample's embedding waits on the device for it (source.label_expiry_s). Unlabelled samples are only
classified. Meanwhile the feed listens on predictions/<device>, where the device answers each sample
with a Prediction or, refusing it or its label, a Refusal naming its id and the reason; at the end it
waits up to --wait seconds for every sample's answer and the late labels' fate. A sample larger than
the packet limit travels in chunks.
Connecting: --profile FILE lends the [broker] table of a file (an app's, or a device profile), checked
as a profile's (TLS files, credentials, protocol, prefix); --set broker.KEY=VALUE overrides one of its
keys. Checking: a device profile (--check-profile, or --profile when it has a [model] table) has the
samples checked against its model before anything is sent (shape, dtype, label range); --set KEY=VALUE
of other tables overrides its keys, as for edgefl run.
A streaming model takes one frame per sample, its state carrying the earlier frames: send frames in
order and labels in runs. Prints one summary line (and --json PATH), also when the connection is lost.
Exit 0 when every sample got a prediction and no label was refused; 1 when some did not, or labels
were refused (the device's refusals of this feed's samples and labels are named); 2 on bad arguments
or samples the checked profile's device would refuse (each problem named); 4 when the broker cannot
be reached, refuses the credentials or the feed (ACL), or the connection is lost while feeding."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``feed`` sub-command to ``sub`` (from ``add_subparsers``)."""
    p: argparse.ArgumentParser = sub.add_parser(
        "feed",
        help="publish an .npz's samples (and labels) to a device over MQTT, like a gateway app",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--broker", required=True, help="mqtt://host[:port] or mqtts://host[:port]")
    p.add_argument("--fleet", required=True, help="the device's fleet (device.fleet)")
    p.add_argument("--device", required=True, help="the device id (device.id)")
    p.add_argument(
        "--data", required=True, type=Path, metavar="FILE.npz", help="x [N, ...] raw samples, y [N] labels"
    )
    p.add_argument(
        "--rate", dest="rate_hz", type=float, default=50.0, metavar="HZ", help="samples/s; 0: at once"
    )
    p.add_argument(
        "--label-fraction",
        type=float,
        default=1.0,
        metavar="P",
        help="fraction of the samples that get their label, in [0, 1] (default 1)",
    )
    p.add_argument(
        "--label-delay",
        dest="label_delay_s",
        type=float,
        default=0.0,
        metavar="S",
        help="0: label inline in the Sample (default); S > 0: a Label on labels/<device> S s after it",
    )
    p.add_argument("--qos", type=int, default=1, choices=(0, 1), help="QoS of the samples (default 1)")
    p.add_argument(
        "--wait",
        dest="wait_s",
        type=float,
        default=10.0,
        metavar="S",
        help="wait for the answers, seconds (default 10)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the labelled fraction (default 0)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="feed only the first N samples")
    p.add_argument(
        "--id-prefix",
        default=None,
        help="sample ids are <prefix><i> (default: a random 24-hex-digit token per sample)",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="a TOML file (an app's [broker] table, or a device profile) whose [broker] table gives TLS "
        "files, credentials, protocol and prefix; a device profile also checks the samples against its "
        "model (shape, dtype, label range) before sending",
    )
    p.add_argument(
        "--check-profile",
        default=None,
        metavar="PROFILE",
        help="the device's profile: the samples are checked against its model before sending (its "
        "[broker] table is not used to connect)",
    )
    add_set_argument(p, "broker.username=gw-7-cam")
    p.add_argument("--prefix", default=None, help="topic prefix (default: the profile's, or edgefl)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")
    p.set_defaults(func=cmd_feed)
    return p


def _broker(args: argparse.Namespace, sets: dict[str, object]) -> BrokerConfig:
    """``--profile``'s ``[broker]`` (as a device profile's), ``--broker``, ``--prefix``, ``--set`` on top.

    ConfigError if the file cannot be read, is not TOML, or the table is invalid (every problem named).
    """
    from edgefl.agent.config import AgentBrokerConfig

    overrides: dict[str, object] = {k: v for k, v in sets.items() if k.startswith("broker.")}
    overrides["broker.url"] = args.broker
    if args.prefix is not None:
        overrides["broker.topic_prefix"] = args.prefix
    folder, table = Path.cwd(), {}
    if args.profile is not None:
        file, data = read_toml(args.profile)
        folder, table = file.parent, data.get("broker", {})
    schema = Schema({"broker": (AgentBrokerConfig, check_broker)})
    broker: BrokerConfig = schema.parse({"broker": table}, folder, False, overrides)["broker"]
    return broker


def _check_profile(args: argparse.Namespace, sets: dict[str, object]) -> Path | None:
    """``--check-profile``, or ``--profile`` with a model; ValueError for other ``--set`` keys without one."""
    if args.check_profile is not None:
        return Path(args.check_profile)
    if args.profile is not None and "model" in read_toml(args.profile)[1]:
        return Path(args.profile)
    others = sorted(k for k in sets if not k.startswith("broker."))
    if others:
        raise ValueError(
            f"--set {', '.join(others)}: only broker.* keys apply without a device profile to check the "
            "samples against (--check-profile)"
        )
    return None


def _argument_problems(args: argparse.Namespace) -> list[str]:
    """Every bad argument value, each naming its option (empty: all fine)."""
    problems = []
    for option, value in (("--device", args.device), ("--fleet", args.fleet)):
        try:
            check_device_id(value)
        except ValueError as exc:
            problems.append(f"{option} {value!r}: {exc}")
    if not 0.0 <= args.label_fraction <= 1.0:
        problems.append(f"--label-fraction {args.label_fraction:g}: must be in [0, 1]")
    for option, value, unit in (
        ("--rate", args.rate_hz, "samples per second"),
        ("--label-delay", args.label_delay_s, "seconds"),
        ("--wait", args.wait_s, "seconds"),
    ):
        if not 0.0 <= value < float("inf"):
            problems.append(f"{option} {value:g}: must be a finite number of {unit} >= 0")
    if args.limit is not None and args.limit < 1:
        problems.append(f"--limit {args.limit}: must be >= 1 (the first N samples)")
    return problems


def cmd_feed(args: argparse.Namespace) -> int:
    """``edgefl feed``: see :data:`HELP`; returns the exit code."""
    try:
        problems = _argument_problems(args)
        if problems:
            raise ValueError("; ".join(problems))
        sets = parse_sets(args.set)
        names = [f.name for f in fields(FeedOptions) if f.name != "broker"]  # each the dest of its option
        opts = FeedOptions(broker=_broker(args, sets), **{name: getattr(args, name) for name in names})
        x, y = load_samples(opts.data, opts.limit)
        checked = _check_profile(args, sets)
        if checked is not None:
            model_sets = {k: v for k, v in sets.items() if not k.startswith("broker.")}
            problems = check_samples(checked, x, y, model_sets)
            if problems:
                print_problems(f"edgefl feed: {opts.data} does not fit device {opts.device}", problems)
                return 2
    except (ValueError, EdgeflError) as exc:
        print(f"edgefl feed: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(feed(opts))
    except EdgeflError as exc:
        print(f"edgefl feed: {exc}", file=sys.stderr)
        return 4
    return _report(opts, result, args.json)


def _report(opts: FeedOptions, result: FeedResult, json_path: str | None) -> int:
    """Print the summary (and write ``json_path``); return the exit code (:data:`HELP`)."""
    acc = result.accuracy
    print(
        f"fed {result.samples_sent} samples to {opts.device} in {result.seconds:.1f} s "
        f"({result.labels_inline} labels inline, {result.labels_late} late); "
        f"{result.predictions_received} predictions" + (f", accuracy {acc:.3f}" if acc is not None else ""),
        flush=True,
    )
    if json_path:
        doc = {**asdict(result), "accuracy": acc}
        atomic_write(Path(json_path), (json.dumps(doc, indent=2) + "\n").encode())
    samples_refused = sum(result.refused.values()) - result.labels_refused
    if result.refused:
        counts = ", ".join(f"{reason} {n}" for reason, n in sorted(result.refused.items()))
        what = " and ".join(
            w for w, k in (("samples", samples_refused), ("labels", result.labels_refused)) if k
        )
        last = f": last: {result.refused_detail}" if result.refused_detail else ""
        print(f"edgefl feed: device {opts.device} refused {what} ({counts}){last}", file=sys.stderr)
    if result.error:
        print(f"edgefl feed: stopped after {result.samples_sent} samples: {result.error}", file=sys.stderr)
        return 4
    unanswered = result.samples_sent - result.predictions_received - samples_refused
    if result.samples_sent and not result.predictions_received and not result.refused:
        topic = Topics(opts.broker.topic_prefix, opts.fleet).predictions(opts.device)
        print(
            f"edgefl feed: no prediction came back on {topic} in {opts.wait_s:g} s: check --fleet and "
            "--device (the agent's device.fleet and device.id) and that the agent runs with "
            'source.kind = "mqtt"',
            file=sys.stderr,
        )
    elif unanswered > 0:
        print(
            f"edgefl feed: {unanswered} sample(s) got neither a prediction nor a refusal in "
            f"{opts.wait_s:g} s: the device may be down or restarting (its persistent session keeps "
            "them at the broker until it is back: raise --wait), or they were dropped at the broker "
            "or from the device's full ingest queue (docs/operations.md, \"A slow device loses "
            'samples at the broker")',
            file=sys.stderr,
        )
    ok = result.predictions_received == result.samples_sent and not result.labels_refused
    return 0 if ok else 1
