"""tree_logprobs / linear_logprobs against their dense references (forward and gradients)."""

from __future__ import annotations

import importlib

import pytest
import torch
from clawfast.kernels import linear_logprobs, linear_logprobs_ref, tree_logprobs, tree_logprobs_ref
from clawfast.kernels._common import triton_interpret
from kernel_testing import TOL_FWD, TOL_GRAD, rel_err
from torch.utils._python_dispatch import TorchDispatchMode

tree_logprobs_module = importlib.import_module("clawfast.kernels.tree_logprobs")


def _problem(n, d, v, m, dtype, device="cpu", scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, d, generator=g, dtype=torch.float64) * scale).to(device, dtype)
    weight = (torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5).to(device, dtype)
    rows = torch.randint(0, n, (m,), generator=g).to(device, torch.int32)
    ids = torch.randint(0, v, (m,), generator=g).to(device, torch.int32)
    return hidden, weight, rows, ids


def _compare(hidden, weight, rows, ids, *, temperature=1.0, **kw):
    """Run the fast path and the float64 reference on the same inputs; return four errors."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    lp, ent = tree_logprobs(h, w, rows, ids, temperature=temperature, **kw)
    hd = hidden.detach().cpu().double().requires_grad_()
    wd = weight.detach().cpu().double().requires_grad_()
    lp_r, ent_r = tree_logprobs_ref(hd, wd, rows.cpu(), ids.cpu(), temperature=temperature)
    g = torch.Generator().manual_seed(1)
    g_lp = torch.randn(lp_r.shape, generator=g, dtype=torch.float64)
    g_ent = torch.randn(ent_r.shape, generator=g, dtype=torch.float64)
    (lp.double().cpu() * g_lp).sum().add((ent.double().cpu() * g_ent).sum()).backward()
    (lp_r * g_lp).sum().add((ent_r * g_ent).sum()).backward()
    return (rel_err(lp, lp_r), rel_err(ent, ent_r), rel_err(h.grad, hd.grad),
            rel_err(w.grad, wd.grad))


def test_reference_gradcheck():
    h, w, rows, ids = _problem(6, 5, 9, 8, torch.float64)
    h.requires_grad_()
    w.requires_grad_()

    def f(h, w):
        return tree_logprobs_ref(h, w, rows, ids, temperature=0.7)

    assert torch.autograd.gradcheck(f, (h, w))


def test_linear_reference_gradcheck():
    g = torch.Generator().manual_seed(8)
    h = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[1, -100, 6], [0, 2, 2]])
    assert torch.autograd.gradcheck(lambda h, w: linear_logprobs_ref(h, w, labels), (h, w))


def test_fast_path_gradcheck():
    h, w, rows, ids = _problem(7, 5, 11, 9, torch.float64)
    h.requires_grad_()
    w.requires_grad_()

    def f(h, w):
        return tree_logprobs(h, w, rows, ids, temperature=1.3, backend="torch", chunk_rows=3)

    assert torch.autograd.gradcheck(f, (h, w))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [None, 97])
def test_torch_path_realistic_shape(dtype, chunk_rows):
    # a branchy batch: more targets than rows, odd sizes, several chunks when chunk_rows=97
    h, w, rows, ids = _problem(523, 96, 6007, 700, dtype, seed=2)
    errs = _compare(h, w, rows, ids, temperature=0.9, backend="torch", chunk_rows=chunk_rows)
    assert errs[0] <= TOL_FWD[dtype] and errs[1] <= TOL_FWD[dtype], errs
    # the torch path computes gradients in float32 even for bf16 inputs; only the output rounds
    grad_tol = 1e-2 if dtype == torch.bfloat16 else TOL_FWD[dtype]
    assert errs[2] <= grad_tol and errs[3] <= grad_tol, errs


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("partial_tile", [True, False])
def test_triton_matches_reference(triton_device, dtype, temperature, partial_tile):
    # the forward's last vocabulary tile is partial (masked), or every tile is whole (no masked tile)
    tiles = tree_logprobs_module._INTERPRETER_TILES if triton_interpret() else tree_logprobs_module._FWD_TILES
    vocab = 101 if partial_tile else 6 * tiles["BLOCK_V"]
    h, w, rows, ids = _problem(37, 40, vocab, 53, dtype, device=triton_device, seed=3)
    errs = _compare(h, w, rows, ids, temperature=temperature, backend="triton", chunk_rows=20)
    assert errs[0] <= TOL_FWD[dtype] and errs[1] <= TOL_FWD[dtype], errs
    assert errs[2] <= TOL_GRAD[dtype] and errs[3] <= TOL_GRAD[dtype], errs


@pytest.mark.triton
def test_triton_edge_cases(triton_device):
    # one row with many targets (duplicates included), rows without targets
    h, w, _, _ = _problem(19, 16, 50, 0, torch.float32, device=triton_device, seed=4)
    rows = torch.tensor([5] * 40 + [0, 18], dtype=torch.int32, device=triton_device)
    ids = torch.tensor(list(range(40)) + [3, 3], dtype=torch.int32, device=triton_device)
    ids[:5] = 7
    errs = _compare(h, w, rows, ids, backend="triton")
    assert max(errs) <= 1e-5, errs
    # no targets at all: entropy only (and its gradient)
    empty = torch.zeros(0, dtype=torch.int32, device=triton_device)
    errs = _compare(h, w, empty, empty, backend="triton")
    assert max(errs[1:]) <= 1e-5, errs


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_tree_of_one_token(backend, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    h, w, _, _ = _problem(1, 16, 33, 0, torch.float32, device=device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    lp, ent = tree_logprobs(h, w, empty, empty, backend=backend)
    _, ent_r = tree_logprobs_ref(h.double(), w.double(), empty, empty)
    assert lp.shape == (0,) and rel_err(ent, ent_r) <= 1e-5


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_float32_inputs_stay_float32_under_autocast(backend, request):
    """A caller's autocast does not make the logits half precision: float32 inputs give the same
    accuracy, forward and gradients, inside torch.autocast as outside it."""
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    h, w, rows, ids = _problem(40, 32, 90, 50, torch.float32, device=device, seed=11)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        errs = _compare(h, w, rows, ids, temperature=0.9, backend=backend, chunk_rows=16)
    assert max(errs) <= 1e-5, errs


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_huge_logits_do_not_overflow(backend, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    h, w, rows, ids = _problem(40, 32, 90, 50, torch.float32, device=device, scale=1e4)
    lp, ent = tree_logprobs(h, w, rows, ids, backend=backend, chunk_rows=10)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    lp_r, ent_r = tree_logprobs_ref(h.cpu().double(), w.cpu().double(), rows.cpu(), ids.cpu())
    assert rel_err(lp, lp_r) <= 1e-5
    # float32 logits of size |z| carry an absolute error ~ eps * |z| * sqrt(d); the (near-zero)
    # entropies inherit it, so bound them by the logit scale rather than their own size
    z_max = float((h.cpu().double() @ w.cpu().double().t()).abs().max())
    assert float((ent.cpu().double() - ent_r).abs().max()) <= 1e-5 * z_max


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("where", ["hidden", "weight"])
def test_nan_input_is_a_clear_error(backend, where, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    h, w, rows, ids = _problem(20, 16, 40, 10, torch.float32, device=device)
    (h if where == "hidden" else w)[3, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        tree_logprobs(h, w, rows, ids, backend=backend)


def test_bad_inputs():
    h, w, rows, ids = _problem(10, 8, 20, 5, torch.float32)
    with pytest.raises(ValueError, match="target_ids"):
        tree_logprobs(h, w, rows, ids + 20, backend="torch")
    with pytest.raises(ValueError, match="target_rows"):
        tree_logprobs(h, w, rows - 11, ids, backend="torch")
    with pytest.raises(ValueError, match="share a dtype"):
        tree_logprobs(h, w.double(), rows, ids, backend="torch")
    with pytest.raises(ValueError, match="weight is"):
        tree_logprobs(h, w[:, :5], rows, ids, backend="torch")
    with pytest.raises(ValueError, match="integers"):
        tree_logprobs(h, w, rows.float(), ids, backend="torch")
    with pytest.raises(ValueError, match="temperature"):
        tree_logprobs(h, w, rows, ids, temperature=0.0, backend="torch")
    with pytest.raises(ValueError, match="length"):
        tree_logprobs(h, w, rows, ids[:3], backend="torch")


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.dtype, torch.ops.aten.addmm.default):
            self.rows += out.shape[0] * out.shape[1]
        return out


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_forward_is_one_matmul_pass(grad, backend, request):
    """No-grad or not, the forward multiplies hidden by weight exactly once (N x V products)."""
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    h, w, rows, ids = _problem(130, 24, 300, 90, torch.float32, device=device)
    h.requires_grad_(grad)
    with _CountMatmuls() as count, torch.set_grad_enabled(grad):
        tree_logprobs(h, w, rows, ids, backend=backend, chunk_rows=29)
    assert count.rows == 130 * 300


@pytest.mark.parametrize("n, v", [(32768, 128256), (100, 151936), (5000, 4096), (70, 1 << 22), (0, 10)])
def test_gpu_chunks_are_whole_row_tiles(n, v):
    """A GPU chunk holds at most its budget of logits, in a multiple of 256 rows where the budget
    holds 256 rows, and never more rows than there are."""
    for elems in (tree_logprobs_module._GPU_FWD_CHUNK_ELEMS, tree_logprobs_module._GPU_BWD_CHUNK_ELEMS):
        rows = tree_logprobs_module._chunk_rows(n, v, None, elems, tree_logprobs_module._GPU_ROW_ALIGN)
        assert 1 <= rows <= max(n, 1) and (rows * v <= elems or rows == 1)
        if n >= elems // v >= 256:
            assert rows % 256 == 0 and rows > elems // v - 256, rows
    assert tree_logprobs_module._chunk_rows(32768, 128256, None, 1 << 26, 256) == 512


def test_linear_logprobs_matches_naive():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 17, 32, generator=g, requires_grad=True)
    weight = torch.randn(211, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 211, (3, 17), generator=g)
    labels[0, :4] = -100
    labels[2, -1] = -100
    lp, ent = linear_logprobs(hidden, weight, labels, temperature=0.8, backend="torch")
    hd = hidden.detach().double().requires_grad_()
    wd = weight.detach().double().requires_grad_()
    lp_r, ent_r = linear_logprobs_ref(hd, wd, labels, temperature=0.8)
    assert lp.shape == labels.shape and ent.shape == labels.shape
    assert bool((lp[labels == -100] == 0).all())
    assert rel_err(lp, lp_r) <= 1e-5 and rel_err(ent, ent_r) <= 1e-5
    (lp.sum() + 0.1 * ent.sum()).backward()
    (lp_r.sum() + 0.1 * ent_r.sum()).backward()
    assert rel_err(hidden.grad, hd.grad) <= 1e-5 and rel_err(weight.grad, wd.grad) <= 1e-5


def test_linear_logprobs_shape_error():
    with pytest.raises(ValueError, match="labels"):
        linear_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_gradient_of_logprobs_alone(backend, request):
    """Entropy unused: its gradient arrives as None and the backward skips the entropy term."""
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    h, w, rows, ids = _problem(45, 24, 70, 60, torch.float32, device=device, seed=9)
    h.requires_grad_()
    w.requires_grad_()
    lp, _ = tree_logprobs(h, w, rows, ids, temperature=0.8, backend=backend, chunk_rows=16)
    lp.sum().backward()
    hd = h.detach().cpu().double().requires_grad_()
    wd = w.detach().cpu().double().requires_grad_()
    tree_logprobs_ref(hd, wd, rows.cpu(), ids.cpu(), temperature=0.8)[0].sum().backward()
    assert rel_err(h.grad, hd.grad) <= 1e-5 and rel_err(w.grad, wd.grad) <= 1e-5


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_a_second_derivative_raises_instead_of_coming_out_wrong(backend, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    h, w, rows, ids = (t.to(device) for t in _problem(7, 5, 11, 9, torch.float32))
    h.requires_grad_()
    lp, _ = tree_logprobs(h, w, rows, ids, backend=backend)
    with pytest.raises(RuntimeError, match="tree_logprobs is differentiable once"):
        torch.autograd.grad(lp.sum(), h, create_graph=True)
