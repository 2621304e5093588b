"""`clawfast proxy serve` as a user runs it: prints its addresses and a key, answers, records, and
writes the rollout's result frame when terminated."""

from __future__ import annotations

import json
import socket
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


def serve(*args, timeout=120) -> subprocess.CompletedProcess:
    """`clawfast proxy serve ARGS` that is expected to stop on its own (a bad argument, a failed start);
    a proxy that starts instead runs into `timeout` and fails the test."""
    return subprocess.run([sys.executable, "-m", "clawfast.cli", "proxy", "serve", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


BAD_ARGUMENTS = {  # {tmp}: the test's directory, holding script.json (valid) and bad.json
    "port too large": (["--port", "99999"], "argument --port: must be a TCP port in 0..65535"),
    "negative port": (["--port", "-1"], "argument --port: must be a TCP port in 0..65535"),
    "grpc port too large": (["--grpc-port", "65536"], "argument --grpc-port: must be a TCP port in 0..65535"),
    "same ports": (["--port", "40001", "--grpc-port", "40001"], "--grpc-port 40001: the same port as --port"),
    "negative output cap": (["--max-tokens-cap", "-5"], "argument --max-tokens-cap: must be at least 1, got -5"),
    "zero output cap": (["--max-tokens-cap", "0"], "argument --max-tokens-cap: must be at least 1, got 0"),
    "negative temperature": (["--temperature", "-3"], "argument --temperature: must be a finite number >= 0"),
    "zero top p": (["--top-p", "0"], "argument --top-p: must lie in (0, 1], got 0"),
    "negative top k": (["--top-k", "-1"], "argument --top-k: must be at least 0, got -1"),
    "zero keepalive": (["--keepalive", "0"], "argument --keepalive: must be a finite number > 0, got 0"),
    "missing script": (["--scripted", "{tmp}/missing.json"], "--scripted {tmp}/missing.json: No such file"),
    "bad script": (["--scripted", "{tmp}/bad.json"], "--scripted {tmp}/bad.json: entry 1 is list"),
    "missing model": (["--model", "{tmp}/missing"], "--model {tmp}/missing: no such directory"),
    "not a model": (["--model", "{tmp}"], "--model {tmp}: not a model directory (no config.json)"),
    "no tokenizer": (["--scripted", "{tmp}/script.json", "--model", "{tmp}"],
                     "--model {tmp}: cannot use its tokenizer"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_a_bad_argument_is_one_line_naming_it_and_exit_2(tmp_path, case):
    (tmp_path / "script.json").write_text(json.dumps(["hi"]))
    (tmp_path / "bad.json").write_text(json.dumps(["hi", ["not", "an", "entry"]]))
    args, message = BAD_ARGUMENTS[case]
    proc = serve(*[a.format(tmp=tmp_path) for a in args], "--records", tmp_path / "records")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert message.format(tmp=tmp_path) in proc.stderr.splitlines()[-1], proc.stderr


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_port_in_use_is_one_line_and_exit_1(tmp_path, flag):
    (tmp_path / "script.json").write_text(json.dumps(["hi"]))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--scripted", tmp_path / "script.json", "--records", tmp_path / "records", "--port", "0", flag, port]
        proc = serve(*args)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.splitlines()[-1] == (f"clawfast proxy serve: {flag} {port}: cannot listen on 127.0.0.1: "
                                                f"Address already in use")
        # Taken after that check (a race): the server's own failure to bind, in one line, still exit 1.
        unchecked = ("import sys, clawfast.commands.proxy as proxy; proxy._try_bind = lambda host, number: None; "
                     "from clawfast.cli import main; sys.exit(main(sys.argv[1:]))")
        proc = subprocess.run([sys.executable, "-c", unchecked, "proxy", "serve", *map(str, args)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        last = proc.stderr.splitlines()[-1]
        assert last.startswith("clawfast proxy serve: the proxy failed to start: "), proc.stderr


@pytest.mark.parametrize("field, value", [("max_tokens_cap", 0), ("default_max_tokens", -1), ("max_model_len", 0),
                                          ("max_tokens_cap", 2.5), ("keepalive_s", 0), ("keepalive_s", float("nan"))])
def test_proxy_config_refuses_bounds_it_cannot_serve(field, value):
    # What the command line checks, the config that every other caller builds checks too: a zero cap
    # answers every call empty, a keep-alive of 0 s spins the server's wait.
    from clawfast.serving import ProxyConfig

    with pytest.raises(ValueError, match=f"ProxyConfig.{field} must be"):
        ProxyConfig(**{field: value})
