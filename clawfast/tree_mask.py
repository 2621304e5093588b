"""The dense additive tree mask, HF's attention-mask layout (docs/TREE.md, docs/KERNELS.md).

Rows are a forest laid out in DFS order; row j is visible to row i iff ``j <= i <= kv_end[j]``. The
dense form is O(N^2) memory: it is the reference form that `Policy(attention="sdpa-dense")` feeds
to a model's own attention and the tests compare against; training attends trees with
`clawfast.kernels.tree_attention`, which reads `kv_end` directly.

Guaranteed: the mask is exactly `clawfast.kernels.tree_mask_ref` (no other rule, e.g. no padding).
"""

from __future__ import annotations

import numpy as np
import torch

from clawfast.kernels import tree_mask_ref


def dense_tree_mask(
    kv_end: np.ndarray | torch.Tensor, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Additive mask [1, 1, N, N] for HF-style attention: 0 where allowed (under a sliding
    ``window`` too, see `tree_mask_ref`), the dtype's minimum elsewhere (every row sees at least
    itself, so no row is fully masked)."""
    if not isinstance(kv_end, torch.Tensor):
        kv_end = torch.as_tensor(np.asarray(kv_end))
    if kv_end.ndim != 1:
        raise ValueError(f"kv_end must be one-dimensional, got shape {tuple(kv_end.shape)}")
    allowed = tree_mask_ref(kv_end.to(device) if device is not None else kv_end, window)
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, blocked)[None, None]
