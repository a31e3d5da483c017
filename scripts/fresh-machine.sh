#!/usr/bin/env bash
# Proves the README's two commands on a bare Debian 12 that has only Go:
# builds a minimal bookworm root filesystem (debootstrap --variant=minbase,
# plus make, which runs the commands), copies in the Go toolchain of this
# machine ($(go env GOROOT)) and a clean `git archive` of HEAD, and runs, as
# root inside it, `make demo` (which installs the packages it needs through
# scripts/deps.sh, starts Postgres, Redis and Kafka and runs the payments
# example end to end), then a short `go test -race` of one package against
# the services it started (FRESH_TEST='make test' runs the whole suite), then
# `make services-down`. Then it removes the root filesystem.
#
# The root runs under chroot in its own mount, PID and IPC namespaces
# (unshare): whatever it mounts or leaves running ends with it. It shares the
# host's network: its services listen on the host's loopback, on ports that
# differ from scripts/services.sh's defaults (the shared services), and apt,
# Maven and the Go module proxy are reached as on a real machine (with the
# host's apt sources and settings, DNS and local CA certificates). Go modules
# come through this machine's module download cache first (read-only, as a
# file:// proxy), then its GOPROXY; go.sum checks them as usual.
#
# The minbase root is cached as a tarball under $JUSTONCE_CACHE/images, as
# scripts/test-image.sh caches its image: about 2 minutes to build once,
# seconds to unpack. Needs root (re-runs itself with sudo), debootstrap
# (installed when missing) and unshare.
#
# Usage: scripts/fresh-machine.sh        (make fresh-machine)
# Environment:
#   FRESH_TEST        what runs after make demo, in the repository inside
#                     (default: go test -race of two of ./transports/kafkainbox's
#                     tests, ten thousand events with duplicates and a SIGKILLed
#                     consumer, against Kafka and Postgres; 'make test' for the
#                     whole suite, about 30 minutes more on 2 cores)
#   FRESH_KEEP=1      keep the root filesystem (its path is printed)
#   JUSTONCE_PG_PORT, JUSTONCE_REDIS_PORT, JUSTONCE_KAFKA_PORT,
#   JUSTONCE_KAFKA_CONTROLLER_PORT
#                     the services' ports inside (default 45432, 46379, 49092,
#                     49093); they must be free on this machine
#   JUSTONCE_CACHE    cache dir (default $HOME/.cache/justonce)
#   DEBIAN_MIRROR     as for scripts/test-image.sh
#   GO                the go command whose GOROOT is copied (default go)
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/.." && pwd)
LIB=$(dirname "$SELF")/lib/debian-rootfs.sh
# shellcheck source=lib/debian-rootfs.sh
. "$LIB"

