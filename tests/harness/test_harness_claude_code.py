"""The real Claude Code CLI (npm ``@anthropic-ai/claude-code``, pinned) against the proxy, offline.

The trainer's path end to end: a rollout is opened over the gRPC control plane, ``claude -p`` runs in a
plain temporary workspace with only the proxy as its API (env and flags from docs/HARNESSES.md),
the scripted engine answers the main thread with a ``Write`` tool call and then a final text, and the
rollout is closed over gRPC. Checked: the file is written by Claude Code's own tool, every call the
proxy answered is in the closed rollout, and each main-thread call's prompt begins with the previous
main call's prompt + output, token for token.

The engine is the scripted one (the test is about the harness and the capture, not the model): it
chooses what to answer from the prompt, so Claude Code's side calls (title, quota, ...) get a short
text whatever order they come in. Needs npm and the registry the first time (installs into
``clawfast.harness_install.cache_root()``; about 10 s, 384 MB); marked ``harness``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from clawfast.harness_install import ensure_npm_harness, npm_bin

from .splice_checks import main_calls_extend_exactly

pytestmark = [pytest.mark.harness, pytest.mark.slow]

CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.332")
TOKEN = "harness-test-token"
FILE_CONTENT = "written by the policy through Claude Code\n"


@pytest.fixture(scope="module")
def claude_bin():
    if shutil.which("npm") is None:
        pytest.fail("npm is required for the harness tests (install Node.js and npm)")
    return npm_bin(ensure_npm_harness(*CLAUDE_CODE), "claude")


def _responder(renderer, target: str):
    """Main thread: Write the file, then (once a tool result is in the prompt) a final text.
    Any other call (no Write tool offered): a short text."""

    def respond(prompt_ids: np.ndarray):
        text = renderer.decode(prompt_ids)
        if '"Write"' not in text:
            return {"text": "Write a file"}
        if "<tool_response>" in text:
            return {"text": "Done: the file is written."}
        # Compact JSON, keys out of schema order: unlike the template's own rendering, so a turn
        # re-rendered from the harness's replay (instead of the sampled ids) breaks the prefix check.
        call = json.dumps({"name": "Write", "arguments": {"content": FILE_CONTENT, "file_path": target}}, separators=(",", ":"))
        return f"I will write the file.\n<tool_call>\n{call}\n</tool_call>"

    return respond


def _claude_env(home, base_url: str, key: str) -> dict[str, str]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        # Removes the per-request nonce header block from the system prompt.
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    }
    for var in (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "CLAUDE_CODE_SUBAGENT_MODEL",
    ):
        env[var] = "policy"
    if os.geteuid() == 0:  # Claude Code refuses --dangerously-skip-permissions as root otherwise
        env["IS_SANDBOX"] = "1"
    return env


@pytest.mark.parametrize("model", ["embedded", "smollm2-135m"])
def test_claude_code_writes_a_file_and_every_call_is_captured(claude_bin, model, request, tmp_path):
    from clawfast.engines.scripted import ScriptedEngine
    from clawfast.proxy import ProxyApp, ProxyConfig, ProxyCore, ProxyServer, RolloutRegistry
    from clawfast.proxy.grpc_client import ControlClient
    from clawfast.proxy.grpc_service import GrpcControlServer

    renderer = request.getfixturevalue("renderer" if model == "embedded" else "smollm2_renderer")
    workspace, home = tmp_path / "ws", tmp_path / "home"
    workspace.mkdir()
    home.mkdir()
    target = workspace / "hello.txt"
    engine = ScriptedEngine(renderer.encode, renderer.turn_end_id, responder=_responder(renderer, str(target)))
    registry = RolloutRegistry(tmp_path / "records")
    app = ProxyApp(ProxyCore(engine, renderer, ProxyConfig(keepalive_s=1.0)), registry)
    with ProxyServer(app), GrpcControlServer(registry, TOKEN, engine=engine) as control:
        with ControlClient(control.address, TOKEN) as client:
            opened = client.open_rollout("write-hello", "claude-code")
            proc = subprocess.run(
                [str(claude_bin), "-p", "Create hello.txt in the current directory.",
                 "--dangerously-skip-permissions", "--output-format", "json"],
                cwd=workspace,
                env=_claude_env(home, opened.base_url, opened.key),
                capture_output=True,
                text=True,
                timeout=300,
            )
            result = client.close_rollout(opened.rollout_id, reward=1.0 if target.exists() else 0.0)
    report = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report
    assert target.read_text() == FILE_CONTENT, report
    final = json.loads(proc.stdout)
    assert final.get("is_error") is False, report
    assert "Done: the file is written." in final.get("result", ""), report

    # Every answered call is in the closed rollout (the engine was asked exactly that many times).
    main = main_calls_extend_exactly(result, "claude-code", engine.calls)
    # The Write call and the final answer are main-thread calls, in that order.
    decoded = [renderer.decode(c.output_ids) for c in main]
    write_at = next(i for i, t in enumerate(decoded) if '"name":"Write"' in t)
    assert any("Done: the file is written." in t for t in decoded[write_at + 1 :])
