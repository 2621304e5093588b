"""LoRA (`model.lora`, `clawfast.train.lora`): the adapter trains alone on frozen base weights, a push
moves the adapter alone into the torch engine, a checkpoint holds the adapter alone and resumes,
`clawfast model merge` exports the merged model, and RL through the whole loop learns with it."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from clawfast.engines.vllm_checkpoint import adapter_is_3d
from clawfast.train.lora import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    adapter_names,
    adapter_rank,
    add_lora,
    add_saved_lora,
    has_adapter,
    load_adapter,
    lora_layers,
    merged_copy,
    save_adapter,
    unpeft_key,
)

from loop_fixtures import VOCAB, make_tiny_model


def tiny_lm(tmp_path, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "base", seed=3), dtype=dtype)


def train_a_few_steps(lm) -> torch.Tensor:
    """Three AdamW steps of next-token loss on random ids (returned); asserts the base did not move."""
    base = {k: v.clone() for k, v in lm.state_dict().items() if ".lora_" not in k}
    optimizer = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 12))
    for _ in range(3):
        torch.nn.functional.cross_entropy(lm(ids).logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    for k, v in lm.state_dict().items():
        if ".lora_" not in k:
            assert torch.equal(v, base[k]), k
    return ids


def test_the_adapter_trains_alone_and_merges_into_the_same_model(tmp_path):
    """Only the adapter requires grad; after optimizer steps the base is bit-identical, the adapter
    moved, and the merged plain model computes the adapted model's logits (float64)."""
    lm = add_lora(tiny_lm(tmp_path), rank=4, alpha=8)
    trainable = {n for n, p in lm.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_names(lm)) and len(trainable) == 2 * 14  # q k v o gate up down, 2 layers
    ids = train_a_few_steps(lm)
    assert any(lm.state_dict()[n].abs().sum() > 0 for n in adapter_names(lm) if ".lora_B." in n)
    merged = merged_copy(lm)
    assert not has_adapter(merged) and type(merged) is type(lm)
    assert not any(".lora_" in k or "base_layer" in k for k in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, lm(ids).logits, rtol=0, atol=1e-10)
        # and it is not the base: the adapter changed the model
        assert (merged(ids).logits - tiny_lm(tmp_path)(ids).logits).abs().max() > 1e-4


def test_merge_refuses_an_out_that_is_a_file_or_the_base_itself(tmp_path, capsys):
    """`clawfast model merge --out FILE` printed FILE and exit 0 with nothing written (transformers only
    logs), and --out BASE overwrote the base model's weights with the merged ones."""
    from clawfast.cli import main
    from clawfast.train.checkpoint import TrainState, save_checkpoint
    from clawfast.train.policy import Policy

    base = make_tiny_model(tmp_path / "base", seed=3)
    policy = Policy.from_pretrained(base)
    policy.lm = add_lora(policy.lm, rank=4, alpha=8)
    checkpoint = save_checkpoint(tmp_path / "run", policy, torch.optim.AdamW(policy.parameters()), TrainState(step=1))
    (tmp_path / "afile").write_text("hi")
    before = (base / "model.safetensors").read_bytes()
    for out, says in ((tmp_path / "afile", "is a file"), (base, "is the base model's directory")):
        assert main(["model", "merge", str(checkpoint), "--out", str(out)]) == 1
        assert says in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "hi" and (base / "model.safetensors").read_bytes() == before
    assert main(["model", "merge", str(checkpoint), "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_moe_adapter_covers_router_and_experts_and_merges(tmp_path, family):
    """"all-linear" on an MoE decoder: peft adapts the attention, the router and the fused experts
    (nested wrappers for the experts' two parameters); routing replay finds the layers' MoE blocks
    as without an adapter; the base stays bit-identical under training,
    the merged plain model computes the adapted logits, and peft loads the saved adapter as it is."""
    from peft import PeftModel
    from tiny_moe import tiny_moe

    lm = add_lora(tiny_moe(family, vocab_size=VOCAB, hidden=32, seed=2), rank=4, alpha=8)
    adapted = {name.split(".")[-1] for name in lora_layers(lm)}
    assert {"q_proj", "gate", "experts"} <= adapted, adapted
    # routing replay sees one MoE block per layer, not the router's wrapper as another
    from clawfast.moe_routing import moe_blocks

    assert [type(b).__name__ for b in moe_blocks(lm)] == [type(layer.mlp).__name__ for layer in lm.model.layers]
    ids = train_a_few_steps(lm)
    merged = merged_copy(lm)
    assert type(merged) is type(lm) and not any(".lora_" in k or "base_layer" in k for k in merged.state_dict())
    save_adapter(lm, tmp_path)
    # what an engine is told: peft gives the fused gate_up_proj twice the rank (a half each), and saves
    # the experts' adapter flattened across them (vLLM's "3D" layout)
    assert adapter_rank(lm) == 8 and adapter_is_3d(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_moe(family, vocab_size=VOCAB, hidden=32, seed=2), str(tmp_path))
    with torch.no_grad():
        expected = lm(ids).logits
        assert (expected - tiny_moe(family, vocab_size=VOCAB, hidden=32, seed=2)(ids).logits).abs().max() > 1e-3
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-4)  # float32 through fused experts
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=1e-6)
        # and so does this module, from peft's config (its adapted parameters included)
        again = add_saved_lora(tiny_moe(family, vocab_size=VOCAB, hidden=32, seed=2), tmp_path)
        torch.testing.assert_close(again(ids).logits, expected, rtol=0, atol=1e-6)


