"""Test harness (never shipped): the checkout's Python files parsed once per test process, and the
``xdist_group`` that runs the tests walking them in one process."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SOURCE_GROUP = pytest.mark.xdist_group("source")
"""The ``xdist_group`` of the tests that walk the checkout's ASTs (tests/test_layout.py, some of
tests/test_wire.py): one worker runs them all, so each file is parsed once in the suite, not once per
worker (two layout tests each parsed every file of the tree: ~2.5 s of CPU apiece)."""


@functools.cache
def parse(path: Path) -> ast.Module:
    """The module AST of ``path`` (UTF-8), parsed once per process: the layout and wire tests walk the
    same few hundred files, which do not change while the tests run. Callers must not modify it."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
