"""The gateway's own routing and errors, against in-process ASGI backends.

The backends here are tiny ASGI apps standing in for vLLM's (named as such): they echo
what reached them, so the tests see exactly what the gateway forwards. The real engines
are exercised end to end in test_serve_e2e.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from weaver.server.gateway import Gateway, GatewayConfig
from weaver.server.metrics import GatewayMetrics


class EchoBackend:
    """Stand-in for one model's vLLM app: answers 200 with the body it received."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dead = False
        self.calls = 0

    @property
    def is_dead(self) -> bool:
        return self.dead

    is_recovering = False

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("dead")

    def scheduler_stats(self) -> dict:
        return {"num_running": 2, "peak_running": 5}

    def describe(self) -> dict:
        return {"model_path": f"/models/{self.name}", "max_model_len": 128}

    async def app(self, scope, receive, send) -> None:
        self.calls += 1
        message = await receive()
        body = json.dumps({"served_by": self.name, "path": scope["path"],
                           "echo": json.loads(message["body"])}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def make_client(api_keys: tuple[str, ...] = ()) -> tuple[httpx.AsyncClient, dict]:
    backends = {"a": EchoBackend("a"), "b": EchoBackend("b")}
    gateway = Gateway(backends, GatewayConfig(api_keys=api_keys), GatewayMetrics())
    transport = httpx.ASGITransport(app=gateway)
    return httpx.AsyncClient(transport=transport, base_url="http://gw"), backends


def run(coro):
    return asyncio.run(coro)


def test_routes_on_model_field_and_forwards_body_unchanged():
    async def go():
        client, backends = make_client()
        payload = {"model": "b", "prompt": "hi", "max_tokens": 3}
        response = await client.post("/v1/completions", json=payload)
        assert response.status_code == 200
        assert response.json() == {"served_by": "b", "path": "/v1/completions", "echo": payload}
        assert (backends["a"].calls, backends["b"].calls) == (0, 1)
    run(go())


def test_models_lists_every_model():
    async def go():
        client, _ = make_client()
        data = (await client.get("/v1/models")).json()
        assert [m["id"] for m in data["data"]] == ["a", "b"]
        assert data["data"][0]["max_model_len"] == 128
    run(go())


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"model": "zzz", "prompt": "x"}', 404, "model"),
        (b"{not json", 400, None),
        (b'{"prompt": "x"}', 400, "model"),
        (b"[1, 2]", 400, "model"),
    ],
)
def test_gateway_errors_are_openai_shaped(body, status, param):
    async def go():
        client, backends = make_client()
        response = await client.post("/v1/completions", content=body,
                                     headers={"content-type": "application/json"})
        assert response.status_code == status
        error = response.json()["error"]
        assert error["code"] == status and error["param"] == param and error["message"]
        assert backends["a"].calls == backends["b"].calls == 0
    run(go())


def test_dead_engine_answers_503_and_others_serve():
    async def go():
        client, backends = make_client()
        backends["a"].dead = True
        dead = await client.post("/v1/completions", json={"model": "a", "prompt": "x"})
        alive = await client.post("/v1/completions", json={"model": "b", "prompt": "x"})
        health = await client.get("/health")
        assert dead.status_code == 503 and dead.json()["error"]["type"] == "ServiceUnavailableError"
        assert alive.status_code == 200
        assert health.status_code == 503
        assert health.json()["models"]["a"]["status"] == "dead"
        assert health.json()["models"]["b"]["status"] == "ok"
    run(go())