def test_an_adapter_saves_loads_and_refuses_another_shape(tmp_path):
    lm = add_lora(tiny_lm(tmp_path), rank=4, alpha=8)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_" in name:
                p.normal_()
    save_adapter(lm, tmp_path)
    assert adapter_rank(lm) == 4 and not adapter_is_3d(tmp_path)
    again = add_lora(tiny_lm(tmp_path), rank=4, alpha=8)
    load_adapter(again, tmp_path)
    for name in adapter_names(lm):
        assert torch.equal(dict(again.named_parameters())[name], dict(lm.named_parameters())[name])
    assert json.loads((tmp_path / ADAPTER_CONFIG).read_text())["base_model_name_or_path"].endswith("base")
    # peft's own format: peft loads the directory onto the base and computes the same model
    from peft import PeftModel

    peft_lm = PeftModel.from_pretrained(tiny_lm(tmp_path), str(tmp_path))
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(peft_lm(ids).logits, lm(ids).logits, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="saved with rank 4"):
        load_adapter(add_lora(tiny_lm(tmp_path), rank=2, alpha=8), tmp_path)
    with pytest.raises(ValueError, match="names no Linear"):
        add_lora(tiny_lm(tmp_path), rank=2, alpha=4, target_modules=("no_such_proj",))


def test_lora_config_refuses_a_rank_below_one():
    from clawfast.train.config_file import config_from_dict

    with pytest.raises(ValueError):
        config_from_dict({"model": {"lora": {"rank": 0}}})


