"""The gRPC control plane over a real grpc server on a loopback port and a real `RolloutRegistry`.

Calls are appended the way the proxy core appends them (`Rollout.append`), with random token ids;
the last test drives one call through the real HTTP server (scripted engine, embedded tokenizer).
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from clawfast import records
from clawfast.proxy import clawfast_proxy_pb2 as pb
from clawfast.proxy import clawfast_proxy_pb2_grpc as pb_grpc
from clawfast.proxy.grpc_client import ControlClient, decode_call_frame
from clawfast.proxy.grpc_service import GrpcControlServer
from clawfast.proxy.rollouts import RolloutRegistry

TOKEN = "s3cret-token"


@pytest.fixture
def registry(tmp_path):
    reg = RolloutRegistry(tmp_path / "records", base_url="http://127.0.0.1:9999")
    yield reg
    reg.close_all()


@pytest.fixture
def server(registry):
    with GrpcControlServer(registry, TOKEN, poll_s=0.01) as srv:
        yield srv


@pytest.fixture
def client(server):
    with ControlClient(server.address, TOKEN, timeout=10) as c:
        yield c


def _append_random(registry: RolloutRegistry, rollout_id: str, rng: np.random.Generator) -> records.CallRecord:
    n_prompt, n_out = int(rng.integers(1, 300)), int(rng.integers(0, 40))
    return registry.get(rollout_id).append(
        prompt_ids=rng.integers(0, 150_000, n_prompt),
        output_ids=rng.integers(0, 150_000, n_out),
        infer_logprobs=-rng.exponential(1.0, n_out).astype(np.float32),
        weight_version=int(rng.integers(0, 5)),
        finish_reason=str(rng.choice(["stop", "length"])),
        timings={"received": float(rng.random()), "answered": float(rng.random())},
        tags=[("main",), ("subagent",), ("main", "title")][int(rng.integers(0, 3))],
        metadata={"protocol": "anthropic", "n": int(rng.integers(0, 9))},
    )


# -- authentication ------------------------------------------------------------------------------


@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)])
def test_every_method_rejects_a_missing_or_wrong_token(server, registry, metadata):
    opened = registry.open(task_id="t")
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.RolloutControlStub(channel)
    unary = [
        (stub.OpenRollout, pb.OpenRolloutRequest(task_id="t", harness="h")),
        (stub.CloseRollout, pb.CloseRolloutRequest(rollout_id=opened.rollout_id)),
        (stub.Stats, pb.StatsRequest()),
        (stub.Health, pb.HealthRequest()),
    ]
    for method, request in unary:
        with pytest.raises(grpc.RpcError) as info:
            method(request, metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamRecords(pb.StreamRecordsRequest(rollout_id=opened.rollout_id), metadata=metadata, timeout=5))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()
    # Nothing was done on the rejected calls: the rollout is still open, no new one appeared.
    assert registry.open_ids() == [opened.rollout_id]


def test_client_maps_wrong_token_to_permission_error(server):
    with ControlClient(server.address, "nope", timeout=5) as bad:
        with pytest.raises(PermissionError, match="UNAUTHENTICATED"):
            bad.health()
        with pytest.raises(PermissionError):
            list(bad.stream_records())


def test_unmapped_errors_stay_grpc_errors():
    with ControlClient("127.0.0.1:1", TOKEN, timeout=2) as nowhere:
        with pytest.raises(grpc.RpcError) as info:
            nowhere.health()
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_server_needs_a_token(registry):
    with pytest.raises(ValueError, match="token"):
        GrpcControlServer(registry, "")


# -- open / close --------------------------------------------------------------------------------


def test_open_returns_a_key_the_registry_resolves_and_both_base_urls(client, registry):
    opened = client.open_rollout("task-7", "claude-code", sample_index=3)
    assert opened.base_url == "http://127.0.0.1:9999"
    assert opened.openai_base_url == "http://127.0.0.1:9999/v1"
    rollout = registry.lookup(opened.key)
    assert rollout is not None and rollout.rollout_id == opened.rollout_id
    assert (rollout.task_id, rollout.harness, rollout.sample_index) == ("task-7", "claude-code", 3)
    other = client.open_rollout("task-7", "claude-code", sample_index=4)
    assert other.rollout_id != opened.rollout_id and other.key != opened.key


def test_close_returns_every_call_bit_for_bit_and_matches_the_log_file(client, registry):
    rng = np.random.default_rng(1)
    opened = client.open_rollout("task-1", "openclaw", sample_index=2)
    appended = [_append_random(registry, opened.rollout_id, rng) for _ in range(7)]
    result = client.close_rollout(opened.rollout_id, reward=0.75, status="ok", info={"verifier": "pytest", "k": [1, 2]})
    assert (result.rollout_id, result.task_id, result.harness, result.sample_index) == (
        opened.rollout_id, "task-1", "openclaw", 2,
    )
    assert (result.reward, result.status, result.info) == (0.75, "ok", {"verifier": "pytest", "k": [1, 2]})
    assert len(result.calls) == 7
    assert all(a.equals(b) for a, b in zip(appended, result.calls))
    on_disk = records.read_rollout(records.rollout_path(registry.records_dir, opened.rollout_id))
    assert on_disk.equals(result)
    assert registry.lookup(opened.key) is None  # the harness's key is revoked


def test_close_errors_are_python_errors_and_leave_the_rollout_open(server, client, registry):
    opened = client.open_rollout("t", "h")
    with pytest.raises(ValueError, match="status"):
        client.close_rollout(opened.rollout_id, status="weird")
    with pytest.raises(ValueError, match="status"):
        client.close_rollout(opened.rollout_id, status="running")
    with pytest.raises(ValueError, match="finite"):
        client.close_rollout(opened.rollout_id, reward=float("nan"))
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.RolloutControlStub(channel)
        for bad_info in ("[1]", "{not json", '{"loss": NaN}', '{"big": 1e999}'):  # the last two: no record holds
            with pytest.raises(grpc.RpcError) as info:
                stub.CloseRollout(
                    pb.CloseRolloutRequest(rollout_id=opened.rollout_id, info_json=bad_info),
                    metadata=(("authorization", f"Bearer {TOKEN}"),),
                    timeout=5,
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert registry.lookup(opened.key) is not None  # still open after every rejected close
    client.close_rollout(opened.rollout_id, status="timeout")
    with pytest.raises(KeyError, match="NOT_FOUND"):
        client.close_rollout(opened.rollout_id)
    with pytest.raises(KeyError):
        client.close_rollout("never-opened")


def test_open_rejects_bad_input(client, registry):
    with pytest.raises(ValueError, match="sample_index"):
        client.open_rollout("t", "h", sample_index=-1)
    registry.base_url = ""
    with pytest.raises(ValueError, match="not bound"):
        client.open_rollout("t", "h")


# -- streaming -----------------------------------------------------------------------------------


def _collect(stream, out: list, done: threading.Event) -> None:
    try:
        out.extend(stream)
    finally:
        done.set()


@pytest.mark.parametrize("close_at_once", [False, True])
def test_stream_of_one_rollout_yields_each_call_once_in_order_then_ends(client, registry, close_at_once):
    rng = np.random.default_rng(2)
    opened = client.open_rollout("t", "claude-code")
    before = [_append_random(registry, opened.rollout_id, rng) for _ in range(3)]
    got: list = []
    done = threading.Event()
    stream = client.stream_records(opened.rollout_id, include_past=True)
    threading.Thread(target=_collect, args=(stream, got, done), daemon=True).start()
    after = []
    for _ in range(6):
        after.append(_append_random(registry, opened.rollout_id, rng))
        if not close_at_once:
            time.sleep(0.005)
    # Closing right after the last append: the stream must still deliver it (from the log file).
    client.close_rollout(opened.rollout_id, reward=1.0)
    assert done.wait(10), "stream did not end after the rollout closed"
    expected = before + after
    assert [c.call_index for c in got] == list(range(len(expected)))
    assert all(a.equals(b) for a, b in zip(expected, got))


def test_stream_without_past_starts_at_the_next_call(client, registry):
    rng = np.random.default_rng(3)
    opened = client.open_rollout("t", "h")
    _append_random(registry, opened.rollout_id, rng)
    got: list = []
    done = threading.Event()
    stream = client.stream_records(opened.rollout_id, include_past=False)
    threading.Thread(target=_collect, args=(stream, got, done), daemon=True).start()
    time.sleep(0.1)  # let the server take its starting cursor before the next append
    new = _append_random(registry, opened.rollout_id, rng)
    client.close_rollout(opened.rollout_id)
    assert done.wait(10)
    assert len(got) == 1 and got[0].equals(new)


def test_stream_of_all_rollouts_follows_new_ones_until_cancelled(client, registry):
    rng = np.random.default_rng(4)
    first = client.open_rollout("a", "h")
    _append_random(registry, first.rollout_id, rng)  # past: not streamed
    got: list = []
    done = threading.Event()
    stream = client.stream_records(include_past=False)
    threading.Thread(target=_collect, args=(stream, got, done), daemon=True).start()
    time.sleep(0.1)
    second = client.open_rollout("b", "h")
    expected = [
        _append_random(registry, first.rollout_id, rng),
        _append_random(registry, second.rollout_id, rng),
        _append_random(registry, second.rollout_id, rng),
    ]
    client.close_rollout(second.rollout_id)
    deadline = time.time() + 10
    while len(got) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert not done.is_set(), "an all-rollouts stream must outlive the rollouts it saw"
    stream.cancel()
    assert done.wait(10)
    by_key = {(c.rollout_id, c.call_index): c for c in got}
    assert len(by_key) == len(got) == 3
    assert all(by_key[(c.rollout_id, c.call_index)].equals(c) for c in expected)


def test_stream_of_unknown_rollout_is_key_error(client):
    for include_past in (True, False):
        with pytest.raises(KeyError, match="NOT_FOUND"):
            list(client.stream_records("no-such-rollout", include_past=include_past))


def test_decode_call_frame_checks_the_crc():
    rng = np.random.default_rng(5)
    call = records.CallRecord("r", 0, "h", rng.integers(0, 9, 5), rng.integers(0, 9, 2), np.array([-0.5, -1.0]))
    frame = records.encode_call(call)
    assert decode_call_frame(frame, "r").equals(call)
    corrupt = bytearray(frame)
    corrupt[20] ^= 0xFF
    with pytest.raises(records.RecordFormatError):
        decode_call_frame(bytes(corrupt), "r")
    with pytest.raises(records.RecordFormatError, match="belongs to rollout 'r'"):
        decode_call_frame(frame, "another")


# -- status --------------------------------------------------------------------------------------


def test_stats_and_health(client, registry):
    rng = np.random.default_rng(6)
    a = client.open_rollout("a", "h")
    b = client.open_rollout("b", "h")
    calls = [_append_random(registry, a.rollout_id, rng) for _ in range(2)]
    calls += [_append_random(registry, b.rollout_id, rng) for _ in range(3)]
    client.close_rollout(a.rollout_id)
    stats = client.stats()
    assert (stats.open_rollouts, stats.closed_rollouts, stats.calls) == (1, 1, 5)
    assert stats.prompt_tokens == sum(len(c.prompt_ids) for c in calls)
    assert stats.output_tokens == sum(len(c.output_ids) for c in calls)
    assert stats.uptime_s >= 0
    health = client.health()
    assert health.ok and health.version and health.weight_version == 0 and health.engine == ""


# -- through the real HTTP server ------------------------------------------------------------------


def test_a_harness_call_through_http_arrives_on_the_stream_and_in_the_closed_rollout(proxy):
    """The trainer's view of one real call: open over gRPC, call the OpenAI front with the key it
    returned, see the record on the stream, close and get the same record back."""
    import openai

    with GrpcControlServer(proxy.registry, TOKEN, poll_s=0.01, engine=proxy.engine) as srv:
        with ControlClient(srv.address, TOKEN, timeout=10) as ctl:
            opened = ctl.open_rollout("task-http", "test", sample_index=1)
            assert opened.openai_base_url == proxy.url + "/v1"
            got: list = []
            done = threading.Event()
            threading.Thread(
                target=_collect, args=(ctl.stream_records(opened.rollout_id), got, done), daemon=True
            ).start()
            proxy.engine.push({"text": "hello from the policy"})
            sdk = openai.OpenAI(base_url=opened.openai_base_url, api_key=opened.key, max_retries=0)
            reply = sdk.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content == "hello from the policy"
            assert ctl.health().engine == "ScriptedEngine"
            result = ctl.close_rollout(opened.rollout_id, reward=1.0)
            assert done.wait(10)
            assert len(result.calls) == len(got) == 1 and got[0].equals(result.calls[0])
            call = result.calls[0]
            assert proxy.core.renderer.decode(call.output_ids, skip_special_tokens=True) == "hello from the policy"
            # The key is revoked with the rollout: the harness can no longer call.
            with pytest.raises(openai.AuthenticationError):
                sdk.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}])
