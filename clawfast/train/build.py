"""What a run is built from: the model directory, the policy, the optimizer, the engine, the rollout
service and the sampling of its rollouts, each from the run's config (`clawfast.train.config`).
The training loop, the cold start, the FSDP followers and `clawfast proxy serve` build through here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import torch

from clawfast.engines.base import Engine, Sampling
from clawfast.rollout import HarnessConfig, OnRay, ProxyConfig, RolloutService, SandboxConfig, SchedulingConfig
from clawfast.train.config import EngineConfig, RunConfig
from clawfast.train.lora import adapter_rank, add_lora, has_adapter
from clawfast.train.push import WeightPusher, engine_layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_dir(config: RunConfig) -> Path:
    """The Hugging Face directory the run starts from ("embedded" or a packaged model's name: built
    on first use)."""
    from clawfast.pretrained import MODELS, prepare_model

    if config.model.path == "embedded":
        from clawfast.embedded import ensure_embedded_model

        return ensure_embedded_model()
    if config.model.path in MODELS:
        return prepare_model(config.model.path)
    path = Path(config.model.path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path {path} is not a Hugging Face model directory (no config.json)")
    return path


def load_policy(config: RunConfig, model_dir: Path, *, value_head: bool = False):
    """A `Policy` from `model_dir` with the run's dtype and attention, its log-probs those of the
    distribution the rollouts sample from: at ``engine.temperature`` (1 for greedy, 0), so that the
    IS weights against the sampler's log-probs measure what changed, not the temperature."""
    from clawfast.train.policy import Policy

    return Policy.from_pretrained(model_dir, dtype=DTYPES[config.model.dtype], attention=config.model.attention,
                                  value_head=value_head, temperature=config.engine.temperature or 1.0)


def resolve_device(name: str) -> torch.device:
    """The torch device ``model.device`` names ("auto": the first GPU torch sees, else the CPU)."""
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"model.device = {name!r}, but torch sees no GPU here (torch {torch.__version__}, "
                             f"CUDA build: {torch.version.cuda or 'none'}): use 'auto' or 'cpu'")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"model.device = {name!r}, but torch sees {torch.cuda.device_count()} GPU(s)")
    return device


# torch.utils.checkpoint options. Non-reentrant on every transformers version (4.57's default is
# reentrant): a reentrant checkpoint whose input needs no gradient (frozen embeddings under LoRA)
# would leave the adapter inside it without gradients. No early stop: a recomputation that stopped
# once it had the tensors it needs would end inside an MoE block, before the hook that routing
# replay leaves the block by (`clawfast.moe_routing.ExpertRouting`).
CHECKPOINTING = {"use_reentrant": False, "early_stop": False}


def build_policy(config: RunConfig, model_dir: Path):
    """The trained policy (a value head under PPO; a LoRA adapter and gradient checkpointing if
    configured), on the CPU (a one-process run moves it to ``model.device``, an FSDP run shards it)."""
    policy = load_policy(config, model_dir, value_head=config.algorithm.name == "ppo")
    if config.model.lora is not None:
        lora = config.model.lora
        add_lora(policy.lm, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    if config.model.gradient_checkpointing:
        # Newer transformers (5.25) name it activation_checkpointing_enable (the old name warns). It acts
        # in train mode only: the RL step runs the policy in it (`clawfast.train.policy.rl_mode`).
        enable = getattr(policy.lm, "activation_checkpointing_enable", None) or policy.lm.gradient_checkpointing_enable
        enable(CHECKPOINTING)
    return policy



def build_optimizer(config: RunConfig, policy: torch.nn.Module) -> torch.optim.Optimizer:
    o = config.optim
    return torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=o.lr, betas=tuple(o.betas),
                             eps=o.eps, weight_decay=o.weight_decay)


