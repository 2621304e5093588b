"""MoE routing replay (docs/MODELS.md "Routing replay"): the torch engine records the experts every
layer chose, the proxy stores them with each call (a row once per rollout), the prefix tree and the
packer carry them to the packed rows, and the trainer's forward uses them. On a model whose routers
nearly tie (`tiny_moe.near_tie_routers`: which experts a token gets is decided by float rounding),
the trainer's log-probs of the sampled tokens equal the engine's with replay on, and are far off
with it off."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from clawfast.engines.base import SamplingParams
from clawfast.engines.torch_engine import TorchEngine
from clawfast.moe_routing import ExpertRouting
from clawfast.train.policy import Policy
from clawfast.train.prepare import prepare_step
from clawfast.train.step_config import StepConfig

from tiny_moe import MOE_FAMILIES, near_tie_routers, tiny_moe

# float32 rounding of two computations of one forward (packed vs. incremental, batched); an expert
# chosen differently moves a log-prob by far more (measured: 0.3 to 1.7)
EXACT = 1e-4
FAR = 0.05


def chain_logprobs(policy: Policy, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    path = torch.as_tensor(np.concatenate([prompt, output]), dtype=torch.long)
    n = len(path)
    with torch.no_grad():
        out = policy(path, torch.arange(n), torch.full((n,), n - 1), torch.arange(len(prompt) - 1, n - 1),
                     path[len(prompt):])
    return out.logprobs.numpy()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_engine_records_the_experts_every_row_was_routed_to(family):
    """Concurrent calls (one batch, a shared prefix computed once and cached): each answer's routing
    covers every row it read, and forcing it in a plain forward gives the engine's log-probs."""
    lm = near_tie_routers(tiny_moe(family, vocab_size=64, seed=1), seed=2)
    engine = TorchEngine(copy.deepcopy(lm), record_routing="all", seed=0)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 64, 24)
    prompts = [np.concatenate([system, rng.integers(0, 64, n)]) for n in (3, 7, 5)]

    async def go():
        out = await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=24, seed=i))
                                     for i, p in enumerate(prompts)])
        await engine.close()
        return out

    answers = asyncio.run(go())
    policy = Policy(lm, attention="torch")
    routing = ExpertRouting(lm)
    far = 0.0
    for prompt, answer in zip(prompts, answers):
        rows = len(prompt) + len(answer.output_ids) - 1
        assert answer.routing_start == 0 and answer.routing.shape == (rows, 2, 2)
        assert answer.routing.dtype == np.uint8 and answer.routing.max() < 8
        routing.clear()
        far = max(far, np.abs(chain_logprobs(policy, prompt, answer.output_ids) - answer.infer_logprobs).max())
        forced = np.concatenate([answer.routing, answer.routing[-1:]]).astype(np.int64)  # the last row: unused
        routing.force(torch.as_tensor(forced), torch.ones(rows + 1, dtype=torch.bool))
        np.testing.assert_allclose(chain_logprobs(policy, prompt, answer.output_ids), answer.infer_logprobs, atol=EXACT)
    assert far > FAR  # the routers do tie: without the engine's choice the trainer computes another model

    generated = TorchEngine(copy.deepcopy(lm), record_routing="generated", seed=0)
    answer = asyncio.run(generated.generate(prompts[0], SamplingParams(max_tokens=8, seed=0)))
    assert answer.routing_start == len(prompts[0]) and len(answer.routing) == len(answer.output_ids) - 1


