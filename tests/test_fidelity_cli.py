"""`clawfast fidelity` run as a real subprocess on rollouts written to a run directory: the JSON
layout, the numbers against `clawfast.threads.reconstruct`, the decoded divergence text, records
written before threads existed (no hints, no metadata), and bad input."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from clawfast.records import RolloutResult, write_rollout, rollout_path
from clawfast.threads import reconstruct

from test_threads import SYSTEM, TOOL, USER, Session


def fidelity(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clawfast.cli", "fidelity", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def session_with_an_edit_and_a_subagent(seed: int):
    """Main steps, a subagent whose report comes back, then a history edit of an old tool result."""
    s = Session(seed, vocab=3000)  # ids the embedded tokenizer decodes
    head = s.msg(SYSTEM, s.text(200)) + s.msg(USER, s.text(20))
    tools = [s.msg(TOOL, s.text(15)) for _ in range(3)]
    a0 = s.ask(head)
    sub = s.msg(SYSTEM, s.text(30)) + s.msg(USER, s.text(10))
    report = s.ask(sub)
    a1 = s.ask(head + a0 + s.msg(TOOL, report[2:-1]))
    a2 = s.ask(head + a0 + s.msg(TOOL, report[2:-1]) + a1 + tools[0])
    edited = head + a0 + s.msg(TOOL, s.text(2)) + a1 + tools[0] + a2 + tools[1]
    s.ask(edited)
    return s.calls


def write_run(tmp_path, sessions, harness="codex"):
    records = tmp_path / "run" / "step-0" / "records"  # nested, as a run directory holds them
    records.mkdir(parents=True)
    for i, calls in enumerate(sessions):
        rollout_id = f"r{i}"
        calls = [dataclasses.replace(c, rollout_id=rollout_id) for c in calls]
        write_rollout(rollout_path(records, rollout_id), RolloutResult(rollout_id, f"t{i}", harness, calls=calls))
    return tmp_path / "run"


def test_json_layout_and_numbers(tmp_path):
    sessions = [session_with_an_edit_and_a_subagent(seed) for seed in range(3)]
    run = write_run(tmp_path, sessions)
    proc = fidelity(run, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["skipped"] == [] and len(out["rollouts"]) == 3
    for got, calls in zip(out["rollouts"], sessions):
        want = reconstruct(calls)
        assert got["continuity"] == want.continuity == 2 / 3
        assert [(c["call_index"], c["thread"], c["kind"], c["extends"]) for c in got["calls"]] == [
            (t.call_index, t.thread, t.kind, t.extends) for t in want.calls]
        assert [c["kind"] for c in got["calls"]] == ["main", "subagent", "main", "main", "main"]
        [div] = got["divergences"]
        assert (div["call_index"], div["against"], div["cause"]) == (4, 3, "history edit")
        assert div["expected"] and div["got"] and div["expected"] != div["got"]  # decoded text
    summary = out["harnesses"]["codex"]
    assert (summary["rollouts"], summary["main_pairs"], summary["exact_pairs"]) == (3, 9, 6)
    assert summary["calls"] == {"main": 12, "subagent": 3} and summary["divergences"] == {"history edit": 3}


def test_text_report_and_a_single_file(tmp_path):
    run = write_run(tmp_path, [session_with_an_edit_and_a_subagent(0)], harness="openclaw")
    proc = fidelity(next(run.rglob("*.cfr")))
    assert proc.returncode == 0, proc.stderr
    assert "openclaw" in proc.stdout and "0.6667" in proc.stdout
    assert "divergence: call 4 leaves call 3 at token" in proc.stdout and "(history edit)" in proc.stdout
    assert "subagent:1" in proc.stdout


def test_bad_input_is_reported(tmp_path):
    assert fidelity(tmp_path / "missing").returncode == 1
    proc = fidelity(tmp_path)
    assert proc.returncode == 1 and "no .cfr rollouts" in proc.stderr
    run = write_run(tmp_path, [session_with_an_edit_and_a_subagent(0)])
    (run / "broken.cfr").write_bytes(b"CLAWFREC\x00garbage")
    proc = fidelity(run, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["rollouts"]) == 1 and out["skipped"][0]["path"].endswith("broken.cfr")


def test_a_rollout_whose_threads_cannot_be_rebuilt_is_skipped(tmp_path):
    """Two calls sharing call_index 0: `reconstruct` refuses them; the file is listed as skipped
    (as an unreadable one is) and the other rollouts are still reported."""
    run = write_run(tmp_path, [session_with_an_edit_and_a_subagent(0)])
    calls = [dataclasses.replace(c, rollout_id="dup") for c in session_with_an_edit_and_a_subagent(1)]
    calls[1] = dataclasses.replace(calls[1], call_index=0)
    write_rollout(run / "dup.cfr", RolloutResult("dup", "t", "codex", calls=calls))
    proc = fidelity(run, "--json")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout)
    assert [r["rollout_id"] for r in out["rollouts"]] == ["r0"]
    [skipped] = out["skipped"]
    assert skipped["path"].endswith("dup.cfr") and "duplicate call indices" in skipped["reason"]
    proc = fidelity(run / "dup.cfr")  # nothing else to report: exit 1, still no traceback
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "dup.cfr: rollout 'dup': duplicate call indices" in proc.stdout


def test_a_tokenizer_that_is_not_a_directory_is_a_usage_error(tmp_path):
    run = write_run(tmp_path, [session_with_an_edit_and_a_subagent(0)])
    proc = fidelity(run, "--tokenizer", tmp_path / "missing")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"clawfast fidelity: --tokenizer {tmp_path / 'missing'}: no such directory\n"
    proc = fidelity(run, "--tokenizer", run)  # a directory, but no tokenizer in it
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"clawfast fidelity: --tokenizer {run}: cannot load a tokenizer: ")
    assert proc.stderr.count("\n") == 1
