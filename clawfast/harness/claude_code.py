"""Claude Code 2.1.332 (npm `@anthropic-ai/claude-code`, CLI `claude`, a native binary): Anthropic
Messages API, streaming, 12 tools of which `Bash` runs shell commands.

Configured by environment variables only: the proxy as ``ANTHROPIC_BASE_URL`` (no ``/v1``), the rollout
key as ``ANTHROPIC_API_KEY``, every model alias mapped to the policy (main, opus, sonnet, haiku,
small-fast and subagent models), non-essential traffic, telemetry and auto-update off, and
``IS_SANDBOX=1`` (as root it otherwise refuses ``--dangerously-skip-permissions``). The per-request
attribution header (a nonce in ``system[0]`` that would break the token prefix between calls) is
turned off with ``CLAUDE_CODE_ATTRIBUTION_HEADER=0``; the proxy strips it as well.
Run headless with ``claude -p --dangerously-skip-permissions --output-format json --max-turns N -- TASK``
(TASK after ``--``, so one starting with '-' is the prompt, not an option).
Session transcripts land in ``$HOME/.claude/projects/<workspace slug>/<session>.jsonl``.
"""

from __future__ import annotations

from pathlib import Path

from clawfast.harness.base import (Harness, HarnessInstall, PreparedRun, RunLayout, ScriptedToolCall, ScriptedTurn,
                                   check_count, glob_files, json_lines, reason_text)
from clawfast.harness_install import ensure_npm_harness, npm_bin

MODEL_ALIAS_VARS = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)


class ClaudeCode(Harness):
    name = "claude-code"
    version = "2.1.332"
    protocol = "anthropic"

    def __init__(self, *, auto_compact_window: int | None = None, auto_compact_pct: int | None = None,
                 **options) -> None:
        """auto_compact_window / auto_compact_pct: when Claude Code compacts a conversation on its
        own: ``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` (the context it assumes, which it raises to at least
        100,000) and ``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE`` (1-100): it compacts once a prompt passes that
        percent of the window less its 20,000-token output reserve (window 100,000 and 30: 24,000
        tokens). A threshold within a few steps of a restart's size (system prompt, tools, summary)
        makes it compact again after every step or two, and after three such compactions in a row it
        ends the run itself ("autocompact_thrashing", exit 1; bench/RESULTS.md, "Past the first
        compaction"). None leaves each to Claude Code (it assumes a 1,000,000-token context for a
        model name it does not know). Other options: `Harness`."""
        super().__init__(**options)
        check_count("auto_compact_window", auto_compact_window, unset=True)
        check_count("auto_compact_pct", auto_compact_pct, high=100, unset=True)
        self.auto_compact_window = auto_compact_window
        self.auto_compact_pct = auto_compact_pct

    def install(self) -> HarnessInstall:
        prefix = ensure_npm_harness("@anthropic-ai/claude-code", self.version)
        return HarnessInstall(self.name, self.version, prefix, npm_bin(prefix, "claude"))

    def prepare(self, layout: RunLayout, base_url: str, key: str, model: str) -> PreparedRun:
        self._validate_common(base_url, key, model)
        env = self._base_env(layout)
        env.update({var: model for var in MODEL_ALIAS_VARS})
        env.update(
            {
                "ANTHROPIC_BASE_URL": base_url.rstrip("/"),
                "ANTHROPIC_API_KEY": key,
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
                "DISABLE_TELEMETRY": "1",
                "DISABLE_AUTOUPDATER": "1",
                "DISABLE_ERROR_REPORTING": "1",
                "IS_SANDBOX": "1",
                # Bash tool commands inherit this; the proxy may take a while on a CPU engine.
                "API_TIMEOUT_MS": str(int(self.timeout_s * 1000)),
            }
        )
        if self.auto_compact_window is not None:
            env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(self.auto_compact_window)
        if self.auto_compact_pct is not None:
            env["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"] = str(self.auto_compact_pct)
        (layout.home / ".claude").mkdir(parents=True, exist_ok=True)
        return PreparedRun(env=env)

    def command(self, task_instruction: str, layout: RunLayout) -> list[str]:
        # The instruction is the prompt argument after `--`: an instruction starting with '-' would
        # otherwise be read as an option (`-p --version` prints the version and exits 0).
        return [
            str(self.installation.executable), "-p",
            "--dangerously-skip-permissions", "--output-format", "json",
            "--max-turns", str(self.max_turns), "--", task_instruction,
        ]  # fmt: skip

    def artifacts(self, layout: RunLayout) -> list[Path]:
        return glob_files(layout.home, ".claude/projects", "**/*.jsonl")

    def exit_reason(self, stdout: str) -> str | None:
        # --output-format json ends with one result object; is_error marks a run that failed,
        # api_error / terminal_reason / subtype name how (autocompact_thrashing, max_turns, ...), and
        # the words are its `result`, or for an error_* subtype its `errors` list.
        results = [v for v in json_lines(stdout) if isinstance(v, dict) and v.get("type") == "result"]
        if not results or results[-1].get("is_error") is not True:
            return None
        result = results[-1]
        kind = next((k for k in (result.get(f) for f in ("api_error", "terminal_reason", "subtype"))
                     if isinstance(k, str) and k), None)
        errors = result.get("errors")
        detail = result.get("result") or ("; ".join(map(str, errors)) if isinstance(errors, list) else None)
        return reason_text(kind, detail)

    def scripted_turns(self, oracle_commands: list[str], final_text: str) -> list[ScriptedTurn]:
        turns = [
            ScriptedTurn(text=f"Step {i + 1}.", tool_calls=(ScriptedToolCall("Bash", {"command": cmd}),))
            for i, cmd in enumerate(oracle_commands)
        ]
        turns.append(ScriptedTurn(text=final_text))  # a text-only turn (end_turn) ends `claude -p`
        return turns
