"""The official openai and anthropic SDKs against a live proxy: replies, tool calls, streams, and the
token-prefix continuity of a multi-turn tool-using conversation in every protocol."""

from __future__ import annotations

import json

import anthropic
import httpx
import numpy as np
import openai
import pytest

SCRIPT = [
    {"text": "Let me look.", "tool_calls": [{"name": "bash", "arguments": {"command": "ls -la"}}]},
    {"reasoning": "a.py is there", "tool_calls": [{"name": "read", "arguments": {"path": "a.py", "limit": 3}}]},
    {"text": "Done: a.py prints hello."},
]
BASH_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
READ_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}}


def assert_continuity(calls, n: int) -> None:
    """Each call's prompt starts with the previous call's prompt + output, token for token."""
    assert len(calls) == n
    for prev, cur in zip(calls, calls[1:]):
        path = np.concatenate([prev.prompt_ids, prev.output_ids])
        assert len(cur.prompt_ids) > len(path)
        np.testing.assert_array_equal(cur.prompt_ids[: len(path)], path)
        assert cur.metadata["spliced_turns"] >= 1
    for call in calls:
        assert call.tags == ("main",)
        assert len(call.infer_logprobs) == len(call.output_ids) and (call.infer_logprobs < 0).all()


# -- Anthropic ------------------------------------------------------------------------------------


def _anthropic_turn(client, stream: bool, **kwargs):
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as s:
        events = [e.type for e in s]
        message = s.get_final_message()
    assert events[0] == "message_start" and "message_stop" in events
    return message


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_conversation(proxy, stream):
    proxy.engine.push(*SCRIPT)
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    tools = [
        {"name": "bash", "description": "Run a shell command", "input_schema": BASH_SCHEMA},
        {"name": "read", "description": "Read a file", "input_schema": READ_SCHEMA},
    ]
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in a.py?"}]}]
    results = ["a.py\nb.py", "print('hello')"]
    for turn in range(3):
        # Claude Code's billing header changes every request; the proxy must strip it.
        system = [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={turn:05d};"},
            {"type": "text", "text": "You are a coding agent."},
        ]
        msg = _anthropic_turn(
            client, stream, model="policy", max_tokens=256, system=system, messages=messages, tools=tools,
            extra_query={"beta": "true"},
        )
        if turn < 2:
            assert msg.stop_reason == "tool_use"
            uses = [b for b in msg.content if b.type == "tool_use"]
            assert [u.name for u in uses] == [SCRIPT[turn]["tool_calls"][0]["name"]]
            assert uses[0].input == SCRIPT[turn]["tool_calls"][0]["arguments"]
            assert uses[0].id.startswith("toolu_")
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": uses[0].id, "content": results[turn]},
                        {"type": "text", "text": "<system-reminder>keep going</system-reminder>"},
                    ],
                }
            )
        else:
            assert msg.stop_reason == "end_turn"
            assert msg.content[-1].text == "Done: a.py prints hello."
    thinking = [b for b in messages[3]["content"] if b["type"] == "thinking"]
    assert thinking and thinking[0]["thinking"] == "a.py is there"
    calls = proxy.calls()
    assert_continuity(calls, 3)
    assert calls[0].metadata["protocol"] == "anthropic"
    assert calls[1].metadata["tool_calls"] == ["read"]
    assert msg.usage.input_tokens == len(calls[2].prompt_ids)
    assert msg.usage.output_tokens == len(calls[2].output_ids)


def test_anthropic_count_tokens_and_models(proxy):
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    messages = [{"role": "user", "content": "hello there"}]
    counted = client.messages.count_tokens(model="policy", messages=messages, system="Be brief.")
    proxy.engine.push("Hi.")
    msg = client.messages.create(model="policy", max_tokens=10, messages=messages, system="Be brief.")
    assert counted.input_tokens == msg.usage.input_tokens == len(proxy.calls()[0].prompt_ids)
    models = client.models.list()
    assert [m.id for m in models.data] == ["policy"]
    assert [m.id for m in openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key).models.list()] == ["policy"]


