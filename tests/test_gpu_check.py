"""The GPU check's smoke mode (scripts/gpu_check.sh --smoke -> bench/gpu_check.py): the plan's
sections on the CPU, through the same install script a GPU machine runs (here every install step
finds what it needs already there); the plan shared by smoke and full runs; a report that survives a
kill; a failed correctness case failing the run."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _module():
    return _load("gpu_check")


def test_smoke_run_checks_trains_and_times_in_the_plans_order(tmp_path):
    """One run of the install script and the four sections that need no vLLM, as on a GPU machine."""
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--smoke", "--sections", "correctness", "train", "kernels",
                           "step", "tiles", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == ["correctness", "train", "kernels", "step", "tiles"] and report["complete"]
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(sections, "ok")
    # the install steps' time stamps (the first may fall a second boundary after the script's start)
    assert re.search(r"^\[gpu_check\.sh \d\d:\d\d:\d\d \+[01]s\] start ", proc.stdout, re.M)

    correctness = _load("gpu_correctness_plan")
    rows = sections["correctness"]["rows"]
    assert sorted((r["op"], r["case"]) for r in rows) == sorted((c.op, c.name) for c in correctness.CASES)
    # backend "varlen" is flash-attention's CUDA kernel: on a CPU its cases say so, neither ok nor failed
    import torch

    cpu = not torch.cuda.is_available()
    varlen = {c.name for c in correctness.CASES if c.params.get("backend") == "varlen"}
    not_run = [r for r in rows if "ok" not in r]
    assert {r["case"] for r in not_run} == (varlen if cpu else set())
    assert all(r["note"].startswith("not run on cpu") for r in not_run)
    assert all(r["ok"] and r["err"] <= r["tol"] for r in rows if r not in not_run)
    assert {r["op"] for r in rows} == {"tree_attention", "tree_logprobs", "linear_logprobs", "tree_gae",
                                       "importance_weights", "policy_loss", "grpo_advantages"}
    for row in rows:  # printed as one line each, as it finished
        assert f"[correctness] {row['op']} | {row['case']} |" in proc.stdout

    for variant in ("embedded model", "LoRA r8"):  # full weights, then an adapter
        steps = [row for row in sections["train"]["rows"] if row["case"].startswith(f"{variant}, step ")]
        assert len(steps) == 3 and "staleness max 1" in steps[-1]["note"], variant
        (run,) = [row for row in sections["train"]["rows"] if row["case"] == f"3 async steps, {variant}"]
        assert run["ok"], run
    ops = {row["op"] for row in sections["kernels"]["rows"]}
    assert {"tree_logprobs", "tree_attention", "tree_gae", "importance_weights", "policy_loss"} <= ops
    step = sections["step"]["rows"]
    assert step and all(row.get("ok") is not False for row in step)
    (varlen_way,) = [row for row in step if row["case"].startswith("tree (varlen)")]
    assert varlen_way["note"].startswith("not run on cpu") == cpu, varlen_way
    for way in ("tree", "per-leaf"):  # where each way's timed step spent its time, largest first
        (times,) = [row for row in step if row["case"] == f"{way}: device time by kernel"]
        seconds = [k["s"] for k in times["kernels"]]
        assert seconds == sorted(seconds, reverse=True) and 0 < times["busy_s"], times
    tiles = sections["tiles"]["rows"]  # every kernel on both layouts, its table's tile first
    for layout in ("agent forest", "causal chain"):
        for kernel in ("fwd", "dq", "dkdv"):
            timed = [r for r in tiles if r["shape"].startswith(layout) and r["case"].startswith(kernel + " ")]
            assert timed[0]["case"].endswith("(table)") and timed[0]["ratio"] == 1 and len(timed) >= 2, timed
            assert all(r["ms"] > 0 and "TFLOP/s" in r["note"] for r in timed)
    for kernel in ("fwd", "dq", "dkdv"):  # each kernel's fastest tile on the forest, against its table's
        (best,) = [r for r in tiles if r["case"] == f"{kernel}: fastest tile"]
        forest = [r["ms"] for r in tiles if r["case"].startswith(kernel + " ") and r["shape"].startswith("agent forest")
                  and "ms" in r]  # in a smoke run every candidate is timed on both layouts
        assert best["ms"] == min(forest) and f"of {len(forest)} tiles timed on both" in best["note"], best
    assert (tmp_path / "gpu_check.log").is_file()
    assert "no section failed" in proc.stdout and "tree_gae" in proc.stdout  # the one table


def test_smoke_and_full_runs_share_one_plan():
    """Same sections in the same order, same commands but for the size arguments, same correctness cases
    and tolerances; the limits keep the value order: correctness and train fit the budget whatever
    follows."""
    gpu_check = _module()
    names = [s.name for s in gpu_check.PLAN]
    assert names == ["correctness", "train", "kernels", "step", "tiles", "vllm", "weight-sync"]
    rows, out = Path("/r/rows.jsonl"), Path("/r/out.json")
    for sec in gpu_check.PLAN:
        full = gpu_check.section_command(sec, gpu_check.parse_args([]), rows, out, sec.limit(False))
        smoke = gpu_check.section_command(sec, gpu_check.parse_args(["--smoke"]), rows, out, sec.limit(False))
        assert full[: len(full) - len(sec.full_args)] == smoke[: len(smoke) - len(sec.smoke_args)], sec.name
        assert ("--out" in full) == sec.out and ("--rows" in full) != sec.out
        assert 0 < sec.limit_s <= sec.smoke_s
    limits = {s.name: s.limit_s for s in gpu_check.PLAN}
    assert limits["correctness"] + limits["train"] <= gpu_check.BUDGET_S - 60  # room for the parent's start
    assert gpu_check.BUDGET_S <= 480 - 60  # scripts/gpu_check.sh's 8 minutes, installs included

    correctness = _load("gpu_correctness_plan")
    full, smoke = correctness.plan(False), correctness.plan(True)
    strip = [{k: v for k, v in c.items() if k != "sizes"} for c in full]
    assert strip == [{k: v for k, v in c.items() if k != "sizes"} for c in smoke]
    assert all(f["sizes"].keys() == s["sizes"].keys() for f, s in zip(full, smoke))
    assert len({(c["op"], c["case"]) for c in full}) == len(full)  # a case is named once
    first = [(c["op"], c["params"].get("dtype")) for c in full[:2]]
    assert first == [("tree_attention", "bfloat16"), ("tree_logprobs", "bfloat16")]  # the default path first
    assert full[0]["sizes"]["head_dim"] == 128 and full[0]["sizes"]["hq"] > full[0]["sizes"]["hkv"]


def _run_killed(tmp_path: Path, sig: int) -> tuple[dict, list[str], int]:
    """gpu_check.py --smoke on the correctness section, sent ``sig`` once three cases have printed."""
    out = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "bench/gpu_check.py", "--smoke", "--sections", "correctness", "train",
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    printed = []
    try:
        for line in proc.stdout:
            if line.startswith("  [correctness] "):
                printed.append(line.strip())
                if len(printed) == 3:
                    break
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    report = json.loads(out.read_text())
    entry = report["sections"]["correctness"]
    if entry.get("pid"):  # a SIGKILLed check cannot end its section: the test does
        try:
            os.killpg(entry["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    return report, printed, code


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_run_killed_mid_section_keeps_the_rows_that_finished(tmp_path, sig):
    report, printed, code = _run_killed(tmp_path, sig)
    entry = report["sections"]["correctness"]
    cases = [f"[correctness] {r['op']} | {r['case']} |" for r in entry["rows"]]
    assert len(entry["rows"]) >= 3 and all(any(line.startswith(c) for c in cases) for line in printed)
    assert report["sections"]["train"]["status"] == "pending" and not report["complete"]
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL and entry["status"] == "running"
    else:  # the check ends its section's processes and says why
        assert code == 130 and entry["status"] == "interrupted" and "SIGTERM" in entry["note"]


def test_a_failed_correctness_case_fails_the_run(tmp_path, monkeypatch):
    gpu_check = _module()
    command = gpu_check.section_command

    def strict(sec, *args):  # two cases, every tolerance 0: their float32 rounding errors fail them
        return command(sec, *args) + (["--only", "tree_gae", "--tol-scale", "0"] if sec.name == "correctness" else [])

    monkeypatch.setattr(gpu_check, "section_command", strict)
    code = gpu_check.main(["--smoke", "--sections", "correctness", "--out", str(tmp_path / "r.json")])
    entry = json.loads((tmp_path / "r.json").read_text())["sections"]["correctness"]
    assert code == 1 and entry["status"] == "failed"
    assert len(entry["rows"]) == 2 and all(r["op"] == "tree_gae" and r["ok"] is False for r in entry["rows"])


def test_a_section_over_its_limit_is_reported_and_the_run_fails(tmp_path, monkeypatch):
    gpu_check = _module()
    plan = tuple(dataclasses.replace(s, smoke_s=1) if s.name == "train" else s for s in gpu_check.PLAN)
    monkeypatch.setattr(gpu_check, "PLAN", plan)
    code = gpu_check.main(["--smoke", "--sections", "train", "--out", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and report["sections"]["train"]["status"] == "timeout"
    assert "over its 1 s limit" in report["sections"]["train"]["note"]


def test_rows_are_read_as_complete_lines(tmp_path):
    reader = _module().RowReader(tmp_path / "rows.jsonl")
    assert reader.new_rows() == []
    with open(tmp_path / "rows.jsonl", "w") as f:
        f.write('{"op": "a", "case": "1"}\n{"op": "b", "ca')
    assert reader.new_rows() == [{"op": "a", "case": "1"}]
    with open(tmp_path / "rows.jsonl", "a") as f:
        f.write('se": "2"}\n')
    assert reader.new_rows() == [{"op": "b", "case": "2"}] and reader.new_rows() == []


# Kernel names as a CUDA trace gives them: libtorch_cuda.so's symbols (torch 2.11, the GPU image's),
# demangled; the Triton and cuBLAS ones are plain names.
KERNEL_NAMES = {
    "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<double, double, double, "
    "at::native::binary_internal::MulFunctor<double> >, std::array<char*, 3ul> >(int, at::native::BinaryFunctor<"
    "double, double, double, at::native::binary_internal::MulFunctor<double> >, std::array<char*, 3ul>)":
        "at::native::vectorized_elementwise_kernel[MulFunctor]",
    "void at::native::vectorized_elementwise_kernel<2, at::native::AbsFunctor<c10::complex<float> >, std::array<"
    "char*, 2ul> >(int, at::native::AbsFunctor<c10::complex<float> >, std::array<char*, 2ul>)":
        "at::native::vectorized_elementwise_kernel[AbsFunctor]",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<at::native::(anonymous namespace)::"
    "launch_clamp_scalar(at::TensorIteratorBase&, c10::Scalar, c10::Scalar, at::native::detail::ClampLimits)::"
    "{lambda()#1}::operator()() const::{lambda()#4}::operator()() const::{lambda(long)#1}>(at::TensorIteratorBase&, "
    "at::native::(anonymous namespace)::launch_clamp_scalar(at::TensorIteratorBase&, c10::Scalar, c10::Scalar, "
    "at::native::detail::ClampLimits)::{lambda()#1}::operator()() const::{lambda()#4}::operator()() const::"
    "{lambda(long)#1} const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl<...>)":
        "at::native::elementwise_kernel[launch_clamp_scalar]",
    "void at::native::unrolled_elementwise_kernel<at::native::round_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#1}::operator()() const::{lambda()#1}::operator()() const::{lambda(double)#1}, std::array<char*, 2ul>, "
    "4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
    "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, ...)":
        "at::native::unrolled_elementwise_kernel[round_kernel_cuda]",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<signed char, at::native::func_wrapper_t<signed "
    "char, at::native::MinNanFunctor<signed char> >, unsigned int, signed char, 4, 4> >(at::native::ReduceOp<"
    "signed char, at::native::func_wrapper_t<signed char, at::native::MinNanFunctor<signed char> >, unsigned int, "
    "signed char, 4, 4>)": "at::native::reduce_kernel[MinNanFunctor]",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, float const*, int)":
        "at::native::cunn_SoftMaxForward",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel":
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_e",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_kernel_impl<"
    "at::native::OpaqueType<2> >(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, "
    "char const*, long)#1}>(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>, at::native::"
    "index_kernel_impl<at::native::OpaqueType<2> >(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)"
    "::{lambda(char*, char const*, long)#1} const&, bool)::{lambda(int)#1}>(long, ...)":
        "at::native::index_elementwise_kernel[index_kernel_impl]",
    "void at::native::index_elementwise_kernel<128, 4, at::native::flip_kernel_impl<at::native::OpaqueType<16> >("
    "at::TensorIterator&)::{lambda(int)#1}>(long, at::native::flip_kernel_impl<at::native::OpaqueType<16> >("
    "at::TensorIterator&)::{lambda(int)#1})": "at::native::index_elementwise_kernel[flip_kernel_impl]",
    "_tree_attn_fwd_kernel": "_tree_attn_fwd_kernel",
}


def test_device_time_keeps_the_operation_an_aten_kernel_runs():
    """ATen runs every elementwise operator through a few template kernels: a trace's entry keeps the
    operation (the innermost function its lambda sits in, else the innermost functor that is not a value type)."""
    short = _load("device_time")._short
    assert {name: short(name) for name in KERNEL_NAMES} == KERNEL_NAMES


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


def test_the_scripts_parse():
    for script in ("scripts/gpu_check.sh", "scripts/gpu_wheels.sh"):
        subprocess.run(["bash", "-n", script], cwd=ROOT, check=True)
    usage = subprocess.run(["bash", "scripts/gpu_wheels.sh"], cwd=ROOT, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stdout


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
    assert "[vllm] vllm | engine start |" in proc.stdout  # streamed as it happened
    paths = {row["case"] for row in sections["weight-sync"]["rows"]}
    assert {"torch in-process", "vllm bytes (baseline)", "vllm broadcast (gloo)"} <= paths
