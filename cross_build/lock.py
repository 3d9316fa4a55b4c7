"""Check a wheelhouse's wheels against their target (closure, expected versions), and write its lock.

Source: PEP 427 (wheel files), core metadata 2.x (``Requires-Dist``), pip's secure installs
(``--require-hashes``).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from .targets import Target, WheelhouseError, applicable_requirements, supported_wheel


@dataclass(frozen=True, slots=True)
class LockEntry:
    """One line of ``requirements.lock``: canonical ``name``, ``version``, hex ``sha256``, ``filename``."""

    name: str
    version: str
    sha256: str
    filename: str = ""


@dataclass(frozen=True, slots=True)
class WheelInfo:
    """One wheel file: ``path``, canonical ``name``, ``version``, its ``requires_dist`` (PEP 508 strings)."""

    path: Path
    name: str
    version: str
    requires_dist: tuple[str, ...]


def read_wheel(path: Path) -> WheelInfo:
    """Read a wheel's name, version and ``Requires-Dist`` from its ``*.dist-info/METADATA``.

    WheelhouseError if the file is not a readable wheel with a METADATA file.
    Source: PEP 427 (wheel layout), core metadata 2.x (``Requires-Dist``).
    """
    try:
        name, version, _build, _tags = parse_wheel_filename(path.name)
        with zipfile.ZipFile(path) as zf:
            meta_name = next(
                n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1
            )
            text = zf.read(meta_name).decode("utf-8")
    except (ValueError, StopIteration, OSError, zipfile.BadZipFile) as exc:
        raise WheelhouseError(path.name, "-", f"not a readable wheel: {exc}") from exc
    meta = Parser().parsestr(text, headersonly=True)
    return WheelInfo(path, str(name), str(version), tuple(meta.get_all("Requires-Dist") or ()))


def check_closure(wheels: Sequence[WheelInfo], target: Target, root: str = "edgefl") -> None:
    """Check that every requirement of every wheel is met by the wheelhouse or the device's OS.

    The target's extras apply to ``root``; its system packages count as installed. WheelhouseError
    names the first unmet requirement (and who needs it), a wheel that does not install on the target,
    or two wheels of one distribution.
    """
    have: dict[str, Version] = {}
    for w in wheels:
        if w.name in have:
            raise WheelhouseError(w.name, target.platform, "two wheels of the same distribution")
        if not supported_wheel(w.path.name, target):
            raise WheelhouseError(w.name, target.platform, f"{w.path.name} does not install on the target")
        have[w.name] = Version(w.version)
    for sys_name, sys_version in target.system_packages.items():
        have.setdefault(str(canonicalize_name(sys_name)), Version(sys_version))
    for w in wheels:
        extras = target.extras if w.name == root else ()
        for req in applicable_requirements(w.requires_dist, target, extras):
            dep = str(canonicalize_name(req.name))
            if dep not in have:
                raise WheelhouseError(dep, target.platform, f"no wheel (required by {w.name} {w.version})")
            if not req.specifier.contains(have[dep], prereleases=True):
                raise WheelhouseError(
                    dep, target.platform, f"{have[dep]} does not satisfy {req} (required by {w.name})"
                )


def check_expectations(lock: Sequence[LockEntry], target: Target) -> None:
    """Check that the lock holds the versions meant for the target (:attr:`Target.expect`).

    WheelhouseError if an expected distribution is missing or locked outside its specifier (e.g.
    ai-edge-litert 1.4.0 when ``ai-edge-litert>=2`` is expected).
    """
    by_name = {e.name: e for e in lock}
    for spec in target.expect:
        req = Requirement(spec)
        name = str(canonicalize_name(req.name))
        entry = by_name.get(name)
        if entry is None:
            raise WheelhouseError(name, target.platform, f"missing from the lock (expected {spec})")
        if not req.specifier.contains(Version(entry.version), prereleases=True):
            raise WheelhouseError(name, target.platform, f"locked {entry.version}, expected {spec}")


def format_lock(entries: Iterable[LockEntry], header: str = "") -> str:
    """Render ``requirements.lock``: one ``name==version --hash=sha256:HEX`` per wheel, sorted by name.

    ``header`` lines come first as comments; each entry follows a ``# <wheel file name>`` comment.
    Source: pip's requirements file format and hash-checking mode.
    """
    lines = [f"# {h}" if h else "#" for h in header.splitlines()]
    for e in sorted(entries, key=lambda e: e.name):
        if e.filename:
            lines.append(f"# {e.filename}")
        lines.append(f"{e.name}=={e.version} --hash=sha256:{e.sha256}")
    return "\n".join(lines) + "\n"
