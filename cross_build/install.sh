#!/bin/sh
# edgefl offline installer. cross_build/wheelhouse.py copies this file into every wheelhouse; run it from
# there, on the gateway, as root. It needs no network and no compiler.
#
#   ./install.sh [--profile NAME] [--prefix DIR] [--python PYTHON] [--no-systemd] [--no-start]
#   ./install.sh --rollback [--prefix DIR]
#
# Install: a new release <prefix>/releases/edgefl-<version>-<UTC time>/ (venv + profiles + models) is
# created next to the old ones, installed from wheels/ with hash checking, checked (pip check, edgefl
# check-config on the profile with the site's /etc/edgefl/agent.env overrides), and only then
# <prefix>/current is switched to it (the old target is kept as <prefix>/previous) and the systemd unit
# restarted. A failed install leaves the running release untouched.
# Rollback: swaps current and previous and restarts the unit.
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
die() { echo "install.sh: $*" >&2; exit 1; }
[ -f "$HERE/TARGET" ] || die "run me from a wheelhouse folder (no TARGET file next to me)"
get() { sed -n "s/^$1=//p" "$HERE/TARGET"; }

MACHINE=$(get machine)
PYVER=$(get python)
SYSSITE=$(get system_site_packages)
PROFILE=$(get default_profile)
BUILD_PREFIX=$(get prefix)
PREFIX=$BUILD_PREFIX
PYTHON=/usr/bin/python3
SYSTEMD=1
START=1
ROLLBACK=0
ENV_FILE=/etc/edgefl/agent.env

while [ $# -gt 0 ]; do
  case "$1" in
    --profile) PROFILE=$2; shift 2 ;;
    --prefix) PREFIX=$2; shift 2 ;;
    --python) PYTHON=$2; shift 2 ;;
    --no-systemd) SYSTEMD=0; shift ;;
    --no-start) START=0; shift ;;
    --rollback) ROLLBACK=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ "$SYSTEMD" = 0 ] || command -v systemctl >/dev/null 2>&1 || die "no systemctl: use --no-systemd"

restart_unit() {
  if [ "$SYSTEMD" = 1 ]; then
    systemctl daemon-reload
    systemctl enable edgefl-agent.service >/dev/null
    if [ "$START" = 1 ]; then systemctl restart edgefl-agent.service; fi
  fi
}

if [ "$ROLLBACK" = 1 ]; then
  [ -L "$PREFIX/previous" ] || die "no $PREFIX/previous to roll back to"
  cur=$(readlink "$PREFIX/current")
  prev=$(readlink "$PREFIX/previous")
  ln -sfn "$prev" "$PREFIX/current.new" && mv -T "$PREFIX/current.new" "$PREFIX/current"
  ln -sfn "$cur" "$PREFIX/previous"
  # The unit of the release rolled back to (its MemoryMax may differ).
  if [ "$SYSTEMD" = 1 ] && [ -f "$PREFIX/current/edgefl-agent.service" ]; then
    install -m 0644 "$PREFIX/current/edgefl-agent.service" /etc/systemd/system/edgefl-agent.service
  fi
  restart_unit
  echo "install.sh: rolled back to $prev (previous is now $cur)"
  exit 0
fi

[ -f "$HERE/firmware_configs/$PROFILE.toml" ] || die "no profile $PROFILE in firmware_configs/"
UNIT="$HERE/systemd/$PROFILE.service"
[ "$SYSTEMD" = 0 ] || [ -f "$UNIT" ] || die "no systemd unit for profile $PROFILE (its state_dir is not under /var/lib)"

# The wheels were chosen for one machine and one CPython: check before touching anything.
got=$("$PYTHON" -c 'import platform, sys; print(platform.machine(), "%d.%d" % sys.version_info[:2])') \
  || die "$PYTHON does not run"
