"""The engine contract the proxy and trainer depend on.

An engine takes prompt token ids and returns the sampled token ids with the sampler's own log-prob of
each (the numbers importance sampling corrects against), and the weight version that produced them.
It knows nothing of text, chat templates or protocols.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens: output budget, at least 1. temperature (>= 0): 0 means greedy (infer_logprobs are
    then of the greedy token under the untempered distribution). top_p in (0, 1] (1: no nucleus
    truncation); top_k >= 0 (0: none). stop_token_ids end generation and are included in the output;
    nothing else does (not the model's own EOS ids: vLLM is asked to ignore them; SGLang, which then
    ignores stop ids too, only where there are none).
    Values outside these bounds are a ValueError naming the parameter here, before any engine sees
    them (one bad call must not fail the calls batched with it)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # `not x >= 0` rather than `x < 0`: NaN fails every comparison and must be refused too.
        if not self.max_tokens >= 1:
            raise ValueError(f"SamplingParams: max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams: temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p must lie in (0, 1], got {self.top_p}")
        if not self.top_k >= 0:
            raise ValueError(f"SamplingParams: top_k must be >= 0 (0: no top-k), got {self.top_k}")


@dataclass(frozen=True)
class Sampling:
    """What the caller of a rollout asks of every model call in it, travelling with the rollout;
    `params` merges it with what one call asks for into that call's `SamplingParams` (the proxy
    does, per call; so does `clawfast.train.sampled`, which has no proxy). temperature / top_p /
    top_k: override what the harness asks for (None: the request's, else 1.0, 1.0 and 0; top_k 0 is
    no top-k, the whole distribution: what a training run samples from whatever a harness asks, so
    that its sampling log-probs are the policy's). max_tokens: caps each
    call's output (None: the server's cap alone). max_calls: the rollout's budget of model calls,
    side calls included; calls beyond it are refused in the caller's protocol (None: unlimited)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    max_calls: int | None = None

    def __post_init__(self) -> None:
        if self.temperature is not None and not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k is not None and not self.top_k >= 0:
            raise ValueError(f"top_k must be >= 0 (0: no top-k), got {self.top_k}")
        for name in ("max_tokens", "max_calls"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")

    def params(self, *, cap: int, default_max_tokens: int, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               seed: int | None = None, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """The `SamplingParams` of one call that asks for `max_tokens`, `temperature`, `top_p` and
        `top_k` (None: asks nothing), served under the output bound `cap` with `default_max_tokens`
        for a call that names no budget. The output budget is the call's (else the default), capped by
        `cap` and by this `max_tokens`; this temperature, top_p and top_k win over the call's (neither:
        1.0, 1.0, 0); a call's top_p 0, where it is the one used, is top_k 1 unless this top_k is set
        (then it is top_p 1: this top_k decides). This is
        the one merge rule: the proxy passes its cap already
        bounded by the room its context leaves."""
        if self.max_tokens is not None:
            cap = min(self.max_tokens, cap)
        top_p = next(v for v in (self.top_p, top_p, 1.0) if v is not None)
        top_k = self.top_k if self.top_k is not None else top_k or 0
        if top_p == 0:
            # A call's top_p 0 (the APIs accept it): the nucleus of least mass is the most likely token
            # alone, which top_k 1 keeps (SamplingParams takes top_p in (0, 1] only).
            top_p, top_k = 1.0, (1 if self.top_k is None else top_k)
        return SamplingParams(
            max_tokens=min(max_tokens or default_max_tokens, cap),
            temperature=next(v for v in (self.temperature, temperature, 1.0) if v is not None),
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop_token_ids=stop_token_ids,
        )


@dataclass
class Generation:
    """output_ids (int32) and infer_logprobs (float32, same length: the sampler's log-prob of each);
    finish_reason is "stop" (a stop token or end of sequence) or "length" (max_tokens reached).
    output_versions (int64, same length, or None): the weight version that sampled each token; a
    call that went on decoding across a weight push (``on_update="continue"``) holds more than one,
    in non-decreasing order. None: `weight_version` sampled every token. weight_version: the version
    of the oldest token (the one the call started on; a call with no tokens: the version serving it).
    routing ([R, layers, top_k], uint8 when the model has at most 256 experts, else uint16, or None)
    and routing_start: for MoE routing replay, the experts each MoE layer chose (in the model's
    layer order; the top-k order the router gave) for rows ``[routing_start, routing_start + R)`` of
    the call's path ``prompt_ids + output_ids``, row p being the forward at input token ``path[p]``
    (the one that predicts ``path[p + 1]``). An engine computes at most rows
    ``[0, len(prompt_ids) + len(output_ids) - 1)`` (the last sampled token is never fed back) and may
    report fewer, e.g. from the first row past a prefix-cache hit. Engines that do not record routing
    (and dense models) leave None and 0.
    `clawfast.records.CallRecord` checks and keeps them (the proxy stores each row once per rollout)."""

    output_ids: np.ndarray
    infer_logprobs: np.ndarray
    finish_reason: str
    weight_version: int
    timings: dict[str, float] = field(default_factory=dict)
    output_versions: np.ndarray | None = None
    routing: np.ndarray | None = None
    routing_start: int = 0


class Engine(abc.ABC):
    """Async generation over token ids. Implementations batch concurrent calls where they can."""

    weight_version: int = 0
    # True for an engine with an `apply_delta(delta)` method taking a
    # `clawfast.engines.weight_delta.WeightDelta` (only what changed since the version serving);
    # the others get whole pushes (`clawfast.train.push.WeightPusher`).
    takes_deltas: bool = False
    # True for an engine that loads weights under the names and layout of the model's checkpoint
    # files (what `save_pretrained` writes: vLLM, a remote server), not of the trainer's modules. They
    # differ where transformers converts weights on load (from 5.0 it fuses an MoE's experts into one
    # tensor per layer); the trainer converts what it pushes (`clawfast.train.push.engine_layout`).
    checkpoint_layout: bool = False
    # True for an engine that serves a LoRA adapter on its base weights through a `load_adapter(directory,
    # version)` method reading the adapter in peft's format (`clawfast.train.lora.save_adapter`): vLLM.
    # The torch engine serves the trainer's adapted modules instead and takes the adapter as a delta.
    takes_adapters: bool = False
    # The longest prompt + output the engine serves, where it states a limit of its own (the
    # in-process vLLM engine's max_model_len, a remote server's as it lists it); None: it states none.
    # The proxy refuses a longer prompt before it reaches the engine, and the rollout service tells
    # each harness this context (`clawfast.rollout.spec.with_context`).
    max_model_len: int | None = None

    @abc.abstractmethod
    async def generate(self, prompt_ids: np.ndarray, params: SamplingParams) -> Generation:
        """Sample a continuation of `prompt_ids`."""

    def update_weights(self, state_dict: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Load new policy weights (a state dict, or (name, tensor) pairs an engine may consume one
        at a time, as a sharded trainer streams them) and set `weight_version`; engines that cannot,
        say so."""
        raise NotImplementedError(f"{type(self).__name__} does not take weight updates")

    async def close(self) -> None:
        """Release processes and memory. Idempotent."""
