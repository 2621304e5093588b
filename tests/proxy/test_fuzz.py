"""Fuzzed request bodies over each protocol's JSON: only protocol-correct answers, never a 5xx."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12)
)
any_json = st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=8), c, max_size=3)), max_leaves=8)


def mutated(value):
    """`value` with any node possibly replaced by arbitrary JSON and any object key possibly dropped."""
    if isinstance(value, dict):
        inner = st.fixed_dictionaries({}, optional={k: mutated(v) for k, v in value.items()})
    elif isinstance(value, list):
        inner = st.tuples(*[mutated(v) for v in value]).map(list)
    else:
        inner = st.just(value)
    return st.one_of(inner, inner, inner, any_json)


TOOL_INPUT = {"type": "object", "properties": {"command": {"type": "string"}}}
VALID = {
    "/v1/messages": {
        "model": "policy",
        "max_tokens": 8,
        "stream": True,
        "system": [{"type": "text", "text": "sys"}],
        "tools": [{"name": "bash", "description": "d", "input_schema": TOOL_INPUT}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "ok"}]}]},
        ],
    },
    "/v1/chat/completions": {
        "model": "policy",
        "max_tokens": 8,
        "stream": False,
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": TOOL_INPUT}}],
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
    },
    "/v1/responses": {
        "model": "policy",
        "max_output_tokens": 8,
        "stream": True,
        "instructions": "sys",
        "tools": [{"type": "function", "name": "bash", "parameters": TOOL_INPUT}, {"type": "custom", "name": "apply_patch"}],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
    },
    "/v1/messages/count_tokens": {"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.fixture(scope="module")
def live(proxy_factory, tmp_path_factory):
    proxy = proxy_factory(
        tmp_path_factory.mktemp("fuzz"),
        script=["plain answer", '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'], cycle=True,
    )
    with httpx.Client(base_url=proxy.url, headers={"x-api-key": proxy.key}, timeout=30) as client:
        yield proxy, client
    proxy.server.stop()


def check(path: str, response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("\n\n") and "error" not in response.text.split("\n", 1)[0]
    else:
        response.json()


@pytest.mark.parametrize("path", sorted(VALID))
def test_valid_bodies_answer(live, path):
    proxy, client = live
    check(path, r := client.post(path, json=VALID[path]))
    assert r.status_code == 200


@pytest.mark.parametrize("path", sorted(VALID))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_bodies_never_5xx(live, path, data):
    proxy, client = live
    body = data.draw(mutated(VALID[path]))
    check(path, client.post(path, content=json.dumps(body)))


@pytest.mark.parametrize("path", sorted(VALID))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64))
def test_garbage_bytes_are_400(live, path, raw):
    proxy, client = live
    r = client.post(path, content=raw)
    check(path, r)
    assert r.status_code == 400


def test_routing_errors_keep_protocol_shape(live):
    proxy, client = live
    check("/v1/messages", r := client.get("/v1/messages"))
    assert r.status_code == 405
    check("/v1/nothing", r := client.post("/v1/nothing", json={}))
    assert r.status_code == 404
