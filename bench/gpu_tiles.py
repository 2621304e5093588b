"""Tree attention's launch tiles timed on the GPU: each Triton kernel alone (forward, dQ, dK / dV) at
every tile of a small grid, against the tile its table holds now, each case streamed through
bench/rows.py the moment it finishes. One GPU run says which tile to keep and which kernel holds
the gap to a flash kernel, where the CPU can only count instructions (bench/kernel_instructions.py).

    python bench/gpu_tiles.py --rows ROWS.jsonl           # CUDA, bf16, head dim 128 (~60 s on an H200)
    python bench/gpu_tiles.py --smoke --rows ROWS.jsonl   # tiny sizes; CPU + TRITON_INTERPRET=1 without a GPU
    python bench/gpu_tiles.py --compile-only 90           # any machine: what each candidate costs on sm_90

Inputs: bench/gpu_kernels.py's attention case (an agent-shaped forest of 16K rows, 32 query / 8
key-value heads, head dim 128, bf16) and one causal chain of as many rows. Candidates (`candidates`):
every `KernelTiles` with a block of 64 or 128 rows, a walk of 16 to 128 rows (at most the block), 4 or
8 warps, 2 or 3 pipeline stages. Each case launches one kernel; dQ and dK / dV read the log-sum-exp
of a forward run once at its table's tile. Before anything runs on the GPU, every candidate's launch
is recorded (on a small CPU copy of the inputs: the row count is not specialised) and compiled for
the device's target in parallel (`clawfast.kernels.aot`: the specialisation the JIT compiles, so its
cache then holds them); one that spills registers, needs more shared memory than the target has or
repeats tensor-core work (`aot.dot_replication`) is a row saying so and is not timed (the table's
own tile always is). With too little of ``--budget`` left for that compile, only the table tiles are
timed. Then, kernel by kernel and tile by tile (the table's first), each remaining candidate is
timed on both layouts (CUDA events, the median of ``--repeats`` after one warm-up call, whose time,
``warmup_ms``, says whether the JIT found the kernel in its cache): ``baseline_ms`` is the table
tile's time and ``ratio`` = candidate / table (below 1: the candidate is faster). A last row per
kernel names its fastest tile on the agent forest (among those timed on both layouts) and, where
that is not the table's, the table entry that would keep it. The note gives the
registers and TFLOP/s over the visible (query, key) pairs, counting the products each kernel runs:
the forward's two per pair, dQ's three and dK / dV's four (both recompute the scores; 9 in all,
where bench/gpu_kernels.py's forward+backward figures count flash attention's 7). A case that no
longer fits ``--budget`` is a row saying it was skipped.

``--smoke`` runs the same cases tiny under Triton's interpreter (interpreter-sized candidates, no
compile step: the interpreter compiles nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time
import traceback
from pathlib import Path

T_START = time.monotonic()
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: rows.py, gpu_kernels_*.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KERNELS = ("fwd", "dq", "dkdv")
# products per visible (query, key) pair and query head, 2 x head dim FLOPs each
PRODUCTS = {"fwd": 2, "dq": 3, "dkdv": 4}
COMPILE_S = 25  # seconds the candidates' compile needs on a 16-core GPU machine (~126 CPU-seconds)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; CPU + TRITON_INTERPRET=1 if no GPU")
    ap.add_argument("--rows", type=Path, default=None, help="JSON lines, one per finished case (bench/rows.py)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds from the script's start; a case that no longer fits is reported as skipped "
                         "(default 60 on a GPU, none in smoke)")
    ap.add_argument("--tokens", type=int, default=16384, help="rows of the forest and of the chain")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                    help="processes compiling the candidates (default: the CPUs this process may use)")
    ap.add_argument("--tiles", nargs="+", type=_tile, default=None, metavar="BLOCK,WALK,WARPS,STAGES",
                    help="the candidates (default: the grid above)")
    ap.add_argument("--compile-only", type=int, default=None, metavar="ARCH",
                    help="no GPU needed: compile the candidates for sm_ARCH (80, 90) and print what each uses")
    args = ap.parse_args(argv)
    if args.budget is None and not args.smoke:
        args.budget = 60.0
    return args


def _tile(text: str) -> tuple[int, int, int, int]:
    """(block, walk, warps, stages) from "B,W,WARPS,STAGES" (a tuple: Triton is not imported before
    main has chosen compiled or interpreted kernels)."""
    try:
        block, walk, warps, stages = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BLOCK,WALK,WARPS,STAGES (four integers), got {text!r}") from None
    if walk < 1 or block % walk or warps < 1 or stages < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the walk must divide the block; warps and stages >= 1")
    return block, walk, warps, stages


def candidates(smoke: bool) -> list[tuple[int, int, int, int]]:
    """The tiles tried for every kernel: (block, walk, warps, stages), walk dividing block."""
    if smoke:  # what the interpreter runs in seconds
        return [(16, 8, 1, 1), (32, 16, 1, 1)]
    return [t for t in itertools.product((64, 128), (16, 32, 64, 128), (4, 8), (2, 3)) if t[1] <= t[0]]


def label(kernel: str, tile) -> str:
    return f"{kernel} {tile.block}x{tile.walk} w{tile.warps} s{tile.stages}"


class Layout:
    """One packed batch's attention inputs and the gradients of its output (the backward's inputs)."""

    def __init__(self, K, torch, name: str, kv_end, hq: int, hkv: int, d: int, dtype, device, gen):
        from clawfast.kernels.tree_attention_schedule import Scores

        self.name, self.n = name, kv_end.shape[0]
        self.mask = K.TreeMask(kv_end.to(device))
        self.rule = Scores(scale=d ** -0.5)
        self.q, self.k, self.v, self.dout = (torch.randn(self.n, h, d, generator=gen, device=device).to(dtype)
                                             for h in (hq, hkv, hkv, hq))
        self.lse = self.delta = None
        self.pairs = self.mask.visible_pairs()
        self.shape = f"{name}, N={self.n} Hq={hq} Hkv={hkv} D={d} {str(dtype)[6:]}"

    def run(self, T, kernel: str, tiles):
        """A thunk launching one kernel with ``tiles`` (the backward ones on the table's forward)."""
        args = (self.q, self.k, self.v)
        if kernel == "fwd":
            return lambda: T.forward_triton(*args, None, self.mask, self.rule, tiles)
        fn = T.dq_triton if kernel == "dq" else T.dkdv_triton
        return lambda: fn(*args, self.lse, self.delta, self.dout, self.mask, self.rule, tiles)

    def prepare_backward(self, T, tiles) -> None:
        """The backward kernels' inputs: the log-sum-exp and rowsum(dO * O) of a forward at ``tiles``."""
        out, self.lse = T.forward_triton(self.q, self.k, self.v, None, self.mask, self.rule, tiles)
        self.delta = (self.dout.to(self.lse.dtype) * out.to(self.lse.dtype)).sum(-1).t().contiguous()


def with_tile(table, kernel: str, tile):
    return dataclasses.replace(table, **{kernel: tile})


def compile_candidates(T, layout: Layout, table, tiles: list, arch: int, jobs: int) -> dict:
    """{label: aot.Result} of every candidate's launch on ``layout`` (CPU tensors: nothing runs, the
    launches are recorded), compiled for sm_``arch`` in ``jobs`` forked processes, which never touch
    the GPU."""
    from clawfast.kernels import aot

    kernels = aot.discover()
    recorder = aot.Recorder(kernels, [arch])
    # the backward kernels' inputs as a forward would leave them (float32 [Hq, N]), its launch unrecorded
    layout.lse = layout.q.new_zeros(layout.q.shape[1], layout.n).float()
    layout.delta = layout.lse.clone()
    with recorder.active(arch):
        for kernel in KERNELS:
            for tile in tiles:
                recorder.case = label(kernel, tile)
                layout.run(T, kernel, with_tile(table, kernel, tile))()
    results = aot.check(list(recorder.variants.values()), kernels, jobs)
    return {case: r for r in results for case in r.calls}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: interpreted kernels
    import torch

    import clawfast.kernels as K
    from clawfast.kernels import tree_attention_triton as T
    from clawfast.kernels._common import target_arch
    from gpu_forests import agent_parent, subtree_ends
    from gpu_kernels_timing import Bench, Cases, describe
    from rows import Rows

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke and not args.compile_only:
        print("no CUDA device: run with --smoke (TRITON_INTERPRET=1 on the CPU) or --compile-only ARCH")
        return 2
    if args.compile_only and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("--compile-only compiles for a GPU: run it without TRITON_INTERPRET")
        return 2
    rows = Rows(args.rows)
    n, hq, hkv, d, dtype = ((args.tokens, 32, 8, 128, torch.bfloat16) if not args.smoke
                            else (96, 4, 2, 16, torch.float32))
    tiles = [T.KernelTiles(*t) for t in (args.tiles or candidates(args.smoke))]
    arch = args.compile_only or (target_arch(torch.device("cuda")) if cuda else 0)
    table = T.triton_tiles(dtype, d, arch)
    cases = Cases(torch, rows, args.budget, cuda, T_START)

    def agent_forest(rows: int):
        parent = agent_parent(torch, rows, torch.Generator().manual_seed(rows)).tolist()
        return torch.tensor(subtree_ends(parent), dtype=torch.int32)

    compiled = {}
    if arch and not args.compile_only and cases.left() < COMPILE_S:
        print(f"{max(cases.left(), 0):.0f} s of the budget left, under the ~{COMPILE_S} s the candidates' "
              "compile needs: only the table tiles are timed", flush=True)
        tiles = []
    elif arch:
        host = Layout(K, torch, "agent forest", agent_forest(min(n, 256)), hq, hkv, d, dtype, torch.device("cpu"),
                      torch.Generator())
        start = time.monotonic()
        compiled = compile_candidates(T, host, table, tiles, arch, args.jobs)
        print(f"compiled {len(compiled)} launches for sm_{arch} in {time.monotonic() - start:.0f} s "
              f"({args.jobs} processes)", flush=True)
    if args.compile_only:
        for case, r in sorted(compiled.items()):
            rows.add(op="tree_attention tiles", case=case, shape=f"sm_{arch}, {host.shape}",
                     note=f"{r.registers} registers, {r.spill_bytes} B spilled, {r.shared_bytes} B shared; "
                          + ("; ".join(r.problems + r.replicated) or "ok"))
        return 0

    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    bench = Bench(torch, device, 1, args.repeats if not args.smoke else 1)
    forest = agent_forest(n)
    layouts = [Layout(K, torch, name, kv_end, hq, hkv, d, dtype, device, gen)
               for name, kv_end in (("agent forest", forest), ("causal chain", torch.full_like(forest, len(forest) - 1)))]
    for layout in layouts:
        layout.prepare_backward(T, table)
    for kernel in KERNELS:
        current = getattr(table, kernel)
        base_ms = {}
        timed: dict = {}  # tile -> {layout name: ms}
        for tile in [current] + [t for t in tiles if t != current]:
            result = compiled.get(label(kernel, tile))
            case = label(kernel, tile) + (" (table)" if tile == current else "")
            if result is not None and (result.problems or result.replicated) and tile != current:
                # the compile does not depend on the layout: one row for both
                rows.add(op="tree_attention tiles", case=case, shape=" / ".join(x.shape for x in layouts),
                         note=f"not timed: {'; '.join(result.problems + result.replicated)}")
                continue
            for layout in layouts:
                row = dict(op="tree_attention tiles", case=case, shape=layout.shape,
                           baseline=f"table tile {label(kernel, current)}")
                if not cases.fits("tile", **row):
                    continue
                try:
                    timing = bench.measure(layout.run(T, kernel, with_tile(table, kernel, tile)))
                except Exception as exc:  # noqa: BLE001 - a tile that fails to launch is a finding
                    if tile == current:
                        cases.error(exc, ours=True, **row)
                    else:
                        traceback.print_exc()
                        rows.add(**row, note=f"candidate failed: {describe(exc)}")
                        cases.free()
                    continue
                if tile == current:
                    base_ms[layout.name] = timing.ms
                timed.setdefault(tile, {})[layout.name] = timing.ms
                base = base_ms.get(layout.name)
                flops = PRODUCTS[kernel] * 2 * d * hq * layout.pairs
                regs = "" if result is None else f"; {result.registers} registers" + "".join(
                    f"; {r}" for r in result.replicated)
                rows.add(**row, ms=timing.ms, warmup_ms=timing.first_ms, baseline_ms=base,
                         ratio=timing.ms / base if base else None, note=f"{flops / timing.ms / 1e9:.3g} TFLOP/s{regs}")
        verdict(rows, kernel, current, timed, [x.name for x in layouts], arch, T._gpu_tiles_key(dtype, d))
    return 1 if cases.failures else 0


KEEP_BELOW = 0.95  # a tile replaces the table's when it takes less than this fraction of its time: repeats vary ~2%


def verdict(rows, kernel: str, current, timed: dict, layouts: list[str], arch: int, key: tuple[int, int]) -> None:
    """The kernel's fastest tile on the first layout (the agent forest: what training runs) among those
    timed on every layout, against its table's tile, and whether to write it into the table."""
    complete = {tile: ms for tile, ms in timed.items() if set(ms) == set(layouts)}
    if current not in complete:
        return  # the table's tile did not run on every layout: nothing to compare against
    best = min(complete, key=lambda tile: complete[tile][layouts[0]])
    ratio = complete[best][layouts[0]] / complete[current][layouts[0]]
    ratios = ", ".join(f"{complete[best][name] / complete[current][name]:.2f}x on the {name}" for name in layouts)
    table = "_SM90_TILES" if arch >= 90 else "_SM80_TILES" if arch else None  # None: the interpreter's tiles
    if best == current:
        advice = "the table's tile is the fastest"
    elif ratio >= KEEP_BELOW:
        advice = f"within {1 - KEEP_BELOW:.0%} of the table's tile: keep the table"
    elif table is None:
        advice = "the interpreter's tiles are not a table"
    else:
        advice = (f"to keep it: in {table}, entry {key}, the {kernel} tile ({best.block}, {best.walk}, {best.warps}, "
                  f"{best.stages}), then `python -m clawfast.kernels.aot` with both Tritons")
    rows.add(op="tree_attention tiles", case=f"{kernel}: fastest tile", shape=", ".join(layouts),
             ms=complete[best][layouts[0]], baseline=f"table tile {label(kernel, current)}",
             baseline_ms=complete[current][layouts[0]], ratio=ratio,
             note=f"{label(kernel, best)} of {len(complete)} tiles timed on both; its time against the table "
                  f"tile's: {ratios}; {advice}")

if __name__ == "__main__":
    sys.exit(main())