def build_engine(engine: EngineConfig, model_dir: Path, *, dtype: str = "float32", seed: int = 0, lm=None,
                 weight_version: int = 0, device: torch.device | None = None, record_routing: str = "off",
                 trainer_device: torch.device | None = None) -> Engine:
    """The engine `engine.kind` names, serving `lm`'s weights (a module, copied, on its device) at
    `weight_version`, or, with no `lm`, the weights in `model_dir` (a torch engine's on `device`,
    default the CPU), in ``engine.dtype`` (None: `dtype`, the training dtype). An `lm` with a LoRA
    adapter: vLLM and remote servers serve the base from `model_dir` and take its adapter. `record_routing`: the
    MoE routing the engine records for routing replay (`algorithm.routing_replay`); only the torch
    engine records any, the others refuse. `trainer_device`: where this process's trainer holds the
    policy (None: no trainer), which sets vLLM's memory share (`vllm_memory`)."""
    dtype = engine.dtype or dtype
    if record_routing != "off" and engine.kind != "torch":
        raise ValueError(f"algorithm.routing_replay = {record_routing!r} needs an engine that records the experts it "
                         f"chose: the torch engine does; clawfast's {engine.kind} engine does not collect them "
                         f"(vLLM 0.32 returns them from its GPU model runner only, enable_return_routed_experts: "
                         f"not wired here until a GPU checks it). Use engine.kind = \"torch\" or routing_replay = \"off\".")
    if engine.kind == "torch":
        from clawfast.engines.torch_engine import TorchEngine

        if lm is None:
            from transformers import AutoModelForCausalLM

            served = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device or "cpu")
        else:  # a copy in the engine's dtype: pushes from a float32 trainer are cast by `load_state_dict`
            served = copy.deepcopy(lm).to(DTYPES[dtype])
        built = TorchEngine(served.eval(), max_batch=engine.max_batch, seed=seed, on_update=engine.on_update,
                            record_routing=record_routing)
        built.weight_version = weight_version
        return built
    if engine.kind == "vllm":
        from clawfast.engines.vllm_engine import VLLMEngine

        # A LoRA policy's base never changes: vLLM serves it from model_dir with the adapter on top.
        lora_rank = adapter_rank(lm) if lm is not None and has_adapter(lm) else None
        built = VLLMEngine(str(model_dir), dtype=dtype, max_model_len=engine.max_model_len, seed=seed,
                           weight_sync=engine.weight_sync or "broadcast", on_update=engine.on_update,
                           deltas=engine.delta_pushes and engine.sync_weights and lora_rank is None,
                           lora_rank=lora_rank, **vllm_memory(engine, trainer_device))
        if lora_rank is not None:
            WeightPusher(built, DTYPES[dtype]).push_adapter(lm, weight_version)
        elif lm is not None:
            push_lm(built, lm, weight_version)
        return built
    from clawfast.engines.remote import RemoteEngine

    adapter = lm is not None and has_adapter(lm) and engine.sync_weights
    built = RemoteEngine(engine.url, weight_version=weight_version, reload_dir=engine.reload_dir,
                         model_dir=model_dir if engine.reload_dir else None, on_update=engine.on_update,
                         deltas=engine.delta_pushes and engine.sync_weights and not adapter, adapters=adapter)
    if adapter:
        WeightPusher(built, DTYPES[dtype]).push_adapter(lm, weight_version)
    elif lm is not None and engine.sync_weights and engine.reload_dir:
        # What the server serves is not known (a resumed run's trained weights, or whatever it was
        # started with): it gets the policy's weights, which every call is then recorded under.
        push_lm(built, lm, weight_version)
    return built


# vLLM's share of a device that a trainer holds too: the trainer's optimizer state and activations are
# allocated after vLLM has started, so vLLM's own default (0.92) would leave them next to nothing.
SHARED_DEVICE_SHARE = 0.5


def vllm_memory(engine: EngineConfig, trainer_device: torch.device | None) -> dict[str, float | int]:
    """vLLM's memory arguments for `engine` (`EngineConfig`'s gpu_memory_utilization and
    kv_cache_memory_bytes): the share defaults to `SHARED_DEVICE_SHARE` where `trainer_device` is
    the device vLLM takes (GPU 0 of those visible, else the CPU: what model.device = "auto" names)."""
    memory: dict[str, float | int] = {}
    if engine.kv_cache_memory_bytes is not None:
        memory["kv_cache_memory_bytes"] = engine.kv_cache_memory_bytes
    share = engine.gpu_memory_utilization
    if share is None and trainer_device is not None and _same_device(trainer_device, resolve_device("auto")):
        share = SHARED_DEVICE_SHARE
    if share is not None:
        memory["gpu_memory_utilization"] = share
    return memory


