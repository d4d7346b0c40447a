"""A phase-split model end to end: real vLLM engines, real KV moved between them, the
official OpenAI client, engines killed under requests.

One server hosts `ref` (SmolLM2, dedicated) and `chat`, the same model split Splitwise-style
over two prompt engines (`p0`, `p1`) and one token engine (`d0`), each a real vLLM engine
with Weaver's KV connector (weaver/vllm_ext/kv_connector.py). Blocks of 32 tokens and a
prefill chunk of 64 make long prompts stage their KV over several steps. Tests run in file
order; the last ones kill a prompt engine mid-prefill and the token engine mid-stream
(each restarted by the gateway's supervisor).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from weaver.bench.prom_histogram import read_counter, read_histogram
from weaver.bench.server_process import weaver_server

pytestmark = pytest.mark.engine(seconds=295)

ENGINE = """
    model: {smollm2}
    kv_cache_gib: 0.25
    max_model_len: 512
    block_size: 32
    max_num_seqs: 16
    extra_engine_args: {{max_num_batched_tokens: 64}}"""
DEPLOYMENT = """
models:
  - name: ref{engine}
  - name: p0{engine}
  - name: p1{engine}
  - name: d0{engine}
phase_split:
  - {{model: chat, prefill: [p0, p1], decode: [d0]}}
"""
MAX_TOKENS = 24
QUESTION = [{"role": "user", "content": "Name three rivers of Europe and say where each "
             "one flows."}]


def make_prompts(num: int) -> list[str]:
    """A few tokens to ~300 (several blocks and prefill chunks)."""
    topics = ["the ocean", "volcanoes", "the moon", "bread", "chess", "rivers", "owls"]
    return [f"Write a short note about {topics[i % 7]}."
            + f" Here is more context about {topics[i % 7]}." * ((i * 7) % 40) + f" Note {i}:"
            for i in range(num)]


PROMPTS = make_prompts(8)


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("phase_split")
    config = root / "deployment.yaml"
    config.write_text(DEPLOYMENT.format(engine=ENGINE.format(smollm2=smollm2_dir)))
    with weaver_server(config, root / "serve.log") as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=600)


def complete(client: openai.OpenAI, model: str, prompt: str, **kwargs) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body={"ignore_eos": True}, **kwargs)


def complete_all(client: openai.OpenAI, model: str, prompts: list[str]) -> list[str]:
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return [r.choices[0].text
                for r in pool.map(lambda p: complete(client, model, p), prompts)]


def counter(server, name: str, **labels: str) -> float:
    """The gateway's counter `name` (no `_total`) over the series with these labels; 0
    before any was counted."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return read_counter(text, name, labels) or 0.0


@pytest.fixture(scope="module")
def reference(client) -> dict:
    # All at once (one after another took ~20 s more): greedy tokens do not depend on the
    # batch, as test_concurrent_requests_spread_over_both_prompt_engines relies on too.
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda prompt: complete(client, "ref", prompt), PROMPTS))
    chat = client.chat.completions.create(model="ref", messages=QUESTION,
                                          max_tokens=MAX_TOKENS, temperature=0)
    return {"texts": [r.choices[0].text for r in replies],
            "prompt_tokens": [r.usage.prompt_tokens for r in replies],
            "chat": chat.choices[0].message.content, "chat_prompt_tokens": chat.usage.prompt_tokens}


def test_clients_see_the_model_not_its_engines(client):
    assert sorted(m.id for m in client.models.list().data) == ["chat", "ref"]
    with pytest.raises(openai.NotFoundError):
        complete(client, "p0", "hello")


