"""The package layout's contract.

Device, coordinator and dashboard do not import each other (``edgefl/cli.py`` is the composition root
above them; DESIGN.md, Layout): the check reads the source (AST), so an import hidden in a function or
under ``TYPE_CHECKING`` counts too. Each module has one name and one file: no links in the tree, the
top-level folders importable only under ``edgefl``, every package folder listed in setup.cfg. No product
module over 800 lines (the known list only shrinks) and no issue references in product code.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT

from tests.support.source import SOURCE_GROUP, parse
from tools.typecheck import package_folders

PACKAGES = ("agent", "coordinator", "dashboard")
PRODUCT = ("agent", "coordinator", "dashboard", "edgefl", "cross_build")
"""The product's folders (what the line count and the limits below speak of)."""
MAX_MODULE_LINES = 800
OVERSIZE: frozenset[str] = frozenset()
"""Modules over the limit, to be split by job: a module leaves this list once it fits, none joins it."""
NOT_IN_TREE = {".git", ".venv", ".venv-build", "build", "cache", "out", "dist", "node_modules",
               ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "__pycache__"}
TOP_LEVEL_NAMES = ("agent", "coordinator", "dashboard", "models", "firmware_configs", "data")
"""Folders that are packages only under ``edgefl`` (setup.cfg package_dir)."""
ISSUE_REFERENCE = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)
pytestmark = SOURCE_GROUP


def tree_files() -> list[Path]:
    """Every file and link of the checkout, without the tools' caches and the virtual environments."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in NOT_IN_TREE and not d.endswith(".egg-info")]
        out += [Path(folder, name) for name in files + [d for d in dirs if Path(folder, d).is_symlink()]]
    return out


def product_modules() -> list[Path]:
    """The product's Python modules (:data:`PRODUCT`)."""
    return sorted(p for top in PRODUCT for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports, with its line (relative imports resolved against ``package``)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(parse(path)):
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


def test_layout_tree_has_no_links() -> None:
    links = [str(p.relative_to(ROOT)) for p in tree_files() if p.is_symlink()]
    assert links == []


def test_layout_no_module_imports_a_bare_top_level_name() -> None:
    bad = [
        f"{f.relative_to(ROOT)}:{line} imports {name}"
        for f in tree_files() if f.suffix == ".py"
        for line, name in imported_modules(f, "")
        if name.split(".")[0] in TOP_LEVEL_NAMES
    ]
    assert bad == []


@pytest.mark.subprocess
def test_layout_one_import_name_in_a_checkout() -> None:
    """From the checkout root (on ``sys.path``, as ``python -m`` puts it) ``agent`` is not a module."""
    code = (
        "import edgefl.agent.core as c, edgefl.dashboard.app as a, edgefl.coordinator.service as s\n"
        "print(c.__file__, a.__file__, s.__file__)\n"
        "for bare in ('agent', 'coordinator', 'dashboard'):\n"
        "    try:\n"
        "        __import__(bare + '.core' if bare == 'agent' else bare)\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
        "    else:\n"
        "        print(bare, 'imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0].split() == [str(ROOT / "agent" / "core.py"), str(ROOT / "dashboard" / "app.py"),
                                str(ROOT / "coordinator" / "service.py")]
    assert lines[1:] == [
        f"{bare}: import edgefl.{bare} (setup.cfg maps {bare}/ under edgefl)"
        for bare in ("agent", "coordinator", "dashboard")
    ]


def test_layout_every_package_folder_is_in_setup_cfg() -> None:
    listed = {str(folder) for folder in package_folders(ROOT / "setup.cfg").values()}
    folders = {
        str(p.parent.relative_to(ROOT))
        for top in ("edgefl", *PACKAGES, "models", "firmware_configs", "data")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert folders - listed == set()
    assert "cross_build" not in listed  # a build-machine tool: not in the wheel


def test_layout_no_module_over_the_line_limit() -> None:
    lines = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in product_modules()
    }
    over = {name for name, n in lines.items() if n > MAX_MODULE_LINES}
    assert over - OVERSIZE == set(), "split these by job"
    assert OVERSIZE - over == set(), "these fit now: take them off OVERSIZE"


def test_layout_no_issue_references_in_product_code() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in product_modules()
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if ISSUE_REFERENCE.search(line)
    ]
    assert found == []


def test_layout_issue_reference_pattern() -> None:
    texts = ("(issue 17)", "issues 8, 18", "Issue #4", "tissue 3", "an issue")
    hits = [t for t in texts if ISSUE_REFERENCE.search(t)]
    assert hits == ["(issue 17)", "issues 8, 18", "Issue #4"]


def module_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run at import: ``body`` and its ``if``/``try``/``with`` blocks (not function bodies)."""
    for node in body:
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for field in ("body", "orelse", "finalbody"):
                yield from module_statements(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from module_statements(handler.body)


def top_level_names(path: Path) -> tuple[set[str], set[str]]:
    """The names ``path`` defines at module level (def, class, assignment) and the names it imports there."""
    defined: set[str] = set()
    imported: set[str] = set()
    for node in module_statements(parse(path).body):
        if isinstance(node, ast.Import | ast.ImportFrom):
            imported |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
    return defined, imported


def checkout_file(module: str, folders: dict[str, Path]) -> Path | None:
    """The checkout's file of ``module`` (a package's ``__init__.py``), or None for a module not ours."""
    package, _, leaf = module.rpartition(".")
    folder = folders.get(module)
    if folder is not None:
        return ROOT / folder / "__init__.py"
    base = ROOT / folders[package] / leaf if package in folders else ROOT / module.replace(".", "/")
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def test_layout_every_name_is_imported_from_the_module_that_defines_it() -> None:
    """``from M import n`` names the module that defines ``n``, never one that only imports it: no name
    of the product, the tests or the benches has a second import path (no re-exports)."""
    folders = package_folders(ROOT / "setup.cfg")
    names: dict[Path, tuple[set[str], set[str]]] = {}
    bad = []
    for f in tree_files():
        if f.suffix != ".py" or f.is_symlink():
            continue
        for node in ast.walk(parse(f)):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module is None:
                continue
            source = checkout_file(node.module, folders)
            if source is None:
                continue
            if source not in names:  # (setdefault would parse the source again for every import)
                names[source] = top_level_names(source)
            defined, imported = names[source]
            bad += [
                f"{f.relative_to(ROOT)}:{node.lineno}: {alias.name} from {node.module}, which imports it"
                for alias in node.names
                if alias.name in imported - defined
                and checkout_file(f"{node.module}.{alias.name}", folders) is None  # not a submodule
            ]
    assert bad == []
