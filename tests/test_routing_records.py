"""MoE routing in call records: `CallRecord.routing` / `routing_start`, their .cfr encoding (old calls
byte for byte as before), and the rule by which a rollout's calls store routing rows
(`clawfast.routing_store`: what the parent call holds alike is not stored again), applied by
`Rollout.append` and read back the way the trainer reads it."""

from __future__ import annotations

import gzip
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from clawfast.engines.base import Generation
from clawfast.proxy.rollouts import RolloutRegistry
from clawfast.routing_store import RolloutRouting
from clawfast.records import (
    CallRecord,
    RecordFormatError,
    RolloutLog,
    RolloutResult,
    _frame_parts,
    decode_rollout,
    encode_call,
    encode_header,
    encode_result,
    encode_rollout,
    read_rollout,
    rollout_path,
    write_rollout,
)

DATA = Path(__file__).parent / "data" / "threads"
LAYERS, TOP_K = 3, 2


def _call(i, rng, *, routing=None, routing_start=0, n_p=None, n_o=None, rollout="r0", **extra):
    n_p = int(rng.integers(1, 40)) if n_p is None else n_p
    n_o = int(rng.integers(0, 15)) if n_o is None else n_o
    return CallRecord(
        rollout_id=rollout, call_index=i, harness="claude-code",
        prompt_ids=rng.integers(0, 1000, n_p), output_ids=rng.integers(0, 1000, n_o),
        infer_logprobs=-rng.random(n_o).astype(np.float32), weight_version=2,
        timings={"received": 1.5}, metadata={"i": i}, routing=routing, routing_start=routing_start, **extra,
    )


def _routing(rng, rows, dtype=np.uint8, experts=None):
    experts = experts or (64 if dtype == np.uint8 else 1000)
    return rng.integers(0, experts, (rows, LAYERS, TOP_K)).astype(dtype)


def _rollout(calls, rid="r0"):
    return RolloutResult(rollout_id=rid, task_id="t", harness="claude-code", sample_index=1, reward=0.5,
                         status="ok", calls=calls, info={"k": 1})


def _mixed_calls(rng):
    """uint8 covering every computable row, uint16 from a later row, none, and a one-row routing."""
    calls = [_call(0, rng, n_p=20, n_o=6, routing=_routing(rng, 25))]
    calls.append(_call(1, rng, n_p=30, n_o=4, routing=_routing(rng, 10, np.uint16), routing_start=23))
    calls.append(_call(2, rng))
    calls.append(_call(3, rng, n_p=5, n_o=0, routing=_routing(rng, 1), routing_start=4))
    return calls


# ----------------------------------------------------------------------------------------------
# Round trips


def test_routing_round_trips_through_files_and_the_streaming_log(tmp_path):
    rng = np.random.default_rng(0)
    calls = _mixed_calls(rng)
    r = _rollout(calls)
    back = read_rollout(write_rollout(tmp_path / "a.cfr", r))
    assert back.equals(r)
    for a, b in zip(calls, back.calls):
        assert b.routing_start == a.routing_start
        if a.routing is None:
            assert b.routing is None
        else:
            assert b.routing.dtype == a.routing.dtype and b.routing.shape == a.routing.shape
            np.testing.assert_array_equal(b.routing, a.routing)
    assert back.calls[0].routing.dtype == np.uint8 and back.calls[1].routing.dtype == np.uint16
    assert int(back.calls[1].routing.max()) >= 256  # uint16 values beyond a byte survive

    # The streaming log: a live file (no result yet) and the closed one read the same calls.
    log = RolloutLog(tmp_path / "live.cfr", r.header())
    for c in calls:
        log.append(c)
    live = read_rollout(tmp_path / "live.cfr", recover=True)
    assert live.status == "running" and all(a.equals(b) for a, b in zip(calls, live.calls))
    log.close(r.reward, r.status, r.info)
    assert read_rollout(tmp_path / "live.cfr").equals(r)
    assert (tmp_path / "live.cfr").read_bytes() == encode_rollout(r)


