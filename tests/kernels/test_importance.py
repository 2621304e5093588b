"""TreePaths and importance_weights against explicit path walks and textbook metric formulas."""

from __future__ import annotations

import math

import pytest
import torch
from clawfast.kernels import (
    ISConfig,
    TreePaths,
    importance_weights,
    importance_weights_ref,
)
from clawfast.kernels.reference import tree_sequences_ref
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import random_packed, rel_err


def _paths(batch):
    return TreePaths.from_tree(batch["parent_row"], batch["input_ids"], batch["kv_end"],
                               batch["target_rows"], batch["target_ids"], batch["target_rollout"],
                               batch["leaf_rows"], batch["leaf_rollout"])


def _seqs(batch):
    return tree_sequences_ref(batch["parent_row"], batch["input_ids"], batch["target_rows"],
                              batch["target_ids"], batch["target_rollout"], batch["leaf_rows"],
                              batch["leaf_rollout"])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tree_paths_match_explicit_walks(seed):
    g = torch.Generator().manual_seed(seed)
    batch = random_packed(120, g)
    paths, seqs = _paths(batch), _seqs(batch)
    m = batch["target_rows"].shape[0]
    x = torch.randn(m, generator=g, dtype=torch.float64)
    expect = torch.tensor([float(x[s].sum()) for s in seqs], dtype=torch.float64)
    assert rel_err(paths.path_sum(x), expect) <= 1e-12
    y = torch.randn(len(seqs), generator=g, dtype=torch.float64)
    expect_t = torch.tensor([sum(float(y[j]) for j, s in enumerate(seqs) if k in s)
                             / sum(1 for s in seqs if k in s) for k in range(m)],
                            dtype=torch.float64)
    assert rel_err(paths.to_targets(y), expect_t) <= 1e-12


def test_tree_paths_errors():
    g = torch.Generator().manual_seed(9)
    batch = random_packed(30, g)
    bad = dict(batch)
    bad["target_ids"] = batch["target_ids"].clone()
    bad["target_ids"][0] = 10_000
    with pytest.raises(ValueError, match="has no child with token"):
        _paths(bad)
    lonely = dict(batch)
    lonely["target_rollout"] = batch["target_rollout"].clone()
    lonely["target_rollout"][0] = 99
    with pytest.raises(ValueError, match="no kept leaf"):
        _paths(lonely)
    with pytest.raises(ValueError, match="seq_ids"):
        TreePaths.from_sequences(torch.tensor([0, 3]), num_seqs=2)


def _logprobs(m, g, spread=0.3):
    infer = -torch.rand(m, generator=g, dtype=torch.float64) * 3
    train = infer + spread * torch.randn(m, generator=g, dtype=torch.float64)
    mask = (torch.rand(m, generator=g) < 0.8).double()
    return train, infer, mask


