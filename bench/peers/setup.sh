#!/usr/bin/env bash
# The peers' venv for bench/bench_peers.py: $CLAWFAST_HOME/venv-peers, seeing the main environment's
# packages (torch, numpy, transformers, clawfast itself), with the pinned peers of requirements.txt
# installed without their dependencies. Idempotent: a complete venv is kept.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${CLAWFAST_HOME:-$HOME/.cache/clawfast}/venv-peers"
STAMP="$VENV/.complete-$(sha256sum requirements.txt | cut -c1-12)"
[ -e "$STAMP" ] && exit 0
rm -rf "$VENV"
python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r requirements.txt
# Each benchmarked entry point must import; a failure here names the peer and the missing module.
"$VENV/bin/python" - <<'PY'
import importlib
for module in ("areal.models.tree_attn.tree", "verl.trainer.ppo.core_algos", "cut_cross_entropy"):
    importlib.import_module(module)
PY
touch "$STAMP"
echo "peers venv ready: $VENV"
