"""mini-swe-agent 2.4.6 (PyPI `mini-swe-agent`, module `minisweagent`): OpenAI Chat Completions via
litellm, one `bash` tool, non-streaming calls.

Configured with the harness's own mechanisms only: ``MSWEA_*`` environment variables (no first-run
wizard, no cost look-ups, global config dir inside the sandbox HOME) and ``-c`` config layers: the
builtin ``mini.yaml`` (named by its absolute path in the install: mini-swe-agent looks a bare name up in
the working directory, the task's workspace, first, so a workspace file named ``mini.yaml`` would
replace it), a small YAML file of overrides written into HOME (model name, API base and
key, step limit) and, when ``instance_template`` is given, one more layer replacing the builtin's
long ``agent.instance_template`` (the first user message). A run ends when the model runs
``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``; the trajectory is written to ``$HOME/mini.traj.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from clawfast.harness.base import (Harness, HarnessInstall, PreparedRun, RunLayout, ScriptedToolCall, ScriptedTurn,
                                   json_value, reached_without_links)
from clawfast.harness.pip_install import ensure_pip_harness

SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
_OVERRIDES = ".clawfast/mini-overrides.yaml"
_TEMPLATE_LAYER = ".clawfast/mini-instance-template.yaml"
_TRAJECTORY = "mini.traj.json"
# The builtin config inside the package: passed by its absolute path, since mini-swe-agent resolves a
# bare `-c mini.yaml` against the cwd (the task's workspace) before this folder.
_BUILTIN_CONFIG = "minisweagent/config/mini.yaml"


class MiniSweAgent(Harness):
    name = "mini-swe-agent"
    version = "2.4.6"
    protocol = "openai-chat"

    def __init__(self, *, instance_template: str | None = None, **options) -> None:
        """instance_template: mini-swe-agent's ``agent.instance_template`` (a Jinja template that
        must hold ``{{task}}``), set as the last ``-c`` layer so it wins over ``mini.yaml``; None
        keeps the harness default (~1,300 tokens of workflow advice). Other options: `Harness`."""
        super().__init__(**options)
        if instance_template is not None:
            if not isinstance(instance_template, str):
                raise ValueError(f"instance_template must be a string, got {type(instance_template).__name__}")
            # Without {{task}} the agent would never see the task: reject rather than run blind.
            if "{{task}}" not in instance_template.replace(" ", ""):
                raise ValueError("instance_template must contain {{task}}")
        self.instance_template = instance_template

    def install(self) -> HarnessInstall:
        venv = ensure_pip_harness("mini-swe-agent", self.version)
        return HarnessInstall(self.name, self.version, venv, venv / "bin" / "python")

    def prepare(self, layout: RunLayout, base_url: str, key: str, model: str) -> PreparedRun:
        self._validate_common(base_url, key, model)
        written: list[Path] = []
        # YAML is a superset of JSON: write JSON so no YAML library is needed and quoting is exact.
        overrides = {
            "model": {
                # litellm's hosted_vllm provider is a plain OpenAI-compatible client; the prefix is
                # stripped before the request, so the proxy sees `model`.
                "model_name": f"hosted_vllm/{model}",
                "model_kwargs": {"api_base": base_url.rstrip("/") + "/v1", "api_key": key},
            },
            "agent": {"step_limit": self.max_turns},
            "environment": {"cwd": layout.workspace_inside},
        }
        self._write(layout.home / _OVERRIDES, json.dumps(overrides, indent=2) + "\n", written)
        if self.instance_template is not None:
            layer = {"agent": {"instance_template": self.instance_template}}
            self._write(layout.home / _TEMPLATE_LAYER, json.dumps(layer, indent=2) + "\n", written)
        env = self._base_env(layout)
        env.update(
            {
                "MSWEA_CONFIGURED": "true",  # skip the interactive first-run wizard
                "MSWEA_COST_TRACKING": "ignore_errors",  # a local model has no price
                "MSWEA_GLOBAL_CONFIG_DIR": f"{layout.home_inside}/.config/mini-swe-agent",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # do not fetch litellm's price list
                "PYTHONDONTWRITEBYTECODE": "1",  # the install is read-only
                # Its client retries any error but a few ten times, waiting up to 60 s between: the proxy's
                # 400 for a spent call budget (Sampling.max_calls) held the run to its wall clock. Three
                # tries (4 + 8 s) still ride out a transient failure.
                "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "3",
            }
        )
        return PreparedRun(env=env, files=written)

    def builtin_config(self) -> Path:
        """The install's own ``mini.yaml``: the install is mounted at the same path inside the sandbox,
        so this path names it there too. RuntimeError if the install holds none or several."""
        root = self.installation.root
        found = sorted(root.glob(f"lib/python*/site-packages/{_BUILTIN_CONFIG}"))
        if len(found) != 1:
            raise RuntimeError(f"{root}: expected one lib/python*/site-packages/{_BUILTIN_CONFIG}, found "
                               f"{len(found)}: the mini-swe-agent install is incomplete or mixed")
        return found[0]

    def command(self, task_instruction: str, layout: RunLayout) -> list[str]:
        layers = [str(self.builtin_config()), f"{layout.home_inside}/{_OVERRIDES}"]
        if self.instance_template is not None:
            # Later `-c` layers override earlier ones, so this one replaces mini.yaml's template.
            layers.append(f"{layout.home_inside}/{_TEMPLATE_LAYER}")
        for layer in layers:
            if "=" in layer:  # mini-swe-agent would read it as a setting and never open the file
                raise ValueError(f"mini-swe-agent reads a -c value holding '=' as a key=value setting, not a "
                                 f"config file: {layer!r}; install harnesses (CLAWFAST_HOME) and make sandboxes "
                                 f"(base_dir) where paths hold no '='")
        argv = [
            str(self.installation.executable), "-m", "minisweagent",
            "-t", task_instruction, "-y", "--exit-immediately",
            "-o", f"{layout.home_inside}/{_TRAJECTORY}",
        ]  # fmt: skip
        for layer in layers:
            argv += ["-c", layer]
        return argv

    def artifacts(self, layout: RunLayout) -> list[Path]:
        path = layout.home / _TRAJECTORY
        return [path] if reached_without_links(layout.home, path) else []

    def unfinished(self, layout: RunLayout) -> str | None:
        # mini-swe-agent exits 0 whatever ended the run; its trajectory's info.exit_status says what did
        # ("Submitted" when the agent submitted; "LimitsExceeded" at its step limit, ...).
        path = layout.home / _TRAJECTORY
        if not reached_without_links(layout.home, path):
            return None
        document = json_value(path.read_text(encoding="utf-8", errors="replace"))
        info = document.get("info") if isinstance(document, dict) else None
        status = info.get("exit_status") if isinstance(info, dict) else None
        return f"exit status {status}" if isinstance(status, str) and status != "Submitted" else None

    def scripted_turns(self, oracle_commands: list[str], final_text: str) -> list[ScriptedTurn]:
        turns = [
            ScriptedTurn(text=f"Step {i + 1}: run the next command.", tool_calls=(ScriptedToolCall("bash", {"command": cmd}),))
            for i, cmd in enumerate(oracle_commands)
        ]
        # A reply without a tool call is a format error for mini-swe-agent: it ends by running
        # the submit command, which must be alone in its tool call.
        turns.append(ScriptedTurn(text=final_text, tool_calls=(ScriptedToolCall("bash", {"command": SUBMIT_COMMAND}),)))
        return turns
