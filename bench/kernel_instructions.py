"""Instructions per score of each loop of the tree-attention kernels, read from their machine code
(SASS) compiled for a GPU on any machine: a GPU-free measure of the per-entry work a kernel change
adds or removes, beside the GPU check's timings.

    python bench/kernel_instructions.py                      # bf16, head dim 128, sm_90
    python bench/kernel_instructions.py --case "float16 d64 g2 plain" --arch 80

What it does: records the variants the public op launches for one grid case of
`clawfast.kernels.aot` (the same recording the compile check uses), compiles each for the target
with Triton, disassembles the cubin with the ``cuobjdump`` Triton ships, and finds each kernel's
innermost loops (a backward branch whose body holds no other backward branch). Each innermost loop
is one step of a walk (`KernelTiles.walk` keys or query rows against the kernel's block), so its
instruction count x the program's threads / (block x walk) is the instructions issued per score
entry, whatever the tile. The kernels walk their full pairs and then their partial pairs
(`BlockSchedule`): the first loop is the full pairs' (no mask), the second the partial pairs'
(masked), the baseline the ratio is taken against. A kernel whose innermost loops are not these two
is an error. Issue-bound loops (the softmax between two tensor-core products) run at most about this
ratio faster; the GPU check's timings say what a GPU makes of it.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the opcodes shown apart: tensor-core products, special-function ops (exp2), and the integer
# compares and selects the mask costs
SHOWN = ("HGMMA", "HMMA", "MUFU", "ISETP", "FSEL", "SEL")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;")
_TARGET = re.compile(r"0x([0-9a-f]+)")


def innermost_loops(text: str) -> list[list[str]]:
    """The opcodes of each innermost loop body, in address order."""
    code = []  # (address, opcode, line)
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            code.append((int(m[1], 16), m[2], line))
    loops = set()
    for address, op, line in code:
        if op == "BRA" and (t := _TARGET.search(line.split("BRA", 1)[1])) and int(t[1], 16) < address:
            loops.add((int(t[1], 16), address))
    inner = [(lo, hi) for lo, hi in loops if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]
    return [[op for a, op, _ in code if lo <= a <= hi] for lo, hi in sorted(inner)]


def measure(case: str, arch: int) -> list[dict]:
    from clawfast.kernels import aot

    kernels, variants, refused = aot.record([arch], f"^tree_attention {case}$")
    if refused or not variants:
        raise SystemExit(f"no Triton variant for tree_attention {case!r}: {refused or 'no grid case matches'} "
                         "(cases look like 'bfloat16 d128 g2 plain', 'float16 d64 g2 window+softcap')")
    rows = []
    for v in sorted(variants, key=lambda v: v.kernel):
        fn = kernels[v.kernel]
        compiled = aot.compile_variant(v, fn)
        constexprs = {fn.arg_names[path[0]]: value for path, value in v.constexprs.items()}
        walk = constexprs.get("BLOCK_K", constexprs.get("BLOCK_Q"))
        scores = constexprs["BLOCK"] * walk
        threads = 32 * v.options["num_warps"]
        loops = innermost_loops(aot.cuobjdump(compiled.asm["cubin"], "-sass"))
        if len(loops) != 2:
            raise RuntimeError(f"{v.kernel}: {len(loops)} innermost loops, expected 2 (full pairs, partial pairs)")
        name = v.kernel.rsplit(".", 1)[1]
        for part, body in zip(("full pairs", "partial pairs"), loops):
            counts = collections.Counter(body)
            rows.append(dict(kernel=name, tile=f"{constexprs['BLOCK']}x{walk} w{v.options['num_warps']}", part=part,
                             per_step=len(body), per_score=len(body) * threads / scores,
                             shown={op: counts[op] * threads / scores for op in SHOWN if counts[op]}))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="bfloat16 d128 g2 plain",
                    help="the tree_attention grid case of clawfast.kernels.aot, after 'tree_attention '")
    ap.add_argument("--arch", type=int, default=90, help="compute capability (default 90)")
    args = ap.parse_args(argv)
    import triton

    rows = measure(args.case, args.arch)
    print(f"tree_attention {args.case}, sm_{args.arch}, triton {triton.__version__}: SASS instructions of each "
          f"walk step (innermost loop), and per score entry (x threads / (block x walk))\n")
    print("| kernel | tile | pairs | per step | per score | of which " + ", ".join(SHOWN) + " | vs partial |")
    print("| --- | --- | --- | ---: | ---: | --- | ---: |")
    for row in rows:
        partial = next(r for r in rows if r["kernel"] == row["kernel"] and r["part"] == "partial pairs")
        shown = ", ".join(f"{op} {x:.2f}" for op, x in row["shown"].items())
        print(f"| {row['kernel']} | {row['tile']} | {row['part']} | {row['per_step']} | {row['per_score']:.1f} | "
              f"{shown} | {row['per_score'] / partial['per_score']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
