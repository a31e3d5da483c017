#!/usr/bin/env bash
# Installs the Debian packages the test services need, when missing:
# postgresql and redis-server (Java 17 and Maven are expected on the machine
# for Kafka). Needs root or sudo; does nothing when all are there.
set -euo pipefail
need=()
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || need+=(postgresql)
command -v redis-server >/dev/null && command -v redis-cli >/dev/null || need+=(redis-server)
((${#need[@]} == 0)) && exit 0
SUDO=
[[ $(id -u) -eq 0 ]] || SUDO=sudo
echo "installing: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq </dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" </dev/null >/dev/null
