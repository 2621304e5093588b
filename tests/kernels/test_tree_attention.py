"""tree_attention against its dense reference, its block schedule against the dense mask, and the
memory rule (no [N, N] tensor) checked op by op."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from clawfast.kernels import TreeMask, tree_attention, tree_attention_ref, tree_mask_ref
from clawfast.kernels import _common, tree_attention_torch
from clawfast.kernels._common import dropout_keep, dropout_threshold
from clawfast.kernels.tree_attention_triton import triton_refuses
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_testing import LargestTensor, chains, random_forest, segment_forest

TA = importlib.import_module("clawfast.kernels.tree_attention")  # the package's attribute is the function
TAT = importlib.import_module("clawfast.kernels.tree_attention_triton")
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


def compare(q, k, v, kv_end, *, sinks=None, backend, **options) -> tuple[float, ...]:
    """Errors of (out, dq, dk, dv[, dsinks]) of `tree_attention` against the float64 dense
    reference; ``options`` (scale, window, softcap) go to both."""
    gen = torch.Generator().manual_seed(7)
    g_out = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    out = tree_attention(q, k, v, kv_end.to(q.device), sinks=sinks, backend=backend, **options)
    (out.double().cpu() * g_out).sum().backward()
    ref_inputs = [t.detach().cpu().double().requires_grad_() for t in inputs]
    ref = tree_attention_ref(*ref_inputs[:3], kv_end.cpu(), sinks=ref_inputs[3] if sinks is not None else None,
                             **options)
    (ref * g_out).sum().backward()
    return (err(out, ref), *(err(t.grad, r.grad) for t, r in zip(inputs, ref_inputs)))


def sink_logits(hq, dtype, gen, device="cpu"):
    # around the scores' scale, so the sink takes a real share of each row's softmax
    return (torch.randn(hq, generator=gen, dtype=torch.float64) + 1.0).to(device, dtype).requires_grad_()


# The options of HF decoders: no window / one shorter than many paths, softcap, sinks, dropout.
OPTIONS = st.fixed_dictionaries({"window": st.sampled_from([None, 1, 3, 17]),
                                 "softcap": st.sampled_from([None, 0.5, 30.0]), "sinks": st.booleans(),
                                 "dropout_p": st.sampled_from([0.0, 0.3]), "seed": st.integers(0, 2**31 - 1)})


@contextmanager
def small_blocks(block: int, chunk_elems: int):
    """The CPU path with tiny blocks and score chunks, so small inputs cross many blocks and chunks
    (contiguous and gathered ones)."""
    with (mock.patch.object(TA, "CPU_BLOCK", block),
          mock.patch.object(tree_attention_torch, "_CPU_CHUNK_ELEMS", chunk_elems)):
        yield


SHAPES = st.sampled_from([(1, 1, 8), (4, 2, 16), (6, 2, 24), (3, 3, 5), (8, 1, 32)])  # (Hq, Hkv, D)
KINDS = st.sampled_from(["bushy", "segments", "chains"])


def test_reference_is_the_dense_rule():
    kv_end = torch.tensor([5, 3, 3, 3, 5, 5, 6])
    want = torch.tensor([[j <= i <= int(kv_end[j]) for j in range(7)] for i in range(7)])
    assert torch.equal(tree_mask_ref(kv_end), want)
    with pytest.raises(ValueError, match="kv_end"):
        tree_mask_ref(torch.tensor([0, 0]))


def test_reference_options_are_the_path_alone():
    """The reference's window, softcap and sinks on a forest are those of each path attended alone
    as one causal sequence, written out from their definitions (window: HF's
    ``kv_idx > q_idx - sliding_window``; sinks: gpt-oss's extra softmax column)."""
    gen = torch.Generator().manual_seed(5)
    kv_end = random_forest(9, gen, roots=2)[2]
    allowed = tree_mask_ref(kv_end)
    q, k, v = (t.detach() for t in qkv(9, 2, 1, 4, torch.float64, gen))
    sinks = torch.tensor([0.3, -0.4], dtype=torch.float64)
    got = tree_attention_ref(q, k, v, kv_end, window=2, softcap=0.8, sinks=sinks)
    assert int(allowed.sum(1).max()) > 2  # some path is longer than the window
    for i in range(9):
        path = torch.nonzero(allowed[i]).flatten()  # ancestors of i and i, in order: a causal sequence
        keys = path[-2:]  # window 2: positions p - 1 and p
        s = 0.8 * torch.tanh(torch.einsum("hd,jd->hj", q[i], k[keys, 0]) * 0.5 / 0.8)  # scale 1 / sqrt(4)
        w = torch.softmax(torch.cat([s, sinks[:, None]], 1), 1)[:, :-1]
        assert torch.allclose(got[i], w @ v[keys, 0], rtol=0, atol=1e-12)


def test_dropout_mask_drops_its_fraction_independently():
    rows = torch.arange(600)
    keep = dropout_keep(7, torch.arange(4), rows, rows, dropout_threshold(0.3))
    assert keep.shape == (4, 600, 600) and abs(float(keep.float().mean()) - 0.7) < 0.005
    # neighbours, heads and seeds agree as often as independent draws would (0.7^2 + 0.3^2 = 0.58)
    for other in (keep[:, :, 1:] == keep[:, :, :-1], keep[:, 1:] == keep[:, :-1], keep[1:] == keep[:-1],
                  dropout_keep(8, torch.arange(4), rows, rows, dropout_threshold(0.3)) == keep):
        assert abs(float(other.float().mean()) - 0.58) < 0.005


def test_dropout_draws_its_seed_from_torchs_generator():
    gen = torch.Generator().manual_seed(2)
    kv_end = segment_forest(50, gen, max_segment=20)
    q, k, v = (t.detach() for t in qkv(50, 2, 1, 8, torch.float64, gen))
    torch.manual_seed(5)
    a = tree_attention(q, k, v, kv_end, dropout_p=0.5)
    torch.manual_seed(5)
    b = tree_attention(q, k, v, kv_end, dropout_p=0.5)
    c = tree_attention(q, k, v, kv_end, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, tree_attention(q, k, v, kv_end))


def test_depth_is_the_number_of_ancestors():
    kv_end = random_forest(300, torch.Generator().manual_seed(3), roots=4)[2]
    assert torch.equal(TreeMask(kv_end).depth().long(), tree_mask_ref(kv_end).sum(1) - 1)
    assert TreeMask(chains([5, 9])).max_depth() == 8


def test_fast_path_gradcheck():
    gen = torch.Generator().manual_seed(0)
    kv_end = segment_forest(23, gen, max_segment=5)
    q, k, v = qkv(23, 4, 2, 6, torch.float64, gen)
    sinks = sink_logits(4, torch.float64, gen)
    with small_blocks(4, 64):
        assert torch.autograd.gradcheck(lambda q, k, v: tree_attention(q, k, v, kv_end, scale=0.7, backend="torch"),
                                        (q, k, v))
        assert torch.autograd.gradcheck(
            lambda q, k, v, sinks: tree_attention(q, k, v, kv_end, scale=0.7, window=3, softcap=0.9, sinks=sinks,
                                                  dropout_p=0.2, seed=11, backend="torch"), (q, k, v, sinks))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 260), shape=SHAPES, kind=KINDS,
       dtype=st.sampled_from([torch.float64, torch.float32]), block=st.sampled_from([4, 16, 128]),
       chunk_elems=st.sampled_from([256, 1 << 22]), options=OPTIONS)
