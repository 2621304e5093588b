"""`clawfast proxy serve`: run the serving proxy by hand.

    clawfast proxy serve [--model DIR | --scripted FILE | --vllm URL] [--host H] [--port P] [--records DIR]
                         [--max-model-len N] [--access-log FILE]

The tokenizer and chat template come from --model (default: the embedded model, built on first use).
The engine is the in-process torch engine on that model, or the scripted engine playing FILE, or a
vLLM server at URL; the proxy runs in a `clawfast.rollout.RolloutService` with no harnesses. It
prints the HTTP address and the key of a default rollout ("manual-<time>") whose calls are appended to <records>/manual-<time>.cfr. With
--grpc-port it also serves the gRPC control plane (`clawfast.proxy.grpc_service`) and prints its
address (and the shared token, unless --grpc-token gave one). With --access-log it appends one JSON
line per HTTP request to FILE as each response ends (`clawfast.proxy.server.AccessLog`): ``tail -f``
it to watch a harness's calls and refusals.

Exit status: 0 when stopped (SIGTERM, Ctrl-C); 2 on a bad argument (a port outside 0..65535, a missing
or unreadable --scripted FILE, a --model that is not a model directory, ...), said in one line naming
it; 1 when the proxy cannot start (a port already in use).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from clawfast.commands.arg_types import non_negative_float, non_negative_int, port, positive_float, positive_int, probability
from clawfast.engines.base import Engine, Sampling

PROG = "clawfast proxy serve"


def build_engine(args: argparse.Namespace, model_dir: Path, renderer=None, script: list | None = None) -> Engine:
    """The engine the flags name: the scripted engine playing `script` (read from --scripted FILE,
    rendered with `renderer`, the `ChatRenderer` of `model_dir`), the server at --vllm URL, or the
    in-process torch engine on `model_dir`."""
    from clawfast.train.build import build_engine as build_configured
    from clawfast.train.config import EngineConfig

    if args.scripted:
        from clawfast.engines.scripted import ScriptedEngine

        return ScriptedEngine(renderer.encode, renderer.turn_end_id, script, cycle=True)
    if args.vllm:
        return build_configured(EngineConfig(kind="remote", url=args.vllm, sync_weights=False), model_dir)
    return build_configured(EngineConfig(kind="torch"), model_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="proxy_command", required=True)
    serve = sub.add_parser("serve", help="serve the Anthropic, Chat Completions and Responses APIs")
    source = serve.add_mutually_exclusive_group()
    source.add_argument("--scripted", metavar="FILE", help="play the JSON list of outputs in FILE (cycling)")
    source.add_argument("--vllm", metavar="URL", help="generate with the vLLM server at URL")
    serve.add_argument("--model", metavar="DIR", help="model (and tokenizer) directory; default: the embedded model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port, default=8765, help="HTTP port (0: any free port; default 8765)")
    serve.add_argument("--records", default="runs/records", metavar="DIR", help="where rollout logs are written")
    serve.add_argument("--model-name", default="policy", help="the name /v1/models reports")
    serve.add_argument("--parser", default=None, help="tool-call parser: qwen3, hermes, mistral, llama3_json")
    serve.add_argument("--temperature", type=non_negative_float, default=None,
                       help="override every request's temperature (0: greedy)")
    serve.add_argument("--top-p", type=probability, default=None, help="override every request's top_p")
    serve.add_argument("--top-k", type=non_negative_int, default=None,
                       help="override every request's top_k (0: no top-k, the whole distribution, so that the "
                            "recorded log-probs are the policy's whatever a harness asks)")
    serve.add_argument("--max-tokens-cap", type=positive_int, default=4096, metavar="N",
                       help="upper bound on any call's output tokens (default 4096)")
    serve.add_argument("--max-model-len", type=positive_int, default=None, metavar="N",
                       help="the context served (prompt + output): a longer prompt is refused as each API words a "
                            "context overflow; default: the engine's own limit, if it states one")
    serve.add_argument("--keepalive", type=positive_float, default=5.0, help="seconds between keep-alive events")
    serve.add_argument("--max-calls-per-rollout", type=positive_int, default=None, metavar="N",
                       help="refuse a rollout's model calls beyond N (side calls included); default: unlimited")
    serve.add_argument("--grpc-port", type=port, default=None,
                       help="also serve the gRPC control plane on this port (0: any)")
    serve.add_argument("--grpc-token", default=None, help="shared token for the gRPC control plane (default: a fresh one, printed)")
    serve.add_argument("--access-log", default=None, metavar="FILE",
                       help="append one JSON line per HTTP request to FILE (status, rollout, latency, error)")


def _fail(message: str, code: int = 2) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _one_line(exc: BaseException) -> str:
    """transformers' messages span several lines; the command reports in one."""
    return " ".join(str(exc).split())