def test_anthropic_system_role_in_messages_and_max_tokens(proxy):
    proxy.engine.push("a long answer that will not fit")
    r = httpx.post(
        proxy.url + "/v1/messages",
        headers={"x-api-key": proxy.key, "anthropic-version": "2023-06-01"},
        json={
            "model": "policy",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "note"}, {"role": "user", "content": "go"}],
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 3
    (call,) = proxy.calls()
    assert call.finish_reason == "length"
    assert "<|im_start|>system\nnote<|im_end|>" in proxy.core.renderer.decode(call.prompt_ids)


# -- Chat Completions -----------------------------------------------------------------------------


def _chat_turn(client, stream: bool, **kwargs):
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        msg = choice.message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in msg.tool_calls or ()]
        return msg.content or "", calls, choice.finish_reason
    content, calls, finish, usage_chunks = "", {}, None, 0
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if not chunk.choices:
            usage_chunks += 1
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            slot = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            slot["id"] += tc.id or ""
            slot["function"]["name"] += tc.function.name or ""
            slot["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert usage_chunks == 1
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tool_conversation(proxy, stream):
    proxy.engine.push(*SCRIPT)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    tools = [
        {"type": "function", "function": {"name": "bash", "description": "Run", "parameters": BASH_SCHEMA}},
        {"type": "function", "function": {"name": "read", "description": "Read", "parameters": READ_SCHEMA}},
    ]
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "What is in a.py?"}]
    for turn in range(3):
        content, calls, finish = _chat_turn(client, stream, model="policy", messages=messages, tools=tools, max_tokens=256)
        if turn < 2:
            assert finish == "tool_calls"
            assert calls[0]["function"]["name"] == SCRIPT[turn]["tool_calls"][0]["name"]
            assert json.loads(calls[0]["function"]["arguments"]) == SCRIPT[turn]["tool_calls"][0]["arguments"]
            messages.append({"role": "assistant", "content": content or None, "tool_calls": calls})
            messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "output"})
        else:
            assert finish == "stop" and content == "Done: a.py prints hello."
    assert_continuity(proxy.calls(), 3)


# -- Responses ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_conversation(proxy, stream):
    proxy.engine.push(*SCRIPT)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    tools = [
        {"type": "function", "name": "bash", "description": "Run", "parameters": BASH_SCHEMA, "strict": False},
        {"type": "function", "name": "read", "description": "Read", "parameters": READ_SCHEMA, "strict": False},
        {"type": "web_search"},
    ]
    items: list = [{"role": "user", "content": [{"type": "input_text", "text": "What is in a.py?"}]}]
    for turn in range(3):
        kwargs = dict(model="policy", instructions="You are a coding agent.", input=items, tools=tools, store=False)
        if stream:
            with client.responses.stream(**kwargs) as s:
                kinds = [e.type for e in s]
                response = s.get_final_response()
            assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
            assert kinds.count("response.output_item.done") == len(response.output)
        else:
            response = client.responses.create(**kwargs)
        assert response.id.startswith("resp_") and response.usage.total_tokens > 0
        calls = [o for o in response.output if o.type == "function_call"]
        if turn < 2:
            assert calls[0].name == SCRIPT[turn]["tool_calls"][0]["name"]
            assert json.loads(calls[0].arguments) == SCRIPT[turn]["tool_calls"][0]["arguments"]
            items += [o.model_dump(exclude_none=True) for o in response.output]
            items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "output"})
        else:
            assert not calls and response.output_text == "Done: a.py prints hello."
    assert any(o.get("type") == "reasoning" for o in items)
    assert_continuity(proxy.calls(), 3)



def test_responses_with_a_previous_response_id_is_refused(proxy):
    # The proxy stores no responses: the input alone would be taken for the whole conversation. The
    # real API refuses an id it does not know the same way.
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="previous response 'resp_abc' not found") as refused:
        client.responses.create(model="policy", input="and then?", previous_response_id="resp_abc")
    assert refused.value.body["param"] == "previous_response_id"
    assert proxy.calls() == []

