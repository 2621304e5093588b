"""`clawfast fidelity RECORDS|RUN_DIR`: how faithfully the captured calls continue one another.

For every rollout (a `.cfr` file, or every one under a directory, a run directory's included, at
any depth) it rebuilds the threads from the tokens (`clawfast.threads.reconstruct`: the proxy's tags
are only hints, so records written by any version are read the same way) and reports, per harness
and per rollout: calls by thread and kind, main-thread continuity (exact extensions / main calls
that extend a main call), drift tokens, and every divergence — the token where a main call leaves
the call it continues, the text on both sides (decoded with `--tokenizer`, default the embedded
model's) and its cause. `--json` prints one object (layout in docs/HARNESSES.md).

Exit status: 0; 1 when nothing could be read; 2 when --tokenizer is not a tokenizer directory. A file
that cannot be read, or whose calls cannot be made into threads (e.g. two calls with one index), is
listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from clawfast.records import FILE_SUFFIX, RecordFormatError, read_rollout
from clawfast.threads import CAUSES, KINDS, reconstruct

TEXT_WINDOW = 48  # tokens of context shown on each side of a divergence


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("records", metavar="RECORDS|RUN_DIR", help="a .cfr rollout file or a directory holding them (searched recursively)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="tokenizer to decode divergences with (default: the embedded model's)")
    parser.add_argument("--recover", action="store_true", help="read live or torn logs (keep complete calls)")


def record_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(path.rglob(f"*{FILE_SUFFIX}"))
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    return [path]


def describe(rollout, decode) -> dict[str, Any]:
    """The JSON-ready fidelity of one rollout."""
    rt = reconstruct(rollout.calls)
    by_index = {c.call_index: c for c in rollout.calls}
    divergences = []
    for d in rt.divergences:
        against, call = by_index[d.against], by_index[d.call_index]
        expected = np.concatenate([against.prompt_ids, against.output_ids])
        got = call.prompt_ids
        divergences.append({
            "call_index": d.call_index, "against": d.against, "token_index": d.token_index, "cause": d.cause,
            "before": decode(got[max(d.token_index - TEXT_WINDOW, 0): d.token_index]),
            "expected": decode(expected[d.token_index: d.token_index + TEXT_WINDOW]),
            "got": decode(got[d.token_index: d.token_index + TEXT_WINDOW]),
        })
    return {
        "rollout_id": rollout.rollout_id,
        "harness": rollout.harness,
        "task_id": rollout.task_id,
        "status": rollout.status,
        "continuity": rt.continuity,
        "main_pairs": rt.main_pairs,
        "exact_pairs": rt.exact_pairs,
        "drift_tokens": rt.drift,
        "calls": [
            {"call_index": t.call_index, "thread": t.thread, "kind": t.kind, "extends": t.extends,
             "hint": list(by_index[t.call_index].tags), "reason": t.reason}
            for t in rt.calls
        ],
        "divergences": divergences,
    }


def summarise(rollouts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per harness: rollouts, calls by kind, continuity over all its main pairs, divergences by cause."""
    out: dict[str, dict[str, Any]] = {}
    for r in rollouts:
        h = out.setdefault(r["harness"], {"rollouts": 0, "calls": Counter(), "main_pairs": 0, "exact_pairs": 0,
                                          "drift_tokens": 0, "divergences": Counter()})
        h["rollouts"] += 1
        h["calls"].update(c["kind"] for c in r["calls"])
        h["main_pairs"] += r["main_pairs"]
        h["exact_pairs"] += r["exact_pairs"]
        h["drift_tokens"] += r["drift_tokens"]
        h["divergences"].update(d["cause"] for d in r["divergences"])
    for h in out.values():
        h["continuity"] = h["exact_pairs"] / h["main_pairs"] if h["main_pairs"] else 1.0
        h["calls"] = {k: h["calls"][k] for k in KINDS if h["calls"][k]}
        h["divergences"] = {k: h["divergences"][k] for k in CAUSES if h["divergences"][k]}
    return out


