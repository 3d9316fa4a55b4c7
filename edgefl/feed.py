"""``edgefl feed``: publish a sample file to a device over MQTT, as a gateway's own app would.

A replay-format ``.npz`` goes out as Samples (and labels, inline or late), with the broker
connection the agent makes; the feed reports the predictions and what the device refused. Usage,
exit codes and messages: ``docs/operations.md``; the messages: ``docs/protocol.md`` ("Live ingest").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.errors import DecodeError, EdgeflError, TransportError
from edgefl.profiles import BrokerConfig, Schema, broker_password, check_broker, read_toml
from edgefl.records import atomic_write
from edgefl.tlsconf import ssl_context_for
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.validators import check_device_id, parse_broker_url
from edgefl.wire.chunking import split_message
from edgefl.wire.ingest import Label, Prediction, Sample, decode_prediction, encode_label, encode_sample
from edgefl.wire.status import decode_status

logger = logging.getLogger(__name__)

IN_FLIGHT = 64
"""QoS 1 publishes awaiting their PUBACK at once (as fast as the broker acknowledges, not one RTT each)."""


@dataclass(frozen=True, slots=True)
class FeedOptions:
    """What to feed where (``edgefl feed --help``).

    ``data`` is an ``.npz`` with ``x`` [N, *sample_shape] and ``y`` int [N], sent to
    ``<prefix>/<fleet>/samples/<device>``; ``rate_hz`` samples per second (0: as fast as the broker
    takes them); ``label_fraction`` in [0, 1] of them labelled (chosen by ``seed``), inline or as a
    Label ``label_delay_s`` seconds later; ``qos`` of the Samples (Labels: 1); ``wait_s`` seconds to
    wait for the device's readiness and the missing predictions; sample ids ``<id_prefix><i>`` (default
    a random token); ``limit`` the first samples only.
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

    ``labels_inline``/``labels_late`` count labels in a Sample / as Label messages;
    ``predictions_received`` one per id; ``correct`` against ``y``; ``seconds`` from the first publish;
    ``latency_s_median``/``latency_s_p95`` over the device's ``latency_s`` (seconds, None without
    predictions); ``publish_s`` to the last acknowledged publish; ``refused`` the rise of the device's
    ``rejected`` counters by reason, ``refused_detail`` its ``last_rejected``; ``chunked`` samples sent
    in chunks.
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

    @property
    def accuracy(self) -> float | None:
        """``correct / predictions_received`` (None without predictions)."""
        return self.correct / self.predictions_received if self.predictions_received else None


