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

    def clawfast_packed_modules(self) -> dict:
        """The model's fused modules (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``)."""
        return dict(getattr(type(self.model_runner.get_model()), "packed_modules_mapping", {}))  # type: ignore[attr-defined]

    def clawfast_load_weights(self, packed: list) -> int:
        """The bytes path: load ``[(hf_name, dtype, shape, raw bytes), ...]`` (see `pack_tensor`) into
        the running model; return how many tensors it was given."""
        import torch

        def unpack():
            for name, dtype, shape, raw in packed:
                yield name, torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)

        # The worker's in-place reload, not model.load_weights: after the first load vLLM may
        # have post-processed parameters (dropping their loaders); reload_weights restores and
        # re-processes them the way a checkpoint load does.
        self.reload_weights(weights_iterator=unpack())  # type: ignore[attr-defined]
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

        self.reload_weights(weights_iterator=received())  # type: ignore[attr-defined]
        return count


def pack_tensor(name: str, tensor: Any) -> tuple[str, str, list[int], bytes]:
    """One tensor of the bytes path, as `WeightSyncExtension.clawfast_load_weights` takes it."""
    # Raw bytes with dtype and shape: vLLM's utility-call IPC keeps bytes and lists intact but
    # does not rebuild tensors nested in arguments (they arrive as lists).
    import torch

    t = tensor.detach().to("cpu").contiguous()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes()


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