def test_replay_makes_the_trainer_compute_what_the_engine_sampled(embedded_dir, renderer, tmp_path):
    """The bar: a conversation through the proxy (the official OpenAI client; each turn extends the
    last, one turn asked twice, so the tree forks), read back from its record file, packed with its
    shared rows once: with ``routing_replay = "all"`` every target's log-prob under the packed tree
    equals the engine's; with "off" they differ by whole experts; "generated" replays the sampled
    rows only. A training step with replay moves the routers."""
    import openai
    from transformers import AutoConfig

    from clawfast.proxy import ProxyApp, ProxyConfig, ProxyCore, ProxyServer, RolloutRegistry
    from clawfast.records import read_rollout, rollout_path
    from clawfast.train.step import train_step

    vocab = AutoConfig.from_pretrained(embedded_dir).vocab_size
    lm = near_tie_routers(tiny_moe("qwen3_moe", vocab_size=vocab, seed=3), seed=4)
    engine = TorchEngine(copy.deepcopy(lm), record_routing="all", seed=0)
    registry = RolloutRegistry(tmp_path / "records")
    with ProxyServer(ProxyApp(ProxyCore(engine, renderer, ProxyConfig(keepalive_s=0.5)), registry)) as server:
        key = registry.open("r", task_id="t").key
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
        messages = [{"role": "system", "content": "You are a careful assistant."},
                    {"role": "user", "content": "List three prime numbers."}]
        for turn in range(3):
            asked = 2 if turn == 1 else 1  # turn 1 asked twice: two answers to one prompt
            for _ in range(asked):
                reply = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=1.0)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or "ok"},
                         {"role": "user", "content": f"And now {turn + 2} more."}]
    registry.close("r", reward=1.0)
    rollout = read_rollout(rollout_path(tmp_path / "records", "r"))
    assert len(rollout.calls) == 4 and all(c.routing is not None for c in rollout.calls)
    # A row is stored once: a later turn stores only what no earlier call of the rollout ran.
    assert all(c.routing_start > 0 for c in rollout.calls[1:])
    stored = sum(len(c.routing) for c in rollout.calls)
    assert stored < sum(len(c.prompt_ids) + len(c.output_ids) - 1 for c in rollout.calls)

    policy = Policy(lm, attention="torch")

    def gap(mode: str) -> tuple[float, dict]:
        data = prepare_step([rollout], None, StepConfig(routing_replay=mode, micro_batch_tokens=512))
        with torch.no_grad():
            diffs = [np.abs(policy.run(b).logprobs.numpy() - b.infer_logprobs) for b in data.batches]
        return float(np.concatenate(diffs).max()), data.counts

    exact, counts = gap("all")
    assert exact < EXACT
    assert counts["routing/rows_replayed"] > 0
    off, off_counts = gap("off")
    assert off > FAR and "routing/rows_replayed" not in off_counts
    _, generated = gap("generated")
    assert 0 < generated["routing/rows_replayed"] < counts["routing/rows_replayed"]

    before = lm.model.layers[0].mlp.gate.weight.detach().clone()
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-2)
    metrics = train_step(policy, optimizer, [rollout], None,
                         # one rollout: GRPO's advantage is 0, the entropy bonus gives the gradient
                         StepConfig(routing_replay="all", micro_batch_tokens=512, is_mode="off", entropy_coef=0.1))
    assert metrics["stepped"] == 1 and np.isfinite(metrics["loss"])
    assert metrics["mismatch_k3"] < 1e-8 and metrics["routing/rows_replayed"] > 0
    assert not torch.equal(before, lm.model.layers[0].mlp.gate.weight)



def test_a_checkpointed_recomputation_replays_the_forced_routing_and_leaves_each_block():
    """Under gradient checkpointing (the trainer's options, `clawfast.train.build.CHECKPOINTING`), each
    MoE block runs again in the backward pass: it must take the forced routing again and leave the
    block through its hook (a recomputation that stopped early left one routing mode open per block
    and backward, on torch's mode stack), and the gradients are those of the plain forward."""
    from clawfast.train.build import CHECKPOINTING

    grads = {}
    for checkpointing in (False, True):
        lm = near_tie_routers(tiny_moe("qwen3_moe", vocab_size=64, hidden=32, seed=5), seed=6).train()
        if checkpointing:
            lm.gradient_checkpointing_enable(CHECKPOINTING)
        routing = ExpertRouting(lm)
        ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
        # distinct experts per row, as a top-k gives
        forced = torch.rand(12, routing.layers, routing.experts, generator=torch.Generator().manual_seed(1))
        forced = forced.argsort(dim=-1)[..., :routing.top_k]
        routing.force(forced, torch.ones(12, dtype=torch.bool))
        for _ in range(2):
            lm.zero_grad()
            lm(input_ids=ids).logits.sum().backward()
            assert routing._open == []
        grads[checkpointing] = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
        routing.clear()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-5, atol=1e-6, msg=name)

