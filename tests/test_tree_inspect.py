"""`clawfast tree inspect` on the bundled sample group, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clawfast.records import load_rollouts
from clawfast.samples import write_samples
from clawfast.tree import build_tree


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clawfast.cli", "tree", "inspect", *map(str, args)],
        capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    out = tmp_path_factory.mktemp("samples")
    proc = subprocess.run([sys.executable, "-m", "clawfast.samples", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def test_samples_are_small_and_deterministic(samples, tmp_path):
    files = sorted(samples.glob("*.cfr"))
    assert len(files) == 8 and sum(f.stat().st_size for f in files) < 400_000
    again = write_samples(tmp_path)
    assert [p.read_bytes() for p in sorted(again)] == [f.read_bytes() for f in files]


def test_inspect_json_matches_build_tree(samples):
    proc = inspect(samples, "--json", "--micro-batch-tokens", "2048")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rollouts = load_rollouts(samples)
    assert [d["rollout_id"] for d in report["rollouts"]] == [r.rollout_id for r in rollouts]
    for d, rollout in zip(report["rollouts"], rollouts):
        tree = build_tree(rollout.calls)
        assert d["tokens"]["unique"] == tree.num_unique_tokens
        assert d["tokens"]["per_call"] == sum(len(c.prompt_ids) + len(c.output_ids) for c in rollout.calls)
        assert d["tokens"]["per_kept_leaf"] == tree.num_flat_tokens
        assert 0 < d["tokens"]["trainable"] <= sum(len(c.output_ids) for c in rollout.calls)
        assert [c["index"] for c in d["calls"]] == [c.call_index for c in rollout.calls]
        assert [c["prompt_len"] for c in d["calls"]] == [len(c.prompt_ids) for c in rollout.calls]
        assert [lf["status"] for lf in d["leaves"]] == [lf.status for lf in tree.leaves]
        assert sum(s["len"] for s in d["segments"]) == tree.num_unique_tokens
        assert {lf["status"] for lf in d["leaves"]} >= {"kept", "excluded"}
    assert any(lf["status"] == "dead" for d in report["rollouts"] for lf in d["leaves"])
    group = report["group"]
    # Eight samples of one task share the system prompt and task text: the forest is smaller than
    # the rollouts' own unique tokens added up.
    assert group["forest_tokens"] < sum(d["tokens"]["unique"] for d in report["rollouts"])
    assert group["micro_batches"]["num_batches"] >= 1 and group["micro_batches"]["micro_batch_tokens"] == 2048


def test_inspect_text_single_file_and_options(samples):
    one = sorted(samples.glob("*.cfr"))[0]
    proc = inspect(one)
    assert proc.returncode == 0, proc.stderr
    for word in ("calls (16)", "segments (", "one sample per call", "one sample per kept leaf", "leaves ("):
        assert word in proc.stdout
    keep = json.loads(inspect(one, "--json", "--keep-dead").stdout)
    assert all(lf["status"] != "dead" for lf in keep["rollouts"][0]["leaves"])
    dropped = json.loads(inspect(one, "--json", "--max-kept-leaves", "0").stdout)
    assert dropped["rollouts"][0]["dropped"] is True and dropped["rollouts"][0]["tokens"]["trainable"] == 0


def test_inspect_bad_input(tmp_path):
    proc = inspect(tmp_path / "missing.cfr")
    assert proc.returncode == 1 and "No such file" in proc.stderr
    (tmp_path / "bad.cfr").write_bytes(b"not a record")
    proc = inspect(tmp_path / "bad.cfr")
    assert proc.returncode == 1 and "bad magic" in proc.stderr
    proc = inspect(tmp_path / "bad.cfr", "--micro-batch-tokens", "x")
    assert proc.returncode == 2  # argparse rejects it
    # The flag's old name is refused with a message naming the new one.
    proc = inspect(tmp_path / "bad.cfr", "--max-tokens", "2048")
    assert proc.returncode == 2 and "--max-tokens is now --micro-batch-tokens" in proc.stderr


def test_inspect_marks_trained_threads_and_links(tmp_path):
    """A Claude Code rollout with two subagents and a compaction (tests/data/threads): the calls'
    threads, which are trained under --train-threads, and the links PPO follows."""
    import gzip
    from pathlib import Path

    data = Path(__file__).parent / "data" / "threads"
    path = tmp_path / "cc.cfr"
    path.write_bytes(gzip.decompress((data / "claude-code-threads.cfr.gz").read_bytes()))
    kinds = json.loads((data / "claude-code-threads.labels.json").read_text())
    for trained in (["main"], ["main", "subagent"], ["main", "subagent", "compaction"]):
        proc = inspect(path, "--json", "--train-threads", ",".join(trained))
        assert proc.returncode == 0, proc.stderr
        [d] = json.loads(proc.stdout)["rollouts"]
        assert [c["tags"] == [k] for c, k in zip(d["calls"], kinds)] == [True] * len(kinds)
        assert [not c["excluded"] for c in d["calls"]] == [k in trained for k in kinds]
        assert {c["thread"] for c in d["calls"] if c["tags"] == ["subagent"]} == {"subagent:1", "subagent:4"}
        links = {(lk["kind"], lk["source"], lk["target"]): lk["followed"] for lk in d["links"]}
        assert links == {("returns", 2, 3): "subagent" in trained, ("returns", 5, 6): "subagent" in trained,
                         ("resumes", 7, 9): "compaction" in trained, ("restarts", 8, 9): "compaction" in trained}
    text = inspect(path, "--train-threads", "main,subagent").stdout
    assert "returns   call 2 -> call 3\n" in text and "restarts  call 8 -> call 9  (not followed" in text
    bad = inspect(path, "--train-threads", "subagent")
    assert bad.returncode == 2 and "must include 'main'" in bad.stderr


def test_inspect_refuses_out_of_range_numbers_as_usage_errors(samples):
    """Checked when the arguments are parsed (exit 2, one line naming the flag): a negative
    --max-kept-leaves was reported as every rollout skipped; a --micro-batch-tokens past what the
    packer numbers (int32 rows) was a pybind11 TypeError printing every array."""
    cases = {("--max-kept-leaves", "-1"): "argument --max-kept-leaves: must be at least 0, got -1",
             ("--micro-batch-tokens", "0"): "argument --micro-batch-tokens: must be in 1..2147483647",
             ("--micro-batch-tokens", str(10**20)): "argument --micro-batch-tokens: must be in 1..2147483647"}
    for args, message in cases.items():
        proc = inspect(samples, *args)
        assert proc.returncode == 2 and proc.stdout == "", (args, proc.stderr)
        assert proc.stderr.splitlines()[-1] == f"clawfast tree inspect: error: {message}" + (
            "" if "leaves" in message else f" (a batch's rows are numbered with int32), got {args[1]}")
    largest = inspect(samples, "--json", "--micro-batch-tokens", "2147483647")  # the bound itself is served
    assert largest.returncode == 0, largest.stderr
    assert json.loads(largest.stdout)["group"]["micro_batches"]["num_batches"] == 1


def test_inspect_reports_a_header_that_is_not_a_json_object(tmp_path):
    from clawfast.records import MAGIC, _KIND_HEADER, _frame, encode_result

    path = tmp_path / "hdr.cfr"
    path.write_bytes(MAGIC + _frame(_KIND_HEADER, b"[1,2]") + encode_result(0.0, "ok", {}))
    proc = inspect(path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr == f"clawfast tree inspect: {path}: header frame at byte 8: an array, not a JSON object\n"
