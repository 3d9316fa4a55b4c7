#!/usr/bin/env bash
# Emulated install check: install a wheelhouse offline into a Debian root filesystem (bookworm or
# trixie) of the target architecture, run under qemu-user through proot (no kernel change, no root bind
# of /sys), then `edgefl check-config` a shipped profile and classify the demo's test set with the
# profiles' model (digits int8, raw-input form), compare the predictions with the same runtime on x86,
# and round-trip the wire codec with the installed cbor2.
#
#   cross_build/check_emulated.sh aarch64|armv7l [bookworm|trixie] [WHEELHOUSE]
#
# The suite (default bookworm) fixes the device's CPython: bookworm 3.11, trixie 3.13; the wheelhouse
# is built for it. armv7l on trixie is refused up front (exit 2): no TFLite runtime publishes an armv7l
# wheel for CPython 3.13 (see docs/operations.md, support matrix).
# WHEELHOUSE defaults to cache/wheelhouse/<target>-<python> (built with cross_build/wheelhouse.py if
# absent or built from another commit).
# Needs: debootstrap, proot, qemu-user-static (Debian packages). Without them it prints "skip: <reason>"
# and exits 0 (exit 77 with EDGEFL_EMULATED_STRICT=1), so CI can run it unconditionally.
# Caches (git-ignored, under cache/): the root filesystems as tarballs (cache/emulated/<suite>-<arch>.tar),
# the wheelhouse, and for armv7l an x86 venv with tflite-runtime 2.14 for the reference run. Only the
# Debian mirror and the package index are reached, and only when a cache is missing.
#
# Why proot and not binfmt_misc: registering binfmt handlers changes the kernel for every process on the
# machine. proot -q runs every guest binary through qemu itself, the debootstrap second stage included.
# /sys is not bound into the root: LiteRT segfaults creating an interpreter on aarch64 when it is.
set -euo pipefail

USAGE="usage: check_emulated.sh aarch64|armv7l [bookworm|trixie] [WHEELHOUSE]"
TARGET=${1:?$USAGE}
SUITE=${2:-bookworm}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE="$ROOT/cache"
case "$SUITE" in
  bookworm) DEBIAN=12; PYVER=3.11 ;;
  trixie) DEBIAN=13; PYVER=3.13 ;;
  *) echo "check_emulated.sh: unknown suite $SUITE (bookworm or trixie); $USAGE" >&2; exit 2 ;;
esac
HOUSE=${3:-$CACHE/wheelhouse/$TARGET-$PYVER}
PY=${PYTHON:-$ROOT/.venv/bin/python}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

case "$TARGET" in
  aarch64) DARCH=arm64; QEMU=qemu-aarch64-static; RUNTIME=litert; PROFILE=gateway_aarch64_256mb
           PKGS=python3,python3-venv ;;
  armv7l)  DARCH=armhf; QEMU=qemu-arm-static; RUNTIME=tflite; PROFILE=gateway_armv7_512mb
           PKGS=python3,python3-venv,python3-numpy,python3-nacl,python3-cffi ;;
  *) echo "check_emulated.sh: unknown target $TARGET (aarch64 or armv7l); $USAGE" >&2; exit 2 ;;
