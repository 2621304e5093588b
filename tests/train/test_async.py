"""The asynchronous loop (``algorithm.max_staleness``): its bound, its k = 0 equivalence with the
synchronous loop, its checkpoints, and that RL through it learns.

Rollouts come from `clawfast.train.sampled.EngineRollouts` (the torch engine serving the trained
tiny model, a rule-based reward on the sampled tokens) or from recorded files; the whole of
`clawfast.train.loop.train` runs, weight pushes included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import clawfast.train.distributed as distributed
from clawfast.train.algorithms import version_lags
from clawfast.train.checkpoint import checkpoint_name, latest_checkpoint, read_state
from clawfast.train.config_file import load_config
from clawfast.train.loop import IN_FLIGHT, train
from clawfast.train.sampled import EngineRollouts, TokenTask

from loop_fixtures import make_recorded, make_tiny_model, recorded_config_text

# The rewarded tokens: 6 of the 64, so a random policy's reward starts near 6/64.
GOOD = frozenset(range(10, 16))


def good_fraction(outputs: list[np.ndarray]) -> float:
    tokens = np.concatenate(outputs)
    return float(np.isin(tokens, list(GOOD)).mean()) if tokens.size else 0.0


def token_tasks(n: int = 4, *, turns: int = 1, delays: dict[int, float] | None = None) -> dict[str, TokenTask]:
    delays = delays or {}
    return {f"t{i}": TokenTask(f"t{i}", prompt=(1, 2 + i, 3, 4 + i), reward=good_fraction, turns=turns,
                               feedback=(5, 6), delay_s=delays.get(i, 0.0)) for i in range(n)}


def sampled_config(tmp_path: Path, model_dir: Path, *, name: str, steps: int, algorithm: str = "grpo",
                   staleness: int | None = None, extra: str = "", max_batch: int = 16) -> object:
    text = f"""