def test_api_key_guards_every_route_but_the_open_status_routes():
    async def go():
        client, _ = make_client(api_keys=("sekrit",))
        no_key = await client.get("/v1/models")
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        right = await client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        health = await client.get("/health")
        tokenize = await client.post("/tokenize", json={"model": "a", "prompt": "x"})
        assert (no_key.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
        assert no_key.json()["error"]["type"] == "AuthenticationError"
        assert health.status_code == 200 and tokenize.status_code == 401
    run(go())


def test_metrics_count_requests_by_model():
    async def go():
        client, _ = make_client()
        for _ in range(3):
            await client.post("/v1/completions", json={"model": "a", "prompt": "x"})
        await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        text = (await client.get("/metrics")).text
        series = 'weaver_requests_total{endpoint="/v1/completions",model="a",status="200"}'
        assert f"{series} 3.0" in text
        assert 'weaver_rejected_requests_total{reason="unknown_model"} 1.0' in text
        assert 'weaver_engine_up{model="b"} 1.0' in text
        assert 'weaver_peak_running{model="a"} 5.0' in text
    run(go())


def test_unknown_route_is_404():
    async def go():
        client, _ = make_client()
        response = await client.get("/v2/whatever")
        assert response.status_code == 404
    run(go())


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/responses",
                                  "/v1/embeddings", "/pooling"])
def test_every_post_route_is_forwarded_to_the_model_it_names(path):
    async def go():
        client, backends = make_client()
        payload = {"model": "a", "prompt": "hi"}
        response = await client.post(path, json=payload)
        assert response.json() == {"served_by": "a", "path": path, "echo": payload}
        assert (backends["a"].calls, backends["b"].calls) == (1, 0)
    run(go())


def test_one_model_served_takes_requests_that_name_none():
    async def go():
        gateway = Gateway({"only": EchoBackend("only")}, GatewayConfig(), GatewayMetrics())
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway),
                                   base_url="http://gw")
        response = await client.post("/tokenize", json={"prompt": "hi"})
        assert response.status_code == 200 and response.json()["served_by"] == "only"
        # The body goes on as it came: vLLM's app applies its own default model.
        assert response.json()["echo"] == {"prompt": "hi"}
    run(go())


def test_model_card_by_id_including_a_hugging_face_id():
    async def go():
        backends = {"org/name": EchoBackend("org/name"), "b": EchoBackend("b")}
        gateway = Gateway(backends, GatewayConfig(), GatewayMetrics())
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway),
                                   base_url="http://gw")
        card = await client.get("/v1/models/org/name")
        missing = await client.get("/v1/models/zzz")
        assert card.status_code == 200
        assert card.json()["id"] == "org/name" and card.json()["max_model_len"] == 128
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    run(go())


class ResponsesBackend(EchoBackend):
    """Stand-in for a vLLM app that stores the responses it created: knows `ids`, answers
    vLLM-style 404 for any other."""

    def __init__(self, name: str, ids: set[str]) -> None:
        super().__init__(name)
        self.ids = ids

    async def app(self, scope, receive, send) -> None:
        self.calls += 1
        await receive()
        response_id = scope["path"].removeprefix("/v1/responses/").split("/")[0]
        status = 200 if response_id in self.ids else 404
        body = json.dumps({"id": response_id, "served_by": self.name} if status == 200
                          else {"error": {"message": "not found", "code": 404}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def test_a_stored_response_is_found_on_the_engine_that_made_it():
    async def go():
        backends = {"a": ResponsesBackend("a", {"resp_1"}),
                    "b": ResponsesBackend("b", {"resp_2"})}
        gateway = Gateway(backends, GatewayConfig(), GatewayMetrics())
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway),
                                   base_url="http://gw")
        first = await client.get("/v1/responses/resp_1")
        second = await client.post("/v1/responses/resp_2/cancel")
        unknown = await client.get("/v1/responses/resp_9")
        assert first.json() == {"id": "resp_1", "served_by": "a"}
        assert second.json() == {"id": "resp_2", "served_by": "b"}
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == 404
        backends["a"].dead = True
        assert (await client.get("/v1/responses/resp_2")).json()["served_by"] == "b"
    run(go())


def test_made_up_paths_do_not_grow_the_endpoint_labels():
    async def go():
        client, _ = make_client()
        await client.post("/v1/completions", json={"model": "a", "prompt": "x"})
        for index in range(3):
            await client.post(f"/made-up-{index}", json={"model": "nope"})
        text = (await client.get("/metrics")).text
        assert 'endpoint="/v1/completions"' in text and "made-up" not in text
    run(go())
