"""`clawfast proxy serve`: run the serving proxy by hand.

    clawfast proxy serve [--model DIR | --scripted FILE | --vllm URL] [--host H] [--port P] [--records DIR]

The tokenizer and chat template come from --model (default: the embedded model, built on first use).
The engine is the in-process torch engine on that model, or the scripted engine playing FILE, or a
vLLM server at URL (needs `clawfast.engines.remote`). It prints the HTTP address and the key of a
default rollout ("manual-<time>") whose calls are appended to <records>/manual-<time>.cfr. With
--grpc-port it also serves the gRPC control plane (`clawfast.proxy.grpc_service`) and prints its
address (and the shared token, unless --grpc-token gave one).
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import signal
import threading
import time
from pathlib import Path

from clawfast.engines.base import Engine
from clawfast.proxy.core import ProxyConfig, ProxyCore
from clawfast.proxy.render import ChatRenderer
from clawfast.proxy.rollouts import RolloutRegistry
from clawfast.proxy.server import ProxyApp, ProxyServer, tune_for_serving


def load_renderer(model_dir: str | Path | None) -> tuple[ChatRenderer, Path]:
    from transformers import AutoTokenizer

    from clawfast.embedded import ensure_embedded_model

    path = Path(model_dir) if model_dir else ensure_embedded_model()
    return ChatRenderer(AutoTokenizer.from_pretrained(path)), path


def build_engine(args: argparse.Namespace, renderer: ChatRenderer, model_dir: Path) -> Engine:
    if args.scripted:
        from clawfast.engines.scripted import ScriptedEngine, load_script

        return ScriptedEngine(renderer.encode, renderer.turn_end_id, load_script(args.scripted), cycle=True)
    if args.vllm:
        try:
            from clawfast.engines.remote import RemoteEngine
        except ImportError as exc:
            raise SystemExit(f"--vllm needs clawfast.engines.remote, which this build lacks ({exc})") from None
        return RemoteEngine(args.vllm)
    from clawfast.engines.torch_engine import TorchEngine

    return TorchEngine.from_pretrained(model_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="proxy_command", required=True)
    serve = sub.add_parser("serve", help="serve the Anthropic, Chat Completions and Responses APIs")
    source = serve.add_mutually_exclusive_group()
    source.add_argument("--scripted", metavar="FILE", help="play the JSON list of outputs in FILE (cycling)")
    source.add_argument("--vllm", metavar="URL", help="generate with the vLLM server at URL")
    serve.add_argument("--model", metavar="DIR", help="model (and tokenizer) directory; default: the embedded model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8765)
    serve.add_argument("--records", default="runs/records", metavar="DIR", help="where rollout logs are written")
    serve.add_argument("--model-name", default="policy", help="the name /v1/models reports")
    serve.add_argument("--parser", default=None, help="tool-call parser: qwen3, hermes, mistral, llama3_json")
    serve.add_argument("--temperature", type=float, default=None, help="override every request's temperature")
    serve.add_argument("--max-tokens-cap", type=int, default=4096)
    serve.add_argument("--keepalive", type=float, default=5.0, help="seconds between keep-alive events")
    serve.add_argument("--max-calls-per-rollout", type=_positive_int, default=None, metavar="N",
                       help="refuse a rollout's model calls beyond N (side calls included); default: unlimited")
    serve.add_argument("--grpc-port", type=int, default=None, help="also serve the gRPC control plane on this port (0: any)")
    serve.add_argument("--grpc-token", default=None, help="shared token for the gRPC control plane (default: a fresh one, printed)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    renderer, model_dir = load_renderer(args.model)
    engine = build_engine(args, renderer, model_dir)
    config = ProxyConfig(
        max_tokens_cap=args.max_tokens_cap, temperature=args.temperature, keepalive_s=args.keepalive, parser=args.parser,
        max_calls_per_rollout=args.max_calls_per_rollout,
    )
    registry = RolloutRegistry(args.records)
    app = ProxyApp(ProxyCore(engine, renderer, config), registry, model_name=args.model_name)
    tune_for_serving()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ProxyServer(app, args.host, args.port))
        opened = registry.open(f"manual-{time.strftime('%Y%m%d-%H%M%S')}", harness="manual")
        print(f"http: {server.base_url}", flush=True)
        print(f"key: {opened.key}", flush=True)
        if args.grpc_port is not None:
            from clawfast.proxy.grpc_service import GrpcControlServer

            token = args.grpc_token or secrets.token_urlsafe(24)
            control = stack.enter_context(GrpcControlServer(registry, token, host=args.host, port=args.grpc_port, engine=engine))
            print(f"grpc: {control.address}", flush=True)
            if not args.grpc_token:
                print(f"grpc token: {token}", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        registry.close_all(status="ok")
    return 0
