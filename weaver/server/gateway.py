"""The one endpoint in front of every engine: an ASGI dispatcher.

Every POST names its model in its JSON `model` field (`/v1/completions`, `/v1/chat/
completions`, `/v1/responses`, `/v1/embeddings`, `/tokenize`, `/detokenize`, ... whatever
vLLM serves) and is forwarded, body and all, to the vLLM app of that model, so vLLM's own
serving classes produce every response, its errors too (a route the model's engine does
not serve answers vLLM's 404). With one model served, a request that names none goes to
it, as under `vllm serve`. A stored response (`/v1/responses/{id}`) is found by asking the
engines in turn. The gateway itself answers only what spans models (`/v1/models`,
`/v1/models/{id}`, `/health`, `/metrics`) and the errors no engine can answer, each
OpenAI-shaped: 400 a body it cannot parse (whatever its nesting or
encoding), 401 a wrong API key, 404 an unknown model, 413 a body over the size bound, 429 a
model with too many requests waiting, 503 an engine that is down or restarting and a server
that is draining (both with Retry-After), 504 a request past its deadline.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from weaver.server.errors import error_body
from weaver.server.inflight import Aborted, InFlight
from weaver.server.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
HEALTH_CHECK_TIMEOUT_S = 5.0
MiB = 1 << 20
# A request's own deadline, in seconds (overrides the model's timeout_s).
TIMEOUT_HEADER = b"x-request-timeout"
MODEL_CARD_PREFIX = "/v1/models/"
RESPONSES_PREFIX = "/v1/responses/"


class ModelBackend(Protocol):
    """What the gateway needs of one model's engine (see weaver.vllm_ext.engine.app)."""

    app: ASGIApp

    @property
    def is_dead(self) -> bool: ...

    @property
    def is_recovering(self) -> bool:
        """Down but being restarted: its 503s carry Retry-After."""
        ...

    async def check_health(self) -> None: ...

    def scheduler_stats(self) -> dict[str, float]: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ModelLimits:
    """A model's back-pressure bound and default deadline (its ModelSpec's)."""

    max_in_flight: int  # its running batch (max_num_seqs) plus the requests let wait
    timeout_s: float | None = None


