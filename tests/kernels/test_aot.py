"""Every Triton kernel compiled for real GPUs (sm_80, sm_90) on this CPU machine: `clawfast.kernels.aot`.

The interpreter the other kernel tests run in never type-checks a kernel or allocates its registers
and shared memory; these tests compile. The whole grid (hundreds of variants, minutes of CPU) runs
in the background from the moment the suite is collected (``conftest.py`` here), at low priority,
and its test runs last; the small tests below show that the check fails where it must.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernel_testing import AOT_PYTHONS, aot_environment

ROOT = Path(__file__).resolve().parents[2]


def _triton_jit_functions_in_source() -> set[str]:
    """module.function of every function decorated with ``triton.jit`` in kernels/*.py, read from
    the source text: an account of the kernels that does not go through the discovery under test."""
    found = set()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    if ast.unparse(target) == "triton.jit":
                        found.add(f"{path.stem}.{node.name}")
    return found


@pytest.mark.aot_background
@pytest.mark.parametrize("triton_build", sorted(AOT_PYTHONS))
def test_every_kernel_variant_compiles_for_sm80_and_sm90(aot_reports, triton_build):
    """The grid's run (started at collection), by the latest Triton and by the GPU image's: every
    @triton.jit function covered, every launched kernel compiled for both targets, and no variant
    failing to compile, over shared memory or spilling registers."""
    assert aot_reports[triton_build] is not None, (
        f"{AOT_PYTHONS[triton_build]} is missing: scripts/setup.sh builds it")
    returncode, report, output = aot_reports[triton_build]
    tail = output[-6000:]
    assert set(report["functions"]) == _triton_jit_functions_in_source(), tail
    assert report["uncovered"] == [], tail
    results = report["results"]
    problems = [r for r in results if r["error"] or r["spill_bytes"]
                or r["shared_bytes"] > {80: 166912, 90: 232448}[r["arch"]]]
    assert problems == [], "\n".join(f"{r['kernel']} sm_{r['arch']} {r['variant']}: {r}" for r in problems[:20])
    launched = {r["kernel"] for r in results}
    for kernel in launched:
        assert {r["arch"] for r in results if r["kernel"] == kernel} == {80, 90}, kernel
    # every option of tree attention reaches the kernels, in every dtype
    fwd = [r["variant"] for r in results if r["kernel"] == "tree_attention_triton._tree_attn_fwd_kernel"]
    for flag in ("WINDOW", "SOFTCAP", "DROPOUT", "SINKS"):
        assert any(flag in v.split() for v in fwd), flag
    for dtype in ("fp32", "bf16", "fp16"):  # float64 is the torch path's
        assert any(v.startswith(dtype) for v in fwd), dtype
    for block_d in (64, 128, 256):
        assert any(f"BLOCK_D={block_d}" in v for v in fwd), block_d
    # No warp repeats another's tensor-core work, but in the register-bound tree-attention tiles
    # (float32, and head dim 256), where every tile that repeats nothing spills. So the tiles models
    # train with (half precision, head dims up to 128) and every log-prob config repeat nothing.
    def register_bound(r):
        return r["kernel"].startswith("tree_attention_triton.") and (
            r["variant"].startswith("fp32") or "BLOCK_D=256" in r["variant"].split())

    repeating = [r for r in results if r["replicated"] and not register_bound(r)]
    assert repeating == [], [(r["kernel"], r["arch"], r["variant"], r["replicated"]) for r in repeating[:10]]
    assert any(r["replicated"] for r in results if register_bound(r))  # the check sees the ones it lets pass
    assert returncode == 0, tail


def _run_aot_snippet(tmp_path: Path, body: str) -> dict:
    """Run ``body`` (defines kernels in a module of its own) and compile what it records, in a
    fresh interpreter without TRITON_INTERPRET; returns its printed JSON."""
    module = tmp_path / "aot_probe.py"
    module.write_text(textwrap.dedent(body))
    proc = subprocess.run([sys.executable, str(module)], cwd=tmp_path, env=aot_environment(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PROBE_HEADER = """
    import json
    import torch
    import triton
    import triton.language as tl
    from clawfast.kernels import aot


    def compile_launch(fn, args, kwargs, arch=80):
        rec = aot.Recorder({"probe." + fn.fn.__name__: fn}, [arch])
        rec.launch(fn, args, kwargs)
        (variant,) = rec.variants.values()
        aot._WORK = [(variant, fn)]
        r = aot._compile(0)
        return {"problems": r.problems, "registers": r.registers, "spills": r.spill_bytes,
                "shared": r.shared_bytes, "replicated": r.replicated}
"""


def test_a_loop_that_rebinds_a_name_to_another_type_is_a_compile_error(tmp_path):
    """The bug the interpreter never saw (the dK/dV kernel's `_`): a name bound before a loop and
    re-bound to another type inside it."""
    out = _run_aot_snippet(tmp_path, PROBE_HEADER + """
    @triton.jit
    def rebinds(x_ptr, n, BLOCK: tl.constexpr):
        _ = tl.arange(0, BLOCK)
        for i in range(n):
            _ = tl.arange(0, BLOCK) < n
        tl.store(x_ptr + tl.arange(0, BLOCK), _.to(tl.float32))

    print(json.dumps(compile_launch(rebinds, (torch.zeros(64), 3), {"BLOCK": 64})))
    """)
    assert len(out["problems"]) == 1 and out["problems"][0].startswith("does not compile"), out
    assert "Loop-carried variable" in out["problems"][0], out


def test_a_tile_too_big_for_the_target_is_reported(tmp_path):
    """Shared memory over sm_80's 163 KiB and register spills are findings, with their sizes."""
    out = _run_aot_snippet(tmp_path, PROBE_HEADER + """
    @triton.jit
    def big_dot(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, K, BK):
            a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
            b = tl.load(b_ptr + (k + rk)[:, None] * BN + rn[None, :])
            acc += tl.dot(a, b)
        tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)

    a = torch.zeros(256, 1024, dtype=torch.float16)
    b = torch.zeros(1024, 256, dtype=torch.float16)
    c = torch.zeros(256, 256)
    print(json.dumps({
        "smem": compile_launch(big_dot, (a, b, c, 1024), dict(BM=256, BN=256, BK=128, num_warps=8, num_stages=4)),
        "spill": compile_launch(big_dot, (a, b, c, 1024), dict(BM=256, BN=256, BK=32, num_warps=1, num_stages=1)),
        "fine": compile_launch(big_dot, (a, b, c, 1024), dict(BM=64, BN=64, BK=32, num_warps=4, num_stages=2)),
    }))
    """)
    assert any("shared memory" in p for p in out["smem"]["problems"]), out["smem"]
    assert out["spill"]["spills"] > 0 and any("spills" in p for p in out["spill"]["problems"]), out["spill"]
    assert out["fine"]["problems"] == [] and out["fine"]["registers"] > 0, out["fine"]


def test_warps_that_repeat_a_chained_dot_are_reported(tmp_path):
    """Flash attention's shape: a q.k^T tile feeding p.v. Triton stacks the warps of a dot that feeds
    another along its rows, 16 each: 64 rows on 8 warps are computed twice, on 4 warps once, and 128
    rows on 8 warps once."""
    out = _run_aot_snippet(tmp_path, PROBE_HEADER + """
    @triton.jit
    def chained(q_ptr, k_ptr, v_ptr, o_ptr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        rm, rn, rd = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, D)
        q = tl.load(q_ptr + rm[:, None] * D + rd[None, :])
        k = tl.load(k_ptr + rn[:, None] * D + rd[None, :])
        v = tl.load(v_ptr + rn[:, None] * D + rd[None, :])
        p = tl.exp(tl.dot(q, tl.trans(k)))
        tl.store(o_ptr + rm[:, None] * D + rd[None, :], tl.dot(p.to(tl.float16), v))

    def launch(bm, warps):
        q = torch.zeros(bm, 128, dtype=torch.float16)
        kv = torch.zeros(64, 128, dtype=torch.float16)
        return compile_launch(chained, (q, kv, kv, q), dict(BM=bm, BN=64, D=128, num_warps=warps), arch=90)

    print(json.dumps({"64 on 8": launch(64, 8), "64 on 4": launch(64, 4), "128 on 8": launch(128, 8)}))
    """)
    (twice,) = out["64 on 8"]["replicated"]
    assert twice.startswith("a 64x64 dot on 8x1 warps") and twice.endswith("runs 2x"), out
    assert out["64 on 4"]["replicated"] == [] and out["128 on 8"]["replicated"] == [], out
    assert all(o["problems"] == [] for o in out.values()), out  # a figure, not a failure


def test_a_float_argument_beside_float64_data_is_reported(tmp_path):
    """Triton passes a Python float as float32: a float64 kernel would clip at 1 - 0.20000000298, not 0.8
    (the clip read from a float64 tensor is exact; float32 data with a float32 argument is fine)."""
    out = _run_aot_snippet(tmp_path, PROBE_HEADER + """
    @triton.jit
    def clip(x_ptr, lo):
        tl.store(x_ptr, tl.maximum(tl.load(x_ptr), 1.0 - lo))

    @triton.jit
    def clip_from_memory(x_ptr, lo_ptr):
        tl.store(x_ptr, tl.maximum(tl.load(x_ptr), 1.0 - tl.load(lo_ptr)))

    f64, f32 = torch.zeros(4, dtype=torch.float64), torch.zeros(4)
    print(json.dumps({"float64": compile_launch(clip, (f64, 0.2), {}), "float32": compile_launch(clip, (f32, 0.2), {}),
                      "memory": compile_launch(clip_from_memory, (f64, f64), {})}))
    """)
    (problem,) = out["float64"]["problems"]
    assert problem.startswith("float32 argument(s) lo beside float64 data"), out
    assert out["float32"]["problems"] == [] and out["memory"]["problems"] == [], out


def test_a_kernel_no_grid_case_reaches_is_reported(tmp_path):
    """Coverage: a @triton.jit function that is neither launched nor called from a launched kernel."""
    out = _run_aot_snippet(tmp_path, PROBE_HEADER + """
    @triton.jit
    def helper(x):
        return x + 1

    @triton.jit
    def launched(x_ptr):
        tl.store(x_ptr, helper(tl.load(x_ptr)))

    @triton.jit
    def forgotten(x_ptr):
        tl.store(x_ptr, 0.0)

    kernels = {"p.helper": helper, "p.launched": launched, "p.forgotten": forgotten}
    print(json.dumps(aot.coverage(kernels, {"p.launched"})))
    """)
    assert out == ["p.forgotten"]


def test_an_autotuned_kernel_contributes_every_config_its_pruning_keeps(tmp_path):
    """On a GPU the autotuner compiles every config it keeps, so the recorder records each as a variant
    (the package has no autotuned kernel today: this is what covers one the day it is written)."""
    out = _run_aot_snippet(tmp_path, PROBE_HEADER + """
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((16, 1), (32, 2), (64, 4))]
    prune = {"early_config_prune": lambda configs, nargs, **kw: [c for c in configs if c.kwargs["BLOCK"] <= 32]}

    @triton.autotune(configs, key=["n"], prune_configs_by=prune)
    @triton.jit
    def scale(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)

    rec = aot.Recorder({"probe.scale": scale.fn}, [90])
    with rec.active(90):
        scale[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](torch.zeros(100), 100)
    print(json.dumps(sorted(v.describe(scale.fn) for v in rec.variants.values())))
    """)
    assert out == ["fp32 BLOCK=16 w1s3", "fp32 BLOCK=32 w2s3"], out


def test_the_recorder_sees_the_gpu_launch_not_the_interpreters(tmp_path):
    """Without TRITON_INTERPRET the launchers pick GPU tiles (128-row attention blocks, the log-prob
    chunk kernels' GPU tiles), which is what the grid must compile; each target gets its own table's
    tiles."""
    out = _run_aot_snippet(tmp_path, """
    import json
    import torch
    from clawfast.kernels import aot
    from clawfast.kernels.tree_attention_triton import triton_tiles
    _, variants, _ = aot.record([80, 90], only="^(tree_attention bfloat16 d128 g2 plain|tree_logprobs bfloat16 V4096)$")
    described = [(v.kernel, v.arch, v.describe(aot.discover()[v.kernel])) for v in variants]
    print(json.dumps({
        "forward": {arch: [d, triton_tiles(torch.bfloat16, 128, arch).fwd.walk] for k, arch, d in described
                    if k.endswith("_tree_attn_fwd_kernel")},
        "variants": sorted({(k, d) for k, arch, d in described if arch == 90})}))
    """)
    for arch, (variant, walk) in out["forward"].items():  # each target's forward has its table's tile
        assert f"BLOCK_K={walk}" in variant.split(), (arch, variant)
    assert out["forward"]["80"][1] != out["forward"]["90"][1]  # the tables differ there
    out = out["variants"]
    kinds = {kernel for kernel, _ in out}
    assert kinds == {"tree_attention_triton._tree_attn_fwd_kernel", "tree_attention_triton._tree_attn_dq_kernel",
                     "tree_attention_triton._tree_attn_dkdv_kernel", "tree_logprobs._tree_logprobs_fwd_kernel",
                     "tree_logprobs._tree_logprobs_target_kernel", "tree_logprobs._tree_logprobs_bwd_kernel"}
    attention = [v for k, v in out if k == "tree_attention_triton._tree_attn_fwd_kernel"]
    assert attention and all("BLOCK=128" in v and "UPCAST" not in v.split() for v in attention), attention
    for kernel, tile in (("_tree_logprobs_fwd_kernel", "BLOCK_V=4096"), ("_tree_logprobs_bwd_kernel", "BLOCK_V=512")):
        chunk = [v for k, v in out if k == f"tree_logprobs.{kernel}"]
        assert chunk and all(tile in v.split() for v in chunk), chunk  # the GPU tiles, not the interpreter's



def test_the_instruction_count_finds_each_kernels_two_walk_loops():
    """bench/kernel_instructions.py reads the full-pair and partial-pair loops of every tree-attention
    kernel from its sm_90 machine code (it raises where a kernel has not exactly these two)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_instructions.py"), "--case",
                           "bfloat16 d64 g2 window"], cwd=ROOT, env=aot_environment(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:4] for line in proc.stdout.splitlines() if line.startswith("| _tree_attn")]
    kernels = ("_tree_attn_fwd_kernel", "_tree_attn_dq_kernel", "_tree_attn_dkdv_kernel")
    assert sorted((k.strip(), part.strip()) for k, _, part in rows) == sorted(
        (k, part) for k in kernels for part in ("full pairs", "partial pairs")), proc.stdout


def test_the_tile_sweep_compiles_its_candidates_for_the_gpu_first():
    """bench/gpu_tiles.py --compile-only: each kernel's launch at each candidate tile, compiled for
    sm_90 as the GPU run does before it times them; a tile that spills is reported as spilling."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_tiles.py"), "--compile-only", "90", "--tokens",
                           "200", "--tiles", "128,16,8,2", "64,64,4,2", "--jobs", "2"], cwd=ROOT,
                          env=aot_environment(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    notes = {line.split(" | ")[1]: line.split(" | ")[-1] for line in proc.stdout.splitlines()
             if line.startswith("tree_attention tiles | ")}
    assert sorted(notes) == sorted(f"{k} {t}" for k in ("fwd", "dq", "dkdv") for t in ("128x16 w8 s2", "64x64 w4 s2"))
    for note in notes.values():  # e.g. "224 registers, 0 B spilled, 83072 B shared; ok"
        spilled = int(re.search(r"(\d+) B spilled", note)[1])
        assert ("spills" in note) == (spilled > 0) and not ("; ok" in note and spilled), notes
    assert any("spills" in note for note in notes.values())  # 64x64 dK / dV on 4 warps: two 64x128 accumulators
