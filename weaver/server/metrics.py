"""Gateway-level Prometheus series, labelled by `model`.

They live in a registry owned by the gateway (no module-level singleton); `/metrics`
renders it together with the process-global registry where vLLM's own `vllm:*` series
(labelled `model_name`) are kept.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "weaver_requests",
            "Requests the gateway routed, by model, endpoint and HTTP status",
            ["model", "endpoint", "status"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "weaver_rejected_requests",
            "Requests answered by the gateway itself with an error (no engine involved)",
            ["reason"],
            registry=self.registry,
        )
        self.engine_up = Gauge(
            "weaver_engine_up", "1 while the model's engine is alive", ["model"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "weaver_request_duration_seconds",
            "Time from request to the last byte of the response, by model",
            ["model", "endpoint"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(REGISTRY)
