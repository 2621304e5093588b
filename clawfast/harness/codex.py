"""Codex CLI 0.171.0 (npm `@openai/codex`, CLI `codex`: a Node launcher for a native binary): OpenAI
Responses API only, streaming; `exec_command` runs shell commands.

Configured by its own config file, ``$CODEX_HOME/config.toml``: a model provider ``policy`` pointing at
the proxy (``/v1``, ``wire_api = "responses"``) whose key is read from ``POLICY_KEY``. Run headless
with ``codex exec --skip-git-repo-check --json --sandbox danger-full-access -- TASK`` (our sandbox
isolates it; Codex's own Landlock sandbox would fight bubblewrap; TASK after ``--``, so one starting
with '-' is the prompt, not an option), standard input closed by the runner. Session logs land in
``$CODEX_HOME/sessions/YYYY/MM/DD/rollout-*.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path

from clawfast.harness.base import (Harness, HarnessInstall, PreparedRun, RunLayout, ScriptedToolCall, ScriptedTurn,
                                   check_count, glob_files, json_lines, reason_text)
from clawfast.harness_install import ensure_npm_harness, npm_bin

PROVIDER = "policy"
KEY_VAR = "POLICY_KEY"


def _toml_str(value: str) -> str:
    # A TOML basic string has JSON's escapes for quotes, backslashes and control characters.
    return json.dumps(value)


class Codex(Harness):
    name = "codex"
    version = "0.171.0"
    protocol = "openai-responses"

    def __init__(self, *, context_window: int | None = None, auto_compact_tokens: int | None = None, **options) -> None:
        """context_window / auto_compact_tokens: Codex's ``model_context_window`` (the model's
        context as Codex is told it) and ``model_auto_compact_token_limit`` (the prompt tokens past
        which it compacts the conversation); None leaves each to Codex (what it knows of a model
        name, nothing for ours). Other options: `Harness`."""
        super().__init__(**options)
        check_count("context_window", context_window, unset=True)
        check_count("auto_compact_tokens", auto_compact_tokens, unset=True)
        self.context_window = context_window
        self.auto_compact_tokens = auto_compact_tokens

    def install(self) -> HarnessInstall:
        prefix = ensure_npm_harness("@openai/codex", self.version)
        return HarnessInstall(self.name, self.version, prefix, npm_bin(prefix, "codex"))

    def prepare(self, layout: RunLayout, base_url: str, key: str, model: str) -> PreparedRun:
        self._validate_common(base_url, key, model)
        config = "\n".join(
            [
                f"model = {_toml_str(model)}",
                f"model_provider = {_toml_str(PROVIDER)}",
                'approval_policy = "never"',
                'sandbox_mode = "danger-full-access"',
                # Top-level keys: before the provider's table, or TOML would put them in it.
                *([f"model_context_window = {self.context_window}"] if self.context_window is not None else []),
                *([f"model_auto_compact_token_limit = {self.auto_compact_tokens}"]
                  if self.auto_compact_tokens is not None else []),
                "",
                f"[model_providers.{PROVIDER}]",
                f"name = {_toml_str(PROVIDER)}",
                f"base_url = {_toml_str(base_url.rstrip('/') + '/v1')}",
                f"env_key = {_toml_str(KEY_VAR)}",
                'wire_api = "responses"',
                "",
            ]
        )
        written: list[Path] = []
        self._write(layout.home / ".codex" / "config.toml", config, written)
        env = self._base_env(layout)
        env["CODEX_HOME"] = f"{layout.home_inside}/.codex"
        env[KEY_VAR] = key
        return PreparedRun(env=env, files=written)

    def command(self, task_instruction: str, layout: RunLayout) -> list[str]:
        # The instruction is the prompt argument after `--`: one starting with '-' would otherwise be
        # read as an option.
        return [
            str(self.installation.executable), "exec",
            "--skip-git-repo-check", "--json", "--sandbox", "danger-full-access", "--", task_instruction,
        ]  # fmt: skip

    def artifacts(self, layout: RunLayout) -> list[Path]:
        return glob_files(layout.home, ".codex/sessions", "**/*.jsonl")

    def exit_reason(self, stdout: str) -> str | None:
        # `exec --json` streams events; a failed turn ends in turn.failed, after an error event with
        # the same message (an error event alone: the stream stopped before the turn's end).
        events = [e for e in json_lines(stdout) if isinstance(e, dict)]
        failed = [e["error"].get("message") for e in events
                  if e.get("type") == "turn.failed" and isinstance(e.get("error"), dict)]
        errors = [e.get("message") for e in events if e.get("type") == "error"]
        return reason_text(None, (failed or errors or [None])[-1])

    def scripted_turns(self, oracle_commands: list[str], final_text: str) -> list[ScriptedTurn]:
        turns = [
            ScriptedTurn(text=f"Step {i + 1}.", tool_calls=(ScriptedToolCall("exec_command", {"cmd": cmd}),))
            for i, cmd in enumerate(oracle_commands)
        ]
        turns.append(ScriptedTurn(text=final_text))
        return turns
