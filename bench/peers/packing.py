"""Peer benchmark: prefix-tree packing, clawfast against AReaL's and TRL's own tree packers.

Inputs: one harness-shaped rollout (`clawfast.synthetic.harness_like_rollout`, seed 0); each call's
``prompt_ids + output_ids`` is one sequence, handed to the peers in call order as they would receive
it (AReaL: a right-padded ``input_ids`` / ``attention_mask`` batch; TRL: one sample dict per call).
Both sides get the same token budget per packed row. Ours is `clawfast.tree.build_tree` (with
``drop_dead=False, exclude_tags=()``, so it packs every call as the peers do, not only the kept
leaves its trainer would) + `clawfast.pack.pack`, timed from the `CallRecord`s; the peers are timed
from their input format, built beforehand.

Cases (full run): AReaL's public `build_packed_tree_batch` at a reduced size (64 calls whose prompts
grow to 8K: it fills a dense S x S mask per tree to derive position ids, O(sum of squared sequence
lengths), about 25 min at bench_tree's 1x size); its trie stage `_greedy_build_tries` alone (no mask, no
position ids: a lower bound of its time) at bench_tree's 1x size; TRL's `TreeRow` (the tree packer of
its experimental AsyncGRPO trainer) at 1x. TRL has no ``packing="tree"`` option; its SFT packing
(`pack_dataset`, BFD) shares no prefixes and needs pyarrow/datasets, which the peers' venv lacks.

Equality, checked before timing on each side's packed output: every root-to-leaf token path is one
of the input sequences and every input sequence is a prefix of some root-to-leaf path (so both sides
hold the same set of maximal sequences), and where the side emits position ids they count 0, 1, ...
along every path. Our paths are read through ``kv_end`` (the ancestors of row i are the rows j with
j <= i <= kv_end[j]), so the check covers the attention structure we hand the kernel.
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch

from clawfast.pack import pack
from clawfast.synthetic import harness_like_rollout
from clawfast.tree import build_tree

NAME = "packing"
MIB = 2**20


def rollout(n_calls: int, max_prompt_tokens: int, tokens_per_call: int | None) -> list:
    # bench_tree.make_rollout's parameters (its 1x size is 64 calls, 65536, 1000 tokens per call).
    return harness_like_rollout(np.random.default_rng(0), n_calls=n_calls, max_prompt_tokens=max_prompt_tokens,
                                retry_frac=0.1, subagent_chains=2, tokens_per_call=tokens_per_call, shuffle=True)


def in_call_order(calls) -> list:
    return sorted(calls, key=lambda c: c.call_index)


def sequences(calls) -> list[np.ndarray]:
    return [np.concatenate([c.prompt_ids, c.output_ids]).astype(np.int64) for c in in_call_order(calls)]


def ours(calls, budget: int):
    return pack([build_tree(calls, drop_dead=False, exclude_tags=())], budget)


def our_paths(batches) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, position ids) of every root-to-leaf path, its rows taken from ``kv_end``."""
    paths = []
    for b in batches:
        rows = np.arange(len(b.kv_end))
        for leaf in b.leaf_rows:
            path = np.flatnonzero((rows <= leaf) & (b.kv_end >= leaf))
            paths.append((b.input_ids[path], b.position_ids[path]))
    return paths


