"""Tree attention inside any Hugging Face causal LM, through transformers' attention registries.

Importing this module registers ``"clawfast_tree"`` (over SDPA) and ``"clawfast_tree_eager"``
(over the model's eager attention) in ``transformers.AttentionInterface`` and in its mask registry.
`use_tree_attention(lm)` switches a model from ``"sdpa"`` / ``"eager"`` to the matching one (as
``set_attn_implementation`` would; no model class is patched). The attention function then does one
of two things per call:
- with the keyword ``tree_attention_args`` (a `TreeAttentionArgs`, which HF decoders pass from the
  backbone's ``forward`` down to every attention call, recomputations under gradient checkpointing
  included): `clawfast.kernels.tree_attention` on the batch's `TreeMask`;
- without it (generation, a single causal chain, a dense mask): the model's own implementation, with
  its own mask function (so an engine's copy of the policy's model samples exactly as before).
Inside `tree_batch()` the mask function returns no mask, so a tree batch builds nothing [N, N].
The base is kept in the implementation's name, so copies and pickles of the model keep it.

Backends (`ATTENTION_BACKENDS`, the ``model.attention`` config field):
- ``auto``: one causal chain runs on the model's own causal attention (exact, no tree mask);
  anything else runs `tree_attention` with its own choice (Triton on CUDA, the torch fast path on
  CPU).
- ``torch`` / ``triton`` / ``flex`` / ``varlen``: `tree_attention` with that backend (flex: no CPU
  backward; varlen: flash-attention's varlen kernel over the tree's path segments, CUDA and half
  precision only).
- ``sdpa-dense``: the model's own attention with a dense additive [1, 1, N, N] mask: the reference
  the tests compare against; O(N^2) memory.

Supported: decoders whose attention calls ``ALL_ATTENTION_FUNCTIONS`` with ``**kwargs`` (Qwen2/3,
Llama, Mistral, Gemma 1-3, Phi-3, gpt-oss, ... in transformers >= 4.48), with the softmax options
they pass: ``sliding_window`` (along each path), ``softcap`` (Gemma 2), ``s_aux`` (per-head sinks,
gpt-oss) and the attention ``dropout`` of a training module (its mask drawn by `tree_attention` from
torch's generator, so gradient checkpointing recomputes the same one). What tree attention does not
model raises instead of being ignored: layers of another kind than full or sliding-window attention
(`TREE_LAYER_TYPES`: Llama 4's chunked attention, hybrid models' linear-attention or state-space
layers), refused by `use_tree_attention`; a model-specific ``position_bias`` or ``sinks`` tensor
(Inkling 2's dense relative-position bias [B, H, N, N] and per-token sinks), which a tree batch
could only take as N^2 values.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import get_args

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from clawfast.kernels import TreeMask, tree_attention
from clawfast.train.config import AttentionBackend

ATTENTION_BACKENDS = get_args(AttentionBackend)
IMPLEMENTATION = "clawfast_tree"
# The model's own implementation each registered name falls back to outside tree batches. No name
# contains "flash": transformers reads that substring as a request for flash-attention inputs.
IMPLEMENTATIONS = {"sdpa": IMPLEMENTATION, "eager": IMPLEMENTATION + "_eager"}
# Keywords through which some HF attention modules add a dense [B, H, N, N] bias or per-token
# sinks to the softmax: inputs of N^2 values, which a tree batch never holds.
_DENSE_KWARGS = ("position_bias", "sinks")
_IN_TREE_BATCH = contextvars.ContextVar("clawfast_in_tree_batch", default=False)
# The layer kinds (a config's ``layer_types``) a tree batch computes: causal attention, whole or in a
# sliding window along each path. Other kinds take their locality or state from the mask or the row
# order (Llama 4's chunked attention, the linear-attention and state-space layers of hybrid models),
# which a packed tree batch does not carry.
TREE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass(frozen=True)
class TreeAttentionArgs:
    """What every layer's attention call needs of the batch: the mask and the backend."""

    mask: TreeMask
    backend: str


