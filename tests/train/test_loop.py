"""The RL loop: deterministic data order, the step on recorded rollouts, mixed harnesses, the real
harness path (proxy + sandbox + harness) with weight versions recorded on every call."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clawfast.train.checkpoint import list_checkpoints
from clawfast.train.config_file import config_from_dict, load_config
from clawfast.train.data import TaskSampler
from clawfast.train.loop import train
from clawfast.train.metrics_log import read_metrics

from loop_fixtures import make_recorded, make_tiny_model, recorded_config_text


@given(n=st.integers(1, 9), seed=st.integers(0, 2**31), position=st.integers(0, 40), size=st.integers(1, 12))
@settings(max_examples=60, deadline=None)
def test_sampler_is_a_function_of_seed_and_position(n, seed, position, size):
    ids = [f"t{i}" for i in range(n)]
    sampler = TaskSampler(list(reversed(ids)), seed)
    window = sampler.take(position, size)
    # The same window from a fresh sampler, and as the concatenation of two smaller takes.
    assert TaskSampler(ids, seed).take(position, size) == window
    cut = size // 2
    assert sampler.take(position, cut) + sampler.take(position + cut, size - cut) == window
    # Every epoch visits every task exactly once.
    for epoch in range(2):
        assert Counter(sampler.take(epoch * n, n)) == Counter(ids)


def test_sampler_refuses_no_tasks():
    with pytest.raises(ValueError, match="no training tasks"):
        TaskSampler([], 0)


def _load(tmp_path: Path, **kwargs):
    model = make_tiny_model(tmp_path / "model")
    harnesses = kwargs.pop("harnesses", ("claude-code",))
    recorded = make_recorded(tmp_path / "recorded", tasks=4, k=3, harnesses=harnesses)
    path = tmp_path / "run.toml"
    path.write_text(recorded_config_text(model, recorded, tmp_path / "run", harnesses=harnesses, **kwargs))
    return load_config(path)


def test_recorded_run_trains_logs_checkpoints_and_plots(tmp_path):
    from safetensors.torch import load_file

    config = _load(tmp_path, steps=3, interval=2)
    before = load_file(str(tmp_path / "model" / "model.safetensors"))
    summary = train(config, progress=False)
    assert summary["steps"] == 3
    records = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["rollouts"] == 2 * 3  # tasks_per_step x samples_per_task
        assert 0.0 <= r["pass@1/claude-code"] <= 1.0
        assert r["stepped"] == 1.0 and np.isfinite(r["loss"]) and r["grad_norm"] > 0
        # Shared prefixes are packed once: fewer rows than the calls' tokens.
        assert r["tokens_packed"] < r["tokens_per_call_flat"] and r["dedup_ratio_call"] > 1
        assert r["weight_version"] == 0  # no engine: nothing to push
        # Main-thread fidelity of the trained rollouts (clawfast.threads), per step.
        assert r["main_pairs"] > 0 and r["main_continuity"] == 1.0 and r["main_drift_tokens"] == 0
        assert r["main_divergences"] == 0 and r["side_calls"] >= 0
    assert [r["data_position"] for r in records] == [2, 4, 6]
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-000002", "step-000003"]
    after = load_file(str(list_checkpoints(tmp_path / "run")[-1] / "model" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert Path(summary["curves"]).stat().st_size > 10_000


def test_varlen_attention_off_a_gpu_stops_the_run_before_it_builds_anything(tmp_path, monkeypatch):
    """model.attention = "varlen" with model.device = "auto" on a machine without a GPU: the policy
    would land on the CPU, where flash-attention's kernel does not run; the run says so first."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = _load(tmp_path, steps=1, interval=1)
    config = config.model_copy(update={"model": config.model.model_copy(update={"attention": "varlen",
                                                                               "dtype": "bfloat16"})})
    with pytest.raises(ValueError, match="'varlen' is flash-attention's CUDA kernel; the policy would be on cpu"):
        train(config, progress=False)
    assert not (tmp_path / "run").exists()


def test_fresh_run_refuses_a_run_dir_with_checkpoints(tmp_path):
    config = _load(tmp_path, steps=2, interval=2)
    train(config, progress=False)
    with pytest.raises(ValueError, match="--resume"):
        train(config, progress=False)
    # Resuming a finished run does nothing more.
    assert train(config, resume=True, progress=False)["steps"] == 2