run_dir = "{tmp_path / name}"
seed = 5
steps = {steps}
[model]
path = "{model_dir}"
[engine]
kind = "torch"
temperature = 1.0
max_tokens = 4
max_batch = {max_batch}
[rollout]
tasks_per_step = 2
samples_per_task = 8
[algorithm]
name = "{algorithm}"
{"" if staleness is None else f"max_staleness = {staleness}"}
[optim]
lr = 1e-2
micro_batch_tokens = 512
[eval]
before = false
after = false
[checkpoint]
interval = {steps}
keep = 10
{extra}
"""
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return load_config(path)


def source_of(tasks: dict[str, TokenTask], max_tokens: int = 4):
    return lambda engine: EngineRollouts(engine, tasks, max_tokens=max_tokens, seed=11)


def train_records(run_dir: Path) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.parametrize("staleness", [None, 1])
def test_rl_raises_the_reward_sync_and_async(tmp_path, tiny_model, algorithm, staleness):
    """The guard against sign, weighting and staleness bugs: the mean reward of 16 samples per step
    goes from below 0.2 to above 0.8 within 40 steps."""
    config = sampled_config(tmp_path, tiny_model, name="rl", steps=40, algorithm=algorithm, staleness=staleness)
    train(config, progress=False, make_source=source_of(token_tasks()))
    rewards = [r["reward/mean"] for r in train_records(config.run_dir)]
    assert len(rewards) == 40 and all(r["rollouts"] == 16 for r in train_records(config.run_dir))
    assert rewards[0] < 0.2, rewards[:3]
    assert np.mean(rewards[-3:]) > 0.8, rewards


def test_rl_raises_the_reward_with_a_lora_adapter(tmp_path):
    """The same guard with ``model.lora``: only the adapter trains, only the adapter is pushed, and
    the reward still goes from below 0.2 to above 0.8 within 40 steps. The model's weights start at
    10x transformers' default range: with its embeddings (the tied LM head) and norms frozen, an
    adapter moves the logits only as far as the embeddings' scale allows, and a 32-wide model at
    the default range cannot put more than ~3 % on any token (measured: stuck near 0.1 reward)."""
    model = make_tiny_model(tmp_path / "model", seed=1, init=0.2)
    config = sampled_config(tmp_path, model, name="rl-lora", steps=40, extra="[model.lora]\nrank = 8\nalpha = 16\n")
    train(config, progress=False, make_source=source_of(token_tasks()))
    records = train_records(config.run_dir)
    rewards = [r["reward/mean"] for r in records]
    assert len(rewards) == 40 and all(r["push/bytes"] < r["push/full_bytes"] for r in records)
    assert rewards[0] < 0.2, rewards[:3]
    assert np.mean(rewards[-3:]) > 0.8, rewards


@pytest.mark.parametrize("staleness", [None, 1])
def test_a_step_that_makes_no_update_pushes_nothing_and_keeps_the_version(tmp_path, tiny_model, staleness):
    """With filter_groups, a step whose groups all scored alike trains nothing: the weights are as
    they were, so the engine gets no push (none pauses it), the version stays, and the rollouts that
    follow are sampled under it, none counted stale."""
    tasks = {f"t{i}": TokenTask(f"t{i}", prompt=(1, 2 + i, 3, 4 + i), reward=lambda outs: 1.0) for i in range(4)}
    config = sampled_config(tmp_path, tiny_model, name="uniform", steps=3, staleness=staleness)
    config = config.model_copy(update={"algorithm": config.algorithm.model_copy(update={"filter_groups": True})})
    engines = []

    def source(engine):
        engines.append(engine)
        return EngineRollouts(engine, tasks, max_tokens=4, seed=11)

    train(config, progress=False, make_source=source)
    records = train_records(config.run_dir)
    assert [r["stepped"] for r in records] == [0.0] * 3 and [r["weight_version"] for r in records] == [0.0] * 3
    assert not any(key.startswith("push/") for r in records for key in r)
    assert engines[0].weight_version == 0 and read_state(latest_checkpoint(config.run_dir)).weight_version == 0


def test_without_weight_pushes_the_engine_serves_the_models_weights_a_resumed_run_too(tmp_path, tiny_model):
    """engine.sync_weights = false: rollouts come from model.path's weights, fixed. A run resumed from
    a checkpoint whose weights trained away from them serves model.path's weights still (it served
    the checkpoint's), at the version the run started with."""
    tasks = token_tasks()
    config = sampled_config(tmp_path, tiny_model, name="frozen", steps=2)
    config = config.model_copy(update={"engine": config.engine.model_copy(update={"sync_weights": False})})
    original = load_file(str(tiny_model / "model.safetensors"))
    engines = []

    def source(engine):
        engines.append(engine)
        return EngineRollouts(engine, tasks, max_tokens=4, seed=11)

    train(config, progress=False, make_source=source)
    trained = load_file(str(latest_checkpoint(config.run_dir) / "model" / "model.safetensors"))
    assert any(not np.array_equal(trained[k], v) for k, v in original.items())
    train(config.model_copy(update={"steps": 3}), resume=True, progress=False, make_source=source)
    for engine in engines:
        served = engine.model.state_dict()
        assert all(np.array_equal(served[k].numpy(), v) for k, v in original.items()) and engine.weight_version == 0
    assert [r["weight_version"] for r in train_records(config.run_dir)] == [0.0] * 3


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_the_trainer_scores_tokens_at_the_temperature_they_were_sampled_at(tmp_path, tiny_model, temperature):
    """Rollouts sampled at engine.temperature: the trainer's log-probs (proximal pass, same weights as
    the sampler) are the sampler's to fp32 rounding, so the IS weights start at 1; at temperature 1
    they differed by the temperature and truncation cut every weight."""
    config = sampled_config(tmp_path, tiny_model, name=f"t{temperature}", steps=1)
    config = config.model_copy(update={"engine": config.engine.model_copy(update={"temperature": temperature})})
    train(config, progress=False, make_source=source_of(token_tasks()))
    (record,) = train_records(config.run_dir)
    assert record["mismatch_log_ppl_abs_diff"] < 1e-5, record["mismatch_log_ppl_abs_diff"]


