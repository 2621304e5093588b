#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on a bare GPU machine, in one command of at most 8 minutes, installs
# included:
#
#   bash scripts/gpu_check.sh                            # install what is missing, then every section
#   CLAWFAST_WHEELS=DIR bash scripts/gpu_check.sh        # offline: installs only from the wheels in DIR
#   bash scripts/gpu_check.sh --smoke                    # the same plan on a CPU machine, tiny sizes
#
# Arguments go to bench/gpu_check.py (--sections, --out, ...; its report is rewritten after every case,
# so a run cut short still has everything that finished). The 8 minutes (GPU_CHECK_BUDGET_S=480) start
# with this script: what the installs leave goes to bench/gpu_check.py as --budget (unless given).
#
# The machine this is for: an image with python, torch built for its GPU, triton, transformers, pytest,
# pybind11, scikit-build-core and cmake, and no package index. The rest comes as a wheel folder built
# beforehand on a machine with an index, for that image's Python:
#
#   bash scripts/gpu_wheels.sh 3.12 /tmp/clawfast-wheels   # ~30 MB; copy it over, then
#   CLAWFAST_WHEELS=/tmp/clawfast-wheels bash scripts/gpu_check.sh
#
# Steps (each prints a time stamp and the seconds since the start; nothing installed that is there):
#   1. torch that sees the GPU: kept when it does; otherwise installed (TORCH_INDEX_URL picks the index of
#      a CUDA build matching the driver) unless CLAWFAST_WHEELS is set, which never touches the network;
#   2. vLLM, for the vllm and weight-sync sections, in its own venv ($CLAWFAST_HOME/venv-vllm-gpu, seeing
#      this interpreter's packages) because it pins its own torch: only from CLAWFAST_WHEELS when the folder
#      has a vllm wheel, or from the index when CLAWFAST_INSTALL_VLLM=1 (minutes: not by default). Without
#      it those two sections are reported as skipped, with the reason;
#   3. the project's runtime dependencies (pyproject.toml, torch and triton excepted) and the peers of the
#      log-prob timings (Liger-Kernel, Cut Cross-Entropy), those missing only; a failure is reported and
#      the check still runs (the correctness section needs torch and triton alone);
#   4. the project itself, editable, its C++ extension built against the torch already there (no build
#      isolation; CMAKE_BUILD_PARALLEL_LEVEL = all CPUs: ~5-15 s).
# PYTHON names the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
PY="${PYTHON:-python3}"
CACHE="${CLAWFAST_HOME:-$HOME/.cache/clawfast}"
WHEELS="${CLAWFAST_WHEELS:-}"
SMOKE=0
HAS_BUDGET=0
for arg in "$@"; do
  [ "$arg" = --smoke ] && SMOKE=1
  case "$arg" in --budget | --budget=*) HAS_BUDGET=1 ;; esac
done

PIP=("$PY" -m pip install -q --disable-pip-version-check)
if [ -n "$WHEELS" ]; then
  [ -d "$WHEELS" ] || { echo "gpu_check.sh: CLAWFAST_WHEELS=$WHEELS is not a folder"; exit 2; }
  PIP+=(--no-index --find-links "$WHEELS")
fi
step() { echo "[gpu_check.sh $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"  # the C++ extension, step 4
step "start (python: $PY; wheels: ${WHEELS:-none, the package index})"

# 1. torch that sees the GPU (a smoke run takes the CPU build it finds).
if [ "$SMOKE" = 1 ]; then
  "$PY" -c "import torch" 2>/dev/null || { echo "gpu_check.sh --smoke: $PY has no torch (scripts/setup.sh installs the CPU build)"; exit 2; }
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  driver_cuda="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)"
  [ -n "$driver_cuda" ] || { echo "gpu_check.sh: nvidia-smi finds no GPU driver: no GPU to check (use --smoke on a CPU)"; exit 2; }
  if [ -n "$WHEELS" ]; then
    echo "gpu_check.sh: $PY's torch does not see the GPU (driver: CUDA $driver_cuda) and CLAWFAST_WHEELS forbids the"
    echo "network: put torch for this driver in the image (gpu_wheels.sh never ships torch)"; exit 2
  fi
  step "installing torch with CUDA (the driver supports CUDA $driver_cuda)"
  "${PIP[@]}" --upgrade ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch
  "$PY" - "$driver_cuda" <<'EOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check.sh: torch {torch.__version__} (CUDA {torch.version.cuda}) does not see the GPU; the driver "
             f"supports CUDA {sys.argv[1]}: set TORCH_INDEX_URL to the index of a build for CUDA <= {sys.argv[1]}")
