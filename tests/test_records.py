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
    assert same.output_versions is None and encode_rollout(RolloutResult("r0", "t", "h", calls=[same])) == \
        encode_rollout(RolloutResult("r0", "t", "h", calls=[CallRecord("r0", 0, "h", [1], [5, 6], [-0.1, -0.2],
                                                                      weight_version=2)]))


def test_version_runs_that_do_not_cover_the_output_are_a_format_error():
    call = CallRecord("r0", 0, "h", [1], [5, 6, 7], [-0.1] * 3, weight_version=0, output_versions=[0, 1, 1])
    data = encode_rollout(RolloutResult("r0", "t", "h", calls=[call]))
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


def _synced_log(path, calls):
    """A log whose writer fsync'd each call and then died: header and calls, no result frame."""
    log = RolloutLog(path, {"rollout_id": "r0", "task_id": "t", "harness": "h", "sample_index": 0}, fsync=True)
    for c in calls:
        log.append(c)
    log._fh.close()
    return path


@pytest.mark.parametrize("tail", ["zeros", "frame prefix then zeros", "zeros shorter than a frame head"])
def test_recovery_keeps_the_synced_calls_before_a_power_loss_tail(tmp_path, tail):
    """After a power loss the file can end in zeros (its size grew, its last pages were never written)
    or in a frame's first bytes then zeros; the calls synced before are kept and the drop is noted."""
    from clawfast.records import encode_call

    rng = np.random.default_rng(8)
    calls = [_call(i, rng) for i in range(4)]
    path = _synced_log(tmp_path / "live.cfr", calls[:3])
    synced = path.stat().st_size
    frame = encode_call(calls[3])
    junk = {"zeros": b"\0" * 4096, "frame prefix then zeros": frame[:20] + b"\0" * 4096,
            "zeros shorter than a frame head": b"\0" * 5}[tail]
    with open(path, "ab") as fh:
        fh.write(junk)
    with pytest.raises(RecordFormatError, match=f"at byte {synced}"):
        read_rollout(path)  # strict without recover
    back = read_rollout(path, recover=True)
    assert back.status == "running" and len(back.calls) == 3
    assert all(a.equals(b) for a, b in zip(back.calls, calls))
    assert back.info["torn_tail"]["at_byte"] == synced and back.info["torn_tail"]["bytes"] == len(junk)


def test_recovery_stops_at_a_damaged_frame_in_the_middle_and_never_reads_past_it():
    """A bad frame followed by good ones: recovery keeps the frames before it and drops it and all after
    it (noted with the byte count), rather than skipping over the damage to later frames."""
    from clawfast.records import encode_call, encode_header

    r = _rollout(np.random.default_rng(9), 4)
    data = bytearray(encode_rollout(r))
    second = len(encode_header(r.header())) + len(encode_call(r.calls[0]))
    data[second + 20] ^= 0x01  # inside call 1's frame; calls 2, 3 and the result are intact
    with pytest.raises(RecordFormatError, match=f"checksum mismatch in frame at byte {second}"):
        decode_rollout(bytes(data))
    back = decode_rollout(bytes(data), recover=True)
    assert len(back.calls) == 1 and back.calls[0].equals(r.calls[0])
    assert back.status == "running" and back.reward == 0.0  # the result frame lay past the damage
    assert back.info["torn_tail"] == {"at_byte": second, "bytes": len(data) - second,
                                      "reason": f"checksum mismatch in frame at byte {second}"}
    # An undamaged file notes nothing.
    assert "torn_tail" not in decode_rollout(encode_rollout(r), recover=True).info


def test_numpy_scalars_become_python_numbers_when_the_record_is_built(tmp_path):
    """Numpy indices, versions and rewards (what array code hands over) are stored as Python numbers,
    so they write and read back equal instead of failing in the JSON encoder at write time."""
    c = CallRecord("r", np.int64(3), "h", [1, 2], [3], [-0.5], weight_version=np.int32(2))
    r = RolloutResult("r", "t", "h", sample_index=np.int64(1), reward=np.float32(0.5), calls=[c])
    assert type(c.call_index) is int and type(c.weight_version) is int
    assert type(r.sample_index) is int and type(r.reward) is float and r.reward == 0.5
    assert read_rollout(write_rollout(tmp_path / "n.cfr", r)).equals(r)
    assert CallRecord("r", 2.0, "h", [1], [], []).call_index == 2  # an integral float is that integer


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda c: c(call_index=True), "call_index must be an integer, got the bool True"),
        (lambda c: c(call_index=1.5), "call_index must be an integer, got 1.5"),
        (lambda c: c(weight_version=float("nan")), "weight_version must be an integer"),
        (lambda c: RolloutResult("r", "t", "h", sample_index="0"), "sample_index must be an integer"),
        (lambda c: RolloutResult("r", "t", "h", reward=np.float32("nan")), "reward must be finite"),
        (lambda c: RolloutResult("r", "t", "h", reward="1"), "reward must be a number"),
        (lambda c: c(metadata={1: "a"}), r"metadata has the key 1 \(int\)"),
        (lambda c: c(metadata={"h": {"k": [1, (2, 3)]}}), r"metadata\['h'\]\['k'\]\[1\] is a tuple"),
        (lambda c: c(metadata={"n": np.int64(4)}), r"metadata\['n'\] is int64"),
        (lambda c: c(metadata=[("a", 1)]), "metadata must be a dict, got list"),
        (lambda c: c(timings={"t": float("nan")}), r"timings\['t'\] is nan"),
        (lambda c: RolloutResult("r", "t", "h", info={"x": [float("inf")]}), r"info\['x'\]\[0\] is inf"),
    ],
)
def test_fields_that_would_not_round_trip_are_refused_when_the_record_is_built(build, match):
    """What the file cannot hold, or would hand back changed ({1: 'a'} as {'1': 'a'}, a tuple as a
    list), is a ValueError naming the field and key path at construction, not at write time."""
    def call(**kw):
        return CallRecord(**{**dict(rollout_id="r", call_index=0, harness="h", prompt_ids=[1], output_ids=[],
                                    infer_logprobs=[]), **kw})

    with pytest.raises(ValueError, match=match):
        build(call)


