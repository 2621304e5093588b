"""ClawGym-format task folders: the loader, its errors, the split rules, the reward protocol in real
bwrap sandboxes (graded rewards, sub-scores, broken scripts), and `clawfast tasks check --no-oracle`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from clawfast.cli import main
from clawfast.tasks import SubprocessRunner, TaskFormatError, load_suite, run_verifier
from clawfast.tasks.clawgym import load_clawgym, parse_spec
from clawfast.tasks.suite_spec import hash_split
from clawfast.tasks.sandbox_runner import SandboxRunner
from clawfast.tasks.verify import PAYLOAD_FILE

from .clawgym_folders import (
    AVERAGING_REWARD_SH,
    MOUNT,
    write_notes_task,
    write_suite,
    write_sum_task,
    write_task,
)
from .eval_config import write_eval_config


# sha256("task_000i")[:8] / 2^64 for i = 0..7: 0.891, 0.148, 0.080, 0.541, 0.751, 0.206, 0.768, 0.611.
KNOWN_SPLITS = ["train", "eval", "eval", "train", "train", "eval", "train", "train"]


@pytest.fixture(scope="module")
def runner():
    with SandboxRunner() as r:
        yield r


def _solve_sum(workspace: Path, answer: str) -> None:
    (workspace / "output").mkdir()
    (workspace / "output" / "answer.txt").write_text(answer + "\n")


# -- the loader ----------------------------------------------------------------------------------


def test_a_folder_loads_as_tasks_with_their_workspace_at_the_mount_dir(tmp_path):
    suite = write_suite(tmp_path / "suite")
    tasks = load_suite(f"clawgym:{suite}", "train")
    assert [t.id for t in tasks] == ["notes_0000", "sum_0000", "sum_0001"]
    by_id = {t.id: t for t in tasks}
    s = by_id["sum_0000"]
    assert s.workdir == MOUNT and s.workspace_dir == suite / "sum_0000" / "input_files"
    assert s.instruction.startswith("Add the numbers") and s.oracle == ()
    assert s.tags == {"category": "data", "grading_type": "automated", "split": "train", "suite": "clawgym"}
    notes = by_id["notes_0000"]  # no input files and no input_mount_dir: the default mount dir
    assert notes.workspace_dir is None and notes.workdir == MOUNT and notes.category == "writing"
    assert notes.verifier.has_subscores
    # Without ?eval= the folder is one split: whichever is asked for.
    assert [t.split for t in load_suite(f"clawgym:{suite}", "eval")] == ["eval"] * 3


def test_an_empty_category_is_uncategorized_and_a_single_task_folder_loads(tmp_path):
    folder = write_task(tmp_path, "t_1", "Do it.", reward_sh="echo 1\n")
    (task,) = load_clawgym(f"clawgym:{folder}")
    assert task.category == "uncategorized" and task.id == "t_1" and not task.verifier.has_subscores


def test_hash_split_is_deterministic_and_partitions_the_folder(tmp_path):
    root = tmp_path / "suite"
    root.mkdir()
    for i in range(40):
        write_task(root, f"task_{i:04d}", "Do it.", reward_sh="echo 1\n")
    spec = f"clawgym:{root}?eval=0.25"
    train = {t.id for t in load_suite(spec, "train")}
    held_out = {t.id for t in load_suite(spec, "eval")}
    assert train and held_out and not train & held_out and len(train | held_out) == 40
    assert held_out == {f"task_{i:04d}" for i in range(40) if hash_split(f"task_{i:04d}", 0.25) == "eval"}
    assert {t.id: t.split for t in load_suite(spec)} == {**{i: "train" for i in train}, **{i: "eval" for i in held_out}}
    # A pure function of the id (SHA-256, not Python's per-process hash): fixed values pin the rule.
    assert [hash_split(f"task_{i:04d}", 0.5) for i in range(8)] == KNOWN_SPLITS
    assert parse_spec(f"clawgym:{root}?eval=0.25") == (root, 0.25)


@pytest.mark.parametrize("spec, message", [
    ("clawgym:", "no path"),
    ("clawgym:/x?eval=1.5", "strictly between 0 and 1"),
    ("clawgym:/x?eval=abc", "not a number"),
    ("clawgym:/x?split=eval", "unknown option 'split'"),
])
def test_bad_suite_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def _break(kind: str, root: Path) -> str:
    """Make one bad folder of kind `kind` under `root`; returns what the error must name."""
    if kind == "missing reward.sh":
        folder = write_sum_task(root, "bad")
        (folder / "reward" / "reward.sh").unlink()
        return "reward/reward.sh is missing"
    if kind == "bad json":
        folder = write_sum_task(root, "bad")
        (folder / "data_entry.json").write_text('{"task_id": "bad", ')
        return "invalid JSON"
    if kind == "unknown grading type":
        write_task(root, "bad", "Do it.", reward_sh="echo 1\n", grading_type="llm_judge")
        return "'metadata.grading_type': 'llm_judge' is not supported"
    if kind == "missing user_query":
        folder = write_sum_task(root, "bad")
        entry = json.loads((folder / "data_entry.json").read_text())
        del entry["user_query"]
        (folder / "data_entry.json").write_text(json.dumps(entry))
        return "'user_query': is required"
    if kind == "mount dir without input_files":
        write_task(root, "bad", "Do it.", reward_sh="echo 1\n", extra={"input_mount_dir": MOUNT})
        return "'input_mount_dir': is set but"
    if kind == "relative mount dir":
        write_task(root, "bad", "Do it.", reward_sh="echo 1\n", inputs={"a.txt": "a"}, mount=False,
                   extra={"input_mount_dir": "workspace"})
        return "normalised absolute path"
    if kind == "unknown key":
        write_task(root, "bad", "Do it.", reward_sh="echo 1\n", extra={"timeout_s": 5})
        return "'timeout_s': unknown key"
    if kind == "bad id":
        write_task(root, "bad id", "Do it.", reward_sh="echo 1\n", folder="bad")
        return "field 'id'"
    if kind == "stray file":
        (root / "README.md").write_text("hi")
        return "README.md is not a task folder"
    if kind == "folder of suites":
        write_sum_task(root / "clawgym_eval", "inner")
        return "point the suite at"
    if kind == "duplicate ids":
        write_task(root, "sum_0000", "Do it.", reward_sh="echo 1\n", folder="zz_copy")  # a good folder's id
        return "is also the id of"
    raise AssertionError(kind)


KINDS = ["missing reward.sh", "bad json", "unknown grading type", "missing user_query",
         "mount dir without input_files", "relative mount dir", "unknown key", "bad id", "stray file",
         "folder of suites", "duplicate ids"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_folder_is_an_error_naming_it_never_a_skip(kind, tmp_path):
    root = write_suite(tmp_path / "suite")
    message = _break(kind, root)
    with pytest.raises(TaskFormatError, match=message) as err:
        load_suite(f"clawgym:{root}")
    if kind not in ("stray file",):
        assert str(root) in str(err.value)
    # The CLI says the same and exits 2.
    assert main(["tasks", "list", "--suite", f"clawgym:{root}"]) == 2


# -- the reward protocol, in real sandboxes --------------------------------------------------------


def test_graded_rewards_and_subscores(runner, tmp_path):
    (task,) = load_clawgym(f"clawgym:{write_sum_task(tmp_path / 's', numbers='1 2 3 4')}")
    cases = {"nothing": (None, 0.0, {"file_exists": 0.0, "content_correct": 0.0}),
             "wrong": ("7", 0.5, {"file_exists": 1.0, "content_correct": 0.0}),
             "right": ("10", 1.0, {"file_exists": 1.0, "content_correct": 1.0})}
    for name, (answer, reward, subscores) in cases.items():
        ws = task.materialize(tmp_path / name)
        if answer is not None:
            _solve_sum(ws, answer)
        v = run_verifier(task, ws, runner)
        assert (v.status, v.score, v.details) == ("ok", reward, {"subscores": subscores}), (name, v)
        assert not (ws / "reward").exists()  # the scripts were copied into the verifier's copy only


def test_the_verifier_sees_the_workspace_at_the_mount_dir(runner, tmp_path):
    (task,) = load_clawgym(f"clawgym:{write_notes_task(tmp_path / 's')}")
    ws = task.materialize(tmp_path / "ws")
    (ws / "notes.md").write_text("clawfast trains agents\n")
    v = run_verifier(task, ws, runner)
    assert v.status == "ok" and v.score == 1.0
    assert v.details["subscores"] == {"at_mount_dir": 1.0, "notes_exist": 1.0, "mentions_clawfast": 1.0}
    assert not Path(MOUNT).exists() or not (Path(MOUNT) / "notes.md").exists()  # nothing written on the host


def test_a_planted_reward_folder_is_replaced_by_the_tasks_own(runner, tmp_path):
    (task,) = load_clawgym(f"clawgym:{write_sum_task(tmp_path / 's')}")
    ws = task.materialize(tmp_path / "ws")
    (ws / "reward").mkdir()
    (ws / "reward" / "reward.sh").write_text("echo 1.0\n")
    (ws / "reward" / "check.py").write_text('print(\'{"file_exists": 1, "content_correct": 1}\')\n')
    v = run_verifier(task, ws, runner)
    assert (v.status, v.score) == ("ok", 0.0)



def test_a_module_the_agent_left_in_the_workspace_is_not_what_the_reward_scripts_import(runner, tmp_path):
    """ClawGym's reward.sh pipes check.py's JSON through ``python3 -c 'import json, ...'`` in the
    agent's workspace: a json.py left there was imported instead and printed 1.0 for a task not done.
    The honest solution still scores 1.0."""
    (task,) = load_clawgym(f"clawgym:{write_sum_task(tmp_path / 's', numbers='1 2 3 4')}")
    ws = task.materialize(tmp_path / "hack")
    (ws / "json.py").write_text("import os, sys\nsys.stdin.read()\nos.write(1, b'1.0\\n')\nos._exit(0)\n")
    assert (run_verifier(task, ws, runner).score) == 0.0
    ws = task.materialize(tmp_path / "honest")
    (ws / "output").mkdir()
    (ws / "output" / "answer.txt").write_text("10\n")
    (ws / "json.py").write_text("raise SystemExit('imported')\n")  # beside an honest answer: never imported
    v = run_verifier(task, ws, runner)
    assert (v.status, v.score) == ("ok", 1.0), v


@pytest.mark.parametrize("planted", ["link", "folder"])
def test_whatever_the_agent_left_at_the_payloads_name_is_replaced(runner, tmp_path, planted):
    # The payload is written on the host: through a planted link it would overwrite a host file; a
    # folder in its place made the write raise, which lost the rollout as a sandbox failure.
    (task,) = load_clawgym(f"clawgym:{write_sum_task(tmp_path / 's', numbers='1 2 3 4')}")
    ws = task.materialize(tmp_path / "ws")
    _solve_sum(ws, "10")
    host_file = tmp_path / "host.txt"
    host_file.write_text("host\n")
    if planted == "link":
        (ws / PAYLOAD_FILE).symlink_to(host_file)
    else:
        (ws / PAYLOAD_FILE).mkdir()
    v = run_verifier(task, ws, runner)
    assert (v.status, v.score) == ("ok", 1.0), v
    assert host_file.read_text() == "host\n"

@pytest.mark.parametrize("script, error, kept", [
    ("echo partial output\nexit 3\n", "exited with status 3", "partial output"),
    ("echo 'score: high'\n", "not a number", "score: high"),
    ("echo 1.5\n", "in [0, 1]", "1.5"),
    ("echo nan\n", "in [0, 1]", "nan"),
    ("true\n", "printed nothing", ""),
    ("echo started\nsleep 30\n", "timed out", "started"),
])
def test_a_broken_reward_script_is_a_verifier_error_with_its_output_kept(runner, tmp_path, script, error, kept):
    (task,) = load_clawgym(f"clawgym:{write_task(tmp_path / 's', 'broken', 'Do it.', reward_sh=script)}")
    task = dataclasses.replace(task, verifier=dataclasses.replace(task.verifier, timeout=2.0))
    v = run_verifier(task, task.materialize(tmp_path / "ws"), runner)
    assert v.status == "verifier_error" and v.score == 0.0 and error in v.error
    assert kept in v.stdout


def test_broken_subscores_leave_the_reward_standing(runner, tmp_path):
    folder = write_task(tmp_path / "s", "t", "Do it.", reward_sh="echo 0.25\n", check_py="print('not json')\n")
    (task,) = load_clawgym(f"clawgym:{folder}")
    v = run_verifier(task, task.materialize(tmp_path / "ws"), runner)
    assert (v.status, v.score) == ("ok", 0.25) and "not JSON" in v.details["subscores_error"]


def test_a_chat_graded_script_reads_the_payload(runner, tmp_path):
    script = ('python3 -c \'import json, os; p = json.load(open(os.environ["OPENCLAW_REWARD_PAYLOAD"])); '
              'print(1.0 if "DONE" in p["final_message"] and p["task_id"] == "chat" else 0.0)\'\n')
    (task,) = load_clawgym(f"clawgym:{write_task(tmp_path / 's', 'chat', 'Say DONE.', reward_sh=script)}")
    assert run_verifier(task, task.materialize(tmp_path / "a"), runner, final_message="All DONE.").score == 1.0
    assert run_verifier(task, task.materialize(tmp_path / "b"), runner, final_message="no").score == 0.0


def test_a_plain_subprocess_refuses_a_task_placed_at_an_absolute_path(tmp_path):
    (task,) = load_clawgym(f"clawgym:{write_sum_task(tmp_path / 's')}")
    with pytest.raises(ValueError, match=f"must lie at {MOUNT}"):
        run_verifier(task, task.materialize(tmp_path / "ws"), SubprocessRunner())


# -- clawfast tasks check --no-oracle -------------------------------------------------------------


def test_check_no_oracle_json_and_table(tmp_path, capsys):
    suite = write_suite(tmp_path / "suite")
    assert main(["tasks", "check", "--suite", f"clawgym:{suite}", "--no-oracle", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["tasks"] == [{"id": "notes_0000", "reward": pytest.approx(1 / 3), "error": None},
                            {"id": "sum_0000", "reward": 0.0, "error": None},
                            {"id": "sum_0001", "reward": 0.0, "error": None}]
    assert out["summary"] == {"tasks": 3, "verifier_errors": 0, "mean_reward": pytest.approx(1 / 9)}
    assert "verifying in bwrap sandboxes" in captured.err and MOUNT in captured.err

    write_task(suite, "broken", "Do it.", reward_sh="exit 1\n")
    assert main(["tasks", "check", "--suite", f"clawgym:{suite}", "--no-oracle"]) == 1
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["id", "split", "category", "reward", "subscores", "seconds", "error"]
    assert "4 tasks, 1 verifier errors, mean do-nothing reward 0.111" in table
    assert "at_mount_dir=1" in table and "exited with status 1" in table


def test_check_without_no_oracle_says_the_suite_has_no_oracles(tmp_path, capsys):
    suite = write_suite(tmp_path / "suite")
    assert main(["tasks", "check", "--suite", f"clawgym:{suite}"]) == 2
    assert "have no oracle" in capsys.readouterr().err



# -- through a real harness -------------------------------------------------------------------------

# check.py of the probe task: the sum is right, the agent started at the mount dir, and none of the
# places where the task's reward scripts or the suite could be was visible to it (`ls` of each wrote
# found paths to found.txt and one "cannot access" line per missing one to missing.txt).
PROBE_CHECK_PY = """import json, sys
from pathlib import Path

