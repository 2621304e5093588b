"""LoRA adapters (`model.lora`, docs/MODELS.md "LoRA"): the policy trains low-rank adapters next to
frozen base weights, through `peft` (its `inject_adapter_in_model`: the model keeps its class and its
module names; each adapted Linear gains ``base_layer`` and its ``lora_A`` / ``lora_B``).

What follows from it, here in one place:
- the optimizer sees the adapter alone (peft leaves every other parameter frozen; `build_optimizer`
  takes what requires grad), so its moments are the adapter's size;
- a weight push is the adapter alone: a `WeightDelta` of its tensors, whole, for an engine serving
  the same adapted modules (`adapter_delta`: the torch engine, a copy of the trainer's model), or
  its files for an engine with LoRA layers of its own (`save_adapter`: vLLM's ``load_adapter``);
- a checkpoint holds the adapter (`save_adapter` / `load_adapter`), not the base, which is
  ``model.path`` and never changes;
- export (and the KL reference) is the merged model (`merged_copy`: W + scale * B A per adapted layer,
  a plain model of the base's class, saved with ``save_pretrained``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from clawfast.engines.weight_delta import TensorDelta, WeightDelta

# peft's file names (``PeftModel.save_pretrained``), its prefix of tensor names, and the adapter name
# `inject_adapter_in_model` gives the one adapter a policy has.
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
PEFT_ADAPTER = "default"


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
    """Whether `lm` has a peft adapter (`add_lora` gives one; read without importing peft, which only
    LoRA runs need): peft keeps its config on the model as ``peft_config``."""
    return bool(getattr(lm, "peft_config", None))


def adapter_rank(lm: nn.Module) -> int:
    """The largest rank of any adapted module or parameter of `lm`'s adapter: what an engine must
    hold. peft gives an MoE's fused ``gate_up_proj`` twice the rank (one per half, through
    ``rank_pattern``), so on an MoE it is above ``r``."""
    config = lm.peft_config[PEFT_ADAPTER]
    return max([config.r, *config.rank_pattern.values()])


def adapter_state(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, by parameter name (detached)."""
    params = dict(lm.named_parameters())
    return {name: params[name].detach() for name in adapter_names(lm)}


def adapter_delta(lm: nn.Module, base_version: int, version: int, dtype: torch.dtype) -> WeightDelta:
    """The push of `version` to an engine serving `base_version` with the same adapted model: the
    adapter's tensors whole, in the engine's `dtype`; ``full_nbytes`` is `base_nbytes`."""
    tensors = [TensorDelta(name, tuple(t.shape), dtype, "dense", t.to(dtype).reshape(-1).contiguous())
               for name, t in adapter_state(lm).items()]
    return WeightDelta(base_version, version, tensors, base_nbytes(lm, dtype))


def base_nbytes(lm: nn.Module, dtype: torch.dtype) -> int:
    """What a full push of the model without its adapter moves in `dtype` (every other tensor of its
    state dict): what an adapter push is measured against."""
    adapter = set(adapter_names(lm))
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() for name, t in lm.state_dict().items() if name not in adapter) * itemsize


def merged_copy(lm: nn.Module) -> nn.Module:
    """A plain copy of `lm` with each adapter merged into its base weight (W + scale * B A) and the
    adapted layers replaced by their base module: the base's class and names, for ``save_pretrained``.
    peft nests wrappers where it adapts several parameters of one module (an MoE's fused experts):
    every wrapper merges, then the outermost ones give way to the module they wrap."""
    merged = copy.deepcopy(lm)
    layers = lora_layers(merged)
    for layer in layers.values():
        layer.merge()
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        if parent in layers:  # inside another wrapper: unwrapped with it
            continue
        setattr(merged.get_submodule(parent) if parent else merged, child, layer.get_base_layer())
    del merged.peft_config
    return merged


