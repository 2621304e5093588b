"""GAE over a packed tree: a reverse segmented scan, no Python loop over time steps.

Rows are tokens in DFS order (``parent_row[i] < i``, -1 at a root); a row's successors are its
children, a row without children ends an episode (next value 0). Per row: ``rewards``, ``values``
and ``mask`` (1 for model tokens, 0 for context tokens). Per-row GAE with verl's multi-turn
convention: at a context token the TD error is skipped and the next value and the running
advantage are carried across unchanged, so a context token gets the advantage of the next model
token (a reward placed on a context token is therefore ignored, exactly as in verl).

Two modes, differing only in how a branch point (k > 1 children) combines its children:

- ``"path"`` (the paper's): independent GAE along every root-to-leaf path, and a token shared by
  several paths gets the **mean over the paths through it**. Because GAE is linear in the values
  and rewards, that mean equals a backup in which a branch point weighs each child by the number
  of leaves below it (``L_child / L_row``), which is what is computed (exact, not an approximation).
- ``"tree"`` (tree backup): a branch point bootstraps from the plain mean over its children (each
  child weight ``1/k``): credit propagates across branches regardless of how many leaves each has.

Recurrence (per row i, children c with weights w_c; sums are 0 for a leaf):
    NV_i = sum_c w_c nv_c,   GA_i = sum_c w_c adv_c
    delta_i = r_i + gamma NV_i - v_i
    adv_i = m_i (delta_i + gamma lam GA_i) + (1 - m_i) GA_i,   nv_i = m_i v_i + (1 - m_i) NV_i
    returns = adv + values

Both nv and adv solve ``x_i = b_i + sum_c mu_c x_c``, which ``subtree_scan`` evaluates by pointer
doubling: ceil(log2(depth + 1)) vectorised steps, each one gather and one scatter-add over all rows
(O(N log depth) work, coefficients only multiplied, never divided, so it is numerically tame).
The Triton backend runs each doubling step as one kernel (atomic adds: the summation order, and so
the last bits, may vary between runs). Guaranteed: equality with the per-path / per-node loops of
``tree_gae_ref`` up to float rounding. Not guaranteed: anything for a forest whose subtrees continue
in another micro-batch (run it on whole trees).
"""

from __future__ import annotations

import torch

