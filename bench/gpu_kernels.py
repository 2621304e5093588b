"""Timings of clawfast.kernels' Triton kernels on one GPU, against their baselines and peers, each case
streamed through bench/rows.py the moment it finishes (most valuable first).

    python bench/gpu_kernels.py --rows ROWS.jsonl           # CUDA, bfloat16 (~90 s on an H200)
    python bench/gpu_kernels.py --smoke --rows ROWS.jsonl   # tiny sizes; CPU + TRITON_INTERPRET=1 without a GPU

Timings only: correctness is bench/gpu_correctness.py's. Each timed function runs once on its own
first (Triton compiles and autotunes there: reported as ``warmup_ms`` and in the note), then
``--warmup - 1`` more untimed calls, then ``--repeats`` timed calls (CUDA events; the median).
Peak memory is the allocator's high-water mark over the timed calls above what was allocated before
them. ``ratio`` = our ms / the baseline's ms (below 1: ours faster); ``mem_ratio`` likewise for peak
memory. A case whose code raises (a baseline out of memory, a peer that fails) is a row with the error;
a peer that is not importable is one row saying so; a case that no longer fits ``--budget`` (seconds
from the script's start) is a row saying it was skipped. In order:

1. ``tree_logprobs`` at Liger-Kernel's published shape (N = 32,768 rows, d = 4,096, V = 128,256, bf16,
   one target per row as the peers take them): no-grad forward vs ONE bf16 matmul of the same shape
   (bar <= 1.2), forward+backward of the log-likelihood vs THREE (bar <= 1.5), vs the naive
   ``log_softmax(h @ W.T).gather`` (peak memory bar <= 0.02), vs Liger-Kernel's fused linear
   cross-entropy (``LigerFusedLinearCrossEntropyLoss``, its own code; forward+backward and no-grad)
   and vs Cut Cross-Entropy (``cut_cross_entropy.linear_cross_entropy``, its own Triton kernels:
   as shipped, ``filter_eps="high"``, which skips gradient blocks whose softmax entries are all
   below 2^-12 (nearly all of them on random weights, where softmax is near uniform), then exact,
   ``filter_eps=None``, then no-grad).
2. ``tree_attention`` on an agent-shaped forest of 16K rows (32 query / 8 key-value heads, head_dim
   128, bf16), forward+backward: Triton vs SDPA with the dense [N, N] tree mask; then on one plain
   causal chain of the same rows, Triton vs SDPA's causal kernel (torch's flash backend: the kernel a
   flat trainer runs, so the ratio prices the tree kernel per attention pair).
3. ``tree_gae`` (path and tree modes) on 16K rows vs the torch path and vs the per-step loop on the
   host; ``importance_weights`` (token, sequence level) and ``policy_loss`` (forward+backward), Triton
   vs the torch path.
4. ``tree_logprobs`` forward+backward with the entropy's gradient too (the trainer with an entropy
   bonus; one more autotune) vs three matmuls.
5. ``tree_attention`` Triton vs FlexAttention (compiled; its compile reported), then the larger
   forests of ``--attention-tokens`` (64K) vs dense SDPA, as the budget allows.

``--smoke`` runs tiny sizes (on a CPU under Triton's interpreter, wall-clock timings, no memory
figures); ``--out`` also writes every row as one JSON document.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

T_START = time.monotonic()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; CPU + TRITON_INTERPRET=1 if no GPU")
    ap.add_argument("--rows", type=Path, default=None, help="JSON lines, one per finished case (bench/rows.py)")
    ap.add_argument("--out", type=Path, default=None, help="also write all rows as one JSON document")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds from the script's start; a case that no longer fits is reported as skipped "
                         "(default 85 on a GPU, none in smoke)")
    ap.add_argument("--logprob-tokens", type=int, default=32768, help="rows of the log-probs cases")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--attention-tokens", type=int, nargs="+", default=[16384, 65536],
                    help="rows of the attention forests: the first in section 2, the others last")
    ap.add_argument("--gae-tokens", type=int, default=16384, help="rows of the GAE / IS / loss cases")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls, the first (compile, autotune) included")
    args = ap.parse_args(argv)
    if args.budget is None and not args.smoke:
        args.budget = 85.0
    return args


# Seconds each group of cases may need on an H200, compiles included (a case starts only if what is
# left of --budget covers it): rough, from the FLOP counts and compile times in the module's notes.
EST_S = {"logprobs": 20, "naive": 4, "liger": 8, "cce": 12, "attention": 12, "chain": 4, "small": 15,
         "entropy": 15, "flex": 40, "attention_big": 20}


@dataclass
class Timing:
    ms: float
    first_ms: float
    peak_mib: float
    value: object = None


class Bench:
    """Timing and memory on one device: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, torch, device, warmup, repeats):
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        self.warmup, self.repeats = max(1, warmup), max(1, repeats)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def measure(self, fn, repeats: int | None = None) -> Timing:
        """The first call alone (compile / autotune), warm-up calls, then timed calls; the peak memory
        of the timed calls above what was allocated before them (NaN on a CPU)."""
        torch = self.torch
        self.sync()
        t0 = time.perf_counter()
        value = fn()
        self.sync()
        first_ms = (time.perf_counter() - t0) * 1e3
        for _ in range(self.warmup - 1):
            fn()
        before = 0
        if self.cuda:
            self.sync()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeats or self.repeats):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if self.cuda else float("nan")
        return Timing(statistics.median(times), first_ms, peak, value)


