"""How the trainer's weights reach the engine: full pushes, or only what changed.

`WeightPusher` stands where a trainer pushes (`Trainer.push_weights(sink, version)` calls
``sink.update_weights(pairs, version)``, a plain policy's state dict or a sharded trainer's stream
of gathered tensors). For an engine that takes deltas (``Engine.takes_deltas``) with
``engine.delta_pushes`` on, the first push is full and keeps a copy of the weights in the engine's
dtype (`clawfast.engines.weight_delta.DeltaEncoder`); each later push diffs against it and sends a
`WeightDelta`. A full push goes again every ``engine.full_push_every`` pushes, and whenever a delta
is refused (the engine serves another version than the delta's base: weights pushed by other means)
or its checksums differ after applying: the encoder's copy *is* the new weights, so that full push
needs nothing from the trainer. A stream that does not match the last push's names and shapes is a
ValueError before the engine changes; its old weights keep serving and the next push is full.

`last` holds the metrics of the latest push: ``push/delta`` (1 for a delta), ``push/bytes`` (what
travelled), ``push/full_bytes`` (what a full push moves), ``push/changed_fraction`` and
``push/fallback`` (1 when a delta was refused and the full weights went instead).

What travels is in the layout the engine loads (`engine_layout`): the trainer's module names for
the in-process torch engine, the checkpoint's for vLLM and remote servers.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from clawfast.engines.base import Engine
from clawfast.engines.weight_delta import DeltaEncoder, DeltaMismatch

log = logging.getLogger(__name__)


class WeightPusher:
    def __init__(self, engine: Engine, dtype: torch.dtype, *, delta: bool = True, full_every: int | None = None,
                 checksums: bool = False) -> None:
        if full_every is not None and full_every < 1:
            raise ValueError(f"full_every must be >= 1 or None, got {full_every}")
        self.engine = engine
        self.dtype = dtype
        self.full_every = full_every
        self.encoder = DeltaEncoder(dtype, checksums=checksums) if delta and engine.takes_deltas else None
        self.since_full = 0  # delta pushes since the last full one
        self.last: dict[str, float] = {}

    def update_weights(self, state_dict: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Push `state_dict` (a Mapping or a stream of (name, tensor) pairs) as `version`."""
        pairs = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
        enc = self.encoder
        # every full_every-th push is whole: the pushes since the last whole one are its deltas and this
        due = self.full_every is not None and self.since_full + 1 >= self.full_every
        if enc is None or enc.base_version is None or due:
            self._full(pairs, version)
            return
        delta = enc.encode(pairs, version)
        try:
            self.engine.apply_delta(delta)
        except (ValueError, DeltaMismatch) as exc:
            log.warning("delta push to version %d refused (%s); pushing the full weights", version, exc)
            self._full(list(enc.base.items()), version, fallback=True)
            return
        self.since_full += 1
        self.last = {"push/delta": 1.0, "push/bytes": float(delta.nbytes), "push/full_bytes": float(delta.full_nbytes),
                     "push/changed_fraction": delta.changed / max(1, delta.full_nbytes // _size(enc.dtype)),
                     "push/fallback": 0.0}

    def push_adapter(self, lm: torch.nn.Module, version: int) -> None:
        """Push `lm`'s LoRA adapter alone as `version`, in the engine's dtype: as files to an engine
        with LoRA layers of its own (``Engine.takes_adapters``: vLLM loads peft's format), else as a
        `WeightDelta` of its tensors whole (`clawfast.train.lora.adapter_delta`) to an engine serving
        the trainer's adapted modules (the torch engine). An engine that takes neither, or refuses the
        adapter, is an error: the base it serves is the trainer's, so nothing else could go instead."""
        from clawfast.train.lora import ADAPTER_FILE, adapter_delta, base_nbytes, save_adapter

        if self.engine.takes_adapters:
            with tempfile.TemporaryDirectory(prefix="clawfast-adapter-") as directory:
                save_adapter(lm, Path(directory), dtype=self.dtype)
                nbytes = (Path(directory) / ADAPTER_FILE).stat().st_size
                self.engine.load_adapter(directory, version)
            full_nbytes = base_nbytes(lm, self.dtype)
        elif self.engine.takes_deltas:
            delta = adapter_delta(lm, self.engine.weight_version, version, self.dtype)
            self.engine.apply_delta(delta)
            nbytes, full_nbytes = delta.nbytes, delta.full_nbytes
        else:
            raise ValueError(f"{type(self.engine).__name__} takes no adapter pushes (model.lora needs the torch "
                             f"engine, vLLM built with lora_rank, or a vLLM server with adapters=True)")
        self.last = {"push/delta": 1.0, "push/bytes": float(nbytes), "push/full_bytes": float(full_nbytes),
                     "push/changed_fraction": nbytes / max(1, full_nbytes), "push/fallback": 0.0}

    def _full(self, pairs: Iterable[tuple[str, Any]], version: int, *, fallback: bool = False) -> None:
        sizes: list[int] = []

        def counted(stream):
            for name, tensor in stream:
                sizes.append(tensor.numel() * (_size(self.encoder.dtype) if self.encoder else tensor.element_size()))
                yield name, tensor

        stream = self.encoder.reset(pairs, version) if self.encoder is not None else pairs
        self.engine.update_weights(counted(stream), version)
        self.since_full = 0
        total = float(sum(sizes))
        self.last = {"push/delta": 0.0, "push/bytes": total, "push/full_bytes": total, "push/changed_fraction": 1.0,
                     "push/fallback": float(fallback)}


def engine_layout(sink, lm: torch.nn.Module, pairs: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    """The (name, tensor) stream `sink` (an engine, or a `WeightPusher` of one) loads, from the trainer
    LM's own `pairs`: unchanged for an engine that serves the same modules (the torch engine), in the
    checkpoint's names and layout for one that reads checkpoints (`Engine.checkpoint_layout`), as
    `save_pretrained` writes them: transformers' own reverse of the conversion it applied on load
    (from 5.0: an MoE layer's fused ``experts.gate_up_proj`` becomes ``experts.<e>.gate_proj.weight``
    and ``experts.<e>.up_proj.weight`` per expert). Tensor by tensor, so a stream stays a stream."""
    engine = sink.engine if isinstance(sink, WeightPusher) else sink
    if not engine.checkpoint_layout:
        return pairs
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5 keeps the checkpoint's layout in memory
        return pairs
    return (item for name, tensor in pairs for item in revert_weight_conversion(lm, {name: tensor}).items())


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
