"""What the tests of calls continued across a push share, for every engine that aborts and resubmits."""

from __future__ import annotations

import numpy as np

from .tiny_qwen3 import EOS


def switch_point(gen) -> int:
    """How many leading tokens the older version sampled; the call must span exactly two versions."""
    versions = gen.output_versions
    k = int((versions == versions[0]).sum())
    assert 0 < k < len(versions) and set(versions[k:].tolist()) == {versions[0] + 1}, versions
    return k


def check_sampled_pieces(gen, prompt, budget: int, old_model, new_model, reference_logprobs, atol: float) -> int:
    """A sampled call continued across one push: ended by the budget (or the end-of-sequence token
    the new weights may sample) in its second piece, every token's log-prob the reference's
    (`reference_logprobs(model, prompt, output)`) under the version it records. Returns the switch."""
    k = switch_point(gen)
    ended_by_eos = gen.output_ids[-1] == EOS
    assert gen.finish_reason == ("stop" if ended_by_eos else "length")
    assert ended_by_eos or len(gen.output_ids) == budget
    np.testing.assert_allclose(gen.infer_logprobs[:k], reference_logprobs(old_model, prompt, gen.output_ids[:k]),
                               atol=atol)
    np.testing.assert_allclose(gen.infer_logprobs[k:], reference_logprobs(new_model, prompt, gen.output_ids)[k:],
                               atol=atol)
    return k
