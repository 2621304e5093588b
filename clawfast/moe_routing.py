"""Which experts a mixture-of-experts model's layers choose: recorded while an engine samples, forced
while the trainer computes log-probs (routing replay, docs/MODELS.md "Routing replay").

A token's log-prob depends on the experts every MoE layer routed each earlier token to. The
trainer's forward (packed, another kernel order, another batch shape) computes router logits that
differ from the sampler's by rounding, and where two experts' scores nearly tie that flips the choice
and changes the output by a whole expert: the train/inference mismatch of MoE models. Replay
records the sampler's choices and makes the trainer's forward use them; the trainer still computes
the gate weights of the forced experts from its own router, so the router keeps its gradient.

How the choice is found, for any Hugging Face MoE decoder: an MoE block (the parent of the module
that owns the router weight, an ``[experts, hidden]`` matrix) chooses its experts with one
``torch.topk`` over the expert axis with ``k = num_experts_per_tok``, inside its own ``forward`` or
its router's (transformers 5: Qwen2/3-MoE, Mixtral, OLMoE, GPT-OSS over softmax probabilities or raw
logits; DeepSeek-V3's last top-k after its group selection). A `torch.overrides.TorchFunctionMode`
entered around each block's forward sees that call: recording keeps its indices; forcing returns the
recorded indices and the values the block's own top-k input holds at them, so whatever the block
does next (normalising the top-k probabilities, a softmax over the chosen logits, a scaling) runs
unchanged on the forced experts. A block that calls such a top-k other than once per forward is an
error, not a guess.

Rows: the routing of a forward over T tokens is ``[T, layers, top_k]`` in the order the blocks
flatten them (batch-major: row b*S + s of a [B, S] input), layers in the model's module order.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# What the trainer replays (`algorithm.routing_replay`) and what an engine records for it.
ROUTING_REPLAY = ("off", "generated", "all")
_EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_shape(model: nn.Module) -> tuple[int, int] | None:
    """(experts, top_k) of a mixture-of-experts model from its config; None for a dense model."""
    config = getattr(model, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    experts = next((getattr(config, n) for n in _EXPERT_COUNT_NAMES if getattr(config, n, None)), None)
    if not (isinstance(top_k, int) and isinstance(experts, int) and experts > 1 and 0 < top_k < experts):
        return None
    return experts, top_k


def routing_dtype(experts: int) -> np.dtype:
    """The smallest unsigned dtype that holds an expert index (uint8 up to 256 experts)."""
    return np.dtype(np.uint8) if experts <= 256 else np.dtype(np.uint16)


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's MoE blocks in module order: the parents of the routers, the modules owning an
    ``[experts, hidden]`` weight (or wrapping one that does, as a LoRA adapter's layer does: its
    ``base_layer``). ValueError for a dense model or one with no such weight."""
    shape = expert_shape(model)
    if shape is None:
        raise ValueError(f"{type(model).__name__} is not a mixture-of-experts model (its config names no "
                         f"num_experts_per_tok with one of {_EXPERT_COUNT_NAMES})")
    experts = shape[0]
    hidden = model.config.hidden_size
    modules = dict(model.named_modules())
    owners = [name for name, module in modules.items()
              if isinstance(getattr(module, "weight", None), torch.Tensor)
              and tuple(module.weight.shape) == (experts, hidden) and name]
    routers = []
    for name in owners:
        # A wrapper around the router (a LoRA adapter's: the wrapped module is its ``base_layer``)
        # is the router as its block sees it.
        parent = name.rpartition(".")[0]
        while parent and getattr(modules[parent], "base_layer", None) is modules[name]:
            name, parent = parent, parent.rpartition(".")[0]
        if name not in routers:
            routers.append(name)
    blocks = [modules[name.rpartition(".")[0]] for name in routers]
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no router weight of shape [{experts}, {hidden}] found")
    return blocks


