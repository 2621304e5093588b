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
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from pathlib import Path

from clawfast.engines.base import Engine, Sampling


def build_engine(args: argparse.Namespace, model_dir: Path) -> Engine:
    """The engine the flags name: the scripted engine playing --scripted FILE, the server at --vllm
    URL, or the in-process torch engine on `model_dir`."""
    from clawfast.train.build import build_engine as build_configured
    from clawfast.train.config import EngineConfig

    if args.scripted:
        from transformers import AutoTokenizer

        from clawfast.engines.scripted import ScriptedEngine, load_script
        from clawfast.proxy.render import ChatRenderer

        renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
        return ScriptedEngine(renderer.encode, renderer.turn_end_id, load_script(args.scripted), cycle=True)
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
    serve.add_argument("--port", type=int, default=8765)
    serve.add_argument("--records", default="runs/records", metavar="DIR", help="where rollout logs are written")
    serve.add_argument("--model-name", default="policy", help="the name /v1/models reports")
    serve.add_argument("--parser", default=None, help="tool-call parser: qwen3, hermes, mistral, llama3_json")
    serve.add_argument("--temperature", type=float, default=None, help="override every request's temperature")
    serve.add_argument("--max-tokens-cap", type=int, default=4096)
    serve.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                       help="the context served (prompt + output): a longer prompt is refused as each API words a "
                            "context overflow; default: the engine's own limit, if it states one")
    serve.add_argument("--keepalive", type=float, default=5.0, help="seconds between keep-alive events")
    serve.add_argument("--max-calls-per-rollout", type=_positive_int, default=None, metavar="N",
                       help="refuse a rollout's model calls beyond N (side calls included); default: unlimited")
    serve.add_argument("--grpc-port", type=int, default=None, help="also serve the gRPC control plane on this port (0: any)")
    serve.add_argument("--grpc-token", default=None, help="shared token for the gRPC control plane (default: a fresh one, printed)")
    serve.add_argument("--access-log", default=None, metavar="FILE",
                       help="append one JSON line per HTTP request to FILE (status, rollout, latency, error)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from clawfast.embedded import ensure_embedded_model
    from clawfast.proxy.server import tune_for_serving
    from clawfast.rollout import EndpointConfig, ProxyConfig, RolloutService

    model_dir = Path(args.model) if args.model else ensure_embedded_model()
    engine = build_engine(args, model_dir)
    sampling = Sampling(temperature=args.temperature, max_calls=args.max_calls_per_rollout)
    proxy = ProxyConfig(max_tokens_cap=args.max_tokens_cap, max_model_len=args.max_model_len, parser=args.parser,
                        keepalive_s=args.keepalive)
    endpoint = EndpointConfig(host=args.host, port=args.port, grpc_port=args.grpc_port, grpc_token=args.grpc_token,
                              model_name=args.model_name, access_log=args.access_log)
    service = RolloutService(engine, model_dir, records_dir=args.records, proxy=proxy, endpoint=endpoint,
                             default_sampling=sampling)
    tune_for_serving()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with service:
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
