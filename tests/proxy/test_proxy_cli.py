"""`clawfast proxy serve` as a user runs it: prints its addresses and a key, answers, records, and
writes the rollout's result frame when terminated."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from clawfast.records import read_rollouts


def test_serve_scripted(tmp_path, embedded_dir):
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]}, {"text": "bye"}]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawfast.cli", "proxy", "serve", "--scripted", str(script), "--port", "0",
         "--records", str(tmp_path / "records"), "--grpc-port", "0", "--grpc-token", "secret", "--max-model-len", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = proc.stdout.readline().split()[-1]
        key = proc.stdout.readline().split()[-1]
        assert url.startswith("http://127.0.0.1:") and key.startswith("cf-"), (url, key, proc.stderr.read())
        grpc_line = proc.stdout.readline()
        assert grpc_line.startswith("grpc: 127.0.0.1:"), grpc_line
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        first = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert first.choices[0].message.tool_calls[0].function.name == "bash"
        second = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert second.choices[0].message.content == "bye"
        with pytest.raises(openai.BadRequestError) as refused:  # past --max-model-len, refused as OpenAI words it
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 400}])
        assert refused.value.code == "context_length_exceeded" and "> 299 maximum" in refused.value.message
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    (rollout,) = read_rollouts(tmp_path / "records")  # no recover=True: the result frame is there
    assert rollout.status == "ok" and len(rollout.calls) == 2
