"""One call at a time (Anthropic's ``disable_parallel_tool_use``, OpenAI's ``parallel_tool_calls:
false``) through the official SDKs: a model that writes two calls is answered with its first, and the
call keeps only the sampled tokens up to that call's end, so the record trains what the harness got and
the next call continues it. Markup that holds every call in one JSON value cannot be cut there: the
calls past the first are dropped from the answer, and the turn is rendered afresh where it is replayed."""

from __future__ import annotations

import json

import anthropic
import numpy as np
import openai
import pytest

from clawfast.proxy import ProxyConfig
from clawfast.proxy.canonical import ToolChoice
from clawfast.proxy.parsers import first_call_end, parse_answer, parse_mistral, parse_qwen3
from clawfast.proxy.transcript import core_transcript
from clawfast.threads import reconstruct
from sample_tools import CHAT_TOOLS, RESPONSES_TOOLS, TOOLS, USER

FIRST = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'
SECOND = '<tool_call>\n{"name": "Read", "arguments": {"path": "a.py"}}\n</tool_call>'
TWO_CALLS = f"Let me look.\n{FIRST}\n{SECOND}"


def _no_id() -> str:
    return ""


def test_anthropic_answers_the_first_call_and_the_record_ends_with_it(proxy, renderer):
    proxy.engine.push(TWO_CALLS, "Two files.")
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    reply = client.messages.create(model="policy", max_tokens=256, messages=[USER], tools=TOOLS,
                                   tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("Bash", {"command": "ls"})]
    assert reply.stop_reason == "tool_use" and reply.content[0].text == "Let me look."
    first = proxy.calls()[0]
    # The fewest sampled tokens whose text holds the first call, with their log-probs.
    kept = renderer.encode(f"Let me look.\n{FIRST}")
    np.testing.assert_array_equal(first.output_ids, kept)
    assert len(first.infer_logprobs) == len(kept) and first.finish_reason == "stop"
    assert first.metadata["parallel_tool_calls"] is False and first.metadata["tool_calls"] == ["Bash"]
    assert "dropped_tool_calls" not in first.metadata
    assert reply.usage.output_tokens == len(kept)

    history = [USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "a.py"}]}]
    client.messages.create(model="policy", max_tokens=64, messages=history, tools=TOOLS)
    second = proxy.calls()[1]
    path = np.concatenate([first.prompt_ids, first.output_ids])
    np.testing.assert_array_equal(second.prompt_ids[:len(path)], path)
    assert second.metadata["spliced_turns"] == 1
    threads = reconstruct(proxy.calls())
    assert threads.exact_pairs == threads.main_pairs == 1
    (event, *_) = [e for e in core_transcript(proxy.core, proxy.calls()) if e["message"]["role"] == "assistant"]
    assert [c["name"] for c in event["message"]["content"] if c["type"] == "toolCall"] == ["Bash"]


def test_without_the_flag_every_call_is_answered(proxy):
    proxy.engine.push(TWO_CALLS)
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    reply = client.messages.create(model="policy", max_tokens=256, messages=[USER], tools=TOOLS)
    assert [b.name for b in reply.content if b.type == "tool_use"] == ["Bash", "Read"]
    assert "parallel_tool_calls" not in proxy.calls()[0].metadata


def test_a_forced_call_one_at_a_time_cuts_after_the_forced_call(proxy, renderer):
    # The proxy writes the opening of a call of any tool; the model names Read, then writes a second call.
    proxy.engine.push(f'Read", "arguments": {{"path": "b.py"}}}}\n</tool_call>\n{FIRST}')
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    reply = client.messages.create(model="policy", max_tokens=256, messages=[USER], tools=TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [(b.name, b.input) for b in reply.content if b.type == "tool_use"] == [("Read", {"path": "b.py"})]
    record = proxy.calls()[0]
    assert record.metadata["tool_choice"] == "required" and record.metadata["parallel_tool_calls"] is False
    assert renderer.decode(record.output_ids).endswith("</tool_call>")


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_parallel_tool_calls_false(proxy, stream):
    proxy.engine.push(TWO_CALLS)
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.key, max_retries=0)
    kwargs = dict(model="policy", messages=[USER], tools=CHAT_TOOLS, parallel_tool_calls=False)
    if stream:
        names = [d.function.name for chunk in client.chat.completions.create(stream=True, **kwargs)
                 for choice in chunk.choices for d in choice.delta.tool_calls or () if d.function.name]
    else:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "tool_calls"
        names = [c.function.name for c in reply.choices[0].message.tool_calls]
    assert names == ["Bash"]


