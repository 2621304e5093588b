"""Ahead-of-time compilation of every Triton kernel variant the public API launches, for NVIDIA GPU
targets, on any machine: no GPU is needed. ``python -m clawfast.kernels.aot --help``.

Triton's interpreter (``TRITON_INTERPRET=1``, how the kernel tests run on a CPU) checks arithmetic,
not compilation: it never type-checks a kernel, allocates shared memory or assigns registers. This
module compiles what a GPU would compile: ``triton.compile(ASTSource(...), target=GPUTarget(...))``
runs the whole pipeline (TTIR, TTGIR, LLVM IR, PTX, and ptxas to a cubin) for a target architecture
without a device.

Which variants (`record`): the public ops are called on CPU tensors (`GRID`: dtypes, head dims,
every option flag, GQA, both target layouts of the log-probs, ...) with every Triton launch
intercepted. A launch is not executed (``torch.empty`` reads as zeros meanwhile, so the host code
between launches runs on defined values); its arguments are specialised by Triton's own binder for
the target, exactly as the JIT does at a real launch (argument types, constexprs, integer and
alignment specialisation, options such as ``num_warps``), and each distinct specialisation is one
variant. An autotuned kernel contributes every config its pruning keeps: on a GPU the autotuner
compiles them all. The launchers choose their tiles by whether Triton interprets and by the
target's compute capability (`_common.target_arch`), never by the tensors' device: the grid runs
once per target with that capability substituted, so without ``TRITON_INTERPRET`` the recorded
variants are each GPU's.

Checks of each (variant, target) (`check`): it compiles to a cubin; its shared memory fits the
target's per-block limit (`TARGETS`); it spills no registers (local memory, from the cubin's
resource usage). Reported beside them: the tensor-core work its warps repeat (`dot_replication`,
from the TTGIR: a dot whose tile is smaller than the area its warps' layout covers is computed once
per covering; e.g. a 64-row tile on 8 warps, which Triton stacks along the rows for a dot feeding
another dot, runs every product and the softmax after it twice). A tile that must choose between
repeating work and spilling registers keeps the former, so this is a figure, not a failure.
Coverage (`coverage`): every ``@triton.jit`` function of the package is launched by the grid or
called from a launched kernel, so a kernel nobody added to the grid fails the run the day it is
written.

The grid crosses dtypes, head dims, GQA, every combination of tree attention's options, tile
configs and targets.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import itertools
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

import torch

# Per-block shared memory limits (bytes, the opt-in maximum: cudaDevAttrMaxSharedMemoryPerBlockOptin)
# of the targets checked by default: A100 (sm_80) and H100 / H200 (sm_90).
TARGETS = {80: 166912, 90: 232448}
PACKAGE = (__spec__.name if __spec__ else __name__).rsplit(".", 1)[0]  # also when run as __main__


# ---------------------------------------------------------------------------------------- discovery


def _modules():
    package = importlib.import_module(PACKAGE)
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name != "aot")
    return [importlib.import_module(f"{PACKAGE}.{name}") for name in names]


def _jit_function(obj):
    """The JITFunction behind ``obj`` (itself, or an autotune / heuristics wrapper), else None."""
    from triton.runtime.jit import JITFunction

    while obj is not None and not isinstance(obj, JITFunction):
        obj = getattr(obj, "fn", None) if hasattr(obj, "arg_names") else None
    return obj


def discover() -> dict[str, object]:
    """Every ``@triton.jit`` function of the package, by qualified name (module.function)."""
    found = {}
    for module in _modules():
        for value in vars(module).values():
            fn = _jit_function(value)
            if fn is not None and fn.fn.__module__ == module.__name__:
                found[f"{module.__name__.rsplit('.', 1)[1]}.{fn.fn.__name__}"] = fn
    return found


def _callees(fn) -> set:
    """The JIT functions a JIT function's body names (its module globals), transitively."""
    from triton.runtime.jit import JITFunction

    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        for node in ast.walk(ast.parse(f.src)):
            if isinstance(node, ast.Name):
                g = f.fn.__globals__.get(node.id)
                if isinstance(g, JITFunction) and g is not f and g not in seen:
                    seen.add(g)
                    todo.append(g)
    return seen


