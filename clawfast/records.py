"""The data contract: what the proxy captures and what a rollout returns.

`CallRecord` is one model call as the engine saw it: the exact prompt token ids, the sampled token
ids and the sampler's own log-probs. `RolloutResult` is one task run once by one harness, with its
reward, status and calls.

On disk (`write_rollout` / `read_rollout`, `RolloutLog` for appending) a rollout is one file of
framed chunks, never pickle:

    frame := kind:u8  length:u64le  payload[length]  crc32(kind, length, payload):u32le

kinds: ``H`` rollout header (JSON), ``C`` one call (JSON header + raw little-endian arrays),
``R`` the result (JSON: reward, status, info). A file may hold a header and calls without a result:
that is a rollout still running, or one whose writer died; every call that was appended survives.

A ``C`` payload is ``meta_len:u32le  meta[meta_len]  prompt:i32[n_prompt]  output:i32[n_output]
logprobs:f32[n_output]  routing?``, all little-endian; ``meta`` is the call's JSON (`_meta_of`,
``n_prompt`` and ``n_output`` among it). Optional parts are announced in ``meta`` and written only
when present, so a call without them is byte for byte what older writers wrote:
``version_runs`` (a call that spans weight versions) is JSON only; ``routing`` (MoE routing, see
`CallRecord`) is ``{"start": s, "rows": R, "layers": Lr, "top_k": k, "dtype": "u1" | "<u2"}`` in
``meta`` and ``R * Lr * k`` expert indices (row-major ``[R, Lr, k]``) after the logprobs, inside the
same frame and checksum. A reader that knows no routing refuses such a call (its body is longer than
its arrays), never misreads it.

Guaranteed: lossless round trip of every field (arrays bit for bit). For that a record refuses, when it
is built (ValueError naming the field and key path), what JSON would not hand back as it was:
`metadata`, `timings` and `info` must be dicts of str keys, lists, str, int, bool, None and finite
floats (no tuple, int key, NaN, numpy integer or float32); `call_index`, `weight_version` and
`sample_index` become Python ints (a numpy integer or integral float converts; a bool, a fraction or a
non-finite value is refused) and `reward` a finite Python float. A truncated or corrupted file raises
`RecordFormatError` naming the byte offset, unless the caller asks for crash recovery
(``recover=True``): reading then stops at the first frame that is cut short or fails its checksum,
wherever it lies, keeps the frames before it and notes the drop in ``info["torn_tail"]``; it never skips
a damaged frame to read later ones (a crash damages only the end, so good frames after a bad one mean
corruption, and the bad frame's length cannot be trusted to find them). One file per rollout id
(`rollout_path`); ids that map to one file name are refused, never written over each other. Not
guaranteed: concurrent writers to one file (one writer per rollout; the proxy serialises appends).
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

MAGIC = b"CLAWFREC"
FORMAT_VERSION = 1
FILE_SUFFIX = ".cfr"

TAGS = ("main", "subagent", "compaction", "title", "summary", "quota", "other-side")  # clawfast.threads.KINDS
EXCLUDED_TAGS = frozenset(TAGS) - {"main"}
STATUSES = ("ok", "timeout", "harness_error", "sandbox_error", "verifier_error", "proxy_error", "running")

_FRAME_HEAD = struct.Struct("<BQ")
_CRC = struct.Struct("<I")
_KIND_HEADER, _KIND_CALL, _KIND_RESULT = ord("H"), ord("C"), ord("R")


def checked_versions(versions: Any, weight_version: int, n: int) -> np.ndarray | None:
    """The per-token versions of a call of `n` output tokens whose oldest token has `weight_version`,
    checked (one per token, non-decreasing, starting there); None when one version sampled them all."""
    if versions is None:
        return None
    versions = np.asarray(versions, dtype=np.int64)
    if versions.shape != (n,):
        raise ValueError(f"output_versions holds {versions.size} versions for {n} output tokens")
    if n and int(versions[0]) != int(weight_version):
        raise ValueError(f"output_versions starts at version {int(versions[0])}, but weight_version is {weight_version}")
    if n > 1 and np.any(np.diff(versions) < 0):
        raise ValueError("output_versions must not decrease: a later token cannot come from older weights")
    return versions if n and versions[-1] != versions[0] else None


class RecordFormatError(ValueError):
    """A record file or record is malformed (truncated, corrupt, inconsistent)."""


def _as_array(values: Any, dtype: type, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if dtype is np.int32:
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
            raise ValueError(f"{name} holds token ids outside [0, 2^31): min {arr.min()}, max {arr.max()}")
    return np.ascontiguousarray(arr, dtype=dtype)


def _as_int(value: Any, name: str) -> int:
    """`value` as a Python int. A numpy integer or an integral float converts (the JSON encoder refuses a
    numpy scalar, and would write 3.0 for 3); a bool, a fraction, NaN or an infinity is refused."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got the bool {value!r}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return int(value)
    raise ValueError(f"{name} must be an integer, got {value!r}")


