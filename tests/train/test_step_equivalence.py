"""The bar: a tree-packed training step equals the same step computed from flat per-leaf trajectories.

The flat reference below is plain code and shares nothing with the fast path but the model and the
prefix tree (which tells it the kept leaves, the trainable tokens and the sampler's log-probs):
every kept leaf's root-to-leaf path runs alone through the HF model as an ordinary causal
sequence (full [T, V] logits, ``log_softmax``), and the loss is summed over its trainable tokens.

Documented weighting (what "shared tokens count once" means): a trainable token shared by c kept
leaves of its rollout has weight ``1/c`` in each of the c flat copies, so it counts once in total.
The normaliser is the number of unique trainable tokens of the step ("token-mean"), or per rollout
its number of unique trainable tokens, then the mean over rollouts ("seq-mean-token-mean"), or
just the number of rollouts ("seq-mean-token-sum").
IS weights: per target, or (``is_level="sequence"``) per flat copy from its whole path.
PPO: per-path GAE with the plain verl loop on each flat copy (reward on the path's last trainable
token, values from the value head at the predicting position); a shared token's advantage and
return are the mean over the copies (the "path" mode of tree GAE).

The packed step runs with a small ``micro_batch_tokens`` so trees are split across micro-batches with
re-included context rows. Tolerance 1e-4 absolute on the loss and on every gradient entry: both
sides are fp32 with the same weights; only reduction orders differ (measured differences ~1e-7).
"""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch

from clawfast.records import RolloutResult
from clawfast.synthetic import random_group, task_group
from clawfast.train.algorithms import group_ids, grpo_rollout_advantages
from clawfast.train.policy import Policy
from clawfast.train.prepare import prepare_step
from clawfast.train.step_config import StepConfig
from clawfast.train.update import accumulate_gradients
from clawfast.threads import reconstruct, with_kinds
from clawfast.tree import build_tree
from clawfast.tree_ref import kept_leaf_paths_ref, trainable_mask_ref

from tiny_moe import MOE_FAMILIES, tiny_moe

VOCAB = 64
ATOL = 1e-4


def tiny_policy(seed: int = 0, value_head: bool = False, family: str = "qwen3") -> Policy:
    """A tiny dense Qwen3, or a tiny mixture-of-experts decoder of `family` (`tiny_moe.MOE_FAMILIES`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if family == "qwen3":
        config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                             attn_implementation="sdpa")
        torch.manual_seed(seed)
        lm = Qwen3ForCausalLM(config).float()
    else:
        lm = tiny_moe(family, vocab_size=VOCAB, hidden=32, seed=seed).train()
    policy = Policy(lm, value_head=value_head)
    if value_head:  # a random (not zero) head, so value gradients are non-trivial
        torch.nn.init.normal_(policy.value_head.weight, std=0.3)
    return policy


@torch.no_grad()
def near_policy_logprobs(lm, calls, rng) -> None:
    """Give each call the model's own log-probs of its outputs plus noise (in place), so the IS
    ratios spread around 1 and truncation/masking really happen."""
    for c in calls:
        if not len(c.output_ids):
            continue
        ids = torch.as_tensor(np.concatenate([c.prompt_ids, c.output_ids]), dtype=torch.long)
        logp = torch.log_softmax(lm(input_ids=ids[None]).logits[0].double(), -1)
        n = len(c.prompt_ids)
        lp = logp[n - 1: -1].gather(1, ids[n:, None])[:, 0].numpy()
        c.infer_logprobs = np.minimum(lp + rng.normal(0, 0.4, size=lp.shape), 0).astype(np.float32)


def harness_rollouts(policy: Policy, seed: int = 0) -> list[RolloutResult]:
    """Two tasks x three samples of harness-shaped sessions (retries, a history-edit branch, a
    subagent, a title call), the last sample of each task from another harness."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(2):
        group = task_group(rng, 3, task_id=f"task{t}", n_calls=16, max_prompt_tokens=160, vocab_size=VOCAB,
                           retry_frac=0.3, subagent_chains=1, subagent_calls=2)
        for i, calls in enumerate(group):
            near_policy_logprobs(policy.lm, calls, rng)
            out.append(RolloutResult(rollout_id=calls[0].rollout_id, task_id=f"task{t}",
                                     harness="codex" if i == 2 else "claude-code", sample_index=i,
                                     reward=float(rng.normal()), calls=calls))
    return out