def test_responses_with_an_item_reference_is_refused(proxy):
    """An item_reference names an item only a store could hold; it was accepted and dropped, and the
    model never saw the item."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="item_reference 'msg_1' not found") as refused:
        client.responses.create(model="policy", input=[{"role": "user", "content": "hi"},
                                                       {"type": "item_reference", "id": "msg_1"}])
    assert refused.value.body["param"] == "input.1"
    assert proxy.calls() == []


def test_arguments_a_javascript_client_writes_back_by_value_splice_the_produced_turn(proxy):
    """Claude Code parses and re-serialises a call's input in JavaScript: ``1.0`` comes back as ``1``
    and ``1e2`` as ``100``. The produced turn is still recognised and spliced: the next prompt
    extends the first call's prompt and output."""
    tools = [{"name": "sleep", "description": "d",
              "input_schema": {"type": "object", "properties": {"seconds": {"type": "number"}}}}]
    proxy.engine.push('<tool_call>\n{"name": "sleep", "arguments": {"seconds": 1.0, "n": 1e2, "x": 0.5}}\n</tool_call>',
                      "ok")
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    messages = [{"role": "user", "content": "wait a second"}]
    first = client.messages.create(model="policy", max_tokens=64, messages=messages, tools=tools)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    replayed = {"type": "tool_use", "id": use.id, "name": "sleep", "input": {"seconds": 1, "n": 100, "x": 0.5}}
    messages += [{"role": "assistant", "content": [replayed]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "done"}]}]
    client.messages.create(model="policy", max_tokens=64, messages=messages, tools=tools)
    assert_continuity(proxy.calls(), 2)