def test_replay_refuses_what_it_cannot_do(embedded_dir, tmp_path):
    """A dense model has no routing to record or force; engines that do not record refuse replay, and
    so does a step whose rollouts recorded none."""
    from transformers import AutoModelForCausalLM

    from clawfast.train.build import build_engine
    from clawfast.train.config import EngineConfig

    dense = AutoModelForCausalLM.from_pretrained(embedded_dir)
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        TorchEngine(dense, record_routing="all")
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        ExpertRouting(dense)
    with pytest.raises(ValueError, match="record_routing must be one of"):
        TorchEngine(dense, record_routing="some")
    with pytest.raises(ValueError, match="needs an engine that records"):
        build_engine(EngineConfig(kind="vllm"), embedded_dir, record_routing="all")
    with pytest.raises(ValueError):
        StepConfig(routing_replay="sometimes")
    from clawfast.records import CallRecord, RolloutResult

    call = CallRecord("r", 0, "h", np.arange(1, 6), np.arange(6, 9), np.full(3, -0.5, np.float32))
    plain = RolloutResult(rollout_id="r", task_id="t", harness="h", sample_index=0, reward=1.0, status="ok",
                          calls=[call])
    with pytest.raises(ValueError, match="no call of the step's 1 rollout"):
        prepare_step([plain], None, StepConfig(routing_replay="all"))
    routing = ExpertRouting(tiny_moe("mixtral", vocab_size=32))
    with pytest.raises(ValueError, match="expert index 9"):
        routing.force(torch.full((4, 2, 2), 9), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="routing of shape"):
        routing.force(torch.zeros((4, 3, 2), dtype=torch.long), torch.ones(4, dtype=torch.bool))


@pytest.mark.parametrize("replay, lora, checkpointing", [("off", False, False), ("all", False, False),
                                                        ("all", True, False), ("all", False, True)],
                         ids=["off", "all", "all-lora", "all-checkpointed"])
def test_the_training_loop_replays_across_weight_pushes(tmp_path, replay, lora, checkpointing):
    """`clawfast train` on a near-tie MoE policy with the torch engine (two-turn token tasks, a push
    after every step): with ``routing_replay = "all"`` the engine records, every step trains on
    replayed rows and its trainer/sampler mismatch stays at rounding, weight push after push; with
    "off" the same run's mismatch is orders of magnitude larger. With a LoRA adapter (on the
    attention, the routers and the experts: peft's "all-linear") replay holds alike, pushes being
    the adapter's. With gradient checkpointing, each MoE block's recomputation in the backward pass
    replays the same routing."""
    from loop_fixtures import VOCAB
    from test_async import sampled_config, source_of, token_tasks, train_records

    from clawfast.train.loop import train

    model_dir = tmp_path / "moe"
    near_tie_routers(tiny_moe("qwen3_moe", vocab_size=VOCAB, hidden=32, seed=5), seed=6).save_pretrained(model_dir)
    config = sampled_config(tmp_path, model_dir, name=f"replay-{replay}-{lora}", steps=3,
                            extra="[model.lora]\nrank = 4\nalpha = 8\n" if lora else "")
    # A small lr: Adam's first steps move every weight by about lr, and at 1e-2 they would pull the
    # routers out of their ties (then there is nothing left for replay to fix).
    config = config.model_copy(update={"algorithm": config.algorithm.model_copy(update={"routing_replay": replay}),
                                       "optim": config.optim.model_copy(update={"lr": 1e-9}),
                                       "model": config.model.model_copy(update={"gradient_checkpointing": checkpointing})})
    train(config, progress=False, make_source=source_of(token_tasks(turns=2)))
    records = train_records(config.run_dir)
    assert len(records) == 3 and all(r["stepped"] == 1 for r in records)
    k3 = [r["mismatch_k3"] for r in records]
    if replay == "all":
        assert all(r["routing/rows_replayed"] > 0 for r in records)
        assert max(k3) < 1e-9, k3
        if lora:
            assert all(r["push/bytes"] < 0.5 * r["push/full_bytes"] for r in records)
    else:
        assert "routing/rows_replayed" not in records[0]
        assert min(k3) > 1e-6, k3