class _ExpertChoice(TorchFunctionMode):
    """Inside one MoE block's forward: finds its top-k over the experts; records its indices, or
    returns `forced` (rows where `mask` holds) with the top-k input's values there."""

    def __init__(self, experts: int, top_k: int, forced: torch.Tensor | None, mask: torch.Tensor | None):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.forced, self.mask = forced, mask
        self.chosen: torch.Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            x = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if k == self.top_k and x.dim() == 2 and dim in (-1, 1) and x.shape[1] == self.experts:
                return self._choose(func(*args, **kwargs), x)
        return func(*args, **kwargs)

    def _choose(self, result, scores: torch.Tensor):
        if self.chosen is not None:
            raise RuntimeError("an MoE block chose its experts twice in one forward: routing replay does not "
                               "know which choice to record or force")
        values, indices = result
        if self.forced is not None:
            if self.forced.shape[0] != indices.shape[0]:
                raise ValueError(f"routing replay: {self.forced.shape[0]} forced rows for a forward of "
                                 f"{indices.shape[0]} tokens")
            indices = torch.where(self.mask[:, None], self.forced.to(indices.dtype), indices)
            values = scores.gather(-1, indices)
        self.chosen = indices
        return torch.return_types.topk((values, indices))


class ExpertRouting:
    """Hooks on every MoE block of `model` (installed here, for the model's life): while
    `recording`, each forward's choices are kept (`take`); while a routing is `force`d, every forward
    uses it (also a recomputation under gradient checkpointing, which runs after the forward
    returned: forcing lasts until the next `force` or `clear`). Otherwise the hooks do nothing."""

    def __init__(self, model: nn.Module):
        self.blocks = moe_blocks(model)
        self.experts, self.top_k = expert_shape(model)
        self.dtype = routing_dtype(self.experts)
        self.recording = False
        self._forced: torch.Tensor | None = None  # [T, layers, k]
        self._mask: torch.Tensor | None = None  # [T] bool
        self._chosen: list[torch.Tensor | None] = [None] * len(self.blocks)
        self._open: list[_ExpertChoice] = []
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(self._enter_hook(i))
            block.register_forward_hook(self._exit_hook(i))

    @property
    def layers(self) -> int:
        return len(self.blocks)

    def _enter_hook(self, i: int):
        def hook(module, args):
            # `module is not` the block: a deep copy of the model (an engine's) carries these hooks too
            if module is not self.blocks[i] or (not self.recording and self._forced is None):
                return
            forced = self._forced[:, i] if self._forced is not None else None
            mode = _ExpertChoice(self.experts, self.top_k, forced, self._mask)
            mode.__enter__()
            self._open.append(mode)
        return hook

    def _exit_hook(self, i: int):
        def hook(module, args, output):
            if module is not self.blocks[i] or not self._open:
                return
            mode = self._open.pop()
            mode.__exit__(None, None, None)
            if mode.chosen is None:
                raise RuntimeError(f"MoE block {i} ({type(module).__name__}) made no top-{self.top_k} choice over "
                                   f"{self.experts} experts that routing replay could see")
            if self.recording:
                self._chosen[i] = mode.chosen
        return hook

    def _close_open(self) -> None:
        """A forward that raised inside a block leaves its mode entered: leave it."""
        while self._open:
            self._open.pop().__exit__(None, None, None)

    @contextmanager
    def recorded(self) -> Iterator["ExpertRouting"]:
        """Record the forwards run inside; `take` returns the last one's choices."""
        self.recording = True
        self._chosen = [None] * len(self.blocks)
        try:
            yield self
        finally:
            self.recording = False
            self._close_open()

    def take(self) -> np.ndarray:
        """[T, layers, top_k] (`dtype`) of the last recorded forward, on the CPU."""
        if any(c is None for c in self._chosen):
            raise RuntimeError("no recorded forward went through every MoE block")
        out = torch.stack([c.reshape(-1, self.top_k) for c in self._chosen], dim=1)
        self._chosen = [None] * len(self.blocks)
        return out.cpu().numpy().astype(self.dtype)

    def force(self, routing: torch.Tensor, mask: torch.Tensor) -> None:
        """Forwards from now on use ``routing[t]`` ([T, layers, top_k]) for the rows where ``mask[t]``
        ([T] bool) holds and their own choice elsewhere."""
        if routing.dim() != 3 or routing.shape[1:] != (self.layers, self.top_k) or mask.shape != routing.shape[:1]:
            raise ValueError(f"routing replay: routing of shape {tuple(routing.shape)} and mask {tuple(mask.shape)} "
                             f"for a model of {self.layers} MoE layers choosing {self.top_k} experts")
        if routing.numel() and int(routing.max()) >= self.experts:
            raise ValueError(f"routing replay: expert index {int(routing.max())} for a model of {self.experts} experts")
        self._forced, self._mask = routing.long(), mask.bool()

    def clear(self) -> None:
        self._forced = self._mask = None
        self._close_open()
