"""A live proxy on a loopback port with a scripted engine (`embedded_dir` and `renderer` are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from clawfast.engines.scripted import ScriptedEngine
from clawfast.proxy import ProxyApp, ProxyConfig, ProxyCore, ProxyServer, RolloutRegistry


class LiveProxy:
    """A running proxy: `url`, `registry`, `engine` (scripted: push outputs), `key` of rollout "r0"."""

    def __init__(self, server: ProxyServer, engine: ScriptedEngine, registry: RolloutRegistry) -> None:
        self.server, self.engine, self.registry = server, engine, registry
        self.url = server.base_url
        self.core = server.app.core
        opened = registry.open("r0", harness="test")
        self.rollout_id, self.key = opened.rollout_id, opened.key

    def calls(self, rollout_id: str = "r0"):
        return self.registry.records(rollout_id)


def make_proxy(renderer, tmp_path, engine_cls=ScriptedEngine, config: ProxyConfig | None = None, **engine_kwargs):
    engine = engine_cls(renderer.encode, renderer.turn_end_id, **engine_kwargs)
    registry = RolloutRegistry(tmp_path / "records")
    app = ProxyApp(ProxyCore(engine, renderer, config or ProxyConfig(keepalive_s=0.05)), registry)
    server = ProxyServer(app).start()
    return LiveProxy(server, engine, registry)


@pytest.fixture(scope="session")
def proxy_factory(renderer):
    """make(tmp_dir, engine_cls=ScriptedEngine, config=None, renderer=the session's, **engine_kwargs) ->
    a started LiveProxy."""
    return lambda tmp, renderer=renderer, **kwargs: make_proxy(renderer, tmp, **kwargs)


@pytest.fixture
def proxy(renderer, tmp_path):
    live = make_proxy(renderer, tmp_path)
    yield live
    live.server.stop()
