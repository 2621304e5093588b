"""Client of the proxy's gRPC control plane, for workers outside the proxy's process.

    with ControlClient("127.0.0.1:50051", token) as client:
        opened = client.open_rollout("task-1", "claude-code", sample_index=0)
        ... run the harness against opened.base_url (or opened.openai_base_url) with opened.key ...
        result = client.close_rollout(opened.rollout_id, reward=1.0)   # -> records.RolloutResult

Records arrive in the on-disk record format and are decoded with `clawfast.records` (CRC-checked).
Server errors become Python exceptions: UNAUTHENTICATED -> PermissionError, NOT_FOUND -> KeyError,
INVALID_ARGUMENT / ALREADY_EXISTS / FAILED_PRECONDITION -> ValueError; anything else stays a
`grpc.RpcError`. The client is thread-safe (one channel, shared by all threads); asyncio callers can
use ``asyncio.to_thread``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import grpc

from clawfast import records
from clawfast.proxy import clawfast_proxy_pb2 as pb
from clawfast.proxy import clawfast_proxy_pb2_grpc as pb_grpc
from clawfast.proxy.grpc_service import GRPC_OPTIONS
from clawfast.proxy.rollouts import OpenedRollout

_T = TypeVar("_T")

_ERRORS: dict[grpc.StatusCode, type[Exception]] = {
    grpc.StatusCode.UNAUTHENTICATED: PermissionError,
    grpc.StatusCode.NOT_FOUND: KeyError,
    grpc.StatusCode.INVALID_ARGUMENT: ValueError,
    grpc.StatusCode.ALREADY_EXISTS: ValueError,
    grpc.StatusCode.FAILED_PRECONDITION: ValueError,
}


@dataclass(frozen=True)
class ProxyStats:
    open_rollouts: int
    closed_rollouts: int
    calls: int
    prompt_tokens: int
    output_tokens: int
    weight_version: int
    uptime_s: float


@dataclass(frozen=True)
class ProxyHealth:
    ok: bool
    engine: str
    weight_version: int
    version: str


def decode_call_frame(frame: bytes, rollout_id: str) -> records.CallRecord:
    """Decode one `records.encode_call` frame (CRC-checked) of the rollout `rollout_id`, via the public
    rollout decoder: a header frame in front makes it a live rollout file (a call of another rollout
    is a RecordFormatError)."""
    header = {
        "format_version": records.FORMAT_VERSION,
        "rollout_id": rollout_id,
        "task_id": "",
        "harness": "",
        "sample_index": 0,
    }
    rollout = records.decode_rollout(records.encode_header(header) + frame, recover=True, source="stream frame")
    if len(rollout.calls) != 1:
        raise records.RecordFormatError(f"stream frame held {len(rollout.calls)} complete calls, expected 1")
    return rollout.calls[0]


def _translate(fn: Callable[..., _T]) -> Callable[..., _T]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as exc:
            err = _as_python_error(exc)
            if err is exc:
                raise
            raise err from exc

    return wrapper


def _as_python_error(exc: grpc.RpcError) -> Exception:
    """The Python exception for a status code we map, else `exc` itself."""
    code = exc.code() if hasattr(exc, "code") else None
    kind = _ERRORS.get(code)
    if kind is None:
        return exc
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return kind(f"{code.name}: {details}")


class RecordStream:
    """Iterator of `CallRecord`s from StreamRecords; `cancel()` (or leaving the ``with`` block) ends it."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[records.CallRecord]:
        try:
            for frame in self._call:
                yield decode_call_frame(frame.record, frame.rollout_id)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return
            err = _as_python_error(exc)
            if err is exc:
                raise
            raise err from exc

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> "RecordStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()


class ControlClient:
    """Talks to `GrpcControlServer` at ``address`` (``host:port``) with the shared ``token``."""

    def __init__(self, address: str, token: str, *, timeout: float = 60.0) -> None:
        if not token:
            raise ValueError("ControlClient needs the proxy's shared token")
        self.address = address
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = pb_grpc.RolloutControlStub(self._channel)

    @_translate
    def open_rollout(self, task_id: str, harness: str, sample_index: int = 0) -> OpenedRollout:
        reply = self._stub.OpenRollout(
            pb.OpenRolloutRequest(task_id=task_id, harness=harness, sample_index=sample_index),
            metadata=self._metadata,
            timeout=self.timeout,
        )
        return OpenedRollout(reply.rollout_id, reply.key, reply.anthropic_base_url)

    @_translate
    def close_rollout(
        self, rollout_id: str, *, reward: float = 0.0, status: str = "ok", info: dict[str, Any] | None = None
    ) -> records.RolloutResult:
        reply = self._stub.CloseRollout(
            pb.CloseRolloutRequest(
                rollout_id=rollout_id, reward=reward, status=status, info_json=json.dumps(info or {})
            ),
            metadata=self._metadata,
            timeout=self.timeout,
        )
        result = records.decode_rollout(reply.rollout, source=f"CloseRollout({rollout_id})")
        if len(result.calls) != reply.num_calls:
            raise records.RecordFormatError(f"CloseRollout({rollout_id}): {len(result.calls)} calls decoded, {reply.num_calls} sent")
        return result

    def stream_records(self, rollout_id: str = "", *, include_past: bool = True) -> RecordStream:
        """Calls of one rollout (ends when it closes) or of every rollout (until cancelled)."""
        call = self._stub.StreamRecords(
            pb.StreamRecordsRequest(rollout_id=rollout_id, include_past=include_past), metadata=self._metadata
        )
        return RecordStream(call)

    @_translate
    def stats(self) -> ProxyStats:
        r = self._stub.Stats(pb.StatsRequest(), metadata=self._metadata, timeout=self.timeout)
        return ProxyStats(
            r.open_rollouts, r.closed_rollouts, r.calls, r.prompt_tokens, r.output_tokens, r.weight_version, r.uptime_s
        )

    @_translate
    def health(self) -> ProxyHealth:
        r = self._stub.Health(pb.HealthRequest(), metadata=self._metadata, timeout=self.timeout)
        return ProxyHealth(r.ok, r.engine, r.weight_version, r.version)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