def test_a_step_that_raises_a_value_error_fails_the_run_it_is_no_config_error(tmp_path, monkeypatch):
    """`clawfast train` exits 2 with one line for a config it refuses before the first step; a
    ValueError raised by a step (a bug, a bad record) is the run's failure: it propagates as such,
    with its traceback and the step it came after, and the checkpoints before it are kept."""
    from clawfast.cli import main
    from clawfast.train import loop

    config = _load(tmp_path, steps=3, interval=1)
    one_step, calls = loop._one_step, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("boom")
        return one_step(*args)

    monkeypatch.setattr(loop, "_one_step", failing)
    with pytest.raises(RuntimeError, match="the run failed after step 1 of 3: boom"):
        main(["train", str(tmp_path / "run.toml"), "--no-progress"])
    assert [p.name for p in list_checkpoints(config.run_dir)] == ["step-000001"]
    assert main(["train", str(tmp_path / "run.toml"), "--no-progress"]) == 2  # refused: it holds checkpoints


def test_a_config_or_run_dir_that_is_not_what_it_should_be_exits_2_with_its_name(tmp_path, capsys):
    """A config path that is a directory or a binary file, a run_dir that is a file: clawfast train
    exits 2 naming it (each was a traceback), and a resume it refuses leaves the run's config.json."""
    from clawfast.cli import main

    _load(tmp_path, steps=1, interval=1)
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "afile").write_text("hi")
    for argv, says in (([str(tmp_path)], "cannot read the config"), ([str(tmp_path / "binary.toml")], "not UTF-8"),
                       ([str(tmp_path / "run.toml"), "--run-dir", str(tmp_path / "afile")], "is a file, not a directory")):
        assert main(["train", *argv, "--no-progress"]) == 2
        assert says in capsys.readouterr().err
    assert main(["train", str(tmp_path / "run.toml"), "--no-progress"]) == 0
    recorded = (tmp_path / "run" / "config.json").read_text()
    assert main(["train", str(tmp_path / "run.toml"), "--no-progress", "--resume", "--set", "model.lora.rank=4"]) == 2
    assert "holds full weights, the policy trains an adapter" in capsys.readouterr().err
    assert (tmp_path / "run" / "config.json").read_text() == recorded


def test_resume_without_a_checkpoint_says_it_starts_at_step_0(tmp_path, capsys):
    """`clawfast train --resume` on a run directory with no checkpoint yet (a restarted job that had
    not reached one, or a mistyped run_dir) starts a fresh run, as its help says, and says so."""
    from clawfast.train.loop import prepare_run_dir

    config = _load(tmp_path, steps=2, interval=2)
    # A KL reference an earlier attempt left before its first checkpoint is not this run's.
    (tmp_path / "run" / "reference").mkdir(parents=True)
    (tmp_path / "run" / "reference" / "config.json").write_text("{}")
    run_dir, ckpt = prepare_run_dir(config, resume=True)
    assert ckpt is None and run_dir == tmp_path / "run" and not (run_dir / "reference").exists()
    assert capsys.readouterr().out == f"no checkpoint in {run_dir}: starting at step 0\n"
    assert prepare_run_dir(config, resume=False) == (run_dir, None)  # a fresh run: nothing to say
    assert capsys.readouterr().out == ""


def test_mixed_harness_groups_by_task_and_harness(tmp_path):
    from clawfast.train import distributed

    config = _load(tmp_path, steps=1, harnesses=("claude-code", "codex"))
    assert config.group_by == "task_harness"
    seen = {}
    real = distributed.train_on_rollouts

    def spy(policy, optimizer, results, cfg, state, ref_policy=None):
        seen["harnesses"] = [r.harness for r in results]
        return real(policy, optimizer, results, cfg, state, ref_policy)

    distributed.train_on_rollouts = spy
    try:
        train(config, progress=False)
    finally:
        distributed.train_on_rollouts = real
    (record,) = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert record["rollouts"] == 2 * 2 * 3
    assert "pass@1/claude-code" in record and "pass@1/codex" in record
    # Mixed at random in the batch, not harness-major.
    hs = seen["harnesses"]
    assert sorted(hs) == sorted(["claude-code"] * 6 + ["codex"] * 6) and hs != sorted(hs)


