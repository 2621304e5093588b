#!/usr/bin/env bash
# The GPU validation run (bench/gpu_check.py) on a bare GPU machine, in one command:
#
#   bash scripts/gpu_check.sh                 # install what is missing, then every section (~8 min)
#   bash scripts/gpu_check.sh --smoke         # the same steps on a CPU machine, tiny sizes
#   CLAWFAST_WHEELS=DIR bash scripts/gpu_check.sh   # offline: every install comes from the wheels in DIR
#
# Arguments go to bench/gpu_check.py (--sections, --out, ...). What it installs, in this order so
# that a cache (a docker layer, a pip cache) keeps the large and stable parts:
#   1. torch with CUDA, unless the interpreter's torch already sees the GPU (TORCH_INDEX_URL picks
#      the index of a CUDA build matching the driver; the default index's Linux build otherwise);
#   2. vLLM for the GPU in its own venv ($CLAWFAST_HOME/venv-vllm-gpu, seeing this interpreter's
#      packages) because it pins its own torch; skipped, and reported as skipped by the check, where
#      CLAWFAST_SKIP_VLLM=1 or no index or wheel offers it;
#   3. Liger-Kernel (the peer in the log-prob rows) and the project's runtime and test needs;
#   4. the project itself, editable, built against the torch already there (no build isolation).
# PYTHON names the interpreter (default python3). Nothing is installed that is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
CACHE="${CLAWFAST_HOME:-$HOME/.cache/clawfast}"
SMOKE=0
for arg in "$@"; do [ "$arg" = --smoke ] && SMOKE=1; done

PIP=("$PY" -m pip install -q --disable-pip-version-check)
if [ -n "${CLAWFAST_WHEELS:-}" ]; then
  PIP+=(--no-index --find-links "$CLAWFAST_WHEELS")
fi
step() { echo "[gpu_check.sh $(date +%H:%M:%S)] $*"; }
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"  # the C++ extension, step 4

# 1. torch that sees the GPU (a smoke run takes the CPU build it finds).
if [ "$SMOKE" = 1 ]; then
  "$PY" -c "import torch" 2>/dev/null || { echo "gpu_check.sh --smoke: $PY has no torch (scripts/setup.sh installs the CPU build)"; exit 2; }
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  driver_cuda="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)"
  [ -n "$driver_cuda" ] || { echo "gpu_check.sh: nvidia-smi finds no GPU driver: no GPU to check (use --smoke on a CPU)"; exit 2; }
  step "installing torch with CUDA (the driver supports CUDA $driver_cuda)"
  "${PIP[@]}" --upgrade ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch
  "$PY" - "$driver_cuda" <<'EOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check.sh: torch {torch.__version__} (CUDA {torch.version.cuda}) does not see the GPU; the driver "
             f"supports CUDA {sys.argv[1]}: set TORCH_INDEX_URL to the index of a build for CUDA <= {sys.argv[1]}")
EOF
fi

# 2. vLLM in its own venv (the CPU test venv of scripts/setup.sh stands in for it in a smoke run).
VLLM_PY=""
if [ "${CLAWFAST_SKIP_VLLM:-0}" != 1 ]; then
  if [ "$SMOKE" = 1 ]; then
    [ -x "$CACHE/venv-vllm/bin/python" ] && VLLM_PY="$CACHE/venv-vllm/bin/python"
  else
    VENV="$CACHE/venv-vllm-gpu"
    if [ ! -e "$VENV/.complete" ]; then
      step "installing vLLM into $VENV"
      rm -rf "$VENV"
      "$PY" -m venv --system-site-packages "$VENV"
      VPIP=("$VENV/bin/python" "${PIP[@]:1}")
      if "${VPIP[@]}" vllm; then touch "$VENV/.complete"; else step "vLLM could not be installed: its sections will be skipped"; fi
    fi
    [ -e "$VENV/.complete" ] && VLLM_PY="$VENV/bin/python"
  fi
fi

# 3. Liger-Kernel and what the project, its training loop and its kernel tests import (torch and triton excluded:
#    step 1's build stays).
needs="$("$PY" - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = ("torch", "triton")
wanted = [d for d in project["dependencies"] + project["optional-dependencies"]["train"]
          if not d.split(";")[0].strip().startswith(skip)]
wanted += ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "psutil"]
print("\n".join(wanted))
EOF
)"
"$PY" -c "import packaging" 2>/dev/null || "${PIP[@]}" packaging
missing="$(printf '%s\n' "$needs" | "$PY" -c '
import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
for line in sys.stdin.read().split("\n"):
    if not line:
        continue
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        if req.specifier.contains(version(req.name), prereleases=True):
            continue
    except PackageNotFoundError:
        pass
    print(line)
')"
if [ "$SMOKE" = 0 ] && ! "$PY" -c "import liger_kernel" 2>/dev/null; then
  step "installing Liger-Kernel"
  "${PIP[@]}" --no-deps liger-kernel || step "Liger-Kernel could not be installed: its rows will say so"
fi
if [ -n "$missing" ]; then
  step "installing $(echo "$missing" | tr '\n' ' ')"
  mapfile -t reqs <<<"$missing"
  "${PIP[@]}" "${reqs[@]}"
fi

# 4. The project (its C++ extension built against this torch).
if ! "$PY" -c "import clawfast.tree, pathlib, sys; sys.exit(0 if pathlib.Path(clawfast.__file__).resolve().parents[1] == pathlib.Path.cwd() else 1)" 2>/dev/null; then
  step "installing clawfast (editable)"
  build=(scikit-build-core pybind11)
  command -v cmake >/dev/null || build+=(cmake)
  command -v ninja >/dev/null || build+=(ninja)
  "${PIP[@]}" "${build[@]}"
  "${PIP[@]}" --no-deps --no-build-isolation -e .
fi

step "running bench/gpu_check.py $*"
exec "$PY" bench/gpu_check.py ${VLLM_PY:+--vllm-python "$VLLM_PY"} "$@"