def test_equals_sees_routing():
    rng = np.random.default_rng(1)
    a = _call(0, np.random.default_rng(7), n_p=10, n_o=3, routing=_routing(rng, 12))
    b = _call(0, np.random.default_rng(7), n_p=10, n_o=3, routing=a.routing.copy())
    assert a.equals(b)
    b.routing[5, 1, 0] ^= 1
    assert not a.equals(b)
    c = _call(0, np.random.default_rng(7), n_p=10, n_o=3)
    assert not a.equals(c) and not c.equals(a)
    d = _call(0, np.random.default_rng(7), n_p=10, n_o=3, routing=a.routing[1:], routing_start=1)
    assert not a.equals(d)


def test_routing_is_normalised():
    rng = np.random.default_rng(2)
    # An empty routing is no routing; a big-endian uint16 array becomes native; np ints are ints.
    empty = _call(0, rng, n_p=4, n_o=2, routing=np.zeros((0, LAYERS, TOP_K), np.uint8))
    assert empty.routing is None and empty.routing_start == 0
    empty_later = _call(0, rng, n_p=4, n_o=2, routing=np.zeros((0, LAYERS, TOP_K), np.uint16), routing_start=3)
    assert empty_later.routing is None and empty_later.routing_start == 0
    big = _routing(rng, 3, np.uint16).astype(">u2")
    call = _call(0, rng, n_p=4, n_o=2, routing=big, routing_start=np.int64(2))
    assert call.routing.dtype == np.dtype(np.uint16) and call.routing.dtype.isnative
    assert type(call.routing_start) is int and call.routing_start == 2
    np.testing.assert_array_equal(call.routing, big)
    assert Generation(np.zeros(0, np.int32), np.zeros(0, np.float32), "stop", 0).routing is None


# ----------------------------------------------------------------------------------------------
# Old files


def _old_encode_call(call: CallRecord) -> bytes:
    """The call frame as clawfast wrote it before routing existed (copied from that version)."""
    meta = {
        "rollout_id": call.rollout_id, "call_index": call.call_index, "harness": call.harness,
        "weight_version": call.weight_version, "finish_reason": call.finish_reason, "timings": call.timings,
        "tags": list(call.tags), "metadata": call.metadata,
        "n_prompt": int(len(call.prompt_ids)), "n_output": int(len(call.output_ids)),
    }
    if call.output_versions is not None:
        versions = call.output_versions
        starts = np.flatnonzero(np.diff(versions)) + 1
        meta["version_runs"] = [[0, int(versions[0])]] + [[int(i), int(versions[i])] for i in starts]
    meta_bytes = json.dumps(meta, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    payload = (struct.pack("<I", len(meta_bytes)) + meta_bytes + call.prompt_ids.astype("<i4").tobytes()
               + call.output_ids.astype("<i4").tobytes() + call.infer_logprobs.astype("<f4").tobytes())
    head = struct.pack("<BQ", ord("C"), len(payload))
    return head + payload + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head)))


