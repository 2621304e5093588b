"""How `VLLMEngine.update_weights` moves tensors into vLLM's workers: the wire both sides share and the
worker's side of it.

Weight updates use vLLM's extension point for RL trainers: `worker_extension_cls` adds
`WeightSyncExtension` methods to each worker, called by name through `collective_rpc` (no pickled
callables, no CUDA IPC). Either way the worker feeds the tensors to its own in-place
`reload_weights` as an iterator, which maps Hugging Face names (and fuses q/k/v, gate/up) exactly as
a checkpoint load does. Two paths, chosen at the engine's construction (``weight_sync``, one of
`WEIGHT_SYNCS`):

- ``"broadcast"`` (default): at construction the engine opens a torch.distributed process group
  with the workers, separate from any default group (FSDP's, vLLM's own): gloo over a loopback
  TCPStore on CPU (vLLM's `stateless_init_torch_distributed_process_group`), vLLM's PyNccl
  communicator over a `StatelessProcessGroup` on CUDA (`open_group`). The engine's process is rank
  0, worker ``r`` (every tensor- and pipeline-parallel worker) rank ``1 + r``; the workers keep the
  checkpoint's names and shapes. An update is one metadata-free RPC (`clawfast_receive_broadcast`)
  plus, per tensor, a two-integer header (checkpoint index, dtype code into `DTYPE_NAMES`) and the
  tensor itself, broadcast one at a time and loaded as it arrives, then an end header (-1, -1):
  nothing beyond the tensor in flight is copied, so an iterable of pairs (a sharded trainer
  gathering one tensor at a time) never exists whole on the engine's side.
- ``"bytes"`` (fallback): one RPC carrying every tensor as (name, dtype, shape, raw bytes)
  (`pack_tensor`), i.e. a CPU copy of the whole update in the engine's process, in the IPC message
  and again in the worker.
- ``"auto"``: broadcast if the group opens, else bytes (logged).

Delta pushes (`clawfast.engines.weight_delta`; an engine built with ``deltas=True``): each worker keeps
a CPU copy of the checkpoint tensors of the last pushes (`clawfast_keep_base`; every load path
updates it). A delta travels as one RPC of packed arrays (`pack_delta`: a tenth of the model, not
worth a broadcast per tensor), or, for a ``vllm serve`` started with this extension, as a delta file
its ``/collective_rpc`` names (`clawfast_load_dir` loads the whole pushes there, keeping the copy);
the worker writes it into its copy and feeds the whole layers it touched to the same in-place reload, so only the delta crosses from the trainer to the workers (the
copy-to-device of those layers stays on the worker's machine). The price: host memory for one
copy of the model's checkpoint tensors per worker.

Not guaranteed: the NCCL branch has not run here (no CUDA build of vLLM on this machine). A peer that
dies mid-broadcast leaves the other side waiting up to `GROUP_TIMEOUT_S` per collective. torch and
vLLM are imported inside the functions that use them, as optional dependencies are everywhere.
"""

from __future__ import annotations

from typing import Any

WEIGHT_SYNCS = ("broadcast", "bytes", "auto")
# Each collective of the weight group (setup, or one tensor's broadcast) fails after this long
# rather than hanging when the other side is gone.
GROUP_TIMEOUT_S = 300.0
# Header dtype codes of the broadcast path (index into this list); floating dtypes only.
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


