"""The training benchmarks' scripts run (small inputs; the figures themselves are in bench/RESULTS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loop_fixtures import make_recorded, make_tiny_model, recorded_config_text

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_budget_sweep_runs_on_recorded_rollouts(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    records = make_recorded(tmp_path / "records")
    config = tmp_path / "run.toml"
    config.write_text(recorded_config_text(model, records, tmp_path / "run"))
    out = tmp_path / "budget.json"
    proc = _run(["bench/bench_budget.py", str(config), str(records), "--budgets", "256", "1024", "--group", "6",
                 "--repeats", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["budgets"]) == {"256", "1024"}
    small, large = result["budgets"]["256"], result["budgets"]["1024"]
    assert small["micro_batches"] >= large["micro_batches"] >= 1 and small["median_s"] > 0



def test_async_benchmark_runs_both_schedules(tmp_path):
    out = tmp_path / "async.json"
    proc = _run(["bench/bench_async.py", "--steps", "2", "--staleness", "1", "--on-update", "abort", "continue",
                 "--max-tokens", "16", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"sync", "async-1/abort", "async-1/continue"}
    assert all(row["steps"] == 2 and row["rollouts_per_min"] > 0 and 0 <= row["trainer_idle"] <= 1
               for row in rows.values())
    assert rows["async-1/continue"]["discarded_tokens_per_push"] == 0


def test_threads_benchmark_runs_both_modes_and_reads_every_thread(tmp_path):
    out = tmp_path / "threads.json"
    proc = _run(["bench/bench_train_threads.py", "--steps", "2", "--seeds", "0", "--workloads", "split", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"main", "all"}
    for row in rows.values():
        n = row["rollouts"]  # each rollout: 3 main calls, a subagent, a compaction, 12 tokens each
        assert row["steps"] == 2 and row["calls"] == {"main": 3 * n, "subagent": n, "compaction": n}
    assert rows["main"]["targets"] == {"main": 36 * n, "subagent": 0, "compaction": 0}
    assert rows["all"]["targets"] == {"main": 36 * n, "subagent": 12 * n, "compaction": 12 * n}


def test_delta_push_benchmark_runs_real_grpo_steps_and_checks_bits(tmp_path):
    out = tmp_path / "delta.json"
    proc = _run(["bench/bench_weight_sync.py", "--delta", "--quick", "--steps", "2", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == [1, 2] and all(r["bit_identical"] for r in rows)
    assert all(0 < r["delta_bytes"] < r["full_bytes"] for r in rows)
