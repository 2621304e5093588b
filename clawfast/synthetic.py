"""Synthetic rollouts shaped like real harness traffic, for tests, benchmarks and samples.

Two families:

- `harness_like_rollout` / `task_group`: one agent session as a harness such as Claude Code makes
  it: a long system prompt (harness instructions + tool schemas) and task text, a main thread whose
  every prompt is the previous prompt + the previous output + a tool result, retried calls (the same
  prompt asked again, a different answer), subagent chains with their own system prompt that shares
  a prefix with the main one, a title call, a history edit (an old tool result cleared) that branches
  the tree, and a compaction (summarise, then continue from the summary) whenever the context would
  overflow. `task_group` makes k such rollouts of one task: they share system prompt, tools and task.
- `random_call_set`: small adversarial call sets for property tests: retries (with equal, prefix or
  empty outputs), forks at any point (inside outputs too), history edits, fresh roots, empty tool
  gaps, excluded tags, excluded calls extending the main path (compaction, subagent; opt-in),
  non-contiguous call indices and shuffled arrival order. Small vocabularies
  make accidental shared prefixes common.

Guaranteed: deterministic for a given `numpy.random.Generator` state; every record passes
`CallRecord.validate`; token ids lie in `[0, vocab_size)`; logprobs are finite and <= 0.
Not guaranteed: any resemblance of the token ids to text (they are uniform random), or that a
particular shape (e.g. a retry) occurs in a given small draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from clawfast.records import CallRecord, RolloutResult

QWEN3_VOCAB = 151_936


def _ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=max(int(n), 0), dtype=np.int32)


def _logprobs(rng: np.random.Generator, n: int) -> np.ndarray:
    # Sampling log-probs: mostly near 0, sometimes a surprising token.
    return (-rng.exponential(0.5, size=n)).astype(np.float32)


def _call(rollout_id, index, harness, prompt, output, rng, tags=("main",), finish="stop", **meta) -> CallRecord:
    return CallRecord(
        rollout_id=rollout_id,
        call_index=index,
        harness=harness,
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        output_ids=np.asarray(output, dtype=np.int32),
        infer_logprobs=_logprobs(rng, len(output)),
        finish_reason=finish,
        tags=tags,
        metadata=dict(meta),
    )


@dataclass(frozen=True)
class SharedPrefix:
    """What the k samples of one task share: harness system prompt (+ tool schemas) and task text."""

    system: np.ndarray
    task: np.ndarray


def shared_prefix(rng: np.random.Generator, max_prompt_tokens: int, vocab_size: int = QWEN3_VOCAB, *,
                  system_tokens: int | None = None) -> SharedPrefix:
    # Claude Code's system prompt plus tool schemas is ~15-20K tokens of a 200K window; by default
    # about a sixth of the window (``system_tokens`` sets it), and a task statement of ~1.5% of it.
    return SharedPrefix(
        system=_ids(rng, max(8, max_prompt_tokens // 6) if system_tokens is None else system_tokens, vocab_size),
        task=_ids(rng, max(4, max_prompt_tokens // 64), vocab_size),
    )


def harness_like_rollout(
    rng: np.random.Generator,
    n_calls: int = 64,
    max_prompt_tokens: int = 65536,
    retry_frac: float = 0.1,
    subagent_chains: int = 2,
    *,
    subagent_calls: int = 3,
    tokens_per_call: int | None = None,
    history_edit: bool = True,
    title_call: bool = True,
    prefix: SharedPrefix | None = None,
    vocab_size: int = QWEN3_VOCAB,
    rollout_id: str = "rollout-0",
    harness: str = "claude-code",
    shuffle: bool = False,
) -> list[CallRecord]:
    """One agent session of exactly `n_calls` calls whose main-thread prompts grow to about
    `max_prompt_tokens` by the last call.

    Each main step adds `tokens_per_call` tokens on average (output + tool result); by default it
    is chosen so that the prompt just reaches the limit at the end. Passing a fixed
    `tokens_per_call` with more calls makes the session overflow and compact, so its total size
    grows linearly with `n_calls` (the benchmark's 4x and 16x sizes). The last call is always a
    main-thread call. `shuffle` returns the calls in random arrival order.
    """
    if n_calls < 1:
        raise ValueError(f"n_calls must be >= 1, got {n_calls}")
    prefix = prefix or shared_prefix(rng, max_prompt_tokens, vocab_size)
    base_len = len(prefix.system) + len(prefix.task)
    if base_len >= max_prompt_tokens:
        raise ValueError(f"system prompt and task ({base_len} tokens) do not fit max_prompt_tokens={max_prompt_tokens}")
    calls: list[CallRecord] = []

    def emit(prompt, output, tags=("main",), **meta) -> np.ndarray:
        calls.append(_call(rollout_id, len(calls), harness, prompt, output, rng, tags, **meta))
        return np.asarray(output, dtype=np.int32)

    budget_sub = subagent_chains * subagent_calls if n_calls >= 4 * (subagent_chains * subagent_calls + 2) else 0
    with_title = title_call and n_calls >= 8
    main_steps = max(1, (n_calls - budget_sub - int(with_title)) / (1.0 + retry_frac))
    growth = tokens_per_call or max(2, int((0.97 * max_prompt_tokens - base_len) / main_steps))
    chains_at = [int(n_calls * (i + 1) / (subagent_chains + 1)) for i in range(subagent_chains)] if budget_sub else []
    edit_at = int(n_calls * 2 / 3) if history_edit and n_calls >= 6 else -1

    # The main history as pieces, so an old tool result can be cleared: prompt = concat(pieces).
    # pieces[0:2] are system and task; after them, outputs and tool results alternate.
    pieces: list[np.ndarray] = [prefix.system, prefix.task]
    tool_results: list[int] = []  # positions in `pieces` holding a tool result
    if with_title:
        # Title generation: its own short system prompt and the user's first message.
        emit(np.concatenate([_ids(rng, 32, vocab_size), prefix.task]), _ids(rng, 8, vocab_size), tags=("title",))

    def output_and_gap() -> tuple[int, int]:
        out = int(rng.integers(max(1, growth // 10), max(2, growth * 4 // 10) + 1))
        gap = max(0, int(rng.normal(growth - out, 0.25 * growth)))
        return out, gap

    last_output: np.ndarray | None = None
    edited = False
    while len(calls) < n_calls:
        left = n_calls - len(calls)
        if chains_at and len(calls) >= chains_at[0] and left > subagent_calls + 1 and last_output is not None:
            chains_at.pop(0)
            # A subagent: the harness's shared instructions, its own role prompt, a delegated task.
            shared = prefix.system[: len(prefix.system) // 2]
            role = _ids(rng, len(prefix.system) // 8 + 1, vocab_size)
            sub_prompt = np.concatenate([shared, role, last_output[-16:]])
            for _ in range(subagent_calls):
                out, gap = output_and_gap()
                sub_out = emit(sub_prompt, _ids(rng, out, vocab_size), tags=("subagent",))
                sub_prompt = np.concatenate([sub_prompt, sub_out, _ids(rng, gap // 2, vocab_size)])
            # Its final answer comes back to the main thread inside the next tool result.
            tool_results.append(len(pieces))
            pieces.append(sub_out)
            continue
        out, gap = output_and_gap()
        if last_output is not None:
            tool_results.append(len(pieces))
            pieces.append(_ids(rng, gap, vocab_size))
        if sum(len(p) for p in pieces) + out > max_prompt_tokens and left >= 2 and last_output is not None:
            # Compaction: the history plus a summarise request; the summary restarts the thread.
            request = np.concatenate(pieces + [_ids(rng, 64, vocab_size)])
            summary = emit(request, _ids(rng, max(16, len(request) // 50), vocab_size), tags=("compaction",))
            pieces, tool_results = [prefix.system, prefix.task, summary], []
            continue
        if not edited and len(calls) >= edit_at >= 0 and len(tool_results) >= 3:
            # Clear an old tool result: the prompt departs from the history before it, so the
            # tree branches there and the older branch stays a (kept) leaf.
            edited = True
            pieces[tool_results[len(tool_results) // 3]] = _ids(rng, 8, vocab_size)
        prompt = np.concatenate(pieces)
        if left >= 2 and rng.random() < retry_frac:
            # The harness asks the same prompt again (timeout, disconnect, overload): the first
            # answer is dropped (a dead leaf).
            emit(prompt, _ids(rng, out, vocab_size), finish="length")
        last_output = emit(prompt, _ids(rng, out, vocab_size))
        pieces.append(last_output)
    if shuffle:
        calls = [calls[i] for i in rng.permutation(len(calls))]
    return calls


def task_group(
    rng: np.random.Generator,
    k: int = 8,
    *,
    task_id: str = "task-0",
    n_calls: int = 64,
    max_prompt_tokens: int = 65536,
    vocab_size: int = QWEN3_VOCAB,
    **kwargs,
) -> list[list[CallRecord]]:
    """k rollouts of one task (a GRPO group): they share the harness system prompt, tools and task
    text and then diverge (different outputs, tool results, retries). Rollout ids are
    ``f"{task_id}-s{i}"``; other keyword arguments go to `harness_like_rollout`."""
    prefix = shared_prefix(rng, max_prompt_tokens, vocab_size)
    return [
        harness_like_rollout(
            rng,
            n_calls,
            max_prompt_tokens,
            prefix=prefix,
            vocab_size=vocab_size,
            rollout_id=f"{task_id}-s{i}",
            **kwargs,
        )
        for i in range(k)
    ]


def group_results(
    groups: list[list[CallRecord]], *, task_id: str, rewards: list[float], harness: str = "claude-code"
) -> list[RolloutResult]:
    """Wrap a task group's call lists into `RolloutResult`s with the given rewards."""
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards for {len(groups)} rollouts")
    return [
        RolloutResult(
            rollout_id=calls[0].rollout_id,
            task_id=task_id,
            harness=harness,
            sample_index=i,
            reward=float(r),
            status="ok",
            calls=sorted(calls, key=lambda c: c.call_index),
        )
        for i, (calls, r) in enumerate(zip(groups, rewards))
    ]


EXCLUDED_TAG_CHOICES = (("subagent",), ("compaction",), ("title",), ("quota",), ("main", "subagent"))


def random_call_set(
    rng: np.random.Generator,
    n_calls: int = 8,
    *,
    vocab_size: int = 4,
    max_len: int = 24,
    p_exclude: float = 0.15,
    p_extend_excluded: float = 0.0,
    shuffle: bool = True,
    rollout_id: str = "r",
    harness: str = "synthetic",
    prefix: np.ndarray | None = None,
) -> list[CallRecord]:
    """A small random rollout for property tests (see the module docstring for the shapes).

    Paths stay within `max_len` tokens. Fresh prompts start with `prefix` when given (the shared
    system prompt of a group). With probability `p_extend_excluded` a call (after the first) is an
    excluded call whose prompt extends the latest main-thread path, as a compaction ("summarise"
    request) or a subagent delegated from the last turn does; 0 leaves the random stream as it was.
    Call indices increase with gaps and start anywhere in [0, 3]; with `shuffle` the list comes in
    random arrival order.
    """
    if n_calls < 1 or max_len < 2:
        raise ValueError("need n_calls >= 1 and max_len >= 2")
    paths: list[tuple[np.ndarray, np.ndarray]] = []  # (prompt, output) of each call so far
    index = int(rng.integers(0, 4))
    calls: list[CallRecord] = []

    def rand(lo: int, hi: int) -> np.ndarray:
        return _ids(rng, int(rng.integers(lo, hi + 1)), vocab_size)

    last_main: np.ndarray | None = None  # path of the latest main-thread call
    for _ in range(n_calls):
        if p_extend_excluded and last_main is not None and rng.random() < p_extend_excluded:
            # Prompt = the main history + a request (possibly empty: a title-like call on the last turn).
            prompt = np.concatenate([last_main, rand(0, 3)])[: max_len - 1]
            out = rand(0, 4)[: max_len - len(prompt)]
            tags = ("compaction",) if rng.random() < 0.5 else ("subagent",)
            calls.append(_call(rollout_id, index, harness, prompt, out, rng, tags, op="extend-excluded"))
            paths.append((np.asarray(prompt, np.int32), np.asarray(out, np.int32)))
            index += int(rng.integers(1, 3))
            continue
        op = "fresh" if not paths else rng.choice(["extend", "extend", "retry", "fork", "edit", "fresh"])
        out = rand(0, 4)
        if op == "fresh":
            prompt = rand(1, 6) if prefix is None else np.concatenate([prefix, rand(0, 3)])
        else:
            p, o = paths[int(rng.integers(len(paths)))] if rng.random() < 0.5 else paths[-1]
            path = np.concatenate([p, o])
            if op == "extend":  # previous path + tool result (possibly empty)
                prompt = np.concatenate([path, rand(0, 3)])
            elif op == "retry":  # same prompt; the new output may repeat or extend part of the old
                prompt = p
                shape = rng.integers(3)
                if shape == 0 and len(o):
                    out = np.concatenate([o[: int(rng.integers(len(o) + 1))], rand(0, 2)])
                elif shape == 1:
                    out = o.copy()
            elif op == "fork":  # cut anywhere (inside an output too) and continue differently
                prompt = np.concatenate([path[: int(rng.integers(1, len(path) + 1))], rand(0, 3)])
            else:  # edit: change one earlier token, keep the rest
                prompt = path.copy() if len(path) else rand(1, 3)
                prompt[int(rng.integers(len(prompt)))] = int(rng.integers(vocab_size))
                prompt = np.concatenate([prompt, rand(0, 2)])
        prompt = prompt[: max_len - 1]
        out = out[: max_len - len(prompt)]
        tags = ("main",)
        if rng.random() < p_exclude:
            tags = EXCLUDED_TAG_CHOICES[int(rng.integers(len(EXCLUDED_TAG_CHOICES)))]
        calls.append(_call(rollout_id, index, harness, prompt, out, rng, tags, op=str(op)))
        paths.append((np.asarray(prompt, np.int32), np.asarray(out, np.int32)))
        if tags == ("main",):
            last_main = np.concatenate(paths[-1])
        index += int(rng.integers(1, 3))
    if shuffle:
        calls = [calls[i] for i in rng.permutation(len(calls))]
    return calls


def random_group(rng: np.random.Generator, k: int = 3, n_calls: int = 6, **kwargs) -> list[list[CallRecord]]:
    """k small random rollouts (`random_call_set`, ids ``g0..g{k-1}``) that share a random prefix."""
    vocab = kwargs.get("vocab_size", 4)
    prefix = _ids(rng, int(rng.integers(1, 5)), vocab)
    return [random_call_set(rng, n_calls, rollout_id=f"g{i}", prefix=prefix, **kwargs) for i in range(k)]
