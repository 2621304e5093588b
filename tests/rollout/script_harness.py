"""A trivial harness for scheduler tests: its CLI is `/bin/sh -c INSTRUCTION`. Its "config file" is
the rollout key written into HOME, which the script copies into its own log (kept with the rollout)
to prove that HOME and the logs work."""

from __future__ import annotations

from pathlib import Path

from clawfast.harness.base import Harness, HarnessInstall, PreparedRun, RunLayout, ScriptedTurn, glob_files, json_lines


class ScriptHarness(Harness):
    name = "script"
    version = "0"
    protocol = "openai-chat"

    def __init__(self, root: Path) -> None:
        super().__init__(timeout_s=60)
        self.root = root

    def install(self) -> HarnessInstall:
        return HarnessInstall(self.name, self.version, self.root, Path("/bin/sh"))

    def prepare(self, layout: RunLayout, base_url: str, key: str, model: str) -> PreparedRun:
        self._validate_common(base_url, key, model)
        written: list[Path] = []
        self._write(layout.home / ".script" / "key", key, written)
        return PreparedRun(env=self._base_env(layout), files=written)

    def command(self, task_instruction: str, layout: RunLayout) -> list[str]:
        log = f"{layout.home_inside}/.script/run.log"
        return ["/bin/sh", "-c", f"cp {layout.home_inside}/.script/key {log}; {task_instruction}"]

    def artifacts(self, layout: RunLayout) -> list[Path]:
        return glob_files(layout.home, ".script", "*.log")

    def exit_reason(self, stdout: str) -> str | None:
        # The script reports a failure as a JSON line {"error": ...}, as a real harness's headless mode does.
        errors = [v["error"] for v in json_lines(stdout) if isinstance(v, dict) and isinstance(v.get("error"), str)]
        return errors[-1] if errors else None

    def scripted_turns(self, oracle_commands: list[str], final_text: str) -> list[ScriptedTurn]:
        return [ScriptedTurn(text=final_text)]
