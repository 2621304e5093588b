"""policy_loss and grpo_advantages against their loop references."""

from __future__ import annotations

import pytest
import torch
from clawfast.kernels import (
    ISConfig,
    TreePaths,
    grpo_advantages,
    grpo_advantages_ref,
    policy_loss,
    policy_loss_ref,
)
from clawfast.kernels.reference import tree_sequences_ref
from kernel_testing import random_packed, rel_err


def _targets(m, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(m, generator=g, dtype=torch.float64) * 3
    lp = old + 0.3 * torch.randn(m, generator=g, dtype=torch.float64)
    return dict(
        logprobs=lp.to(dtype),
        old_logprobs=old.to(dtype),
        advantages=torch.randn(m, generator=g, dtype=torch.float64).to(dtype),
        mask=(torch.rand(m, generator=g) < 0.8).to(dtype),
        weight=torch.rand(m, generator=g, dtype=torch.float64).to(dtype) + 0.5,
        infer_logprobs=(old + 0.2 * torch.randn(m, generator=g, dtype=torch.float64)).to(dtype),
        entropy=torch.rand(m, generator=g, dtype=torch.float64).to(dtype),
        ref_logprobs=(old + 0.1 * torch.randn(m, generator=g, dtype=torch.float64)).to(dtype),
        seq_ids=torch.randint(0, 7, (m,), generator=g),
    )


def _run_both(inputs, *, sequences=None, paths=None, **kw):
    lp = inputs["logprobs"].clone().requires_grad_()
    lp_r = inputs["logprobs"].clone().double().requires_grad_()
    rest = {k: v for k, v in inputs.items() if k != "logprobs"}
    loss, met = policy_loss(lp, rest.pop("old_logprobs"), rest.pop("advantages"), **rest,
                            paths=paths, **kw)
    rest_r = {k: v for k, v in inputs.items() if k != "logprobs"}
    loss_r, met_r = policy_loss_ref(lp_r, rest_r.pop("old_logprobs"), rest_r.pop("advantages"),
                                    sequences=sequences, **rest_r, **kw)
    loss.backward()
    loss_r.backward()
    return loss, lp.grad, met, loss_r, lp_r.grad, met_r


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_reference(aggregation, dual_clip, dtype):
    inputs = _targets(300, 0, dtype)
    loss, grad, met, loss_r, grad_r, met_r = _run_both(
        inputs, aggregation=aggregation, dual_clip=dual_clip, clip_low=0.2, clip_high=0.28,
        entropy_coef=0.01, kl_coef=0.05, is_config=ISConfig(cap=1.2))
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert rel_err(loss, loss_r) <= tol and rel_err(grad, grad_r) <= tol
    assert met.keys() == met_r.keys()
    for k in met_r:
        assert met[k] == pytest.approx(met_r[k], rel=max(tol, 1e-6), abs=1e-7), k
    assert 0 < met["clip_frac"] < 1
    if dual_clip is not None:
        assert met["dual_clip_frac"] >= 0


def test_sequence_level_is_on_a_tree():
    g = torch.Generator().manual_seed(4)
    batch = random_packed(80, g)
    m = batch["target_rows"].shape[0]
    inputs = _targets(m, 1)
    inputs["seq_ids"] = batch["target_rollout"]
    inputs["infer_logprobs"] = inputs["old_logprobs"] + 0.02 * torch.randn(m, generator=g,
                                                                             dtype=torch.float64)
    paths = TreePaths.from_tree(batch["parent_row"], batch["input_ids"], batch["kv_end"],
                                batch["target_rows"], batch["target_ids"], batch["target_rollout"],
                                batch["leaf_rows"], batch["leaf_rollout"])
    seqs = tree_sequences_ref(batch["parent_row"], batch["input_ids"], batch["target_rows"],
                              batch["target_ids"], batch["target_rollout"], batch["leaf_rows"],
                              batch["leaf_rollout"])
    cfg = ISConfig(level="sequence", mode="mask", lo=0.9, hi=1.1)
    loss, grad, met, loss_r, grad_r, met_r = _run_both(
        inputs, aggregation="seq-mean-token-mean", is_config=cfg, paths=paths, sequences=seqs)
    assert rel_err(loss, loss_r) <= 1e-10 and rel_err(grad, grad_r) <= 1e-10
    for k in met_r:
        assert met[k] == pytest.approx(met_r[k], rel=1e-6, abs=1e-9), k


def test_reference_gradcheck():
    inputs = _targets(12, 2)
    lp = inputs.pop("logprobs").requires_grad_()
    old, adv = inputs.pop("old_logprobs"), inputs.pop("advantages")

    def f(lp):
        return policy_loss_ref(lp, old, adv, **inputs, dual_clip=2.0, entropy_coef=0.1,
                               kl_coef=0.1, aggregation="seq-mean-token-mean")[0]

    assert torch.autograd.gradcheck(f, (lp,))


def test_masked_everything_is_zero_with_zero_grad():
    inputs = _targets(20, 3)
    inputs["mask"] = torch.zeros(20, dtype=torch.float64)
    inputs["infer_logprobs"][:] = float("nan")  # masked: never read
    lp = inputs.pop("logprobs").requires_grad_()
    loss, met = policy_loss(lp, inputs.pop("old_logprobs"), inputs.pop("advantages"), **inputs,
                            aggregation="seq-mean-token-mean")
    loss.backward()
    assert float(loss.detach()) == 0.0 and bool((lp.grad == 0).all())
    assert met["clip_frac"] == 0 and met["is_count"] == 0


def test_on_policy_gradient_is_minus_advantage():
    # old = logprobs detached: ratio 1, no clipping; d loss / d lp = -A a / sum a
    m = 10
    lp = torch.randn(m, dtype=torch.float64, requires_grad=True)
    adv = torch.randn(m, dtype=torch.float64)
    loss, met = policy_loss(lp, None, adv)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv / m)
    assert met["ratio_mean"] == pytest.approx(1.0) and met["clip_frac"] == 0


