"""Checkpoints of a training run, written atomically, and exact resume.

Layout (``<run_dir>/checkpoints/``)::

    step-000005/
        model/            the policy LM as a Hugging Face directory (safetensors + config + the
                          tokenizer files of the source model): `clawfast eval`, the engines and
                          `transformers` load it directly
        adapter_model.safetensors, adapter_config.json   instead of model/ when the policy
                          trains a LoRA adapter (`clawfast.train.lora`), in peft's format (peft and
                          vLLM load it as it is): the base is ``model.path``, unchanged;
                          `clawfast model merge` writes the merged model
        value_head.safetensors   PPO only
        trainer.pt        optimizer state and torch RNG state (loaded with weights_only=True)
        state.json        step, data position, weight version, Python and NumPy RNG states
        COMPLETE          written last; a directory without it is never loaded
    LATEST                the name of the newest complete checkpoint

A checkpoint is built in ``.tmp-step-N`` (every file fsynced), renamed into place, and only then is
``LATEST`` replaced (temp file + rename), so a SIGKILL at any instant leaves either the previous
checkpoint or the new one as LATEST, never a half-written one (a step saved again replaces its old
copy only once the new one is in place and named). Saving step N deletes complete checkpoints past N
(an earlier attempt's, past the LATEST this run went on from) before ``keep`` prunes the others.

Guaranteed: `load_checkpoint` restores the policy parameters and the optimizer's state (AdamW's
moments and step counts) bit for bit, the step and data position, the weight version, and the RNG
states of `random`, NumPy's global generator and torch's CPU generator (tests/train/test_resume.py
kills a run with SIGKILL and checks that the resumed run's checkpoints equal an uninterrupted run's).
The optimizer's hyper-parameters (lr, betas, eps, weight_decay; the warm-up's base lr) are not
restored: they stay those the optimizer was built with, the resumed run's config (`optim.*`, which
its config.json records), so a run resumed with a new lr trains at that lr. A checkpoint is refused
(ValueError) by a policy that trains otherwise: full weights vs a LoRA adapter (``model.lora``),
with vs without PPO's value head (``algorithm.name``). Not guaranteed: CUDA RNG states
(not saved: the trainer's randomness is on the CPU), or determinism of rollouts that real harnesses
produce (timing-dependent: a resumed run continues at the same data position with the same
seeds, but a harness may not repeat itself).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clawfast.train.lora import ADAPTER_FILE, add_saved_lora, has_adapter, load_adapter, merged_copy, save_adapter, saved_adapter_config

CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
COMPLETE = "COMPLETE"
VALUE_HEAD_FILE = "value_head.safetensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "vocab.json", "merges.txt", "added_tokens.json")


@dataclass
class TrainState:
    """step: RL steps done (`RunConfig.steps`). data_position: training tasks consumed by the sampler (the next
    step starts there). weight_version: the version the engine serves. extra: small JSON facts."""

    step: int = 0
    data_position: int = 0
    weight_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    """The Python and NumPy global RNG states as JSON-able values (torch's goes in trainer.pt)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)  # MT19937: {"key": uint32[624], "pos": int}
    return {
        "python": [version, list(internal), gauss],
        "numpy": {**np_state, "state": {"key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"])}},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = dict(state["numpy"])
    np_state["state"] = {"key": np.asarray(np_state["state"]["key"], dtype=np.uint32), "pos": np_state["state"]["pos"]}
    np.random.set_state(np_state)


def copy_tokenizer(source: Path, dest: Path) -> None:
    """Copy the tokenizer files of a model directory (those that exist) into `dest`."""
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)


