"""Judges: a model that reads a task's rubric (`Task.rubric`) beside what the agent did and scores it.

One module holds the prompt (`judge_prompt`), its parsing (`parse_verdict`) and the engines that
answer it (`Judge`): an OpenAI-compatible chat-completions URL (`UrlJudge`), or the embedded torch
engine on a model directory (`EngineJudge`). `build_judge(config)` makes the one ``eval.judge``
names. A `Verdict` keeps the prompt it answered, the raw answer and what was parsed from it, so
every judged score can be read back and re-checked.

The prompt is built where the final workspace still exists (the rollout worker, before its sandbox
closes: the rubric's files are read there) and travels in the rollout's info as plain text; the
judge is asked later, in the process that runs the evaluation (`clawfast.tasks.scoring`).

The judge is told to answer one JSON object ``{"scores": {criterion: s}, "total": t, "notes": "..."}``
(PinchBench's shape). `parse_verdict` reads the answer past its reasoning (a leading ``<think>`` block,
an unterminated one to the end; or up to the first ``</think>`` where the template opened it, unless
no JSON follows: a verdict may quote the tag), and there the last fenced ``json`` block holding ``total`` or ``scores``,
else the last such JSON object: ``total`` when it is a number in [0, 1], else the mean of ``scores``.
Anything else (no JSON, a score outside [0, 1] or past a float's range, no total and no scores, an
answer that ends inside a JSON object opened after its last verdict, i.e. cut short) is a verdict
with ``error`` set and no score, never a guessed one; `ask` never raises for what a judge answers.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from clawfast.tasks.task import Task
from clawfast.tasks.transcript import summarize
from clawfast.tasks.verify import finite_number, short_repr

# Bytes of one workspace file a judge reads; a rubric's files are reports and summaries.
FILE_PREVIEW_BYTES = 16384
# Characters of the transcript summary a judge reads (its end is kept: the run's outcome is there).
TRANSCRIPT_CHARS = 24000
# A fenced json block: from a line that opens it to the next line that is only a fence (a ``` inside
# the JSON, in a note, does not end it).
_FENCED_JSON = re.compile(r"^[ \t]*```json[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.DOTALL | re.MULTILINE)
_OPENS_OBJECT = re.compile(r'\{\s*("|$)')  # a brace that opens a JSON object: a key, or the end, follows


def _file_section(workspace: Path, rel: str) -> str:
    # Read without following any link: a link the agent planted (the file or a folder above it) must
    # not show the judge a file from outside its workspace. Imported here: the sandbox package loads
    # its backends, which the trainer, a user of this module, must not import (tests/test_dependencies.py, R5).
    from clawfast.sandbox.workspace import read_head

    try:
        head, size = read_head(str(workspace), rel, FILE_PREVIEW_BYTES)
    except FileNotFoundError:
        return f"### {rel}\n(missing: the agent did not leave this file)"
    except (OSError, ValueError) as exc:  # a link, a FIFO, a file the agent made unreadable, ...
        return f"### {rel}\n(not read: {exc})"
    try:
        # final=False: a character cut at the preview's end is dropped, not taken for binary data.
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=size <= FILE_PREVIEW_BYTES)
    except UnicodeDecodeError:
        return f"### {rel}\n(binary, {size} bytes)"
    more = f"\n... ({size - FILE_PREVIEW_BYTES} more bytes)" if size > FILE_PREVIEW_BYTES else ""
    return f"### {rel}\n{text}{more}"


def judge_prompt(task: Task, transcript: list[dict[str, Any]], workspace: Path | str) -> str:
    """The prompt a judge answers for one run of `task` (which must have a rubric): the task, what a
    good run does, the run's transcript (summarized), the rubric's files as the agent left them in
    `workspace`, the rubric, and the answer's format."""
    if task.rubric is None:
        raise ValueError(f"task {task.id!r} has no rubric to judge")
    rubric = task.rubric
    summary = summarize(transcript)
    if len(summary) > TRANSCRIPT_CHARS:
        summary = f"... ({len(summary) - TRANSCRIPT_CHARS} characters before)\n" + summary[-TRANSCRIPT_CHARS:]
    parts = [
        "You are a grading function. Read the task, what the agent did and the rubric, then score the "
        "agent's work strictly against the rubric. Do not use tools and do not write anything but the "
        "JSON object asked for at the end.",
        f"## Task\n{task.instruction}",
    ]
    if rubric.expected:
        parts.append(f"## Expected Behavior\n{rubric.expected}")
    parts.append(f"## Agent Transcript (summarized)\n{summary or '(the agent did nothing)'}")
    if rubric.files:
        parts.append("## Files the agent left\n" + "\n\n".join(_file_section(Path(workspace), f) for f in rubric.files))
    parts += [
        f"## Grading Rubric\n{rubric.text}",
        "Score each criterion from 0.0 to 1.0, then the whole run from 0.0 to 1.0. Answer with only "
        'this JSON object: {"scores": {"criterion name": 0.0}, "total": 0.0, "notes": "brief justification"}',
    ]
    return "\n\n".join(parts)