def test_a_call_without_routing_encodes_as_before():
    rng = np.random.default_rng(3)
    for i in range(20):
        n_p, n_o = int(rng.integers(1, 30)), int(rng.integers(0, 10))
        fields = dict(rollout_id="r0", call_index=i, harness="h", prompt_ids=rng.integers(0, 1000, n_p),
                      output_ids=rng.integers(0, 1000, n_o), infer_logprobs=-rng.random(n_o), tags=("main",),
                      metadata={"protocol": "chat"}, timings={"received": 0.25})
        if i % 2 and n_o > 1:
            fields["output_versions"] = np.array([0] * (n_o // 2) + [1] * (n_o - n_o // 2))
        plain = CallRecord(**fields)
        expected = _old_encode_call(plain)
        assert encode_call(plain) == expected
        # Saying "no routing" in either spelling writes the same bytes.
        assert encode_call(CallRecord(**fields, routing=None, routing_start=0)) == expected
        empty = np.zeros((0, LAYERS, TOP_K), np.uint8)
        assert encode_call(CallRecord(**fields, routing=empty)) == expected
        assert b'"routing"' not in expected


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.cfr.gz")))
def test_stored_fixture_files_read_and_re_encode_byte_for_byte(name):
    data = gzip.decompress((DATA / name).read_bytes())
    rollout = decode_rollout(data, recover=True)
    assert rollout.calls and all(c.routing is None and c.routing_start == 0 for c in rollout.calls)
    calls = b"".join(encode_call(c) for c in rollout.calls)
    assert calls in data  # every call frame, re-encoded, is the stored bytes
    if rollout.status != "running":
        assert encode_rollout(rollout) == data


# ----------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize(
    "routing, start, match",
    [
        (np.zeros((4, LAYERS), np.uint8), 0, r"\[rows, layers, top_k\]"),
        (np.zeros((4, LAYERS, TOP_K, 1), np.uint8), 0, r"\[rows, layers, top_k\]"),
        (np.zeros((4, LAYERS, TOP_K), np.float32), 0, "uint8 or uint16"),
        (np.zeros((4, LAYERS, TOP_K), np.int64), 0, "uint8 or uint16"),
        (np.zeros((4, LAYERS, TOP_K), np.uint32), 0, "uint8 or uint16"),
        ([[[1, 2]]], 0, "uint8 or uint16"),
        (np.zeros((4, 0, TOP_K), np.uint8), 0, "no expert"),
        (np.zeros((11, LAYERS, TOP_K), np.uint8), 0, r"rows \[0, 11\) do not lie within .* 10 tokens"),
        (np.zeros((3, LAYERS, TOP_K), np.uint8), 8, r"rows \[8, 11\)"),
        (np.zeros((3, LAYERS, TOP_K), np.uint8), -1, r"rows \[-1, 2\)"),
        (np.zeros((0, LAYERS, TOP_K), np.uint8), 11, r"rows \[11, 11\)"),
        (None, 2, "routing_start 2 without routing"),
        (np.zeros((3, LAYERS, TOP_K), np.uint8), 1.0, "routing_start must be an int"),
    ],
)
def test_bad_routing_is_refused_naming_the_call(routing, start, match):
    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match=match) as info:
        _call(7, rng, n_p=6, n_o=4, routing=routing, routing_start=start, rollout="roll-x")
    assert "call 7 of rollout 'roll-x'" in str(info.value)
    assert not isinstance(info.value, RecordFormatError)


def test_validate_checks_routing_set_after_construction():
    rng = np.random.default_rng(5)
    call = _call(0, rng, n_p=6, n_o=4, routing=_routing(rng, 9))
    call.routing_start = 2
    with pytest.raises(ValueError, match=r"rows \[2, 11\)"):
        call.validate()


def _reframe(call: CallRecord, meta_edit=None, body_edit=None) -> bytes:
    """`call`'s frame with its JSON and/or body changed, checksummed anew (so only the decoder's own
    checks can catch it)."""
    frame = encode_call(call)
    payload = frame[9:-4]
    (meta_len,) = struct.unpack_from("<I", payload)
    meta, body = json.loads(payload[4:4 + meta_len]), payload[4 + meta_len:]
    if meta_edit:
        meta_edit(meta)
    if body_edit:
        body = body_edit(body)
    meta_bytes = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    return b"".join(_frame_parts(ord("C"), [struct.pack("<I", len(meta_bytes)), meta_bytes, body]))


def _file_with(call_frame: bytes) -> bytes:
    return (encode_header({"format_version": 1, "rollout_id": "r0", "task_id": "t", "harness": "h", "sample_index": 0})
            + call_frame + encode_result(0.0, "ok", {}))


