#!/usr/bin/env bash
# README command 1: from a fresh machine to a trained agent, on CPU.
#
#   scripts/quickstart.sh [RUN_DIR]
#
# 1. installs what clawfast needs (scripts/setup.sh: torch 2.13.0 CPU, bubblewrap, socat, the package)
#    and the pinned mini-swe-agent (a real, unmodified third-party harness) into the harness cache;
# 2. builds the embedded model (a tiny Qwen3 + a BPE tokenizer trained here; nothing downloaded);
# 3. `clawfast train examples/quickstart.toml`: eval pass@1 on the held-out split before training,
#    a cold start on oracle demonstrations captured through mini-swe-agent, GRPO through
#    mini-swe-agent on clawbench-mini, eval pass@1 after; every rollout runs in a bwrap sandbox
#    whose only peer is the proxy;
# 4. prints pass@1 before and after and writes the curves to RUN_DIR/curves.png.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR="${1:-runs/quickstart-$(date +%Y%m%d-%H%M%S)}"
START=$(date +%s)

echo "== 1/4 install"
# Only what the quickstart uses: no vLLM or peers venv, one harness.
CLAWFAST_SKIP_VLLM=1 CLAWFAST_SKIP_PEERS=1 CLAWFAST_SKIP_DOCKER=1 CLAWFAST_HARNESSES=mini-swe-agent scripts/setup.sh

echo "== 2/4 embedded model"
python3 -c "from clawfast.embedded import ensure_embedded_model; print(ensure_embedded_model())"

echo "== 3/4 train (eval before, cold start, GRPO, eval after)"
clawfast train examples/quickstart.toml --run-dir "$RUN_DIR" --no-progress

echo "== 4/4 results"
clawfast plot "$RUN_DIR"
python3 - "$RUN_DIR" <<'PY'
import sys
from clawfast.train.report import breakdown
from clawfast.train.metrics import read_metrics

evals = {r.get("label"): r for r in read_metrics(sys.argv[1]) if r["kind"] == "eval"}
for label in ("before", "coldstart", "after"):
    if label in evals:
        r = evals[label]
        print(f"held-out pass@1 {label:<10} {r['pass@1']:.3f}  ({int(r['rollouts'])} rollouts, mini-swe-agent; "
              f"{breakdown(r, 'pass@1_difficulty')})")
if "before" in evals and "after" in evals:
    for key, name in [("pass@1", "all held-out tasks")] + [
            (k, k.split("/", 1)[1] + " held-out tasks") for k in sorted(evals["after"]) if k.startswith("pass@1_difficulty/")]:
        gain = 100 * (evals["after"].get(key, 0.0) - evals["before"].get(key, 0.0))
        print(f"gain on {name}: {gain:+.1f} points")
PY
echo "total time: $(( $(date +%s) - START )) s"
