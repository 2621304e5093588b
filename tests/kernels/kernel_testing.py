"""Helpers of the kernel tests (imported by the test modules of this directory)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from clawfast.pretrained import home
from torch.utils._python_dispatch import TorchDispatchMode


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (norm-wise relative error; NaN in ``actual`` gives inf)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if e.numel() == 0:
        assert a.numel() == 0
        return 0.0
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a - e).abs().max() / e.abs().max().clamp(min=1e-30))


# The bars, against a float64 reference fed the same (rounded) inputs: forward outputs
# within 1e-5 for every input dtype (accumulation is float32); gradients within 1e-5 for float32
# and 2e-2 for half types, whose logits-gradient chunk and matmuls run in the input dtype on the
# Triton path exactly as on a GPU (measured: ~5e-4 fp16, ~7e-3 bf16).
TOL_FWD = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}
TOL_GRAD = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def _int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def random_forest(n: int, gen: torch.Generator, roots: int = 2, vocab: int = 50):
    """A random DFS-ordered forest: (parent_row[N], input_ids[N], kv_end[N]).

    Row i attaches to row i-1 or one of its ancestors (or starts a new root), which is exactly
    what DFS pre-order allows; siblings get distinct token ids, as in a trie.
    """
    parent = [-1] * n
    used: dict[int, set] = {}
    ids = [0] * n
    for i in range(1, n):
        chain, j = [], i - 1
        while j >= 0:
            chain.append(j)
            j = parent[j]
        choice = int(torch.randint(0, len(chain) + (1 if roots > 1 else 0), (1,), generator=gen))
        parent[i] = chain[choice] if choice < len(chain) else -1
    vocab = max(vocab, n + 1)  # room for distinct ids even if one row has every other as child
    for i in range(n):
        taken = used.setdefault(parent[i], set())
        while True:
            t = int(torch.randint(0, vocab, (1,), generator=gen))
            if t not in taken:
                taken.add(t)
                ids[i] = t
                break
    end = list(range(n))
    for i in reversed(range(n)):
        if parent[i] >= 0:
            end[parent[i]] = max(end[parent[i]], end[i])
    return _int32(parent), _int32(ids), _int32(end)


def random_packed(n: int, gen: torch.Generator, rollouts: int = 3, p_target: float = 0.8):
    """A random merged forest with targets and kept leaves of several rollouts.

    Each leaf belongs to one or more rollouts (identical paths of different samples merge); a row
    gets a target for rollout R (predicting it from its parent) with probability ``p_target`` when
    some leaf of R lies below it. Returns a dict of PackedBatch-like int tensors.
    """
    parent, ids, end = random_forest(n, gen)
    par = parent.tolist()
    has_kid = {p for p in par if p >= 0}
    leaf_rows, leaf_rollout = [], []
    below: list[set] = [set() for _ in range(n)]
    for leaf in range(n):
        if leaf in has_kid:
            continue
        groups = [r for r in range(rollouts) if float(torch.rand(1, generator=gen)) < 0.5] or [0]
        for r in groups:
            leaf_rows.append(leaf)
            leaf_rollout.append(r)
            i = leaf
            while i >= 0:
                below[i].add(r)
                i = par[i]
    t_rows, t_ids, t_roll = [], [], []
    for c in range(n):
        if par[c] < 0:
            continue
        for r in sorted(below[c]):
            if float(torch.rand(1, generator=gen)) < p_target:
                t_rows.append(par[c])
                t_ids.append(int(ids[c]))
                t_roll.append(r)
    return dict(parent_row=parent, input_ids=ids, kv_end=end, target_rows=_int32(t_rows),
                target_ids=_int32(t_ids), target_rollout=_int32(t_roll),
                leaf_rows=_int32(leaf_rows), leaf_rollout=_int32(leaf_rollout))


def segment_forest(n: int, gen: torch.Generator, max_segment: int, roots: int = 2, p_close: float = 0.3):
    """kv_end[N] of a forest shaped like harness traffic: segments of 1..max_segment rows (shared
    prompts, outputs, tool results) in DFS order, each hanging under the last row of an open
    segment (closing some first: a fork) or starting one of at most ``roots`` trees. The larger
    ``p_close``, the bushier and shallower the trees."""
    parent: list[int] = []
    stack: list[int] = []
    trees = 0
    while len(parent) < n:
        length = min(n - len(parent), int(torch.randint(1, max_segment + 1, (1,), generator=gen)))
        keep = 1 if trees == roots else 0  # the last tree's root segment stays open
        while len(stack) > keep and float(torch.rand(1, generator=gen)) < p_close:
            stack.pop()
        if not stack:
            trees += 1
        top = stack[-1] if stack else -1
        for i in range(length):
            parent.append(top if i == 0 else len(parent) - 1)
        stack.append(len(parent) - 1)
    end = list(range(n))
    for i in reversed(range(n)):
        if parent[i] >= 0:
            end[parent[i]] = max(end[parent[i]], end[i])
    return _int32(end)


def chains(lengths: list[int]):
    """kv_end of independent causal sequences (a flat varlen batch): every row sees its sequence's
    earlier rows."""
    end, off = [], 0
    for length in lengths:
        end += [off + length - 1] * length
        off += length
    return _int32(end)


class LargestTensor(TorchDispatchMode):
    """Inside the block, records the largest tensor any op creates (forward and backward alike):
    ``numel`` and the op that made it."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


# The background ahead-of-time compile of every kernel variant (conftest.py, test_aot.py): by the
# main environment's Triton and by the GPU image's (the venv scripts/setup.sh builds), in turn.
AOT_TIMEOUT_S = 3600
AOT_PYTHONS = {"latest": Path(sys.executable), "gpu-image": home() / "venv-triton" / "bin" / "python"}


def aot_environment() -> dict:
    """The environment of a compiling process: Triton compiled, not interpreted."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, set to silence its warning
    return env