def dtypes() -> list:
    """The torch dtypes of `DTYPE_NAMES`, in order."""
    import torch

    return [getattr(torch, n) for n in DTYPE_NAMES]


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs in each worker process."""

    _clawfast_base: dict | None = None  # name -> CPU tensor, kept once `clawfast_keep_base` asked

    def clawfast_keep_base(self) -> bool:
        """From now on keep a CPU copy of every tensor loaded, for delta pushes."""
        self._clawfast_base = {}
        return True

    def _clawfast_loaded(self, pairs):
        """`pairs` as they go to the reload, each kept in the base copy when one is kept."""
        base = self._clawfast_base
        for name, tensor in pairs:
            if base is not None:
                base[name] = tensor.detach().to("cpu", copy=True)
            yield name, tensor

    def clawfast_apply_delta(self, packed: list, reload: list) -> list:
        """Write a packed delta (`pack_delta`) into the base copy, then reload the checkpoint tensors
        `reload` (whole layers) from it; return the names whose checksum differs after applying."""
        return self._clawfast_apply(unpack_delta(packed), reload)

    def clawfast_apply_delta_file(self, path: str, reload: str) -> list:
        """`clawfast_apply_delta` of a delta file (`weight_delta.write_delta_file`; a server's
        ``/collective_rpc`` passes strings only: `reload` is a JSON list)."""
        import json

        from clawfast.engines.weight_delta import read_delta_file

        return self._clawfast_apply(read_delta_file(path).tensors, json.loads(reload))

    def clawfast_load_dir(self, path: str) -> int:
        """Load every safetensors file of a checkpoint directory with the in-place reload, keeping
        the base copy (a server that takes delta files); return how many tensors it loaded."""
        from pathlib import Path

        from safetensors import safe_open

        if self._clawfast_base is None:
            self._clawfast_base = {}
        count = 0

        def pairs():
            nonlocal count
            for file in sorted(Path(path).glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                        count += 1
                        yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=self._clawfast_loaded(pairs()))  # type: ignore[attr-defined]
        return count

    def _clawfast_apply(self, deltas: list, reload: list) -> list:
        from clawfast.engines.weight_delta import apply_tensor_delta, checksum

        base = self._clawfast_base
        missing = [t.name for t in deltas if base is None or t.name not in base]
        missing += [name for name in reload if base is None or name not in base]
        if missing:
            raise ValueError(f"no base copy of {missing[:3]}: push the full weights first")
        for t in deltas:
            apply_tensor_delta(base[t.name], t)
        bad = [t.name for t in deltas if t.checksum is not None and checksum(base[t.name]) != t.checksum]
        self.reload_weights(weights_iterator=((name, base[name]) for name in reload))  # type: ignore[attr-defined]
        return bad

    def clawfast_packed_modules(self) -> dict:
        """The model's fused modules (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``)."""
        return dict(getattr(type(self.model_runner.get_model()), "packed_modules_mapping", {}))  # type: ignore[attr-defined]

    def clawfast_moe_layers(self) -> int:
        """How many fused mixture-of-experts layers the model has (vLLM's `MoERunner`, the layers its
        MoE kernels and MoE LoRA run)."""
        from vllm.model_executor.layers.fused_moe import MoERunner

        return sum(isinstance(m, MoERunner) for m in self.model_runner.get_model().modules())  # type: ignore[attr-defined]

    def clawfast_load_weights(self, packed: list) -> int:
        """The bytes path: load ``[(hf_name, dtype, shape, raw bytes), ...]`` (see `pack_tensor`) into
        the running model; return how many tensors it was given."""

        def unpack():
            for name, *array in packed:
                yield name, _unpack_array(array)

        # The worker's in-place reload, not model.load_weights: after the first load vLLM may
        # have post-processed parameters (dropping their loaders); reload_weights restores and
        # re-processes them the way a checkpoint load does.
        self.reload_weights(weights_iterator=self._clawfast_loaded(unpack()))  # type: ignore[attr-defined]
        return len(packed)

    def clawfast_join_group(self, host: str, port: int, world_size: int, backend: str, names: list,
                            shapes: list, timeout_s: float) -> int:
        """The broadcast path, once: join the trainer's process group as rank 1 + this worker's rank
        and keep the checkpoint's names and shapes (headers index into them). Returns the rank."""
        rank = 1 + self.rank  # type: ignore[attr-defined]
        self._clawfast_group = open_group(host, port, rank, world_size, backend, timeout_s)
        self._clawfast_schema = (list(names), [tuple(s) for s in shapes])
        return rank

    def clawfast_receive_broadcast(self) -> int:
        """The broadcast path, per update: receive (header, tensor) pairs from rank 0 until the end
        header, feeding them to the in-place reload as they arrive; return how many it loaded."""
        import torch

        group = self._clawfast_group
        names, shapes = self._clawfast_schema
        device = group.device
        count = 0

        def received():
            nonlocal count
            while True:
                header = torch.empty(2, dtype=torch.int64, device=device)
                group.broadcast(header)
                index, dtype = header.tolist()
                if index < 0:
                    return
                tensor = torch.empty(shapes[index], dtype=dtypes()[dtype], device=device)
                group.broadcast(tensor)
                count += 1
                yield names[index], tensor

        self.reload_weights(weights_iterator=self._clawfast_loaded(received()))  # type: ignore[attr-defined]
        return count


