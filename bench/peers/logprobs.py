"""Fused log-probs: `clawfast.kernels.linear_logprobs` against Apple's Cut Cross-Entropy
(``cut_cross_entropy.linear_cross_entropy``, ``impl="torch_compile"``, the implementation that runs
on a CPU) on the same hidden states, classifier and labels (float32, 2 intra-op threads).

Checked before timing: CCE's per-token loss (``reduction="none"``) equals minus our log-probs, and the
gradients of the summed log-likelihood with respect to the hidden states and the classifier agree
(relative to their largest entry). Timed: forward + backward of the summed log-likelihood, medians
after a warm-up (CCE's first call compiles), peak extra resident memory of one call. Ours also
returns the per-token entropy in the same pass, which CCE does not compute; a second row times ours
with the entropy in the loss too (its gradient is then computed as well), which is what the trainer
does when ``algorithm.entropy_coef`` is set. Naive logits (``log_softmax(h @ W.T)``) are a third
reference in the note. On a GPU, Liger-Kernel's fused linear cross-entropy is the peer instead:
``bench/gpu_kernels.py`` has that row.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: memory.py

from memory import measure  # noqa: E402

NAME = "logprobs"
TOL = 1e-4  # float32, chunked vs whole-row softmax: relative to the largest entry


def _inputs(torch, n: int, d: int, v: int):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=gen) * 0.5
    weight = torch.randn(v, d, generator=gen) / d**0.5
    labels = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, labels


def _rel(torch, a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def run(quick: bool) -> list[dict]:
    import torch
    from cut_cross_entropy import __version__ as cce_version
    from cut_cross_entropy import linear_cross_entropy

    import clawfast.kernels as K

    torch.set_num_threads(2)
    n, d, v, repeats = (256, 64, 1024, 1) if quick else (4096, 256, 16384, 3)
    hidden, weight, labels = _inputs(torch, n, d, v)

    def grads(loss_of):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = loss_of(h, w)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    def ours(h, w):
        lp, _ = K.linear_logprobs(h, w, labels)
        return -lp.sum()

    def ours_entropy(h, w):
        lp, ent = K.linear_logprobs(h, w, labels)
        return -lp.sum() - 0.01 * ent.sum()

    def cce(h, w):
        return linear_cross_entropy(h, w, labels, reduction="sum", impl="torch_compile")

    def naive(h, w):
        return -torch.log_softmax(h @ w.t(), dim=-1).gather(1, labels[:, None]).sum()

    with torch.no_grad():
        per_token = linear_cross_entropy(hidden, weight, labels, reduction="none", impl="torch_compile")
        lp, _ = K.linear_logprobs(hidden, weight, labels)
    ours_out, cce_out = grads(ours), grads(cce)
    diffs = {"loss per token": _rel(torch, -lp, per_token), "grad hidden": _rel(torch, ours_out[1], cce_out[1]),
             "grad weight": _rel(torch, ours_out[2], cce_out[2])}
    if max(diffs.values()) > TOL:
        raise AssertionError(f"linear_logprobs and CCE disagree: {diffs} (tolerance {TOL})")

    ours_s, ours_mib = measure(lambda: grads(ours), repeats)
    ent_s, ent_mib = measure(lambda: grads(ours_entropy), repeats)
    cce_s, cce_mib = measure(lambda: grads(cce), repeats)
    naive_s, naive_mib = measure(lambda: grads(naive), repeats)
    shape = f"N={n} d={d} V={v} fp32"
    peer = f"cut-cross-entropy {cce_version} linear_cross_entropy(impl='torch_compile')"
    check = "per-token loss = -log-prob; grads of the summed log-likelihood (h, W)"
    naive_note = f"naive logits {naive_s:.3f} s / {naive_mib:.0f} MiB"
    return [
        {"case": "fwd+bwd, log-likelihood", "shape": shape, "ours": "clawfast.kernels.linear_logprobs", "peer": peer,
         "ours_s": ours_s, "peer_s": cce_s, "ours_mib": ours_mib, "peer_mib": cce_mib, "speedup": cce_s / ours_s,
         "mem_ratio": ours_mib / cce_mib if cce_mib > 0 else None, "check": check, "max_diff": max(diffs.values()),
         "tol": TOL, "note": naive_note},
        {"case": "fwd+bwd, log-likelihood + entropy (CCE: none)", "shape": shape,
         "ours": "clawfast.kernels.linear_logprobs", "peer": peer, "ours_s": ent_s, "peer_s": cce_s,
         "ours_mib": ent_mib, "peer_mib": cce_mib, "speedup": cce_s / ent_s,
         "mem_ratio": ent_mib / cce_mib if cce_mib > 0 else None, "check": "as above", "max_diff": max(diffs.values()),
         "tol": TOL, "note": f"the entropy's gradient costs {ent_s / ours_s:.2f}x our log-likelihood-only time"},
    ]


if __name__ == "__main__":
    import json

    print(json.dumps(run("--quick" in sys.argv), indent=1))
