"""The policy: any Hugging Face causal LM run on a packed prefix-tree batch (docs/TREE.md).

`Policy` wraps a causal LM (anything `AutoModelForCausalLM` loads whose attention goes through
transformers' attention registry and which takes explicit ``position_ids``: Qwen3, Llama-style and
other decoders). One call of `Policy` runs the backbone on the rows of a `PackedBatch` under the
tree mask (row j visible to row i iff ``j <= i <= kv_end[j]``; position ids are depths, so every
path sees the positions it would see alone), and turns the final hidden states into the log-probs
of the (row, token) targets with the fused `clawfast.kernels.tree_logprobs` using the LM head
weight, on the rows that predict a target only (prompt and context rows need no logits): the
[N, V] logits are never materialised. An optional value head (one Linear on the final
hidden state) gives PPO its values.

Attention (``attention``, `clawfast.train.attention.ATTENTION_BACKENDS`): `Policy` switches the
model's attention implementation to the tree one over its own (`clawfast.train.attention`): tree
attention from ``kv_end`` (`clawfast.kernels.tree_attention`, block-sparse, no [N, N] tensor) for
tree batches, the model's own SDPA or eager attention for every other call (generation on a copy
of the model, single chains); or ``"sdpa-dense"``, the model's own attention with a dense additive
[1, 1, N, N] mask (the reference; O(N^2) memory).

Everything happens inside ``forward`` on purpose: FSDP2 (`clawfast.train.fsdp`) gathers a sharded
module's parameters only around its ``forward``, and the LM head weight must be whole when the
fused kernel reads it.

Guaranteed: for every target, the log-prob its path gives when run alone as a plain causal
sequence (tests/test_keystone.py, tests/train/test_step_equivalence.py), with every backend.

RL passes (`rl_mode`, which `clawfast.train.step.train_step` applies first): the policy in train
mode (so gradient checkpointing recomputes) with every dropout off (so the proximal pass, the IS
weights and each update's forward see one function, the one the engine samples from). The cold
start's supervised passes keep the model's dropout (`clawfast.train.coldstart.sft_epoch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from clawfast.kernels import TreeMask, tree_logprobs
from clawfast.moe_routing import ExpertRouting
from clawfast.train.attention import ATTENTION_BACKENDS, TreeAttentionArgs, tree_batch, use_tree_attention
from clawfast.tree_mask import dense_tree_mask


# Train-mode-only noise that HF modules read from a plain number attribute (not an nn.Dropout):
# the attention modules' ``dropout=0.0 if not self.training else self.attention_dropout``, and the
# router jitter of Mixtral-style MoE blocks (``if self.training and self.jitter_noise > 0``).
NOISE_ATTRIBUTES = ("attention_dropout", "jitter_noise")
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def rl_mode(policy: nn.Module) -> nn.Module:
    """Put `policy` (in place; returned) in the mode every RL pass runs in: train mode, because
    transformers checkpoints a decoder layer only while it trains (``model.gradient_checkpointing``
    is otherwise a no-op), and no dropout at all, because the PPO ratio pi / pi_prox and the IS
    weights compare passes of one function: with a fresh dropout mask per pass, the ratio is not 1 at
    unchanged weights, and none of them is the function the engine sampled from (engines run in eval
    mode). As TRL's RL trainers do (``disable_dropout_in_model``): every dropout module's ``p`` (peft's
    ``lora_dropout`` included) and every `NOISE_ATTRIBUTES` number become 0, for good (the run's cold
    start, which keeps them, comes before its first RL step). `clawfast.train.step.train_step` calls
    this first, so any policy given to it (or to `train_on_rollouts`) is in this mode; a caller of the
    step's parts alone (`fix_step`, `accumulate_gradients`) calls it itself. The torch engine and the
    reference policy run copies of their own in eval mode: this does not touch them."""
    policy.train()
    for module in policy.modules():
        if isinstance(module, DROPOUTS):
            module.p = 0.0
        for name in NOISE_ATTRIBUTES:
            value = getattr(module, name, None)
            # a number only: some models name an nn.Dropout submodule "attention_dropout" (zeroed above)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                setattr(module, name, 0.0)
    return policy


@dataclass
class PolicyOutput:
    """logprobs[M] and entropy[M] (of each target's predicting row; float32 or float64, with grad),
    values[N] (every row; None without a value head)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor | None


@dataclass
class BatchTensors:
    """The PackedBatch fields the forward needs, as long tensors on one device."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    kv_end: torch.Tensor
    target_rows: torch.Tensor
    target_ids: torch.Tensor

    @classmethod
    def from_batch(cls, batch, device: torch.device | str) -> "BatchTensors":
        def t(a: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a), dtype=torch.long, device=device)

        return cls(t(batch.input_ids), t(batch.position_ids), t(batch.kv_end), t(batch.target_rows),
                   t(batch.target_ids))


class _HiddenOnly:
    """A backbone's output holding only final hidden states (every other field None), for
    `check_logits_are_the_head`."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str):
        return None

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.last_hidden_state,)[index]


