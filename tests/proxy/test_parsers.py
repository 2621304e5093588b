"""Tool-call parsers: each family's markup, malformed markup as text, never an exception."""

from __future__ import annotations

import itertools
import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clawfast.proxy.parsers import PARSERS, detect_parser, parse_llama3_json, parse_mistral, parse_qwen3


def ids():
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def test_qwen3_text_thinking_and_calls():
    text = (
        "<think>\nplan it\n</think>\n\nI will run two things.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read", "arguments": "{\\"path\\": \\"a.py\\"}"}\n</tool_call>'
    )
    turn = parse_qwen3(text, "stop", ids())
    assert turn.reasoning == "plan it" and turn.content == "I will run two things."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [
        ("id0", "bash", {"command": "ls"}),
        ("id1", "read", {"path": "a.py"}),
    ]
    assert turn.finish_reason == "tool_calls" and turn.parse_error is None


def test_qwen3_closing_think_only_and_plain_text():
    turn = parse_qwen3("thought about it</think>\n\nAnswer.", "stop", ids())
    assert (turn.reasoning, turn.content, turn.tool_calls) == ("thought about it", "Answer.", [])
    assert parse_qwen3("<think>\nstill thinking", "length", ids()).reasoning == "still thinking"


@pytest.mark.parametrize(
    "bad, why",
    [
        ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}\n</tool_call>', "does not parse"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', "without a string name"),
        ('<tool_call>\n["bash"]\n</tool_call>', "not an object"),
        ('<tool_call>\n{"name": "bash", "arguments": [1]}\n</tool_call>', "not a JSON object"),
        ('ok <tool_call>\n{"name": "bash", "arguments": {}}', "unterminated"),
    ],
)
def test_qwen3_malformed_is_text(bad, why):
    turn = parse_qwen3(bad, "stop", ids())
    assert turn.tool_calls == [] and turn.content == bad.strip() and why in turn.parse_error
    assert turn.finish_reason == "stop"


# JSON that json.loads accepts and orjson (which writes every reply) refuses: an integer beyond 64 bits,
# a lone surrogate, arguments nested past what fits under orjson's 254 levels inside a reply.
UNWRITABLE_ARGUMENTS = ['{"n": 123456789012345678901234567890}', '{"s": "\\ud83d"}',
                        '{"a": ' + "[" * 252 + "]" * 252 + "}"]


@pytest.mark.parametrize("arguments", UNWRITABLE_ARGUMENTS)
def test_calls_no_reply_can_carry_are_text_in_every_family(arguments):
    """Treated as malformed markup is: the whole output as text, a parse_error, no call."""
    outputs = {
        parse_qwen3: f'<tool_call>\n{{"name": "calc", "arguments": {arguments}}}\n</tool_call>',
        parse_mistral: f"[TOOL_CALLS]calc[ARGS]{arguments}",
        parse_llama3_json: f'{{"name": "calc", "parameters": {arguments}}}',
    }
    for parse, text in outputs.items():
        turn = parse(text, "stop", ids())
        assert turn.tool_calls == [] and turn.finish_reason == "stop", parse
        assert "cannot be written back as JSON" in turn.parse_error and text in turn.content
    name = parse_qwen3('<tool_call>\n{"name": "calc\\udc00", "arguments": {}}\n</tool_call>', "stop", ids())
    assert name.tool_calls == [] and "cannot be written back" in name.parse_error
    deepest = '{"a": ' + "[" * 240 + "]" * 240 + "}"  # still fits
    fits = parse_qwen3(f'<tool_call>\n{{"name": "calc", "arguments": {deepest}}}\n</tool_call>', "stop", ids())
    assert fits.tool_calls and fits.parse_error is None


def test_a_calls_arguments_under_either_key_are_read_and_under_none_are_not_invented():
    """Models trained on several families write a call's arguments as "arguments" or "parameters":
    either is read in every family (Qwen3 and Mistral read "arguments" alone, and a call under
    "parameters" ran with {}, arguments the model never wrote). A call with its arguments under
    another key, or under both, is malformed markup; one with a name alone calls a tool with none."""
    for key in ("arguments", "parameters"):
        for parse, text in ((parse_qwen3, f'<tool_call>\n{{"name": "bash", "{key}": {{"command": "rm -rf build"}}}}\n</tool_call>'),
                            (parse_mistral, f'[TOOL_CALLS][{{"name": "bash", "{key}": {{"command": "rm -rf build"}}}}]'),
                            (parse_llama3_json, f'{{"name": "bash", "{key}": {{"command": "rm -rf build"}}}}')):
            (call,) = parse(text, "stop", ids()).tool_calls
            assert json.loads(call.arguments) == {"command": "rm -rf build"}, (parse, key)
    for bad, why in (('{"name": "bash", "args": {"command": "ls"}}', "no 'arguments'"),
                     ('{"name": "bash", "arguments": {}, "parameters": {"command": "ls"}}', "both")):
        turn = parse_qwen3(f"<tool_call>\n{bad}\n</tool_call>", "stop", ids())
        assert turn.tool_calls == [] and why in turn.parse_error
    (bare,) = parse_qwen3('<tool_call>\n{"name": "now"}\n</tool_call>', "stop", ids()).tool_calls
    assert bare.arguments == "{}"


