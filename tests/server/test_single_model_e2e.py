"""`weaver serve MODEL [vLLM flags]` end to end: one real engine, the official client.

Two single-model servers, as a `vllm serve` user would start them:
- a Hugging Face id served offline from a hub cache built here (the `hub_cache` fixture:
  the hub's own layout, HF_HUB_OFFLINE=1), with vLLM flags after it;
- a pooling model (`--runner pooling`), for the embeddings route.
The routes both kinds share with the multi-model server are tested in test_serve_e2e.py.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from weaver.bench.server_process import weaver_server

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory, hub_cache):
    env = {k: v for k, v in hub_cache.items() if k != "repo_id"}
    log = tmp_path_factory.mktemp("hub") / "serve.log"
    with weaver_server(hub_cache["repo_id"], log, "--max-model-len", "512",
                       "--max-num-seqs", "4", env_overrides=env) as running:
        yield running


def test_a_hugging_face_id_serves_offline_with_vllm_flags(hub_server, hub_cache):
    client = openai.OpenAI(base_url=f"{hub_server.base_url}/v1", api_key="none",
                           max_retries=0)
    repo_id = hub_cache["repo_id"]
    # vLLM's default served name is the id itself; --max-model-len reached the engine.
    card = client.models.retrieve(repo_id)
    assert card.id == repo_id and card.model_extra["max_model_len"] == 512
    reply = client.completions.create(model=repo_id, prompt="The river", max_tokens=6,
                                      temperature=0)
    assert reply.usage.completion_tokens == 6
    # The gateway's limits took --max-num-seqs from the flags (weaver serve's /health).
    health = httpx.get(f"{hub_server.base_url}/health", timeout=30).json()
    assert health["models"][repo_id]["status"] == "ok"
    assert health["models"][repo_id]["model_path"].startswith(hub_cache["HF_HUB_CACHE"])


def test_a_request_naming_no_model_goes_to_the_one_served(hub_server):
    tokens = httpx.post(f"{hub_server.base_url}/tokenize", json={"prompt": "The river"},
                        timeout=30)
    assert tokens.status_code == 200 and tokens.json()["count"] >= 2


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory):
    from weaver.models.registry import prepare_model

    model_dir = prepare_model("tiny-llama-a")
    log = tmp_path_factory.mktemp("pooling") / "serve.log"
    with weaver_server(str(model_dir), log, "--runner", "pooling", "--served-model-name",
                       "embedder", "--max-model-len", "256") as running:
        yield running


def test_embeddings_of_a_pooling_model_through_the_official_client(pooling_server):
    client = openai.OpenAI(base_url=f"{pooling_server.base_url}/v1", api_key="none",
                           max_retries=0)
    result = client.embeddings.create(model="embedder", input=["a river", "a volcano"])
    assert [item.index for item in result.data] == [0, 1]
    first, second = (item.embedding for item in result.data)
    assert len(first) == 128 and first != second  # tiny-llama-a's hidden size
    # A route this engine does not serve answers vLLM's own error, not the gateway's.
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="embedder", prompt="x", max_tokens=2)
    assert refused.value.status_code in (400, 404)
    assert "served models" not in str(refused.value)
