"""Weaving through the cold device's unified KV pool (issue 6), end to end on real vLLM
engines through the OpenAI endpoint.

`cold` (tiny-llama-c: 4 layers, 4 KV heads of 128) keeps its own KV cache and the memory it
lends in one pool of 32 KiB pages (one of its head-blocks at block size 32). `hot` (SmolLM2:
30 layers, 3 KV heads of 64, block size 64 so that its head-blocks fill the same pages)
weaves half its sequences into it: their blocks are leased from the pool's allocator in the
cold engine's scheduler, their K/V written into pool pages, their decode attention run by
the cold worker over those pages. `ref` and `cold-ref` are the same models dedicated. The
SmolLM2 engines have the same capped local KV (8 usable blocks of 64 tokens) and a 64-token
prefill chunk, so long prompts span several chunks.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
from pathlib import Path

import httpx
import openai
import pytest

from weaver.server.process import weaver_server

pytestmark = pytest.mark.engine

NUM_PROMPTS = 24
MAX_TOKENS = 24
SMOLLM2_ENGINE = """
    model: {smollm2}
    kv_cache_gib: 0.25
    max_model_len: 512
    block_size: 64
    num_gpu_blocks_override: 9
    max_num_seqs: 32
    cpu_cores: '0'
    extra_engine_args: {{max_num_batched_tokens: 64}}"""
TINY_ENGINE = """
    model: {tiny}
    max_model_len: 512
    block_size: 32
    cpu_cores: '1'"""

DEPLOYMENT = """
models:
  - name: ref
    role: dedicated{smollm2}
  - name: hot
    role: hot{smollm2}
  - name: cold-ref
    role: dedicated{tiny}
    kv_cache_gib: 0.05
  - name: cold
    role: cold{tiny}
    kv_cache_gib: 0.05
    lend_kv_gib: 0.2
    unified_kv: true
weaving:
  - {{hot: hot, cold: [cold], offload_ratio: 0.5, timeout_s: 5.0}}
"""


def make_prompts(num: int) -> list[str]:
    topics = ["the ocean", "volcanoes", "the moon", "bread", "chess", "rivers", "owls"]
    prompts = []
    for i in range(num):
        topic = topics[i % len(topics)]
        filler = f" Here is more context about {topic}." * ((i * 7) % 40)
        prompts.append(f"Write a short note about {topic}.{filler} Note {i}:")
    return prompts


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    from weaver.models.registry import prepare_model

    tiny = prepare_model("tiny-llama-c")
    root = tmp_path_factory.mktemp("unified-pool")
    config = root / "deployment.yaml"
    config.write_text(DEPLOYMENT.format(smollm2=SMOLLM2_ENGINE.format(smollm2=smollm2_dir),
                                        tiny=TINY_ENGINE.format(tiny=tiny)))
    with weaver_server(config, root / "serve.log") as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=600)


def complete_all(client: openai.OpenAI, model: str, prompts: list[str]) -> list[str]:
    def one(prompt: str) -> str:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
        return reply.choices[0].text

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def metric(server, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{server.base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name):
            total += float(line.split()[-1])
    return total


def test_hot_weaving_through_the_pool_is_token_exact(server, client):
    prompts = make_prompts(NUM_PROMPTS)
    reference = complete_all(client, "ref", prompts)
    assert complete_all(client, "hot", prompts) == reference
    assert metric(server, 'weaver_offload_sequences_total{model="hot"}') >= NUM_PROMPTS // 2
    assert metric(server, 'weaver_offload_tasks_total{cold="cold",hot="hot"}') > 0
    assert metric(server, 'weaver_offload_fallbacks_total{model="hot"}') == 0


def test_cold_model_on_the_pool_is_token_exact_while_hot_weaves(server, client):
    prompts = make_prompts(8)
    reference = complete_all(client, "cold-ref", prompts)
    with cf.ThreadPoolExecutor(2) as pool:
        hot = pool.submit(complete_all, client, "hot", make_prompts(NUM_PROMPTS))
        cold = pool.submit(complete_all, client, "cold", prompts)
        assert cold.result(timeout=600) == reference
        hot.result(timeout=600)


def test_no_shared_memory_left_after_sigterm(server):
    prefix = f"weaver{server.process.pid}-"
    assert server.stop(signal.SIGTERM) == 0
    leftovers = [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)]
    assert leftovers == []