def save_checkpoint(run_dir: str | Path, policy, optimizer: torch.optim.Optimizer, state: TrainState, *,
                    tokenizer_dir: str | Path | None = None, keep: int | None = None) -> Path:
    """Write the checkpoint of `state.step` (see the module docstring); returns its directory.

    policy: a `clawfast.train.policy.Policy` (its `lm` is saved as a HF directory). tokenizer_dir:
    where the tokenizer files are copied from. keep: delete older complete checkpoints beyond this
    many (None: keep all)."""
    from safetensors.torch import save_file

    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(state.step)
    final = root / name
    tmp = root / f".tmp-{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if has_adapter(policy.lm):
        save_adapter(policy.lm, tmp)
    else:
        policy.lm.save_pretrained(tmp / "model", safe_serialization=True)
        if tokenizer_dir is not None:
            copy_tokenizer(Path(tokenizer_dir), tmp / "model")
    if getattr(policy, "value_head", None) is not None:
        save_file({k: v.detach().contiguous().cpu() for k, v in policy.value_head.state_dict().items()},
                  str(tmp / VALUE_HEAD_FILE))
    torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps({**asdict(state), "rng": rng_state()}) + "\n")
    (tmp / COMPLETE).write_text(name + "\n")
    _fsync_tree(tmp)
    # The same step saved again (a re-run after a crash between rename and LATEST): the old copy is
    # moved aside, not deleted, until the new one is in place and named.
    replaced = root / f".replaced-{name}"
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(tmp, final)
    _write_text_atomic(root / LATEST, name + "\n")
    shutil.rmtree(replaced, ignore_errors=True)
    _prune(root, state.step, keep)
    return final


def _prune(root: Path, step: int, keep: int | None) -> None:
    """Delete the complete checkpoints past `step` (an earlier attempt's, past the LATEST this run went
    on from: it replaces them, and kept they would pass for its newest) and, with `keep`, all but the
    newest `keep` of the others."""
    complete = list_checkpoints(root.parent)
    stale = [c for c in complete if _step_of(c) > step]
    current = [c for c in complete if c not in stale]
    for old in stale + (current[:-keep] if keep is not None else []):
        shutil.rmtree(old, ignore_errors=True)


def _step_of(checkpoint: Path) -> int:
    """The step a checkpoint directory's name says (`checkpoint_name`; past 999,999 steps the name is
    longer, so names alone do not sort)."""
    return int(checkpoint.name[len("step-"):])


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step-*") if (p / COMPLETE).is_file() and p.name[len("step-"):].isdigit()), key=_step_of)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint LATEST names (falling back to the newest complete one), or None."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / COMPLETE).is_file():
            return candidate
    complete = list_checkpoints(run_dir)
    return complete[-1] if complete else None


def read_state(checkpoint: str | Path) -> TrainState:
    raw = json.loads((Path(checkpoint) / "state.json").read_text())
    raw.pop("rng", None)
    return TrainState(**raw)


def load_checkpoint(checkpoint: str | Path, policy, optimizer: torch.optim.Optimizer | None = None, *,
                    restore_rng: bool = True) -> TrainState:
    """Load a checkpoint into `policy` (and `optimizer`), restore the RNG states, return its state.

    The optimizer takes the checkpoint's state (moments, step counts) and keeps its own
    hyper-parameters, those of the run's config (`_keep_hyperparameters`). Raises ValueError for a
    directory that is not a complete checkpoint, or one of a run that trained otherwise (LoRA adapter
    vs full weights, PPO's value head vs none)."""
    from safetensors.torch import load_file

    checkpoint = Path(checkpoint)
    if not (checkpoint / COMPLETE).is_file():
        raise ValueError(f"{checkpoint} is not a complete checkpoint (no {COMPLETE} marker)")
    if (checkpoint / ADAPTER_FILE).is_file() != has_adapter(policy.lm):
        raise ValueError(f"{checkpoint} holds {'a LoRA adapter' if (checkpoint / ADAPTER_FILE).is_file() else 'full weights'}"
                         f", the policy {'trains an adapter' if has_adapter(policy.lm) else 'trains every weight'}: "
                         f"resume with the run's own model.lora")
    saved_head, has_head = (checkpoint / VALUE_HEAD_FILE).is_file(), getattr(policy, "value_head", None) is not None
    if saved_head != has_head:  # else: a missing file, or torch's param-group mismatch in the optimizer
        raise ValueError(f"{checkpoint} is a {'PPO' if saved_head else 'GRPO'} run's checkpoint "
                         f"({'with' if saved_head else 'without'} a value head), the policy is "
                         f"{'PPO' if has_head else 'GRPO'}'s ({'with' if has_head else 'without'} one): "
                         f"resume with the run's own algorithm.name ({'ppo' if saved_head else 'grpo'!r})")
    try:
        if has_adapter(policy.lm):
            load_adapter(policy.lm, checkpoint)
        else:
            _load_full(checkpoint, policy.lm)
        if getattr(policy, "value_head", None) is not None:
            policy.value_head.load_state_dict(load_file(str(checkpoint / VALUE_HEAD_FILE)))
        trainer = torch.load(checkpoint / "trainer.pt", weights_only=True)
        if optimizer is not None:
            configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            optimizer.load_state_dict(trainer["optimizer"])
            _keep_hyperparameters(optimizer, configured)
        raw = json.loads((checkpoint / "state.json").read_text())
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise ValueError(f"{checkpoint}: state.json is not JSON ({exc}); resume from an earlier checkpoint") from exc
        raise
    except Exception as exc:  # a file gone or torn (a disk that filled), a tensor of another shape (another model)
        raise ValueError(f"{checkpoint}: cannot be loaded into this run's policy: {type(exc).__name__}: "
                         f"{str(exc)[:300]}; resume with the run's own model, or from an earlier checkpoint") from exc
    if restore_rng:
        torch.set_rng_state(trainer["torch_rng"])
        set_rng_state(raw["rng"])
    raw.pop("rng")
    return TrainState(**raw)