def test_staleness_zero_is_the_synchronous_loop_exactly(tmp_path, tiny_model):
    """Same seed: max_staleness = 0 gives the synchronous loop's rollouts (rewards, tasks), losses
    and checkpoint weights, bit for bit (an engine batching one call at a time: no batched matmul
    rounding)."""
    runs = {}
    for name, staleness in (("sync", None), ("async0", 0)):
        config = sampled_config(tmp_path, tiny_model, name=name, steps=4, staleness=staleness, max_batch=1)
        train(config, progress=False, make_source=source_of(token_tasks(turns=2)))
        runs[name] = config.run_dir
    a, b = train_records(runs["sync"]), train_records(runs["async0"])
    for key in ("tasks", "reward/mean", "loss", "pg_loss", "grad_norm", "tokens_packed", "weight_version"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert all(r["async/staleness_max"] == 0 and r["async/dropped_stale_groups"] == 0 for r in b)
    wa = load_file(str(latest_checkpoint(runs["sync"]) / "model" / "model.safetensors"))
    wb = load_file(str(latest_checkpoint(runs["async0"]) / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert read_state(latest_checkpoint(runs["sync"])) == read_state(latest_checkpoint(runs["async0"]))


def test_staleness_zero_matches_sync_on_recorded_rollouts(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    recorded = make_recorded(tmp_path / "recorded")
    dirs = {}
    for name, extra in (("sync", ""), ("async0", "[algorithm]\nmax_staleness = 0\n")):
        path = tmp_path / f"{name}.toml"
        path.write_text(recorded_config_text(model, recorded, tmp_path / name, steps=4, interval=2, extra=extra))
        train(load_config(path), progress=False)
        dirs[name] = tmp_path / name
    for step in (2, 4):
        ca = dirs["sync"] / "checkpoints" / checkpoint_name(step)
        cb = dirs["async0"] / "checkpoints" / checkpoint_name(step)
        wa, wb = (load_file(str(c / "model" / "model.safetensors")) for c in (ca, cb))
        assert all(np.array_equal(wa[k], wb[k]) for k in wa)
        assert read_state(ca) == read_state(cb)
    assert [r["loss"] for r in train_records(dirs["sync"])] == [r["loss"] for r in train_records(dirs["async0"])]


@pytest.mark.parametrize("max_tokens", [4, 160])
def test_no_trained_token_is_older_than_the_bound(tmp_path, tiny_model, monkeypatch, max_tokens):
    """Slow tasks (three calls, 0.4 s of 'tool time' between them) beside fast ones, max_staleness 1:
    every token the trainer is handed is within one version of the trainer's. With short answers
    fast groups overtake slow ones, which then arrive too old and are dropped and counted. With long
    answers (160 tokens: a call outlasts a train step, so pushes land while calls decode; at 48 a run
    sometimes had none), calls in flight at a push go on decoding on the new weights (the engine's
    ``on_update="continue"``): their tokens carry two versions, and the bound holds for the oldest."""
    seen, spanning = [], []
    real = distributed.train_on_rollouts

    def checked(policy, optimizer, results, config, state, ref_policy=None):
        seen.append([int((state.weight_version - c.token_versions).max(initial=0))
                     for r in results for c in r.calls])
        spanning.extend(c for r in results for c in r.calls if c.output_versions is not None)
        return real(policy, optimizer, results, config, state, ref_policy)

    monkeypatch.setattr(distributed, "train_on_rollouts", checked)
    tasks = token_tasks(6, turns=3, delays={0: 0.4, 1: 0.4})
    config = sampled_config(tmp_path, tiny_model, name="bound", steps=8, staleness=1)
    assert config.engine.on_update == "continue"
    train(config, progress=False, make_source=source_of(tasks, max_tokens))
    records = train_records(config.run_dir)
    assert len(seen) == 8 and all(len(lags) == 16 * 3 for lags in seen)
    assert max(max(lags) for lags in seen) <= 1
    assert max(max(lags) for lags in seen) == 1  # the bound is used, not just respected
    assert [r["async/staleness_max"] for r in records] == [float(max(lags)) for lags in seen]
    assert sum(r["async/calls_spanning_pushes"] for r in records) == len(spanning)
    if max_tokens == 4:  # short calls: the slow tasks' tool time decides, and fast groups overtake them
        assert sum(r["async/dropped_stale_groups"] for r in records) > 0
    else:
        assert spanning  # a push came while calls decoded, and they went on
        for call in spanning:
            assert call.weight_version == call.output_versions[0] < call.output_versions[-1]


def test_checkpoint_stores_what_was_in_flight_and_resume_reruns_it(tmp_path, tiny_model, capsys):
    config = sampled_config(tmp_path, tiny_model, name="resume", steps=4, staleness=1,
                            extra="")
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"interval": 2})})
    train(config, progress=False, make_source=source_of(token_tasks()))
    ckpt2 = Path(config.run_dir) / "checkpoints" / checkpoint_name(2)
    state2 = read_state(ckpt2)
    # max_staleness 1: while step 2 trained, step 3's two groups were already running.
    assert len(state2.extra[IN_FLIGHT]) == 2 and state2.data_position > max(state2.extra[IN_FLIGHT])
    assert IN_FLIGHT not in read_state(latest_checkpoint(config.run_dir)).extra  # the last step: nothing left
    # Back to step 2, as if the run had died there.
    import shutil

    shutil.rmtree(Path(config.run_dir) / "checkpoints" / checkpoint_name(4))
    (Path(config.run_dir) / "checkpoints" / "LATEST").write_text(checkpoint_name(2) + "\n")
    capsys.readouterr()
    train(config, resume=True, progress=False, make_source=source_of(token_tasks()))
    out = capsys.readouterr().out
    assert "2 task group(s) were in flight at the checkpoint" in out
    assert read_state(latest_checkpoint(config.run_dir)).step == 4


