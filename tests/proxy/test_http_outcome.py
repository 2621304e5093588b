"""How each request ended, kept where a user looks: every answered call's record carries the HTTP
status it was answered with; every request refused after its key resolved to a rollout is one of that
rollout's refusals (returned by close and read back from its .cfr file); and the access log has one
JSON line per HTTP request. All through real HTTP clients against a live proxy."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest

from clawfast.engines.base import Sampling
from clawfast.engines.scripted import ScriptedEngine
from clawfast.proxy import ProxyApp, ProxyConfig, ProxyCore, ProxyServer, RolloutRegistry
from clawfast.proxy.rollouts import MAX_REFUSAL_MESSAGE, MAX_REFUSALS, refusal
from clawfast.proxy.server import DISCONNECTED, AccessLog
from clawfast.records import read_rollout, rollout_path
from gated_engine import GatedScriptedEngine, wait_for

HI = [{"role": "user", "content": "hi"}]
ANTHROPIC_BODY = {"model": "policy", "max_tokens": 8, "messages": HI}
CHAT_BODY = {"model": "policy", "messages": HI}


class Live:
    """A started proxy (optionally with an access log) over `engine_cls`."""

    def __init__(self, renderer, tmp_path, engine_cls=ScriptedEngine, config=None, access_log=None, **engine_kwargs):
        self.engine = engine_cls(renderer.encode, renderer.turn_end_id, **engine_kwargs)
        self.registry = RolloutRegistry(tmp_path / "records")
        core = ProxyCore(self.engine, renderer, config or ProxyConfig(keepalive_s=0.05))
        self.server = ProxyServer(ProxyApp(core, self.registry, access_log=access_log)).start()
        self.url = self.server.base_url
        self.access_log = access_log

    def open(self, rollout_id: str, **kwargs) -> str:
        return self.registry.open(rollout_id, harness="test", **kwargs).key

    def close(self, rollout_id: str, **kwargs):
        """(the result close returns, the rollout read back from its file)."""
        result = self.registry.close(rollout_id, **kwargs)
        return result, read_rollout(rollout_path(self.registry.records_dir, rollout_id))

    def log_lines(self, n: int) -> list[dict]:
        """The access log's first `n` lines, once they are there, in order of arrival."""

        def lines():
            return self.access_log.read_text().splitlines() if self.access_log.exists() else []

        wait_for(lambda: len(lines()) >= n)
        return sorted((json.loads(line) for line in lines()), key=lambda e: e["time"])


@pytest.fixture
def start(renderer, tmp_path):
    started = []

    def make(**kwargs) -> Live:
        live = Live(renderer, tmp_path, **kwargs)
        started.append(live)
        return live

    yield make
    for live in started:
        if isinstance(live.engine, GatedScriptedEngine):
            live.engine.gate.set()
        live.server.stop()


class FailingEngine(ScriptedEngine):
    """Refuses (ValueError, as an engine does for a prompt too long) or fails, after `delay` seconds."""

    kind, delay = "fail", 0.0

    async def generate(self, prompt_ids, params):
        if self.delay:
            await asyncio.sleep(self.delay)
        raise (ValueError if self.kind == "refuse" else RuntimeError)("no")


def facts(entries):
    return [(e["status"], e["error_type"], e["protocol"], e["path"], e["stream"]) for e in entries]


# -- records ---------------------------------------------------------------------------------------