def test_a_history_resent_with_another_json_type_or_key_order_renders_as_sent(proxy, renderer):
    """The same history sent again with a value of another JSON type (``1`` for ``true``) or keys in
    another order: the prompt renders what was sent, as a fresh proxy would (the translation memory
    took ``1 == True`` and key-order-blind ``==`` for the same unit and rendered the old one)."""
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {}, "y": {}}}}]
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)

    def ask(arguments):
        client.messages.create(model="policy", max_tokens=8, tools=tools, messages=[
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": arguments}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}])
        return renderer.decode(proxy.calls()[-1].prompt_ids)

    proxy.engine.push("a", "b", "c")
    assert '{"x": true}' in ask({"x": True})
    assert '{"x": 1}' in ask({"x": 1})
    assert '{"y": 2, "x": 1}' in ask({"y": 2, "x": 1})


# -- Auth and errors ------------------------------------------------------------------------------


def test_unknown_and_closed_keys_are_401_in_each_protocol(proxy):
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=proxy.url, api_key="nope", max_retries=0).messages.create(
            model="policy", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert err.value.body["error"]["type"] == "authentication_error"
    oc = openai.OpenAI(base_url=proxy.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        oc.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert err.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        oc.responses.create(model="policy", input="hi")
    # A closed rollout's key stops working and nothing more is written for it.
    proxy.engine.push("ok")
    ok = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    ok.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    result = proxy.registry.close(proxy.rollout_id)
    assert len(result.calls) == 1
    with pytest.raises(openai.AuthenticationError):
        ok.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    from clawfast.records import read_rollout, rollout_path

    on_disk = read_rollout(rollout_path(proxy.registry.records_dir, proxy.rollout_id))
    assert on_disk.equals(result)


def test_malformed_tool_call_is_plain_text_and_recorded(proxy):
    bad = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>'
    proxy.engine.push(bad, bad)
    oc = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    out = oc.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], tools=[
        {"type": "function", "function": {"name": "bash", "parameters": BASH_SCHEMA}}])
    assert out.choices[0].finish_reason == "stop" and not out.choices[0].message.tool_calls
    assert out.choices[0].message.content == bad.replace("\n</tool_call>", "\n</tool_call>").strip()
    msg = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0).messages.create(
        model="policy", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    assert msg.stop_reason == "end_turn" and msg.content[0].type == "text"
    calls = proxy.calls()
    assert all("does not parse" in c.metadata["parse_error"] for c in calls)


def test_incremental_translation_equals_fresh_translation():
    """Each front's parse with a rollout's UnitMemory gives the same conversation as without."""
    from clawfast.proxy.anthropic import AnthropicFront
    from clawfast.proxy.chat import ChatFront
    from clawfast.proxy.incremental import UnitMemory
    from clawfast.proxy.responses import ResponsesFront

    bodies = {
        AnthropicFront(): lambda n: {"model": "m", "max_tokens": 5, "system": "s", "messages": [
            {"role": "user", "content": "u"}] + [m for i in range(n) for m in (
                {"role": "assistant", "content": [{"type": "text", "text": f"t{i}"}, {"type": "tool_use", "id": f"x{i}", "name": "bash", "input": {"i": i}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"x{i}", "content": f"r{i}"}, {"type": "text", "text": "note"}]})]},
        ChatFront(): lambda n: {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}] + [
            m for i in range(n) for m in (
                {"role": "assistant", "content": None, "tool_calls": [{"id": f"x{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": f"x{i}", "content": f"r{i}"})]},
        ResponsesFront(): lambda n: {"model": "m", "instructions": "s", "input": [{"role": "user", "content": "u"}] + [
            m for i in range(n) for m in (
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
                {"type": "function_call", "call_id": f"x{i}", "name": "bash", "arguments": "{}"},
                {"type": "function_call_output", "call_id": f"x{i}", "output": f"r{i}"})]},
    }
    for front, make in bodies.items():
        memory = UnitMemory()
        previous = None
        for n in (0, 1, 2, 4, 3, 5):  # growing, then an edited (shorter) history, then growing again
            body = json.dumps(make(n)).encode()
            with_memory = front.parse(body, memory).conversation
            assert with_memory == front.parse(body).conversation
            if previous is not None and n > 0:
                shared = min(len(previous.messages), len(with_memory.messages)) - 2
                assert all(a is b for a, b in zip(previous.messages[:shared], with_memory.messages[:shared]))
            previous = with_memory


def test_responses_custom_tool_round_trip(proxy):
    """Codex's free-form tools: offered as a function with one string `input`, answered as a
    custom_tool_call, replayed as one, and spliced back as the exact sampled tokens."""
    patch = "*** Begin Patch\n*** Add File: a.py\n+print('hi')\n*** End Patch"
    proxy.engine.push({"tool_calls": [{"name": "apply_patch", "arguments": {"input": patch}}]}, "ok")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    tools = [{"type": "custom", "name": "apply_patch", "description": "Edit files"}]
    items: list = [{"role": "user", "content": "add a.py"}]
    first = client.responses.create(model="policy", input=items, tools=tools)
    (call,) = first.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == patch
    items += [call.model_dump(exclude_none=True), {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "done"}]
    assert client.responses.create(model="policy", input=items, tools=tools).output_text == "ok"
    assert_continuity(proxy.calls(), 2)


@pytest.mark.parametrize("written, given", [({"input": {"path": "a.py"}}, '{"path":"a.py"}'),
                                            ({"input": None}, "null"), ({}, "")])
def test_a_custom_tool_input_that_is_no_string_reaches_the_harness_as_json(proxy, written, given):
    proxy.engine.push({"tool_calls": [{"name": "apply_patch", "arguments": written}]})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    tools = [{"type": "custom", "name": "apply_patch", "description": "Edit files"}]
    (call,) = client.responses.create(model="policy", input="add a.py", tools=tools).output
    assert call.type == "custom_tool_call" and call.input == given


# Tool calls that json.loads accepts but orjson, which writes every reply, refuses: an integer beyond 64
# bits, a lone surrogate, nesting that only the reply's own levels take past orjson's 254.
UNWRITABLE_CALLS = [
    '<tool_call>\n{"name": "calc", "arguments": {"n": 123456789012345678901234567890}}\n</tool_call>',
    '<tool_call>\n{"name": "calc", "arguments": {"s": "\\ud83d"}}\n</tool_call>',
    '<tool_call>\n{"name": "calc", "arguments": {"a": ' + "[" * 252 + "]" * 252 + "}}\n</tool_call>",
]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_no_reply_can_carry_are_answered_as_text(proxy, stream):
    """Such a call is plain text with a parse_error, as malformed markup is, in every API, streamed or
    not: never a 500 whose record says 200."""
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    responses_tools = [{"type": "function", "name": "calc", "parameters": {"type": "object"}}]
    claude = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    gpt = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    hi = [{"role": "user", "content": "hi"}]
    for output in UNWRITABLE_CALLS:
        proxy.engine.push(output, output, output)
        message = _anthropic_turn(claude, stream, model="policy", max_tokens=2000, messages=hi,
                                  tools=[{"name": "calc", "input_schema": {"type": "object"}}])
        assert (message.stop_reason, [(b.type, b.text) for b in message.content]) == ("end_turn", [("text", output)])
        if stream:
            chunks = [c for c in gpt.chat.completions.create(model="policy", messages=hi, tools=tools, stream=True)
                      if c.choices]
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == output
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "stop"
            events = list(gpt.responses.create(model="policy", input="hi", tools=responses_tools, stream=True))
            assert events[-1].type == "response.completed"
            response = events[-1].response
        else:
            choice = gpt.chat.completions.create(model="policy", messages=hi, tools=tools).choices[0]
            assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (output, None, "stop")
            response = gpt.responses.create(model="policy", input="hi", tools=responses_tools)
        assert [item.type for item in response.output] == ["message"] and response.output_text == output
    calls = proxy.calls()
    assert [(c.metadata["protocol"], c.metadata["http_status"]) for c in calls] == [
        ("anthropic", 200), ("chat", 200), ("responses", 200)] * len(UNWRITABLE_CALLS)
    assert all("cannot be written back as JSON" in c.metadata["parse_error"] for c in calls)
    assert "refusals" not in proxy.registry.close(proxy.rollout_id).info


def test_non_text_parts_read_as_their_text_or_their_type(proxy):
    """A refusal part reads as its refusal, an image as [image], any other non-text part as a placeholder
    naming its type, in every API."""
    proxy.engine.push("ok", "ok", "ok")
    gpt = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    gpt.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            {"type": "file", "file": {"file_id": "file-1"}}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't"}]},
        {"role": "user", "content": "again"}])
    gpt.responses.create(model="policy", input=[
        {"role": "user", "content": [
            {"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": "https://example.com/a.png"},
            {"type": "input_file", "file_id": "file-1"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No way."}]},
        {"role": "user", "content": "again"}])
    anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0).messages.create(
        model="policy", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "d"}},
            {"type": "search_result", "source": "https://example.com", "title": "t",
             "content": [{"type": "text", "text": "r"}]}]}])
    chat, responses, messages = (proxy.core.renderer.decode(c.prompt_ids) for c in proxy.calls())
    assert "user\nlook\n[image]\n[input_audio]\n[file]<|im_end|>" in chat and "assistant\nI can't<|im_end|>" in chat
    assert "user\nlook\n[image]\n[input_file]<|im_end|>" in responses and "assistant\nNo way.<|im_end|>" in responses
    assert "user\nlook\n[image]\n[document]\n[search_result]<|im_end|>" in messages


