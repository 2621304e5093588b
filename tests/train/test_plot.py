"""Metrics files, their truncation on resume, and `clawfast plot`."""

from __future__ import annotations

import json
import re
import sys

import pytest

from clawfast.cli import main
from clawfast.records import RolloutResult
from clawfast.tasks import clawbench_mini
from clawfast.train.metrics import metrics_by_tag, rollout_metrics, subscore_means
from clawfast.train.metrics_log import MetricsLogger, read_metrics
from clawfast.train.plot import plot_run
from clawfast.train.report import pass_at_1


def _fill(run_dir, steps=6):
    with MetricsLogger(run_dir, tensorboard=False) as log:
        log.log("eval", 0, {"pass@1": 0.0, "pass@1/mini-swe-agent": 0.0, "label": "before"})
        log.log("coldstart", 0, {"epoch": 1, "nll": 2.5})
        for s in range(1, steps + 1):
            log.log("train", s, {"reward/mean": s / steps, "pass@1/mini-swe-agent": s / steps, "loss": 1.0 / s,
                                 "entropy": 3.0 - s * 0.1, "is_ratio_mean": 1.0, "clip_frac": 0.01,
                                 "tokens_per_call_flat": 1000.0, "tokens_packed": 250.0, "time/rollout_s": 30.0,
                                 "mismatch_k3": float("nan")})
        log.log("eval", steps, {"pass@1": 0.25, "pass@1/mini-swe-agent": 0.25, "label": "after"})


def test_jsonl_records_and_nan(tmp_path):
    _fill(tmp_path)
    records = read_metrics(tmp_path)
    assert [r["kind"] for r in records][:2] == ["eval", "coldstart"]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert train[0]["mismatch_k3"] is None  # NaN is not JSON


