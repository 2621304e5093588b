"""`clawfast tree inspect ROLLOUT`: what the prefix tree makes of captured rollouts.

For each rollout (a `.cfr` file, or every one in a directory) it prints the calls (index, kind as
the trainer sees it — from `clawfast.threads.reconstruct`, not the proxy's hint —, its thread and
whether it is trained under ``--train-threads``, prompt/output lengths, end node), the links between
threads (followed by PPO's GAE when their side kind is trained), the segments, the unique token count against the two flat layouts
(one sample per call as captured; one sample per kept leaf) with the dedup ratios, and each leaf
with its status and calls. With several rollouts it also packs them together, as the trainer does
for a group, and reports the deduplicated forest size. `--json` prints the same as one JSON object.

Guaranteed: the numbers are those of `clawfast.tree.build_tree` / `clawfast.pack.pack` on the calls
as stored, tagged with their reconstructed kinds (as the trainer does). Not guaranteed: a stable
text layout (parse `--json` instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from clawfast.commands.arg_types import non_negative_int
from clawfast.records import RecordFormatError, load_rollouts


class _Renamed(argparse.Action):
    """The old name of --micro-batch-tokens, refused with a message naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now --micro-batch-tokens (rows per packed micro-batch)")


def micro_batch_tokens(text: str) -> int:
    """1..`clawfast.pack.MAX_MICRO_BATCH_TOKENS`: a usage error here, not pack's ValueError after every
    rollout has been read."""
    from clawfast.pack import MAX_MICRO_BATCH_TOKENS

    value = int(text)
    if not 1 <= value <= MAX_MICRO_BATCH_TOKENS:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_MICRO_BATCH_TOKENS} (a batch's rows are numbered "
                                         f"with int32), got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("inspect", help="print the prefix tree of captured rollouts")
    p.add_argument("rollout", metavar="ROLLOUT", help="a .cfr rollout file or a directory of them")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--max-kept-leaves", type=non_negative_int, default=None, metavar="N",
                   help="drop a rollout whose kept leaves exceed N (as the trainer would)")
    p.add_argument("--keep-dead", action="store_true", help="keep retried/regenerated leaves (no dead status)")
    p.add_argument("--micro-batch-tokens", type=micro_batch_tokens, default=None, metavar="T",
                   help="also pack all rollouts into micro-batches of at most T rows (tokens) and report the fill")
    p.add_argument("--max-tokens", action=_Renamed, help=argparse.SUPPRESS)
    p.add_argument("--recover", action="store_true", help="read live or torn logs (keep complete calls)")
    p.add_argument("--train-threads", default="main", metavar="KINDS",
                   help="comma-separated thread kinds to train, as algorithm.train_threads (default: main)")


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 3) if den else None


