"""Importance-sampling correction for the trainer/inference mismatch.

The engine samples with log-probs ``infer_logprobs``; the trainer recomputes ``logprobs`` for the
same tokens. Their ratio ``rho = exp(logprobs - infer_logprobs)`` corrects the policy gradient. In
decoupled PPO (``policy_loss``) ``logprobs`` are the proximal policy's (the trainer at the start of
its step) and ``infer_logprobs`` the behaviour policy's (whatever weights sampled each token, possibly
several versions old), so rho covers both the engine/trainer mismatch and the staleness.

- level ``"token"``: one ratio per target. level ``"sequence"``: one ratio per sequence, the
  product of its token ratios, i.e. the sum of log-ratios along each root-to-leaf path
  (``TreePaths.path_sum``, no tree expansion); a target shared by several paths gets the mean of
  their weights (``TreePaths.to_targets``).
- mode ``"truncate"``: weight ``min(rho, cap)`` (truncated IS, cap 2 by default).
  mode ``"mask"``: weight ``rho`` inside ``[lo, hi]`` and 0 outside (masked IS).
- log-ratios are clamped to ``[-log_clamp, log_clamp]`` before ``exp`` (no overflow).

Metrics (computed on device in float64, brought to the host in ONE transfer): over the items of
the chosen level (targets weighted by their mask, or sequences with at least one valid target) the
ratio mean/std/min/max, the fraction above / below the thresholds (``cap`` / ``1/cap`` when
truncating, ``hi`` / ``lo`` when masking), the effective sample size ``(sum rho)^2 / (n sum rho^2)``,
chi^2 ``mean(rho^2) - 1``, the mean weight; and, always per token, the mismatch KL(infer || train)
estimators k1 ``mean(-log r)`` and k3 ``mean(r - 1 - log r)``. With no valid item every metric
is 0 and ``is_count`` says so.

Layers: ``_importance_stats_kernel`` (Triton: clamp, ratio, weight and the metric sums in one pass,
float64 atomics), ``_stats_torch`` (the same pass in torch), ``importance_weights`` (entry point).
Weights carry no gradient. Entries with mask 0 get weight 0 and may hold anything (even NaN);
non-finite log-probs where mask > 0 raise ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import HAS_TRITON, acc_dtype, check_1d, check_float, pick_backend, triton_interpret
from .tree_paths import TreePaths

if HAS_TRITON:
    import triton
    import triton.language as tl

    # Sizes and offsets vary from launch to launch: specialising them (== 1, divisible by 16) would only
    # compile more variants for nothing: they bound masks and loops, they are never strides.
    @triton.jit(do_not_specialize=['n'])
    def _importance_stats_kernel(lr_ptr, a_ptr, w_ptr, stats_ptr, params_ptr, n, MASK_MODE: tl.constexpr,
                                 BLOCK: tl.constexpr):
        """params: (log clamp, cap, lo, hi, threshold low, threshold high) as float64, read from memory:
        Triton passes a Python float as float32, and the ratios are compared in float64."""
        log_clamp, cap = tl.load(params_ptr), tl.load(params_ptr + 1)
        lo, hi = tl.load(params_ptr + 2), tl.load(params_ptr + 3)
        thr_lo, thr_hi = tl.load(params_ptr + 4), tl.load(params_ptr + 5)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        a = tl.load(a_ptr + offs, mask=ok, other=0.0).to(tl.float64)
        valid = ok & (a > 0)
        lr = tl.load(lr_ptr + offs, mask=valid, other=0.0).to(tl.float64)
        lr = tl.minimum(tl.maximum(lr, -log_clamp), log_clamp)
        rho = tl.exp(lr)
        if MASK_MODE:
            w = tl.where((rho >= lo) & (rho <= hi), rho, 0.0)
        else:
            w = tl.minimum(rho, cap)
        w = tl.where(valid, w, 0.0)
        tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=ok)
        a = tl.where(valid, a, 0.0)
        tl.atomic_add(stats_ptr + 0, tl.sum(a, 0))
        tl.atomic_add(stats_ptr + 1, tl.sum(a * rho, 0))
        tl.atomic_add(stats_ptr + 2, tl.sum(a * rho * rho, 0))
        tl.atomic_add(stats_ptr + 3, tl.sum(tl.where(rho > thr_hi, a, 0.0), 0))
        tl.atomic_add(stats_ptr + 4, tl.sum(tl.where(rho < thr_lo, a, 0.0), 0))
        tl.atomic_add(stats_ptr + 5, tl.sum(a * w, 0))
        tl.atomic_add(stats_ptr + 6, tl.sum(-a * lr, 0))
        tl.atomic_add(stats_ptr + 7, tl.sum(a * (rho - 1.0 - lr), 0))
        tl.atomic_min(stats_ptr + 8, tl.min(tl.where(valid, rho, float("inf")), 0))
        tl.atomic_max(stats_ptr + 9, tl.max(tl.where(valid, rho, float("-inf")), 0))
        tl.atomic_add(stats_ptr + 10, tl.sum(valid.to(tl.float64), 0))


LEVELS = ("token", "sequence")
MODES = ("truncate", "mask")
# stats vector layout (float64): the sums below, min, max, count
_S_A, _S_R, _S_R2, _S_ABOVE, _S_BELOW, _S_W, _S_K1, _S_K3, _S_MIN, _S_MAX, _S_N = range(11)


@dataclass(frozen=True)
class ISConfig:
    """How to turn ratios into weights. ``lo``/``hi`` bound masked IS; ``cap`` truncates."""

    level: str = "token"
    mode: str = "truncate"
    cap: float = 2.0
    lo: float = 0.5
    hi: float = 2.0
    log_clamp: float = 20.0

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not self.cap > 0:
            raise ValueError(f"cap must be > 0, got {self.cap}")
        if not 0 <= self.lo <= self.hi:
            raise ValueError(f"need 0 <= lo <= hi, got lo={self.lo}, hi={self.hi}")
        if not self.log_clamp > 0:
            raise ValueError(f"log_clamp must be > 0, got {self.log_clamp}")

    @property
    def thresholds(self) -> tuple[float, float]:
        return (1.0 / self.cap, self.cap) if self.mode == "truncate" else (self.lo, self.hi)


@dataclass
class ISResult:
    """weights[M] (no grad; 0 where masked); metrics: floats from one host transfer."""

    weights: torch.Tensor
    metrics: dict[str, float]


def _stats_torch(lr, a, cfg: ISConfig):
    a = a.double()
    valid = a > 0
    lr = torch.where(valid, lr.double(), 0.0).clamp(-cfg.log_clamp, cfg.log_clamp)
    rho = torch.exp(lr)
    if cfg.mode == "mask":
        w = torch.where((rho >= cfg.lo) & (rho <= cfg.hi), rho, 0.0)
    else:
        w = rho.clamp(max=cfg.cap)
    w = torch.where(valid, w, 0.0)
    a = torch.where(valid, a, 0.0)
    thr_lo, thr_hi = cfg.thresholds
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=a.device)
    stats = torch.stack([
        a.sum(), (a * rho).sum(), (a * rho * rho).sum(),
        torch.where(rho > thr_hi, a, 0.0).sum(), torch.where(rho < thr_lo, a, 0.0).sum(),
        (a * w).sum(), (-a * lr).sum(), (a * (rho - 1.0 - lr)).sum(),
        torch.where(valid, rho, inf).min() if rho.numel() else inf,
        torch.where(valid, rho, -inf).max() if rho.numel() else -inf,
        valid.sum().double(),
    ])
    return w, stats


def _stats_triton(lr, a, cfg: ISConfig):
    n = lr.shape[0]
    w = torch.empty(n, dtype=torch.float64, device=lr.device)
    stats = torch.zeros(11, dtype=torch.float64, device=lr.device)
    stats[_S_MIN], stats[_S_MAX] = float("inf"), float("-inf")
    if n:
        block = 64 if triton_interpret() else 1024
        params = torch.tensor([cfg.log_clamp, cfg.cap, cfg.lo, cfg.hi, *cfg.thresholds], dtype=torch.float64,
                              device=lr.device)
        _importance_stats_kernel[(triton.cdiv(n, block),)](
            lr.contiguous(), a.contiguous(), w, stats, params, n, MASK_MODE=cfg.mode == "mask", BLOCK=block)
    return w, stats


def _stats(lr, a, cfg, backend):
    return _stats_triton(lr, a, cfg) if backend == "triton" else _stats_torch(lr, a, cfg)


def _finish(stats: torch.Tensor, tok_stats: torch.Tensor) -> torch.Tensor:
    """Metric vector (order: METRIC_NAMES) from the level stats and the token stats, on device."""
    s_a = stats[_S_A]
    any_item = s_a > 0
    den = torch.where(any_item, s_a, 1.0)
    mean = stats[_S_R] / den
    m2 = stats[_S_R2] / den
    tok_den = torch.where(tok_stats[_S_A] > 0, tok_stats[_S_A], 1.0)
    z = torch.zeros((), dtype=torch.float64, device=stats.device)

    def on(x):
        return torch.where(any_item, x, z)

    return torch.stack([
        on(mean), on((m2 - mean * mean).clamp(min=0).sqrt()), on(stats[_S_MIN]), on(stats[_S_MAX]),
        stats[_S_ABOVE] / den, stats[_S_BELOW] / den,
        on(stats[_S_R] ** 2 / (den * torch.where(any_item, stats[_S_R2], 1.0))),
        on(m2 - 1.0), stats[_S_W] / den,
        tok_stats[_S_K1] / tok_den, tok_stats[_S_K3] / tok_den, stats[_S_N],
    ])


METRIC_NAMES = ("is_ratio_mean", "is_ratio_std", "is_ratio_min", "is_ratio_max", "is_frac_above",
                "is_frac_below", "is_ess", "is_chi2", "is_weight_mean", "mismatch_k1",
                "mismatch_k3", "is_count")


def _check_pair(logprobs, infer_logprobs, mask):
    check_1d("logprobs", logprobs)
    m = logprobs.shape[0]
    check_1d("infer_logprobs", infer_logprobs, m)
    check_float("logprobs", logprobs)
    check_float("infer_logprobs", infer_logprobs)
    if mask is not None:
        check_1d("mask", mask, m)
        if bool((mask < 0).any()):
            raise ValueError("mask must be >= 0")
    valid = torch.ones(m, dtype=torch.bool, device=logprobs.device) if mask is None else mask > 0
    for name, t in (("logprobs", logprobs), ("infer_logprobs", infer_logprobs)):
        bad = valid & ~torch.isfinite(t)
        if bool(bad.any()):
            raise ValueError(f"{name} holds {int(bad.sum())} non-finite value(s) where mask > 0")


def importance_weights_device(logprobs, infer_logprobs, mask=None, *, config: ISConfig = ISConfig(),
                              paths: TreePaths | None = None, backend: str = "auto"):
    """``importance_weights`` without the host transfer: (weights[M], metric vector on device)."""
    _check_pair(logprobs, infer_logprobs, mask)
    backend = pick_backend(backend, logprobs)
    dt = acc_dtype(logprobs.dtype)
    m = logprobs.shape[0]
    a = (torch.ones(m, dtype=dt, device=logprobs.device) if mask is None else mask.to(dt))
    with torch.no_grad():
        lr = torch.where(a > 0, logprobs.detach().to(dt) - infer_logprobs.to(dt), 0.0)
        w_tok, tok_stats = _stats(lr, a, config, backend)
        if config.level == "token":
            return w_tok.to(dt), _finish(tok_stats, tok_stats)
        if paths is None:
            raise ValueError("level='sequence' needs paths (TreePaths.from_tree or from_sequences)")
        seq_lr = paths.path_sum(lr.double())
        seq_valid = paths.path_sum((a > 0).double()) > 0
        w_seq, seq_stats = _stats(seq_lr, seq_valid.double(), config, backend)
        w = torch.where(a > 0, paths.to_targets(w_seq.double()), 0.0)
        return w.to(dt), _finish(seq_stats, tok_stats)


def metrics_to_host(names, vec: torch.Tensor) -> dict[str, float]:
    """One device-to-host transfer for a whole metric vector."""
    return dict(zip(names, vec.tolist()))


def importance_weights(logprobs: torch.Tensor, infer_logprobs: torch.Tensor,
                       mask: torch.Tensor | None = None, *, config: ISConfig = ISConfig(),
                       paths: TreePaths | None = None, backend: str = "auto") -> ISResult:
    """IS weights of every target and the mismatch metrics (see the module docstring).

    logprobs[M] (trainer), infer_logprobs[M] (engine), mask[M] (>0 = valid, default all valid).
    ``paths`` is needed for level="sequence".
    """
    w, vec = importance_weights_device(logprobs, infer_logprobs, mask, config=config,
                                       paths=paths, backend=backend)
    return ISResult(w, metrics_to_host(METRIC_NAMES, vec))