def test_mistral_both_formats():
    turn = parse_mistral('Sure.[TOOL_CALLS][{"name": "bash", "arguments": {"command": "ls"}}]', "stop", ids())
    assert turn.content == "Sure." and turn.tool_calls[0].name == "bash"
    turn = parse_mistral('[TOOL_CALLS]bash[ARGS]{"command": "ls"}[TOOL_CALLS]read[ARGS]{"path": "x"}', "stop", ids())
    assert [c.name for c in turn.tool_calls] == ["bash", "read"]
    bad = parse_mistral("[TOOL_CALLS][{oops", "stop", ids())
    assert bad.tool_calls == [] and bad.parse_error


def test_llama3_json():
    turn = parse_llama3_json('{"name": "bash", "parameters": {"command": "ls"}}', "stop", ids())
    assert turn.tool_calls[0].name == "bash" and json.loads(turn.tool_calls[0].arguments) == {"command": "ls"}
    assert parse_llama3_json("Just words.", "stop", ids()).content == "Just words."
    # A JSON answer that names something but carries no parameters is text, as vLLM reads it.
    for answer in ('{"name": "Alice", "age": 3}', '[{"name": "a"}, {"name": "b", "parameters": {}}]', "[1, 2]"):
        plain = parse_llama3_json(answer, "stop", ids())
        assert plain.tool_calls == [] and plain.content == answer and not plain.parse_error


def test_detect_parser():
    assert detect_parser({"<tool_call>": 5}) == "qwen3"
    assert detect_parser({"[TOOL_CALLS]": 5}) == "mistral"
    assert detect_parser({"<|python_tag|>": 5}) == "llama3_json"


markup = st.sampled_from(
    ["<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]", "{", "}", '"name"', ":", '"arguments"', "\n", "[", "]"]
)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.one_of(markup, st.text(max_size=8)), max_size=20), finish=st.sampled_from(["stop", "length"]))
def test_parsers_never_raise(pieces, finish):
    text = "".join(pieces)
    for parse in set(PARSERS.values()):
        turn = parse(text, finish, ids())
        assert turn.finish_reason in ("stop", "length", "tool_calls")
        for call in turn.tool_calls:
            assert isinstance(json.loads(call.arguments), dict)
            orjson.dumps([call.name, json.loads(call.arguments)])  # every call a parser returns can be written back


def test_an_answer_inside_a_think_block_the_prompt_opened():
    """A thinking-only template opens ``<think>`` in its generation prompt: an answer cut before its
    closing tag is all reasoning (not text the harness would show), a closed one splits there, and no
    tool call is read, or cut after, inside the reasoning."""
    from clawfast.proxy.front import ToolChoice
    from clawfast.proxy.parsers import first_call_end, opens_reasoning, parse_answer

    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n") and not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    call = '<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call>'
    cut = parse_answer(parse_qwen3, "Let me think about " + call, "length", ids(), ToolChoice(), reasoning_open=True)
    assert (cut.reasoning, cut.content, cut.tool_calls) == ("Let me think about " + call, "", [])
    assert parse_answer(parse_qwen3, "Let me think", "length", ids(), ToolChoice()).content == "Let me think"
    closed = parse_answer(parse_qwen3, "plan\n</think>\n\nOn it.\n" + call, "stop", ids(), ToolChoice(), reasoning_open=True)
    assert (closed.reasoning, closed.content, [c.name for c in closed.tool_calls]) == ("plan", "On it.", ["bash"])
    two = "plan " + call + "\n</think>\n\n" + call + call
    end = first_call_end("qwen3", two, reasoning_open=True)
    assert two[:end].endswith("</think>\n\n" + call)
    assert first_call_end("qwen3", "plan " + call + call, reasoning_open=True) is None
