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
    import importlib

    # Each public name -> the module that defines it, imported on first access (PEP 562), so that a
    # submodule such as `grpc_client` (for processes outside the proxy) does not pull in the HTTP server,
    # the template engine and pydantic that `server` and `core` need.
    _WHERE = {
        "ChatRenderer": "render",
        "OpenedRollout": "rollouts",
        "ProxyApp": "server",
        "ProxyConfig": "core",
        "ProxyCore": "core",
        "ProxyServer": "server",
        "Rollout": "rollouts",
        "RolloutRegistry": "rollouts",
    }
    __all__ = sorted(_WHERE)

    def __getattr__(name: str):
        if name not in _WHERE:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value  # later accesses skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
