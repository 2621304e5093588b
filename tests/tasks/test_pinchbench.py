"""PinchBench suites: loading (every field checked, errors naming file and field), grade functions run
in their own process on the workspace and a transcript, and scores by grading type (`clawfast.tasks.scoring`)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path

import pytest

from clawfast.tasks import load_suite
from clawfast.tasks.judge import FILE_PREVIEW_BYTES, Verdict, judge_prompt, parse_verdict
from clawfast.tasks.pinchbench import load_pinchbench, split_sections
from clawfast.tasks.scoring import combine, judge_results
from clawfast.tasks.sandbox_runner import SandboxRunner
from clawfast.tasks.task import GradeFunctionVerifier, TaskFormatError
from clawfast.tasks.transcript import text_event
from clawfast.tasks.verify import run_verifier, score_do_nothing

from .eval_config import write_eval_config

SUITE = Path(__file__).resolve().parents[1] / "data" / "pinchbench"


def tool_call_event(command: str) -> dict:
    return {"type": "message", "message": {"role": "assistant", "content": [
        {"type": "toolCall", "id": "call_0", "name": "exec", "arguments": {"command": command}}]}}


def test_suite_loads_every_grading_type():
    tasks = {t.id: t for t in load_suite(f"pinchbench:{SUITE}")}
    assert sorted(tasks) == ["task_01_total", "task_02_report", "task_03_haiku"]
    total, report, haiku = tasks["task_01_total"], tasks["task_02_report"], tasks["task_03_haiku"]
    # automated: code alone; the asset is read from assets/ and written at its dest.
    assert isinstance(total.verifier, GradeFunctionVerifier) and total.rubric is None
    assert total.files == {"input/counts.txt": (SUITE / "assets" / "counts.txt").read_bytes()}
    assert total.instruction.startswith("The file `input/counts.txt`") and "---" not in total.instruction
    assert total.tags == {"category": "data", "grading_type": "automated", "split": "train", "suite": "pinchbench"}
    assert total.timeout == 120.0 and total.private_dirs == (SUITE,)
    # hybrid: its own weights (0.6 / 0.4), an inline workspace file, the rubric section.
    assert report.rubric.weight == pytest.approx(0.4) and "Criterion 1: Faithful" in report.rubric.text
    assert report.files["notes/status.md"].startswith(b"# Status\n")
    assert "build is green" in report.rubric.expected
    # llm_judge without a rubric section: the judge reads the grading criteria.
    assert haiku.verifier is None and haiku.rubric.weight == 1.0 and "- [ ] Three lines" in haiku.rubric.text


def test_eval_split_and_exclude():
    everything = load_pinchbench(f"pinchbench:{SUITE}?eval=0.5")
    assert {t.split for t in everything} <= {"train", "eval"}
    evals = load_pinchbench(f"pinchbench:{SUITE}?eval=0.5", "eval")
    assert evals == [t for t in everything if t.split == "eval"]
    assert [t.id for t in load_pinchbench(f"pinchbench:{SUITE}?exclude=task_03_haiku")] == ["task_01_total", "task_02_report"]
    with pytest.raises(ValueError, match="exclude names task_99"):
        load_pinchbench(f"pinchbench:{SUITE}?exclude=task_99")
    with pytest.raises(ValueError, match="unknown option 'seed'"):
        load_pinchbench(f"pinchbench:{SUITE}?seed=1")


def _broken_suite(tmp_path: Path, edit) -> Path:
    root = tmp_path / "suite"
    shutil.copytree(SUITE, root)
    path = root / "tasks" / "task_02_report.md"
    path.write_text(edit(path.read_text()))
    return root


@pytest.mark.parametrize("edit, field", [
    (lambda s: s.replace("grading_type: hybrid", "grading_type: vibes"), "grading_type"),
    (lambda s: s.replace("## Prompt", "## Prompts"), "## Prompt"),
    (lambda s: s.replace("category: writing\n", ""), "category"),
    (lambda s: s.replace("timeout_seconds: 120", "timeout_seconds: soon"), "timeout_seconds"),
    (lambda s: s.replace("name: Status Report", "name: Status Report\nowner: me"), "owner"),
    (lambda s: s.replace("automated: 0.6", "automated: 0"), "grading_weights"),
    (lambda s: s.replace("## Automated Checks", "## Checks"), "## Automated Checks"),
    (lambda s: s.replace("```python", "```python\n```\n```python"), "## Automated Checks"),
    (lambda s: s.replace('path: "notes/status.md"', 'path: "../escape.md"'), "workspace_files[0].path"),
    (lambda s: s.replace("    content: |", "    text: |"), "workspace_files[0]"),
    (lambda s: s.replace("def grade(transcript, workspace_path):", "def grade(transcript, workspace_path)"),
     "verifier.code"),
    (lambda s: s.replace("id: task_02_report", "id: task_01_total"), "id"),
])
def test_errors_name_the_file_and_the_field(tmp_path, edit, field):
    root = _broken_suite(tmp_path, edit)
    with pytest.raises(TaskFormatError, match=re.escape(str(root / "tasks")) + r"/\w+\.md: field " + re.escape(repr(field))):
        load_pinchbench(f"pinchbench:{root}")


def test_missing_asset_front_matter_and_multi_session(tmp_path):
    root = _broken_suite(tmp_path, lambda s: s.replace('  - path: "notes/status.md"\n    content: |\n      # Status\n'
                                                       '      - build: green\n      - release: blocked on review\n',
                                                       "  - source: gone.pdf\n    dest: gone.pdf\n"))
    with pytest.raises(TaskFormatError, match=r"task_02_report.md: field 'workspace_files\[0\].source': 'gone.pdf' "
                                              r"is not a file \(looked at .*assets/gone.pdf and .*suite/gone.pdf\)"):
        load_pinchbench(f"pinchbench:{root}")
    (root / "tasks" / "task_02_report.md").write_text("# no front matter\n")
    with pytest.raises(TaskFormatError, match="task_02_report.md: no front matter"):
        load_pinchbench(f"pinchbench:{root}")
    (root / "tasks" / "task_02_report.md").write_text(
        "---\nid: task_02_report\nmulti_session: true\nsessions:\n  - id: a\n    prompt: hi\n---\n## Prompt\nhi\n")
    with pytest.raises(TaskFormatError, match=r"field 'multi_session'.*\?exclude=task_02_report"):
        load_pinchbench(f"pinchbench:{root}")
    # Left out by name, a task clawfast cannot run does not stop the suite.
    assert [t.id for t in load_pinchbench(f"pinchbench:{root}?exclude=task_02_report")] == ["task_01_total", "task_03_haiku"]


def test_a_fence_closes_only_on_a_line_that_is_just_backticks(tmp_path):
    """A grade function that looks for a Markdown code fence in the agent's file holds ``` in a string
    (and a line that opens one, with an info string, inside a multi-line string): neither ends the block."""
    grade = ('def grade(transcript, workspace_path):\n'
             '    from pathlib import Path\n'
             '    p = Path(workspace_path) / "README.md"\n'
             '    text = p.read_text() if p.exists() else ""\n'
             '    example = """\n```bash\n## not a section\n"""\n'
             '    return {"exists": float(p.exists()), "has_fence": float("```bash" in text)}\n')
    root = tmp_path / "suite"
    (root / "tasks").mkdir(parents=True)
    (root / "tasks" / "task_01_readme.md").write_text(
        "---\nid: task_01_readme\nname: README\ncategory: writing\ngrading_type: automated\ntimeout_seconds: 120\n"
        "---\n## Prompt\nWrite README.md with a fenced bash example.\n\n## Automated Checks\n"
        f"```python\n{grade}```\n")
    [task] = load_pinchbench(f"pinchbench:{root}")
    assert task.verifier.code == grade
    ws = task.materialize(tmp_path / "ws")
    (ws / "README.md").write_text("# Demo\n\n```bash\necho hi\n```\n")
    result = run_verifier(task, ws)
    assert (result.status, result.score) == ("ok", 1.0), result


