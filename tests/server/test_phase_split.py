"""The phase-split router (weaver/server/phase_split.py) against in-process ASGI engines.

`FakeEngine` stands in for one vLLM engine's OpenAI app (named as such): it records the
bodies it gets, answers a prefill (max_tokens 1) by staging a real KV segment as the KV
connector would, a decode by counting the segment's KV as loaded, and can die under a
request the way vLLM's app does (500, or an error event mid-stream, with the engine's dead
flag set). Real engines, real KV and real kills: tests/server/test_phase_split_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from weaver.config.deployment import PhaseSplitSpec
from weaver.kv.staging import (
    W_LOAD_NS,
    W_LOADED_TOKENS,
    W_NUM_LOADS,
    W_SAVE_NS,
    W_SAVED_TOKENS,
    StagingSegment,
    segment_path,
)
from weaver.server.gateway import Gateway, GatewayConfig
from weaver.server.metrics import GatewayMetrics
from weaver.server.phase_split import (
    LOAD_KEY,
    MAX_RUNS,
    SAVE_KEY,
    PhaseSplitMetrics,
    PhaseSplitModel,
    segment_prefix,
)

PROMPT_TOKENS = 10


class FakeEngine:
    """Stand-in for one phase-split engine's vLLM app (see the module docstring)."""

    def __init__(self, name: str, kv_usage: float = 0.0) -> None:
        self.name = name
        self.dead = False
        self.recovering = False
        self.kv_usage = kv_usage
        self.bodies: list[dict] = []
        self.die_on_prefill = 0  # how many prefills die
        self.die_after_events = 0  # decodes: die after this many events (0: never)
        self.status = 200
        self.hold: asyncio.Event | None = None  # a prefill waits for it
        self.restarts = False  # a death leaves it recovering, as under the supervisor

    @property
    def is_dead(self) -> bool:
        return self.dead

    @property
    def is_recovering(self) -> bool:
        return self.recovering

    async def check_health(self) -> None:
        pass

    def scheduler_stats(self) -> dict:
        return {"kv_cache_usage": self.kv_usage, "num_running": 1}

    def describe(self) -> dict:
        return {"model_path": "/models/m", "max_model_len": 64}

    async def app(self, scope, receive, send) -> None:
        body = json.loads((await receive())["body"])
        self.bodies.append(body)
        params = body.get("kv_transfer_params") or {}
        if self.status != 200:
            await _json(send, self.status, {"error": {"message": "bad request"}})
        elif SAVE_KEY in params:
            await self._prefill(params[SAVE_KEY], send)
        elif LOAD_KEY in params:
            await self._decode(body, params[LOAD_KEY], send)
        else:
            await _json(send, 200, {"path": scope["path"], "served_by": self.name})

    async def _prefill(self, segment: str, send) -> None:
        if self.hold is not None:
            await self.hold.wait()
        staged = StagingSegment.create(segment, 2, 1, 64, 16, PROMPT_TOKENS, 7)
        if self.die_on_prefill:  # half-way through staging
            staged.write(W_SAVED_TOKENS, PROMPT_TOKENS // 2)
            staged.close()
            self.die_on_prefill -= 1
            self.dead = True
            await _json(send, 500, {"error": {"message": "EngineCore died"}})
            return
        staged.write(W_SAVED_TOKENS, PROMPT_TOKENS)
        staged.write(W_SAVE_NS, 3_000_000)
        staged.close()
        await _json(send, 200, {"choices": [{"text": "x"}]})

    async def _decode(self, body: dict, segment: str, send) -> None:
        staged = StagingSegment.open(segment)
        staged.write(W_LOADED_TOKENS, PROMPT_TOKENS - 1)
        staged.write(W_LOAD_NS, 1_000_000)
        staged.add(W_NUM_LOADS, 1)
        staged.close()
        count = body.get("max_tokens", 4)
        if not body.get("stream"):
            if self.die_after_events:
                self.dead, self.recovering = True, self.restarts
                await _json(send, 500, {"error": {"message": "EngineDeadError"}})
                return
            await _json(send, 200, {"choices": [{"text": "t" * count}], "by": self.name})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(count):
            if self.die_after_events and i == self.die_after_events:
                self.dead = True
                await _event(send, b'{"error": {"message": "EngineDeadError", "code": 500}}')
                await _event(send, b"[DONE]", more=False)
                return
            await _event(send, json.dumps({"i": i, "by": self.name}).encode())
        await _event(send, b"[DONE]", more=False)


async def _json(send, status: int, payload: dict) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


async def _event(send, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n",
                "more_body": more})