def _decoder(tokenizer_dir: str | None):
    """decode(ids) -> text with the tokenizer in `tokenizer_dir` (None: the embedded model's); raises
    ValueError, naming --tokenizer, when that is not a directory holding a tokenizer."""
    from transformers import AutoTokenizer

    if tokenizer_dir is None:
        from clawfast.embedded import ensure_embedded_model

        tokenizer_dir = str(ensure_embedded_model())
    elif not Path(tokenizer_dir).is_dir():
        # Not left to transformers: it would take the path for a hub repository id and say that is malformed.
        raise ValueError(f"--tokenizer {tokenizer_dir}: no such directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as exc:  # transformers' message spans lines: reported in one
        message = " ".join(str(exc).split())
        raise ValueError(f"--tokenizer {tokenizer_dir}: cannot load a tokenizer: {message}") from None
    vocab = len(tokenizer)

    def decode(ids) -> str:
        ids = [int(i) for i in ids]
        if any(i >= vocab for i in ids):  # recorded with another tokenizer: show the ids
            return " ".join(map(str, ids))
        return tokenizer.decode(ids)

    return decode


def _print(summary: dict[str, dict[str, Any]], rollouts: list[dict[str, Any]], out) -> None:
    w = out.write
    w(f"{'harness':<16} {'rollouts':>8} {'continuity':>11} {'pairs':>7} {'drift':>7}  calls by kind / divergences by cause\n")
    for name, h in sorted(summary.items()):
        kinds = ", ".join(f"{k} {n}" for k, n in h["calls"].items())
        causes = ", ".join(f"{k} {n}" for k, n in h["divergences"].items()) or "none"
        w(f"{name:<16} {h['rollouts']:>8} {h['continuity']:>11.4f} {h['main_pairs']:>7} {h['drift_tokens']:>7}  {kinds} / {causes}\n")
    for r in rollouts:
        threads = Counter(c["thread"] for c in r["calls"])
        w(f"\nrollout {r['rollout_id']}  harness {r['harness']}  status {r['status']}  continuity "
          f"{r['exact_pairs']}/{r['main_pairs']}  threads: " + ", ".join(f"{t} ({n})" for t, n in threads.items()) + "\n")
        for c in r["calls"]:
            extends = "-" if c["extends"] is None else c["extends"]
            w(f"  call {c['call_index']:>4}  {c['kind']:<11} {c['thread']:<16} extends {extends!s:>4}  "
              f"hint {','.join(c['hint']):<11} {c['reason']}\n")
        for d in r["divergences"]:
            w(f"  divergence: call {d['call_index']} leaves call {d['against']} at token {d['token_index']} ({d['cause']})\n"
              f"    before:   {d['before'][-200:]!r}\n    expected: {d['expected'][:200]!r}\n    got:      {d['got'][:200]!r}\n")


def run(args: argparse.Namespace) -> int:
    try:
        files = record_files(Path(args.records))
    except FileNotFoundError as exc:
        print(f"clawfast fidelity: {exc}", file=sys.stderr)
        return 1
    if not files:
        print(f"clawfast fidelity: no {FILE_SUFFIX} rollouts under {args.records}", file=sys.stderr)
        return 1
    try:
        decode = _decoder(args.tokenizer)
    except ValueError as exc:
        print(f"clawfast fidelity: {exc}", file=sys.stderr)
        return 2
    described, skipped = [], []
    for path in files:
        try:
            rollout = read_rollout(path, recover=args.recover)
        except (RecordFormatError, OSError) as exc:
            skipped.append({"path": str(path), "reason": str(exc)})
            continue
        if not rollout.calls:
            skipped.append({"path": str(path), "reason": "no calls"})
            continue
        try:
            described.append(describe(rollout, decode))
        except ValueError as exc:  # `reconstruct` refuses the calls (e.g. two with one call index)
            skipped.append({"path": str(path), "reason": str(exc)})
    summary = summarise(described)
    if args.json:
        json.dump({"rollouts": described, "harnesses": summary, "skipped": skipped}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print(summary, described, sys.stdout)
        for s in skipped:
            print(f"skipped {s['path']}: {s['reason']}")
    return 0 if described else 1
