"""Delta weight pushes: per tensor, only the elements whose value in the engine's dtype changed.

Between two RL steps most bf16 weights are bit-identical (an AdamW step moves a weight by about
lr, below half a bf16 ulp for most of them), so a push that sends only the changed elements moves a
small fraction of the model. `DeltaEncoder` (the trainer's side) keeps the last pushed weights, cast
to the engine's dtype, and turns the next (name, tensor) stream into a `WeightDelta`: per tensor that
changed, the smallest of three encodings (`TensorDelta`): the whole tensor, the changed elements'
new values with where they are, or one byte per changed element holding both where it is and which
way it moved by one unit in the last place. An engine that takes
deltas (`TorchEngine.apply_delta`) checks the whole delta against its shapes, dtypes and serving
version before it changes anything (`check_delta`), then writes it in place and, when the delta
carries checksums, compares each changed tensor's (`write_delta`). `write_delta_file` /
`read_delta_file` carry a delta to a server that reloads from disk.

Equality is bitwise (the dtype's bits compared as integers): -0.0 and 0.0 differ, a NaN equals
the same NaN, so the engine's weights end bit-identical to a full push of the same tensors.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch

# Integer views of each float dtype's bits: equality of bits, not of values.
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.float64: torch.int64}


class DeltaMismatch(RuntimeError):
    """A delta applied, but a tensor's checksum differs from the trainer's: push the full weights."""


@dataclass(frozen=True)
class TensorDelta:
    """The new value of one tensor, in one of three encodings (`encoding`):

    - ``"dense"``: `values` is the whole tensor, flattened;
    - ``"values"``: `values` holds the new value of each changed element and `gaps` where they are
      (the flat indices as differences, the first from -1, in the narrowest integer dtype);
    - ``"ulps"``: an AdamW step at RL learning rates moves most changed bf16 weights by exactly one
      unit in the last place, so `values` (uint8) holds one code per such element: its low 7 bits
      the distance from the previous one (1-127; 0 is a code of its own, "127 further, nothing
      changes", for longer distances), its high bit the direction (set: one unit down, i.e. the
      bits read as an integer minus one). The other changed elements are `jumps`: their new values,
      at the flat indices `jump_index`.

    checksum: crc32 of the whole new tensor's bytes, or None."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    encoding: str
    values: torch.Tensor
    gaps: torch.Tensor | None = None
    jumps: torch.Tensor | None = None
    jump_index: torch.Tensor | None = None
    checksum: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes that travel."""
        parts = (self.values, self.gaps, self.jumps, self.jump_index)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


ENCODINGS = ("dense", "values", "ulps")
_FAR = 127  # the distance a "ulps" code of 0 advances
_DOWN = 0x80  # a "ulps" code's direction bit


def _ulp_positions(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat index each "ulps" code lands on, and which codes are moves (not long-distance fillers)."""
    distance = (codes & _FAR).to(torch.int64)
    move = distance != 0
    return torch.cumsum(torch.where(move, distance, _FAR), 0) - 1, move