def test_sections_ignore_headings_inside_code_and_closing_rules():
    body = "# Title\n\n## Prompt\n\nDo it.\n\n---\n\n## Automated Checks\n\n```python\n## not a section\n```\n"
    assert split_sections(body) == {"Prompt": "Do it.", "Automated Checks": "```python\n## not a section\n```"}


def _task(task_id: str):
    return {t.id: t for t in load_suite(f"pinchbench:{SUITE}")}[task_id]


def test_grade_scores_workspace_and_transcript(tmp_path):
    task = _task("task_01_total")
    workspace = task.materialize(tmp_path / "ws")
    (workspace / "total.txt").write_text("12\n")
    transcript = [text_event("user", task.instruction), tool_call_event("awk '{s+=$2} END {print s}' input/counts.txt > total.txt")]
    result = run_verifier(task, workspace, transcript=transcript)
    assert (result.status, result.score) == ("ok", 1.0)
    assert result.details["criteria"] == {"file_created": 1.0, "sum_correct": 1.0, "ran_a_command": 1.0}
    # Same workspace, no transcript: the criterion that reads it fails.
    result = run_verifier(task, workspace)
    assert result.score == pytest.approx(2 / 3) and result.details["criteria"]["ran_a_command"] == 0.0
    # Booleans count as 0 / 1; the do-nothing workspace and an empty transcript score 0.
    assert score_do_nothing(_task("task_02_report")).score == 0.0
    assert score_do_nothing(task).score == 0.0


