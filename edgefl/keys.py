"""The ``edgefl keys`` command: make and show the Ed25519 keys that profiles take.

``generate`` writes ``NAME.key`` (PKCS #8 PEM, 0600) and ``NAME.pub`` (SPKI PEM), ``show`` prints a
key file's public key in hex and PEM (``docs/security.md``, "Keys"). Exit 0 done; 1 a file exists or
cannot be read, written or parsed (named, with why); 2 usage.

Source: RFC 8032 §5.1.5 (keys), RFC 8410 (their PKCS #8 / SPKI encoding), RFC 7468 (PEM).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from edgefl.wire.signing import (
    VerifyKey,
    parse_signing_key,
    parse_verify_key,
    public_pem,
    read_key_text,
    write_key_pair,
)


def cmd_generate(args: argparse.Namespace) -> int:
    """Write a new key pair (``--out``, ``--name``), print the files and the hex public key; 0, or 1."""
    try:
        private, public, key = write_key_pair(Path(args.out), args.name)
    except (OSError, ValueError) as exc:
        print(f"edgefl keys: {exc}", file=sys.stderr)
        return 1
    print(f"private key: {private} (PKCS #8 PEM, mode 0600: security.signing_key_file)")
    print(f"public key:  {public} (PEM: a device_keys_dir / site_keys_dir entry, or root_key_file)")
    hexkey = key.verify_key.hex
    print(f"public key (hex; a coordinator's goes in the devices' security.coordinator_public_key): {hexkey}")
    return 0


def _read_public(path: Path) -> VerifyKey:
    text = read_key_text(path, "key")
    try:
        return parse_signing_key(text).verify_key
    except ValueError as private_error:
        try:
            return parse_verify_key(text)
        except ValueError as public_error:
            raise ValueError(_neither(str(private_error), str(public_error))) from None


def _neither(private: str, public: str) -> str:
    """Why a file holds neither key, without calling it one kind when it is neither (a certificate)."""
    p, q = private.removeprefix("private key: "), public.removeprefix("public key: ")
    if "PUBLIC KEY" in p:
        return public  # a public key file, unusable: the public key's reason
    if p.replace("'PRIVATE KEY'", "'PUBLIC KEY'") == q:
        return "not an Ed25519 key: " + p.replace("'PRIVATE KEY'", "'PRIVATE KEY' or 'PUBLIC KEY'")
    return private


def cmd_show(args: argparse.Namespace) -> int:
    """Print the public key of a key file as 64 hex digits and as PEM; 0, or 1 (named, never quoted)."""
    path = Path(args.file)
    try:
        public = _read_public(path)
    except UnicodeDecodeError:
        print(f"edgefl keys: {path}: not a text file (64 hex digits or PEM)", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"edgefl keys: {path}: {exc}", file=sys.stderr)
        return 1
    print(public.hex)
    print(public_pem(public), end="")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``keys`` sub-command (``generate``, ``show``) to ``sub`` (from ``add_subparsers``)."""
    p: argparse.ArgumentParser = sub.add_parser("keys", help="make or show Ed25519 signing keys")
    ksub = p.add_subparsers(dest="keys_command", required=True)
    g = ksub.add_parser(
        "generate", help="write NAME.key (private, 0600) and NAME.pub; print the hex public key"
    )
    g.add_argument(
        "--out", required=True, metavar="DIR", help="folder for the two files (made 0700 if missing)"
    )
    g.add_argument("--name", required=True, help="file stem: a device id, coordinator, a site name")
    g.set_defaults(func=cmd_generate)
    s = ksub.add_parser("show", help="print the public key of a key file (hex and PEM)")
    s.add_argument("file", help="a private or public key file (64 hex digits or PEM)")
    s.set_defaults(func=cmd_show)
    return p
