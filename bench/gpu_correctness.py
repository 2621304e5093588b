"""Correctness of every compiled kernel of clawfast.kernels at GPU shapes: the first GPU-check section.

    python bench/gpu_correctness.py [--rows PATH] [--seed S] [--only TEXT] [--workers W]
    python bench/gpu_correctness.py --smoke     # the same cases, tiny, under TRITON_INTERPRET=1 on a CPU
    python bench/gpu_correctness.py --list      # the cases and their tolerances, nothing run

Each case runs a public op with ``backend="triton"`` (compiled on a GPU) on fresh random inputs and
compares it, forward and gradients, with its float64 reference ``*_ref`` from ``kernels/reference.py``
fed the same rounded inputs (and the same rounded upstream gradients). The references of attention and
log-probs are dense ([H, N, N] scores, [N, V] logits) and run on the GPU in float64, so their shapes are
moderate: 2-4K rows, real head counts and head dims, a 128K vocabulary at d = 4096. The loop references
of GAE, IS weights and the policy loss run on the host in float64 over 2-8K targets. Inputs are
agent-shaped forests: per group a shared prompt, then samples made of output and tool-result segments
that fork where a harness retried or edited its history.

``CASES`` is the plan, in value order: the default training path first (bf16 tree attention at head
dim 128 with GQA, bf16 tree log-probs with the entropy term, the token-level policy loss with
truncated IS), then GAE, the other head dims and the softmax options, the other dtypes, the flat
log-probs, the remaining IS and loss options. ``--smoke`` runs the same cases in the same order with
the same tolerances; only the sizes (``Case.full`` / ``Case.smoke``) differ.

Each finished case is one row (``bench/rows.py``): op, case, shape, ``err`` and ``tol`` of its worst
part (largest err / tol), ``ok``, ``ms`` (the case's wall time: compiling, kernel, reference) and a
note with every part's error and the case's seed (``--seed S --only CASE`` reruns one case exactly).
The cases run in ``--workers`` processes taking them in order from one queue (default: half the CPUs,
at most 6; two in a smoke run): Triton compiles each new kernel variant on the host (a second or so
of CPU each, about 80 variants here), so the processes compile in parallel while the GPU checks. A
case that raises is a failed row; a process that dies (a CUDA error poisons its context) fails its
case and is replaced; a case out of GPU memory is retried up to twice. Exit status 1 when a case failed.

Errors (``err``): attention ``max |a - e| / max(max |e|, 1)`` (relative to the largest entry; the
scale 1 keeps exact zeros of a gradient from dividing by nothing); the other tensors ``max |a - e| /
max |e|``; metric floats ``|a - e| / max(|e|, 0.1)`` (relative 1e-5 or absolute 1e-6, as the tests).
Tolerances (``tolerance``), against float64 on the same rounded inputs:

- 1e-5 where the kernel computes and stores in float32: every float32 case (IEEE or 3xTF32 dots,
  float32 cuBLAS without TF32), the log-prob and entropy outputs of every dtype (float32 accumulation,
  float32 outputs), GAE, IS weights and metrics, the policy loss, its gradient and metrics;
- in units u of roundoff of the input dtype (bf16 u = 2^-8, fp16 u = 2^-11) where a value passes
  through that dtype: 4u (bf16 1.6e-2, fp16 2.0e-3) for attention outputs (P tiles rounded to the input
  dtype for the tensor cores, the output stored in it) and the log-prob gradients (the logits-gradient
  chunk is stored in the input dtype and multiplied by cuBLAS); 8u (bf16 3.1e-2, fp16 3.9e-3) for the
  attention gradients dq, dk, dv, dsinks (dS tiles rounded too, and delta = rowsum(dO * O) taken from
  the rounded output as flash-attention does: each row's dS sums to zero, so dK is a difference of
  near-equal terms and that rounding shows relative to it magnified). A float32 emulation of exactly
  these roundings at GPU shapes (N = 2048, 32/8 heads, head dim 64 and 128, agent forests) gives
  2.4-4.0e-3 for bf16 and 2.8-6.0e-4 for fp16 against float64, about 1u everywhere; the interpreter on
  the smoke sizes (40 rows) reaches 3.8u on dk for some seeds (6 seeds x 11 half-precision cases).
  The margins still catch a wrong tile: a wrong mask, scale or softmax statistic costs orders of
  magnitude more.
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: rows.py

from rows import Rows  # noqa: E402

# ------------------------------------------------------------------------------------------- plan

ATTENTION_FULL = dict(rows=2048, hq=32, hkv=8, head_dim=128)
ATTENTION_SMOKE = dict(rows=40, hq=4, hkv=2, head_dim=32)
LOGPROBS_FULL = dict(rows=2048, hidden=4096, vocab=128256)
LOGPROBS_SMOKE = dict(rows=24, hidden=32, vocab=96)
LINEAR_FULL = dict(batch=2, seq=1024, prompt=256, hidden=4096, vocab=128256)
LINEAR_SMOKE = dict(batch=2, seq=12, prompt=3, hidden=32, vocab=96)
TARGETS_FULL = dict(rows=2048, samples=8)  # the forest of the IS / loss targets: ~3.6K targets
TARGETS_SMOKE = dict(rows=40, samples=3)
GAE_FULL = dict(rows=2048, samples=8)
GAE_SMOKE = dict(rows=40, samples=3)


@dataclass(frozen=True)
class Case:
    """One row of the plan: ``op`` and ``name`` label it, ``run`` names its function, ``params`` are
    its non-size settings (dtype, options), ``full`` / ``smoke`` its sizes in the two modes."""

    op: str
    name: str
    run: str
    params: dict = field(default_factory=dict)
    full: dict = field(default_factory=dict)
    smoke: dict = field(default_factory=dict)

    def sizes(self, smoke: bool) -> dict:
        return self.smoke if smoke else self.full


def _attn(name, dtype="bfloat16", full=None, smoke=None, **options):
    return Case("tree_attention", name, "attention", dict(dtype=dtype, **options),
                {**ATTENTION_FULL, **(full or {})}, {**ATTENTION_SMOKE, **(smoke or {})})


def _logprobs(name, dtype, entropy=True):
    return Case("tree_logprobs", name, "tree_logprobs", dict(dtype=dtype, entropy=entropy), LOGPROBS_FULL,
                LOGPROBS_SMOKE)


def _linear(name, dtype):
    return Case("linear_logprobs", name, "linear_logprobs", dict(dtype=dtype, temperature=0.7), LINEAR_FULL,
                LINEAR_SMOKE)


def _is(name, level, mode):
    return Case("importance_weights", name, "importance", dict(level=level, mode=mode), TARGETS_FULL,
                TARGETS_SMOKE)


# Value order: what every training step runs first.
CASES: tuple[Case, ...] = (
    _attn("bf16 fwd+bwd, GQA 32/8, head dim 128 (default path)", full=dict(rows=4096)),
    _logprobs("bf16 fwd+bwd with the entropy term (default path)", "bfloat16"),
    Case("policy_loss", "token-mean, token-level truncated IS, entropy (default path)", "policy_loss",
         dict(default=True), TARGETS_FULL, TARGETS_SMOKE),
    _is("token level, truncate", "token", "truncate"),
    _is("sequence level on tree paths, truncate", "sequence", "truncate"),
    Case("tree_gae", "path mode, gamma 1, lam 1", "gae", dict(mode="path", gamma=1.0, lam=1.0), GAE_FULL,
         GAE_SMOKE),
    Case("tree_gae", "tree mode, gamma 0.99, lam 0.95", "gae", dict(mode="tree", gamma=0.99, lam=0.95),
         GAE_FULL, GAE_SMOKE),
    _attn("bf16 fwd+bwd, GQA 32/8, head dim 64", full=dict(head_dim=64), smoke=dict(head_dim=16)),
    _attn("bf16 fwd+bwd, GQA 16/8, head dim 256", full=dict(hq=16, head_dim=256), smoke=dict(head_dim=64)),
    _attn("bf16 fwd+bwd, MHA 16/16, head dim 128", full=dict(hq=16, hkv=16), smoke=dict(hkv=4)),
    _attn("bf16 window + sinks (gpt-oss), GQA 64/8, head dim 64", window=True, sinks=True,
          full=dict(hq=64, head_dim=64), smoke=dict(head_dim=16)),
    _attn("bf16 window + softcap (Gemma 2), GQA 16/8, head dim 256", window=True, softcap=30.0,
          full=dict(hq=16, head_dim=256), smoke=dict(head_dim=64)),
    _attn("bf16 attention dropout 0.1, GQA 32/8, head dim 128", dropout_p=0.1),
    _attn("fp32 window + softcap + sinks + dropout, GQA 32/8, head dim 128", dtype="float32", window=True,
          softcap=0.8, sinks=True, dropout_p=0.2),
    _attn("fp16 fwd+bwd, GQA 32/8, head dim 128", dtype="float16"),
    _attn("fp32 fwd+bwd, GQA 32/8, head dim 128", dtype="float32"),
    _logprobs("fp32 fwd+bwd with the entropy term", "float32"),
    _logprobs("fp16 fwd+bwd with the entropy term", "float16"),
    _logprobs("bf16 fwd+bwd, log-probs alone (no entropy gradient)", "bfloat16", entropy=False),
    _linear("bf16 fwd+bwd, ignore_index, temperature 0.7", "bfloat16"),
    _linear("fp32 fwd+bwd, ignore_index, temperature 0.7", "float32"),
    _linear("fp16 fwd+bwd, ignore_index, temperature 0.7", "float16"),
    Case("policy_loss", "dual clip + ref KL + entropy, seq-mean-token-mean, sequence-level masked IS",
         "policy_loss", dict(default=False), TARGETS_FULL, TARGETS_SMOKE),
    _is("token level, mask", "token", "mask"),
    _is("sequence level on tree paths, mask", "sequence", "mask"),
    Case("grpo_advantages", "task x harness groups (torch on the device)", "grpo", {},
         dict(groups=256, samples=8), dict(groups=4, samples=3)),
)

ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
# Outputs that pass through the input dtype, and their bars in units of its roundoff (module docstring).
ROUNDED_PARTS = {"out": 4, "d_hidden": 4, "d_weight": 4, "dq": 8, "dk": 8, "dv": 8, "dsinks": 8}


def tolerance(part: str, dtype: str = "float32") -> float:
    """The bar of one compared output (see the module docstring)."""
    if dtype in ROUNDOFF and part in ROUNDED_PARTS:
        return ROUNDED_PARTS[part] * ROUNDOFF[dtype]
    return 1e-10 if dtype == "float64" else 1e-5


def plan(smoke: bool) -> list[dict]:
    """The cases as data, for the checks that smoke and full runs share one plan."""
    return [{"op": c.op, "case": c.name, "run": c.run, "params": c.params, "sizes": c.sizes(smoke)}
            for c in CASES]


def select(only: list[str] | None) -> list[Case]:
    if not only:
        return list(CASES)
    return [c for c in CASES if any(text in f"{c.op} {c.name}" for text in only)]


# ------------------------------------------------------------------------------------- the inputs


class Forest:
    """An agent-shaped packed forest in DFS order: ``groups`` trees, each a shared prompt chain then
    ``samples`` samples under its last row; a sample is segments (model output, tool result,
    alternately) that continue the last one or, with probability ``p_fork``, fork from an earlier
    segment end of the same sample (a retried call, an edited history). Host lists: parent[N],
    sample[N] (-1 on a prompt row), model[N] (1 on model-output rows), kv_end[N]."""

    def __init__(self, n: int, samples: int, rng, groups: int = 2, prompt_frac: float = 0.25,
                 max_segment: int | None = None, p_fork: float = 0.25):
        self.n = n
        max_segment = max_segment or max(2, n // (samples * groups * 3))
        parent, sample, model = [], [], []
        per_group = [n // groups + (1 if g < n % groups else 0) for g in range(groups)]
        sample_id = 0
        for g_rows in per_group:
            prompt = max(1, int(g_rows * prompt_frac))
            start = len(parent)
            for i in range(prompt):
                parent.append(-1 if i == 0 else start + i - 1)
                sample.append(-1)
                model.append(0)
            rest = g_rows - prompt
            k = max(1, min(samples, rest))
            sizes = [rest // k + (1 if s < rest % k else 0) for s in range(k)]
            for size in sizes:
                stack = [start + prompt - 1]
                kind = 1
                left = size
                while left > 0:
                    length = min(left, int(rng.integers(1, max_segment + 1)))
                    if len(stack) > 1 and rng.random() < p_fork:
                        del stack[int(rng.integers(1, len(stack))):]  # back to an earlier segment end
                    for i in range(length):
                        parent.append(stack[-1] if i == 0 else len(parent) - 1)
                        sample.append(sample_id)
                        model.append(kind)
                    stack.append(len(parent) - 1)
                    kind = 1 - kind
                    left -= length
                sample_id += 1
        self.parent, self.sample, self.model = parent, sample, model
        self.num_samples = sample_id
        end = list(range(n))
        for i in reversed(range(n)):
            if parent[i] >= 0:
                end[parent[i]] = max(end[parent[i]], end[i])
        self.kv_end = end
        kids = [0] * n
        for p in parent:
            if p >= 0:
                kids[p] += 1
        self.leaves = [i for i in range(n) if kids[i] == 0]
        self.group_of_sample = {}
        for i in range(n):
            if sample[i] >= 0:
                root = i
                while parent[root] >= 0:
                    root = parent[root]
                self.group_of_sample.setdefault(sample[i], root)

    def depth(self) -> int:
        depth = [0] * self.n
        for i, p in enumerate(self.parent):
            depth[i] = depth[p] + 1 if p >= 0 else 1
        return max(depth)

    def targets(self, rng, vocab: int):
        """Tree targets as a packed batch has them: every non-root row c is predicted from its parent,
        once per rollout with a kept leaf below c (a prompt row: every sample of its group). Returns
        (input_ids[N], target_rows, target_ids, target_rollout, target_model, leaf_rows, leaf_rollout,
        sequences) with distinct ids among siblings and ``sequences[l]`` the target indices on leaf l's
        path (the explicit walk the sequence-level references take)."""
        n, parent = self.n, self.parent
        ids = [0] * n
        taken: dict[int, set] = {}
        for c in range(n):
            used = taken.setdefault(parent[c], set())
            while True:
                t = int(rng.integers(0, vocab))
                if t not in used:
                    used.add(t)
                    ids[c] = t
                    break
        samples_of_root: dict[int, list[int]] = {}
        for s, root in self.group_of_sample.items():
            samples_of_root.setdefault(root, []).append(s)
        root_of = [0] * n
        for i in range(n):
            root_of[i] = i if parent[i] < 0 else root_of[parent[i]]
        rows, tids, roll, model, child = [], [], [], [], []
        for c in range(n):
            if parent[c] < 0:
                continue
            owners = [self.sample[c]] if self.sample[c] >= 0 else sorted(samples_of_root.get(root_of[c], []))
            for r in owners:
                rows.append(parent[c])
                tids.append(ids[c])
                roll.append(r)
                model.append(self.model[c])
                child.append(c)
        leaf_rows = [leaf for leaf in self.leaves if self.sample[leaf] >= 0]
        leaf_roll = [self.sample[leaf] for leaf in leaf_rows]
        by_rollout: dict[int, list[int]] = {}
        for k, r in enumerate(roll):
            by_rollout.setdefault(r, []).append(k)
        sequences = []
        for leaf, r in zip(leaf_rows, leaf_roll):
            on_path, i = set(), leaf
            while i >= 0:
                on_path.add(i)
                i = parent[i]
            sequences.append(IndexList(k for k in by_rollout.get(r, []) if child[k] in on_path))
        return ids, rows, tids, roll, model, leaf_rows, leaf_roll, sequences


class IndexList(list):
    """A list of target indices (what the sequence-level references take) that answers ``in`` from a
    set: the references ask it once per (target, sequence), which a plain list makes quadratic."""

    def __init__(self, items=()):
        super().__init__(items)
        self._set = frozenset(self)

    def __contains__(self, item) -> bool:
        return item in self._set


# --------------------------------------------------------------------------------------- errors


def _finite(torch, a) -> bool:
    return bool(torch.isfinite(a).all())


def rel_err(torch, actual, expected) -> float:
    """max |a - e| / max |e| (inf when ``actual`` holds a NaN or inf)."""
    a, e = actual.detach().double(), expected.detach().double().to(actual.device)
    if e.numel() == 0:
        return 0.0 if a.numel() == 0 else math.inf
    if a.shape != e.shape or not _finite(torch, a):
        return math.inf
    return float((a - e).abs().max() / e.abs().max().clamp(min=1e-30))


def unit_err(torch, actual, expected) -> float:
    """max |a - e| / max(max |e|, 1): attention's error (exact zeros of a gradient divide by 1)."""
    a, e = actual.detach().double(), expected.detach().double().to(actual.device)
    if a.shape != e.shape or not _finite(torch, a):
        return math.inf
    return float((a - e).abs().max() / e.abs().max().clamp(min=1.0))