def test_answered_calls_record_http_status_200(start):
    live = start(script=["Hello."], cycle=True)
    key = live.open("r")
    claude = anthropic.Anthropic(base_url=live.url, api_key=key, max_retries=0)
    gpt = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)
    claude.messages.create(**ANTHROPIC_BODY)
    with claude.messages.stream(**ANTHROPIC_BODY) as s:
        assert s.get_final_message().content[0].text == "Hello."
    gpt.chat.completions.create(**CHAT_BODY)
    assert "".join(c.choices[0].delta.content or "" for c in gpt.chat.completions.create(**CHAT_BODY, stream=True) if c.choices) == "Hello."
    gpt.responses.create(model="policy", input="hi")
    assert [e.type for e in gpt.responses.create(model="policy", input="hi", stream=True)][-1] == "response.completed"
    got = [(c.metadata["protocol"], c.metadata["stream"], c.metadata["http_status"]) for c in live.registry.records("r")]
    assert got == [("anthropic", False, 200), ("anthropic", True, 200), ("chat", False, 200), ("chat", True, 200),
                   ("responses", False, 200), ("responses", True, 200)]
    result, on_disk = live.close("r", info={"mine": 1})
    assert [c.metadata["http_status"] for c in on_disk.calls] == [200] * 6
    assert result.info == on_disk.info == {"mine": 1}  # no refusal: no refusal keys


def test_a_slow_stream_records_the_200_it_sent_first(start):
    """The stream head (and its 200) go out before the engine is done; the record still says 200."""
    live = start(engine_cls=GatedScriptedEngine, script=["Hello."], cycle=True)
    key = live.open("r")
    threading.Timer(0.3, live.engine.gate.set).start()
    r = httpx.post(live.url + "/v1/messages", json=dict(ANTHROPIC_BODY, stream=True), headers={"x-api-key": key}, timeout=10)
    assert r.status_code == 200 and "event: ping" in r.text and "event: message_stop" in r.text
    (call,) = live.registry.records("r")
    assert call.metadata["http_status"] == 200 and "client_disconnected" not in call.metadata


@pytest.mark.parametrize("stream, sent", [(True, 200), (False, None)])
def test_a_call_whose_client_left_records_what_was_sent(start, tmp_path, stream, sent):
    """A client that leaves mid-turn: the record (written when generation ends) says 200 if the
    stream's head had gone out, None if nothing had; the access log line says the same."""
    live = start(engine_cls=GatedScriptedEngine, script=["Hello."], cycle=True, access_log=tmp_path / "access.jsonl")
    key = live.open("r")
    body = dict(ANTHROPIC_BODY, stream=stream)
    if stream:
        with httpx.Client(timeout=10) as client:
            with client.stream("POST", live.url + "/v1/messages", json=body, headers={"x-api-key": key}) as r:
                assert next(r.iter_lines()) == "event: message_start"
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=0.3)
    assert live.engine.started.wait(5)
    (line,) = live.log_lines(1)  # written when the server sees the client leave
    assert (line["status"], line["rollout_id"], line["stream"], line["error"]) == (sent, "r", stream, DISCONNECTED)
    live.engine.gate.set()
    wait_for(lambda: len(live.registry.records("r")) == 1)
    (call,) = live.registry.records("r")
    assert call.metadata["client_disconnected"] is True and call.metadata["http_status"] == sent
    assert "refusals" not in live.close("r")[0].info


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_that_cannot_be_built_leaves_no_record(start, monkeypatch, stream):
    """The record is written after the reply is built, so it never says 200 for a call answered with a
    500: a reply that fails to build (a bug) is a 500 in the protocol's shape, or a stream's error
    event once its 200 head went out, kept as a refusal, with no record."""
    from clawfast.proxy.chat import ChatFront

    def broken(self, answer):
        raise TypeError("cannot build this reply")

    monkeypatch.setattr(ChatFront, "response", broken)
    monkeypatch.setattr(ChatFront, "stream_body", broken)
    live = start(engine_cls=GatedScriptedEngine, script=["Hello."], cycle=True)
    key = live.open("r")
    gpt = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)
    if stream:
        chunks = gpt.chat.completions.create(**CHAT_BODY, stream=True)  # returns once the 200 head is in
        live.engine.gate.set()
        with pytest.raises(openai.APIError, match="internal error: TypeError: cannot build this reply"):
            list(chunks)
    else:
        live.engine.gate.set()
        with pytest.raises(openai.InternalServerError) as failed:
            gpt.chat.completions.create(**CHAT_BODY)
        assert failed.value.body["type"] == "server_error"
    assert live.registry.records("r") == []
    (entry,) = live.close("r")[0].info["refusals"]
    assert facts([entry]) == [(500, "api_error", "chat", "/v1/chat/completions", stream)]
    assert entry.get("in_stream") == (True if stream else None)