def random_rollouts(policy: Policy, seed: int) -> list[RolloutResult]:
    """Adversarial small trees: retries with prefix/equal/empty outputs, forks inside outputs."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(2):
        for i, calls in enumerate(random_group(rng, 3, 7, vocab_size=3, max_len=28)):
            calls = [copy.copy(c) for c in calls]
            for c in calls:
                c.rollout_id = f"t{t}-{c.rollout_id}"
            near_policy_logprobs(policy.lm, calls, rng)
            out.append(RolloutResult(rollout_id=calls[0].rollout_id, task_id=f"t{t}", harness="h",
                                     sample_index=i, reward=float(rng.normal()), calls=calls))
    return out


# ------------------------------------------------------------------------- flat reference


def path_forward(policy: Policy, ids: torch.Tensor):
    """Plain causal run of one path: (log_softmax [T, V], hidden [T, d])."""
    hidden = policy.lm.model(input_ids=ids[None]).last_hidden_state[0]
    return torch.log_softmax(policy.lm.lm_head(hidden), dim=-1), hidden


def flat_loss(policy: Policy, rollouts, config: StepConfig, *, ref_policy: Policy | None = None) -> torch.Tensor:
    """The step's loss from flat per-leaf copies (module docstring), differentiable."""
    keep = [r for r in rollouts if r.status in config.keep_statuses]
    trees = [build_tree(with_kinds(r.calls, reconstruct(r.calls)), max_kept_leaves=config.max_kept_leaves) for r in keep]
    rewards = [r.reward for r in keep]
    adv_of = grpo_rollout_advantages(rewards, group_ids(keep, config.group_by))
    copies, count = [], Counter()
    for g, tree in enumerate(trees):
        if tree.dropped:
            continue
        train = trainable_mask_ref(tree)
        for path in kept_leaf_paths_ref(tree):
            copies.append((g, path, train))
            for t in path[1:]:
                if train[t]:
                    count[(g, t)] += 1
    per_rollout = Counter(g for g, _ in count)
    runs = []  # per copy: (g, path, trainable positions, logp, hidden)
    for g, path, train in copies:
        ids = torch.as_tensor(trees[g].tokens[path], dtype=torch.long)
        logp, hidden = path_forward(policy, ids)
        ref = path_forward(ref_policy, ids)[0].detach() if ref_policy is not None else None
        pos = [d for d in range(1, len(path)) if train[path[d]]]
        runs.append((g, path, ids, pos, logp, hidden, ref))

    adv_tok, ret_tok = {}, {}
    if config.name == "ppo":  # per-path GAE, then the mean over the copies of each token
        sums = {}
        for g, path, ids, pos, logp, hidden, ref in runs:
            v = policy.value_head(hidden)[:, 0].detach().double()
            trainable = set(pos)
            next_v = last_gae = 0.0
            for d in range(len(path) - 1, 0, -1):
                if d not in trainable:
                    continue  # context: carry next value and running advantage across
                r = rewards[g] if d == max(pos) else 0.0
                delta = r + config.gamma * next_v - float(v[d - 1])
                last_gae = delta + config.gamma * config.lam * last_gae
                next_v = float(v[d - 1])
                s = sums.setdefault((g, path[d]), [0.0, 0.0, 0])
                s[0] += last_gae
                s[1] += last_gae + float(v[d - 1])
                s[2] += 1
        adv_tok = {k: a / n for k, (a, _, n) in sums.items()}
        ret_tok = {k: r / n for k, (_, r, n) in sums.items()}

    def is_weight(log_rho):
        rho = float(np.exp(log_rho))
        if config.is_mode == "truncate":
            return min(rho, config.is_cap)
        if config.is_mode == "mask":
            return rho if config.is_lo <= rho <= config.is_hi else 0.0
        return 1.0

    total = torch.zeros((), dtype=torch.float64)
    n_live = len(per_rollout)
    for g, path, ids, pos, logp, hidden, ref in runs:
        # sequence level: one weight per flat copy, from the sum of its tokens' log-ratios (the
        # proximal policy is the current one: one update)
        lp_path = logp.detach()[[d - 1 for d in pos], ids[pos]].double()
        seq_w = is_weight(float((lp_path - torch.as_tensor(trees[g].infer_logprobs[path[pos]]).double()).sum()))
        for d in pos:
            t = path[d]
            lp = logp[d - 1, ids[d]].double()
            ent = -(logp[d - 1].exp() * logp[d - 1]).sum().double()
            adv = adv_tok[(g, t)] if config.name == "ppo" else float(adv_of[g])
            ratio = torch.exp(lp - lp.detach())
            clip_high = config.clip_low if config.clip_high is None else config.clip_high
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - config.clip_low, 1 + clip_high))
            if config.is_level == "sequence":
                w = seq_w
            else:
                w = is_weight(float(lp.detach()) - float(trees[g].infer_logprobs[t]))
            term = w * pg - config.entropy_coef * ent
            if ref is not None:
                diff = ref[d - 1, ids[d]].double() - lp
                term = term + config.kl_coef * (torch.exp(diff) - diff - 1)
            if config.name == "ppo":
                v = policy.value_head(hidden[d - 1])[0].double()
                old, ret = v.detach(), ret_tok[(g, t)]
                clipped = old + (v - old).clamp(-config.value_clip, config.value_clip)
                term = term + config.value_coef * 0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2)
            weight = 1.0 / count[(g, t)]
            if config.aggregation == "token-mean":
                total = total + weight * term / len(count)
            elif config.aggregation == "seq-mean-token-mean":
                total = total + weight * term / (per_rollout[g] * n_live)
            else:  # seq-mean-token-sum
                total = total + weight * term / n_live
    return total


