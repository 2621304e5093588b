"""Tree attention inside any Hugging Face causal LM, through transformers' attention registries.

Importing this module registers ``"clawfast_tree"`` in ``transformers.AttentionInterface`` and in
its mask registry. `use_tree_attention(lm)` sets a model's attention implementation to it (as
``set_attn_implementation`` would; no model class is patched). The attention function then does
one of two things per call:
- with the keyword ``tree_attention_args`` (a `TreeAttentionArgs`, which HF decoders pass from the
  backbone's ``forward`` down to every attention call, recomputations under gradient checkpointing
  included): `clawfast.kernels.tree_attention` on the batch's `TreeMask`;
- without it (generation, a single causal chain, a dense mask): transformers' SDPA attention.
Inside `tree_batch()` the mask function returns no mask, so a tree batch builds nothing [N, N];
elsewhere it is SDPA's mask function.

Backends (`ATTENTION_BACKENDS`, the ``model.attention`` config field):
- ``auto``: one causal chain runs on SDPA's causal attention (exact, no mask); anything else runs
  `tree_attention` with its own choice (Triton on CUDA, the torch fast path on CPU).
- ``torch`` / ``triton`` / ``flex``: `tree_attention` with that backend (flex: no CPU backward).
- ``sdpa-dense``: SDPA with a dense additive [1, 1, N, N] mask: the reference the tests compare
  against; O(N^2) memory.

Supported: decoders whose attention calls ``ALL_ATTENTION_FUNCTIONS`` with ``**kwargs`` (Qwen2/3,
Llama, Mistral, Gemma, Phi-3, ... in transformers >= 4.48). A sliding window shorter than the
batch's deepest path, attention dropout during training, logit soft-capping and attention sinks
raise instead of being ignored.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from clawfast.kernels import TreeMask, tree_attention

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flex", "sdpa-dense")
IMPLEMENTATION = "clawfast_tree"
# Keywords through which HF attention modules change the softmax; tree attention does not model them.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")
_IN_TREE_BATCH = contextvars.ContextVar("clawfast_in_tree_batch", default=False)


@dataclass(frozen=True)
class TreeAttentionArgs:
    """What every layer's attention call needs of the batch: the mask, the backend, and the largest
    position id (to check sliding windows against)."""

    mask: TreeMask
    backend: str
    max_position: int


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               tree_attention_args: TreeAttentionArgs | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention-function signature: query [1, Hq, N, D], key/value [1, Hkv, N, D] ->
    ([1, N, Hq, D], None)."""
    if tree_attention_args is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    args = tree_attention_args
    name = type(module).__name__
    if attention_mask is not None:
        raise RuntimeError(f"{name} received an attention mask beside the tree mask; tree batches take none")
    if dropout:
        raise NotImplementedError(f"{name}: attention dropout ({dropout}) is not supported by tree attention; "
                                  "set the model's attention_dropout to 0")
    window = kwargs.get("sliding_window")
    if window is not None and args.max_position >= window:
        raise NotImplementedError(f"{name} uses a sliding window of {window} tokens and the batch has paths of "
                                  f"{args.max_position + 1}: tree attention attends to whole paths")
    for kw in _UNSUPPORTED_KWARGS:
        if kwargs.get(kw) is not None:
            raise NotImplementedError(f"{name} passes {kw!r} to its attention: not supported by tree attention")
    if query.shape[0] != 1:
        raise ValueError(f"a tree batch is one packed row sequence (batch size 1), got {query.shape[0]}")
    out = tree_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                         args.mask, scale=scaling, backend=args.backend)
    return out[None], None


def _mask(*args, **kwargs):
    """No mask inside a tree batch (tree attention reads kv_end); SDPA's mask everywhere else."""
    return None if _IN_TREE_BATCH.get() else sdpa_mask(*args, **kwargs)


AttentionInterface.register(IMPLEMENTATION, _attention)
AttentionMaskInterface.register(IMPLEMENTATION, _mask)


def use_tree_attention(lm: torch.nn.Module) -> None:
    """Set ``lm``'s attention implementation (and its sub-configs') to ``"clawfast_tree"``."""
    lm.config._attn_implementation = IMPLEMENTATION


@contextmanager
def tree_batch() -> Iterator[None]:
    """The backbone forward of a tree batch: the model builds no attention mask inside."""
    token = _IN_TREE_BATCH.set(True)
    try:
        yield
    finally:
        _IN_TREE_BATCH.reset(token)