def _as_float(value: Any, name: str) -> float:
    """`value` as a finite Python float (a numpy number converts; a bool is 0.0 or 1.0, a pass/fail)."""
    if not isinstance(value, (int, float, np.integer, np.floating, np.bool_)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}")
    return number


def json_problem(value: Any, where: str) -> str | None:
    """Why `value` would not read back from a record's JSON as it is, or None. `where` names it (a field
    and key path, e.g. ``metadata['headers']``) in the answer.

    What reads back equal: dicts with str keys, lists, str, int, bool, None and finite floats. Anything else
    is refused rather than changed on the way: a tuple would read back as a list and an int key as a str
    key; NaN, infinities and numpy scalars cannot be written at all."""
    if value is None or isinstance(value, (str, int)):  # a bool is an int; an int or str subclass writes as one
        return None
    if isinstance(value, float):  # np.float64 is a float and reads back equal
        return None if math.isfinite(value) else f"{where} is {value}: JSON holds finite numbers only"
    if isinstance(value, list):
        for i, item in enumerate(value):
            problem = json_problem(item, f"{where}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return (f"{where} has the key {key!r} ({type(key).__name__}): JSON keys are strings, so it would "
                        f"read back changed")
            problem = json_problem(item, f"{where}[{key!r}]")
            if problem:
                return problem
        return None
    if isinstance(value, tuple):
        return f"{where} is a tuple: it would read back as a list (pass a list)"
    return (f"{where} is {type(value).__name__} {value!r:.80}, which JSON cannot hold (convert numpy numbers "
            f"with int() / float(), arrays with .tolist())")


def _json_dict_problem(value: Any, name: str) -> str | None:
    """Why the dict field `name` (metadata, timings, info) would not round-trip through the file, or None."""
    if not isinstance(value, dict):
        return f"{name} must be a dict, got {type(value).__name__}"
    return json_problem(value, name)


