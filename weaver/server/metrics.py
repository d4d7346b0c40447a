"""Gateway-level Prometheus series, labelled by `model`.

They live in a registry owned by the gateway (no module-level singleton); `/metrics`
renders it together with the process-global registry where vLLM's own `vllm:*` series
(labelled `model_name`) are kept.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

# From each engine's SchedulerStats (weaver.vllm_ext.engine.stats), by model.
_SCHEDULER_SERIES = {
    "num_running": "Requests in the engine's running batch",
    "num_waiting": "Requests waiting for the engine's scheduler",
    "kv_cache_usage": "Fraction of the engine's own KV blocks in use",
    "peak_running": "Most requests in one batch since the engine started",
}


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
        self.engine_restarts = Counter(
            "weaver_engine_restarts", "Times the gateway restarted the model's engine (dead "
            "or hung)", ["model"], registry=self.registry,
        )
        self.request_seconds = Histogram(
            "weaver_request_duration_seconds",
            "Time from request to the last byte of the response, by model",
            ["model", "endpoint"],
            registry=self.registry,
        )

        self.scheduler = {
            key: Gauge(f"weaver_{key}", help_text, ["model"], registry=self.registry)
            for key, help_text in _SCHEDULER_SERIES.items()
        }

    def set_scheduler_stats(self, model: str, stats: dict[str, float]) -> None:
        for key, value in stats.items():
            if key in self.scheduler:
                self.scheduler[key].labels(model=model).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(REGISTRY)
