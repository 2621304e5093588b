"""Sample rollouts to try the tools on before any harness has run.

`write_samples(outdir)` writes one deterministic GRPO group: 8 synthetic rollouts of one task in the
shape real harness traffic has (growing prompts, a retried call, a subagent chain, a title call, a
cleared tool result), as `.cfr` record files, about 250 KB in all. Token ids are random, not text.

    python -m clawfast.samples OUTDIR
    clawfast tree inspect OUTDIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from clawfast.records import write_rollouts
from clawfast.synthetic import group_results, task_group

SAMPLE_SEED = 20240611
SAMPLE_TASK = "sample-task-0"
SAMPLE_REWARDS = (1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0)


def write_samples(outdir: str | Path) -> list[Path]:
    """Write the sample group to `outdir` (created if needed); returns the files written."""
    rng = np.random.default_rng(SAMPLE_SEED)
    group = task_group(
        rng,
        k=len(SAMPLE_REWARDS),
        task_id=SAMPLE_TASK,
        n_calls=16,
        max_prompt_tokens=768,
        retry_frac=0.1,
        subagent_chains=1,
        subagent_calls=2,
    )
    results = group_results(group, task_id=SAMPLE_TASK, rewards=list(SAMPLE_REWARDS))
    return write_rollouts(outdir, results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clawfast.samples", description=__doc__.splitlines()[0])
    parser.add_argument("outdir", help="directory to write the sample .cfr files into")
    args = parser.parse_args(argv)
    paths = write_samples(args.outdir)
    size = sum(p.stat().st_size for p in paths)
    print(f"wrote {len(paths)} rollouts ({size / 1024:.0f} KB) to {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
