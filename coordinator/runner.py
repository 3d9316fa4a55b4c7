"""``edgefl coordinator``: the coordinator as its own long-running process.

It resumes from its state file after a restart (global head, version, round, history), evaluates
each new head on the held-out digits test set when the model is the digits model, and appends one
JSON line per closed round to ``--log`` so other tools (the chaos test) can audit the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.aio import within
from edgefl.coordinator.privacy import DPFedAvg
from edgefl.coordinator.service import Coordinator
from edgefl.coordinator.strategy import DEFAULT_STRATEGY, STRATEGY_NAMES, Strategy, make_strategy
from edgefl.errors import UpdateRejected
from edgefl.runtime import Backbone
from edgefl.topics import Topics
from edgefl.transport import MqttTransport
from edgefl.validators import parse_broker_url
from edgefl.wire.codec import Compression
from edgefl.wire.signing import load_signing_key, load_verify_keys

logger = logging.getLogger(__name__)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``coordinator`` sub-command to an ``argparse`` sub-parsers object.

    Returns
    -------
    argparse.ArgumentParser
        The sub-command's parser (``func`` set to :func:`main`).
    """
    from edgefl.resources import shipped

    p: argparse.ArgumentParser = sub.add_parser(
        "coordinator",
        help="run the coordinator of a fleet",
        description="Run federated rounds for one fleet over MQTT; resume from --state after a restart.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--broker", default="mqtt://127.0.0.1:1883", help="mqtt://host:port")
    p.add_argument("--fleet", default="default", help="fleet name: topics live under <prefix>/<fleet>/")
    p.add_argument("--prefix", default="edgefl", help="topic prefix")
    p.add_argument(
        "--model",
        default=str(shipped("models/digits_cnn_int8_rawin.tflite")),
        help="backbone .tflite (its sha256 binds the global head)",
    )
    p.add_argument("--rounds", type=int, default=10, help="rounds to run in total (resumed runs count on)")
    p.add_argument(
        "--min-clients", type=int, default=2, help="updates that close a round before its deadline"
    )
    p.add_argument("--deadline", type=float, default=60.0, help="round deadline, seconds")
    p.add_argument("--wait-devices", type=int, default=0, help="wait for this many ready devices first")
    p.add_argument("--local-epochs", type=int, default=2, help="client epochs per round")
    p.add_argument("--lr", type=float, default=0.05, help="client learning rate of round 1")
    p.add_argument("--lr-decay", type=float, default=0.8, help="per-round factor on the client learning rate")
    p.add_argument("--batch-size", type=int, default=16, help="client SGD batch size")
    p.add_argument(
        "--strategy",
        default=DEFAULT_STRATEGY,
        choices=STRATEGY_NAMES,
        help="aggregation rule; fedbuff runs buffered-asynchronous steps (one per round)",
    )
    p.add_argument(
        "--clip-norm",
        type=float,
        default=None,
        metavar="C",
        help="fixed bound on each update's L2 norm (default: adaptive, --clip-multiplier x round median)",
    )
    p.add_argument(
        "--clip-multiplier", type=float, default=2.0, help="adaptive norm bound, in round median norms"
    )
    p.add_argument("--trim-fraction", type=float, default=0.2, help="trimmed-mean: share cut at each end")
    p.add_argument(
        "--max-updates", type=int, default=64, help="median/trimmed-mean: most updates held per round"
    )
    p.add_argument("--buffer-size", type=int, default=3, help="fedbuff: updates per server step")
    p.add_argument("--max-staleness", type=int, default=20, help="fedbuff: refuse updates staler than this")
    p.add_argument(
        "--dp-noise-multiplier",
        type=float,
        default=None,
        metavar="Z",
        help="central DP (McMahan et al. 2018): noise sd = Z x --dp-clip-norm; FedAvg-family strategies only",
    )
    p.add_argument("--dp-clip-norm", type=float, default=1.0, help="DP: bound C on each update's L2 norm")
    p.add_argument("--dp-delta", type=float, default=1e-5, help="DP: delta at which epsilon is reported")
    p.add_argument(
        "--dp-expected-clients",
        type=float,
        default=None,
        help="DP: fixed denominator, expected updates per round (default: --min-clients)",
    )
    p.add_argument("--compression", default="none", choices=[c.value for c in Compression])
    p.add_argument(
        "--state", default=None, metavar="PATH", help="state file: resume from it, save each round"
    )
    p.add_argument("--log", default=None, metavar="PATH", help="append one JSON line per closed round")
    p.add_argument("--signing-key", default=None, metavar="PATH", help="Ed25519 key signing global/round")
    p.add_argument(
        "--device-keys", default=None, metavar="DIR", help="<device>.pub keys: require signed updates"
    )
    p.add_argument(
        "--max-packet-bytes", type=int, default=256 * 1024, help="the broker's maximum packet size"
    )
    p.set_defaults(func=main)
    return p


