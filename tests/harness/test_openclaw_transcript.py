"""OpenClaw's own session transcript (`OpenClaw.transcript`), read from the SQLite store a run leaves
in HOME (``.openclaw/agents/main/agent/openclaw-agent.sqlite``, table ``transcript_events``) as the
events PinchBench graders read.

The fixture tests/data/openclaw_session/openclaw-agent.sqlite is a real store: OpenClaw 2026.9.6 run
through the proxy with the scripted engine (one ``exec`` call, ``printf hi > a.txt``, then a final
text), copied with ``VACUUM INTO`` and re-vacuumed at 512-byte pages to keep it small; its events are
all stored as plain JSON. The live test runs the real OpenClaw (marked ``harness``, like
test_harness_openclaw.py) with a command whose result is large enough for OpenClaw to store it
zstd-compressed, so reading such rows is checked against the real thing too.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from clawfast.harness.base import RunLayout
from clawfast.harness.openclaw import OpenClaw

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "openclaw_session"
STORE = Path(".openclaw") / "agents" / "main" / "agent" / "openclaw-agent.sqlite"
TOKEN = "transcript-test-token"


def _layout(tmp_path) -> RunLayout:
    return RunLayout(tmp_path / "home", tmp_path / "ws")


def _messages(events: list[dict]) -> list[dict]:
    return [e["message"] for e in events if e.get("type") == "message"]


def _tool_calls(message: dict) -> list[dict]:
    return [item for item in message["content"] if item.get("type") == "toolCall"]


def test_fixture_store_reads_as_the_expected_events(tmp_path):
    layout = _layout(tmp_path)
    store = layout.home / STORE
    store.parent.mkdir(parents=True)
    shutil.copy(FIXTURE / "openclaw-agent.sqlite", store)
    before = store.read_bytes()

    events = OpenClaw().transcript(layout)

    assert events == json.loads((FIXTURE / "expected_events.json").read_text())
    user, called, result, final = _messages(events)
    assert user["role"] == "user" and user["content"] == [{"type": "text", "text": "Write hi into a.txt."}]
    assert called["role"] == "assistant"
    [call] = _tool_calls(called)
    assert call["name"] == "exec" and call["arguments"] == {"command": "printf hi > a.txt"}
    assert result["role"] == "toolResult" and result["toolCallId"] == call["id"] and result["toolName"] == "exec"
    assert [item["type"] for item in result["content"]] == ["text"]
    assert final["role"] == "assistant" and final["content"] == [{"type": "text", "text": "Done: a.txt holds hi."}]
    # Other event types (the session header first) pass through as stored.
    assert events[0]["type"] == "session"
    # Read-only: the store is unchanged and nothing was created beside it.
    assert store.read_bytes() == before
    assert [p.name for p in store.parent.iterdir()] == [store.name]


def test_no_store_is_none(tmp_path):
    layout = _layout(tmp_path)
    assert OpenClaw().transcript(layout) is None  # HOME does not even exist
    # Configured but never started: the config is there, no session store.
    (layout.home / ".openclaw").mkdir(parents=True)
    (layout.home / ".openclaw" / "openclaw.json").write_text("{}\n")
    assert OpenClaw().transcript(layout) is None


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 16)


def _other_database(path: Path) -> None:
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE unrelated (x)")
    con.close()


@pytest.mark.parametrize("write", [_garbage, _other_database], ids=["garbage", "no-session-tables"])
def test_unreadable_store_is_a_clear_error(tmp_path, write):
    layout = _layout(tmp_path)
    store = layout.home / STORE
    store.parent.mkdir(parents=True)
    write(store)
    with pytest.raises(ValueError, match=re.escape(str(store)) + ".*not a readable OpenClaw session store"):
        OpenClaw().transcript(layout)


# -- the real harness ------------------------------------------------------------------------------

INSTRUCTION = "Write hi into a.txt, then count to 400."
# The second command's result (about 1.5 KB of text, kept twice in the event) is over the size from
# which OpenClaw stores an event zstd-compressed (1 KB).
COMMANDS = ["printf hi > a.txt", "seq 1 400"]
FINAL = "Done: a.txt holds hi and I counted to 400."


@pytest.fixture(scope="module")
def openclaw():
    if shutil.which("npm") is None:
        pytest.fail("npm is required for the harness tests (install Node.js and npm)")
    harness = OpenClaw(timeout_s=120)
    harness.installation  # installs the pinned version into the cache on first use
    return harness


@pytest.mark.harness
@pytest.mark.slow
def test_live_run_transcript_holds_the_scripted_calls_and_final_text(openclaw, renderer, tmp_path):
    from clawfast.engines.scripted import ScriptedEngine
    from clawfast.proxy import ProxyApp, ProxyConfig, ProxyCore, ProxyServer, RolloutRegistry
    from clawfast.proxy.grpc_client import ControlClient
    from clawfast.proxy.grpc_service import GrpcControlServer

    layout = _layout(tmp_path)
    layout.home.mkdir()
    layout.workspace.mkdir()
    turns = [t.to_entry() for t in openclaw.scripted_turns(COMMANDS, FINAL)]

    def respond(prompt_ids):
        text = renderer.decode(prompt_ids)
        if '"name": "exec"' not in text:  # a side call (no tools): a short text
            return {"text": "ok"}
        return turns[min(text.count("<tool_response>"), len(turns) - 1)]

    engine = ScriptedEngine(renderer.encode, renderer.turn_end_id, responder=respond)
    registry = RolloutRegistry(tmp_path / "records")
    app = ProxyApp(ProxyCore(engine, renderer, ProxyConfig(keepalive_s=1.0)), registry)
    with ProxyServer(app), GrpcControlServer(registry, TOKEN, engine=engine) as control:
        with ControlClient(control.address, TOKEN) as client:
            opened = client.open_rollout("openclaw-transcript", "openclaw")
            prepared = openclaw.prepare(layout, opened.base_url, opened.key, "policy")
            proc = subprocess.run(openclaw.command(INSTRUCTION, layout), cwd=layout.workspace, env=prepared.env,
                                  capture_output=True, text=True, timeout=300)
            client.close_rollout(opened.rollout_id, reward=0.0)
    report = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report
    assert (layout.workspace / "a.txt").read_text() == "hi", report

    store = layout.home / STORE
    with sqlite3.connect(f"{store.as_uri()}?mode=ro", uri=True) as con:
        compressed = con.execute("SELECT count(*) FROM transcript_events WHERE event_json IS NULL").fetchone()[0]
    con.close()
    assert compressed >= 1  # the decompression path is exercised on a real row

    messages = _messages(openclaw.transcript(layout))
    assert messages[0]["role"] == "user" and messages[0]["content"] == [{"type": "text", "text": INSTRUCTION}]
    calls = [call for m in messages if m["role"] == "assistant" for call in _tool_calls(m)]
    assert [(c["name"], c["arguments"]) for c in calls] == [("exec", {"command": cmd}) for cmd in COMMANDS]
    results = {m["toolCallId"]: m for m in messages if m["role"] == "toolResult"}
    counted = results[calls[1]["id"]]["content"][0]["text"]
    assert counted.split() == [str(i) for i in range(1, 401)]  # the compressed event, read back whole
    assert messages[-1]["role"] == "assistant" and messages[-1]["content"][-1] == {"type": "text", "text": FINAL}


@pytest.mark.harness
def test_a_compressed_event_larger_than_its_row_records_is_refused_not_inflated(openclaw, tmp_path):
    """The store is in the sandbox's HOME, the agent's to write: an event replaced by a zstd frame of
    64 MiB (a few KB stored) under a recorded size of 40 bytes. The frame is cut off at the recorded
    size, and the store refused naming it (the host's node process inflated it whole before the size
    was compared: 6.9 GiB for a 2 GiB frame)."""
    from clawfast.harness_install import node24_bin

    layout = _layout(tmp_path)
    store = layout.home / STORE
    store.parent.mkdir(parents=True)
    shutil.copy(FIXTURE / "openclaw-agent.sqlite", store)
    script = ('process.stdout.write(require("node:zlib").zstdCompressSync(Buffer.alloc(64 * 1024 * 1024))'
              '.toString("base64"))')
    bomb = subprocess.run([str(node24_bin(openclaw.installation.root)), "-e", script], capture_output=True, text=True,
                          check=True).stdout
    import base64

    with sqlite3.connect(store) as con:
        con.execute("PRAGMA ignore_check_constraints = ON")  # the agent's own sqlite3 may do as much
        con.execute("UPDATE transcript_events SET event_json = NULL, event_zstd = ?, event_utf8_bytes = 40 "
                    "WHERE seq = (SELECT MAX(seq) FROM transcript_events)", (base64.b64decode(bomb),))
    con.close()
    with pytest.raises(ValueError, match="(?s)" + re.escape(str(store)) + ".*cannot decompress.*larger than 40 bytes"):
        openclaw.transcript(layout)
