"""The recorded MoE routing of each packed row, for routing replay (`algorithm.routing_replay`,
docs/MODELS.md "Routing replay"; the forcing itself is `clawfast.moe_routing`, what a call stores
`clawfast.routing_store`).

Under replay a row is one computation: a token under a prefix *with the experts the engine chose
there*. Two calls (or two rollouts) whose paths share tokens but whose engine routed a shared row
differently (it ran that row twice, and rounding flipped a near tie) did two different computations
from that row on, and a tree that merged them could replay only one. So the tree and the packer
merge rows by **keys** instead of token ids: a row with no recorded routing keeps its token id as
its key; a row with one gets ``vocab + i``, i numbering the distinct (token, routing) pairs of the
step. The prefix tree and the packer run unchanged on the keys; the packed batches are turned back
into token ids (`RoutingKeys.unkey`) with each row's routing beside them.

Which rows have a routing (`clawfast.routing_store.RolloutRouting`): "all", every row some call
stored or took from its parent; "generated", only rows of tokens the engine sampled in the call that
stored them (a prompt's rows are routed by the trainer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from clawfast.records import RolloutResult
from clawfast.routing_store import RolloutRouting


@dataclass(eq=False)
class RoutingKeys:
    """Keys below `vocab` are token ids (no routing); key ``vocab + i`` is token ``token[i]`` routed
    to ``routing[i]`` ([layers, top_k])."""

    vocab: int
    token: np.ndarray
    routing: np.ndarray

    def unkey(self, batch) -> None:
        """A batch packed from keyed trees: token ids back in ``input_ids`` / ``target_ids``, and
        ``routing`` / ``routing_rows`` set (rows without one: zeros, not replayed)."""
        keys = np.asarray(batch.input_ids)
        routed = keys >= self.vocab
        batch.input_ids = self.tokens(keys)
        batch.target_ids = self.tokens(batch.target_ids)
        if routed.any():
            batch.routing = np.zeros((len(keys), *self.routing.shape[1:]), dtype=self.routing.dtype)
            batch.routing[routed] = self.routing[keys[routed] - self.vocab]
            batch.routing_rows = routed

    def tokens(self, keys: np.ndarray) -> np.ndarray:
        """The token ids of `keys` (same shape and dtype)."""
        out = np.array(keys, copy=True)
        routed = out >= self.vocab
        out[routed] = self.token[out[routed] - self.vocab]
        return out


def keyed_rollouts(rollouts: Sequence[RolloutResult], mode: str) -> tuple[list[RolloutResult], RoutingKeys]:
    """The rollouts with every call's token ids replaced by keys (module docstring), and the keys.
    `mode`: "generated" or "all". ValueError when no call recorded routing, or the rollouts'
    routings differ in shape (records of another model)."""
    if mode not in ("generated", "all"):
        raise ValueError(f"routing replay mode must be 'generated' or 'all', got {mode!r}")
    if not rollouts:
        return [], RoutingKeys(0, np.zeros(0, np.int32), np.zeros((0, 0, 0), np.uint8))
    ordered = [sorted(r.calls, key=lambda c: int(c.call_index)) for r in rollouts]
    paths = [[c.path for c in calls] for calls in ordered]
    histories, tables = [], []
    for calls, call_paths in zip(ordered, paths):
        history = RolloutRouting()
        for call, path in zip(calls, call_paths):
            history.add(path, call.routing, call.routing_start,
                        first_own=len(call.prompt_ids) if mode == "generated" else 0)
        histories.append(history)
        tables.append(history.table())
    present = [t for t in tables if t is not None]
    shapes = {t[0].shape[1:] for t in present}
    if len(shapes) > 1:
        raise ValueError(f"the rollouts recorded routing of different shapes (layers, top_k): {sorted(shapes)}")
    if not present:
        raise ValueError(f"routing replay is on ({mode!r}) but no call of the step's {len(rollouts)} rollout(s) "
                         f"recorded routing: their engine did not record it (a run records with the torch engine; "
                         f"recorded files keep what their engine gave) or the model is dense")
    vocab = 1 + max((int(p.max()) for call_paths in paths for p in call_paths), default=0)
    rows = np.concatenate([t[0] for t in present])
    width = rows.shape[1] * rows.shape[2] * rows.dtype.itemsize
    # Distinct routings, exactly: a row's bytes as one opaque value.
    _, content = np.unique(np.ascontiguousarray(rows).reshape(len(rows), -1).view(np.dtype((np.void, width)))[:, 0],
                           return_inverse=True)
    stored_tokens = np.concatenate([t[1] for t in present]).astype(np.int64)
    codes, first, key_of_row = np.unique(content.reshape(-1).astype(np.int64) * vocab + stored_tokens,
                                         return_index=True, return_inverse=True)
    if vocab + len(codes) > np.iinfo(np.int32).max:
        raise ValueError(f"{len(codes)} distinct routed rows do not fit int32 keys")
    keys = RoutingKeys(vocab, stored_tokens[first].astype(np.int32), rows[first])
    key_of_row = vocab + key_of_row.reshape(-1)
    out, offset = [], 0
    for rollout, calls, call_paths, history, table in zip(rollouts, ordered, paths, histories, tables):
        keyed = []
        for call, path, src in zip(calls, call_paths, history.sources):
            if src is None:  # no routed row: its keys are its tokens
                keyed.append(call)
                continue
            path = np.where(src >= 0, key_of_row[offset + np.maximum(src, 0)], path).astype(np.int32)
            keyed.append(replace(call, prompt_ids=path[:len(call.prompt_ids)], output_ids=path[len(call.prompt_ids):]))
        offset += len(table[0]) if table is not None else 0
        out.append(replace(rollout, calls=keyed))
    return out, keys