def coverage(kernels: dict[str, object], launched: set[str]) -> list[str]:
    """The JIT functions neither launched by the grid nor called from a launched kernel."""
    reached = set()
    for name in launched:
        reached.add(kernels[name])
        reached |= _callees(kernels[name])
    return sorted(name for name, fn in kernels.items() if fn not in reached)


# ---------------------------------------------------------------------------------------- recording


@dataclass
class Variant:
    """One specialisation of one kernel for one target, as a launch would compile it."""

    kernel: str
    arch: int
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    calls: list[str] = field(default_factory=list)  # the grid cases that launch it

    @property
    def key(self) -> str:
        return json.dumps([self.kernel, self.arch, self.signature, sorted(map(str, self.constexprs.items())),
                           sorted(map(str, self.attrs.items())), self.options], sort_keys=True, default=str)

    def describe(self, fn) -> str:
        """Pointer dtypes, constexprs and integers specialised by value, and the launch options."""
        names = fn.arg_names
        parts = []
        dtypes = []
        for name, ty in self.signature.items():
            if ty.startswith("*") and ty[1:] not in dtypes:
                dtypes.append(ty[1:])
        parts.append("/".join(dtypes))
        for path, value in sorted(self.constexprs.items()):
            name = names[path[0]]
            if fn.params[path[0]].is_constexpr:
                if value is True:
                    parts.append(name)
                elif value is not False and value is not None:
                    parts.append(f"{name}={value}")
            else:  # an integer argument Triton specialised to a constant (== 1)
                parts.append(f"{name}=={value}")
        div16 = [names[path[0]] for path, attr in sorted(self.attrs.items())
                 if attr and not self.signature[names[path[0]]].startswith("*")]
        if div16:
            parts.append("16|" + ",".join(div16))
        parts.append(f"w{self.options['num_warps']}s{self.options['num_stages']}")
        return " ".join(parts)


class Refused(Exception):
    """A grid case whose inputs the op's Triton kernels do not take (the op says why)."""


