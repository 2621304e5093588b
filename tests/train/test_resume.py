"""Resume after SIGKILL: the resumed run's checkpoints equal an uninterrupted run's, and every step
is logged exactly once with the same data.

Both runs are real `clawfast train` processes on recorded rollouts (deterministic, no engine), a
2-layer model and checkpoints every 2 steps. The interrupted one is killed with SIGKILL as soon as
its first checkpoint is on disk (wherever in the next steps that lands: mid-step, mid-checkpoint),
then resumed with ``--resume``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from clawfast.train.checkpoint import list_checkpoints
from clawfast.train.metrics_log import read_metrics

from loop_fixtures import make_recorded, make_tiny_model, recorded_config_text

STEPS = 8


def _cmd(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "clawfast.cli", "train", str(config), "--no-progress", *extra]


def _env() -> dict[str, str]:
    # One thread: less load on a shared machine, and the same reduction order in both runs.
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _same_checkpoint(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model" / "model.safetensors")), load_file(str(b / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{a.name}: weight {k} differs"
    ta = torch.load(a / "trainer.pt", weights_only=True)
    tb = torch.load(b / "trainer.pt", weights_only=True)
    assert ta["optimizer"]["param_groups"] == tb["optimizer"]["param_groups"]
    assert ta["optimizer"]["state"].keys() == tb["optimizer"]["state"].keys()
    for i, s in ta["optimizer"]["state"].items():
        for key, value in s.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(tb["optimizer"]["state"][i][key])), \
                f"{a.name}: optimizer state {i}/{key} differs"
    assert torch.equal(ta["torch_rng"], tb["torch_rng"])
    sa, sb = json.loads((a / "state.json").read_text()), json.loads((b / "state.json").read_text())
    assert sa == sb  # step, data position, weight version, Python and NumPy RNG states


def test_sigkill_and_resume_match_an_uninterrupted_run(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    recorded = make_recorded(tmp_path / "recorded", tasks=5, k=3)
    straight_cfg = tmp_path / "straight.toml"
    straight_cfg.write_text(recorded_config_text(model, recorded, tmp_path / "straight", steps=STEPS))
    killed_cfg = tmp_path / "killed.toml"
    killed_cfg.write_text(recorded_config_text(model, recorded, tmp_path / "killed", steps=STEPS))

    subprocess.run(_cmd(straight_cfg), env=_env(), check=True, capture_output=True, timeout=600)

    proc = subprocess.Popen(_cmd(killed_cfg), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = tmp_path / "killed" / "checkpoints" / "LATEST"
    deadline = time.monotonic() + 300
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = [p.name for p in list_checkpoints(tmp_path / "killed")]
    assert killed_at and killed_at[-1] != f"step-{STEPS:06d}"

    resumed = subprocess.run(_cmd(killed_cfg, "--resume"), env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    straight = {p.name: p for p in list_checkpoints(tmp_path / "straight")}
    after = {p.name: p for p in list_checkpoints(tmp_path / "killed")}
    assert set(straight) == set(after) == {f"step-{s:06d}" for s in range(2, STEPS + 1, 2)}
    for name in sorted(straight):
        _same_checkpoint(straight[name], after[name])

    # No step lost or repeated, and each step trained on the same tasks at the same position.
    def steps(run):
        return [(r["step"], r["data_position"], r["tasks"], r["loss"]) for r in read_metrics(run) if r["kind"] == "train"]

    assert [s[0] for s in steps(tmp_path / "killed")] == list(range(1, STEPS + 1))
    assert steps(tmp_path / "killed") == steps(tmp_path / "straight")