@pytest.mark.harness
def test_harness_rollouts_record_the_weight_version(tmp_path):
    """The real path (proxy, mini-swe-agent, local sandbox, verifier) with the scripted engine
    playing the oracle: rollouts are scored, and every call records the version being served."""
    from transformers import AutoTokenizer

    from clawfast.embedded import ensure_embedded_model
    from clawfast.engines.scripted import ScriptedEngine
    from clawfast.harness import get_harness
    from clawfast.proxy.render import ChatRenderer
    from clawfast.rollout.oracle import OracleResponder
    from clawfast.tasks import clawbench_mini
    from clawfast.train.build import rollout_service
    from clawfast.train.data import HarnessRollouts

    config = config_from_dict({"rollout": {"sandbox": "local", "concurrency": 2, "harness_max_turns": 4},
                               "run_dir": str(tmp_path / "run")})
    tasks = {t.id: t for t in clawbench_mini() if t.id in ("files-create-1", "shell-chmod-1")}
    model_dir = ensure_embedded_model()
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    engine = ScriptedEngine(renderer.encode, renderer.turn_end_id,
                            responder=OracleResponder(renderer, get_harness("mini-swe-agent"), list(tasks.values())))
    with rollout_service(config, engine, model_dir, tmp_path / "records") as service:
        source = HarnessRollouts(service, tasks)
        first = source.run(sorted(tasks), ["mini-swe-agent"], 1)
        engine.update_weights({}, 7)
        second = source.run(["files-create-1"], ["mini-swe-agent"], 1)
    assert [r.status for r in first.results] == ["ok", "ok"]
    assert [r.reward for r in first.results + second.results] == [1.0, 1.0, 1.0]
    assert {c.weight_version for r in first.results for c in r.calls} == {0}
    assert {c.weight_version for r in second.results for c in r.calls} == {7}


def test_instance_template_is_one_more_config_layer(tmp_path):
    """The compact prompt is set through mini-swe-agent's own `-c` layers, after the adapter's."""
    import json

    from clawfast.harness import get_harness
    from clawfast.harness.base import RunLayout
    from clawfast.train.build import harness_options

    config = config_from_dict({"rollout": {"harness_options": {"mini-swe-agent": {"instance_template": "Do: {{task}}"}},
                                          "harness_max_turns": 5}})
    harness = get_harness("mini-swe-agent", **harness_options(config)["mini-swe-agent"])
    layout = RunLayout(home=tmp_path / "home", workspace=tmp_path / "ws", home_inside="/run/home",
                       workspace_inside="/run/ws")
    prepared = harness.prepare(layout, "http://127.0.0.1:9", "key", "policy")
    layer = json.loads((tmp_path / "home" / MINI_LAYER).read_text())
    assert layer == {"agent": {"instance_template": "Do: {{task}}"}}
    argv = harness.command("a task", layout)
    # The override layer comes last, after the built-in config (named by its absolute path).
    builtin = next(i for i, arg in enumerate(argv) if arg.endswith("/minisweagent/config/mini.yaml"))
    assert argv[-2:] == ["-c", f"/run/home/{MINI_LAYER}"] and argv[builtin - 1] == "-c" and builtin < len(argv) - 2
    assert tmp_path / "home" / MINI_LAYER in prepared.files
    assert harness.max_turns == 5


MINI_LAYER = ".clawfast/mini-instance-template.yaml"


def test_updates_per_step_split_whole_groups():
    from clawfast.records import RolloutResult
    from clawfast.train.algorithms import group_ids
    from clawfast.train.prepare import split_groups

    rs = [RolloutResult(f"r{i}", f"t{i % 5}", "codex" if i % 2 else "claude-code", i) for i in range(20)]
    for group_by in ("task", "task_harness"):
        for n in (1, 2, 3, 7):
            parts = [[rs[i] for i in part] for part in split_groups(group_ids(rs, group_by), n)]
            assert sorted(r.rollout_id for p in parts for r in p) == sorted(r.rollout_id for r in rs)
            key = (lambda r: r.task_id) if group_by == "task" else (lambda r: (r.task_id, r.harness))
            owners = {}
            for i, p in enumerate(parts):
                for r in p:
                    assert owners.setdefault(key(r), i) == i  # a group never straddles two updates
            assert len(parts) == min(n, len({key(r) for r in rs}))


def test_ppo_run_with_two_updates_per_step_checkpoints_the_value_head(tmp_path):
    config = _load(tmp_path, steps=1, interval=1, extra='[algorithm]\nname = "ppo"\n').model_copy()
    config = config.model_copy(update={"optim": config.optim.model_copy(update={"updates_per_step": 2})})
    train(config, progress=False)
    (record,) = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert np.isfinite(record["value_loss"]) and record["stepped"] == 1.0
    assert (list_checkpoints(tmp_path / "run")[-1] / "value_head.safetensors").is_file()