# -- refusals --------------------------------------------------------------------------------------


def test_refusals_are_kept_with_the_rollout_and_in_its_file(start):
    live = start(config=ProxyConfig(keepalive_s=0.05, max_model_len=256), script=["Hello."], cycle=True)
    key = live.open("r", sampling=Sampling(max_calls=2))
    claude = anthropic.Anthropic(base_url=live.url, api_key=key, max_retries=0)
    gpt = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)
    t0 = time.time()
    claude.messages.create(**ANTHROPIC_BODY)
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        claude.messages.create(**dict(ANTHROPIC_BODY, messages=[{"role": "user", "content": "word " * 600}]))
    bad = httpx.post(live.url + "/v1/chat/completions", content=b"{not json", timeout=10,
                     headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    assert bad.status_code == 400
    gpt.chat.completions.create(**CHAT_BODY)
    with pytest.raises(openai.BadRequestError, match="budget of 2 model calls is spent"):
        list(gpt.chat.completions.create(**CHAT_BODY, stream=True))
    with pytest.raises(openai.BadRequestError, match="budget of 2 model calls is spent"):
        gpt.responses.create(model="policy", input="hi")
    # A request with an unknown key belongs to no rollout.
    stranger = anthropic.Anthropic(base_url=live.url, api_key="cf-unknown", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(**ANTHROPIC_BODY)
    assert live.open("other") and live.close("other")[0].info == {}
    t1 = time.time()
    mine = {"from": "caller"}
    result, on_disk = live.close("r", info=mine)
    assert mine == {"from": "caller"}  # the caller's dict is not changed
    refusals = result.info["refusals"]
    assert facts(refusals) == [
        (400, "context_length", "anthropic", "/v1/messages", False),
        (400, "invalid_request", "chat", "/v1/chat/completions", None),  # the body was never read as far
        (400, "invalid_request", "chat", "/v1/chat/completions", True),
        (400, "invalid_request", "responses", "/v1/responses", False),
    ]
    assert "prompt is too long" in refusals[0]["message"]
    assert "body is not valid JSON" in refusals[1]["message"]
    assert all("budget of 2 model calls is spent" in e["message"] for e in refusals[2:])
    assert all(t0 <= e["time"] <= t1 for e in refusals)
    assert result.info["refusals_dropped"] == 0 and result.info["from"] == "caller"
    assert len(result.calls) == 2
    # The durable copy holds the same, and a re-read result equals the returned one.
    assert on_disk.info == result.info and on_disk.equals(result)


class LimitedEngine(ScriptedEngine):
    """A scripted engine stating a context of its own, as vLLM does."""

    max_model_len = 200


@pytest.mark.parametrize(("configured", "engine_cls", "limit"), [(256, ScriptedEngine, 256), (None, LimitedEngine, 200),
                                                                 (256, LimitedEngine, 200)])
def test_a_prompt_past_the_context_is_refused_as_each_api_words_it(start, configured, engine_cls, limit):
    """The limit is the config's or the engine's own, whichever is smaller; a prompt past it gets each
    API's own context-overflow error (Anthropic's "prompt is too long: N tokens > M maximum", OpenAI's
    code context_length_exceeded), which is what a harness acts on (Claude Code and OpenClaw compact
    and retry); the engine never sees it, and the rollout keeps each as a context_length refusal."""
    live = start(config=ProxyConfig(keepalive_s=0.05, max_model_len=configured), engine_cls=engine_cls,
                 script=["Hello."], cycle=True)
    key = live.open("r")
    claude = anthropic.Anthropic(base_url=live.url, api_key=key, max_retries=0)
    gpt = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)
    too_long = [{"role": "user", "content": "word " * 300}]
    assert claude.messages.create(**ANTHROPIC_BODY).content[0].text == "Hello."  # a short prompt fits
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(**dict(ANTHROPIC_BODY, messages=too_long))
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert re.fullmatch(rf"prompt is too long: (\d+) tokens > {limit - 1} maximum", error["message"]), error
    openai_calls = [
        lambda: gpt.chat.completions.create(model="policy", messages=too_long),
        lambda: list(gpt.chat.completions.create(model="policy", messages=too_long, stream=True)),
        lambda: gpt.responses.create(model="policy", input=too_long),
        lambda: list(gpt.responses.create(model="policy", input=too_long, stream=True)),
    ]
    for call, field in zip(openai_calls, ["messages", "messages", "input", "input"]):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert (refused.value.code, refused.value.type) == ("context_length_exceeded", "invalid_request_error")
        assert f"> {limit - 1} maximum" in refused.value.message and refused.value.param == field
    assert live.engine.calls == 1
    refusals = live.close("r")[0].info["refusals"]
    assert [(e["status"], e["error_type"], e["protocol"]) for e in refusals] == [
        (400, "context_length", "anthropic"), (400, "context_length", "chat"), (400, "context_length", "chat"),
        (400, "context_length", "responses"), (400, "context_length", "responses")]


def test_too_large_and_count_tokens_refusals(start):
    """The size check runs after the key resolved: a 413 is the rollout's; so is a bad count_tokens body."""
    live = start(script=["Hello."], cycle=True)
    key = live.open("r")
    # A body said to be 65 MiB (and not sent: it is refused on the header alone).
    head = (f"POST /v1/messages HTTP/1.1\r\nhost: proxy\r\nx-api-key: {key}\r\ncontent-type: application/json\r\n"
            f"content-length: {65 * 1024 * 1024}\r\n\r\n{{}}")
    with socket.create_connection((live.server.host, live.server.port), timeout=10) as sock:
        sock.sendall(head.encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 413")
    with httpx.Client(base_url=live.url, timeout=10) as client:
        r = client.post("/v1/messages/count_tokens", json={"model": "policy", "messages": "nope"}, headers={"x-api-key": key})
        assert r.status_code == 400
    refusals = live.close("r")[1].info["refusals"]
    assert facts(refusals) == [(413, "too_large", "anthropic", "/v1/messages", None),
                               (400, "invalid_request", "anthropic", "/v1/messages/count_tokens", None)]


def test_a_body_sent_in_chunks_is_held_to_the_same_limit(start, monkeypatch):
    """No content-length to refuse it by: a chunked body is a 413 once it passes the limit, on both
    routes that read a body."""
    from clawfast.proxy import server

    monkeypatch.setattr(server, "MAX_BODY_BYTES", 4096)
    live = start(script=["Hello."], cycle=True)
    key = live.open("r")
    body = json.dumps({**ANTHROPIC_BODY, "system": "x" * 8192}).encode()
    with httpx.Client(base_url=live.url, timeout=10) as client:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            chunks = (body[i:i + 1024] for i in range(0, len(body), 1024))  # an iterator: sent chunked
            r = client.post(path, content=chunks, headers={"x-api-key": key, "content-type": "application/json"})
            assert r.status_code == 413 and "over 4096 bytes" in r.json()["error"]["message"], r.text
        small = iter([json.dumps(ANTHROPIC_BODY).encode()])  # chunked too, under the limit
        assert client.post("/v1/messages", content=small, headers={"x-api-key": key}).status_code == 200
    assert [e[0] for e in facts(live.close("r")[1].info["refusals"])] == [413, 413]


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT_BODY),
                                        ("/v1/responses", {"model": "policy", "input": "hi"})])
