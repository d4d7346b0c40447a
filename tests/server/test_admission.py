"""What the gateway refuses or cuts short, and how: body bound (413), back-pressure (429),
deadlines (504), a graceful drain (503), bodies it cannot parse (400), keyed status routes.

The backends are stand-ins for vLLM's app (named as such): one holds each request until the
test releases it, and notes whether it was cancelled, which is how vLLM's serving code learns
to abort a request in its engine. The real engines are in test_serve_e2e.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from weaver.server.gateway import Gateway, GatewayConfig, ModelLimits
from weaver.server.metrics import GatewayMetrics


class HeldBackend:
    """Stand-in for one model's vLLM app: answers once `release` is set, streaming one
    event per 10 ms when the request asks for a stream; notes cancellations."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0
        self.cancelled = 0
        self.is_dead = False
        self.is_recovering = False

    async def check_health(self) -> None:
        return None

    def scheduler_stats(self) -> dict:
        return {}

    def describe(self) -> dict:
        return {}

    async def app(self, scope, receive, send) -> None:
        self.started += 1
        request = json.loads((await receive())["body"])
        try:
            if request.get("stream"):
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream")]})
                while not self.release.is_set():
                    await send({"type": "http.response.body", "body": b"data: {}\n\n",
                                "more_body": True})
                    await asyncio.sleep(0.01)
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
                return
            await self.release.wait()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"ok": true}'})
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def make(config: GatewayConfig | None = None) -> tuple[httpx.AsyncClient, Gateway, HeldBackend]:
    backend = HeldBackend()
    gateway = Gateway({"m": backend}, config or GatewayConfig(), GatewayMetrics())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw")
    return client, gateway, backend


def run(coro):
    return asyncio.run(coro)


async def until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


REQUEST = {"model": "m", "prompt": "x"}


def test_a_body_over_the_bound_is_413_and_never_reaches_the_engine():
    async def go():
        client, _, backend = make(GatewayConfig(max_body_bytes=2048))
        big = {**REQUEST, "prompt": "x" * 4096}
        response = await client.post("/v1/completions", json=big)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == 413
        assert backend.started == 0
    run(go())


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
    b'{"model": "m", "prompt": "\xff\xfe"}',  # not UTF-8
    b"\xff\xfe{\x00",  # a UTF-16 byte-order mark before a broken document
    b"\x00" * 64,
    b"",
])
def test_bodies_that_cannot_be_parsed_or_routed_are_4xx(body):
    async def go():
        client, _, backend = make()
        response = await client.post("/v1/completions", content=body,
                                     headers={"content-type": "application/json"})
        assert 400 <= response.status_code < 500
        assert response.json()["error"]["message"]
    run(go())


def test_requests_past_the_bound_get_429_with_retry_after():
    async def go():
        client, gateway, backend = make(GatewayConfig(limits={"m": ModelLimits(2)},
                                                      retry_after_s=7))
        held = [asyncio.create_task(client.post("/v1/completions", json=REQUEST))
                for _ in range(2)]
        await until(lambda: gateway.in_flight.count("m") == 2)
        refused = await client.post("/v1/completions", json=REQUEST)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "7"
        backend.release.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        assert gateway.in_flight.count("m") == 0
        again = await client.post("/v1/completions", json=REQUEST)
        assert again.status_code == 200
    run(go())


def test_a_request_past_its_deadline_is_aborted_in_the_engine_and_answered_504():
    async def go():
        client, gateway, backend = make(GatewayConfig(limits={"m": ModelLimits(8, 0.05)}))
        response = await client.post("/v1/completions", json=REQUEST)
        assert response.status_code == 504 and "deadline" in response.json()["error"]["message"]
        assert backend.cancelled == 1 and gateway.in_flight.total == 0
    run(go())


def test_the_timeout_header_overrides_the_models_deadline():
    async def go():
        client, _, backend = make(GatewayConfig(limits={"m": ModelLimits(8, 60.0)}))
        response = await client.post("/v1/completions", json=REQUEST,
                                     headers={"X-Request-Timeout": "0.05"})
        assert response.status_code == 504 and backend.cancelled == 1
        bad = await client.post("/v1/completions", json=REQUEST,
                                headers={"X-Request-Timeout": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Timeout"
    run(go())


def test_a_stream_past_its_deadline_ends_with_an_error_event():
    async def go():
        client, _, backend = make()
        response = await client.post("/v1/completions", json={**REQUEST, "stream": True},
                                     headers={"X-Request-Timeout": "0.1"})
        assert response.status_code == 200  # sent with the first event
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 504
        assert backend.cancelled == 1
    run(go())


def test_drain_refuses_new_requests_and_lets_those_in_flight_finish():
    async def go():
        client, gateway, backend = make(GatewayConfig(retry_after_s=3))
        held = asyncio.create_task(client.post("/v1/completions", json=REQUEST))
        await until(lambda: gateway.in_flight.total == 1)
        drain = asyncio.create_task(gateway.drain(grace_s=30))
        await until(lambda: gateway.draining)
        refused = await client.post("/v1/completions", json=REQUEST)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "3"
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        backend.release.set()
        assert (await held).status_code == 200
        await asyncio.wait_for(drain, 5)
        assert backend.cancelled == 0
    run(go())


def test_drain_aborts_what_outlives_the_grace_with_a_clean_error():
    async def go():
        client, gateway, backend = make()
        plain = asyncio.create_task(client.post("/v1/completions", json=REQUEST))
        stream = asyncio.create_task(client.post("/v1/completions",
                                                 json={**REQUEST, "stream": True}))
        await until(lambda: gateway.in_flight.total == 2)
        await asyncio.wait_for(gateway.drain(grace_s=0.05), 5)
        plain_response, stream_response = await plain, await stream
        assert plain_response.status_code == 503
        assert "shut down" in plain_response.json()["error"]["message"]
        events = [line for line in stream_response.text.splitlines() if line.startswith("data")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 503
        assert backend.cancelled == 2 and gateway.in_flight.total == 0
    run(go())


def test_status_routes_can_require_a_key():
    async def go():
        client, _, _ = make(GatewayConfig(api_keys=("k1", "k2"), open_status_routes=False))
        for path in ("/health", "/metrics"):
            assert (await client.get(path)).status_code == 401
            keyed = await client.get(path, headers={"Authorization": "Bearer k2"})
            assert keyed.status_code == 200
    run(go())