def make_split(num_prompt: int = 1, num_token: int = 1):
    engines = {f"p{i}": FakeEngine(f"p{i}") for i in range(num_prompt)}
    engines.update({f"d{i}": FakeEngine(f"d{i}") for i in range(num_token)})
    spec = PhaseSplitSpec(model="m", prefill=[n for n in engines if n[0] == "p"],
                          decode=[n for n in engines if n[0] == "d"])
    registry = CollectorRegistry()
    model = PhaseSplitModel(spec, engines, PhaseSplitMetrics(registry), retry_after_s=7,
                            recovery_wait_s=5.0)
    metrics = GatewayMetrics()
    gateway = Gateway({"m": model}, GatewayConfig(), metrics)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw")
    return client, engines, model, registry


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, {"model": "m", **labels}) or 0.0


def run(coro):
    return asyncio.run(coro)


def test_prefill_gets_one_token_and_the_decode_the_request_with_the_same_segment():
    async def go():
        client, engines, _, registry = make_split()
        request = {"model": "m", "prompt": "hi", "max_tokens": 5, "n": 1, "min_tokens": 2,
                   "stream_options": {"include_usage": True}}
        response = await client.post("/v1/completions", json=request)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == "ttttt"
        prefill, = engines["p0"].bodies
        decode, = engines["d0"].bodies
        segment = prefill["kv_transfer_params"][SAVE_KEY]
        assert prefill == {"model": "m", "prompt": "hi", "max_tokens": 1,
                           "kv_transfer_params": {SAVE_KEY: segment}}
        assert decode == {**request, "kv_transfer_params": {LOAD_KEY: segment}}
        assert not (await asyncio.to_thread(_exists, segment)), "segment left behind"
        assert sample(registry, "weaver_phase_split_kv_transfers_total") == 1
        assert sample(registry, "weaver_phase_split_kv_transferred_tokens_total") == 9
        assert sample(registry, "weaver_phase_split_kv_save_seconds_sum") == pytest.approx(0.003)
        assert sample(registry, "weaver_phase_split_kv_load_seconds_sum") == pytest.approx(0.001)
    run(go())


def _exists(segment: str) -> bool:
    import os

    return os.path.exists(segment_path(segment))


def test_stream_is_relayed_whole():
    async def go():
        client, _, _, _ = make_split()
        response = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [], "max_tokens": 3, "stream": True})
        assert response.status_code == 200
        assert response.text == "".join(
            f'data: {{"i": {i}, "by": "d0"}}\n\n' for i in range(3)) + "data: [DONE]\n\n"
    run(go())


def test_prompt_goes_to_the_shortest_queue_and_decode_to_the_least_kv_used():
    async def go():
        client, engines, model, registry = make_split(num_prompt=2, num_token=2)
        engines["d0"].kv_usage, engines["d1"].kv_usage = 0.6, 0.1
        engines["p0"].hold = asyncio.Event()  # p0 busy with a long prompt
        long_one = asyncio.create_task(client.post("/v1/completions", json={
            "model": "m", "prompt": "x" * 4000, "max_tokens": 2}))
        while not engines["p0"].bodies:
            await asyncio.sleep(0.01)
        assert model.queued_prompt_tokens["p0"] == 1000
        short = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert short.status_code == 200
        assert [len(engines[n].bodies) for n in ("p0", "p1", "d0", "d1")] == [1, 1, 0, 1]
        engines["p0"].hold.set()
        assert (await long_one).status_code == 200
        assert model.queued_prompt_tokens["p0"] == 0
        assert sample(registry, "weaver_phase_split_routed_total", engine="p1",
                      phase="prefill") == 1
    run(go())


def test_a_prompt_engine_that_dies_sends_the_request_to_another():
    async def go():
        client, engines, _, registry = make_split(num_prompt=2)
        engines["p0"].die_on_prefill = 1
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "a",
                                                              "max_tokens": 2})
        assert response.status_code == 200
        assert [len(engines[n].bodies) for n in ("p0", "p1", "d0")] == [1, 1, 1]
        assert sample(registry, "weaver_phase_split_reruns_total", phase="prefill") == 1
        # The dead engine's half-staged segment is removed, and counts as no decode at all.
        assert sample(registry, "weaver_phase_split_kv_transfers_total") == 1
        assert sample(registry, "weaver_phase_split_kv_recomputed_total") == 0
        assert not list(Path("/dev/shm").glob(f"{segment_prefix()}*"))
    run(go())


def test_no_prompt_engine_left_is_a_clean_503_with_retry_after():
    async def go():
        client, engines, _, _ = make_split()
        engines["p0"].die_on_prefill = 1
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "a"})
        assert response.status_code == 503
        assert response.headers["retry-after"] == "7"
        assert "no prompt engine" in response.json()["error"]["message"]
        assert engines["d0"].bodies == []
    run(go())