def test_a_synchronous_resume_runs_what_was_in_flight_once(tmp_path, tiny_model):
    """A checkpoint of an asynchronous run (max_staleness 2) lists four positions in flight; resumed on
    the synchronous schedule, two steps run them, and the checkpoints after hold no list: the last
    two positions stayed listed in every later checkpoint, and each resume from one ran them again."""
    import json

    from clawfast.train.data import TaskSampler

    config = sampled_config(tmp_path, tiny_model, name="sync-resume", steps=2)
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"interval": 1})})
    tasks = token_tasks()
    train(config, progress=False, make_source=source_of(tasks))
    ckpt2 = Path(config.run_dir) / "checkpoints" / checkpoint_name(2)
    state = json.loads((ckpt2 / "state.json").read_text())
    (ckpt2 / "state.json").write_text(json.dumps({**state, "data_position": 8, "extra": {IN_FLIGHT: [4, 5, 6, 7]}}))
    train(config.model_copy(update={"steps": 5}), resume=True, progress=False, make_source=source_of(tasks))
    listed = [read_state(Path(config.run_dir) / "checkpoints" / checkpoint_name(s)).extra.get(IN_FLIGHT) for s in (3, 4, 5)]
    assert listed == [[6, 7], None, None]
    sampler = TaskSampler(sorted(tasks), config.seed)
    want = [",".join(sampler.take(p, 1)[0] for p in pair) for pair in ((4, 5), (6, 7), (8, 9))]
    assert [r["tasks"] for r in train_records(config.run_dir)[2:]] == want


