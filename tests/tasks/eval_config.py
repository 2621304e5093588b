"""The config of a small `clawfast eval` through mini-swe-agent on the embedded model, for a suite."""

from __future__ import annotations

from pathlib import Path


def write_eval_config(tmp_path: Path, suite: str) -> Path:
    config = tmp_path / "eval.toml"
    config.write_text(f"""
run_dir = "{tmp_path / 'run'}"
[model]
path = "embedded"
[engine]
kind = "torch"
max_tokens = 24
[tasks]
suite = "{suite}"
[rollout]
harnesses = ["mini-swe-agent"]
concurrency = 3
sandbox = "bwrap"
timeout_s = 120
harness_max_turns = 2
[eval]
samples_per_task = 1
temperature = 0.0
""")
    return config
