"""The gateway's Prometheus series of a unified KV pool, from the stats file its owner writes."""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.pages import TenantShape
from weaver.server.weaving import UnifiedPoolMetrics

SHAPE = TenantShape(num_layers=2, num_kv_heads=2, head_size=32, block_size=32, dtype_bytes=4)


def write_owner_stats(path, *, reclaims: int, evictions: int, cached: int) -> None:
    """What PoolOwner.stats() publishes: the allocator's stats plus the owner's counters."""
    allocator = UnifiedKVAllocator(100, SHAPE.head_block_bytes)
    allocator.add_tenant("cold", SHAPE, 60, is_owner=True)
    allocator.add_tenant("hot", SHAPE, 40)
    path.write_text(json.dumps({
        "pool": "p", "owner": "cold", "num_reclaims": reclaims, "num_reclaimed_blocks": 0,
        "num_cache_evictions": evictions, "num_cached_blocks": cached, "tenant_reports": {},
        **asdict(allocator.stats())}))


def test_pool_series_follow_the_owners_running_totals(tmp_path):
    registry = CollectorRegistry()
    metrics = UnifiedPoolMetrics(registry)
    pool = SimpleNamespace(pool_name="p", stats_path=str(tmp_path / "p.stats.json"))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"pool": "p", **labels})

    metrics.refresh(pool, "cold")  # no file yet: skipped, nothing published
    assert value("weaver_kv_pool_size_pages") is None

    write_owner_stats(tmp_path / "p.stats.json", reclaims=2, evictions=5, cached=7)
    metrics.refresh(pool, "cold")
    assert value("weaver_kv_pool_size_pages") == 100
    assert value("weaver_kv_pool_quota_pages", tenant="hot") == 40
    assert value("weaver_kv_pool_cached_blocks") == 7
    assert value("weaver_kv_pool_cache_evictions_total") == 5
    assert value("weaver_kv_pool_reclaims_total") == 2

    # The owner's counters are running totals: the series add the increments only.
    write_owner_stats(tmp_path / "p.stats.json", reclaims=3, evictions=9, cached=1)
    metrics.refresh(pool, "cold")
    assert value("weaver_kv_pool_cached_blocks") == 1
    assert value("weaver_kv_pool_cache_evictions_total") == 9
    assert value("weaver_kv_pool_reclaims_total") == 3

    # The owner restarted (weaver serve's Weaving.before_engine_start): it counts from 0,
    # and the series go on growing from where they were.
    metrics.forget("cold")
    write_owner_stats(tmp_path / "p.stats.json", reclaims=1, evictions=2, cached=0)
    metrics.refresh(pool, "cold")
    assert value("weaver_kv_pool_reclaims_total") == 4
    assert value("weaver_kv_pool_cache_evictions_total") == 11


def test_a_loan_pools_series_come_from_the_gateways_own_allocator():
    """A loan pool has no owner engine: the gateway hosts it and publishes its allocator's
    stats directly; there are no reclaims or cached blocks to report."""
    allocator = UnifiedKVAllocator(100, SHAPE.head_block_bytes)
    allocator.add_tenant("hot-a", SHAPE, 50)
    allocator.add_tenant("hot-b", SHAPE, 50)
    registry = CollectorRegistry()
    UnifiedPoolMetrics(registry).publish("loan", {"pool": "loan", "tenant_reports": {},
                                                  **asdict(allocator.stats())}, "gateway")
    assert registry.get_sample_value("weaver_kv_pool_size_pages", {"pool": "loan"}) == 100
    assert registry.get_sample_value("weaver_kv_pool_quota_pages",
                                     {"pool": "loan", "tenant": "hot-b"}) == 50
    assert registry.get_sample_value("weaver_kv_pool_reclaims_total", {"pool": "loan"}) is None
