"""Config loading: TOML -> typed sections, errors that name the file and the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from clawfast.train.config import RunConfig
from clawfast.train.config_file import ConfigError, config_from_dict, load_config
from clawfast.train.step_config import step_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.toml")))
def test_examples_load_and_build_a_step_config(name):
    config = load_config(EXAMPLES / name)
    assert isinstance(config, RunConfig)
    step = step_config(config)
    assert step.name == config.algorithm.name
    assert step.micro_batch_tokens == config.optim.micro_batch_tokens


def test_engine_defaults_follow_the_kind(tmp_path):
    """Calls in flight continue across a push, and pushes are deltas, where the engine does both
    exactly; a remote server finishes its calls (its abort reaches every client) and takes whole
    pushes unless told its workers run the project's extension."""
    engines = {kind: load_config(write(tmp_path, f'[engine]\nkind = "{kind}"\n{extra}')).engine for kind, extra in (
        ("torch", ""), ("vllm", ""), ("remote", 'url = "http://h:1"\nreload_dir = "/tmp/r"\n'))}
    assert {k: (e.on_update, e.delta_pushes) for k, e in engines.items()} == {
        "torch": ("continue", True), "vllm": ("continue", True), "remote": ("finish", False)}
    told = load_config(write(tmp_path, '[engine]\nkind = "remote"\nurl = "http://h:1"\nreload_dir = "/tmp/r"\n'
                                       'on_update = "continue"\ndelta_pushes = true\ndtype = "bfloat16"\n')).engine
    assert (told.on_update, told.delta_pushes, told.dtype) == ("continue", True, "bfloat16")


def test_defaults_and_sections(tmp_path):
    config = load_config(write(tmp_path, 'steps = 3\n[optim]\nlr = 0.5\n[rollout]\nharnesses = ["codex", "openclaw"]\n'))
    assert config.steps == 3 and config.optim.lr == 0.5
    assert config.group_by == "task_harness"  # auto: several harnesses
    assert step_config(config).group_by == "task_harness"
    assert load_config(write(tmp_path, "")).group_by == "task"


def test_a_harness_is_known_once_it_is_registered(tmp_path, monkeypatch):
    """The run's harness names are the registry's (`clawfast.harness.HARNESSES`): a harness added
    there trains without the config being told."""
    from clawfast.harness import HARNESSES, MiniSweAgent

    text = '[rollout]\nharnesses = ["my-harness"]\n'
    with pytest.raises(ConfigError, match="my-harness"):
        load_config(write(tmp_path, text))
    monkeypatch.setitem(HARNESSES, "my-harness", MiniSweAgent)
    assert load_config(write(tmp_path, text)).rollout.harnesses == ("my-harness",)