@dataclass
class Verdict:
    """A judge's answer to one prompt. total: the judged score in [0, 1] (None when `error`).
    scores: per criterion. notes: the judge's justification. error: why there is no score (the
    judge failed, or its answer could not be read). judge: which judge answered."""

    prompt: str
    response: str
    total: float | None
    scores: dict[str, float] = field(default_factory=dict)
    notes: str = ""
    error: str | None = None
    judge: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _past_reasoning(text: str) -> tuple[str, bool]:
    """`text` past the model's reasoning, which can only open an answer: a leading ``<think>`` block
    (all of an unterminated one: an answer cut short while reasoning), or, where the chat template
    opened it in the prompt, everything up to the first ``</think>``; and whether that last rule cut
    it (a verdict may quote a think tag in its notes: then the whole text is read again). Drafts
    written while reasoning are not the verdict."""
    stripped = text.lstrip()
    if stripped.startswith("<think>"):
        end = stripped.find("</think>")
        return ("" if end < 0 else stripped[end + len("</think>"):]), False
    end = text.find("</think>")
    if end >= 0:
        return text[end + len("</think>"):], True
    return text, False


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
        return None


def _unfinished(text: str, start: int) -> bool:
    """Whether the JSON-like value opening at `text[start]` is still open where `text` ends (its strings
    and brackets never all close): an answer cut short inside it."""
    depth, in_string, escaped = 0, False, False
    for ch in text[start:]:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return False
    return True


def _json_objects(text: str) -> tuple[list[Any], list[tuple[int, Any]], list[int]]:
    """The JSON values of `text`'s fenced ``json`` blocks; its top-level JSON values with where each
    starts, in order; and where a ``{`` opens a JSON object (`_OPENS_OBJECT`) left unfinished where
    `text` ends."""
    fenced = [_parse(block) for block in _FENCED_JSON.findall(text)]
    found, unfinished = [], []
    decoder = json.JSONDecoder()
    i = text.find("{")
    while i != -1:
        try:
            value, end = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            if _OPENS_OBJECT.match(text, i) and _unfinished(text, i):  # a lone brace in prose never counts
                unfinished.append(i)
            i = text.find("{", i + 1)
            continue
        found.append((i, value))
        i = text.find("{", end)
    return fenced, found, unfinished


def _unit(value: Any) -> float | None:
    number = finite_number(value)
    return number if number is not None and 0.0 <= number <= 1.0 else None


def _is_verdict(value: Any) -> bool:
    return isinstance(value, dict) and ("total" in value or "scores" in value)


def parse_verdict(prompt: str, response: str, *, judge: str = "") -> Verdict:
    """Read a judge's `response` (see the module docstring)."""
    def failed(error: str) -> Verdict:
        return Verdict(prompt, response, None, error=error, judge=judge)

    text, opened_in_prompt = _past_reasoning(response)
    fenced, bare, unfinished = _json_objects(text)
    if opened_in_prompt and not bare and not unfinished:  # the </think> was quoted, not the reasoning's end
        fenced, bare, unfinished = _json_objects(response)
    fenced = [o for o in fenced if _is_verdict(o)]
    # An object still open where the answer ends, after every complete verdict-shaped one (fenced or
    # not; those may sit inside it), is an answer cut short: its final word is lost, and an earlier
    # object is not it. Only a brace that opens a JSON object (a key, or the end, follows) counts:
    # prose may hold a lone one (code quoted in a note).
    last_verdict = max((start for start, value in bare if _is_verdict(value)), default=-1)
    if any(start > last_verdict for start in unfinished):
        return failed("the answer ends inside an unfinished JSON object (cut short?)")
    # A fenced block is the judge marking its answer: prose objects after it are examples or restated
    # formats. Without one, the last object is the final word.
    objects = fenced or [o for _, o in bare if _is_verdict(o)]
    if not objects:
        return failed("the answer holds no JSON object with 'total' or 'scores'")
    answer = objects[-1]
    scores = answer.get("scores", {})
    if not isinstance(scores, dict):
        return failed(f"'scores' must be an object, got {type(scores).__name__}")
    parsed = {}
    for name, value in scores.items():
        score = _unit(value)
        if score is None:
            return failed(f"criterion {name!r}: {short_repr(value)} is not a score in [0, 1]")
        parsed[str(name)] = score
    if "total" in answer and answer["total"] is not None:
        total = _unit(answer["total"])
        if total is None:
            return failed(f"'total' {short_repr(answer['total'])} is not a score in [0, 1]")
    elif parsed:
        total = sum(parsed.values()) / len(parsed)
    else:
        return failed("the answer has neither a total nor criterion scores")
    notes = answer.get("notes", "")
    if not isinstance(notes, str):
        try:
            # Strict JSON, as the record that keeps the verdict: NaN or Infinity in the notes must not
            # fail that record later.
            notes = json.dumps(notes, allow_nan=False)
        except ValueError:
            notes = "(notes not representable as JSON)"
    return Verdict(prompt, response, total, parsed, notes, judge=judge)


