"""One RL training step at a real model's shape on the GPU: tree packing vs one sample per kept leaf
vs one sample per call, each row streamed through bench/rows.py as it finishes.

    python bench/gpu_step.py --rows ROWS.jsonl          # CUDA: Qwen3-0.6B's shape, bf16 (~2.5 minutes)
    python bench/gpu_step.py --smoke --rows ROWS.jsonl  # CPU: a tiny Qwen3, the same cases and rows

Setup: Qwen3-0.6B's published config (`QWEN3_0_6B`: 28 layers, hidden 1,024, 16 query / 8 key-value
heads of 128, MLP 3,072, vocabulary 151,936, tied embeddings, RoPE theta 1e6) with random weights in
bfloat16 on CUDA; one GRPO group of 8 harness-shaped rollouts of one task
(`bench_train_step.make_rollouts`: `clawfast.synthetic.task_group`, 20 calls each, prompts growing
to 16,384 tokens, retries, a subagent chain, a title call, a history edit); AdamW; `StepConfig`'s
defaults (GRPO, token-level truncated IS, one update) with ``micro_batch_tokens`` = 32,768 rows
per micro-batch. One step = forward + backward over every micro-batch, gradient clipping, AdamW step
(plus the step's data preparation on the host, reported apart). Four ways, in the order they run:

- ``tree``: the project's own step, `clawfast.train.step.train_step` (threads, prefix trees, leaf
  filter, deduplicating packer, `Policy` with ``attention="auto"``: Triton tree attention and
  Triton `tree_logprobs` on CUDA; the torch fast paths on a CPU, or ``--tree-attention triton``
  for Triton's interpreter).
- ``per-leaf``: one sample per kept leaf (`bench_train_step.flat_step_data(.., "leaf")`, each
  trainable token weighted 1 / (kept leaves holding it): the tree's loss), run by the same
  micro-batch code (`accumulate_gradients`) on the model's own attention: with flash-attention 2
  importable, samples packed first-fit into ``micro_batch_tokens`` rows and attended varlen from
  their position ids (`flash_attention_2`); otherwise one sample per forward on SDPA's causal kernel
  (torch's flash backend). SDPA on a packed row sequence would build a dense block-diagonal
  [N, N] mask and run the masked kernel over all N^2 pairs, and a padded batch computes the
  padding: one sample per forward is the fastest SDPA form of the same work.
- ``tree (varlen)``: the tree's step with ``attention="varlen"`` (flash-attention's varlen kernel over
  each micro-batch's path segments, their ancestors' keys gathered; CUDA only, a row saying so on a
  CPU): one warm-up step, one timed step, against per-leaf.
- ``per-call``: one sample per recorded main-thread call (`flat_step_data(.., "call")`: every call
  as its own sequence, as a capturing proxy yields them), same attention as per-leaf. Its step is
  the longest (6-8x the tree's tokens); when it does not fit what is left of ``--budget``, a
  stratified subset of its samples (every m-th by length) is timed and its forward+backward time
  scaled by the cost-model ratio (full / subset), which the row says.

Timing: the tree runs one full warm-up step (Triton compiles; reported), then
``--repeats`` timed steps (median); per-leaf warms up on one micro-batch; per-call shares that
warm-up (the same kernels). Times are wall clock with the device synchronised. After every way's
timed steps (the timings first: per-call times a subset of what is left beyond these), the tree and
per-leaf each run one more step under torch.profiler's device trace (`device_time.py`; not in the
median), and a row per way gives that step's device time by kernel and how busy the
device was over the whole step (the tree's host preparation, forward, backward and optimizer;
per-leaf's data is prepared before), so that a slow way says which kernels made it slow. Peak memory: the
allocator's high-water mark during the timed steps above what was allocated before them (weights
and optimizer state: ``static`` in the note). Tokens: the rows each way runs through the model, and
the group's unique kept tokens (the same useful work for every way). A way that fails (out of
memory included) is a row with the error, and the next way still runs. The issue's goals at a 32K
budget are the bars (benchmark figures, not tests): tree >= 1.3x faster than per-leaf, >= 8x than
per-call; ``ratio`` = tree ms / baseline ms, as in bench/gpu_kernels.py. The first row (``layouts``)
gives each way's rows, attention pairs and model FLOPs (`step_cost`): at the default sizes the tree
does 1.16x less work than per-leaf and 6.1x less than per-call (attention is ~2/3 of it at 16K-token
paths), so at equal kernel speed per FLOP those are the speed-ups to expect.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

T_START = time.monotonic()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Qwen3-0.6B's config.json (hf.co/Qwen/Qwen3-0.6B): what transformers' Qwen3Config needs of it.
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
                  rope_theta=1e6)
SMOKE_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                   tie_word_embeddings=True, attention_bias=False, use_sliding_window=False, rope_theta=1e6)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny Qwen3 on the CPU (Triton interpreter if asked)")
    ap.add_argument("--rows", type=Path, default=None, help="JSON lines, one per finished case (bench/rows.py)")
    ap.add_argument("--k", type=int, default=8, help="rollouts in the GRPO group")
    ap.add_argument("--calls", type=int, default=None, help="calls per rollout (default 20; smoke 12)")
    ap.add_argument("--prompt", type=int, default=None, help="main-thread prompt length reached by the last call "
                    "(default 16384; smoke 512)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="rows per packed micro-batch (default 32768; smoke 1024)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per way (median; default 2, smoke 1)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole script, from its start (default 142 on a GPU, none in smoke)")
    ap.add_argument("--tree-attention", default="auto", choices=("auto", "triton", "torch", "flex", "varlen"),
                    help="Policy's attention backend for the tree way")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="every way, if memory is short")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    smoke = args.smoke
    args.calls = args.calls or (12 if smoke else 20)
    args.prompt = args.prompt or (512 if smoke else 16384)
    args.micro_batch_tokens = args.micro_batch_tokens or (1024 if smoke else 32768)
    args.repeats = args.repeats or (1 if smoke else 2)
    if args.budget is None and not smoke:
        args.budget = 142.0
    return args


class Clock:
    """Seconds left of the script's budget (counted from its start, imports included)."""

    def __init__(self, budget: float | None):
        self.budget = budget

    def elapsed(self) -> float:
        return time.monotonic() - T_START

    def left(self) -> float:
        return math.inf if self.budget is None else self.budget - self.elapsed()


