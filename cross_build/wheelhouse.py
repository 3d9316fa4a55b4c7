"""Build an offline wheelhouse of edgefl for an ARM gateway (``edgefl wheelhouse --target T --out DIR``).

``--python 3.11|3.12|3.13`` chooses the device's CPython (the wheels' ``cp3XX`` tags).

On an x86 build machine, without installing anything there, collect edgefl's own wheel and every
dependency as a binary wheel for the target's platform, then write ``DIR``::

    DIR/wheels/*.whl            edgefl + every dependency (binary wheels for the target)
    DIR/requirements.lock       name==version --hash=sha256:... for every wheel in wheels/
    DIR/install.sh              offline install into a venv under /opt/edgefl, installs the systemd unit
    DIR/systemd/<profile>.service  the unit rendered from each shipped profile (MemoryMax from its cap)
    DIR/firmware_configs/ DIR/models/   the shipped profiles and .tflite models (not in the wheel)
    DIR/TARGET                  what the wheelhouse was built for (read by install.sh)

Targets (see :data:`TARGETS`); each wheelhouse is for one CPython (``--python 3.11|3.12|3.13``, default
the Python of the newest Debian stable the target runs on, :attr:`Target.python_version`):

- ``aarch64``: glibc >= 2.28, CPython 3.11, 3.12 or 3.13 (default 3.13, Debian 13). ai-edge-litert 2.x
  is tagged only ``manylinux_2_27_aarch64``; with the usual ``manylinux2014``/``2_17``/``2_28`` list
  pip silently falls back to ai-edge-litert 1.4.0, so the platform list holds every ``manylinux_2_Y``
  the glibc allows (:func:`manylinux_tags`) and the lock is checked against :attr:`Target.expect`.
- ``armv7l``: Debian 12 (glibc 2.36), CPython 3.11 only. LiteRT has no armv7l wheel: tflite-runtime 2.14.0
  (the ``tflite`` extra), whose armv7l wheels stop at cp311, so 3.12 and 3.13 are refused up front
  (:func:`refusal`). PyPI has no armv7l numpy wheel: numpy is Debian's ``python3-numpy`` (1.24.2)
  through a ``--system-site-packages`` venv. cbor2 6.x is a Rust extension (no pure-Python code left in
  its sdist, needs rustc >= 1.85) with no armv7l wheel, so cbor2 is pinned to 5.9.0, the last release
  with a pure-Python implementation, built here from its sdist with ``CBOR2_BUILD_C_EXTENSION=0``.
- ``x86_64``: glibc >= 2.28, CPython 3.11, 3.12 or 3.13 (default 3.13), for completeness.

Every wheelhouse carries the signing library, edgefl's ``security`` extra (PyNaCl), so an offline
gateway can sign and verify: PyNaCl's abi3 wheels (``manylinux_2_26_aarch64``, ``manylinux_2_17_x86_64``)
and cffi's; on armv7l PyPI has neither a PyNaCl nor a cffi (>= 2) wheel, so PyNaCl is Debian's
``python3-nacl`` (1.5.0, with ``python3-cffi`` 1.15.1 for its metadata) like numpy, and ``install.sh``
refuses to install without them.

pip evaluates environment markers against the *build* machine even with ``--platform`` (so edgefl's
``platform_machine != "armv7l"`` marker would pull LiteRT into the armv7l set): edgefl's requirements are
evaluated here against the target's marker environment, and after the download every wheel's
``Requires-Dist`` is checked against the wheelhouse (:func:`check_closure`). Nothing is skipped
silently: a missing wheel raises :class:`WheelhouseError` naming the dependency and the platform.

Source: PEP 600 (``manylinux_x_y`` tags), PEP 508 (environment markers), PEP 427 (wheel file names),
pip's secure installs (``--require-hashes``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from edgefl.errors import EdgeflError

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
UNIT_TEMPLATE = Path(__file__).resolve().parent / "edgefl-agent.service"
DEFAULT_PREFIX = "/opt/edgefl"

# The oldest glibc any manylinux_2_Y tag names, per architecture: x86 wheels go back to manylinux1
# (glibc 2.5); the ARM architectures start at manylinux2014 (glibc 2.17). Same rule as packaging's
# _manylinux.platform_tags.
_OLDEST_GLIBC_MINOR = {"x86_64": 5, "i686": 5}
_OLDEST_GLIBC_MINOR_DEFAULT = 17
# PEP 600's aliases for the legacy tags.
_LEGACY_ALIASES = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


class WheelhouseError(EdgeflError):
    """A wheelhouse could not be built completely.

    Parameters
    ----------
    name : str
        The dependency (distribution name) at fault, or ``"edgefl"`` for the project's own wheel.
    platform : str
        The target platform, e.g. ``"cp311-manylinux_2_28_aarch64"``.
    reason : str
        What went wrong, e.g. ``"no binary wheel"``.
    """

    def __init__(self, name: str, platform: str, reason: str) -> None:
        self.name = name
        self.platform = platform
        self.reason = reason
        super().__init__(f"{name} for {platform}: {reason}")


@dataclass(frozen=True, slots=True)
class PureWheel:
    """A dependency built here as a pure-Python wheel from its sdist (no compiler on the device).

    Parameters
    ----------
    name : str
        Distribution name, e.g. ``"cbor2"``.
    version : str
        The exact version to build.
    env : Mapping[str, str]
        Extra environment for the build, e.g. ``{"CBOR2_BUILD_C_EXTENSION": "0"}``.
    """

    name: str
    version: str
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Target:
    """A gateway platform the wheelhouse is built for.

    Parameters
    ----------
    name : str
        The ``--target`` value (``"aarch64"``, ``"armv7l"``, ``"x86_64"``).
    machine : str
        ``platform.machine()`` on the device (the ``platform_machine`` marker), e.g. ``"armv7l"``.
    glibc : tuple[int, int]
        The oldest glibc (major, minor) the wheelhouse must run on; bounds the manylinux tags.
    python_version : str
        CPython ``major.minor`` on the device; in :data:`TARGETS`, the default: the Python of the newest
        Debian stable the target runs on.
    refused : Mapping[str, str]
        CPython ``major.minor`` → why no wheelhouse can be built for it (no runtime wheel exists);
        :func:`target_for` refuses these before any download.
    extras : tuple[str, ...]
        edgefl extras installed on this target: ``"security"`` (the signing library) everywhere,
        plus ``"tflite"`` on armv7l.
    pins : tuple[str, ...]
        Extra requirement specifiers for the download (narrow a dependency, e.g.
        ``"tflite-runtime==2.14.0"``).
    system_packages : Mapping[str, str]
        Distributions taken from the device's OS (a ``--system-site-packages`` venv), name → the
        version Debian 12 ships. They are not downloaded; requirements on them are checked
        against that version.
    system_modules : Mapping[str, str]
        Module ``install.sh`` imports before installing → the Debian package that provides it (its
        refusal names the package), for the system packages.
    no_deps : tuple[str, ...]
        Requirements downloaded without their dependencies, because a dependency is a system
        package (pip cannot be told to leave one out); their ``Requires-Dist`` are checked by
        :func:`check_closure` like every other wheel's.
    pure : tuple[PureWheel, ...]
        Dependencies built here as pure-Python wheels from their sdist.
    expect : tuple[str, ...]
        Specifiers the lock must satisfy (guards against pip's silent fallbacks).
    default_profile : str
        Stem of the profile in ``firmware_configs/`` that ``install.sh`` uses by default.
    debian_packages : tuple[str, ...]
        Debian packages the device needs before ``install.sh`` (documented; checked by install.sh).
    """

    name: str
    machine: str
    glibc: tuple[int, int]
    python_version: str = "3.11"
    refused: Mapping[str, str] = field(default_factory=dict)
    extras: tuple[str, ...] = ("security",)
    pins: tuple[str, ...] = ()
    system_packages: Mapping[str, str] = field(default_factory=dict)
    system_modules: Mapping[str, str] = field(default_factory=dict)
    no_deps: tuple[str, ...] = ()
    pure: tuple[PureWheel, ...] = ()
    expect: tuple[str, ...] = ()
    default_profile: str = ""
    debian_packages: tuple[str, ...] = ("python3", "python3-venv")

    @property
    def abi(self) -> str:
        """The CPython ABI tag, e.g. ``"cp311"``."""
        return "cp" + self.python_version.replace(".", "")

    @property
    def platform(self) -> str:
        """A short label for messages, e.g. ``"cp311-manylinux_2_28_aarch64"``."""
        return f"{self.abi}-manylinux_{self.glibc[0]}_{self.glibc[1]}_{self.machine}"


# cbor2 5.9.0 is the last cbor2 with a pure-Python implementation; setup.py honours
# CBOR2_BUILD_C_EXTENSION=0 (checked in the 5.9.0 sdist).
CBOR2_PURE = PureWheel("cbor2", "5.9.0", {"CBOR2_BUILD_C_EXTENSION": "0"})

# Every CPython a wheelhouse can be asked for (``--python``); edgefl needs >= 3.11 (setup.cfg).
PYTHONS = ("3.11", "3.12", "3.13")

# tflite-runtime 2.14.0 (the last release) publishes armv7l wheels for cp39-cp311 only, and LiteRT
# (ai-edge-litert) none for armv7l at all (checked on the package index, 2026-12).
_NO_ARMV7L_RUNTIME = (
    "no TFLite runtime wheel exists for armv7l on CPython {py}: tflite-runtime 2.14.0 (the last "
    "release) stops at cp311 and ai-edge-litert has no armv7l wheel; use CPython 3.11 (Debian 12)"
)

TARGETS: Mapping[str, Target] = {
    "aarch64": Target(
        name="aarch64", machine="aarch64", glibc=(2, 28), python_version="3.13",
        pins=("ai-edge-litert>=2",), expect=("ai-edge-litert>=2", "cbor2>=6", "pynacl>=1.5"),
        default_profile="gateway_aarch64_256mb",
    ),
    "armv7l": Target(
        name="armv7l", machine="armv7l", glibc=(2, 36), python_version="3.11",
        refused={py: _NO_ARMV7L_RUNTIME.format(py=py) for py in ("3.12", "3.13")},
        extras=("tflite", "security"),
        pins=("tflite-runtime==2.14.0",),
        # PyPI has no armv7l wheel of numpy, PyNaCl or cffi >= 2 (checked with pip download, 2026-12)
        system_packages={"numpy": "1.24.2", "pynacl": "1.5.0", "cffi": "1.15.1"},
        system_modules={"numpy": "python3-numpy", "nacl.signing": "python3-nacl", "cffi": "python3-cffi"},
        no_deps=("tflite-runtime",), pure=(CBOR2_PURE,),
        expect=("tflite-runtime==2.14.0", "cbor2==5.9.0"),
        default_profile="gateway_armv7_512mb",
        debian_packages=("python3", "python3-venv", "python3-numpy", "python3-nacl", "python3-cffi"),
    ),
    "x86_64": Target(
        name="x86_64", machine="x86_64", glibc=(2, 28), python_version="3.13",
        pins=("ai-edge-litert>=2",), expect=("ai-edge-litert>=2", "pynacl>=1.5"),
        default_profile="dev_x86",
    ),
}


def refusal(target: str, python: str) -> str | None:
    """Why no wheelhouse can be built for a target and CPython, or None if one can.

    Parameters
    ----------
    target : str
        A key of :data:`TARGETS`, e.g. ``"armv7l"``.
    python : str
        CPython ``major.minor``, e.g. ``"3.13"``.

    Returns
    -------
    str or None
        The reason (names the missing runtime), None when the pair is supported.
    """
    if target not in TARGETS:
        return f"unknown target {target!r} (one of {', '.join(sorted(TARGETS))})"
    if python not in PYTHONS:
        return f"unsupported CPython {python!r} (one of {', '.join(PYTHONS)})"
    return TARGETS[target].refused.get(python)


def target_for(name: str, python: str | None = None) -> Target:
    """The target a wheelhouse is built for: :data:`TARGETS` ``[name]`` for one CPython.

    Parameters
    ----------
    name : str
        A key of :data:`TARGETS`.
    python : str or None
        CPython ``major.minor``; None takes the target's default (:attr:`Target.python_version`).

    Returns
    -------
    Target
        The target with ``python_version`` set (wheels are then tagged ``cp3XX``).

    Raises
    ------
    WheelhouseError
        If the pair is refused (:func:`refusal`), naming the target, the Python and the reason.
    """
    base = TARGETS.get(name)
    py = python if python is not None else (base.python_version if base is not None else "")
    why = refusal(name, py)
    if why is not None or base is None:
        raise WheelhouseError("edgefl", f"{name} CPython {py}", why or "unknown target")
    return dataclasses.replace(base, python_version=py)


@dataclass(frozen=True, slots=True)
class LockEntry:
    """One line of ``requirements.lock``.

    Parameters
    ----------
    name : str
        Canonical distribution name (PEP 503), e.g. ``"ai-edge-litert"``.
    version : str
        Exact version.
    sha256 : str
        Hex SHA-256 of the wheel file.
    filename : str
        The wheel's file name in ``wheels/`` (written as a comment).
    """

    name: str
    version: str
    sha256: str
    filename: str = ""


@dataclass(frozen=True, slots=True)
class WheelInfo:
    """What the wheelhouse needs to know about one wheel file.

    Parameters
    ----------
    path : Path
        The ``.whl`` file.
    name : str
        Canonical distribution name.
    version : str
        Version from the file name.
    requires_dist : tuple[str, ...]
        The ``Requires-Dist`` lines of its METADATA (PEP 508 strings, with markers).
    """

    path: Path
    name: str
    version: str
    requires_dist: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Wheelhouse:
    """Summary of a built wheelhouse.

    Parameters
    ----------
    target : Target
        What it was built for.
    out : Path
        Its folder.
    lock : tuple[LockEntry, ...]
        The locked wheels, sorted by name.
    wheels_bytes : int
        Total size of ``wheels/`` in bytes.
    total_bytes : int
        Total size of the folder in bytes (wheels, models, profiles, scripts).
    build_s : float
        Wall-clock build time in seconds.
    """

    target: Target
    out: Path
    lock: tuple[LockEntry, ...]
    wheels_bytes: int
    total_bytes: int
    build_s: float


def manylinux_tags(machine: str, glibc: tuple[int, int]) -> list[str]:
    """Every manylinux platform tag a target's glibc accepts, most specific first.

    Parameters
    ----------
    machine : str
        Architecture as in wheel tags: ``"aarch64"``, ``"armv7l"``, ``"x86_64"``.
    glibc : tuple[int, int]
        The target's glibc version (major, minor); only glibc 2.x is known.

    Returns
    -------
    list[str]
        ``manylinux_2_{minor}_{machine}`` down to the architecture's oldest (2.17 for ARM, 2.5 for
        x86), each followed by its legacy alias where PEP 600 defines one (``manylinux2014`` for
        2.17, ``manylinux2010`` for 2.12, ``manylinux1`` for 2.5). For aarch64 at glibc 2.28 that is
        ``manylinux_2_28``, ``manylinux_2_27`` (where ai-edge-litert 2.x lives), ..., ``manylinux_2_17``,
        ``manylinux2014``.

    Raises
    ------
    ValueError
        If ``glibc`` is not 2.x or older than the architecture's first manylinux tag.

    Source: PEP 600 (``manylinux_x_y``, legacy aliases); packaging's ``_manylinux.platform_tags``.
    """
    major, minor = glibc
    oldest = _OLDEST_GLIBC_MINOR.get(machine, _OLDEST_GLIBC_MINOR_DEFAULT)
    if major != 2 or minor < oldest:
        raise ValueError(f"glibc {major}.{minor}: no manylinux tag for {machine} (needs 2.{oldest}+)")
    tags: list[str] = []
    for m in range(minor, oldest - 1, -1):
        tags.append(f"manylinux_2_{m}_{machine}")
        alias = _LEGACY_ALIASES.get(m)
        if alias is not None:
            tags.append(f"{alias}_{machine}")
    return tags


def target_environment(target: Target) -> dict[str, str]:
    """Return the PEP 508 marker environment of the device, for evaluating requirements here.

    Parameters
    ----------
    target : Target
        The platform.

    Returns
    -------
    dict[str, str]
        This interpreter's environment with ``platform_machine``, ``sys_platform``, ``os_name``,
        ``platform_system``, ``python_version``, ``python_full_version`` and the implementation keys
        replaced by the target's (CPython on Linux).

    Source: PEP 508 §Environment Markers.
    """
    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    env.update(
        platform_machine=target.machine, sys_platform="linux", os_name="posix", platform_system="Linux",
        python_version=target.python_version, python_full_version=f"{target.python_version}.0",
        implementation_name="cpython", platform_python_implementation="CPython",
        implementation_version=f"{target.python_version}.0",
    )
    return env


def applicable_requirements(
    requires_dist: Iterable[str], target: Target, extras: Iterable[str] = ()
) -> list[Requirement]:
    """Select the requirements that apply on the target (markers evaluated with the given extras).

    Parameters
    ----------
    requires_dist : Iterable[str]
        PEP 508 requirement strings, e.g. from a wheel's ``Requires-Dist``.
    target : Target
        The platform whose marker environment is used.
    extras : Iterable[str]
        Extras requested for the distribution these requirements belong to.

    Returns
    -------
    list[Requirement]
        The applicable requirements, markers stripped, in input order.

    Source: PEP 508; the ``extra`` marker per the core metadata spec.
    """
    env = target_environment(target)
    out: list[Requirement] = []
    for line in requires_dist:
        req = Requirement(line)
        if req.marker is not None:
            applies = any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras))
            if not applies:
                continue
        req.marker = None
        out.append(req)
    return out


def read_wheel(path: Path) -> WheelInfo:
    """Read a wheel's name, version and ``Requires-Dist`` from its ``*.dist-info/METADATA``.

    Parameters
    ----------
    path : Path
        A ``.whl`` file.

    Returns
    -------
    WheelInfo
        Its name (canonical), version and requirements.

    Raises
    ------
    WheelhouseError
        If the file is not a readable wheel with a METADATA file.

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


