"""The one endpoint in front of every engine: an ASGI dispatcher.

Requests that name a model (`/v1/completions`, `/v1/chat/completions`, and any other
POST under `/v1/` with a JSON `model` field) are forwarded, body and all, to the vLLM app
of that model, so vLLM's own serving classes produce every response. The gateway itself
answers only what spans models (`/v1/models`, `/health`, `/metrics`) and the errors no
engine can answer (bad JSON, unknown model, dead engine, wrong API key).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from weaver.server.errors import error_body
from weaver.server.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
HEALTH_CHECK_TIMEOUT_S = 5.0


class ModelBackend(Protocol):
    """What the gateway needs of one model's engine (see weaver.vllm_ext.engine.app)."""

    app: ASGIApp

    @property
    def is_dead(self) -> bool: ...

    async def check_health(self) -> None: ...

    def scheduler_stats(self) -> dict[str, float]: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass
class GatewayConfig:
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    created_at: int = 0  # unix time reported in /v1/models


class Gateway:
    def __init__(
        self,
        backends: Mapping[str, ModelBackend],
        config: GatewayConfig,
        metrics: GatewayMetrics,
        extra_health: Callable[[], dict[str, Any]] | None = None,
        before_metrics: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.backends = dict(backends)
        self.config = config
        self.metrics = metrics
        self.extra_health = extra_health  # weaving state, filled by the weaving layer
        self.before_metrics = before_metrics  # pulls worker-side counters before a scrape
        for name, backend in self.backends.items():
            self.metrics.engine_up.labels(model=name).set(0 if backend.is_dead else 1)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await _answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path.startswith("/v1/") and not self._is_authorized(scope):
            self.metrics.rejected.labels(reason="unauthorized").inc()
            await _send_json(send, 401, error_body(401, "invalid or missing API key"))
            return
        if path == "/v1/models" and method == "GET":
            await _send_json(send, 200, self._models_body())
        elif path == "/health" and method == "GET":
            await self._health(send)
        elif path == "/metrics" and method == "GET":
            if self.before_metrics is not None:
                await self.before_metrics()
            for name, backend in self.backends.items():
                self.metrics.set_scheduler_stats(name, backend.scheduler_stats())
            await _send(send, 200, self.metrics.render(), b"text/plain; version=0.0.4")
        elif path.startswith("/v1/") and method == "POST":
            await self._forward(scope, receive, send)
        else:
            await _send_json(send, 404, error_body(404, f"no route {method} {path}"))

    def _is_authorized(self, scope: dict) -> bool:
        if not self.config.api_keys:
            return True
        headers = dict(scope.get("headers") or [])
        token = headers.get(b"authorization", b"").decode("latin-1")
        if not token.startswith("Bearer "):
            return False
        offered = token.removeprefix("Bearer ").encode()
        # Constant-time comparison, so the key cannot be guessed byte by byte from timings.
        return any(hmac.compare_digest(offered, key.encode()) for key in self.config.api_keys)

    def _models_body(self) -> bytes:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.config.created_at,
                "owned_by": "weaver",
                "root": backend.describe().get("model_path", name),
                "max_model_len": backend.describe().get("max_model_len"),
            }
            for name, backend in self.backends.items()
        ]
        return json.dumps({"object": "list", "data": data}).encode()

    async def _health(self, send: Callable) -> None:
        results = await asyncio.gather(*(self._model_health(n) for n in self.backends))
        models = dict(zip(self.backends, results, strict=False))
        is_ok = all(m["status"] == "ok" for m in models.values())
        body: dict[str, Any] = {"status": "ok" if is_ok else "degraded", "models": models}
        if self.before_metrics is not None:
            await self.before_metrics()
        if self.extra_health is not None:
            body.update(self.extra_health())
        await _send_json(send, 200 if is_ok else 503, json.dumps(body).encode())

    async def _model_health(self, name: str) -> dict[str, Any]:
        backend = self.backends[name]
        status = "ok"
        if backend.is_dead:
            status = "dead"
        else:
            try:
                await asyncio.wait_for(backend.check_health(), HEALTH_CHECK_TIMEOUT_S)
            except Exception as exc:  # any failure of the probe means not healthy
                logger.warning("health check of %s failed: %r", name, exc)
                status = "dead" if backend.is_dead else "unhealthy"
        self.metrics.engine_up.labels(model=name).set(1 if status == "ok" else 0)
        return {"status": status, **backend.describe()}

    async def _forward(self, scope: dict, receive: Callable, send: Callable) -> None:
        body = await _read_body(receive)
        endpoint = scope["path"]
        try:
            request = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self.metrics.rejected.labels(reason="bad_json").inc()
            await _send_json(send, 400, error_body(400, f"request body is not valid JSON: {exc}"))
            return
        model = request.get("model") if isinstance(request, dict) else None
        if not isinstance(model, str) or not model:
            self.metrics.rejected.labels(reason="no_model").inc()
            message = "the request must name a model in its 'model' field; see GET /v1/models"
            await _send_json(send, 400, error_body(400, message, param="model"))
            return
        backend = self.backends.get(model)
        if backend is None:
            self.metrics.rejected.labels(reason="unknown_model").inc()
            message = f"model {model!r} does not exist; served models: {sorted(self.backends)}"
            await _send_json(send, 404, error_body(404, message, param="model"))
            return
        if backend.is_dead:
            self.metrics.engine_up.labels(model=model).set(0)
            self.metrics.requests.labels(model=model, endpoint=endpoint, status="503").inc()
            message = f"the engine of model {model!r} is not running; other models still serve"
            await _send_json(send, 503, error_body(503, message))
            return
        await self._call_backend(model, backend, scope, _replay(body, receive), send)

    async def _call_backend(
        self, model: str, backend: ModelBackend, scope: dict, receive: Callable, send: Callable
    ) -> None:
        status_seen: list[int] = []

        async def send_and_record(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        started = time.monotonic()
        await backend.app(scope, receive, send_and_record)
        status = str(status_seen[0]) if status_seen else "none"
        self.metrics.requests.labels(model=model, endpoint=scope["path"], status=status).inc()
        self.metrics.request_seconds.labels(model=model, endpoint=scope["path"]).observe(
            time.monotonic() - started
        )


async def _read_body(receive: Callable) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Callable) -> Callable[[], Awaitable[dict]]:
    """A `receive` that hands the buffered body to the engine's app once, then passes on
    the connection's own messages, so a client that disconnects aborts its generation."""
    sent = False

    async def replay_receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_receive


async def _send(send: Callable, status: int, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send: Callable, status: int, body: bytes) -> None:
    await _send(send, status, body, b"application/json")


async def _answer_lifespan(receive: Callable, send: Callable) -> None:
    # Engines are started before the server and closed after it (weaver.server.app), so the
    # ASGI lifespan has nothing to do but acknowledge.
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