ws = Path(sys.argv[1])
def read(name):
    return (ws / name).read_text() if (ws / name).is_file() else None
answer, pwd, found, missing = read("output/answer.txt"), read("pwd.txt"), read("found.txt"), read("missing.txt")
print(json.dumps({
    "answer_correct": 1.0 if answer is not None and answer.strip() == "10" else 0.0,
    "started_at_mount_dir": 1.0 if pwd is not None and pwd.strip() == str(ws) else 0.0,
    "reward_hidden": 1.0 if found == "" and missing is not None and missing.count("cannot access") == 4 else 0.0,
}))
"""


@pytest.mark.parametrize("harness", ["mini-swe-agent"] + [pytest.param(name, marks=pytest.mark.harness)
                                                        for name in ("claude-code", "openclaw", "codex")])
def test_a_harness_works_at_the_mount_dir_and_cannot_find_the_reward_scripts(harness):
    import shutil
    import tempfile

    from clawfast.rollout.check import check_harness

    # The suite lies where the sandbox's read-only view of the host would show it (not under /tmp).
    suite = Path(tempfile.mkdtemp(prefix="clawfast-test-suite-", dir="/var/tmp"))
    try:
        folder = write_task(suite, "probe_0000", "Add the numbers in input/numbers.txt into output/answer.txt.",
                            reward_sh=AVERAGING_REWARD_SH, check_py=PROBE_CHECK_PY,
                            inputs={"input/numbers.txt": "1 2 3 4"})
        (task,) = load_clawgym(f"clawgym:{suite}")
        places = ["reward/reward.sh", f"{MOUNT}/reward/reward.sh", str(folder / "reward" / "reward.sh"),
                  str(folder / "data_entry.json")]
        # Plain commands: Claude Code's Bash tool refuses compound ones it cannot parse for certain.
        task = dataclasses.replace(task, oracle=(
            "pwd > pwd.txt",
            f"ls -d {' '.join(places)} > found.txt 2> missing.txt",
            f"ls -A {suite} >> found.txt",
            "mkdir -p output",
            "python3 -c \"print(sum(int(x) for x in open('input/numbers.txt').read().split()))\" > output/answer.txt",
        ))
        report = check_harness(harness, task=task)
    finally:
        shutil.rmtree(suite, ignore_errors=True)
    result = report.result
    verdict = result.info["verifier"]
    assert verdict["details"]["subscores"] == {"answer_correct": 1.0, "started_at_mount_dir": 1.0,
                                               "reward_hidden": 1.0}, verdict
    assert (result.status, result.reward) == ("ok", 1.0)


def test_clawfast_eval_on_a_clawgym_folder_reports_reward_and_pass_rate_per_category(tmp_path, capsys):
    from clawfast.embedded import ensure_embedded_model

    suite = write_suite(tmp_path / "suite")
    config = write_eval_config(tmp_path, f"clawgym:{suite}")
    model = ensure_embedded_model()
    assert main(["eval", str(config), "--checkpoint", str(model), "--out", str(tmp_path / "e1"), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["rollouts"] == 3.0 and metrics["verifier_errors"] == 0.0
    assert set(k for k in metrics if k.startswith(("pass@1_category/", "reward_category/"))) == {
        "pass@1_category/data", "pass@1_category/writing", "reward_category/data", "reward_category/writing"}
    assert {k for k in metrics if k.startswith("reward_task/")} == {
        "reward_task/notes_0000", "reward_task/sum_0000", "reward_task/sum_0001"}
    # The notes task's sub-score for the workspace's place is earned whatever the model writes.
    assert metrics["reward_task/notes_0000"] >= 1 / 3 and metrics["subscore/at_mount_dir"] == 1.0
    mean = sum(metrics[f"reward_task/{t}"] for t in ("notes_0000", "sum_0000", "sum_0001")) / 3
    assert metrics["reward/mean"] == pytest.approx(mean)

    assert main(["eval", str(config), "--checkpoint", str(model), "--out", str(tmp_path / "e2")]) == 0
    out = capsys.readouterr().out
    assert f"suite clawgym:{suite}" in out and "mean score" in out and "grader errors 0" in out
    assert "per category" in out and "writing" in out and "data" in out


def test_the_local_backend_marks_a_placed_task_and_the_batch_runs_on(tmp_path):
    from clawfast.embedded import ensure_embedded_model
    from clawfast.rollout import ORACLE, HarnessConfig, RolloutService, RolloutSpec, SandboxConfig
    from clawfast.rollout.check import check_task

    (placed,) = load_clawgym(f"clawgym:{write_sum_task(tmp_path / 's')}")
    placed = dataclasses.replace(placed, oracle=("mkdir -p output && echo 10 > output/answer.txt",))
    plain = check_task()
    with RolloutService(ORACLE, ensure_embedded_model(), records_dir=tmp_path / "records",
                        harnesses=HarnessConfig({"mini-swe-agent": {"timeout_s": 120}}, timeout_s=120),
                        sandbox=SandboxConfig("local"), oracle_tasks=[placed, plain]) as service:
        bad, good = service.run([RolloutSpec(placed, "mini-swe-agent", 0), RolloutSpec(plain, "mini-swe-agent", 0)])
    assert (bad.status, bad.reward, bad.info["sandbox_attempts"]) == ("sandbox_error", 0.0, 1)
    assert "sandbox refused the task" in bad.info["error"] and "local backend cannot" in bad.info["error"]
    assert (good.status, good.reward) == ("ok", 1.0)


def test_a_config_resolves_a_relative_clawgym_suite_and_keeps_its_options(tmp_path, monkeypatch):
    from clawfast.train.config_file import load_config
    from clawfast.train.data import load_tasks

    write_suite(tmp_path / "cfg" / "suite")
    (tmp_path / "cfg" / "run.toml").write_text('[tasks]\nsuite = "clawgym:suite?eval=0.5"\n')
    monkeypatch.chdir(tmp_path)  # not the config's directory
    config = load_config(tmp_path / "cfg" / "run.toml")
    assert config.tasks.suite == f"clawgym:{(tmp_path / 'cfg' / 'suite').resolve()}?eval=0.5"
    train, held_out = load_tasks(config, "train"), load_tasks(config, "eval")
    assert not set(train) & set(held_out)
    assert sorted({*train, *held_out}) == ["notes_0000", "sum_0000", "sum_0001"]


def test_a_broken_reward_script_makes_the_rollout_a_verifier_error(tmp_path):
    from clawfast.rollout.check import check_harness

    folder = write_task(tmp_path / "s", "broken_0000", "Do it.", reward_sh="echo 'graded: yes'\n",
                        inputs={"a.txt": "a"})
    (task,) = load_clawgym(f"clawgym:{folder}")
    result = check_harness("mini-swe-agent", task=dataclasses.replace(task, oracle=("cat a.txt",))).result
    assert (result.status, result.reward) == ("verifier_error", 0.0)
    assert "not a number" in result.info["verifier"]["error"] and "graded: yes" in result.info["verifier"]["stdout"]


# -- hybrid tasks: 0.7 reward.sh + 0.3 rubric --------------------------------------------------------

RUBRIC = {
    "eval_type": "llm_rubric", "score_options": [0, 0.25, 0.5, 0.75, 1], "eval_input": "Judge the notes.",
    "rules": [
        {"name": "Tone", "file_path": "notes.md", "scores": {"0": "rude", "0.5": "flat", "1": "warm"}},
        {"name": "Depth", "file_path": f"{MOUNT}/notes.md", "scores": {"1": "explains why", "0": "a list"}},
    ],
}


def _hybrid(root: Path, reward: str, rubric=RUBRIC) -> Path:
    path = write_task(root, "hyb", "Write notes.md about clawfast.", reward_sh=f"echo {reward}\n",
                      grading_type="hybrid", inputs={"seed.txt": "x"})
    if rubric is not None:
        (path / "reward" / "rubric.json").write_text(json.dumps(rubric))
    return path


def test_a_hybrid_task_scores_seven_tenths_code_and_three_tenths_rubric(runner, tmp_path):
    from clawfast.tasks.judge import Verdict
    from clawfast.tasks.scoring import combine

    (task,) = load_clawgym(f"clawgym:{_hybrid(tmp_path / 's', '0.5')}")
    assert task.tags["grading_type"] == "hybrid" and task.rubric.weight == 0.3
    # Rules become the judge's text; their files are named relative to the workspace, once.
    assert task.rubric.files == ("notes.md",)
    assert task.rubric.text.splitlines() == ["Judge the notes.", "### Tone (file: notes.md)", "**Score 0**: rude",
                                             "**Score 0.5**: flat", "**Score 1**: warm",
                                             "### Depth (file: notes.md)", "**Score 0**: a list",
                                             "**Score 1**: explains why"]
    code = run_verifier(task, task.materialize(tmp_path / "ws"), runner)
    assert (code.status, code.score) == ("ok", 0.5)
    for judged, expected in ((0.25, 0.7 * 0.5 + 0.3 * 0.25), (1.0, 0.7 * 0.5 + 0.3), (0.0, 0.35)):
        score = combine(task, code.score, Verdict("p", "r", judged))
        assert (score.score, score.code, score.judged, score.judge) == (expected, 0.5, judged, "judged")
    assert (combine(task, code.score, None).score, combine(task, code.score, None).judge) == (None, "not judged")


@pytest.mark.parametrize("rubric, grading, message", [
    (None, "hybrid", "a hybrid task needs reward/rubric.json"),
    ({**RUBRIC, "eval_type": "score"}, "hybrid", "field 'eval_type'"),
    ({**RUBRIC, "rules": []}, "hybrid", "field 'rules'"),
    ({**RUBRIC, "rules": [{"name": "x", "file_path": "/etc/passwd", "scores": {"1": "y"}}]}, "hybrid",
     r"field 'rules\[0\].file_path': '/etc/passwd' is not inside the workspace"),
    ({**RUBRIC, "rules": [{"name": "x", "scores": {"high": "y"}}]}, "hybrid", r"field 'rules\[0\].scores'"),
    # A blank name, no levels, or levels float() reads but that are no score: nothing to grade by.
    ({**RUBRIC, "rules": [{"name": "  ", "scores": {"1": "y"}}]}, "hybrid",
     r"field 'rules\[0\].name': must be a non-blank"),
    ({**RUBRIC, "rules": [{"name": "x", "scores": {}}]}, "hybrid",
     r"field 'rules\[0\].scores': must hold at least one"),
    ({**RUBRIC, "rules": [{"name": "x", "scores": {"0": "n", "NaN": "y"}}]}, "hybrid", r"got 'NaN'"),
    ({**RUBRIC, "rules": [{"name": "x", "scores": {"Infinity": "y"}}]}, "hybrid", r"got 'Infinity'"),
    ({**RUBRIC, "rules": [{"name": "x", "scores": {"1e999": "y"}}]}, "hybrid", r"got '1e999'"),
    (RUBRIC, "automated", "is 'automated' but reward/rubric.json exists"),
])
def test_bad_rubrics_are_errors_naming_the_file_and_field(tmp_path, rubric, grading, message):
    path = _hybrid(tmp_path / "s", "1", rubric)
    if grading != "hybrid":
        entry = json.loads((path / "data_entry.json").read_text())
        entry["metadata"]["grading_type"] = grading
        (path / "data_entry.json").write_text(json.dumps(entry))
    with pytest.raises(TaskFormatError, match=message) as err:
        load_clawgym(f"clawgym:{path}")
    assert str(path) in str(err.value)


def test_a_link_planted_toward_the_reward_scripts_is_removed_before_they_run(runner, tmp_path):
    """reward/ is placed in the workspace's copy under the name ClawGym's scripts run by: notes.md
    left as a link to reward/check.py (whose text holds the word the check looks for) would score
    without a line written. The link goes; the do-nothing share of the score stays."""
    (task,) = load_clawgym(f"clawgym:{write_notes_task(tmp_path / 'n')}")
    ws = task.materialize(tmp_path / "ws")
    (ws / "notes.md").symlink_to("reward/check.py")
    v = run_verifier(task, ws, runner)
    assert (v.status, v.score) == ("ok", pytest.approx(1 / 3)), v
    honest = task.materialize(tmp_path / "honest")
    (honest / "notes.md").write_text("clawfast trains agents through their harnesses.\n")
    assert run_verifier(task, honest, runner).score == 1.0