def load_samples(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read a replay-format ``.npz``: ``x`` [N, ...] raw, ``y`` int64 [N]; ValueError naming the problem."""
    try:
        with np.load(path, allow_pickle=False) as data:
            x, y = np.asarray(data["x"]), np.asarray(data["y"]).astype(np.int64)
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not an .npz holding x and y ({exc})") from exc
    if x.ndim < 2 or len(x) != len(y):
        raise ValueError(f"{path}: x {list(x.shape)} and y {list(y.shape)} do not match")
    return x, y


async def feed(opts: FeedOptions, *, transport: MqttTransport | None = None) -> FeedResult:
    """Publish the samples (and labels) of ``opts.data`` to a device and collect its predictions.

    ``transport``: a started transport to use (by default the feed connects its own). ValueError for an
    unreadable data file; TransportError if the broker cannot be reached or refuses a publish;
    ConfigError if TLS files or the password file cannot be read.
    """
    x, y = load_samples(opts.data)
    if opts.limit is not None:
        x, y = x[: opts.limit], y[: opts.limit]
    n = len(x)
    rng = np.random.default_rng(opts.seed)
    labelled = np.zeros(n, dtype=bool)
    labelled[rng.permutation(n)[: round(opts.label_fraction * n)]] = True
    prefix = opts.id_prefix if opts.id_prefix is not None else os.urandom(3).hex() + "-"
    ids = [f"{prefix}{i}" for i in range(n)]
    index = {sid: i for i, sid in enumerate(ids)}
    topics = Topics(opts.broker.topic_prefix, opts.fleet)
    own = transport is None
    if transport is None:
        b = opts.broker
        transport = MqttTransport(
            b.host,
            b.port,
            f"edgefl-feed-{opts.device}-{prefix.rstrip('-')}",
            protocol=b.protocol,
            keepalive_s=b.keepalive_s,
            queue_size=max(256, 2 * n),
            username=b.username,
            password=broker_password(b),
            tls_context=ssl_context_for(b),
            max_packet_bytes=b.max_packet_bytes,
            max_incoming_packet_bytes=b.max_incoming_packet_bytes,
        )
        await transport.start(wait_s=15)
    predicted: dict[int, Prediction] = {}
    all_in = asyncio.Event()
    device_ready = asyncio.Event()  # the device's status says it takes samples (its subscriptions are in)
    statuses: list[dict[str, Any]] = []  # the retained one first (the baseline), then the device's news
    status_topic = topics.status(opts.device)

    def refused_now() -> dict[str, int]:
        return _rise(statuses[0], statuses[-1]) if statuses else {}

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
                statuses.append(dict(st.fields))
                if st.state != "offline" and st.fields.get("ready") is True:
                    device_ready.set()
                if n and len(predicted) + sum(refused_now().values()) >= n:
                    all_in.set()  # every sample answered or refused: nothing more will come
                continue
            if msg.topic != topics.predictions(opts.device):
                continue
            try:
                p = decode_prediction(msg.payload)
            except DecodeError as exc:
                logger.warning("prediction refused: %s", exc)
                continue
            i = index.get(p.id)
            if i is not None:
                predicted.setdefault(i, p)
                if len(predicted) + sum(refused_now().values()) >= n:
                    all_in.set()

    sem = asyncio.Semaphore(IN_FLIGHT)
    inflight: set[asyncio.Task[None]] = set()
    errors: list[TransportError] = []

    async def send(topic: str, payload: bytes, qos: int) -> None:
        assert transport is not None
        try:
            await transport.publish(topic, payload, qos=qos)
        except TransportError as exc:
            errors.append(exc)
        finally:
            sem.release()

    async def spawn(topic: str, payload: bytes, qos: int) -> None:
        if errors:
            raise errors[0]
        await sem.acquire()  # back-pressure: at most IN_FLIGHT unacknowledged publishes
        task = asyncio.create_task(send(topic, payload, qos))
        inflight.add(task)
        task.add_done_callback(inflight.discard)

    collector = asyncio.create_task(collect())
    late: list[tuple[float, int]] = []  # (due monotonic, sample index), a heap
    inline = late_sent = chunked = 0
    t0 = time.monotonic()
    try:
        # the retained status first: its rejected counters are the baseline the feed's refusals rise from
        await transport.subscribe(status_topic, 1)
        await transport.subscribe(topics.predictions(opts.device), 1)
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

        async def send_due_labels(now: float) -> None:
            nonlocal late_sent
            while late and late[0][0] <= now:
                _, i = heapq.heappop(late)
                await spawn(label_topic, encode_label(Label(ids[i], int(y[i]), time.time())), 1)
                late_sent += 1

        for i in range(n):
            if opts.rate_hz > 0:
                due = t0 + i / opts.rate_hz
                while (now := time.monotonic()) < due:
                    await send_due_labels(now)
                    await asyncio.sleep(max(0.0, (min(due, late[0][0]) if late else due) - now))
            await send_due_labels(time.monotonic())
            with_label = bool(labelled[i]) and opts.label_delay_s <= 0
            sample = Sample(ids[i], x[i], int(y[i]) if with_label else None, time.time())
            limit = transport.packet_limit()
            parts = split_message(encode_sample(sample), sample_topic, limit)  # a random chunk set id
            chunked += len(parts) > 1
            for part in parts:  # in order: the device reassembles a sample larger than a packet
                await spawn(sample_topic, part, opts.qos)
            inline += with_label
            if labelled[i] and opts.label_delay_s > 0:
                heapq.heappush(late, (time.monotonic() + opts.label_delay_s, i))
        while late:
            await asyncio.sleep(max(0.0, late[0][0] - time.monotonic()))
            await send_due_labels(time.monotonic())
        if inflight:
            await asyncio.gather(*inflight)
        if errors:
            raise errors[0]
        publish_s = time.monotonic() - t0
        if n:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_in.wait(), opts.wait_s)
    finally:
        collector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collector
        for task in list(inflight):
            task.cancel()
        if own:
            await transport.stop()
    correct = sum(int(p.cls == y[i]) for i, p in predicted.items())
    lat = np.array([p.latency_s for p in predicted.values()], dtype=np.float64)
    last = statuses[-1].get("last_rejected") if statuses else None
    refused = refused_now()
    detail = str(last.get("detail", "")) if isinstance(last, dict) and refused else ""
    return FeedResult(
        n,
        inline,
        late_sent,
        len(predicted),
        correct,
        time.monotonic() - t0,
        float(np.median(lat)) if len(lat) else None,
        float(np.percentile(lat, 95)) if len(lat) else None,
        publish_s,
        refused,
        detail,
        chunked,
    )


def _rise(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """By how much each of a device status's ``rejected`` counters rose from ``before`` to ``after``."""
    b, a = before.get("rejected"), after.get("rejected")
    if not isinstance(a, dict):
        return {}
    b = b if isinstance(b, dict) else {}
    out = {}
    for reason, count in a.items():
        base = b.get(reason, 0)
        base = base if isinstance(base, int) and not isinstance(base, bool) and base >= 0 else 0
        if isinstance(count, int) and not isinstance(count, bool) and count > base:
            out[str(reason)] = count - base
    return out


def check_samples(profile_path: Path | str, x: np.ndarray, y: np.ndarray) -> list[str]:
    """What the device of a profile would refuse in ``x`` [N, *sample_shape], ``y`` int [N], if anything.

    Its ``[model]`` and ``[pipeline]`` are read and the model loaded (a file without ``[model]`` checks
    nothing); one line per problem, naming the data, the device's expectation and the profile key.
    ConfigError for an invalid profile, ModelError for a model that cannot be loaded.
    """
    from edgefl.agent.config import load_profile  # here: the profile and LiteRT only with --profile
    from edgefl.head import check_labels, label_range
    from edgefl.runtime import Backbone

    _, data = read_toml(profile_path)
    if "model" not in data:
        return []
    profile = load_profile(profile_path, check_files=False)
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
Publish the samples of FILE.npz (x: raw samples in the device's raw dtype and sample shape, y: labels;
the replay file format) to one device over MQTT, as a gateway app would: each sample is a Sample
message on <prefix>/<fleet>/samples/<device> (QoS --qos), RATE per second. A seeded random fraction P of
the samples is labelled: with --label-delay 0 the label travels inline in its Sample; with S > 0 it is
sent as a Label message on labels/<device> (QoS 1) S seconds after its sample, and the sample's
embedding waits on the device for it (source.label_expiry_s). Unlabelled samples are only classified.
Meanwhile the feed listens on predictions/<device> and at the end waits up to --wait seconds for a
prediction of every sample; a sample larger than the packet limit travels in chunks. With --profile
naming a device profile, the samples are first checked against its model (shape, dtype, labels).
When samples got no prediction, the device's status says why (its rejected counters): printed.
A streaming model takes one frame per sample, its state carrying the earlier frames: send frames in
order and labels in runs. Prints one summary line (and --json PATH).
Exit 0 when every sample got a prediction; 1 when some did not (the device's refusals are named);
2 on bad arguments or samples the --profile's device would refuse (each problem named); 4 when the
broker cannot be reached or refuses the feed (credentials, ACL)."""


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
        help="wait for predictions (default 10)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the labelled fraction (default 0)")
    p.add_argument("--limit", type=int, default=None, help="feed only the first N samples")
    p.add_argument("--id-prefix", default=None, help="sample ids are <prefix><i> (default: a random token)")
    p.add_argument(
        "--profile",
        default=None,
        help="a TOML file (a device profile, or only a [broker] table) whose [broker] table gives TLS "
        "files, credentials, protocol and prefix; a device profile also checks the samples against its "
        "model (shape, dtype, label range) before sending",
    )
    p.add_argument("--prefix", default=None, help="topic prefix (default: the profile's, or edgefl)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")
    p.set_defaults(func=cmd_feed)
    return p


def load_broker_table(path: Path | str, overrides: dict[str, object]) -> BrokerConfig:
    """The validated ``[broker]`` table of a TOML file (other tables ignored), ``overrides`` on top.

    The table is read as a device profile's (its keys, the agent's session included, and
    :func:`edgefl.profiles.check_broker`). ``overrides`` are ``{"broker.key": value}`` (``--broker``,
    ``--prefix``). ConfigError if the file cannot be read, is not TOML, or the table is invalid (every
    problem named).
    """
    from edgefl.agent.config import AgentBrokerConfig  # a device profile's [broker] keys

    file, data = read_toml(path)
    table = data.get("broker", {})
    schema = Schema({"broker": (AgentBrokerConfig, check_broker)})
    built = schema.parse({"broker": table}, file.parent, False, overrides)
    broker: BrokerConfig = built["broker"]
    return broker


def _broker(args: argparse.Namespace) -> BrokerConfig:
    """The broker options: the profile's ``[broker]``, ``--broker``/``--prefix`` on top; or the URL alone."""
    overrides: dict[str, object] = {"broker.url": args.broker}
    if args.prefix is not None:
        overrides["broker.topic_prefix"] = args.prefix
    if args.profile is not None:
        return load_broker_table(args.profile, overrides)
    parse_broker_url(args.broker)  # ValueError names the problem
    return BrokerConfig(
        url=args.broker,
        topic_prefix=args.prefix or "edgefl",
        tls=args.broker.startswith("mqtts://"),
    )


def cmd_feed(args: argparse.Namespace) -> int:
    """``edgefl feed``: see :data:`HELP`; returns the exit code."""
    try:
        check_device_id(args.device)
        check_device_id(args.fleet)
        if not (0.0 <= args.label_fraction <= 1.0 and args.rate_hz >= 0 and args.label_delay_s >= 0):
            raise ValueError("--label-fraction must be in [0, 1], --rate and --label-delay >= 0")
        names = [f.name for f in fields(FeedOptions) if f.name != "broker"]  # each the dest of its option
        opts = FeedOptions(broker=_broker(args), **{name: getattr(args, name) for name in names})
        x, y = load_samples(opts.data)
        if args.profile is not None:
            if args.limit is not None:
                x, y = x[: args.limit], y[: args.limit]
            problems = check_samples(args.profile, x, y)
            if problems:
                print(f"edgefl feed: {opts.data} does not fit device {opts.device}:", file=sys.stderr)
                for problem in problems:
                    print(f"  {problem}", file=sys.stderr)
                return 2
    except (ValueError, EdgeflError) as exc:
        print(f"edgefl feed: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(feed(opts))
    except EdgeflError as exc:
        print(f"edgefl feed: {exc}", file=sys.stderr)
        return 4
    acc = result.accuracy
    print(
        f"fed {result.samples_sent} samples to {opts.device} in {result.seconds:.1f} s "
        f"({result.labels_inline} labels inline, {result.labels_late} late); "
        f"{result.predictions_received} predictions" + (f", accuracy {acc:.3f}" if acc is not None else "")
    )
    if args.json:
        doc = {**asdict(result), "accuracy": acc}
        atomic_write(Path(args.json), (json.dumps(doc, indent=2) + "\n").encode())
    if result.refused:
        counts = ", ".join(f"{reason} {n}" for reason, n in sorted(result.refused.items()))
        last = f": last: {result.refused_detail}" if result.refused_detail else ""
        print(f"edgefl feed: device {opts.device} refused samples ({counts}){last}", file=sys.stderr)
    elif result.samples_sent and not result.predictions_received:
        topic = Topics(opts.broker.topic_prefix, opts.fleet).predictions(opts.device)
        print(
            f"edgefl feed: no prediction came back on {topic} in {opts.wait_s:g} s: check --fleet and "
            "--device (the agent's device.fleet and device.id) and that the agent runs with "
            'source.kind = "mqtt"',
            file=sys.stderr,
        )
    return 0 if result.predictions_received == result.samples_sent else 1
