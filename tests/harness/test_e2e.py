"""Real harnesses end to end: the harness (installed pinned, unmodified) runs in a bubblewrap sandbox
whose only peer is the real proxy; the scripted engine replays a clawbench-mini task's oracle
through the harness's own shell tool; the verifier scores the final workspace in another sandbox.

Each test needs its harness installed in the cache (`clawfast harness install NAME`; the first run
installs it, which needs the package registry). mini-swe-agent (PyPI, into its own venv) runs by
default; the npm harnesses (Claude Code, OpenClaw, Codex) are marked `harness`.
"""

from __future__ import annotations

import os
import shutil

import pytest

from clawfast.harness import get_harness
from clawfast.rollout.check import check_harness, check_task
from clawfast.threads import CAUSES, reconstruct

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("socat") is None,
    reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)",
)
needs_npm = pytest.mark.skipif(shutil.which("npm") is None, reason="npm installs the harness (Debian: apt-get install npm)")


def run_check(name: str, tmp_path, *, exact_prefix: bool = True, model_dir=None):
    task = check_task()
    report = check_harness(name, task=task, timeout_s=300, logs_dir=tmp_path / "logs", model_dir=model_dir)
    result = report.result
    assert (result.status, result.reward) == ("ok", 1.0), "\n".join(report.lines())
    # One main call per scripted turn: each oracle command, then the final answer; by structure, and
    # continuing exactly (what `clawfast fidelity` reports for this rollout).
    threads = reconstruct(result.calls)
    main = [t for t in threads.calls if t.kind == "main"]
    assert len(main) == len(task.oracle) + 1 == report.turns_scripted, "\n".join(report.lines())
    assert threads.continuity >= 0.999 and all(d.cause in CAUSES for d in threads.divergences), threads
    # Token in, token out: every sampled output is in the next prompt verbatim ...
    assert report.pairs and all(p.output_kept for p in report.pairs), "\n".join(report.lines())
    if exact_prefix:
        # ... and, for a harness that does not edit its history, as an exact prefix.
        assert all(p.exact for p in report.pairs), "\n".join(report.lines())
    assert report.ok
    # The harness's own logs were kept with the rollout.
    assert (tmp_path / "logs" / result.rollout_id / "stdout").is_file()
    return report


def snapshot(root) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under `root`, without following links."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return out


@needs_bwrap
def test_mini_swe_agent_oracle_replay_scores_1(tmp_path):
    install = get_harness("mini-swe-agent").installation
    before = snapshot(install.root)
    report = run_check("mini-swe-agent", tmp_path)
    assert snapshot(install.root) == before  # the install is mounted read-only and nothing wrote to it
    assert report.result.info["artifacts"] == ["home/mini.traj.json"]
    assert all(c.metadata.get("protocol") == "chat" for c in report.result.calls)


@pytest.mark.harness
@needs_bwrap
@needs_npm
def test_claude_code_oracle_replay_scores_1(tmp_path):
    report = run_check("claude-code", tmp_path)
    assert all(c.metadata.get("protocol") == "anthropic" for c in report.result.calls)


@needs_bwrap
def test_mini_swe_agent_continues_exactly_on_smollm2s_template(smollm2_dir, tmp_path):
    """The quickstart's model: no special token for <tool_call> or <tool_response>, its own BPE; the
    proxy's splicing and parsing must hold all the same."""
    report = run_check("mini-swe-agent", tmp_path, model_dir=smollm2_dir)
    assert all(c.metadata.get("protocol") == "chat" for c in report.result.calls)


@pytest.mark.harness
@needs_bwrap
@needs_npm
def test_claude_code_continues_exactly_on_smollm2s_template(smollm2_dir, tmp_path):
    report = run_check("claude-code", tmp_path, model_dir=smollm2_dir)
    assert all(c.metadata.get("protocol") == "anthropic" for c in report.result.calls)
    assert any(a.endswith(".jsonl") for a in report.result.info["artifacts"])  # the session transcript


@pytest.mark.harness
@needs_bwrap
@needs_npm
def test_openclaw_oracle_replay_scores_1(tmp_path):
    # The adapter denies the two tools whose runtime-context message OpenClaw re-inserts after the
    # newest turn on every call; without that consecutive prompts would share a prefix only up to it.
    report = run_check("openclaw", tmp_path)
    assert all(c.metadata.get("protocol") == "chat" for c in report.result.calls)
    assert any(a.endswith(".sqlite") for a in report.result.info["artifacts"])  # its session store


@pytest.mark.harness
@needs_bwrap
@needs_npm
def test_codex_oracle_replay_scores_1(tmp_path):
    report = run_check("codex", tmp_path)
    assert all(c.metadata.get("protocol") == "responses" for c in report.result.calls)
    assert any("sessions" in a for a in report.result.info["artifacts"])


