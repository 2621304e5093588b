"""Importance sampling for the trainer/engine mismatch: clawfast against verl's rollout correction
(``verl.trainer.ppo.rollout_corr_helper``) on the same log-probs, float64 on both sides, one
intra-op thread each.

Inputs: B sequences of random lengths (T/2 to T) right-padded into verl's [B, T] layout with a
response mask; trainer log-probs in [-3, 0]; engine log-probs = trainer's + a log-ratio that is
small (std 0.01) on most tokens and large (std 0.5) on 2% of them, so some tokens and sequences
fall outside the thresholds. Ours gets the same valid tokens flat (the packed layout) with their
sequence ids.

- metrics: verl's ``compute_rollout_correction_and_rejection_mask`` (IS weights, rejection mask,
  off-policy metrics: what its trainer logs as ``rollout_corr/*``) against the trainer's
  ``clawfast.train.mismatch.mismatch`` (`importance_weights`, the log-perplexity metrics and
  `verl_names`, which names them after verl's), for four configurations: truncated IS (TIS, cap 2)
  per token and per sequence; masked IS in [0.5, 2] (verl: IcePop ``"0.5_2.0"`` plus its rejection
  sampling with the same bounds, ``token_k1`` / ``seq_sum_k1``) per token and per sequence.
  Checked: the weights at every valid token, and every metric both sides name alike, within TOL
  relative to max(1, |verl's value|). Each row's note lists the names compared and the
  ``rollout_corr/*`` names only one side has.
- weights: verl's ``compute_rollout_correction_weights`` (TIS weights and its IS metrics, from the
  log-ratio it is given: the subtraction is in its timed call) against `importance_weights` (weights
  and our IS metrics in one pass), per token and per sequence. Checked: the weights.

Every check runs before any timing, and all disagreements are reported together. Timed: medians
and peak extra resident MiB (`memory.measure`); at these sizes the memory numbers are a few MiB at
most, mostly whether the allocator could reuse pages freed by the checks.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: memory.py

from memory import measure  # noqa: E402

NAME = "importance"
TOL = 1e-7  # relative: verl's masked means add 1e-8 to every denominator (ours do not)
CAP, LO, HI = 2.0, 0.5, 2.0
TRAINER = "clawfast.train.mismatch.mismatch (importance_weights + log-ppl + verl_names)"
# (case, our is_level, our is_mode, verl's keyword arguments). verl's k1 rejection bounds the ratio
# rollout / train, so train / rollout in [LO, HI] is k1 in [1/HI, 1/LO].
CASES = (
    ("token TIS", "token", "truncate", {"rollout_is": "token", "rollout_is_threshold": CAP}),
    ("sequence TIS", "sequence", "truncate", {"rollout_is": "sequence", "rollout_is_threshold": CAP}),
    ("token masked IS (IcePop + token_k1 RS)", "token", "mask",
     {"rollout_is": "token", "rollout_is_threshold": f"{LO}_{HI}", "rollout_rs": "token_k1",
      "rollout_rs_threshold": f"{1 / HI}_{1 / LO}"}),
    ("sequence masked IS (IcePop + seq_sum_k1 RS)", "sequence", "mask",
     {"rollout_is": "sequence", "rollout_is_threshold": f"{LO}_{HI}", "rollout_rs": "seq_sum_k1",
      "rollout_rs_threshold": f"{1 / HI}_{1 / LO}"}),
)


def _inputs(torch, b: int, t: int):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    train = -3.0 * torch.rand(b, t, generator=gen, dtype=torch.float64)
    outlier = torch.rand(b, t, generator=gen) < 0.02
    log_ratio = torch.where(outlier, 0.5, 0.01) * torch.randn(b, t, generator=gen, dtype=torch.float64)
    return train, train - log_ratio, mask


def _names(names) -> str:
    return ", ".join(n.removeprefix("rollout_corr/") for n in names) or "-"


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(b))


def _row(case, shape, ours, peer, times, check, diff, note):
    (ours_s, ours_mib), (peer_s, peer_mib) = times
    return {"case": case, "shape": shape, "ours": ours, "peer": peer, "ours_s": ours_s, "peer_s": peer_s,
            "ours_mib": ours_mib, "peer_mib": peer_mib, "speedup": peer_s / ours_s,
            "mem_ratio": ours_mib / peer_mib if peer_mib > 0 else None, "check": check, "max_diff": diff,
            "tol": TOL, "note": note}


def run(quick: bool) -> list[dict]:
    import torch
    import verl
    from verl.trainer.ppo.rollout_corr_helper import (
        compute_rollout_correction_and_rejection_mask,
        compute_rollout_correction_weights,
    )

    from clawfast.kernels import ISConfig, TreePaths, importance_weights
    from clawfast.train.mismatch import mismatch
    from clawfast.train.step_config import StepConfig

    b, t, repeats = (8, 256, 3) if quick else (64, 4096, 10)
    train, rollout, mask = _inputs(torch, b, t)
    valid = mask > 0
    lp, infer, a = train[valid], rollout[valid], mask[valid]
    seq = torch.arange(b)[:, None].expand(b, t)[valid]
    shape = f"B={b} T={t} ({lp.shape[0]} valid tokens) fp64"

    def paths(level):
        return TreePaths.from_sequences(seq, b) if level == "sequence" else None

    # every row's (case, our name, peer name, our call, verl's call, check, max diff, note): all
    # checks first, then all timings
    work, failures = [], []
    for case, level, mode, kw in CASES:
        config = StepConfig(is_level=level, is_mode=mode, is_cap=CAP, is_lo=LO, is_hi=HI)

        def ours(level=level, config=config):
            return mismatch(lp, infer, a, seq, config, paths(level))

        def theirs(kw=kw):
            return compute_rollout_correction_and_rejection_mask(train, rollout, mask, **kw)

        weights, mine = ours()
        proto, _, their = theirs()
        w_diff = float((proto.batch["rollout_is_weights"][valid] - weights).abs().max())
        if w_diff > TOL:
            failures.append(f"{case}: weights differ by up to {w_diff:.3g}")
        shared = sorted(set(mine) & set(their))
        diffs = {name: _rel(mine[name], their[name]) for name in shared}
        failures += [f"{case}: {name} ours {mine[name]!r} verl {their[name]!r}"
                     for name, d in diffs.items() if d > TOL]
        only_verl = sorted(set(their) - set(mine))
        only_ours = sorted(n for n in set(mine) - set(their) if n.startswith("rollout_corr/"))
        note = (f"compared: {_names(shared)}; only verl: {_names(only_verl)}; "
                f"only ours (rollout_corr/*; plus our own is_*/mismatch_* names): {_names(only_ours)}")
        work.append((f"rollout_corr metrics, {case}", TRAINER,
                     f"verl {verl.__version__} compute_rollout_correction_and_rejection_mask", ours, theirs,
                     "IS weights at valid tokens; every metric named alike (relative)",
                     max(w_diff, *diffs.values()), note))

    for level in ("token", "sequence"):
        config = ISConfig(level=level, mode="truncate", cap=CAP)

        def ours(level=level, config=config):
            return importance_weights(lp, infer, a, config=config, paths=paths(level))

        def theirs(level=level):
            return compute_rollout_correction_weights(train - rollout, mask, rollout_is=level,
                                                      rollout_is_threshold=CAP)

        diff = float((theirs()[0][valid] - ours().weights).abs().max())
        if diff > TOL:
            failures.append(f"{level} TIS weights differ by up to {diff:.3g}")
        work.append((f"TIS weights, {level}", "clawfast.kernels.importance_weights",
                     f"verl {verl.__version__} compute_rollout_correction_weights", ours, theirs,
                     "IS weights at valid tokens", diff,
                     "each side also computes its IS metrics in the call (neither can skip them)"))

    if failures:
        raise AssertionError("clawfast and verl's rollout correction disagree (tolerance "
                             f"{TOL} relative to max(1, |verl|)):\n  " + "\n  ".join(failures))

    # one intra-op thread for both sides: on a shared 2-core machine, two-thread elementwise ops time
    # the scheduler (see bench_kernels.bench_gae)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [_row(case, shape, ours_name, peer, (measure(ours, repeats), measure(theirs, repeats)), check, diff,
                     note) for case, ours_name, peer, ours, theirs, check, diff, note in work]
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    import json

    print(json.dumps(run("--quick" in sys.argv), indent=1))
