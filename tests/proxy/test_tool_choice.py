"""tool_choice through the official SDKs: a forced call (a named tool, or any tool) opens with the
model's own tool-call markup written into the prompt, and the model's continuation is parsed as a
call of it; ``none`` answers tool-call markup as text; what cannot be honoured is a 400. The record's
prompt ends with the opening, and the next call's prompt continues the opening and the sampled tokens."""

from __future__ import annotations

import json

import anthropic
import numpy as np
import openai
import pytest

from clawfast.proxy.transcript import core_transcript
from clawfast.threads import reconstruct
from sample_tools import CHAT_TOOLS, RESPONSES_TOOLS, TOOLS, USER



def _ends_with(ids: np.ndarray, tail: np.ndarray) -> bool:
    return len(ids) >= len(tail) and list(ids[len(ids) - len(tail):]) == list(tail)


def test_anthropic_named_tool_is_forced_and_the_next_call_continues_its_tokens(proxy, renderer):
    # The engine plays what follows the opening the proxy wrote: the arguments and the block's end.
    proxy.engine.push(' {"command": "ls"}}\n</tool_call>', "Two files: a.py and b.py.")
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    reply = client.messages.create(model="policy", max_tokens=64, messages=[USER], tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "Bash"})
    assert reply.stop_reason == "tool_use"
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("Bash", {"command": "ls"})
    first = proxy.calls()[0]
    opening = '<tool_call>\n{"name": "Bash", "arguments":'  # the space before the arguments is the model's
    assert first.metadata["tool_choice"] == "tool" and first.metadata["prefill"] == opening
    assert _ends_with(first.prompt_ids, renderer.encode(opening))  # prompt tokens, never sampled
    assert reply.usage.input_tokens == len(first.prompt_ids)
    forced = {"type": "tool", "name": "Bash"}
    assert client.messages.count_tokens(model="policy", messages=[USER], tools=TOOLS,
                                        tool_choice=forced).input_tokens == len(first.prompt_ids)
    with pytest.raises(anthropic.BadRequestError, match="not among the request's tools"):
        client.messages.count_tokens(model="policy", messages=[USER], tools=TOOLS,
                                     tool_choice={"type": "tool", "name": "Write"})

    history = [USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a.py b.py"}]}]
    client.messages.create(model="policy", max_tokens=64, messages=history, tools=TOOLS)
    second = proxy.calls()[1]
    path = np.concatenate([first.prompt_ids, first.output_ids])
    np.testing.assert_array_equal(second.prompt_ids[:len(path)], path)
    assert second.metadata["spliced_turns"] == 1 and "tool_choice" not in second.metadata
    threads = reconstruct(proxy.calls())
    assert [t.extends for t in threads.calls] == [None, 0] and threads.exact_pairs == threads.main_pairs == 1
    # The transcript reads the forced call as the call the harness got.
    (event,) = [e for e in core_transcript(proxy.core, proxy.calls()) if e["message"]["role"] == "assistant"][:1]
    (call,) = [c for c in event["message"]["content"] if c["type"] == "toolCall"]
    assert (call["name"], call["arguments"]) == ("Bash", {"command": "ls"})


def test_openai_chat_required_lets_the_model_pick_the_tool(proxy, renderer):
    proxy.engine.push('Read", "arguments": {"path": "a.py"}}\n</tool_call>')
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.key, max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=[USER], tools=CHAT_TOOLS, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "Read" and json.loads(call.function.arguments) == {"path": "a.py"}
    record = proxy.calls()[0]
    assert record.metadata["tool_choice"] == "required"
    assert _ends_with(record.prompt_ids, renderer.encode('<tool_call>\n{"name": "'))


def test_openai_chat_named_function_and_none(proxy):
    markup = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'
    proxy.engine.push(' {"command": "pwd"}}\n</tool_call>', markup)
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.key, max_retries=0)
    named = client.chat.completions.create(model="policy", messages=[USER], tools=CHAT_TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "Bash"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "Bash" and json.loads(call.function.arguments) == {"command": "pwd"}
    # none: what the model wrote comes back as text (as vLLM answers it), and nothing is written for it.
    plain = client.chat.completions.create(model="policy", messages=[USER], tools=CHAT_TOOLS, tool_choice="none")
    choice = plain.choices[0]
    assert choice.message.tool_calls is None and choice.message.content == markup and choice.finish_reason == "stop"
    record = proxy.calls()[1]
    assert record.metadata["tool_choice"] == "none" and "prefill" not in record.metadata
    assert record.metadata["tool_calls"] == []


def test_a_streamed_forced_call_streams_the_call(proxy):
    proxy.engine.push(' {"path": "b.py"}}\n</tool_call>')
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    with client.messages.stream(model="policy", max_tokens=64, messages=[USER], tools=TOOLS,
                                tool_choice={"type": "tool", "name": "Read"}) as stream:
        reply = stream.get_final_message()
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    assert (use.name, use.input, reply.stop_reason) == ("Read", {"path": "b.py"}, "tool_use")


def test_responses_named_function_is_forced_and_echoed(proxy):
    proxy.engine.push(' {"command": "ls"}}\n</tool_call>')
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.key, max_retries=0)
    reply = client.responses.create(model="policy", input="What files are here?", tools=RESPONSES_TOOLS,
                                    tool_choice={"type": "function", "name": "Bash"})
    (item,) = [i for i in reply.output if i.type == "function_call"]
    assert item.name == "Bash" and json.loads(item.arguments) == {"command": "ls"}
    assert reply.tool_choice.type == "function" and reply.tool_choice.name == "Bash"