@pytest.mark.parametrize("text, field", [
    ("[optim]\nlr = -1\n", "optim.lr"),
    ("[optim]\nlr = \"fast\"\n", "optim.lr"),
    ("[rollout]\nharnesses = [\"nope\"]\n", "rollout.harnesses"),
    ("[rollout]\nharnesses = []\n", "rollout.harnesses"),
    ("[rollout]\nsamples_per_task = 1\n", "<root>"),  # GRPO with groups of one
    ("[engine]\nkind = \"sglang\"\n", "engine.kind"),
    ("[engine]\nkind = \"remote\"\n", "engine"),
    ("[engine]\nkind = \"remote\"\nurl = \"http://h:1\"\nsync_weights = false\non_update = \"abort\"\n", "engine"),
    ("[engine]\nkind = \"vllm\"\non_update = \"abort\"\n", "engine"),
    ("[engine]\non_update = \"later\"\n", "engine.on_update"),
    ("[engine]\nfull_push_every = 0\n", "engine.full_push_every"),
    ("[engine]\ndtype = \"fp8\"\n", "engine.dtype"),
    ("[engine]\ngpu_memory_utilization = 0.5\n", "engine"),  # the torch engine takes no share
    ("[model]\nattention = \"varlen\"\n", "model"),  # flash-attention's kernel: half precision
    ("[model]\nattention = \"varlen\"\ndtype = \"bfloat16\"\ndevice = \"cpu\"\n", "model"),
    ("[engine]\nkind = \"vllm\"\ngpu_memory_utilization = 1.5\n", "engine.gpu_memory_utilization"),
    ("[engine]\nkind = \"vllm\"\nkv_cache_memory_bytes = 0\n", "engine.kv_cache_memory_bytes"),
    ("[algorithm]\nkeep_statuses = [\"fine\"]\n", "algorithm.keep_statuses"),
    ("[algorithm]\nis_mode = \"mask\"\nis_lo = 3.0\n", "algorithm"),
    ("[algorithm]\nclip_low = 1.5\n", "algorithm.clip_low"),
    ("[algorithm]\ntrain_threads = [\"subagent\"]\n", "algorithm.train_threads"),
    ("[algorithm]\ntrain_threads = [\"main\", \"subagents\"]\n", "algorithm.train_threads"),
    ("[optim]\nbetas = [0.9, 1.0]\n", "optim.betas"),
    ("[tasks]\nsplit = \"test\"\n", "tasks.split"),
    ("[eval]\nsamples = 3\n", "eval.samples"),
    ("[eval.judge]\nmodel = \"j\"\n", "eval.judge"),
    ("[eval.judge]\nurl = \"http://h:1/v1\"\nmodel_dir = \"/m\"\n", "eval.judge"),
    ("[eval.judge]\nurl = \"h:1/v1\"\n", "eval.judge"),
    ("stepz = 3\n", "stepz"),
    ("[rollout]\nsource = \"recorded\"\n", "rollout"),
    ("[rollout.harness_options.mini-swe-agent]\ninstance_template = \"no task here\"\n", "rollout"),
    ("[rollout.harness_options.mini-swe-agent]\ninstance_template = 3\n", "rollout"),
    ("[rollout.harness_options.mini-swe-agent]\ninstance_templat = \"{{task}}\"\n", "rollout"),
    ("[rollout.harness_options.mini-swe-agent]\ntimeout_s = 3\n", "rollout"),
    ("[rollout]\nharnesses = [\"codex\"]\n[rollout.harness_options.mini-swe-agent]\ninstance_template = \"{{task}}\"\n", "rollout"),
    ("[rollout]\nharnesses = [\"openclaw\"]\n[rollout.harness_options.openclaw]\ncontext_window = 0\n", "rollout"),
    ("[rollout]\nharness_options = {mini-swe-agent = 3}\n", "rollout.harness_options.mini-swe-agent"),
    ("[rollout]\nmini_instance_template = \"{{task}}\"\n", "rollout"),
    ("[engine]\nmax_model_len = 16000\n[rollout]\nharnesses = [\"codex\"]\n[rollout.harness_options.codex]\n"
     "context_window = 16001\n", "<root>"),
    ("[distributed]\nrollouts = \"ray\"\n", "<root>"),
    ("[model]\ndevice = \"gpu\"\n", "model.device"),
    ("[model]\ndevice = \"cuda:x\"\n", "model.device"),
    ("[model]\ndevice = \"cuda\"\n[distributed]\nfsdp = true\n", "<root>"),
])
def test_bad_field_is_named(tmp_path, text, field):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    message = str(info.value)
    assert "run.toml" in message
    assert f"field {field!r}" in message


def test_model_device_resolves_or_says_why_not(monkeypatch):
    """"auto" takes the first GPU torch sees, else the CPU; a GPU named where there is none is an
    error that says what torch sees (the run stops before anything is built)."""
    import torch

    from clawfast.train.build import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="torch sees no GPU"):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="sees 1 GPU"):
        resolve_device("cuda:1")


def test_vllm_takes_half_of_a_device_the_trainer_holds_and_its_own_default_of_one_it_has_alone(monkeypatch):
    """vLLM runs on GPU 0 of those visible, else on the CPU; where the trainer holds that device its
    share defaults to half (the trainer allocates its optimizer state and activations after vLLM
    has started), elsewhere vLLM's own default applies; a set share or KV cache size is passed as is."""
    import torch

    from clawfast.train.build import SHARED_DEVICE_SHARE, vllm_memory
    from clawfast.train.config import EngineConfig

    plain, shared = EngineConfig(kind="vllm"), {"gpu_memory_utilization": SHARED_DEVICE_SHARE}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_memory(plain, torch.device("cpu")) == shared  # a one-process or FSDP run on the CPU
    assert vllm_memory(plain, None) == {}  # evaluation: no trainer
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for trainer in (torch.device("cuda"), torch.device("cuda", 0)):
        assert vllm_memory(plain, trainer) == shared
    assert vllm_memory(plain, torch.device("cuda", 1)) == {}  # FSDP ranks start at GPU 1
    assert vllm_memory(plain, torch.device("cpu")) == {}
    told = EngineConfig(kind="vllm", gpu_memory_utilization=0.3, kv_cache_memory_bytes=1 << 30)
    assert vllm_memory(told, torch.device("cuda", 0)) == {"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": 1 << 30}


