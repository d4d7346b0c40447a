"""What the weaving e2e tests send and read through the gateway (not a test module).

A plain module, imported by name: pytest puts tests/weaving on sys.path."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading

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


def pool_gauges(server) -> tuple[dict[str, float], dict[str, float], float]:
    """(pages, quota pages) per tenant and the pool's size, from one scrape (empty and 0
    before the owner's first stats)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    pages: dict[str, float] = {}
    quotas: dict[str, float] = {}
    size = 0.0
    for line in text.splitlines():
        if line.startswith(("weaver_kv_pool_pages{", "weaver_kv_pool_quota_pages{")):
            tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
            into = pages if line.startswith("weaver_kv_pool_pages{") else quotas
            into[tenant] = float(line.split()[-1])
        elif line.startswith("weaver_kv_pool_size_pages{"):
            size += float(line.split()[-1])
    return pages, quotas, size


class PoolWatcher:
    """Polls the pool gauges while requests run: the hot tenants' peak share of the pool,
    and each tenant's peak pages and quota."""

    def __init__(self, server, hots: tuple[str, ...]) -> None:
        self.server = server
        self.hots = hots
        self.peak_hot_share = 0.0
        self.peak_pages: dict[str, float] = {}
        self.peak_quota: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PoolWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            pages, quotas, size = pool_gauges(self.server)
            if size:
                self.peak_hot_share = max(self.peak_hot_share,
                                          sum(pages.get(hot, 0.0) for hot in self.hots) / size)
            for peaks, values in ((self.peak_pages, pages), (self.peak_quota, quotas)):
                for tenant, value in values.items():
                    peaks[tenant] = max(peaks.get(tenant, 0.0), value)