@needs_bwrap
@needs_npm
@pytest.mark.harness
@pytest.mark.parametrize("name", ["codex", "openclaw"])
def test_call_budget_ends_harnesses_without_a_turn_limit(name, tmp_path):
    """`codex exec` and OpenClaw have no turn limit of their own: the proxy's per-rollout call budget is
    theirs. With an oracle of 8 no-op commands before the real ones and a budget of 3, the harness gets
    a 400 on its fourth call and exits; the rollout ends at once with its 3 calls, scored as usual, and
    its error carries the reason the harness itself reported (`Harness.exit_reason`)."""
    import dataclasses

    from clawfast.embedded import ensure_embedded_model
    from clawfast.rollout import ORACLE, HarnessConfig, RolloutService, RolloutSpec, Sampling

    task = check_task()
    task = dataclasses.replace(task, oracle=("true",) * 8 + tuple(task.oracle))
    with RolloutService(ORACLE, ensure_embedded_model(), records_dir=tmp_path / "records",
                        harnesses=HarnessConfig({name: {"timeout_s": 120, "max_turns": 30}}, timeout_s=120,
                                                logs_dir=tmp_path / "logs"), oracle_tasks=[task]) as service:
        [result] = service.run([RolloutSpec(task, name, 0)], Sampling(max_calls=3))
    assert len(result.calls) == 3
    assert result.status == "harness_error" and result.reward == 0.0  # refused before the real commands ran
    assert result.info["timings"]["harness"] < 60
    logs = (tmp_path / "logs" / result.rollout_id / "stdout").read_text() + (tmp_path / "logs" / result.rollout_id / "stderr").read_text()
    assert "budget of 3 model calls is spent" in logs
    assert result.info["error"].startswith(f"harness exited with status {result.info['exit_code']}; it reported ")
    assert "budget of 3 model calls is spent" in result.info["error"], result.info["error"]


@needs_bwrap
def test_mini_swe_agent_stopped_at_its_step_limit_is_a_harness_error(tmp_path):
    """mini-swe-agent exits 0 whatever ended its run; stopped at its step limit (max_turns 1, the
    oracle needing more) the rollout was ``ok``, where Claude Code's limit is a harness_error. Its
    trajectory's exit status says it did not finish; a run that submits is ``ok``."""
    import dataclasses

    from clawfast.embedded import ensure_embedded_model
    from clawfast.rollout import ORACLE, HarnessConfig, RolloutService, RolloutSpec

    task = check_task()
    task = dataclasses.replace(task, oracle=("true", "true") + tuple(task.oracle))
    results = {}
    for turns in (1, 30):
        with RolloutService(ORACLE, ensure_embedded_model(), records_dir=tmp_path / f"records{turns}",
                            harnesses=HarnessConfig({"mini-swe-agent": {"timeout_s": 120, "max_turns": turns}},
                                                    timeout_s=120), oracle_tasks=[task]) as service:
            [results[turns]] = service.run([RolloutSpec(task, "mini-swe-agent", 0)])
    stopped, finished = results[1], results[30]
    assert stopped.status == "harness_error"
    assert stopped.info["error"] == "harness exited with status 0 without finishing: exit status LimitsExceeded"
    assert (finished.status, finished.reward) == ("ok", 1.0)


@needs_bwrap
def test_mini_swe_agent_given_a_call_budget_ends_soon_after_it_is_spent(tmp_path):
    """mini-swe-agent's client retried the proxy's 400 for a spent budget ten times, waiting up to 60 s
    between: the run held its slot to the wall clock and ended a timeout. It gives up after three tries."""
    import dataclasses

    from clawfast.embedded import ensure_embedded_model
    from clawfast.rollout import ORACLE, HarnessConfig, RolloutService, RolloutSpec, Sampling

    task = check_task()
    task = dataclasses.replace(task, oracle=("true", "true") + tuple(task.oracle))
    with RolloutService(ORACLE, ensure_embedded_model(), records_dir=tmp_path / "records",
                        harnesses=HarnessConfig({"mini-swe-agent": {"timeout_s": 120, "max_turns": 30}}, timeout_s=120),
                        oracle_tasks=[task]) as service:
        [result] = service.run([RolloutSpec(task, "mini-swe-agent", 0)], Sampling(max_calls=1))
    assert result.status == "harness_error" and len(result.calls) == 1
    assert result.info["timings"]["harness"] < 45


_npm = [pytest.mark.harness, needs_npm]


@needs_bwrap
@pytest.mark.parametrize("name", ["mini-swe-agent", pytest.param("claude-code", marks=_npm),
                                  pytest.param("codex", marks=_npm), pytest.param("openclaw", marks=_npm)])
def test_an_instruction_that_starts_with_a_dash_is_the_prompt_not_an_option(name, tmp_path):
    """A task's instruction is data: one starting with '-' (a Markdown list, a flag the task talks about) must
    reach the model as the prompt. Before the adapters put it after `--`, `claude -p --version` printed the
    version and exited 0, and a leading `- ` was an unknown option."""
    import dataclasses

    task = check_task()
    task = dataclasses.replace(task, instruction="--version is not what this is about.\n- " + task.instruction)
    report = check_harness(name, task=task, timeout_s=300, logs_dir=tmp_path / "logs")
    # The scripted engine replays the oracle whatever the prompt says: a harness that took the instruction
    # for an option exits before its first call, and the do-nothing workspace scores 0.
    assert (report.result.status, report.result.reward) == ("ok", 1.0), "\n".join(report.lines())