def test_torch_path_matches_reference(seed, n, shape, kind, dtype, block, chunk_elems, options):
    gen = torch.Generator().manual_seed(seed)
    kv_end = make_kv_end(kind, n, gen)
    q, k, v = qkv(n, *shape, dtype, gen)
    sinks = sink_logits(shape[0], dtype, gen) if options.pop("sinks") else None
    with small_blocks(block, chunk_elems):
        errs = compare(q, k, v, kv_end, sinks=sinks, backend="torch", **options)
    assert max(errs) <= TOL[dtype], errs


@pytest.mark.triton
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 90), shape=SHAPES, kind=KINDS, options=OPTIONS)
def test_triton_matches_reference(triton_device, seed, n, shape, kind, options):
    dtype = torch.float32  # the Triton kernels take half types and float32 (float64: the torch path)
    gen = torch.Generator().manual_seed(seed)
    kv_end = make_kv_end(kind, n, gen)
    q, k, v = qkv(n, *shape, dtype, gen, device=triton_device)
    sinks = sink_logits(shape[0], dtype, gen, device=triton_device) if options.pop("sinks") else None
    errs = compare(q, k, v, kv_end, sinks=sinks, backend="triton", scale=0.3, **options)
    assert max(errs) <= TOL[dtype], errs


# A trunk of 100 rows forking into branches of 40 and 41: at every kernel's interpreter block size
# (16 and 32 rows) its schedule holds full pairs (the trunk under either branch), partial ones (the
# diagonal, the fork, the window's edge) and full pairs of the last query block, which holds padding
# rows; so each kernel runs both of its loops on it.
FORK = torch.tensor([180] * 100 + [139] * 40 + [180] * 41, dtype=torch.int32)