def _keep_hyperparameters(optimizer: torch.optim.Optimizer, configured: list[dict[str, Any]]) -> None:
    """Put back the hyper-parameters the optimizer was built with (the run's config) over those
    `load_state_dict` copied from the checkpoint: a resumed run continues the moments and step counts,
    at the lr, betas, eps and weight decay its config.json records. The warm-up's base lr
    (``initial_lr``, `clawfast.train.warmup`) is the configured lr too, so the ramp and the lr past it
    follow the config; its key stays where the checkpoint had it (the saved state keeps its shape)."""
    for group, built in zip(optimizer.param_groups, configured):
        if "initial_lr" in group:
            group["initial_lr"] = built.get("initial_lr", built["lr"])
        group.update(built)


def _load_full(checkpoint: Path, lm: torch.nn.Module) -> None:
    # Read back by transformers itself, which undoes what `save_pretrained` converted: from 5.0 an MoE
    # layer's fused experts are written one tensor per expert, names the model in memory does not have.
    saved = type(lm).from_pretrained(checkpoint / "model", dtype=next(lm.parameters()).dtype,
                                     local_files_only=True)
    missing, unexpected = lm.load_state_dict(saved.state_dict(), strict=False)
    del saved
    # Tied weights (the LM head sharing the embedding) are saved once; anything else missing is an error.
    tied = set(getattr(lm, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied and not _is_tied_copy(lm, k)]
    if missing or unexpected:
        raise ValueError(f"{checkpoint}: weights do not match the policy (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")


def _is_tied_copy(lm: torch.nn.Module, key: str) -> bool:
    """True if parameter `key` is the same tensor as another parameter (a tied LM head)."""
    params = dict(lm.named_parameters(remove_duplicate=False))
    target = params.get(key)
    return target is not None and any(v is target and k != key for k, v in params.items())


def export_merged(checkpoint: Path, out: Path, base: Path | None = None) -> Path:
    """Write the merged model of a LoRA checkpoint (its adapter on `base`, default the directory the
    run's base was loaded from) to `out` as a Hugging Face directory, with the base's tokenizer."""
    from transformers import AutoModelForCausalLM

    checkpoint, out = Path(checkpoint), Path(out)
    saved = saved_adapter_config(checkpoint)  # ValueError for a checkpoint of full weights
    base = Path(base or saved.base_model_name_or_path or "")
    if not (base / "config.json").is_file():
        raise ValueError(f"the adapter's base {base} is not a Hugging Face model directory: name it (--base)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: name a directory to write the merged model in")
    if out.exists() and out.resolve() == base.resolve():
        raise ValueError(f"--out {out} is the base model's directory: the merge would overwrite the base")
    lm = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    add_saved_lora(lm, checkpoint)
    merged_copy(lm).save_pretrained(out, safe_serialization=True)
    copy_tokenizer(base, out)
    return out