# ---------------------------------------------------------------------------------- compare


def grads(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in policy.named_parameters()}


def assert_same_step(policy: Policy, rollouts, config: StepConfig, ref_policy: Policy | None = None) -> dict:
    packed_policy = copy.deepcopy(policy)
    data = prepare_step(rollouts, None, config)
    assert len(data.batches) >= 3 and sum(int(b.is_context.sum()) for b in data.batches) > 0, "no split"
    metrics = accumulate_gradients(packed_policy, data, config, ref_policy=ref_policy)

    policy.zero_grad(set_to_none=True)
    want = flat_loss(policy, rollouts, config, ref_policy=ref_policy)
    want.backward()
    assert abs(metrics["loss"] - want.item()) <= ATOL, (metrics["loss"], want.item())
    got_g, want_g = grads(packed_policy), grads(policy)
    nonzero = 0
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
        nonzero += int(want_g[name].abs().max() > 1e-6)
    assert nonzero >= len(want_g) - 1, "gradients are (almost) all zero: the comparison proves nothing"
    return metrics


def longest_kept(rollouts) -> int:
    return max(lf.depth for r in rollouts for lf in build_tree(with_kinds(r.calls, reconstruct(r.calls))).leaves if lf.status == "kept")


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_grpo_step_equals_flat_per_leaf(aggregation):
    policy = tiny_policy(0)
    rollouts = harness_rollouts(policy, seed=1)
    ref_policy = tiny_policy(7)
    config = StepConfig(name="grpo", micro_batch_tokens=longest_kept(rollouts) + 40, aggregation=aggregation,
                        is_mode="truncate", is_cap=1.3, entropy_coef=0.01, kl_coef=0.05)
    metrics = assert_same_step(policy, rollouts, config, ref_policy)
    assert 0 < metrics["is_frac_above"] < 1, "truncation never (or always) happened"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_grpo_step_equals_flat_per_leaf_on_moe_models(family):
    # The router's and every expert's gradients too: a packed row routes as its path does alone.
    policy = tiny_policy(0, family=family)
    rollouts = harness_rollouts(policy, seed=1)
    config = StepConfig(name="grpo", micro_batch_tokens=longest_kept(rollouts) + 40, is_mode="truncate", is_cap=1.3,
                        entropy_coef=0.01, kl_coef=0.05)
    assert_same_step(policy, rollouts, config, tiny_policy(7, family=family))


@pytest.mark.parametrize("seed", [3, 11])
def test_grpo_step_equals_flat_on_adversarial_trees(seed):
    policy = tiny_policy(1)
    rollouts = random_rollouts(policy, seed)
    config = StepConfig(micro_batch_tokens=longest_kept(rollouts) + 3, is_mode="mask", is_lo=0.7, is_hi=1.4)
    metrics = assert_same_step(policy, rollouts, config)
    assert 0 < metrics["is_frac_above"] + metrics["is_frac_below"] < 1


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_ppo_step_equals_flat_per_leaf(aggregation):
    policy = tiny_policy(2, value_head=True)
    rollouts = harness_rollouts(policy, seed=4)
    config = StepConfig(name="ppo", micro_batch_tokens=longest_kept(rollouts) + 40, aggregation=aggregation,
                        gamma=0.99, lam=0.95, value_coef=0.5, value_clip=0.2, is_cap=1.5, entropy_coef=0.01)
    assert_same_step(policy, rollouts, config)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_sequence_level_is_step_equals_flat_per_leaf(mode):
    # one weight per kept root-to-leaf path, exact although the micro-batches split the trees: each
    # flat copy carries its path's weight, a shared token the mean over its copies
    policy = tiny_policy(0)
    rollouts = harness_rollouts(policy, seed=1)
    config = StepConfig(micro_batch_tokens=longest_kept(rollouts) + 40, is_level="sequence", is_mode=mode, is_cap=1.5,
                        is_lo=0.2, is_hi=5.0, entropy_coef=0.01)
    metrics = assert_same_step(policy, rollouts, config)
    assert 0 < metrics["is_frac_above"] + metrics["is_frac_below"] < 1, "the path weights never (or always) acted"
