"""Tiny mixture-of-experts decoders, built from a config with random weights (nothing downloaded), for
the tests that check MoE policies end to end: `MOE_FAMILIES` are Qwen3-MoE and Mixtral, every layer
sparse, 8 experts of which 2 route each token. A wide init keeps the router far from ties, so two
computations of the same logits (packed and alone) pick the same experts."""

from __future__ import annotations

import torch

MOE_FAMILIES = ("qwen3_moe", "mixtral")


def tiny_moe(family: str, *, vocab_size: int, hidden: int = 64, layers: int = 2, seed: int = 0,
             attn: str = "sdpa", max_len: int = 1024, init: float = 0.2, **extra) -> torch.nn.Module:
    """A float32 causal LM of `family` in eval mode; `init`: the weights' initializer range (wide by
    default, see above; transformers' own is 0.02); `extra` goes to its config."""
    import transformers

    shape = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=max_len,
                 num_experts_per_tok=2, attn_implementation=attn, initializer_range=init, **extra)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=hidden // 2,
                                             intermediate_size=hidden * 2, decoder_sparse_step=1,
                                             norm_topk_prob=True, **shape)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=8, intermediate_size=hidden // 2, **shape)
        cls = transformers.MixtralForCausalLM
    else:
        raise ValueError(f"unknown MoE family {family!r}; known: {MOE_FAMILIES}")
    torch.manual_seed(seed)
    return cls(config).to(torch.float32).eval()


def near_tie_routers(model: torch.nn.Module, *, spread: float = 1e-6, seed: int = 0) -> torch.nn.Module:
    """Make every router score its experts almost alike (one shared row plus `spread` times noise):
    which experts a token goes to is then decided by float rounding, so two computations of the
    same logits (the sampler's, the trainer's) choose differently; the experts themselves still
    differ, so a different choice changes the output. The worst case for routing replay to fix."""
    from clawfast.moe_routing import expert_shape, moe_blocks

    experts, _ = expert_shape(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in moe_blocks(model):
            for module in block.modules():
                w = getattr(module, "weight", None)
                if isinstance(w, torch.Tensor) and tuple(w.shape) == (experts, model.config.hidden_size):
                    shared = torch.randn(w.shape[1], generator=g) * 0.2
                    w.copy_(shared + spread * torch.randn(w.shape, generator=g))
    return model
