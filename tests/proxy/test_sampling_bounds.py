"""Sampling parameters a request may carry: top_p 0, which the real APIs accept and no engine's
sampler takes (top_p must lie in (0, 1] there: the torch engine's would draw from NaN), reaches the
engine as top_k 1, the nucleus of least mass, in each protocol, unless the rollout's own top_p wins;
and chat's top_k -1 (vLLM's "no top-k") reaches the engine as 0, which the engines' SamplingParams,
refusing a negative top_k, depends on."""

from __future__ import annotations

import anthropic
import openai
import pytest

from clawfast.engines.base import Sampling
from gated_engine import RecordingEngine


def test_top_p_zero_is_the_most_likely_token_in_each_protocol(proxy_factory, tmp_path):
    live = proxy_factory(tmp_path, engine_cls=RecordingEngine, script=["Hello."], cycle=True)
    try:
        claude = anthropic.Anthropic(base_url=live.url, api_key=live.key, max_retries=0)
        gpt = openai.OpenAI(base_url=live.url + "/v1", api_key=live.key, max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        gpt.chat.completions.create(model="policy", messages=messages, top_p=0.0)
        gpt.responses.create(model="policy", input="hi", top_p=0.0)
        claude.messages.create(model="policy", max_tokens=8, messages=messages, extra_body={"top_p": 0.0})
        assert [(p.top_p, p.top_k) for p in live.engine.params] == [(1.0, 1)] * 3
        # The bounds themselves are served as asked: the smallest positive top_p and 1.
        for top_p in (1e-6, 1.0):
            assert gpt.chat.completions.create(model="policy", messages=messages, top_p=top_p).choices
        assert [(p.top_p, p.top_k) for p in live.engine.params[3:]] == [(1e-6, 0), (1.0, 0)]
    finally:
        live.server.stop()


def test_the_rollouts_top_p_wins_over_a_calls_top_p_zero():
    assert Sampling(top_p=0.9).params(cap=8, default_max_tokens=8, top_p=0.0).top_p == 0.9
    assert Sampling().params(cap=8, default_max_tokens=8, top_p=0.0, top_k=5).top_k == 1


def test_the_rollouts_top_k_wins_over_a_calls_top_k_and_top_p_zero():
    """A training run samples the whole distribution (top_k 0) whatever a harness asks: its sampling
    log-probs are then the policy's, which the trainer computes."""
    whole = Sampling(top_k=0)
    for asked in ({"top_k": 20}, {"top_p": 0.0}, {"top_p": 0.0, "top_k": 5}, {}):
        params = whole.params(cap=8, default_max_tokens=8, **asked)
        assert (params.top_k, params.top_p) == (0, 1.0), asked
    assert Sampling(top_k=3).params(cap=8, default_max_tokens=8, top_k=20).top_k == 3
    assert Sampling().params(cap=8, default_max_tokens=8, top_k=20).top_k == 20  # none set: the call's
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        Sampling(top_k=-1)


def test_a_training_run_samples_with_its_own_top_k():
    from clawfast.train.build import rollout_sampling
    from clawfast.train.config import RunConfig

    assert rollout_sampling(RunConfig(), 1.0).top_k == 0
    assert rollout_sampling(RunConfig.model_validate({"engine": {"top_k": 7}}), 1.0).top_k == 7


def test_chat_top_k_minus_one_is_no_top_k(proxy_factory, tmp_path):
    live = proxy_factory(tmp_path, engine_cls=RecordingEngine, script=["Hello."], cycle=True)
    try:
        gpt = openai.OpenAI(base_url=live.url + "/v1", api_key=live.key, max_retries=0)
        gpt.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                    extra_body={"top_k": -1})
        assert [p.top_k for p in live.engine.params] == [0]
    finally:
        live.server.stop()
