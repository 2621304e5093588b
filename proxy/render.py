"""Canonical conversation -> prompt token ids, through the model's own chat template, incrementally.

A prompt is assembled from pieces, each a pure function of its input and cached:

    header(system, tools) + chunk(message_1) + ... + chunk(message_n) + generation_prompt

- `chunk(m)` is the template's rendering of `m` alone: ``render([S, m]) - render([S])`` for a
  placeholder system message ``S``, tokenized on its own (for roles where probing shows the template
  inserts the content verbatim, the same text is built by concatenation, without the template). Chunks are cached by message value
  (`ChatRenderer`), and each thread's previous prompt is kept with its chunk boundaries
  (`RolloutPrompts`), so a call that extends the previous one reuses its token prefix by message
  identity and renders only the new messages: a call's CPU time grows with its new tokens, not with
  its context (bench/bench_proxy.py measures it).
- An assistant turn the engine produced in this rollout is not re-rendered: `RolloutPrompts`
  remembers the exact token ids of each produced turn by its replay key (visible text and tool
  calls; and by its reasoning, where the harness sends that back: `produced_turn`) and splices them back — generation prompt + sampled ids + the template's closing text — so
  the next call of the thread extends the previous call's prompt + output token for token.

Guaranteed: for a message-local template (the embedded one) the assembled prompt equals the
template's full rendering tokenized at once, whenever no produced turn is spliced (tested).
Not guaranteed: for templates whose rendering of a message depends on its neighbours (Qwen3 groups
consecutive tool results into one user turn; it drops reasoning of turns before the last user query)
the prompt differs from the full rendering at those places. It is still deterministic, so calls of one
thread keep sharing their prefix, and it is what the engine saw, which is all training needs.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jinja2 import TemplateError

from clawfast.proxy.canonical import Conversation, Message, ToolCall, ToolSpec
from clawfast.proxy.incremental import common_prefix

_PLACEHOLDER_SYSTEM = "\ue000"  # a private-use character no real system prompt starts with
_SENTINEL = "\ue001"
# A tool call the template renders to show where its markup puts a call's name and arguments (an id
# of 9 letters and digits: Mistral's templates refuse any other).
_PROBE_NAME, _PROBE_ARG, _PROBE_ID = "clawfast_probe_tool", "clawfast_probe_arg", "a1b2c3d4e"


class TokenLRU:
    """LRU map from a hashable key to an int32 id array, bounded by the total number of ids held."""

    def __init__(self, max_tokens: int) -> None:
        self._items: OrderedDict[Any, np.ndarray] = OrderedDict()
        self._tokens = 0
        self._max = max_tokens
        self._lock = threading.Lock()

    def get(self, key: Any) -> np.ndarray | None:
        with self._lock:
            ids = self._items.get(key)
            if ids is not None:
                self._items.move_to_end(key)
            return ids

    def put(self, key: Any, ids: np.ndarray) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._items[key] = ids
            self._tokens += len(ids)
            while self._tokens > self._max and len(self._items) > 1:
                _, dropped = self._items.popitem(last=False)
                self._tokens -= len(dropped)

    def __len__(self) -> int:
        return len(self._items)


class ChatRenderer:
    """Renders pieces of prompts for one tokenizer and chat template; thread-safe, shared by all
    rollouts. `tokenizer` is a transformers fast tokenizer with a chat template."""

    def __init__(self, tokenizer: Any, *, cache_tokens: int = 16_000_000) -> None:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self._encoder = tokenizer.backend_tokenizer  # the Rust tokenizer: no Python-side overhead
        self._template = _compile_jinja_template(tokenizer.chat_template)
        self._specials = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        self._cache = TokenLRU(cache_tokens)
        self.vocab_size = len(tokenizer)
        self.stop_token_ids = self._stop_ids()
        vocab = tokenizer.get_vocab()
        # The token that ends an assistant turn (what a scripted engine appends).
        self.turn_end_id = vocab.get("<|im_end|>", tokenizer.eos_token_id)
        self._base_msgs = [{"role": "system", "content": _PLACEHOLDER_SYSTEM}]
        self._base_text = self.render_text(self._base_msgs)
        self.generation_prompt = self._generation_prompt_text()  # its text
        self.generation_prompt_ids = self.encode(self.generation_prompt)
        self._verbatim = self._verbatim_frames()
        self._assistant_tail = self._assistant_tail_text()
        self._tail_ids: dict[str, np.ndarray] = {}  # a handful of entries: one per stop token
        self._openings: dict[str | None, str | None] = {}  # tool name (None: any) -> `tool_call_opening`

    # -- text ------------------------------------------------------------------------------------

    def render_text(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False) -> str:
        return self._template.render(
            messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt, **self._specials
        )

    def encode(self, text: str) -> np.ndarray:
        # Plain `encode` on the calling thread: the batch variants hand work to a thread pool, which
        # on a busy machine added milliseconds of wake-up latency per call (bench_proxy p50 0.5 -> 3 ms).
        return np.asarray(self._encoder.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: np.ndarray | list[int], skip_special_tokens: bool = False) -> str:
        return self._encoder.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: np.ndarray | list[int]) -> list[str]:
        """Each token's text decoded alone (special tokens kept; a piece of a character is U+FFFD)."""
        return self._encoder.decode_batch([[int(t)] for t in ids], skip_special_tokens=False)

    def _stop_ids(self) -> tuple[int, ...]:
        vocab = self.tokenizer.get_vocab()
        ids = {vocab[t] for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>") if t in vocab}
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def _generation_prompt_text(self) -> str:
        msgs = [{"role": "system", "content": _PLACEHOLDER_SYSTEM}, {"role": "user", "content": _SENTINEL}]
        with_prompt = self.render_text(msgs, add_generation_prompt=True)
        without = self.render_text(msgs)
        if not with_prompt.startswith(without):
            raise ValueError("chat template: the generation prompt does not extend the conversation")
        return with_prompt[len(without) :]

    def _assistant_tail_text(self) -> str:
        """What the template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        text = self._template_chunk_text(Message("assistant", _SENTINEL))
        return text[text.index(_SENTINEL) + len(_SENTINEL) :]

    def _verbatim_frames(self) -> dict[str, tuple[str, str]]:
        """Roles whose chunk is ``prefix + content + suffix`` with the content inserted verbatim, found
        by probing the template with awkward contents (whitespace at the ends, markup, unicode) and
        tool-call ids. For those roles a chunk is built without running the template (~50 us saved
        per new message); any role that fails a probe keeps going through the template."""
        probes = ["\ue001", "  padded \n\n", "\n<think>x</think>\n", "<tool_response>\n{\"a\": 1}", "ünï ✓ \t", ""]
        frames = {}
        for role in ("user", "system", "tool"):
            ids = ("call_a", "b") if role == "tool" else (None,)
            text = self._template_chunk_text(Message(role, _SENTINEL, tool_call_id=ids[0]))
            prefix, _, suffix = text.partition(_SENTINEL)
            if all(
                self._template_chunk_text(Message(role, probe, tool_call_id=i)) == prefix + probe + suffix
                for probe in probes
                for i in ids
            ):
                frames[role] = (prefix, suffix)
        return frames

    def tool_call_opening(self, name: str | None) -> str | None:
        """The text this model's chat template writes after the generation prompt to open a call of
        the tool `name`, through to where its arguments begin (None: of a tool the model picks, through
        to where the name or the arguments begin, whichever comes first), as the template renders an
        answer that is one tool call (with whatever it writes first, e.g. an empty think block); spaces
        at its end are left to the model (a BPE tokenizer joins them to the next token). None where
        the template writes no such place: no tool calls, or, for a named tool, the arguments before
        the name. Derived from the template, so it is the model's own markup whatever its family."""
        if name not in self._openings:  # one entry per tool name asked for
            self._openings[name] = self._tool_call_opening(name)
        return self._openings[name]

    def _tool_call_opening(self, name: str | None) -> str | None:
        probe = self._answer_with_call(_PROBE_NAME)
        if probe is None or _PROBE_NAME not in probe:
            return None
        at_name, at_args = probe.index(_PROBE_NAME), probe.rfind("{", 0, probe.index(_PROBE_ARG))
        if name is None:
            return probe[:min(at_name, at_args)].rstrip(" ")
        if at_name > at_args:
            return None
        text = self._answer_with_call(name)
        return None if text is None else text[:text.rfind("{", 0, text.index(_PROBE_ARG))].rstrip(" ")

    def _answer_with_call(self, name: str) -> str | None:
        """What the template writes after the generation prompt for an answer (to a user message)
        that is one call of `name` with the arguments ``{_PROBE_ARG: 1}``; None if the template
        refuses it or does not write it after its generation prompt."""
        msgs = [*self._base_msgs, {"role": "user", "content": _SENTINEL}]
        call = ToolCall(_PROBE_ID, name, json.dumps({_PROBE_ARG: 1}))
        try:
            before = self.render_text(msgs, add_generation_prompt=True)
            text = self.render_text(msgs + [Message("assistant", "", (call,)).template_dict()])
        except TemplateError:
            return None
        if not text.startswith(before) or _PROBE_ARG not in text[len(before):]:
            return None
        return text[len(before):]

    def _chunk_text(self, message: Message) -> str:
        frame = self._verbatim.get(message.role)
        if frame is not None and not message.tool_calls and not message.reasoning:
            return frame[0] + message.content + frame[1]
        return self._template_chunk_text(message)

    def _template_chunk_text(self, message: Message) -> str:
        base = self._base_text
        full = self.render_text(self._base_msgs + [message.template_dict()])
        if not full.startswith(base):
            raise ValueError("chat template is not prefix-stable: a message changes the text before it")
        return full[len(base) :]

    def _tail_after(self, output_ids: np.ndarray) -> str:
        """The template's closing text after an answer, minus a stop token the engine already sampled."""
        tail = self._assistant_tail
        if len(output_ids) and int(output_ids[-1]) in self.stop_token_ids:
            stop_text = self.decode(output_ids[-1:])
            if tail.startswith(stop_text):
                tail = tail[len(stop_text) :]
        return tail

    def answer_text(self, output_ids: np.ndarray) -> str:
        """An answer's text as the proxy parses it: special tokens kept, a final stop token dropped."""
        if len(output_ids) and int(output_ids[-1]) in self.stop_token_ids:
            output_ids = output_ids[:-1]
        return self.decode(output_ids)

    def continuation_text(self, prefill_ids: np.ndarray, output_ids: np.ndarray) -> str:
        """The answer's text past a prefill (`answer_text` where there is none), decoded after the
        prefill's tokens: a tokenizer may decode a token's leading space only after a neighbour
        (SentencePiece strips it at the start)."""
        if not len(prefill_ids):
            return self.answer_text(output_ids)
        head = self.decode(prefill_ids)
        whole = self.answer_text(np.concatenate([np.asarray(prefill_ids, np.int32), np.asarray(output_ids, np.int32)]))
        return whole[len(head):] if whole.startswith(head) else self.answer_text(output_ids)

    def added_messages(self, added_ids: np.ndarray, after_output_ids: np.ndarray) -> list[tuple[str, str]] | None:
        """The messages a harness added after an assistant turn, from their tokens: `added_ids` are what
        a later prompt holds past that turn's sampled `after_output_ids`, up to and with the generation
        prompt. Returns (role, content) of each, role ``user`` or ``tool``, when the text is the turn's
        closing text, then chunks each framed verbatim as this template frames one message of its
        role (`_verbatim_frames`), then the generation prompt; None when it is anything else (a
        template that frames messages by their neighbours, an edited history), for the caller to
        take the text whole."""
        text = self.decode(added_ids)
        tail, generation_prompt = self._tail_after(after_output_ids), self.generation_prompt
        if not text.startswith(tail) or not text.endswith(generation_prompt):
            return None
        text = text[len(tail):len(text) - len(generation_prompt)]
        messages = []
        while text:
            for role in ("tool", "user"):
                prefix, suffix = self._verbatim.get(role, ("", ""))
                end = text.find(suffix, len(prefix)) if prefix and suffix and text.startswith(prefix) else -1
                if end != -1:
                    messages.append((role, text[len(prefix):end]))
                    text = text[end + len(suffix):]
                    break
            else:
                return None
        return messages

    # -- ids -------------------------------------------------------------------------------------

    def header_ids(self, system: str, tools: tuple[ToolSpec, ...]) -> np.ndarray:
        key = ("header", system, tools)
        ids = self._cache.get(key)
        if ids is None:
            msgs = [{"role": "system", "content": system}] if system else []
            ids = self.encode(self.render_text(msgs, [t.template_dict() for t in tools]))
            self._cache.put(key, ids)
        return ids

    def message_ids(self, message: Message) -> np.ndarray:
        ids = self._cache.get(message)
        if ids is None:
            ids = self.encode(self._chunk_text(message))
            self._cache.put(message, ids)
        return ids

    def produced_turn_ids(self, output_ids: np.ndarray) -> np.ndarray:
        """The tokens an assistant turn stands for in later prompts: generation prompt + the sampled
        ids + the template's closing text (minus a stop token the engine already sampled)."""
        tail = self._tail_after(output_ids)
        tail_ids = self._tail_ids.get(tail)
        if tail_ids is None:
            tail_ids = self._tail_ids[tail] = self.encode(tail)
        return np.concatenate([self.generation_prompt_ids, np.asarray(output_ids, np.int32), tail_ids])

    def render_ids(self, conversation: Conversation, spliced: dict | None = None) -> tuple[np.ndarray, int]:
        """Prompt ids of a conversation and how many produced turns were spliced in."""
        parts = [self.header_ids(conversation.system, conversation.tools)]
        n_spliced = 0
        for message in conversation.messages:
            ids = produced_turn(spliced, message) if spliced else None
            if ids is None:
                ids = self.message_ids(message)
            else:
                n_spliced += 1
            parts.append(ids)
        parts.append(self.generation_prompt_ids)
        return np.concatenate(parts), n_spliced

    def full_render_ids(self, conversation: Conversation) -> np.ndarray:
        """Reference: the whole conversation rendered by the template at once, then tokenized."""
        msgs = ([{"role": "system", "content": conversation.system}] if conversation.system else []) + [
            m.template_dict() for m in conversation.messages
        ]
        tools = [t.template_dict() for t in conversation.tools]
        return self.encode(self.render_text(msgs, tools, add_generation_prompt=True))


@dataclass
class RenderedPrompt:
    ids: np.ndarray
    spliced_turns: int


@dataclass
class _LastRender:
    """A thread's previous prompt, with the token offset where each message's chunk ends."""

    system: str
    tools: tuple
    messages: tuple
    ends: list[int]
    spliced: list[bool]
    header_len: int
    ids: np.ndarray  # header + chunks + generation prompt


@dataclass
class RolloutPrompts:
    """Per-rollout memory: produced turns (replay key -> reasoning -> exact ids; `produced_turn`),
    each thread's last rendered prompt (so a call renders only the messages past the prefix it
    shares with the previous one — found by identity, which `clawfast.proxy.incremental` preserves, or equality). How a call
    continues the earlier ones is read from the records afterwards (`clawfast.threads`).

    A thread is a sequence of calls that continue one conversation (the main agent, one subagent,
    ...); the caller names it. Thread-safe for one rollout."""

    produced: dict = field(default_factory=dict)
    last_render: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def render(self, renderer: ChatRenderer, conversation: Conversation, thread: str) -> RenderedPrompt:
        with self._lock:
            last = self.last_render.get(thread)
            messages = conversation.messages
            if last is not None and last.system == conversation.system and (last.tools is conversation.tools or last.tools == conversation.tools):
                k = common_prefix(messages, last.messages)
                end = last.ends[k - 1] if k else last.header_len
                parts, ends, spliced, header_len = [last.ids[:end]], last.ends[:k], last.spliced[:k], last.header_len
            else:
                header = renderer.header_ids(conversation.system, conversation.tools)
                k, end, parts, ends, spliced, header_len = 0, len(header), [header], [], [], len(header)
            for message in messages[k:]:
                ids = produced_turn(self.produced, message)
                spliced.append(ids is not None)
                if ids is None:
                    ids = renderer.message_ids(message)
                parts.append(ids)
                end += len(ids)
                ends.append(end)
            parts.append(renderer.generation_prompt_ids)
            ids = np.concatenate(parts)
            self.last_render[thread] = _LastRender(conversation.system, conversation.tools, messages, ends, spliced, header_len, ids)
        return RenderedPrompt(ids, sum(spliced))

    def remember(self, renderer: ChatRenderer, output_ids: np.ndarray, turn: Message) -> None:
        """Keep the exact ids of the produced `turn`, to splice where a later prompt replays it
        (`produced_turn`)."""
        with self._lock:
            ids = renderer.produced_turn_ids(output_ids)
            by_reasoning = self.produced.setdefault(turn.replay_key(), {})
            by_reasoning[turn.reasoning] = by_reasoning[None] = ids


def produced_turn(produced: dict, message: Message) -> np.ndarray | None:
    """The exact ids of the produced turn an assistant `message` replays (`RolloutPrompts.produced`:
    replay key -> reasoning -> ids), or None: the one thought through as `message` says where the
    harness sent its reasoning back (two turns may show the same text after different thinking),
    else the last one produced with its visible text and calls."""
    by_reasoning = produced.get(message.replay_key()) if message.role == "assistant" else None
    if by_reasoning is None:
        return None
    return by_reasoning.get(message.reasoning, by_reasoning[None])