@pytest.mark.parametrize("body, error", [
    ("    raise KeyError('transcript')", "verifier exited with status 1"),
    ("    return [1.0]", "verifier exited with status 1"),
    ("    return {'a': 1.5}", "verifier exited with status 1"),
    ("    return {'a': 'yes'}", "verifier exited with status 1"),
])
def test_a_grade_that_fails_is_a_verifier_error(tmp_path, body, error):
    task = dataclasses.replace(_task("task_01_total"),
                               verifier=GradeFunctionVerifier(f"def grade(transcript, workspace_path):\n{body}\n"))
    result = run_verifier(task, task.materialize(tmp_path / "ws"))
    assert (result.status, result.score, result.error) == ("verifier_error", 0.0, error)
    assert result.stderr.strip()  # the traceback or the runner's reason


@pytest.mark.parametrize("exits", [True, False])
def test_the_agents_code_a_grade_runs_cannot_print_the_score(tmp_path, exits):
    """A grader that imports the workspace's module (as PinchBench's off-by-one grader does) ran the
    agent's code in the runner's process: a module printing a score line of its own (and exiting,
    or not) scored 1.0. What it prints is discarded; the runner's own line is the score."""
    code = ("import importlib.util, os\n"
            "def grade(transcript, workspace_path):\n"
            "    spec = importlib.util.spec_from_file_location('s', os.path.join(workspace_path, 'sum.py'))\n"
            "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "    return {'works': 0.0}\n")
    task = dataclasses.replace(_task("task_01_total"), verifier=GradeFunctionVerifier(code))
    workspace = task.materialize(tmp_path / "ws")
    (workspace / "sum.py").write_text("import os\nprint('{\"score\": 1.0}')\nos.write(1, b'{\"score\": 1.0}\\n')\n"
                                      + ("os._exit(0)\n" if exits else ""))
    with SandboxRunner() as runner:
        result = run_verifier(task, workspace, runner)
    if exits:  # the runner never wrote its line: no score, not 1.0
        assert (result.status, result.score) == ("verifier_error", 0.0)
    else:
        assert (result.status, result.score, result.details) == ("ok", 0.0, {"criteria": {"works": 0.0}})


def test_judge_prompt_holds_task_transcript_rubric_and_files(tmp_path):
    task = dataclasses.replace(_task("task_02_report"),
                               rubric=dataclasses.replace(_task("task_02_report").rubric, files=("report.txt", "gone.txt")))
    workspace = task.materialize(tmp_path / "ws")
    (workspace / "report.txt").write_text("Build green; release waits for review.\n")
    prompt = judge_prompt(task, [text_event("user", task.instruction), tool_call_event("cat notes/status.md")], workspace)
    for part in (task.instruction, "## Expected Behavior", 'Tool call: exec({"command": "cat notes/status.md"})',
                 "### report.txt\nBuild green; release waits for review.", "### gone.txt\n(missing",
                 "Criterion 2: Brief", '"total": 0.0'):
        assert part in prompt



def test_judge_prompt_never_reads_through_a_link_the_agent_left(tmp_path):
    # A link at the file or at a folder above it would show the judge (and the rollout's info) a
    # file from outside the workspace.
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "report.txt").write_text("HOST SECRET\n")
    base = _task("task_02_report")
    task = dataclasses.replace(base, rubric=dataclasses.replace(
        base.rubric, files=("report.txt", "out/report.txt", "long.txt", "pipe")))
    workspace = task.materialize(tmp_path / "ws")
    (workspace / "report.txt").symlink_to(outside / "report.txt")
    (workspace / "out").symlink_to(outside)
    # a preview that ends inside a character is still text
    (workspace / "long.txt").write_text("a" * (FILE_PREVIEW_BYTES - 1) + "é" + "b" * 10)
    os.mkfifo(workspace / "pipe")
    prompt = judge_prompt(task, [], workspace)
    assert "HOST SECRET" not in prompt
    assert "### report.txt\n(not read: 'report.txt' is a symbolic link)" in prompt
    assert "### out/report.txt\n(not read: 'out/report.txt': 'out' is a symbolic link)" in prompt
    assert "### long.txt\n" + "a" * (FILE_PREVIEW_BYTES - 1) + "\n... (11 more bytes)" in prompt
    assert "### pipe\n(not read: 'pipe' is not a regular file)" in prompt

