"""LoRA adapters (`model.lora`, docs/MODELS.md "LoRA"): the policy trains low-rank adapters next to
frozen base weights, through `peft` (its `inject_adapter_in_model`: the model keeps its class and its
module names; each adapted Linear gains ``base_layer`` and its ``lora_A`` / ``lora_B``).

What follows from it, here in one place:
- the optimizer sees the adapter alone (peft leaves every other parameter frozen; `build_optimizer`
  takes what requires grad), so its moments are the adapter's size;
- a weight push is the adapter alone (`adapter_delta`: a `WeightDelta` of its tensors, whole, for an
  engine serving the same adapted modules: the torch engine, a copy of the trainer's model);
- a checkpoint holds the adapter (`save_adapter` / `load_adapter`), not the base, which is
  ``model.path`` and never changes;
- export (and the KL reference) is the merged model (`merged_copy`: W + scale * B A per adapted layer,
  a plain model of the base's class, saved with ``save_pretrained``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from clawfast.engines.weight_delta import TensorDelta, WeightDelta

ADAPTER_FILE = "adapter.safetensors"
ADAPTER_CONFIG = "adapter.json"


def add_lora(lm: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
             target_modules: str | tuple[str, ...] = "all-linear") -> nn.Module:
    """Inject a LoRA adapter into `lm` in place (its base weights frozen, only the adapter trains)
    and return it. ``"all-linear"``: every Linear but the LM head (peft's rule)."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets)
    try:
        inject_adapter_in_model(config, lm)
    except ValueError as exc:  # peft: no module matched
        raise ValueError(f"model.lora.target_modules = {target_modules!r} names no Linear of "
                         f"{type(lm).__name__} ({exc})") from None
    lm.clawfast_lora = {"rank": rank, "alpha": alpha, "dropout": dropout,
                        "target_modules": targets if isinstance(targets, str) else list(targets)}
    return lm


def lora_layers(lm: nn.Module) -> dict[str, nn.Module]:
    """The adapted layers of `lm`, by module name (none for a model without an adapter)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in lm.named_modules() if isinstance(m, LoraLayer)}


def adapter_names(lm: nn.Module) -> list[str]:
    """The parameter names of the adapter's tensors, in module order."""
    layers = lora_layers(lm)
    return [name for name, _ in lm.named_parameters()
            if name.rpartition(".lora_")[0] in layers]


def has_adapter(lm: nn.Module) -> bool:
    """Whether `add_lora` gave `lm` an adapter (read without importing peft, which only LoRA runs need)."""
    return getattr(lm, "clawfast_lora", None) is not None


def adapter_state(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, by parameter name (detached)."""
    params = dict(lm.named_parameters())
    return {name: params[name].detach() for name in adapter_names(lm)}


def adapter_delta(lm: nn.Module, base_version: int, version: int, dtype: torch.dtype) -> WeightDelta:
    """The push of `version` to an engine serving `base_version` with the same adapted model: the
    adapter's tensors whole, in the engine's `dtype`; ``full_nbytes`` is what a full push of the
    model without an adapter moves (every tensor of its state dict)."""
    adapter = adapter_state(lm)
    tensors = [TensorDelta(name, tuple(t.shape), dtype, "dense", t.to(dtype).reshape(-1).contiguous())
               for name, t in adapter.items()]
    itemsize = torch.empty((), dtype=dtype).element_size()
    full = sum(t.numel() for name, t in lm.state_dict().items() if name not in adapter) * itemsize
    return WeightDelta(base_version, version, tensors, full)


def merged_copy(lm: nn.Module) -> nn.Module:
    """A plain copy of `lm` with each adapter merged into its base weight (W + scale * B A) and the
    adapted layers replaced by their base Linear: the base's class and names, for ``save_pretrained``."""
    merged = copy.deepcopy(lm)
    for name, layer in lora_layers(merged).items():
        layer.merge()
        parent, _, child = name.rpartition(".")
        setattr(merged.get_submodule(parent) if parent else merged, child, layer.get_base_layer())
    if hasattr(merged, "clawfast_lora"):
        del merged.clawfast_lora
    return merged


def save_adapter(lm: nn.Module, directory: Path) -> None:
    """The adapter's tensors (`ADAPTER_FILE`) and its shape (`ADAPTER_CONFIG`) into `directory`."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous().cpu() for k, v in adapter_state(lm).items()}, str(directory / ADAPTER_FILE))
    base = getattr(lm.config, "_name_or_path", "")  # the directory the base was loaded from
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"lora": lm.clawfast_lora, "base": base}, indent=1) + "\n")


def load_adapter(lm: nn.Module, directory: Path) -> None:
    """Load a saved adapter into `lm`, whose adapter must have the same tensors (names, shapes):
    ValueError naming what differs."""
    from safetensors.torch import load_file

    saved: dict[str, Any] = json.loads((directory / ADAPTER_CONFIG).read_text())["lora"]
    if saved != getattr(lm, "clawfast_lora", None):
        raise ValueError(f"{directory}: the adapter was saved as {saved}, the policy's is "
                         f"{getattr(lm, 'clawfast_lora', None)} (model.lora)")
    weights = load_file(str(directory / ADAPTER_FILE))
    params = dict(lm.named_parameters())
    names = adapter_names(lm)
    if sorted(weights) != sorted(names):
        missing = sorted(set(names) - set(weights))[:3]
        extra = sorted(set(weights) - set(names))[:3]
        raise ValueError(f"{directory}: adapter tensors differ from the policy's (missing {missing}, unexpected {extra})")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)

