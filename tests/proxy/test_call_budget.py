"""A per-rollout model-call budget (the rollout's `Sampling.max_calls`, set when it is opened): the step
bound for harnesses with no turn limit of their own. Calls beyond it are refused in the caller's
protocol, record nothing, and never touch other rollouts."""

from __future__ import annotations

import asyncio
import random
import threading

import anthropic
import httpx
import openai
import pytest

from clawfast.engines.base import Sampling
from clawfast.engines.scripted import ScriptedEngine
from clawfast.proxy import ProxyConfig
from gated_engine import GatedScriptedEngine, RecordingEngine, wait_for


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


class JitteryEngine(ScriptedEngine):
    """The scripted engine, answering after a random 0-20 ms (calls end in any order)."""

    async def generate(self, prompt_ids, params):
        await asyncio.sleep(random.uniform(0.0, 0.02))
        return await super().generate(prompt_ids, params)


def test_the_budget_holds_under_concurrent_calls(proxy_factory, tmp_path):
    """Many clients of one rollout calling at once never get more than its budget through. A count of
    answered calls plus generations in flight dipped between a generation's end and its record, and
    a call let through in that gap overran the budget (2 of 40 such rollouts did)."""
    live = proxy_factory(tmp_path, engine_cls=JitteryEngine, script=["Hello."], cycle=True)
    budget, clients, calls_each, rollouts = 3, 8, 6, 40
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}

    async def hammer(key: str) -> list[int]:
        async with httpx.AsyncClient(base_url=live.url, headers={"authorization": f"Bearer {key}"}, timeout=30) as c:
            async def client() -> list[int]:
                statuses = []
                for _ in range(calls_each):
                    statuses.append((await c.post("/v1/chat/completions", json=body)).status_code)
                    await asyncio.sleep(random.uniform(0.0, 0.005))
                return statuses

            return [s for statuses in await asyncio.gather(*(client() for _ in range(clients))) for s in statuses]

    try:
        for i in range(rollouts):
            opened = live.registry.open(f"b{i}", harness="test", sampling=Sampling(max_calls=budget))
            statuses = asyncio.run(hammer(opened.key))
            result = live.registry.close(opened.rollout_id)
            assert len(result.calls) == statuses.count(200) == budget, (i, len(result.calls), sorted(statuses))
            assert len(result.info["refusals"]) == clients * calls_each - budget
    finally:
        live.server.stop()


def test_a_finished_call_counts_before_its_record_is_written(renderer, tmp_path):
    """The gap itself, step by step: a call whose generation has ended but whose record is not written
    yet still counts. A call refused before it reached the engine (here: too long) does not."""
    from clawfast.proxy import ProxyCore, RolloutRegistry
    from clawfast.proxy.canonical import Conversation, Message, Request
    from clawfast.proxy.chat import ChatFront
    from clawfast.proxy.front import ProtocolError

    engine = ScriptedEngine(renderer.encode, renderer.turn_end_id, ["Hello."], cycle=True)
    core = ProxyCore(engine, renderer, ProxyConfig(max_model_len=64))
    registry = RolloutRegistry(tmp_path / "records")
    rollout = registry.lookup(registry.open("b", sampling=Sampling(max_calls=2)).key)

    def prepare(text: str):
        request = Request("chat", Conversation("", (), (Message("user", text),)), "policy", False, 8)
        return core.prepare(ChatFront(), rollout, request, {})

    async def main() -> None:
        with pytest.raises(ProtocolError, match="prompt is too long"):
            prepare("word " * 100)
        first = prepare("hi")
        gen = await core.start(first)  # ended and no longer tracked; its record is not written yet
        prepare("hi")
        with pytest.raises(ProtocolError, match="budget of 2 model calls is spent"):
            prepare("hi")
        core.complete(first, gen)

    asyncio.run(main())
    assert rollout.calls_started() == 2 and len(registry.close("b").calls) == 1


def test_budget_must_be_positive_in_the_train_config():
    from pydantic import ValidationError

    from clawfast.train.config import RolloutSection

    assert RolloutSection(max_model_calls=12).max_model_calls == 12
    with pytest.raises(ValidationError, match="max_model_calls"):
        RolloutSection(max_model_calls=0)


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