def test_completions_are_token_exact_and_the_prompt_kv_is_moved_not_recomputed(
        server, client, reference):
    transfers = counter(server, "weaver_phase_split_kv_transfers")
    tokens = counter(server, "weaver_phase_split_kv_transferred_tokens")
    replies = [complete(client, "chat", prompt) for prompt in PROMPTS]
    assert [r.choices[0].text for r in replies] == reference["texts"]
    assert [r.model for r in replies] == ["chat"] * len(PROMPTS)
    # Every prompt's KV but its last token's came from a prompt engine.
    assert counter(server, "weaver_phase_split_kv_transfers") - transfers == len(PROMPTS)
    moved = counter(server, "weaver_phase_split_kv_transferred_tokens") - tokens
    assert moved == sum(n - 1 for n in reference["prompt_tokens"])
    assert counter(server, "weaver_phase_split_kv_recomputed") == 0
    loads = read_histogram(httpx.get(f"{server.base_url}/metrics", timeout=30).text,
                           "weaver_phase_split_kv_load_seconds")
    assert loads is not None and loads.count >= len(PROMPTS)


def test_streamed_and_chat_answers_are_token_exact(client, reference):
    stream = complete(client, "chat", PROMPTS[5], stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference["texts"][5]
    chat = client.chat.completions.create(model="chat", messages=QUESTION,
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == reference["chat"]
    assert chat.usage.prompt_tokens == reference["chat_prompt_tokens"]
    streamed = client.chat.completions.create(model="chat", messages=QUESTION, stream=True,
                                              max_tokens=MAX_TOKENS, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in streamed
                   if c.choices) == reference["chat"]


def test_concurrent_requests_spread_over_both_prompt_engines(server, client, reference):
    assert complete_all(client, "chat", PROMPTS) == reference["texts"]
    for engine in ("p0", "p1"):
        routed = counter(server, "weaver_phase_split_routed", engine=engine)
        assert routed >= 2, f"{engine} got {routed} prefills"


def engine_pid(server, phase: str, engine: str) -> int:
    described = server.health().json()["models"]["chat"][phase][engine]
    return described["engine_pids"][0]


def wait_back(server, phase: str, engine: str, restarts: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        described = server.health().json()["models"]["chat"][phase][engine]
        if described["status"] == "ok" and described["restarts"] == restarts:
            return
        assert time.monotonic() < deadline, f"{engine} not back: {described}"
        time.sleep(1)


def test_a_prompt_engine_killed_mid_prefill_hands_its_requests_to_the_other(
        server, client, reference):
    long_prompts = make_prompts(40)[33:]  # ~230-280 tokens each: several prefill steps
    expected = complete_all(client, "ref", long_prompts)
    victim = engine_pid(server, "prefill", "p0")
    before = counter(server, "weaver_phase_split_routed", engine="p0")
    with cf.ThreadPoolExecutor(1) as pool:
        answers = pool.submit(complete_all, client, "chat", long_prompts)
        deadline = time.monotonic() + 30
        # Until p0 is prefilling two of them.
        while counter(server, "weaver_phase_split_routed", engine="p0") < before + 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        assert answers.result(timeout=300) == expected
    assert counter(server, "weaver_phase_split_reruns", model="chat", phase="prefill") >= 1
    # p0 comes back while the next test runs (on p1 meanwhile).


def test_a_token_engine_killed_mid_stream_reruns_and_the_stream_is_exact(server, client):
    prompt, max_tokens = "In a small village by the sea, ", 96
    kwargs = dict(prompt=prompt, max_tokens=max_tokens, temperature=0,
                  extra_body={"ignore_eos": True})
    expected = client.completions.create(model="ref", **kwargs).choices[0].text
    victim = engine_pid(server, "decode", "d0")
    pieces = []
    for chunk in client.completions.create(model="chat", stream=True, **kwargs):
        pieces.extend(c.text for c in chunk.choices)
        if len(pieces) == 10:
            os.kill(victim, signal.SIGKILL)
    assert "".join(pieces) == expected
    assert counter(server, "weaver_phase_split_reruns", model="chat", phase="decode") == 1
    wait_back(server, "decode", "d0", restarts=1)


def test_after_the_kills_it_serves_exactly_and_no_staged_kv_is_left(server, client, reference):
    wait_back(server, "prefill", "p0", restarts=1)
    assert complete_all(client, "chat", PROMPTS[:4]) == reference["texts"][:4]
    pid = server.process.pid
    assert not list(Path("/dev/shm").glob(f"wvkv_{pid}_*"))
