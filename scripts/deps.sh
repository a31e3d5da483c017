#!/usr/bin/env bash
# Installs the Debian packages that `make demo` and `make test` need beside
# Go, when missing, so that both run on a fresh Debian 12 that has only Go
# (and make):
#   postgresql, redis-server         the test services (scripts/services.sh)
#   openjdk-17-jdk-headless          Kafka's broker runs on Java 17 (or later), and
#                                    services.sh compiles its readiness probe with javac
#   maven                            fetches Kafka's jars from Maven Central, once
#   ca-certificates                  HTTPS for Maven and for Go's module downloads
#   gcc, libc6-dev                   cgo, which `go test -race` (make test) needs
# Needs root or sudo; does nothing when all are there (run it again: it only
# installs what is still missing). scripts/fresh-machine.sh proves it on a
# bare Debian 12 root filesystem.
set -euo pipefail

# The java services.sh runs: JAVA_HOME's, else the one on PATH.
JAVA=${JAVA_HOME:+$JAVA_HOME/bin/}java
JAVAC=${JAVA_HOME:+$JAVA_HOME/bin/}javac

# java_major: the feature release of $JAVA ("17" of 17.0.15, "1" of 1.8.0),
# 0 when there is none.
java_major() {
  local v=
  command -v "$JAVA" >/dev/null && v=$("$JAVA" -version 2>&1 | sed -n 's/.* version "\([0-9]*\).*/\1/p' | head -n1)
  echo "${v:-0}"
}

need=()
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || need+=(postgresql)
command -v redis-server >/dev/null && command -v redis-cli >/dev/null || need+=(redis-server)
if ! command -v "$JAVAC" >/dev/null || (($(java_major) < 17)); then
  need+=(openjdk-17-jdk-headless)
fi
command -v mvn >/dev/null || need+=(maven)
[[ -s /etc/ssl/certs/ca-certificates.crt ]] || need+=(ca-certificates)
command -v gcc >/dev/null || need+=(gcc libc6-dev)
((${#need[@]} == 0)) && exit 0

# shellcheck source=lib/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/apt.sh"
echo "installing: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt_install "${need[@]}"
if (($(java_major) < 17)); then
  echo "deps: $JAVA is still Java $(java_major) after installing openjdk-17-jdk-headless: set JAVA_HOME to /usr/lib/jvm/java-17-openjdk-* (or update-alternatives --config java)" >&2
  exit 1
fi
