"""Log-probs through the official openai SDK: Chat Completions ``logprobs`` lists each sampled token
with the log-prob the call recorded (the policy's, at sampling), streamed or not; ``top_logprobs``
alternatives, which no engine reports, and Responses' log-probs are a 400 rather than an empty list."""

from __future__ import annotations

import numpy as np
import openai
import pytest

USER = {"role": "user", "content": "Say hello."}
TOOLS = [{"type": "function", "function": {"name": "Bash", "description": "Run a shell command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


def _client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.key, max_retries=0)


def _check_against_record(content, record, renderer) -> None:
    assert len(content) == len(record.output_ids) > 1
    assert [c.token for c in content] == [renderer.decode([t]) for t in record.output_ids]
    np.testing.assert_allclose([c.logprob for c in content], record.infer_logprobs, rtol=1e-6)
    assert all(c.bytes == list(c.token.encode()) and c.top_logprobs == [] for c in content)


def test_logprobs_list_every_sampled_token_with_its_recorded_log_prob(proxy, renderer):
    proxy.engine.push('Hello there.\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>')
    reply = _client(proxy).chat.completions.create(model="policy", messages=[USER], tools=TOOLS, logprobs=True)
    record = proxy.calls()[0]
    # Tool-call markup and the turn's end are sampled tokens too (as vLLM lists them).
    _check_against_record(reply.choices[0].logprobs.content, record, renderer)
    assert renderer.decode([record.output_ids[-1]]) == reply.choices[0].logprobs.content[-1].token


def test_streamed_logprobs_accumulate_to_the_same_list(proxy, renderer):
    proxy.engine.push("Hello there, how are you today?")
    stream = _client(proxy).chat.completions.create(model="policy", messages=[USER], logprobs=True, stream=True)
    content = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    _check_against_record(content, proxy.calls()[0], renderer)


def test_without_logprobs_the_reply_has_none(proxy):
    proxy.engine.push("Hello.")
    assert _client(proxy).chat.completions.create(model="policy", messages=[USER]).choices[0].logprobs is None


@pytest.mark.parametrize("kwargs, message", [
    ({"logprobs": True, "top_logprobs": 2}, "top_logprobs is not supported"),
    ({"top_logprobs": 2}, "top_logprobs requires logprobs"),
])
def test_top_logprobs_is_refused_and_nothing_is_generated(proxy, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message) as err:
        _client(proxy).chat.completions.create(model="policy", messages=[USER], **kwargs)
    assert err.value.body["param"] == "top_logprobs"
    assert proxy.calls() == []


@pytest.mark.parametrize("kwargs, param", [
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_responses_log_probs_are_refused(proxy, kwargs, param):
    with pytest.raises(openai.BadRequestError, match="log-probs are not supported on this endpoint") as err:
        _client(proxy).responses.create(model="policy", input="Say hello.", **kwargs)
    assert err.value.body["param"] == param and proxy.calls() == []
    # What Codex includes is no log-prob.
    proxy.engine.push("Hello.")
    reply = _client(proxy).responses.create(model="policy", input="Say hello.", include=["reasoning.encrypted_content"])
    assert reply.output_text == "Hello."