def describe_rollout(rollout, tree, threads, trained: tuple[str, ...] = ("main",)) -> dict[str, Any]:
    """The JSON-ready description of one rollout, its threads (`clawfast.threads.RolloutThreads`) and tree."""
    from clawfast.pack import pack

    # Trainable tokens = targets of the tree packed alone (a dropped tree has none).
    trainable = sum(len(b.target_ids) for b in pack([tree], max(1, tree.num_unique_tokens)))
    by_index = {c.call_index: c for c in rollout.calls}
    thread_of = {t.call_index: t for t in threads.calls}
    calls = [
        {
            "index": int(i),
            "tags": list(by_index[int(i)].tags),
            "thread": thread_of[int(i)].thread,
            "excluded": bool(excl),
            "prompt_len": len(by_index[int(i)].prompt_ids),
            "output_len": len(by_index[int(i)].output_ids),
            "end_node": int(end),
        }
        for i, end, excl in zip(tree.call_indices, tree.end_node, tree.call_excluded)
    ]
    segments = [
        {
            "index": s,
            "parent": int(tree.seg_parent[s]),
            "depth": int(tree.seg_depth[s]),
            "len": int(tree.seg_len[s]),
            "kind": "generated" if tree.seg_kind[s] == 1 else "context",
            "call": int(tree.token_call[tree.seg_start[s]]) if tree.seg_kind[s] == 1 else None,
        }
        for s in range(tree.num_segments)
    ]
    leaves = [
        {"index": i, "node": int(lf.node), "depth": int(lf.depth), "status": lf.status, "calls": list(lf.calls)}
        for i, lf in enumerate(tree.leaves)
    ]
    return {
        "rollout_id": rollout.rollout_id,
        "task_id": rollout.task_id,
        "harness": rollout.harness,
        "sample_index": rollout.sample_index,
        "reward": rollout.reward,
        "status": rollout.status,
        "dropped": bool(tree.dropped),
        "calls": calls,
        "segments": segments,
        "tokens": {
            "unique": int(tree.num_unique_tokens),
            "trainable": trainable,
            "per_call": int(tree.num_call_tokens),
            "per_kept_leaf": int(tree.num_flat_tokens),
            "dedup_vs_per_call": _ratio(tree.num_call_tokens, tree.num_unique_tokens),
            "dedup_vs_per_kept_leaf": _ratio(tree.num_flat_tokens, tree.num_unique_tokens),
        },
        "leaves": leaves,
        "links": [{"kind": lk.kind, "source": lk.source, "target": lk.target, "followed": lk.thread_kind in trained}
                  for lk in threads.links],
    }


def describe_group(trees, micro_batch_tokens: int | None) -> dict[str, Any]:
    """All non-dropped rollouts packed together: one forest, shared prefixes once."""
    from clawfast.pack import pack, pack_stats

    live = [t for t in trees if not t.dropped]
    whole = max(1, sum(t.num_unique_tokens for t in live))  # everything fits: no split, no context rows
    forest = sum(b.num_tokens for b in pack(trees, whole))
    per_call = sum(t.num_call_tokens for t in trees)
    per_leaf = sum(t.num_flat_tokens for t in live)
    out: dict[str, Any] = {
        "rollouts": len(trees),
        "dropped": len(trees) - len(live),
        "forest_tokens": forest,
        "per_call": per_call,
        "per_kept_leaf": per_leaf,
        "dedup_vs_per_call": _ratio(per_call, forest),
        "dedup_vs_per_kept_leaf": _ratio(per_leaf, forest),
    }
    if micro_batch_tokens is not None:
        out["micro_batches"] = pack_stats(pack(trees, micro_batch_tokens))
        out["micro_batches"]["micro_batch_tokens"] = micro_batch_tokens
    return out


def _print_rollout(d: dict[str, Any], out) -> None:
    w = out.write
    w(f"rollout {d['rollout_id']}  task {d['task_id']}  harness {d['harness']}  sample {d['sample_index']}  "
      f"reward {d['reward']:g}  status {d['status']}{'  DROPPED (too many kept leaves)' if d['dropped'] else ''}\n")
    w(f"  calls ({len(d['calls'])})\n    {'index':>6} {'kind':<12} {'thread':<16} {'trained':<7} {'prompt':>8} "
      f"{'output':>7} {'end':>6}\n")
    for c in d["calls"]:
        w(f"    {c['index']:>6} {','.join(c['tags']):<12} {c['thread']:<16} {'no' if c['excluded'] else 'yes':<7} "
          f"{c['prompt_len']:>8} {c['output_len']:>7} {c['end_node']:>6}\n")
    if d["links"]:
        w(f"  links ({len(d['links'])})\n")
        for lk in d["links"]:
            w(f"    {lk['kind']:<9} call {lk['source']} -> call {lk['target']}"
              f"{'' if lk['followed'] else '  (not followed: its side kind is not trained)'}\n")
    w(f"  segments ({len(d['segments'])})\n    {'seg':>6} {'parent':>6} {'depth':>7} {'len':>7} {'kind':<10} {'call':>5}\n")
    for s in d["segments"]:
        call = "-" if s["call"] is None else s["call"]
        w(f"    {s['index']:>6} {s['parent']:>6} {s['depth']:>7} {s['len']:>7} {s['kind']:<10} {call:>5}\n")
    t = d["tokens"]
    w(f"  tokens: unique {t['unique']} (trainable {t['trainable']})  |  one sample per call {t['per_call']} ({t['dedup_vs_per_call']}x)"
      f"  |  one sample per kept leaf {t['per_kept_leaf']} ({t['dedup_vs_per_kept_leaf']}x)\n")
    w(f"  leaves ({len(d['leaves'])})\n    {'leaf':>5} {'node':>6} {'depth':>7} {'status':<9} calls\n")
    for lf in d["leaves"]:
        w(f"    {lf['index']:>5} {lf['node']:>6} {lf['depth']:>7} {lf['status']:<9} {','.join(map(str, lf['calls']))}\n")