def check_logits_are_the_head(lm: nn.Module) -> None:
    """Refuse a causal LM whose forward changes its logits past the LM head (Gemma 2's final
    soft-cap, Cohere's and Granite's logit scales, a head with a bias): the fused log-probs compute
    ``hidden @ head.weight.T`` and would train another distribution than the one the engines sample
    from. Probed, not looked up by model type: the backbone is stood in for by hidden states whose
    logits reach +-40, where a soft-cap or a scale shows, and the model's own logits are compared
    with the head's product."""
    head = lm.get_output_embeddings()
    weight, backbone = head.weight, lm.base_model
    with torch.no_grad():
        hidden = torch.randn(1, 3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        hidden = hidden.to(weight.device, weight.dtype)
        hidden = hidden * (40.0 / torch.nn.functional.linear(hidden, weight).float().abs().max().clamp_min(1e-6))
        want = torch.nn.functional.linear(hidden, weight).float()
        backbone.forward = lambda *args, **kwargs: _HiddenOnly(hidden)
        try:
            got = lm(input_ids=torch.zeros(1, 3, dtype=torch.long, device=weight.device), use_cache=False).logits
        finally:
            del backbone.forward  # the class's own forward again
    got = got.float()
    diff = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    if not diff <= 1e-3 * float(want.abs().max()):
        raise ValueError(
            f"{type(lm).__name__} changes its logits past the LM head (max difference {diff:.3g} from "
            f"hidden @ head.weight.T on logits up to {float(want.abs().max()):.3g}: a final soft-cap such as "
            f"final_logit_softcapping, a logit scale, or a head bias); clawfast's fused log-probs compute "
            f"hidden @ head.weight.T only, so training would follow another distribution than the one sampled")


class Policy(nn.Module):
    """A causal LM (``lm``) plus an optional scalar value head, run on packed tree batches."""

    def __init__(self, lm: nn.Module, *, value_head: bool = False, temperature: float = 1.0,
                 attention: str = "auto"):
        super().__init__()
        if lm.get_output_embeddings() is None:
            raise ValueError(f"{type(lm).__name__} has no output embedding (LM head)")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
        check_logits_are_the_head(lm)
        use_tree_attention(lm)
        self.lm = lm
        self.expert_routing: ExpertRouting | None = None  # installed by the first batch with recorded routing
        self.attention = attention
        self.temperature = float(temperature)
        hidden = lm.get_output_embeddings().weight.shape[1]
        self.value_head = nn.Linear(hidden, 1) if value_head else None
        if self.value_head is not None:
            # A zero head starts every value at 0: no random bias in the first advantages.
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
            self.value_head.to(dtype=lm.get_output_embeddings().weight.dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32, value_head: bool = False,
                        temperature: float = 1.0, attention: str = "auto") -> "Policy":
        """Load a local HF causal-LM directory (config + weights). Nothing is downloaded."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        return cls(lm, value_head=value_head, temperature=temperature, attention=attention)

    @property
    def backbone(self) -> nn.Module:
        """The decoder stack without the LM head (``lm.model`` for Qwen3/Llama-style models)."""
        return self.lm.base_model

    @property
    def dtype(self) -> torch.dtype:
        return self.lm.get_output_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm.get_output_embeddings().weight.device

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_end: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, d] of the rows under the tree mask (final norm applied)."""
        n = kv_end.shape[0]
        ids, pos = input_ids[None], position_ids[None]
        if self.attention == "sdpa-dense":
            mask = dense_tree_mask(kv_end, self.dtype, device=input_ids.device)
            return self.backbone(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).last_hidden_state[0]
        if self.attention == "auto" and n and bool((kv_end == n - 1).all()):
            # one causal chain (a flat sample): the model's own causal attention is exact
            return self.backbone(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
        args = TreeAttentionArgs(TreeMask(kv_end), self.attention)
        with tree_batch():
            out = self.backbone(input_ids=ids, position_ids=pos, use_cache=False, tree_attention_args=args)
        return out.last_hidden_state[0]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_end: torch.Tensor,
                target_rows: torch.Tensor, target_ids: torch.Tensor) -> PolicyOutput:
        """Log-probs of the targets, the entropy at each target's row, values of every row."""
        hidden = self.hidden_states(input_ids, position_ids, kv_end)
        weight = self.lm.get_output_embeddings().weight
        rows, target_row_index = torch.unique(target_rows, return_inverse=True)
        logprobs, row_entropy = tree_logprobs(hidden[rows], weight, target_row_index, target_ids,
                                              temperature=self.temperature)
        values = None
        if self.value_head is not None:
            values = self.value_head(hidden)[:, 0].float()
        return PolicyOutput(logprobs, row_entropy[target_row_index], values)

    def run(self, batch) -> PolicyOutput:
        """``forward`` on a PackedBatch (numpy arrays moved to the policy's device), its rows routed
        to the experts recorded in ``batch.routing`` where ``batch.routing_rows`` holds (an MoE policy
        under routing replay; the rest by the policy's routers)."""
        bt = BatchTensors.from_batch(batch, self.device)
        self._route(batch)
        return self(bt.input_ids, bt.position_ids, bt.kv_end, bt.target_rows, bt.target_ids)

    def _route(self, batch) -> None:
        """Force the batch's recorded routing until the next batch (a recomputation under gradient
        checkpointing runs during ``backward``, after this forward returned)."""
        routing = getattr(batch, "routing", None)
        if routing is None:
            if self.expert_routing is not None:
                self.expert_routing.clear()
            return
        if self.expert_routing is None:
            self.expert_routing = ExpertRouting(self.lm)
        self.expert_routing.force(torch.as_tensor(routing.astype(np.int64), device=self.device),
                                  torch.as_tensor(batch.routing_rows, device=self.device))
