# shellcheck shell=bash
# Helpers to build a minimal Debian 12 (bookworm) root filesystem with
# debootstrap, sourced by scripts/test-image.sh (the test image) and
# scripts/fresh-machine.sh (a bare machine for the README's commands).
# Needs root. The caller defines log and die.

# debian_mirror: the mirror for debootstrap: DEBIAN_MIRROR, else the first
# deb.debian.org-style URI of the machine's apt sources (security aside),
# else http://deb.debian.org/debian.
debian_mirror() {
  if [[ -n ${DEBIAN_MIRROR:-} ]]; then
    echo "$DEBIAN_MIRROR"
    return
  fi
  local u
  # deb822 sources (URIs: ...) or one-line sources (deb URI suite ...); skip security.
  u=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {print $2}' | grep -v security | head -n1 || true)
  [[ -z $u ]] && u=$(grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
    awk '{print $2}' | grep -v security | head -n1 || true)
  echo "${u:-http://deb.debian.org/debian}"
}

# unmount_under DIR: unmount whatever is mounted under DIR, deepest first
# (debootstrap unmounts /proc on exit, but not when something still held
# it then). Fails if something stays mounted.
unmount_under() {
  local dir=$1 i m left
  for ((i = 0; i < 50; i++)); do
    left=
    while read -r m; do
      left=1
      umount "$m" 2>/dev/null || true
    done < <(awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r)
    [[ -z $left ]] && return 0
    sleep 0.2
  done
  awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
  ! awk -v d="$dir/" 'index($2, d) == 1 {found=1} END {exit !found}' /proc/mounts
}

# shellcheck source=apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

# debootstrap_rootfs DIR [PACKAGES]: debootstrap a minbase bookworm into DIR
# (which must not exist or be empty), with the comma-separated PACKAGES
# added; installs debootstrap on the host when missing. Leaves nothing
# mounted under DIR; its log is DIR.log while it runs, shown on failure.
debootstrap_rootfs() {
  local root=$1 include=${2:-} m
  if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    apt_install debootstrap || die "could not install debootstrap"
  fi
  m=$(debian_mirror)
  log "debootstrap bookworm (minbase${include:+ + $include}) from $m into $root (about 2 minutes)"
  debootstrap --variant=minbase ${include:+--include="$include"} bookworm "$root" "$m" \
    >"$root.log" 2>&1 || { tail -n 30 "$root.log" >&2; die "debootstrap failed (log: $root.log)"; }
  rm -f "$root.log"
  unmount_under "$root" || die "cannot unmount what debootstrap mounted under $root"
}
