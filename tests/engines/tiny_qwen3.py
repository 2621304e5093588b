"""The tiny Qwen3 the engine tests serve: small enough for a CPU, and shaped for vLLM's CPU attention
backend (which refuses head_dim 16; docs/ENGINES.md)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 384
MAX_LEN = 256
EOS = VOCAB - 1


def tiny_qwen3(seed: int = 1) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=MAX_LEN,
        # Wide init: peaked next-token distributions, so greedy argmax is not decided by 1e-6 ties.
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=VOCAB - 2,
        pad_token_id=VOCAB - 3,
    )
    return transformers.Qwen3ForCausalLM(config).eval()


def adapted(model_dir, seed: int, rank: int = 4, targets="all-linear") -> transformers.Qwen3ForCausalLM:
    """The model saved in `model_dir`, in fp32, with a peft LoRA adapter (`clawfast.train.lora.add_lora`)
    of random weights, big enough to move every log-prob."""
    from clawfast.train.lora import add_lora

    lm = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    add_lora(lm, rank=rank, alpha=2 * rank, target_modules=targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return lm
