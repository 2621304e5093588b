#!/usr/bin/env bash
# Installs everything clawfast needs on a fresh Debian machine with Python 3.11 and Node 20.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v bwrap >/dev/null || ! command -v socat >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq bubblewrap socat >/dev/null
fi

# torch first and pinned: 2.13.0 is the CPU build; an unpinned resolve would pull a CUDA build.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
