#!/bin/sh
# edgefl offline installer. cross_build/wheelhouse.py copies this file into every wheelhouse; run it from
# there, on the gateway, as root. It needs no network and no compiler.
#
#   ./install.sh [--profile NAME] [--prefix DIR] [--python PYTHON] [--no-systemd] [--no-start]
#   ./install.sh --rollback [--prefix DIR]
#
# Install: a new release <prefix>/releases/edgefl-<version>-<UTC time>/ (venv + profiles + models) is
# created next to the old ones, installed from wheels/ with hash checking, checked (pip check, edgefl
# check-config on the profile with the site's /etc/edgefl/agent.env overrides); then the user, the unit
# and its enabling are put in place, <prefix>/current is switched (the old target kept as previous) and
# the unit restarted. All or nothing: if any step fails, every step done is undone (release removed,
# current/previous, unit file, enabling, user and agent.env as they were, the old release restarted).
# Rollback: swaps current and previous and restarts the unit.
# The Python must be the one the wheelhouse was built for (TARGET's python=); with systemd, systemd
# must be running (PID 1), else use --no-systemd. EDGEFL_SYSCONFDIR (default /etc) moves the unit and
# agent.env (images, tests).
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
SYSCONF=${EDGEFL_SYSCONFDIR:-/etc}
ENV_DIR=$SYSCONF/edgefl
ENV_FILE=$ENV_DIR/agent.env
UNIT_DST=$SYSCONF/systemd/system/edgefl-agent.service

while [ $# -gt 0 ]; do
  case "$1" in
    --profile) PROFILE=$2; shift 2 ;;
    --prefix) PREFIX=$2; shift 2 ;;
    --python) PYTHON=$2; shift 2 ;;
    --no-systemd) SYSTEMD=0; shift ;;
    --no-start) START=0; shift ;;
    --rollback) ROLLBACK=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
if [ "$SYSTEMD" = 1 ]; then
  command -v systemctl >/dev/null 2>&1 || die "no systemctl: use --no-systemd"
  # systemctl exists in containers too, where it cannot reach a manager: ask before touching anything.
  state=$(systemctl is-system-running 2>/dev/null) || true
  case "$state" in
    running|degraded|starting|initializing|maintenance) ;;
    *) die "systemd is not running here (systemctl is-system-running: ${state:-no answer}; PID 1 is $(cat /proc/1/comm 2>/dev/null || echo unknown)): use --no-systemd" ;;
  esac
fi

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
    install -m 0644 "$PREFIX/current/edgefl-agent.service" "$UNIT_DST"
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
[ "$pyver" = "$PYVER" ] || die "this wheelhouse is for CPython $PYVER (cp$(echo "$PYVER" | tr -d .) wheels) but $PYTHON is CPython $pyver: use --python with a $PYVER, or build one with edgefl wheelhouse --target $(get target) --python $pyver"
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || die "$PYTHON cannot create venvs: apt-get install python3-venv"
VENV_FLAGS=""
if [ "$SYSSITE" = 1 ]; then
  # numpy and the signing library (PyNaCl) come from the OS on this target (no wheel on PyPI for
  # them): see requirements.lock's header.
  for pair in $(get system_modules); do
    "$PYTHON" -c "import ${pair%%=*}" 2>/dev/null || die "${pair%%=*} missing: apt-get install ${pair#*=}"
  done
  VENV_FLAGS="--system-site-packages"
fi

