"""Rendering: the incremental, chunked prompt against the template's full rendering; splicing of
produced turns; drift when history is edited."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from clawfast.proxy.canonical import Conversation, Message, ToolCall, ToolSpec, canonical_arguments
from clawfast.proxy.render import ChatRenderer, RolloutPrompts

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
tool_call = st.builds(
    ToolCall,
    id=st.text("abc123", min_size=1, max_size=6),
    name=st.sampled_from(["bash", "read", "write_file"]),
    arguments=st.dictionaries(st.sampled_from(["path", "command", "n"]), st.one_of(text, st.integers())).map(canonical_arguments),
)
message = st.one_of(
    st.builds(Message, role=st.just("user"), content=text),
    st.builds(Message, role=st.just("system"), content=text),
    st.builds(Message, role=st.just("assistant"), content=text, tool_calls=st.lists(tool_call, max_size=2).map(tuple), reasoning=text),
    st.builds(Message, role=st.just("tool"), content=text, tool_call_id=st.text("abc", max_size=3)),
)
tools = st.lists(
    st.builds(ToolSpec, name=st.sampled_from(["bash", "read"]), description=text, parameters=st.just('{"type": "object"}')),
    max_size=2,
).map(tuple)
conversations = st.builds(Conversation, system=text, tools=tools, messages=st.lists(message, min_size=1, max_size=6).map(tuple))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations)
def test_chunked_render_equals_full_template_render(renderer, conv):
    # With no leading system text, a system *message* first in line would be the template's header
    # in the full rendering; the proxy keeps it a message (it is not the harness's system prompt).
    assume(conv.system or conv.messages[0].role != "system")
    ids, spliced = renderer.render_ids(conv)
    assert spliced == 0
    np.testing.assert_array_equal(ids, renderer.full_render_ids(conv))


def _conv(*messages, system="sys", tools=()):
    return Conversation(system, tools, tuple(messages))


def test_render_is_incremental(embedded_dir):
    from transformers import AutoTokenizer

    fresh = ChatRenderer(AutoTokenizer.from_pretrained(embedded_dir))
    encoded: list[str] = []
    real_encode = fresh.encode
    fresh.encode = lambda s: (encoded.append(s), real_encode(s))[1]
    prompts = RolloutPrompts()
    history = [Message("user", "task")] + [Message("tool", f"result {i}", tool_call_id=str(i)) for i in range(50)]
    prompts.render(fresh, _conv(*history), "main")
    encoded.clear()
    longer = _conv(*history, Message("user", "one more"))
    calls = []
    real_message_ids = fresh.message_ids
    fresh.message_ids = lambda m: (calls.append(m), real_message_ids(m))[1]
    ids = prompts.render(fresh, longer, "main").ids
    # Only the new message is looked up, rendered and tokenized; the prefix is reused as is.
    assert calls == [longer.messages[-1]]
    assert len(encoded) == 1 and "one more" in encoded[0]
    np.testing.assert_array_equal(ids, fresh.full_render_ids(longer))


edits = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(message, min_size=1, max_size=3)),
        st.tuples(st.just("truncate"), st.integers(0, 5)),
        st.tuples(st.just("answer"), st.sampled_from(["ok", "done"])),
        st.tuples(st.just("system"), text),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=edits)
def test_incremental_render_equals_stateless_render(renderer, steps):
    """RolloutPrompts (prefix reuse) against ChatRenderer.render_ids (everything from cached chunks)
    over random histories: extensions, truncations, answered turns, system prompt changes."""
    prompts = RolloutPrompts()
    system, messages = "sys", [Message("user", "start")]
    for kind, arg in steps:
        if kind == "append":
            messages += arg
        elif kind == "truncate":
            messages = messages[: max(1, arg)]
        elif kind == "system":
            system = arg
        conv = Conversation(system, (), tuple(messages))
        got = prompts.render(renderer, conv, "main")
        want, n_spliced = renderer.render_ids(conv, prompts.produced)
        np.testing.assert_array_equal(got.ids, want)
        assert got.spliced_turns == n_spliced
        if kind == "answer":
            output = np.concatenate([renderer.encode(arg), [renderer.turn_end_id]]).astype(np.int32)
            turn = Message("assistant", arg, (ToolCall(f"c{len(messages)}", "bash", "{}"),))
            prompts.remember(renderer, output, turn)
            messages.append(turn)


def test_produced_turn_is_spliced_and_edits_re_render(renderer):
    prompts = RolloutPrompts()
    conv1 = _conv(Message("user", "list files"))
    first = prompts.render(renderer, conv1, "main")
    # The engine answers with tokens that the text re-tokenization would NOT reproduce: "ls" as two
    # single-character tokens. The next prompt must hold exactly these.
    call_text = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    before, after = call_text.split("ls")
    output = np.concatenate(
        [renderer.encode(before), renderer.encode("l"), renderer.encode("s"), renderer.encode(after), [renderer.turn_end_id]]
    ).astype(np.int32)
    replayed = Message("assistant", "", (ToolCall("call_1", "bash", canonical_arguments({"command": "ls"})),))
    prompts.remember(renderer, output, replayed)
    conv2 = _conv(Message("user", "list files"), replayed, Message("tool", "a.py", tool_call_id="call_1"))
    second = prompts.render(renderer, conv2, "main")
    path = np.concatenate([first.ids, output])
    np.testing.assert_array_equal(second.ids[: len(path)], path)
    assert second.spliced_turns == 1
    assert not np.array_equal(second.ids, renderer.full_render_ids(conv2))  # re-tokenizing would differ

    # The harness edits history (drops the tool exchange): the prompt is rendered from where it
    # departs, and equals the template's own rendering.
    conv3 = _conv(Message("user", "list files"), Message("user", "summary so far"))
    third = prompts.render(renderer, conv3, "main")
    np.testing.assert_array_equal(third.ids, renderer.full_render_ids(conv3))


def test_reasoning_does_not_block_splicing(renderer):
    prompts = RolloutPrompts()
    first = prompts.render(renderer, _conv(Message("user", "hi")), "main")
    output = np.concatenate([renderer.encode("<think>\nhmm\n</think>\n\nHello"), [renderer.turn_end_id]]).astype(np.int32)
    prompts.remember(renderer, output, Message("assistant", "Hello"))
    # Chat Completions harnesses drop reasoning_content; the exact tokens (with thinking) come back.
    second = prompts.render(renderer, _conv(Message("user", "hi"), Message("assistant", "Hello "), Message("user", "again")), "main")
    assert second.spliced_turns == 1
    np.testing.assert_array_equal(second.ids[: len(first.ids) + len(output)], np.concatenate([first.ids, output]))


def test_two_turns_alike_but_for_their_thinking_splice_each_its_own(renderer):
    """Two produced turns show the same text ("Done.") after different thinking. Where the harness
    sends the reasoning back, each replayed turn gets its own tokens (the later one's were spliced
    in for both: a history that never happened, and a fork); where it drops it, the last one's."""
    prompts = RolloutPrompts()
    outputs = {}
    for thought in ("first", "second"):
        outputs[thought] = np.concatenate([renderer.encode(f"<think>\n{thought}\n</think>\n\nDone."),
                                           [renderer.turn_end_id]]).astype(np.int32)
        prompts.remember(renderer, outputs[thought], Message("assistant", "Done.", reasoning=thought))
    for sent, want in (("first", "first"), ("second", "second"), ("", "second"), ("edited", "second")):
        conv = _conv(Message("user", "go"), Message("assistant", "Done.", reasoning=sent), Message("user", "more"))
        ids = prompts.render(renderer, conv, f"thread-{sent}").ids
        prefix = renderer.header_ids("sys", ()).size + renderer.message_ids(Message("user", "go")).size
        turn = renderer.produced_turn_ids(outputs[want])
        np.testing.assert_array_equal(ids[prefix:prefix + len(turn)], turn)


def test_generation_prompt_and_stop_tokens(renderer):
    assert renderer.decode(renderer.generation_prompt_ids) == "<|im_start|>assistant\n"
    assert renderer.decode([renderer.turn_end_id]) == "<|im_end|>"
    assert renderer.turn_end_id in renderer.stop_token_ids


def test_verbatim_frames_only_where_the_template_inserts_content_verbatim(embedded_dir):
    """A template that trims user content must not get the concatenation shortcut for users."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_dir)
    tok.chat_template = tok.chat_template.replace(
        "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>", "<|im_start|>{{ message.role }}\n{{ message.content | trim }}<|im_end|>"
    )
    trimming = ChatRenderer(tok)
    assert "user" not in trimming._verbatim and "tool" in trimming._verbatim
    conv = _conv(Message("user", "  spaced out \n"), Message("tool", "  kept  ", tool_call_id="1"))
    ids, _ = trimming.render_ids(conv)
    np.testing.assert_array_equal(ids, trimming.full_render_ids(conv))
    assert "\nspaced out<|im_end|>" in trimming.decode(ids)