def test_bad_inputs():
    inputs = _targets(10, 4)
    lp, old, adv = inputs["logprobs"], inputs["old_logprobs"], inputs["advantages"]
    with pytest.raises(ValueError, match="seq_ids"):
        policy_loss(lp, old, adv, aggregation="seq-mean-token-mean")
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(lp, old, adv, aggregation="mean")
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(lp, old, adv, dual_clip=0.5)
    bad = adv.clone()
    bad[2] = float("nan")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, old, bad)
    with pytest.raises(ValueError, match="length"):
        policy_loss(lp, old[:3], adv)


@pytest.mark.parametrize("two_keys", [False, True])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_matches_reference(two_keys, normalize_std):
    g = torch.Generator().manual_seed(6)
    rewards = torch.rand(64, generator=g, dtype=torch.float64)
    task = torch.randint(0, 9, (64,), generator=g)
    keys = torch.stack([task, torch.randint(0, 3, (64,), generator=g)], 1) if two_keys else task
    keys[0] = 99 if not two_keys else torch.tensor([99, 0])  # a group of one
    adv = grpo_advantages(rewards, keys, normalize_std=normalize_std)
    adv_r = grpo_advantages_ref(rewards, keys, normalize_std=normalize_std)
    torch.testing.assert_close(adv, adv_r, rtol=1e-12, atol=1e-12)
    assert float(adv[0]) == 0.0
    with pytest.raises(ValueError, match="group_keys"):
        grpo_advantages(rewards, keys[:5])


@pytest.mark.triton
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triton_matches_reference(triton_device, aggregation, dtype):
    inputs = {k: v.to(triton_device) for k, v in _targets(200, 7, dtype).items()}
    inputs["logprobs"][:3] += 25.0  # log-ratios beyond the clamp: zero gradient, finite loss
    lp = inputs.pop("logprobs").clone().requires_grad_()
    old, adv = inputs.pop("old_logprobs"), inputs.pop("advantages")
    kw = dict(dual_clip=3.0, clip_low=0.2, clip_high=0.3, entropy_coef=0.01, kl_coef=0.1,
              aggregation=aggregation)
    loss, met = policy_loss(lp, old, adv, **inputs, **kw, backend="triton")
    lp_r = lp.detach().cpu().double().requires_grad_()
    cpu = {k: v.cpu() for k, v in inputs.items()}
    loss_r, met_r = policy_loss_ref(lp_r, old.cpu(), adv.cpu(), **cpu, **kw)
    loss.backward()
    loss_r.backward()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert rel_err(loss, loss_r) <= tol and rel_err(lp.grad, lp_r.grad) <= tol
    for k in met_r:
        assert met[k] == pytest.approx(met_r[k], rel=max(tol, 1e-6), abs=1e-7), k


# ------------------------------------------------------------------ decoupled PPO (async off-policy)


