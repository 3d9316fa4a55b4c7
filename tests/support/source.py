"""Test harness (never shipped): the checkout's Python files parsed once per test process."""

from __future__ import annotations

import ast
import functools
from pathlib import Path


@functools.cache
def parse(path: Path) -> ast.Module:
    """The module AST of ``path`` (UTF-8), parsed once per process: the layout and wire tests walk the
    same few hundred files, which do not change while the tests run. Callers must not modify it."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