def _base_attention(base: str, module: torch.nn.Module) -> Callable:
    if base != "eager":
        return ALL_ATTENTION_FUNCTIONS[base]
    # a model's eager attention is its modeling file's function (what it passes HF as the default)
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__module__} has no eager_attention_forward to fall back to")
    return eager


def _tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                    args: TreeAttentionArgs, kwargs: dict) -> tuple[torch.Tensor, None]:
    name = type(module).__name__
    if attention_mask is not None:
        raise RuntimeError(f"{name} received an attention mask beside the tree mask; tree batches take none")
    for kw in _DENSE_KWARGS:
        if kwargs.get(kw) is not None:
            raise ValueError(f"{name} passes a dense {kw!r} to its attention, which tree attention (O(N), from "
                             "kv_end) cannot take: train this model with model.attention = 'sdpa-dense'")
    if query.shape[0] != 1:
        raise ValueError(f"a tree batch is one packed row sequence (batch size 1), got {query.shape[0]}")
    out = tree_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                         args.mask, scale=scaling, window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"),
                         sinks=kwargs.get("s_aux"), dropout_p=dropout, backend=args.backend)
    return out[None], None


def _register(base: str) -> None:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  tree_attention_args: TreeAttentionArgs | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """HF attention-function signature: query [1, Hq, N, D], key/value [1, Hkv, N, D] ->
        ([1, N, Hq, D], None)."""
        if tree_attention_args is None:
            return _base_attention(base, module)(module, query, key, value, attention_mask, dropout=dropout,
                                                 scaling=scaling, **kwargs)
        return _tree_attention(module, query, key, value, attention_mask, dropout, scaling, tree_attention_args,
                               kwargs)

    def mask(*args, **kwargs):
        """No mask inside a tree batch (tree attention reads kv_end); the base's mask everywhere else."""
        return None if _IN_TREE_BATCH.get() else ALL_MASK_ATTENTION_FUNCTIONS[base](*args, **kwargs)

    AttentionInterface.register(IMPLEMENTATIONS[base], attention)
    AttentionMaskInterface.register(IMPLEMENTATIONS[base], mask)


for _base in IMPLEMENTATIONS:
    _register(_base)


def _configs(config) -> Iterator:
    yield config
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            yield from _configs(sub)


def use_tree_attention(lm: torch.nn.Module) -> None:
    """Switch ``lm``'s attention implementation (and its sub-configs') from ``"sdpa"`` / ``"eager"``
    to the tree-attention one over it; a model already switched stays as it is. ValueError for a
    model with layers a tree batch cannot compute (`TREE_LAYER_TYPES`)."""
    # The decoder's layers run the tree batch; an encoder's sub-config (an audio tower's chunked
    # attention) does not.
    text = lm.config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ()) - TREE_LAYER_TYPES
    if getattr(text, "attention_chunk_size", None):
        kinds.add("chunked_attention")
    if kinds:
        raise ValueError(f"{type(lm).__name__} has {sorted(kinds)} layers, which tree attention does not "
                         f"model (it computes {sorted(TREE_LAYER_TYPES)} along each path)")
    for config in _configs(lm.config):
        impl = config._attn_implementation_internal
        if impl in IMPLEMENTATIONS.values():
            continue
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"{type(lm).__name__} uses attention {impl!r}; tree attention falls back to the model's "
                             f"own one outside tree batches and supports {sorted(IMPLEMENTATIONS)}: load the model "
                             "with one of those")
        config._attn_implementation_internal = IMPLEMENTATIONS[impl]


@contextmanager
def tree_batch() -> Iterator[None]:
    """The backbone forward of a tree batch: the model builds no attention mask inside."""
    token = _IN_TREE_BATCH.set(True)
    try:
        yield
    finally:
        _IN_TREE_BATCH.reset(token)
