"""clawfast.proxy: the serving proxy between real agent harnesses and the policy engine.

Layers, each usable on its own:
- `canonical`: the protocol-neutral conversation and parsed turn.
- `anthropic`, `chat`, `responses` (+ ``*_models``): protocol fronts, wire format <-> canonical.
- `render`: canonical -> prompt ids through the chat template, incremental, splicing produced turns.
- `parsers`: model output -> turn (Qwen3/Hermes, Mistral, Llama-3 JSON tool calls).
- `tagging`: a hint per call (main / subagent / compaction / title / quota); the kinds training uses
  come from the records' structure (`clawfast.threads`).
- `rollouts`: the registry of open rollouts, their keys and append-only record logs.
- `core`: prepare -> generate -> complete, no sockets.
- `server`: Starlette/uvicorn routes, keep-alives, disconnects.
- `grpc_service`, `grpc_client`: the gRPC control plane (open / close rollouts, stream records).

`clawfast.rollout.RolloutService` assembles these into a running proxy (``clawfast proxy serve``,
`clawfast.commands.proxy`, is one of its users).
"""

if __name__ == "proxy":
    # Found by its directory name, not as clawfast.proxy (Python started at a checkout's root): hand the
    # name to any other top-level `proxy` (the proxy.py distribution's), or fail as a missing module
    # (clawfast._toplevel).
    from clawfast._toplevel import hand_off

    hand_off(__name__, b'"""clawfast.proxy:', empty_when_missing=False)
else:
    from clawfast.proxy.core import ProxyConfig, ProxyCore
    from clawfast.proxy.render import ChatRenderer
    from clawfast.proxy.rollouts import OpenedRollout, Rollout, RolloutRegistry
    from clawfast.proxy.server import ProxyApp, ProxyServer

    __all__ = [
        "ChatRenderer",
        "OpenedRollout",
        "ProxyApp",
        "ProxyConfig",
        "ProxyCore",
        "ProxyServer",
        "Rollout",
        "RolloutRegistry",
    ]
