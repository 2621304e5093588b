"""`clawfast.threads.reconstruct` on rollouts built token by token in a chat-template shape, with no
marker string and every call tagged ``main``: side calls shaped like other harnesses' (compaction
with and without its own system prompt, title requests that carry the tools, summary labels, a
subagent with a subset of the tools, probes), retries, history edits and re-rendered turns. The
harness-traffic versions of these are in tests/harness/test_side_calls.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from clawfast.records import CallRecord
from clawfast.threads import reconstruct, with_kinds
from clawfast.tree import build_tree

START, END, SYSTEM, USER, ASSISTANT, TOOL = 1, 2, 3, 4, 5, 6
GEN = [START, ASSISTANT]  # the generation prompt every prompt ends with


class Session:
    """Calls of one rollout in a ChatML-like token shape: a message is START role content END and
    an answer is sampled after the generation prompt, ending with END (the stop token)."""

    def __init__(self, seed: int = 0, vocab: int = 5000) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.calls: list[CallRecord] = []

    def text(self, n: int) -> list[int]:
        return self.rng.integers(10, self.vocab, n).tolist()

    @staticmethod
    def msg(role: int, content: list[int]) -> list[int]:
        return [START, role, *content, END]

    def ask(self, history: list[int], answer: list[int] | None = None, *, finish: str = "stop") -> list[int]:
        """One call on `history` (messages); returns the answer turn as it is replayed later."""
        answer = self.text(int(self.rng.integers(12, 40))) + [END] if answer is None else answer
        self.calls.append(CallRecord("r", len(self.calls), "h", np.array(history + GEN), np.array(answer),
                                     -np.ones(len(answer)), finish_reason=finish))
        return GEN + answer


def kinds(calls) -> list[str]:
    return [t.kind for t in reconstruct(calls).calls]


def main_session(s: Session, steps: int, system: list[int], task: list[int]) -> list[int]:
    history = s.msg(SYSTEM, system) + s.msg(USER, task)
    for _ in range(steps):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    return history


def test_a_plain_chain_is_main_and_continues_exactly():
    s = Session()
    main_session(s, 6, s.text(300), s.text(30))
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] * 6
    assert [t.extends for t in rt.calls] == [None, 0, 1, 2, 3, 4]
    assert (rt.main_pairs, rt.exact_pairs, rt.continuity, rt.drift, rt.divergences) == (5, 5, 1.0, 0, [])


def test_compaction_with_the_main_system_prompt_and_no_marker():
    s = Session(1)
    system, task = s.text(300), s.text(30)
    history = main_session(s, 4, system, task)
    summary = s.ask(history + s.msg(USER, s.text(25)))  # the history plus a request, the same header
    restart = s.msg(SYSTEM, system) + s.msg(USER, task + summary[2:])
    history = restart
    for _ in range(3):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] * 4 + ["compaction"] + ["main"] * 3
    assert rt.calls[5].thread == "main" and rt.calls[5].extends is None
    [div] = rt.divergences
    assert (div.call_index, div.against, div.cause) == (5, 3, "compaction")
    assert rt.continuity == 1.0 and rt.main_pairs == 5


def test_a_compaction_whose_restart_keeps_the_summary_without_the_analysis_before_it():
    """Claude Code asks its compaction for an analysis, then the summary, and restarts from the summary
    text alone (tags stripped): the answer's last part is quoted, not its middle. The compaction is
    told apart and the calls after it stay main (they were a side thread, out of training)."""
    analysis_open, analysis_close, summary_open, summary_close = 7, 8, 9, 11
    s = Session(33)
    system, task = s.text(300), s.text(30)
    history = s.msg(SYSTEM, system) + s.msg(USER, task)
    for _ in range(3):
        last = s.ask(history)
        history = history + last + s.msg(TOOL, s.text(20))
    summary = s.text(120)
    s.ask(history + s.msg(USER, s.text(40)),
          [analysis_open, *s.text(120), analysis_close, summary_open, *summary, summary_close, END])
    history = s.msg(SYSTEM, system) + s.msg(USER, s.text(15) + summary) + last + s.msg(TOOL, s.text(20))
    for _ in range(3):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] * 3 + ["compaction"] + ["main"] * 3
    assert sorted((link.kind, link.source, link.target) for link in rt.links) == [("restarts", 3, 4), ("resumes", 2, 4)]


def test_a_subagent_whose_report_returns_without_its_thinking():
    """A thinking subagent's last answer is reasoning, then the report; the main thread gets the report
    alone. The subagent is one (it was a side thread with no link back, or, running longer than the
    main thread, taken for main), and its report returns into the main call that holds it."""
    think_open, think_close = 7, 8
    for steps, main_after in ((3, 2), (6, 1)):
        s = Session(6)
        system, task = s.text(300), s.text(30)
        history = s.msg(SYSTEM, system) + s.msg(USER, task)
        history = history + s.ask(history)  # delegates
        sub = s.msg(SYSTEM, system[:100] + s.text(30)) + s.msg(USER, s.text(25))
        for k in range(steps):
            report = s.text(60)
            answer = [think_open, *s.text(60), think_close, *report, END] if k == steps - 1 else None
            sub = sub + s.ask(sub, answer) + s.msg(TOOL, s.text(15))
        history = history + s.msg(TOOL, report)
        for _ in range(main_after):
            history = history + s.ask(history) + s.msg(TOOL, s.text(20))
        rt = reconstruct(s.calls)
        assert kinds(s.calls) == ["main"] + ["subagent"] * steps + ["main"] * main_after
        assert [(link.kind, link.source, link.target) for link in rt.links] == [("returns", steps, steps + 1)]


def test_a_subagents_own_compaction_restarts_it_and_its_report_returns_into_the_kept_retry():
    """A subagent compacts its context and goes on from the summary: the compaction call restarts the
    subagent's thread (the link was made for main threads only). Its report returns into a main call
    cut short and asked again on the same prompt: the link goes into the retry the thread goes on
    from (into the dead call, its credit was lost)."""
    s = Session(80)
    system, task = s.text(300), s.text(30)
    history = s.msg(SYSTEM, system) + s.msg(USER, task)
    for _ in range(2):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    history = history + s.ask(history)  # 2: delegates
    sub_system, sub_task = system[:100] + s.text(30), s.text(25)
    sub = s.msg(SYSTEM, sub_system) + s.msg(USER, sub_task)
    for _ in range(3):  # 3-5
        sub = sub + s.ask(sub) + s.msg(TOOL, s.text(15))
    summary = s.ask(sub + s.msg(USER, s.text(30)))  # 6: the subagent's compaction
    sub = s.msg(SYSTEM, sub_system) + s.msg(USER, sub_task + summary[2:-1])
    for _ in range(2):  # 7, 8
        report = s.ask(sub)
        sub = sub + report + s.msg(TOOL, s.text(15))
    history = history + s.msg(TOOL, report[2:-1])
    s.ask(history, s.text(30), finish="length")  # 9: cut short, dropped by the harness
    history = history + s.ask(history) + s.msg(TOOL, s.text(20))  # 10: the same prompt again
    s.ask(history)  # 11
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] * 3 + ["subagent"] * 3 + ["compaction"] + ["subagent"] * 2 + ["main"] * 3
    assert sorted((link.kind, link.source, link.target) for link in rt.links) == [("restarts", 6, 7), ("returns", 8, 10)]


def test_a_planner_whose_plan_the_agent_is_handed_is_a_side_call():
    """Plan, then act (an architect and an editor; a user's planner step): one call writes a plan, and
    the agent's first prompt holds it. The agent is main whatever its length; the planner, one call
    outranking the whole agent for having been quoted by it, was main and the agent a side thread."""
    for steps in (3, 10):
        s = Session(70)
        task = s.text(30)
        plan = s.ask(s.msg(SYSTEM, s.text(60)) + s.msg(USER, task))
        main_session(s, steps, s.text(300), task + s.text(5) + plan[2:-1])
        assert kinds(s.calls)[1:] == ["main"] * steps and kinds(s.calls)[0] != "main"


def test_two_subagents_alike_stay_two_when_the_first_attempt_was_asked_again():
    """Two subagents handed the same first prompt, the first one's first call cut short and asked
    again: each call on that prompt was checked against the dead first attempt alone, so the second
    subagent was taken for a retry of it and merged into the first, its report linked nowhere."""
    s = Session(31)
    system = s.text(300)
    history = s.msg(SYSTEM, system) + s.msg(USER, s.text(30))
    history = history + s.ask(history)  # 0: delegates twice
    first = s.msg(SYSTEM, system[:40] + s.text(30)) + s.msg(USER, s.text(25))
    subagents = [list(first), list(first)]
    s.ask(first, s.text(15), finish="length")  # 1: the first subagent's first call, cut and dropped
    reports = [None, None]
    for _ in range(3):  # 2-7, the two subagents in turn
        for j in range(2):
            reports[j] = s.ask(subagents[j])
            subagents[j] = subagents[j] + reports[j] + s.msg(TOOL, s.text(15))
    for report in reports:
        history = history + s.msg(TOOL, report[2:-1])
    history = history + s.ask(history) + s.msg(TOOL, s.text(10))  # 8
    s.ask(history)  # 9
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] + ["subagent"] * 7 + ["main"] * 2
    assert len({t.thread for t in rt.calls if t.kind == "subagent"}) == 2
    assert [(link.kind, link.source, link.target) for link in rt.links] == [("returns", 6, 8), ("returns", 7, 8)]


def test_compaction_with_its_own_system_prompt_replaying_the_history():
    s = Session(2)
    system, task = s.text(300), s.text(30)
    history = main_session(s, 4, system, task)
    messages = history[len(s.msg(SYSTEM, system)):]
    summary = s.ask(s.msg(SYSTEM, s.text(40)) + messages + s.msg(USER, s.text(10)))
    history = s.msg(SYSTEM, system) + s.msg(USER, s.text(8) + summary[2:])
    for _ in range(2):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    assert kinds(s.calls) == ["main"] * 4 + ["compaction"] + ["main"] * 2


def test_title_request_that_carries_the_tools_forks_the_first_prompt():
    s = Session(3)
    system, task = s.text(300), s.text(30)
    head = s.msg(SYSTEM, system) + s.msg(USER, task)
    first = s.ask(head)
    s.ask(head + s.msg(USER, s.text(12)), s.text(6) + [END])  # same system + tools, asks for a title
    history = head + first + s.msg(TOOL, s.text(20))
    for _ in range(3):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main", "title"] + ["main"] * 3
    assert rt.calls[1].extends is None and rt.calls[1].thread != "main"
    assert rt.calls[2].extends == 0


def test_title_asked_before_the_main_thread_with_its_own_prompt():
    s = Session(4)
    task = s.text(30)
    s.ask(s.msg(SYSTEM, s.text(20)) + s.msg(USER, task), s.text(7) + [END])
    main_session(s, 3, s.text(300), task)
    assert kinds(s.calls) == ["title", "main", "main", "main"]


def test_summary_label_quoting_the_last_answer_while_the_agent_goes_on():
    s = Session(5)
    system, task = s.text(300), s.text(30)
    history = s.msg(SYSTEM, system) + s.msg(USER, task)
    history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    answer = s.ask(history)
    s.ask(s.msg(SYSTEM, s.text(15)) + s.msg(USER, answer[2:-1]), s.text(5) + [END])  # "label this tool use"
    history = history + answer + s.msg(TOOL, s.text(20))
    history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    assert kinds(s.calls) == ["main", "main", "summary", "main"]


def test_subagent_with_a_subset_of_the_tools_returns_in_a_tool_result():
    s = Session(6)
    system, task = s.text(300), s.text(30)
    history = s.msg(SYSTEM, system) + s.msg(USER, task)
    history = history + s.ask(history)  # delegates
    sub = s.msg(SYSTEM, system[:100] + s.text(30)) + s.msg(USER, s.text(25))
    for _ in range(3):
        sub_answer = s.ask(sub)
        sub = sub + sub_answer + s.msg(TOOL, s.text(15))
    history = history + s.msg(TOOL, sub_answer[2:-1])
    for _ in range(3):  # the main thread goes on longer than the subagent ran
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] + ["subagent"] * 3 + ["main"] * 3
    assert len({rt.calls[i].thread for i in (1, 2, 3)}) == 1 and rt.calls[1].thread != "main"
    assert rt.calls[4].extends == 0 and rt.continuity == 1.0


def test_a_subagent_longer_than_the_main_thread_is_still_a_subagent():
    s = Session(7)
    system = s.text(300)
    history = s.msg(SYSTEM, system) + s.msg(USER, s.text(30))
    history = history + s.ask(history)
    sub = s.msg(SYSTEM, s.text(50)) + s.msg(USER, s.text(25))
    for _ in range(6):
        sub_answer = s.ask(sub)
        sub = sub + sub_answer + s.msg(TOOL, s.text(15))
    s.ask(history + s.msg(TOOL, sub_answer[2:-1]))
    assert kinds(s.calls) == ["main"] + ["subagent"] * 6 + ["main"]


def test_quota_probe_retry_and_dead_branch():
    s = Session(8)
    s.ask(s.msg(USER, [42]), [77], finish="length")  # asks for one token
    head = s.msg(SYSTEM, s.text(300)) + s.msg(USER, s.text(30))
    s.ask(head, s.text(20), finish="length")  # cut off, asked again
    first = s.ask(head)
    history = head + first + s.msg(TOOL, s.text(20))
    s.ask(history + s.msg(TOOL, s.text(5)))  # a variant the harness dropped
    history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    s.ask(history)
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["quota", "main", "main", "main", "main", "main"]
    assert rt.calls[2].extends is None and rt.calls[4].extends == 2
    statuses = {lf.calls: lf.status for lf in build_tree(with_kinds(s.calls, rt)).leaves}
    assert statuses[(0,)] == "excluded" and statuses[(1,)] == "dead" and statuses[(5,)] == "kept"


def test_history_edit_and_re_rendered_turn_are_located_and_attributed():
    s = Session(9)
    head = s.msg(SYSTEM, s.text(300)) + s.msg(USER, s.text(30))
    tools = [s.msg(TOOL, s.text(20)) for _ in range(3)]
    a0 = s.ask(head)
    a1 = s.ask(head + a0 + tools[0])
    a2 = s.ask(head + a0 + tools[0] + a1 + tools[1])
    edited = head + a0 + s.msg(TOOL, s.text(3)) + a1 + tools[1] + a2 + tools[2]  # an old result cleared
    a3 = s.ask(edited)
    rerendered = a3[:5] + [9] + a3[6:]  # the harness's replay of call 3's answer differs at one token
    s.ask(edited + rerendered + s.msg(TOOL, s.text(20)))
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] * 5
    assert [t.extends for t in rt.calls] == [None, 0, 1, 2, 3]
    edit, render = rt.divergences
    assert (edit.call_index, edit.against, edit.cause) == (3, 2, "history edit")
    assert edit.token_index == len(head + a0) + 2
    assert (render.call_index, render.against, render.cause) == (4, 3, "template re-render")
    assert render.token_index == len(edited) + 5
    assert (rt.main_pairs, rt.exact_pairs) == (4, 2)


def test_an_answer_the_harness_dropped_is_a_dead_main_branch():
    """mini-swe-agent after a length cut: the answer is not replayed, a user message says why."""
    s = Session(12)
    head = s.msg(SYSTEM, s.text(300)) + s.msg(USER, s.text(30))
    s.ask(head, s.text(20), finish="length")
    history = head + s.msg(USER, s.text(15))
    history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    s.ask(history)
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] * 3
    assert [t.extends for t in rt.calls] == [None, None, 1] and rt.continuity == 1.0


def test_hints_decide_what_the_structure_cannot():
    s = Session(10)
    history = main_session(s, 3, s.text(300), s.text(30))
    s.ask(history + s.msg(USER, s.text(10)))  # the last call: a final answer or a compaction request
    assert kinds(s.calls)[-1] == "main"
    hinted = s.calls[:-1] + [dataclasses.replace(s.calls[-1], tags=("compaction",))]
    assert kinds(hinted)[-1] == "compaction"
    # A subagent whose answer is too short to find in a later prompt: only its header says so.
    t = Session(11)
    history = t.msg(SYSTEM, t.text(300)) + t.msg(USER, t.text(30))
    history = history + t.ask(history)
    t.ask(t.msg(SYSTEM, t.text(40)) + t.msg(USER, t.text(20)), [11, 12, END])
    t.ask(history + t.msg(TOOL, [11, 12]))
    assert kinds(t.calls) == ["main", "title", "main"]
    hinted = [dataclasses.replace(c, tags=("subagent",)) if c.call_index == 1 else c for c in t.calls]
    assert kinds(hinted) == ["main", "subagent", "main"]


@pytest.mark.parametrize("after", [0, 2])
@pytest.mark.parametrize("calls", [1, 3])
def test_a_memory_extractor_that_keeps_a_sliver_of_the_system_prompt_is_a_side_thread(after, calls):
    """Another CLI's memory extractor: its own system prompt (only its first 6 tokens are the main
    one's), the last turns replayed as messages, a few calls, mid-session or at the end. It holds the
    main thread's turns but keeps less than the thread's first prompt, so it is no history edit."""
    s = Session(20)
    preamble = s.text(6)
    history = main_session(s, 3, preamble + s.text(300), s.text(30))
    recent = history[-120:]
    extractor = s.msg(SYSTEM, preamble + s.text(80)) + recent[recent.index(START):]
    for _ in range(calls):
        extractor = extractor + s.ask(extractor) + s.msg(TOOL, s.text(10))
    for _ in range(after):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    side = "other-side" if calls > 1 else "summary"
    assert kinds(s.calls) == ["main"] * 3 + [side] * calls + ["main"] * after
    # The proxy's subagent hint is no longer overridden by a misread link.
    hinted = [dataclasses.replace(c, tags=("subagent",)) if 3 <= c.call_index < 3 + calls else c for c in s.calls]
    assert kinds(hinted) == ["main"] * 3 + ["subagent"] * calls + ["main"] * after


@pytest.mark.parametrize("after", [0, 2])
def test_a_side_call_with_the_main_system_prompt_and_another_first_request(after):
    """The main system prompt, then a first user turn of its own and the last turn replayed."""
    s = Session(21)
    system = s.text(300)
    history = main_session(s, 3, system, s.text(30))
    last = history[-120:]  # the last turn and the tool result before it
    s.ask(s.msg(SYSTEM, system) + s.msg(USER, s.text(15)) + last[last.index(START):], s.text(8) + [END])
    for _ in range(after):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    got = kinds(s.calls)
    assert got[:3] == ["main"] * 3 and got[3] in ("summary", "title") and got[4:] == ["main"] * after


def test_a_subagent_with_its_own_system_prompt_started_mid_session_returns_its_answer():
    s = Session(22)
    history = main_session(s, 3, s.text(300), s.text(30))
    sub = s.msg(SYSTEM, s.text(60)) + s.msg(USER, s.text(25))
    for _ in range(4):
        answer = s.ask(sub)
        sub = sub + answer + s.msg(TOOL, s.text(15))
    history = history + s.ask(history)
    history = history + s.msg(TOOL, answer[2:-1])
    s.ask(history)
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] * 3 + ["subagent"] * 4 + ["main"] * 2
    assert [(lk.kind, lk.source, lk.target) for lk in rt.links] == [("returns", 6, 8)]


def _delegate(s: Session, first_prompts, steps=(3, 3)) -> None:
    """Main delegates len(steps) subagents at once, their prompts `first_prompts(main's system
    text)`; subagent j makes steps[j] calls, interleaved with the others'; every report comes back in
    one main turn, and main goes on twice."""
    system = s.text(300)
    history = s.msg(SYSTEM, system) + s.msg(USER, s.text(30))
    history = history + s.ask(history)  # delegates them all at once
    subs, answers = first_prompts(system), [None] * len(steps)
    for k in range(max(steps)):
        for j, n in enumerate(steps):
            if k < n:
                answers[j] = s.ask(subs[j])
                subs[j] = subs[j] + answers[j] + s.msg(TOOL, s.text(15))
    for answer in answers:
        history = history + s.msg(TOOL, answer[2:-1])
    history = history + s.ask(history) + s.msg(TOOL, s.text(10))
    s.ask(history)


def test_parallel_subagents_interleaved_return_together():
    """Two subagents delegated at once (their calls interleaved), both reports in one main turn."""
    s = Session(30)
    _delegate(s, lambda system: [s.msg(SYSTEM, system[:40] + s.text(30)) + s.msg(USER, s.text(25))
                                 for _ in range(2)])
    rt = reconstruct(s.calls)
    got = kinds(s.calls)
    assert got == ["main"] + ["subagent"] * 6 + ["main"] * 2, [(t.call_index, t.kind, t.reason) for t in rt.calls]
    assert len({t.thread for t in rt.calls if t.kind == "subagent"}) == 2
    assert sorted((lk.kind, lk.source, lk.target) for lk in rt.links) == [("returns", 5, 7), ("returns", 6, 7)]

def test_a_subagent_that_delegates_to_its_own_subagent():
    s = Session(31)
    system = s.text(300)
    history = s.msg(SYSTEM, system) + s.msg(USER, s.text(30))
    history = history + s.ask(history)
    outer = s.msg(SYSTEM, system[:40] + s.text(30)) + s.msg(USER, s.text(25))
    outer = outer + s.ask(outer)  # delegates further
    inner = s.msg(SYSTEM, system[:40] + s.text(35)) + s.msg(USER, s.text(20))
    for _ in range(2):
        a = s.ask(inner)
        inner = inner + a + s.msg(TOOL, s.text(10))
    outer = outer + s.msg(TOOL, a[2:-1])
    b = s.ask(outer)
    history = history + s.msg(TOOL, b[2:-1])
    s.ask(history)
    rt = reconstruct(s.calls)
    got = kinds(s.calls)
    assert got == ["main", "subagent", "subagent", "subagent", "subagent", "main"], [(t.call_index, t.kind, t.reason) for t in rt.calls]
    assert sorted((lk.kind, lk.source, lk.target) for lk in rt.links) == [("returns", 3, 4), ("returns", 4, 5)]

@pytest.mark.parametrize("after", [0, 2])
def test_a_sub_session_with_the_main_system_prompt_and_its_own_task(after):
    """A subagent that keeps the main system prompt whole (same header and tools), its own first request."""
    s = Session(32)
    system = s.text(300)
    history = main_session(s, 2, system, s.text(30))
    history = history + s.ask(history)
    sub = s.msg(SYSTEM, system) + s.msg(USER, s.text(25))
    for _ in range(3):
        a = s.ask(sub)
        sub = sub + a + s.msg(TOOL, s.text(15))
    history = history + s.msg(TOOL, a[2:-1])
    for _ in range(after + 1):
        history = history + s.ask(history) + s.msg(TOOL, s.text(10))
    got = kinds(s.calls)
    assert got == ["main"] * 3 + ["subagent"] * 3 + ["main"] * (after + 1), [(t.call_index, t.kind, t.reason) for t in reconstruct(s.calls).calls]

def test_a_compaction_restart_that_keeps_the_whole_first_prompt():
    s = Session(33)
    system, task = s.text(300), s.text(30)
    head = s.msg(SYSTEM, system) + s.msg(USER, task)
    history = main_session(s, 3, system, task)
    summary = s.ask(history + s.msg(USER, s.text(20)))
    history = head + s.msg(USER, summary[2:-1])
    for _ in range(2):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] * 3 + ["compaction"] + ["main"] * 2, [(t.call_index, t.kind, t.reason) for t in rt.calls]
    assert sorted((lk.kind, lk.source, lk.target) for lk in rt.links) == [("restarts", 3, 4), ("resumes", 2, 4)]

def test_a_compaction_in_pieces_links_each_summary_to_the_call_that_reads_it():
    """Claude Code after a context refusal: a summary of the first turns (the first call's history
    and turn, then the request), then a summary of the rest behind that first summary, then the
    restart behind the second summary keeping the last turn whole. Each summary ``restarts`` in the
    call that reads it; the main thread ``resumes`` in the restart."""
    s = Session(34)
    system, task, request = s.text(300), s.text(30), s.msg(USER, s.text(40))
    head = s.msg(SYSTEM, system) + s.msg(USER, task)
    history, turns = head, []
    for _ in range(5):
        turn = s.ask(history) + s.msg(TOOL, s.text(20))
        turns.append(turn)
        history = history + turn
    first = s.ask(head + turns[0] + request)
    second = s.ask(s.msg(SYSTEM, system) + s.msg(USER, s.text(8) + first[2:-1]) + s.msg(SYSTEM, s.text(5))
                   + turns[1] + turns[2] + turns[3] + request)
    s.ask(s.msg(SYSTEM, system) + s.msg(USER, s.text(8) + second[2:-1]) + s.msg(SYSTEM, s.text(5)) + turns[4])
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] * 5 + ["compaction"] * 2 + ["main"], [(t.call_index, t.kind, t.reason) for t in rt.calls]
    assert sorted((lk.kind, lk.source, lk.target) for lk in rt.links) == [("restarts", 5, 6), ("restarts", 6, 7),
                                                                          ("resumes", 4, 7)]


@pytest.mark.parametrize("hint", [None, "subagent", "compaction"])
def test_a_side_call_that_keeps_the_whole_first_prompt_last_in_the_session(hint):
    """The main header and task, the last turns, another request, as the session's last call: the
    structure reads a history edit going on (docs/HARNESSES.md, failure modes); a side hint decides."""
    s = Session(34)
    system, task = s.text(300), s.text(30)
    history = main_session(s, 3, system, task)
    head = s.msg(SYSTEM, system) + s.msg(USER, task)
    recent = history[-120:]
    at = next(i for i in range(len(recent) - 1) if recent[i:i + 2] == [START, TOOL])  # from a tool result on
    s.ask(head + recent[at:] + s.msg(USER, s.text(12)))
    calls = s.calls if hint is None else s.calls[:-1] + [dataclasses.replace(s.calls[-1], tags=(hint,))]
    got = kinds(calls)
    assert got == ["main"] * 3 + [hint or "main"], [(t.call_index, t.kind, t.reason) for t in reconstruct(calls).calls]


@pytest.mark.parametrize("where", ["mid", "every"])
def test_a_question_put_to_the_whole_history_that_the_main_thread_replaces(where):
    """A next-speaker check (another CLI's): the history so far + a question of its own, a short
    answer, and the main thread goes on from the same history with a tool result instead."""
    s = Session(40)
    system = s.text(300)
    history = s.msg(SYSTEM, system) + s.msg(USER, s.text(30))
    truth = []
    for step in range(4):
        a = s.ask(history); truth.append("main")
        if where == "every" or step == 1:
            s.ask(history + a + s.msg(USER, s.text(15)), s.text(4) + [END]); truth.append("side")
        history = history + a + s.msg(TOOL, s.text(20))
    s.ask(history); truth.append("main")
    rt = reconstruct(s.calls)
    got = [t.kind for t in rt.calls]
    assert all((g == "main") == (t == "main") for g, t in zip(got, truth)), [(t.call_index, t.kind, t.reason, tr) for t, tr in zip(rt.calls, truth)]


def random_session(seed: int) -> tuple[list[CallRecord], list[str], set[int]]:
    """A session of random shape, its true kinds and its restarts after a compaction: main steps with retries, subagents, compactions
    in both forms (the main header, or one of its own replaying the history; the last turn kept or
    not), a title (forked from the first prompt or asked on its own), summary labels, probes and a
    history edit of an old tool result."""
    s = Session(seed)
    rng = s.rng
    truth: list[str] = []
    restarts: set[int] = set()
    restarting = False  # a compaction happened and the main thread has not been asked since

    def ask(kind: str, history, answer=None, **kw):
        nonlocal restarting
        if kind == "main" and restarting:
            restarts.add(len(truth))
            restarting = kw.get("finish") == "length"  # asked again on the same prompt
        truth.append(kind)
        return s.ask(history, answer, **kw)

    system, task = s.text(int(rng.integers(50, 300))), s.text(30)
    head = s.msg(SYSTEM, system) + s.msg(USER, task)
    if rng.random() < 0.5:
        ask("quota", s.msg(USER, [42]), [77], finish="length")
    history, results, last = head, [], None  # results: offsets of the tool results in `history`
    titled = False
    for _ in range(int(rng.integers(4, 14))):
        op = rng.choice(["step", "step", "step", "retry", "cut", "subagent", "compaction", "label", "edit", "title"])
        if op == "cut":  # an answer cut by length that the harness drops, saying so in a new message
            ask("main", history, s.text(15), finish="length")
            history = history + s.msg(USER, s.text(10))
        if op == "title" and not titled and last is not None:
            titled = True
            if rng.random() < 0.5:
                ask("title", head + s.msg(USER, s.text(12)), s.text(6) + [END])  # the main header and tools
            else:
                ask("title", s.msg(SYSTEM, s.text(20)) + s.msg(USER, task), s.text(7) + [END])
            continue
        if op == "retry":
            ask("main", history, s.text(15), finish="length")
        if op == "subagent" and last is not None:
            sub = s.msg(SYSTEM, system[: len(system) // 2] + s.text(20)) + s.msg(USER, s.text(25))
            for _ in range(int(rng.integers(1, 5))):
                answer = ask("subagent", sub)
                sub = sub + answer + s.msg(TOOL, s.text(15))
            results.append(len(history))
            history = history + s.msg(TOOL, answer[2:-1])  # its report as the delegating call's result
            continue
        if op == "compaction" and last is not None:
            messages = history[len(s.msg(SYSTEM, system)):]
            own = rng.random() < 0.5
            request = (s.msg(SYSTEM, s.text(40)) + messages if own else history) + s.msg(USER, s.text(20))
            summary = ask("compaction", request)
            history = head[: len(s.msg(SYSTEM, system))] + s.msg(USER, task + summary[2:])
            if rng.random() < 0.5:  # the last turn kept after the summary
                history = history + last + s.msg(TOOL, s.text(10))
            results, last = [], None  # the harness asks the restarted thread before anything else
            restarting = True
            continue
        if op == "label" and last is not None:
            ask("summary", s.msg(SYSTEM, s.text(15)) + s.msg(USER, last[2:-1]), s.text(5) + [END])
            continue
        if op == "edit" and len(results) >= 3:  # an old tool result (the newest ones stay as they were)
            at = results[0]
            old = history[at: history.index(END, at) + 1]
            history = history[:at] + s.msg(TOOL, s.text(3)) + history[at + len(old):]
            shift = len(s.msg(TOOL, s.text(0))) + 3 - len(old)
            results = [r + shift for r in results[1:]]
        last = ask("main", history)
        results.append(len(history) + len(last))
        history = history + last + s.msg(TOOL, s.text(20))
    ask("main", history)
    return s.calls, truth, restarts


@pytest.mark.parametrize("seed", range(100))
def test_random_sessions_recover_their_kinds(seed):
    calls, truth, restarts = random_session(seed)
    rng = np.random.default_rng(seed)
    rt = reconstruct([calls[i] for i in rng.permutation(len(calls))])  # any arrival order
    assert [t.kind for t in rt.calls] == truth, [(t.call_index, t.kind, k, t.reason) for t, k in zip(rt.calls, truth) if t.kind != k]
    assert all((t.thread == "main") == (t.kind == "main") for t in rt.calls)
    assert rt.exact_pairs == rt.main_pairs - sum(d.cause == "history edit" for d in rt.divergences)
    assert {d.call_index for d in rt.divergences if d.cause == "compaction"} == restarts
    # Every restart is the target of its compaction's link and of the main thread's before it; every
    # link joins a thread of its kind to a later call.
    kind = {t.call_index: t.kind for t in rt.calls}
    restarted = {lk.target for lk in rt.links if lk.kind == "restarts"}
    assert restarted == {lk.target for lk in rt.links if lk.kind == "resumes"} <= restarts
    for lk in rt.links:
        assert lk.source < lk.target and kind[lk.source] == {"returns": "subagent", "restarts": "compaction",
                                                            "resumes": "main"}[lk.kind]


def test_rejects_mixed_rollouts_and_duplicate_indices():
    s = Session()
    main_session(s, 2, s.text(10), s.text(5))
    with pytest.raises(ValueError, match="several rollouts"):
        reconstruct([s.calls[0], dataclasses.replace(s.calls[1], rollout_id="other")])
    with pytest.raises(ValueError, match="duplicate"):
        reconstruct([s.calls[0], dataclasses.replace(s.calls[1], call_index=0)])
    assert reconstruct([]).calls == [] and reconstruct([]).continuity == 1.0


def test_one_call_hinted_subagent_does_not_turn_the_main_chain_into_one():
    """The proxy hints `subagent` when a call's tool list is a strict subset of main's, which one
    main call can show (a tool server dropping out for a call): a hint decides a chain only where
    most of its calls carry it, so the main chain stays main and the title a title."""
    s = Session(50)
    system, task = s.text(300), s.text(30)
    s.ask(s.msg(SYSTEM, s.text(20)) + s.msg(USER, task), s.text(7) + [END])  # a title, asked first
    main_session(s, 8, system, task)
    hinted = [dataclasses.replace(c, tags=("subagent",)) if c.call_index == 5 else c for c in s.calls]
    assert kinds(hinted) == ["title"] + ["main"] * 8
    most = [dataclasses.replace(c, tags=("subagent",)) if c.call_index >= 4 else c for c in s.calls]
    assert kinds(most)[1:] == ["subagent"] * 8  # most of the chain hinted: the hint decides


def test_a_subagent_report_truncated_in_the_middle_still_returns():
    """A long report put in the main thread's tool result cut to its head and tail (tool-output
    truncation removes the middle): its head and tail pieces are found, so the subagent, longer than
    the main thread, is still the subagent."""
    s = Session(90)
    system = s.text(300)
    history = s.msg(SYSTEM, system) + s.msg(USER, s.text(30))
    history = history + s.ask(history)  # delegates
    sub = s.msg(SYSTEM, system[:50] + s.text(40)) + s.msg(USER, s.text(25))
    for k in range(6):
        a = s.ask(sub, s.text(300) + [END]) if k == 5 else s.ask(sub)
        sub = sub + a + s.msg(TOOL, s.text(15))
    report = a[2:-1]
    history = history + s.msg(TOOL, report[:100] + s.text(3) + report[-100:])  # "... [truncated] ..."
    for _ in range(3):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    rt = reconstruct(s.calls)
    got = [(t.call_index, t.kind, t.reason) for t in rt.calls]
    assert kinds(s.calls) == ["main"] + ["subagent"] * 6 + ["main"] * 3, got
    assert [(lk.kind, lk.source, lk.target) for lk in rt.links] == [("returns", 6, 7)]


@pytest.mark.parametrize("title_first", [False, True])
@pytest.mark.parametrize("answer_tokens", [40, 3])
def test_a_one_call_main_thread_beside_a_title_is_main_whichever_ends_last(title_first, answer_tokens):
    """A task answered in one call, and a title asked from the task: two one-call chains. The one
    shown the harness's system prompt is main, not the one that happened to come last, nor the one
    that said more (a main answer may be shorter than a title: "4")."""
    s = Session(60)
    system, task = s.text(300), s.text(30)
    if title_first:
        s.ask(s.msg(SYSTEM, s.text(20)) + s.msg(USER, task), s.text(7) + [END])
    s.ask(s.msg(SYSTEM, system) + s.msg(USER, task), s.text(answer_tokens) + [END])
    if not title_first:
        s.ask(s.msg(SYSTEM, s.text(20)) + s.msg(USER, task), s.text(7) + [END])
    assert kinds(s.calls) == (["title", "main"] if title_first else ["main", "title"])


def test_parallel_subagents_given_the_same_first_prompt_are_two_threads():
    """Two subagents started at once on the same prompt (the same task twice): the second first call
    is no retry of the first, since both answers are taken up; each thread returns its report."""
    s = Session(30)

    def same_first(system):
        first = s.msg(SYSTEM, system[:40] + s.text(30)) + s.msg(USER, s.text(25))
        return [list(first), list(first)]

    _delegate(s, same_first)
    rt = reconstruct(s.calls)
    assert kinds(s.calls) == ["main"] + ["subagent"] * 6 + ["main"] * 2
    assert [rt.calls[i].thread for i in range(1, 7)] == ["subagent:1", "subagent:2"] * 3
    assert [(lk.kind, lk.source, lk.target) for lk in rt.links] == [("returns", 5, 7), ("returns", 6, 7)]


@pytest.mark.parametrize("seed", [2, 7, 9, 12])
def test_a_call_of_another_template_does_not_change_the_others(seed):
    """One call whose prompt shares nothing with the others and does not end with the generation
    prompt (another template, a raw completion): the ending the other prompts share, which a call
    replaying one of them may render otherwise, is still theirs, so no other call changes kind."""
    calls, truth, _ = random_session(seed)
    at = len(calls) // 2
    odd = CallRecord("r", at, "h", np.array([START, SYSTEM] + list(range(6000, 6040)) + [END, 9, 9]),
                     np.array(list(range(7000, 7010)) + [END]), -np.ones(11))
    calls = [dataclasses.replace(c, call_index=c.call_index + (c.call_index >= at)) for c in calls]
    got = kinds(calls[:at] + [odd] + calls[at:])
    assert got[:at] + got[at + 1:] == truth and got[at] == "title"


@pytest.mark.parametrize("stages", ["parallel", "sequential"])
def test_a_compaction_in_stages_follows_the_partial_summaries_back_to_the_main_thread(stages):
    """OpenClaw's summariser in stages (its own system prompt, no tools): chunks of the transcript
    summarised apart, then merged (or each chunk summarised behind the summary so far). The merge
    quotes only the partial summaries; they are followed back to the main thread whose turns they
    read, each partial summary ``restarts`` in the call that merges it."""
    s = Session(100)
    system, task = s.text(300), s.text(30)
    history = main_session(s, 4, system, task)
    summariser = s.msg(SYSTEM, s.text(40))
    body = history[len(s.msg(SYSTEM, system)):]
    half = len(body) // 2
    p1 = s.ask(summariser + s.msg(USER, body[:half]))
    if stages == "parallel":
        p2 = s.ask(summariser + s.msg(USER, body[half:]))
        final = s.ask(summariser + s.msg(USER, s.text(5) + p1[2:-1] + s.text(3) + p2[2:-1]))
    else:
        final = s.ask(summariser + s.msg(USER, s.text(4) + p1[2:-1]) + s.msg(USER, body[half:]))
    history = s.msg(SYSTEM, system) + s.msg(USER, task + final[2:-1])
    for _ in range(2):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    rt = reconstruct(s.calls)
    pieces = 3 if stages == "parallel" else 2
    got = [(t.call_index, t.kind, t.reason) for t in rt.calls]
    assert kinds(s.calls) == ["main"] * 4 + ["compaction"] * pieces + ["main"] * 2, got
    merge, restart = 3 + pieces, 4 + pieces
    want = [("restarts", j, merge) for j in range(4, merge)] + [("restarts", merge, restart), ("resumes", 3, restart)]
    assert sorted((lk.kind, lk.source, lk.target) for lk in rt.links) == sorted(want)


@pytest.mark.parametrize("steps", [(1, 3), (3, 1), (1, 1), (2, 1, 2)])
def test_parallel_subagents_given_the_same_first_prompt_are_as_many_threads_however_long(steps):
    """A subagent done in one call is never extended, only quoted back: it is still no retry of a
    sibling given the same first prompt. Each is a thread of its own and returns its report."""
    s = Session(31)

    def same_first(system):
        first = s.msg(SYSTEM, system[:40] + s.text(30)) + s.msg(USER, s.text(25))
        return [list(first) for _ in steps]

    _delegate(s, same_first, steps)
    rt = reconstruct(s.calls)
    subagent_calls = [t for t in rt.calls if t.kind == "subagent"]
    assert len(subagent_calls) == sum(steps) and len({t.thread for t in subagent_calls}) == len(steps)
    report_turn = 1 + sum(steps)
    assert sorted((lk.kind, lk.target) for lk in rt.links) == [("returns", report_turn)] * len(steps)