@pytest.mark.parametrize(
    "meta_edit, body_edit, match",
    [
        (None, lambda b: b[:-1], "do not match"),  # one routing byte short
        (None, lambda b: b[:-LAYERS * TOP_K], "do not match"),  # one row short
        (None, lambda b: b + b"\0", "do not match"),
        (lambda m: m.pop("routing"), None, "do not match"),  # routing bytes a reader is not told of
        (lambda m: m["routing"].update(rows=m["routing"]["rows"] + 1), None, "do not match"),
        (lambda m: m["routing"].update(dtype="<u2"), None, "do not match"),
        (lambda m: m["routing"].update(dtype="u4"), None, "bad routing header"),
        (lambda m: m["routing"].update(layers=0), None, "bad routing header"),
        (lambda m: m["routing"].pop("top_k"), None, "malformed"),
        (lambda m: m.update(routing=[1, 2]), None, "malformed"),
        (lambda m: m["routing"].update(start=m["n_prompt"] + m["n_output"]), None, "invalid record"),
    ],
)
def test_bad_routing_on_disk_is_a_format_error(meta_edit, body_edit, match):
    rng = np.random.default_rng(6)
    call = _call(0, rng, n_p=12, n_o=5, routing=_routing(rng, 10), routing_start=3)
    assert decode_rollout(_file_with(_reframe(call))).calls[0].equals(call)  # the re-framing itself is sound
    with pytest.raises(RecordFormatError, match=match):
        decode_rollout(_file_with(_reframe(call, meta_edit, body_edit)))


def test_truncated_or_corrupt_routing_files_are_rejected():
    rng = np.random.default_rng(7)
    data = encode_rollout(_rollout(_mixed_calls(rng)))
    for cut in range(0, len(data), 5):
        with pytest.raises(RecordFormatError):
            decode_rollout(data[:cut])
    for pos in range(8, len(data), 7):
        bad = bytearray(data)
        bad[pos] ^= 0x21
        with pytest.raises(RecordFormatError):
            decode_rollout(bytes(bad))
    # A live log torn inside a routing body (the second call's, its frame's last part) keeps the calls before it.
    calls = _mixed_calls(np.random.default_rng(7))
    first = len(encode_header(_rollout([]).header())) + len(encode_call(calls[0]))
    inside = first + len(encode_call(calls[1])) - 4 - calls[1].routing.nbytes // 2
    torn = decode_rollout(data[:inside], recover=True)
    assert torn.status == "running" and len(torn.calls) == 1 and torn.calls[0].equals(calls[0])
    with pytest.raises(RecordFormatError, match="truncated"):
        decode_rollout(data[:inside])


# ----------------------------------------------------------------------------------------------
# What a rollout stores, and what reads back


def _random_sequence(rng, n_calls, *, from_zero):
    """Paths that extend or branch off earlier ones (a small vocabulary makes chance matches too), each
    with the rows its engine reports: all computable ones from 0 when `from_zero` (at the end maybe
    fewer), else any range."""
    paths = []
    for _ in range(n_calls):
        if paths and rng.random() < 0.8:
            base = paths[int(rng.integers(len(paths)))][0]
            keep = int(rng.integers(0, len(base) + 1)) if rng.random() < 0.5 else len(base)
            path = np.concatenate([base[:keep], rng.integers(0, 3, int(rng.integers(0, 8)))])
        else:
            path = rng.integers(0, 3, int(rng.integers(1, 12)))
        if len(path) == 0:
            path = rng.integers(0, 3, 1)
        path = path.astype(np.int32)
        n_p = int(rng.integers(1, len(path) + 1))
        top = len(path) - 1  # rows an engine can compute
        if from_zero:
            a, b = 0, top - (int(rng.integers(0, 3)) if rng.random() < 0.3 else 0)
        else:
            a = int(rng.integers(0, top + 1))
            b = int(rng.integers(a, top + 1))
        b = max(a, b)
        paths.append((path, n_p, a, b))
    return paths


def _true_routing(path, rows):
    """Deterministic routing of each row, from the prefix it reads."""
    out = np.empty((rows[1] - rows[0], LAYERS, TOP_K), np.uint16)
    for p in range(*rows):
        out[p - rows[0]] = np.random.default_rng(zlib.crc32(path[: p + 1].tobytes())).integers(0, 300, (LAYERS, TOP_K))
    return out


