"""The proxy core: canonical request -> prompt ids -> engine -> parsed turn -> CallRecord.

No sockets here: `prepare` (tag, render) and `complete` (parse, record, remember the produced turn)
are synchronous, `start` wraps the engine call in a tracked task. The HTTP server drives them; tests
can too.

Guaranteed: every answered call is appended to its rollout's log before its last bytes are sent and
after its reply is built (`answer`, then `complete`), so a reply that cannot be built leaves no record; a
call whose client went away is still recorded once generation ends, with
``metadata["client_disconnected"] = True``; generation tasks are tracked and `drain` waits for them,
so none outlives the server. Malformed tool-call text never fails a call: it is answered as text and
recorded in ``metadata["parse_error"]``. Every record's ``metadata["http_status"]`` is the HTTP status
the call was answered with: 200 (also a stream's: its 200 headers go out before the record is written
or just after it), or None for a call whose client left before any response was sent. A call that is
not answered (refused, engine failure, also one that fails after a stream's 200 headers went out) has
no record: the server keeps it as a refusal of its rollout (`clawfast.proxy.rollouts.refusal`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from jinja2 import TemplateError

from clawfast.engines.base import Engine, Generation, SamplingParams
from clawfast.proxy.canonical import Conversation, Request, Turn
from clawfast.proxy.front import Answer, Front, ProtocolError
from clawfast.proxy.parsers import detect_parser, first_call_end, get_parser, opens_reasoning, parse_answer
from clawfast.proxy.render import ChatRenderer, RenderedPrompt, RolloutPrompts
from clawfast.proxy.rollouts import Rollout
from clawfast.proxy.stops import before_stop, cut_at_stop, cut_where
from clawfast.proxy.tagging import Tagging, classify
from clawfast.records import CallRecord, LogClosed
from clawfast.serving import ProxyConfig  # defined below the proxy: the trainer writes one too

log = logging.getLogger(__name__)

HEADERS_KEPT = (
    "x-claude-code-session-id",
    "x-claude-code-agent-id",
    "x-claude-code-parent-agent-id",
    "anthropic-beta",
    "user-agent",
    "x-codex-turn-metadata",  # names a compaction request ("request_kind")
    "x-codex-window-id",  # its suffix counts the context windows of a session
)


@dataclass
class PreparedCall:
    rollout: Rollout
    front: Front
    request: Request
    prompt: RenderedPrompt
    params: SamplingParams
    tagging: Tagging
    answer: Answer
    headers: dict[str, str]
    t_received: float
    t_rendered: float
    path: str = ""  # the HTTP path it came on (for refusals)
    # The request's prefill or a forced tool call's opening (`ProxyCore.prefill_text`): the end of
    # `prompt.ids`, and the start of the answer's text and of the turn later prompts replay.
    prefill_text: str = ""
    prefill: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    turn: Turn | None = None  # the whole answer, prefill included (`answer.turn`: what the reply holds)
    committed: bool = False
    extra_metadata: dict[str, Any] = field(default_factory=dict)


def _after_prefill(turn: Turn, prefill: str) -> Turn:
    """What a reply holds of `turn`: its text past the request's prefill, which the caller wrote (the
    whole turn where its text does not start with the prefill: one that opened reasoning)."""
    head = prefill.lstrip()  # as the parsed text, stripped
    if not head or not turn.content.startswith(head):
        return turn
    return dataclasses.replace(turn, content=turn.content[len(head):])


def _rollout_prompts(rollout: Rollout) -> RolloutPrompts:
    prompts = rollout.state.get("prompts")
    if prompts is None:
        prompts = rollout.state.setdefault("prompts", RolloutPrompts())
    return prompts


class ProxyCore:
    def __init__(self, engine: Engine, renderer: ChatRenderer, config: ProxyConfig | None = None) -> None:
        self.engine = engine
        self.renderer = renderer
        self.config = config or ProxyConfig()
        self.served_context = self.config.served_context(engine.max_model_len)
        vocab = renderer.tokenizer.get_vocab()
        self.parser_name = self.config.parser or detect_parser(vocab)
        self._parse = get_parser(self.parser_name)
        self.reasoning_open = opens_reasoning(renderer.generation_prompt)
        self._pending: set[asyncio.Task] = set()

    # -- rendering -------------------------------------------------------------------------------

    def _render(self, rollout: Rollout, conversation: Conversation, thread: str) -> RenderedPrompt:
        try:
            return _rollout_prompts(rollout).render(self.renderer, conversation, thread)
        except TemplateError as exc:  # the model's own template refused this conversation's shape
            message = f"the chat template rejected the conversation: {exc}"
            raise ProtocolError(400, "invalid_request", message) from None

    def count_tokens(self, rollout: Rollout, request: Request) -> int:
        """The length in tokens of the prompt `request` would be given, its prefill included;
        ProtocolError (400) if the chat template rejects it or it could not be answered
        (`prefill_text`)."""
        prefill = self.prefill_text(request)
        prefilled = len(self.renderer.encode(prefill)) if prefill else 0
        return len(self._render(rollout, request.conversation, "count").ids) + prefilled

    def prefill_text(self, request: Request) -> str:
        """What the answer starts with, written after the generation prompt: the request's prefill,
        or the opening of the tool call its tool choice forces, in this model's markup
        (`ChatRenderer.tool_call_opening`). ProtocolError (400) where the template writes no opening
        to force, and for a prefill with a forced call (the prefill's text would come before the call,
        which not every markup parses)."""
        choice = request.tool_choice
        if choice.mode not in ("required", "tool"):
            return request.prefill
        if request.prefill:
            raise ProtocolError(400, "invalid_request", "a prefill (a final assistant message) and a tool_choice that "
                                "forces a tool call cannot be combined", "tool_choice")
        opening = self.renderer.tool_call_opening(choice.name)
        if opening is None:
            raise ProtocolError(400, "invalid_request", f"tool_choice {choice.mode!r} cannot be forced for this "
                                "model: its chat template writes no tool call that opens with the tool's name "
                                "before its arguments", "tool_choice")
        return opening

    def prepare(self, front: Front, rollout: Rollout, request: Request, headers: dict[str, str],
                path: str = "") -> PreparedCall:
        """Check the rollout's budget, tag and render the call, bound its output; ProtocolError (400)
        if it is refused. A call that passes the budget check counts against it from then on, unless
        this refuses it for another reason (the engine never sees it)."""
        t0 = time.time()
        budget = rollout.sampling.max_calls
        if not rollout.start_call(budget):
            raise ProtocolError(400, "invalid_request", f"this rollout's budget of {budget} model calls is spent")
        try:
            return self._prepare(front, rollout, request, headers, path, t0)
        except BaseException:
            rollout.unstart_call()
            raise

    def _prepare(self, front: Front, rollout: Rollout, request: Request, headers: dict[str, str], path: str,
                 t0: float) -> PreparedCall:
        cfg, asked = self.config, rollout.sampling
        main_tools = rollout.state.get("main_tools")
        tagging = classify(request.conversation, headers, request.max_tokens, main_tools)
        if tagging.tag == "main" and main_tools is None and request.conversation.tools:
            rollout.state["main_tools"] = frozenset(t.name for t in request.conversation.tools)
        prompt = self._render(rollout, request.conversation, tagging.thread)
        prefill_text = self.prefill_text(request)
        prefill = self.renderer.encode(prefill_text) if prefill_text else np.zeros(0, np.int32)
        if prefill_text:
            prompt = RenderedPrompt(np.concatenate([prompt.ids, prefill]), prompt.spliced_turns)
        cap = cfg.max_tokens_cap
        if self.served_context is not None:
            room = self.served_context - len(prompt.ids)
            if room < 1:
                # Each front words this as its API does, so a harness handles it as it would a real
                # model's context overflow (Claude Code and OpenClaw compact and retry, Codex stops).
                raise ProtocolError(
                    400, "context_length",
                    f"prompt is too long: {len(prompt.ids)} tokens > {self.served_context - 1} maximum",
                    front.conversation_field,
                )
            cap = min(cap, room)
        # What the rollout's caller asked for wins over what the harness asks for (`Sampling.params`).
        params = asked.params(cap=cap, default_max_tokens=cfg.default_max_tokens, max_tokens=request.max_tokens,
                              temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                              stop_token_ids=self.renderer.stop_token_ids)
        answer = front.new_answer(request, len(prompt.ids))
        kept = {k: headers[k] for k in HEADERS_KEPT if k in headers}
        return PreparedCall(rollout, front, request, prompt, params, tagging, answer, kept, t0, time.time(), path,
                            prefill_text, prefill)

    # -- generation ------------------------------------------------------------------------------

    def start(self, call: PreparedCall) -> asyncio.Task:
        """The call's generation as a task; it is cancelled if the rollout closes before it ends (and
        then kept as the rollout's refusal)."""
        task = asyncio.get_running_loop().create_task(self._generate(call))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        call.rollout.track(task, {"protocol": call.request.protocol, "path": call.path, "stream": call.request.stream})
        return task

    async def _generate(self, call: PreparedCall) -> Generation:
        gen = await self.engine.generate(call.prompt.ids, call.params)
        if call.request.stop:
            gen = cut_at_stop(gen, len(call.prompt.ids), call.request.stop, lambda ids: self._continuation_text(call, ids))
        choice = call.request.tool_choice
        if not choice.parallel and choice.mode != "none":
            gen = self._cut_after_first_call(call, gen)
        return gen

    def _cut_after_first_call(self, call: PreparedCall, gen: Generation) -> Generation:
        """A request that allows one call at a time is answered with the model's first: the fewest
        sampled tokens whose text holds its markup, as a stop sequence ends an answer
        (`clawfast.proxy.stops`), so the record trains what the harness got and the next call continues
        it. `gen` itself where the model's markup holds every call in one JSON value
        (`parse_answer` then drops all but the first)."""
        text, _ = before_stop(self._continuation_text(call, gen.output_ids), call.request.stop)
        end = first_call_end(self.parser_name, call.prefill_text + text, self.reasoning_open)
        if end is None or end <= len(call.prefill_text):
            return gen
        head = text[: end - len(call.prefill_text)]
        return cut_where(gen, len(call.prompt.ids), lambda ids: self._continuation_text(call, ids).startswith(head))

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def drain(self) -> None:
        """Wait for every generation in flight (their records are written by their callbacks)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    # -- completion ------------------------------------------------------------------------------

    def _continuation_text(self, call: PreparedCall, output_ids: np.ndarray) -> str:
        return self.renderer.continuation_text(call.prefill, output_ids)

    def parse(self, call: PreparedCall, gen: Generation) -> Turn:
        text, stop = before_stop(self._continuation_text(call, gen.output_ids), call.request.stop)
        turn = parse_answer(self._parse, call.prefill_text + text, gen.finish_reason, call.front.new_tool_call_id,
                            call.request.tool_choice, self.reasoning_open)
        turn.stop_sequence = stop
        return turn

    def answer(self, call: PreparedCall, gen: Generation) -> Turn:
        """Parse the generation into `call.answer` (its turn and output tokens), which the reply is
        built from; `complete` records the call once its reply is built."""
        call.turn = turn = self.parse(call, gen)
        call.answer.turn = _after_prefill(turn, call.request.prefill)
        call.answer.output_tokens = len(gen.output_ids)
        if call.request.logprobs:
            # Each token's text alone, as vLLM reports it.
            call.answer.sampled = list(zip(self.renderer.token_texts(gen.output_ids),
                                           np.asarray(gen.infer_logprobs, np.float64).tolist()))
        return turn

    def complete(self, call: PreparedCall, gen: Generation, *, disconnected: bool = False,
                 http_status: int | None = 200) -> CallRecord | None:
        """Append the record and remember the turn (`answer` parses it first if it has not yet).
        `http_status`: what the call is answered with (None: nothing was sent, the client left).
        Returns None (and records nothing) if the rollout was closed while the call was in flight."""
        if call.committed:
            raise RuntimeError("call already completed")
        call.committed = True
        turn = call.turn if call.turn is not None else self.answer(call, gen)
        if not turn.dropped_tool_calls:
            # A turn answered without some of the calls its tokens hold is rendered afresh where a later
            # prompt replays it: its tokens would show the model calls the harness never ran.
            prompts = _rollout_prompts(call.rollout)
            prompts.remember(self.renderer, np.concatenate([call.prefill, np.asarray(gen.output_ids, np.int32)]),
                             turn.as_message())
        metadata: dict[str, Any] = {
            "protocol": call.request.protocol,
            "model": call.request.model,
            "stream": call.request.stream,
            "thread": call.tagging.thread,
            "tag_reason": call.tagging.reason,
            "spliced_turns": call.prompt.spliced_turns,
            "response_id": call.answer.response_id,
            "tool_calls": [c.name for c in turn.tool_calls],
            "http_status": http_status,
        }
        if call.headers:
            metadata["headers"] = call.headers
        if turn.parse_error:
            metadata["parse_error"] = turn.parse_error
        if turn.stop_sequence is not None:
            metadata["stop_sequence"] = turn.stop_sequence
        if call.request.tool_choice.mode != "auto":
            metadata["tool_choice"] = call.request.tool_choice.mode
        if not call.request.tool_choice.parallel:
            metadata["parallel_tool_calls"] = False
        if turn.dropped_tool_calls:
            metadata["dropped_tool_calls"] = turn.dropped_tool_calls
        if call.prefill_text:
            # The prompt's last tokens (so many), and the start of the answer's text.
            metadata["prefill"], metadata["prefill_tokens"] = call.prefill_text, len(call.prefill)
        if disconnected:
            metadata["client_disconnected"] = True
        metadata.update(call.extra_metadata)
        now = time.time()
        timings = {"received": call.t_received, "rendered": call.t_rendered, "answered": now}
        timings.update({f"engine_{k}": float(v) for k, v in gen.timings.items()})
        try:
            return call.rollout.append(
                prompt_ids=call.prompt.ids,
                output_ids=np.asarray(gen.output_ids, np.int32),
                infer_logprobs=np.asarray(gen.infer_logprobs, np.float32),
                weight_version=gen.weight_version,
                output_versions=gen.output_versions,
                routing=gen.routing,
                routing_start=gen.routing_start,
                finish_reason=gen.finish_reason,
                timings=timings,
                tags=(call.tagging.tag,),
                metadata=metadata,
            )
        except LogClosed as exc:  # the rollout ended while this call ran (any other error is a bug: it raises)
            log.warning("dropped a call of closed rollout %s: %s", call.rollout.rollout_id, exc)
            return None

    def complete_later(self, call: PreparedCall, task: asyncio.Task, *, http_status: int | None = None,
                       on_failure: Callable[[asyncio.Task], None] | None = None) -> None:
        """The client went away: record the call, marked, once its generation ends. `http_status`: the
        status already sent (200 if a stream's head went out), None if nothing was. `on_failure` gets
        the task if the engine failed it instead (a cancelled one is not a failure)."""

        def done(t: asyncio.Task) -> None:
            if t.cancelled():
                return
            if t.exception() is not None:
                if on_failure is not None:
                    on_failure(t)
                return
            self.complete(call, t.result(), disconnected=True, http_status=http_status)

        task.add_done_callback(done)
