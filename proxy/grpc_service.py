"""The proxy's gRPC control plane: the trainer opens and closes rollouts and pulls their records.

`GrpcControlServer(registry, token, ...)` serves ``clawfast.proxy.v1.RolloutControl`` (see
``clawfast_proxy.proto``) next to the HTTP fronts, over the same `RolloutRegistry`:

- OpenRollout -> rollout id, the harness's key, and the Anthropic (no ``/v1``) and OpenAI (``/v1``)
  base URLs of the HTTP server that the registry was bound to.
- CloseRollout -> the rollout in the on-disk record format (`records.encode_rollout`), never pickle.
- StreamRecords -> one `records.encode_call` frame per answered call, for one rollout or for all.
- Stats, Health.

Every call must carry ``authorization: Bearer <token>``; a missing or wrong token is UNAUTHENTICATED
(compared in constant time). Bad arguments are INVALID_ARGUMENT, unknown rollouts NOT_FOUND.

Guaranteed: a stream of one rollout yields each of its calls exactly once, in call order, and ends
after the rollout is closed, with every call it captured: calls answered after the stream's last look
at the registry are read back from the rollout's log file, which the registry closes only after the
last append. Streams look at the registry every `poll_s` seconds (default 0.05), so a record
arrives at most that late (the registry has no subscription hook to wake them). A stream of all
rollouts sees every rollout opened through OpenRollout after it started, from its first call, and
every call of a rollout it has seen; a rollout opened directly on the registry (``clawfast proxy
serve``'s manual one) is seen only if it is still open at one of the stream's polls; a rollout that
was already open when the stream began counts as seen. The service keeps the id of every rollout
opened through it for its lifetime (one short string each) for that purpose.
Not guaranteed: Stats is a snapshot taken without stopping the proxy and counts only rollouts closed
through this service (not ones closed at server shutdown); TLS (bind to loopback or put the port
behind a tunnel: the token is sent in clear).
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc

from clawfast import records
from clawfast.proxy import clawfast_proxy_pb2 as pb
from clawfast.proxy import clawfast_proxy_pb2_grpc as pb_grpc
from clawfast.proxy.rollouts import RolloutRegistry

# A closed rollout carries every call's prompt; long agent runs reach tens of MB.
MAX_MESSAGE_BYTES = 1 << 30
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
CLOSE_STATUSES = tuple(s for s in records.STATUSES if s != "running")


class _TokenAuth(grpc.ServerInterceptor):
    """Rejects every call whose metadata lacks ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(sent.encode(), self._expected):
            return continuation(details)
        handler = continuation(details)

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        def deny_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            deny(request, context)
            yield  # pragma: no cover - abort raises

        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                deny_stream, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            deny,
            handler.request_deserializer if handler else None,
            handler.response_serializer if handler else None,
        )