@pytest.mark.parametrize("response, total, scores, error", [
    ('{"scores": {"faithful": 1.0, "brief": 0.5}, "total": 0.8, "notes": "ok"}', 0.8, {"faithful": 1.0, "brief": 0.5}, None),
    ('Here it is:\n```json\n{"scores": {"a": 0.25}, "total": 0.25}\n```\nThanks', 0.25, {"a": 0.25}, None),
    ('Thinking {"draft": 1}... final: {"scores": {"a": 0.5, "b": 1.0}}', 0.75, {"a": 0.5, "b": 1.0}, None),
    ("The run was fine. Total: 0.9", None, {}, "no JSON object"),
    ('{"scores": {"a": 2}, "total": 1.0}', None, {}, "criterion 'a': 2 is not a score"),
    ('{"total": -0.1}', None, {}, "'total' -0.1 is not a score"),
    ('{"scores": {}, "notes": "?"}', None, {}, "neither a total nor criterion scores"),
    # The fenced block is the answer: an object after it (an example, the format restated) is not.
    ('```json\n{"scores": {"t": 0.2}, "total": 0.2}\n```\nA correct run would be {"scores": {"t": 1.0}, "total": 1.0}.',
     0.2, {"t": 0.2}, None),
    ('```json\n{"total": 0.9}\n```\nOn reflection:\n```json\n{"total": 0.4}\n```', 0.4, {}, None),
    # Only a line that is just a fence closes one; a fence inside the notes does not.
    ('```json\n{"total": 0.5, "notes": "no ```bash block"}\n```', 0.5, {}, None),
    # Reasoning is not the answer: not a draft in a <think> block, ...
    ('<think>Maybe {"total": 0.9}?</think>\n{"scores": {"r": 0.1}, "total": 0.1}', 0.1, {"r": 0.1}, None),
    # ... nor before a </think> whose <think> the chat template opened, nor in one never closed.
    ('Maybe {"total": 0.9}?</think>{"total": 0.3}', 0.3, {}, None),
    ('<think>The format is {"scores": {"c": 0.0}, "total": 0.0}. Maybe {"total": 0.9', None, {}, "no JSON object"),
    # A think tag the verdict quotes is not reasoning (it made a judge_error of a clean 0).
    ('{"scores": {"a": 0.0}, "total": 0.0, "notes": "the agent only printed <think> tags"}', 0.0, {"a": 0.0}, None),
    ('{"total": 0.0, "notes": "its answer ends with </think>"}', 0.0, {}, None),
    ('Hmm.</think>{"total": 0.2, "notes": "a </think> in the log"}', 0.2, {}, None),
    # An answer cut short inside its verdict is no verdict, not an earlier object's.
    ('<think>Maybe {"total": 0.9}?</think>\n{"scores": {"report": 0.1}, "total": 0.', None, {}, "cut short"),
    ('{"total": 0.8}\nRevised: {"scores": {"a": 0.1}, "notes": "the run', None, {}, "cut short"),
    # Braces in prose before the verdict are not an unfinished object, nor are braces after it that open
    # no JSON object (code quoted in a note); an object opened after a fenced verdict is one.
    ('Answer in the {format} { given: {"total": 0.7}', 0.7, {}, None),
    ('{"total": 0.6}\nIt printed f"{name without closing it.', 0.6, {}, None),
    ('```json\n{"total": 0.4}\n```\nRevised:\n```json\n{"total": 0.', None, {}, "cut short"),
    ('{"total": 0.8}\nRevised:\n{\n', None, {}, "cut short"),
    # Numbers no float holds, and NaN: an error, never an exception.
    ('{"scores": {"q": 1' + "0" * 320 + '}, "total": 1}', None, {}, "criterion 'q'"),
    ('{"total": NaN}', None, {}, "'total' nan is not a score"),
    ('{"total": 1e999}', None, {}, "'total' inf is not a score"),
    ('{"total": 0.5, "notes": {"x": NaN}}', 0.5, {}, None),
    ('{"total": ' + "[" * 100_000, None, {}, "cut short"),
])
def test_parse_verdict(response, total, scores, error):
    verdict = parse_verdict("PROMPT", response, judge="j")
    assert (verdict.total, verdict.scores, verdict.prompt, verdict.response) == (total, scores, "PROMPT", response)
    assert (verdict.error is None) if error is None else error in verdict.error


