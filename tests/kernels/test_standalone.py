"""clawfast.kernels stands alone, and the benchmark scripts' smoke modes run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args, env_extra=None, timeout=600):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_import_pulls_in_nothing_else_of_clawfast():
    code = (
        "import sys, json; import clawfast.kernels as K; "
        "K.tree_logprobs, K.tree_gae, K.importance_weights, K.policy_loss; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    proc = _run(["-c", code])
    assert proc.returncode == 0, proc.stderr
    mods = json.loads(proc.stdout)
    ours = [m for m in mods if m.startswith("clawfast") and m != "clawfast"
            and not m.startswith("clawfast.kernels")]
    assert ours == [], f"importing clawfast.kernels pulled in {ours}"
    heavy = [m for m in mods if m.split(".")[0] in
             {"transformers", "starlette", "uvicorn", "grpc", "httpx", "pydantic", "ray", "docker"}]
    assert heavy == [], f"importing clawfast.kernels pulled in {heavy}"


def test_public_names():
    import clawfast.kernels as K

    for name in ("tree_logprobs", "linear_logprobs", "tree_gae", "importance_weights", "policy_loss"):
        assert callable(getattr(K, name)) and callable(getattr(K, name + "_ref"))


@pytest.mark.triton
def test_gpu_bench_smoke_mode():
    env = {} if _has_cuda() else {"TRITON_INTERPRET": "1"}
    proc = _run(["bench/gpu_kernels.py", "--smoke"], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for op in ("tree_logprobs", "tree_gae", "importance_weights", "policy_loss"):
        assert op in proc.stdout
    assert "all checks passed" in proc.stdout


def test_cpu_bench_quick_mode(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["bench/bench_kernels.py", "--quick", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["logprobs"] and data["gae"]
    assert all(r["max_abs_diff"] < 1e-4 for r in data["logprobs"] + data["gae"])


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_docs_flat_ppo_example_runs():
    """The drop-in example of docs/KERNELS.md is real code: run it as written."""
    text = (ROOT / "docs" / "KERNELS.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    proc = _run(["-c", block])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "clip_frac" in proc.stdout