def metric_err(actual: float, expected: float) -> float:
    if not math.isfinite(actual):
        return math.inf
    return abs(actual - expected) / max(abs(expected), 0.1)


def metrics_err(got: dict, want: dict) -> float:
    if set(got) != set(want):
        return math.inf
    return max((metric_err(got[k], want[k]) for k in want), default=0.0)


# ----------------------------------------------------------------------------------------- cases
# Each takes (torch, device, sizes, params, seed) and returns (shape text, {part: err}, dtype name,
# note); parts are judged by `tolerance(part, dtype)`.


def _rng(seed: int):
    import numpy as np

    return np.random.default_rng(seed)


def _randn(torch, gen, device, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64, device=device)


def _generator(torch, device, seed: int):
    return torch.Generator(device=device).manual_seed(seed)


def case_attention(torch, device, sizes, params, seed):
    from clawfast.kernels import TreeMask, tree_attention, tree_attention_ref

    dtype = getattr(torch, params["dtype"])
    n, hq, hkv, d = sizes["rows"], sizes["hq"], sizes["hkv"], sizes["head_dim"]
    forest = Forest(n, samples=8 if n >= 256 else 3, rng=_rng(seed))
    kv_end = torch.tensor(forest.kv_end, dtype=torch.int32, device=device)
    depth = forest.depth()
    gen = _generator(torch, device, seed)
    q, k, v, g_out = (_randn(torch, gen, device, n, h, d).to(dtype) for h in (hq, hkv, hkv, hq))
    inputs = [q, k, v]
    options = {}
    if params.get("window"):
        options["window"] = max(2, depth // 4)  # shorter than the long paths, longer than the short ones
    if params.get("softcap"):
        options["softcap"] = params["softcap"]
    if params.get("dropout_p"):
        options.update(dropout_p=params["dropout_p"], seed=seed % 2**31)
    sinks = None
    if params.get("sinks"):
        sinks = (_randn(torch, gen, device, hq) + 1.0).to(dtype)  # a real share of every row's softmax
        inputs.append(sinks)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = tree_attention(*leaves[:3], TreeMask(kv_end), sinks=leaves[3] if sinks is not None else None,
                         backend="triton", **options)
    out.backward(g_out)
    if device != "cpu":
        torch.cuda.synchronize()
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref = tree_attention_ref(*ref_in[:3], kv_end, sinks=ref_in[3] if sinks is not None else None, **options)
    ref.backward(g_out.double())
    errs = {"out": unit_err(torch, out, ref) if out.dtype == dtype else math.inf}
    for name, t, r in zip(("dq", "dk", "dv", "dsinks"), leaves, ref_in):
        errs[name] = unit_err(torch, t.grad, r.grad) if t.grad is not None else math.inf
    shape = f"N={n} Hq={hq} Hkv={hkv} D={d} depth<={depth}"
    if options.get("window"):
        shape += f" window={options['window']}"
    return shape, errs, params["dtype"], f"{forest.num_samples} samples, {len(forest.leaves)} leaves"


def _logprob_inputs(torch, device, dtype, n, d, v, gen):
    hidden = (_randn(torch, gen, device, n, d) * 2.0).to(dtype)  # logits of std ~2: peaked rows
    weight = (_randn(torch, gen, device, v, d) / d**0.5).to(dtype)
    return hidden, weight


def _logprob_errs(torch, lp, ent, lp_r, ent_r, h, w, hd, wd):
    return {"logprobs": rel_err(torch, lp, lp_r), "entropy": rel_err(torch, ent, ent_r),
            "d_hidden": rel_err(torch, h.grad, hd.grad) if h.grad is not None else math.inf,
            "d_weight": rel_err(torch, w.grad, wd.grad) if w.grad is not None else math.inf}


def case_tree_logprobs(torch, device, sizes, params, seed):
    from clawfast.kernels import tree_logprobs, tree_logprobs_ref

    dtype = getattr(torch, params["dtype"])
    n, d, v = sizes["rows"], sizes["hidden"], sizes["vocab"]
    forest = Forest(n, samples=8 if n >= 256 else 3, rng=_rng(seed))
    _, rows, ids, *_ = forest.targets(_rng(seed + 1), v)
    rows = torch.tensor(rows, dtype=torch.int32, device=device)
    ids = torch.tensor(ids, dtype=torch.int32, device=device)
    gen = _generator(torch, device, seed)
    hidden, weight = _logprob_inputs(torch, device, dtype, n, d, v, gen)
    g_lp = _randn(torch, gen, device, rows.shape[0]).float()
    g_ent = _randn(torch, gen, device, n).float()
    h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    lp, ent = tree_logprobs(h, w, rows, ids, backend="triton")
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if params["entropy"] else 0.0)
    loss.backward()
    hd, wd = (t.detach().double().requires_grad_() for t in (hidden, weight))
    lp_r, ent_r = tree_logprobs_ref(hd, wd, rows, ids)
    loss_r = (lp_r * g_lp.double()).sum() + ((ent_r * g_ent.double()).sum() if params["entropy"] else 0.0)
    loss_r.backward()
    errs = _logprob_errs(torch, lp, ent, lp_r, ent_r, h, w, hd, wd)
    return (f"N={n} d={d} V={v} M={rows.shape[0]}", errs, params["dtype"],
            f"float32 outputs: {lp.dtype == torch.float32 and ent.dtype == torch.float32}")


