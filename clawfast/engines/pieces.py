"""One answer from pieces decoded on successive weight versions (``on_update="continue"`` for an
engine that cannot pause a request and change its weights underneath: vLLM, a remote server).

At a push the engine aborts its running requests; each comes back with the tokens it sampled so far
(a `Piece`, under the version that sampled them). Once the new weights serve, the call goes on as a
new request: the prompt followed by every token sampled so far (`Pieces.prompt`; the server
computes their KV on the new weights), for what is left of the budget (`Pieces.params`). The
pieces join into one `Generation` whose tokens, log-probs and per-token versions are the pieces'
in order, ending as the last piece ended: a stop token or the budget inside either piece ends the
call exactly as it would have without the push.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from clawfast.engines.base import Generation, SamplingParams


@dataclass
class Piece:
    output_ids: np.ndarray
    infer_logprobs: np.ndarray
    version: int


@dataclass
class Pieces:
    """The pieces of one call so far: `prompt` and `params` say what its next request asks."""

    base_prompt: list[int]
    base_params: SamplingParams
    pieces: list[Piece] = field(default_factory=list)

    @property
    def sampled(self) -> int:
        return sum(len(p.output_ids) for p in self.pieces)

    def add(self, output_ids, infer_logprobs, version: int) -> None:
        ids, lps = np.asarray(output_ids, dtype=np.int32), np.asarray(infer_logprobs, dtype=np.float32)
        if len(ids) != len(lps):
            raise RuntimeError(f"a piece of {len(ids)} tokens came back with {len(lps)} log-probs")
        self.pieces.append(Piece(ids, lps, int(version)))

    @property
    def left(self) -> int:
        """What is left of the call's budget (0: spent, and no next request is made)."""
        return self.base_params.max_tokens - self.sampled

    @property
    def prompt(self) -> list[int]:
        """The next request's prompt: the call's prompt and every token sampled so far."""
        return self.base_prompt + [int(t) for p in self.pieces for t in p.output_ids]

    @property
    def params(self) -> SamplingParams:
        """The call's sampling parameters for what is left of its budget (`left`, which must be at
        least 1: SamplingParams refuses less). A seeded call's next piece gets a seed of its own: the
        first would replay the random draws of its first tokens."""
        seed = self.base_params.seed
        if seed is not None and self.pieces:
            seed = (seed + len(self.pieces) * 0x9E3779B97F4A7C15) % 2**63
        return dataclasses.replace(self.base_params, max_tokens=self.left, seed=seed)

    def joined(self, finish_reason: str, timings: dict[str, float]) -> Generation:
        """The call's answer: the pieces in order, ending with `finish_reason` (the last piece's)."""
        kept = [p for p in self.pieces if len(p.output_ids)] or self.pieces[-1:]
        ids = np.concatenate([p.output_ids for p in kept])
        versions = np.concatenate([np.full(len(p.output_ids), p.version, dtype=np.int64) for p in kept])
        return Generation(ids, np.concatenate([p.infer_logprobs for p in kept]), finish_reason, kept[0].version,
                          dict(timings, pieces=float(len(self.pieces))), versions)