def build_strategy(args: argparse.Namespace) -> Strategy:
    """The strategy the flags name, wrapped in central DP when ``--dp-noise-multiplier`` is given.

    Raises
    ------
    ValueError
        On a bad combination (DP around median, trimmed mean or FedBuff) or out-of-range values.
    """
    own: dict[str, dict[str, Any]] = {
        "trimmed-mean": {"trim_fraction": args.trim_fraction, "max_updates": args.max_updates},
        "median": {"max_updates": args.max_updates},
        "fedbuff": {"buffer_size": args.buffer_size, "max_staleness": args.max_staleness},
    }
    strategy = make_strategy(
        args.strategy,
        local_epochs=args.local_epochs,
        lr=args.lr,
        batch_size=args.batch_size,
        min_clients=args.min_clients,
        deadline_s=args.deadline,
        clip_norm=args.clip_norm,
        clip_multiplier=args.clip_multiplier,
        **own.get(args.strategy, {}),
    )
    if args.dp_noise_multiplier is None:
        return strategy
    return DPFedAvg(
        strategy,
        clip_norm=args.dp_clip_norm,
        noise_multiplier=args.dp_noise_multiplier,
        expected_clients=args.dp_expected_clients or float(args.min_clients),
        delta=args.dp_delta,
    )


def main(args: argparse.Namespace) -> int:
    """Run the coordinator until ``--rounds`` rounds closed or SIGTERM; exit 0, or 1 on a failed start."""
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    from edgefl.datasets import load_digits, split_digits
    from edgefl.demo import accuracy, embed_all

    backbone = Backbone(Path(args.model))
    W0, b0 = backbone.head_from_model()
    evaluate = None
    if backbone.sample_shape == (8, 8, 1):
        x, y = load_digits()
        test = split_digits(y).test
        emb_test, y_test = embed_all(backbone, x[test], (0.0,), (16.0,)), y[test]

        def evaluate(W: np.ndarray, b: np.ndarray) -> float:
            return accuracy(W, b, emb_test, y_test)

    _, host, port = parse_broker_url(args.broker)
    # A persistent session: updates published while the coordinator restarts wait for it at the broker.
    transport = MqttTransport(host, port, f"edgefl-coordinator-{args.fleet}", session_expiry_s=3600)
    try:
        strategy = build_strategy(args)
    except ValueError as exc:
        print(f"edgefl coordinator: {exc}", file=sys.stderr)
        return 2
    coord = Coordinator(
        transport,
        Topics(args.prefix, args.fleet),
        W0,
        b0,
        model_sha256=backbone.sha256,
        strategy=strategy,
        evaluate=evaluate,
        compression=Compression(args.compression),
        lr_decay=args.lr_decay,
        signing_key=load_signing_key(Path(args.signing_key)) if args.signing_key else None,
        device_keys=load_verify_keys(Path(args.device_keys)) if args.device_keys else None,
        max_packet_bytes=args.max_packet_bytes,
    )
    state_path = Path(args.state) if args.state else None
    if state_path is not None:
        try:
            coord.load_state(state_path)
        except UpdateRejected as exc:
            print(f"edgefl coordinator: {exc}", file=sys.stderr)
            return 1
        coord.state_path = state_path
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await transport.start(wait_s=None)
    pump = asyncio.create_task(coord.pump())
    try:
        await within(transport.connected.wait(), 60)
        await coord.start()
        if args.wait_devices:
            await coord.wait_for_devices(args.wait_devices, timeout_s=120)
        while coord.state.round < args.rounds and not stop.is_set():
            r = coord.state.round + 1
            runner = asyncio.create_task(coord.run_round(r))
            stopper = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if runner not in done:
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner
                break
            rec = runner.result()
            if state_path is not None:
                coord.save_state(state_path)
            logger.info(
                "round %d: %d clients, accuracy %.3f, %d clipped (bound %.3g)%s%s",
                rec.round,
                rec.clients,
                rec.accuracy,
                rec.clipped,
                rec.norm_bound,
                "" if math.isnan(rec.epsilon) else f", epsilon {rec.epsilon:.3g} at delta {rec.delta:g}",
                f", REFUSED ({rec.refused}): kept version {coord.state.version}" if rec.refused else "",
            )
            if args.log:
                line = {
                    "round": rec.round,
                    "clients": rec.clients,
                    "accuracy": rec.accuracy,
                    "update_bytes_mean": rec.update_bytes_mean,
                    "duration_s": rec.duration_s,
                    "update_ids": coord.counted.get(rec.round, []),
                    "version": coord.state.version,
                    "strategy": strategy.name,
                    "clipped": rec.clipped,
                    "clipped_by_device": dict(strategy.clipped),  # since the start of this process
                    "norm_bound": rec.norm_bound if math.isfinite(rec.norm_bound) else None,
                    "epsilon": None if math.isnan(rec.epsilon) else rec.epsilon,
                    "delta": None if math.isnan(rec.delta) else rec.delta,
                    "refused": rec.refused or None,
                }
                with open(args.log, "a") as f:
                    f.write(json.dumps(line) + "\n")
    finally:
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
        await transport.stop()
    return 0