class Cases:
    """Runs cases under the budget: a case that raises or no longer fits becomes a row saying so."""

    def __init__(self, torch, rows, budget: float | None, cuda: bool):
        self.torch, self.rows, self.budget, self.cuda = torch, rows, budget, cuda
        self.failures: list[str] = []

    def left(self) -> float:
        return math.inf if self.budget is None else self.budget - (time.monotonic() - T_START)

    def fits(self, group: str, **row) -> bool:
        need = EST_S[group] if self.cuda else 0
        if self.left() >= need:
            return True
        self.rows.add(**row, note=f"skipped: {max(self.left(), 0):.0f} s of the {self.budget:.0f} s budget left, "
                                  f"~{EST_S[group]} s needed on an H200")
        return False

    def error(self, exc: BaseException, *, ours: bool, **row) -> None:
        traceback.print_exc()  # the whole story to the log; the row gets its first line
        self.rows.add(**row, note=f"{'error' if ours else 'baseline failed'}: {describe(exc)}")
        if ours:
            self.failures.append(f"{row.get('op')} {row.get('case')}: {describe(exc)}")
        self.free()

    def free(self) -> None:
        if self.cuda:
            self.torch.cuda.empty_cache()


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0][:160] if text else ""
    oom = "out of memory" in text.lower() or type(exc).__name__ == "OutOfMemoryError"
    return ("out of memory: " if oom else "") + f"{type(exc).__name__}: {first}"


def secs(ms: float) -> str:
    return f"{ms / 1e3:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def try_time(bench, fn):
    """A baseline's Timing, or the exception it raised (out of memory at a large shape, a peer's bug)."""
    try:
        return bench.measure(fn)
    except Exception as exc:  # noqa: BLE001 - the row reports it
        traceback.print_exc()
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return exc


def versus(ours: Timing, base, **row) -> dict:
    """A row of ours against a baseline's Timing (or the exception it raised: said in the note)."""
    row.update(ms=ours.ms, peak_mib=ours.peak_mib, warmup_ms=ours.first_ms)
    if isinstance(base, Timing):
        row.update(baseline_ms=base.ms, ratio=ours.ms / base.ms, baseline_peak_mib=base.peak_mib,
                   baseline_warmup_ms=base.first_ms)
        if base.peak_mib == base.peak_mib and base.peak_mib > 0:
            row["mem_ratio"] = ours.peak_mib / base.peak_mib
    else:
        row["note"] = note(f"baseline failed: {describe(base)}", row.get("note", ""))
    return row


def note(*parts) -> str:
    return "; ".join(p for p in parts if p)


# ------------------------------------------------------------------------------------------- log-probs