class Recorder:
    """Intercepts Triton launches (JITFunction.run, Autotuner.run) and turns each into variants of
    the target it records for (``arch``: the launchers choose their tiles by it, `_common.target_arch`)."""

    def __init__(self, kernels: dict[str, object], archs: list[int]):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime import jit

        # Triton's own launch-time binder (what JITFunction.run calls; checked with 3.6 and 3.9)
        if not (hasattr(jit, "create_function_from_signature") and hasattr(jit.JITFunction, "_pack_args")):
            raise RuntimeError(f"triton {triton.__version__} lacks the JIT binder this module specialises launches "
                               "with (triton.runtime.jit.create_function_from_signature, JITFunction._pack_args)")

        self.names = {fn: name for name, fn in kernels.items()}
        self.backends = {arch: make_backend(GPUTarget("cuda", arch, 32)) for arch in archs}
        self._binders = {}
        self._bind = jit.create_function_from_signature
        self.variants: dict[str, Variant] = {}
        self.case = ""
        self.arch = archs[0]

    def launch(self, fn, args, kwargs) -> None:
        """Record the launch ``fn[grid](*args, **kwargs)`` (kwargs: constexprs and options)."""
        arch, backend = self.arch, self.backends[self.arch]
        key = (fn, arch)
        if key not in self._binders:
            self._binders[key] = self._bind(fn.signature, fn.params, backend)
        bound, specialization, options = self._binders[key](*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        variant = Variant(self.names[fn], arch, signature, constexprs, attrs,
                          {"num_warps": options.num_warps, "num_stages": options.num_stages,
                           "num_ctas": options.num_ctas, "maxnreg": options.maxnreg})
        variant = self.variants.setdefault(variant.key, variant)
        if self.case not in variant.calls:
            variant.calls.append(self.case)

    def autotuned(self, tuner, args, kwargs) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}  # Autotuner.run gets them too
        tuner.nargs = dict(zip(tuner.arg_names, args))
        for config in tuner.prune_configs(kwargs):
            self.launch(tuner.fn, args, {**kwargs, **config.all_kwargs()})
        tuner.nargs = None

    @contextlib.contextmanager
    def active(self, arch: int):
        """Launches recorded for target ``arch`` instead of run; ``torch.empty`` zero-filled; the public
        ops' device check (Triton needs CUDA tensors) lifted, since nothing runs, and their target
        (`_common.target_arch`) is ``arch``."""
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        common = importlib.import_module(f"{PACKAGE}._common")
        real = (JITFunction.run, Autotuner.run, torch.empty, torch.empty_like)
        picks = [(m, m.pick_backend) for m in _modules() if getattr(m, "pick_backend", None) is common.pick_backend]
        targets = [m for m in _modules() if getattr(m, "target_arch", None) is common.target_arch]
        self.arch = arch

        def pick_triton(backend, *tensors, triton_refuses=None, **kw):
            if triton_refuses is not None:  # the public op would not launch Triton here
                raise Refused(triton_refuses)
            return "triton"

        JITFunction.run = lambda fn, *a, grid, warmup, **kw: self.launch(fn, a, kw)
        Autotuner.run = lambda tuner, *a, **kw: self.autotuned(tuner, a, kw)
        torch.empty = lambda *a, **k: real[2](*a, **k).zero_()
        torch.empty_like = lambda *a, **k: real[3](*a, **k).zero_()
        for module, _ in picks:
            module.pick_backend = pick_triton
        for module in targets:
            module.target_arch = lambda device: arch
        try:
            yield self
        finally:
            JITFunction.run, Autotuner.run, torch.empty, torch.empty_like = real
            for module, pick in picks:
                module.pick_backend = pick
            for module in targets:
                module.target_arch = common.target_arch


# ---------------------------------------------------------------------------------------- the grid
#
# Shapes are small (nothing runs) but every integer argument falls in the value classes real
# workloads hit, since Triton specialises integers by value (== 1, divisible by 16): rows N not a
# multiple of 16, GQA groups of 1 and 2, one and several targets per row, a second log-prob chunk.

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128, 256)
ATTENTION_OPTIONS = ("window", "softcap", "sinks", "dropout")


def _attention_option_sets() -> list[tuple[str, ...]]:
    """Every combination of the options (each is a constexpr of the kernels)."""
    return [c for r in range(len(ATTENTION_OPTIONS) + 1) for c in itertools.combinations(ATTENTION_OPTIONS, r)]


def _attention(dtype, head_dim, group, options, rows=200):
    from clawfast.kernels import tree_attention

    hkv = 2
    q = torch.zeros(rows, hkv * group, head_dim, dtype=dtype, requires_grad=True)
    k = torch.zeros(rows, hkv, head_dim, dtype=dtype, requires_grad=True)
    v = torch.zeros(rows, hkv, head_dim, dtype=dtype, requires_grad=True)
    kv_end = torch.full((rows,), rows - 1, dtype=torch.int32)  # one path: the window hides keys
    kw = {}
    if "window" in options:
        kw["window"] = 64
    if "softcap" in options:
        kw["softcap"] = 30.0
    if "sinks" in options:
        kw["sinks"] = torch.zeros(hkv * group, dtype=dtype, requires_grad=True)
    if "dropout" in options:
        kw.update(dropout_p=0.1, seed=1)
    tree_attention(q, k, v, kv_end, backend="triton", **kw).sum().backward()