def case_linear_logprobs(torch, device, sizes, params, seed):
    from clawfast.kernels import linear_logprobs, linear_logprobs_ref

    dtype = getattr(torch, params["dtype"])
    b, t_len, prompt, d, v = sizes["batch"], sizes["seq"], sizes["prompt"], sizes["hidden"], sizes["vocab"]
    gen = _generator(torch, device, seed)
    hidden = (_randn(torch, gen, device, b, t_len, d) * 2.0).to(dtype)
    weight = (_randn(torch, gen, device, v, d) / d**0.5).to(dtype)
    labels = torch.randint(0, v, (b, t_len), generator=gen, device=device)
    labels[:, :prompt] = -100  # prompt positions: no loss
    labels[-1, -1] = -100
    g_lp = _randn(torch, gen, device, b, t_len).float()
    g_ent = _randn(torch, gen, device, b, t_len).float()
    temperature = params["temperature"]
    h, w = (x.detach().clone().requires_grad_() for x in (hidden, weight))
    lp, ent = linear_logprobs(h, w, labels, temperature=temperature, backend="triton")
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    hd, wd = (x.detach().double().requires_grad_() for x in (hidden, weight))
    lp_r, ent_r = linear_logprobs_ref(hd, wd, labels, temperature=temperature)
    ((lp_r * g_lp.double()).sum() + (ent_r * g_ent.double()).sum()).backward()
    errs = _logprob_errs(torch, lp, ent, lp_r, ent_r, h, w, hd, wd)
    ignored_zero = bool((lp[labels == -100] == 0).all())
    if not ignored_zero:
        errs["ignored positions are 0"] = math.inf
    return f"B={b} T={t_len} d={d} V={v}", errs, params["dtype"], f"T={temperature}"


