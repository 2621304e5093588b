"""The scripted engine: plays given model outputs through the real tokenizer. For tests and benchmarks.

This is the only fake engine in the project, and it is honest about what it fakes: the *choice* of
output. Everything else is real — outputs are token ids from the model's own tokenizer, ending with
the chat template's stop token, truncated by `max_tokens` (finish "length"), and each token has a
log-prob (a fixed pseudo-random value in (-3, -0.01], seeded, so records are reproducible). It
answers with no delay, which makes it the zero-latency engine of bench/bench_proxy.py.

A script entry is either the exact output text (``"<tool_call>\\n{...}\\n</tool_call>"``) or a dict
``{"text": str, "tool_calls": [{"name": str, "arguments": {...}}], "reasoning": str}`` rendered in
Qwen3 markup by `qwen3_output_text`. A file for ``clawfast proxy serve --scripted FILE`` holds a JSON
list of entries.
"""

from __future__ import annotations

import json
import os
from collections import deque
from typing import Any, Callable, Iterable

import numpy as np

from clawfast.engines.base import Engine, Generation, SamplingParams

Entry = str | dict


def qwen3_output_text(entry: Entry) -> str:
    """The model output text for a script entry, in Qwen3 markup (think, text, tool_call blocks)."""
    if isinstance(entry, str):
        return entry
    unknown = set(entry) - {"text", "tool_calls", "reasoning"}
    if unknown:
        raise ValueError(f"script entry has unknown keys {sorted(unknown)}; expected text, tool_calls, reasoning")
    parts = []
    if entry.get("reasoning"):
        parts.append(f"<think>\n{entry['reasoning']}\n</think>\n\n")
    if entry.get("text"):
        parts.append(entry["text"])
    for i, call in enumerate(entry.get("tool_calls") or ()):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"script tool call {call!r} needs a string 'name'")
        body = json.dumps({"name": call["name"], "arguments": call.get("arguments", {})}, ensure_ascii=False)
        parts.append(("\n" if parts or i else "") + f"<tool_call>\n{body}\n</tool_call>")
    return "".join(parts)


def load_script(path: str | os.PathLike) -> list[Entry]:
    """The entries of a script file. Raises OSError when it cannot be read, ValueError (naming the
    file, and the entry) when it is not a JSON list of valid entries."""
    with open(path) as fh:
        try:
            entries = json.load(fh)
        except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError for a binary file
            raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: a script is a JSON list of entries")
    for i, entry in enumerate(entries):
        if not isinstance(entry, (str, dict)):  # qwen3_output_text would fail on it with a TypeError
            raise ValueError(f"{path}: entry {i} is {type(entry).__name__}, not a string or an object")
        try:
            qwen3_output_text(entry)  # validate early, naming the bad entry
        except (ValueError, TypeError) as exc:  # TypeError: e.g. {"text": 5}
            raise ValueError(f"{path}: entry {i}: {exc}") from None
    return entries


class ScriptExhausted(RuntimeError):
    pass


class ScriptedEngine(Engine):
    """Plays `script` entries in order (cycling if `cycle`), or asks `responder(prompt_ids)` for the
    entry of each call. `encode` maps text to token ids (e.g. the proxy renderer's `encode`) and
    `stop_token_id` is appended to every complete output."""

    def __init__(
        self,
        encode: Callable[[str], Iterable[int]],
        stop_token_id: int,
        script: Iterable[Entry] = (),
        *,
        cycle: bool = False,
        responder: Callable[[np.ndarray], Entry] | None = None,
        seed: int = 0,
    ) -> None:
        self._encode = encode
        self._stop = int(stop_token_id)
        self._script = deque(script)
        self._cycle = cycle
        self._responder = responder
        self._rng = np.random.default_rng(seed)
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.calls = 0

    def push(self, *entries: Entry) -> None:
        """Queue more outputs (tests script a conversation as it goes)."""
        self._script.extend(entries)

    def _next_entry(self, prompt_ids: np.ndarray) -> Entry:
        if self._responder is not None:
            return self._responder(prompt_ids)
        if not self._script:
            raise ScriptExhausted(f"scripted engine: no output left for call {self.calls}")
        entry = self._script.popleft()
        if self._cycle:
            self._script.append(entry)
        return entry

    def _tokens(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        hit = self._cache.get(text)
        if hit is None:
            ids = np.asarray(list(self._encode(text)) + [self._stop], dtype=np.int32)
            logprobs = -self._rng.uniform(0.01, 3.0, size=len(ids)).astype(np.float32)
            hit = self._cache[text] = (ids, logprobs)
        return hit

    async def generate(self, prompt_ids: np.ndarray, params: SamplingParams) -> Generation:
        entry = self._next_entry(prompt_ids)
        self.calls += 1
        ids, logprobs = self._tokens(qwen3_output_text(entry))
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, logprobs, finish = ids[: params.max_tokens], logprobs[: params.max_tokens], "length"
        return Generation(ids.copy(), logprobs.copy(), finish, self.weight_version)

    def update_weights(self, state_dict: Any, version: int) -> None:
        """Accepts any weights and only bumps the version (the script decides the outputs)."""
        self.weight_version = int(version)
