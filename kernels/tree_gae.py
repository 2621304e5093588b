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

Both nv and adv solve ``x_i = b_i + sum_c mu_c x_c``, which ``subtree_scan`` evaluates without a
loop over rows; coefficients are only multiplied, never divided, so it is numerically tame.
The torch backend cuts the forest into chains (runs of rows whose only child is the next row) and
doubles over shifted slices inside them (ceil(log2(longest chain)) steps of contiguous elementwise
ops), then pointer-doubles over the forest of chains; a forest with under 2 rows per chain on
average is pointer-doubled over its rows directly (each step one gather and one scatter-add).
The Triton backend pointer-doubles over the rows, ceil(log2(depth + 1)) steps of one kernel each
(atomic adds: the summation order, and so the last bits, may vary between runs). Guaranteed:
equality with the per-path / per-node loops of ``tree_gae_ref`` up to float rounding. Not
guaranteed: anything for a forest whose subtrees continue in another micro-batch (run it on whole
trees).
"""

from __future__ import annotations

import torch

from ._common import (
    HAS_TRITON,
    acc_dtype,
    check_1d,
    check_finite,
    check_float,
    check_int,
    pick_backend,
    triton_interpret,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    # Sizes and offsets vary from launch to launch: specialising them (== 1, divisible by 16) would only
    # compile more variants for nothing: they bound masks and loops, they are never strides.
    @triton.jit(do_not_specialize=['N'])
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
# the torch backend scans chain by chain when chains hold at least this many rows on average, and
# does plain pointer doubling over the rows otherwise (see _Scanner)
MIN_ROWS_PER_CHAIN = 2


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
    block = 64 if triton_interpret() else 1024
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


def _kids(parent: torch.Tensor) -> torch.Tensor:
    """Number of children of every row."""
    return torch.bincount(parent + 1, minlength=parent.shape[0] + 1)[1:]


def _continues(parent: torch.Tensor, kids: torch.Tensor) -> torch.Tensor:
    """cont[N - 1]: row i + 1 is the only child of row i, so both lie on one chain."""
    rows = torch.arange(parent.shape[0] - 1, device=parent.device)
    return (kids[:-1] == 1) & (parent[1:] == rows)


class _Chains:
    """The forest cut into chains: maximal runs of consecutive rows in which every row but the last
    has exactly one child, the next row (in DFS order a single child always is the next row).

    A scan runs as doubling over shifted slices inside the chains (contiguous elementwise ops, no
    gather or scatter over the rows per step), then pointer doubling over the forest of chains,
    which is small for agent trees (turns of hundreds of tokens between a few branch points).
    """

    def __init__(self, parent: torch.Tensor, cont: torch.Tensor):
        self.cont = cont
        head = torch.cat([cont.new_ones(1), ~cont])
        self.end = torch.cat([~cont, cont.new_ones(1)])  # the last row of its chain
        self.chain = torch.cumsum(head, 0) - 1  # chain id of every row (ids in DFS order)
        self.heads = torch.nonzero(head).view(-1)
        self.ends = torch.cat([self.heads[1:] - 1, self.heads.new_full((1,), parent.shape[0] - 1)])
        # the row a chain hangs from: the end of its parent chain, or -1 for a root chain
        up = parent.index_select(0, self.heads)
        self.chain_parent = torch.where(up >= 0, self.chain.index_select(0, up.clamp(min=0)), -1)
        self.ladder = _ancestor_ladder(self.chain_parent)

    def scan(self, b: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        n = b.shape[0]
        # y[0]: the scan restricted to the row's own chain (the chain end's children ignored);
        # y[1]: g_i, the product of the coefficients from row i down to its chain end (1 there)
        y = torch.stack([b, self.end.to(b.dtype)])
        a = mu[1:] * self.cont  # a_i links row i to row i + 1 (0 where a chain ends)
        # after k doubling steps row i has summed rows i .. i + 2^k - 1 up to the first zero link:
        # a zero coefficient cuts a chain as its end does (GAE's next value: at every model token),
        # so the steps only have to span the longest run of rows joined by nonzero links. On the
        # bench forest (random mask, 70% model tokens) the next-value scan takes 3 steps instead
        # of 12 (-150 us); a real trace's long context runs (prompt, tool output) need more
        cuts = torch.nonzero(a == 0).view(-1)
        edges = torch.cat([cuts.new_full((1,), -1), cuts, cuts.new_full((1,), n - 1)])
        steps = (int(torch.diff(edges).max()) - 1).bit_length()
        d = 1
        for _ in range(steps):
            # y_i += (a_i .. a_{i+d-1}) y_{i+d}: a window that passes a chain end holds its a = 0.
            # The windows of rows i >= n - d pass the last row (a chain end), so ``a`` drops them:
            # it shrinks by d per step and then holds the products over windows of 2d rows
            y[:, : n - d] += a * y[:, d:]
            a = a[:-d] * a[d:]
            d *= 2
        local, g = y[0], y[1]
        # chain level: X_s = local[head_s] + g[head_s] sum_{t child chain of s} mu[head_t] X_t
        # (index_select, not x[idx]: 4x faster for 16K rows on CPU)
        mu_head = mu.index_select(0, self.heads)
        has_up = self.chain_parent >= 0
        up = self.chain_parent.clamp(min=0)
        g_up = g.index_select(0, self.heads).index_select(0, up)
        x_head = _scan_torch(local.index_select(0, self.heads), self.ladder, mu_head * g_up)
        below = torch.zeros_like(x_head)  # sum over the child chains
        below.index_add_(0, up, torch.where(has_up, mu_head * x_head, 0.0))
        return local + g * below.index_select(0, self.chain)

    def leaves(self, is_leaf: torch.Tensor) -> torch.Tensor:
        """float64 number of leaves below every row: constant along a chain (a chain-level scan)."""
        ends = is_leaf.index_select(0, self.ends).double()
        return _scan_torch(ends, self.ladder, torch.ones_like(ends)).index_select(0, self.chain)


class _Scanner:
    """Solves ``x_i = b_i + sum_{c child of i} mu_c x_c`` repeatedly on one forest (N >= 1).

    torch backend, measured at 16K rows on one thread (bench/bench_kernels.py shapes, old -> new):
    pointer doubling over all rows costs one gather and one index_add of N rows per step, 2.5-3.0
    ms per tree_gae on the flat sequence and on the agent forest (~700 rows per chain); the chain
    form takes ~1.0 ms on both. On bushy trees (~1 row per chain: nothing to compress) the chain
    form was 1.5x slower (2.0 vs 1.3 ms) and about even at 2 rows per chain: MIN_ROWS_PER_CHAIN.
    """

    def __init__(self, parent: torch.Tensor, backend: str, kids: torch.Tensor | None = None):
        self.parent, self.backend = parent, backend
        self.chains = self.ladder = None
        if backend == "torch":
            # built once per forest: the decomposition does not depend on the coefficients
            cont = _continues(parent, _kids(parent) if kids is None else kids)
            n_chains = parent.shape[0] - int(cont.sum())
            if MIN_ROWS_PER_CHAIN * n_chains <= parent.shape[0]:
                self.chains = _Chains(parent, cont)
            else:
                self.ladder = _ancestor_ladder(parent)

    def __call__(self, b: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            return _scan_triton(b.contiguous(), self.parent.contiguous(), mu.contiguous())
        if self.chains is not None:
            return self.chains.scan(b, mu)
        return _scan_torch(b, self.ladder, mu)

    def leaves(self, is_leaf: torch.Tensor) -> torch.Tensor:
        """float64 number of leaves below every row."""
        if self.chains is not None:
            return self.chains.leaves(is_leaf)
        # the same scan with every coefficient 1 (float64: exact counts)
        leaf = is_leaf.double()
        return self(leaf, torch.ones_like(leaf))


def subtree_scan(b: torch.Tensor, parent_row: torch.Tensor, mu: torch.Tensor, *,
                 backend: str = "auto") -> torch.Tensor:
    """Solve ``x_i = b_i + sum_{c child of i} mu_c x_c`` on a DFS-ordered forest (float tensors;
    computed in float32, or float64 for float64 ``b``, and returned in ``b``'s dtype)."""
    check_1d("b", b)
    check_float("b", b)
    check_1d("mu", mu, b.shape[0])
    check_float("mu", mu)
    _check_parents(parent_row, b.shape[0])
    if b.numel() == 0:
        return b.clone()
    dt = acc_dtype(b.dtype)
    return _Scanner(parent_row.long(), pick_backend(backend, b))(b.to(dt), mu.to(dt)).to(b.dtype)


def _check_parents(parent_row, n: int) -> None:
    """A forest in DFS order: each row's parent is -1 or an earlier row (a self-parent or a cycle would
    keep the ancestor ladder from ever reaching the roots)."""
    check_1d("parent_row", parent_row, n)
    check_int("parent_row", parent_row)
    if n:
        p = parent_row.long()
        if bool((p < -1).any()) or bool((p >= torch.arange(n, device=p.device)).any()):
            raise ValueError("parent_row[i] must be -1 or a row before i (DFS order)")


def _check(rewards, values, parent_row, mask, gamma, lam, mode):
    check_1d("rewards", rewards)
    n = rewards.shape[0]
    check_1d("values", values, n)
    check_float("rewards", rewards)
    check_float("values", values)
    _check_parents(parent_row, n)
    if mask is not None:
        check_1d("mask", mask, n)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, val in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= val <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {val}")
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
    if n == 0:
        empty = torch.zeros(0, dtype=dt, device=rewards.device)
        return empty, empty.clone()
    with torch.no_grad():
        r, v = rewards.to(dt), values.to(dt)
        m = torch.ones_like(r) if mask is None else mask.to(dt)
        parent = parent_row.long()
        kids = _kids(parent)
        scan = _Scanner(parent, pick_backend(backend, rewards), kids)
        # per-row reads from the parent: a root reads row 0 and its weight is then set to 0 (the
        # root's kids[0] may be 0: the where drops that inf). index_select, not x[up]: 4x faster
        # for 16K rows on CPU
        up = parent.clamp(min=0)
        if mode == "tree":
            w = torch.where(parent >= 0, 1.0 / kids.index_select(0, up).to(dt), 0.0)
        else:
            leaves = scan.leaves(kids == 0)
            w = torch.where(parent >= 0, (leaves / leaves.index_select(0, up)).to(dt), 0.0)
        m_par = m.index_select(0, up)
        nv = scan(m * v, w * (1.0 - m_par))
        next_v = torch.zeros_like(r).index_add_(0, up, w * nv)
        delta = r + gamma * next_v - v
        adv = scan(m * delta, w * (m_par * (gamma * lam) + (1.0 - m_par)))
        return adv, adv + v
