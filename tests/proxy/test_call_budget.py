"""A per-rollout model-call budget (the rollout's `Sampling.max_calls`, set when it is opened): the step
bound for harnesses with no turn limit of their own. Calls beyond it are refused in the caller's
protocol, record nothing, and never touch other rollouts."""

from __future__ import annotations

import threading

import anthropic
import httpx
import openai
import pytest

from clawfast.engines.base import Sampling
from clawfast.engines.scripted import ScriptedEngine
from clawfast.proxy import ProxyConfig
from gated_engine import GatedScriptedEngine, wait_for


def test_calls_beyond_the_budget_are_refused_in_each_protocol(proxy_factory, tmp_path):
    live = proxy_factory(tmp_path, script=["Hello."], cycle=True)
    try:
        budgeted = live.registry.open("b", harness="test", sampling=Sampling(max_calls=2))
        claude = anthropic.Anthropic(base_url=live.url, api_key=budgeted.key, max_retries=0)
        gpt = openai.OpenAI(base_url=live.url + "/v1", api_key=budgeted.key, max_retries=0)
        ask = dict(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert claude.messages.create(**ask).content[0].text == "Hello."
        assert gpt.chat.completions.create(model="policy", messages=ask["messages"]).choices[0].message.content == "Hello."
        with pytest.raises(anthropic.BadRequestError, match="budget of 2 model calls is spent"):
            claude.messages.create(**ask)
        with pytest.raises(openai.BadRequestError, match="budget of 2 model calls is spent"):
            gpt.chat.completions.create(model="policy", messages=ask["messages"])
        with pytest.raises(openai.BadRequestError, match="budget of 2 model calls is spent"):
            gpt.responses.create(model="policy", input="hi")
        assert len(live.calls("b")) == 2
        # Another rollout of the same proxy, opened without a budget, is not limited by it.
        fresh = anthropic.Anthropic(base_url=live.url, api_key=live.key, max_retries=0)
        for _ in range(3):
            assert fresh.messages.create(**ask).content[0].text == "Hello."
        assert len(live.calls("r0")) == 3
    finally:
        live.server.stop()


def test_calls_in_flight_count_against_the_budget(proxy_factory, tmp_path):
    live = proxy_factory(tmp_path, engine_cls=GatedScriptedEngine, config=ProxyConfig(keepalive_s=0.05),
                         script=["Hello."], cycle=True)
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": live.registry.open("b", harness="test", sampling=Sampling(max_calls=1)).key}
    try:
        first = []
        thread = threading.Thread(target=lambda: first.append(httpx.post(live.url + "/v1/messages", json=body, headers=headers, timeout=10)))
        thread.start()
        assert live.engine.started.wait(5)
        second = httpx.post(live.url + "/v1/messages", json=body, headers=headers, timeout=10)
        assert second.status_code == 400 and second.json()["error"]["type"] == "invalid_request_error"
        live.engine.gate.set()
        thread.join(10)
        assert first[0].status_code == 200
        wait_for(lambda: len(live.calls("b")) == 1)
    finally:
        live.engine.gate.set()
        live.server.stop()


def test_budget_must_be_positive_in_the_train_config():
    from pydantic import ValidationError

    from clawfast.train.config import RolloutSection

    assert RolloutSection(max_model_calls=12).max_model_calls == 12
    with pytest.raises(ValidationError, match="max_model_calls"):
        RolloutSection(max_model_calls=0)


class RecordingEngine(ScriptedEngine):
    """The scripted engine, keeping the `SamplingParams` of every call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.params = []

    async def generate(self, prompt_ids, params):
        self.params.append(params)
        return await super().generate(prompt_ids, params)


def test_each_rollout_samples_with_its_own_sampling(proxy_factory, tmp_path):
    """Temperature, top_p and the output cap travel with the rollout: two rollouts of one proxy with
    different sampling, asked the same thing, sample differently; one opened without keeps the request's."""
    live = proxy_factory(tmp_path, engine_cls=RecordingEngine, script=["Hello."], cycle=True)
    try:
        greedy = live.registry.open("g", harness="test", sampling=Sampling(temperature=0.0, max_tokens=4))
        hot = live.registry.open("h", harness="test", sampling=Sampling(temperature=1.3, top_p=0.9))
        ask = dict(model="policy", max_tokens=8, temperature=0.7, messages=[{"role": "user", "content": "hi"}])
        for key in (greedy.key, hot.key, live.key):
            openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0).chat.completions.create(**ask)
        got = [(p.temperature, p.top_p, p.max_tokens) for p in live.engine.params]
        assert got == [(0.0, 1.0, 4), (1.3, 0.9, 8), (0.7, 1.0, 8)]
    finally:
        live.server.stop()
