"""`clawfast train` with ``distributed.fsdp = true``: two torchrun processes on gloo (CPU) train the
same run as one process: the same loss per step in metrics.jsonl and the same checkpoints (weights
and AdamW state) within 1e-5, also when the sharded run stops and resumes from its checkpoint.

Every run is a real `clawfast train` process (torchrun for the sharded ones) on recorded rollouts
(deterministic, no engine) with a 2-layer model. What differs between one and two processes is only
the order of the cross-rank gradient sums, hence a tolerance, not equality. The runs have a KL
term (``kl_coef > 0``), so the reference policy travels to every rank too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from clawfast.train.checkpoint import list_checkpoints
from clawfast.train.lora import ADAPTER_FILE, unpeft_key
from clawfast.train.metrics_log import read_metrics

from loop_fixtures import make_recorded, make_tiny_model, recorded_config_text

ATOL = 1e-5
STEPS = 4

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch without gloo"),
]


def _env() -> dict[str, str]:
    # No GPU even where there is one: the test is about gloo on CPUs, and one thread per process.
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _train(config: Path, *extra: str, procs: int = 1) -> subprocess.CompletedProcess:
    cli = ["-m", "clawfast.cli", "train", str(config), "--no-progress", *extra]
    if procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", *cli]
    else:
        cmd = [sys.executable, *cli]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


LORA = "[model.lora]\nrank = 4\nalpha = 8\n"


def _config(tmp: Path, name: str, *, fsdp: bool, steps: int = STEPS, extra: str = "") -> Path:
    # A KL term: the frozen reference policy is broadcast to every rank (and reloaded on resume).
    extra = f"[algorithm]\nkl_coef = 0.5\n[distributed]\nfsdp = {'true' if fsdp else 'false'}\n{extra}"
    path = tmp / f"{name}.toml"
    path.write_text(recorded_config_text(tmp / "model", tmp / "recorded", tmp / name, steps=steps, interval=2,
                                         extra=extra))
    return path


def _losses(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if r["kind"] == "train"}


def _max_checkpoint_diff(a: Path, b: Path) -> float:
    """Largest absolute difference over the model weights and the AdamW state of two checkpoints;
    asserts that they hold the same tensors, step counts and hyperparameters."""
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    ta = torch.load(a / "trainer.pt", weights_only=True)["optimizer"]
    tb = torch.load(b / "trainer.pt", weights_only=True)["optimizer"]
    assert ta["param_groups"] == tb["param_groups"]
    assert ta["state"].keys() == tb["state"].keys()
    for i, entry in ta["state"].items():
        assert entry.keys() == tb["state"][i].keys()
        assert torch.equal(entry["step"], tb["state"][i]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert entry[key].shape == tb["state"][i][key].shape
            diff = max(diff, float((entry[key] - tb["state"][i][key]).abs().max()))
    return diff


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's trained tensors: the model's, or a LoRA run's adapter."""
    adapter = checkpoint / ADAPTER_FILE
    return load_file(str(adapter if adapter.is_file() else checkpoint / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The reference: the run in one plain process (fsdp = false)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    make_tiny_model(tmp / "model")
    make_recorded(tmp / "recorded", tasks=5, k=3)
    _train(_config(tmp, "single", fsdp=False))
    return tmp


def _compare(single_dir: Path, sharded_dir: Path) -> float:
    ref, got = _losses(single_dir), _losses(sharded_dir)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    worst = 0.0
    for step in ref:
        assert got[step]["tasks"] == ref[step]["tasks"] and got[step]["rollouts"] == ref[step]["rollouts"]
        assert got[step]["stepped"] == 1.0
        assert abs(got[step]["kl_ref"] - ref[step]["kl_ref"]) <= ATOL and (step == 1 or ref[step]["kl_ref"] > 0)
        assert got[step]["fsdp_world_size"] == 2 and "fsdp_world_size" not in ref[step]
        worst = max(worst, abs(got[step]["loss"] - ref[step]["loss"]))
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5)
    assert worst <= ATOL, f"loss differs by {worst}"
    names = [p.name for p in list_checkpoints(single_dir)]
    assert [p.name for p in list_checkpoints(sharded_dir)] == names == ["step-000002", "step-000004"]
    for name in names:
        diff = _max_checkpoint_diff(single_dir / "checkpoints" / name, sharded_dir / "checkpoints" / name)
        assert diff <= ATOL, f"{name}: weights or optimizer state differ by {diff}"
        print(f"{sharded_dir.name} {name}: max |weight or AdamW state diff| {diff:.2e}")
    print(f"{sharded_dir.name}: max |loss diff| {worst:.2e}")
    return worst


def test_two_gloo_processes_train_like_one(single):
    done = _train(_config(single, "sharded", fsdp=True), procs=2)
    assert done.stdout.count("steps done: 4") == 1  # rank 0 alone reports
    _compare(single / "single", single / "sharded")


def test_two_gloo_processes_train_an_adapter_like_one(single):
    """``model.lora`` under FSDP: the adapter's losses, checkpoints (adapter and AdamW state) and
    KL to the merged reference are the one-process run's; the base is never touched."""
    _train(_config(single, "lora-single", fsdp=False, extra=LORA))
    _train(_config(single, "lora-sharded", fsdp=True, extra=LORA), procs=2)
    _compare(single / "lora-single", single / "lora-sharded")
    last = list_checkpoints(single / "lora-sharded")[-1]
    assert not (last / "model").exists() and any(t.abs().max() > 0 for t in _weights(last).values())


def test_sharded_run_resumes_from_its_checkpoint(single):
    """Two processes run 2 steps; two new processes resume to step 4 (weights from the checkpoint,
    AdamW moments scattered to the shards): the same as the uninterrupted one-process run."""
    _train(_config(single, "resumed", fsdp=True, steps=2), procs=2)
    assert [p.name for p in list_checkpoints(single / "resumed")] == ["step-000002"]
    _train(_config(single, "resumed", fsdp=True, steps=STEPS), "--resume", procs=2)
    _compare(single / "single", single / "resumed")


def test_one_process_checkpoint_resumes_sharded(single):
    """The checkpoint format is the same: a one-process run stopped at step 2 continues under FSDP
    (the path a cold-started run takes) and ends where the one-process run does."""
    _train(_config(single, "mixed", fsdp=False, steps=2))
    _train(_config(single, "mixed", fsdp=True, steps=STEPS), "--resume", procs=2)
    ref, got = _losses(single / "single"), _losses(single / "mixed")
    assert "fsdp_world_size" not in got[2] and got[3]["fsdp_world_size"] == 2
    for name in ("step-000002", "step-000004"):
        diff = _max_checkpoint_diff(single / "single" / "checkpoints" / name, single / "mixed" / "checkpoints" / name)
        assert diff <= ATOL, f"{name}: weights or optimizer state differ by {diff}"
    assert max(abs(got[s]["loss"] - ref[s]["loss"]) for s in ref) <= ATOL


def test_a_failure_on_rank_0_stops_every_rank(single):
    """Rank 0 refuses a fresh run in a directory with checkpoints; the other rank is told and exits
    non-zero too (instead of waiting for commands that never come)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "clawfast.cli",
           "train", str(_config(single, "sharded", fsdp=True)), "--no-progress"]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "already holds checkpoints" in done.stderr and "rank 0 stopped" in done.stderr


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sharded_async_run_streams_its_weights_to_the_engine(single, lora):
    """FSDP, the torch engine and the asynchronous loop (max_staleness 1): each step's push streams
    one gathered tensor at a time to the engine, which ends up serving exactly the weights of the
    run's last checkpoint (and not the initial ones). With ``model.lora`` the pushes are the
    adapter's (gathered alone): the engine serves the last checkpoint's adapter on the initial base."""
    name = "streamed-lora" if lora else "streamed"
    path = single / f"{name}.toml"
    path.write_text(f"""
run_dir = "{single / name}"
seed = 1
steps = 3
[model]
path = "{single / 'model'}"
[engine]
kind = "torch"
max_tokens = 4
[rollout]
tasks_per_step = 2
samples_per_task = 4
[algorithm]
max_staleness = 1
[optim]
lr = 1e-2
micro_batch_tokens = 256
[eval]
before = false
after = false
[checkpoint]
interval = 3
[distributed]
fsdp = true
{LORA if lora else ""}""")
    served = single / f"{name}-served.safetensors"
    script = Path(__file__).with_name("fsdp_sampled_run.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           str(path), str(served)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    got = load_file(str(served))
    initial = load_file(str(single / "model" / "model.safetensors"))
    records = list(_losses(single / name).values())
    assert [r["fsdp_world_size"] for r in records] == [2.0, 2.0, 2.0]
    if lora:
        final = {unpeft_key(k): v for k, v in _weights(list_checkpoints(single / name)[-1]).items()}
        assert all(torch.equal(got[k], final[k]) for k in final)
        assert any(t.abs().max() > 0 for k, t in final.items() if ".lora_B." in k)
        base = {k.replace(".base_layer.", "."): v for k, v in got.items() if ".lora_" not in k}
        assert all(torch.equal(base[k], initial[k]) for k in initial)
        assert all(r["push/bytes"] < 0.2 * r["push/full_bytes"] for r in records)
        return
    final = load_file(str(list_checkpoints(single / name)[-1] / "model" / "model.safetensors"))
    assert set(final) <= set(got)
    assert all(torch.equal(got[k], final[k]) for k in final)
    assert any(not torch.equal(got[k], initial[k]) for k in initial)


def test_fsdp_without_torchrun_is_refused(tmp_path):
    """A plain process with fsdp = true stops with a clear error instead of training unsharded."""
    make_tiny_model(tmp_path / "model")
    make_recorded(tmp_path / "recorded", tasks=2, k=3)
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "clawfast.cli", "train", str(_config(tmp_path, "run", fsdp=True)),
                           "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "torchrun" in done.stderr