def test_ask_never_raises_for_an_answer():
    from clawfast.records import encode_result
    from clawfast.tasks.judge import ask

    for answer in ['{"scores": {"quality": 1' + "0" * 320 + '}, "total": 1}', '{"total": 0.5, "notes": [NaN]}']:
        verdict = ask(ScriptedJudge(answer), "p")
        assert verdict.response == answer
        encode_result(0.0, "ok", {"judge": verdict.to_json()})  # the record that keeps it holds it


def _verdict(total):
    return Verdict("p", "r", total, error=None if total is not None else "bad answer")


def test_scores_by_grading_type():
    total, report, haiku = _task("task_01_total"), _task("task_02_report"), _task("task_03_haiku")
    assert combine(total, 0.5, None).to_json() == {"score": 0.5, "code": 0.5, "judged": None, "weight": 0.0,
                                                   "judge": "no rubric"}
    assert combine(report, 1.0, _verdict(0.5)).score == pytest.approx(0.6 * 1.0 + 0.4 * 0.5)
    assert combine(haiku, 0.0, _verdict(0.75)).score == 0.75
    # Without a judge, or with one that failed, the task's score says so: never a silent 0 or 1.
    for task in (report, haiku):
        assert (combine(task, 1.0, None).score, combine(task, 1.0, None).judge) == (None, "not judged")
        assert (combine(task, 1.0, _verdict(None)).score, combine(task, 1.0, _verdict(None)).judge) == (None, "judge_error")


class ScriptedJudge:
    """Answers every prompt with the same text (a judge model is not what these tests are about)."""

    def __init__(self, answer: str) -> None:
        self.answer, self.name, self.concurrency, self.prompts = answer, "scripted", 2, []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        return self.answer


def test_judge_results_store_prompt_verdict_and_score():
    from clawfast.records import RolloutResult

    tasks = {t.id: t for t in load_suite(f"pinchbench:{SUITE}")}
    ok = {"status": "ok", "score": 1.0}
    results = [
        RolloutResult("r1", "task_02_report", "h", reward=1.0, info={"verifier": ok, "judge": {"prompt": "P1", "weight": 0.4}}),
        RolloutResult("r2", "task_03_haiku", "h", reward=0.0, info={"verifier": {"status": "ok"}, "judge": {"prompt": "P2"}}),
        RolloutResult("r3", "task_01_total", "h", reward=1.0, info={"verifier": ok}),
        RolloutResult("r4", "task_03_haiku", "h", status="sandbox_error", info={}),
    ]
    judge = ScriptedJudge('{"scores": {"faithful": 0.5}, "total": 0.5, "notes": "half"}')
    judge_results(results, tasks, judge)
    assert [r.reward for r in results] == [pytest.approx(0.8), 0.5, 1.0, 0.0]
    assert sorted(judge.prompts) == ["P1", "P2"]
    assert results[0].info["judge"]["verdict"]["prompt"] == "P1" and results[0].info["judge"]["verdict"]["notes"] == "half"
    assert results[3].info["score"]["judge"] == "judge_error"
    assert "ended before grading (status sandbox_error)" in results[3].info["judge"]["verdict"]["error"]
    # No judge: the hybrid keeps its certain points (the verifier's share), the judge-only task none.
    results = [RolloutResult("r1", "task_02_report", "h", reward=1.0, info={"verifier": ok, "judge": {"prompt": "P1"}})]
    judge_results(results, tasks, None)
    assert results[0].info["score"] == {"score": None, "code": 1.0, "judged": None, "weight": pytest.approx(0.4),
                                        "judge": "not judged"}
    assert results[0].reward == pytest.approx(0.6)


