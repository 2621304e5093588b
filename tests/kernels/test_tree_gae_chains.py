"""tree_gae's chain form (torch backend) on branched forests with long chains, both code paths."""

from __future__ import annotations

import sys

import pytest
import torch
from clawfast.kernels import subtree_scan, tree_gae, tree_gae_ref
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import random_forest, rel_err

_MOD = sys.modules["clawfast.kernels.tree_gae"]


def _stretch(parent, lengths):
    """Every node of a DFS forest becomes a chain of lengths[i] rows (DFS order kept)."""
    out, last = [], []
    for i, p in enumerate(parent.tolist()):
        out.append(last[p] if p >= 0 else -1)
        out.extend(range(len(out) - 1, len(out) - 1 + lengths[i] - 1))
        last.append(len(out) - 1)
    return torch.tensor(out, dtype=torch.int32)


@pytest.fixture(params=[0, 10**9], ids=["chains", "rows"])
def path_choice(request, monkeypatch):
    # 0: always the chain form; 10**9: always pointer doubling over the rows
    monkeypatch.setattr(_MOD, "MIN_ROWS_PER_CHAIN", request.param)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), seed=st.integers(0, 10_000), mode=st.sampled_from(["path", "tree"]),
       gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0), longest=st.integers(1, 9),
       f32=st.booleans())
def test_chain_form_matches_reference(n, seed, mode, gamma, lam, longest, f32):
    g = torch.Generator().manual_seed(seed)
    base, _, _ = random_forest(n, g, roots=1 + seed % 3)
    parent = _stretch(base, torch.randint(1, longest + 1, (n,), generator=g).tolist())
    k = parent.shape[0]
    dt = torch.float32 if f32 else torch.float64
    r, v = (torch.randn(k, generator=g, dtype=torch.float64).to(dt) for _ in range(2))
    m = (torch.rand(k, generator=g) < 0.6).to(dt)
    adv_r, ret_r = tree_gae_ref(r.double(), v.double(), parent, mask=m.double(), gamma=gamma,
                                lam=lam, mode=mode)
    tol = 1e-5 if f32 else 1e-10
    for force in (0, 10**9):
        old, _MOD.MIN_ROWS_PER_CHAIN = _MOD.MIN_ROWS_PER_CHAIN, force
        try:
            adv, ret = tree_gae(r, v, parent, mask=m, gamma=gamma, lam=lam, mode=mode,
                                backend="torch")
        finally:
            _MOD.MIN_ROWS_PER_CHAIN = old
        assert adv.dtype == dt
        torch.testing.assert_close(adv.double(), adv_r, rtol=tol, atol=tol)
        torch.testing.assert_close(ret.double(), ret_r, rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", range(4))
def test_subtree_scan_any_coefficients(path_choice, seed):
    # coefficients of any sign, some exactly 0 (they cut chains), against a reverse loop
    g = torch.Generator().manual_seed(seed)
    base, _, _ = random_forest(60, g, roots=3)
    parent = _stretch(base, torch.randint(1, 12, (60,), generator=g).tolist())
    k = parent.shape[0]
    b = torch.randn(k, generator=g, dtype=torch.float64)
    mu = torch.randn(k, generator=g, dtype=torch.float64) * (torch.rand(k, generator=g) < 0.8)
    expect = b.clone()
    for i in reversed(range(k)):
        if int(parent[i]) >= 0:
            expect[int(parent[i])] += mu[i] * expect[i]
    assert rel_err(subtree_scan(b, parent, mu, backend="torch"), expect) <= 1e-12