def supported_wheel(filename: str, target: Target) -> bool:
    """Whether a wheel file can be installed on the target.

    Parameters
    ----------
    filename : str
        A wheel file name (PEP 427).
    target : Target
        The platform.

    Returns
    -------
    bool
        True if one of its tags is ``{py3*, cp3*, cp3XX}-{none, abi3, cp3XX}-{any, manylinux tag}``
        with an interpreter and ABI the target's CPython (``cp3XX``) accepts.

    Source: PEP 425 (compatibility tags), PEP 384 (abi3).
    """
    platforms = {"any", *manylinux_tags(target.machine, target.glibc)}
    minor = int(target.python_version.split(".")[1])
    _name, _version, _build, tags = parse_wheel_filename(filename)
    for tag in tags:
        if tag.platform not in platforms:
            continue
        interp = tag.interpreter
        if tag.abi == target.abi and interp == target.abi:
            return True
        if tag.abi == "abi3" and interp.startswith("cp3") and int(interp[3:] or 0) <= minor:
            return True
        if tag.abi == "none" and interp in {"py3", "py2.py3", f"py{minor + 30}", target.abi} | {
            f"py3{m}" for m in range(minor + 1)
        }:
            return True
    return False


def check_closure(wheels: Sequence[WheelInfo], target: Target, root: str = "edgefl") -> None:
    """Check that every requirement of every wheel is met by the wheelhouse or the device's OS.

    Parameters
    ----------
    wheels : Sequence[WheelInfo]
        Every wheel of the wheelhouse.
    target : Target
        The platform (its extras apply to ``root``; its system packages count as installed).
    root : str
        The distribution the extras belong to.

    Raises
    ------
    WheelhouseError
        Naming the first unmet requirement (and who needs it), a wheel that does not install on the
        target, or two wheels of one distribution.
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

    Parameters
    ----------
    lock : Sequence[LockEntry]
        The locked wheels.
    target : Target
        The platform.

    Raises
    ------
    WheelhouseError
        If an expected distribution is missing or locked at a version outside its specifier (e.g.
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


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def format_lock(entries: Iterable[LockEntry], header: str = "") -> str:
    """Render ``requirements.lock``: one ``name==version --hash=sha256:HEX`` per wheel, sorted by name.

    Parameters
    ----------
    entries : Iterable[LockEntry]
        The wheels.
    header : str
        Comment lines (without ``#``) written first.

    Returns
    -------
    str
        The file's text; each entry is preceded by a ``# <wheel file name>`` comment.

    Source: pip's requirements file format and hash-checking mode.
    """
    lines = [f"# {h}" if h else "#" for h in header.splitlines()]
    for e in sorted(entries, key=lambda e: e.name):
        if e.filename:
            lines.append(f"# {e.filename}")
        lines.append(f"{e.name}=={e.version} --hash=sha256:{e.sha256}")
    return "\n".join(lines) + "\n"


_LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s+--hash=sha256:([0-9a-f]{64})$")


def parse_lock(text: str) -> list[LockEntry]:
    """Parse ``requirements.lock`` as written by :func:`format_lock`.

    Parameters
    ----------
    text : str
        The file's text.

    Returns
    -------
    list[LockEntry]
        The entries in file order (``filename`` from the preceding comment when it names a wheel).

    Raises
    ------
    ValueError
        On a line that is neither a comment, blank, nor ``name==version --hash=sha256:<64 hex>``
        (message names the line number).
    """
    out: list[LockEntry] = []
    last_comment = ""
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            last_comment = line[1:].strip()
            continue
        m = _LOCK_LINE.match(line)
        if m is None:
            raise ValueError(
                f"requirements.lock line {i}: expected name==version --hash=sha256:<hex>: {line!r}"
            )
        filename = last_comment if last_comment.endswith(".whl") else ""
        out.append(LockEntry(str(canonicalize_name(m.group(1))), m.group(2), m.group(3), filename))
        last_comment = ""
    return out


def render_unit(
    profile_path: Path, prefix: str = DEFAULT_PREFIX, template: Path = UNIT_TEMPLATE
) -> str:
    """Render the systemd unit for one device profile.

    Parameters
    ----------
    profile_path : Path
        A profile in ``firmware_configs/``; it is validated with :func:`edgefl.agent.config.load_profile`.
    prefix : str
        Install prefix on the device (releases under ``<prefix>/releases``, ``<prefix>/current``).
    template : Path
        The unit template with ``@PREFIX@``, ``@PROFILE@``, ``@MEMORY_MAX_MB@``, ``@MEMORY_HIGH_MB@``
        and ``@STATE_DIRECTORY@`` fields.

    Returns
    -------
    str
        The unit: ``MemoryMax`` = ``memory.cap_mb`` MiB, ``MemoryHigh`` = ``cap_mb - reserve_mb``
        MiB, ``StateDirectory`` = ``device.state_dir`` relative to ``/var/lib``.

    Raises
    ------
    WheelhouseError
        If the profile is invalid, or its ``device.state_dir`` is not under ``/var/lib`` (with
        ``ProtectSystem=strict`` the agent could not write anywhere else).
    """
    from edgefl.agent.config import load_profile
    from edgefl.errors import ConfigError

    try:
        # Model files are checked on the device by install.sh (check-config); here only the numbers.
        profile = load_profile(profile_path, check_files=False)
    except ConfigError as exc:
        raise WheelhouseError(profile_path.name, "-", "invalid profile: " + "; ".join(exc.problems)) from exc
    state = Path(profile.device.state_dir)
    var_lib = Path("/var/lib")
    if not state.is_absolute() or var_lib not in state.parents:
        raise WheelhouseError(
            profile_path.name, "-",
            f"device.state_dir = {str(state)!r}: must be under /var/lib for the unit's StateDirectory=",
        )
    fields = {
        "PREFIX": prefix.rstrip("/"),
        "PROFILE": profile_path.stem,
        "MEMORY_MAX_MB": str(profile.memory.cap_mb),
        "MEMORY_HIGH_MB": str(profile.memory.cap_mb - profile.memory.reserve_mb),
        "STATE_DIRECTORY": str(state.relative_to(var_lib)),
    }
    text = template.read_text(encoding="utf-8")
    for key, value in fields.items():
        text = text.replace(f"@{key}@", value)
    leftover = re.search(r"@[A-Z_]+@", text)
    if leftover is not None:
        raise WheelhouseError("edgefl-agent.service", "-", f"unfilled template field {leftover.group(0)}")
    return text


def _pip(args: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    logger.info("running %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)


def _pip_failure(exc: subprocess.CalledProcessError, names: Sequence[str], target: Target) -> WheelhouseError:
    text = (exc.stderr or "") + (exc.stdout or "")
    m = re.search(r"No matching distribution found for ([A-Za-z0-9._-]+)", text)
    if m is None:
        m = re.search(r"Could not find a version that satisfies the requirement ([A-Za-z0-9._-]+)", text)
    name = m.group(1) if m else ",".join(names)
    tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:])
    return WheelhouseError(name, target.platform, f"no binary wheel (pip: {tail})")


def build_own_wheel(repo: Path, dest: Path) -> Path:
    """Build edgefl's wheel (``pip wheel --no-deps``) into ``dest``.

    Parameters
    ----------
    repo : Path
        The source checkout (holds ``setup.cfg``).
    dest : Path
        Folder for the wheel.

    Returns
    -------
    Path
        The ``edgefl-<version>-py3-none-any.whl`` file.

    Raises
    ------
    WheelhouseError
        If the build fails or does not produce exactly one edgefl wheel.
    """
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _pip(["wheel", "--no-deps", "-q", "-w", tmp, str(repo)])
        except subprocess.CalledProcessError as exc:
            raise WheelhouseError("edgefl", "py3-none-any", f"pip wheel failed: {exc.stderr[-500:]}") from exc
        built = sorted(Path(tmp).glob("edgefl-*.whl"))
        if len(built) != 1:
            raise WheelhouseError("edgefl", "py3-none-any", f"expected one wheel, got {built}")
        out = dest / built[0].name
        shutil.move(str(built[0]), out)
    return out


def build_pure_wheel(spec: PureWheel, dest: Path, target: Target) -> Path:
    """Build a pure-Python wheel of one dependency from its sdist (``pip wheel --no-binary``).

    Parameters
    ----------
    spec : PureWheel
        Name, exact version and build environment (e.g. ``CBOR2_BUILD_C_EXTENSION=0``).
    dest : Path
        Folder for the wheel.
    target : Target
        The platform (for messages).

    Returns
    -------
    Path
        The ``<name>-<version>-py3-none-any.whl`` file.

    Raises
    ------
    WheelhouseError
        If the build fails or the wheel is not pure Python (``none-any``): a C extension built here
        would be an x86 binary.
    """
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _pip(
                ["wheel", "--no-deps", "--no-binary", spec.name, "-q", "-w", tmp,
                 f"{spec.name}=={spec.version}"],
                env=spec.env,
            )
        except subprocess.CalledProcessError as exc:
            raise _pip_failure(exc, [spec.name], target) from exc
        built = sorted(Path(tmp).glob("*.whl"))
        if len(built) != 1 or not built[0].name.endswith("-none-any.whl"):
            names = [b.name for b in built]
            raise WheelhouseError(spec.name, target.platform, f"not a pure-Python wheel: {names}")
        out = dest / built[0].name
        shutil.move(str(built[0]), out)
    return out


def download_wheels(requirements: Sequence[str], dest: Path, target: Target, *, deps: bool) -> None:
    """``pip download`` binary wheels for the target (nothing is installed here).

    Parameters
    ----------
    requirements : Sequence[str]
        PEP 508 specifiers (markers already evaluated for the target).
    dest : Path
        Folder for the wheels.
    target : Target
        The platform: ``--platform`` for every tag of :func:`manylinux_tags`, ``--python-version``,
        ``--implementation cp``, ``--abi``.
    deps : bool
        Whether pip resolves and downloads dependencies too.

    Raises
    ------
    WheelhouseError
        Naming the requirement pip found no binary wheel for.
    """
    if not requirements:
        return
    args = ["download", "-q", "--only-binary=:all:", "--python-version", target.python_version,
            "--implementation", "cp", "--abi", target.abi, "--abi", "abi3", "--abi", "none", "-d", str(dest)]
    for tag in manylinux_tags(target.machine, target.glibc):
        args += ["--platform", tag]
    if not deps:
        args.append("--no-deps")
    try:
        _pip([*args, *requirements])
    except subprocess.CalledProcessError as exc:
        raise _pip_failure(exc, requirements, target) from exc


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build_wheelhouse(
    target: Target,
    out: Path,
    repo: Path = REPO_ROOT,
    prefix: str = DEFAULT_PREFIX,
) -> Wheelhouse:
    """Build the complete offline wheelhouse for one target into ``out`` (see the module docstring).

    Parameters
    ----------
    target : Target
        The platform.
    out : Path
        Output folder; its ``wheels/`` is emptied first.
    repo : Path
        The edgefl source checkout.
    prefix : str
        Install prefix on the device, written into the units and ``install.sh``.

    Returns
    -------
    Wheelhouse
        The lock, sizes in bytes and the build time in seconds.

    Raises
    ------
    WheelhouseError
        If the target's CPython is refused (:attr:`Target.refused`, before anything is built), any
        dependency has no wheel for the target (named, with the platform), the closure is incomplete,
        or the lock misses an expected version.
    """
    why = target.refused.get(target.python_version)
    if why is not None:
        raise WheelhouseError("edgefl", f"{target.name} CPython {target.python_version}", why)
    t0 = time.monotonic()
    wheels_dir = out / "wheels"
    if wheels_dir.exists():
        shutil.rmtree(wheels_dir)
    wheels_dir.mkdir(parents=True)

    own = read_wheel(build_own_wheel(repo, wheels_dir))
    logger.info("built %s", own.path.name)
    system = {str(canonicalize_name(n)) for n in target.system_packages}
    pure = {str(canonicalize_name(p.name)): p for p in target.pure}
    no_deps = {str(canonicalize_name(n)) for n in target.no_deps}

    # pip merges several specifiers of one name, so a pin is simply added next to edgefl's own range.
    wanted: list[str] = []
    wanted_no_deps: list[str] = []
    reqs = applicable_requirements(own.requires_dist, target, target.extras)
    reqs += [Requirement(p) for p in target.pins]
    for req in reqs:
        name = str(canonicalize_name(req.name))
        if name in system or name in pure:
            continue
        (wanted_no_deps if name in no_deps else wanted).append(str(req))

    for spec in target.pure:
        path = build_pure_wheel(spec, wheels_dir, target)
        logger.info("built %s from its sdist", path.name)
    download_wheels(wanted, wheels_dir, target, deps=True)
    download_wheels(wanted_no_deps, wheels_dir, target, deps=False)

    infos = [read_wheel(p) for p in sorted(wheels_dir.glob("*.whl"))]
    check_closure(infos, target)
    lock = tuple(
        sorted((LockEntry(w.name, w.version, sha256_file(w.path), w.path.name) for w in infos),
               key=lambda e: e.name)
    )
    check_expectations(lock, target)

    header = (
        f"edgefl wheelhouse for {target.name} ({target.platform}), written by cross_build/wheelhouse.py.\n"
        "Install offline: pip install --no-index --find-links wheels --require-hashes --no-deps \\\n"
        "    -r requirements.lock"
    )
    if target.system_packages:
        header += "\nFrom the OS (venv --system-site-packages): " + ", ".join(
            f"{n} {v}" for n, v in sorted(target.system_packages.items())
        )
    (out / "requirements.lock").write_text(format_lock(lock, header), encoding="utf-8")

    for sub in ("firmware_configs", "models", "systemd"):
        if (out / sub).exists():
            shutil.rmtree(out / sub)
    shutil.copytree(repo / "firmware_configs", out / "firmware_configs",
                    ignore=shutil.ignore_patterns("state", "*.pyc"))
    (out / "models").mkdir()
    for model in sorted((repo / "models").glob("*.tflite")):
        shutil.copy2(model, out / "models" / model.name)
    (out / "systemd").mkdir()
    for profile in sorted((out / "firmware_configs").glob("*.toml")):
        try:
            unit = render_unit(profile, prefix)
        except WheelhouseError as exc:
            # install.sh refuses a profile without a unit unless told --no-systemd.
            logger.warning("no systemd unit for %s: %s", profile.name, exc.reason)
            continue
        (out / "systemd" / f"{profile.stem}.service").write_text(unit, encoding="utf-8")
    (out / "TARGET").write_text(
        f"target={target.name}\nmachine={target.machine}\npython={target.python_version}\n"
        f"glibc={target.glibc[0]}.{target.glibc[1]}\nsystem_site_packages={int(bool(target.system_packages))}\n"
        f"default_profile={target.default_profile}\nprefix={prefix}\n"
        f"debian_packages={' '.join(target.debian_packages)}\n"
        f"system_modules={' '.join(f'{m}={d}' for m, d in target.system_modules.items())}\n",
        encoding="utf-8",
    )
    install = out / "install.sh"
    shutil.copy2(Path(__file__).resolve().parent / "install.sh", install)
    install.chmod(0o755)
    return Wheelhouse(target, out, lock, _tree_bytes(wheels_dir), _tree_bytes(out), time.monotonic() - t0)


def run(args: argparse.Namespace) -> int:
    """Build the wheelhouse for parsed ``--target/--python/--out/--prefix/--repo``; returns 0 built, 1 failed.

    A refused target/Python pair (:func:`refusal`) fails before anything is built or downloaded.
    """
    repo = Path(args.repo) if args.repo else REPO_ROOT
    try:
        target = target_for(args.target, getattr(args, "python", None))
        house = build_wheelhouse(target, Path(args.out), repo, args.prefix)
    except WheelhouseError as exc:
        print(f"edgefl wheelhouse: {exc}", file=sys.stderr)
        return 1
    print(f"{house.out}: {len(house.lock)} wheels for {target.platform}, "
          f"wheels {house.wheels_bytes / 1e6:.1f} MB, total {house.total_bytes / 1e6:.1f} MB, "
          f"built in {house.build_s:.0f} s")
    for e in house.lock:
        print(f"  {e.name}=={e.version}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cross_build.wheelhouse --target T [--python V] --out DIR``: exit code 0 or 1."""
    from .cli import add_arguments

    p = argparse.ArgumentParser(prog="wheelhouse", description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(p)
    args = p.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                            stream=sys.stderr)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