VERSION=$(sed -n 's/^edgefl==\([^ ]*\) .*/\1/p' "$HERE/requirements.lock")
[ -n "$VERSION" ] || die "requirements.lock has no edgefl line"
NAME="edgefl-$VERSION-$(date -u +%Y%m%dT%H%M%SZ)"
RELEASE="$PREFIX/releases/$NAME"
[ ! -e "$RELEASE" ] || die "$RELEASE exists"
MADE_PREFIX=0; MADE_RELEASES=0
[ -d "$PREFIX" ] || MADE_PREFIX=1
[ -d "$PREFIX/releases" ] || MADE_RELEASES=1
mkdir -p "$PREFIX/releases"
# All or nothing: each step below records what it changed; undo() reverts those, newest first.
OLD_CURRENT=""; OLD_PREVIOUS=""; SWITCHED=0
MADE_USER=0; MADE_ENV_DIR=0; MADE_ENV_FILE=0
UNIT_SAVED=""; UNIT_PUT=0; RELOADED=0; WAS_ENABLED=""; ENABLED=0; WAS_ACTIVE=""; RESTARTED=0
[ ! -L "$PREFIX/current" ] || OLD_CURRENT=$(readlink "$PREFIX/current")
[ ! -L "$PREFIX/previous" ] || OLD_PREVIOUS=$(readlink "$PREFIX/previous")
undo() {
  rc=$?
  trap - EXIT
  set +e
  undone="release $NAME removed"
  outcome="the running release is unchanged"
  if [ "$SWITCHED" = 1 ]; then
    if [ -n "$OLD_CURRENT" ]; then
      ln -sfn "$OLD_CURRENT" "$PREFIX/current.new" && mv -T "$PREFIX/current.new" "$PREFIX/current"
    else
      rm -f "$PREFIX/current"
    fi
    if [ -n "$OLD_PREVIOUS" ]; then ln -sfn "$OLD_PREVIOUS" "$PREFIX/previous"; else rm -f "$PREFIX/previous"; fi
    undone="$undone, current -> ${OLD_CURRENT:-(none)}"
  fi
  if [ "$UNIT_PUT" = 1 ]; then
    if [ -n "$UNIT_SAVED" ]; then mv -f "$UNIT_SAVED" "$UNIT_DST"; else rm -f "$UNIT_DST"; fi
    undone="$undone, unit file restored"
  fi
  if [ "$ENABLED" = 1 ] && [ "$WAS_ENABLED" != enabled ]; then
    systemctl disable edgefl-agent.service >/dev/null 2>&1 && undone="$undone, unit disabled"
  fi
  if [ "$RELOADED" = 1 ]; then systemctl daemon-reload >/dev/null 2>&1; fi
  if [ "$RESTARTED" = 1 ] && [ "$WAS_ACTIVE" = active ] && [ -n "$OLD_CURRENT" ]; then
    if systemctl restart edgefl-agent.service >/dev/null 2>&1; then
      undone="$undone, old release restarted"
    else
      undone="$undone, old release NOT restarted (systemctl restart edgefl-agent failed)"
      outcome="the previous release is back in place but not running"
    fi
  fi
  if [ "$MADE_ENV_FILE" = 1 ]; then rm -f "$ENV_FILE"; undone="$undone, $ENV_FILE removed"; fi
  if [ "$MADE_ENV_DIR" = 1 ]; then rmdir "$ENV_DIR" 2>/dev/null; fi
  if [ "$MADE_USER" = 1 ]; then userdel edgefl >/dev/null 2>&1 && undone="$undone, user edgefl removed"; fi
  rm -rf "$RELEASE"
  if [ "$MADE_RELEASES" = 1 ]; then rmdir "$PREFIX/releases" 2>/dev/null; fi
  if [ "$MADE_PREFIX" = 1 ]; then rmdir "$PREFIX" 2>/dev/null; fi
  echo "install.sh: failed (exit $rc), undone: $undone; $outcome" >&2
  exit "$rc"
}
trap undo EXIT
trap 'exit 130' INT TERM HUP
t0=$(date +%s)

"$PYTHON" -m venv $VENV_FLAGS "$RELEASE/venv"
PIP_CONFIG_FILE=/dev/null "$RELEASE/venv/bin/python" -m pip install --disable-pip-version-check -q \
  --no-index --find-links "$HERE/wheels" --require-hashes --no-deps -r "$HERE/requirements.lock"
"$RELEASE/venv/bin/python" -m pip check --disable-pip-version-check
# the units run with PYTHONOPTIMIZE=2 (-OO) under ProtectSystem=strict: compile that bytecode now, or
# every start would compile every import again, in memory
"$RELEASE/venv/bin/python" -m compileall -q -o 2 "$RELEASE/venv/lib" >/dev/null
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
  if ! getent passwd edgefl >/dev/null 2>&1; then
    useradd --system --user-group --no-create-home --home-dir /var/lib/edgefl --shell /usr/sbin/nologin edgefl
    MADE_USER=1
  fi
  if [ ! -d "$ENV_DIR" ]; then mkdir -p "$ENV_DIR"; MADE_ENV_DIR=1; fi
  if [ ! -f "$ENV_FILE" ]; then
    MADE_ENV_FILE=1
    printf '%s\n' '# Site settings for edgefl-agent.service, kept across upgrades, e.g.' \
      '# EDGEFL_ARGS="--set device.id=gw-0001 --set broker.url=mqtts://coordinator.example:8883"' > "$ENV_FILE"
    chmod 0640 "$ENV_FILE"
  fi
  mkdir -p "$(dirname "$UNIT_DST")"
  if [ -f "$UNIT_DST" ]; then
    UNIT_SAVED="$UNIT_DST.edgefl-old"
    cp -p "$UNIT_DST" "$UNIT_SAVED"
  fi
  UNIT_PUT=1
  install -m 0644 "$RELEASE/edgefl-agent.service" "$UNIT_DST"
  RELOADED=1
  systemctl daemon-reload
  WAS_ENABLED=$(systemctl is-enabled edgefl-agent.service 2>/dev/null) || true
  WAS_ACTIVE=$(systemctl is-active edgefl-agent.service 2>/dev/null) || true
  ENABLED=1
  systemctl enable edgefl-agent.service >/dev/null
fi
if [ -n "$OLD_CURRENT" ]; then ln -sfn "$OLD_CURRENT" "$PREFIX/previous"; fi
SWITCHED=1
ln -sfn "releases/$NAME" "$PREFIX/current.new" && mv -T "$PREFIX/current.new" "$PREFIX/current"
if [ "$SYSTEMD" = 1 ] && [ "$START" = 1 ]; then
  RESTARTED=1
  systemctl restart edgefl-agent.service
fi
trap - EXIT INT TERM HUP
rm -f "$UNIT_SAVED"
echo "install.sh: installed $NAME (profile $PROFILE) in $((t1 - t0)) s; $PREFIX/current -> releases/$NAME"
