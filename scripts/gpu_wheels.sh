#!/usr/bin/env bash
# The wheel folder a GPU machine without a package index needs for scripts/gpu_check.sh:
#
#   bash scripts/gpu_wheels.sh PYVER [DIR]      # e.g. 3.12; DIR defaults to ./gpu-wheels-PYVER
#   CLAWFAST_WHEELS=DIR bash scripts/gpu_check.sh   # then, on the GPU machine
#
# Run it where pip reaches a package index (any OS and Python: it downloads, never installs). It fetches
# binary wheels for CPython PYVER on manylinux x86_64 of:
#   - the project's runtime dependencies (pyproject.toml [project] dependencies) and, recursively, theirs;
#   - the log-prob peers of bench/gpu_kernels.py: liger-kernel and cut-cross-entropy (pure Python);
#   - the build tools of the C++ extension (scikit-build-core, pybind11), small, in case the image lacks them;
# minus what the GPU image brings: torch, triton, nvidia-* / cuda-* (never shipped: the image's builds
# match its driver), and transformers with its own requirements (huggingface-hub, hf-xet, tokenizers,
# safetensors, numpy), pytest and cmake (IMAGE below; IMAGE="..." overrides it). The optional extras
# (train: tensorboard, matplotlib) are left out: the check does not use them.
# Prints every wheel and the folder's size, and fails when it is over MAX_MB (default 60).
#
# Measured (2026-12-04, PYVER 3.12): 37 wheels, 22.1 MB, in 53 s; the largest grpcio (7.2 MB), uvloop (4.4 MB),
# pydantic-core (2.2 MB). Installing the missing ones from it offline into a Python 3.12 stand-in of the image
# (transformers 5.17.0, pytest, pytest-xdist, pybind11, scikit-build-core, cmake; torch and triton as metadata) took 10 s.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 PYVER [DIR]   (e.g. $0 3.12 /tmp/clawfast-wheels)"; exit 2; }
PYVER="$1"
DIR="${2:-gpu-wheels-$PYVER}"
MAX_MB="${MAX_MB:-60}"
IMAGE="${IMAGE:-torch triton transformers huggingface-hub hf-xet tokenizers safetensors numpy pytest pytest-xdist cmake}"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p "$DIR"

"$PY" - "$PYVER" "$DIR" "$IMAGE" <<'EOF'
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    import tomllib
except ImportError:
    import pip._vendor.tomli as tomllib
try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name

pyver, out, image = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split()
skip = {canonicalize_name(n) for n in image}
# the interpreter of the GPU machine, for the requirements' markers
target = {"python_version": pyver, "python_full_version": f"{pyver}.0", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "os_name": "posix", "platform_release": "", "platform_version": "",
          "implementation_version": f"{pyver}.0"}
platforms = [f"manylinux_2_{m}_x86_64" for m in (39, 35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64",
             "linux_x86_64"]
tag = pyver.replace(".", "")


def skipped(name: str) -> bool:
    return name in skip or name.startswith(("nvidia-", "cuda-"))


def wanted(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(dict(target, extra=e)) for e in (extras or {""}))


roots = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
roots += ["liger-kernel", "cut-cross-entropy", "scikit-build-core", "pybind11"]
specs: dict[str, SpecifierSet] = {}
extras: dict[str, set[str]] = {}
got: dict[str, tuple[str, Path]] = {}  # name -> (version, wheel)
todo = [(Requirement(r), set()) for r in roots]
while todo:
    level, todo = todo, []
    fetch = set()
    for req, parent_extras in level:
        name = canonicalize_name(req.name)
        if skipped(name) or not wanted(req, parent_extras):
            continue
        merged = specs.get(name, SpecifierSet()) & req.specifier
        new_extras = set(req.extras) - extras.get(name, set())
        specs[name], extras[name] = merged, extras.get(name, set()) | set(req.extras)
        if name not in got or not merged.contains(got[name][0], prereleases=True) or new_extras:
            fetch.add(name)
    for name in sorted(fetch):
        if name in got and not specs[name].contains(got[name][0], prereleases=True):
            got.pop(name)[1].unlink()
        before = set(out.glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", pyver, "--implementation", "cp", "-d", str(out)]
        for p in platforms:
            cmd += ["--platform", p]
        subprocess.run(cmd + [f"{name}{specs[name]}"], check=True)
        new = set(out.glob("*.whl")) - before
        key = re.sub(r"[-_.]+", "_", name)
        wheel = next((w for w in new | before if re.sub(r"[-_.]+", "_", w.name.split("-")[0].lower()) == key),
                     None)
        if wheel is None:
            sys.exit(f"gpu_wheels.sh: pip downloaded no wheel for {name}{specs[name]}")
        with zipfile.ZipFile(wheel) as z:
            meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(z.read(meta_name).decode())
        got[name] = (meta["Version"], wheel)
        for line in meta.get_all("Requires-Dist") or []:
            todo.append((Requirement(line), extras[name]))
print(f"{len(got)} packages (skipped as the image's: {' '.join(sorted(skip))}, nvidia-*, cuda-*)")
EOF

echo "wheels in $DIR:"
( cd "$DIR" && ls -1 ./*.whl | sed 's|^\./||' | while read -r w; do printf '  %8s KB  %s\n' "$(( $(stat -c %s "$w") / 1024 ))" "$w"; done )
bytes=$(du -sb "$DIR" | cut -f1)
mb=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1e6 }')
echo "$DIR: $(ls -1 "$DIR"/*.whl | wc -l) wheels, $mb MB (limit $MAX_MB MB)"
awk -v b="$bytes" -v m="$MAX_MB" 'BEGIN { exit !(b <= m * 1e6) }' || { echo "gpu_wheels.sh: $DIR is over $MAX_MB MB"; exit 1; }
