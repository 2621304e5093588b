"""A per-rollout model-call budget (ProxyConfig.max_calls_per_rollout): the step bound for harnesses
with no turn limit of their own. Calls beyond it are refused in the caller's protocol, record nothing,
and never touch other rollouts."""

from __future__ import annotations

import threading

import anthropic
import httpx
import openai
import pytest

from clawfast.proxy import ProxyConfig
from gated_engine import GatedScriptedEngine, wait_for


def test_calls_beyond_the_budget_are_refused_in_each_protocol(proxy_factory, tmp_path):
    live = proxy_factory(tmp_path, config=ProxyConfig(max_calls_per_rollout=2), script=["Hello."], cycle=True)
    try:
        claude = anthropic.Anthropic(base_url=live.url, api_key=live.key, max_retries=0)
        gpt = openai.OpenAI(base_url=live.url + "/v1", api_key=live.key, max_retries=0)
        ask = dict(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert claude.messages.create(**ask).content[0].text == "Hello."
        assert gpt.chat.completions.create(model="policy", messages=ask["messages"]).choices[0].message.content == "Hello."
        with pytest.raises(anthropic.BadRequestError, match="budget of 2 model calls is spent"):
            claude.messages.create(**ask)
        with pytest.raises(openai.BadRequestError, match="budget of 2 model calls is spent"):
            gpt.chat.completions.create(model="policy", messages=ask["messages"])
        with pytest.raises(openai.BadRequestError, match="budget of 2 model calls is spent"):
            gpt.responses.create(model="policy", input="hi")
        assert len(live.calls()) == 2
        other = live.registry.open("r1", harness="test")
        fresh = anthropic.Anthropic(base_url=live.url, api_key=other.key, max_retries=0)
        assert fresh.messages.create(**ask).content[0].text == "Hello."
        assert len(live.calls("r1")) == 1
    finally:
        live.server.stop()


def test_calls_in_flight_count_against_the_budget(proxy_factory, tmp_path):
    live = proxy_factory(tmp_path, engine_cls=GatedScriptedEngine, config=ProxyConfig(keepalive_s=0.05, max_calls_per_rollout=1),
                         script=["Hello."], cycle=True)
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": live.key}
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
        wait_for(lambda: len(live.calls()) == 1)
    finally:
        live.engine.gate.set()
        live.server.stop()


def test_budget_must_be_positive_in_the_train_config():
    from pydantic import ValidationError

    from clawfast.train.config import RolloutSection

    assert RolloutSection(max_model_calls=12).max_model_calls == 12
    with pytest.raises(ValidationError, match="max_model_calls"):
        RolloutSection(max_model_calls=0)
