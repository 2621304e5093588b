"""Tree attention: `clawfast.kernels.tree_attention` (``backend="torch"``, the CPU fast path, with
`TreeMask` of ``kv_end``) against AReaL's FlexAttention path (`_tree_attn_fwd_func` of
``areal.models.tree_attn.module_fsdp``: torch.compile'd ``flex_attention`` with the BlockMask of
`build_block_mask_from_trie`), on one packed prefix tree of harness-shaped sequences.

Inputs: a harness-shaped rollout (`packing.rollout`, seed 0); each call's ``prompt_ids +
output_ids`` is one sequence. AReaL packs them with its own `build_packed_tree_batch` at
``max_tokens_per_mb = S``; its first tree is attended. We pack the calls of that tree with our own
packer (`packing.ours`, one batch). q, k, v of a row are looked up from (token id, position id) in
fixed random tables, so both layouts hold the same q/k/v for the same token of the same sequence,
whatever order each packer gives its rows. Float32, 4 query / 2 key-value heads, head_dim 64.

Equality, checked before timing: for every sequence of the tree and every position in it, the
attention output at its row on our side equals the output at its row on AReaL's side (rows found
from AReaL's trie, `get_sequence_tree_indices`, and from our ``kv_end`` paths), max abs difference
relative to the largest output entry <= TOL (1e-4, as the log-prob section's float32 comparison:
typically 3e-7 here, but a CPU run once measured 2.4e-5, which is float32 summation order, not a
wrong row: one wrong row is off by the size of an output). AReaL's padding rows are not compared.

Rows: forward per layer (both mask structures built beforehand, as both trainers reuse one per
micro-batch); the mask structure itself (ours `TreeMask` + its block schedule vs AReaL's
`build_block_mask_from_trie`, whose BlockMask's mask_mod closes over the dense S x S bool mask); our
forward + backward alone: FlexAttention has no backward on CPU (the GPU fwd+bwd comparison is in
bench/gpu_kernels.py).
"""

from __future__ import annotations

import ctypes
import gc
import importlib.metadata
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: memory.py

from memory import measure  # noqa: E402

NAME = "attention"
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
TOL = 1e-4  # float32, two softmaxes that sum in different orders: relative to the largest entry
TABLE = 4099  # rows of the q/k/v lookup tables (prime: (token, position) pairs spread over them)
MIB = 2**20


def _qkv(torch, tokens, positions):
    """q, k, v [N, H, D] of rows given their token and position ids: a pure function of (token,
    position), so the same token of the same sequence gets the same q/k/v on both sides."""
    gen = torch.Generator().manual_seed(0)
    tq = torch.randn(TABLE, HEADS, HEAD_DIM, generator=gen)
    tk = torch.randn(TABLE, KV_HEADS, HEAD_DIM, generator=gen)
    tv = torch.randn(TABLE, KV_HEADS, HEAD_DIM, generator=gen)
    at = (torch.as_tensor(tokens).long() * 1_000_003 + torch.as_tensor(positions).long() * 7919) % TABLE
    return tq[at].contiguous(), tk[at].contiguous(), tv[at].contiguous()


def _areal_rows(trie) -> dict:
    """Per sequence id of the tree: its packed rows, position by position."""
    import numpy as np

    return {sid: np.concatenate([np.arange(s, e + 1) for s, e in trie.get_sequence_tree_indices(sid)])
            for sid in trie.all_sequence_ids}


def _our_rows(batch, seq):
    """Rows of ``seq`` in our batch: the first len(seq) rows of a root-to-leaf path (read through
    kv_end) whose tokens start with it; in a token trie that prefix is unique."""
    import numpy as np

    rows = np.arange(len(batch.kv_end))
    for leaf in batch.leaf_rows:
        path = np.flatnonzero((rows <= leaf) & (batch.kv_end >= leaf))
        if len(path) >= len(seq) and np.array_equal(batch.input_ids[path[: len(seq)]], seq):
            return path[: len(seq)]
    raise AssertionError(f"clawfast: a sequence of {len(seq)} tokens is no prefix of any root-to-leaf path")