EOF
fi
step "torch: $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.cuda.is_available())')"

# 2. vLLM in its own venv (the CPU test venv of scripts/setup.sh stands in for it in a smoke run).
VLLM_PY=""
if [ "$SMOKE" = 1 ]; then
  [ -x "$CACHE/venv-vllm/bin/python" ] && VLLM_PY="$CACHE/venv-vllm/bin/python"
else
  VENV="$CACHE/venv-vllm-gpu"
  if [ ! -e "$VENV/.complete" ]; then
    if { [ -n "$WHEELS" ] && compgen -G "$WHEELS/vllm-*.whl" >/dev/null; } || { [ -z "$WHEELS" ] && [ "${CLAWFAST_INSTALL_VLLM:-0}" = 1 ]; }; then
      step "installing vLLM into $VENV"
      rm -rf "$VENV"
      "$PY" -m venv --system-site-packages "$VENV"
      VPIP=("$VENV/bin/python" "${PIP[@]:1}")
      if "${VPIP[@]}" vllm; then touch "$VENV/.complete"; else step "vLLM could not be installed: its sections will be skipped"; fi
    else
      step "no vLLM (no vllm wheel in CLAWFAST_WHEELS, or CLAWFAST_INSTALL_VLLM unset): its sections will be skipped"
    fi
  fi
  [ -e "$VENV/.complete" ] && VLLM_PY="$VENV/bin/python"
fi

# 3. What the project imports at run time, and the log-prob peers (GPU runs), where missing.
missing="$("$PY" - "$SMOKE" <<'EOF'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10
    import pip._vendor.tomli as tomllib
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
from importlib.metadata import PackageNotFoundError, version

wanted = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
if sys.argv[1] == "0":
    wanted += ["liger-kernel", "cut-cross-entropy"]
for line in wanted:
    req = Requirement(line)
    if req.name in ("torch", "triton") or (req.marker is not None and not req.marker.evaluate()):
        continue
    try:
        if req.specifier.contains(version(req.name), prereleases=True):
            continue
    except PackageNotFoundError:
        pass
    print(str(req).split(";")[0].strip())
EOF
)"
if [ -n "$missing" ]; then
  mapfile -t reqs <<<"$missing"
  peers=()
  deps=()
  for r in "${reqs[@]}"; do
    case "$r" in liger-kernel*|cut-cross-entropy*) peers+=("$r") ;; *) deps+=("$r") ;; esac
  done
  if [ "${#deps[@]}" -gt 0 ]; then
    step "installing ${deps[*]}"
    "${PIP[@]}" "${deps[@]}" || step "FAILED to install some of: ${deps[*]} (the sections that import them will say so)"
  fi
  if [ "${#peers[@]}" -gt 0 ]; then  # their torch / triton pins must not replace the image's
    step "installing the peers ${peers[*]} (without their dependencies)"
    "${PIP[@]}" --no-deps "${peers[@]}" || step "FAILED to install ${peers[*]}: their timing rows will say so"
  fi
fi

# 4. The project (its C++ extension built against this torch), unless this checkout is installed already.
if ! "$PY" -c "import clawfast.tree, pathlib, sys; sys.exit(0 if pathlib.Path(clawfast.__file__).resolve().parents[1] == pathlib.Path.cwd() else 1)" 2>/dev/null; then
  build=()
  "$PY" -c "import scikit_build_core" 2>/dev/null || build+=(scikit-build-core)
  "$PY" -c "import pybind11" 2>/dev/null || build+=(pybind11)
  command -v cmake >/dev/null || "$PY" -c "import cmake" 2>/dev/null || build+=(cmake)
  if [ "${#build[@]}" -gt 0 ]; then
    step "installing the build tools ${build[*]}"
    "${PIP[@]}" "${build[@]}"
  fi
  step "building and installing clawfast (editable; $CMAKE_BUILD_PARALLEL_LEVEL parallel compile jobs)"
  "${PIP[@]}" --no-deps --no-build-isolation -e . || step "FAILED to install clawfast: only the sections that need no C++ extension can pass"
fi

args=("$@")
if [ "$SMOKE" = 0 ] && [ "$HAS_BUDGET" = 0 ]; then
  left=$(( ${GPU_CHECK_BUDGET_S:-480} - ($(date +%s) - T0) - 10 ))  # 10 s for the report and the exit
  [ "$left" -lt 60 ] && left=60
  args+=(--budget "$left")
fi
step "running bench/gpu_check.py ${args[*]}"
exec "$PY" bench/gpu_check.py ${VLLM_PY:+--vllm-python "$VLLM_PY"} "${args[@]}"