def qwen3_config(smoke: bool):
    from transformers import Qwen3Config

    sizes = dict(SMOKE_MODEL if smoke else QWEN3_0_6B)
    theta = sizes.pop("rope_theta")
    try:  # transformers 5: the RoPE settings live in rope_parameters
        config = Qwen3Config(**sizes, rope_parameters={"rope_type": "default", "rope_theta": theta},
                             attn_implementation="sdpa")
    except TypeError:
        config = Qwen3Config(**sizes, rope_theta=theta, attn_implementation="sdpa")
    rope = getattr(config, "rope_parameters", None) or {}
    got = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if got != theta:
        raise RuntimeError(f"Qwen3Config kept rope theta {got}, not {theta}")
    return config


def build_policy(args, device, dtype, torch):
    from transformers import Qwen3ForCausalLM

    from clawfast.train.policy import Policy

    config = qwen3_config(args.smoke)
    torch.manual_seed(args.seed)
    with torch.device(device):  # random init on the device itself: seconds, not a CPU pass over 0.6B weights
        lm = Qwen3ForCausalLM(config)
    lm.to(dtype)
    if args.gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    policy = Policy(lm, attention=args.tree_attention)
    policy.train()
    return policy


# ---------------------------------------------------------------------------------------------- cost model


@dataclasses.dataclass
class Cost:
    """Model FLOPs of one forward+backward over a list of micro-batches."""

    rows: int
    pairs: int
    head_rows: int
    flops: float
    largest: int  # rows of the largest micro-batch: activation memory grows with the rows of one forward