def _decoupled_inputs(seed, n=90):
    """A random packed forest and, per target, current / proximal / behaviour log-probs (float64):
    the current policy has moved from the proximal one (so the clip acts) and the behaviour policy
    (the sampler, possibly stale) differs from both (so truncation / masking act)."""
    g = torch.Generator().manual_seed(seed)
    batch = random_packed(n, g)
    m = batch["target_rows"].shape[0]
    prox = -torch.rand(m, generator=g, dtype=torch.float64) * 3
    return batch, dict(
        logprobs=prox + 0.3 * torch.randn(m, generator=g, dtype=torch.float64),
        proximal=prox,
        behaviour=prox + 0.3 * torch.randn(m, generator=g, dtype=torch.float64),
        advantages=torch.randn(m, generator=g, dtype=torch.float64),
        a=(torch.rand(m, generator=g) < 0.8).double() * (torch.rand(m, generator=g, dtype=torch.float64) + 0.5),
    )


def _decoupled_ref(x, sequences, level, mode, cap, lo, hi, clip_low, clip_high):
    """Decoupled PPO in plain float64 torch: w(rho) x max(-A r, -A clip(r)), token-mean with weights a,
    where rho = pi_prox / pi_behav (per target, or the product over each sequence's valid targets,
    a target taking the mean weight of the sequences through it) and r = pi / pi_prox."""
    a, adv = x["a"], x["advantages"]
    lp = x["logprobs"].clone().requires_grad_()
    log_rho = torch.where(a > 0, x["proximal"] - x["behaviour"], 0.0)
    if level == "sequence":
        log_rho = torch.stack([log_rho[s].sum() for s in sequences])
    rho = torch.exp(log_rho.clamp(-20, 20))
    w = rho.clamp(max=cap) if mode == "truncate" else torch.where((rho >= lo) & (rho <= hi), rho, 0.0)
    if level == "sequence":
        w = torch.stack([torch.stack([w[j] for j, s in enumerate(sequences) if k in s]).mean()
                         for k in range(a.shape[0])])
    r = torch.exp((lp - x["proximal"]).clamp(-20, 20))
    unclipped, clipped = -adv * r, -adv * r.clamp(1 - clip_low, 1 + clip_high)
    loss = (a * w * torch.maximum(unclipped, clipped)).sum() / a.sum()
    loss.backward()
    clip_frac = float((a * (clipped > unclipped)).sum() / a.sum())
    above = float((rho > (cap if mode == "truncate" else hi)).double().mean())
    return loss.detach(), lp.grad, w, clip_frac, above


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("seed", [0, 1])
def test_decoupled_loss_matches_float64_reference(level, mode, seed):
    batch, x = _decoupled_inputs(seed)
    paths = TreePaths.from_tree(batch["parent_row"], batch["input_ids"], batch["kv_end"], batch["target_rows"],
                                batch["target_ids"], batch["target_rollout"], batch["leaf_rows"],
                                batch["leaf_rollout"])
    seqs = tree_sequences_ref(batch["parent_row"], batch["input_ids"], batch["target_rows"], batch["target_ids"],
                              batch["target_rollout"], batch["leaf_rows"], batch["leaf_rollout"])
    cap, lo, hi = 1.4, 0.7, 1.5
    loss_r, grad_r, w_r, clip_r, above = _decoupled_ref(x, seqs, level, mode, cap, lo, hi, 0.2, 0.28)
    assert 0 < clip_r < 1 and 0 < above < 1, "clip or truncation/masking never (or always) acted"
    cfg = ISConfig(level=level, mode=mode, cap=cap, lo=lo, hi=hi)
    lp = x["logprobs"].clone().requires_grad_()
    loss, met = policy_loss(lp, x["proximal"], x["advantages"], weight=x["a"], infer_logprobs=x["behaviour"],
                            is_config=cfg, paths=paths, clip_low=0.2, clip_high=0.28, backend="torch")
    loss.backward()
    # float64 on both sides; only summation orders differ
    assert rel_err(loss, loss_r) <= 1e-12 and rel_err(lp.grad, grad_r) <= 1e-12
    assert met["clip_frac"] == pytest.approx(clip_r, abs=1e-12)
    # the same weights handed in precomputed (how the trainer passes sequence-level weights)
    lp2 = x["logprobs"].clone().requires_grad_()
    loss2, met2 = policy_loss(lp2, x["proximal"], x["advantages"], weight=x["a"], is_weights=w_r,
                              clip_low=0.2, clip_high=0.28, backend="torch")
    loss2.backward()
    assert rel_err(loss2, loss_r) <= 1e-12 and rel_err(lp2.grad, grad_r) <= 1e-12
    assert "is_count" not in met2 and met2["clip_frac"] == pytest.approx(clip_r, abs=1e-12)