from ._common import HAS_TRITON, acc_dtype, check_1d, check_finite, check_float, check_int, pick_backend

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _tree_gae_scan_kernel(x_ptr, x_out_ptr, anc_ptr, mu_ptr, anc_out_ptr, mu_out_ptr, N,
                              BLOCK: tl.constexpr):
        """One doubling step: x_out[anc[u]] += mu[u] x[u]; anc_out = anc[anc]; mu_out = mu mu[anc]."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        anc = tl.load(anc_ptr + offs, mask=ok, other=-1)
        valid = ok & (anc >= 0)
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
        mu = tl.load(mu_ptr + offs, mask=ok, other=0.0)
        tl.atomic_add(x_out_ptr + anc, mu * x, mask=valid)
        anc2 = tl.load(anc_ptr + anc, mask=valid, other=-1)
        mu2 = tl.load(mu_ptr + anc, mask=valid, other=0.0)
        tl.store(anc_out_ptr + offs, tl.where(valid, anc2, -1), mask=ok)
        tl.store(mu_out_ptr + offs, mu * mu2, mask=ok)


MODES = ("path", "tree")


def _ancestor_ladder(parent: torch.Tensor) -> list[torch.Tensor]:
    """[anc_0, anc_1, ...]: each row's 2^k-th ancestor, as int64 over N + 1 slots where slot N is
    a sentinel standing for "above the root" (its own ancestor). Shared by every scan on a tree."""
    n = parent.shape[0]
    anc = torch.cat([torch.where(parent >= 0, parent, n), parent.new_full((1,), n)])
    ladder = []
    while bool((anc < n).any()):
        ladder.append(anc)
        anc = anc.gather(0, anc)
    return ladder


def _scan_torch(b: torch.Tensor, ladder: list[torch.Tensor], mu: torch.Tensor) -> torch.Tensor:
    # the sentinel slot keeps every step free of masks: coefficients that would reach above a
    # root are 0 (a root's own coefficient is zeroed), so the sentinel's x stays exactly 0
    n = b.shape[0]
    x = torch.cat([b, b.new_zeros(1)])
    coef = torch.cat([torch.where(ladder[0][:n] < n, mu, 0.0), mu.new_zeros(1)]) if ladder else None
    for anc in ladder:
        # contributions use the pre-step x: S_{k+1}(i) = S_k(i) + sum_{anc_k(u) = i} mu_k(u) S_k(u)
        x.index_add_(0, anc, coef * x)
        coef.mul_(coef.gather(0, anc))
    return x[:n]


def _scan_triton(b: torch.Tensor, parent: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    block = 1024 if b.is_cuda else 64
    grid = (triton.cdiv(n, block),)
    x, anc, coef = b.clone(), parent.clone(), mu.clone()
    x2, anc2, coef2 = torch.empty_like(x), torch.empty_like(anc), torch.empty_like(coef)
    # depth < 2**steps for every row once 2**steps > n; stop early when all pointers are spent
    steps = max(n - 1, 1).bit_length()
    for _ in range(steps):
        x2.copy_(x)
        _tree_gae_scan_kernel[grid](x, x2, anc, coef, anc2, coef2, n, BLOCK=block)
        x, x2, anc, anc2, coef, coef2 = x2, x, anc2, anc, coef2, coef
        if not bool((anc >= 0).any()):
            break
    return x


class _Scanner:
    """Solves ``x_i = b_i + sum_{c child of i} mu_c x_c`` repeatedly on one forest."""

    def __init__(self, parent: torch.Tensor, backend: str):
        self.parent, self.backend = parent, backend
        # the ancestor pointers do not depend on the coefficients: build them once per tree
        self.ladder = _ancestor_ladder(parent) if backend == "torch" else None

    def __call__(self, b: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        if b.numel() == 0:
            return b.clone()
        if self.backend == "triton":
            return _scan_triton(b.contiguous(), self.parent.contiguous(), mu.contiguous())
        return _scan_torch(b, self.ladder, mu)


def subtree_scan(b: torch.Tensor, parent_row: torch.Tensor, mu: torch.Tensor, *,
                 backend: str = "auto") -> torch.Tensor:
    """Solve ``x_i = b_i + sum_{c child of i} mu_c x_c`` on a DFS-ordered forest (float tensors)."""
    return _Scanner(parent_row.long(), pick_backend(backend, b))(b, mu)


def _check(rewards, values, parent_row, mask, gamma, lam, mode):
    check_1d("rewards", rewards)
    n = rewards.shape[0]
    check_1d("values", values, n)
    check_1d("parent_row", parent_row, n)
    check_float("rewards", rewards)
    check_float("values", values)
    check_int("parent_row", parent_row)
    if mask is not None:
        check_1d("mask", mask, n)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, val in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= val <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {val}")
    if n:
        p = parent_row.long()
        if bool((p < -1).any()) or bool((p >= torch.arange(n, device=p.device)).any()):
            raise ValueError("parent_row[i] must be -1 or a row before i (DFS order)")
    check_finite("rewards", rewards)
    check_finite("values", values)


def tree_gae(rewards: torch.Tensor, values: torch.Tensor, parent_row: torch.Tensor, *,
             mask: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
             mode: str = "path", backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ``(adv[N], returns[N])`` of every row of a packed forest.

    rewards[N], values[N] float; parent_row[N] int (-1 at a root, else an earlier row);
    mask[N] (1 model token, 0 context; default all 1). float32 out (float64 for float64 inputs).
    No gradients flow (GAE targets are constants).
    """
    _check(rewards, values, parent_row, mask, gamma, lam, mode)
    dt = acc_dtype(rewards.dtype if rewards.dtype == torch.float64 else values.dtype)
    n = rewards.shape[0]
    dev = rewards.device
    scan = _Scanner(parent_row.long(), pick_backend(backend, rewards))
    with torch.no_grad():
        r, v = rewards.to(dt), values.to(dt)
        m = torch.ones(n, dtype=dt, device=dev) if mask is None else mask.to(dt)
        parent = parent_row.long()
        child = torch.nonzero(parent >= 0).view(-1)
        par = parent[child]
        w = torch.zeros(n, dtype=dt, device=dev)
        if mode == "tree":
            k = torch.bincount(par, minlength=n).to(dt)
            w[child] = 1.0 / k[par]
        else:
            leaf = torch.ones(n, dtype=torch.float64, device=dev)
            leaf[par] = 0.0
            # leaves below each row: the same scan with every coefficient 1 (float64: exact counts)
            leaves = scan(leaf, torch.ones_like(leaf))
            w[child] = (leaves[child] / leaves[par]).to(dt)
        m_par = torch.zeros(n, dtype=dt, device=dev)
        m_par[child] = m[par]
        nv = scan(m * v, w * (1.0 - m_par))
        next_v = torch.zeros(n, dtype=dt, device=dev).index_add_(0, par, w[child] * nv[child])
        delta = r + gamma * next_v - v
        adv = scan(m * delta, w * (m_par * (gamma * lam) + (1.0 - m_par)))
        return adv, adv + v
