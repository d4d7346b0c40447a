"""How `weaver serve` behaves under load and failure: the deployment file's `serving` block.

Per-model limits (waiting requests, request deadline) live on the model (ModelSpec); what
spans models (body size, drain, engine restarts, who may read /health and /metrics) is here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

MiB = 1 << 20


class RestartPolicy(BaseModel):
    """When and how often a dead or hung engine is restarted (weaver/server/supervisor.py)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="restart dead or hung engines")
    probe_interval_s: float = Field(2.0, gt=0, description="time between health probes")
    unhealthy_after_s: float = Field(
        30.0, gt=0, description="an engine whose probes fail this long is hung and restarted")
    backoff_s: float = Field(1.0, ge=0, description="wait before the first restart")
    backoff_max_s: float = Field(60.0, ge=0, description="the back-off doubles up to this")
    max_restarts: int = Field(
        5, ge=0, description="restarts allowed within window_s; past it the engine stays down")
    window_s: float = Field(600.0, gt=0, description="the window max_restarts counts in")

    @model_validator(mode="after")
    def _check_backoff(self) -> RestartPolicy:
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be at least "
                             f"backoff_s ({self.backoff_s})")
        return self

    def backoff_for(self, attempt: int) -> float:
        """Seconds to wait before restart number `attempt` (1-based) of a crash series."""
        return min(self.backoff_s * 2 ** max(attempt - 1, 0), self.backoff_max_s)


class ServingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(
        16 * MiB, ge=1024, description="largest request body; larger ones are answered 413")
    drain_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM, how long in-flight requests may finish before "
        "they are aborted with an error")
    retry_after_s: int = Field(
        5, ge=1, description="the Retry-After of 429 and 503 answers")
    open_status_routes: bool = Field(
        True, description="GET /health and /metrics answer without an API key (as vLLM's "
        "do); false: they need one of the keys, like /v1")
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
