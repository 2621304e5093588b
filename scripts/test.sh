#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to the main pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
CACHE="${CLAWFAST_HOME:-$HOME/.cache/clawfast}"

# The image scripts/docker_engine.sh builds, for the docker backend's tests (which fail without an
# engine or the image: with CLAWFAST_SKIP_DOCKER=1 no engine is started, and those tests fail).
if [ "${CLAWFAST_SKIP_DOCKER:-0}" != 1 ]; then
  export CLAWFAST_TEST_DOCKER_IMAGE=clawfast-sandbox:bookworm
fi

# The vllm-marked tests run in the vLLM venv (scripts/setup.sh explains why); the rest run in the
# main environment, last, so its summary closes the output.
if [ -x "$CACHE/venv-vllm/bin/python" ]; then
  "$CACHE/venv-vllm/bin/python" -m pytest -m vllm tests -p no:cacheprovider
fi
python3 -m pytest tests -m "not vllm" "$@"