def _ulp_codes(index: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The "ulps" codes of moves at the increasing flat `index` (int64), `down` where it moves down."""
    gaps = torch.diff(index, prepend=index.new_full((1,), -1))
    fillers = (gaps - 1) // _FAR
    codes = torch.zeros(int(fillers.sum()) + len(index), dtype=torch.uint8, device=index.device)
    last = torch.cumsum(fillers + 1, 0) - 1
    codes[last] = ((gaps - _FAR * fillers) | torch.where(down, _DOWN, 0)).to(torch.uint8)
    return codes


@dataclass
class WeightDelta:
    """What changed between the weights of `base_version` and those of `version`: every tensor of
    the model is either in `tensors` or unchanged. full_nbytes: what a full push of the same weights
    moves in the engine's dtype."""

    base_version: int
    version: int
    tensors: list[TensorDelta] = field(default_factory=list)
    full_nbytes: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def changed(self) -> int:
        """Elements sent (a dense tensor counts whole; "ulps" codes count as elements)."""
        return sum(t.values.numel() + (t.jumps.numel() if t.jumps is not None else 0) for t in self.tensors)


def _narrowest(largest: int) -> torch.dtype:
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if largest <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def checksum(tensor: torch.Tensor) -> int:
    """crc32 of a tensor's bytes (on the CPU)."""
    data = tensor.detach().reshape(-1).contiguous().cpu()  # flat: a 0-d tensor has no bytes view
    return zlib.crc32(data.view(torch.uint8).numpy() if data.numel() else b"")


class DeltaEncoder:
    """The trainer's copy of what the engine serves, in the engine's `dtype`, kept where the pushed
    tensors live (a GPU trainer's on its GPU: one more copy of the model in `dtype`); `encode` diffs
    the next weights against it and takes them as the new base. `checksums`: each changed tensor's
    delta carries the crc32 of its new value (a copy to the CPU per changed tensor; for tests and
    suspicious runs)."""

    def __init__(self, dtype: torch.dtype, *, checksums: bool = False) -> None:
        if dtype not in _BITS:
            raise ValueError(f"delta pushes compare float weights; {dtype} is not one")
        self.dtype = dtype
        self.checksums = checksums
        self.base: dict[str, torch.Tensor] = {}
        self.base_version: int | None = None  # None: no base (nothing pushed yet, or a failed encode)

    def reset(self, pairs: Iterable[tuple[str, torch.Tensor]], version: int) -> Iterable[tuple[str, torch.Tensor]]:
        """Take the weights of a full push as the base, tensor by tensor as the push consumes them
        (yields each, cast to the engine's dtype)."""
        self.base, self.base_version = {}, None
        for name, tensor in pairs:
            self.base[name] = tensor.detach().to(self.dtype, copy=True).contiguous()
            yield name, self.base[name]
        self.base_version = int(version)

    def encode(self, pairs: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightDelta:
        """The delta from the base to `pairs` (every tensor of the base, once), taken as the new base.
        A ValueError (a tensor missing, unknown or reshaped) leaves no base: the next push is full."""
        if self.base_version is None:
            raise ValueError("no base to diff against: push the full weights first")
        delta = WeightDelta(self.base_version, int(version))
        self.base_version = None  # set again once the whole stream was read: a failure leaves no base
        seen: set[str] = set()
        for name, tensor in pairs:
            old = self.base.get(name)
            if old is None or name in seen:
                raise ValueError(f"delta push: {name!r} is {'repeated' if old is not None else 'not in the base'}")
            new = tensor.detach().to(device=old.device, dtype=self.dtype)
            if new.shape != old.shape:
                raise ValueError(f"delta push: {name!r} has shape {tuple(new.shape)}, the base {tuple(old.shape)}")
            seen.add(name)
            delta.full_nbytes += new.numel() * new.element_size()
            bits = _BITS[self.dtype]
            changed = (new.reshape(-1).view(bits) != old.reshape(-1).view(bits)).nonzero().squeeze(1)
            if changed.numel() == 0:
                continue
            delta.tensors.append(_encode(name, old, new, changed))
            if self.checksums:
                delta.tensors[-1] = dataclasses.replace(delta.tensors[-1], checksum=checksum(old))
        missing = set(self.base) - seen
        if missing:
            raise ValueError(f"delta push: {len(missing)} tensors of the base were not pushed, e.g. {sorted(missing)[:3]}")
        self.base_version = int(version)
        return delta


def _encode(name: str, old: torch.Tensor, new: torch.Tensor, changed: torch.Tensor) -> TensorDelta:
    """The smallest encoding of `new` against `old` (whose `changed` flat indices differ); `old`
    then holds `new`."""
    flat_old, flat_new = old.view(-1), new.reshape(-1)
    bits = _BITS[old.dtype]
    size = new.element_size()
    shape = tuple(new.shape)
    new_values = flat_new[changed]
    steps = new_values.view(bits).to(torch.int64) - flat_old[changed].view(bits).to(torch.int64)
    unit = steps.abs() == 1
    codes = _ulp_codes(changed[unit], steps[unit] < 0)
    jump_index = changed[~unit].to(_narrowest(new.numel()))
    ulps_bytes = codes.numel() + jump_index.numel() * (size + jump_index.element_size())
    gaps = torch.diff(changed, prepend=changed.new_full((1,), -1))
    gaps = gaps.to(_narrowest(int(gaps.max())))
    values_bytes = changed.numel() * (gaps.element_size() + size)
    if min(values_bytes, ulps_bytes) >= new.numel() * size:
        delta = TensorDelta(name, shape, old.dtype, "dense", flat_new.clone())
    elif ulps_bytes < values_bytes:
        delta = TensorDelta(name, shape, old.dtype, "ulps", codes, jumps=new_values[~unit], jump_index=jump_index)
    else:
        delta = TensorDelta(name, shape, old.dtype, "values", new_values, gaps)
    flat_old[changed] = new_values
    return delta


def check_delta(delta: WeightDelta, serving_version: int, params: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError, before anything changes, if `delta` does not fit an engine serving
    `serving_version` with tensors `params`: another base version, an unknown name, another shape
    or dtype, values or indices that do not match."""
    if delta.base_version != serving_version:
        raise ValueError(f"delta from version {delta.base_version} to {delta.version}, but the engine serves "
                         f"version {serving_version}: push the full weights")
    if delta.version < serving_version:
        raise ValueError(f"delta to version {delta.version}, older than the serving version {serving_version}")
    seen: set[str] = set()
    for t in delta.tensors:
        param = params.get(t.name)
        if param is None:
            raise ValueError(f"delta names {t.name!r}, which the engine's model does not have")
        if t.name in seen:
            raise ValueError(f"delta names {t.name!r} twice")
        seen.add(t.name)
        if tuple(param.shape) != t.shape or param.dtype != t.dtype:
            raise ValueError(f"delta for {t.name!r} is {t.dtype} {t.shape}, the engine's tensor "
                             f"{param.dtype} {tuple(param.shape)}")
        if t.encoding not in ENCODINGS:
            raise ValueError(f"delta for {t.name!r}: unknown encoding {t.encoding!r}")
        want = torch.uint8 if t.encoding == "ulps" else t.dtype
        if t.values.dtype != want or t.values.dim() != 1:
            raise ValueError(f"{t.encoding} delta for {t.name!r} holds {t.values.dtype} values of shape "
                             f"{tuple(t.values.shape)}, not one-dimensional {want}")
        numel = param.numel()
        if t.encoding == "dense":
            if t.values.numel() != numel:
                raise ValueError(f"dense delta for {t.name!r} holds {t.values.numel()} values for {numel} elements")
            continue
        if t.encoding == "values":
            if t.gaps is None or t.gaps.shape != t.values.shape or t.gaps.is_floating_point():
                raise ValueError(f"values delta for {t.name!r}: gaps do not match its {t.values.numel()} values")
            index = torch.cumsum(t.gaps.to(torch.int64), 0) - 1
        else:
            if (t.jumps is None) != (t.jump_index is None) or (t.jumps is not None and (
                    t.jumps.dtype != t.dtype or t.jumps.shape != t.jump_index.shape or t.jumps.dim() != 1
                    or t.jump_index.is_floating_point())):
                raise ValueError(f"ulps delta for {t.name!r}: its jumps and their indices do not match")
            index, _ = _ulp_positions(t.values)
            if t.jump_index is not None and t.jump_index.numel():
                jumps = t.jump_index.to(torch.int64)
                if int(jumps.min()) < 0 or int(jumps.max()) >= numel:
                    raise ValueError(f"ulps delta for {t.name!r} has a jump outside its {numel} elements")
        if index.numel() and (bool((torch.diff(index) < 1).any()) or int(index[0]) < 0 or int(index[-1]) >= numel):
            raise ValueError(f"{t.encoding} delta for {t.name!r} indexes outside its {numel} elements "
                             "or not in increasing order")


def apply_tensor_delta(param: torch.Tensor, t: TensorDelta) -> None:
    """Write `t` into `param` in place (checked by `check_delta`)."""
    flat = param.data.view(-1)
    if t.encoding == "dense":
        flat.copy_(t.values.to(flat.device))
    elif t.encoding == "values":
        flat[torch.cumsum(t.gaps.to(flat.device, torch.int64), 0) - 1] = t.values.to(flat.device)
    else:
        codes = t.values.to(flat.device)
        index, move = _ulp_positions(codes)
        index, down = index[move], (codes[move] & _DOWN) != 0
        bits = flat.view(_BITS[flat.dtype])
        bits[index] = (bits[index].to(torch.int64) + torch.where(down, -1, 1)).to(bits.dtype)
        if t.jumps is not None:
            flat[t.jump_index.to(flat.device, torch.int64)] = t.jumps.to(flat.device)


def write_delta(delta: WeightDelta, params: Mapping[str, torch.Tensor]) -> None:
    """Write a checked delta into `params` in place, a storage shared by tied names (embeddings and
    output head) once, then compare checksums: DeltaMismatch names the tensors whose value differs
    from the trainer's."""
    written: set[tuple[int, tuple[int, ...]]] = set()
    for t in delta.tensors:
        param = params[t.name]
        storage = (param.data_ptr(), tuple(param.shape))
        if storage not in written:  # a step added twice to a tied tensor would move it twice
            apply_tensor_delta(param, t)
            written.add(storage)
    bad = [t.name for t in delta.tensors if t.checksum is not None and checksum(params[t.name]) != t.checksum]
    if bad:
        raise DeltaMismatch(f"{len(bad)} tensors differ from the trainer's after the delta, e.g. {bad[:3]}")


_ARRAYS = ("values", "gaps", "jumps", "jump_index")


def write_delta_file(delta: WeightDelta, path: str | Path) -> Path:
    """`delta` as one safetensors file (its arrays as tensors ``<i>.<field>``, the rest in the
    header's metadata), written under a temporary name and renamed: a reader never sees half of it."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors, meta = {}, []
    for i, t in enumerate(delta.tensors):
        for key in _ARRAYS:
            value = getattr(t, key)
            if value is not None:
                tensors[f"{i}.{key}"] = value.detach().to("cpu").contiguous()
        meta.append({"name": t.name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                     "encoding": t.encoding, "checksum": t.checksum})
    header = {"base_version": str(delta.base_version), "version": str(delta.version),
              "full_nbytes": str(delta.full_nbytes), "tensors": json.dumps(meta)}
    partial = path.with_name(f".{path.name}.partial")
    save_file(tensors, str(partial), metadata=header)
    partial.rename(path)
    return path


def read_delta_file(path: str | Path) -> WeightDelta:
    """What `write_delta_file` wrote; a file that is not a delta is a ValueError."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - a safetensors handle
        meta = json.loads(header["tensors"])
        deltas = [TensorDelta(m["name"], tuple(m["shape"]), getattr(torch, m["dtype"]), m["encoding"],
                              *(tensors.get(f"{i}.{key}") for key in _ARRAYS), checksum=m["checksum"])
                  for i, m in enumerate(meta)]
        return WeightDelta(int(header["base_version"]), int(header["version"]), deltas, int(header["full_nbytes"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path} is not a weight delta file: {exc!r}") from exc