@dataclass
class GatewayConfig:
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    created_at: int = 0  # unix time reported in /v1/models
    limits: Mapping[str, ModelLimits] = field(default_factory=dict)  # by model; none: unbounded
    max_body_bytes: int = 16 * MiB
    retry_after_s: int = 5
    open_status_routes: bool = True  # /health and /metrics without an API key


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
        self.in_flight = InFlight()
        self._served_paths: set[str] = set()  # the metrics' endpoint labels (_endpoint_label)
        self.draining = False  # set by a graceful drain: new requests get 503
        for name, backend in self.backends.items():
            self.metrics.engine_up.labels(model=name).set(0 if backend.is_dead else 1)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await _answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        is_keyed = path not in ("/health", "/metrics") or not self.config.open_status_routes
        if is_keyed and not self._is_authorized(scope):
            self.metrics.rejected.labels(reason="unauthorized").inc()
            await send_json(send, 401, error_body(401, "invalid or missing API key"))
            return
        if path == "/v1/models" and method == "GET":
            await send_json(send, 200, self._models_body())
        elif path.startswith(MODEL_CARD_PREFIX) and method == "GET":
            await self._model_card(path.removeprefix(MODEL_CARD_PREFIX), send)
        elif path.startswith(RESPONSES_PREFIX) and method in ("GET", "POST", "DELETE"):
            await self._forward_by_response_id(scope, receive, send)
        elif path == "/health" and method == "GET":
            await self._health(send)
        elif path == "/metrics" and method == "GET":
            if self.before_metrics is not None:
                await self.before_metrics()
            for name, backend in self.backends.items():
                self.metrics.set_scheduler_stats(name, backend.scheduler_stats())
            await _send(send, 200, self.metrics.render(), b"text/plain; version=0.0.4")
        elif method == "POST":
            await self._forward(scope, receive, send)
        else:
            await send_json(send, 404, error_body(404, f"no route {method} {path}"))

    async def drain(self, grace_s: float) -> None:
        """Take no new requests (503 with Retry-After), give those in flight up to grace_s
        to finish, then abort the rest with a clean error (503)."""
        self.draining = True
        logger.info("draining: %d request(s) in flight get up to %.0f s to finish",
                    self.in_flight.total, grace_s)
        if await self.in_flight.wait_idle(grace_s):
            return
        num_aborted = self.in_flight.abort_all(Aborted(
            503, "the server shut down before this request finished; retry it"))
        logger.warning("drain grace of %.0f s is over: aborted %d request(s)", grace_s,
                       num_aborted)
        await self.in_flight.wait_idle(HEALTH_CHECK_TIMEOUT_S)

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

    def _card(self, name: str) -> dict[str, Any]:
        described = self.backends[name].describe()
        return {"id": name, "object": "model", "created": self.config.created_at,
                "owned_by": "weaver", "root": described.get("model_path", name),
                "max_model_len": described.get("max_model_len")}

    def _models_body(self) -> bytes:
        data = [self._card(name) for name in self.backends]
        return json.dumps({"object": "list", "data": data}).encode()

    async def _model_card(self, name: str, send: Callable) -> None:
        """GET /v1/models/{id} (the OpenAI client's models.retrieve); an id may hold a
        '/' (a Hugging Face id)."""
        if name not in self.backends:
            message = f"model {name!r} does not exist; served models: {sorted(self.backends)}"
            await send_json(send, 404, error_body(404, message, "model"))
            return
        await send_json(send, 200, json.dumps(self._card(name)).encode())

    async def _take_body(self, scope: dict, receive: Callable, send: Callable) -> bytes | None:
        """A new request's body; None once it has been answered 503 (draining) or 413."""
        if self.draining:
            await self._reject(send, 503, "draining", "the server is shutting down and takes "
                               "no new requests; retry on another replica or later", retry=True)
            return None
        body = await _read_body(receive, self.config.max_body_bytes, _content_length(scope))
        if body is None:
            await self._reject(send, 413, "body_too_large", "the request body is larger than "
                               f"{self.config.max_body_bytes} bytes (serving.max_body_bytes)")
        return body

    async def _forward_by_response_id(self, scope: dict, receive: Callable,
                                      send: Callable) -> None:
        """`/v1/responses/{id}` (retrieve, cancel, delete) names no model: each live engine
        is asked in turn and the first that knows the id answers; when none does, the
        last engine's own 404 goes to the client."""
        body = await self._take_body(scope, receive, send)
        if body is None:
            return
        live = [(name, b) for name, b in self.backends.items() if not b.is_dead]
        if not live:
            await self._reject(send, 503, "engine_down", "no engine is running; retry later",
                               retry=True)
            return
        for index, (name, backend) in enumerate(live):
            if index == len(live) - 1:
                await self._call_backend(name, backend, scope, replay_body(body, receive), send,
                                         None)
                return
            answer = _HeldUntilFound(send)
            await backend.app(scope, replay_body(body, receive), answer.send)
            if answer.is_found:
                self.metrics.requests.labels(model=name, endpoint=RESPONSES_PREFIX + "{id}",
                                             status=str(answer.status)).inc()
                return

    async def _health(self, send: Callable) -> None:
        results = await asyncio.gather(*(self._model_health(n) for n in self.backends))
        models = dict(zip(self.backends, results, strict=False))
        is_ok = all(m["status"] == "ok" for m in models.values()) and not self.draining
        status = "draining" if self.draining else "ok" if is_ok else "degraded"
        body: dict[str, Any] = {"status": status, "models": models,
                                "in_flight": self.in_flight.total}
        if self.before_metrics is not None:
            await self.before_metrics()
        if self.extra_health is not None:
            body.update(self.extra_health())
        await send_json(send, 200 if is_ok else 503, json.dumps(body).encode())

    async def _model_health(self, name: str) -> dict[str, Any]:
        backend = self.backends[name]
        status = "ok"
        if backend.is_dead:
            status = "restarting" if backend.is_recovering else "dead"
        else:
            try:
                await asyncio.wait_for(backend.check_health(), HEALTH_CHECK_TIMEOUT_S)
            except Exception as exc:  # any failure of the probe means not healthy
                logger.warning("health check of %s failed: %r", name, exc)
                status = "dead" if backend.is_dead else "unhealthy"
        self.metrics.engine_up.labels(model=name).set(1 if status == "ok" else 0)
        return {"status": status, **backend.describe()}

    async def _reject(self, send: Callable, status: int, reason: str, message: str,
                      param: str | None = None, retry: bool = False) -> None:
        self.metrics.rejected.labels(reason=reason).inc()
        headers = [(b"retry-after", str(self.config.retry_after_s).encode())] if retry else []
        await send_json(send, status, error_body(status, message, param), headers)

    async def _forward(self, scope: dict, receive: Callable, send: Callable) -> None:
        body = await self._take_body(scope, receive, send)
        if body is None:
            return
        endpoint = self._endpoint_label(scope["path"])
        try:
            request = json.loads(body)
        except (ValueError, RecursionError) as exc:
            # ValueError: bad JSON or bad encoding; RecursionError: nested too deep to parse.
            detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            await self._reject(send, 400, "bad_json", f"request body is not valid JSON: {detail}")
            return
        model = request.get("model") if isinstance(request, dict) else None
        if model is None and len(self.backends) == 1 and isinstance(request, dict):
            model = next(iter(self.backends))  # one model served: vLLM's default model
        if not isinstance(model, str) or not model:
            message = "the request must name a model in its 'model' field; see GET /v1/models"
            await self._reject(send, 400, "no_model", message, param="model")
            return
        backend = self.backends.get(model)
        if backend is None:
            message = f"model {model!r} does not exist; served models: {sorted(self.backends)}"
            await self._reject(send, 404, "unknown_model", message, param="model")
            return
        try:
            timeout_s = _request_timeout(scope, self.config.limits.get(model))
        except ValueError as exc:
            await self._reject(send, 400, "bad_timeout", str(exc), param="X-Request-Timeout")
            return
        if backend.is_dead:
            self.metrics.engine_up.labels(model=model).set(0)
            self.metrics.requests.labels(model=model, endpoint=endpoint, status="503").inc()
            is_recovering = backend.is_recovering
            message = (f"the engine of model {model!r} is restarting; other models still serve"
                       if is_recovering else f"the engine of model {model!r} is not running "
                       "and will not be restarted (see GET /health); other models still serve")
            await self._reject(send, 503, "engine_down", message, retry=is_recovering)
            return
        limits = self.config.limits.get(model)
        if limits is not None and self.in_flight.count(model) >= limits.max_in_flight:
            self.metrics.requests.labels(model=model, endpoint=endpoint, status="429").inc()
            await self._reject(send, 429, "queue_full", f"model {model!r} has "
                               f"{self.in_flight.count(model)} requests in flight, its bound "
                               "(max_num_seqs + max_waiting_requests); retry later", retry=True)
            return
        await self._call_backend(model, backend, scope, replay_body(body, receive), send, timeout_s)

    async def _call_backend(self, model: str, backend: ModelBackend, scope: dict,
                            receive: Callable, send: Callable, timeout_s: float | None) -> None:
        response = _ResponseState()

        async def send_and_record(message: dict) -> None:
            if (message["type"] == "http.response.start" and message["status"] >= 500
                    and backend.is_recovering):
                # The engine died under this request (vLLM answers 500 EngineDeadError) and
                # is being restarted: a retry will be served.
                retry_after = (b"retry-after", str(self.config.retry_after_s).encode())
                message = {**message, "status": 503,
                           "headers": [*message.get("headers", []), retry_after]}
            response.note(message)
            await send(message)

        started = time.monotonic()
        aborted = await self.in_flight.run(model, backend.app(scope, receive, send_and_record),
                                           timeout_s)
        if aborted is not None:
            await _finish_aborted(send, response, aborted)
        status = str(response.status) if response.status is not None else "none"
        if response.status != 404:
            self._served_paths.add(scope["path"])
        endpoint = self._endpoint_label(scope["path"])
        self.metrics.requests.labels(model=model, endpoint=endpoint, status=status).inc()
        self.metrics.request_seconds.labels(model=model, endpoint=endpoint).observe(
            time.monotonic() - started
        )

    def _endpoint_label(self, path: str) -> str:
        """The path as a metrics label once an engine has served it; any other path is
        "other", so that requests to made-up paths cannot grow the label set."""
        if path.startswith(RESPONSES_PREFIX):
            return RESPONSES_PREFIX + "{id}"
        return path if path in self._served_paths else "other"


