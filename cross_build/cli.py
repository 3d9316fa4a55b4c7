"""The ``edgefl wheelhouse`` sub-command: argument parsing only, cheap to import.

``edgefl/cli.py`` imports this module (in a source checkout) to register the sub-command; the builder
(:mod:`cross_build.wheelhouse`, with ``packaging``) is imported only when the sub-command runs.
"""

from __future__ import annotations

import argparse

# sorted(targets.TARGETS) and targets.PYTHONS, copied so that --help does not import packaging (a test checks)
TARGET_NAMES = ("aarch64", "armv7l", "x86_64")
PYTHON_VERSIONS = ("3.11", "3.12", "3.13")
DEFAULT_PREFIX = "/opt/edgefl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--target``, ``--python``, ``--out``, ``--prefix`` and ``--repo`` to a ``wheelhouse`` parser."""
    p.add_argument("--target", required=True, choices=TARGET_NAMES, help="gateway platform")
    p.add_argument("--python", default=None, choices=PYTHON_VERSIONS,
                   help="the device's CPython, wheels are tagged for it (default: the Python of the newest "
                        "Debian stable the target runs on: 3.13 for aarch64 and x86_64, 3.11 for armv7l)")
    p.add_argument("--out", required=True, help="output folder (its wheels/ is replaced)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX,
                   help=f"install prefix on the device (default {DEFAULT_PREFIX})")
    p.add_argument("--repo", default=None, help="edgefl source checkout (default: this one)")


def add_wheelhouse_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``edgefl wheelhouse --target T [--python V] --out DIR`` on ``edgefl.cli``'s sub-parsers."""
    w = sub.add_parser("wheelhouse", help="build an offline wheelhouse for a gateway (source checkout only)")
    add_arguments(w)
    w.set_defaults(func=run_wheelhouse)


def run_wheelhouse(args: argparse.Namespace) -> int:
    """Build the wheelhouse the parsed arguments ask for; returns the exit code (0 built, 1 failed)."""
    from .wheelhouse import run

    return run(args)
