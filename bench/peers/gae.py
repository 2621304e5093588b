"""GAE: `clawfast.kernels.tree_gae` against verl's ``compute_gae_advantage_return``
(``verl.trainer.ppo.core_algos``, a Python loop over time steps vectorised over the batch) on the
same rewards, values and masks, float64 on both sides, one intra-op thread each.

Inputs are agent-shaped: the mask alternates model turns (1) and tool outputs (0), the outcome
reward sits on each sequence's last token (a model token), values are random.

- chains: one sequence of 16,384 tokens (verl: [1, T]) and a batch of 8 sequences of 8K-16K tokens
  right-padded into verl's [B, T] layout; ours: the same tokens as a forest of chains
  (``parent_row = i - 1``, -1 at each sequence's first token). Checked: returns at every real
  token, and verl's whitened advantages against ``verl_F.masked_whiten`` (verl's own helper, same
  mask) applied to ours. verl's timed call includes that whitening, ours does not (an O(N) pass).
- trees: `bench_kernels.agent_forest` (4 samples under a shared prompt, retried turns). verl has no
  tree form: every root-to-leaf path is expanded and right-padded into its [P, L] layout (the
  expansion is not timed) and verl runs on that; ours is ``tree_gae(mode="path")`` on the tree,
  which gives each row the mean over the paths through it. Checked: verl's raw per-path
  advantages (returns - values, i.e. before its whitening, which over expanded tokens weighs a
  shared row by its number of paths) averaged back onto the rows equal ours, returns likewise.

Timed after the check: median seconds and peak extra resident MiB (`memory.measure`; a few MiB
at most here, mostly allocator reuse of pages freed by the check).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: memory.py, bench_kernels.py

from memory import measure  # noqa: E402

NAME = "gae"
GAMMA, LAM = 0.99, 0.95
TOL = 1e-9  # float64: a doubling scan against a sequential loop
GOAL = 100.0  # the bar for chains: tree_gae >= 100x verl's loop


def _turn_mask(torch, n: int, gen):
    """1 on model turns (50-300 tokens), 0 on tool outputs (20-500 tokens), alternating."""
    mask = torch.zeros(n, dtype=torch.float64)
    pos, model = 0, True
    while pos < n:
        lo, hi = (50, 300) if model else (20, 500)
        run = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        mask[pos:pos + run] = float(model)
        pos, model = pos + run, not model
    return mask


def _padded(torch, flat, idx):
    """[B, T] of ``flat`` gathered at ``idx`` (-1: padding, 0 there)."""
    return torch.where(idx >= 0, flat[idx.clamp(min=0)], 0.0)


def _row(case, shape, ours_s, ours_mib, peer_s, peer_mib, peer, check, diff, note):
    return {"case": case, "shape": shape, "ours": "clawfast.kernels.tree_gae", "peer": peer,
            "ours_s": ours_s, "peer_s": peer_s, "ours_mib": ours_mib, "peer_mib": peer_mib,
            "speedup": peer_s / ours_s, "mem_ratio": ours_mib / peer_mib if peer_mib > 0 else None,
            "check": check, "max_diff": diff, "tol": TOL, "note": note}


def _chains(torch, tree_gae, verl_gae, masked_whiten, peer, lengths, repeats):
    gen = torch.Generator().manual_seed(len(lengths))
    n, b, width = sum(lengths), len(lengths), max(lengths)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    pos = torch.arange(n) - torch.repeat_interleave(starts, torch.tensor(lengths))
    parent = torch.where(pos == 0, -1, torch.arange(n) - 1).to(torch.int32)
    values = torch.randn(n, generator=gen, dtype=torch.float64)
    mask = torch.cat([_turn_mask(torch, length, gen) for length in lengths])
    last = starts + torch.tensor(lengths) - 1
    mask[last] = 1.0
    rewards = torch.zeros(n, dtype=torch.float64)
    rewards[last] = torch.rand(b, generator=gen, dtype=torch.float64)
    idx = torch.full((b, width), -1, dtype=torch.long)
    for i, (s, length) in enumerate(zip(starts.tolist(), lengths, strict=True)):
        idx[i, :length] = torch.arange(s, s + length)
    r_b, v_b, m_b = (_padded(torch, x, idx) for x in (rewards, values, mask))
    real = idx >= 0

    def theirs():
        return verl_gae(r_b, v_b, m_b, GAMMA, LAM)

    def ours():
        return tree_gae(rewards, values, parent, mask=mask, gamma=GAMMA, lam=LAM)

    adv_v, ret_v = theirs()
    adv_o, ret_o = ours()
    diffs = {"returns": float((ret_v[real] - ret_o[idx[real]]).abs().max()),
             "whitened advantages": float((adv_v - masked_whiten(_padded(torch, adv_o, idx), m_b))[real].abs().max())}
    if max(diffs.values()) > TOL:
        raise AssertionError(f"tree_gae and verl's GAE disagree on {b} chain(s) of {lengths[0]}+ tokens: {diffs} "
                             f"(tolerance {TOL})")
    peer_s, peer_mib = measure(theirs, repeats)
    ours_s, ours_mib = measure(ours, repeats * 5)
    speedup = peer_s / ours_s
    verdict = (f"{speedup:.0f}x vs the {GOAL:.0f}x goal: {'met' if speedup >= GOAL else 'MISSED'}" if width >= 16384
               else f"{speedup:.0f}x (the {GOAL:.0f}x goal is for 16K-token chains)")
    case = "one chain" if b == 1 else f"batch of {b} chains"
    shape = f"B={b} T={width} ({n} tokens, {int(mask.sum())} model) fp64"
    return _row(case, shape, ours_s, ours_mib, peer_s, peer_mib, peer,
                "returns; verl's whitened advantages vs masked_whiten(ours)", max(diffs.values()),
                f"{verdict}; verl's time includes its masked_whiten")


def _forest(torch, tree_gae, verl_gae, peer, total, repeats):
    from bench_kernels import agent_forest
    from clawfast.kernels.reference import tree_paths_ref

    parent = agent_forest(total, samples=4, prompt=total // 8, turn=256)
    n = parent.shape[0]
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(n, generator=gen, dtype=torch.float64)
    mask = _turn_mask(torch, n, gen)
    mask[: total // 8] = 0.0  # the shared prompt
    paths = tree_paths_ref(parent)
    leaves = torch.tensor([p[-1] for p in paths])
    mask[leaves] = 1.0
    rewards = torch.zeros(n, dtype=torch.float64)
    rewards[leaves] = torch.rand(len(paths), generator=gen, dtype=torch.float64)
    width = max(len(p) for p in paths)
    idx = torch.full((len(paths), width), -1, dtype=torch.long)
    for i, p in enumerate(paths):
        idx[i, : len(p)] = torch.tensor(p)
    r_b, v_b, m_b = (_padded(torch, x, idx) for x in (rewards, values, mask))
    real = idx >= 0

    def theirs():
        return verl_gae(r_b, v_b, m_b, GAMMA, LAM)

    def ours():
        return tree_gae(rewards, values, parent, mask=mask, gamma=GAMMA, lam=LAM, mode="path")

    _, ret_v = theirs()
    raw = (ret_v - v_b)[real]  # verl's advantages before its whitening
    rows = idx[real]
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, rows, torch.ones_like(raw))
    adv_v = torch.zeros(n, dtype=torch.float64).index_add_(0, rows, raw) / count
    adv_o, ret_o = ours()
    diffs = {"advantages": float((adv_v - adv_o).abs().max()), "returns": float((adv_v + values - ret_o).abs().max())}
    if max(diffs.values()) > TOL:
        raise AssertionError(f"tree_gae(mode='path') and verl's per-path GAE averaged over paths disagree on a "
                             f"{n}-row forest: {diffs} (tolerance {TOL})")
    peer_s, peer_mib = measure(theirs, repeats)
    ours_s, ours_mib = measure(ours, repeats * 5)
    expanded = int(real.sum())
    shape = f"N={n} rows, {len(paths)} paths, {expanded} expanded tokens, longest {width} fp64"
    return _row("agent forest, path mode", shape, ours_s, ours_mib, peer_s, peer_mib, peer,
                "verl per expanded path, raw advantages (returns - values) averaged over the paths "
                "through each row = ours; returns likewise", max(diffs.values()),
                f"{peer_s / ours_s:.0f}x; verl gets the paths pre-expanded (untimed) and needs "
                f"{expanded / n:.2f}x the tokens; its whitening (timed) is not compared")


def run(quick: bool) -> list[dict]:
    import torch
    import verl
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return
    from verl.utils.torch_functional import masked_whiten

    from clawfast.kernels import tree_gae

    peer = f"verl {verl.__version__} compute_gae_advantage_return"
    chain, batch, forest, repeats = (1024, [1024, 768, 900, 512], 1024, 1) if quick else \
        (16384, [16384, 12000, 8192, 15000, 9000, 16000, 10500, 14000], 16384, 5)
    # one intra-op thread for both sides: on a shared 2-core machine, two-thread ops on small tensors
    # time the scheduler (see bench_kernels.bench_gae)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [_chains(torch, tree_gae, compute_gae_advantage_return, masked_whiten, peer, [chain], repeats),
                _chains(torch, tree_gae, compute_gae_advantage_return, masked_whiten, peer, batch, repeats),
                _forest(torch, tree_gae, compute_gae_advantage_return, peer, forest, repeats)]
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    import json

    print(json.dumps(run("--quick" in sys.argv), indent=1))
