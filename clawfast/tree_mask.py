"""Dense tree attention masks from `kv_end` (docs/TREE.md, DESIGN.md "The tree mask").

Rows are a forest laid out in DFS order; row j is visible to row i iff ``j <= i <= kv_end[j]``. The
dense form is O(N^2) memory and is meant for tests, CPU runs and small batches; large batches use a
kernel that reads `kv_end` directly.

Guaranteed: the mask is exactly that predicate (no other rule, e.g. no padding handling).
"""

from __future__ import annotations

import numpy as np
import torch


def tree_mask_bool(kv_end: np.ndarray | torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """bool[N, N]: True where query row i may attend to key row j."""
    kv_end = torch.as_tensor(np.asarray(kv_end) if not isinstance(kv_end, torch.Tensor) else kv_end, device=device)
    if kv_end.ndim != 1:
        raise ValueError(f"kv_end must be one-dimensional, got shape {tuple(kv_end.shape)}")
    n = kv_end.shape[0]
    idx = torch.arange(n, device=kv_end.device)
    if n and (bool((kv_end < idx).any()) or bool((kv_end >= n).any())):
        raise ValueError("kv_end[j] must lie in [j, N) for every row j")
    i, j = idx[:, None], idx[None, :]
    return (j <= i) & (i <= kv_end.to(idx.dtype)[None, :])


def dense_tree_mask(
    kv_end: np.ndarray | torch.Tensor, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Additive mask [1, 1, N, N] for HF-style attention: 0 where allowed, the dtype's minimum
    elsewhere (every row sees at least itself, so no row is fully masked)."""
    allowed = tree_mask_bool(kv_end, device=device)
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, blocked)[None, None]
