"""Shared helpers of clawfast.kernels: input checks, backend choice, Triton availability.

Only torch (and, when present, triton) is imported here: the kernels package must stay usable
without the rest of clawfast.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton is optional: on machines without it every op runs its torch fast path.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False

BACKENDS = ("auto", "torch", "triton")


def triton_interpret() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1, read once by triton at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def target_arch(device: torch.device) -> int:
    """The compute capability Triton compiles for on ``device`` (major * 10 + minor: 80 for an A100,
    90 for an H100 / H200), or 0 where Triton interprets or the device is not CUDA. Launch tiles may
    depend on it (the register file's use differs between GPU generations); `clawfast.kernels.aot`
    substitutes each target it records for."""
    if triton_interpret() or device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


# The dtypes the Triton matmul kernels (tree attention, log-probs) take: float64 has no tensor-core
# tile that fits their registers; it is a reference precision, served by the torch path.
TRITON_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def refuses_dtype(dtype: torch.dtype) -> str | None:
    """Why the Triton matmul kernels cannot take ``dtype`` (None: they can)."""
    if dtype in TRITON_FLOATS:
        return None
    return f"the Triton path takes float16/bfloat16/float32, got {dtype}"


def pick_backend(backend: str, *tensors: torch.Tensor, backends: tuple[str, ...] = BACKENDS,
                 triton_refuses: str | None = None) -> str:
    """Resolve ``backend`` (one of ``backends``): "auto" means Triton for CUDA tensors, the torch fast
    path otherwise. "triton" on CPU tensors is allowed only under TRITON_INTERPRET=1 (the tests use it).
    ``triton_refuses``: why the op's Triton kernels cannot take these inputs (None: they can); "auto"
    then runs the torch path, and "triton" raises with that reason.

    Which backend runs depends on the tensors' device; how a Triton kernel is launched (its tiles and
    warps) depends only on whether Triton interprets (`triton_interpret`) and on the target's compute
    capability (`target_arch`), which ``clawfast.kernels.aot`` substitutes, so it records a GPU's
    launches on a CPU.
    """
    if backend not in backends:
        raise ValueError(f"backend must be one of {backends}, got {backend!r}")
    on_cuda = any(t.is_cuda for t in tensors)
    if backend == "auto":
        return "triton" if (on_cuda and HAS_TRITON and triton_refuses is None) else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' requested but triton is not installed")
        if not on_cuda and not triton_interpret():
            raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
        if triton_refuses is not None:
            raise ValueError(f"{triton_refuses}: use backend='torch'")
    return backend


def check_1d(name: str, t: torch.Tensor, length: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} has length {t.shape[0]}, expected {length}")


def check_int(name: str, t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {t.dtype}")


def check_float(name: str, t: torch.Tensor) -> None:
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must be floating point, got dtype {t.dtype}")


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise ValueError if ``t`` holds NaN or +-inf (one reduction, one host sync)."""
    if t.numel() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} holds {bad} non-finite value(s) (NaN or inf)")


def check_range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Raise ValueError unless every element lies in [low, high)."""
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < low or hi >= high:
            raise ValueError(f"{name} must lie in [{low}, {high}), got min {lo}, max {hi}")


def first_derivative_only(op: str):
    """Decorates an autograd Function's hand-written backward: a backward asked for a graph
    (``create_graph=True``, the grad mode autograd runs it in) raises, where the gradient it returned
    would carry no graph and a second derivative through `op` would silently be missing. Stricter than
    torch's ``once_differentiable``, which raises only when the incoming gradient requires grad: a
    gradient penalty's upstream gradient often does not, and its second derivative then lost `op`'s
    part without a word (the tree-attention term of a penalty came out 0)."""

    def decorate(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(f"{op} is differentiable once: its backward is hand-written, so a "
                                   "second derivative (create_graph=True) cannot go through it")
            return backward(ctx, *grads)

        return checked

    return decorate


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for half types and float32, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Attention dropout as a pure function of (seed, head, query row, key row): the forward, the
# backward (also a recomputation under gradient checkpointing) and every backend draw the same
# mask without storing it. A 32-bit integer mix in int64 arithmetic (constants below 2**31, so no
# product overflows); the Triton kernels repeat the same three steps.
_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B


def mix32(x):
    x = ((x ^ (x >> 16)) * _MIX) & _MASK32
    x = ((x ^ (x >> 16)) * _MIX) & _MASK32
    return x ^ (x >> 16)


def dropout_threshold(p: float) -> int:
    """A key is dropped iff the top 24 bits of its hash fall below this: probability p up to 2**-24."""
    return round(p * (1 << 24))


def dropout_keep(seed: int, heads: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, threshold: int) -> torch.Tensor:
    """bool [*heads.shape, R, C]: True where the (head, query row, key row) entry survives dropout."""
    r = mix32(mix32(heads.long() ^ seed)[..., None] ^ rows.long())
    return (mix32(r[..., None] ^ cols.long()) >> 8) >= threshold
