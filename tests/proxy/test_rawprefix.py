"""PrefixParser (reusing parsed message prefixes across bodies) must equal orjson.loads on every body."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clawfast.proxy.rawprefix import PrefixParser

text = st.text(alphabet=st.sampled_from(list('ab "\\[]{}:,\n\tü✓') + ["\u2028"]), max_size=12)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]),
     "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2))}
)


def dump(messages, extra_before, extra_after, pretty) -> bytes:
    body = dict(extra_before)
    body["messages"] = messages
    body.update(extra_after)
    return json.dumps(body, indent=2 if pretty else None, ensure_ascii=pretty).encode()


@settings(max_examples=150, deadline=None)
@given(
    first=st.lists(message, min_size=0, max_size=5),
    steps=st.lists(st.tuples(st.integers(0, 6), st.lists(message, max_size=3), text), min_size=1, max_size=5),
    before=st.dictionaries(st.sampled_from(["model", "system", "max_tokens"]), text, max_size=2),
    pretty=st.booleans(),
)
def test_equals_full_parse(first, steps, before, pretty):
    parser = PrefixParser("messages")
    messages = first
    body = dump(messages, before, {"tools": []}, pretty)
    assert parser.loads(body) == orjson.loads(body)
    for keep, new, tail in steps:
        messages = messages[:keep] + new  # an extension, a rewrite of the end, or a shorter history
        body = dump(messages, before, {"tools": [tail]}, pretty)
        assert parser.loads(body) == orjson.loads(body)


def test_an_extended_history_comes_back_as_the_same_objects():
    parser = PrefixParser("messages")
    messages = [{"role": "user", "content": f"m{i} \"quoted\" ü"} for i in range(50)]
    previous = parser.loads(dump(messages, {"model": "m"}, {"tools": ["t"]}, False))["messages"]
    for step in range(3):
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"a{step}"}]})
        body = dump(messages, {"model": "m"}, {"tools": ["t"]}, False)
        got = parser.loads(body)
        assert got == orjson.loads(body)
        assert all(a is b for a, b in zip(previous, got["messages"]))
        previous = got["messages"]


def test_a_changed_first_message_is_parsed_afresh():
    parser = PrefixParser("messages")
    for i in range(4):
        body = dump([{"role": "user", "content": f"nonce {i}"}, {"role": "user", "content": "x" * 1000}], {}, {}, False)
        assert parser.loads(body) == orjson.loads(body)


def test_bad_json_and_odd_shapes_fall_back_to_the_full_parse():
    parser = PrefixParser("messages")
    base = b'{"model":"m","messages":[{"role":"user","content":"a"}]'
    parser.loads(base + b"}")
    with pytest.raises(orjson.JSONDecodeError):
        parser.loads(base[:-1] + b',{"role":"user","content":"b"},]}')  # trailing comma
    # Errors right after the reused element must not be cut away with it.
    for bad in (base[:-1] + b",]}", base[:-1] + b' {"role":"user","content":"b"}]}'):
        with pytest.raises(orjson.JSONDecodeError):
            parser.loads(bad)
    # A duplicate key after the array: the last one wins, as in orjson.
    dup = base + b',"messages":[{"role":"user","content":"z"}]}'
    assert parser.loads(dup) == orjson.loads(dup)
    # Non-object elements and a non-list value.
    for body in (b'{"messages":[{"role":"user","content":"a"},1,"x"]}', b'{"messages":"hi"}', b"[1]"):
        assert parser.loads(body) == orjson.loads(body)