def _read_back(calls):
    """Each call's routing of every row, as the trainer reads records (`RolloutRouting`): None where
    it has none."""
    history = RolloutRouting()
    for call in calls:
        history.add(call.path, call.routing, call.routing_start)
    table = history.table()
    out = []
    for src in history.sources:
        if src is None:
            out.append(None)
            continue
        rows = np.zeros((len(src), LAYERS, TOP_K), np.uint16)
        rows[src >= 0] = table[0][src[src >= 0]]
        out.append(np.where((src >= 0)[:, None, None], rows, 9999))
    return out


@pytest.mark.parametrize("from_zero", [True, False])
@pytest.mark.parametrize("noisy", [False, True])
def test_every_reported_row_reads_back_as_the_engine_reported_it(tmp_path, from_zero, noisy):
    """Through the registry and its file: each call's reported rows read back exactly as its engine
    reported them, whether that engine routes a row as every other call did (deterministic) or, on
    some rows, otherwise (noisy: rounding flipped a near tie); a deterministic engine reporting every
    row it ran stores each row (a path prefix) once."""
    rng = np.random.default_rng(8 + from_zero + 2 * noisy)
    for trial in range(60):
        reg = RolloutRegistry(tmp_path / f"{trial}")
        reg.open("r")
        rollout = reg.get("r")
        sequence = _random_sequence(rng, int(rng.integers(1, 9)), from_zero=from_zero)
        reported = []
        for path, n_p, a, b in sequence:
            routing = _true_routing(path, (a, b))
            if noisy and len(routing):
                flip = rng.random(len(routing)) < 0.2
                routing[flip, 0, 0] = 300 + rng.integers(0, 5, int(flip.sum()))
            reported.append(routing)
            rollout.append(prompt_ids=path[:n_p], output_ids=path[n_p:], infer_logprobs=np.zeros(len(path) - n_p),
                           routing=routing, routing_start=a)
        reg.close("r")
        calls = read_rollout(rollout_path(tmp_path / f"{trial}", "r")).calls
        for (path, _, a, b), routing, back in zip(sequence, reported, _read_back(calls)):
            if b > a:
                np.testing.assert_array_equal(back[a:b], routing)
        if from_zero and not noisy and all(b == len(path) - 1 for path, _, _, b in sequence):
            prefixes = [c.path[: c.routing_start + i + 1].tobytes() for c in calls if c.routing is not None
                        for i in range(len(c.routing))]
            assert len(prefixes) == len(set(prefixes))  # once


def test_a_call_stores_from_its_first_row_the_parent_lacks_or_holds_otherwise(tmp_path):
    reg = RolloutRegistry(tmp_path)
    reg.open("r")
    rollout = reg.get("r")
    path1 = np.arange(1, 11, dtype=np.int32)  # prompt 6, output 4: rows [0, 9) computable
    first = rollout.append(prompt_ids=path1[:6], output_ids=path1[6:], infer_logprobs=np.zeros(4),
                           routing=_true_routing(path1, (0, 9)))
    assert first.routing_start == 0 and len(first.routing) == 9
    # Re-sends path1 and extends it: row 9 (at path1's last sampled token) is the first new one.
    path2 = np.concatenate([path1, [50, 51, 52, 53]]).astype(np.int32)
    second = rollout.append(prompt_ids=path2[:12], output_ids=path2[12:], infer_logprobs=np.zeros(2),
                            routing=_true_routing(path2, (0, 13)))
    assert second.routing_start == 9
    # A branch that leaves inside the first call's output shares only the rows before it.
    branch = np.concatenate([path1[:8], [99, 98]]).astype(np.int32)
    third = rollout.append(prompt_ids=branch[:8], output_ids=branch[8:], infer_logprobs=np.zeros(2),
                           routing=_true_routing(branch, (0, 9)))
    assert third.routing_start == 8
    # Its engine reported from row 3 only (a prefix-cache hit): rows before inherit, nothing new.
    fourth = rollout.append(prompt_ids=path1[:6], output_ids=path1[6:9], infer_logprobs=np.zeros(3),
                            routing=_true_routing(path1, (3, 8)), routing_start=3)
    assert fourth.routing is None and fourth.routing_start == 0
    # The same prefix as the second, but its engine routed row 4 otherwise (it ran it again): stored
    # from row 4 on (the tree keeps it apart from there).
    flipped = _true_routing(path2, (0, 13))
    flipped[4, 1, 1] += 1
    fifth = rollout.append(prompt_ids=path2[:12], output_ids=path2[12:], infer_logprobs=np.zeros(2),
                           routing=flipped)
    assert fifth.routing_start == 4 and len(fifth.routing) == 9
    back = _read_back(reg.close("r").calls)
    np.testing.assert_array_equal(back[4][:13], flipped)  # the fifth call reads its own routing
    np.testing.assert_array_equal(back[1][:13], _true_routing(path2, (0, 13)))