def test_unknown_key_says_so(tmp_path):
    with pytest.raises(ConfigError, match=r"field 'optim.learning_rate': unknown key"):
        load_config(write(tmp_path, "[optim]\nlearning_rate = 1e-4\n"))


def test_not_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "steps = = 3"))
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


def test_overrides_use_toml_values(tmp_path):
    path = write(tmp_path, "steps = 3\n")
    config = load_config(path, overrides=["steps=7", "rollout.harnesses=[\"codex\"]", "run_dir=out/x", "optim.lr=2e-3"])
    assert config.steps == 7 and config.rollout.harnesses == ("codex",) and config.optim.lr == 2e-3
    assert config.run_dir == "out/x"
    with pytest.raises(ConfigError, match="field 'steps'"):
        load_config(path, overrides=["steps=-2"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(path, overrides=["steps"])


def test_input_paths_resolve_against_the_config_file(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "run.toml"
    path.write_text('[model]\npath = "models/m"\n[tasks]\nsuite = "my-tasks"\n')
    config = load_config(path)
    assert config.model.path == str((tmp_path / "sub" / "models" / "m").resolve())
    assert config.tasks.suite == str((tmp_path / "sub" / "my-tasks").resolve())
    # Names are not paths.
    config = config_from_dict({"model": {"path": "embedded"}, "tasks": {"suite": "clawbench-mini"}})
    assert config.model.path == "embedded" and config.tasks.suite == "clawbench-mini"


def test_override_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    """A path in the file is the file's (its directory); the same path given with --set is the
    command line's (the working directory), as any command's arguments are."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "cwd").mkdir()
    path = tmp_path / "sub" / "run.toml"
    path.write_text('[model]\npath = "models/m"\n[rollout]\nsource = "recorded"\nrecorded_dir = "recs"\n')
    monkeypatch.chdir(tmp_path / "cwd")
    config = load_config(path, overrides=["model.path=mine/m", 'tasks.suite="clawgym:gym?eval=0.5"'])
    assert config.model.path == str((tmp_path / "cwd" / "mine" / "m").resolve())
    assert config.tasks.suite == "clawgym:" + str((tmp_path / "cwd" / "gym").resolve()) + "?eval=0.5"
    assert config.rollout.recorded_dir == str((tmp_path / "sub" / "recs").resolve())  # the file's own
    config = load_config(path, overrides=['model={path = "table/m"}', "model.path=embedded"])
    assert config.model.path == "embedded"  # a name, not a path
    assert load_config(path, overrides=['model={path = "table/m"}']).model.path == str(
        (tmp_path / "cwd" / "table" / "m").resolve())


def test_none_sets_a_field_whose_type_allows_none_in_a_file_and_with_set(tmp_path):
    """TOML has no null: "none" is None where the field's type allows None, in every section."""
    path = write(tmp_path, '[optim]\nmax_grad_norm = "none"\n[algorithm]\nvalue_clip = "None"\n')
    config = load_config(path)
    assert config.optim.max_grad_norm is None and config.algorithm.value_clip is None
    assert step_config(config).max_grad_norm is None and step_config(config).value_clip is None
    config = load_config(write(tmp_path, "steps = 3\n"), overrides=[
        "optim.max_grad_norm=none", "algorithm.value_clip=none", "engine.max_model_len=none",
        "algorithm.max_staleness=none", 'model.lora="none"'])
    assert config.optim.max_grad_norm is None and config.algorithm.value_clip is None
    assert config.engine.max_model_len is None and config.algorithm.max_staleness is None
    assert config.model.lora is None
    # the default stays when unset; a field that does not allow None keeps "none" and says why not
    assert load_config(write(tmp_path, "steps = 3\n")).optim.max_grad_norm == 1.0
    with pytest.raises(ConfigError, match="field 'optim.lr'"):
        load_config(write(tmp_path, "steps = 3\n"), overrides=["optim.lr=none"])
    assert config_from_dict({"tasks": {"suite": "none"}}).tasks.suite.endswith("/none")  # a str: a path
    # an optional path is None, not a path named "none" (paths are resolved before the sections read it)
    recorded = write(tmp_path, '[rollout]\nsource = "recorded"\nrecorded_dir = "rec"\n')
    live = load_config(recorded, overrides=["rollout.source=harness", "rollout.recorded_dir=none"])
    assert live.rollout.recorded_dir is None


@pytest.mark.parametrize("mode", ["truncate", "off"])
def test_is_bounds_are_checked_where_they_act(tmp_path, mode):
    """is_lo / is_hi bound masked IS only: in "mask" an inverted pair is refused at load, naming the
    fields; in the other modes they are never read, so no step fails on them."""
    for bounds in ("is_lo = 3.0\n", "is_hi = 0.3\n", "is_lo = 1.5\nis_hi = 1.0\n"):
        with pytest.raises(ConfigError, match=r"field 'algorithm'.*algorithm.is_lo below algorithm.is_hi"):
            load_config(write(tmp_path, f'[algorithm]\nis_mode = "mask"\n{bounds}'))
        config = load_config(write(tmp_path, f'[algorithm]\nis_mode = "{mode}"\n{bounds}'))
        is_config = step_config(config).is_config()  # raised "need 0 <= lo <= hi" at the first step
        assert is_config.mode == "truncate" and is_config.thresholds == (0.5, 2.0)


def test_a_negative_seed_is_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"field 'seed': Input should be greater than or equal to 0"):
        load_config(write(tmp_path, "seed = -1\n"))
    assert load_config(write(tmp_path, "seed = 0\n")).seed == 0


def test_config_is_frozen():
    config = RunConfig()
    with pytest.raises(Exception):
        config.steps = 4


def test_a_renamed_key_says_its_new_name():
    with pytest.raises(ConfigError, match="harness_max_steps is now harness_max_turns"):
        config_from_dict({"rollout": {"harness_max_steps": 3}})


@pytest.mark.parametrize("section", ["optim", "coldstart"])
def test_the_old_row_budget_key_says_its_new_name(section):
    # engine.max_tokens (one call's output cap) keeps its name; the micro-batch row budget does not
    with pytest.raises(ConfigError, match="max_tokens is now micro_batch_tokens"):
        config_from_dict({section: {"max_tokens": 4096}})
    assert config_from_dict({"engine": {"max_tokens": 64}}).engine.max_tokens == 64


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_loads(path):
    config = load_config(path)
    assert config.steps >= 1


def test_train_threads_default_order_and_step_config(tmp_path):
    config = load_config(write(tmp_path, "[algorithm]\ntrain_threads = [\"compaction\", \"main\", \"subagent\"]\n"))
    assert config.algorithm.train_threads == ("main", "subagent", "compaction")
    assert step_config(config).train_threads == ("main", "subagent", "compaction")
    assert load_config(write(tmp_path, "")).algorithm.train_threads == ("main",)


def test_eval_judge_names_a_url_or_a_model_dir(tmp_path):
    assert load_config(write(tmp_path, "")).eval.judge is None
    judge = load_config(write(tmp_path, '[eval.judge]\nurl = "http://h:8000/v1"\nmodel = "qwen"\n')).eval.judge
    assert (judge.url, judge.model, judge.model_dir, judge.api_key_env) == ("http://h:8000/v1", "qwen", None, "OPENAI_API_KEY")
    assert load_config(write(tmp_path, '[eval.judge]\nmodel_dir = "/m"\n')).eval.judge.model_dir == "/m"


@pytest.mark.parametrize("override, says", [
    ({"optim": {"lr": float("inf")}}, "optim.lr': Input should be a finite number"),
    ({"algorithm": {"kl_coef": float("nan")}}, "algorithm.kl_coef': Input should be a finite number"),
    ({"steps": True}, "steps must be a number, got true"),
    ({"optim": {"lr": True}}, "lr must be a number, got true"),
])
def test_a_number_that_is_infinite_or_a_bool_is_refused_before_the_run(override, says):
    """lr = inf passed and failed the run at its first step (exit 1, after set-up); steps = true ran
    one step and lr = true trained at 1.0, silently."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        config_from_dict(override)
