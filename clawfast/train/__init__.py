"""Training: the policy on packed tree batches, RL algorithms (GRPO, PPO), the training step, and the
run around it.

- `policy`, `attention`, `algorithms`, `step`, `fsdp`: one optimizer step on a batch of rollouts
  (`train_step`; `train_on_rollouts` for a whole RL step); the step's parts: `step_config`,
  `prepare` (no model), `proximal` (fixed before the first update), `update` (forward/backward),
  `mismatch` and `verl_names` (IS / mismatch metrics), `data_parallel`, `warmup`.
- `config`: the run's typed configuration, the one config source; `config_file`: a TOML file to it
  (`load_config`).
- `build`: the model directory, policy, optimizer, engine, rollout service and sampling of a run.
- `data`: the data order (`TaskSampler`), the tasks of a split, the rollout sources.
- `loop`: the RL loop (`train`) and evaluation (`evaluate`); `coldstart`: SFT on demonstrations
  captured through the real harness; `distributed`: the FSDP leader and followers; `checkpoint`:
  atomic checkpoints and exact resume; `metrics`: metrics of rollouts; `metrics_log`: JSONL /
  TensorBoard; `progress`: the live view; `plot`: the curves PNG; `report`: the one-line summaries.

Rollouts are reached only through `clawfast.rollout.RolloutService` (tests/test_dependencies.py);
submodules are imported on use (torch and transformers are heavy).
"""
