"""tree_gae against the per-path verl loop and the per-node tree-backup loop."""

from __future__ import annotations

import pytest
import torch
from clawfast.kernels import subtree_scan, tree_gae, tree_gae_ref
from clawfast.kernels.reference import gae_loop
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import random_forest, rel_err


def _inputs(n, seed, dtype=torch.float64, mask_p=0.7, roots=2):
    g = torch.Generator().manual_seed(seed)
    parent, _, _ = random_forest(n, g, roots=roots)
    rewards = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    values = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    mask = (torch.rand(n, generator=g) < mask_p).to(dtype)
    return rewards, values, parent, mask


@pytest.mark.parametrize("mode", ["path", "tree"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference(mode, dtype, seed):
    r, v, parent, mask = _inputs(150, seed, dtype)
    gamma, lam = 0.99, 0.9 if seed else 1.0
    adv, ret = tree_gae(r, v, parent, mask=mask, gamma=gamma, lam=lam, mode=mode, backend="torch")
    adv_r, ret_r = tree_gae_ref(r.double(), v.double(), parent, mask=mask.double(), gamma=gamma,
                                lam=lam, mode=mode)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert rel_err(adv, adv_r) <= tol and rel_err(ret, ret_r) <= tol


@pytest.mark.triton
@pytest.mark.parametrize("mode", ["path", "tree"])
def test_triton_matches_reference(triton_device, mode):
    r, v, parent, mask = _inputs(90, 7, torch.float32)
    dev = triton_device
    adv, ret = tree_gae(r.to(dev), v.to(dev), parent.to(dev), mask=mask.to(dev), gamma=0.97,
                        lam=0.95, mode=mode, backend="triton")
    adv_r, ret_r = tree_gae_ref(r.double(), v.double(), parent, mask=mask.double(), gamma=0.97,
                                lam=0.95, mode=mode)
    assert rel_err(adv, adv_r) <= 1e-5 and rel_err(ret, ret_r) <= 1e-5


def test_single_chain_is_verl_loop():
    # a flat sequence of 3000 tokens: one path, so both modes are exactly verl's GAE
    n = 3000
    g = torch.Generator().manual_seed(3)
    r, v = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) < 0.5).double()
    parent = torch.arange(-1, n - 1, dtype=torch.int32)
    adv_l, ret_l = gae_loop(r[None], v[None], mask[None], 0.99, 0.95)
    for mode in ("path", "tree"):
        adv, ret = tree_gae(r, v, parent, mask=mask, gamma=0.99, lam=0.95, mode=mode)
        assert rel_err(adv, adv_l[0]) <= 1e-10 and rel_err(ret, ret_l[0]) <= 1e-10


def test_modes_differ_only_at_unbalanced_branches():
    # root -> a (one leaf below) and root -> b -> {c, d} (two leaves): path weighs b 2/3, tree 1/2
    parent = torch.tensor([-1, 0, 0, 2, 2], dtype=torch.int32)
    r = torch.tensor([0.0, 1.0, 0.0, 0.0, 4.0], dtype=torch.float64)
    v = torch.zeros(5, dtype=torch.float64)
    adv_p, _ = tree_gae(r, v, parent, mode="path")
    adv_t, _ = tree_gae(r, v, parent, mode="tree")
    assert float(adv_p[0]) == pytest.approx((1.0 + 0.0 + 4.0) / 3)  # mean over the 3 paths
    assert float(adv_t[0]) == pytest.approx(0.5 * 1.0 + 0.5 * (0.5 * 0.0 + 0.5 * 4.0))


def test_edge_cases():
    empty = torch.zeros(0, dtype=torch.float32)
    adv, ret = tree_gae(empty, empty, torch.zeros(0, dtype=torch.int32))
    assert adv.shape == (0,) and ret.shape == (0,)
    one = torch.tensor([2.0])
    adv, ret = tree_gae(one, torch.tensor([0.5]), torch.tensor([-1]), gamma=0.9)
    assert float(adv[0]) == pytest.approx(1.5) and float(ret[0]) == pytest.approx(2.0)
    # every token is context: nothing to credit, advantages are 0 and returns are the values
    r, v, parent, _ = _inputs(40, 5)
    adv, ret = tree_gae(r, v, parent, mask=torch.zeros(40, dtype=torch.float64), mode="tree")
    assert bool((adv == 0).all()) and torch.equal(ret, v)


def test_bad_inputs():
    r, v, parent, _ = _inputs(10, 6)
    bad = r.clone()
    bad[4] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        tree_gae(bad, v, parent)
    with pytest.raises(ValueError, match="parent_row"):
        tree_gae(r, v, torch.arange(10))
    with pytest.raises(ValueError, match="mode"):
        tree_gae(r, v, parent, mode="paths")
    with pytest.raises(ValueError, match="gamma"):
        tree_gae(r, v, parent, gamma=1.5)
    with pytest.raises(ValueError, match="length"):
        tree_gae(r, v[:5], parent)


def test_subtree_scan_deep_chain():
    # depth 4095: 12 doubling steps; coefficients < 1 multiply down to underflow without harm
    n = 4096
    parent = torch.arange(-1, n - 1)
    b = torch.rand(n, dtype=torch.float64)
    mu = torch.full((n,), 0.999, dtype=torch.float64)
    x = subtree_scan(b, parent, mu)
    expect = torch.zeros(n, dtype=torch.float64)
    acc = 0.0
    for i in reversed(range(n)):
        acc = float(b[i]) + (0.999 * acc if i + 1 < n else 0.0)
        expect[i] = acc
    assert rel_err(x, expect) <= 1e-12


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 10_000), mode=st.sampled_from(["path", "tree"]),
       gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0))
def test_property_random_trees(n, seed, mode, gamma, lam):
    r, v, parent, mask = _inputs(n, seed, roots=1 + seed % 3)
    adv, ret = tree_gae(r, v, parent, mask=mask, gamma=gamma, lam=lam, mode=mode)
    adv_r, ret_r = tree_gae_ref(r, v, parent, mask=mask, gamma=gamma, lam=lam, mode=mode)
    torch.testing.assert_close(adv, adv_r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret, ret_r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_subtree_scan_checks_its_forest(backend, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    b, mu = torch.ones(3, device=device), torch.ones(3, device=device)
    for parent in ([0, 0, 1], [-1, 2, 1], [-5, 0, 1]):  # a self-parent and a cycle would loop forever
        with pytest.raises(ValueError, match="parent_row"):
            subtree_scan(b, torch.tensor(parent, device=device), mu, backend=backend)
    with pytest.raises(ValueError, match="mu has length 2"):
        subtree_scan(b, torch.tensor([-1, 0, 1], device=device), mu[:2], backend=backend)
    with pytest.raises(ValueError, match="parent_row must hold integers"):
        subtree_scan(b, torch.tensor([-1.0, 0.0, 1.0], device=device), mu, backend=backend)
