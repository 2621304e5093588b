"""clawfast.kernels: RL training kernels for packed prefix trees (and flat sequences).

Every op has a Triton kernel (used for CUDA tensors), a torch fast path (CPU, or no Triton) and a
plain reference ``*_ref`` of the same function in ``reference.py``:

- ``tree_logprobs`` / ``linear_logprobs``: fused log-probs + entropy, never materialising [N, V].
- ``tree_attention``: softmax attention over a packed forest (query i sees key j iff
  ``j <= i <= kv_end[j]``), block-sparse, never an [N, N] tensor; FlexAttention as a backend too.
- ``tree_gae``: GAE over a packed tree (per-path mean or tree backup), a reverse segmented scan.
- ``importance_weights``: truncated / masked IS at token or sequence level, with mismatch metrics.
- ``policy_loss``: PPO clipped surrogate x IS weight, dual clip, entropy bonus, k3 KL;
  ``grpo_advantages``: group-normalised advantages.

This package imports only torch and triton: it is usable without the rest of clawfast.
"""

if __name__ == "kernels":
    # Found by its directory name, not as clawfast.kernels (Python started at a checkout's root): hand the
    # name to the hub-kernels distribution (clawfast._toplevel). Where that is not installed, become an
    # empty namespace package, what transformers reads as "not installed": a ModuleNotFoundError would be
    # closer to absent, but transformers 5.x imports a `kernels` that find_spec finds and importlib.metadata
    # does not know, uncaught, so it would fail `import transformers`.
    from clawfast._toplevel import hand_off

    hand_off(__name__, b'"""clawfast.kernels:', empty_when_missing=True)
else:
    from .importance import ISConfig, ISResult, importance_weights
    from .policy_loss import grpo_advantages, policy_loss
    from .reference import (
        grpo_advantages_ref,
        importance_weights_ref,
        linear_logprobs_ref,
        policy_loss_ref,
        tree_attention_ref,
        tree_gae_ref,
        tree_logprobs_ref,
        tree_mask_ref,
    )
    from .tree_attention import tree_attention
    from .tree_attention_schedule import TreeMask
    from .tree_gae import subtree_scan, tree_gae
    from .tree_logprobs import linear_logprobs, tree_logprobs
    from .tree_paths import TreePaths

    __all__ = [
        "ISConfig",
        "ISResult",
        "TreeMask",
        "TreePaths",
        "grpo_advantages",
        "grpo_advantages_ref",
        "importance_weights",
        "importance_weights_ref",
        "linear_logprobs",
        "linear_logprobs_ref",
        "policy_loss",
        "policy_loss_ref",
        "subtree_scan",
        "tree_attention",
        "tree_attention_ref",
        "tree_gae",
        "tree_gae_ref",
        "tree_logprobs",
        "tree_logprobs_ref",
        "tree_mask_ref",
    ]
