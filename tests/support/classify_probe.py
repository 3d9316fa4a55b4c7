"""Classify the demo's test set with a shipped model; the probe of ``check_emulated.sh``.

Three sub-commands, so the same file runs on the build machine and inside the emulated root::

    classify_probe.py export-test-set OUT.npz            (host) the digits test split, raw uint8
    classify_probe.py run MODEL RUNTIME TESTSET OUT.npz  (guest and host) logits and predictions
    classify_probe.py compare GUEST.npz HOST.npz         (host) exit 0 only if every prediction matches
    classify_probe.py codec                              (guest) codec round trip with the installed cbor2,
                                                         and a signature with the installed PyNaCl

``run`` goes through :class:`edgefl.agent.pipeline.Pipeline` (the code the agent ships), with the
profiles' digits normalisation (``raw / 16``) quantised by the model's input scale.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def export_test_set(out: Path) -> int:
    """Write the demo's test split to ``out``: ``x`` uint8 [N, 8, 8, 1] (0..16), ``y`` int64 [N]; 0."""
    from edgefl.datasets import load_digits, split_digits

    x, y = load_digits()
    test = split_digits(y, seed=0).test
    np.savez(out, x=x[test], y=y[test])
    return 0


def run(model: Path, runtime: str, testset: Path, out: Path) -> int:
    """Classify every test sample one at a time through :class:`edgefl.runtime.Backbone`; 0.

    ``runtime`` is ``"litert"`` or ``"tflite"``; ``out`` gets ``logits`` float32 [N, K], ``pred`` and
    ``y`` int64 [N], ``output_scale`` (one quantisation step of the logits), ``runtime``, ``machine``.
    """
    from edgefl.agent.pipeline import Pipeline
    from edgefl.runtime import Backbone

    data = np.load(testset)
    x, y = data["x"], data["y"]
    t0 = time.perf_counter()
    bb = Backbone(model, runtime=runtime)  # type: ignore[arg-type]
    load_s = time.perf_counter() - t0
    pipeline = Pipeline(bb, (0.0,), (16.0,), mode="unfused", batch=1)
    t0 = time.perf_counter()
    logits = pipeline.run(x.reshape(len(x), *bb.sample_shape))[1]
    infer_s = time.perf_counter() - t0
    pred = logits.argmax(axis=1).astype(np.int64)
    np.savez(out, logits=logits, pred=pred, y=y, output_scale=np.float64(bb.output_quant.scale),
             runtime=np.str_(bb.runtime_name), machine=np.str_(platform.machine()))
    print(f"{platform.machine()} {bb.runtime_name}: {len(y)} samples, accuracy {np.mean(pred == y):.4f}, "
          f"load {load_s * 1e3:.0f} ms, {infer_s / len(y) * 1e3:.2f} ms/sample")
    return 0


def compare(guest: Path, host: Path) -> int:
    """Compare the guest's predictions and logits with the host's: 0 if every prediction matches, else 1."""
    g, h = np.load(guest), np.load(host)
    same = int(np.sum(g["pred"] == h["pred"]))
    n = len(h["pred"])
    steps = float(np.max(np.abs(g["logits"] - h["logits"])) / float(h["output_scale"]))
    print(f"{g['machine']} {g['runtime']} vs {h['machine']} {h['runtime']}: predictions match {same}/{n}, "
          f"max |logit diff| = {steps:.1f} quantisation steps, accuracy {np.mean(g['pred'] == g['y']):.4f} "
          f"vs {np.mean(h['pred'] == h['y']):.4f}")
    return 0 if same == n else 1


def codec_round_trip() -> int:
    """Round-trip a DeviceStatus with the installed cbor2: 0 if it comes back equal, else 1."""
    from importlib.metadata import version

    from edgefl.errors import DecodeError
    from edgefl.wire.status import DeviceStatus, decode_status, encode_status

    msg = DeviceStatus(device="gw-1", state="online")
    try:
        ok = decode_status(encode_status(msg)) == msg
    except DecodeError as exc:
        print(f"{platform.machine()} cbor2 {version('cbor2')}: codec round trip FAILED: {exc}")
        return 1
    print(f"{platform.machine()} cbor2 {version('cbor2')}: codec round trip {'ok' if ok else 'MISMATCH'}")
    return (0 if ok else 1) | signing_check()


def signing_check() -> int:
    """Sign and verify with the installed PyNaCl: 0 if the RFC 8032 vector and a signed round check out.

    Source: RFC 8032 §7.1 (TEST 1).
    """
    from importlib.metadata import version

    from edgefl.errors import DecodeError
    from edgefl.wire.rounds import RoundAnnouncement, encode_round
    from edgefl.wire.signing import SigningKey, sign_message, verify_payload

    seed = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
    expected = bytes.fromhex(
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
    )
    import nacl.signing

    vector_ok = bytes(nacl.signing.SigningKey(seed).sign(b"").signature) == expected
    key = SigningKey(seed)
    announcement = RoundAnnouncement(1, 0, 30.0, 1, 0.1, 16, 1, ("gw-1",))
    payload = sign_message(encode_round, announcement, key, fleet="f")
    try:
        verify_payload(payload, key.verify_key, fleet="f", kind="round")
        verify_payload(payload, key.verify_key, fleet="other", kind="round")
        bound = False  # a signature must not verify for another fleet
    except DecodeError:
        bound = True
    ok = vector_ok and bound
    print(f"{platform.machine()} PyNaCl {version('pynacl')}: Ed25519 RFC 8032 vector "
          f"{'ok' if vector_ok else 'MISMATCH'}, signed round {'ok' if bound else 'NOT BOUND'}")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch the sub-command; returns the exit code (2 on a usage error)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["export-test-set"] and len(args) == 2:
        return export_test_set(Path(args[1]))
    if args[:1] == ["run"] and len(args) == 5:
        return run(Path(args[1]), args[2], Path(args[3]), Path(args[4]))
    if args == ["codec"]:
        return codec_round_trip()
    if args[:1] == ["compare"] and len(args) == 3:
        return compare(Path(args[1]), Path(args[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