@pytest.mark.triton
@pytest.mark.parametrize("options", [{}, {"window": 120}, {"softcap": 0.9, "dropout_p": 0.3, "seed": 5, "sinks": True}])
def test_triton_walks_full_and_partial_pairs(triton_device, options):
    tiles = TAT.triton_tiles(torch.float32, 16, 0)
    n = FORK.shape[0]
    for kernel in (tiles.fwd, tiles.dq, tiles.dkdv):
        s = TreeMask(FORK).schedule(kernel.block, options.get("window"))
        last = s.num_blocks - 1
        full, partial = s.kv_partial_ptr - s.kv_ptr[:-1], s.kv_ptr[1:] - s.kv_partial_ptr
        assert n % kernel.block and int(full.sum()) > 0 and int(partial.sum()) > 0 and int(full[last]) > 0
    gen = torch.Generator().manual_seed(11)
    q, k, v = qkv(n, 4, 2, 16, torch.float32, gen, device=triton_device)
    options = dict(options)
    sinks = sink_logits(4, torch.float32, gen, device=triton_device) if options.pop("sinks", False) else None
    errs = compare(q, k, v, FORK, sinks=sinks, backend="triton", **options)
    assert max(errs) <= TOL[torch.float32], errs


@pytest.mark.triton
def test_triton_refuses_what_it_has_no_kernel_for_and_auto_gives_it_to_the_torch_path(triton_device):
    gen = torch.Generator().manual_seed(5)
    kv_end = segment_forest(20, gen, max_segment=6)
    q, k, v = qkv(20, 2, 1, 8, torch.float64, gen, device=triton_device)
    with pytest.raises(ValueError, match="Triton path takes float16/bfloat16/float32, got torch.float64"):
        tree_attention(q, k, v, kv_end, backend="triton")
    assert triton_refuses(torch.float64, 8) is not None and triton_refuses(torch.float32, 8) is None
    assert _common.pick_backend("auto", q, triton_refuses="no") == "torch"
    # float32 at head dim 256 has no tile that keeps its registers (bench/results/kernel_compile.md)
    q256, k256, v256 = qkv(20, 2, 1, 256, torch.float32, gen, device=triton_device)
    with pytest.raises(ValueError, match="no float32 kernel for head dim 256"):
        tree_attention(q256, k256, v256, kv_end, backend="triton")
    assert triton_refuses(torch.bfloat16, 256) is None and triton_refuses(torch.bfloat16, 512) is not None


@pytest.mark.triton
def test_triton_half_precision(triton_device):
    gen = torch.Generator().manual_seed(3)
    kv_end = segment_forest(70, gen, max_segment=20)
    q, k, v = qkv(70, 4, 2, 16, torch.bfloat16, gen, device=triton_device)
    errs = compare(q, k, v, kv_end, backend="triton")
    assert max(errs) <= 2e-2, errs  # bf16 inputs and P/dS tiles rounded to bf16, as on a GPU


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 200), kind=KINDS, block=st.sampled_from([1, 3, 8, 32]),
       window=st.sampled_from([None, 1, 4, 40]))
