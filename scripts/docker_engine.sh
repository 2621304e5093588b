#!/usr/bin/env bash
# A Docker engine and a sandbox image for the docker backend's tests (tests/sandbox/test_docker.py),
# on a bare Debian machine, with no registry involved. Called by scripts/setup.sh; safe to rerun.
# - The engine runs with --bridge=none (and no iptables / ip forwarding): containers get no network
#   address at all, which is what the backend wants anyway (network_mode="none"), and it needs
#   neither a bridge device nor firewall rules on the host. An engine that already answers is reused.
# - The image is built locally: debootstrap a minbase bookworm (plus socat, bash, python3) from the
#   Debian mirror apt already uses, `docker import` it. Nothing is pulled from a registry. The root
#   file system's tarball is cached, so a fresh engine with a kept cache skips debootstrap.
# scripts/test.sh names the same image in CLAWFAST_TEST_DOCKER_IMAGE.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${CLAWFAST_HOME:-$HOME/.cache/clawfast}"
IMAGE=clawfast-sandbox:bookworm
SUITE=bookworm
INCLUDE=socat,bash,python3
# Names the root file system's contents: the cached tarball and the image's label carry it, so a
# change to SUITE or INCLUDE rebuilds both instead of reusing a stale one.
ROOTFS="$SUITE-minbase-${INCLUDE//,/-}"
TARBALL="$CACHE/docker/$ROOTFS.tar"
LOG="$CACHE/docker/dockerd.log"
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
mkdir -p "$CACHE/docker"

say() { echo "docker_engine: $*"; }
have() { command -v "$1" >/dev/null || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
engine_answers() { timeout 20 docker info >/dev/null 2>&1; }

# The first Debian mirror in apt's sources whose suite is a release (not -updates, -security, ...),
# in either the one-line format or deb822 (.sources); deb.debian.org when there is none.
debian_mirror() {
  local lists=() sources=() f mirror=""
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do [ -f "$f" ] && lists+=("$f"); done
  for f in /etc/apt/sources.list.d/*.sources; do [ -f "$f" ] && sources+=("$f"); done
  if [ "${#lists[@]}" -gt 0 ]; then
    mirror="$(awk '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                                 if ($(i + 1) !~ /[-\/]/) { print $i; exit } }' "${lists[@]}")"
  fi
  if [ -z "$mirror" ] && [ "${#sources[@]}" -gt 0 ]; then
    mirror="$(awk 'BEGIN { RS = ""; FS = "\n" }
      { types = uris = suites = ""; enabled = "yes"
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^[ \t]*#/ || $i !~ /:/) continue
          key = tolower(substr($i, 1, index($i, ":") - 1)); val = substr($i, index($i, ":") + 1)
          if (key == "types") types = val; else if (key == "uris") uris = val
          else if (key == "suites") suites = val; else if (key == "enabled") enabled = tolower(val)
        }
        if (enabled ~ /no/ || (" " types " ") !~ /[ \t]deb[ \t]/) next
        n = split(suites, s, /[ \t]+/)
        for (j = 1; j <= n; j++) if (s[j] != "" && s[j] !~ /[-\/]/) {
          m = split(uris, u, /[ \t]+/); for (k = 1; k <= m; k++) if (u[k] != "") { print u[k]; exit }
        } }' "${sources[@]}")"
  fi
  echo "${mirror:-http://deb.debian.org/debian}"
}

install_packages() {
  local pkgs=()
  have dockerd || pkgs+=(docker.io)
  have debootstrap || pkgs+=(debootstrap)
  if [ "${#pkgs[@]}" -eq 0 ]; then
    say "dockerd and debootstrap present"
    return
  fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
  say "installed ${pkgs[*]}"
}

start_engine() {
  if engine_answers; then
    say "reusing the engine that answers"
    return
  fi
  local group=() pid i
  # Not root: the engine's socket is handed to this user's group, so docker works without sudo.
  [ -z "$SUDO" ] || group=(--group "$(id -gn)")
  : >"$LOG"
  # setsid: the engine outlives this script and is not hit by a Ctrl-C aimed at it.
  $SUDO setsid dockerd --bridge=none --iptables=false --ip-forward=false "${group[@]}" \
    </dev/null >>"$LOG" 2>&1 &
  pid=$!
  for ((i = 0; i < 60; i++)); do
    if engine_answers; then
      say "started dockerd (--bridge=none), log in $LOG"
      return
    fi
    [ -d "/proc/$pid" ] || break
    sleep 1
  done
  if [ -d "/proc/$pid" ]; then say "dockerd did not answer within ${i}s; the end of $LOG:" >&2
  else say "dockerd exited; the end of $LOG:" >&2; fi
  tail -n 30 "$LOG" >&2
  exit 1
}

build_rootfs() {
  local mirror dir
  mirror="$(debian_mirror)"
  dir="$(mktemp -d "$CACHE/docker/rootfs.XXXXXX")"
  # --one-file-system: never descend into a /proc or /sys that a failed debootstrap left mounted.
  # shellcheck disable=SC2064  # expand now: dir is local
  trap "$SUDO rm -rf --one-file-system '$dir'" EXIT
  say "debootstrap $SUITE ($INCLUDE) from $mirror"
  if ! $SUDO debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$dir" "$mirror" \
      >"$CACHE/docker/debootstrap.log" 2>&1; then
    say "debootstrap failed; the end of $CACHE/docker/debootstrap.log:" >&2
    tail -n 30 "$CACHE/docker/debootstrap.log" >&2
    exit 1
  fi
  $SUDO rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  $SUDO tar -C "$dir" --numeric-owner -cf "$TARBALL.part" .
  $SUDO chown "$(id -u):$(id -g)" "$TARBALL.part"
  mv "$TARBALL.part" "$TARBALL"
  $SUDO rm -rf --one-file-system "$dir"
  trap - EXIT
}

import_image() {
  docker import --change "LABEL clawfast.rootfs=$ROOTFS" --change 'CMD ["bash"]' \
    "$TARBALL" "$IMAGE" >/dev/null
}

# Runs one phase and prints how long it took.
phase() {
  local name=$1 t0=$SECONDS
  shift
  "$@"
  say "$name: $((SECONDS - t0))s"
}

image_current() {
  [ "$(docker image inspect --format '{{index .Config.Labels "clawfast.rootfs"}}' "$IMAGE" 2>/dev/null)" \
    = "$ROOTFS" ]
}

phase packages install_packages
phase engine start_engine
if image_current; then
  say "image $IMAGE present"
else
  if [ -s "$TARBALL" ]; then
    say "root file system cached in $TARBALL"
  else
    phase debootstrap build_rootfs
  fi
  phase "import $IMAGE" import_image
fi
