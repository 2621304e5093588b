"""`RolloutControl` over the proxy's gRPC control plane, for workers outside the proxy's process
(Ray actors). In the proxy's own process, pass its `RolloutRegistry` instead: it has the same
`open` / `close` shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clawfast.records import RolloutResult


@dataclass(frozen=True)
class ProxyRollout:
    """An opened rollout: its id, the harness's key and the proxy root URL (no ``/v1``)."""

    rollout_id: str
    key: str
    base_url: str


class GrpcControl:
    """address: ``host:port`` of the proxy's gRPC control plane; token: its shared bearer token."""

    def __init__(self, address: str, token: str, *, timeout: float = 60.0) -> None:
        from clawfast.proxy.grpc_client import ControlClient

        self.client = ControlClient(address, token, timeout=timeout)

    def open(self, *, task_id: str, harness: str, sample_index: int) -> ProxyRollout:
        opened = self.client.open_rollout(task_id, harness, sample_index)
        return ProxyRollout(opened.rollout_id, opened.key, opened.anthropic_base_url)

    def close(self, rollout_id: str, *, reward: float, status: str, info: dict[str, Any]) -> RolloutResult:
        return self.client.close_rollout(rollout_id, reward=reward, status=status, info=info)

    def shutdown(self) -> None:
        self.client.close()