def test_resume_truncates_later_steps_and_tolerates_a_torn_line(tmp_path):
    _fill(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"kind": "train", "st')  # killed mid-write
    with MetricsLogger(tmp_path, resume_step=3, tensorboard=False) as log:
        log.log("train", 4, {"loss": 0.5})
    steps = [(r["kind"], r["step"]) for r in read_metrics(tmp_path)]
    assert steps == [("eval", 0), ("coldstart", 0), ("train", 1), ("train", 2), ("train", 3), ("train", 4)]


def test_plot_writes_a_png(tmp_path):
    _fill(tmp_path)
    path = plot_run(tmp_path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_cli(tmp_path, capsys):
    _fill(tmp_path)
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x.png").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty)]) == 2
    assert "no metrics file" in capsys.readouterr().err
    (empty / "metrics.jsonl").write_text(json.dumps({"kind": "coldstart", "step": 0, "nll": 1.0}) + "\n")
    assert main(["plot", str(empty)]) == 2


@pytest.mark.parametrize("line", ["[1, 2]", "3", '"text"', "null"])
def test_a_line_that_is_not_a_json_object_is_refused_naming_the_file_and_line(tmp_path, capsys, line):
    """Valid JSON that is not an object (here on line 2 of 2, which is no torn tail: it parses) made
    `clawfast plot` and `clawfast report` crash with an AttributeError; the reader refuses it."""
    _fill(tmp_path, steps=1)
    path = tmp_path / "metrics.jsonl"
    first = path.read_text().splitlines()[0]
    path.write_text(f"{first}\n{line}\n")
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: line 2 is not a JSON object") + "$"):
        read_metrics(tmp_path)
    capsys.readouterr()
    for command in ("plot", "report"):
        assert main([command, str(tmp_path)]) == 2
        assert capsys.readouterr().err == f"clawfast {command}: {path}: line 2 is not a JSON object\n"


def test_report_of_evals_no_rollout_was_scored_in_has_no_gain_line(tmp_path, capsys):
    """Every eval task a rubric and no judge configured: the evals hold no pass@1, and `clawfast report`
    crashed on the gain line (KeyError); it reports the table without one."""
    records = [{"kind": "eval", "step": step, "label": label, "rollouts": 0.0, "time": float(step)}
               for step, label in ((0, "before"), (2, "after"))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", str(tmp_path)]) == 0
    assert "gain from" not in capsys.readouterr().out


def test_a_file_that_is_not_text_is_refused_naming_it(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe\x00")
    for command in ("plot", "report"):
        assert main([command, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"clawfast {command}: {tmp_path / 'metrics.jsonl'}: not a metrics file (not UTF-8")


def test_without_matplotlib_a_run_ends_with_its_metrics_and_says_why(tmp_path, capsys, monkeypatch):
    """matplotlib is the ``train`` extra's: a run's end and `clawfast plot` say it is missing, and
    the run does not fail for want of its picture."""
    from clawfast.train.loop import _draw_curves

    _fill(tmp_path)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets where it is not installed
    assert _draw_curves(tmp_path) is None
    assert "matplotlib does not import" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 2
    assert "pip install 'clawfast[train]'" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_bytes() == before and not (tmp_path / "curves.png").exists()
    assert main(["plot", str(tmp_path / "no-run")]) == 2  # a missing run is said as such, matplotlib or not
    assert "no metrics file" in capsys.readouterr().err


def test_rollout_metrics_per_harness():
    rs = [RolloutResult(f"r{i}", "t", h, i, reward=rw, status=st)
          for i, (h, rw, st) in enumerate([("codex", 1.0, "ok"), ("codex", 0.0, "timeout"),
                                           ("openclaw", 1.0, "ok"), ("openclaw", 0.5, "ok")])]
    m = rollout_metrics(rs)
    assert m["pass@1/codex"] == 0.5 and m["pass@1/openclaw"] == 0.5 and m["pass@1"] == 0.5
    assert m["reward/openclaw"] == 0.75 and m["status/timeout"] == 1.0 and m["status/ok"] == 3.0
    with pytest.raises(FileNotFoundError):
        read_metrics("/nonexistent-run")


def test_pass_at_1_by_difficulty_counts_each_attempt_once():
    tasks = {t.id: t for t in clawbench_mini() if t.id in ("files-create-0", "shell-chmod-0", "files-replace-1", "data-csv-json-0")}
    assert sorted(t.tags["difficulty"] for t in tasks.values()) == ["easy", "easy", "hard", "medium"]
    rs = [RolloutResult("a", "files-create-0", "m", 0, reward=1.0), RolloutResult("b", "files-create-0", "m", 1, reward=0.0),
          RolloutResult("c", "shell-chmod-0", "m", 0, reward=1.0), RolloutResult("d", "files-replace-1", "m", 0, reward=0.5),
          RolloutResult("e", "data-csv-json-0", "m", 0, reward=0.0, status="timeout")]
    assert metrics_by_tag(rs, tasks, "difficulty") == {
        "pass@1_difficulty/easy": 2 / 3, "pass@1_difficulty/medium": 0.0, "pass@1_difficulty/hard": 0.0,
        "reward_difficulty/easy": 2 / 3, "reward_difficulty/medium": 0.5, "reward_difficulty/hard": 0.0}
    assert metrics_by_tag(rs, tasks, "no-such-tag") == {}
    by_task = metrics_by_tag(rs, tasks, "task")
    assert by_task["pass@1_task/files-create-0"] == 0.5 and by_task["reward_task/files-replace-1"] == 0.5


def test_rollout_metrics_count_verifier_errors_and_average_subscores():
    def verdict(status, subscores=None):
        return {"verifier": {"status": status, "details": {"subscores": subscores} if subscores else {}}}

    rs = [RolloutResult("a", "t", "m", 0, reward=0.5, info=verdict("ok", {"exists": 1.0, "correct": 0.0})),
          RolloutResult("b", "t", "m", 1, reward=1.0, info=verdict("ok", {"exists": 1.0, "correct": 1.0})),
          RolloutResult("c", "t", "m", 2, reward=0.0, status="verifier_error", info=verdict("verifier_error")),
          RolloutResult("d", "t", "m", 3, reward=0.0, status="harness_error")]
    m = rollout_metrics(rs)
    assert m["verifier_errors"] == 1.0 and not any(k.startswith("subscore/") for k in m)
    assert m["reward/mean"] == 0.375 and m["pass@1"] == 0.25
    assert subscore_means(rs) == {"subscore/correct": 0.5, "subscore/exists": 1.0}
    assert pass_at_1(rs)["subscore/correct"] == 0.5 and pass_at_1(rs)["verifier_errors"] == 1.0