def _assert_metrics(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_reference_on_a_tree(level, mode, dtype):
    g = torch.Generator().manual_seed(11)
    batch = random_packed(100, g, p_target=0.9)
    m = batch["target_rows"].shape[0]
    train, infer, mask = _logprobs(m, g, spread=0.05 if level == "sequence" else 0.4)
    cfg = ISConfig(level=level, mode=mode, cap=1.5, lo=0.8, hi=1.25)
    res = importance_weights(train.to(dtype), infer.to(dtype), mask.to(dtype), config=cfg,
                             paths=_paths(batch), backend="torch")
    w_ref, met_ref = importance_weights_ref(train.to(dtype), infer.to(dtype), mask, config=cfg,
                                            sequences=_seqs(batch))
    assert res.weights.dtype == dtype
    assert rel_err(res.weights, w_ref) <= (1e-12 if dtype == torch.float64 else 1e-5)
    if dtype == torch.float64:
        _assert_metrics(res.metrics, met_ref)
    assert 0 < res.metrics["is_count"]


@pytest.mark.triton
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_triton_matches_reference(triton_device, level, mode):
    g = torch.Generator().manual_seed(12)
    train, infer, mask = _logprobs(150, g)
    seq_ids = torch.randint(0, 9, (150,), generator=g)
    cfg = ISConfig(level=level, mode=mode)
    dev = triton_device
    paths = TreePaths.from_sequences(seq_ids.to(dev), num_seqs=10)  # sequence 9 may be empty
    res = importance_weights(train.float().to(dev), infer.float().to(dev), mask.float().to(dev),
                             config=cfg, paths=paths, backend="triton")
    seqs = [torch.nonzero(seq_ids == s).view(-1).tolist() for s in range(10)]
    w_ref, met_ref = importance_weights_ref(train, infer, mask, config=cfg, sequences=seqs)
    assert rel_err(res.weights, w_ref) <= 1e-5
    for k in met_ref:
        assert res.metrics[k] == pytest.approx(met_ref[k], rel=1e-5, abs=1e-6), k


def test_truncation_and_masking_values():
    infer = torch.zeros(4, dtype=torch.float64)
    train = torch.log(torch.tensor([0.25, 1.0, 1.5, 5.0], dtype=torch.float64))
    w = importance_weights(train, infer, config=ISConfig(cap=2.0)).weights
    assert w.tolist() == pytest.approx([0.25, 1.0, 1.5, 2.0])
    res = importance_weights(train, infer, config=ISConfig(mode="mask", lo=0.5, hi=2.0))
    assert res.weights.tolist() == pytest.approx([0.0, 1.0, 1.5, 0.0])
    assert res.metrics["is_frac_above"] == pytest.approx(0.25)
    assert res.metrics["is_frac_below"] == pytest.approx(0.25)
    assert res.metrics["is_ess"] == pytest.approx((7.75**2) / (4 * (0.0625 + 1 + 2.25 + 25)))
    assert res.metrics["mismatch_k1"] == pytest.approx(-float(train.mean()))


def test_edge_cases():
    m = 6
    train = torch.randn(m, dtype=torch.float64)
    # masked everything: zero weights, zero metrics, count 0; NaN under the mask is ignored
    infer = torch.full((m,), float("nan"), dtype=torch.float64)
    res = importance_weights(train, infer, torch.zeros(m, dtype=torch.float64))
    assert bool((res.weights == 0).all()) and all(v == 0 for v in res.metrics.values())
    # huge log-ratios are clamped in log space: finite ratios, no overflow
    res = importance_weights(torch.tensor([500.0, -500.0]), torch.zeros(2), config=ISConfig())
    assert res.metrics["is_ratio_max"] == pytest.approx(math.exp(20.0))
    assert res.weights.tolist() == pytest.approx([2.0, math.exp(-20.0)])
    # NaN where the mask is on: a clear error
    with pytest.raises(ValueError, match="non-finite"):
        importance_weights(train, torch.full((m,), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match="paths"):
        importance_weights(train, train, config=ISConfig(level="sequence"))
    with pytest.raises(ValueError, match="level"):
        ISConfig(level="seq")
    # empty input
    res = importance_weights(torch.zeros(0), torch.zeros(0))
    assert res.weights.shape == (0,) and res.metrics["is_count"] == 0


def test_zero_length_sequences():
    # sequences 1 and 3 own no target: their sum is 0 and they do not count as items
    paths = TreePaths.from_sequences(torch.tensor([0, 0, 2, 2]), num_seqs=4)
    x = torch.tensor([0.1, 0.2, -0.3, 0.05], dtype=torch.float64)
    assert paths.path_sum(x).tolist() == pytest.approx([0.3, 0.0, -0.25, 0.0])
    res = importance_weights(x, torch.zeros(4, dtype=torch.float64),
                             config=ISConfig(level="sequence"), paths=paths)
    assert res.metrics["is_count"] == 2
    assert res.weights.tolist() == pytest.approx([math.exp(0.3)] * 2 + [math.exp(-0.25)] * 2)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 30), seed=st.integers(0, 10_000), rollouts=st.integers(1, 3))
def test_property_path_sums(n, seed, rollouts):
    g = torch.Generator().manual_seed(seed)
    batch = random_packed(n, g, rollouts=rollouts)
    if batch["target_rows"].numel() == 0:
        return
    paths, seqs = _paths(batch), _seqs(batch)
    x = torch.randn(batch["target_rows"].shape[0], generator=g, dtype=torch.float64)
    expect = torch.tensor([float(x[s].sum()) for s in seqs], dtype=torch.float64)
    torch.testing.assert_close(paths.path_sum(x), expect, rtol=1e-12, atol=1e-12)


def test_tree_paths_refuse_negative_and_float_token_ids():
    # rows 0 -> 1 -> 2, tokens 5, 6, 7; row 1 predicts row 2's token 7
    parent, ids, kv_end = torch.tensor([-1, 0, 1]), torch.tensor([5, 6, 7]), torch.tensor([2, 2, 2])
    assert TreePaths.from_tree(parent, ids, kv_end, torch.tensor([1]), torch.tensor([7])).num_rows == 3
    with pytest.raises(ValueError, match="target_ids must be token ids"):  # a -100 label read as row 0's child
        TreePaths.from_tree(parent, ids, kv_end, torch.tensor([1]), torch.tensor([-1]))
    with pytest.raises(ValueError, match="target_ids must hold integers"):
        TreePaths.from_tree(parent, ids, kv_end, torch.tensor([1]), torch.tensor([7.0]))
    with pytest.raises(ValueError, match="target_rollout must hold integers"):
        TreePaths.from_tree(parent, ids, kv_end, torch.tensor([1]), torch.tensor([7]), torch.tensor([0.5]))
