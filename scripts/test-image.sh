#!/usr/bin/env bash
# Builds the local Docker image the testcontainers-go tests run (Postgres 15 and
# Redis from Debian's packages), without pulling anything: debootstrap a minimal
# Debian 12 root with postgresql-15 and redis-server, add an entrypoint that
# reads POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB as the official postgres
# image does, and `docker import` it. Prints the image reference on stdout.
#
# The image is tagged justonce/testsvc:<hash of this script>, so a change here
# builds a new one. The root filesystem tarball is cached under
# $JUSTONCE_CACHE/images (default $HOME/.cache/justonce/images): a machine whose
# Docker storage was wiped imports it again in seconds instead of rebuilding.
#
# Usage: scripts/test-image.sh          build (or reuse) and print the reference
# Environment:
#   JUSTONCE_CACHE     cache dir (default $HOME/.cache/justonce)
#   DEBIAN_MIRROR      mirror for debootstrap (default: the first deb.debian.org-style
#                      URI of the machine's apt sources, else http://deb.debian.org/debian;
#                      see scripts/lib/debian-rootfs.sh)
#   DOCKER_HOST        as for the docker CLI
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
LIB=$(dirname "$SELF")/lib/debian-rootfs.sh
# shellcheck source=lib/debian-rootfs.sh
. "$LIB"
CACHE=${JUSTONCE_CACHE:-$HOME/.cache/justonce}
HASH=$(cat "$SELF" "$LIB" | sha256sum | cut -c1-12)
IMAGE=justonce/testsvc:$HASH
TAR=$CACHE/images/testsvc-$HASH.tar

log() { printf '[test-image] %s\n' "$*" >&2; }
die() { printf '[test-image] ERROR: %s\n' "$*" >&2; exit 1; }

command -v docker >/dev/null || die "docker CLI not found (apt-get install docker.io)"

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "reusing $IMAGE"
  echo "$IMAGE"
  exit 0
fi

ROOTFS=
remove_rootfs() {
  [[ -n $ROOTFS && -d $ROOTFS ]] || return 0
  unmount_under "$ROOTFS" && rm -rf --one-file-system "$ROOTFS" "$ROOTFS.log"
}

build_tar() {
  command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
  local root t0=$SECONDS
  root=$(mktemp -d /tmp/justonce-image.XXXXXX)
  ROOTFS=$root
  trap remove_rootfs EXIT
  debootstrap_rootfs "$root" postgresql-15,redis-server
  # No packaged cluster or service state: the entrypoint makes its own.
  rm -rf "$root"/var/lib/postgresql/15/main "$root"/etc/postgresql/15/main \
    "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/*
  cat >"$root/usr/local/bin/justonce-entrypoint" <<'ENTRY'
#!/bin/sh
# Entrypoint of the justonce test image. `postgres [ARGS...]` initialises
# $PGDATA on first start from POSTGRES_USER (default postgres), POSTGRES_PASSWORD
# (empty: trust), POSTGRES_DB (default the user) and POSTGRES_HOST_AUTH_METHOD,
# as the official image does, then runs the server as the postgres user with
# ARGS. It listens on POSTGRES_LISTEN (default 127.0.0.1: the image is meant for
# host networking). Anything else is run as given (e.g. redis-server ...).
set -eu
if [ "${1:-}" = postgres ]; then
  shift
  bin=/usr/lib/postgresql/15/bin
  PGDATA=${PGDATA:-/var/lib/postgresql/data}
  export PGDATA
  user=${POSTGRES_USER:-postgres}
  db=${POSTGRES_DB:-$user}
  mkdir -p "$PGDATA" /var/run/postgresql
  chown postgres:postgres "$PGDATA" /var/run/postgresql
  chmod 700 "$PGDATA"
  if [ ! -s "$PGDATA/PG_VERSION" ]; then
    auth=${POSTGRES_HOST_AUTH_METHOD:-}
    if [ -z "$auth" ]; then
      if [ -n "${POSTGRES_PASSWORD:-}" ]; then auth=scram-sha-256; else auth=trust; fi
    fi
    pw=/tmp/pgpass.$$
    printf '%s\n' "${POSTGRES_PASSWORD:-}" >"$pw"
    chown postgres "$pw"
    if [ -n "${POSTGRES_PASSWORD:-}" ]; then pwopt="--pwfile=$pw"; else pwopt=; fi
    runuser -u postgres -- "$bin/initdb" -D "$PGDATA" -U "$user" $pwopt -A "$auth" -E UTF8 --no-locale --no-sync >/dev/null
    rm -f "$pw"
    if [ "$db" != postgres ]; then
      echo "CREATE DATABASE \"$db\" OWNER \"$user\"" |
        runuser -u postgres -- "$bin/postgres" --single -D "$PGDATA" -j postgres >/dev/null
    fi
    echo "justonce-entrypoint: initialised $PGDATA (user $user, database $db, auth $auth)"
  fi
  exec runuser -u postgres -- "$bin/postgres" -D "$PGDATA" \
    -c "listen_addresses=${POSTGRES_LISTEN:-127.0.0.1}" -c unix_socket_directories=/var/run/postgresql "$@"
fi
exec "$@"
ENTRY
  chmod 755 "$root/usr/local/bin/justonce-entrypoint"
  mkdir -p "$CACHE/images"
  tar -C "$root" --numeric-owner --one-file-system -cf "$TAR.tmp" .
  mv "$TAR.tmp" "$TAR"
  remove_rootfs
  trap - EXIT
  log "root filesystem built in $((SECONDS - t0))s: $TAR ($(du -h "$TAR" | cut -f1))"
}

mkdir -p "$CACHE/images"
exec 8>"$CACHE/images/.lock"
flock -w 900 8 || die "another test-image.sh holds $CACHE/images/.lock"
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "$IMAGE"
  exit 0
fi
[[ -s $TAR ]] || build_tar
# Keep only this version's tarball.
find "$CACHE/images" -maxdepth 1 -name 'testsvc-*.tar' ! -name "testsvc-$HASH.tar" -delete
t0=$SECONDS
docker import \
  --change 'ENTRYPOINT ["/usr/local/bin/justonce-entrypoint"]' \
  --change 'CMD ["postgres"]' \
  --change 'ENV LANG=C.UTF-8' \
  "$TAR" "$IMAGE" >/dev/null || die "docker import failed"
log "imported $IMAGE in $((SECONDS - t0))s"
echo "$IMAGE"
