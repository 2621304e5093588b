"""Verifier cost per clawbench-mini task: where the checker runs and how its interpreter starts.

Rows (each over the same oracle-solved workspaces, one verifier run per task per repeat):
- `subprocess, python3 -S` — the fast path: `SubprocessRunner`, the checker started without `site`;
- `subprocess, python3`   — the named baseline: the same with a normal interpreter start-up (`site` and
  every `.pth` hook of the environment);
- `bwrap sandbox, python3 -S` — what training pays: a fresh bubblewrap sandbox per verifier run.

Prints one table (median seconds per verify, verifies per second, ratio to the baseline) and writes
bench/results/bench_tasks.json. Load on a shared machine moves the absolute numbers; the ratio between
rows run in the same process is what to read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from clawfast.tasks import clawbench_mini, run_commands, run_verifier
from clawfast.tasks.verify import SubprocessRunner

REPEATS = 2


def setup(tmp: Path):
    """Each task of the suite with an oracle-solved workspace."""
    out = []
    for task in clawbench_mini():
        ws = task.materialize(tmp / task.id)
        assert run_commands(task.oracle, ws).ok, task.id
        out.append((task, ws))
    return out


def without_s(task):
    verifier = dataclasses.replace(task.verifier, command=task.verifier.command.replace("python3 -S", "python3"))
    return dataclasses.replace(task, verifier=verifier)


def measure(solved, runner, transform=lambda t: t):
    times = []
    for _ in range(REPEATS):
        for task, ws in solved:
            t0 = time.perf_counter()
            res = run_verifier(transform(task), ws, runner)
            times.append(time.perf_counter() - t0)
            assert res.score == 1.0, (task.id, res)
    return statistics.median(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        solved = setup(Path(tmp))
        rows = {"subprocess, python3 (baseline)": measure(solved, SubprocessRunner(), without_s),
                "subprocess, python3 -S": measure(solved, SubprocessRunner())}
        try:
            from clawfast.tasks.sandbox_runner import SandboxRunner

            with SandboxRunner() as runner:
                rows["bwrap sandbox, python3 -S"] = measure(solved, runner)
        except Exception as exc:  # no bubblewrap here: say so in the table, keep the other rows
            print(f"bwrap sandbox row skipped: {exc}")
    base = rows["subprocess, python3 (baseline)"]
    print(f"{len(solved)} tasks x {REPEATS} repeats, load average {os.getloadavg()[0]:.1f}")
    print(f"{'runner':34} {'median s/verify':>16} {'verifies/s':>11} {'vs baseline':>12}")
    results = []
    for name, median in rows.items():
        print(f"{name:34} {median:16.4f} {1 / median:11.1f} {base / median:11.2f}x")
        results.append({"runner": name, "median_s": median, "per_s": 1 / median, "speedup_vs_baseline": base / median})
    out = Path(__file__).parent / "results" / "bench_tasks.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"tasks": len(solved), "repeats": REPEATS, "load_average": os.getloadavg()[0],
                               "rows": results}, indent=1))


if __name__ == "__main__":
    main()