def test_openai_stream_null_is_no_stream(start, path, body):
    """The OpenAI APIs take ``stream: null`` (and ``stream_options.include_usage: null``) as false."""
    live = start(script=["Hello."], cycle=True)
    key = live.open("r")
    body = {**body, "stream": None} | ({"stream_options": {"include_usage": None}} if "messages" in body else {})
    r = httpx.post(live.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text


def test_count_tokens_refuses_what_the_template_rejects_as_messages_does(embedded_dir, tmp_path):
    """A chat template that raises (``raise_exception``) is the same 400 invalid_request_error on
    count_tokens as on /v1/messages, kept as a refusal of each route."""
    from transformers import AutoTokenizer

    from clawfast.proxy import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    assistant = "{% elif message.role == 'assistant' %}"
    assert assistant in tokenizer.chat_template
    boom = "{% if message.content == 'boom' %}{{ raise_exception('roles must alternate') }}{% endif %}"
    tokenizer.chat_template = tokenizer.chat_template.replace(assistant, assistant + boom, 1)
    live = Live(ChatRenderer(tokenizer), tmp_path)
    try:
        key = live.open("r")
        claude = anthropic.Anthropic(base_url=live.url, api_key=key, max_retries=0)
        messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "boom"},
                    {"role": "user", "content": "b"}]
        assert claude.messages.count_tokens(model="policy", messages=messages[:1]).input_tokens > 0
        bodies = []
        for call in (lambda: claude.messages.create(model="policy", max_tokens=8, messages=messages),
                     lambda: claude.messages.count_tokens(model="policy", messages=messages)):
            with pytest.raises(anthropic.BadRequestError) as refused:
                call()
            bodies.append(refused.value.body)
        rejected = "the chat template rejected the conversation: roles must alternate"
        error = {"type": "invalid_request_error", "message": rejected}
        assert bodies[0] == bodies[1] == {"type": "error", "error": error}
        refusals = live.close("r")[0].info["refusals"]
        assert facts(refusals) == [(400, "invalid_request", "anthropic", "/v1/messages", False),
                                   (400, "invalid_request", "anthropic", "/v1/messages/count_tokens", None)]
    finally:
        live.server.stop()