class _HeldUntilFound:
    """Passes an engine's answer on unless it is a 404 (that engine does not know the
    id), which is swallowed so that the next engine can be asked."""

    def __init__(self, send: Callable) -> None:
        self._send = send
        self.status: int | None = None

    @property
    def is_found(self) -> bool:
        return self.status is not None and self.status != 404

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        if self.is_found:
            await self._send(message)


@dataclass
class _ResponseState:
    """What of a response has gone to the client, so an abort can end it cleanly."""

    status: int | None = None
    is_event_stream: bool = False
    is_complete: bool = False

    def note(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            headers = dict(message.get("headers") or [])
            self.is_event_stream = headers.get(b"content-type", b"").startswith(
                b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.is_complete = True


async def _finish_aborted(send: Callable, response: _ResponseState, aborted: Aborted) -> None:
    """Tell the client why its request was cut short, in the form its response has."""
    if response.is_complete:
        return
    body = error_body(aborted.status, aborted.message)
    if response.status is None:
        await send_json(send, aborted.status, body)
    elif response.is_event_stream:
        # The status went out with the first event; vLLM's own mid-stream errors are an
        # event with an "error" object, and the stream then ends.
        await send({"type": "http.response.body", "body": b"data: " + body + b"\n\n",
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    else:
        await send({"type": "http.response.body", "body": b""})


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _request_timeout(scope: dict, limits: ModelLimits | None) -> float | None:
    """The request's deadline: its X-Request-Timeout header, else its model's timeout_s."""
    for name, value in scope.get("headers") or ():
        if name == TIMEOUT_HEADER:
            try:
                seconds = float(value)
            except ValueError:
                seconds = float("nan")
            if not 0 < seconds < float("inf"):
                raise ValueError(f"X-Request-Timeout must be a positive number of seconds, "
                                 f"not {value.decode('latin-1')!r}")
            return seconds
    return limits.timeout_s if limits is not None else None


async def _read_body(receive: Callable, max_bytes: int, content_length: int | None
                     ) -> bytes | None:
    """The whole body, or None once it is known to be larger than max_bytes (read no
    further: the bound is what keeps a huge body out of memory)."""
    if content_length is not None and content_length > max_bytes:
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay_body(body: bytes, receive: Callable) -> Callable[[], Awaitable[dict]]:
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


async def _send(send: Callable, status: int, body: bytes, content_type: bytes,
                extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
               *(extra_headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Callable, status: int, body: bytes,
                     extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await _send(send, status, body, b"application/json", extra_headers)


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
