"""A colocated group's unified KV pool (MuxServe's unified KV cache) in the gateway.

With `unified_kv: true` a group's models keep their KV in one pool instead of one cache
each. The gateway plans it (`plan_mux_pool`), hosts it before any engine starts
(weaver.kv.owner.HostedPool: the pool's bytes, the page table, the allocator service and
the ADBS thread), and every engine of the group leases its blocks from it
(weaver/vllm_ext/scheduler.py) and maps the pages (weaver/vllm_ext/attention/pool.py).
Hosting it here rather than in one of the engines keeps the members equal and lets any of
them die and restart without taking the pool, or the other engine's KV, with it.

Each model starts with the quota of the KV it would have on its own (its
num_gpu_blocks_override, else its kv_cache_gib, less vLLM's null block), so the pool is
exactly the memory of the group's separate caches; ADBS moves quota from there, never below
one max_model_len sequence of a model.
"""

from __future__ import annotations

import contextlib
import math
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from weaver.config.deployment import Deployment, ModelSpec, MuxGroupSpec
from weaver.kv.owner import HostedPool
from weaver.kv.pages import TenantShape
from weaver.kv.pool_plan import PoolPlan, PoolTenantPlan
from weaver.offload.naming import region_name
from weaver.server.features import ServeFeature
from weaver.vllm_ext.additional_config import pool_section_for
from weaver.weaving.plan import GiB, check_fills_pages, default_shm_prefix, tenant_shape


def own_kv_blocks(spec: ModelSpec, shape: TenantShape) -> int:
    """The blocks the model's engine would have on its own: vLLM's count from the KV
    budget (or the override), less block 0, its null block."""
    if spec.num_gpu_blocks_override is not None:
        return spec.num_gpu_blocks_override - 1
    return int(spec.kv_cache_gib * GiB) // shape.block_bytes() - 1


def plan_mux_pool(deployment: Deployment, group: MuxGroupSpec,
                  model_dirs: Mapping[str, Path], shm_prefix: str) -> PoolPlan:
    """The pool of a group with unified_kv; ValueError saying the fix when its models cannot
    share pages."""
    specs = [deployment.model(name) for name in group.models]
    shapes = {spec.name: tenant_shape(model_dirs[spec.name], spec) for spec in specs}
    first = specs[0]
    page_bytes = shapes[first.name].head_block_bytes
    tenants = []
    for spec in specs:
        shape = shapes[spec.name]
        if spec.dtype != first.dtype:
            # Pages change tenants without being cleared; bytes of one dtype read as another
            # can decode as NaN, which masked attention keeps (weaver/weaving/plan.py).
            raise ValueError(f"mux group {group.name!r} keeps one KV pool: {spec.name!r} "
                             f"must use {first.name!r}'s dtype {first.dtype}, not {spec.dtype}")
        check_fills_pages(f"mux group {group.name!r} keeps one KV pool", first.name,
                          shapes[first.name], spec.name, shape)
        pages_per_block = shape.pages_per_block(page_bytes)
        blocks = own_kv_blocks(spec, shape)
        sequence_blocks = math.ceil(spec.max_model_len / shape.block_size)
        if blocks < sequence_blocks:
            raise ValueError(
                f"mux group {group.name!r}: {spec.name!r} brings {blocks} KV blocks to the "
                f"pool, fewer than one {spec.max_model_len}-token sequence needs "
                f"({sequence_blocks}); raise its kv_cache_gib or num_gpu_blocks_override")
        tenants.append(PoolTenantPlan(spec.name, shape, blocks * pages_per_block,
                                      min_quota_pages=sequence_blocks * pages_per_block))
    name = region_name(shm_prefix, group.name, "kvpool")
    return PoolPlan(pool_name=name, table_name=f"{name}.table", page_bytes=page_bytes,
                    num_pages=sum(t.quota_pages for t in tenants), tenants=tuple(tenants),
                    service_address=f"\0{name}.alloc", authkey_hex=secrets.token_hex(16))


def plan_mux_pools(deployment: Deployment,
                   model_dirs: Mapping[str, Path]) -> dict[str, PoolPlan]:
    """Group name -> its pool, for every group with unified_kv."""
    return {group.name: plan_mux_pool(deployment, group, model_dirs, default_shm_prefix())
            for group in deployment.mux if group.unified_kv}


class MuxPools(ServeFeature):
    """The unified KV pools of the colocated groups that keep one: hosted here before any
    engine starts (the engines map them), closed after every engine has stopped."""

    def __init__(self, deployment: Deployment, pools: Mapping[str, PoolPlan]) -> None:
        self.pools = dict(pools)  # group -> plan
        # model -> its group's pool: the engine's `weaver.pool` block, itself its tenant
        self.pool_of = {model: self.pools[group.name] for group in deployment.mux
                        if group.name in self.pools for model in group.models}

    def engine_section(self, model: str) -> dict[str, Any]:
        plan = self.pool_of.get(model)
        return pool_section_for(plan, model) if plan is not None else {}

    def set_up(self, stack: contextlib.AsyncExitStack, registry: CollectorRegistry) -> None:
        if not self.pools:
            return
        hosted = {}
        for group, plan in self.pools.items():
            hosted[group] = HostedPool(plan)
            stack.callback(hosted[group].close)
        registry.register(MuxPoolCollector(hosted))


class MuxPoolCollector(Collector):
    """weaver_mux_kv_* series: each hosted pool's quotas and use per model, read from its
    allocator at each scrape (it lives in this process)."""

    def __init__(self, pools: Mapping[str, HostedPool]) -> None:
        self.pools = dict(pools)

    def describe(self) -> Iterator:
        yield from self._families().values()

    def collect(self) -> Iterator:
        families = self._families()
        for group, pool in self.pools.items():
            stats = pool.allocator.stats()
            families["pages"].add_metric([group], stats.num_pages)
            families["rebalances"].add_metric([group], stats.num_rebalances)
            families["moved"].add_metric([group], stats.num_quota_pages_moved)
            for tenant in stats.tenants:
                labels = [tenant.name, group]
                families["quota"].add_metric(labels, tenant.quota_pages)
                families["used"].add_metric(labels, tenant.num_used_pages)
                families["failed"].add_metric(labels, tenant.num_failed_allocations)
        yield from families.values()

    @staticmethod
    def _families() -> dict:
        labels = ["model", "group"]
        return {
            "pages": GaugeMetricFamily("weaver_mux_kv_pool_pages", "Pages in the group's "
                                       "unified KV pool", labels=["group"]),
            "quota": GaugeMetricFamily("weaver_mux_kv_quota_pages", "The model's quota of "
                                       "the group's pool (ADBS moves it)", labels=labels),
            "used": GaugeMetricFamily("weaver_mux_kv_used_pages", "Pages the model's engine "
                                      "holds in the group's pool (its lease included)",
                                      labels=labels),
            "failed": CounterMetricFamily(
                "weaver_mux_kv_failed_allocations", "Block requests of the model's engine "
                "that its quota could not cover (ADBS then counts it as short)",
                labels=labels),
            "rebalances": CounterMetricFamily(
                "weaver_mux_kv_rebalances", "ADBS rounds that moved quota in the group's "
                "pool", labels=["group"]),
            "moved": CounterMetricFamily("weaver_mux_kv_quota_moved_pages", "Quota pages "
                                         "ADBS moved between the group's models",
                                         labels=["group"]),
        }