def _target_batch(torch, device, sizes, seed):
    """The targets of an agent forest with trainer-like log-probs: proximal (old), behaviour (infer,
    the sampler's), current; model-output targets have mask 1, prompt and tool-result targets 0."""
    from clawfast.kernels import TreePaths

    forest = Forest(sizes["rows"], sizes["samples"], _rng(seed))
    ids, rows, tids, roll, model, leaf_rows, leaf_roll, sequences = forest.targets(_rng(seed + 1), 50000)

    def t(x, dt=torch.int64):
        return torch.tensor(x, dtype=dt, device=device)

    paths = TreePaths.from_tree(t(forest.parent), t(ids), t(forest.kv_end), t(rows), t(tids), t(roll),
                                t(leaf_rows), t(leaf_roll))
    m = len(rows)
    gen = torch.Generator().manual_seed(seed)  # host: the references take host tensors
    old = -torch.rand(m, generator=gen, dtype=torch.float64) * 3
    # the current policy moved from the proximal one (so the clip acts), a few targets far (so the dual clip acts)
    lp = old + 0.3 * torch.randn(m, generator=gen, dtype=torch.float64)
    lp += 1.5 * (torch.rand(m, generator=gen) < 0.03)
    batch = dict(old=old, infer=old + 0.05 * torch.randn(m, generator=gen, dtype=torch.float64), lp=lp,
                 adv=torch.randn(m, generator=gen, dtype=torch.float64),
                 ref=old + 0.1 * torch.randn(m, generator=gen, dtype=torch.float64),
                 entropy=torch.rand(m, generator=gen, dtype=torch.float64) * 4,
                 mask=torch.tensor(model, dtype=torch.float64),
                 weight=torch.rand(m, generator=gen, dtype=torch.float64) + 0.5,
                 seq_ids=torch.tensor(roll, dtype=torch.int64))
    # float32 as the trainer has them; the references get the same rounded values in float64
    batch = {k: (x.float() if x.is_floating_point() else x) for k, x in batch.items()}
    return forest, batch, paths, sequences


