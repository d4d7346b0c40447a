"""What the weaving e2e tests send and read through the gateway (not a test module).

A plain module, imported by name: pytest puts tests/weaving on sys.path."""

from __future__ import annotations

import concurrent.futures as cf
import os

import httpx
import openai

MAX_TOKENS = 24


def make_prompts(num: int) -> list[str]:
    """Mixed lengths, from a few tokens to ~300 (several 64-token prefill chunks)."""
    topics = ["the ocean", "volcanoes", "the moon", "bread", "chess", "rivers", "owls"]
    prompts = []
    for i in range(num):
        topic = topics[i % len(topics)]
        filler = f" Here is more context about {topic}." * ((i * 7) % 40)
        prompts.append(f"Write a short note about {topic}.{filler} Note {i}:")
    return prompts


def own_and_other_core() -> tuple[str, str]:
    """This xdist worker's core (the one tests/conftest.py binds its engines to; the first
    core in a plain run) and another: a module whose engines must run on different cores
    puts its heavy one on the first, so that only its light one shares a core with the
    other worker's engines."""
    cores = [str(core) for core in sorted(os.sched_getaffinity(0))]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    own = cores[int(worker[2:]) % len(cores)]
    return own, next((core for core in cores if core != own), own)


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=600)


def complete_all(client: openai.OpenAI, model: str, prompts: list[str]) -> list[str]:
    """Greedy completions of every prompt, sent at once (MAX_TOKENS each, no early stop)."""
    def one(prompt: str) -> str:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
        return reply.choices[0].text

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def metric(server, name: str) -> float:
    """The sum of every series of the gateway's /metrics whose line starts with `name`."""
    total = 0.0
    for line in httpx.get(f"{server.base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name):
            total += float(line.split()[-1])
    return total