# -- end to end: real harnesses in bubblewrap, the scripted engine playing an oracle, the graders reading
# the run's transcript, the judged part through a scripted judge -------------------------------------

ORACLES = {
    "task_01_total": ("awk '{s += $2} END {print s}' input/counts.txt > total.txt",),
    "task_02_report": ("printf 'Build green; the release waits for review.\\n' > report.txt",),
    "task_03_haiku": ("printf 'Prefix shared once\\nbranches read the trunk they share\\nattention is cheap\\n' > haiku.txt",),
}


def test_a_harness_log_with_a_turn_the_model_never_produced_is_not_the_transcript():
    """OpenClaw's session log lives in the sandbox's HOME, which the agent can write: a tool call or an
    answer added there (graders read the transcript for what the agent did) makes the run's transcript
    the proxy's. The log as the model produced it (key order and surrounding spaces aside) is kept."""
    from clawfast.rollout.worker import only_the_models_turns

    def assistant(*items):
        return {"type": "message", "message": {"role": "assistant", "content": list(items)}}

    call = {"type": "toolCall", "id": "c1", "name": "exec", "arguments": {"command": "ls", "timeout": 5}}
    recorded = [text_event("user", "go"), assistant({"type": "text", "text": "Looking."}, call),
                assistant({"type": "text", "text": "Done."})]
    logged = [text_event("user", "go"),
              assistant({"type": "text", "text": " Looking.\n"}, {**call, "id": "x", "arguments": {"timeout": 5, "command": "ls"}}),
              {"type": "message", "message": {"role": "toolResult", "content": [{"type": "text", "text": "a.py"}]}},
              assistant({"type": "text", "text": "Done."})]
    assert only_the_models_turns(logged, recorded)
    forged_call = {"type": "toolCall", "id": "c2", "name": "web_search", "arguments": {"query": "q"}}
    assert not only_the_models_turns(logged + [assistant(forged_call)], recorded)
    assert not only_the_models_turns(logged + [assistant({"type": "text", "text": "All verified."})], recorded)
    assert not only_the_models_turns(logged + [assistant(call)], recorded)  # one call, claimed twice


def test_a_transcript_of_any_shape_is_summarized_leaving_out_what_is_not_an_event():
    """A harness's log lives where the agent can write: a toolResult whose text is null, a message that
    is a string, arguments no JSON holds. The judge's summary leaves them out (a TypeError or an
    AttributeError there failed the rollout as an infrastructure error, and it ran again)."""
    from clawfast.tasks.transcript import summarize

    events = [text_event("user", "go"),
              {"type": "message", "message": {"role": "toolResult", "content": [{"type": "text", "text": None}]}},
              {"type": "message", "message": "x"},
              {"type": "message", "message": {"role": "assistant", "content": [
                  {"type": "toolCall", "name": "exec", "arguments": {"n": float("nan"), "s": {1, 2}}}]}},
              {"type": "message", "message": {"role": "assistant", "content": [{"type": "text", "text": "Done."}]}}]
    lines = summarize(events).splitlines()
    assert lines[0] == "User: go" and lines[1] == "Tool result: " and lines[-1] == "Assistant: Done."
    assert lines[2].startswith("Tool call: exec(")


def _run_suite_through(harness: str, tmp_path) -> dict:
    from clawfast.rollout.check import check_harness

    tasks = {t.id: dataclasses.replace(t, oracle=ORACLES[t.id]) for t in load_suite(f"pinchbench:{SUITE}")}
    results = [check_harness(harness, task=task, timeout_s=300, logs_dir=tmp_path / "logs").result
               for task in tasks.values()]
    for r in results:
        assert r.status == "ok", (r.task_id, r.info)
    by_task = {r.task_id: r for r in results}
    # The grader read the transcript: the command the scripted model ran through the harness's tool.
    total = by_task["task_01_total"].info["verifier"]
    assert total["details"]["criteria"] == {"file_created": 1.0, "sum_correct": 1.0, "ran_a_command": 1.0}
    assert by_task["task_02_report"].info["verifier"]["details"]["criteria"] == {"report_exists": 1.0, "mentions_review": 1.0}
    # The judge's prompt was built in the worker, beside the workspace: task, transcript, rubric.
    prompt = by_task["task_02_report"].info["judge"]["prompt"]
    assert "Read `notes/status.md`" in prompt and "report.txt" in prompt and "Criterion 1: Faithful" in prompt
    assert "printf 'Prefix shared once" in by_task["task_03_haiku"].info["judge"]["prompt"]
    judge = ScriptedJudge('{"scores": {"faithful": 1.0, "brief": 0.0}, "total": 0.5, "notes": "long"}')
    judge_results(results, tasks, judge)
    assert {r.task_id: r.reward for r in results} == {"task_01_total": 1.0, "task_02_report": pytest.approx(0.8),
                                                      "task_03_haiku": 0.5}
    assert len(judge.prompts) == 2
    return by_task


needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("socat") is None,
                                 reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)")


@needs_bwrap
def test_pinchbench_tasks_through_mini_swe_agent(tmp_path):
    by_task = _run_suite_through("mini-swe-agent", tmp_path)
    # mini-swe-agent keeps no log clawfast reads: the proxy built the transcript from the recorded calls.
    assert by_task["task_01_total"].info["timings"]["transcript"] > 0


@pytest.mark.harness
@needs_bwrap
@pytest.mark.skipif(shutil.which("npm") is None, reason="npm installs the harness (Debian: apt-get install npm)")
def test_pinchbench_tasks_through_openclaw(tmp_path):
    by_task = _run_suite_through("openclaw", tmp_path)
    # OpenClaw's own session log was read: every assistant turn in it is one the model produced.
    assert all("transcript" not in r.info for r in by_task.values()), [r.info.get("transcript") for r in by_task.values()]


@needs_bwrap
def test_clawfast_eval_reports_judged_and_not_judged(tmp_path, capsys):
    import json

    from clawfast.cli import main
    from clawfast.embedded import ensure_embedded_model

    config = write_eval_config(tmp_path, f"pinchbench:{SUITE}")
    model = ensure_embedded_model()
    assert main(["eval", str(config), "--checkpoint", str(model), "--out", str(tmp_path / "e1"), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    # No judge: the two tasks with a rubric are not judged and stay out of pass@1; the automated one is in.
    assert (metrics["rollouts_all"], metrics["rollouts"], metrics["not_judged"], metrics["judged"]) == (3.0, 1.0, 2.0, 0.0)
    assert set(k for k in metrics if k.startswith("reward_task/")) == {"reward_task/task_01_total"}
    assert "pass@1_suite/pinchbench" in metrics and "pass@1_category/data" in metrics
    lines = [json.loads(line) for line in (tmp_path / "e1" / "scores.jsonl").read_text().splitlines()]
    assert sorted((r["task_id"], r["score"]["judge"]) for r in lines) == [
        ("task_01_total", "no rubric"), ("task_02_report", "not judged"), ("task_03_haiku", "not judged")]
    assert all("## Grading Rubric" in r["judge"]["prompt"] for r in lines if r["task_id"] != "task_01_total")

    # The embedded model as the judge: it answers no verdict, so those parts are judge errors, said so.
    assert main(["eval", str(config), "--checkpoint", str(model), "--out", str(tmp_path / "e2"),
                 "--set", f'eval.judge.model_dir="{model}"', "--set", "eval.judge.max_tokens=16"]) == 0
    out = capsys.readouterr().out
    assert "judged 0  not judged 0  judge errors 2" in out and "per suite" in out and "pinchbench" in out
    lines = [json.loads(line) for line in (tmp_path / "e2" / "scores.jsonl").read_text().splitlines()]
    verdicts = [r["judge"]["verdict"] for r in lines if r["task_id"] != "task_01_total"]
    assert all(v["error"] and v["prompt"] == r["judge"]["prompt"] for v, r in zip(verdicts, lines[1:]))


def test_training_refuses_tasks_only_a_judge_scores():
    from clawfast.train.data import check_trainable

    tasks = {t.id: t for t in load_suite(f"pinchbench:{SUITE}")}
    with pytest.raises(ValueError, match=r"1 training task\(s\) are scored by a judge alone.*: task_03_haiku\. "):
        check_trainable(tasks)
    # Hybrid tasks train on their verifier's part.
    check_trainable({k: v for k, v in tasks.items() if k != "task_03_haiku"})
