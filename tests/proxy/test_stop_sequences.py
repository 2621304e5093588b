"""Stop sequences (OpenAI ``stop``, Anthropic ``stop_sequences``) through the official SDKs: the
harness gets the text before the first one, the record keeps the fewest sampled tokens that hold it,
and the next call's prompt continues from those tokens."""

from __future__ import annotations

import anthropic
import numpy as np
import openai
import pytest

from clawfast.engines.base import Generation
from clawfast.proxy.stops import before_stop, cut_at_stop, first_stop
from clawfast.proxy.transcript import core_transcript
from clawfast.records import routing_problem
from clawfast.threads import reconstruct

REACT = "Thought: list the files.\nAction: ls\nObservation: a.py b.py\nThought: done"
STOP = "\nObservation:"


def _holding_prefix(renderer, ids, stops) -> int | None:
    """Reference: the shortest prefix of `ids` whose answer text holds a stop sequence, by a scan."""
    for k in range(1, len(ids) + 1):
        if first_stop(renderer.answer_text(ids[:k]), stops) is not None:
            return k
    return None


def test_the_cut_keeps_the_shortest_prefix_that_holds_a_stop_sequence(renderer):
    rng = np.random.default_rng(7)
    words = ["Thought:", "Action:", "ls", "\n", "Observation:", "ünï", "✓", " ", "```", "x=1", "<tool_call>", "END"]
    for _ in range(60):
        text = "".join(rng.choice(words, size=int(rng.integers(1, 30))))
        ids = np.asarray(list(renderer.encode(text)) + [renderer.turn_end_id], np.int32)
        n = len(ids)
        # Stops: pieces of the text itself (so most cuts happen) and one that may not occur.
        starts = rng.integers(0, len(text), size=2)
        stops = tuple(text[s:s + int(rng.integers(1, 6))] for s in starts) + (str(rng.choice(words)),)
        prompt_len, routing_start = int(rng.integers(1, 9)), int(rng.integers(0, 4))
        routing = rng.integers(0, 8, size=(prompt_len + n - 1 - routing_start, 2, 2)).astype(np.uint8)
        gen = Generation(ids, -rng.uniform(0, 2, n).astype(np.float32), "length", 3,
                         output_versions=np.arange(n, dtype=np.int64), routing=routing, routing_start=routing_start)
        cut = cut_at_stop(gen, prompt_len, stops, renderer.answer_text)
        k = _holding_prefix(renderer, ids, stops)
        if k is None:
            assert cut is gen
            continue
        assert len(cut.output_ids) == k and cut.finish_reason == "stop"
        np.testing.assert_array_equal(cut.output_ids, ids[:k])
        np.testing.assert_array_equal(cut.infer_logprobs, gen.infer_logprobs[:k])
        np.testing.assert_array_equal(cut.output_versions, np.arange(k))
        rows = prompt_len + k - 1 - routing_start  # the rows of every fed-back token of the kept path
        assert (cut.routing is None) == (rows <= 0)
        if rows > 0:
            np.testing.assert_array_equal(cut.routing, routing[:rows])
        assert routing_problem(cut.routing, cut.routing_start, prompt_len + k) is None
        # The harness sees the text before the first stop sequence completed by a token (the earliest
        # of those the same token completes).
        visible, stop = before_stop(renderer.answer_text(cut.output_ids), stops)
        assert stop is not None and text.startswith(visible + stop)


def test_the_earliest_stop_wins_and_the_longest_at_one_place():
    assert first_stop("a\nObs: x\nEnd", ["\nEnd", "\nObs"]) == (1, "\nObs")
    assert first_stop("a\nObservation", ["\nObs", "\nObservation"]) == (1, "\nObservation")
    assert before_stop("no stop here", ["\nObs"]) == ("no stop here", None)


