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
