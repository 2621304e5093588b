"""Run by torchrun from tests/train/test_train_fsdp.py: `train` under FSDP with the torch engine and
rollouts sampled from it (`EngineRollouts`); rank 0 then writes the weights the engine ended up
serving to OUT (safetensors), for comparison with the run's last checkpoint.

    torchrun --nproc-per-node 2 tests/train/fsdp_sampled_run.py CONFIG OUT
"""

from __future__ import annotations

import sys

import numpy as np
from safetensors.torch import save_file

from clawfast.train.config_file import load_config
from clawfast.train.loop import train
from clawfast.train.sampled import EngineRollouts, TokenTask


def reward(outputs):
    tokens = np.concatenate(outputs)
    return float(np.isin(tokens, np.arange(10, 16)).mean())


def main(config_path: str, out: str) -> None:
    tasks = {f"t{i}": TokenTask(f"t{i}", prompt=(1, 2 + i, 3), reward=reward, turns=2, feedback=(5,)) for i in range(4)}
    engines = []

    def make_source(engine):
        engines.append(engine)
        return EngineRollouts(engine, tasks, max_tokens=4, seed=0)

    train(load_config(config_path), progress=False, make_source=make_source)
    if engines:  # rank 0
        save_file({k: v.detach().clone() for k, v in engines[0].model.state_dict().items()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
