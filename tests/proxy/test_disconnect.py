"""Keep-alives while the engine works, client disconnects mid-turn, and rollouts closed mid-turn."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from clawfast.engines.scripted import ScriptedEngine
from clawfast.proxy import ProxyConfig
from gated_engine import GatedScriptedEngine, wait_for


@pytest.fixture
def gated(proxy_factory, tmp_path):
    live = proxy_factory(tmp_path, engine_cls=GatedScriptedEngine, config=ProxyConfig(keepalive_s=0.05), script=["Hello."], cycle=True)
    yield live
    live.engine.gate.set()
    live.server.stop()


ANTHROPIC_BODY = {"model": "policy", "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def test_anthropic_stream_sends_pings_while_generating(gated):
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", gated.url + "/v1/messages", json=ANTHROPIC_BODY, headers={"x-api-key": gated.key}) as r:
            events, pings = [], 0
            for line in r.iter_lines():
                if line.startswith("event: "):
                    events.append(line[7:])
                    pings += line == "event: ping"
                    if pings == 3:
                        gated.engine.gate.set()
    assert events[0] == "message_start"
    assert events.count("ping") >= 3
    rest = [e for e in events if e != "ping"]
    assert rest == ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]


def test_chat_stream_keepalive_comments(gated):
    body = {"model": "policy", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", gated.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {gated.key}"}) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if lines.count(": keep-alive") == 2:
                    gated.engine.gate.set()
    assert lines[0].startswith("data: ") and '"role":"assistant"' in lines[0]
    assert lines[-2] == "data: [DONE]" or lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_mid_turn_is_recorded_and_leaks_nothing(gated, stream):
    body = dict(ANTHROPIC_BODY, stream=stream)
    client = httpx.Client(timeout=10)
    try:
        if stream:
            with client.stream("POST", gated.url + "/v1/messages", json=body, headers={"x-api-key": gated.key}) as r:
                first = next(r.iter_lines())
                assert first == "event: message_start"
            # leaving the block closes the connection mid-turn
        else:
            gated.engine.started.clear()
            thread = threading.Thread(
                target=lambda: pytest.raises(httpx.HTTPError, httpx.post, gated.url + "/v1/messages", json=body,
                                             headers={"x-api-key": gated.key}, timeout=0.3)
            )
            thread.start()
            thread.join()
    finally:
        client.close()
    assert gated.engine.started.wait(5)
    time.sleep(0.2)  # the server notices the disconnect while the engine is still held
    assert gated.calls() == []
    gated.engine.gate.set()
    wait_for(lambda: len(gated.calls()) == 1)
    (call,) = gated.calls()
    assert call.metadata["client_disconnected"] is True
    assert len(call.output_ids) > 0
    wait_for(lambda: gated.core.pending == 0)


@pytest.mark.parametrize("stream", [True, False])
def test_closing_a_rollout_cancels_its_generation_and_answers_401(gated, stream):
    """A harness killed on timeout leaves calls in the engine: closing its rollout must free the engine."""
    body = dict(ANTHROPIC_BODY, stream=stream)
    replies = []
    thread = threading.Thread(target=lambda: replies.append(
        httpx.post(gated.url + "/v1/messages", json=body, headers={"x-api-key": gated.key}, timeout=10)))
    thread.start()
    assert gated.engine.started.wait(5)
    result = gated.registry.close(gated.rollout_id, reward=0.0, status="timeout")
    thread.join(10)
    wait_for(lambda: gated.core.pending == 0)
    assert gated.engine.cancelled == 1
    assert result.calls == []
    (reply,) = replies
    if stream:  # the head went out before the close: the 401 is an SSE error event
        assert reply.status_code == 200 and reply.text.rstrip().split("\n")[-2] == "event: error"
        assert '"authentication_error"' in reply.text
    else:
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        assert "closed while this call was generating" in reply.json()["error"]["message"]


def test_closing_a_rollout_cancels_a_disconnected_call(gated):
    """A call whose client left is recorded when it ends, unless its rollout closes first: then it is
    cancelled, not run to the end for a record that would be dropped."""
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", gated.url + "/v1/messages", json=ANTHROPIC_BODY, headers={"x-api-key": gated.key}) as r:
            assert next(r.iter_lines()) == "event: message_start"
    assert gated.engine.started.wait(5)
    time.sleep(0.2)  # the server notices the disconnect
    opened = gated.registry.open("r1", harness="test")  # a rollout that stays open keeps its calls
    result = gated.registry.close(gated.rollout_id)
    wait_for(lambda: gated.core.pending == 0)
    assert gated.engine.cancelled == 1 and result.calls == []
    gated.engine.gate.set()
    r = httpx.post(gated.url + "/v1/messages", json=dict(ANTHROPIC_BODY, stream=False), headers={"x-api-key": opened.key}, timeout=10)
    assert r.status_code == 200 and len(gated.calls("r1")) == 1


class RefusingEngine(ScriptedEngine):
    """The scripted engine refusing (ValueError, as an engine does for a prompt too long) or failing,
    at once or after `delay` seconds."""

    kind, delay = "refuse", 0.0

    async def generate(self, prompt_ids, params):
        if self.delay:
            await asyncio.sleep(self.delay)
        raise (ValueError if self.kind == "refuse" else RuntimeError)("no")


@pytest.mark.parametrize("kind, status", [("refuse", 400), ("fail", 500)])
def test_engine_errors_answer_in_protocol_shape_and_record_nothing(proxy_factory, tmp_path, kind, status):
    live = proxy_factory(tmp_path, engine_cls=RefusingEngine, config=ProxyConfig(keepalive_s=0.05))
    live.engine.kind = kind
    headers = {"x-api-key": live.key}
    try:
        for stream in (False, True):  # nothing sent yet: a real status, not an SSE error event
            r = httpx.post(live.url + "/v1/messages", json=dict(ANTHROPIC_BODY, stream=stream), headers=headers, timeout=10)
            assert r.status_code == status and r.json()["type"] == "error"
        r = httpx.post(live.url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                       headers=headers, timeout=10)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
        # A slow failure: the stream head and keep-alives went out, so the error is an SSE event.
        live.engine.delay = 0.2
        r = httpx.post(live.url + "/v1/messages", json=ANTHROPIC_BODY, headers=headers, timeout=10)
        assert r.status_code == 200
        assert r.text.startswith("event: message_start") and "event: ping" in r.text
        assert r.text.rstrip().split("\n")[-2] == "event: error"
        assert live.calls() == []
    finally:
        live.server.stop()



def test_responses_stream_keepalives_are_events_the_sdk_passes_over(gated):
    """Codex waits for SSE events, not bytes: a comment would not reset its idle timer. The keep-alive
    is response.in_progress again, numbered in sequence, and the SDK's stream still ends complete."""
    import openai

    client = openai.OpenAI(base_url=gated.url + "/v1", api_key=gated.key, max_retries=0)
    kinds, numbers = [], []
    fallback = threading.Timer(3, gated.engine.gate.set)  # without keep-alive events the loop sees none
    fallback.start()
    with client.responses.stream(model="policy", input="hi") as stream:
        for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if kinds.count("response.in_progress") == 3:
                gated.engine.gate.set()
        final = stream.get_final_response()
    fallback.cancel()
    assert kinds[:4] == ["response.created"] + ["response.in_progress"] * 3
    assert numbers == list(range(len(numbers)))
    assert kinds[-1] == "response.completed" and final.output_text == "Hello."
