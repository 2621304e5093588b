"""The GPU validation script's smoke mode (scripts/gpu_check.sh --smoke -> bench/gpu_check.py):
every section's code path on the CPU, through the same install script a GPU machine runs (here
every install step finds what it needs already there)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _check(tmp_path: Path, *args: str, env_extra: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable, **(env_extra or {}))
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--smoke", *args, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_smoke_run_checks_kernels_and_trains_one_async_step(tmp_path):
    proc, report = _check(tmp_path, "--sections", "kernel-tests", "kernels", "train")
    sections = report["sections"]
    assert {name: s["status"] for name, s in sections.items()} == {"kernel-tests": "ok", "kernels": "ok", "train": "ok"}
    assert " passed" in sections["kernel-tests"]["rows"][0]["case"]
    ops = {row["op"] for row in sections["kernels"]["rows"]}
    assert {"tree_logprobs", "tree_attention", "tree_gae", "importance_weights", "policy_loss"} <= ops
    assert any(row.get("baseline") == "per-step loop (host)" for row in sections["kernels"]["rows"])
    steps = [row for row in sections["train"]["rows"] if row["case"].startswith("step ")]
    assert len(steps) == 3 and "staleness max 1" in steps[-1]["note"]
    assert (tmp_path / "gpu_check.log").is_file()
    assert "no section failed" in proc.stdout and "tree_gae" in proc.stdout  # the one table


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_section_over_its_limit_is_reported_and_the_run_fails(tmp_path, monkeypatch):
    gpu_check = _module()
    monkeypatch.setitem(gpu_check.SMOKE_LIMITS, "train", 1)
    code = gpu_check.main(["--smoke", "--sections", "train", "--out", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and report["sections"]["train"]["status"] == "timeout"
    assert "over its 1 s limit" in report["sections"]["train"]["note"]


def test_vllm_sections_are_skipped_with_the_reason_where_vllm_is_missing(tmp_path):
    gpu_check = _module()
    no_vllm = tmp_path / "no-such-python"  # an interpreter that cannot import vLLM, on any machine
    code = gpu_check.main(["--smoke", "--sections", "vllm", "weight-sync", "--vllm-python", str(no_vllm),
                           "--out", str(tmp_path / "r.json")])
    sections = json.loads((tmp_path / "r.json").read_text())["sections"]
    assert code == 0 and sections["vllm"]["status"] == "skipped" and sections["weight-sync"]["status"] == "skipped"
    assert "vLLM is not importable" in sections["vllm"]["note"]


def test_a_full_run_needs_a_gpu(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what a GPU-less machine reports
    code = _module().main(["--out", str(tmp_path / "r.json")])
    assert code == 2 and "no CUDA device" in capsys.readouterr().out


@pytest.mark.vllm
def test_smoke_run_serves_through_vllm_and_times_every_sync_path(tmp_path):
    """Run by the vLLM venv's interpreter (scripts/test.sh): vLLM behind the proxy, a push, and
    bench_weight_sync's paths."""
    # bench/gpu_check.py itself: the install script would bring this venv the main environment's
    # newer transformers, which this vLLM build refuses (scripts/setup.sh).
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", "--sections", "vllm", "weight-sync",
                           "--vllm-python", sys.executable, "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + (tmp_path / "gpu_check.log").read_text()[-4000:]
    sections = json.loads(out.read_text())["sections"]
    assert sections["vllm"]["status"] == "ok" and sections["weight-sync"]["status"] == "ok"
    cases = {row["case"] for row in sections["vllm"]["rows"]}
    assert "recorded log-probs vs HF, pushed weights" in cases
    paths = {row["case"] for row in sections["weight-sync"]["rows"]}
    assert {"torch in-process", "vllm bytes (baseline)", "vllm broadcast (gloo)"} <= paths
