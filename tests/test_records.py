import numpy as np
import pytest

from clawfast.records import (
    CallRecord,
    RecordFormatError,
    RolloutLog,
    RolloutResult,
    encode_rollout,
    decode_rollout,
    load_rollouts,
    read_rollout,
    write_rollout,
    write_rollouts,
)


def _call(i, rng, rollout="r0"):
    n_p, n_o = rng.integers(1, 50), rng.integers(0, 20)
    return CallRecord(
        rollout_id=rollout,
        call_index=i,
        harness="claude-code",
        prompt_ids=rng.integers(0, 1000, n_p),
        output_ids=rng.integers(0, 1000, n_o),
        infer_logprobs=-rng.random(n_o).astype(np.float32) * 5,
        weight_version=3,
        finish_reason="tool_use",
        timings={"received": 1.5, "answered": 2.25},
        tags=("main",) if i % 3 else ("subagent",),
        metadata={"protocol": "anthropic", "drift": i, "nested": {"a": [1, "b"]}},
    )


def _rollout(rng, n_calls=5, rid="r0"):
    return RolloutResult(
        rollout_id=rid, task_id="t1", harness="claude-code", sample_index=2, reward=0.75,
        status="ok", calls=[_call(i, rng, rid) for i in range(n_calls)], info={"log": "x"},
    )


def test_round_trip_is_lossless(tmp_path):
    rng = np.random.default_rng(1)
    r = _rollout(rng)
    path = write_rollout(tmp_path / "a.cfr", r)
    back = read_rollout(path)
    assert back.equals(r)
    assert back.calls[1].infer_logprobs.dtype == np.float32
    assert back.calls[0].excluded and not back.calls[1].excluded


def test_directory_of_rollouts(tmp_path):
    rng = np.random.default_rng(2)
    rs = [_rollout(rng, n, f"roll/{n}") for n in (0, 1, 7)]
    write_rollouts(tmp_path / "d", rs)
    back = load_rollouts(tmp_path / "d")
    assert sorted(b.rollout_id for b in back) == sorted(r.rollout_id for r in rs)
    for b in back:
        assert b.equals(next(r for r in rs if r.rollout_id == b.rollout_id))


def test_every_truncation_is_rejected():
    rng = np.random.default_rng(3)
    data = encode_rollout(_rollout(rng, 3))
    for cut in range(0, len(data), 7):
        with pytest.raises(RecordFormatError):
            decode_rollout(data[:cut])


def test_corruption_is_rejected():
    rng = np.random.default_rng(4)
    data = bytearray(encode_rollout(_rollout(rng, 3)))
    for pos in range(8, len(data), 11):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        with pytest.raises(RecordFormatError):
            decode_rollout(bytes(bad))


def test_live_log_survives_a_torn_tail(tmp_path):
    rng = np.random.default_rng(5)
    calls = [_call(i, rng) for i in range(4)]
    log = RolloutLog(tmp_path / "live.cfr", {"rollout_id": "r0", "task_id": "t", "harness": "h", "sample_index": 0})
    for c in calls:
        log.append(c)
    # the writer dies mid-append
    with open(tmp_path / "live.cfr", "ab") as fh:
        fh.write(b"C\x99\x00")
    with pytest.raises(RecordFormatError, match="truncated"):
        read_rollout(tmp_path / "live.cfr")
    back = read_rollout(tmp_path / "live.cfr", recover=True)
    assert back.status == "running" and len(back.calls) == 4
    assert all(a.equals(b) for a, b in zip(back.calls, calls))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_ids=[1, -2]), "outside"),
        (dict(prompt_ids=[1, 2**40]), "outside"),
        (dict(prompt_ids=[1.5]), "integers"),
        (dict(output_ids=[1, 2], infer_logprobs=[-0.1]), "logprobs"),
        (dict(prompt_ids=[]), "empty prompt"),
        (dict(output_ids=[1], infer_logprobs=[float("nan")]), "non-finite"),
        (dict(output_ids=[1], infer_logprobs=[0.5]), "positive"),
    ],
)
def test_malformed_calls_raise(kwargs, match):
    base = dict(rollout_id="r", call_index=0, harness="h", prompt_ids=[1, 2], output_ids=[3], infer_logprobs=[-0.5])
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        CallRecord(**base)


def test_vocab_bound():
    c = CallRecord(rollout_id="r", call_index=0, harness="h", prompt_ids=[1, 99], output_ids=[], infer_logprobs=[])
    with pytest.raises(ValueError, match="vocab"):
        c.validate(vocab_size=50)
