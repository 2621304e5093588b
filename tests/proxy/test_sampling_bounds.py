"""Sampling parameters a request may carry: top_p must be above 0 (top_p 0 keeps no token: the torch
engine's sampler would draw from NaN), refused with a 400 naming it in each protocol, before any
engine sees it; and chat's top_k -1 (vLLM's "no top-k") still reaches the engine as 0, which the
engines' SamplingParams, refusing a negative top_k, depends on."""

from __future__ import annotations

import anthropic
import openai
import pytest

from gated_engine import RecordingEngine


def test_top_p_zero_is_refused_in_each_protocol(proxy_factory, tmp_path):
    live = proxy_factory(tmp_path, engine_cls=RecordingEngine, script=["Hello."], cycle=True)
    try:
        claude = anthropic.Anthropic(base_url=live.url, api_key=live.key, max_retries=0)
        gpt = openai.OpenAI(base_url=live.url + "/v1", api_key=live.key, max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError, match="top_p") as chat:
            gpt.chat.completions.create(model="policy", messages=messages, top_p=0.0)
        with pytest.raises(openai.BadRequestError, match="top_p") as responses:
            gpt.responses.create(model="policy", input="hi", top_p=0.0)
        with pytest.raises(anthropic.BadRequestError, match="top_p") as messages_api:
            claude.messages.create(model="policy", max_tokens=8, messages=messages, extra_body={"top_p": 0.0})
        assert chat.value.status_code == responses.value.status_code == messages_api.value.status_code == 400
        assert live.engine.params == [] and live.calls() == []  # refused before the engine
        # The bounds themselves are served: the smallest positive top_p and 1.
        for top_p in (1e-6, 1.0):
            assert gpt.chat.completions.create(model="policy", messages=messages, top_p=top_p).choices
        assert [p.top_p for p in live.engine.params] == [1e-6, 1.0]
    finally:
        live.server.stop()


def test_chat_top_k_minus_one_is_no_top_k(proxy_factory, tmp_path):
    live = proxy_factory(tmp_path, engine_cls=RecordingEngine, script=["Hello."], cycle=True)
    try:
        gpt = openai.OpenAI(base_url=live.url + "/v1", api_key=live.key, max_retries=0)
        gpt.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                    extra_body={"top_k": -1})
        assert [p.top_k for p in live.engine.params] == [0]
    finally:
        live.server.stop()
