"""`weaver serve` end to end: real vLLM engines, the official OpenAI client.

One server (two SmolLM2 engines) is started for the whole module. The tests run in file
order: the last two kill one engine and then stop the server.
"""

from __future__ import annotations

import signal
import time

import httpx
import openai
import psutil
import pytest

from weaver.server.process import weaver_server

pytestmark = pytest.mark.engine

API_KEY = "test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODELS = ("smollm2-hot", "smollm2-cold")
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("serve")
    config = root / "deployment.yaml"
    config.write_text("models:\n" + "".join(
        f"  - name: {name}\n    model: {smollm2_dir}\n    kv_cache_gib: 0.25\n"
        f"    max_model_len: {MAX_MODEL_LEN}\n"
        for name in MODELS
    ))
    with weaver_server(config, root / "serve.log", "--api-key", API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def test_lists_every_model(client):
    assert sorted(m.id for m in client.models.list().data) == sorted(MODELS)


@pytest.mark.parametrize("model", MODELS)
def test_chat_answers_paris(client, model):
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24,
                                           temperature=0)
    assert reply.model == model
    assert "Paris" in reply.choices[0].message.content


def test_completion_counts_tokens(client):
    reply = client.completions.create(model="smollm2-hot", prompt="Once upon a time",
                                      max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 12
    assert reply.choices[0].text.strip()


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model="smollm2-cold", messages=QUESTION, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 3
    assert "".join(pieces) == whole


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert "no-such-model" in str(info.value)


def test_missing_field_is_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2-hot", messages=None)  # type: ignore[arg-type]


def test_malformed_json_is_400(server):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=b'{"model": ',
                          headers={"Authorization": f"Bearer {API_KEY}",
                                   "content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"


def test_prompt_longer_than_max_model_len_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2-hot", prompt="hello " * (MAX_MODEL_LEN + 10),
                                  max_tokens=4)
    assert "maximum context length" in str(info.value)


def test_wrong_api_key_is_401(server):
    wrong = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_metrics_are_labelled_by_model(server, client):
    client.completions.create(model="smollm2-hot", prompt="Hi", max_tokens=2)
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'model="smollm2-hot"' in text and 'weaver_engine_up{model="smollm2-cold"} 1.0' in text
    assert "vllm:" in text  # vLLM's own per-engine series come along


def test_server_stays_up_after_errors(client):
    reply = client.chat.completions.create(model="smollm2-hot", messages=QUESTION, max_tokens=24,
                                           temperature=0)
    assert "Paris" in reply.choices[0].message.content


def test_killing_one_engine_leaves_the_other_serving(server, client):
    victim_pids = server.health().json()["models"]["smollm2-cold"]["engine_pids"]
    assert victim_pids
    for pid in victim_pids:
        psutil.Process(pid).kill()
    deadline = time.monotonic() + 60
    while server.health().json()["models"]["smollm2-cold"]["status"] != "dead":
        assert time.monotonic() < deadline, "the gateway never noticed the dead engine"
        time.sleep(0.5)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="smollm2-cold", messages=QUESTION, max_tokens=4)
    assert info.value.status_code == 503
    reply = client.chat.completions.create(model="smollm2-hot", messages=QUESTION, max_tokens=24,
                                           temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert server.health().status_code == 503  # degraded, and says so


def test_sigterm_leaves_no_child_process(server):
    children = server.descendants()
    assert children, "the server should have engine processes to stop"
    assert server.stop(signal.SIGTERM) == 0
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"orphaned processes: {[p.pid for p in alive]}"