def test_a_token_engine_that_dies_mid_stream_reruns_and_the_stream_goes_on():
    async def go():
        client, engines, _, registry = make_split(num_token=2)
        engines["d0"].die_after_events = 2
        engines["d1"].kv_usage = 0.5  # d0 first
        response = await client.post("/v1/completions", json={
            "model": "m", "prompt": "a", "max_tokens": 5, "stream": True})
        assert response.status_code == 200
        events = response.text.split("\n\n")[:-1]
        assert events == ['data: {"i": 0, "by": "d0"}', 'data: {"i": 1, "by": "d0"}',
                          'data: {"i": 2, "by": "d1"}', 'data: {"i": 3, "by": "d1"}',
                          'data: {"i": 4, "by": "d1"}', "data: [DONE]"]
        assert len(engines["p0"].bodies) == 2, "the re-run prefills again"
        assert sample(registry, "weaver_phase_split_reruns_total", phase="decode") == 1
    run(go())


def test_a_token_engine_that_dies_before_answering_reruns_once_it_is_back():
    async def go():
        client, engines, _, registry = make_split()
        d0 = engines["d0"]
        d0.die_after_events, d0.restarts = 1, True
        call = asyncio.create_task(client.post("/v1/completions", json={
            "model": "m", "prompt": "a", "max_tokens": 3}))
        while not d0.dead:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the re-run waits for the restart
        d0.dead, d0.recovering, d0.die_after_events = False, False, 0
        response = await call
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == "ttt"
        assert sample(registry, "weaver_phase_split_reruns_total", phase="decode") == 1
    run(go())


def test_the_requests_own_error_is_passed_on_and_nothing_decodes():
    async def go():
        client, engines, _, _ = make_split()
        engines["p0"].status = 400
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "a"})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "bad request"
        assert engines["d0"].bodies == []
    run(go())


def test_engines_that_keep_dying_end_in_a_503_after_max_runs():
    async def go():
        client, engines, _, registry = make_split(num_prompt=MAX_RUNS + 1)
        for name, engine in engines.items():
            engine.die_on_prefill = int(name.startswith("p"))
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "a"})
        assert response.status_code == 503
        assert f"{MAX_RUNS} times" in response.json()["error"]["message"]
        assert sample(registry, "weaver_phase_split_reruns_total", phase="prefill") == MAX_RUNS
    run(go())


def test_other_routes_go_whole_to_a_token_engine():
    async def go():
        client, engines, _, _ = make_split()
        response = await client.post("/tokenize", json={"model": "m", "prompt": "a"})
        assert response.json() == {"path": "/tokenize", "served_by": "d0"}
        assert engines["p0"].bodies == []
    run(go())


def test_the_model_is_down_only_when_a_whole_phase_is():
    _, engines, model, _ = make_split(num_prompt=2)
    engines["p0"].dead = True
    assert not model.is_dead
    engines["p1"].dead = engines["p1"].recovering = True
    assert model.is_dead and model.is_recovering
    described = model.describe()
    assert described["prefill"]["p0"]["status"] == "dead"
    assert described["prefill"]["p1"]["status"] == "restarting"
    assert described["decode"]["d0"]["status"] == "ok"


def test_each_engine_gets_the_connector_of_its_phase_and_answers_to_the_models_name(tmp_path):
    from weaver.config.deployment import parse_deployment
    from weaver.server.features import engine_configs, serve_features
    from weaver.vllm_ext.engine.app import engine_cli_args

    deployment = parse_deployment({
        "models": [{"name": n, "model": "smollm2"} for n in ("p0", "d0", "ref")],
        "phase_split": [{"model": "chat", "prefill": ["p0"], "decode": ["d0"]}]})
    configs = engine_configs(deployment, serve_features(deployment, {}, {}))
    for name, role in (("p0", "kv_producer"), ("d0", "kv_consumer")):
        args = engine_cli_args(deployment.model(name), tmp_path, configs[name])
        assert args[args.index("--served-model-name") + 1] == "chat"
        connector = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert connector == {"kv_connector": "WeaverStagingConnector", "kv_role": role,
                             "kv_connector_module_path": "weaver.vllm_ext.kv_connector"}
    assert "--kv-transfer-config" not in engine_cli_args(deployment.model("ref"), tmp_path,
                                                         configs["ref"])


def test_the_gateway_routes_the_split_model_and_hides_its_engines():
    from weaver.config.deployment import parse_deployment
    from weaver.server.app import ServeSettings, gateway_backends, gateway_config

    deployment = parse_deployment({
        "models": [{"name": n, "model": "smollm2", "max_num_seqs": 8} for n in ("p0", "d0",
                                                                             "d1", "ref")],
        "phase_split": [{"model": "chat", "prefill": ["p0"], "decode": ["d0", "d1"]}]})
    settings = ServeSettings(deployment)
    backends = gateway_backends(settings, {n: FakeEngine(n) for n in ("p0", "d0", "d1", "ref")})
    assert sorted(backends) == ["chat", "ref"]
    assert isinstance(backends["chat"], PhaseSplitModel)
    # Its bound: the token engines' batches and waiting room together.
    assert gateway_config(settings).limits["chat"].max_in_flight == 2 * (8 + 256)