def vllm_servable_model(path):
    """A tiny Qwen3 over the token tasks' vocabulary that vLLM's CPU attention takes (head_dim 64)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(4)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                 max_position_embeddings=256, tie_word_embeddings=False)).save_pretrained(path)
    return path


@pytest.mark.vllm
@pytest.mark.slow
def test_a_lora_run_pushes_each_adapter_into_vllm(tmp_path):
    """`clawfast train` with engine.kind = "vllm" and an adapter, synchronous (each step samples from
    the adapter the last step pushed): vLLM serves every pushed adapter, so the trainer's log-probs of
    what it sampled are vLLM's (mismatch_k3 at fp32 rounding, step after step, while the adapter
    moves the model); a push is the adapter's file alone. The trainer shares the CPU with vLLM, whose
    share is half (`build.vllm_memory`) and whose KV cache has the size the config gives."""
    pytest.importorskip("vllm")
    from safetensors.torch import load_file
    from test_async import sampled_config, source_of, token_tasks, train_records

    from clawfast.train.checkpoint import latest_checkpoint
    from clawfast.train.loop import train

    model_dir = vllm_servable_model(tmp_path / "base")
    config = sampled_config(tmp_path, model_dir, name="lora-vllm", steps=3, staleness=0,
                            extra="[model.lora]\nrank = 4\nalpha = 8\n")
    config = config.model_copy(update={"engine": config.engine.model_copy(
        update={"kind": "vllm", "max_model_len": 64, "kv_cache_memory_bytes": 64 << 20})})
    caches, source = [], source_of(token_tasks(turns=2))
    train(config, progress=False,
          make_source=lambda engine: caches.append(engine._llm.vllm_config.cache_config) or source(engine))
    assert (caches[0].gpu_memory_utilization, caches[0].kv_cache_memory_bytes) == (0.5, 64 << 20)
    records = train_records(config.run_dir)
    assert len(records) == 3 and all(r["stepped"] == 1 for r in records)
    k3 = [r["mismatch_k3"] for r in records]
    assert max(k3) < 1e-8, k3
    for r in records:
        assert r["push/delta"] == 1 and r["push/bytes"] < 0.1 * r["push/full_bytes"], r
    saved = load_file(str(latest_checkpoint(config.run_dir) / ADAPTER_FILE))
    assert all(t.abs().max() > 1e-3 for name, t in saved.items() if ".lora_B." in name)  # the adapter moved


@pytest.mark.slow
def test_a_lora_run_on_the_quickstart_model_trains_and_pushes_the_adapter_alone(tmp_path, smollm2_dir, monkeypatch):
    """GRPO on SmolLM2-135M with a rank-8 adapter on the attention projections (`clawfast train`, the
    torch engine, rollouts sampled from it): every push moves under 1 % of the model's bytes, the base weights are
    bit-identical after the run in the trainer and in the engine, the engine serves exactly the
    checkpoint's adapter, a resumed run loads it, and `clawfast model merge` exports a model whose
    logits are the engine's."""
    from transformers import AutoModelForCausalLM

    from clawfast.train import loop
    from safetensors.torch import load_file

    from clawfast.train.checkpoint import latest_checkpoint
    from clawfast.train.sampled import EngineRollouts, TokenTask
    from test_async import sampled_config, train_records

    good = set(range(300, 400))
    tasks = {f"t{i}": TokenTask(f"t{i}", prompt=(1, 200 + i, 3, 250 + i),
                                reward=lambda outs: float(np.isin(np.concatenate(outs), list(good)).mean()),
                                turns=1) for i in range(4)}
    engines, policies = [], []
    build_policy = loop.build_policy
    monkeypatch.setattr(loop, "build_policy", lambda *a, **k: policies.append(build_policy(*a, **k)) or policies[-1])

    def source(engine):
        engines.append(engine)
        return EngineRollouts(engine, tasks, max_tokens=4, seed=11)

    config = sampled_config(tmp_path, smollm2_dir, name="lora", steps=2, max_batch=16,
                            extra='[model.lora]\nrank = 8\nalpha = 16\ntarget_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]\n')
    loop.train(config, progress=False, make_source=source)
    records = train_records(config.run_dir)
    assert len(records) == 2 and all(r["stepped"] == 1 for r in records)
    for r in records:
        assert r["push/bytes"] <= 0.01 * r["push/full_bytes"], r
    original = load_file(str(smollm2_dir / "model.safetensors"))  # `prepare_model` writes one file
    checkpoint = latest_checkpoint(config.run_dir)
    assert (checkpoint / ADAPTER_FILE).is_file() and not (checkpoint / "model").exists()
    for lm in (policies[0].lm, engines[0].model):
        state = lm.state_dict()
        for name, tensor in original.items():
            served = state.get(name) if name in state else state[name.replace(".weight", ".base_layer.weight")]
            assert torch.equal(served.to(tensor.dtype), tensor), name
    saved = {unpeft_key(k): v for k, v in load_file(str(checkpoint / ADAPTER_FILE)).items()}
    served = dict(engines[0].model.named_parameters())
    assert all(torch.equal(served[name], tensor) for name, tensor in saved.items())  # the last push is the adapter
    assert any(t.abs().sum() > 0 for name, t in saved.items() if ".lora_B." in name)  # it trained

    out = tmp_path / "merged"
    subprocess.run([sys.executable, "-m", "clawfast.cli", "model", "merge", str(checkpoint), "--out", str(out)],
                   check=True, capture_output=True, text=True)
    # compared in float64, against how far the adapter moved the logits: in float32, W x + B (A x) and
    # (W + B A) x round apart through 30 layers by up to 2e-3 on some logits; in float64 only the merged
    # weights' own float32 rounding is left (1e-5 of the adapter's effect; one layer's adapter left out
    # of the merge would be a few percent of it)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    served = copy.deepcopy(engines[0].model).double()
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float64)
    ids = torch.tensor([[1, 200, 3, 250, 301, 302]])
    with torch.no_grad():
        logits = merged(ids).logits
        error = (logits - served(ids).logits).abs().max().item()
        effect = (logits - base(ids).logits).abs().max().item()
    assert error < 1e-3 * effect, (error, effect)

    resumed = config.model_copy(update={"steps": 3})
    loop.train(resumed, resume=True, progress=False, make_source=source)
    assert len(train_records(config.run_dir)) == 3
