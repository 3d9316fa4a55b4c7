"""The gateway platforms a wheelhouse is built for, and which wheels and requirements install on each.

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
``Requires-Dist`` is checked against the wheelhouse (:func:`cross_build.lock.check_closure`). Nothing is
skipped silently: a missing wheel raises :class:`WheelhouseError` naming the dependency and the platform.

Source: PEP 600 (``manylinux_x_y`` tags), PEP 508 (environment markers), PEP 425 (compatibility tags).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename

from edgefl.errors import EdgeflError

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