def _print_group(g: dict[str, Any], out) -> None:
    out.write(
        f"all {g['rollouts']} rollouts packed together ({g['dropped']} dropped): forest {g['forest_tokens']} tokens"
        f"  |  one sample per call {g['per_call']} ({g['dedup_vs_per_call']}x)"
        f"  |  one sample per kept leaf {g['per_kept_leaf']} ({g['dedup_vs_per_kept_leaf']}x)\n"
    )
    if "micro_batches" in g:
        mb = g["micro_batches"]
        out.write(f"  micro-batches of {mb['micro_batch_tokens']}: {mb['num_batches']} batches, {mb['num_tokens']} rows "
                  f"({mb['num_context_tokens']} re-included context), {mb['num_targets']} targets, "
                  f"fill mean {mb['fill_mean']:.3f} min {mb['fill_min']:.3f}\n")


def run(args: argparse.Namespace) -> int:
    from clawfast.threads import KINDS, reconstruct, trained_kinds, with_kinds
    from clawfast.tree import build_tree

    try:
        trained = trained_kinds([k.strip() for k in args.train_threads.split(",") if k.strip()])
    except ValueError as exc:
        print(f"clawfast tree inspect: --train-threads {exc}", file=sys.stderr)
        return 2

    try:
        rollouts = load_rollouts(args.rollout, recover=args.recover)
    except (FileNotFoundError, IsADirectoryError, RecordFormatError) as exc:
        print(f"clawfast tree inspect: {exc}", file=sys.stderr)
        return 1
    if not rollouts:
        print(f"clawfast tree inspect: no .cfr rollouts in {args.rollout}", file=sys.stderr)
        return 1
    described, trees, skipped = [], [], []
    for rollout in rollouts:
        if not rollout.calls:
            skipped.append({"rollout_id": rollout.rollout_id, "reason": "no calls"})
            continue
        try:
            threads = reconstruct(rollout.calls)
            calls = with_kinds(rollout.calls, threads)
            tree = build_tree(calls, max_kept_leaves=args.max_kept_leaves, drop_dead=not args.keep_dead,
                              exclude_tags=frozenset(KINDS) - frozenset(trained))
        except ValueError as exc:
            skipped.append({"rollout_id": rollout.rollout_id, "reason": str(exc)})
            continue
        trees.append(tree)
        described.append(describe_rollout(dataclasses.replace(rollout, calls=calls), tree, threads, trained))
    try:
        group = describe_group(trees, args.micro_batch_tokens) if trees else None
    except ValueError as exc:  # e.g. a kept path longer than --micro-batch-tokens
        print(f"clawfast tree inspect: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump({"rollouts": described, "skipped": skipped, "group": group}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for d in described:
            _print_rollout(d, sys.stdout)
        for s in skipped:
            print(f"rollout {s['rollout_id']}: skipped ({s['reason']})")
        if group is not None and (len(trees) > 1 or args.micro_batch_tokens is not None):
            _print_group(group, sys.stdout)
    return 1 if skipped and not described else 0