def areal_input(seqs: list[np.ndarray]) -> dict[str, torch.Tensor]:
    width = max(map(len, seqs))
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention_mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.from_numpy(s)
        attention_mask[i, : len(s)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def areal_packed_paths(mbs) -> list[tuple[np.ndarray, np.ndarray]]:
    """Root-to-leaf paths of `build_packed_tree_batch`'s micro-batches, read from their packed
    ``input_ids`` / ``position_ids`` at the positions its trie nodes name."""
    paths = []
    for mb in mbs:
        ids, pos = mb["input_ids"][0].numpy(), mb["position_ids"][0].numpy()
        for node in mb["trie_node"].nodes:
            if not node.children:
                at = np.concatenate([np.arange(s, e + 1) for s, e in node.get_all_tree_indices()])
                paths.append((ids[at], pos[at]))
    return paths


def areal_trie_paths(tries) -> list[tuple[np.ndarray, None]]:
    return [(np.concatenate([np.asarray(n.tokens) for n in (*node.ancestors, node)]), None)
            for trie in tries for node in trie.nodes if not node.children]


def trl_samples(calls) -> list[dict]:
    samples = []
    for c in in_call_order(calls):
        n_prompt, n_out = len(c.prompt_ids), len(c.output_ids)
        samples.append({
            "input_ids": torch.from_numpy(np.concatenate([c.prompt_ids, c.output_ids]).astype(np.int64)),
            "completion_mask": torch.cat([torch.zeros(n_prompt, dtype=torch.long), torch.ones(n_out, dtype=torch.long)]),
            "old_log_probs": torch.cat([torch.zeros(n_prompt), torch.from_numpy(c.infer_logprobs)]),
            "advantage": 0.0,
            "group_id": 0,  # one rollout: every call belongs to one group
        })
    return samples


def trl_pack(tree_row, samples: list[dict], budget: int) -> list[dict]:
    # TokenBudgetBatcher's placement with one DP rank (it lives in async_grpo_trainer, which imports
    # `datasets`): a sample joins the open row if it fits, else the row is emitted and a new one opens.
    rows = [tree_row()]
    for s in samples:
        if not rows[-1].fits(s, budget):
            rows.append(tree_row())
        rows[-1].add(s)
    return [r.pack() for r in rows]


def trl_paths(packed: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Root-to-leaf paths of TRL's rows: segment t's path is tree_kv_index[cu_k[t]:cu_k[t+1]]; a
    segment is a leaf when no other segment's path runs through its last token."""
    paths = []
    for p in packed:
        cu_q, cu_k = p["tree_cu_seqlens_q"].numpy(), p["tree_cu_seqlens_k"].numpy()
        kv, ids, pos = p["tree_kv_index"].numpy(), p["input_ids"].numpy(), p["position_ids"].numpy()
        seg_of = np.repeat(np.arange(len(cu_q) - 1), np.diff(cu_q))
        has_child = np.zeros(len(cu_q) - 1, dtype=bool)
        for t in range(len(cu_q) - 1):
            own, path = cu_q[t + 1] - cu_q[t], kv[cu_k[t] : cu_k[t + 1]]
            if len(path) > own:
                has_child[seg_of[path[-own - 1]]] = True
        for t in np.flatnonzero(~has_child):
            path = kv[cu_k[t] : cu_k[t + 1]]
            paths.append((ids[path], pos[path]))
    return paths


def check_paths(side: str, paths, seqs: list[np.ndarray]) -> int:
    """Raise unless `paths` hold exactly the maximal input sequences; returns the number of leaves."""
    inputs = {s.tobytes() for s in seqs}
    leaves = [np.asarray(tokens, dtype=np.int64).tobytes() for tokens, _ in paths]
    invented = sum(leaf not in inputs for leaf in leaves)
    assert not invented, f"{side}: {invented} of {len(leaves)} root-to-leaf paths are no input sequence"
    missing = sum(not any(leaf.startswith(s) for leaf in leaves) for s in inputs)
    assert not missing, f"{side}: {missing} of {len(inputs)} input sequences are no prefix of a root-to-leaf path"
    bad_pos = sum(pos is not None and not np.array_equal(pos, np.arange(len(pos))) for _, pos in paths)
    assert not bad_pos, f"{side}: position ids of {bad_pos} root-to-leaf paths do not count 0, 1, ..."
    return len(leaves)


def timed(fn, repeats: int) -> tuple[float, float]:
    from memory import measure

    gc.collect()
    return measure(fn, repeats)


def shape(calls, budget: int) -> str:
    n_in = sum(len(c.prompt_ids) + len(c.output_ids) for c in calls)
    return f"{len(calls)} calls, {n_in / 1e6:.2f}M input tokens, micro_batch_tokens {budget}"


def row(case, calls, budget, peer, t_ours, t_peer, check, note) -> dict:
    (ours_s, ours_mib), (peer_s, peer_mib) = t_ours, t_peer
    return {
        "case": case, "shape": shape(calls, budget),
        "ours": "clawfast.tree.build_tree(drop_dead=False, exclude_tags=()) + clawfast.pack.pack", "peer": peer,
        "ours_s": ours_s, "peer_s": peer_s, "ours_mib": ours_mib, "peer_mib": peer_mib,
        "speedup": peer_s / ours_s, "mem_ratio": ours_mib / peer_mib if peer_mib > 0 else None,
        "check": check, "max_diff": 0.0, "tol": 0.0, "note": note,
    }


def our_side(calls, budget: int, seqs, repeats: int) -> dict:
    batches = ours(calls, budget)
    return {
        "leaves": check_paths("clawfast", our_paths(batches), seqs),
        "tokens": sum(b.num_tokens for b in batches),
        "kv_end_mib": sum(b.kv_end.nbytes for b in batches) / MIB,
        "timed": timed(lambda: ours(calls, budget), repeats),
    }


def check_text(mine: dict, their_leaves: int, extra: str = "") -> str:
    return (f"on both sides every root-to-leaf token path is an input sequence and every input sequence a "
            f"prefix of one ({mine['leaves']} paths ours, {their_leaves} theirs){extra}")


def areal_full_case(calls, budget: int, version: str, repeats: tuple[int, int]) -> dict:
    from areal.api.cli_args import MicroBatchSpec
    from areal.models.tree_attn.tree import build_block_mask_from_trie, build_packed_tree_batch

    seqs = sequences(calls)
    data, spec = areal_input(seqs), MicroBatchSpec(max_tokens_per_mb=budget)
    mbl = build_packed_tree_batch(data, spec)
    leaves = check_paths("areal", areal_packed_paths(mbl.mbs), seqs)
    mine = our_side(calls, budget, seqs, repeats[0])
    # What its forward builds per tree before attention: a BlockMask whose mask_mod closes over the
    # dense S x S mask, so the dense mask stays resident as long as the BlockMask does.
    block = build_block_mask_from_trie(mbl.mbs[0]["trie_node"], budget, torch.device("cpu"))
    held = [c.cell_contents for c in block.mask_mod.__closure__ if torch.is_tensor(c.cell_contents)]
    tables = sum(x.numel() * x.element_size() for x in block.as_tuple() if torch.is_tensor(x))
    per_tree_mib = (tables + sum(x.numel() * x.element_size() for x in held)) / MIB
    t_block, _ = timed(lambda: build_block_mask_from_trie(mbl.mbs[0]["trie_node"], budget, torch.device("cpu")), 0)
    del block, held
    n_trees, real = len(mbl.mbs), sum(mbl.group_lens)
    peer_t = timed(lambda: build_packed_tree_batch(data, spec), repeats[1])
    note = (f"packed tokens ours {mine['tokens']:,} vs areal {real:,} (padded to {n_trees} trees x {budget} = "
            f"{n_trees * budget:,}: pad_to_maximum is mandatory); attention structure ours kv_end int32 "
            f"{mine['kv_end_mib']:.3f} MiB vs areal {n_trees} x {per_tree_mib:.1f} MiB (dense S x S bool held by "
            f"its BlockMask + block tables), which its forward rebuilds per tree in {t_block:.2f} s on top of "
            f"the packing time; it also fills that dense mask inside build_packed_tree_batch to derive position "
            f"ids, O(sum of squared sequence lengths), so this case is smaller than bench_tree's 1x size "
            f"(about 25 min for AReaL there, extrapolated: 67x the squared lengths)")
    return row("tree packing vs areal build_packed_tree_batch", calls, budget,
               f"areal {version} build_packed_tree_batch", mine["timed"], peer_t,
               check_text(mine, leaves, ", position ids 0..len-1 along every path"), note)


def areal_trie_case(calls, budget: int, version: str, repeats: tuple[int, int]) -> dict:
    from areal.models.tree_attn.tree import _greedy_build_tries

    seqs = sequences(calls)
    data = areal_input(seqs)
    tries, n_tokens = _greedy_build_tries(data, budget)
    leaves = check_paths("areal", areal_trie_paths(tries), seqs)
    mine = our_side(calls, budget, seqs, repeats[0])
    peer_t = timed(lambda: _greedy_build_tries(data, budget), repeats[1])
    note = (f"packed tokens ours {mine['tokens']:,} vs areal {sum(n_tokens):,} in {len(tries)} "
            f"trees; areal's trie stage only (first step of build_packed_tree_batch: per-token Python trie, "
            f"first-fit of whole sequences, compression), no position ids or mask, so a lower bound of its "
            f"packing time; the rest would pad each tree to {budget} and fill a dense {budget} x {budget} bool "
            f"mask per tree ({budget * budget / MIB:,.0f} MiB each) vs our kv_end int32 "
            f"{mine['kv_end_mib']:.3f} MiB")
    return row("tree packing vs areal trie stage", calls, budget, f"areal {version} _greedy_build_tries",
               mine["timed"], peer_t, check_text(mine, leaves), note)


def trl_case(calls, budget: int, version: str, repeats: tuple[int, int]) -> dict:
    # Loaded from its file: trl/experimental/async_grpo/__init__.py imports the trainer, which needs
    # `datasets`; packing.py itself needs only torch and transformers.
    location = Path(importlib.util.find_spec("trl").origin).parent / "experimental" / "async_grpo" / "packing.py"
    spec = importlib.util.spec_from_file_location("trl_async_grpo_packing", location)
    trl_packing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trl_packing)

    seqs, samples = sequences(calls), trl_samples(calls)
    packed = trl_pack(trl_packing.TreeRow, samples, budget)
    leaves = check_paths("trl", trl_paths(packed), seqs)
    mine = our_side(calls, budget, seqs, repeats[0])
    peer_t = timed(lambda: trl_pack(trl_packing.TreeRow, samples, budget), repeats[1])
    attn = sum(p[k].numel() * p[k].element_size() for p in packed
               for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")) / MIB
    note = (f"packed tokens ours {mine['tokens']:,} vs trl {sum(len(p['input_ids']) for p in packed):,} in "
            f"{len(packed)} rows (its nodes key on (token, next token): a fork costs a token, and every sample "
            f"ends on its own leaf); attention structure ours kv_end int32 {mine['kv_end_mib']:.3f} MiB vs trl "
            f"{attn:.1f} MiB (tree_kv_index int64: every segment's root path, + cu_seqlens); placement replays "
            f"TokenBudgetBatcher with one DP rank; TRL has no packing='tree' option, and its SFT BFD packing "
            f"shares no prefixes (not run: trl.data_utils needs pyarrow/datasets)")
    return row("tree packing vs trl TreeRow", calls, budget, f"trl {version} experimental.async_grpo TreeRow",
               mine["timed"], peer_t, check_text(mine, leaves, ", position ids 0..len-1 along every path"), note)


def run(quick: bool) -> list[dict]:
    areal_v, trl_v = importlib.metadata.version("areal"), importlib.metadata.version("trl")
    if quick:
        tiny = rollout(16, 2048, None)
        return [areal_full_case(tiny, 2048, areal_v, (1, 1)), areal_trie_case(tiny, 2048, areal_v, (1, 1)),
                trl_case(tiny, 2048, trl_v, (1, 1))]
    one_x = rollout(64, 65536, 1000)
    return [areal_full_case(rollout(64, 8192, None), 8192, areal_v, (5, 1)),
            areal_trie_case(one_x, 65536, areal_v, (5, 3)), trl_case(one_x, 65536, trl_v, (5, 3))]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `memory`
    print(json.dumps(run("--quick" in sys.argv[1:]), indent=1))