@dataclass
class CallRecord:
    """One model call, token in and token out.

    prompt_ids: the exact token ids the engine was given (int32).
    output_ids: the token ids it sampled (int32).
    infer_logprobs: the sampler's own log-prob of each sampled token (float32, same length).
    tags: what the call was (`TAGS`): the proxy's hint from the request, or the kind
        `clawfast.threads.reconstruct` gave it from the rollout's structure (`threads.with_kinds`).
    metadata: the request facts that produced the tags and anything else worth keeping (protocol,
        headers of interest, prompt drift against the previous call, client disconnects).
    timings: seconds, e.g. ``{"received": t0, "answered": t1, "generate": g}``.
    weight_version: the version of the weights that sampled the oldest output token.
    output_versions: None when `weight_version` sampled every output token; for a call that went on
        decoding across a weight push, the version that sampled each one (int64, same length,
        non-decreasing; an array of one version is stored as None). `token_versions` gives the
        array either way. On disk only a call that spans versions stores them (as runs); an older
        file reads back with one version covering the call.
    routing / routing_start: the experts each MoE layer chose, for routing replay, or None (a dense
        model, an engine that does not record, or rows an earlier call of the rollout already
        stored). ``routing[i]`` ([layers, top_k], uint8 or uint16) is row ``routing_start + i`` of
        the call's path ``prompt_ids + output_ids``: the model's forward at input token ``path[p]``
        (the one that predicts ``path[p + 1]``). Rows cover ``[routing_start, routing_start + R)``
        within the path (an engine computes at most ``len(path) - 1`` of them: the last sampled
        token is never fed back). An empty array is stored as None (and `routing_start` as 0). A
        call stores only the rows its parent call does not hold alike (`clawfast.routing_store`),
        so a call that extends an earlier one usually starts its routing where that one's ended.
    """

    rollout_id: str
    call_index: int
    harness: str
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    infer_logprobs: np.ndarray
    weight_version: int = 0
    finish_reason: str = "stop"
    timings: dict[str, float] = field(default_factory=dict)
    tags: tuple[str, ...] = ("main",)
    metadata: dict[str, Any] = field(default_factory=dict)
    output_versions: np.ndarray | None = None
    routing: np.ndarray | None = None
    routing_start: int = 0

    def __post_init__(self) -> None:
        self.prompt_ids = _as_array(self.prompt_ids, np.int32, "prompt_ids")
        self.output_ids = _as_array(self.output_ids, np.int32, "output_ids")
        self.infer_logprobs = _as_array(self.infer_logprobs, np.float32, "infer_logprobs")
        try:
            # Checked here, not when the record is written: a call the proxy cannot write fails where
            # it was made, and what is written reads back equal (`equals`).
            self.call_index = _as_int(self.call_index, "call_index")
            if self.call_index < 0:  # the call's place in its rollout: threads and trees order by it
                raise ValueError(f"call_index must be >= 0, got {self.call_index}")
            self.weight_version = _as_int(self.weight_version, "weight_version")
            for name in ("timings", "metadata"):
                problem = _json_dict_problem(getattr(self, name), name)
                if problem:
                    raise ValueError(problem)
            self.output_versions = checked_versions(self.output_versions, self.weight_version, len(self.output_ids))
            self.routing = _native_routing(self.routing)
            if isinstance(self.routing_start, np.integer):
                self.routing_start = int(self.routing_start)
        except ValueError as exc:
            raise ValueError(f"call {self.call_index} of rollout {self.rollout_id!r}: {exc}") from None
        self.tags = tuple(self.tags)
        self.validate()
        if self.routing is None or len(self.routing) == 0:  # checked above: an empty array is no routing
            self.routing, self.routing_start = None, 0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError if the record cannot be training data."""
        if len(self.output_ids) != len(self.infer_logprobs):
            raise ValueError(
                f"call {self.call_index} of rollout {self.rollout_id!r}: {len(self.output_ids)} output ids "
                f"but {len(self.infer_logprobs)} logprobs"
            )
        if len(self.prompt_ids) == 0:
            raise ValueError(f"call {self.call_index} of rollout {self.rollout_id!r}: empty prompt")
        if self.infer_logprobs.size:
            lp = self.infer_logprobs
            if not np.all(np.isfinite(lp)):
                raise ValueError(f"call {self.call_index}: non-finite output logprob")
            # Sampling log-probs are <= 0; allow float32 rounding of log(1).
            if lp.max() > 1e-4:
                raise ValueError(f"call {self.call_index}: positive output logprob {lp.max()}")
        problem = routing_problem(self.routing, self.routing_start, len(self.prompt_ids) + len(self.output_ids))
        if problem:
            raise ValueError(f"call {self.call_index} of rollout {self.rollout_id!r}: {problem}")
        if vocab_size is not None:
            for name, ids in (("prompt_ids", self.prompt_ids), ("output_ids", self.output_ids)):
                if ids.size and ids.max() >= vocab_size:
                    raise ValueError(
                        f"call {self.call_index}: {name} holds token id {ids.max()} >= vocab size {vocab_size}"
                    )

    @property
    def token_versions(self) -> np.ndarray:
        """int64[n_output]: the weight version that sampled each output token."""
        if self.output_versions is not None:
            return self.output_versions
        return np.full(len(self.output_ids), int(self.weight_version), dtype=np.int64)

    @property
    def excluded(self) -> bool:
        """True if a tag keeps this call out of the loss (any tag but main)."""
        return bool(EXCLUDED_TAGS.intersection(self.tags))

    def equals(self, other: "CallRecord") -> bool:
        return (
            _meta_of(self) == _meta_of(other)
            and np.array_equal(self.prompt_ids, other.prompt_ids)
            and np.array_equal(self.output_ids, other.output_ids)
            and self.infer_logprobs.tobytes() == other.infer_logprobs.tobytes()
            and (self.routing is None) == (other.routing is None)
            and (self.routing is None or np.array_equal(self.routing, other.routing))
        )

    @property
    def path(self) -> np.ndarray:
        """int32: ``prompt_ids + output_ids``, the tokens the routing rows index."""
        return np.concatenate([self.prompt_ids, self.output_ids])


ROUTING_DTYPES = {"u1": np.dtype(np.uint8), "<u2": np.dtype("<u2")}  # on-disk name -> dtype


def _native_routing(routing: Any) -> np.ndarray | None:
    """`routing` as a C-contiguous native-order uint8/uint16 array (an unsigned array of another
    byte order is converted; any other dtype is refused, never narrowed)."""
    if routing is None:
        return None
    arr = np.asarray(routing)
    if arr.dtype.kind != "u" or arr.dtype.itemsize not in (1, 2):
        raise ValueError(f"routing must be a uint8 or uint16 array of expert indices, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.uint8 if arr.dtype.itemsize == 1 else np.uint16)


def routing_problem(routing: np.ndarray | None, start: int, path_len: int) -> str | None:
    """Why `routing` starting at path row `start` cannot belong to a path of `path_len` tokens, or None."""
    if routing is None:
        return None if start == 0 else f"routing_start {start} without routing"
    if not isinstance(routing, np.ndarray) or routing.dtype not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        return f"routing must be a uint8 or uint16 array, got {getattr(routing, 'dtype', type(routing).__name__)}"
    if routing.ndim != 3:
        return f"routing must be [rows, layers, top_k], got shape {routing.shape}"
    rows = routing.shape[0]
    if rows and (routing.shape[1] == 0 or routing.shape[2] == 0):
        return f"routing of shape {routing.shape} holds no expert per row"
    if isinstance(start, bool) or not isinstance(start, int):
        return f"routing_start must be an int, got {start!r}"
    if start < 0 or start + rows > path_len:
        return (f"routing rows [{start}, {start + rows}) do not lie within the call's path of {path_len} "
                f"tokens (prompt + output)")
    return None


@dataclass
class RolloutResult:
    """One task run once by one harness: its reward, truthful status and captured calls."""

    rollout_id: str
    task_id: str
    harness: str
    sample_index: int = 0
    reward: float = 0.0
    status: str = "ok"
    calls: list[CallRecord] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"rollout {self.rollout_id!r}: unknown status {self.status!r}; expected one of {STATUSES}")
        try:  # as in CallRecord: what cannot be written, or would read back changed, fails here
            self.sample_index = _as_int(self.sample_index, "sample_index")
            self.reward = _as_float(self.reward, "reward")
            problem = _json_dict_problem(self.info, "info")
            if problem:
                raise ValueError(problem)
        except ValueError as exc:
            raise ValueError(f"rollout {self.rollout_id!r}: {exc}") from None
        check_calls_of(self.rollout_id, self.calls)

    def header(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "rollout_id": self.rollout_id,
            "task_id": self.task_id,
            "harness": self.harness,
            "sample_index": self.sample_index,
        }

    def equals(self, other: "RolloutResult") -> bool:
        return (
            self.header() == other.header()
            and (self.reward, self.status, self.info) == (other.reward, other.status, other.info)
            and len(self.calls) == len(other.calls)
            and all(a.equals(b) for a, b in zip(self.calls, other.calls))
        )


def check_calls_of(rollout_id: str, calls: Iterable[CallRecord]) -> None:
    """ValueError if a call belongs to another rollout than `rollout_id`: a file holds one rollout,
    and a reader would take the call for one of its calls."""
    for call in calls:
        if call.rollout_id != rollout_id:
            raise ValueError(f"rollout {rollout_id!r}: call {call.call_index} belongs to rollout {call.rollout_id!r}")


def _meta_of(call: CallRecord) -> dict[str, Any]:
    meta = {
        "rollout_id": call.rollout_id,
        "call_index": call.call_index,
        "harness": call.harness,
        "weight_version": call.weight_version,
        "finish_reason": call.finish_reason,
        "timings": call.timings,
        "tags": list(call.tags),
        "metadata": call.metadata,
        "n_prompt": int(len(call.prompt_ids)),
        "n_output": int(len(call.output_ids)),
    }
    if call.output_versions is not None:  # a call on one version stores none: files stay as they were
        meta["version_runs"] = version_runs(call.output_versions)
    if call.routing is not None:  # likewise: a call without routing is written as before
        rows, layers, top_k = (int(d) for d in call.routing.shape)
        meta["routing"] = {"start": int(call.routing_start), "rows": rows, "layers": layers, "top_k": top_k,
                           "dtype": "u1" if call.routing.dtype.itemsize == 1 else "<u2"}
    return meta


def version_runs(versions: np.ndarray) -> list[list[int]]:
    """[[first token index, version], ...]: where each run of one version starts."""
    starts = np.flatnonzero(np.diff(versions)) + 1 if len(versions) else np.zeros(0, dtype=np.int64)
    return [[0, int(versions[0])]] + [[int(i), int(versions[i])] for i in starts] if len(versions) else []


def versions_of_runs(runs: list[list[int]], n: int) -> np.ndarray:
    """The per-token versions of `n` tokens from `version_runs`."""
    versions = np.empty(n, dtype=np.int64)
    bounds = [int(start) for start, _ in runs] + [n]
    if bounds[0] != 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"version_runs {runs} do not cover {n} tokens in order")
    for (start, version), end in zip(runs, bounds[1:]):
        versions[int(start):end] = int(version)
    return versions


# ----------------------------------------------------------------------------------------------
# Encoding


def _frame(kind: int, payload: bytes) -> bytes:
    return b"".join(_frame_parts(kind, [payload]))


def _frame_parts(kind: int, parts: list) -> list:
    """A frame as a list of buffers, so large arrays are checksummed and written without copies."""
    head = _FRAME_HEAD.pack(kind, sum(memoryview(p).nbytes for p in parts))
    crc = zlib.crc32(head)
    for part in parts:
        crc = zlib.crc32(part, crc)
    return [head, *parts, _CRC.pack(crc)]


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


def _call_parts(call: CallRecord) -> list:
    meta = _json_bytes(_meta_of(call))
    # Records are little-endian on disk; on a little-endian host these are views, not copies.
    arrays = [
        memoryview(np.ascontiguousarray(a, dtype=dt)).cast("B")
        for a, dt in ((call.prompt_ids, "<i4"), (call.output_ids, "<i4"), (call.infer_logprobs, "<f4"))
    ]
    if call.routing is not None:
        dt = "u1" if call.routing.dtype.itemsize == 1 else "<u2"
        arrays.append(memoryview(np.ascontiguousarray(call.routing, dtype=dt).reshape(-1)).cast("B"))
    return _frame_parts(_KIND_CALL, [struct.pack("<I", len(meta)), meta, *arrays])


def encode_call(call: CallRecord) -> bytes:
    """One call as a ``C`` frame (header and frame trailer included)."""
    return b"".join(_call_parts(call))


def encode_header(header: dict[str, Any]) -> bytes:
    return MAGIC + _frame(_KIND_HEADER, _json_bytes(header))


def encode_result(reward: float, status: str, info: dict[str, Any]) -> bytes:
    return _frame(_KIND_RESULT, _json_bytes({"reward": reward, "status": status, "info": info}))


def encode_rollout(rollout: RolloutResult) -> bytes:
    check_calls_of(rollout.rollout_id, rollout.calls)  # `calls` may have been set after construction
    parts = [encode_header(rollout.header())]
    parts += [encode_call(c) for c in rollout.calls]
    parts.append(encode_result(rollout.reward, rollout.status, rollout.info))
    return b"".join(parts)


def _decode_call(payload: bytes, offset: int) -> CallRecord:
    try:
        (meta_len,) = struct.unpack_from("<I", payload, 0)
        meta = json.loads(payload[4 : 4 + meta_len])
        n_p, n_o = int(meta["n_prompt"]), int(meta["n_output"])
        body = payload[4 + meta_len :]
        routing_meta = meta.get("routing")
        shape, dtype = (0, 0, 0), ROUTING_DTYPES["u1"]
        if routing_meta is not None:
            shape = tuple(int(routing_meta[k]) for k in ("rows", "layers", "top_k"))
            if routing_meta["dtype"] not in ROUTING_DTYPES or min(shape) < 1:
                raise RecordFormatError(f"call frame at byte {offset}: bad routing header {routing_meta}")
            dtype = ROUTING_DTYPES[routing_meta["dtype"]]
        n_routing = shape[0] * shape[1] * shape[2]
        if len(body) != 4 * (n_p + 2 * n_o) + dtype.itemsize * n_routing:
            raise RecordFormatError(
                f"call frame at byte {offset}: array bytes {len(body)} do not match {n_p} prompt and {n_o} output tokens"
                + (f" and routing of shape {list(shape)} {routing_meta['dtype']}" if routing_meta is not None else "")
            )
        arrays = np.frombuffer(body, dtype="<i4", count=n_p + n_o)
        logprobs = np.frombuffer(body, dtype="<f4", offset=4 * (n_p + n_o), count=n_o)
        routing = None
        if routing_meta is not None:
            routing = np.frombuffer(body, dtype=dtype, offset=4 * (n_p + 2 * n_o), count=n_routing)
            routing = routing.reshape(shape).astype(dtype.newbyteorder("="))
        return CallRecord(
            rollout_id=meta["rollout_id"],
            call_index=int(meta["call_index"]),
            harness=meta["harness"],
            prompt_ids=arrays[:n_p].astype(np.int32),
            output_ids=arrays[n_p:].astype(np.int32),
            infer_logprobs=logprobs.astype(np.float32),
            weight_version=int(meta["weight_version"]),
            finish_reason=meta["finish_reason"],
            timings=meta["timings"],
            tags=tuple(meta["tags"]),
            metadata=meta["metadata"],
            output_versions=versions_of_runs(meta["version_runs"], n_o) if "version_runs" in meta else None,
            routing=routing,
            routing_start=int(routing_meta["start"]) if routing_meta is not None else 0,
        )
    except RecordFormatError:
        raise
    except (KeyError, TypeError, struct.error, json.JSONDecodeError) as exc:
        raise RecordFormatError(f"call frame at byte {offset}: malformed ({exc})") from exc
    except ValueError as exc:
        raise RecordFormatError(f"call frame at byte {offset}: invalid record ({exc})") from exc


def _iter_frames(data: bytes, torn: dict[str, Any] | None) -> Iterator[tuple[int, bytes, int]]:
    """(kind, payload, offset) of each frame after the magic. A frame cut short or failing its checksum
    raises RecordFormatError when `torn` is None. Otherwise (recovery) it ends the reading, wherever it
    lies: `torn` gets its offset, the bytes dropped from there to the end and why, and no later frame is
    read. Its length cannot be trusted to find the next frame, and a crash leaves damage only at the end
    (a frame cut short, or, after a power loss, zeros or a frame's first bytes then zeros), so a good frame
    past a bad one is not a crash's tail: reading on would hide the damage."""
    pos = len(MAGIC)
    while pos < len(data):
        start = pos
        problem = None
        if pos + _FRAME_HEAD.size > len(data):
            problem = f"truncated frame header at byte {start}"
        else:
            kind, length = _FRAME_HEAD.unpack_from(data, pos)
            pos += _FRAME_HEAD.size
            end = pos + length + _CRC.size
            if end > len(data):
                problem = f"truncated frame at byte {start}: needs {length} payload bytes"
            else:
                payload = data[pos : pos + length]
                (crc,) = _CRC.unpack_from(data, pos + length)
                if crc != zlib.crc32(payload, zlib.crc32(data[start : start + _FRAME_HEAD.size])):
                    problem = f"checksum mismatch in frame at byte {start}"
        if problem is not None:
            if torn is None:
                raise RecordFormatError(problem)
            torn.update(at_byte=start, bytes=len(data) - start, reason=problem)
            return
        yield kind, payload, start
        pos = end


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _json_object(payload: bytes, what: str, offset: int) -> dict[str, Any]:
    """A header or result frame's JSON, which must be an object: any other JSON value (a list, a
    string, null) would fail later as an AttributeError, or pass for a missing frame."""
    try:
        value = json.loads(payload)
    except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
        raise RecordFormatError(f"{what} frame at byte {offset}: malformed JSON ({exc})") from None
    if not isinstance(value, dict):
        raise RecordFormatError(f"{what} frame at byte {offset}: {_JSON_KINDS[type(value)]}, not a JSON object")
    return value


def decode_rollout(data: bytes, *, recover: bool = False, source: str = "<bytes>") -> RolloutResult:
    """Decode one rollout file. With ``recover=True`` (crash recovery, a live log) reading stops at the
    first frame that is cut short or fails its checksum, wherever it lies: the frames before it are
    returned, it and everything after it are dropped (never skipped over to read later frames), and
    ``info["torn_tail"]`` says so: ``{"at_byte", "bytes" (dropped), "reason"}``. The rollout has status
    ``running`` if no result frame was read. A frame whose checksum holds but whose content is invalid
    raises in either mode: the writer wrote it so."""
    if not data.startswith(MAGIC):
        raise RecordFormatError(f"{source}: not a clawfast record file (bad magic)")
    header = None
    calls: list[CallRecord] = []
    result = None
    torn: dict[str, Any] | None = {} if recover else None
    try:
        for kind, payload, offset in _iter_frames(data, torn):
            if kind == _KIND_HEADER and header is None:
                header = _json_object(payload, "header", offset)
            elif kind == _KIND_CALL and header is not None and result is None:
                calls.append(_decode_call(payload, offset))
            elif kind == _KIND_RESULT and header is not None and result is None:
                result = _json_object(payload, "result", offset)
            else:
                raise RecordFormatError(f"unexpected frame {chr(kind)!r} at byte {offset}")
    except RecordFormatError as exc:
        raise RecordFormatError(f"{source}: {exc}") from None
    if header is None:
        raise RecordFormatError(f"{source}: no rollout header")
    if header.get("format_version") != FORMAT_VERSION:
        raise RecordFormatError(f"{source}: unsupported format version {header.get('format_version')}")
    if result is None and not recover:
        raise RecordFormatError(f"{source}: truncated: no result frame (pass recover=True to read a live log)")
    result = result or {"reward": 0.0, "status": "running", "info": {}}
    try:
        info = {**result["info"], "torn_tail": torn} if torn else result["info"]
        return RolloutResult(
            rollout_id=header["rollout_id"],
            task_id=header["task_id"],
            harness=header["harness"],
            sample_index=int(header["sample_index"]),
            reward=float(result["reward"]),
            status=result["status"],
            calls=calls,
            info=info,
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise RecordFormatError(f"{source}: invalid rollout ({exc})") from None


# ----------------------------------------------------------------------------------------------
# Files and directories


def rollout_path(directory: str | os.PathLike, rollout_id: str) -> Path:
    """``<directory>/<id>.cfr``, each character of the id but letters, digits and ``-_.`` written ``_``.
    Two ids can map to one path ('a/b', 'a_b', 'a:b'): the writers refuse the second rather than let it
    replace the first (`write_rollout`, `write_rollouts`; `RolloutLog` never replaces a file)."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in rollout_id)
    return Path(directory) / f"{safe}{FILE_SUFFIX}"


def _rollout_id_in(path: Path) -> Any:
    """The rollout id in the header frame of the file at `path`, or None if it holds no readable header.
    Reads the header alone: a file can hold gigabytes of calls after it."""
    with open(path, "rb") as fh:
        head = fh.read(len(MAGIC) + _FRAME_HEAD.size)
        if len(head) < len(MAGIC) + _FRAME_HEAD.size or not head.startswith(MAGIC):
            return None
        _, length = _FRAME_HEAD.unpack_from(head, len(MAGIC))
        # A header is a few hundred bytes; a damaged length must not make this read the whole file.
        rest = fh.read(min(length, 1 << 20) + _CRC.size)
    try:
        kind, payload, offset = next(_iter_frames(head + rest, None), (None, b"", 0))
        return _json_object(payload, "header", offset).get("rollout_id") if kind == _KIND_HEADER else None
    except RecordFormatError:
        return None


def write_rollout(path: str | os.PathLike, rollout: RolloutResult) -> Path:
    """Write one rollout atomically (temp file + rename) and return its path. A file already at `path`
    is replaced only if its header holds the same rollout id: two ids that `rollout_path` maps to one
    name must not silently overwrite each other (ValueError naming both)."""
    path = Path(path)
    if path.exists():
        held = _rollout_id_in(path)
        if held != rollout.rollout_id:
            holds = f"rollout {held!r}" if held is not None else "no readable rollout header"
            raise ValueError(f"{path} holds {holds}: not replacing it with rollout {rollout.rollout_id!r} "
                             f"(rollout ids that differ only in characters other than letters, digits "
                             f"and -_. map to one file name)")
    data = encode_rollout(rollout)  # before the temp file: a rollout that cannot be written leaves nothing
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def read_rollout(path: str | os.PathLike, *, recover: bool = False) -> RolloutResult:
    path = Path(path)
    return decode_rollout(path.read_bytes(), recover=recover, source=str(path))


def write_rollouts(directory: str | os.PathLike, rollouts: Iterable[RolloutResult]) -> list[Path]:
    """Write each rollout to `rollout_path` in `directory`. Raises ValueError, before writing any, if two
    of them map to one path (the same id twice, or ids that `rollout_path` writes alike), and, as
    `write_rollout` does, for a file already there that holds another rollout."""
    directory = Path(directory)
    rollouts = list(rollouts)
    paths = [rollout_path(directory, r.rollout_id) for r in rollouts]
    first_id: dict[Path, str] = {}
    for path, r in zip(paths, rollouts):
        if path in first_id:
            raise ValueError(f"rollouts {first_id[path]!r} and {r.rollout_id!r} both map to {path}")
        first_id[path] = r.rollout_id
    directory.mkdir(parents=True, exist_ok=True)
    return [write_rollout(path, r) for path, r in zip(paths, rollouts)]


def read_rollouts(directory: str | os.PathLike, *, recover: bool = False) -> list[RolloutResult]:
    """Every rollout file of a directory, sorted by file name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a directory of rollouts")
    return [read_rollout(p, recover=recover) for p in sorted(directory.glob(f"*{FILE_SUFFIX}"))]


def load_rollouts(path: str | os.PathLike, *, recover: bool = False) -> list[RolloutResult]:
    """A rollout file or a directory of them."""
    path = Path(path)
    return read_rollouts(path, recover=recover) if path.is_dir() else [read_rollout(path, recover=recover)]


class LogClosed(ValueError):
    """An append to a `RolloutLog` that is closed (its rollout ended while the call ran)."""


class RolloutLog:
    """Append-only log of one rollout, written as calls are answered so a crash loses nothing.

    Each append is flushed to the OS before it returns; `fsync=True` also forces it to disk.
    """

    def __init__(self, path: str | os.PathLike, header: dict[str, Any], *, fsync: bool = False) -> None:
        if "rollout_id" not in header:  # before the file is made: a reader could not tell whose it is
            raise ValueError(f"{path}: a rollout log's header needs a rollout_id, got keys {sorted(header)}")
        self.path = Path(path)
        self.rollout_id = header["rollout_id"]
        self._fsync = fsync
        self._fh = open(self.path, "xb")
        self._closed = False
        self._write(encode_header({"format_version": FORMAT_VERSION, **header}))

    def _write(self, *parts: bytes | memoryview) -> None:
        self._fh.writelines(parts)
        self._fh.flush()
        if self._fsync:
            os.fsync(self._fh.fileno())

    def append(self, call: CallRecord) -> None:
        if self._closed:
            raise LogClosed(f"{self.path}: log is closed")
        check_calls_of(self.rollout_id, [call])
        self._write(*_call_parts(call))

    def close(self, reward: float = 0.0, status: str = "ok", info: dict[str, Any] | None = None) -> None:
        if self._closed:
            return
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        reward, info = _as_float(reward, "reward"), info or {}
        problem = _json_dict_problem(info, "info")  # as `RolloutResult` checks it: the file reads back as one
        if problem:
            raise ValueError(f"{self.path}: {problem}")
        self._write(encode_result(reward, status, info))
        self._fh.close()
        self._closed = True

    def __enter__(self) -> "RolloutLog":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._closed:
            self._fh.close()
            self._closed = True