def test_rollout_ids_that_map_to_one_file_are_refused_not_overwritten(tmp_path):
    """'task/1:s0' and 'task_1_s0' both write task_1_s0.cfr: writing both is refused (before either
    is written), and so is writing one over the file the other left; the same rollout may be rewritten."""
    from clawfast.records import read_rollouts, rollout_path

    def rollout(rid, reward=0.0):
        return RolloutResult(rid, "t", "h", reward=reward, calls=[CallRecord(rid, 0, "h", [1, 2], [3], [-0.1])])

    with pytest.raises(ValueError, match="rollouts 'task/1:s0' and 'task_1_s0' both map to"):
        write_rollouts(tmp_path / "a", [rollout("task/1:s0"), rollout("task_1_s0")])
    assert not list((tmp_path / "a").glob("*.cfr"))

    write_rollouts(tmp_path / "b", [rollout("task/1:s0")])
    with pytest.raises(ValueError, match="holds rollout 'task/1:s0': not replacing it with rollout 'task_1_s0'"):
        write_rollouts(tmp_path / "b", [rollout("task_1_s0")])
    write_rollout(rollout_path(tmp_path / "b", "task/1:s0"), rollout("task/1:s0", reward=1.0))  # same id: replaced
    (back,) = read_rollouts(tmp_path / "b")
    assert back.rollout_id == "task/1:s0" and back.reward == 1.0

    (tmp_path / "b" / "junk.cfr").write_bytes(b"not a record")
    with pytest.raises(ValueError, match="holds no readable rollout header"):
        write_rollout(tmp_path / "b" / "junk.cfr", rollout("junk"))


def test_a_live_log_refuses_a_result_info_that_would_not_read_back(tmp_path):
    log = RolloutLog(tmp_path / "l.cfr", {"rollout_id": "r0", "task_id": "t", "harness": "h", "sample_index": 0})
    with pytest.raises(ValueError, match=r"info\['k'\] is a tuple"):
        log.close(info={"k": (1, 2)})
    log.close(reward=np.float32(0.5), info={"k": [1, 2]})  # the refused close wrote nothing: this one closes it
    back = read_rollout(tmp_path / "l.cfr")
    assert back.reward == 0.5 and back.info == {"k": [1, 2]} and "torn_tail" not in back.info


def test_a_call_of_another_rollout_or_a_negative_index_is_refused(tmp_path):
    def call(rollout_id="r0", call_index=0):
        return CallRecord(rollout_id=rollout_id, call_index=call_index, harness="h", prompt_ids=[1, 2],
                          output_ids=[3], infer_logprobs=[-0.5])

    with pytest.raises(ValueError, match="call_index must be >= 0, got -1"):
        call(call_index=-1)
    with pytest.raises(ValueError, match="call 0 belongs to rollout 'r1'"):
        RolloutResult(rollout_id="r0", task_id="t", harness="h", calls=[call("r1")])
    # `calls` set after construction is checked where the rollout is written
    result = RolloutResult(rollout_id="r0", task_id="t", harness="h")
    result.calls = [call(), call("r1", 1)]
    with pytest.raises(ValueError, match="call 1 belongs to rollout 'r1'"):
        write_rollout(tmp_path / "r0.cfr", result)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="needs a rollout_id"):
        RolloutLog(tmp_path / "nameless.cfr", {"task_id": "t"})
    assert not (tmp_path / "nameless.cfr").exists()
    log = RolloutLog(tmp_path / "live.cfr", {"rollout_id": "r0", "task_id": "t", "harness": "h", "sample_index": 0})
    log.append(call())
    with pytest.raises(ValueError, match="belongs to rollout 'r1'"):
        log.append(call("r1", 1))
    log.close()
    assert [c.call_index for c in read_rollout(tmp_path / "live.cfr").calls] == [0]