log() { printf '[fresh-machine] %s\n' "$*" >&2; }
die() { printf '[fresh-machine] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ $(id -u) -ne 0 ]]; then
  exec sudo --preserve-env=FRESH_TEST,FRESH_KEEP,JUSTONCE_PG_PORT,JUSTONCE_REDIS_PORT,JUSTONCE_KAFKA_PORT,JUSTONCE_KAFKA_CONTROLLER_PORT,JUSTONCE_CACHE,DEBIAN_MIRROR,GO,PATH,HOME bash "$SELF" "$@"
fi

GO=${GO:-go}
CACHE=${JUSTONCE_CACHE:-$HOME/.cache/justonce}
PG_PORT=${JUSTONCE_PG_PORT:-45432}
REDIS_PORT=${JUSTONCE_REDIS_PORT:-46379}
KAFKA_PORT=${JUSTONCE_KAFKA_PORT:-49092}
KAFKA_CONTROLLER_PORT=${JUSTONCE_KAFKA_CONTROLLER_PORT:-49093}
FRESH_TEST=${FRESH_TEST:-"go test -race -count=1 -timeout 10m -run 'TestTenThousandWithDuplicates|TestConformance/Crash$' ./transports/kafkainbox"}
# The base root: minbase and make. Its name changes with this script and
# the helpers that build it.
INCLUDE=make
BASE_HASH=$(cat "$SELF" "$LIB" | sha256sum | cut -c1-12)
BASE=$CACHE/images/fresh-bookworm-$BASE_HASH.tar

T0=$SECONDS
step() { log "$* ($((SECONDS - T0))s since start)"; }

command -v unshare >/dev/null || die "unshare not found (util-linux)"
command -v git >/dev/null || die "git not found: the repository goes in as a git archive of HEAD"
GOROOT_HOST=$("$GO" env GOROOT) || die "no Go toolchain ($GO env GOROOT failed)"
GOMODCACHE_HOST=$("$GO" env GOMODCACHE)
GOPROXY_HOST=$("$GO" env GOPROXY)

port_open() { timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }
for p in "$PG_PORT" "$REDIS_PORT" "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT"; do
  port_open "$p" && die "port $p is taken on this machine: set JUSTONCE_PG_PORT, JUSTONCE_REDIS_PORT, JUSTONCE_KAFKA_PORT or JUSTONCE_KAFKA_CONTROLLER_PORT"
done
if [[ -n $(git -C "$REPO" status --porcelain --untracked-files=no) ]]; then
  log "note: uncommitted changes are not in the archive of HEAD"
fi

# ---------------------------------------------------------------- the base root

BUILDING=
remove_building() {
  [[ -n $BUILDING && -d $BUILDING ]] || return 0
  unmount_under "$BUILDING" && rm -rf --one-file-system "$BUILDING" "$BUILDING.log"
}
mkdir -p "$CACHE/images"
exec 8>"$CACHE/images/.lock"
flock -w 900 8 || die "another build holds $CACHE/images/.lock"
if [[ ! -s $BASE ]]; then
  step "building the base root filesystem"
  BUILDING=$(mktemp -d /tmp/justonce-fresh-base.XXXXXX)
  trap remove_building EXIT
  debootstrap_rootfs "$BUILDING" "$INCLUDE"
  # What a fresh machine has not fetched yet: package lists and archives
  # (their partial/ folders stay, owned by apt's sandbox user).
  find "$BUILDING"/var/cache/apt/archives "$BUILDING"/var/lib/apt/lists -maxdepth 1 -type f ! -name lock -delete
  chmod 755 "$BUILDING" # mktemp's 0700 would become the root's /, closed to apt's and Postgres's users
  tar -C "$BUILDING" --numeric-owner --one-file-system -cf "$BASE.tmp" .
  mv "$BASE.tmp" "$BASE"
  remove_building
  trap - EXIT
  find "$CACHE/images" -maxdepth 1 -name 'fresh-bookworm-*.tar' ! -name "fresh-bookworm-$BASE_HASH.tar" -delete
  step "base root filesystem: $BASE ($(du -h "$BASE" | cut -f1))"
else
  step "reusing the base root filesystem $BASE"
fi
exec 8>&-

# ---------------------------------------------------------------- this run's root

WORK=$(mktemp -d /tmp/justonce-fresh.XXXXXX)
ROOT=$WORK/root
cleanup() {
  local rc=$?
  trap - EXIT
  if [[ -n ${FRESH_KEEP:-} ]]; then
    log "kept $ROOT (FRESH_KEEP=1); remove it with: rm -rf --one-file-system $WORK"
  else
    # The namespaces' mounts ended with them; this is a safety net.
    unmount_under "$WORK" || log "something stays mounted under $WORK"
    rm -rf --one-file-system "$WORK"
  fi
  log "done in $((SECONDS - T0))s, exit $rc"
  exit "$rc"
}
trap cleanup EXIT
mkdir -p "$ROOT"
tar -C "$ROOT" --numeric-owner -xf "$BASE"
chmod 755 "$ROOT"
# The machine's own apt sources and network settings (mirror, proxy,
# validity checks), as a Debian 12 machine of this kind has them.
rm -f "$ROOT"/etc/apt/sources.list
cp -a /etc/apt/sources.list.d/. "$ROOT"/etc/apt/sources.list.d/ 2>/dev/null || true
[[ -f /etc/apt/sources.list ]] && cp /etc/apt/sources.list "$ROOT"/etc/apt/sources.list
for f in /etc/apt/apt.conf.d/*; do
  grep -qE '^[[:space:]]*Acquire' "$f" 2>/dev/null && cp "$f" "$ROOT"/etc/apt/apt.conf.d/
done
# The machine's own certificate authorities (/usr/local/share/ca-certificates),
# as a machine of this kind has them: where a proxy inspects TLS, Maven and Go
# need its CA. Debian's ca-certificates (deps.sh installs it) adds them to the
# system's and Java's trust stores.
if compgen -G '/usr/local/share/ca-certificates/*' >/dev/null; then
  mkdir -p "$ROOT"/usr/local/share/ca-certificates
  cp -a /usr/local/share/ca-certificates/. "$ROOT"/usr/local/share/ca-certificates/
fi
cp /etc/resolv.conf "$ROOT"/etc/resolv.conf
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$ROOT"/etc/hosts
# Packages start no daemon here (as in a container): the services are
# scripts/services.sh's, on their own ports. Without this, installing
# postgresql and redis-server would start theirs on 5432 and 6379 of the
# shared loopback.
printf '#!/bin/sh\nexit 101\n' >"$ROOT"/usr/sbin/policy-rc.d
chmod 755 "$ROOT"/usr/sbin/policy-rc.d
step "copying Go ($GOROOT_HOST, $("$GOROOT_HOST/bin/go" version | cut -d' ' -f3)) and git archive HEAD ($(git -C "$REPO" rev-parse --short HEAD))"
cp -a "$GOROOT_HOST" "$ROOT"/usr/local/go
mkdir -p "$ROOT"/root/justonce "$ROOT"/mnt/goproxy
git -C "$REPO" archive --format=tar HEAD | tar -C "$ROOT"/root/justonce -xf -

goproxy=$GOPROXY_HOST
if [[ -d $GOMODCACHE_HOST/cache/download ]]; then
  goproxy="file:///mnt/goproxy,$GOPROXY_HOST"
fi
cat >"$ROOT"/root/fresh-run.sh <<EOF
#!/bin/bash
# Run inside the bare root by scripts/fresh-machine.sh.
set -uo pipefail
cd /root/justonce
t0=\$SECONDS
rc=0
run() {
  local t=\$SECONDS r=0
  echo "[fresh-machine] inside: \$*"
  bash -c "\$*" || r=\$?
  echo "[fresh-machine] inside: exit \$r after \$((SECONDS - t))s: \$*"
  return "\$r"
}
echo "[fresh-machine] inside: \$(. /etc/os-release && echo "\$PRETTY_NAME"); \$(go version)"
for c in java javac mvn psql redis-server gcc git; do
  command -v "\$c" >/dev/null && echo "[fresh-machine] inside: \$c is already here: \$(command -v \$c)"
done
run make demo || rc=\$?
if ((rc == 0)); then
  run $(printf '%q' "$FRESH_TEST") || rc=\$?
fi
run make services-down || true
echo "[fresh-machine] inside: done in \$((SECONDS - t0))s, exit \$rc"
exit "\$rc"
EOF
chmod 755 "$ROOT"/root/fresh-run.sh

step "running make demo, then '$FRESH_TEST', as root in the bare root (services on 127.0.0.1:$PG_PORT, :$REDIS_PORT, :$KAFKA_PORT)"
set +e
# A private mount namespace (what is mounted here stays here), a PID
# namespace (whatever still runs when the run ends is killed with it), an
# IPC namespace (Postgres's shared memory); the host's network.
export ROOT GOPROXY_IN=$goproxy MODDL=$GOMODCACHE_HOST/cache/download PG_PORT REDIS_PORT KAFKA_PORT KAFKA_CONTROLLER_PORT
unshare --mount --propagation private --pid --fork --ipc bash -c '
  set -e
  mount -t proc proc "$ROOT/proc"
  mount -t sysfs sysfs "$ROOT/sys"
  mount --rbind /dev "$ROOT/dev"
  mount -t tmpfs -o mode=1777,size=1g shm "$ROOT/dev/shm"
  if [[ -d $MODDL ]]; then mount --bind -o ro "$MODDL" "$ROOT/mnt/goproxy"; fi
  exec chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    GOPROXY="$GOPROXY_IN" JUSTONCE_PG_PORT="$PG_PORT" JUSTONCE_REDIS_PORT="$REDIS_PORT" \
    JUSTONCE_KAFKA_PORT="$KAFKA_PORT" JUSTONCE_KAFKA_CONTROLLER_PORT="$KAFKA_CONTROLLER_PORT" \
    /root/fresh-run.sh
'
rc=$?
set -e
step "the bare root's run ended: exit $rc"
exit "$rc"
