# shellcheck shell=bash
# apt_install PKG...: installs Debian packages, noninteractive, as root (through
# sudo when not root). A machine's image may carry a dpkg run that was cut off
# ("dpkg was interrupted, you must manually run 'dpkg --configure -a'"), and
# another apt may hold the lock: it finishes the one and waits for the other
# (up to 5 minutes) instead of failing, and retries once after repairing
# broken dependencies. Returns apt-get's status (errexit may be off in callers).
apt_install() {
  local sudo=() opts=(-o DPkg::Lock::Timeout=300 -y -qq --no-install-recommends)
  [[ $(id -u) -eq 0 ]] || sudo=(sudo)
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive dpkg --configure -a </dev/null >/dev/null || true
  "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=300 update -qq </dev/null || return
  if ! "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install "${opts[@]}" "$@" </dev/null >/dev/null; then
    echo "apt: install of $* failed; repairing (dpkg --configure -a, apt-get -f install) and trying once more" >&2
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive dpkg --configure -a </dev/null >/dev/null || true
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -f install "${opts[@]}" </dev/null >/dev/null || true
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install "${opts[@]}" "$@" </dev/null >/dev/null || return
  fi
}
