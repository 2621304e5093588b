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
        (dict(output_ids=[1, 2], infer_logprobs=[-0.1, -0.2], output_versions=[0]), "versions for 2"),
        (dict(output_ids=[1, 2], infer_logprobs=[-0.1, -0.2], output_versions=[1, 2]), "starts at version 1"),
        (dict(output_ids=[1, 2], infer_logprobs=[-0.1, -0.2], weight_version=2, output_versions=[2, 1]),
         "must not decrease"),
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


def test_per_token_versions_round_trip_and_old_files_read_as_one_version(tmp_path):
    """A call continued across pushes keeps each token's version through the file (stored as runs);
    a call on one version stores none, so files written before per-token versions, which hold
    none, read back with the call's one version covering every token."""
    from clawfast.records import _meta_of

    rng = np.random.default_rng(7)
    calls = [_call(i, rng) for i in range(3)]
    n = len(calls[1].output_ids) or 1
    calls[1] = CallRecord("r0", 1, "h", [1, 2], np.arange(n + 4), -np.ones(n + 4), weight_version=3,
                          output_versions=[3] * 2 + [4] * n + [6] * 2)
    rollout = RolloutResult("r0", "t", "h", calls=calls)
    back = read_rollout(write_rollout(tmp_path / "v.cfr", rollout))
    assert back.equals(rollout)
    np.testing.assert_array_equal(back.calls[1].token_versions, [3] * 2 + [4] * n + [6] * 2)
    assert _meta_of(back.calls[1])["version_runs"] == [[0, 3], [2, 4], [2 + n, 6]]
    assert back.calls[0].output_versions is None and "version_runs" not in _meta_of(back.calls[0])
    assert (back.calls[0].token_versions == 3).all()
    # Uniform versions are the one-version case, stored the way files always were.
    same = CallRecord("r0", 0, "h", [1], [5, 6], [-0.1, -0.2], weight_version=2, output_versions=[2, 2])
    assert same.output_versions is None and encode_rollout(RolloutResult("r", "t", "h", calls=[same])) == \
        encode_rollout(RolloutResult("r", "t", "h", calls=[CallRecord("r0", 0, "h", [1], [5, 6], [-0.1, -0.2],
                                                                      weight_version=2)]))


def test_version_runs_that_do_not_cover_the_output_are_a_format_error():
    call = CallRecord("r0", 0, "h", [1], [5, 6, 7], [-0.1] * 3, weight_version=0, output_versions=[0, 1, 1])
    data = encode_rollout(RolloutResult("r", "t", "h", calls=[call]))
    bad = data.replace(b'"version_runs":[[0,0],[1,1]]', b'"version_runs":[[0,0],[5,1]]')
    assert bad != data
    import zlib

    # Re-seal the frame's checksum so that the decoder reaches the runs themselves.
    from clawfast.records import MAGIC, _CRC, _FRAME_HEAD

    pos = len(MAGIC)
    frames = []
    while pos < len(bad):
        kind, length = _FRAME_HEAD.unpack_from(bad, pos)
        head = bad[pos:pos + _FRAME_HEAD.size]
        payload = bad[pos + _FRAME_HEAD.size:pos + _FRAME_HEAD.size + length]
        frames.append(head + payload + _CRC.pack(zlib.crc32(payload, zlib.crc32(head))))
        pos += _FRAME_HEAD.size + length + _CRC.size
    with pytest.raises(RecordFormatError, match="do not cover"):
        decode_rollout(MAGIC + b"".join(frames))



@pytest.mark.parametrize("frame", ["header", "result"])
@pytest.mark.parametrize("payload", [b"[1,2]", b'"text"', b"null", b"7", b"\xb1\xb2"])
def test_a_header_or_result_frame_that_is_not_a_json_object_is_a_format_error(tmp_path, frame, payload):
    """Valid JSON of another kind (or bytes that are not UTF-8) is a RecordFormatError naming the
    file, as any other bad frame is (callers list such a file as unreadable instead of crashing)."""
    from clawfast.records import MAGIC, _KIND_HEADER, _KIND_RESULT, _frame, encode_call, encode_header, encode_result

    r = _rollout(np.random.default_rng(5), 2)
    header = MAGIC + _frame(_KIND_HEADER, payload) if frame == "header" else encode_header(r.header())
    result = _frame(_KIND_RESULT, payload) if frame == "result" else encode_result(r.reward, r.status, r.info)
    path = tmp_path / "bad.cfr"
    path.write_bytes(header + b"".join(encode_call(c) for c in r.calls) + result)
    for recover in (False, True):
        with pytest.raises(RecordFormatError, match=f"^{path}: {frame} frame at byte "):
            read_rollout(path, recover=recover)
