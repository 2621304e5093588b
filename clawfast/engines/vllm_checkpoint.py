"""What a `VLLMEngine` weight update may hold: the model's checkpoint, read from its safetensors headers.

Every update is checked against the checkpoint in the model directory (a directory without
safetensors is refused at the engine's construction): an unknown name, a wrong shape, a non-floating
dtype, a name given twice or a partial update that splits a layer (vLLM processes a layer once all of
its tensors arrived: q/k/v of one fused qkv_proj, gate/up, a module's weight and bias) is a
ValueError before anything moves, because vLLM's reload, once fed such a tensor, leaves the model
unusable (measured: an unknown name kills the engine core, q_proj alone makes it emit token 0). A
tied model's ``lm_head.weight`` (HF state dicts list it, its checkpoint does not) must come with the
embedding, as HF state dicts have it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from clawfast.engines.vllm_weight_sync import DTYPE_NAMES, dtypes

_EMBED = "model.embed_tokens.weight"


@dataclass(frozen=True)
class CheckpointSchema:
    """What the model's checkpoint holds: HF name -> shape, the
    groups vLLM loads as one layer (a fused module such as qkv_proj, or one module's weight and
    bias: a layer is processed once all its tensors arrived, so a partial update must cover each
    group it touches). A tied model's ``lm_head.weight``, which HF state dicts list and its
    checkpoint does not, is a name here, grouped with the embedding: vLLM reloads its lm_head
    module from it, and one without the other leaves lm_head on the old values (measured)."""

    shapes: dict[str, tuple[int, ...]]
    groups: dict[str, tuple[str, ...]]

    @classmethod
    def read(cls, model_dir: str, packed_modules: Mapping[str, list[str]]) -> CheckpointSchema:
        import json
        from pathlib import Path

        from safetensors import safe_open

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"VLLMEngine weight updates need a safetensors checkpoint; {model_dir} has none")
        shapes = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        config = json.loads((Path(model_dir) / "config.json").read_text())
        tied = config.get("tie_word_embeddings") and "lm_head.weight" not in shapes and _EMBED in shapes
        if tied:
            shapes["lm_head.weight"] = shapes[_EMBED]
        fused_into = {part: fused for fused, parts in packed_modules.items() for part in parts}
        groups: dict[str, list[str]] = {}
        for name in shapes:
            module, _, _ = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            key = f"{parent}.{fused_into[leaf]}" if leaf in fused_into else module
            if tied and name == "lm_head.weight":
                key = _EMBED.rpartition(".")[0]  # one group with the embedding it is tied to
            groups.setdefault(key, []).append(name)
        return cls(shapes, {n: tuple(g) for g in groups.values() for n in g})

    def check(self, name: str, tensor: Any) -> None:
        """ValueError unless `tensor` can load as checkpoint tensor `name`."""
        import torch

        if name not in self.shapes:
            raise ValueError(f"update_weights: {name!r} is not a tensor of this model's checkpoint")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tuple(tensor.shape) != self.shapes[name]:
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is {self.shapes[name]}")
        if tensor.dtype not in dtypes():  # the worker casts to the serving dtype, as a checkpoint load does
            raise ValueError(f"update_weights: {name!r} has dtype {tensor.dtype}, expected one of {DTYPE_NAMES}")

    def check_layers(self, names: set[str]) -> None:
        """ValueError unless `names` (each a checkpoint name) is not empty and covers every layer it
        touches."""
        if not names:
            raise ValueError("update_weights: empty state dict")
        missing = sorted({m for n in names for m in self.groups[n]} - names)
        if missing:
            raise ValueError(f"update_weights: a partial update must cover whole layers; missing {missing[:8]}")

    def check_update(self, pairs: list[tuple[str, Any]]) -> None:
        """ValueError unless `pairs` is a whole update: each pair loadable, no name twice, whole layers."""
        names = {name for name, _ in pairs}
        if len(names) != len(pairs):
            raise ValueError("update_weights: a name appears twice")
        for name, tensor in pairs:
            self.check(name, tensor)
        self.check_layers(names)


def adapter_is_3d(directory: str | Path) -> bool:
    """Whether the LoRA adapter saved in `directory` (peft's format) adapts parameters rather than
    modules alone (its config's ``target_parameters``: an MoE's router and fused experts). peft saves
    a fused 3-D parameter's adapter flattened across the experts, the layout vLLM calls 3D and must be
    told of (``LoRARequest.is_3d_lora_weight``, the server's ``load_lora_adapter`` alike)."""
    path = Path(directory) / "adapter_config.json"  # peft's file name
    if not path.is_file():
        raise ValueError(f"{directory} holds no LoRA adapter ({path.name} missing)")
    return bool(json.loads(path.read_text()).get("target_parameters"))