def bench_logprobs(K, torch, bench, cases, rows, device, n, d, v, gen, backend):
    dtype = torch.bfloat16
    h = (torch.randn(n, d, generator=gen, device=device) * 0.5).to(dtype)
    w = (torch.randn(v, d, generator=gen, device=device) / d**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=gen, device=device)
    target_rows = torch.arange(n, device=device, dtype=torch.int32)
    target_ids = labels.to(torch.int32)
    shape = f"N={n} d={d} V={v} bf16, one target per row"
    op = "tree_logprobs"
    mm_flops = 2.0 * n * d * v

    def one_mm():
        h @ w.t()

    def three_mm():
        z = h @ w.t()
        z @ w
        z.t() @ h

    def ours_nograd():
        with torch.no_grad():
            lp, _ = K.tree_logprobs(h, w, target_rows, target_ids, backend=backend)
        return -lp.sum()  # the summed NLL, as the peers' reduction="sum" returns it

    def ours_fwd_bwd(entropy=False):
        def run():
            hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
            lp, ent = K.tree_logprobs(hg, wg, target_rows, target_ids, backend=backend)
            loss = -lp.sum() - (0.01 * ent.sum() if entropy else 0.0)
            loss.backward()
            return -lp.sum().detach()
        return run

    def naive_fwd_bwd():
        hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
        logp = torch.log_softmax((hg @ wg.t()).float(), dim=-1)
        loss = -logp.gather(1, labels[:, None]).sum()
        loss.backward()
        return loss.detach()

    def agree(ours: Timing, base) -> str:
        if not isinstance(base, Timing) or base.value is None or ours.value is None:
            return ""
        a, b = float(ours.value), float(base.value)
        return f"summed NLL {a:.6g} vs {b:.6g} (rel diff {abs(a - b) / max(abs(b), 1e-30):.1e})"

    out = {}
    # (key, case, ours, its matmul baseline, how many matmuls, bar, what the first call compiles)
    for key, case, fn, base_fn, mms, bar, first in (
            ("nograd", "no-grad forward", ours_nograd, one_mm, 1, "<= 1.2", "Triton compile + autotune"),
            ("fb", "fwd+bwd (log-likelihood)", ours_fwd_bwd(), three_mm, 3, "<= 1.5", "backward compile + autotune")):
        row = dict(op=op, case=case, shape=shape)
        if not cases.fits("logprobs", **row):
            continue
        try:
            base = bench.measure(base_fn)
            ours = bench.measure(fn)
            out[key] = ours
            baseline = "1 bf16 matmul (h @ W.T)" if mms == 1 else "3 bf16 matmuls (logits, dh, dW)"
            rows.add(**versus(ours, base, **row, baseline=baseline, bar=bar, note=note(
                f"first call {secs(ours.first_ms)} ({first})",
                f"{'matmul' if mms == 1 else f'{mms} matmuls'} {mms * mm_flops / base.ms / 1e9:.0f} TFLOP/s"
                if bench.cuda else "")))
        except Exception as exc:  # noqa: BLE001
            cases.error(exc, ours=True, **row)
    fb, ng = out.get("fb"), out.get("nograd")
    if fb is None:
        return out

    row = dict(op=op, case="fwd+bwd (log-likelihood)", shape=shape, baseline="naive torch log_softmax(h @ W.T)")
    if cases.fits("naive", **row):
        base = try_time(bench, naive_fwd_bwd)
        rows.add(**versus(fb, base, **row, bar="mem <= 0.02", note=agree(fb, base)))

    # Liger-Kernel: its module, as a transformer model's loss would call it.
    row = dict(op=op, case="fwd+bwd (log-likelihood)", shape=shape)
    try:
        import importlib.metadata

        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger_name = f"Liger-Kernel {importlib.metadata.version('liger-kernel')} LigerFusedLinearCrossEntropyLoss"
    except Exception as exc:  # noqa: BLE001 - one row says why, never silently dropped
        rows.add(**row, baseline="Liger-Kernel fused linear cross-entropy", note=f"not importable: {describe(exc)}")
    else:
        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger_fwd_bwd():
            hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
            loss = liger(wg, hg, labels)
            loss.backward()
            return loss.detach()

        def liger_nograd():
            with torch.no_grad():
                return liger(w, h, labels)

        if cases.fits("liger", **row, baseline=liger_name):
            base = try_time(bench, liger_fwd_bwd)
            rows.add(**versus(fb, base, **row, baseline=liger_name, note=note(
                agree(fb, base), f"Liger's first call {secs(base.first_ms)}" if isinstance(base, Timing) else "")))
            if ng is not None:
                base = try_time(bench, liger_nograd)
                rows.add(**versus(ng, base, op=op, case="no-grad forward", shape=shape, baseline=liger_name,
                                  note=agree(ng, base)))

    # Cut Cross-Entropy: its own Triton kernels (impl="cce"), as shipped and exact.
    try:
        from cut_cross_entropy import __version__ as cce_version
        from cut_cross_entropy import linear_cross_entropy
    except Exception as exc:  # noqa: BLE001
        rows.add(**row, baseline="Cut Cross-Entropy linear_cross_entropy", note=f"not importable: {describe(exc)}")
    else:
        def cce_fwd_bwd(filter_eps):
            def run():
                hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
                loss = linear_cross_entropy(hg, wg, labels, reduction="sum", filter_eps=filter_eps, impl="cce")
                loss.backward()
                return loss.detach()
            return run

        def cce_nograd():
            with torch.no_grad():
                return linear_cross_entropy(h, w, labels, reduction="sum", impl="cce")

        for eps, label, extra in (
                ("high", "filter_eps='high' (default: gradient blocks below 2^-12 skipped)",
                 "approximate gradient; on random weights the softmax is near uniform (~1/V per entry), so "
                 "nearly every block is skipped"),
                (None, "filter_eps=None (exact gradient)", "")):
            name = f"Cut Cross-Entropy {cce_version} linear_cross_entropy(impl='cce', {label})"
            if not cases.fits("cce", **row, baseline=name):
                break
            base = try_time(bench, cce_fwd_bwd(eps))
            rows.add(**versus(fb, base, **row, baseline=name, note=note(
                agree(fb, base), extra, f"CCE's first call {secs(base.first_ms)}" if isinstance(base, Timing) else "")))
        if ng is not None and cases.fits("cce", op=op, case="no-grad forward", shape=shape):
            name = f"Cut Cross-Entropy {cce_version} linear_cross_entropy(impl='cce')"
            base = try_time(bench, cce_nograd)
            rows.add(**versus(ng, base, op=op, case="no-grad forward", shape=shape, baseline=name,
                              note=agree(ng, base)))
    out["run_entropy"] = ours_fwd_bwd(entropy=True)
    out["three_mm"] = three_mm
    out["shape"] = shape
    return out