def save_adapter(lm: nn.Module, directory: Path, dtype: torch.dtype | None = None) -> None:
    """The adapter in peft's own format: `ADAPTER_CONFIG` (peft's `LoraConfig`, with the adapted
    modules by name and the base's directory) and `ADAPTER_FILE` (tensors named as
    ``PeftModel.save_pretrained`` names them, in `dtype`, default their own), so peft, vLLM
    (``LoRARequest``, ``--lora-modules``) and this module all read the same directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    config = copy.deepcopy(lm.peft_config[PEFT_ADAPTER])
    config.base_model_name_or_path = getattr(lm.config, "_name_or_path", "") or None  # the base's directory
    config.save_pretrained(str(directory))
    save_file({peft_key(k): v.to(dtype or v.dtype).contiguous().cpu() for k, v in adapter_state(lm).items()},
              str(directory / ADAPTER_FILE))


def saved_adapter_config(directory: Path):
    """The peft `LoraConfig` of the adapter saved in `directory` (ValueError if it holds none)."""
    from peft import LoraConfig

    if not (Path(directory) / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{directory} holds no LoRA adapter ({ADAPTER_CONFIG})")
    return LoraConfig.from_pretrained(str(directory))


def add_saved_lora(lm: nn.Module, directory: Path) -> nn.Module:
    """Inject into `lm` an adapter shaped as the one saved in `directory` (peft's config: rank, alpha,
    dropout, adapted modules and parameters) and load its tensors."""
    from peft import inject_adapter_in_model

    # peft's own config, as saved: it names the adapted parameters too (an MoE's router and
    # experts), which rank, alpha and module names alone would not reproduce
    inject_adapter_in_model(saved_adapter_config(directory), lm)
    load_adapter(lm, directory)
    return lm


def load_adapter(lm: nn.Module, directory: Path) -> None:
    """Load a saved adapter into `lm`, whose adapter must have the same rank, alpha and tensors
    (names, shapes): ValueError naming what differs."""
    from safetensors.torch import load_file

    saved = saved_adapter_config(directory)
    ours = lm.peft_config[PEFT_ADAPTER] if has_adapter(lm) else None
    shape = (saved.r, saved.lora_alpha)
    if ours is None or shape != (ours.r, ours.lora_alpha):
        raise ValueError(f"{directory}: the adapter was saved with rank {saved.r}, alpha {saved.lora_alpha}; the "
                         f"policy's is {'none' if ours is None else f'rank {ours.r}, alpha {ours.lora_alpha}'} (model.lora)")
    weights = {unpeft_key(k): v for k, v in load_file(str(Path(directory) / ADAPTER_FILE)).items()}
    params = dict(lm.named_parameters())
    names = adapter_names(lm)
    if sorted(weights) != sorted(names):
        missing = sorted(set(names) - set(weights))[:3]
        extra = sorted(set(weights) - set(names))[:3]
        raise ValueError(f"{directory}: adapter tensors differ from the policy's (missing {missing}, unexpected {extra})")
    with torch.no_grad():
        for name, tensor in weights.items():
            if tensor.shape != params[name].shape:
                raise ValueError(f"{directory}: {name} is {tuple(tensor.shape)}, the policy's {tuple(params[name].shape)}")
            params[name].copy_(tensor)


def peft_key(name: str) -> str:
    """A parameter name of the injected adapter (``<module>.lora_A.default.weight``) as peft's files
    name it (``base_model.model.<module>.lora_A.weight``)."""
    return PEFT_PREFIX + name.replace(f".{PEFT_ADAPTER}.", ".")


def unpeft_key(key: str) -> str:
    """`peft_key` undone."""
    if not key.startswith(PEFT_PREFIX):
        raise ValueError(f"{key!r} is not a peft adapter tensor name (no {PEFT_PREFIX!r} prefix)")
    module, _, rest = key[len(PEFT_PREFIX):].rpartition(".lora_")
    kind, _, param = rest.partition(".")
    return f"{module}.lora_{kind}.{PEFT_ADAPTER}.{param}"
