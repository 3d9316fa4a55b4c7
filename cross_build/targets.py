"""The gateway platforms a wheelhouse is built for, and which wheels and requirements install on each.

Why armv7l differs: ``docs/operations.md`` ("Platforms"). Every ``manylinux_2_Y`` the glibc allows is
listed (pip's usual list makes aarch64 fall back to ai-edge-litert 1.4.0) and markers are evaluated
against the target, not the build machine. Source: PEP 600 (``manylinux_x_y`` tags), PEP 508
(environment markers), PEP 425 (compatibility tags).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import parse_wheel_filename

from edgefl.errors import EdgeflError

# The oldest glibc a manylinux_2_Y tag names: 2.5 on x86, else 2.17 (packaging's _manylinux.platform_tags)
_OLDEST_GLIBC_MINOR = {"x86_64": 5, "i686": 5}
_OLDEST_GLIBC_MINOR_DEFAULT = 17
_LEGACY_ALIASES = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}  # PEP 600's legacy tags


class WheelhouseError(EdgeflError):
    """A wheelhouse could not be built completely: ``name`` (a distribution, or ``"edgefl"``) on ``platform``.

    ``reason`` says what went wrong, e.g. ``"no binary wheel"``.
    """

    def __init__(self, name: str, platform: str, reason: str) -> None:
        self.name = name
        self.platform = platform
        self.reason = reason
        super().__init__(f"{name} for {platform}: {reason}")


@dataclass(frozen=True, slots=True)
class PureWheel:
    """A dependency ``name==version`` built here as a pure-Python wheel from its sdist, with ``env``."""

    name: str
    version: str
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Target:
    """A gateway platform the wheelhouse is built for.

    ``name``: the ``--target`` value; ``machine``: the device's ``platform_machine``; ``glibc``: the
    oldest (major, minor) it runs (bounds the manylinux tags); ``python_version``: CPython
    ``major.minor`` (in :data:`TARGETS`: the default); ``refused``: CPython → why no wheelhouse can be
    built for it. ``extras``: edgefl extras installed; ``pins``: extra specifiers for the download;
    ``system_packages``: distributions from the device's OS (a ``--system-site-packages`` venv) →
    Debian 12's version, not downloaded but checked; ``system_modules``: module ``install.sh`` imports
    first → its Debian package; ``no_deps``: requirements downloaded without dependencies; ``pure``:
    dependencies built here pure-Python; ``expect``: specifiers the lock must satisfy (against pip's
    silent fallbacks); ``default_profile``: ``install.sh``'s profile stem; ``debian_packages``: needed
    before ``install.sh``.
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


# cbor2 5.9.0: the last with a pure-Python build (its setup.py honours CBOR2_BUILD_C_EXTENSION=0)
CBOR2_PURE = PureWheel("cbor2", "5.9.0", {"CBOR2_BUILD_C_EXTENSION": "0"})

# Every CPython a wheelhouse can be asked for (``--python``); edgefl needs >= 3.11 (setup.cfg).
PYTHONS = ("3.11", "3.12", "3.13")

# checked on the package index, 2026-12
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
    """Why no wheelhouse can be built for ``target`` and CPython ``python``, or None if one can."""
    if target not in TARGETS:
        return f"unknown target {target!r} (one of {', '.join(sorted(TARGETS))})"
    if python not in PYTHONS:
        return f"unsupported CPython {python!r} (one of {', '.join(PYTHONS)})"
    return TARGETS[target].refused.get(python)


def target_for(name: str, python: str | None = None) -> Target:
    """:data:`TARGETS` ``[name]`` for CPython ``python`` (None: the target's default).

    WheelhouseError if the pair is refused (:func:`refusal`), naming the target, the Python and why.
    """
    base = TARGETS.get(name)
    py = python if python is not None else (base.python_version if base is not None else "")
    why = refusal(name, py)
    if why is not None or base is None:
        raise WheelhouseError("edgefl", f"{name} CPython {py}", why or "unknown target")
    return dataclasses.replace(base, python_version=py)


def manylinux_tags(machine: str, glibc: tuple[int, int]) -> list[str]:
    """Every manylinux platform tag a target's glibc (2.x) accepts, most specific first.

    ``manylinux_2_{minor}_{machine}`` down to the architecture's oldest (2.17 for ARM, 2.5 for x86),
    each followed by its PEP 600 legacy alias where one exists. ValueError for a glibc that is not 2.x
    or older than the architecture's first tag.
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
    """The PEP 508 marker environment of this interpreter, with the device's platform and CPython keys.

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
    """The requirements of ``requires_dist`` that apply on the target with ``extras``, markers stripped.

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
    """Whether a wheel file can be installed on the target (its interpreter, ABI and platform tags).

    Source: PEP 425 (compatibility tags), PEP 384 (abi3); packaging's ``cpython_tags``, ``compatible_tags``.
    """
    version = tuple(int(part) for part in target.python_version.split("."))
    platforms = [*manylinux_tags(target.machine, target.glibc), "any"]
    accepted = {
        *cpython_tags(version, [target.abi], platforms),
        *compatible_tags(version, target.abi, platforms),
    }
    return any(tag in accepted for tag in parse_wheel_filename(filename)[3])
