"""A real vLLM engine keeps its KV cache in the unified pool: weaver/vllm_ext/block_pool.py,
attention/pool.py and attention/headwise.py together.

tiny-llama-a runs twice under the same memory, 3 KV blocks for 8 prompts, so vLLM must
queue, preempt and recompute: once plain (num_gpu_blocks_override), once with its blocks
allocated through the pool's allocator (a pool of exactly 3 of its blocks, beside a second
tenant's shape with no quota, so there is nothing to reclaim) and its attention reading the
pool's pages; then both again with prefix caching on, over prompts sharing a prefix.
Engines run in child processes pinned to one core (as `weaver serve` pins engines), with
PYTHONPATH set to this checkout. The four runs are independent (each its own shared-memory
prefix), so they run two at a time, one on core 0 and one on core 1: an engine binds one
thread either way, so each run computes what it would alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine(seconds=145)

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("pool_engine_run.py")
QUOTA_BLOCKS = 3
TIMEOUT_S = 600


def _run(model_dir: Path, mode: str, shm_prefix: str, core: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_OMP_THREADS_BIND": core}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the engine's KV budget
    proc = subprocess.run([sys.executable, str(RUNNER), str(model_dir), mode, shm_prefix,
                           str(QUOTA_BLOCKS)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from weaver.models.registry import prepare_model

    return prepare_model("tiny-llama-a")


def _run_pair(model_dir: Path, *runs: tuple[str, str]) -> list[dict]:
    """`_run` of each (mode, shm_prefix) at the same time, the i-th on core i."""
    with cf.ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(_run, model_dir, mode, prefix, str(core))
                   for core, (mode, prefix) in enumerate(runs)]
        return [future.result() for future in futures]


@pytest.fixture(scope="module")
def plain_and_pooled(tiny_dir) -> list[dict]:
    return _run_pair(tiny_dir, ("plain", f"wpool{os.getpid()}p"),
                     ("pool", f"wpool{os.getpid()}"))


@pytest.fixture(scope="module")
def plain(plain_and_pooled) -> dict:
    return plain_and_pooled[0]


@pytest.fixture(scope="module")
def pooled(plain_and_pooled) -> dict:
    return plain_and_pooled[1]


def test_pool_engine_is_token_identical_to_plain(plain, pooled):
    assert len(pooled["outputs"]) == 8 and all(len(o) == 24 for o in pooled["outputs"])
    assert pooled["outputs"] == plain["outputs"]


def test_the_quota_bounds_the_engine_and_every_block_comes_back(pooled):
    stats = pooled["pool_stats"]
    # 8 prompts of 5-40 tokens + 24 new ones need 12 blocks at once; the quota gives 3.
    assert stats["peak_live_blocks"] == QUOTA_BLOCKS
    assert stats["live_blocks"] == 0
    assert stats["attention_steps"] > 0
    assert stats["kv_writes"] == 2 * stats["attention_steps"]  # 2 layers


def test_vllms_own_cache_buffer_costs_no_memory(pooled):
    # vLLM still builds its 512 MiB of per-layer views; they are never touched.
    assert pooled["pool_stats"]["vllm_buffer_rss_bytes"] < 0.05 * pooled["kv_budget_bytes"]


def test_pool_segments_live_with_the_engine_only(pooled):
    assert pooled["segments_while_running"] == [True, True]
    leftovers = [name for name in pooled["segments"] if os.path.exists(f"/dev/shm/{name}")]
    assert not leftovers, f"left behind: {leftovers}"


@pytest.fixture(scope="module")
def cached_runs(tiny_dir) -> list[dict]:
    return _run_pair(tiny_dir, ("plain-cached", f"wpool{os.getpid()}pc"),
                     ("pool-cached", f"wpool{os.getpid()}c"))


@pytest.fixture(scope="module")
def plain_cached(cached_runs) -> dict:
    return cached_runs[0]


@pytest.fixture(scope="module")
def pooled_cached(cached_runs) -> dict:
    return cached_runs[1]


def test_prefix_caching_in_the_pool_is_token_identical_and_hits(plain_cached, pooled_cached):
    # Prompts sharing a 40-token prefix; freed cached blocks keep their pages in the pool,
    # so later requests read the first one's K/V from them.
    assert pooled_cached["outputs"] == plain_cached["outputs"]
    assert plain_cached["cached_prompt_tokens"] > 0
    assert pooled_cached["cached_prompt_tokens"] > 0
    assert pooled_cached["pool_stats"]["peak_live_blocks"] <= QUOTA_BLOCKS


def test_workers_import_this_checkout(plain, pooled):
    for run in (plain, pooled):
        assert Path(run["weaver_file"]).resolve() == REPO / "weaver" / "__init__.py"
