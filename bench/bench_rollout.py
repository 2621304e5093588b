"""Rollout scheduler throughput: rollouts per minute through the real path (proxy rollout registry,
a fresh bubblewrap sandbox per rollout, the harness, the verifier in another sandbox, close), against
the named baseline of running the same rollouts one after another (concurrency 1).

The harness is a trivial one (`/bin/sh -c` writing the answer file after a fixed `--work` seconds of
"thinking"), so what is measured is the scheduler and sandbox overhead and how well waiting overlaps:
with real harnesses the time per rollout is dominated by the model and the harness itself.
Results: a table on stdout and bench/results/bench_rollout.json. ``--quick`` runs a tiny smoke size.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from clawfast.harness.base import Harness, HarnessInstall, PreparedRun, RunLayout, ScriptedTurn
from clawfast.proxy.rollouts import RolloutRegistry
from clawfast.rollout.scheduler import RolloutScheduler
from clawfast.rollout.spec import make_specs
from clawfast.rollout.worker import RolloutConfig, RolloutWorker
from clawfast.sandbox.bwrap import BwrapBackend
from clawfast.tasks.sandbox_runner import SandboxRunner
from clawfast.tasks.task import CommandVerifier, Task

RESULTS = Path(__file__).resolve().parent / "results"


class ShellHarness(Harness):
    """Benchmark stand-in for a harness: its CLI is `/bin/sh -c INSTRUCTION` (no model calls)."""

    name, version, protocol = "shell", "0", "openai-chat"

    def __init__(self, root: Path) -> None:
        super().__init__(install=HarnessInstall("shell", "0", root, Path("/bin/sh")))

    def install(self) -> HarnessInstall:
        return self.installation

    def prepare(self, layout: RunLayout, base_url: str, key: str, model: str) -> PreparedRun:
        return PreparedRun(env=self._base_env(layout))

    def command(self, task_instruction: str, layout: RunLayout) -> list[str]:
        return ["/bin/sh", "-c", task_instruction]

    def scripted_turns(self, oracle_commands: list[str], final_text: str) -> list[ScriptedTurn]:
        return [ScriptedTurn(text=final_text)]


def run_once(n: int, concurrency: int, work_s: float, tmp: Path) -> tuple[float, int]:
    """Seconds for `n` rollouts at `concurrency`, and how many ended ok with reward 1."""
    tasks = [
        Task(id=f"b{i}", instruction=f"sleep {work_s}; echo hi > out.txt",
             verifier=CommandVerifier("test \"$(cat out.txt)\" = hi && echo '{\"score\": 1}'", timeout=30),
             oracle=["echo hi > out.txt"], tags={"category": "bench", "split": "train"}, timeout=60)
        for i in range(n)
    ]  # fmt: skip
    registry = RolloutRegistry(tmp / f"records-{concurrency}-{time.monotonic_ns()}", base_url="http://127.0.0.1:47399")
    backend = BwrapBackend()
    try:
        with SandboxRunner(backend) as verifier_runner:
            worker = RolloutWorker(registry, backend, {"shell": ShellHarness(tmp)},
                                   config=RolloutConfig(), verifier_runner=verifier_runner)
            start = time.perf_counter()
            with RolloutScheduler(worker, concurrency=concurrency) as scheduler:
                results = scheduler.run(make_specs(tasks, ["shell"]))
            elapsed = time.perf_counter() - start
    finally:
        backend.close()
    return elapsed, sum(r.status == "ok" and r.reward == 1.0 for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--work", type=float, default=0.5, help="seconds each harness run takes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rollouts, args.repeats, args.work = 8, 1, 0.1
    rows = []
    with tempfile.TemporaryDirectory(prefix="cfb-", dir="/tmp") as tmp:
        for label, conc in (("sequential (baseline)", 1), (f"scheduler, concurrency {args.concurrency}", args.concurrency)):
            times, oks = [], []
            for _ in range(args.repeats):
                elapsed, ok = run_once(args.rollouts, conc, args.work, Path(tmp))
                times.append(elapsed)
                oks.append(ok)
            median = statistics.median(times)
            rows.append({"path": label, "concurrency": conc, "rollouts": args.rollouts, "median_s": median,
                         "rollouts_per_min": 60.0 * args.rollouts / median, "ok": min(oks)})
    base = rows[0]["median_s"]
    for row in rows:
        row["speedup_vs_sequential"] = base / row["median_s"]
    print(f"{args.rollouts} rollouts, harness work {args.work}s each, {platform.node()} ({platform.machine()})")
    print(f"{'path':<28} {'median s':>9} {'rollouts/min':>13} {'ok':>4} {'ratio':>6}")
    for row in rows:
        print(f"{row['path']:<28} {row['median_s']:>9.2f} {row['rollouts_per_min']:>13.1f} "
              f"{row['ok']:>4} {row['speedup_vs_sequential']:>5.2f}x")
    RESULTS.mkdir(exist_ok=True)
    out = {"bench": "bench_rollout", "work_s": args.work, "repeats": args.repeats, "rows": rows}
    (RESULTS / "bench_rollout.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
