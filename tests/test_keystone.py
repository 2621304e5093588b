"""Keystone: a packed tree batch gives every target the log-prob its path gives alone.

A tiny Qwen3ForCausalLM (built from a config, fp32, random weights) runs once per packed
micro-batch under the tree mask from `kv_end` and position ids = depth; every target's log-prob
must equal the one obtained by running the target's root-to-leaf path on its own as a plain causal
sequence. The mask is applied two ways: the model's own attention with the dense additive mask (the
reference form), and `Policy` with every tree-attention backend (no [N, N] tensor). This is the property the trainer relies on: deduplicated, tree-masked
training computes exactly the per-path log-probs; mixture-of-experts decoders (Qwen3-MoE, Mixtral:
`tiny_moe`) hold it too. Micro-batches that split a tree (re-included
context rows) are covered by small `micro_batch_tokens`.

Tolerance 1e-4: both sides are fp32 with identical weights and inputs; only the order of the
softmax/matmul reductions differs (measured differences are ~1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clawfast.pack import pack
from clawfast.pack_ref import pack_ref
from clawfast.synthetic import random_group
from clawfast.train.policy import Policy
from clawfast.tree import build_tree
from clawfast.tree_mask import dense_tree_mask
from clawfast.tree_ref import path_tokens

from tiny_moe import MOE_FAMILIES, tiny_moe

VOCAB = 24
ATOL = 1e-4


def tiny_qwen3(attn: str = "eager"):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        attn_implementation=attn,
    )
    torch.manual_seed(1234)
    return Qwen3ForCausalLM(config).to(torch.float32).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3()


@torch.no_grad()
def packed_logprobs(model, batch) -> np.ndarray:
    ids = torch.as_tensor(batch.input_ids, dtype=torch.long)[None]
    pos = torch.as_tensor(batch.position_ids, dtype=torch.long)[None]
    mask = dense_tree_mask(batch.kv_end, torch.float32)
    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    rows = torch.as_tensor(batch.target_rows, dtype=torch.long)
    return logp[rows, torch.as_tensor(batch.target_ids, dtype=torch.long)].numpy()


@torch.no_grad()
def paths_logprobs(model, paths: list[np.ndarray]) -> list[np.ndarray]:
    """Per path: lp[d] = log p(path[d] | path[:d]) for d >= 1 (lp[0] is NaN), each path a plain
    causal sequence. Paths run as one right-padded batch: padding after a position cannot change
    it under the causal mask."""
    width = max(len(p) for p in paths)
    ids = torch.zeros(len(paths), width, dtype=torch.long)
    for i, p in enumerate(paths):
        ids[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)
    logp = torch.log_softmax(model(input_ids=ids).logits, dim=-1)
    out = []
    for i, p in enumerate(paths):
        lp = np.full(len(p), np.nan, dtype=np.float32)
        lp[1:] = logp[i, : len(p) - 1].gather(1, ids[i, 1 : len(p), None])[:, 0].numpy()
        out.append(lp)
    return out


@torch.no_grad()
def policy_logprobs(policy, batch) -> np.ndarray:
    return policy.run(batch).logprobs.numpy()


def assert_keystone(model, trees, batches, packed) -> int:
    """Compare every target with its path run alone; returns the number of targets checked.
    ``packed(batch)`` gives the packed batch's target log-probs."""
    keys = sorted({(int(r), int(leaf)) for b in batches for r, leaf in zip(b.target_rollout, b.target_leaf)})
    if not keys:
        return 0
    paths = [path_tokens(trees[r], trees[r].leaves[leaf].node) for r, leaf in keys]
    alone = dict(zip(keys, zip(paths, paths_logprobs(model, paths))))
    checked = 0
    for batch in batches:
        got = packed(batch)
        for m in range(len(got)):
            key = (int(batch.target_rollout[m]), int(batch.target_leaf[m]))
            path, want = alone[key]
            depth = int(batch.position_ids[batch.target_rows[m]]) + 1
            assert depth < len(path) and path[depth] == batch.target_ids[m], "target is not on its leaf's path"
            assert abs(got[m] - want[depth]) <= ATOL, (
                f"target {m} (rollout {key[0]}, leaf {key[1]}, depth {depth}): packed {got[m]} vs alone {want[depth]}"
            )
            checked += 1
    return checked


