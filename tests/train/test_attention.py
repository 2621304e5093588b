"""Tree attention inside Hugging Face models (`clawfast.train.attention` through `Policy`).

Each backend must give the dense-mask reference's hidden states and parameter gradients on several
decoder families (and, for sliding windows, soft-capping and sinks, those of each path run alone),
leave the model's own attention implementation in place outside tree batches, and never build an
[N, N] tensor; attention dropout must train reproducibly (checkpointing included).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import clawfast.train.attention as attention_module
from clawfast.kernels import TreeMask, tree_mask_ref
from clawfast.train.attention import IMPLEMENTATION, IMPLEMENTATIONS, TreeAttentionArgs, use_tree_attention
from clawfast.train.policy import Policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from kernel_testing import LargestTensor, random_forest, segment_forest  # noqa: E402

VOCAB = 50
FAMILIES = {
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 16}),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {"pad_token_id": 0}),
}


# Decoders whose attention changes the softmax: a sliding window (Mistral, on SDPA), Gemma 2's
# soft-capped logits beside local/global layers (eager, as HF runs it), gpt-oss's sinks (eager).
OPTION_FAMILIES = {
    "mistral-window": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 5}, "sdpa"),
    "gemma2-softcap-window": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
                              {"head_dim": 16, "sliding_window": 4, "attn_logit_softcapping": 0.5,
                               "query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "full_attention"],
                               "final_logit_softcapping": None},  # Policy refuses a final soft-cap (test_policy_head.py)
                              "eager"),
    "gptoss-sinks-window": (tf.GptOssConfig, tf.GptOssForCausalLM,
                            {"head_dim": 16, "sliding_window": 6, "num_local_experts": 4, "num_experts_per_tok": 2,
                             "layer_types": ["sliding_attention", "full_attention"]}, "eager"),
}


# float32 models on the Triton path (which takes float32 at most) against the same model on another
# path: both round to float32, a wrong key set or option moves results by O(1).
TRITON_TOL = 1e-4


def tiny_lm(family: str, dtype=torch.float64, **extra):
    config_cls, model_cls, kw, implementation = (*FAMILIES[family], "sdpa") if family in FAMILIES else \
        OPTION_FAMILIES[family]
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
    config = config_cls(**{**shape, **kw, **extra})
    config._attn_implementation = implementation
    config._experts_implementation = "eager"  # MoE (gpt-oss): the per-expert loop runs in float64
    torch.manual_seed(0)
    return model_cls(config).to(dtype)


def forest_batch(n: int, seed: int):
    """(input_ids, position_ids = depth, kv_end) of a random bushy forest of n rows."""
    parent, ids, kv_end = random_forest(n, torch.Generator().manual_seed(seed), roots=3)
    depth = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        depth[i] = 0 if parent[i] < 0 else depth[parent[i]] + 1
    return ids.long() % VOCAB, depth, kv_end.long()


def segment_batch(n: int, seed: int, **kw):
    """(input_ids, position_ids = depth, kv_end) of a harness-shaped forest (`segment_forest`)."""
    kv_end = segment_forest(n, torch.Generator().manual_seed(seed), **kw).long()
    # depth = number of ancestors (j < i <= kv_end[j]): a stack of the open rows' ends in DFS order
    depth, stack = torch.zeros(n, dtype=torch.long), []
    for i, end in enumerate(kv_end.tolist()):
        while stack and stack[-1] < i:
            stack.pop()
        depth[i] = len(stack)
        stack.append(end)
    return torch.arange(n) % VOCAB, depth, kv_end


def hidden_and_grads(lm, attention: str, batch):
    lm.zero_grad(set_to_none=True)
    hidden = Policy(lm, attention=attention).hidden_states(*batch)
    gen = torch.Generator().manual_seed(1)
    (hidden * torch.randn(hidden.shape, generator=gen, dtype=hidden.dtype)).sum().backward()
    return hidden.detach(), {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("attention", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_hidden_states_and_gradients_match_the_dense_mask(family, attention):
    # the Triton kernels take float32 at most (float64 is the torch path's): float32 rounding bounds
    # that comparison, where a wrong key set would move the results by O(1)
    dtype, tol = (torch.float32, TRITON_TOL) if attention == "triton" else (torch.float64, 1e-10)
    lm = tiny_lm(family, dtype)
    batch = forest_batch(90, seed=len(family))
    want_h, want_g = hidden_and_grads(lm, "sdpa-dense", batch)
    got_h, got_g = hidden_and_grads(lm, attention, batch)
    assert float((got_h - want_h).abs().max()) <= tol * float(want_h.abs().max())
    assert want_g.keys() == got_g.keys() and len(got_g) > 10
    for name, g in want_g.items():
        assert float((got_g[name] - g).abs().max()) <= tol * max(1.0, float(g.abs().max())), name


def test_gradient_checkpointing_recomputes_with_tree_attention():
    # the recomputation runs in backward, outside Policy: it must still attend the tree
    batch = segment_batch(120, seed=4, max_segment=30)
    lm = tiny_lm("qwen3").train()
    want_h, want_g = hidden_and_grads(lm, "torch", batch)
    lm.gradient_checkpointing_enable()
    got_h, got_g = hidden_and_grads(lm, "torch", batch)
    assert float((got_h - want_h).abs().max()) <= 1e-12
    for name, g in want_g.items():
        assert float((got_g[name] - g).abs().max()) <= 1e-10 * max(1.0, float(g.abs().max())), name


# (Gemma 2's eager attention turns a left-padded row into NaN on its own: no padding there.)
@pytest.mark.parametrize("family, base, left_pad", [("llama", "sdpa", 5), ("gemma2-softcap-window", "eager", 0)])
def test_outside_tree_batches_the_model_attends_with_its_own_implementation(family, base, left_pad):
    # what a copy of the policy's model (the torch engine's) does: padded batches, explicit masks,
    # sliding windows and soft-capping as the model's own attention does them
    lm = tiny_lm(family)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[1, :left_pad] = 0
    with torch.no_grad():
        want = lm(input_ids=ids, attention_mask=pad).logits
        Policy(lm)
        assert lm.config._attn_implementation == IMPLEMENTATIONS[base]
        got = lm(input_ids=ids, attention_mask=pad).logits
    assert float((got - want)[pad.bool()].abs().max()) <= 1e-12


def test_only_sdpa_and_eager_models_are_switched():
    lm = tiny_lm("llama")
    lm.config._attn_implementation_internal = "flex_attention"
    with pytest.raises(ValueError, match="'flex_attention'.*\\['eager', 'sdpa'\\]"):
        use_tree_attention(lm)
    lm.config._attn_implementation_internal = "sdpa"
    use_tree_attention(lm)
    use_tree_attention(lm)  # already switched: unchanged
    assert lm.config._attn_implementation == IMPLEMENTATION


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_flex_forward_matches_the_dense_mask(family):
    lm = tiny_lm(family, torch.float32)
    batch = forest_batch(150, seed=3)
    with torch.no_grad():
        want = Policy(lm, attention="sdpa-dense").hidden_states(*batch)
        got = Policy(lm, attention="flex").hidden_states(*batch)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_one_chain_uses_the_models_causal_attention_under_auto(monkeypatch):
    lm = tiny_lm("qwen3")
    n = 40
    ids, pos, kv_end = torch.arange(n) % VOCAB, torch.arange(n), torch.full((n,), n - 1)
    calls = []
    real = attention_module.tree_attention
    monkeypatch.setattr(attention_module, "tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        auto = Policy(lm, attention="auto").hidden_states(ids, pos, kv_end)
        assert calls == []
        tree = Policy(lm, attention="torch").hidden_states(ids, pos, kv_end)
        assert len(calls) == 2  # one per layer
    assert float((auto - tree).abs().max()) <= 1e-10


def _largest_tensor_of_a_step(policy: Policy, n: int, seed: int) -> tuple[int, str]:
    ids, depth, kv_end = segment_batch(n, seed, max_segment=512, p_close=0.6)
    with LargestTensor() as seen:
        out = policy(ids, depth, kv_end, torch.arange(n - 1), ids[1:])
        out.logprobs.sum().backward()
    return seen.numel, seen.op


def test_a_65k_row_tree_batch_never_allocates_a_quadratic_tensor():
    n = 65536
    lm = tiny_lm("qwen3", torch.float32, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=n)
    numel, op = _largest_tensor_of_a_step(Policy(lm, attention="torch"), n, seed=0)
    # a dense mask or score matrix would hold n^2 = 4.3e9 elements; the largest tensors here are
    # O(N) activations and bounded chunks (scores, logits)
    assert numel <= 256 * n, (numel, op)


def test_the_memory_check_catches_the_dense_mask():
    n = 4096
    lm = tiny_lm("qwen3", torch.float32, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=n)
    numel, _ = _largest_tensor_of_a_step(Policy(lm, attention="sdpa-dense"), n, seed=0)
    assert numel >= n * n


def paths_alone(backbone, ids, kv_end, weights):
    """Hidden states of every row with its path run alone through the model's own attention (one
    causal sequence, positions from 0), and the gradients of sum(weights * hidden) that way: each
    row counted once, from the first leaf's path that holds it (a row depends on its ancestors only)."""
    n = kv_end.shape[0]
    allowed = tree_mask_ref(kv_end)
    hidden = torch.empty(n, backbone.config.hidden_size, dtype=weights.dtype)
    done = torch.zeros(n, dtype=torch.bool)
    loss = 0.0
    for leaf in torch.nonzero(kv_end == torch.arange(n)).flatten().tolist():
        path = torch.nonzero(allowed[leaf]).flatten()
        h = backbone(input_ids=ids[path][None], position_ids=torch.arange(len(path))[None],
                     use_cache=False).last_hidden_state[0]
        new = ~done[path]
        hidden[path[new]] = h[new].detach()
        loss = loss + (h[new] * weights[path[new]]).sum()
        done[path] = True
    loss.backward()
    return hidden