class RolloutControlService(pb_grpc.RolloutControlServicer):
    """The servicer; `GrpcControlServer` owns the sockets and threads."""

    def __init__(self, registry: RolloutRegistry, *, engine: Any = None, poll_s: float = 0.05) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.registry = registry
        self.engine = engine
        self.poll_s = poll_s
        self.started = time.time()
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        # Every rollout opened through OpenRollout, in order (append-only): an all-rollouts stream
        # reads it so that a rollout opened and closed between two of its polls is not missed.
        self._opened: list[str] = []
        # Totals of rollouts closed through CloseRollout: changed only in _count_closed.
        self._closed = 0
        self._closed_calls = 0
        self._closed_prompt = 0
        self._closed_output = 0

    # -- rollouts ---------------------------------------------------------------------------------

    def OpenRollout(self, request: pb.OpenRolloutRequest, context: grpc.ServicerContext) -> pb.OpenRolloutReply:
        if request.sample_index < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sample_index must be >= 0, got {request.sample_index}")
        base_url = self.registry.base_url.rstrip("/")
        if not base_url:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the proxy's HTTP server is not bound yet")
        try:
            opened = self.registry.open(
                task_id=request.task_id, harness=request.harness, sample_index=request.sample_index
            )
        except ValueError as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        with self._lock:
            self._opened.append(opened.rollout_id)
        return pb.OpenRolloutReply(
            rollout_id=opened.rollout_id,
            key=opened.key,
            anthropic_base_url=base_url,
            openai_base_url=f"{base_url}/v1",
        )

    def CloseRollout(self, request: pb.CloseRolloutRequest, context: grpc.ServicerContext) -> pb.CloseRolloutReply:
        # What a caller may ask (a closing status, an info object) is checked here; what no record can
        # hold (a reward or info that would not read back: NaN, 1e999) the registry refuses before it
        # takes the rollout out, leaving it open for a corrected close.
        status = request.status or "ok"
        if status not in CLOSE_STATUSES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"status {status!r} is not one of {CLOSE_STATUSES}")
        try:
            info = json.loads(request.info_json) if request.info_json else {}
        except json.JSONDecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"info_json is not JSON: {exc}")
        if not isinstance(info, dict):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "info_json must be a JSON object")
        try:
            result = self.registry.close(request.rollout_id, reward=request.reward, status=status, info=info)
        except KeyError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no open rollout {request.rollout_id!r}")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._count_closed(result)
        return pb.CloseRolloutReply(rollout=records.encode_rollout(result), num_calls=len(result.calls))

    def _count_closed(self, result: records.RolloutResult) -> None:
        with self._lock:
            self._closed += 1
            self._closed_calls += len(result.calls)
            self._closed_prompt += sum(len(c.prompt_ids) for c in result.calls)
            self._closed_output += sum(len(c.output_ids) for c in result.calls)

    # -- records ----------------------------------------------------------------------------------

    def StreamRecords(
        self, request: pb.StreamRecordsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.CallRecordFrame]:
        if request.rollout_id:
            try:
                current = len(self.registry.records(request.rollout_id))  # KeyError if not open
                since = 0 if request.include_past else current
            except KeyError:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no open rollout {request.rollout_id!r}")
            cursors = {request.rollout_id: since}
            follow_new = False
        else:
            with self._lock:
                journal = len(self._opened)
            cursors = {
                rid: 0 if request.include_past else self._count(rid) for rid in self.registry.open_ids()
            }
            follow_new = True
        while context.is_active() and not self.stopping.is_set():
            if follow_new:
                with self._lock:
                    new_ids, journal = self._opened[journal:], len(self._opened)
                for rid in new_ids + self.registry.open_ids():
                    cursors.setdefault(rid, 0)
            for rid in list(cursors):
                calls, closed = self._calls_since(rid, cursors[rid])
                for call in calls:
                    yield pb.CallRecordFrame(
                        rollout_id=rid, call_index=call.call_index, record=records.encode_call(call)
                    )
                cursors[rid] += len(calls)
                if closed:
                    del cursors[rid]
            if not cursors and not follow_new:
                return
            self.stopping.wait(self.poll_s)

    def _count(self, rollout_id: str) -> int:
        try:
            return len(self.registry.records(rollout_id))
        except KeyError:  # closed in between
            return 0

    def _calls_since(self, rollout_id: str, since: int) -> tuple[list[records.CallRecord], bool]:
        """(calls with index >= since, whether the rollout is closed). A closed rollout's remaining
        calls come from its log file, which holds every call that was appended."""
        try:
            return self.registry.records(rollout_id, since), False
        except KeyError:
            pass
        path = records.rollout_path(self.registry.records_dir, rollout_id)
        try:
            return records.read_rollout(path, recover=True).calls[since:], True
        except FileNotFoundError:
            return [], True

    # -- status -----------------------------------------------------------------------------------

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        open_ids = self.registry.open_ids()
        calls = prompt = output = 0
        for rid in open_ids:
            try:
                live = self.registry.records(rid)
            except KeyError:
                continue
            calls += len(live)
            prompt += sum(len(c.prompt_ids) for c in live)
            output += sum(len(c.output_ids) for c in live)
        with self._lock:
            return pb.StatsReply(
                open_rollouts=len(open_ids),
                closed_rollouts=self._closed,
                calls=calls + self._closed_calls,
                prompt_tokens=prompt + self._closed_prompt,
                output_tokens=output + self._closed_output,
                weight_version=self._weight_version(),
                uptime_s=time.time() - self.started,
            )

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        from clawfast import __version__

        return pb.HealthReply(
            ok=not self.stopping.is_set(),
            engine=type(self.engine).__name__ if self.engine is not None else "",
            weight_version=self._weight_version(),
            version=__version__,
        )

    def _weight_version(self) -> int:
        return int(getattr(self.engine, "weight_version", 0) or 0)


class GrpcControlServer:
    """A gRPC server on a thread pool serving `RolloutControlService`. Use as a context manager.

    Each open StreamRecords holds one worker thread while it lasts, so ``max_workers`` bounds
    concurrent streams plus in-flight unary calls. ``port=0`` picks a free port; `address` is
    ``host:port`` once started.
    """

    def __init__(
        self,
        registry: RolloutRegistry,
        token: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        engine: Any = None,
        max_workers: int = 32,
        poll_s: float = 0.05,
    ) -> None:
        if not token:
            raise ValueError("the gRPC control plane needs a non-empty shared token")
        self.service = RolloutControlService(registry, engine=engine, poll_s=poll_s)
        self.host = host
        self.port = port
        self._token = token
        self._max_workers = max_workers
        self._server: grpc.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "GrpcControlServer":
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="clawfast-grpc"),
            interceptors=[_TokenAuth(self._token)],
            options=GRPC_OPTIONS,
        )
        pb_grpc.add_RolloutControlServicer_to_server(self.service, server)
        # IPv6 literals need brackets in a gRPC target.
        host = f"[{self.host}]" if ":" in self.host else self.host
        bound = server.add_insecure_port(f"{host}:{self.port}")
        if bound == 0:
            raise OSError(f"cannot bind the gRPC control plane to {self.host}:{self.port}")
        self.port = bound
        server.start()
        self._server = server
        return self

    def stop(self, grace: float = 2.0) -> None:
        """End open streams, then stop (waiting up to `grace` seconds for unary calls)."""
        self.service.stopping.set()
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None

    def __enter__(self) -> "GrpcControlServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
