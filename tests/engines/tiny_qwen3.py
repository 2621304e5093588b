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