def test_schedule_lists_the_visible_blocks(seed, n, kind, block, window):
    """Without a window the listed pairs are exactly the block pairs with a visible key; with one,
    a superset of them (pruned by depth ranges; exact at block size 1). Full pairs are exact in both
    and listed first (each part ascending), and the key-major lists hold the same pairs, in the same
    two parts."""
    kv_end = make_kv_end(kind, n, torch.Generator().manual_seed(seed))
    s = TreeMask(kv_end).schedule(block, window)
    nb = (n + block - 1) // block
    visible = tree_mask_ref(kv_end, window)
    dense = torch.zeros(nb * block, nb * block, dtype=torch.bool)
    dense[:n, :n] = visible
    blocks = dense.view(nb, block, nb, block)
    any_visible = blocks.any(3).any(1)
    rows_ok = (torch.arange(nb * block) < n).view(nb, block)
    # "full": every real query row of the block sees every real key of the key block
    all_visible = (blocks | ~(rows_ok[:, :, None, None] & rows_ok[None, None, :, :])).all(3).all(1)
    listed = torch.zeros(nb, nb, dtype=torch.bool)
    full = torch.zeros(nb, nb, dtype=torch.bool)
    ptr, part, idx = s.kv_ptr.tolist(), s.kv_partial_ptr.tolist(), s.kv_idx.tolist()
    for qb in range(nb):
        kbs = idx[ptr[qb] : ptr[qb + 1]]
        full_kbs, partial_kbs = idx[ptr[qb] : part[qb]], idx[part[qb] : ptr[qb + 1]]
        assert full_kbs == sorted(full_kbs) and partial_kbs == sorted(partial_kbs) and kbs[-1] == qb
        listed[qb, kbs] = True
        full[qb, full_kbs] = True
    if window is None or block == 1:
        assert torch.equal(listed, any_visible)
    else:
        assert not bool((any_visible & ~listed).any())  # nothing visible is left out
    assert torch.equal(full, all_visible & listed & ~torch.eye(nb, dtype=torch.bool))
    by_key = torch.zeros(nb, nb, dtype=torch.bool)
    qptr, qpart, qidx = s.q_ptr.tolist(), s.q_partial_ptr.tolist(), s.q_idx.tolist()
    for kb in range(nb):
        full_qbs, partial_qbs = qidx[qptr[kb] : qpart[kb]], qidx[qpart[kb] : qptr[kb + 1]]
        assert full_qbs == sorted(full_qbs) and partial_qbs == sorted(partial_qbs)
        assert bool(full[full_qbs, kb].all()) and not bool(full[partial_qbs, kb].any())
        by_key[full_qbs + partial_qbs, kb] = True
    assert torch.equal(by_key, listed)


def test_window_prunes_the_blocks_of_long_paths():
    mask = TreeMask(chains([6000, 10000]))
    full, windowed = mask.schedule(128), mask.schedule(128, 256)
    # a query block reaches back at most 256 rows: the diagonal and up to 3 blocks before, also the
    # block holding the first chain's end and the second's start (depths ~6000 and 0: only its
    # first-chain rows see the first chain's blocks, and only their depths count)
    per_query = (windowed.kv_ptr[1:] - windowed.kv_ptr[:-1]).tolist()
    assert max(per_query) <= 4 and windowed.num_pairs < full.num_pairs // 10


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
# One case runs a window and softcap (a score_mod) through flex; two run sinks (the virtual key row N:
# in a new key block at N = 640, inside the partial last block at N = 333, with window and softcap).
@pytest.mark.parametrize("kind, n, options", [("segments", 700, {}), ("bushy", 300, {}), ("chains", 333, {}),
                                              ("segments", 700, {"window": 150, "softcap": 0.9}),
                                              ("bushy", 640, {"sinks": True}),
                                              ("chains", 333, {"sinks": True, "window": 50, "softcap": 0.9})])
def test_flex_forward_matches_reference(real_empty, kind, n, options):
    gen = torch.Generator().manual_seed(n)
    kv_end = make_kv_end(kind, n, gen)
    q, k, v = (t.detach() for t in qkv(n, 4, 2, 16, torch.float32, gen))
    if options.get("sinks"):
        options = {**options, "sinks": torch.randn(4, generator=gen, dtype=torch.float32) * 3}
    out = tree_attention(q, k, v, kv_end, backend="flex", **options)
    ref = tree_attention_ref(q.double(), k.double(), v.double(), kv_end, **options)
    assert err(out, ref) <= 1e-5


@pytest.mark.parametrize("window", [None, 300])
def test_flex_block_mask_is_the_schedule(window):
    kv_end = segment_forest(700, torch.Generator().manual_seed(5), max_segment=200)
    mask = TreeMask(kv_end)
    bm = mask.flex_block_mask(window)
    s = mask.schedule(128, window)
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
    with pytest.raises(NotImplementedError, match="backward on CPU.*backend='torch'"):
        tree_attention(q, k, v, chains([20]), backend="flex")


