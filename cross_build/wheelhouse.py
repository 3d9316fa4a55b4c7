"""Build an offline wheelhouse of edgefl for an ARM gateway (``edgefl wheelhouse --target T --out DIR``).

On an x86 build machine, installing nothing there, collect edgefl's wheel and every dependency as a
binary wheel for the target's platform and CPython (``--python``, the ``cp3XX`` tags), with the lock,
the installer, the systemd units, profiles and models (the folder's layout: ``docs/operations.md``,
"Build a wheelhouse"). Source: pip's secure installs (``--require-hashes``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from edgefl.profiles import sha256_file

from .cli import DEFAULT_PREFIX, add_arguments
from .lock import LockEntry, check_closure, check_expectations, format_lock, read_wheel
from .targets import PureWheel, Target, WheelhouseError, applicable_requirements, manylinux_tags, target_for

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
UNIT_TEMPLATE = Path(__file__).resolve().parent / "edgefl-agent.service"
COORDINATOR_UNIT_TEMPLATE = Path(__file__).resolve().parent / "edgefl-coordinator.service"
COORDINATOR_UNIT = "edgefl-coordinator.service"
"""The coordinator's unit in ``<wheelhouse>/systemd/`` (no device profile has this stem)."""


def render_unit(profile_path: Path, prefix: str = DEFAULT_PREFIX) -> str:
    """Render the systemd unit of one device profile in ``firmware_configs/`` (validated first).

    ``edgefl-agent.service``'s ``@PREFIX@``, ``@PROFILE@``, ``@MEMORY_MAX_MB@``, ``@MEMORY_HIGH_MB@`` and
    ``@STATE_DIRECTORY@`` become ``prefix``, the profile, ``memory.cap_mb``, ``cap_mb - reserve_mb`` and
    ``device.state_dir`` relative to ``/var/lib``. WheelhouseError for an invalid profile or a
    ``device.state_dir`` outside ``/var/lib`` (``ProtectSystem=strict`` allows nothing else).
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
    return _fill(UNIT_TEMPLATE, fields)


def render_coordinator_unit(prefix: str = DEFAULT_PREFIX) -> str:
    """Render the coordinator's systemd unit for an install under ``prefix`` (``@PREFIX@``).

    It runs ``edgefl coordinator /etc/edgefl/coordinator.toml`` and never restarts exit 1, 2, 3 or 6
    (:mod:`edgefl.coordinator.command`). WheelhouseError if the template has a field left unfilled.
    """
    return _fill(COORDINATOR_UNIT_TEMPLATE, {"PREFIX": prefix.rstrip("/")})


def _fill(template: Path, fields: Mapping[str, str]) -> str:
    """``template`` with each ``@KEY@`` of ``fields`` replaced; WheelhouseError naming a field left over."""
    text = template.read_text(encoding="utf-8")
    for key, value in fields.items():
        text = text.replace(f"@{key}@", value)
    leftover = re.search(r"@[A-Z_]+@", text)
    if leftover is not None:
        raise WheelhouseError(template.name, "-", f"unfilled template field {leftover.group(0)}")
    return text


def write_support_files(out: Path, repo: Path = REPO_ROOT, prefix: str = DEFAULT_PREFIX) -> None:
    """Write what a wheelhouse carries beside its wheels into ``out``: profiles, models, units, install.sh.

    Copies of the checkout's ``firmware_configs/`` and ``models/``, one agent unit per device profile
    that can have one and the coordinator's (units under ``prefix``); earlier folders are replaced.
    WheelhouseError if the coordinator's template has a field left unfilled; OSError.
    """
    from edgefl.coordinator.profile import is_coordinator_profile
    from edgefl.errors import ConfigError
    from edgefl.profiles import read_toml

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
        with contextlib.suppress(ConfigError):
            if is_coordinator_profile(read_toml(profile)[1]):
                continue  # the coordinator's unit is one for every fleet, below
        try:
            unit = render_unit(profile, prefix)
        except WheelhouseError as exc:
            # install.sh refuses a profile without a unit unless told --no-systemd.
            logger.warning("no systemd unit for %s: %s", profile.name, exc.reason)
            continue
        (out / "systemd" / f"{profile.stem}.service").write_text(unit, encoding="utf-8")
    (out / "systemd" / COORDINATOR_UNIT).write_text(render_coordinator_unit(prefix), encoding="utf-8")
    install = out / "install.sh"
    shutil.copy2(Path(__file__).resolve().parent / "install.sh", install)
    install.chmod(0o755)


def _pip(args: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    logger.info("running %s", " ".join(cmd))
    subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=True)


def _pip_failure(exc: subprocess.CalledProcessError, names: Sequence[str], target: Target) -> WheelhouseError:
    text = (exc.stderr or "") + (exc.stdout or "")
    m = re.search(r"No matching distribution found for ([A-Za-z0-9._-]+)", text)
    if m is None:
        m = re.search(r"Could not find a version that satisfies the requirement ([A-Za-z0-9._-]+)", text)
    name = m.group(1) if m else ",".join(names)
    tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:])
    return WheelhouseError(name, target.platform, f"no binary wheel (pip: {tail})")


def build_own_wheel(repo: Path, dest: Path) -> Path:
    """Build edgefl's ``py3-none-any`` wheel from the checkout ``repo`` into ``dest`` (pip wheel --no-deps).

    WheelhouseError if the build fails or does not produce exactly one edgefl wheel.
    """
    try:
        return _pip_wheel([str(repo)], dest, "edgefl-*.whl")
    except subprocess.CalledProcessError as exc:
        raise WheelhouseError("edgefl", "py3-none-any", f"pip wheel failed: {exc.stderr[-500:]}") from exc
    except ValueError as exc:
        raise WheelhouseError("edgefl", "py3-none-any", f"expected one wheel, got {exc}") from None


def build_pure_wheel(spec: PureWheel, dest: Path, target: Target) -> Path:
    """Build a pure-Python wheel of one dependency from its sdist (``pip wheel --no-binary``) into ``dest``.

    WheelhouseError if the build fails or the wheel is not ``none-any`` (a C extension built here would
    be an x86 binary).
    """
    try:
        args = ["--no-binary", spec.name, f"{spec.name}=={spec.version}"]
        return _pip_wheel(args, dest, "*-none-any.whl", env=spec.env)
    except subprocess.CalledProcessError as exc:
        raise _pip_failure(exc, [spec.name], target) from exc
    except ValueError as exc:
        raise WheelhouseError(spec.name, target.platform, f"not a pure-Python wheel: {exc}") from None


def _pip_wheel(args: Sequence[str], dest: Path, pattern: str, env: Mapping[str, str] | None = None) -> Path:
    """``pip wheel --no-deps`` into ``dest``; ValueError (the names built) unless one wheel, ``pattern``."""
    with tempfile.TemporaryDirectory() as tmp:
        _pip(["wheel", "--no-deps", "-q", "-w", tmp, *args], env=env)
        built = sorted(Path(tmp).glob("*.whl"))
        if len(built) != 1 or not built[0].match(pattern):
            raise ValueError([b.name for b in built])
        out = dest / built[0].name
        shutil.move(str(built[0]), out)
    return out


def download_wheels(requirements: Sequence[str], dest: Path, target: Target, *, deps: bool) -> None:
    """``pip download`` binary wheels of ``requirements`` (markers evaluated) for the target into ``dest``.

    Every tag of :func:`manylinux_tags`, the target's Python, ``cp`` and its ABI; ``deps`` lets pip
    resolve dependencies too. WheelhouseError naming the requirement with no binary wheel.
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
) -> tuple[LockEntry, ...]:
    """Build the complete offline wheelhouse for one target into ``out`` (its ``wheels/`` emptied first).

    ``repo`` is the source checkout, ``prefix`` the install prefix on the device; returns the lock's
    entries, sorted by name. WheelhouseError if the target's CPython is refused (before anything is
    built), a dependency has no wheel for the target (named, with the platform), the closure is
    incomplete, or the lock misses an expected version.
    """
    why = target.refused.get(target.python_version)
    if why is not None:
        raise WheelhouseError("edgefl", f"{target.name} CPython {target.python_version}", why)
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

    write_support_files(out, repo, prefix)
    (out / "TARGET").write_text(
        f"target={target.name}\nmachine={target.machine}\npython={target.python_version}\n"
        f"glibc={target.glibc[0]}.{target.glibc[1]}\nsystem_site_packages={int(bool(target.system_packages))}\n"
        f"default_profile={target.default_profile}\nprefix={prefix}\n"
        f"debian_packages={' '.join(target.debian_packages)}\n"
        f"system_modules={' '.join(f'{m}={d}' for m, d in target.system_modules.items())}\n",
        encoding="utf-8",
    )
    return lock


def run(args: argparse.Namespace) -> int:
    """Build the wheelhouse for parsed ``--target/--python/--out/--prefix/--repo``: 0 built, 1 failed."""
    repo = Path(args.repo) if args.repo else REPO_ROOT
    out = Path(args.out)
    t0 = time.monotonic()
    try:
        target = target_for(args.target, getattr(args, "python", None))
        lock = build_wheelhouse(target, out, repo, args.prefix)
    except WheelhouseError as exc:
        print(f"edgefl wheelhouse: {exc}", file=sys.stderr)
        return 1
    print(f"{out}: {len(lock)} wheels for {target.platform}, "
          f"wheels {_tree_bytes(out / 'wheels') / 1e6:.1f} MB, total {_tree_bytes(out) / 1e6:.1f} MB, "
          f"built in {time.monotonic() - t0:.0f} s")
    for e in lock:
        print(f"  {e.name}=={e.version}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cross_build.wheelhouse --target T [--python V] --out DIR``: exit code 0 or 1."""
    p = argparse.ArgumentParser(prog="wheelhouse", description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(p)
    args = p.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                            stream=sys.stderr)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