machine=${got% *}
pyver=${got#* }
[ "$machine" = "$MACHINE" ] || die "this wheelhouse is for $MACHINE; $PYTHON reports platform.machine() = $machine"
[ "$pyver" = "$PYVER" ] || die "this wheelhouse is for CPython $PYVER; $PYTHON is $pyver"
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || die "$PYTHON cannot create venvs: apt-get install python3-venv"
VENV_FLAGS=""
if [ "$SYSSITE" = 1 ]; then
  # numpy comes from the OS on this target (no wheel on PyPI for it): see requirements.lock's header.
  "$PYTHON" -c 'import numpy' 2>/dev/null || die "numpy missing: apt-get install python3-numpy"
  VENV_FLAGS="--system-site-packages"
fi

VERSION=$(sed -n 's/^edgefl==\([^ ]*\) .*/\1/p' "$HERE/requirements.lock")
[ -n "$VERSION" ] || die "requirements.lock has no edgefl line"
NAME="edgefl-$VERSION-$(date -u +%Y%m%dT%H%M%SZ)"
RELEASE="$PREFIX/releases/$NAME"
mkdir -p "$PREFIX/releases"
[ ! -e "$RELEASE" ] || die "$RELEASE exists"
trap 'rm -rf "$RELEASE"; echo "install.sh: failed, $RELEASE removed; the running release is unchanged" >&2' EXIT
t0=$(date +%s)

"$PYTHON" -m venv $VENV_FLAGS "$RELEASE/venv"
PIP_CONFIG_FILE=/dev/null "$RELEASE/venv/bin/python" -m pip install --disable-pip-version-check -q \
  --no-index --find-links "$HERE/wheels" --require-hashes --no-deps -r "$HERE/requirements.lock"
"$RELEASE/venv/bin/python" -m pip check --disable-pip-version-check
cp -R "$HERE/firmware_configs" "$HERE/models" "$RELEASE/"
cp "$HERE/requirements.lock" "$HERE/TARGET" "$RELEASE/"
if [ "$SYSTEMD" = 1 ]; then
  sed "s|$BUILD_PREFIX/|$PREFIX/|g" "$UNIT" > "$RELEASE/edgefl-agent.service"
fi

# Validate the profile as the unit will run it (with the site's overrides) before switching.
(
  EDGEFL_ARGS=""
  if [ -f "$ENV_FILE" ]; then set -a; . "$ENV_FILE"; set +a; fi
  # shellcheck disable=SC2086  # EDGEFL_ARGS is a word list, as systemd splits it
  "$RELEASE/venv/bin/edgefl" check-config "$RELEASE/firmware_configs/$PROFILE.toml" $EDGEFL_ARGS
)
t1=$(date +%s)

if [ "$SYSTEMD" = 1 ]; then
  getent passwd edgefl >/dev/null 2>&1 || useradd --system --user-group --no-create-home \
    --home-dir /var/lib/edgefl --shell /usr/sbin/nologin edgefl
  mkdir -p /etc/edgefl
  if [ ! -f "$ENV_FILE" ]; then
    printf '%s\n' '# Site settings for edgefl-agent.service, kept across upgrades, e.g.' \
      '# EDGEFL_ARGS="--set device.id=gw-0001 --set broker.url=mqtts://coordinator.example:8883"' > "$ENV_FILE"
    chmod 0640 "$ENV_FILE"
  fi
  install -m 0644 "$RELEASE/edgefl-agent.service" /etc/systemd/system/edgefl-agent.service
fi
if [ -L "$PREFIX/current" ]; then ln -sfn "$(readlink "$PREFIX/current")" "$PREFIX/previous"; fi
ln -sfn "releases/$NAME" "$PREFIX/current.new" && mv -T "$PREFIX/current.new" "$PREFIX/current"
trap - EXIT
restart_unit
echo "install.sh: installed $NAME (profile $PROFILE) in $((t1 - t0)) s; $PREFIX/current -> releases/$NAME"