class Judge(Protocol):
    """Answers a judge prompt with the model's text. `name` says which model (kept in verdicts);
    `concurrency`: how many prompts it may answer at once, from as many threads."""

    name: str
    concurrency: int

    def __call__(self, prompt: str) -> str: ...


def ask(judge: Judge, prompt: str) -> Verdict:
    """`judge`'s verdict on `prompt`; a judge that fails is a verdict with its error, not a crash."""
    try:
        response = judge(prompt)
    except Exception as exc:  # one failed judge call must not lose the evaluation
        return Verdict(prompt, "", None, error=f"judge failed: {type(exc).__name__}: {exc}", judge=judge.name)
    try:
        return parse_verdict(prompt, response, judge=judge.name)
    except Exception as exc:  # nor one answer that the parser cannot read
        return Verdict(prompt, response, None, error=f"cannot read the answer: {type(exc).__name__}: {exc}",
                       judge=judge.name)


class UrlJudge:
    """A model behind an OpenAI-compatible chat-completions endpoint (vLLM, SGLang, a hosted API).
    `url` is the API root (``http://host:port/v1``); the key is read from the environment variable
    `api_key_env` (none sent when it is unset). Greedy, one answer per prompt."""

    def __init__(self, url: str, model: str, *, api_key_env: str = "OPENAI_API_KEY", max_tokens: int = 1024,
                 timeout_s: float = 180.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"judge url must be http(s)://..., got {url!r}")
        self.url, self.model, self.max_tokens, self.timeout_s = url.rstrip("/"), model, max_tokens, timeout_s
        self.api_key = os.environ.get(api_key_env)
        self.name = f"{model}@{self.url}"
        self.concurrency = 8

    def __call__(self, prompt: str) -> str:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
                "max_tokens": self.max_tokens}
        response = httpx.post(f"{self.url}/chat/completions", json=body, headers=headers, timeout=self.timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"{self.url}/chat/completions answered {response.status_code}: {response.text[:500]}")
        content = response.json()["choices"][0]["message"].get("content")
        if not isinstance(content, str):
            raise RuntimeError(f"{self.url}/chat/completions answered no text content")
        return content


class EngineJudge:
    """The model in `model_dir` (a Hugging Face directory with a chat template) on clawfast's torch
    engine, greedy, on the CPU unless `device` says otherwise."""

    def __init__(self, model_dir: str | Path, *, max_tokens: int = 1024, dtype: str = "float32",
                 device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from clawfast.engines.torch_engine import TorchEngine

        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"judge model_dir {self.model_dir} is not a model directory (no config.json)")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if not self.tokenizer.chat_template:
            raise ValueError(f"judge model_dir {self.model_dir}: the tokenizer has no chat template")
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype)).to(device)
        self.engine = TorchEngine(model, max_batch=1, seed=0)
        self.max_tokens = max_tokens
        self.name = str(self.model_dir)
        # One at a time: each prompt runs the engine on its own event loop.
        self.concurrency = 1

    def __call__(self, prompt: str) -> str:
        import numpy as np

        from clawfast.engines.base import SamplingParams

        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=False)
        eos = self.tokenizer.eos_token_id
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0,
                                stop_token_ids=(eos,) if eos is not None else ())
        gen = asyncio.run(self.engine.generate(np.asarray(ids, dtype=np.int32), params))
        return self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)


def build_judge(config: Any) -> Judge | None:
    """The judge ``eval.judge`` names (`clawfast.train.config.JudgeConfig`), None when none is set."""
    if config is None:
        return None
    if config.url is not None:
        return UrlJudge(config.url, config.model, api_key_env=config.api_key_env, max_tokens=config.max_tokens)
    return EngineJudge(config.model_dir, max_tokens=config.max_tokens)
