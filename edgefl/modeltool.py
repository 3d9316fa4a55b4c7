"""``edgefl model inspect`` and ``edgefl model prepare``: a user's own .tflite, read and made usable.

``inspect`` says what the model holds; ``prepare`` adds the embedding as an output, without TensorFlow.
A CLI-layer module: it may compose the runtime and the agent's memory estimates.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from edgefl import modelfile
from edgefl.errors import ModelError
from edgefl.records import atomic_write

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_MODEL = 3

#: Batch sizes the memory estimate is given for (a fixed-batch model: its own batch only).
ESTIMATE_BATCHES = (1, 8, 32)


def describe(path: Path, *, embedding_tensor: str | None = None) -> dict[str, Any]:
    """What the agent needs to know about a model, as a JSON-ready dict (``edgefl model inspect --json``).

    ``embedding_tensor`` as the profile's ``model.embedding_tensor``. The keys (a contract of ``--json``)
    are those built below; ``memory_bytes_per_batch``: ``estimates.estimate_inference_bytes`` per batch;
    ``backbone_sha256``: the identity on the wire. ModelError if the model cannot be loaded or has no head.
    """
    from edgefl.agent import estimates
    from edgefl.runtime import Backbone

    bb = Backbone(path, embedding_tensor=embedding_tensor)
    graph = bb.graph
    tin = graph.tensors[bb.input_index]
    tout = graph.tensors[bb.output_index]
    wi = bb.head_weights_index
    W, _ = bb.head_from_model() if wi is not None else (None, None)
    shapes = estimates.model_shapes(bb)
    batches = ESTIMATE_BATCHES if bb.resizable else (bb.batch,)
    return {
        "model": str(path),
        "sha256": bb.sha256,
        "backbone_sha256": bb.backbone_sha256,
        "runtime": bb.runtime_name,
        "input": {
            "name": tin.name,
            "shape": list(tin.shape),
            "shape_signature": list(tin.shape_signature or tin.shape),
            "dtype": tin.dtype,
            "scale": bb.input_quant.scale,
            "zero_point": bb.input_quant.zero_point,
        },
        "embedding_tensor": {"index": bb.embedding_index, "name": graph.tensors[bb.embedding_index].name},
        "embedding_dim": bb.embedding_dim,
        "num_classes": int(W.shape[1]) if W is not None else shapes.classes,
        "head_weight_dtype": graph.tensors[wi].dtype if wi is not None else None,
        "head_activation": bb.head_activation,
        "output": {
            "index": bb.output_index,
            "name": tout.name,
            "dtype": tout.dtype,
            "shape": list(tout.shape),
            "scale": bb.output_quant.scale,
            "zero_point": bb.output_quant.zero_point,
        },
        "stateful": bb.stateful,
        "stateful_ops": bb.stateful_ops,
        "embedding_output": bb.embedding_output,
        "batch_resizable": bb.resizable,
        "memory_bytes_per_batch": {str(n): estimates.estimate_inference_bytes(shapes, n) for n in batches},
    }


def prepare_bytes(buf: bytes, *, embedding_tensor: str | None = None, path: str = "<model>") -> bytes:
    """The model with its embedding added as an extra output (the original outputs first, unchanged).

    ``embedding_tensor`` names it (None: the last FULLY_CONNECTED op's input). ModelError if there is
    no such op (and no name) or the name is not a tensor.
    """
    graph = modelfile.read_graph(buf, path)
    if embedding_tensor:
        index = modelfile.find_tensor(graph, embedding_tensor, path)
    else:
        fc = modelfile.head_fc(graph)
        if fc is None:
            raise ModelError(path, "no FULLY_CONNECTED op: name the embedding with --embedding-tensor")
        index = graph.ops[fc].inputs[0]
    return modelfile.add_outputs(buf, [index], path)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``edgefl model inspect MODEL [--json PATH]``: print the model's description (exit 3 if unusable)."""
    try:
        info = describe(Path(args.model), embedding_tensor=args.embedding_tensor)
    except ModelError as exc:
        print(f"edgefl: model error: {exc}", file=sys.stderr)
        return EXIT_MODEL
    text = json.dumps(info, indent=2)
    if args.json:
        atomic_write(Path(args.json), (text + "\n").encode())
    i = info["input"]
    print(f"{info['model']}")
    print(f"  input      {i['dtype']} {i['shape']} (signature {i['shape_signature']}), "
          f"scale {i['scale']:.6g}, zero point {i['zero_point']}")  # fmt: skip
    print(f"  head       FULLY_CONNECTED D={info['embedding_dim']} K={info['num_classes']} "
          f"weights {info['head_weight_dtype']}, then {info['head_activation']}")  # fmt: skip
    print(f"  embedding  tensor {info['embedding_tensor']['index']} "
          f"{info['embedding_tensor']['name']!r}, model output: {info['embedding_output']}")  # fmt: skip
    print(f"  stateful   {info['stateful']} {info['stateful_ops'] or ''}".rstrip())
    print(f"  batch      resizable: {info['batch_resizable']}")
    mem = ", ".join(f"batch {k}: {v / 2**20:.1f} MiB" for k, v in info["memory_bytes_per_batch"].items())
    print(f"  inference  {mem}")
    if not info["embedding_output"]:
        print(f"  note       the agent adds the embedding as an output at start-up; "
              f"`edgefl model prepare {args.model} --out OUT` writes that model")  # fmt: skip
    return EXIT_OK


def cmd_prepare(args: argparse.Namespace) -> int:
    """``edgefl model prepare MODEL --out OUT [--mean M --std S --raw-dtype uint8]``.

    Writes the model with its embedding as an extra output (and, given ``--mean``/``--std``, the
    normalisation folded into a uint8 input, :mod:`edgefl.modelfold`), then the original's SHA-256
    (:func:`edgefl.modelfile.with_origin`: the same backbone, ``model_sha256``, as the original).
    Exit 0, 2 (usage: only one of --mean/--std, or either on a float-input model, whose
    normalisation belongs in ``pipeline.mean``/``std``) or 3 (the model cannot be prepared).
    """
    from edgefl.runtime import Backbone

    if (args.mean is None) != (args.std is None):
        print("edgefl: model prepare: give both --mean and --std, or neither", file=sys.stderr)
        return EXIT_USAGE
    src = Path(args.model)
    report = None
    try:
        if not src.is_file():
            raise ModelError(str(src), "model file not found")
        buf = src.read_bytes()
        origin = modelfile.read_origin(buf) or hashlib.sha256(buf).hexdigest()  # prepared twice: the first
        buf = modelfile.strip_origin(buf)
        if args.mean is not None:
            from edgefl.modelfold import fold_input_normalisation

            graph = modelfile.read_graph(buf, str(src))
            kinds = [graph.tensors[i].dtype for i in graph.inputs]
            if kinds and all(k.startswith("float") for k in kinds):
                # a usage error, not a broken model: the normalisation belongs in the profile then
                print(
                    f"edgefl: model prepare: {src} has a {kinds[0]} input: the fold applies to int8-input "
                    "models; set pipeline.mean/std instead (and run prepare without --mean/--std)",
                    file=sys.stderr,
                )
                return EXIT_USAGE

            buf, report = fold_input_normalisation(
                buf, args.mean, args.std, raw_dtype=args.raw_dtype, path=str(src)
            )
        out = prepare_bytes(buf, embedding_tensor=args.embedding_tensor, path=str(src))
        atomic_write(Path(args.out), modelfile.with_origin(out, origin))
        bb = Backbone(Path(args.out), embedding_tensor=args.embedding_tensor, prepare=False)
    except ModelError as exc:
        print(f"edgefl: model error: {exc}", file=sys.stderr)
        return EXIT_MODEL
    print(f"wrote {args.out}: embedding tensor {bb.embedding_index} (D={bb.embedding_dim}) is output "
          f"{len(bb.graph.outputs) - 1}; the original outputs are unchanged")  # fmt: skip
    if report is not None:
        shift = report.shift_steps
        exact = "exact" if shift == 0 else f"inputs shifted by {shift:.3f} int8 steps (mean not an integer)"
        print(f"  input uint8, scale {report.scale:.8g} (1/std), zero point {report.zero_point}, one "
              f"QUANTIZE to the int8 input: {exact}, {report.ties} rounding tie(s)")  # fmt: skip
        print(f"  give the pipeline mean = {report.mean_used:g}, std = {args.std:g}: "
              "its fused step is then a copy")  # fmt: skip
    return EXIT_OK


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``model`` sub-command (``inspect``, ``prepare``) to ``sub`` (from ``add_subparsers``)."""
    p: argparse.ArgumentParser = sub.add_parser("model", help="inspect or prepare a user's own .tflite")
    msub = p.add_subparsers(dest="model_command", required=True)
    i = msub.add_parser("inspect", help="input, head, activation, state, batch and memory of a model")
    i.add_argument("model", help="the .tflite model")
    i.add_argument("--json", default=None, metavar="PATH", help="also write the description as JSON")
    i.add_argument("--embedding-tensor", default=None, help="the embedding's tensor name (default: FC input)")
    i.set_defaults(func=cmd_inspect)
    r = msub.add_parser("prepare", help="write the model with its embedding as an extra output")
    r.add_argument("model", help="the .tflite model")
    r.add_argument("--out", required=True, help="the prepared .tflite to write")
    r.add_argument("--embedding-tensor", default=None, help="the embedding's tensor name (default: FC input)")
    r.add_argument("--mean", type=float, default=None, help="fold x = (raw - mean) / std into a uint8 input")
    r.add_argument("--std", type=float, default=None, help="the normalisation's std (with --mean)")
    r.add_argument("--raw-dtype", default="uint8", choices=("uint8",), help="raw sample dtype (uint8)")
    r.set_defaults(func=cmd_prepare)
    return p
