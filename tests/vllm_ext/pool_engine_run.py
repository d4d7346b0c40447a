"""One vLLM engine of tiny-llama-a, plain or keeping its KV in a unified pool, for
test_pool_engine.py (not a test).

Usage: python pool_engine_run.py MODEL_DIR plain|pool|plain-cached|pool-cached SHM_PREFIX
QUOTA_BLOCKS
Prints one JSON line on the real stdout: greedy outputs (token ids), the worker's pid and
resident memory after the run, the pool's stats and its segment names (pool mode).

The pool holds exactly QUOTA_BLOCKS blocks of the engine ("cold", the owner) and a second
model's shape ("hot", tiny-llama-b's KV geometry) with no quota: the owner can take nothing
from anyone, so the pool's size bounds it (with a larger pool it would reclaim the other
tenant's unused quota). The plain engine gets exactly QUOTA_BLOCKS blocks
(num_gpu_blocks_override), so both run under the same memory and vLLM schedules, preempts
and recomputes them alike. Both get a KV budget of KV_BUDGET_BYTES: vLLM's own cache
buffer of that size, which the pool engine never touches.

The -cached modes turn vLLM's prefix caching on and give the prompts a shared 40-token
prefix, so that later requests hit blocks earlier ones wrote (and freed, in the pool
engine: cached blocks keep their pages); they also print the tokens served from the cache.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

NUM_PROMPTS = 8
MAX_TOKENS = 24
# vLLM insists on memory for one request of max_model_len: 3 blocks here, the quota used.
MAX_MODEL_LEN = 96
PAGE_BYTES = 8 * 1024  # one head-block of tiny-llama-a (block 32 x K+V x 32 x fp32)
KV_BUDGET_BYTES = 512 << 20  # vLLM's untouched buffer of that size must cost no memory


def pool_plan(shm_prefix: str, quota_blocks: int):
    from weaver.kv.pages import TenantShape, headwise_block_size
    from weaver.kv.pool_plan import PoolPlan, PoolTenantPlan

    cold = TenantShape(num_layers=2, num_kv_heads=2, head_size=32,
                       block_size=headwise_block_size(PAGE_BYTES, 32, 4), dtype_bytes=4)
    hot = TenantShape(num_layers=3, num_kv_heads=1, head_size=64,
                      block_size=headwise_block_size(PAGE_BYTES, 64, 4), dtype_bytes=4)
    cold_pages = quota_blocks * cold.pages_per_block(PAGE_BYTES)
    # No rebalancing, and nothing unassigned or lent to reclaim: the quota is the pool.
    return PoolPlan(
        pool_name=f"{shm_prefix}_pool", table_name=f"{shm_prefix}_table",
        page_bytes=PAGE_BYTES, num_pages=cold_pages, rebalance_interval_s=0.0,
        tenants=(PoolTenantPlan("cold", cold, cold_pages, is_owner=True),
                 PoolTenantPlan("hot", hot, 0)))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    model_dir, mode, shm_prefix, quota_blocks = sys.argv[1:5]

    from vllm import LLM, SamplingParams

    from weaver.vllm_ext.additional_config import make_additional_config
    from weaver.vllm_ext.engine.app import SCHEDULER

    plan = pool_plan(shm_prefix, int(quota_blocks))
    cached = mode.endswith("-cached")
    pool = (plan, "cold") if mode.startswith("pool") else None
    blocks = {} if pool else {"num_gpu_blocks_override": int(quota_blocks) + 1}  # + null block
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=NUM_PROMPTS, block_size=plan.tenant("cold").shape.block_size,
              kv_cache_memory_bytes=KV_BUDGET_BYTES, **blocks,
              enable_prefix_caching=cached, scheduler_cls=SCHEDULER,
              worker_extension_cls="weaver.vllm_ext.worker.WeaverWorkerExtension",
              additional_config=make_additional_config(pool=pool))
    if cached:  # a shared 40-token prefix (one full block) and 1 to 8 tokens of their own
        prompts = [{"prompt_token_ids": list(range(100, 140)) + list(range(10 + i, 11 + 2 * i))}
                   for i in range(NUM_PROMPTS)]
    else:  # prompts of 5 to 40 tokens; 24 new tokens each: one or two blocks of 32
        prompts = [{"prompt_token_ids": list(range(10 + i, 10 + i + 5 + 5 * i))}
                   for i in range(NUM_PROMPTS)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # Cached: one at first (it fills the cache), then the rest together.
    replies = (llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params) if cached
               else llm.generate(prompts, params))
    outputs = [o.outputs[0].token_ids for o in replies]
    (info,) = llm.collective_rpc("weaver_info")
    result = {"outputs": [list(o) for o in outputs], "worker_pid": info["pid"],
              "worker_rss_bytes": rss_bytes(info["pid"]), "weaver_file": info["weaver_file"],
              "kv_budget_bytes": KV_BUDGET_BYTES,
              "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in replies)}
    if pool is not None:
        (result["pool_stats"],) = llm.collective_rpc("weaver_pool_stats")
        result["segments"] = [plan.pool_name, plan.table_name]
        result["segments_while_running"] = [os.path.exists(f"/dev/shm/{name}")
                                            for name in result["segments"]]
    protocol.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
