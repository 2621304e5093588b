"""tree_attention against its dense reference, its block schedule against the dense mask, and the
memory rule (no [N, N] tensor) checked op by op."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from clawfast.kernels import TreeMask, tree_attention, tree_attention_ref, tree_mask_ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_testing import LargestTensor, chains, random_forest, segment_forest

TA = importlib.import_module("clawfast.kernels.tree_attention")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def make_kv_end(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "bushy":
        return random_forest(n, gen, roots=3)[2]
    if kind == "segments":
        return segment_forest(n, gen, max_segment=max(1, n // 4))
    cuts = sorted(torch.randperm(n - 1, generator=gen)[: min(n - 1, 4)].add(1).tolist()) if n > 1 else []
    bounds = [0, *cuts, n]
    return chains([b - a for a, b in zip(bounds, bounds[1:])])


def qkv(n, hq, hkv, d, dtype, gen, device="cpu"):
    def t(h):
        return torch.randn(n, h, d, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()

    return t(hq), t(hkv), t(hkv)


def err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max(max |e|, 1). The inputs are unit normal, so this is the relative error except
    where the reference vanishes: with N = 1, or a tree of one-row chains, dq and dk are exactly 0."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a - e).abs().max() / e.abs().max().clamp(min=1.0))


def compare(q, k, v, kv_end, **kw) -> tuple[float, float, float, float]:
    """Errors of (out, dq, dk, dv) of `tree_attention` against the float64 dense reference."""
    gen = torch.Generator().manual_seed(7)
    g_out = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    out = tree_attention(q, k, v, kv_end.to(q.device), **kw)
    (out.double().cpu() * g_out).sum().backward()
    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = tree_attention_ref(qd, kd, vd, kv_end.cpu(), scale=kw.get("scale"))
    (ref * g_out).sum().backward()
    return err(out, ref), err(q.grad, qd.grad), err(k.grad, kd.grad), err(v.grad, vd.grad)


@contextmanager
def small_blocks(block: int, chunk_elems: int):
    """The CPU path with tiny blocks and score chunks, so small inputs cross many blocks and chunks
    (contiguous and gathered ones)."""
    with mock.patch.object(TA, "_CPU_BLOCK", block), mock.patch.object(TA, "_CPU_CHUNK_ELEMS", chunk_elems):
        yield


SHAPES = st.sampled_from([(1, 1, 8), (4, 2, 16), (6, 2, 24), (3, 3, 5), (8, 1, 32)])  # (Hq, Hkv, D)
KINDS = st.sampled_from(["bushy", "segments", "chains"])


def test_reference_is_the_dense_rule():
    kv_end = torch.tensor([5, 3, 3, 3, 5, 5, 6])
    want = torch.tensor([[j <= i <= int(kv_end[j]) for j in range(7)] for i in range(7)])
    assert torch.equal(tree_mask_ref(kv_end), want)
    with pytest.raises(ValueError, match="kv_end"):
        tree_mask_ref(torch.tensor([0, 0]))


def test_fast_path_gradcheck():
    gen = torch.Generator().manual_seed(0)
    kv_end = segment_forest(23, gen, max_segment=5)
    q, k, v = qkv(23, 4, 2, 6, torch.float64, gen)
    with small_blocks(4, 64):
        assert torch.autograd.gradcheck(lambda q, k, v: tree_attention(q, k, v, kv_end, scale=0.7, backend="torch"),
                                        (q, k, v))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 260), shape=SHAPES, kind=KINDS,
       dtype=st.sampled_from([torch.float64, torch.float32]), block=st.sampled_from([4, 16, 128]),
       chunk_elems=st.sampled_from([256, 1 << 22]))
def test_torch_path_matches_reference(seed, n, shape, kind, dtype, block, chunk_elems):
    gen = torch.Generator().manual_seed(seed)
    kv_end = make_kv_end(kind, n, gen)
    q, k, v = qkv(n, *shape, dtype, gen)
    with small_blocks(block, chunk_elems):
        errs = compare(q, k, v, kv_end, backend="torch")
    assert max(errs) <= TOL[dtype], errs


@pytest.mark.triton
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 90), shape=SHAPES, kind=KINDS,
       dtype=st.sampled_from([torch.float64, torch.float32]))
def test_triton_matches_reference(triton_device, seed, n, shape, kind, dtype):
    gen = torch.Generator().manual_seed(seed)
    kv_end = make_kv_end(kind, n, gen)
    q, k, v = qkv(n, *shape, dtype, gen, device=triton_device)
    errs = compare(q, k, v, kv_end, backend="triton", scale=0.3)
    assert max(errs) <= TOL[dtype], errs


@pytest.mark.triton
def test_triton_half_precision(triton_device):
    gen = torch.Generator().manual_seed(3)
    kv_end = segment_forest(70, gen, max_segment=20)
    q, k, v = qkv(70, 4, 2, 16, torch.bfloat16, gen, device=triton_device)
    errs = compare(q, k, v, kv_end, backend="triton")
    assert max(errs) <= 2e-2, errs  # bf16 inputs and P/dS tiles rounded to bf16, as on a GPU


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 200), kind=KINDS, block=st.sampled_from([1, 3, 8, 32]))
def test_schedule_lists_exactly_the_visible_blocks(seed, n, kind, block):
    kv_end = make_kv_end(kind, n, torch.Generator().manual_seed(seed))
    s = TreeMask(kv_end).schedule(block)
    nb = (n + block - 1) // block
    dense = torch.zeros(nb * block, nb * block, dtype=torch.bool)
    dense[:n, :n] = tree_mask_ref(kv_end)
    blocks = dense.view(nb, block, nb, block)
    any_visible = blocks.any(3).any(1)
    rows_ok = (torch.arange(nb * block) < n).view(nb, block)
    # "full": every real query row of the block sees every real key of the key block
    all_visible = (blocks | ~(rows_ok[:, :, None, None] & rows_ok[None, None, :, :])).all(3).all(1)
    listed = torch.zeros(nb, nb, dtype=torch.bool)
    ptr, idx = s.kv_ptr.tolist(), s.kv_idx.tolist()
    for qb in range(nb):
        kbs = idx[ptr[qb] : ptr[qb + 1]]
        assert kbs == sorted(kbs) and kbs[-1] == qb  # ascending, the diagonal block last
        listed[qb, kbs] = True
    assert torch.equal(listed, any_visible)
    kb = torch.arange(nb)
    seen = (kb[None, :] <= kb[:, None]) & (kb[:, None] <= s.q_hi.long()[None, :])
    assert torch.equal(seen, any_visible)  # the query-block range of each key block
    full = (kb[None, :] < kb[:, None]) & (kb[:, None] <= s.full_hi.long()[None, :])
    assert torch.equal(full, all_visible & (kb[None, :] < kb[:, None]))


def test_visible_pairs_counts_the_mask():
    kv_end = segment_forest(150, torch.Generator().manual_seed(2), max_segment=30)
    assert TreeMask(kv_end).visible_pairs() == int(tree_mask_ref(kv_end).sum())


def test_mask_is_built_once_per_block_size():
    mask = TreeMask(segment_forest(40, torch.Generator().manual_seed(1), max_segment=9))
    assert mask.schedule(8) is mask.schedule(8)
    gen = torch.Generator().manual_seed(4)
    q, k, v = qkv(40, 2, 1, 8, torch.float64, gen)
    a = tree_attention(q, k, v, mask, backend="torch")
    b = tree_attention(q, k, v, mask.kv_end, backend="torch")
    assert torch.equal(a, b)


@pytest.fixture
def real_empty(monkeypatch):
    """torch.empty without this directory's poison: torch.compile traces it with fake tensors, and
    the poison's in-place fill would be traced into the graph. (Same monkeypatch instance as the
    poison fixture, so undo() removes it.)"""
    monkeypatch.undo()


# One compiled FlexAttention forward per case (compiling costs seconds on CPU): the block mask is
# exercised with partial and full blocks, a partial last block, GQA and several trees.
@pytest.mark.parametrize("kind, n", [("segments", 700), ("bushy", 300), ("chains", 333)])
def test_flex_forward_matches_reference(real_empty, kind, n):
    gen = torch.Generator().manual_seed(n)
    kv_end = make_kv_end(kind, n, gen)
    q, k, v = (t.detach() for t in qkv(n, 4, 2, 16, torch.float32, gen))
    out = tree_attention(q, k, v, kv_end, backend="flex")
    ref = tree_attention_ref(q.double(), k.double(), v.double(), kv_end)
    assert err(out, ref) <= 1e-5


def test_flex_block_mask_is_the_schedule():
    kv_end = segment_forest(700, torch.Generator().manual_seed(5), max_segment=200)
    mask = TreeMask(kv_end)
    bm = mask.flex_block_mask()
    s = mask.schedule(128)
    nb = s.num_blocks
    partial = bm.kv_num_blocks[0, 0].long()
    full = bm.full_kv_num_blocks[0, 0].long()
    assert int(full.sum()) > 0 and torch.equal(partial + full, (s.kv_ptr[1:] - s.kv_ptr[:-1]).long())
    dense = torch.zeros(nb, nb, dtype=torch.bool)
    for qb in range(nb):
        dense[qb, bm.kv_indices[0, 0, qb, : partial[qb]].long()] = True
        dense[qb, bm.full_kv_indices[0, 0, qb, : full[qb]].long()] = True
    listed = torch.zeros(nb, nb, dtype=torch.bool)
    for qb in range(nb):
        listed[qb, s.kv_idx[s.kv_ptr[qb] : s.kv_ptr[qb + 1]].long()] = True
    assert torch.equal(dense, listed)


def test_flex_has_no_cpu_backward_and_says_so():
    gen = torch.Generator().manual_seed(0)
    q, k, v = qkv(20, 2, 1, 16, torch.float32, gen)
    with pytest.raises(NotImplementedError, match="backend='torch'"):
        tree_attention(q, k, v, chains([20]), backend="flex")


def test_bad_inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (t.detach() for t in qkv(10, 4, 2, 8, torch.float32, gen))
    kv_end = chains([6, 4])
    with pytest.raises(ValueError, match=r"kv_end\[j\] must lie in \[j, N\).*kv_end\[3\] = 2"):
        tree_attention(q, k, v, torch.tensor([5, 5, 5, 2, 5, 5, 9, 9, 9, 9]))
    with pytest.raises(ValueError, match="kv_end\\[9\\] = 10"):
        tree_attention(q, k, v, torch.tensor([9] * 9 + [10]))
    with pytest.raises(ValueError, match="integers"):
        tree_attention(q, k, v, kv_end.float())
    with pytest.raises(ValueError, match="empty"):
        TreeMask(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="kv_end has 9 rows, q has 10"):
        tree_attention(q, k, v, chains([9]))
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(q[:, :3], k, v, kv_end)
    with pytest.raises(ValueError, match="share a dtype"):
        tree_attention(q, k.double(), v, kv_end)
    with pytest.raises(ValueError, match="3-D"):
        tree_attention(q[None], k, v, kv_end)
    with pytest.raises(ValueError, match="same shape"):
        tree_attention(q, k, v[:, :1], kv_end)
    with pytest.raises(ValueError, match="backend"):
        tree_attention(q, k, v, kv_end, backend="dense")


def test_no_quadratic_tensor_in_forward_and_backward():
    n = 8192
    kv_end = segment_forest(n, torch.Generator().manual_seed(0), max_segment=3000, roots=1)
    assert TreeMask(kv_end).visible_pairs() > n * n // 8  # long paths: a dense mask would matter
    q, k, v = qkv(n, 4, 2, 16, torch.float32, torch.Generator().manual_seed(1))
    with LargestTensor() as seen:
        tree_attention(q, k, v, kv_end, backend="torch").sum().backward()
    # O(N) tensors plus one bounded scores chunk; a [N, N] mask or scores matrix would be 67M
    assert seen.numel <= max(TA._CPU_CHUNK_ELEMS, 64 * n), (seen.numel, seen.op)
    assert q.grad is not None and k.grad is not None