def test_rows_the_engine_ran_twice_otherwise_are_trained_apart(tmp_path):
    """An engine without prefix caching runs each turn's whole conversation again, and on a near-tie
    model the second run routes some rows otherwise than the first. The call stores its routing from
    the first such row (`clawfast.routing_store`), the tree keeps the two computations apart from
    there, and every call's log-probs are replayed exactly: the first turn's on its own rows, the
    next turn's on the rows it ran."""
    from clawfast.proxy import RolloutRegistry
    from clawfast.records import RolloutResult

    lm = near_tie_routers(tiny_moe("mixtral", vocab_size=64, seed=7), seed=8)
    engine = TorchEngine(copy.deepcopy(lm), record_routing="all", seed=0, prefix_cache_tokens=0)
    registry = RolloutRegistry(tmp_path)
    registry.open("r")
    rollout = registry.get("r")
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 64, 30).astype(np.int32)
    for turn in range(4):
        answer = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=12, seed=turn)))
        rollout.append(prompt_ids=prompt, output_ids=answer.output_ids, infer_logprobs=answer.infer_logprobs,
                       routing=answer.routing, routing_start=answer.routing_start)
        prompt = np.concatenate([prompt, answer.output_ids, rng.integers(0, 64, 5)]).astype(np.int32)
    result: RolloutResult = registry.close("r", reward=1.0)
    starts = [c.routing_start for c in result.calls[1:]]
    previous = [len(c.path) - 1 for c in result.calls[:-1]]
    assert any(s < p for s, p in zip(starts, previous))  # some turn ran earlier rows otherwise

    policy = Policy(lm, attention="torch")
    data = prepare_step([result], None, StepConfig(routing_replay="all", micro_batch_tokens=1024))
    plain = prepare_step([result], None, StepConfig(micro_batch_tokens=1024))
    # Unrouted: at most each call's last sampled token, which no forward of its own read (and which a
    # call that branched off earlier does not share).
    assert data.counts["routing/rows_own"] <= len(result.calls)
    assert sum(b.num_tokens for b in data.batches) > sum(b.num_tokens for b in plain.batches)  # kept apart
    with torch.no_grad():
        for b in data.batches:
            np.testing.assert_allclose(policy.run(b).logprobs.numpy(), b.infer_logprobs, atol=EXACT)


def test_sequence_weights_sum_each_target_on_its_own_path():
    """Sequence-level IS under replay: where a later call ran a row of an earlier answer otherwise, the
    tree holds two sibling rows of one token; each target's log-ratio is summed on the paths through
    its own row (a lookup by token would give one sibling's targets the other's path)."""
    from clawfast.records import CallRecord, RolloutResult
    from clawfast.train.algorithms import forest_paths

    rng = np.random.default_rng(1)

    def routed(n):
        return rng.integers(0, 8, (n, 2, 2)).astype(np.uint8)

    def rollout(rid, reward):
        prompt, answer, more, second = (rng.integers(10, 50, n).astype(np.int32) for n in (10, 5, 3, 5))
        first_routing = routed(14)
        first = CallRecord(rid, 0, "h", prompt, answer, np.full(5, -0.5, np.float32), routing=first_routing,
                           routing_start=0)
        again = np.concatenate([first_routing, routed(8)])
        again[12] = (first_routing[12] + 1) % 8  # row 12, in the first answer, routed otherwise this time
        second_call = CallRecord(rid, 1, "h", np.concatenate([prompt, answer, more]), second,
                                 np.full(5, -0.5, np.float32), routing=again, routing_start=0)
        return RolloutResult(rid, "t", "h", 0, reward, "ok", calls=[first, second_call])

    data = prepare_step([rollout("a", 1.0), rollout("b", 0.0)], None,
                        StepConfig(name="grpo", is_level="sequence", routing_replay="all", micro_batch_tokens=4096))
    forest, rows = data.forest, np.concatenate(data.forest_rows)
    siblings = {}
    for row in range(forest.num_rows):
        siblings.setdefault((int(forest.parent[row]), int(forest.tokens[row])), []).append(row)
    assert any(len(s) > 1 for s in siblings.values())  # the case at hand: one token, two rows
    paths = forest_paths(forest, rows)
    np.testing.assert_array_equal(paths.target_child.numpy(), rows)
    x = torch.arange(1, len(rows) + 1, dtype=torch.float64)
    want = []
    for leaf in forest.leaf_rows:
        on, row = set(), int(leaf)
        while row >= 0:
            on.add(row)
            row = int(forest.parent[row])
        want.append(sum(float(x[k]) for k, r in enumerate(rows) if r in on))
    np.testing.assert_allclose(paths.path_sum(x).numpy(), want)