def step_cost(batches, policy) -> Cost:
    """6 x decoder-layer parameters per row; attention 4 Hq D per visible (query, key) pair and layer
    forward, x3.5 with the backward (flash-attention's count); the LM head 8 V d per distinct
    predicting row (one matmul forward, the backward's recompute and two gradient matmuls)."""
    import numpy as np

    from bench_tree import attention_pairs

    cfg = policy.lm.config
    layer_params = sum(p.numel() for p in policy.backbone.layers.parameters())
    rows = sum(int(b.num_tokens) for b in batches)
    pairs = attention_pairs(batches)
    head_rows = sum(len(np.unique(b.target_rows)) for b in batches)
    flops = (6.0 * layer_params * rows + 3.5 * 4.0 * cfg.num_attention_heads * cfg.head_dim
             * cfg.num_hidden_layers * pairs + 8.0 * cfg.vocab_size * cfg.hidden_size * head_rows)
    return Cost(rows, pairs, head_rows, flops, max((int(b.num_tokens) for b in batches), default=0))


# --------------------------------------------------------------------------------------------- the ways


@contextlib.contextmanager
def one_sample_per_batch(bt):
    """`flat_step_data` with every sample in a micro-batch of its own (a single causal chain, which
    `Policy` runs on the model's own causal attention)."""
    saved = bt._first_fit_decreasing
    bt._first_fit_decreasing = lambda samples, micro_batch_tokens: [[s] for s in samples]
    try:
        yield
    finally:
        bt._first_fit_decreasing = saved


@contextlib.contextmanager
def model_attention(policy, flash: bool):
    """The flat ways' attention: flash-attention 2 over position-id-packed samples (the backbone
    called without the tree mask), or nothing to change (single chains already run on SDPA)."""
    if not flash:
        saved = policy.attention
        policy.attention = "auto"  # Policy runs a single causal chain on the model's own attention
        try:
            yield
        finally:
            policy.attention = saved
        return
    config = policy.lm.config
    saved = config._attn_implementation_internal
    policy.lm.set_attn_implementation("flash_attention_2")

    def hidden_states(input_ids, position_ids, kv_end):
        return policy.backbone(input_ids=input_ids[None], position_ids=position_ids[None],
                               use_cache=False).last_hidden_state[0]

    policy.hidden_states = hidden_states  # an instance attribute: Policy.forward calls it
    try:
        yield
    finally:
        del policy.hidden_states
        config._attn_implementation_internal = saved


def flash_available() -> tuple[bool, str]:
    try:
        from transformers.utils import is_flash_attn_2_available
    except ImportError as exc:
        return False, f"transformers has no is_flash_attn_2_available ({exc})"
    if not is_flash_attn_2_available():
        return False, "flash_attn is not importable"
    return True, ""