def test_the_registry_trims_a_conversation_to_its_new_rows(tmp_path):
    reg = RolloutRegistry(tmp_path)
    reg.open("r")
    rollout = reg.get("r")
    prompt, out = np.arange(1, 21, dtype=np.int32), np.arange(100, 105, dtype=np.int32)
    first = rollout.append(prompt_ids=prompt, output_ids=out, infer_logprobs=np.zeros(5),
                           routing=_true_routing(np.concatenate([prompt, out]), (0, 24)))
    assert first.routing_start == 0 and len(first.routing) == 24
    prompt2 = np.concatenate([prompt, out, [7, 8, 9]]).astype(np.int32)
    second = rollout.append(prompt_ids=prompt2, output_ids=[200, 201], infer_logprobs=[-1.0, -1.0],
                            routing=_true_routing(np.concatenate([prompt2, [200, 201]]).astype(np.int32), (0, 29)))
    assert second.routing_start == 24 and len(second.routing) == 5  # row 24 onward: new to the rollout
    again = rollout.append(prompt_ids=prompt2, output_ids=[200], infer_logprobs=[-1.0],
                           routing=_true_routing(prompt2, (0, 28)))
    assert again.routing is None and again.routing_start == 0  # a retry of a stored prefix stores none
    plain = rollout.append(prompt_ids=prompt2, output_ids=[5], infer_logprobs=[-1.0])
    assert plain.routing is None
    back = reg.close("r")
    assert [c.routing_start for c in back.calls] == [0, 24, 0, 0]


# ----------------------------------------------------------------------------------------------
# The proxy passes the engine's routing on


def test_the_proxy_records_the_engines_routing(renderer, tmp_path):
    import httpx

    from clawfast.engines.scripted import ScriptedEngine
    from clawfast.proxy import ProxyApp, ProxyConfig, ProxyCore, ProxyServer

    class RoutingEngine(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            gen = await super().generate(prompt_ids, params)
            path = np.concatenate([np.asarray(prompt_ids, np.int32), gen.output_ids])
            gen.routing, gen.routing_start = _true_routing(path, (0, len(path) - 1)), 0
            return gen

    engine = RoutingEngine(renderer.encode, renderer.turn_end_id, ["Hello there.", "Fine, thanks."])
    registry = RolloutRegistry(tmp_path / "records")
    server = ProxyServer(ProxyApp(ProxyCore(engine, renderer, ProxyConfig(keepalive_s=0.05)), registry)).start()
    try:
        key = registry.open("r0", harness="test").key
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            answer = httpx.post(server.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                json={"model": "policy", "messages": messages}, timeout=30)
            assert answer.status_code == 200, answer.text
            messages += [answer.json()["choices"][0]["message"], {"role": "user", "content": "and?"}]
        result = registry.close("r0")
    finally:
        server.stop()
    first, second = result.calls
    path1, path2 = first.path, second.path
    assert first.routing_start == 0 and len(first.routing) == len(path1) - 1
    shared = int(np.flatnonzero(np.concatenate([path1[: len(path2)] != path2[: len(path1)], [True]]))[0])
    assert second.routing_start == min(shared, len(path1) - 1) > 0
    np.testing.assert_array_equal(second.routing, _true_routing(path2, (second.routing_start, len(path2) - 1)))
    assert read_rollout(rollout_path(tmp_path / "records", "r0")).equals(result)