def _case(quick: bool) -> dict:
    import numpy as np
    import packing
    import torch
    from areal.api.cli_args import MicroBatchSpec
    from areal.models.tree_attn.module_fsdp import _tree_attn_fwd_func
    from areal.models.tree_attn.tree import build_block_mask_from_trie, build_packed_tree_batch

    from clawfast.kernels import TreeMask, tree_attention

    torch.set_num_threads(2)
    version = importlib.metadata.version("areal")
    # Prompts grow to S/2 so a first tree of S rows holds many calls sharing prefixes.
    size, n_calls, repeats = (2048, 16, 3) if quick else (16384, 48, 3)
    calls = packing.rollout(n_calls, size // 2, None)
    seqs = packing.sequences(calls)

    # AReaL: its packer, its first tree, its block mask, its attention entry point.
    mb = build_packed_tree_batch(packing.areal_input(seqs), MicroBatchSpec(max_tokens_per_mb=size)).mbs[0]
    trie = mb["trie_node"]
    a_rows = _areal_rows(trie)
    a_ids, a_pos = mb["input_ids"][0], mb["position_ids"][0]
    block = build_block_mask_from_trie(trie, size, torch.device("cpu"))
    aq, ak, av = _qkv(torch, a_ids, a_pos)

    def areal_fwd():
        with torch.no_grad():  # [B, S, H, D], AReaL's HF-side layout
            return _tree_attn_fwd_func(aq[None], ak[None], av[None], tree_block_mask=block)[0]

    # Ours: the same calls (those in AReaL's first tree), our packer, one batch of <= S rows.
    in_order = packing.in_call_order(calls)  # seqs[i] is in_order[i]'s sequence: AReaL's sequence id i
    batches = packing.ours([in_order[sid] for sid in sorted(a_rows)], size)
    assert len(batches) == 1, f"clawfast packed AReaL's first tree into {len(batches)} batches at {size} rows"
    b = batches[0]
    kv_end = torch.from_numpy(b.kv_end.astype(np.int64))
    mask = TreeMask(kv_end)
    oq, ok, ov = _qkv(torch, b.input_ids, b.position_ids)

    def ours_fwd():
        with torch.no_grad():
            return tree_attention(oq, ok, ov, mask, backend="torch")

    # Check, per (sequence, position), before any timing. AReaL's first call compiles.
    t0 = time.perf_counter()
    a_out = areal_fwd()
    compile_s = time.perf_counter() - t0
    o_out = ours_fwd()
    a_at = np.concatenate([a_rows[sid] for sid in sorted(a_rows)])
    o_at = np.concatenate([_our_rows(b, seqs[sid]) for sid in sorted(a_rows)])
    assert np.array_equal(a_ids.numpy()[a_at], b.input_ids[o_at]), "row maps disagree on tokens"
    ref = a_out[torch.from_numpy(a_at)].double()
    diff = float((o_out[torch.from_numpy(o_at)].double() - ref).abs().max() / ref.abs().max())
    assert diff <= TOL, f"attention outputs disagree: max diff {diff:.3g} (relative to max) > {TOL}"

    shape = (f"{len(a_rows)} sequences ({len(a_at):,} tokens), packed rows ours {b.num_tokens:,} vs areal "
             f"{size:,} (padded), {HEADS}q/{KV_HEADS}kv heads, head_dim {HEAD_DIM}, fp32")
    check = (f"per (sequence, position): {len(a_at):,} outputs equal within {TOL} relative to max "
             f"(q/k/v from (token, position) tables)")
    return locals()


def _flex_backward_error(torch, q, k, v, block) -> str:
    """Whether AReaL's compiled flex path has a backward on this CPU (torch 2.13: no)."""
    from areal.models.tree_attn.module_fsdp import _tree_attn_fwd_func

    qq = q[None].clone().requires_grad_()
    try:
        _tree_attn_fwd_func(qq, k[None], v[None], tree_block_mask=block).sum().backward()
        return ""
    except Exception as exc:  # noqa: BLE001 - the error is what the note reports
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def _flex_dynamic() -> bool:
    from areal.models.tree_attn import module_fsdp

    return module_fsdp._FLEX_DYNAMIC


def _row(case, c, ours, peer, t_ours, t_peer, check, diff, tol, note) -> dict:
    (ours_s, ours_mib), (peer_s, peer_mib) = t_ours, t_peer
    return {"case": case, "shape": c["shape"], "ours": ours, "peer": peer, "ours_s": ours_s, "peer_s": peer_s,
            "ours_mib": ours_mib, "peer_mib": peer_mib,
            "speedup": peer_s / ours_s if peer_s is not None else None,
            "mem_ratio": ours_mib / peer_mib if peer_mib else None,
            "check": check, "max_diff": diff, "tol": tol, "note": note}


def _timed(fn, repeats):
    gc.collect()
    # Hand freed heap pages back first: else a call reuses pages an earlier (bigger) step left
    # resident and its peak extra reads as 0.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return measure(fn, repeats)


def run(quick: bool) -> list[dict]:
    import torch
    from areal.models.tree_attn.tree import build_block_mask_from_trie

    from clawfast.kernels import TreeMask, tree_attention

    c = _case(quick)
    reps, size, v = c["repeats"], c["size"], c["version"]
    rows = []

    t_ours, t_peer = _timed(c["ours_fwd"], reps), _timed(c["areal_fwd"], reps)
    rows.append(_row("tree attention forward vs areal flex", c, 'clawfast.kernels.tree_attention(backend="torch")',
                     f"areal {v} _tree_attn_fwd_func (torch.compile(flex_attention), its BlockMask)",
                     t_ours, t_peer, c["check"], c["diff"], TOL,
                     f"no_grad forward of one layer, mask structures prebuilt; areal's first call (torch.compile "
                     f"of flex_attention, dynamic={_flex_dynamic()}, on CPU) took {c['compile_s']:.1f} s, not "
                     f"timed; areal attends all {size:,} padded rows"))

    kv_end, trie, block = c["kv_end"], c["trie"], c["block"]

    def ours_mask():
        m = TreeMask(kv_end)
        m.schedule(128)  # the block schedule the CPU path uses (cached per mask)
        return m

    def peer_mask():  # timed once at 16K rows: about 9 s a build on 2 cores
        return build_block_mask_from_trie(trie, size, torch.device("cpu"))

    held = sum(x.cell_contents.numel() * x.cell_contents.element_size() for x in block.mask_mod.__closure__
               if torch.is_tensor(x.cell_contents))
    tables = sum(x.numel() * x.element_size() for x in block.as_tuple() if torch.is_tensor(x))
    sched = ours_mask().schedule(128)
    ours_bytes = kv_end.numel() * 4 + sum(x.numel() * x.element_size() for x in vars(sched).values()
                                          if torch.is_tensor(x))
    rows.append(_row("tree mask structure vs areal block mask", c, "clawfast.kernels.TreeMask(kv_end) + schedule(128)",
                     f"areal {v} build_block_mask_from_trie", _timed(ours_mask, reps),
                     _timed(peer_mask, 1 if size > 4096 else reps),
                     "same tree (outputs checked in the forward row)", c["diff"], TOL,
                     f"held after build: ours kv_end int32 + schedule {ours_bytes / MIB:.3f} MiB vs areal "
                     f"BlockMask {(held + tables) / MIB:.1f} MiB (its mask_mod keeps the dense {size} x {size} bool "
                     f"mask, {held / MIB:.1f} MiB, alive); built once per micro-batch by both"))

    oq, ok, ov = c["oq"], c["ok"], c["ov"]
    grad = torch.randn(oq.shape, generator=torch.Generator().manual_seed(1))

    def ours_step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (oq, ok, ov))
        tree_attention(qq, kk, vv, c["mask"], backend="torch").backward(grad)
        return qq.grad, kk.grad, vv.grad

    # Last: a call with requires_grad makes torch.compile retrace, which must not land in a timing.
    flex_bwd = _flex_backward_error(torch, c["aq"], c["ak"], c["av"], block)
    rows.append(_row("tree attention forward+backward (ours alone)", c,
                     'clawfast.kernels.tree_attention(backend="torch") fwd+bwd', "none on CPU",
                     _timed(ours_step, reps), (None, None), "n/a (no peer backward on CPU)", 0.0, 0.0,
                     f"areal's flex path has no CPU backward here ({flex_bwd or 'it ran: time it'}); the GPU "
                     f"fwd+bwd comparison is bench/gpu_kernels.py"))
    return rows


if __name__ == "__main__":
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/peers/: packing.py
    print(json.dumps(run("--quick" in sys.argv[1:]), indent=1))