def test_a_tool_choice_that_cannot_be_honoured_is_a_400(proxy):
    chat = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.key, max_retries=0)
    claude = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="not among the request's tools"):
        claude.messages.create(model="policy", max_tokens=8, messages=[USER], tools=TOOLS,
                               tool_choice={"type": "tool", "name": "Write"})
    with pytest.raises(anthropic.BadRequestError, match="needs tools"):
        claude.messages.create(model="policy", max_tokens=8, messages=[USER], tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        claude.messages.create(model="policy", max_tokens=8, messages=[USER], tools=TOOLS,
                               tool_choice={"type": "sometimes"})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        chat.chat.completions.create(model="policy", messages=[USER], tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="runs no hosted tools"):
        chat.responses.create(model="policy", input="hi", tools=[{"type": "web_search_preview"}],
                              tool_choice={"type": "web_search_preview"})
    assert proxy.calls() == [] and proxy.engine.calls == 0  # nothing reached the engine


# Minimal chat templates with the tool-call markups of other families, to derive their openings from.
_FRAME = ("{%- for m in messages -%}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
          "@MARKUP@{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor -%}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n@THINK@{% endif -%}")
MARKUPS = {
    # (markup, what the generation prompt holds after its header, opening of any tool, of Bash)
    "hermes, name first": ('<tool_call>\n{"name": "@N@", "arguments": @A@}\n</tool_call>', "",
                           '<tool_call>\n{"name": "', '<tool_call>\n{"name": "Bash", "arguments":'),
    "mistral v3": ('[TOOL_CALLS] [{"name": "@N@", "arguments": @A@}]', "",
                   '[TOOL_CALLS] [{"name": "', '[TOOL_CALLS] [{"name": "Bash", "arguments":'),
    "mistral v11": ("[TOOL_CALLS]@N@[ARGS]@A@", "", "[TOOL_CALLS]", "[TOOL_CALLS]Bash[ARGS]"),
    "llama 3": ('{"name": "@N@", "parameters": @A@}', "", '{"name": "', '{"name": "Bash", "parameters":'),
    # The arguments before the name: any tool opens at the arguments; a named tool cannot be forced.
    "hermes 2 pro, arguments first": ('<tool_call>\n{"arguments": @A@, "name": "@N@"}\n</tool_call>', "",
                                      '<tool_call>\n{"arguments":', None),
    # A thinking model's generation prompt opens the think block, which an answer closes first.
    "think block": ("<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"@N@\", \"arguments\": @A@}\n</tool_call>",
                    "<think>\n", '\n</think>\n\n<tool_call>\n{"name": "',
                    '\n</think>\n\n<tool_call>\n{"name": "Bash", "arguments":'),
}


def _renderer_with(template: str):
    from transformers import AutoTokenizer

    from clawfast.embedded import ensure_embedded_model
    from clawfast.proxy import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    tokenizer.chat_template = template
    return ChatRenderer(tokenizer)


@pytest.mark.parametrize("family", sorted(MARKUPS))
def test_the_opening_is_what_the_template_writes_before_the_arguments(family):
    """Derived from the chat template, not from a list of families: any tool opens where the name (or
    the arguments) begins, a named tool where its arguments begin, spaces at the end left to the model."""
    markup, think, anyone, bash = MARKUPS[family]
    markup = markup.replace("@N@", "{{ c.function.name }}").replace("@A@", "{{ c.function.arguments }}")
    renderer = _renderer_with(_FRAME.replace("@MARKUP@", markup).replace("@THINK@", think))
    assert renderer.tool_call_opening(None) == anyone
    assert renderer.tool_call_opening("Bash") == bash
    if bash is not None:
        # The opening and what the model writes after it are the template's own rendering of the call.
        whole = renderer._answer_with_call("Bash")
        assert whole.startswith(bash) and whole[len(bash):].lstrip(" ").startswith("{")


def test_a_template_without_tool_calls_cannot_force_one(proxy_factory, tmp_path):
    renderer = _renderer_with(_FRAME.replace("@MARKUP@", "").replace("@THINK@", ""))
    assert renderer.tool_call_opening(None) is None and renderer.tool_call_opening("Bash") is None


def test_a_forced_call_and_a_prefill_together_are_a_400(proxy):
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="cannot be combined"):
        client.messages.create(model="policy", max_tokens=8, tools=TOOLS, tool_choice={"type": "any"},
                               messages=[USER, {"role": "assistant", "content": "I will"}])
    assert proxy.engine.calls == 0