@pytest.mark.triton
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_triton_decoupled_loss_matches_float64_reference(triton_device, level):
    batch, x = _decoupled_inputs(2, n=60)
    paths = TreePaths.from_tree(*(batch[k].to(triton_device) for k in (
        "parent_row", "input_ids", "kv_end", "target_rows", "target_ids", "target_rollout", "leaf_rows",
        "leaf_rollout")))
    seqs = tree_sequences_ref(batch["parent_row"], batch["input_ids"], batch["target_rows"], batch["target_ids"],
                              batch["target_rollout"], batch["leaf_rows"], batch["leaf_rollout"])
    loss_r, grad_r, _, clip_r, _ = _decoupled_ref(x, seqs, level, "truncate", 1.4, 0.7, 1.5, 0.2, 0.2)
    d = {k: v.to(triton_device) for k, v in x.items()}
    lp = d["logprobs"].clone().requires_grad_()
    loss, met = policy_loss(lp, d["proximal"], d["advantages"], weight=d["a"], infer_logprobs=d["behaviour"],
                            is_config=ISConfig(level=level, cap=1.4), paths=paths, backend="triton")
    loss.backward()
    assert rel_err(loss, loss_r) <= 1e-10 and rel_err(lp.grad, grad_r) <= 1e-10
    assert met["clip_frac"] == pytest.approx(clip_r, abs=1e-12)


def test_precomputed_is_weights_are_checked():
    x = _decoupled_inputs(3, n=30)[1]
    lp, prox, adv = x["logprobs"], x["proximal"], x["advantages"]
    with pytest.raises(ValueError, match="not both"):
        policy_loss(lp, prox, adv, infer_logprobs=x["behaviour"], is_weights=torch.ones_like(lp))
    with pytest.raises(ValueError, match="is_weights must be >= 0"):
        policy_loss(lp, prox, adv, is_weights=-torch.ones_like(lp))
    with pytest.raises(ValueError, match="is_weights"):
        policy_loss(lp, prox, adv, is_weights=torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_gradients_reach_logprobs_and_entropy_alone_on_every_backend(backend, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    inputs = {k: v.to(device) for k, v in _targets(40, 9).items()}
    grads = {k: inputs.pop(k).clone().requires_grad_()
             for k in ("logprobs", "old_logprobs", "advantages", "ref_logprobs", "entropy", "mask", "weight")}
    loss, _ = policy_loss(grads["logprobs"], grads["old_logprobs"], grads["advantages"],
                          ref_logprobs=grads["ref_logprobs"], entropy=grads["entropy"], mask=grads["mask"],
                          weight=grads["weight"], kl_coef=0.1, entropy_coef=0.01, aggregation="seq-mean-token-mean",
                          backend=backend, **inputs)
    loss.backward()
    assert {k: t.grad is not None for k, t in grads.items()} == {
        "logprobs": True, "old_logprobs": False, "advantages": False, "ref_logprobs": False, "entropy": True,
        "mask": False, "weight": False}


@pytest.mark.triton
def test_a_second_derivative_through_the_triton_loss_raises(triton_device):
    inputs = {k: v.to(triton_device) for k, v in _targets(20, 3).items()}
    lp = inputs.pop("logprobs").clone().requires_grad_()
    loss, _ = policy_loss(lp, inputs.pop("old_logprobs"), inputs.pop("advantages"), backend="triton", **inputs)
    with pytest.raises(RuntimeError, match="policy_loss \\(Triton\\) is differentiable once"):
        torch.autograd.grad(loss, lp, create_graph=True)


def test_sparse_sequence_ids_aggregate_as_dense_ones():
    inputs = _targets(30, 5)
    lp, old, adv = inputs.pop("logprobs"), inputs.pop("old_logprobs"), inputs.pop("advantages")
    seq = inputs.pop("seq_ids")
    dense, _ = policy_loss(lp, old, adv, seq_ids=seq, aggregation="seq-mean-token-mean", **inputs)
    sparse, _ = policy_loss(lp, old, adv, seq_ids=seq * 10**12 + 7, aggregation="seq-mean-token-mean", **inputs)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=0)


def test_a_negative_or_nan_weight_or_mask_is_an_error_not_a_dropped_target():
    inputs = _targets(10, 4)
    lp, old, adv = inputs["logprobs"], inputs["old_logprobs"], inputs["advantages"]
    for bad in (-3.0, float("nan"), float("inf")):
        weight = torch.ones(10, dtype=lp.dtype)
        weight[1] = bad
        with pytest.raises(ValueError, match="weight must be finite and >= 0"):
            policy_loss(lp, old, adv, weight=weight)
        masked = torch.ones(10, dtype=lp.dtype)
        masked[1] = 0.0
        policy_loss(lp, old, adv, weight=weight, mask=masked)  # a masked target may hold anything
    mask = torch.ones(10, dtype=lp.dtype)
    mask[0] = -1.0
    with pytest.raises(ValueError, match="mask must be >= 0"):
        policy_loss(lp, old, adv, mask=mask)