def _same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` are one device (torch's current device is 0 unless set otherwise)."""
    return a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))


def weight_pusher(config: RunConfig, engine: Engine) -> WeightPusher:
    """What the run's trainer pushes into: `engine`, with delta pushes where the engine takes them
    (``engine.delta_pushes``, ``engine.full_push_every``, ``engine.push_checksums``)."""
    ec = config.engine
    return WeightPusher(engine, DTYPES[ec.dtype or config.model.dtype], delta=ec.delta_pushes,
                        full_every=ec.full_push_every, checksums=ec.push_checksums)


def push_weights(engine: Engine | WeightPusher, policy, version: int) -> None:
    """Send a plain policy's weights to the engine (or its `WeightPusher`) under `version` (every
    later call records it); a policy with a LoRA adapter sends the adapter alone
    (`WeightPusher.push_adapter`); a sharded policy streams them instead
    (`clawfast.train.distributed.ShardedTrainer.push_weights`)."""
    if has_adapter(policy.lm):
        if not isinstance(engine, WeightPusher):
            raise TypeError("an adapter push goes through a WeightPusher (it knows the engine's dtype)")
        engine.push_adapter(policy.lm, version)
        return
    push_lm(engine, policy.lm, version)


def push_lm(engine: Engine | WeightPusher, lm: torch.nn.Module, version: int) -> None:
    """All of `lm`'s weights to the engine under `version`, in the layout it loads (`engine_layout`:
    an MoE's fused experts one tensor per expert for an engine that reads checkpoints)."""
    pairs = ((k, v.detach()) for k, v in lm.state_dict().items())
    engine.update_weights(dict(engine_layout(engine, lm, pairs)), version)


def harness_options(config: RunConfig, *, max_turns: int | None = None) -> dict[str, dict]:
    """`get_harness` keyword arguments per harness of the run: its ``rollout.harness_options``, the
    run's ``rollout.timeout_s`` and ``rollout.harness_max_turns`` (`max_turns`: instead of it)."""
    rc = config.rollout
    return {name: {**rc.harness_options.get(name, {}), "timeout_s": rc.timeout_s,
                   "max_turns": max_turns or rc.harness_max_turns} for name in rc.harnesses}


def rollout_sampling(config: RunConfig, temperature: float) -> Sampling:
    """What every call of the run's rollouts samples with, at `temperature`."""
    return Sampling(temperature=temperature, top_p=config.engine.top_p, top_k=config.engine.top_k,
                    max_calls=config.rollout.max_model_calls)


def rollout_service(config: RunConfig, engine: Engine | str, model_dir: Path, records_dir: Path, *,
                    logs_dir: Path | None = None, concurrency: int | None = None, max_turns: int | None = None,
                    oracle_tasks: Sequence = (), on_ray: bool | None = None) -> RolloutService:
    """The run's `RolloutService` over `engine` (``"oracle"``: the cold start's scripted oracle): the
    one place a run's config becomes the service's settings. concurrency / max_turns: instead of
    ``rollout.concurrency`` / ``rollout.harness_max_turns``. on_ray: run on the cluster of
    ``distributed`` (default: when ``distributed.rollouts = "ray"``)."""
    rc, e = config.rollout, config.engine
    if on_ray is None:
        on_ray = config.distributed.rollouts == "ray"
    ray = OnRay(config.distributed.ray_address, config.tasks.suite, config.tasks.suite_seed) if on_ray else None
    # ``engine.max_tokens`` is both the cap and the budget of a call that names none: a harness may
    # ask for less, never for more.
    proxy = ProxyConfig(max_tokens_cap=e.max_tokens, default_max_tokens=e.max_tokens, max_model_len=e.max_model_len)
    return RolloutService(
        engine, model_dir, records_dir=records_dir, proxy=proxy,
        harnesses=HarnessConfig(harness_options(config, max_turns=max_turns), timeout_s=rc.timeout_s,
                                logs_dir=logs_dir),
        sandbox=SandboxConfig(rc.sandbox),
        scheduling=SchedulingConfig(concurrency or rc.concurrency, ray=ray, infra_retries=rc.infra_retries),
        oracle_tasks=oracle_tasks,
    )  # fmt: skip