esac
# A target/Python pair the builder refuses (no runtime wheel exists) is refused here before any work.
if ! REFUSAL=$(PYTHONPATH="$ROOT" "$PY" -c 'import sys
from cross_build.targets import refusal
r = refusal(sys.argv[1], sys.argv[2])
print(r or "")
sys.exit(1 if r else 0)' "$TARGET" "$PYVER"); then
  echo "check_emulated.sh: refused: $TARGET on $SUITE (Debian $DEBIAN, CPython $PYVER): $REFUSAL" >&2
  exit 2
fi

skip() {
  echo "skip: $*"
  if [ "${EDGEFL_EMULATED_STRICT:-0}" = 1 ]; then exit 77; fi
  exit 0
}
for tool in debootstrap proot "$QEMU"; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || skip "$tool not installed (apt-get install debootstrap proot qemu-user-static)"
done
QEMU_BIN=$(command -v "$QEMU")
log() { printf '[%s %s %s] %s\n' "$(date -u +%H:%M:%S)" "$TARGET" "$SUITE" "$*"; }

GUEST_ENV=(HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)

# Run a command inside the root filesystem as root, through qemu: proot -q (fake root, no kernel
# change) on aarch64; on armv7l a chroot in a private mount namespace with a binfmt handler (see below).
guest() {
  local rootfs=$1; shift
  if [ "$EMULATION" = proot ]; then
    env -i "${GUEST_ENV[@]}" ${DEBOOTSTRAP_DIR:+DEBOOTSTRAP_DIR=$DEBOOTSTRAP_DIR} \
      proot -0 -q "$QEMU_BIN" -r "$rootfs" -b /dev -b /proc -w / "$@"
  else
    unshare --mount --fork /bin/sh -c '
      r=$1; shift
      mount --bind /dev "$r/dev" && mount -t proc proc "$r/proc" && exec chroot "$r" "$@"
    ' guest "$rootfs" env -i "${GUEST_ENV[@]}" ${DEBOOTSTRAP_DIR:+DEBOOTSTRAP_DIR=$DEBOOTSTRAP_DIR} "$@"
  fi
}

# armv7l: Debian 12's proot (5.1.0) does not translate the paths of statx(), which 32-bit ARM glibc
# 2.36 uses for every stat(): ls, chmod and debootstrap's second stage fail inside proot. So the armhf
# root runs under chroot, with a binfmt_misc handler registered for 32-bit ARM ELF files for the length
# of the check only (it is kernel-wide) and removed on exit. A handler already present is used as is
# and left alone. "F" opens qemu now, so it need not be inside the root.
EMULATION=proot
BINFMT_NAME=""
BINFMT_MOUNTED=0
BINFMT_DIR=/proc/sys/fs/binfmt_misc
binfmt_register() {
  if ! [ -w "$BINFMT_DIR/register" ]; then
    mount -t binfmt_misc binfmt_misc "$BINFMT_DIR" 2>/dev/null \
      || skip "armv7l needs binfmt_misc (mount -t binfmt_misc) and root"
    BINFMT_MOUNTED=1
  fi
  if grep -qs "^interpreter .*qemu-arm" "$BINFMT_DIR"/qemu-arm "$BINFMT_DIR"/edgefl-qemu-arm; then
    log "using the binfmt handler already registered for ARM"
    return
  fi
  BINFMT_NAME=edgefl-qemu-arm
  printf '%s' ":$BINFMT_NAME:M::\x7fELF\x01\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\x28\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:$QEMU_BIN:F" \
    > "$BINFMT_DIR/register"
  log "registered binfmt handler $BINFMT_NAME (removed at exit)"
}
binfmt_unregister() {
  if [ -n "$BINFMT_NAME" ] && [ -e "$BINFMT_DIR/$BINFMT_NAME" ]; then
    echo -1 > "$BINFMT_DIR/$BINFMT_NAME" && log "unregistered binfmt handler $BINFMT_NAME"
  fi
  if [ "$BINFMT_MOUNTED" = 1 ]; then umount "$BINFMT_DIR" || true; fi
}
if [ "$TARGET" = armv7l ]; then
  [ "$(id -u)" = 0 ] || skip "armv7l needs root (chroot, binfmt_misc)"
  EMULATION=chroot
fi

mkdir -p "$CACHE/emulated"
TARBALL="$CACHE/emulated/$SUITE-$DARCH.tar"
WORK=$(mktemp -d "$CACHE/emulated/run-$TARGET-$SUITE.XXXXXX")
trap 'binfmt_unregister; rm -rf "$WORK"' EXIT
if [ "$EMULATION" = chroot ]; then binfmt_register; fi
ROOTFS="$WORK/rootfs"

if [ ! -f "$TARBALL" ]; then
  log "building the Debian $DEBIAN ($SUITE) $DARCH root filesystem (first run only)"
  t0=$(date +%s)
  mkdir -p "$ROOTFS"
  debootstrap --foreign --arch="$DARCH" --variant=minbase --include="$PKGS" "$SUITE" "$ROOTFS" "$MIRROR" \
    > "$WORK/debootstrap1.log" 2>&1 || { tail -20 "$WORK/debootstrap1.log"; exit 1; }
  # The first stage leaves /proc as a symlink to the host's /proc, which proot cannot bind over.
  if [ -L "$ROOTFS/proc" ]; then rm "$ROOTFS/proc" && mkdir "$ROOTFS/proc"; fi
  DEBOOTSTRAP_DIR=/debootstrap guest "$ROOTFS" /debootstrap/debootstrap --second-stage \
    > "$WORK/debootstrap2.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap2.log"; exit 1; }
  rm -rf "$ROOTFS/var/cache/apt/archives/"*.deb
  tar -C "$ROOTFS" -cf "$TARBALL.tmp" . && mv "$TARBALL.tmp" "$TARBALL"
  log "root filesystem built in $(( $(date +%s) - t0 )) s: $TARBALL ($(du -h "$TARBALL" | cut -f1))"
else
  mkdir -p "$ROOTFS"
  tar -C "$ROOTFS" -xf "$TARBALL"
fi