def bench_logprobs_entropy(bench, cases, rows, lp):
    """Section 4: the trainer's form with an entropy bonus (the entropy's gradient: one more autotune)."""
    if "run_entropy" not in lp:
        return
    row = dict(op="tree_logprobs", case="fwd+bwd (log-likelihood + entropy)", shape=lp["shape"])
    if not cases.fits("entropy", **row):
        return
    try:
        ours = bench.measure(lp["run_entropy"])
        mm3 = bench.measure(lp["three_mm"])
        extra = f"{ours.ms / lp['fb'].ms:.2f}x the log-likelihood-only time" if "fb" in lp else ""
        rows.add(**versus(ours, mm3, **row, baseline="3 bf16 matmuls (logits, dh, dW)", bar="<= 1.5", note=note(
            f"first call {secs(ours.first_ms)} (the entropy-gradient variant's compile + autotune)", extra)))
    except Exception as exc:  # noqa: BLE001
        cases.error(exc, ours=True, **row)


# ------------------------------------------------------------------------------------------- attention


def agent_parent(torch, n, gen):
    """A forest like a packed GRPO group: 4 samples under a shared prompt, turns with retries."""
    parent = list(range(-1, n // 8 - 1))
    per = (n - len(parent)) // 4
    for _ in range(4):
        attach, left = n // 8 - 1, per
        while left > 0:
            length = min(left, 256)
            start = len(parent)
            parent.extend([attach] + list(range(start, start + length - 1)))
            left -= length
            if float(torch.rand(1, generator=gen)) < 0.2:
                attach = start  # the next turn branches from inside this one (an edit/retry)
            else:
                attach = start + length - 1
    return torch.tensor(parent, dtype=torch.int32)


def kv_end_of(torch, parent):
    """kv_end[j]: the last row of j's subtree (rows in DFS order)."""
    end = list(range(parent.shape[0]))
    par = parent.tolist()
    for i in reversed(range(len(par))):
        if par[i] >= 0:
            end[par[i]] = max(end[par[i]], end[i])
    return torch.tensor(end, dtype=torch.int32)


class AttentionInputs:
    def __init__(self, K, torch, device, n, gen):
        cpu = device.type == "cpu"
        self.cpu = cpu
        self.hq, self.hkv, self.d = (4, 2, 16) if cpu else (32, 8, 128)
        self.dtype = torch.float32 if cpu else torch.bfloat16
        gen_host = torch.Generator().manual_seed(n)  # the forest's shape: drawn on the host
        self.kv_end = kv_end_of(torch, agent_parent(torch, n, gen_host)).to(device)
        self.n = n = self.kv_end.shape[0]
        self.mask = K.TreeMask(self.kv_end)
        self.q, self.k, self.v = (torch.randn(n, h, self.d, generator=gen, device=device).to(self.dtype)
                                  for h in (self.hq, self.hkv, self.hkv))
        self.g = torch.randn(n, self.hq, self.d, generator=gen, device=device).to(self.dtype)
        pairs = self.mask.visible_pairs()
        self.pairs = pairs
        self.shape = (f"N={n} Hq={self.hq} Hkv={self.hkv} D={self.d} {str(self.dtype)[6:]}, agent forest, "
                      f"pairs/causal={pairs / (n * (n + 1) / 2):.2f}")

    def flops(self, pairs):
        return 3.5 * 4.0 * self.hq * self.d * pairs  # forward 2 matmuls per pair, backward 2.5x


def tree_step(K, torch, x: AttentionInputs, backend, mask=None):
    """Forward+backward of tree attention (forward only for flex on a CPU: no flex backward there)."""
    grads = not (x.cpu and backend == "flex")
    mask = x.mask if mask is None else mask

    def run():
        q, k, v = (t.detach().requires_grad_(grads) for t in (x.q, x.k, x.v))
        out = K.tree_attention(q, k, v, mask, backend=backend)
        if grads:
            out.backward(x.g)
    return run


def bench_attention(K, torch, bench, cases, rows, x: AttentionInputs, with_chain: bool):
    """Triton vs SDPA with the dense mask on the forest; Triton vs SDPA causal on one chain."""
    import torch.nn.functional as F

    op = "tree_attention"
    row = dict(op=op, case="fwd+bwd triton", shape=x.shape)
    if not cases.fits("attention" if with_chain else "attention_big", **row, baseline="dense SDPA"):
        return None
    try:
        ours = bench.measure(tree_step(K, torch, x, "triton"))
    except Exception as exc:  # noqa: BLE001
        cases.error(exc, ours=True, **row)
        return None

    def dense():
        # key/value heads repeated for the query heads, as HF's SDPA path does with a mask: the
        # memory-efficient kernel takes a mask but no GQA (enable_gqa would fall back to math)
        q, k, v = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (x.q, x.k, x.v))
        rep = x.hq // x.hkv
        allowed = K.tree_mask_ref(x.kv_end)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             attn_mask=allowed)
        out.backward(x.g.transpose(0, 1)[None])

    base = try_time(bench, dense)
    dense_name = "dense SDPA (bool [N, N] tree mask; k, v repeated to Hq heads)"
    rows.add(**versus(ours, base, **row, baseline=dense_name, note=note(
        f"first call {secs(ours.first_ms)} (compile)",
        f"triton {x.flops(x.pairs) / ours.ms / 1e9:.0f} TFLOP/s on the visible pairs" if bench.cuda else "")))
    if not with_chain:
        return ours
    cases.free()
    # One plain causal chain of N rows: the same kernel on a flat sample, against the kernel a flat
    # trainer runs (SDPA is_causal: torch's flash backend on a GPU).
    row = dict(op=op, case="fwd+bwd triton, one causal chain", shape=f"N={x.n} Hq={x.hq} Hkv={x.hkv} D={x.d} "
               f"{str(x.dtype)[6:]}, one sequence")
    if not cases.fits("chain", **row):
        return ours
    try:
        chain = K.TreeMask(torch.full_like(x.kv_end, x.n - 1))
        mine = bench.measure(tree_step(K, torch, x, "triton", chain))
    except Exception as exc:  # noqa: BLE001
        cases.error(exc, ours=True, **row)
        return ours

    def causal():
        q, k, v = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (x.q, x.k, x.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(x.g.transpose(0, 1)[None])

    base = try_time(bench, causal)
    causal_pairs = x.n * (x.n + 1) // 2
    rows.add(**versus(mine, base, **row, baseline="SDPA is_causal (torch's flash backend on a GPU)", note=note(
        f"triton {x.flops(causal_pairs) / mine.ms / 1e9:.0f} TFLOP/s" if bench.cuda else "",
        f"SDPA {x.flops(causal_pairs) / base.ms / 1e9:.0f} TFLOP/s" if bench.cuda and isinstance(base, Timing)
        else "")))
    return ours


def bench_flex(K, torch, bench, cases, rows, x: AttentionInputs, ours: Timing | None):
    op = "tree_attention"
    case = "fwd+bwd triton" + (" (flex: forward only on a CPU)" if x.cpu else "")
    row = dict(op=op, case=case, shape=x.shape, baseline="FlexAttention (compiled, the tree's block mask)")
    if not cases.fits("flex", **row):
        return
    try:
        ours = ours or bench.measure(tree_step(K, torch, x, "triton"))
    except Exception as exc:  # noqa: BLE001
        cases.error(exc, ours=True, **row)
        return
    base = try_time(bench, tree_step(K, torch, x, "flex"))
    rows.add(**versus(ours, base, **row, note=note(
        f"flex's first call {secs(base.first_ms)} (torch.compile)" if isinstance(base, Timing) else "")))


# ------------------------------------------------------------------------------------ GAE, IS, loss


def bench_small_ops(K, torch, bench, cases, rows, device, n, gen):
    if not cases.fits("small", op="tree_gae", case="path, tree, loop; importance_weights; policy_loss"):
        return

    def rel(a, b) -> float:
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0

    gen_host = torch.Generator().manual_seed(n)
    parent = agent_parent(torch, n, gen_host).to(device)
    nn = parent.shape[0]
    r = torch.randn(nn, generator=gen, device=device)
    v = torch.randn(nn, generator=gen, device=device)
    mask = (torch.rand(nn, generator=gen, device=device) < 0.7).float()
    first_tree = None
    for mode in ("path", "tree"):
        row = dict(op="tree_gae", case=mode, shape=f"N={nn} agent forest")
        try:
            ours = bench.measure(lambda: K.tree_gae(r, v, parent, mask=mask, mode=mode, backend="triton")[0])
            base = try_time(bench, lambda: K.tree_gae(r, v, parent, mask=mask, mode=mode, backend="torch")[0])
            diff = rel(ours.value, base.value) if isinstance(base, Timing) else None
            rows.add(**versus(ours, base, **row, baseline="torch path", note=note(
                f"first call {secs(ours.first_ms)} (compile)",
                f"max rel diff vs torch {diff:.1e}" if diff is not None else "")))
            if mode == "tree":
                first_tree = ours
        except Exception as exc:  # noqa: BLE001
            cases.error(exc, ours=True, **row)
    # The per-step loop a trainer without a tree kernel runs (one Python step per row, on the host,
    # where such a loop lives): timed once, the copy to the host included.
    row = dict(op="tree_gae", case="tree", shape=f"N={nn} agent forest", baseline="per-step loop (host)")
    if first_tree is not None:
        try:
            t0 = time.perf_counter()
            host = [t.cpu() for t in (r, v, parent, mask)]
            a_loop, _ = K.tree_gae_ref(host[0], host[1], host[2], mask=host[3], mode="tree")
            t_loop = (time.perf_counter() - t0) * 1e3
            rows.add(**row, ms=first_tree.ms, baseline_ms=t_loop, ratio=first_tree.ms / t_loop,
                     note=f"max rel diff vs the loop {rel(first_tree.value, a_loop):.1e}; the loop timed once")
        except Exception as exc:  # noqa: BLE001
            cases.error(exc, ours=False, **row)
    m = nn
    infer = -torch.rand(m, generator=gen, device=device) * 3
    train = infer + 0.1 * torch.randn(m, generator=gen, device=device)
    tmask = (torch.rand(m, generator=gen, device=device) < 0.9).float()
    seq = torch.randint(0, 64, (m,), generator=gen, device=device)
    paths = K.TreePaths.from_sequences(seq, num_seqs=64)
    for level in ("token", "sequence"):
        row = dict(op="importance_weights", case=level, shape=f"M={m}, 64 sequences")
        try:
            cfg = K.ISConfig(level=level, mode="mask" if level == "sequence" else "truncate")

            def run(backend, cfg=cfg):
                return K.importance_weights(train, infer, tmask, config=cfg, paths=paths, backend=backend)

            ours = bench.measure(lambda: run("triton"))
            base = try_time(bench, lambda: run("torch"))
            diff = rel(ours.value.weights, base.value.weights) if isinstance(base, Timing) else None
            rows.add(**versus(ours, base, **row, baseline="torch path", note=note(
                f"first call {secs(ours.first_ms)} (compile)",
                f"max rel diff of the weights vs torch {diff:.1e}" if diff is not None else "")))
        except Exception as exc:  # noqa: BLE001
            cases.error(exc, ours=True, **row)
    adv = torch.randn(m, generator=gen, device=device)

    def loss_step(backend):
        def run():
            lp = train.detach().requires_grad_()
            loss, _ = K.policy_loss(lp, infer, adv, mask=tmask, infer_logprobs=infer, dual_clip=3.0,
                                    aggregation="seq-mean-token-mean", seq_ids=seq, backend=backend)
            loss.backward()
            return loss.detach()
        return run

    row = dict(op="policy_loss", case="fwd+bwd, token IS", shape=f"M={m}")
    try:
        ours = bench.measure(loss_step("triton"))
        base = try_time(bench, loss_step("torch"))
        diff = rel(ours.value, base.value) if isinstance(base, Timing) else None
        rows.add(**versus(ours, base, **row, baseline="torch path", note=note(
            f"first call {secs(ours.first_ms)} (compile)", f"loss rel diff vs torch {diff:.1e}" if diff is not None
            else "")))
    except Exception as exc:  # noqa: BLE001
        cases.error(exc, ours=True, **row)


# ------------------------------------------------------------------------------------------------ main


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: interpreted kernels
    import torch

    import clawfast.kernels as K
    from rows import Rows

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no CUDA device: run with --smoke (TRITON_INTERPRET=1 on the CPU)")
        return 2
    rows = Rows(args.rows)
    if args.smoke:
        lp_n, d, v, attn, gae_n, repeats, warmup = 40, 32, 80, [64, 96], 160, 1, 1
    else:
        lp_n, d, v, attn, gae_n = args.logprob_tokens, args.hidden, args.vocab, args.attention_tokens, args.gae_tokens
        repeats, warmup = args.repeats, args.warmup
    cuda = device.type == "cuda"
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (TRITON_INTERPRET=1)'}; "
          f"{time.monotonic() - T_START:.1f} s since start", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    bench = Bench(torch, device, warmup, repeats)
    cases = Cases(torch, rows, args.budget, cuda)

    lp = bench_logprobs(K, torch, bench, cases, rows, device, lp_n, d, v, gen, "triton")
    cases.free()
    x = AttentionInputs(K, torch, device, attn[0], gen)
    ours_attn = bench_attention(K, torch, bench, cases, rows, x, with_chain=True)
    cases.free()
    bench_small_ops(K, torch, bench, cases, rows, device, gae_n, gen)
    bench_logprobs_entropy(bench, cases, rows, lp)
    lp.clear()
    cases.free()
    bench_flex(K, torch, bench, cases, rows, x, ours_attn)
    del x
    cases.free()
    for n in attn[1:]:
        try:
            big = AttentionInputs(K, torch, device, n, gen)
        except Exception as exc:  # noqa: BLE001
            cases.error(exc, ours=True, op="tree_attention", case="fwd+bwd triton", shape=f"N={n}")
            continue
        bench_attention(K, torch, bench, cases, rows, big, with_chain=False)
        del big
        cases.free()

    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(device=str(device), smoke=args.smoke, rows=rows.rows), indent=2,
                                       default=str))
        print(f"wrote {args.out}")
    print(f"done in {time.monotonic() - T_START:.1f} s", flush=True)
    if cases.failures:
        print("FAILED:\n  " + "\n  ".join(cases.failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