def test_dense_tree_mask_matches_the_rule():
    kv_end = np.array([5, 3, 3, 3, 5, 5, 6])
    want = np.array([[j <= i <= kv_end[j] for j in range(7)] for i in range(7)])
    mask = dense_tree_mask(kv_end, torch.float32)
    assert mask.shape == (1, 1, 7, 7)
    assert torch.equal(mask[0, 0] == 0, torch.as_tensor(want))
    assert bool((mask[0, 0][~torch.as_tensor(want)] == torch.finfo(torch.float32).min).all())
    with pytest.raises(ValueError):
        dense_tree_mask(np.array([0, 0]))  # kv_end[1] < 1
    # a window of 2 along each path (0 -> 1 -> 2 -> 3, 0 -> 4 -> 5, 6): a row keeps its parent and itself
    windowed = dense_tree_mask(kv_end, torch.float32, window=2)[0, 0] == 0
    out_of_window = {(2, 0), (3, 0), (3, 1), (5, 0)}
    assert torch.equal(windowed, torch.as_tensor(want) & torch.tensor(
        [[(i, j) not in out_of_window for j in range(7)] for i in range(7)]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 3),
    n_calls=st.integers(1, 6),
    vocab=st.integers(2, 5),
    slack=st.floats(0.0, 1.5),
    p_extend_excluded=st.sampled_from([0.0, 0.3]),  # compaction/subagent calls below kept leaves
)
def test_keystone_random_trees(model, seed, k, n_calls, vocab, slack, p_extend_excluded):
    rng = np.random.default_rng(seed)
    group = random_group(rng, k, n_calls, vocab_size=vocab, max_len=20, p_extend_excluded=p_extend_excluded)
    trees = [build_tree(calls) for calls in group]
    longest = max((lf.depth for t in trees for lf in t.leaves if lf.status == "kept"), default=1)
    batches = pack(trees, longest + int(slack * longest))
    expected = sum(len(b.target_ids) for b in batches)
    assert assert_keystone(model, trees, batches, lambda b: packed_logprobs(model, b)) == expected


@pytest.mark.parametrize(
    "packer, attn", [(pack, "eager"), (pack, "sdpa"), (pack_ref, "eager")], ids=["fast-eager", "fast-sdpa", "ref-eager"]
)
def test_keystone_split_tree(packer, attn):
    # One group whose shared subtree exceeds micro_batch_tokens: split across micro-batches, with
    # the ancestor path re-included as context rows in the later ones.
    model = tiny_qwen3(attn)
    group = random_group(np.random.default_rng(5), 4, 8, vocab_size=3, max_len=24)
    trees = [build_tree(calls) for calls in group]
    longest = max(lf.depth for t in trees for lf in t.leaves if lf.status == "kept")
    batches = packer(trees, longest + 3)
    assert len(batches) >= 3 and sum(int(b.is_context.sum()) for b in batches) > 0
    assert assert_keystone(model, trees, batches, lambda b: packed_logprobs(model, b)) > 30


def keystone_through_policy(model, attention: str) -> int:
    """The keystone of `Policy(model, attention)` on split trees (context rows) and whole ones; flex
    compiles once per micro-batch shape, so a handful of batches rather than random trees."""
    policy = Policy(model, attention=attention)
    checked = 0
    for seed, slack in ((5, 3), (6, 1000)):
        group = random_group(np.random.default_rng(seed), 4, 8, vocab_size=3, max_len=24)
        trees = [build_tree(calls) for calls in group]
        longest = max(lf.depth for t in trees for lf in t.leaves if lf.status == "kept")
        checked += assert_keystone(model, trees, pack(trees, longest + slack), lambda b: policy_logprobs(policy, b))
    return checked


@pytest.mark.parametrize("attention", ["auto", "torch", "triton", "flex", "sdpa-dense"])
def test_keystone_through_policy(attention):
    assert keystone_through_policy(tiny_qwen3("sdpa"), attention) > 60


@pytest.mark.parametrize("attention", ["auto", "torch", "triton", "sdpa-dense"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_keystone_through_policy_on_moe_models(family, attention):
    # Mixture-of-experts decoders: every token is routed by its own hidden state, so a packed row
    # routes as it does alone, and the keystone holds with the same tolerance.
    assert keystone_through_policy(tiny_moe(family, vocab_size=VOCAB, seed=3), attention) > 60
