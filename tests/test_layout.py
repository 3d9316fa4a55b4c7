"""The package layout's contract: device, coordinator and dashboard do not import each other.

``edgefl/cli.py`` and ``edgefl/demo.py`` are the composition root above them (DESIGN.md, Layout). The
check reads the source (AST), so an import hidden in a function or under ``TYPE_CHECKING`` counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGES = ("agent", "coordinator", "dashboard")


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports, with its line (relative imports resolved against ``package``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package if node.level else ""
            name = ".".join(p for p in (base, node.module or "") if p)
            out.append((node.lineno, name))
            out += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_layout_packages_do_not_import_each_other(package: str) -> None:
    others = [p for p in PACKAGES if p != package]
    forbidden = [f"edgefl.{p}" for p in others] + list(PACKAGES)  # bare "agent" etc.: not installed names
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules under {package}/"
    bad = [
        f"{f.relative_to(ROOT)}:{line} imports {name}"
        for f in files
        for line, name in imported_modules(f, f"edgefl.{package}")
        if any(name == x or name.startswith(x + ".") for x in forbidden)
    ]
    assert bad == []


def test_layout_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The checker itself: a lazy import inside a function is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from edgefl.dashboard.app import serve\n    from . import core\n")
    names = [n for _, n in imported_modules(probe, "edgefl.agent")]
    assert "edgefl.dashboard.app" in names and "edgefl.agent.core" in names
