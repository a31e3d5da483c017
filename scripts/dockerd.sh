#!/usr/bin/env bash
# Starts a Docker engine for the testcontainers-go tests on machines that have
# Debian's docker.io but no running daemon (CI): no bridge, no iptables, so no
# container network exists and containers can only use host networking; test
# traffic stays on loopback. An engine that already answers on DOCKER_HOST (or
# /var/run/docker.sock) is used as it is and never stopped by this script.
#
# Usage: scripts/dockerd.sh up|down|env
#   up    start (or reuse) the engine; prints `DOCKER_HOST=...` on stdout
#   down  stop the engine `up` started (pid file only) and any container left
#         with the label justonce.test=1
#   env   print the DOCKER_HOST line of the running engine
# Environment:
#   JUSTONCE_DOCKER_DIR   state dir: socket, pid file, log (default /tmp/justonce-docker)
#   JUSTONCE_DOCKER_ROOT  image/container storage (default /var/lib/justonce-docker;
#                         kept between runs, so imported images are reused)
set -euo pipefail

STATE=${JUSTONCE_DOCKER_DIR:-/tmp/justonce-docker}
ROOT=${JUSTONCE_DOCKER_ROOT:-/var/lib/justonce-docker}
SOCK=$STATE/docker.sock
PIDFILE=$STATE/dockerd.pid
LOG=$STATE/dockerd.log

log() { printf '[dockerd] %s\n' "$*" >&2; }
die() { printf '[dockerd] ERROR: %s\n' "$*" >&2; exit 1; }

answers() { DOCKER_HOST=$1 timeout 5 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }
ours_running() {
  [[ -s $PIDFILE ]] || return 1
  local pid
  pid=$(tr -dc 0-9 <"$PIDFILE")
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q dockerd
}

existing() { # an engine not started by us
  if [[ -n ${DOCKER_HOST:-} ]] && [[ $DOCKER_HOST != "unix://$SOCK" ]] && answers "$DOCKER_HOST"; then
    echo "$DOCKER_HOST"
  elif [[ -S /var/run/docker.sock ]] && answers unix:///var/run/docker.sock; then
    echo unix:///var/run/docker.sock
  else
    return 1
  fi
}

cmd_up() {
  local h t0=$SECONDS
  command -v docker >/dev/null || die "docker CLI not found (apt-get install docker.io)"
  if ours_running && answers "unix://$SOCK"; then
    log "reusing our engine (pid $(cat "$PIDFILE"))"
    echo "DOCKER_HOST=unix://$SOCK"
    return
  fi
  if h=$(existing); then
    log "using the running engine at $h"
    echo "DOCKER_HOST=$h"
    return
  fi
  command -v dockerd >/dev/null || die "dockerd not found (apt-get install docker.io)"
  mkdir -p "$STATE" "$ROOT"
  rm -f "$SOCK"
  setsid nohup dockerd --host "unix://$SOCK" --pidfile "$PIDFILE" --data-root "$ROOT" \
    --exec-root "$STATE/exec" --bridge=none --iptables=false --ip6tables=false --ip-forward=false \
    --ip-masq=false --userland-proxy=false </dev/null >"$LOG" 2>&1 9>&- 8>&- &
  local i
  for ((i = 0; i < 600; i++)); do
    if answers "unix://$SOCK"; then
      log "engine up in $((SECONDS - t0))s (pid $(cat "$PIDFILE"), storage driver $(DOCKER_HOST=unix://$SOCK docker info --format '{{.Driver}}'))"
      echo "DOCKER_HOST=unix://$SOCK"
      return
    fi
    sleep 0.1
  done
  tail -n 40 "$LOG" >&2 || true
  die "dockerd did not answer on $SOCK within 60s"
}

cmd_down() {
  local h ids
  if h=$(ours_running && echo "unix://$SOCK" || existing); then
    ids=$(DOCKER_HOST=$h docker ps -aq --filter label=justonce.test=1 2>/dev/null || true)
    if [[ -n $ids ]]; then
      log "removing leftover test containers: $(echo $ids)"
      # shellcheck disable=SC2086
      DOCKER_HOST=$h docker rm -f $ids >/dev/null || true
    fi
  fi
  if ours_running; then
    local pid
    pid=$(tr -dc 0-9 <"$PIDFILE")
    log "stopping our engine (pid $pid)"
    kill -TERM "$pid"
    local i
    for ((i = 0; i < 300; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && { log "dockerd did not stop in 30s, sending KILL"; kill -KILL "$pid"; }
  fi
  # The engine's network namespace files stay mounted after it exits.
  local m
  for m in "$STATE"/exec/netns/*; do
    while [[ -e $m ]] && umount "$m" 2>/dev/null; do :; done
  done
  rm -rf "$STATE"
}

cmd_env() {
  if ours_running; then echo "DOCKER_HOST=unix://$SOCK"; elif h=$(existing); then echo "DOCKER_HOST=$h"; else die "no engine"; fi
}

case ${1:-} in
  up) cmd_up ;;
  down) cmd_down ;;
  env) cmd_env ;;
  *)
    echo "usage: $0 up|down|env" >&2
    exit 2
    ;;
esac