def test_a_server_tools_result_in_the_history_is_read_whatever_its_content(proxy, renderer):
    """A conversation carried over from the API holds a web search the server ran: its result block's
    content is a list of results, or one error object (not a list: it was a 400 here), in an assistant
    turn, or among the blocks of a tool result. Each call is answered; the result reads as its type."""
    proxy.engine.push("ok", "ok")
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    for content in ({"type": "web_search_tool_result_error", "error_code": "max_uses_exceeded"},
                    [{"type": "web_search_result", "url": "https://example.com", "title": "t", "encrypted_content": "x"}]):
        client.messages.create(model="policy", max_tokens=8, messages=[
            {"role": "user", "content": "search it"},
            {"role": "assistant", "content": [
                {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "q"}},
                {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": content},
                {"type": "text", "text": "Nothing found."}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": [
                {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": content}]}]}])
    error, results = (renderer.decode(c.prompt_ids) for c in proxy.calls())
    assert "Nothing found." in error and "[web_search_tool_result]" in error
    assert "Nothing found." in results and "[web_search_tool_result]" in results


def test_anthropic_tools_the_api_defines_are_not_offered(proxy, renderer):
    # Claude Code's WebSearch asks for the server's search tool: this server runs none, and a client
    # tool the API defines comes without its schema; the request's own tools are offered as ever.
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    own = {"name": "Bash", "description": "Run a shell command",
           "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}
    defined = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 8},
               {"type": "bash_20250124", "name": "bash"},
               {"type": "mcp_toolset", "mcp_server_name": "docs"}]  # some carry no name
    proxy.engine.push("No search here.")
    client.messages.create(model="policy", max_tokens=32, messages=[{"role": "user", "content": "hi"}],
                           tools=[own, *defined])
    prompt = renderer.decode(proxy.calls()[0].prompt_ids)
    assert '"Bash"' in prompt and "web_search" not in prompt and '"bash"' not in prompt
    with pytest.raises(anthropic.BadRequestError, match="not among the request's tools"):
        client.messages.create(model="policy", max_tokens=32, messages=[{"role": "user", "content": "hi"}],
                               tools=[own, *defined], tool_choice={"type": "tool", "name": "web_search"})
    with pytest.raises(anthropic.BadRequestError, match="needs tools, and the request has none"):
        client.messages.create(model="policy", max_tokens=32, messages=[{"role": "user", "content": "hi"}],
                               tools=defined, tool_choice={"type": "tool", "name": "web_search"})


def test_chat_offers_function_tools_only_and_responses_wants_a_top_level_name(proxy, renderer):
    gpt = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    bash = {"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}
    freeform = {"type": "custom", "custom": {"name": "apply_patch", "description": "Edit files"}}
    proxy.engine.push("Nothing to run.")
    gpt.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], tools=[bash, freeform])
    prompt = renderer.decode(proxy.calls()[0].prompt_ids)
    assert '"Bash"' in prompt and "apply_patch" not in prompt
    # Chat's nested shape sent to Responses: the API answers 400 for the missing name, not a call with no tools.
    with pytest.raises(openai.BadRequestError, match=r"tools\.0\.name: Field required"):
        gpt.responses.create(model="policy", input="hi", tools=[bash])


def test_an_answer_cut_inside_the_think_block_the_prompt_opened_is_reasoning(embedded_dir, proxy_factory, tmp_path):
    """A thinking-only template (its generation prompt opens ``<think>``): an answer cut by max_tokens
    before it closed the block reaches the harness as thinking, not as text; the transcript reads it
    the same way."""
    from transformers import AutoTokenizer

    from clawfast.proxy import ChatRenderer
    from clawfast.proxy.transcript import core_transcript

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    header = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    assert header in tokenizer.chat_template
    tokenizer.chat_template = tokenizer.chat_template.replace(header, header.replace("\n{% endif", "\n<think>\n{% endif"))
    live = proxy_factory(tmp_path, renderer=ChatRenderer(tokenizer))
    try:
        assert live.core.reasoning_open
        live.engine.push("The user wants the files listed, so I will call ls and then")
        claude = anthropic.Anthropic(base_url=live.url, api_key=live.key, max_retries=0)
        message = claude.messages.create(model="policy", max_tokens=6, messages=[{"role": "user", "content": "files?"}])
        assert message.stop_reason == "max_tokens"
        assert message.content[0].type == "thinking" and message.content[0].thinking.startswith("The user wants")
        assert "".join(b.text for b in message.content if b.type == "text") == ""
        (assistant,) = [e["message"] for e in core_transcript(live.core, live.calls()) if e["message"]["role"] == "assistant"]
        assert assistant["content"] == []
    finally:
        live.server.stop()