@pytest.mark.parametrize("family", sorted(OPTION_FAMILIES))
@pytest.mark.parametrize("attention", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_window_softcap_and_sinks_match_each_path_alone(family, attention):
    """The keystone rule on models whose softmax has options: a tree batch gives every row the
    hidden state and the gradients of its path attended alone by the model's own implementation
    (the dense tree mask cannot serve as the reference here: HF applies no window to a given mask)."""
    dtype = torch.float32 if attention == "triton" else torch.float64  # the Triton kernels take float32 at most
    lm = tiny_lm(family, dtype)
    ids, pos, kv_end = segment_batch(70, seed=2, max_segment=14)
    assert int(pos.max()) >= 2 * max(lm.config.sliding_window, 1)  # paths much longer than the window
    weights = torch.randn(70, lm.config.hidden_size, generator=torch.Generator().manual_seed(3), dtype=dtype)
    policy = Policy(lm, attention=attention)
    lm.zero_grad(set_to_none=True)
    got = policy.hidden_states(ids, pos, kv_end)
    (got * weights).sum().backward()
    got_g = {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad(set_to_none=True)
    want = paths_alone(policy.backbone, ids, kv_end, weights)
    want_g = {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}
    # Float32 inside these float64 models bounds what the comparison can show: Gemma 2's eager
    # softmax runs in float32, and every RMSNorm casts to float32 and back, so parameter gradients
    # summed over the paths' repeated rows in another order agree to float32 rounding. A wrong key
    # set or a missing option moves them by O(1). (The kernels' float64 checks hold 1e-10 with
    # window, softcap and sinks.) In a float32 model (Triton's) float32 rounding bounds both.
    tol = TRITON_TOL if dtype == torch.float32 else 1e-6 if family.startswith("gemma2") else 1e-10
    assert float((got.detach() - want).abs().max()) <= tol * float(want.abs().max())
    assert want_g.keys() == got_g.keys() and len(got_g) > 10
    if family.startswith("gptoss"):
        assert any(name.endswith("sinks") for name in got_g)
    grad_tol = TRITON_TOL if dtype == torch.float32 else 2e-6
    for name, g in want_g.items():
        assert float((got_g[name] - g).abs().max()) <= grad_tol * max(1.0, float(g.abs().max())), name


@pytest.mark.parametrize("checkpointing", [False, True])
def test_attention_dropout_trains_on_tree_batches(checkpointing):
    """A training module's attention dropout runs in tree batches: drawn from torch's generator
    (reproducible under a seed), the same on the torch path and Triton, and the same mask again
    when gradient checkpointing recomputes the layer in backward."""
    batch = segment_batch(80, seed=5, max_segment=20)
    lm = tiny_lm("qwen3", attention_dropout=0.3)

    def run(attention, train=True, checkpoint=False):
        lm.train(train)
        if checkpoint:
            lm.gradient_checkpointing_enable()
        torch.manual_seed(0)
        out = hidden_and_grads(lm, attention, batch)
        lm.gradient_checkpointing_disable()
        return out

    h, g = run("torch")
    h_eval, _ = run("torch", train=False)
    assert float((h - h_eval).abs().max()) > 1e-2  # dropout acted
    h2, g2 = run("torch", checkpoint=checkpointing)
    assert float((h2 - h).abs().max()) <= 1e-12
    for name, grad in g.items():
        assert float((g2[name] - grad).abs().max()) <= 1e-10 * max(1.0, float(grad.abs().max())), name


@pytest.mark.triton
def test_attention_dropout_is_the_same_on_triton():
    batch = segment_batch(60, seed=6, max_segment=20)
    lm = tiny_lm("qwen3", torch.float32, attention_dropout=0.3).train()
    torch.manual_seed(1)
    want_h, want_g = hidden_and_grads(lm, "torch", batch)
    torch.manual_seed(1)
    got_h, got_g = hidden_and_grads(lm, "triton", batch)
    assert float((got_h - want_h).abs().max()) <= TRITON_TOL * float(want_h.abs().max())
    for name, grad in want_g.items():
        assert float((got_g[name] - grad).abs().max()) <= TRITON_TOL * max(1.0, float(grad.abs().max())), name


def test_a_dense_position_bias_is_refused_with_the_way_out():
    attention = ALL_ATTENTION_FUNCTIONS[IMPLEMENTATION]
    q = torch.randn(1, 2, 5, 4)
    args = TreeAttentionArgs(TreeMask(torch.full((5,), 4)), "torch")
    with pytest.raises(ValueError, match="dense 'position_bias'.*sdpa-dense"):
        attention(torch.nn.Module(), q, q, q, None, tree_attention_args=args, position_bias=torch.zeros(1, 2, 5, 5))


def test_bad_backend_name():
    with pytest.raises(ValueError, match="attention must be one of"):
        Policy(tiny_lm("qwen3"), attention="dense")



def test_build_policy_applies_the_model_section(tmp_path):
    from loop_fixtures import make_tiny_model

    from clawfast.train.config import RunConfig
    from clawfast.train.build import build_policy

    model_dir = make_tiny_model(tmp_path / "model")
    config = RunConfig.model_validate({"model": {"path": str(model_dir), "attention": "torch",
                                                 "gradient_checkpointing": True}})
    policy = build_policy(config, model_dir)
    assert policy.attention == "torch" and policy.lm.is_gradient_checkpointing
    assert policy.lm.config._attn_implementation == IMPLEMENTATION


def test_layers_a_tree_batch_cannot_compute_are_refused():
    # Llama 4's chunked attention and Qwen3-Next's linear attention take their locality or state from
    # the mask or the row order: a packed tree batch would silently compute something else.
    chunked = tf.Llama4ForCausalLM(tf.Llama4TextConfig(
        hidden_size=16, intermediate_size=32, intermediate_size_mlp=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, vocab_size=64, attention_chunk_size=4, num_local_experts=2))
    with pytest.raises(ValueError, match=r"Llama4ForCausalLM has \['chunked_attention'\] layers"):
        use_tree_attention(chunked)
    linear = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, vocab_size=64, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
        linear_value_head_dim=8))
    with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM has \['linear_attention'\] layers"):
        Policy(linear)


def test_an_encoders_chunked_attention_does_not_refuse_the_decoder():
    # Gemma 4's audio tower attends in chunks; its text decoder, which runs the tree batch, does not.
    config = tf.Gemma4Config(audio_config=tf.Gemma4AudioConfig(), vision_config=tf.Gemma4VisionConfig())
    assert config.audio_config.attention_chunk_size
    holder = torch.nn.Module()
    holder.config = config
    for sub in attention_module._configs(config):
        sub._attn_implementation_internal = "sdpa"
    use_tree_attention(holder)
    assert config.get_text_config()._attn_implementation_internal == IMPLEMENTATION