def path_segments_attention(q, k, v, mask: TreeMask, scale: float, window: int | None) -> torch.Tensor:
    """What flash-attention's varlen kernel computes on ``mask.path_segments()``, in plain torch:
    each segment's queries against its gathered keys, causal aligned to the bottom right (query i of
    Lq sees keys up to i + Lk - Lq), a window of W keeping the last W of those."""
    seg = mask.path_segments()
    keys, values = k[seg.key_rows], v[seg.key_rows]
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for s in range(seg.cu_q.shape[0] - 1):
        (qa, qb), (ka, kb) = seg.cu_q[s:s + 2].tolist(), seg.cu_k[s:s + 2].tolist()
        last = torch.arange(qb - qa)[:, None] + (kb - ka) - (qb - qa)  # each query's own key position
        key = torch.arange(kb - ka)[None]
        seen = (key <= last) & (key > last - window if window is not None else True)
        scores = torch.einsum("qhd,khd->hqk", q[qa:qb], keys[ka:kb].repeat_interleave(group, 1)) * scale
        weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        out[qa:qb] = torch.einsum("hqk,khd->qhd", weights, values[ka:kb].repeat_interleave(group, 1))
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 120), kind=KINDS, shape=SHAPES,
       window=st.sampled_from([None, 1, 3, 17]))
def test_path_segments_are_the_tree_mask_as_bottom_right_causal_sequences(seed, n, kind, shape, window):
    """Backend "varlen" hands flash-attention's varlen kernel the mask's path segments: each a run of
    rows each the child of the previous, its keys the path from the root. Attended causally, aligned
    to the bottom right (flash-attention 2's rule when keys outnumber queries), with the window over
    key positions, they are the tree mask (float64, against the dense reference); the keys gathered
    are N plus each segment's depth."""
    gen = torch.Generator().manual_seed(seed)
    kv_end = make_kv_end(kind, n, gen)
    hq, hkv, d = shape
    q, k, v = (t.detach() for t in qkv(n, hq, hkv, d, torch.float64, gen))
    mask = TreeMask(kv_end)
    seg = mask.path_segments()
    starts = seg.cu_q[:-1].long()
    assert seg.gathered_rows == n + int(mask.depth()[starts].sum())
    assert seg.cu_q[-1] == n and seg.cu_k[-1] == seg.gathered_rows
    assert seg.max_q == int(seg.cu_q.diff().max()) and seg.max_k == int(seg.cu_k.diff().max())
    scale = d ** -0.5
    expected = tree_attention_ref(q, k, v, kv_end, scale=scale, window=window)
    assert err(path_segments_attention(q, k, v, mask, scale, window), expected) < 1e-12


def test_path_segments_take_every_forest_and_refuse_every_other_mask():
    """Every kv_end of up to 6 rows: where its intervals [j, kv_end[j]] nest (a forest in DFS order)
    each query's keys are exactly its visible rows, else a ValueError names a row (the other
    backends compute such a mask as given; path segments cannot hold it)."""
    import itertools

    for n in range(1, 7):
        for kv_end in itertools.product(*(range(j, n) for j in range(n))):
            # nested: a row inside another's interval has its interval inside it
            forest = all(kv_end[b] <= kv_end[a] for a in range(n) for b in range(a + 1, kv_end[a] + 1))
            mask = TreeMask(torch.tensor(kv_end))
            if not forest:
                with pytest.raises(ValueError, match="not a forest"):
                    mask.path_segments()
                continue
            seg = mask.path_segments()
            seen = set()
            for s in range(seg.cu_q.shape[0] - 1):
                (qa, qb), (ka, kb) = seg.cu_q[s:s + 2].tolist(), seg.cu_k[s:s + 2].tolist()
                for i in range(qa, qb):  # bottom-right causal: its own key is (kb - ka) - (qb - i) into the keys
                    seen |= {(i, j) for j in seg.key_rows[ka:kb - (qb - 1 - i)].tolist()}
            assert seen == {(i, j) for j in range(n) for i in range(j, kv_end[j] + 1)}, kv_end