# A cached wheelhouse carries the edgefl wheel and the models of the commit it was built from: rebuild
# the default one when the source differs (a stale one once compared new x86 models with old ones).
SOURCE_ID="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
git -C "$ROOT" diff --quiet HEAD -- 2>/dev/null || SOURCE_ID="$SOURCE_ID-dirty"
if [ -z "${3:-}" ] && [ -f "$HOUSE/requirements.lock" ] && [ "$(cat "$HOUSE/SOURCE" 2>/dev/null)" != "$SOURCE_ID" ]; then
  log "cached wheelhouse built from $(cat "$HOUSE/SOURCE" 2>/dev/null || echo 'an unknown source'), not $SOURCE_ID: rebuilding"
  rm -rf "$HOUSE"
fi
if [ ! -f "$HOUSE/requirements.lock" ]; then
  log "building the wheelhouse into $HOUSE"
  PYTHONPATH="$ROOT" "$PY" -m cross_build.wheelhouse --target "$TARGET" --python "$PYVER" --out "$HOUSE"
  [ -n "${3:-}" ] || echo "$SOURCE_ID" > "$HOUSE/SOURCE"
fi
log "wheelhouse $HOUSE: wheels $(du -sh "$HOUSE/wheels" | cut -f1), total $(du -sh "$HOUSE" | cut -f1)"

# The demo's test set (edgefl.datasets.split_digits, seed 0) as raw uint8 samples, made on the host.
"$PY" "$ROOT/tests/support/classify_probe.py" export-test-set "$WORK/testset.npz"

mkdir -p "$ROOTFS/opt/wheelhouse" "$ROOTFS/opt/check"
cp -R "$HOUSE/." "$ROOTFS/opt/wheelhouse/"
cp "$ROOT/tests/support/classify_probe.py" "$WORK/testset.npz" "$ROOTFS/opt/check/"

# qemu-user runs inside the guest process: its translated code and translator state count in the
# guest's RSS (113 MiB with the model under emulation against ~60 MiB on a real aarch64 gateway), so
# check-config's memory floor would refuse the 96 MiB profile. The site override a gateway operator
# would use (/etc/edgefl/agent.env, read by install.sh's check-config) lifts the cap for this check only.
mkdir -p "$ROOTFS/etc/edgefl"
printf '%s\n' '# check_emulated.sh: qemu-user counts in RSS under emulation' \
  'EDGEFL_ARGS="--set memory.cap_mb=1024"' > "$ROOTFS/etc/edgefl/agent.env"
log "installing offline under emulation"
t0=$(date +%s)
guest "$ROOTFS" /bin/sh /opt/wheelhouse/install.sh --no-systemd --prefix /opt/edgefl --profile "$PROFILE" \
  2>&1 | sed 's/^/  guest: /'
INSTALL_S=$(( $(date +%s) - t0 ))
log "install under emulation: $INSTALL_S s; installed release $(du -sh "$ROOTFS"/opt/edgefl/releases/* | cut -f1)"

log "codec round trip under emulation (edgefl.wire.status with the cbor2 of the wheelhouse)"
CODEC_RC=0
guest "$ROOTFS" /opt/edgefl/current/venv/bin/python /opt/check/classify_probe.py codec 2>&1 | sed 's/^/  guest: /' \
  || CODEC_RC=1

log "classifying the test set under emulation ($RUNTIME)"
guest "$ROOTFS" /opt/edgefl/current/venv/bin/python /opt/check/classify_probe.py run \
  /opt/edgefl/current/models/digits_cnn_int8_rawin.tflite "$RUNTIME" /opt/check/testset.npz /opt/check/guest.npz \
  2>&1 | sed 's/^/  guest: /'

log "classifying the test set on x86 with $RUNTIME"
HOST_PY=$PY
if [ "$RUNTIME" = tflite ]; then
  # Same runtime as the device: tflite-runtime 2.14 (numpy < 2), in a cached x86 venv.
  HOST_VENV="$CACHE/venv-tflite-x86"
  if [ ! -x "$HOST_VENV/bin/python" ]; then
    "$PY" -m venv "$HOST_VENV"
    "$HOST_VENV/bin/pip" install -q --disable-pip-version-check "tflite-runtime==2.14.0" "numpy<2"
  fi
  HOST_PY="$HOST_VENV/bin/python"
fi
PYTHONPATH="$ROOT" "$HOST_PY" "$ROOT/tests/support/classify_probe.py" run "$ROOT/models/digits_cnn_int8_rawin.tflite" \
  "$RUNTIME" "$WORK/testset.npz" "$WORK/host.npz"

MATCH_RC=0
"$PY" "$ROOT/tests/support/classify_probe.py" compare "$ROOTFS/opt/check/guest.npz" "$WORK/host.npz" \
  | sed "s/^/[$TARGET] /" || MATCH_RC=1
log "done: install $INSTALL_S s, wheelhouse $(du -sh "$HOUSE" | cut -f1), predictions $([ $MATCH_RC = 0 ] && echo match || echo DIFFER), codec $([ $CODEC_RC = 0 ] && echo ok || echo FAILED)"
[ "$MATCH_RC" = 0 ] && [ "$CODEC_RC" = 0 ]