@pytest.mark.parametrize("stop", [STOP, [STOP, "\nNever"]])
def test_openai_chat_ends_at_the_stop_sequence_and_the_next_call_continues_its_tokens(proxy, stop):
    proxy.engine.push(REACT, "Final answer: two files.")
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.key, max_retries=0)
    messages = [{"role": "user", "content": "What files are here?"}]
    reply = client.chat.completions.create(model="policy", messages=messages, stop=stop)
    choice = reply.choices[0]
    assert choice.message.content == "Thought: list the files.\nAction: ls"
    assert choice.finish_reason == "stop"
    first = proxy.calls()[0]
    assert first.metadata["stop_sequence"] == STOP
    assert STOP in proxy.core.renderer.decode(first.output_ids)
    assert reply.usage.completion_tokens == len(first.output_ids) < len(proxy.core.renderer.encode(REACT))
    # The harness answers the action; the policy's own cut tokens are what the next prompt holds.
    messages += [{"role": "assistant", "content": choice.message.content},
                 {"role": "user", "content": "Observation: a.py b.py"}]
    client.chat.completions.create(model="policy", messages=messages, stop=stop)
    calls = proxy.calls()
    path = np.concatenate([first.prompt_ids, first.output_ids])
    np.testing.assert_array_equal(calls[1].prompt_ids[: len(path)], path)
    assert reconstruct(calls).kind_of() == {0: "main", 1: "main"}
    # The transcript graders read holds what the harness was sent, not the tokens past the stop.
    events = core_transcript(proxy.core, calls)
    assert [e["message"]["content"] for e in events][:2] == [
        [{"type": "text", "text": "Thought: list the files.\nAction: ls"}],
        [{"type": "text", "text": "Observation: a.py b.py"}],
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_reports_the_stop_sequence_it_ended_at(proxy, stream):
    proxy.engine.push(REACT)
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    kwargs = dict(model="policy", max_tokens=256, messages=[{"role": "user", "content": "files?"}],
                  stop_sequences=["\nAction:", STOP])
    if stream:
        with client.messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "\nAction:"
    assert [b.text for b in message.content] == ["Thought: list the files."]


def test_a_tool_call_before_the_stop_sequence_is_still_a_tool_call(proxy):
    proxy.engine.push({"text": "Running it.", "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]})
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    tools = [{"name": "bash", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    message = client.messages.create(model="policy", max_tokens=256, tools=tools, stop_sequences=["</tool_call>"],
                                     messages=[{"role": "user", "content": "files?"}])
    # The cut falls inside the tool-call block: the call cannot be read, and the text goes back as text.
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "</tool_call>"
    assert proxy.calls()[0].metadata["parse_error"].startswith("unterminated")
    proxy.engine.push({"text": "Running it.", "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]})
    message = client.messages.create(model="policy", max_tokens=256, tools=tools, stop_sequences=["\nNever"],
                                      messages=[{"role": "user", "content": "files?"}])
    assert message.stop_reason == "tool_use" and message.stop_sequence is None


@pytest.mark.parametrize("protocol", ["chat", "anthropic"])
def test_an_empty_stop_sequence_is_refused(proxy, protocol):
    if protocol == "chat":
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.key, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="stop sequence must not be empty"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], stop=["", "x"])
    else:
        client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="stop sequence must not be empty"):
            client.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                   stop_sequences=[""])
    assert proxy.calls() == [] and proxy.engine.calls == 0


def test_after_a_prefill_the_cut_reads_the_text_the_reply_does(embedded_dir, proxy_factory, tmp_path):
    """A SentencePiece-style decoder drops a leading space at the start of a decode: the answer past a
    prefill is decoded after the prefill's tokens. The stop cut reads that same text, so the record
    keeps only the tokens before the stop the reply ended at (a cut that decoded the answer alone
    would miss " STOP" and train tokens the harness never got)."""
    from tokenizers import decoders
    from transformers import AutoTokenizer

    from clawfast.proxy import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    # Llama 2 / Mistral v1's decoder shape: pieces joined, then one leading space stripped.
    tokenizer.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Fuse(),
                                                             decoders.Strip(" ", 1, 0)])
    renderer = ChatRenderer(tokenizer)
    live = proxy_factory(tmp_path, renderer=renderer)
    try:
        output = " STOP and more"
        live.engine.push(output)
        client = anthropic.Anthropic(base_url=live.url, api_key=live.key, max_retries=0)
        message = client.messages.create(model="policy", max_tokens=64, stop_sequences=[" STOP"], messages=[
            {"role": "user", "content": "go"}, {"role": "assistant", "content": "Answer:"}])
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == " STOP"
        assert "".join(b.text for b in message.content) == ""
        (record,) = live.calls()
        stop_ids = renderer.encode(" STOP")
        np.testing.assert_array_equal(record.output_ids, renderer.encode(output)[: len(stop_ids)])
    finally:
        live.server.stop()