@pytest.mark.parametrize("window", [None, 3])
def test_varlen_calls_pytorchs_flash_ops_as_their_schemas_and_meta_kernels_take_them(window):
    """The CUDA kernel itself runs only on a GPU (bench/gpu_correctness.py's varlen cases check it
    against float64); here the forward and backward call PyTorch's flash-attention ops on meta tensors:
    their schemas take our arguments, GQA shapes included, and the gradients come back in the inputs'
    shapes and dtype."""
    import dataclasses

    from clawfast.kernels.tree_attention_schedule import Scores
    from clawfast.kernels.tree_attention_varlen import VarlenTreeAttention

    seg = TreeMask(torch.tensor([5, 5, 5, 4, 4, 5, 6])).path_segments()
    meta = dataclasses.replace(seg, **{f: getattr(seg, f).to("meta") for f in ("cu_q", "cu_k", "key_rows")})
    q, k, v = (torch.zeros(7, h, 64, dtype=torch.bfloat16, device="meta", requires_grad=True) for h in (4, 2, 2))
    out = VarlenTreeAttention.apply(q, k, v, meta, Scores(0.125, window=window))
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    out.backward(torch.zeros_like(out))
    assert [(t.grad.shape, t.grad.dtype) for t in (q, k, v)] == [(t.shape, t.dtype) for t in (q, k, v)]


def test_varlen_says_what_it_cannot_run():
    """Backend "varlen" is flash-attention's CUDA kernel in half precision without softcap, sinks or
    dropout: anything else is refused with the reason (on this CPU, the device last)."""
    gen = torch.Generator().manual_seed(0)
    kv_end = chains([12])
    for dtype, d, options, reason in [
        (torch.float32, 16, {}, "float16 or bfloat16"),
        (torch.bfloat16, 12, {}, "multiples of 8"),
        (torch.bfloat16, 16, {"softcap": 30.0, "dropout_p": 0.1}, "no softcap, dropout"),
        (torch.bfloat16, 16, {"sinks": True}, "no sinks"),
        (torch.bfloat16, 16, {}, "CUDA kernel; q is on cpu"),
    ]:
        q, k, v = qkv(12, 2, 1, d, dtype, gen)
        if options.pop("sinks", False):
            options["sinks"] = sink_logits(2, dtype, gen)
        with pytest.raises(ValueError, match=reason):
            tree_attention(q, k, v, kv_end, backend="varlen", **options)


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
    for window in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive int"):
            tree_attention(q, k, v, kv_end, window=window)
    for softcap in (0.0, -1.0, float("inf"), "50"):
        with pytest.raises(ValueError, match="softcap must be a positive finite number"):
            tree_attention(q, k, v, kv_end, softcap=softcap)
    for scale in (0.0, -0.5, float("nan"), True):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            tree_attention(q, k, v, kv_end, scale=scale)
    with pytest.raises(ValueError, match=r"sinks must be a floating-point tensor \[Hq\] = \[4\].*\(2,\)"):
        tree_attention(q, k, v, kv_end, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="sinks must be a floating-point"):
        tree_attention(q, k, v, kv_end, sinks=torch.zeros(4, dtype=torch.long))
    for p in (-0.1, 1.0, "0.1"):
        with pytest.raises(ValueError, match="dropout_p must be a probability"):
            tree_attention(q, k, v, kv_end, dropout_p=p)
    for seed in (-1, 2**31, 1.5):
        with pytest.raises(ValueError, match="seed must be an int"):
            tree_attention(q, k, v, kv_end, dropout_p=0.1, seed=seed)
    with pytest.raises(ValueError, match="FlexAttention has no attention dropout"):
        tree_attention(q, k, v, kv_end, dropout_p=0.1, backend="flex")


def test_no_quadratic_tensor_in_forward_and_backward():
    n = 8192
    kv_end = segment_forest(n, torch.Generator().manual_seed(0), max_segment=3000, roots=1)
    assert TreeMask(kv_end).visible_pairs() > n * n // 8  # long paths: a dense mask would matter
    q, k, v = qkv(n, 4, 2, 16, torch.float32, torch.Generator().manual_seed(1))
    with LargestTensor() as seen:
        tree_attention(q, k, v, kv_end, backend="torch").sum().backward()
    # O(N) tensors plus one bounded scores chunk; a [N, N] mask or scores matrix would be 67M
    assert seen.numel <= max(tree_attention_torch._CPU_CHUNK_ELEMS, 64 * n), (seen.numel, seen.op)
    assert q.grad is not None and k.grad is not None


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_a_second_derivative_raises_instead_of_going_missing(backend, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(2)
    q, k, v = qkv(9, 2, 1, 16, torch.float32, gen, device)
    out = tree_attention(q, k, v, chains([4, 5]).to(device), backend=backend)
    with pytest.raises(RuntimeError, match="tree_attention is differentiable once"):
        torch.autograd.grad(out.square().sum(), v, create_graph=True)
    (dv,) = torch.autograd.grad(out.square().sum(), v)  # the first derivative still runs
    assert dv.shape == v.shape
