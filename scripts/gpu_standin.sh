#!/usr/bin/env bash
# The GPU check's rehearsal on a CPU machine, in a stand-in of the GPU image: the image's Python, torch,
# Triton and transformers releases (bench/RESULTS.md, "GPU validation": the H200's), none of the project's
# other needs, then exactly what a GPU machine runs, offline from a wheel folder, in smoke mode:
#
#   bash scripts/gpu_standin.sh                 # Python 3.12, torch 2.11.0, triton 3.6.0, transformers 5.17.0
#   bash scripts/gpu_standin.sh --sections correctness train   # arguments go to scripts/gpu_check.sh
#   bash scripts/gpu_standin.sh --build         # only build the venv (scripts/setup.sh does), alone
#   IMAGE_PYTHON=/path/to/python3.12 bash scripts/gpu_standin.sh
#
# The Python: IMAGE_PYTHON, else the first python3.12 that runs (PATH, then pyenv's), else python3, said
# in its first line (the image's is 3.12: the libraries are what the stand-in is for). Needs the package
# index: the first build downloads ~3.5 GB, and every run builds the wheel folder (~23 MB).
# tests/test_gpu_standin.py runs it in the suite, and its torch and triton are pyproject.toml's floors.
# What it catches before a GPU is lent: an API the image's releases lack, a dependency the wheel folder
# (scripts/gpu_wheels.sh) misses, an install step that needs the network. What it cannot: anything CUDA
# runs (the stand-in's torch sees no GPU; its Triton kernels run in the interpreter), and the vllm and
# weight-sync sections, which a smoke run takes to this machine's CPU vLLM venv (scripts/setup.sh).
# Measured (2026-12-06, 2 cores): 4.4 minutes with the venv's packages in pip's cache (its first build
# downloads ~3.5 GB); every section ok. Its first run found the train section failing where
# matplotlib is missing (fixed: a run ends without its curves, saying why).
# Steps: (1) the venv $CLAWFAST_HOME/venv-gpu-standin, built once per release set: torch's PyPI build
# (a CUDA build: ~5 GB with its CUDA libraries; a CPU build of that release is not on PyPI), triton,
# transformers, and the image's tools (pytest, pytest-xdist, pybind11, scikit-build-core, cmake); numpy
# below 2.4, because Triton 3.6's interpreter fails on numpy 2.5 ("only 0-dimensional arrays can be
# converted to Python scalars"; the GPU never interprets); (2) scripts/gpu_wheels.sh for that Python;
# (3) CLAWFAST_WHEELS=... PYTHON=... scripts/gpu_check.sh --smoke, arguments passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="${TORCH:-2.11.0}"
TRITON="${TRITON:-3.6.0}"
TRANSFORMERS="${TRANSFORMERS:-5.17.0}"
CACHE="${CLAWFAST_HOME:-$HOME/.cache/clawfast}"
VENV="$CACHE/venv-gpu-standin"
T0=$(date +%s)
step() { echo "[gpu_standin.sh $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }

BUILD_ONLY=0
if [ "${1:-}" = --build ]; then
  [ $# -eq 1 ] || { echo "gpu_standin.sh: --build takes no other argument"; exit 2; }
  BUILD_ONLY=1
fi

# the interpreter itself (sys.executable): a pyenv shim is found but fails where 3.12 is not its selected version
PY=""
for candidate in ${IMAGE_PYTHON:-python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12}; do
  if PY="$("$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' 2>/dev/null)"; then
    break
  fi
  PY=""
done
if [ -z "$PY" ]; then
  PY="$("${IMAGE_PYTHON:-python3}" -c 'import sys; print(sys.executable)')"
  step "the GPU image's Python 3.12 is not found here: the stand-in takes $("$PY" -V 2>&1) ($PY)"
fi
PYVER="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
NUMPY="numpy<2.4"
# a venv is rebuilt when one of these changes
STAMP="$PY $("$PY" -V 2>&1) torch $TORCH triton $TRITON transformers $TRANSFORMERS $NUMPY"

if [ "$(cat "$VENV/.complete" 2>/dev/null)" != "$STAMP" ]; then
  step "building $VENV ($STAMP; minutes: torch's CUDA build is large)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH" "triton==$TRITON" \
    "transformers==$TRANSFORMERS" "$NUMPY" pytest pytest-xdist pybind11 scikit-build-core cmake
  echo "$STAMP" >"$VENV/.complete"
fi
[ "$BUILD_ONLY" = 1 ] && exit 0
step "stand-in: $("$VENV/bin/python" -c 'import sys, torch, triton, transformers, numpy; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, numpy {numpy.__version__}")')"

WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
step "wheel folder for python $PYVER (scripts/gpu_wheels.sh)"
bash scripts/gpu_wheels.sh "$PYVER" "$WHEELS" | tail -1
step "scripts/gpu_check.sh --smoke $*"
CLAWFAST_WHEELS="$WHEELS" PYTHON="$VENV/bin/python" bash scripts/gpu_check.sh --smoke "$@"
