"""The rollout registry: who may call the proxy, and where each answered call is written.

Synchronous and thread-safe, so the HTTP server (asyncio) and a gRPC service (thread pool) can share
one instance. The API:

    reg = RolloutRegistry("runs/records")
    opened = reg.open(task_id="t1", harness="claude-code",   # -> OpenedRollout(rollout_id, key, base_url)
                      sampling=Sampling(temperature=0.0))    # optional: what every call of it samples with
    rollout = reg.lookup(opened.key)                         # -> Rollout | None (None: unknown or closed)
    rollout.append(prompt_ids=..., output_ids=..., ...)      # -> CallRecord, written before it returns
    reg.records(opened.rollout_id, since=0)                  # -> list[CallRecord] captured so far
    result = reg.close(opened.rollout_id, reward=1.0)        # -> RolloutResult with every call

Each rollout has its own key (the harness sends it as ``x-api-key`` or ``Authorization: Bearer``) and
its own append-only `RolloutLog` file ``<records_dir>/<rollout_id>.cfr``; a call is appended (and
flushed) when it is answered, so a trainer crash loses nothing that was answered. Call indices are
allocated in one place (`Rollout.append`), in answer order, without gaps. A call's MoE routing
(`CallRecord.routing`) is stored less the leading rows its parent call holds alike
(`clawfast.routing_store`), so a conversation's shared prefix is stored once.

Refusals: a request whose key resolved to an open rollout and that the proxy then refused (budget
spent, prompt too long, template or body rejected, engine error, ...) is kept with that rollout
(`Rollout.refuse`, one `refusal` dict each) and written at close into the result frame's info, so
``result.info["refusals"]`` (returned by `close` and read back from the .cfr file) lists them in the
order they happened: the first `MAX_REFUSALS`, and ``info["refusals_dropped"]`` counts the rest. Both
keys are present only when there was a refusal. A generation cut off by `close` is one too
(``at_close: True``): its client is answered afterwards, when the rollout is gone.

Guaranteed: a closed or unknown key is never resolved to a rollout (the proxy answers 401 and writes
nothing: no record, no refusal); closing twice raises `KeyError`; closing cancels the rollout's
generations still in the engine (a killed harness's queued calls would otherwise hold the engine for
nothing); a call that finishes after its rollout closed is dropped, never written elsewhere; the
refusals kept per rollout are bounded (`MAX_REFUSALS`, each message cut to `MAX_REFUSAL_MESSAGE`
characters), so a harness's retry loop cannot grow memory. Not guaranteed: persistence of the
in-memory index across processes (the files are the durable copy;
`clawfast.records.read_rollout(..., recover=True)` reads a live or orphaned one); refusals of a
rollout whose process died before `close` (they are written only in the result frame, which such a
file lacks); a refusal that happens after `close` (the client of a generation that ended just as
the rollout closed: it is in the access log only).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from clawfast.engines.base import Sampling
from clawfast.records import CallRecord, RolloutLog, RolloutResult, rollout_path
from clawfast.routing_store import RolloutRouting, first_stored_row

MAX_REFUSALS = 100  # refusals kept per rollout; later ones are only counted
MAX_REFUSAL_MESSAGE = 2000  # characters of a refusal's message kept
CLOSED_WHILE_GENERATING = "the rollout was closed while this call was generating"
RETRIED_DIR = "retried"  # under the records directory: attempts set aside (`RolloutRegistry.set_aside`)


def refusal(status: int, error_type: str, message: str, *, protocol: str | None, path: str,
            stream: bool | None = None, t: float | None = None, **extra: Any) -> dict[str, Any]:
    """One refused request as a rollout keeps it (plain JSON). status: the error's HTTP status;
    error_type: its kind in the generic vocabulary of `clawfast.proxy.front.ProtocolError` (invalid_request,
    authentication, too_large, api_error, ...); protocol: ``anthropic`` | ``chat`` | ``responses``;
    path: the request's path; stream: whether it asked to stream (None: its body was not read as far);
    t: when it was refused (the entry's ``time``, epoch seconds; default: now). `extra`: ``in_stream: True`` when the 200 headers of a
    stream were already sent and the error went out as an event, ``at_close: True`` for a generation
    cut off by `RolloutRegistry.close`."""
    if len(message) > MAX_REFUSAL_MESSAGE:
        message = message[:MAX_REFUSAL_MESSAGE] + f"... ({len(message) - MAX_REFUSAL_MESSAGE} more characters)"
    entry = {"time": round(time.time() if t is None else t, 6), "protocol": protocol, "path": path,
             "stream": stream, "status": status, "error_type": error_type, "message": message}
    entry.update(extra)
    return entry


@dataclass(frozen=True)
class OpenedRollout:
    """What a harness needs: its key and where to send requests (in process or over gRPC)."""

    rollout_id: str
    key: str
    base_url: str  # the proxy's HTTP root, no /v1 (ANTHROPIC_BASE_URL); "" until a server has bound one

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url.rstrip('/')}/v1"


@dataclass
class Rollout:
    """One open rollout. `sampling`: what its caller asked every call to sample with. `state` is
    free for the proxy's per-rollout memory (rendering, tagging)."""

    rollout_id: str
    key: str
    task_id: str
    harness: str
    sample_index: int
    log: RolloutLog
    opened_at: float
    sampling: Sampling = field(default_factory=Sampling)
    calls: list[CallRecord] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    refusals: list[dict[str, Any]] = field(default_factory=list)  # the first MAX_REFUSALS
    refusals_dropped: int = 0  # refusals beyond those, counted only
    _closed: bool = False
    _calls_started: int = 0  # what the call budget counts (`start_call`)
    # each generation in flight -> the request facts of its refusal should `close` cut it off
    _generations: dict[asyncio.Task, dict[str, Any] | None] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _routing: RolloutRouting | None = None  # what its calls' routing rows hold, from its first call with any

    def track(self, generation: asyncio.Task, request: dict[str, Any] | None = None) -> None:
        """Remember a generation in flight for this rollout, so that `close` can cancel it. Call on the
        task's loop; a rollout already closed cancels it at once. `request`: the keyword arguments of
        `refusal` (protocol, path, stream) naming the call, kept as a refusal if `close` cuts it off
        (None: not kept)."""
        with self._lock:
            if not self._closed:
                self._generations[generation] = request
                generation.add_done_callback(self._forget)
                return
        generation.cancel()

    def refuse(self, entry: dict[str, Any]) -> bool:
        """Keep one refused request (a `refusal` dict), or only count it past `MAX_REFUSALS`. Returns
        False, keeping nothing, if the rollout is already closed (its result is written)."""
        with self._lock:
            if self._closed:
                return False
            self._keep_refusal(entry)
            return True

    def _keep_refusal(self, entry: dict[str, Any]) -> None:
        if len(self.refusals) < MAX_REFUSALS:
            self.refusals.append(entry)
        else:
            self.refusals_dropped += 1

    def calls_started(self) -> int:
        """Calls let through to the engine so far: answered, in flight, failed or cut off (what a call
        budget counts)."""
        with self._lock:
            return self._calls_started

    def start_call(self, budget: int | None) -> bool:
        """Count one more call unless `budget` (None: no limit) calls are counted already; False, and
        nothing counted, if so. Check and count are one step under the lock, and a counted call stays
        counted: a count made of answered calls plus generations in flight dips while a finished
        generation's record is on its way, and a call let through in that gap overran the budget."""
        with self._lock:
            if budget is not None and self._calls_started >= budget:
                return False
            self._calls_started += 1
            return True

    def unstart_call(self) -> None:
        """Take back a `start_call` whose call was refused before it reached the engine."""
        with self._lock:
            self._calls_started -= 1

    def _forget(self, generation: asyncio.Task) -> None:
        with self._lock:
            self._generations.pop(generation, None)

    def _cancel_generations(self) -> None:
        """Thread-safe: the tasks live on the server's loop, `close` may run on a gRPC worker thread.
        Each cut-off generation that names its request is kept as a refusal (``at_close``)."""
        with self._lock:
            self._closed = True
            pending, self._generations = self._generations, {}
            now = time.time()
            for task, request in pending.items():
                if request is not None and not task.done():
                    self._keep_refusal(refusal(401, "authentication", CLOSED_WHILE_GENERATING, t=now,
                                               at_close=True, **request))
        for task in pending:
            try:
                task.get_loop().call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the server's loop is closed: nothing of it runs any more
                pass

    def append(self, **fields: Any) -> CallRecord:
        """Build the next CallRecord (call_index and rollout_id filled in), write it, keep it. Its
        `routing` keeps only the rows from the first one its parent call does not hold alike
        (`clawfast.routing_store.first_stored_row`)."""
        with self._lock:
            record = CallRecord(rollout_id=self.rollout_id, call_index=len(self.calls), harness=self.harness, **fields)
            if record.routing is not None and self._routing is None:
                self._routing = RolloutRouting([c.path for c in self.calls])
            if self._routing is not None:
                record = self._store_new_rows(record)
            self.log.append(record)
            self.calls.append(record)
            return record

    def _store_new_rows(self, record: CallRecord) -> CallRecord:
        """`record` with only the routing rows its parent call does not hold alike."""
        path = record.path
        inherited = self._routing.inherited(path)
        if record.routing is not None:
            start, rows = record.routing_start, len(record.routing)
            first = first_stored_row(self._routing, inherited, record.routing, start)
            if first > start:  # a copy, so the engine's whole array is not kept alive
                kept = record.routing[first - start:].copy() if first < start + rows else None
                record = replace(record, routing=kept, routing_start=first if kept is not None else 0)
        self._routing.add(path, record.routing, record.routing_start, inherited=inherited)
        return record


class RolloutRegistry:
    """default_sampling: the `Sampling` of a rollout opened without one (e.g. over gRPC)."""

    def __init__(self, records_dir: str | Path, *, fsync: bool = False, base_url: str = "",
                 default_sampling: Sampling | None = None) -> None:
        self.records_dir = Path(records_dir)
        self.default_sampling = default_sampling or Sampling()
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.base_url = base_url
        self._fsync = fsync
        self._by_key: dict[str, Rollout] = {}
        self._by_id: dict[str, Rollout] = {}
        self._lock = threading.Lock()

    def open(
        self,
        rollout_id: str | None = None,
        *,
        task_id: str = "",
        harness: str = "",
        sample_index: int = 0,
        key: str | None = None,
        sampling: Sampling | None = None,
    ) -> OpenedRollout:
        """Start a rollout: create its log file and mint its key; `sampling` applies to each of its
        calls (None: `default_sampling`). Raises ValueError if the id is already open or its file
        exists."""
        rollout_id = rollout_id or f"r-{secrets.token_hex(8)}"
        key = key or f"cf-{secrets.token_urlsafe(24)}"
        with self._lock:
            if rollout_id in self._by_id:
                raise ValueError(f"rollout {rollout_id!r} is already open")
            if key in self._by_key:
                raise ValueError("that key is already in use")
            path = rollout_path(self.records_dir, rollout_id)
            try:
                log = RolloutLog(
                    path,
                    {"rollout_id": rollout_id, "task_id": task_id, "harness": harness, "sample_index": sample_index},
                    fsync=self._fsync,
                )
            except FileExistsError:
                raise ValueError(f"{path} already exists: rollout ids must be unique per records directory") from None
            rollout = Rollout(rollout_id, key, task_id, harness, sample_index, log, time.time(),
                              sampling or self.default_sampling)
            self._by_key[key] = rollout
            self._by_id[rollout_id] = rollout
        return OpenedRollout(rollout_id, key, self.base_url)

    def lookup(self, key: str | None) -> Rollout | None:
        """The open rollout that owns `key`, or None."""
        if not key:
            return None
        return self._by_key.get(key)

    def get(self, rollout_id: str) -> Rollout:
        with self._lock:
            try:
                return self._by_id[rollout_id]
            except KeyError:
                raise KeyError(f"no open rollout {rollout_id!r}") from None

    def records(self, rollout_id: str, since: int = 0) -> list[CallRecord]:
        """Calls of an open rollout with call_index >= since, in call order."""
        rollout = self.get(rollout_id)
        with rollout._lock:
            return rollout.calls[since:]

    def open_ids(self) -> list[str]:
        with self._lock:
            return list(self._by_id)

    def close(
        self, rollout_id: str, *, reward: float = 0.0, status: str = "ok", info: dict[str, Any] | None = None
    ) -> RolloutResult:
        """Revoke the key, cancel the rollout's generations in flight, write the result frame and return
        the rollout with all its calls. A call whose generation already ended is still appended to the
        in-memory list if it does so before the log closes, and is otherwise dropped (the log is closed
        under the rollout's lock). The result's info (returned and written) is `info` plus, if any
        request of the rollout was refused, ``"refusals"`` and ``"refusals_dropped"`` (the proxy's
        own, replacing keys of those names in `info`; `info` itself is not changed). A result no record
        can hold (an unknown status, a reward that is no finite number, info that would not read back)
        is a ValueError, and the rollout stays open."""
        with self._lock:
            rollout = self._by_id.get(rollout_id)
            if rollout is None:
                raise KeyError(f"no open rollout {rollout_id!r}")
            # Built before the rollout is taken out: a result no record can hold (an unknown status, a
            # reward that is no finite number, info that would not read back) is a ValueError and leaves
            # it open.
            result = RolloutResult(
                rollout_id=rollout_id,
                task_id=rollout.task_id,
                harness=rollout.harness,
                sample_index=rollout.sample_index,
                reward=reward,
                status=status,
                info=dict(info or {}),
            )
            del self._by_id[rollout_id]
            self._by_key.pop(rollout.key, None)
        rollout._cancel_generations()
        with rollout._lock:  # closed now: no refusal is added any more
            if rollout.refusals or rollout.refusals_dropped:
                result.info["refusals"] = list(rollout.refusals)
                result.info["refusals_dropped"] = rollout.refusals_dropped
            rollout.log.close(reward=result.reward, status=status, info=result.info)
            result.calls = list(rollout.calls)
        return result

    def set_aside(self, rollout_id: str) -> Path:
        """Move a closed rollout's file to ``<records_dir>/retried/``, where no reader of the records
        directory (a trainer, `clawfast.train.data.RecordedRollouts`) takes it for a rollout of its
        task: an attempt that an infrastructure failure ended and that runs again
        (`clawfast.rollout.retry`). Returns the new path."""
        with self._lock:
            if rollout_id in self._by_id:
                raise ValueError(f"rollout {rollout_id!r} is still open: close it before setting it aside")
        path = rollout_path(self.records_dir, rollout_id)
        aside = self.records_dir / RETRIED_DIR
        aside.mkdir(exist_ok=True)
        return path.rename(aside / path.name)

    def close_all(self, status: str = "proxy_error") -> None:
        """Close every open rollout (server shutdown), marking them with `status`."""
        for rollout_id in self.open_ids():
            try:
                self.close(rollout_id, status=status, info={"reason": "proxy shut down"})
            except KeyError:
                pass