def test_the_kl_reference_is_the_policy_rl_started_from_even_when_kl_turns_on_at_a_resume(tmp_path, monkeypatch, capsys):
    """A fresh run with kl_coef > 0 keeps the starting weights as its reference; a run resumed at
    step 2 with kl_coef turned on is anchored to model.path's weights (it ran no cold start), not to
    the resumed step's, and one that ran a cold start is refused: its starting policy is gone."""
    import json

    from safetensors.torch import load_file

    from clawfast.train import loop
    from clawfast.train.config_file import load_config

    refs = []
    reference_policy = loop._reference_policy
    monkeypatch.setattr(loop, "_reference_policy", lambda *a: refs.append(reference_policy(*a)) or refs[-1])
    config = _load(tmp_path, steps=2, interval=1)
    original = load_file(str(tmp_path / "model" / "model.safetensors"))
    train(config, progress=False)
    assert refs == [None]
    text = (tmp_path / "run.toml").read_text().replace("steps = 2", "steps = 3") + "[algorithm]\nkl_coef = 0.1\n"
    (tmp_path / "run.toml").write_text(text)
    resumed = load_config(tmp_path / "run.toml")
    train(resumed, resume=True, progress=False)
    assert f"KL reference: {tmp_path / 'model'} (the weights RL started from; kl_coef was 0 before step 3)" \
        in capsys.readouterr().out
    ref = refs[-1].lm.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in original.items())
    last = list_checkpoints(tmp_path / "run")[-1]
    trained = load_file(str(last / "model" / "model.safetensors"))
    assert any(not torch.equal(trained[k], v) for k, v in original.items())  # not the resumed step's weights

    state = json.loads((last / "state.json").read_text())
    (last / "state.json").write_text(json.dumps({**state, "extra": {**state["extra"], "coldstart_done": True}}))
    (tmp_path / "run.toml").write_text(text.replace("steps = 3", "steps = 4"))
    with pytest.raises(ValueError, match="kept no KL reference: the reference is the policy after the cold start"):
        train(load_config(tmp_path / "run.toml"), resume=True, progress=False)


def test_a_cold_start_turned_on_at_a_resume_past_step_0_is_refused(tmp_path):
    """A cold start comes before the RL steps: turned on when resuming at step 2 it would have run
    SFT mid-run and saved step 2 again over the checkpoint it resumed from."""
    config = _load(tmp_path, steps=2, interval=2)
    train(config, progress=False)
    # Recorded rollouts cannot run a cold start (the config refuses it): the check before it is the one here.
    later = config.model_copy(update={"steps": 3, "coldstart": config.coldstart.model_copy(update={"enabled": True})})
    with pytest.raises(ValueError, match="coldstart.enabled on a run resumed at step 2 that ran no cold start"):
        train(later, resume=True, progress=False)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-000002"]


def test_coldstart_never_demonstrates_held_out_tasks():
    from clawfast.tasks import clawbench_mini
    from clawfast.train.coldstart import demonstration_tasks

    config = config_from_dict({"coldstart": {"enabled": True, "suite_seeds": [0, 1, 2, 3], "difficulties": ["easy"]}})
    demos = demonstration_tasks(config)
    held_out = [t for t in clawbench_mini(0) if t.split == "eval"]
    assert demos and all(t.split == "train" and t.tags["difficulty"] == "easy" for t in demos)
    assert not {t.instruction for t in demos} & {t.instruction for t in held_out}
    assert not {t.id for t in demos} & {t.id for t in held_out}
    assert len({t.instruction for t in demos}) == len(demos)


def test_training_tasks_filter_by_difficulty_and_category_while_eval_stays_whole():
    from clawfast.tasks import clawbench_mini
    from clawfast.train.data import load_tasks

    config = config_from_dict({"tasks": {"difficulties": ["easy"], "categories": ["files", "shell"]}})
    train_tasks = load_tasks(config, "train", config.tasks.difficulties, config.tasks.categories)
    want = {t.id for t in clawbench_mini(0) if t.split == "train" and t.tags["difficulty"] == "easy"
            and t.tags["category"] in ("files", "shell")}
    assert want and set(train_tasks) == want
    assert set(load_tasks(config, "eval")) == {t.id for t in clawbench_mini(0) if t.split == "eval"}