def test_responses_parallel_tool_calls_false_is_honoured_and_echoed(proxy):
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.key, max_retries=0)
    proxy.engine.push(TWO_CALLS, TWO_CALLS)
    one = client.responses.create(model="policy", input="What files are here?", tools=RESPONSES_TOOLS,
                                  parallel_tool_calls=False)
    calls = [i for i in one.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("Bash", {"command": "ls"})]
    assert one.parallel_tool_calls is False
    both = client.responses.create(model="policy", input="What files are here?", tools=RESPONSES_TOOLS)
    assert [i.name for i in both.output if i.type == "function_call"] == ["Bash", "Read"]
    assert both.parallel_tool_calls is True


def test_calls_in_one_json_value_are_dropped_past_the_first_and_the_turn_rendered_afresh(renderer, proxy_factory,
                                                                                       tmp_path):
    # Mistral v3 markup: every call in one JSON array, which no token boundary splits into calls.
    live = proxy_factory(tmp_path, config=ProxyConfig(keepalive_s=0.05, parser="mistral"))
    try:
        array = '[TOOL_CALLS][{"name": "Bash", "arguments": {"command": "ls"}}, ' \
                '{"name": "Read", "arguments": {"path": "a.py"}}]'
        live.engine.push(array, "Done.")
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=live.key, max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=[USER], tools=CHAT_TOOLS,
                                               parallel_tool_calls=False)
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "Bash"
        first = live.calls()[0]
        assert first.metadata["dropped_tool_calls"] == 1 and first.metadata["tool_calls"] == ["Bash"]
        # Sampled, and trained, whole (and the turn's end the engine sampled after it).
        np.testing.assert_array_equal(first.output_ids, [*renderer.encode(array), renderer.turn_end_id])
        history = [USER, reply.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "a.py"}]
        client.chat.completions.create(model="policy", messages=history, tools=CHAT_TOOLS)
        # The replayed turn shows one call: its tokens (two calls) are not spliced in.
        assert live.calls()[1].metadata["spliced_turns"] == 0
    finally:
        live.server.stop()


def test_first_call_end_per_family():
    think = "<think>a <tool_call> in thought</think>"
    text = f"{think}Sure.\n{FIRST}\n{SECOND}"
    assert text[: first_call_end("qwen3", text)] == f"{think}Sure.\n{FIRST}"
    assert first_call_end("qwen3", f"Sure.\n{FIRST}\nDone.") is None  # one call: nothing to cut
    assert first_call_end("qwen3", f"{FIRST}\n<tool_call>\n{{\"name\"") == len(FIRST)  # a second call cut short
    v11 = '[TOOL_CALLS]Bash[ARGS]{"command": "ls"}[TOOL_CALLS]Read[ARGS]{"path": "a.py"}'
    assert v11[: first_call_end("mistral", v11)] == '[TOOL_CALLS]Bash[ARGS]{"command": "ls"}'
    assert first_call_end("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]') is None
    assert first_call_end("llama3_json", '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}]') is None


def test_parse_answer_keeps_one_call_where_one_is_allowed():
    one_at_a_time = ToolChoice(parallel=False)
    turn = parse_answer(parse_qwen3, f"{FIRST}\n{SECOND}", "stop", _no_id, one_at_a_time)
    assert [c.name for c in turn.tool_calls] == ["Bash"] and turn.dropped_tool_calls == 1
    array = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    assert [c.name for c in parse_answer(parse_mistral, array, "stop", _no_id, ToolChoice()).tool_calls] == ["a", "b"]
    none = parse_answer(parse_qwen3, FIRST, "stop", _no_id, ToolChoice("none", parallel=False))
    assert none.tool_calls == [] and none.content == FIRST
