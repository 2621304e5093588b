"""The GPU check rehearsed in a stand-in of the GPU image (scripts/gpu_standin.sh): that image's Python,
torch, Triton and transformers releases and nothing else of the project's, then what a GPU machine
runs, offline from the wheel folder (scripts/gpu_wheels.sh, scripts/gpu_check.sh), in smoke mode.
Every section but the two that run in this machine's vLLM venv (tests/test_gpu_check.py runs those)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("CLAWFAST_HOME") or Path.home() / ".cache" / "clawfast") / "venv-gpu-standin"
SECTIONS = ["correctness", "train", "kernels", "step", "tiles"]


def test_the_gpu_check_passes_in_a_stand_in_of_the_gpu_image(tmp_path):
    out = tmp_path / "standin.json"
    proc = subprocess.run(["bash", "scripts/gpu_standin.sh", "--sections", *SECTIONS, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    log = out.with_suffix(".log")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:] + (log.read_text()[-4000:] if log.is_file() else "")
    report = json.loads(out.read_text())
    env = report["env"]
    # the image's libraries; its Python 3.12 where one runs here (else the script said which it took)
    venv_python = subprocess.run([str(VENV / "bin" / "python"), "-c", "import platform; print(platform.python_version())"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    assert (env["python"], env["torch"].split("+")[0], env["triton"], env["transformers"]) == \
        (venv_python, "2.11.0", "3.6.0", "5.17.0"), env
    assert {name: s["status"] for name, s in report["sections"].items()} == dict.fromkeys(SECTIONS, "ok")
    # the stand-in's interpreter, installing from the wheel folder only (no index)
    assert re.search(r"start \(python: \S+/venv-gpu-standin/bin/python; wheels: /", proc.stdout), proc.stdout[:2000]


def test_the_torch_and_triton_floors_are_the_stand_ins():
    """pyproject.toml's torch and triton floors are the releases the stand-in runs: the lowest tested."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    script = (ROOT / "scripts/gpu_standin.sh").read_text()
    for name in ("torch", "triton"):
        (floor,) = [re.split(r"[;\s]", d.split(">=")[1])[0] for d in deps if d.startswith(f"{name}>=")]
        (standin,) = re.findall(rf'^{name.upper()}="\$\{{{name.upper()}:-([0-9.]+)\}}"', script, re.M)
        assert floor == standin, (name, floor, standin)
    # and the Triton the compile test runs beside the latest (scripts/setup.sh's venv-triton) is the image's
    (compiler,) = re.findall(r"^TRITON_IMAGE=([0-9.]+)$", (ROOT / "scripts/setup.sh").read_text(), re.M)
    assert compiler == re.findall(r'^TRITON="\$\{TRITON:-([0-9.]+)\}"', script, re.M)[0], compiler