def test_engine_failures_are_refusals(start, tmp_path):
    live = start(engine_cls=FailingEngine, access_log=tmp_path / "access.jsonl")
    key = live.open("r")
    headers = {"x-api-key": key}
    post = lambda body: httpx.post(live.url + "/v1/messages", json=body, headers=headers, timeout=10)  # noqa: E731
    assert post(ANTHROPIC_BODY).status_code == 500
    live.engine.kind = "refuse"
    assert post(ANTHROPIC_BODY).status_code == 400
    # A slow failure: the stream's 200 and head went out, the error is an event.
    live.engine.kind, live.engine.delay = "fail", 0.2
    r = post(dict(ANTHROPIC_BODY, stream=True))
    assert r.status_code == 200 and "event: error" in r.text
    result, on_disk = live.close("r")
    refusals = on_disk.info["refusals"]
    assert facts(refusals) == [(500, "api_error", "anthropic", "/v1/messages", False),
                               (400, "invalid_request", "anthropic", "/v1/messages", False),
                               (500, "api_error", "anthropic", "/v1/messages", True)]
    assert [e["message"] for e in refusals] == ["engine error: RuntimeError: no", "engine refused the request: no",
                                                "engine error: RuntimeError: no"]
    assert [e.get("in_stream") for e in refusals] == [None, None, True]
    assert result.calls == [] and result.info == on_disk.info
    lines = live.log_lines(3)
    assert [(e["status"], e["error"]) for e in lines] == [(500, "engine error: RuntimeError: no"),
                                                          (400, "engine refused the request: no"),
                                                          (200, "engine error: RuntimeError: no")]


@pytest.mark.parametrize("kind, code, message", [("refuse", "invalid_request_error", "engine refused the request: no"),
                                                 ("fail", "server_error", "engine error: RuntimeError: no")])