def case_importance(torch, device, sizes, params, seed):
    from clawfast.kernels import ISConfig, importance_weights, importance_weights_ref

    forest, batch, paths, sequences = _target_batch(torch, device, sizes, seed)
    level, mode = params["level"], params["mode"]
    cfg = ISConfig(level=level, mode=mode, cap=1.5, lo=0.8, hi=1.25)
    # sequence ratios are products over a path: a smaller per-token spread keeps them near 1
    spread = 0.4 if level == "token" else 0.05
    noise = torch.randn(batch["old"].shape[0], generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    lp = (batch["infer"].double() + spread * noise).float()
    res = importance_weights(lp.to(device), batch["infer"].to(device), batch["mask"].to(device), config=cfg,
                             paths=paths if level == "sequence" else None, backend="triton")
    w_ref, met_ref = importance_weights_ref(lp.double(), batch["infer"].double(), batch["mask"].double(),
                                            config=cfg, sequences=sequences if level == "sequence" else None)
    errs = {"weights": rel_err(torch, res.weights.cpu(), w_ref), "metrics": metrics_err(res.metrics, met_ref)}
    note = (f"{len(sequences)} paths, clipped/masked fraction above {met_ref['is_frac_above']:.3f} "
            f"below {met_ref['is_frac_below']:.3f}")
    return f"M={lp.shape[0]} targets, N={forest.n} rows", errs, "float32", note


def case_policy_loss(torch, device, sizes, params, seed):
    from clawfast.kernels import ISConfig, policy_loss, policy_loss_ref

    forest, batch, paths, sequences = _target_batch(torch, device, sizes, seed)
    m = batch["lp"].shape[0]
    if params["default"]:  # the trainer's defaults: step.py, one update at token level
        kw = dict(is_config=ISConfig(), clip_low=0.2, clip_high=0.28, aggregation="token-mean", entropy_coef=0.0)
        with_paths, ref, seq = False, None, None
    else:
        kw = dict(is_config=ISConfig(level="sequence", mode="mask", lo=0.5, hi=2.0), clip_low=0.2, clip_high=0.28,
                  dual_clip=3.0, aggregation="seq-mean-token-mean", entropy_coef=0.01, kl_coef=0.05)
        with_paths, ref, seq = True, batch["ref"], batch["seq_ids"]
        # sequence-level ratios stay near 1 when each token's behaviour / proximal gap is small
        batch = dict(batch, infer=batch["old"] + 0.02 * (batch["infer"] - batch["old"]) / 0.05)
    tensors = dict(weight=batch["weight"], mask=batch["mask"], infer_logprobs=batch["infer"],
                   entropy=batch["entropy"], ref_logprobs=ref, seq_ids=seq)
    lp = batch["lp"].to(device).clone().requires_grad_()
    dev = {k: (x.to(device) if x is not None else None) for k, x in tensors.items()}
    loss, met = policy_loss(lp, batch["old"].to(device), batch["adv"].to(device), **dev,
                            paths=paths if with_paths else None, backend="triton", **kw)
    loss.backward()
    lp_r = batch["lp"].detach().double().requires_grad_()
    host = {k: (x.double() if x is not None and x.is_floating_point() else x) for k, x in tensors.items()}
    loss_r, met_r = policy_loss_ref(lp_r, batch["old"].double(), batch["adv"].double(), **host,
                                    sequences=sequences if with_paths else None, **kw)
    loss_r.backward()
    errs = {"loss": rel_err(torch, loss.cpu(), loss_r), "d_logprobs": rel_err(torch, lp.grad.cpu(), lp_r.grad),
            "metrics": metrics_err(met, met_r)}
    note = f"clip_frac {met_r['clip_frac']:.3f}, dual_clip_frac {met_r['dual_clip_frac']:.3f}"
    return f"M={m} targets, N={forest.n} rows", errs, "float32", note


def case_gae(torch, device, sizes, params, seed):
    from clawfast.kernels import tree_gae, tree_gae_ref

    forest = Forest(sizes["rows"], sizes["samples"], _rng(seed))
    n = forest.n
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.zeros(n, dtype=torch.float64)
    rewards[torch.tensor(forest.leaves)] = torch.rand(len(forest.leaves), generator=gen, dtype=torch.float64)
    dense = torch.rand(n, generator=gen) < 0.05  # some per-token rewards too (format, tool errors)
    rewards[dense] += 0.1 * torch.randn(int(dense.sum()), generator=gen, dtype=torch.float64)
    values = torch.randn(n, generator=gen, dtype=torch.float64) * 0.5
    mask = torch.tensor(forest.model, dtype=torch.float64)
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    parent = torch.tensor(forest.parent, dtype=torch.int64)
    kw = dict(gamma=params["gamma"], lam=params["lam"], mode=params["mode"])
    adv, ret = tree_gae(rewards.to(device), values.to(device), parent.to(device), mask=mask.to(device),
                        backend="triton", **kw)
    adv_r, ret_r = tree_gae_ref(rewards.double(), values.double(), parent, mask=mask.double(), **kw)
    errs = {"advantages": rel_err(torch, adv.cpu(), adv_r), "returns": rel_err(torch, ret.cpu(), ret_r)}
    return f"N={n} depth<={forest.depth()} leaves={len(forest.leaves)}", errs, "float32", ""


def case_grpo(torch, device, sizes, params, seed):
    from clawfast.kernels import grpo_advantages, grpo_advantages_ref

    groups, samples = sizes["groups"], sizes["samples"]
    gen = torch.Generator().manual_seed(seed)
    r = groups * samples
    # float64, as the trainer passes them (clawfast/train/algorithms.py)
    rewards = (torch.rand(r, generator=gen) < 0.4).double() + 0.1 * torch.rand(r, generator=gen, dtype=torch.float64)
    task = torch.arange(r) // samples
    harness = torch.randint(0, 2, (r,), generator=gen)
    keys = torch.stack([task, harness], 1)
    keys[0] = torch.tensor([groups, 0])  # a group of one: advantage 0
    adv = grpo_advantages(rewards.to(device), keys.to(device))
    adv_r = grpo_advantages_ref(rewards.double(), keys)
    return f"R={r} rewards", {"advantages": rel_err(torch, adv.cpu(), adv_r)}, "float64", ""


RUNNERS = {"attention": case_attention, "tree_logprobs": case_tree_logprobs, "linear_logprobs": case_linear_logprobs,
           "importance": case_importance, "policy_loss": case_policy_loss, "gae": case_gae, "grpo": case_grpo}


# ---------------------------------------------------------------------------------------- running


def case_seed(seed: int, index: int) -> int:
    return (seed + 1_000_003 * index) % 2**31


def _fatal(exc: BaseException) -> bool:
    """A CUDA error that poisons the process's context: its process must not run another case."""
    text = str(exc)
    return any(s in text for s in ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch"))


def run_case(torch, device: str, case: Case, smoke: bool, seed: int, tol_scale: float = 1.0) -> dict:
    """One case, start to finish: its row (never raises; an exception is a failed row)."""
    t0 = time.perf_counter()
    row = {"op": case.op, "case": case.name}
    try:
        shape, errs, dtype, note = RUNNERS[case.run](torch, device, case.sizes(smoke), case.params, seed)
    except Exception as exc:  # noqa: BLE001 - reported as the case's result
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        row.update(ok=False, ms=(time.perf_counter() - t0) * 1e3, note=f"{type(exc).__name__}: {first}; seed {seed}")
        row["fatal"] = _fatal(exc)
        return row
    finally:
        if device != "cpu":
            torch.cuda.empty_cache()
    ratios = {part: (err / (tolerance(part, dtype) * tol_scale) if tol_scale > 0 else (math.inf if err else 0.0))
              for part, err in errs.items()}
    worst = max(ratios, key=lambda p: (ratios[p], errs[p]))
    parts = ", ".join(f"{p} {e:.2g}" for p, e in errs.items())
    row.update(shape=shape, err=errs[worst], tol=tolerance(worst, dtype) * tol_scale,
               ok=all(math.isfinite(e) for e in errs.values()) and ratios[worst] <= 1.0,
               ms=(time.perf_counter() - t0) * 1e3, note=f"{parts}; seed {seed}" + (f"; {note}" if note else ""))
    return row


def _setup(smoke: bool):
    """torch and the device in a process about to run cases (TRITON_INTERPRET set before triton loads)."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        if not smoke:
            raise SystemExit("gpu_correctness: no CUDA device (use --smoke on a CPU)")
        os.environ["TRITON_INTERPRET"] = "1"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 cuBLAS in the log-prob backward: IEEE
    torch.backends.cudnn.allow_tf32 = False
    import clawfast.kernels  # noqa: F401 - after TRITON_INTERPRET

    return torch, "cuda" if cuda else "cpu"


def _worker(tasks, results, smoke: bool, seed: int, tol_scale: float) -> None:
    torch, device = _setup(smoke)
    cases = {f"{c.op} {c.name}": c for c in CASES}
    pid = os.getpid()
    while True:
        try:
            index, name = tasks.get(timeout=0.2)
        except queue.Empty:
            return
        results.put(("start", pid, index, None))
        try:
            row = run_case(torch, device, cases[name], smoke, case_seed(seed, index), tol_scale)
        except torch.cuda.OutOfMemoryError as exc:
            results.put(("oom", pid, index, str(exc).splitlines()[0][:200]))
            time.sleep(1.0)
            continue
        fatal = row.pop("fatal", False)
        results.put(("row", pid, index, row))
        if fatal:
            return


def run_all(cases: list[Case], smoke: bool, seed: int, workers: int, rows: Rows, tol_scale: float = 1.0) -> None:
    """The cases in ``workers`` processes fed from one queue in plan order; rows as they finish."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    tasks, results = ctx.Queue(), ctx.Queue()
    index_of = {f"{c.op} {c.name}": i for i, c in enumerate(CASES)}
    by_index = {index_of[f"{c.op} {c.name}"]: c for c in cases}
    for i in sorted(by_index):
        tasks.put((i, f"{by_index[i].op} {by_index[i].name}"))
    procs: dict[int, mp.Process] = {}
    inflight: dict[int, int] = {}
    pending = set(by_index)
    queued = len(pending)  # tasks in the queue not yet taken
    ooms: dict[int, int] = {}

    def start() -> None:
        p = ctx.Process(target=_worker, args=(tasks, results, smoke, seed, tol_scale), daemon=True)
        p.start()
        procs[p.pid] = p

    def fail(i: int, note: str) -> None:
        c = by_index[i]
        rows.add(op=c.op, case=c.name, ok=False, note=f"{note}; seed {case_seed(seed, i)}")
        pending.discard(i)

    for _ in range(max(1, min(workers, len(pending)))):
        start()
    while pending:
        try:
            kind, pid, i, payload = results.get(timeout=0.5)
        except queue.Empty:
            kind = None
        if kind == "start":
            inflight[pid] = i
            queued -= 1
        elif kind == "row":
            inflight.pop(pid, None)
            if i in pending:
                rows.add(**payload)
                pending.discard(i)
        elif kind == "oom":
            inflight.pop(pid, None)
            ooms[i] = ooms.get(i, 0) + 1
            if ooms[i] > 2:
                fail(i, f"out of GPU memory three times: {payload}")
            else:
                tasks.put((i, f"{by_index[i].op} {by_index[i].name}"))
                queued += 1
        if kind is not None:
            continue
        for pid, p in list(procs.items()):
            if p.is_alive():
                continue
            procs.pop(pid)
            i = inflight.pop(pid, None)
            if i is not None and i in pending:
                fail(i, f"its process died (exit status {p.exitcode})")
        if pending and queued > 0 and len(procs) < workers:
            start()  # a worker that stopped after a fatal CUDA error, or died, is replaced
        elif pending and not procs:
            for i in sorted(pending):
                fail(i, "not run: no process left to run it")
    for p in procs.values():
        p.join(timeout=5)


def default_workers(smoke: bool) -> int:
    return 2 if smoke else max(1, min(6, (os.cpu_count() or 2) // 2))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; on a CPU, Triton's interpreter")
    ap.add_argument("--rows", type=Path, help="append each finished case here as a JSON line (bench/rows.py)")
    ap.add_argument("--seed", type=int, default=None, help="base seed (default: fresh, printed)")
    ap.add_argument("--only", nargs="+", help="only the cases whose 'op case' contains one of these texts")
    ap.add_argument("--workers", type=int, default=None, help="processes running cases (default: CPUs / 2, <= 6)")
    ap.add_argument("--tol-scale", type=float, default=1.0,
                    help="multiply every tolerance (0: any nonzero error fails; shows that failures are reported)")
    ap.add_argument("--list", action="store_true", help="print the plan and exit")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for c in CASES:
            print(f"{c.op} | {c.name} | {c.sizes(args.smoke)}")
        return 0
    cases = select(args.only)
    if not cases:
        print(f"no case matches {args.only}")
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") % 2**31
    workers = args.workers or default_workers(args.smoke)
    print(f"gpu_correctness: {len(cases)} cases, seed {seed}, {workers} processes"
          f"{' (smoke)' if args.smoke else ''}", flush=True)
    rows = Rows(args.rows)
    t0 = time.perf_counter()
    run_all(cases, args.smoke, seed, workers, rows, args.tol_scale)
    failed = rows.failed
    print(f"gpu_correctness: {len(rows.rows) - len(failed)} of {len(rows.rows)} cases within tolerance in "
          f"{time.perf_counter() - t0:.1f} s (seed {seed})" + (f"; FAILED: {len(failed)}" if failed else ""),
          flush=True)
    return 1 if failed or len(rows.rows) < len(cases) else 0


if __name__ == "__main__":
    sys.exit(main())