def _try_bind(host: str, number: int) -> None:
    """Raise OSError if `number` cannot be listened on at `host` now (socket.gaierror: `host` does not
    resolve). uvicorn and gRPC report a failed bind only in their own log lines, then the start fails
    with a bare RuntimeError; trying first lets the command name the flag. Every address `host`
    resolves to is tried, as asyncio's server binds them all, with SO_REUSEADDR as it sets it (a port
    left in TIME_WAIT is free)."""
    for family, kind, proto, _, address in socket.getaddrinfo(host, number, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)


def _check_ports(args: argparse.Namespace) -> int | None:
    """The exit status (after saying why) when --host / --port / --grpc-port cannot be served; None when
    they can. Port 0 (any free port) always can."""
    if args.grpc_port and args.grpc_port == args.port:
        return _fail(f"--grpc-port {args.grpc_port}: the same port as --port")
    for flag, number in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if not number:
            continue
        try:
            _try_bind(args.host, number)
        except socket.gaierror as exc:
            return _fail(f"--host {args.host}: {exc.strerror}")
        except OSError as exc:  # in use, or a privileged port: the arguments are fine, this machine refuses
            return _fail(f"{flag} {number}: cannot listen on {args.host}: {exc.strerror}", 1)
    return None


def _load_renderer(model_dir: Path):
    """The `ChatRenderer` of `model_dir`'s tokenizer (every engine needs it: the proxy renders with it);
    raises OSError or ValueError for a directory without a usable tokenizer."""
    from transformers import AutoTokenizer

    from clawfast.proxy.render import ChatRenderer

    return ChatRenderer(AutoTokenizer.from_pretrained(model_dir))


def run(args: argparse.Namespace) -> int:
    from clawfast.embedded import ensure_embedded_model
    from clawfast.proxy.server import tune_for_serving
    from clawfast.rollout import EndpointConfig, ProxyConfig, RolloutService

    # Every argument is checked before the model loads, so a mistake is reported in seconds, in one line.
    problem = _check_ports(args)
    if problem is not None:
        return problem
    if args.model is not None and not Path(args.model).is_dir():
        return _fail(f"--model {args.model}: no such directory")
    script = None
    if args.scripted:
        from clawfast.engines.scripted import load_script

        try:
            script = load_script(args.scripted)
        except OSError as exc:
            return _fail(f"--scripted {args.scripted}: {exc.strerror or exc}")
        except ValueError as exc:  # its message names the file
            return _fail(f"--scripted {exc}")
        if not script:  # cycling through nothing: every call would fail
            return _fail(f"--scripted {args.scripted}: the script is an empty list")
    model_dir = Path(args.model) if args.model else ensure_embedded_model()
    if not args.scripted and not args.vllm and not (model_dir / "config.json").is_file():
        return _fail(f"--model {model_dir}: not a model directory (no config.json)")
    try:
        renderer = _load_renderer(model_dir)
    except (OSError, ValueError) as exc:
        return _fail(f"--model {model_dir}: cannot use its tokenizer: {_one_line(exc)}")
    try:
        engine = build_engine(args, model_dir, renderer, script)
    except (OSError, ValueError) as exc:
        flag = f"--vllm {args.vllm}" if args.vllm else f"--model {model_dir}"
        return _fail(f"{flag}: cannot build the engine: {_one_line(exc)}")
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_calls=args.max_calls_per_rollout)
    proxy = ProxyConfig(max_tokens_cap=args.max_tokens_cap, max_model_len=args.max_model_len, parser=args.parser,
                        keepalive_s=args.keepalive)
    endpoint = EndpointConfig(host=args.host, port=args.port, grpc_port=args.grpc_port, grpc_token=args.grpc_token,
                              model_name=args.model_name, access_log=args.access_log)
    service = RolloutService(engine, model_dir, records_dir=args.records, proxy=proxy, endpoint=endpoint,
                             default_sampling=sampling)
    tune_for_serving()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(service)
        except (RuntimeError, OSError) as exc:
            # Taken between the check above and the bind (uvicorn has logged why), or the records
            # directory cannot be written: a failure to start, not a bad argument.
            return _fail(f"the proxy failed to start: {_one_line(exc)}", 1)
        opened = service.open(f"manual-{time.strftime('%Y%m%d-%H%M%S')}", harness="manual")
        print(f"http: {service.base_url}", flush=True)
        print(f"key: {opened.key}", flush=True)
        if service.grpc is not None:
            print(f"grpc: {service.grpc.address}", flush=True)
            if not args.grpc_token:
                print(f"grpc token: {service.grpc_token}", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        service.close(opened.rollout_id, status="ok")
    return 0