def pack_tensor(name: str, tensor: Any) -> tuple[str, str, list[int], bytes]:
    """One tensor of the bytes path, as `WeightSyncExtension.clawfast_load_weights` takes it."""
    # Raw bytes with dtype and shape: vLLM's utility-call IPC keeps bytes and lists intact but
    # does not rebuild tensors nested in arguments (they arrive as lists).
    return (name, *_pack_array(tensor))


def _pack_array(t: Any) -> tuple[str, list[int], bytes] | None:
    import torch

    if t is None:
        return None
    t = t.detach().to("cpu").contiguous()
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _unpack_array(packed: Any) -> Any:
    import torch

    if packed is None:
        return None
    dtype, shape, raw = packed
    return torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape) if raw else \
        torch.zeros(shape, dtype=getattr(torch, dtype))


def pack_delta(tensors: list) -> list:
    """A delta's `TensorDelta`s as plain lists and bytes (what vLLM's RPC carries intact)."""
    return [[t.name, list(t.shape), str(t.dtype).removeprefix("torch."), t.encoding,
             *(_pack_array(a) for a in (t.values, t.gaps, t.jumps, t.jump_index)), t.checksum] for t in tensors]


def unpack_delta(packed: list) -> list:
    """`pack_delta`'s inverse: the `TensorDelta`s."""
    import torch

    from clawfast.engines.weight_delta import TensorDelta

    return [TensorDelta(name, tuple(shape), getattr(torch, dtype), encoding, *(_unpack_array(a) for a in arrays),
                        checksum=checksum)
            for name, shape, dtype, encoding, *arrays, checksum in packed]


class WeightGroup:
    """One side of the trainer<->workers weight group, separate from any default process group
    (FSDP's, vLLM's own): gloo over a TCPStore on CPU, vLLM's PyNccl communicator on CUDA. Rank 0
    is the trainer; `broadcast` sends from it (rank 0) or receives into the tensor (others)."""

    def __init__(self, backend: str, group: Any, device: Any) -> None:
        self.backend, self._group, self.device = backend, group, device

    def broadcast(self, tensor: Any) -> None:
        if self.backend == "gloo":
            self._group.broadcast(tensor, root=0).wait()
        else:
            import torch

            self._group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())

    def close(self) -> None:
        if self.backend == "gloo":
            from vllm.distributed.utils import (
                stateless_destroy_torch_distributed_process_group,
            )

            stateless_destroy_torch_distributed_process_group(self._group)
        else:
            self._group.destroy()


def open_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
               listen_socket: Any = None) -> WeightGroup:
    """Join the weight group at `host:port` as `rank` ("gloo" or "nccl"); rank 0 may pass the
    `listen_socket` it already bound to that port."""
    from datetime import timedelta

    import torch

    if backend == "gloo":
        from vllm.distributed.utils import (
            stateless_init_torch_distributed_process_group,
        )

        group = stateless_init_torch_distributed_process_group(
            host, port, rank, world_size, "gloo", listen_socket=listen_socket, timeout=timedelta(seconds=timeout_s)
        )
        return WeightGroup("gloo", group, torch.device("cpu"))
    # vLLM's own trainer<->worker NCCL setup (its "nccl" weight-transfer backend uses the same).
    from vllm.distributed.weight_transfer.nccl_common import (
        stateless_init_process_group,
    )

    if listen_socket is not None:
        listen_socket.close()  # StatelessProcessGroup binds the port itself
    device = torch.accelerator.current_device_index()
    return WeightGroup("nccl", stateless_init_process_group(host, port, rank, world_size, device), torch.device("cuda", device))
