"""Where a stretch of work spends its device's time: time per kernel, from torch.profiler.

    with device_profile(cuda) as prof:
        step()
    summary = device_breakdown(prof, cuda, wall_s)

On CUDA the profiler records the device's activity (kernels, memory copies and sets; CUPTI) and the
host's launch calls, which are not counted: no CPU operators, stacks or shapes. The device events are
summed by name (`_short`: ATen's elementwise and reduction kernels apart by the operation each runs),
the project's own Triton kernels (`clawfast.kernels.aot.discover`) by their function name; each
one's share is of their summed time. ``busy_s`` is the union of their intervals: against the wall
time it says whether the device waited on the host. On a CPU (smoke runs) the same summary
holds the operators' self time, ``busy_s`` their sum.
"""

from __future__ import annotations

import re
from collections import defaultdict

_TOP = 8  # kernels named in the note; the rest are summed


def device_profile(cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])


def own_kernels() -> set[str]:
    """The function names of the project's Triton kernels (what a CUDA trace calls their launches)."""
    from clawfast.kernels.aot import discover

    return {qualified.rsplit(".", 1)[1] for qualified in discover()}


def _short(name: str) -> str:
    """A kernel's name without its return type, anonymous namespaces, template arguments and parameter
    list (cuBLAS and CUTLASS names run to hundreds of characters): ``void at::native::(anonymous
    namespace)::cunn_SoftMaxForward<4, float>(...)`` is ``at::native::cunn_SoftMaxForward``. A
    template kernel that runs what its first non-numeric template argument names (ATen's elementwise
    and reduction kernels, every operator through one of a few) keeps that name in brackets, so the
    operators stay apart: ``at::native::vectorized_elementwise_kernel[MulFunctor]``."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ").strip()
    base = re.split(r"[<(]", name, maxsplit=1)[0].strip()[:80] or name[:80]
    rest = name[len(base):].lstrip()
    what = _template_subject(rest) if rest.startswith("<") else None
    return f"{base}[{what}]" if what else base


def _template_subject(args: str) -> str | None:
    """What a template argument list (``<...>...``) runs: in its first argument that is not a number,
    the function named innermost (the one an operator's lambda sits in: ``hypot_kernel_cuda(...)::
    {lambda...}``; ``gpu_index_kernel<index_kernel_impl<...>(...)::{lambda...}>(...)`` runs
    index_kernel_impl), else the last class template named that is no value type
    (``BinaryFunctor<float, ..., MulFunctor<float>>`` runs MulFunctor), else None
    (``cunn_SoftMaxForward<4, float>``)."""
    depth, start, first = 0, 1, None
    for i, c in enumerate(args):
        if c in "<({[":
            depth += 1
        elif c in ">)}]":
            depth -= 1
        if (depth == 1 and c == ",") or depth == 0:
            arg = args[start:i].strip()
            if not re.fullmatch(r"-?\d+[ul]*|true|false", arg):
                first = arg
                break
            start = i + 1
    if not first:
        return None
    called = _called_functions(first)
    if called:
        return max(called, key=lambda item: item[0])[1]  # the first of the innermost
    # value types (c10::complex, std::array) are what an operation runs on, not the operation
    templates = [name for scope, name in re.findall(r"((?:\w+::)*)(\w+)<", first)
                 if not scope.startswith(("c10::", "std::"))]
    return templates[-1] if templates else None


def _called_functions(text: str) -> list[tuple[int, str]]:
    """(template depth, name) of each function `text` names as called, ``name(`` or ``name<...>(``,
    in order; lambdas and operators are no names."""
    found, depth = [], 0
    for m in re.finditer(r"\w+|[<>]", text):
        token = m.group()
        if token == "<":
            depth += 1
        elif token == ">":
            depth -= 1
        elif token not in ("lambda", "operator") and not token[0].isdigit():
            after = m.end()
            if text.startswith("<", after):
                after = _closing_angle(text, after) + 1
            if text.startswith("(", after):
                found.append((depth, token))
    return found


def _closing_angle(text: str, i: int) -> int:
    """The index of the ``>`` that closes the ``<`` at `i` (or the text's end)."""
    depth = 0
    for j in range(i, len(text)):
        depth += {"<": 1, ">": -1}.get(text[j], 0)
        if depth == 0:
            return j
    return len(text)


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def device_breakdown(prof, cuda: bool, wall_s: float) -> dict:
    """{busy_s, wall_s, kernels: [{name, s, launches, own}] largest first, note}: the profiled stretch's
    time per kernel (CUDA) or per operator's self time (CPU)."""
    from torch.autograd import DeviceType

    own = own_kernels() if cuda else set()
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans = []
    for event in prof.events():
        if cuda:
            if event.device_type != DeviceType.CUDA:
                continue
            us = event.time_range.elapsed_us()
            spans.append((event.time_range.start, event.time_range.end))
        else:
            us = event.self_cpu_time_total
        entry = per_name[_short(event.name)]
        entry[0] += us
        entry[1] += 1
    kernels = sorted(({"name": name, "s": us / 1e6, "launches": n, "own": name in own}
                      for name, (us, n) in per_name.items()), key=lambda k: -k["s"])
    unit = "kernel" if cuda else "operator"
    if not kernels:
        note = f"the profiler recorded no {unit} (CUPTI unavailable?)"
        return dict(busy_s=0.0, wall_s=wall_s, kernels=[], note=note)
    total = sum(k["s"] for k in kernels)
    busy = _union_us(spans) / 1e6 if cuda else total  # self times do not overlap

    def share(s: float) -> str:
        return f"{s:.3g} s ({s / total:.0%})"

    ours = [k for k in kernels if k["own"]]
    named = kernels[:_TOP]
    rest = sum(k["s"] for k in kernels[_TOP:])
    what = "device busy" if cuda else "in operators (self time)"
    note = (f"{what} {busy:.3g} s of the {wall_s:.3g} s wall ({busy / wall_s:.0%}); "
            + (f"the project's Triton kernels {share(sum(k['s'] for k in ours))}; " if cuda else "")
            + f"largest {unit}s: "
            + ", ".join(f"{k['name']}{' (ours)' if k['own'] else ''} {share(k['s'])} x{k['launches']}" for k in named)
            + (f"; {len(kernels) - len(named)} others {share(rest)}" if rest else ""))
    return dict(busy_s=busy, wall_s=wall_s, kernels=kernels, note=note)