def test_a_failed_responses_stream_ends_in_response_failed(start, kind, code, message):
    """As the Responses API ends a failed stream: response.failed, carrying the response (its id, status
    "failed", its error's code and message), numbered after the head's events. Codex reads the code
    (context_length_exceeded: a context overflow; any other: a stream to retry)."""
    live = start(engine_cls=FailingEngine)
    live.engine.kind, live.engine.delay = kind, 0.2  # the head goes out first
    key = live.open("r")
    gpt = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)
    events = list(gpt.responses.create(model="policy", input="hi", stream=True))
    kinds = [e.type for e in events]  # keep-alives while the engine works are response.in_progress too
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.failed"
    assert set(kinds[1:-1]) == {"response.in_progress"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    failed = events[-1].response
    assert failed.id == events[0].response.id and failed.status == "failed" and failed.output == []
    assert (failed.error.code, failed.error.message) == (code, message)
    (entry,) = live.close("r")[0].info["refusals"]
    assert (entry["protocol"], entry["stream"], entry["in_stream"]) == ("responses", True, True)
    # The codes the proxy's JSON errors use, here too: a context refusal is context_length_exceeded.
    from clawfast.proxy.canonical import Conversation, Message, Request
    from clawfast.proxy.front import ProtocolError
    from clawfast.proxy.responses import ResponsesFront

    front = ResponsesFront()
    request = Request("responses", Conversation("", (), (Message("user", "hi"),)), "policy", True, 8)
    answer = front.new_answer(request, 3)
    head = front.stream_head(answer)
    tail = front.stream_error(answer, ProtocolError(400, "context_length", "prompt is too long"))
    assert head.count(b"event: ") == 2 and tail.startswith(b"event: response.failed\n")
    event = json.loads(tail.split(b"data: ", 1)[1])
    assert (event["sequence_number"], event["response"]["error"]) == (
        2, {"code": "context_length_exceeded", "message": "prompt is too long"})


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_cut_off_by_close_is_a_refusal(start, stream):
    live = start(engine_cls=GatedScriptedEngine, script=["Hello."], cycle=True)
    key = live.open("r")
    replies = []
    thread = threading.Thread(target=lambda: replies.append(httpx.post(
        live.url + "/v1/messages", json=dict(ANTHROPIC_BODY, stream=stream), headers={"x-api-key": key}, timeout=10)))
    thread.start()
    assert live.engine.started.wait(5)
    result, on_disk = live.close("r", status="timeout")
    thread.join(10)
    (entry,) = result.info["refusals"]
    assert facts([entry]) == [(401, "authentication", "anthropic", "/v1/messages", stream)]
    assert entry["at_close"] is True and "closed while this call was generating" in entry["message"]
    assert on_disk.info == result.info and on_disk.status == "timeout"
    assert replies[0].status_code == (200 if stream else 401)  # the client's answer came after the close


def test_the_refusals_kept_are_bounded(start):
    live = start(script=["Hello."], cycle=True)
    key = live.open("r", sampling=Sampling(max_calls=1))
    extra = 25
    with httpx.Client(base_url=live.url, timeout=10, headers={"x-api-key": key}) as client:
        assert client.post("/v1/messages", json=ANTHROPIC_BODY).status_code == 200
        for _ in range(MAX_REFUSALS + extra):
            assert client.post("/v1/messages", json=ANTHROPIC_BODY).status_code == 400
    assert len(live.registry.get("r").refusals) == MAX_REFUSALS
    result, on_disk = live.close("r")
    assert len(result.info["refusals"]) == MAX_REFUSALS and result.info["refusals_dropped"] == extra
    assert on_disk.info == result.info and len(on_disk.calls) == 1
    # A long message is cut too.
    long = refusal(500, "api_error", "x" * (10 * MAX_REFUSAL_MESSAGE), protocol="chat", path="/v1/chat/completions")
    assert MAX_REFUSAL_MESSAGE < len(long["message"]) < MAX_REFUSAL_MESSAGE + 100


# -- access log ------------------------------------------------------------------------------------


def test_the_access_log_has_one_line_per_request(start, tmp_path):
    path = tmp_path / "logs" / "access.jsonl"  # its directory is made
    live = start(access_log=path, script=["Hello."], cycle=True)
    key = live.open("r", sampling=Sampling(max_calls=3))
    auth, bearer = {"x-api-key": key}, {"authorization": f"Bearer {key}"}
    sent = []
    with httpx.Client(base_url=live.url, timeout=10) as client:
        def do(method, url, status, **kwargs):
            r = client.request(method, url, **kwargs)
            assert r.status_code == status, r.text
            sent.append((method, url, status))
            return r

        do("POST", "/v1/chat/completions", 200, json=CHAT_BODY, headers=bearer)
        streamed = do("POST", "/v1/messages", 200, json=dict(ANTHROPIC_BODY, stream=True), headers=auth)
        assert "event: message_stop" in streamed.text
        do("POST", "/v1/responses", 200, json={"model": "policy", "input": "hi", "stream": True}, headers=bearer)
        do("POST", "/v1/messages", 401, json=ANTHROPIC_BODY, headers={"x-api-key": "cf-unknown"})
        do("POST", "/v1/messages", 400, json=ANTHROPIC_BODY, headers=auth)  # the budget of 3 is spent
        do("POST", "/v1/messages/count_tokens", 200, json={"model": "policy", "messages": HI}, headers=auth)
        do("GET", "/v1/models", 200, headers=auth)
        do("GET", "/v1/models", 401)
        do("GET", "/health", 200)
        do("GET", "/nowhere", 404)
        do("GET", "/v1/messages", 405, headers=auth)
        lines = live.log_lines(len(sent))  # readable while the proxy runs: flushed per line
    assert len(lines) == len(sent)
    for line, (method, url, status) in zip(lines, sent):
        assert tuple(line) == AccessLog.FIELDS
        assert (line["method"], line["path"], line["status"]) == (method, url, status)
        assert line["latency_ms"] >= 0 and isinstance(line["time"], float)
        assert (line["error"] is None) == (status < 400)
    calls = live.registry.records("r")
    chat, anth, resp, stranger, spent, count, models, nokey, health, nowhere, wrong = lines
    assert (chat["rollout_id"], chat["protocol"], chat["stream"], chat["output_tokens"]) == ("r", "chat", False, len(calls[0].output_ids))
    assert (anth["rollout_id"], anth["protocol"], anth["stream"], anth["output_tokens"]) == ("r", "anthropic", True, len(calls[1].output_ids))
    assert (resp["protocol"], resp["stream"], resp["output_tokens"]) == ("responses", True, len(calls[2].output_ids))
    assert (stranger["rollout_id"], stranger["protocol"], stranger["output_tokens"]) == (None, "anthropic", None)
    assert "unknown or closed rollout key" in stranger["error"]
    assert spent["rollout_id"] == "r" and spent["stream"] is False and "budget of 3 model calls is spent" in spent["error"]
    assert (count["rollout_id"], count["protocol"]) == ("r", "anthropic")
    assert models["protocol"] is None and models["rollout_id"] is None and "unknown or closed" in nokey["error"]
    assert health["rollout_id"] is None and "not found" in nowhere["error"].lower()
    assert "method not allowed" in wrong["error"]
    # Only the budget refusal is the rollout's (the 401 had no rollout, the 405 was refused before its key was read).
    assert facts(live.close("r")[0].info["refusals"]) == [(400, "invalid_request", "anthropic", "/v1/messages", False)]


def test_serve_writes_an_access_log(tmp_path, embedded_dir):
    """`clawfast proxy serve --access-log FILE`, as a user runs it (and tails the file)."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"text": "bye"}]))
    log = tmp_path / "access.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawfast.cli", "proxy", "serve", "--scripted", str(script), "--port", "0",
         "--records", str(tmp_path / "records"), "--access-log", str(log)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = proc.stdout.readline().split()[-1]
        key = proc.stdout.readline().split()[-1]
        assert url.startswith("http://127.0.0.1:") and key.startswith("cf-"), (url, key, proc.stderr.read())
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        assert client.chat.completions.create(model="m", messages=HI).choices[0].message.content == "bye"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="cf-nope", max_retries=0).chat.completions.create(model="m", messages=HI)
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) == 2)
        ok, refused = (json.loads(line) for line in log.read_text().splitlines())
        assert (ok["status"], ok["protocol"], ok["rollout_id"].startswith("manual-")) == (200, "chat", True)
        assert (refused["status"], refused["rollout_id"]) == (401, None) and "unknown or closed" in refused["error"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