def test_sft_loss_is_the_nll_of_exactly_the_generated_tokens(tmp_path):
    """Two calls of one session (the second prompt extends the first call's path by a tool result):
    the SFT loss equals the mean NLL of both outputs' tokens read off one plain causal forward."""
    from clawfast.records import CallRecord, RolloutResult
    from clawfast.train.coldstart import demonstration_tree, sft_epoch
    from clawfast.train.policy import Policy

    rng = np.random.default_rng(5)
    ids = lambda n: rng.integers(0, 64, size=n).astype(np.int32)  # noqa: E731
    p1, o1, tool, o2 = ids(23), ids(7), ids(5), ids(9)
    p2 = np.concatenate([p1, o1, tool])
    lp = lambda n: np.full(n, -1.0, np.float32)  # noqa: E731
    calls = [CallRecord("r", 0, "h", p1, o1, lp(7)), CallRecord("r", 1, "h", p2, o2, lp(9))]
    demo = RolloutResult("r", "t", "h", calls=calls, reward=1.0)
    policy = Policy.from_pretrained(make_tiny_model(tmp_path / "m"))
    path = torch.as_tensor(np.concatenate([p2, o2]), dtype=torch.long)
    with torch.no_grad():
        logp = torch.log_softmax(policy.lm(input_ids=path[None]).logits[0].double(), -1)
    positions = list(range(len(p1), len(p1) + 7)) + list(range(len(p2), len(p2) + 9))
    want = -np.mean([float(logp[i - 1, path[i]]) for i in positions])
    m = sft_epoch(policy, torch.optim.SGD(policy.parameters(), lr=0.0), [demonstration_tree(demo)], micro_batch_tokens=64,
                  batch_rollouts=1, rng=np.random.default_rng(0))
    assert m["targets"] == 16 and m["updates"] == 1
    assert abs(m["nll"] - want) < 1e-4  # fp32 forward vs a float64 log-softmax of the same logits


def test_eval_finds_the_model_of_a_run_a_checkpoint_or_a_model_dir(tmp_path, capsys):
    from clawfast.cli import main
    from clawfast.commands.eval import model_dir_of

    config = _load(tmp_path, steps=2, interval=1)
    train(config, progress=False)
    run = tmp_path / "run"
    latest = list_checkpoints(run)[-1]
    assert model_dir_of(run) == latest / "model"  # not the run's own config.json
    assert model_dir_of(latest) == latest / "model"
    assert model_dir_of(tmp_path / "model") == tmp_path / "model"
    with pytest.raises(ValueError, match="not a checkpoint"):
        model_dir_of(tmp_path / "recorded")
    assert main(["eval", str(tmp_path / "run.toml"), "--checkpoint", str(tmp_path / "recorded")]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
    # A config of recorded rollouts cannot evaluate: said, exit 2 (it was a traceback).
    assert main(["eval", str(tmp_path / "run.toml"), "--checkpoint", str(run)]) == 2
    assert "evaluation runs through harnesses" in capsys.readouterr().err
    # A LoRA checkpoint holds no model: merge it first, it says (it was "not a model directory").
    (latest / "adapter_model.safetensors").write_bytes(b"")
    for where in (run, latest):
        with pytest.raises(ValueError, match="holds a LoRA adapter, not a model: merge it into its base first"):
            model_dir_of(where)


def test_evals_a_checkpoint_asked_for_are_rerun_only_where_cut_short(tmp_path):
    """`eval.interval` fires at the last step too (once: `eval.after`'s, where that is on); an eval is
    known done by its record in metrics.jsonl, which a resume truncates past its checkpoint, so an
    eval a killed run did not finish is run again and a finished one is not."""
    from clawfast.train.loop import _eval_logged, _interval_eval_due
    from clawfast.train.metrics_log import MetricsLogger

    every_5 = config_from_dict({"steps": 10, "eval": {"interval": 5, "after": False}})
    assert [s for s in range(1, 11) if _interval_eval_due(every_5, s)] == [5, 10]
    with_after = config_from_dict({"steps": 10, "eval": {"interval": 5}})
    assert [s for s in range(1, 11) if _interval_eval_due(with_after, s)] == [5]
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log("eval", 5, {"pass@1": 0.5, "label": "step 5"})
    logger.log("train", 6, {"loss": 1.0})
    logger.close()
    resumed = MetricsLogger(tmp_path, resume_step=5, tensorboard=False)
    assert _eval_logged(resumed, 5, "step 5") and not _eval_logged(resumed, 5, "after")
    resumed.close()
    assert not _eval_logged(MetricsLogger(tmp_path, resume_step=4, tensorboard=False), 5, "step 5")
