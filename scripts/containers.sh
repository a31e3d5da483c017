#!/usr/bin/env bash
# Runs the ledger (inbox) and HTTP bridge tests against Postgres and Redis
# containers started through testcontainers-go, on a machine without network
# access to an image registry: installs Debian's docker.io and debootstrap when
# missing, starts an engine without any container network (scripts/dockerd.sh:
# host networking only), builds the local image (scripts/test-image.sh, cached),
# runs `go test -tags containers -run '^TestContainers$'` on the packages, then
# stops what it started. Each TestContainers starts its own containers and
# terminates them when it ends.
#
# Usage: scripts/containers.sh [packages...]   (default: ./inbox ./httpbridge)
#        scripts/containers.sh prepare         install, start the engine and build the
#                                              image only; the engine stays up (CI runs
#                                              this in the background during lint)
# Environment: JUSTONCE_CONTAINERS_RUN (a -test.run pattern for the suites run in
# the containers; default: all of each package's tests), GO (default go).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

GO=${GO:-go}
PREPARE=
if [[ ${1:-} == prepare ]]; then
  PREPARE=1
  shift
fi
PKGS=("$@")
((${#PKGS[@]})) || PKGS=(./inbox ./httpbridge)
SUDO=
[[ $(id -u) -ne 0 ]] && SUDO=sudo
# shellcheck source=lib/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/apt.sh"

log() { printf '[containers] %s\n' "$*" >&2; }

t0=$SECONDS
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
  log "installing ${need[*]}"
  apt_install "${need[@]}" || exit
  # The package enables a system daemon where systemd runs; ours is started below.
  log "installed in $((SECONDS - t0))s"
fi

started_engine=
cleanup() {
  local rc=$?
  if [[ -n $started_engine && ( -z $PREPARE || $rc -ne 0 ) ]]; then
    $SUDO env JUSTONCE_DOCKER_DIR="${JUSTONCE_DOCKER_DIR:-}" bash scripts/dockerd.sh down || true
  fi
  log "done in $((SECONDS - t0))s, exit $rc"
  exit "$rc"
}
trap cleanup EXIT

t1=$SECONDS
line=$($SUDO bash scripts/dockerd.sh up)
export "${line?}"
[[ $line == "DOCKER_HOST=unix://${JUSTONCE_DOCKER_DIR:-/tmp/justonce-docker}/docker.sock" ]] && started_engine=1
log "engine: $DOCKER_HOST ($((SECONDS - t1))s)"

t1=$SECONDS
JUSTONCE_TEST_IMAGE=$($SUDO env DOCKER_HOST="$DOCKER_HOST" HOME="$HOME" bash scripts/test-image.sh)
export JUSTONCE_TEST_IMAGE
log "image: $JUSTONCE_TEST_IMAGE ($((SECONDS - t1))s)"
if [[ -n $PREPARE ]]; then
  log "prepared; the engine stays up for the tests (scripts/dockerd.sh down stops it)"
  exit 0
fi

# No reaper container (its image cannot be pulled here): every test
# terminates its containers itself, and dockerd.sh down sweeps leftovers.
export TESTCONTAINERS_RYUK_DISABLED=true
# The tests run inside a container (/.dockerenv): containers are on the host network.
export TESTCONTAINERS_HOST_OVERRIDE=127.0.0.1

t1=$SECONDS
$GO vet -tags containers "${PKGS[@]}"
set +e +o pipefail
# (testcontainers-go's own log lines are left out)
$GO test -tags containers -race -count=1 -timeout 15m -run '^TestContainers$' -v "${PKGS[@]}" 2>&1 |
  grep -v -e '^20[0-9][0-9]/[0-9][0-9]/[0-9][0-9] ' -e '^  [A-Z][A-Za-z ]*: '
rc=${PIPESTATUS[0]}
set -e -o pipefail
log "tests: $((SECONDS - t1))s, exit $rc"
left=$(docker ps -aq --filter label=justonce.test=1 | wc -l)
if ((left)); then
  log "ERROR: $left test container(s) still exist after the tests"
  docker ps -a --filter label=justonce.test=1 >&2
  exit 1
fi
nets=$(docker network ls --format '{{.Driver}} {{.Name}}' | grep -v -e '^host host$' -e '^null none$' || true)
if [[ -n $nets ]]; then
  log "ERROR: a container network was created: $nets"
  exit 1
fi
exit "$rc"
