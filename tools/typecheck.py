"""Run mypy (strict, setup.cfg) on the product laid out as installed, with the checkout's paths.

The product's packages live in top-level folders that setup.cfg's ``package_dir`` maps under ``edgefl``
(``agent/`` is ``edgefl.agent``). The editable install finds them through an import hook, which mypy
does not follow; so this builds ``build/typecheck/edgefl``, links to the checkout's ``.py`` files laid out
as the wheel lays them out, runs mypy on it and on the tools beside the product (setup.cfg ``files``),
and prints every message with the checkout's path (``agent/core.py``, not the link's).

Usage: ``python -m tools.typecheck [mypy options]`` from the checkout root (``make typecheck``); exit code
is mypy's (0 clean, 1 errors, 2 crash).
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIRROR = Path("build") / "typecheck"


def package_folders(setup_cfg: Path) -> dict[str, Path]:
    """Each package setup.cfg lists, with the checkout folder that holds it.

    Parameters
    ----------
    setup_cfg : Path
        The checkout's setup.cfg (``[options] packages`` and ``package_dir``).

    Returns
    -------
    dict[str, Path]
        Dotted package name → folder relative to the checkout root, e.g. ``edgefl.agent`` → ``agent``.
    """
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg, encoding="utf-8")
    packages = cfg.get("options", "packages").split()
    mapped = {}
    for line in cfg.get("options", "package_dir", fallback="").splitlines():
        if "=" in line:
            name, folder = (part.strip() for part in line.split("=", 1))
            mapped[name] = Path(folder)
    folders: dict[str, Path] = {}
    for name in packages:
        parent, _, leaf = name.rpartition(".")
        folders[name] = mapped.get(name) or (folders[parent] / leaf if parent else Path(name))
    return folders


def build_mirror(root: Path, mirror: Path) -> dict[str, str]:
    """Rebuild ``mirror`` as links to the checkout's ``.py`` files laid out by package name.

    Parameters
    ----------
    root : Path
        The checkout root.
    mirror : Path
        The tree to (re)build, relative to ``root``; removed first.

    Returns
    -------
    dict[str, str]
        Mirror path → checkout path, both relative to ``root`` (to map mypy's messages back).
    """
    shutil.rmtree(root / mirror, ignore_errors=True)
    back = {}
    for name, folder in package_folders(root / "setup.cfg").items():
        target = mirror.joinpath(*name.split("."))
        for source in sorted((root / folder).glob("*.py")):
            link = target / source.name
            (root / target).mkdir(parents=True, exist_ok=True)
            (root / link).symlink_to(os.path.relpath(source, (root / link).parent))
            back[str(link)] = str(folder / source.name)
    return back


def main(argv: list[str]) -> int:
    """Build the mirror, run mypy with ``argv``, print its output with checkout paths; mypy's exit code."""
    os.chdir(ROOT)
    back = build_mirror(ROOT, MIRROR)
    done = subprocess.run([sys.executable, "-m", "mypy", *argv], capture_output=True, text=True, check=False)
    pattern = re.compile(re.escape(str(MIRROR)) + r"/[\w/]+\.py")
    for stream, text in ((sys.stdout, done.stdout), (sys.stderr, done.stderr)):
        stream.write(pattern.sub(lambda m: back.get(m.group(0), m.group(0)), text))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
