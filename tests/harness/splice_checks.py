"""What the real-harness proxy tests assert of every captured main thread."""

from __future__ import annotations

import numpy as np

from clawfast.threads import reconstruct


def main_calls_extend_exactly(result, harness: str, engine_calls: int) -> list:
    """The rollout of `harness` scored 1.0 with one record per engine call, and each main-thread call's
    prompt starts with the previous call's prompt + sampled output, token for token, its assistant turn
    spliced back in (never re-rendered) and no drift. Returns the main-thread calls."""
    assert len(result.calls) == engine_calls >= 2
    assert [c.call_index for c in result.calls] == list(range(len(result.calls)))
    assert result.reward == 1.0 and result.harness == harness
    main = [c for c in result.calls if c.tags == ("main",)]
    assert len(main) >= 2, [(c.tags, c.metadata) for c in result.calls]
    for prev, cur in zip(main, main[1:]):
        path = np.concatenate([prev.prompt_ids, prev.output_ids])
        assert len(cur.prompt_ids) > len(path)
        # The harness replays the assistant turn in its own form; the proxy must put the sampled
        # ids back in (splice), never re-render that text.
        assert cur.metadata["spliced_turns"] >= 1, f"assistant turn re-rendered, not spliced: {cur.metadata}"
        np.testing.assert_array_equal(cur.prompt_ids[: len(path)], path)
    # The structure gives the same main thread, continuing exactly (`clawfast fidelity`'s numbers).
    threads = reconstruct(result.calls)
    assert [t.call_index for t in threads.calls if t.kind == "main"] == [c.call_index for c in main], threads.calls
    assert threads.continuity == 1.0 and threads.drift == 0 and not threads.divergences
    return main
