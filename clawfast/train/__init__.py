"""Training: the policy on packed tree batches, RL algorithms (GRPO, PPO), the training step, and the
run around it.

- `policy`, `algorithms`, `step`, `fsdp`: one optimizer step on a batch of rollouts (`train_step`).
- `config`: the run's typed TOML configuration (`load_config`).
- `loop`: the RL loop (`train`) and evaluation (`evaluate`); `coldstart`: SFT on demonstrations
  captured through the real harness; `checkpoint`: atomic checkpoints and exact resume;
  `metrics`: JSONL / TensorBoard metrics, the live view and the curves PNG.

Submodules are imported on use (torch, transformers and the proxy are heavy).
"""