def _logprobs(dtype, vocab, entropy, flat):
    from clawfast.kernels import linear_logprobs, tree_logprobs

    rows, d = 70, 256
    hidden = torch.zeros(rows, d, dtype=dtype, requires_grad=True)
    weight = torch.zeros(vocab, d, dtype=dtype, requires_grad=True)
    if flat:  # one target per row (max_targets == 1)
        lp, ent = linear_logprobs(hidden, weight, torch.zeros(rows, dtype=torch.long), backend="triton", chunk_rows=40)
    else:  # a branch row predicts several tokens
        target_rows = torch.arange(rows).repeat_interleave(2)
        lp, ent = tree_logprobs(hidden, weight, target_rows, torch.zeros_like(target_rows), backend="triton",
                                chunk_rows=40)
    (lp.sum() + (ent.sum() if entropy else 0)).backward()


def _gae(dtype, mode):
    from clawfast.kernels import tree_gae

    parent = torch.arange(-1, 199)
    parent[100] = 50
    tree_gae(torch.zeros(200, dtype=dtype), torch.zeros(200, dtype=dtype), parent, mode=mode, backend="triton")


def _subtree_scan(dtype):
    from clawfast.kernels import subtree_scan

    subtree_scan(torch.zeros(200, dtype=dtype), torch.arange(-1, 199), torch.zeros(200, dtype=dtype),
                 backend="triton")