def test_anthropic_prefill_is_continued_and_the_reply_holds_what_follows_it(proxy, renderer):
    """A final assistant message is the start of the answer: the model continues it (its tokens end
    the prompt), the reply holds only the continuation, and the next call, replaying the whole
    answer, continues the path."""
    proxy.engine.push(' "files": ["a.py", "b.py"]}', "Done.")
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    reply = client.messages.create(model="policy", max_tokens=64,
                                   messages=[USER, {"role": "assistant", "content": "{"}])
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == ' "files": ["a.py", "b.py"]}' and reply.stop_reason == "end_turn"
    first = proxy.calls()[0]
    assert first.metadata["prefill"] == "{" and "tool_choice" not in first.metadata
    assert _ends_with(first.prompt_ids, np.concatenate([renderer.generation_prompt_ids, renderer.encode("{")]))
    prefilled = [USER, {"role": "assistant", "content": "{"}]
    assert client.messages.count_tokens(model="policy", messages=prefilled).input_tokens == len(first.prompt_ids)
    whole = "{" + reply.content[0].text
    client.messages.create(model="policy", max_tokens=64, messages=[
        USER, {"role": "assistant", "content": whole}, {"role": "user", "content": "Thanks."}])
    second = proxy.calls()[1]
    path = np.concatenate([first.prompt_ids, first.output_ids])
    np.testing.assert_array_equal(second.prompt_ids[:len(path)], path)
    assert second.metadata["spliced_turns"] == 1
    (event, _) = [e for e in core_transcript(proxy.core, proxy.calls()) if e["message"]["role"] == "assistant"]
    assert event["message"]["content"] == [{"type": "text", "text": whole}]


def test_a_prefill_the_api_would_refuse_is_a_400(proxy):
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client.messages.create(model="policy", max_tokens=8, messages=[USER, {"role": "assistant", "content": "So "}])
    use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}
    with pytest.raises(anthropic.BadRequestError, match="text only"):
        client.messages.create(model="policy", max_tokens=8, tools=TOOLS,
                               messages=[USER, {"role": "assistant", "content": [use]}])
    assert proxy.engine.calls == 0


def test_the_transcript_reads_what_the_harness_added_before_a_prefilled_call(proxy):
    """The prefill's tokens end the prompt, after the generation prompt: what the harness added before
    them (a tool result, a user message) reads as it would before any other call."""
    proxy.engine.push({"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}]}, ' {"command": "cat a.py"}}\n</tool_call>',
                      "Sure.", ' "ok": true}')
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    first = client.messages.create(model="policy", max_tokens=64, messages=[USER], tools=TOOLS)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    history = [USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a.py b.py"}]}]
    forced = client.messages.create(model="policy", max_tokens=64, messages=history, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "Bash"})
    (again,) = [b for b in forced.content if b.type == "tool_use"]
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in forced.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": again.id, "content": "x = 1"}]}]
    said = client.messages.create(model="policy", max_tokens=64, messages=history, tools=TOOLS)
    history += [{"role": "assistant", "content": said.content[0].text}, {"role": "user", "content": "JSON please"},
                {"role": "assistant", "content": "{"}]
    client.messages.create(model="policy", max_tokens=64, messages=history, tools=TOOLS)
    events = core_transcript(proxy.core, proxy.calls())
    texts = [(e["message"]["role"], [c.get("text") or c.get("name") for c in e["message"]["content"]]) for e in events]
    assert texts == [("assistant", ["Bash"]), ("toolResult", ["a.py b.py"]), ("assistant", ["Bash"]),
                     ("toolResult", ["x = 1"]), ("assistant", ["Sure."]), ("user", ["JSON please"]),
                     ("assistant", ['{ "ok": true}'])]
