"""`weaver serve MODEL [vLLM flags]` end to end: one real engine, the official client.

Two single-model servers, as a `vllm serve` user would start them:
- a Hugging Face id served offline from a hub cache built here (the `hub_cache` fixture:
  the hub's own layout, HF_HUB_OFFLINE=1), with vLLM flags after it;
- a pooling model (`--runner pooling`), for the embeddings route.
The routes both kinds share with the multi-model server are tested in test_serve_e2e.py.
The two servers are independent, so they start and stop at the same time, each engine
pinned to a core of its own (vLLM's default binding would put both on core 0): side by
side they take little longer than one alone, and the stops' waits overlap.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from weaver.bench.server_process import RunningServer, weaver_server

pytestmark = pytest.mark.engine(seconds=80)


class ServerThread:
    """A `weaver_server(...)` block held open by a thread of its own until `stop()`: the
    server is started by that thread (and gets SIGTERM when it ends: popen_dying_with_parent),
    so the thread lives exactly as long as the server should."""

    def __init__(self, *args, **kwargs) -> None:
        self._args, self._kwargs = args, kwargs
        self._ready, self._done = threading.Event(), threading.Event()
        self.server: RunningServer | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with weaver_server(*self._args, **self._kwargs) as running:
                self.server = running
                self._ready.set()
                self._done.wait()
        except BaseException as error:  # handed to the test by wait()
            self.error = error
        finally:
            self._ready.set()

    def wait(self) -> RunningServer:
        self._ready.wait()
        if self.server is None:
            raise RuntimeError("the server did not start") from self.error
        return self.server

    def request_stop(self) -> None:
        self._done.set()

    def stop(self) -> None:
        self.request_stop()
        self._thread.join()
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def servers(tmp_path_factory, hub_cache) -> dict[str, RunningServer]:
    from weaver.models.registry import prepare_model

    hub_env = {k: v for k, v in hub_cache.items() if k != "repo_id"}
    model_dir = prepare_model("tiny-llama-a")
    threads = {
        "hub": ServerThread(hub_cache["repo_id"], tmp_path_factory.mktemp("hub") / "serve.log",
                            "--max-model-len", "512", "--max-num-seqs", "4",
                            env_overrides={**hub_env, "VLLM_CPU_OMP_THREADS_BIND": "0"}),
        "pooling": ServerThread(str(model_dir), tmp_path_factory.mktemp("pooling") / "serve.log",
                                "--runner", "pooling", "--served-model-name", "embedder",
                                "--max-model-len", "256",
                                env_overrides={"VLLM_CPU_OMP_THREADS_BIND": "1"}),
    }
    try:
        yield {name: thread.wait() for name, thread in threads.items()}
    finally:
        for thread in threads.values():
            thread.request_stop()  # both stop at once
        for thread in threads.values():
            thread.stop()


@pytest.fixture(scope="module")
def hub_server(servers) -> RunningServer:
    return servers["hub"]


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
def pooling_server(servers) -> RunningServer:
    return servers["pooling"]


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