class Runner:
    def __init__(self, torch, policy, config, rows, clock, device, args):
        self.torch, self.policy, self.config, self.rows = torch, policy, config, rows
        self.clock, self.device, self.args = clock, device, args
        self.cuda = device.type == "cuda"
        self.optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6,
                                           betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def allocated(self) -> int:
        return self.torch.cuda.memory_allocated() if self.cuda else 0

    def reset_peak(self) -> int:
        if not self.cuda:
            return 0
        self.sync()
        self.torch.cuda.reset_peak_memory_stats()
        return self.torch.cuda.memory_allocated()

    def peak_mib(self, before: int) -> float:
        if not self.cuda:
            return float("nan")
        self.sync()
        return (self.torch.cuda.max_memory_allocated() - before) / 2**20

    def cleanup(self):
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    # one step of each kind ------------------------------------------------------------------

    def tree_step(self, rollouts) -> dict:
        from clawfast.train.step import train_step

        self.sync()
        t0 = time.perf_counter()
        m = train_step(self.policy, self.optimizer, rollouts, None, self.config)
        self.sync()
        total = time.perf_counter() - t0
        return dict(total_s=total, prepare_s=m["time_prepare_s"], fwd_bwd_s=m["time_fwd_bwd_s"],
                    optimizer_s=m.get("time_optimizer_s", 0.0), loss=m["loss"])

    def flat_step(self, data, prepare_s: float, scale: float = 1.0) -> dict:
        """bench_train_step.flat_step on prepared data: accumulate, clip, AdamW step. ``scale``
        multiplies the forward+backward time (a subset standing for the whole)."""
        from clawfast.train.update import accumulate_gradients, grad_norm

        self.sync()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        m = accumulate_gradients(self.policy, data, self.config)
        self.sync()
        t1 = time.perf_counter()
        grad_norm(self.policy, self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sync()
        t2 = time.perf_counter()
        fwd_bwd = (t1 - t0) * scale
        return dict(total_s=prepare_s + fwd_bwd + (t2 - t1), prepare_s=prepare_s, fwd_bwd_s=fwd_bwd,
                    optimizer_s=t2 - t1, loss=m["loss"])


def subset(data, keep):
    """The same StepData restricted to micro-batches ``keep`` (one mini-batch of them)."""
    keep = list(keep)
    return dataclasses.replace(
        data, batches=[data.batches[i] for i in keep], weights=[data.weights[i] for i in keep],
        advantages=None if data.advantages is None else [data.advantages[i] for i in keep],
        minibatches=[], denominators=[])


def stratified(data, stride: int) -> list[int]:
    """Every ``stride``-th micro-batch by size, from the middle of each stratum, plus the largest (the
    peak memory's)."""
    order = sorted(range(len(data.batches)), key=lambda i: data.batches[i].num_tokens)
    return sorted(set(order[stride // 2::stride]) | {order[-1]})


def fmt_flop(x: float, per_s: bool = False) -> str:
    unit = "TFLOP" if x >= 1e12 else "GFLOP"
    return f"{x / (1e12 if x >= 1e12 else 1e9):.3g} {unit}" + ("/s" if per_s else "")


def fmt_s(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.0f} ms"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: interpreted kernels
    import torch

    import bench_train_step as bt
    from clawfast.kernels import TreeMask
    from clawfast.train.prepare import prepare_step, token_counts
    from clawfast.train.step_config import StepConfig
    from device_time import device_breakdown, device_profile
    from rows import Rows

    rows = Rows(args.rows)
    clock = Clock(args.budget)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA device: run with --smoke (a tiny model on the CPU)")
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    where = torch.cuda.get_device_name() if cuda else "cpu"

    t0 = time.perf_counter()
    policy = build_policy(args, device, dtype, torch)
    build_s = time.perf_counter() - t0
    rollouts = bt.make_rollouts(argparse.Namespace(seed=args.seed, k=args.k, calls=args.calls, prompt=args.prompt,
                                                   vocab=policy.lm.config.vocab_size))
    config = StepConfig(micro_batch_tokens=args.micro_batch_tokens)
    prep = prepare_step(rollouts, None, config)
    counts = token_counts(prep)
    unique = int(counts["tokens_packed"] - counts["tokens_context_rows"])
    cfg = policy.lm.config
    model = ("Qwen3-0.6B" if not args.smoke else "tiny Qwen3") + \
        f" (L={cfg.num_hidden_layers} d={cfg.hidden_size} {cfg.num_attention_heads}q/{cfg.num_key_value_heads}kv" \
        f"x{cfg.head_dim} V={cfg.vocab_size} tied) {str(dtype)[6:]} random"
    shape = (f"{model}; GRPO group k={args.k} x {args.calls} calls, prompts <= {args.prompt}; "
             f"micro_batch_tokens {args.micro_batch_tokens}")
    print(f"device: {where}; model built in {build_s:.1f} s; {clock.elapsed():.1f} s since start; "
          f"{unique} unique kept tokens, {counts['tokens_packed']:.0f} packed rows in "
          f"{counts['num_microbatches']:.0f} micro-batches", flush=True)

    run = Runner(torch, policy, config, rows, clock, device, args)
    results: dict[str, dict] = {}
    failed = []

    def report(way: str, case: str, steps: list[dict], cost: Cost, extra: dict, note: str):
        ms = statistics.median(s["total_s"] for s in steps) * 1e3
        fwd_bwd = statistics.median(s["fwd_bwd_s"] for s in steps)
        opt = statistics.median(s["optimizer_s"] for s in steps)
        prep_s = statistics.median(s["prepare_s"] for s in steps)
        sec = ms / 1e3
        r = dict(ms=ms, rows=cost.rows, pairs=cost.pairs, largest=cost.largest, tokens_per_s=cost.rows / sec,
                 unique_tokens_per_s=unique / sec, peak_mib=extra.get("peak_mib", float("nan")),
                 fwd_bwd_s=fwd_bwd)
        results[way] = r
        rows.add(op="train_step", case=case, shape=shape, ms=ms, peak_mib=r["peak_mib"], tokens=cost.rows,
                 unique_tokens=unique, tokens_per_s=r["tokens_per_s"], unique_tokens_per_s=r["unique_tokens_per_s"],
                 attention_pairs=cost.pairs, model_tflops=cost.flops / 1e12,
                 achieved_tflops=cost.flops / fwd_bwd / 1e12 if fwd_bwd > 0 else None, repeats=len(steps),
                 note=(f"{cost.rows} rows ({cost.rows / unique:.2f}x the {unique} unique kept tokens), "
                       f"{cost.pairs / 1e9:.3g}G attention pairs, {extra['batches']} micro-batches (the largest "
                       f"{cost.largest} rows); "
                       f"{cost.rows / sec:,.0f} rows/s, {unique / sec:,.0f} unique tokens/s; fwd+bwd {fmt_s(fwd_bwd)} "
                       f"({fmt_flop(cost.flops)} by the cost model: {fmt_flop(cost.flops / max(fwd_bwd, 1e-9), True)}), "
                       f"optimizer {fmt_s(opt)}, host prep {fmt_s(prep_s)}; median of {len(steps)}; {note}"))

    def error_row(case: str, exc: BaseException, *, ours: bool):
        """A way that raised: its row says why. The exit status fails for the tree's own path, and for
        a baseline's error other than running out of memory (a baseline too big is a finding)."""
        traceback.print_exc()  # the whole story to the log; the row gets its first line
        msg = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in msg.lower()
        rows.add(op="train_step", case=case, shape=shape,
                 note=f"{'out of memory' if oom else 'error'}: {type(exc).__name__}: {msg}")
        if ours or not oom:
            failed.append(case)
        run.cleanup()

    def skipped_row(case: str, need: float):
        rows.add(op="train_step", case=case, shape=shape,
                 note=f"skipped: {max(clock.left(), 0):.0f} s of the {args.budget or 0:.0f} s budget left, "
                      f"~{need:.0f} s needed")

    def profiled_step(way: str, step, step_s: float):
        """One more step of the way, after every way's timed ones and outside their median, under the
        profiler (`device_time`): a row of where its device time went, or of why there is none (no
        time left for it, or an error: a diagnostic's, which fails nothing)."""
        case = f"{way}: device time by kernel"
        if clock.left() < 1.2 * step_s:
            skipped_row(case, step_s)
            return
        try:
            run.sync()
            with device_profile(cuda) as prof:
                t0 = time.perf_counter()
                step()
                run.sync()
                wall = time.perf_counter() - t0
            summary = device_breakdown(prof, cuda, wall)
        except Exception as exc:  # noqa: BLE001 - the way's timed rows stand; this one says why it is missing
            traceback.print_exc()
            rows.add(op="train_step", case=case, shape=shape, note=f"error: {type(exc).__name__}: {exc}"[:300])
            run.cleanup()
            return
        rows.add(op="train_step", case=case, shape=shape, busy_s=summary["busy_s"], wall_s=summary["wall_s"],
                 kernels=summary["kernels"][:24], note=summary["note"] + " (one more step, under the profiler)")

    flash, why = flash_available()
    attn_desc = ("flash-attention 2 varlen over position-id-packed samples (first-fit into micro_batch_tokens rows)"
                 if flash else f"SDPA causal, one sample per forward ({why})")

    def flat_data(layout: str):
        t0 = time.perf_counter()
        with (contextlib.nullcontext() if flash else one_sample_per_batch(bt)):
            data = bt.flat_step_data(rollouts, layout, config)
        return data, time.perf_counter() - t0

    # The three layouts' sizes first (host only): a run cut short still reports them.
    tree_cost = step_cost(prep.batches, policy)
    leaf_data, leaf_prep_s = flat_data("leaf")
    leaf_cost = step_cost(leaf_data.batches, policy)
    call_data, call_prep_s = flat_data("call")
    call_cost = step_cost(call_data.batches, policy)
    rows.add(op="train_step", case="layouts (rows, attention pairs, model FLOPs per step)", shape=shape,
             note="; ".join(f"{name}: {c.rows} rows in {n} micro-batches, {c.pairs / 1e9:.3g}G pairs, "
                            f"{fmt_flop(c.flops)}" for name, c, n in
                            (("tree", tree_cost, len(prep.batches)), ("per-leaf", leaf_cost, len(leaf_data.batches)),
                             ("per-call", call_cost, len(call_data.batches))))
             + f"; {unique} unique kept tokens; model built in {build_s:.1f} s, {clock.elapsed():.0f} s since start")

    # The ways' profiled steps (way, step, its seconds): diagnostics, so they run after every way's
    # timed steps, and per-call times a subset of what is left beyond them.
    profiles: list[tuple[str, Callable[[], object], float]] = []

    def profile_need() -> float:
        return sum(1.2 * step_s for _, _, step_s in profiles)

    # ------------------------------------------------------------------------------- (a) tree
    tree_name = {"auto": "Triton tree attention" if cuda else "torch tree attention (CPU fast path)",
                 "triton": "Triton tree attention" + ("" if cuda else " (interpreter)"),
                 "torch": "torch tree attention", "flex": "FlexAttention tree mask",
                 "varlen": "flash-attention varlen over path segments"}[args.tree_attention]
    tree_case = f"tree: packed prefix trees (train_step), {tree_name}"
    try:
        run.cleanup()
        t0 = time.perf_counter()
        run.tree_step(rollouts)  # warm-up: Triton compiles, AdamW state, cuBLAS handles
        warm = time.perf_counter() - t0
        before = run.reset_peak()
        steps = []
        for i in range(args.repeats):
            if i and clock.left() < 1.2 * steps[-1]["total_s"] + 60:  # keep room for the baselines
                break
            steps.append(run.tree_step(rollouts))
        peak = run.peak_mib(before)
        report("tree", tree_case, steps, tree_cost, dict(peak_mib=peak, batches=len(prep.batches)),
               f"warm-up step {warm:.1f} s (compiles); "
               + (f"static (weights, AdamW state) {before / 2**20:,.0f} MiB; " if cuda else "") +
               f"loss {steps[-1]['loss']:.4g}")
        profiles.append(("tree", lambda: run.tree_step(rollouts), steps[-1]["total_s"]))
    except Exception as exc:  # noqa: BLE001 - reported as this way's row; the next way still runs
        error_row(tree_case, exc, ours=True)

    # ---------------------------------------------------------------------------- (b) per-leaf
    def ratio_row(way: str, base_case: str, bar: str, goal: float, ours: str = "tree"):
        if ours not in results or way not in results:
            return
        tree, base = results[ours], results[way]
        row = dict(op="train_step", case=f"{ours} vs {way}", shape=shape, ms=tree["ms"], baseline=base_case,
                   baseline_ms=base["ms"], ratio=tree["ms"] / base["ms"], bar=bar, speedup=base["ms"] / tree["ms"],
                   peak_mib=tree["peak_mib"], baseline_peak_mib=base["peak_mib"])
        if base["peak_mib"] == base["peak_mib"] and base["peak_mib"] > 0:
            row["mem_ratio"] = tree["peak_mib"] / base["peak_mib"]
        row["note"] = (f"tree {base['ms'] / tree['ms']:.2f}x faster (goal >= {goal:g}x); "
                       f"{base['rows'] / tree['rows']:.2f}x the tree's rows, "
                       f"{base['pairs'] / max(tree['pairs'], 1):.2f}x its attention pairs; activations are held for one "
                       f"micro-batch at a time, the largest {tree['largest']} rows in the tree and {base['largest']} in "
                       f"{way}; unique tokens/s "
                       f"{tree['unique_tokens_per_s']:,.0f} vs {base['unique_tokens_per_s']:,.0f}")
        rows.add(**row)

    leaf_case = f"per-leaf: one sample per kept leaf, {attn_desc}"
    leaf_rate = None  # seconds of fwd+bwd per model FLOP on the flat path, for per-call's estimate
    try:
        data, prep_s, cost = leaf_data, leaf_prep_s, leaf_cost
        est = (results["tree"]["fwd_bwd_s"] / tree_cost.flops * cost.flops) if "tree" in results else 0.0
        if clock.left() < est + 20:
            skipped_row(leaf_case, est)
        else:
            with model_attention(policy, flash):
                run.cleanup()
                warm_idx = [min(range(len(data.batches)), key=lambda i: data.batches[i].num_tokens)]
                t0 = time.perf_counter()
                run.flat_step(subset(data, warm_idx), 0.0)  # warm-up on the smallest micro-batch
                warm = time.perf_counter() - t0
                before = run.reset_peak()
                steps = []
                for i in range(args.repeats):
                    if i and clock.left() < 1.2 * steps[-1]["total_s"] + 30:  # keep room for per-call
                        break
                    steps.append(run.flat_step(data, prep_s))
                peak = run.peak_mib(before)
                leaf_rate = statistics.median(s["fwd_bwd_s"] for s in steps) / cost.flops
                report("per-leaf", leaf_case, steps, cost, dict(peak_mib=peak, batches=len(data.batches)),
                       f"warm-up on one micro-batch {warm:.1f} s; loss {steps[-1]['loss']:.4g} (the tree's loss)")
                profiles.append(("per-leaf", lambda: run.flat_step(leaf_data, leaf_prep_s),
                                 steps[-1]["fwd_bwd_s"] + steps[-1]["optimizer_s"]))
            ratio_row("per-leaf", leaf_case, "<= 0.77 (tree >= 1.3x faster)", 1.3)
    except Exception as exc:  # noqa: BLE001
        error_row(leaf_case, exc, ours=False)

    # ------------------------------------------- (c) the tree on flash-attention's varlen kernel
    # The same step with backend "varlen" (`clawfast.kernels.tree_attention_varlen`): each path segment
    # one sequence, its ancestors' keys gathered. One timed step after a warm-up; per-call keeps 15 s.
    varlen_case = "tree (varlen): packed prefix trees (train_step), flash-attention's varlen kernel over path segments"
    if not cuda:
        rows.add(op="train_step", case=varlen_case, shape=shape,
                 note="not run on cpu: backend 'varlen' is flash-attention's CUDA kernel")
    else:
        try:
            # a warm-up and one step, each about per-leaf's (the same attention kernel on fewer rows and
            # pairs, plus the gathers); 15 s stay for per-call, and the profiles' time
            base = results.get("per-leaf", results.get("tree"))
            est = 2.2 * base["ms"] / 1e3 if base else 30.0
            if clock.left() < est + 15 + profile_need():
                skipped_row(varlen_case, est)
            else:
                policy.attention = "varlen"
                run.cleanup()
                t0 = time.perf_counter()
                run.tree_step(rollouts)
                warm = time.perf_counter() - t0
                before = run.reset_peak()
                steps = [run.tree_step(rollouts)]
                peak = run.peak_mib(before)
                gathered = sum(TreeMask(torch.as_tensor(b.kv_end)).path_segments().gathered_rows for b in prep.batches)
                report("tree (varlen)", varlen_case, steps, tree_cost, dict(peak_mib=peak, batches=len(prep.batches)),
                       f"keys gathered per layer {gathered / tree_cost.rows:.2f}x the rows; warm-up step {warm:.1f} s; "
                       f"loss {steps[-1]['loss']:.4g}")
                ratio_row("per-leaf", leaf_case, "<= 0.77 (tree >= 1.3x faster)", 1.3, ours="tree (varlen)")
        except Exception as exc:  # noqa: BLE001
            error_row(varlen_case, exc, ours=True)
        finally:
            policy.attention = args.tree_attention

    # ---------------------------------------------------------------------------- (d) per-call
    call_case = f"per-call: one sample per recorded call, {attn_desc}"
    try:
        data, prep_s, cost = call_data, call_prep_s, call_cost
        rate = leaf_rate or (results["tree"]["fwd_bwd_s"] / tree_cost.flops if "tree" in results else None)
        est = rate * cost.flops if rate else 0.0
        room = clock.left() - 10 - profile_need()
        stride, note = 1, "every call timed"
        if est > room > 0 and len(data.batches) > 1:
            stride = min(len(data.batches), max(2, math.ceil(est / max(room, 1e-3))))
        if stride > 1:
            keep = stratified(data, stride)
            sub = subset(data, keep)
            sub_cost = step_cost(sub.batches, policy)
            scale = cost.flops / sub_cost.flops
            note = (f"timed on {len(keep)} of {len(data.batches)} samples (1 in {stride} by length, and the "
                    f"longest), "
                    f"fwd+bwd scaled x{scale:.2f} (model FLOPs full / subset): the full step was estimated at "
                    f"{est:.0f} s, {clock.left():.0f} s were left")
        else:
            sub, scale = data, 1.0
        if room < 5:
            skipped_row(call_case, est / stride)
        else:
            with model_attention(policy, flash):
                run.cleanup()
                if leaf_rate is None:  # per-leaf did not run: warm up here
                    run.flat_step(subset(data, [min(range(len(data.batches)),
                                                    key=lambda i: data.batches[i].num_tokens)]), 0.0)
                before = run.reset_peak()
                steps = [run.flat_step(sub, prep_s, scale)]
                while (len(steps) < args.repeats
                       and clock.left() > 1.2 * steps[-1]["fwd_bwd_s"] / scale + 5 + profile_need()):
                    steps.append(run.flat_step(sub, prep_s, scale))
                peak = run.peak_mib(before)
            report("per-call", call_case, steps, cost, dict(peak_mib=peak, batches=len(data.batches)),
                   f"{note}; loss {steps[-1]['loss']:.4g} (a different loss: shared tokens count once per call)")
            ratio_row("per-call", call_case, "<= 0.125 (tree >= 8x faster)", 8.0)
    except Exception as exc:  # noqa: BLE001
        error_row(call_case, exc, ours=False)

    # ------------------------------------------------ the diagnostics last: device time by kernel
    for way, step, step_s in profiles:
        run.cleanup()  # after per-call: the tree's step peaks near an H100's memory
        with (model_attention(policy, flash) if way == "per-leaf" else contextlib.nullcontext()):
            profiled_step(way, step, step_s)

    print(f"done in {clock.elapsed():.1f} s" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
