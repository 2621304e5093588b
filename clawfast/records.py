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

Guaranteed: lossless round trip of every field (arrays bit for bit); a truncated or corrupted file
raises `RecordFormatError` naming the byte offset, unless the caller asks to keep the complete frames
before a torn tail (crash recovery). Not guaranteed: concurrent writers to one file (one writer per
rollout; the proxy serialises appends).
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
        if not math.isfinite(self.reward):
            raise ValueError(f"rollout {self.rollout_id!r}: non-finite reward {self.reward}")

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


def _iter_frames(data: bytes, recover: bool) -> Iterator[tuple[int, bytes, int]]:
    pos = len(MAGIC)
    while pos < len(data):
        start = pos
        if pos + _FRAME_HEAD.size > len(data):
            if recover:
                return
            raise RecordFormatError(f"truncated frame header at byte {start}")
        kind, length = _FRAME_HEAD.unpack_from(data, pos)
        pos += _FRAME_HEAD.size
        end = pos + length + _CRC.size
        if end > len(data):
            if recover:
                return
            raise RecordFormatError(f"truncated frame at byte {start}: needs {length} payload bytes")
        payload = data[pos : pos + length]
        (crc,) = _CRC.unpack_from(data, pos + length)
        if crc != zlib.crc32(payload, zlib.crc32(data[start : start + _FRAME_HEAD.size])):
            if recover and end == len(data):
                return
            raise RecordFormatError(f"checksum mismatch in frame at byte {start}")
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
    """Decode one rollout file. With ``recover=True`` a torn tail (the writer died mid-append) is
    dropped and the rollout is returned with status ``running`` if no result frame was written."""
    if not data.startswith(MAGIC):
        raise RecordFormatError(f"{source}: not a clawfast record file (bad magic)")
    header = None
    calls: list[CallRecord] = []
    result = None
    try:
        for kind, payload, offset in _iter_frames(data, recover):
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
        return RolloutResult(
            rollout_id=header["rollout_id"],
            task_id=header["task_id"],
            harness=header["harness"],
            sample_index=int(header["sample_index"]),
            reward=float(result["reward"]),
            status=result["status"],
            calls=calls,
            info=result["info"],
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise RecordFormatError(f"{source}: invalid rollout ({exc})") from None


# ----------------------------------------------------------------------------------------------
# Files and directories


def rollout_path(directory: str | os.PathLike, rollout_id: str) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in rollout_id)
    return Path(directory) / f"{safe}{FILE_SUFFIX}"


def write_rollout(path: str | os.PathLike, rollout: RolloutResult) -> Path:
    """Write one rollout atomically (temp file + rename) and return its path."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(encode_rollout(rollout))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def read_rollout(path: str | os.PathLike, *, recover: bool = False) -> RolloutResult:
    path = Path(path)
    return decode_rollout(path.read_bytes(), recover=recover, source=str(path))


def write_rollouts(directory: str | os.PathLike, rollouts: Iterable[RolloutResult]) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return [write_rollout(rollout_path(directory, r.rollout_id), r) for r in rollouts]


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


class RolloutLog:
    """Append-only log of one rollout, written as calls are answered so a crash loses nothing.

    Each append is flushed to the OS before it returns; `fsync=True` also forces it to disk.
    """

    def __init__(self, path: str | os.PathLike, header: dict[str, Any], *, fsync: bool = False) -> None:
        self.path = Path(path)
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
            raise ValueError(f"{self.path}: log is closed")
        self._write(*_call_parts(call))

    def close(self, reward: float = 0.0, status: str = "ok", info: dict[str, Any] | None = None) -> None:
        if self._closed:
            return
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        self._write(encode_result(float(reward), status, info or {}))
        self._fh.close()
        self._closed = True

    def __enter__(self) -> "RolloutLog":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._closed:
            self._fh.close()
            self._closed = True