def _importance(dtype, level, mode):
    from clawfast.kernels import ISConfig, TreePaths, importance_weights

    m = 200
    paths = TreePaths.from_sequences(torch.arange(m) // 50) if level == "sequence" else None
    importance_weights(torch.zeros(m, dtype=dtype), torch.zeros(m, dtype=dtype),
                       config=ISConfig(level=level, mode=mode), paths=paths, backend="triton")


def _policy_loss(dtype, dual_clip, ref):
    from clawfast.kernels import policy_loss

    m = 200
    lp = torch.zeros(m, dtype=dtype, requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(m, dtype=dtype), torch.zeros(m, dtype=dtype), dual_clip=dual_clip,
                          ref_logprobs=torch.zeros(m, dtype=dtype) if ref else None,
                          kl_coef=0.1 if ref else 0.0, backend="triton")
    loss.backward()


def grid():
    """(case name, thunk) for every public-op configuration whose launches make up the variants."""
    for dtype, head_dim, group, options in itertools.product(FLOATS, HEAD_DIMS, (1, 2), _attention_option_sets()):
        if group == 1 and options:
            continue  # the group is not specialised (one variant for every G): G == 1 once is enough
        name = f"tree_attention {str(dtype)[6:]} d{head_dim} g{group} {'+'.join(options) or 'plain'}"
        yield name, (lambda a=(dtype, head_dim, group, options): _attention(*a))
    for dtype, vocab, entropy, flat in itertools.product(FLOATS, (4096, 4095), (False, True), (False, True)):
        name = f"{'linear' if flat else 'tree'}_logprobs {str(dtype)[6:]} V{vocab}{' +entropy' if entropy else ''}"
        yield name, (lambda a=(dtype, vocab, entropy, flat): _logprobs(*a))
    for dtype, mode in itertools.product((torch.float32, torch.float64), ("path", "tree")):
        yield f"tree_gae {str(dtype)[6:]} {mode}", (lambda a=(dtype, mode): _gae(*a))
    for dtype in (*FLOATS, torch.float64):
        yield f"subtree_scan {str(dtype)[6:]}", (lambda d=dtype: _subtree_scan(d))
    for dtype, level, mode in itertools.product((*FLOATS, torch.float64), ("token", "sequence"), ("truncate", "mask")):
        yield f"importance_weights {str(dtype)[6:]} {level} {mode}", (lambda a=(dtype, level, mode): _importance(*a))
    for dtype, dual, ref in itertools.product((*FLOATS, torch.float64), (None, 3.0), (False, True)):
        name = f"policy_loss {str(dtype)[6:]}{' +dual' if dual else ''}{' +ref' if ref else ''}"
        yield name, (lambda a=(dtype, dual, ref): _policy_loss(*a))


def record(archs: list[int], only: str | None = None):
    """(kernels, variants, refused): every variant the grid's cases launch (those matching the regex
    ``only``), per target, and the cases the public ops refuse to run on Triton, with the reason."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreted functions; run without it")
    kernels = discover()
    recorder = Recorder(kernels, archs)
    refused = {}
    for arch in archs:  # one pass per target: the launchers' tiles may differ between them
        with recorder.active(arch):
            for name, thunk in grid():
                if only is not None and not re.search(only, name):
                    continue
                recorder.case = name
                try:
                    thunk()
                except Refused as e:
                    refused[name] = str(e)
    return kernels, list(recorder.variants.values()), refused


# ---------------------------------------------------------------------------------------- compiling


@dataclass
class Result:
    kernel: str
    variant: str
    arch: int
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    replicated: list[str] = field(default_factory=list)
    rounded: list[str] = field(default_factory=list)  # `rounded_arguments`
    seconds: float = 0.0
    error: str | None = None
    calls: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        out = []
        if self.error:
            out.append(f"does not compile: {self.error}")
        if self.shared_bytes is not None and self.shared_bytes > TARGETS.get(self.arch, 1 << 62):
            out.append(f"{self.shared_bytes} B of shared memory > the {TARGETS[self.arch]} B of sm_{self.arch}")
        if self.spill_bytes:
            out.append(f"spills {self.spill_bytes} B of registers to local memory")
        if self.rounded:
            out.append(f"float32 argument(s) {', '.join(self.rounded)} beside float64 data: Triton passes a Python "
                       "float as float32 (read such values from a float64 tensor)")
        return out


def rounded_arguments(signature: dict) -> list[str]:
    """The float32 scalar arguments of a variant that reads or writes float64 data. Triton passes a
    Python float as float32, so float64 arithmetic would use a rounded value (a clip of 0.2 as
    0.20000000298) where the torch path and the reference use the double; the interpreter of some
    releases (3.9) keeps the double, so only the compiled kernel differs."""
    if not any(ty == "*fp64" for ty in signature.values()):
        return []
    return [name for name, ty in signature.items() if ty == "fp32"]


_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def cuobjdump(cubin: bytes, *flags: str) -> str:
    """The output of the ``cuobjdump`` Triton ships, run with ``flags`` on ``cubin``."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def _resources(cubin: bytes) -> tuple[int, int, int]:
    """(registers, local-memory bytes per thread, static shared bytes) from ``cuobjdump``."""
    out = cuobjdump(cubin, "--dump-resource-usage")
    match = _RESOURCES.search(out)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {out[:500]}")
    reg, stack, shared, local = map(int, match.groups())
    return reg, stack + local, shared


# A tensor-core (MMA) layout, `#mma = #ttg.nvidia_mma<{versionMajor = 3, ..., warpsPerCTA = [8, 1], ...,
# instrShape = [16, 32, 16]}>`, and a dot's result type, `-> tensor<64x64xf32, #mma>`.
_MMA_LAYOUT = re.compile(r"^#(mma\d*) = #ttg\.nvidia_mma<\{[^}]*?warpsPerCTA = \[([\d, ]+)\][^}]*?"
                         r"instrShape = \[([\d, ]+)\]", re.M)
_DOT_RESULT = re.compile(r"= (?:tt\.dot|ttng\.warp_group_dot) .*-> tensor<(\d+)x(\d+)x\w+, #(mma\d*)>")


def dot_replication(ttgir: str) -> list[str]:
    """The dots whose [M, N] tile is smaller than the area their MMA layout's warps cover (each warp
    16 rows by the instruction's N, ``warpsPerCTA`` of them): the layout wraps around the tile, so
    the warps past it compute the same products again, as does every elementwise op on the result."""
    layouts = {m[1]: ([int(x) for x in m[2].split(",")], [int(x) for x in m[3].split(",")])
               for m in _MMA_LAYOUT.finditer(ttgir)}
    found = set()
    for m in _DOT_RESULT.finditer(ttgir):
        rows, cols, (warps, instr) = int(m[1]), int(m[2]), layouts[m[3]]
        cover = (warps[0] * 16, warps[1] * instr[1])
        factor = max(1, cover[0] // rows) * max(1, cover[1] // cols)
        if factor > 1:
            found.add(f"a {rows}x{cols} dot on {warps[0]}x{warps[1]} warps covering {cover[0]}x{cover[1]} "
                      f"runs {factor}x")
    return sorted(found)


_WORK: list[tuple[Variant, object]] = []


def compile_variant(variant: Variant, fn):
    """``fn`` compiled for ``variant``'s target: Triton's CompiledKernel, whose ``asm`` holds each stage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn, variant.signature, variant.constexprs, variant.attrs)
    options = {k: v for k, v in variant.options.items() if v is not None}
    return triton.compile(src, target=GPUTarget("cuda", variant.arch, 32), options=options)


def _compile(index: int) -> Result:
    variant, fn = _WORK[index]
    result = Result(variant.kernel, variant.describe(fn), variant.arch, calls=variant.calls[:3],
                    rounded=rounded_arguments(variant.signature))
    start = time.perf_counter()
    try:
        compiled = compile_variant(variant, fn)
        result.registers, result.spill_bytes, static_shared = _resources(compiled.asm["cubin"])
        result.shared_bytes = compiled.metadata.shared + static_shared
        result.replicated = dot_replication(compiled.asm["ttgir"])
    except Exception as e:  # noqa: BLE001 - every failure is a finding, reported with its kernel
        lines = [line for line in str(e).splitlines() if line.strip()]
        result.error = f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]
    result.seconds = time.perf_counter() - start
    return result


def check(variants: list[Variant], kernels: dict[str, object], jobs: int, progress=None) -> list[Result]:
    """Compile every variant (in ``jobs`` forked processes) and return one Result each."""
    global _WORK
    _WORK = [(v, kernels[v.kernel]) for v in variants]
    if jobs <= 1:
        results = []
        for i in range(len(_WORK)):
            results.append(_compile(i))
            if progress:
                progress(results[-1], len(results), len(_WORK))
        return results
    results = []
    with ProcessPoolExecutor(jobs, mp_context=get_context("fork")) as pool:
        for result in pool.map(_compile, range(len(_WORK)), chunksize=1):
            results.append(result)
            if progress:
                progress(result, len(results), len(_WORK))
    return results


# ---------------------------------------------------------------------------------------- report


def table(results: list[Result]) -> str:
    """Markdown: one row per (kernel, variant, target)."""
    lines = ["| kernel | variant | target | registers | spills (B) | shared (KiB) | limit (KiB) | repeated tensor-core work "
             "| compile (s) | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(results, key=lambda r: (r.kernel, r.variant, r.arch)):
        shared = "" if r.shared_bytes is None else f"{r.shared_bytes / 1024:.1f}"
        status = "; ".join(r.problems) or "ok"
        lines.append(f"| {r.kernel} | {r.variant} | sm_{r.arch} | {r.registers or ''} | "
                     f"{'' if r.spill_bytes is None else r.spill_bytes} | {shared} | {TARGETS.get(r.arch, 0) / 1024:.0f} | "
                     f"{'; '.join(r.replicated)} | {r.seconds:.1f} | {status} |")
    return "\n".join(lines) + "\n"


def summary(results: list[Result]) -> str:
    """Markdown: per (kernel, target), the variant count and the largest registers / shared memory."""
    lines = ["| kernel | target | variants | max registers | max shared (KiB) | spilling | repeating work | failing |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    groups: dict[tuple[str, int], list[Result]] = {}
    for r in results:
        groups.setdefault((r.kernel, r.arch), []).append(r)
    for (kernel, arch), rs in sorted(groups.items()):
        ok = [r for r in rs if r.registers is not None]
        lines.append(f"| {kernel} | sm_{arch} | {len(rs)} | {max((r.registers for r in ok), default='')} | "
                     f"{max((r.shared_bytes for r in ok), default=0) / 1024:.1f} | "
                     f"{sum(1 for r in rs if r.spill_bytes)} | {sum(1 for r in rs if r.replicated)} | "
                     f"{sum(1 for r in rs if r.problems)} |")
    return "\n".join(lines) + "\n"


def _triton_version() -> str:
    import triton

    return triton.__version__


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Compile every Triton kernel variant the public API launches, "
                                             "for GPU targets, without a GPU.")
    ap.add_argument("--arch", type=int, nargs="+", default=sorted(TARGETS),
                    help="compute capabilities to compile for (default: 80 90)")
    ap.add_argument("--only", metavar="REGEX", help="only the grid cases matching REGEX (coverage not checked)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: all CPUs)")
    ap.add_argument("--json", type=Path, help="write every result as JSON here")
    ap.add_argument("--table", type=Path, help="write the Markdown summary and table here")
    ap.add_argument("--quiet", action="store_true", help="print only problems and the summary")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    kernels, variants, refused = record(args.arch, args.only)
    launched = {v.kernel for v in variants}
    uncovered = [] if args.only else coverage(kernels, launched)
    for name, reason in refused.items():
        print(f"refused by the API (no Triton launch): {name}: {reason}")
    print(f"{len(kernels)} @triton.jit functions, {len(launched)} launched kernels, {len(variants)} variants "
          f"for sm_{', sm_'.join(map(str, args.arch))} (recorded in {time.perf_counter() - start:.1f} s); "
          f"compiling with {args.jobs} processes", flush=True)

    def progress(r: Result, done: int, total: int):
        if r.problems or not args.quiet:
            print(f"[{done}/{total}] {r.kernel} sm_{r.arch} {r.variant}: "
                  f"{'; '.join(r.problems) or f'{r.registers} regs, {r.shared_bytes} B shared'}"
                  f"{''.join(f'; {x}' for x in r.replicated)} ({r.seconds:.1f} s)", flush=True)

    results = check(variants, kernels, args.jobs, progress)
    bad = [r for r in results if r.problems]
    print(summary(results))
    for name in uncovered:
        print(f"NOT COVERED: {name} is a @triton.jit function that no grid case launches or calls: add its op "
              f"to {PACKAGE}.aot.grid")
    print(f"{len(results)} compiled in {time.perf_counter() - start:.0f} s: {len(bad)} with problems, "
          f"{len(uncovered)} functions not covered")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"archs": args.arch, "triton": _triton_version(), "uncovered": uncovered,
                                         "refused": refused,
                                         "functions": sorted(kernels), "results": [asdict(r) for r in results]},
                                        indent=1) + "\n")
    if args.table:
        refusals = "".join(f"- {name}: {reason}\n" for name, reason in refused.items())
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(
            f"# Triton kernels compiled ahead of time\n\n`python -m {PACKAGE}.aot --arch {' '.join(map(str, args.arch))}` "
            f"with triton {_triton_version()} and torch {torch.__version__}, on {time.strftime('%Y-%m-%d')}: "
            f"{len(results)} variants, {len(bad)} with problems, {len(uncovered)} functions not covered.\n\n"
            f"## Summary\n\n{summary(results)}\n"
            + (f"Cases the ops refuse to run on Triton (the torch path runs them):\n\n{refusals}\n" if refused else "")
            + f"## Every variant\n\n{table(results)}")
    return 1 if bad or uncovered else 0


if __name__ == "__main__":
    sys.exit(main())