@pytest.mark.harness
def test_producer_keeps_the_bound_with_slow_real_harness_rollouts(tmp_path):
    """The producer over the rollout service (proxy, mini-swe-agent, local sandbox, verifier, the
    scripted engine playing the oracle), max_staleness 1, the first two groups in data order slow
    (their oracle sleeps 10 s): fast groups overtake them, and whatever the timing, every group the
    trainer is handed has its oldest call within one version of the trainer's."""
    import dataclasses

    from transformers import AutoTokenizer

    from clawfast.embedded import ensure_embedded_model
    from clawfast.engines.scripted import ScriptedEngine
    from clawfast.harness import get_harness
    from clawfast.proxy.render import ChatRenderer
    from clawfast.rollout.oracle import OracleResponder
    from clawfast.tasks import clawbench_mini
    from clawfast.train.build import rollout_service
    from clawfast.train.config import RunConfig
    from clawfast.train.data import HarnessRollouts, TaskSampler
    from clawfast.train.producer import RolloutProducer

    config = RunConfig.model_validate({"rollout": {"sandbox": "local", "concurrency": 4, "harness_max_turns": 4},
                                       "run_dir": str(tmp_path / "run")})
    wanted = ("files-create-1", "shell-chmod-1", "files-create-2", "files-lines-1")
    tasks = {t.id: t for t in clawbench_mini() if t.id in wanted}
    sampler = TaskSampler(sorted(tasks), 0)
    for slow in sampler.take(0, 2):
        tasks[slow] = dataclasses.replace(tasks[slow], oracle=tuple(f"sleep 10; {c}" for c in tasks[slow].oracle))
    model_dir = ensure_embedded_model()
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    engine = ScriptedEngine(renderer.encode, renderer.turn_end_id,
                            responder=OracleResponder(renderer, get_harness("mini-swe-agent"), list(tasks.values())))
    taken, dropped = [], 0
    with rollout_service(config, engine, model_dir, tmp_path / "records") as service:
        producer = RolloutProducer(HarnessRollouts(service, tasks), sampler, harnesses=("mini-swe-agent",),
                                   samples_per_task=1, tasks_per_step=2, max_staleness=1, groups_needed=6)
        with producer:
            for version in range(3):
                groups, n = producer.take(version)
                dropped += n
                taken.append((version, groups))
                engine.update_weights({}, version + 1)
                producer.retire(len(groups))
    assert [len(groups) for _, groups in taken] == [2, 2, 2]
    assert [g.position for g in taken[0][1]] == [2, 3]  # the fast ones, overtaking positions 0 and 1
    for version, groups in taken:
        for g in groups:
            assert version_lags(g.results, version).max() <= 1, (version, g.position)
            assert [(r.status, r.reward) for r in g.results] == [("ok", 1.0)], [r.info for r in g.results]
    positions = sorted(g.position for _, groups in taken for g in groups)
    assert len(positions) == 6 and len(set(positions)) == 6 and max(positions) == 5 + dropped


def test_a_recorded_call_that_spans_a_push_trains_with_each_tokens_version_and_logprob(tmp_path, tiny_model):
    """A call the torch engine continued across a push, written to a rollout file and read back:
    its per-token versions survive the file, the staleness filter counts its oldest token, and the
    trainer's targets carry each token's own sampling log-prob."""
    import torch

    from clawfast.engines.base import SamplingParams
    from clawfast.engines.torch_engine import TorchEngine
    from clawfast.records import CallRecord, RolloutResult, read_rollouts, write_rollouts
    from clawfast.train.prepare import prepare_step
    from clawfast.train.step_config import StepConfig
    from engines.test_torch_engine import continued_call

    engine = TorchEngine.from_pretrained(tiny_model, seed=0, max_batch=1)
    torch.manual_seed(0)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    prompt = np.array([1, 2, 3, 4])
    gen = continued_call(engine, prompt, SamplingParams(max_tokens=40, seed=3), new)
    assert gen.output_versions[0] == 0 and gen.output_versions[-1] == 1
    rollouts = [RolloutResult(f"r{i}", "t0", "h", reward=float(i), calls=[CallRecord(
        f"r{i}", 0, "h", prompt if i else prompt[:3], gen.output_ids, gen.infer_logprobs,
        weight_version=gen.weight_version, output_versions=gen.output_versions)]) for i in range(2)]
    back = read_rollouts(write_rollouts(tmp_path, rollouts)[0].parent)
    np.testing.assert_array_equal(back[1].calls[0].token_versions, gen.output_versions)
    assert back[1].calls[0].equals(rollouts[1].calls[0])
    # The oldest token is version 0: at trainer version 2 it lags 2 whatever its later tokens.
    assert prepare_step(back, None, StepConfig(max_staleness=1), weight_version=2).counts["dropped_stale"] == 2
    data = prepare_step(back, None, StepConfig(max_staleness=2), weight_version=2)
    assert data.counts["dropped_stale"] == 0
    for r in range(2):
        got = np.concatenate([b.infer_logprobs[(b.target_rollout == r) & (b.loss_mask > 0)] for b in data.batches])
        np.testing.assert_array_equal(got, gen.infer_logprobs)
