"""Workers report running totals; the gateway's counters must only ever grow, also across
an engine restart (whose worker counts from 0 again)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from weaver.server.weaving import WeavingMetrics


def tasks(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("weaver_offload_tasks_total", {"hot": "h", "cold": "c"})


def test_totals_become_increments_and_a_restarted_engine_counts_anew():
    registry = CollectorRegistry()
    metrics = WeavingMetrics(registry)
    pair = {"hot": "h", "cold": "c"}
    metrics.add_total(metrics.tasks, pair, 10, source="h")
    metrics.add_total(metrics.tasks, pair, 25, source="h")
    assert tasks(registry) == 25
    metrics.add_total(metrics.tasks, pair, 4, source="h")  # stale or restarted: no decrease
    assert tasks(registry) == 25
    metrics.forget("c")  # another engine's restart changes nothing here
    metrics.add_total(metrics.tasks, pair, 30, source="h")
    assert tasks(registry) == 30
    metrics.forget("h")  # the hot engine restarted: its worker's totals start at 0
    metrics.add_total(metrics.tasks, pair, 7, source="h")
    assert tasks(registry) == 37
