"""The gateway's side of weaving: plan the pairs, connect their engines, watch them.

Order at start-up (nothing of this is on the request path): every engine starts with its
plan in `additional_config`; then each cold worker creates and owns its region, and only
then does each hot worker attach it. At shutdown the cold workers close (and unlink)
their regions; a region whose owner died is unlinked here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from weaver.config.deployment import Deployment, Role
from weaver.offload.naming import region_paths
from weaver.server.features import ServeFeature
from weaver.vllm_ext.additional_config import hot_section, pool_section_for
from weaver.weaving import series
from weaver.weaving.plan import PairPlan, default_shm_prefix, plan_pairs

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 60.0
STATS_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 5.0
# Fine below 10 ms, where operator splitting moves the offload wait (benchmarks/split_wait.py
# reads p50/p99 from these buckets).
WAIT_BUCKETS = (5e-5, 1e-4, 1.5e-4, 2e-4, 2.5e-4, 3e-4, 4e-4, 5e-4, 6e-4, 7.5e-4, 1e-3, 1.25e-3,
                1.5e-3, 2e-3, 2.5e-3, 3e-3, 4e-3, 5e-3, 6e-3, 7.5e-3, 1e-2, 1.5e-2, 2.5e-2,
                5e-2, 0.1, 0.5, 1.0, 5.0)


class WeavingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.sequences = Counter(*series.OFFLOAD_SEQUENCES, registry=registry)
        self.tasks = Counter(*series.OFFLOAD_TASKS, registry=registry)
        self.fallbacks = Counter(*series.OFFLOAD_FALLBACKS, registry=registry)
        self.wait = Histogram("weaver_offload_wait_seconds",
                              "Hot side's wait for a remote attention task (publish to output)",
                              ["hot", "cold"], buckets=WAIT_BUCKETS, registry=registry)
        self.remote_blocks = Gauge("weaver_remote_kv_blocks_used",
                                   "Remote KV blocks held by running hot sequences",
                                   ["hot", "cold"], registry=registry)
        self.cold_busy = Counter(*series.COLD_BUSY, registry=registry)
        self.weaving_active = Gauge(*series.WEAVING_ACTIVE, registry=registry)
        self.step_asides = Counter(*series.STEP_ASIDES, registry=registry)
        self.cold_tpot_factor = Gauge(*series.COLD_TPOT_FACTOR, registry=registry)
        # The unified KV pools of cold models with unified_kv (weaver/kv), as
        # their owners publish the allocator's stats.
        self.pool_pages = Gauge("weaver_kv_pool_pages", "Pages a tenant's live blocks hold "
                                "in a cold device's unified KV pool (leased spares included)",
                                ["pool", "tenant"], registry=registry)
        self.pool_quota = Gauge("weaver_kv_pool_quota_pages", "A tenant's quota of the pool",
                                ["pool", "tenant"], registry=registry)
        self.pool_size = Gauge("weaver_kv_pool_size_pages", "Pages in the pool", ["pool"],
                               registry=registry)
        self.pool_rebalances = Counter("weaver_kv_pool_rebalances",
                                       "ADBS rebalances that moved quota", ["pool"],
                                       registry=registry)
        self.pool_reclaims = Counter("weaver_kv_pool_reclaims", "Times the cold model took "
                                     "quota back for its own requests", ["pool"],
                                     registry=registry)
        # Prefix-cached free blocks of the owner keep their pages until vLLM reuses them
        # or ADBS lends the pages (then they are evicted): how warm the cold model's cache
        # stays while it lends, and what lending cost it.
        self.pool_cached_blocks = Gauge("weaver_kv_pool_cached_blocks", "The owner's free "
                                        "blocks that keep their prefix-cached pages",
                                        ["pool"], registry=registry)
        self.pool_cache_evictions = Counter("weaver_kv_pool_cache_evictions", "The owner's "
                                            "prefix-cached blocks evicted to lend their pages",
                                            ["pool"], registry=registry)
        self.pool_reclaim_preemptions = Counter(
            "weaver_kv_pool_reclaim_preemptions", "Remote requests a hot model preempted "
            "(and recomputes) to give pool memory back to the cold model", ["model"],
            registry=registry)
        self._last: dict[tuple, float] = {}

    def add_total(self, counter: Counter, labels: dict[str, str], total: float,
                  source: str) -> None:
        """Workers report running totals, Prometheus counters take increments: add what
        `total` (reported by engine `source`) grew by since its last report."""
        key = (source, counter._name, tuple(sorted(labels.items())))
        delta = total - self._last.get(key, 0.0)
        if delta > 0:
            counter.labels(**labels).inc(delta)
        self._last[key] = max(total, self._last.get(key, 0.0))

    def forget(self, source: str) -> None:
        """A restarted engine counts from 0 again: its next totals are all new."""
        self._last = {key: total for key, total in self._last.items() if key[0] != source}


def weaving_plans(deployment: Deployment, model_dirs: Mapping[str, Path]) -> list[PairPlan]:
    return plan_pairs(deployment, dict(model_dirs), default_shm_prefix())


class Weaving(ServeFeature):
    """The deployment's weaving pairs in the serve lifecycle: each hot engine's plan and
    each unified cold pool in the engines' blocks, the pairs linked once every engine is
    up (and again after a restart), their regions reclaimed when an owner died."""

    def __init__(self, deployment: Deployment, plans: list[PairPlan]) -> None:
        for spec in deployment.models:
            if spec.role is Role.HOT and not any(p.hot == spec.name for p in plans):
                raise ValueError(f"hot model {spec.name!r} is in no weaving entry; add one or "
                                 "make it dedicated")
        self.plans = plans
        self.supervisor: WeavingSupervisor | None = None
        self._registry: CollectorRegistry | None = None

    @classmethod
    def plan(cls, deployment: Deployment, model_dirs: Mapping[str, Path]) -> Weaving:
        return cls(deployment, weaving_plans(deployment, model_dirs))

    def engine_section(self, model: str) -> dict[str, Any]:
        hot = next((p for p in self.plans if p.hot == model), None)
        pool = next((p.pool for p in self.plans if p.cold == model and p.pool is not None),
                    None)
        return {**(hot_section(hot) if hot is not None else {}),
                **(pool_section_for(pool, model) if pool is not None else {})}

    def set_up(self, stack: contextlib.AsyncExitStack, registry: CollectorRegistry) -> None:
        self._registry = registry
        # Runs once every engine has stopped: regions whose owner died are unlinked.
        stack.callback(remove_leftover_regions, self.plans)

    def before_engine_start(self, model: str) -> None:
        # A cold engine that died left its regions behind; its successor makes new ones.
        remove_leftover_regions([p for p in self.plans if p.cold == model])

    async def after_start(self, engines: Mapping[str, Any],
                          stack: contextlib.AsyncExitStack) -> None:
        if not self.plans:
            return
        assert self._registry is not None, "set_up runs before after_start"
        supervisor = WeavingSupervisor(self.plans, engines, WeavingMetrics(self._registry))
        self.supervisor = supervisor
        stack.push_async_callback(supervisor.close)
        await supervisor.connect()
        for engine in engines.values():
            engine.on_restarted = supervisor.reconnect

    def health(self) -> dict[str, Any]:
        return self.supervisor.health() if self.supervisor is not None else {}

    async def refresh(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.refresh()


class WeavingSupervisor:
    def __init__(self, plans: list[PairPlan], engines: Mapping[str, Any],
                 metrics: WeavingMetrics) -> None:
        self.plans = plans
        self.engines = engines
        self.metrics = metrics
        self.state: dict[str, dict[str, Any]] = {
            f"{p.hot}->{p.cold}": {"hot": p.hot, "cold": p.cold, "status": "starting",
                                   "offload_ratio": p.offload_ratio,
                                   "remote_blocks": p.num_remote_blocks, "reason": None}
            for p in plans
        }
        self._cuda_handles: dict[str, str] = {}  # region name -> its owner's IPC handle
        self._reconnect_failures: dict[str, str] = {}  # pair -> why it stays degraded

    async def connect(self) -> None:
        for cold in sorted({p.cold for p in self.plans}):
            await self._open_cold(cold)
        for plan in self.plans:
            await self._attach_hot(plan)

    async def _open_cold(self, cold: str) -> None:
        # A region on a GPU is exported once by its owner (CUDA IPC) and opened once by
        # its hot worker; one in shared memory is found by its name.
        mine = [p.to_dict() for p in self.plans if p.cold == cold]
        (opened,) = await _rpc(self.engines[cold], "weaver_open_cold", RPC_TIMEOUT_S, mine)
        self._cuda_handles.update(opened.get("cuda_handles", {}))

    async def _attach_hot(self, plan: PairPlan) -> None:
        await _rpc(self.engines[plan.hot], "weaver_attach_hot", RPC_TIMEOUT_S,
                   plan.to_dict(), self._cuda_handles.get(plan.region_name))
        key = f"{plan.hot}->{plan.cold}"
        self.state[key].update(status="ok", reason=None)
        self._reconnect_failures.pop(key, None)
        logger.info("weaving %s -> %s connected (%d remote blocks, ratio %s)",
                    plan.hot, plan.cold, plan.num_remote_blocks, plan.offload_ratio)

    async def reconnect(self, name: str) -> None:
        """Connect the pairs of an engine that restarted (weaver.server.supervisor): a cold
        one creates its regions again and its hot engines re-attach (their running remote
        sequences' K/V carried over); a hot one attaches its colds' regions again. A pair
        whose other engine is down stays degraded until that one is back."""
        self.metrics.forget(name)
        plans = [p for p in self.plans if name in (p.hot, p.cold)]
        if any(p.cold == name for p in plans):
            await self._open_cold(name)
        for plan in plans:
            key = f"{plan.hot}->{plan.cold}"
            other = plan.cold if plan.hot == name else plan.hot
            if self.engines[other].is_dead:
                self.state[key].update(status="degraded", reason=f"{other} is down")
                continue
            try:
                await self._attach_hot(plan)
            except Exception as exc:  # the models serve; the pair computes remote rows itself
                logger.error("weaving %s -> %s not reconnected after %s restarted: %r",
                             plan.hot, plan.cold, name, exc)
                self._reconnect_failures[key] = f"reconnect failed: {exc}"
                self.state[key].update(status="degraded", reason=self._reconnect_failures[key])

    async def refresh(self) -> None:
        """Pull the workers' counters into Prometheus and the pairs' state into /health."""
        for plan in self.plans:
            key = f"{plan.hot}->{plan.cold}"
            hot = self.engines[plan.hot]
            if hot.is_dead:
                self.state[key].update(status="degraded", reason="hot engine is down")
                continue
            stats = await self._stats_of(plan.hot)
            if stats is None:
                continue
            self._record(plan, stats.get("hot") or {})
            cold_dead = self.engines[plan.cold].is_dead
            reason = ((stats.get("hot") or {}).get("degraded_reason")
                      or self._reconnect_failures.get(key)
                      or ("cold engine is down" if cold_dead else None))
            self.state[key].update(status="degraded" if reason else "ok", reason=reason)
            placement = (stats.get("hot") or {}).get("placement")
            if placement:  # offload_ratio auto: is weaving on, and why (not)
                self.state[key].update(weaving_active=placement.get("weaving_active"),
                                       policy_reason=placement.get("reason"))
        for cold in sorted({p.cold for p in self.plans}):
            await self._refresh_cold(cold)
        for pool, owner in {p.pool.pool_name: (p.pool, p.cold) for p in self.plans
                            if p.pool}.values():
            self._refresh_pool(pool, owner)

    def _refresh_pool(self, pool: Any, owner: str) -> None:
        """The owner (the cold engine's scheduler) publishes its allocator's stats as a JSON
        file next to the pool; a missing or half-written one is skipped (logged)."""
        try:
            with open(pool.stats_path) as stats_file:
                stats = json.load(stats_file)
        except (OSError, ValueError) as exc:
            logger.debug("unified KV pool stats %s unavailable: %r", pool.stats_path, exc)
            return
        m, name = self.metrics, pool.pool_name
        m.pool_size.labels(pool=name).set(stats["num_pages"])
        for tenant in stats["tenants"]:
            m.pool_pages.labels(pool=name, tenant=tenant["name"]).set(tenant["num_used_pages"])
            m.pool_quota.labels(pool=name, tenant=tenant["name"]).set(tenant["quota_pages"])
        m.add_total(m.pool_rebalances, {"pool": name}, stats["num_rebalances"], owner)
        m.add_total(m.pool_reclaims, {"pool": name}, stats["num_reclaims"], owner)
        m.pool_cached_blocks.labels(pool=name).set(stats["num_cached_blocks"])
        m.add_total(m.pool_cache_evictions, {"pool": name}, stats["num_cache_evictions"],
                    owner)
        for tenant, report in stats.get("tenant_reports", {}).items():
            m.add_total(m.pool_reclaim_preemptions, {"model": tenant},
                        report.get("reclaim_preemptions", 0), owner)

    async def _stats_of(self, name: str) -> dict[str, Any] | None:
        """The worker's weaving counters, or None (logged) when it does not answer."""
        try:
            (stats,) = await _rpc(self.engines[name], "weaver_stats", STATS_TIMEOUT_S)
        except Exception as exc:  # a scrape must not fail because one engine did
            logger.warning("weaving stats of %s unavailable: %r", name, exc)
            return None
        return stats

    async def _refresh_cold(self, cold: str) -> None:
        if self.engines[cold].is_dead:
            return
        stats = await self._stats_of(cold)
        if stats is None:
            return
        by_region = {p.region_name: p for p in self.plans if p.cold == cold}
        for receiver in stats.get("cold") or ():
            plan = by_region.get(receiver.get("region"))
            if plan is None:
                continue
            m, pair = self.metrics, {"hot": plan.hot, "cold": plan.cold}
            m.add_total(m.cold_busy, {**pair, "where": "poll_point"},
                        receiver.get("busy_at_poll_points_s", 0.0), cold)
            m.add_total(m.cold_busy, {**pair, "where": "idle"},
                        receiver.get("busy_by_idle_poller_s", 0.0), cold)

    def _record(self, plan: PairPlan, hot: dict[str, Any]) -> None:
        m, pair = self.metrics, {"hot": plan.hot, "cold": plan.cold}
        m.add_total(m.sequences, {"model": plan.hot}, hot.get("remote_sequences", 0), plan.hot)
        m.add_total(m.tasks, pair, hot.get("offloaded_tasks", 0), plan.hot)
        m.add_total(m.fallbacks, {"model": plan.hot}, hot.get("fallback_tasks", 0), plan.hot)
        for seconds in hot.get("wait_seconds", []):
            m.wait.labels(**pair).observe(seconds)
        m.remote_blocks.labels(**pair).set(hot.get("remote_blocks_used", 0))
        samples = series.placement_samples(hot.get("placement"))
        if samples is not None:
            active, asides, factor = samples
            m.weaving_active.labels(**pair).set(active)
            m.add_total(m.step_asides, pair, asides, plan.hot)
            m.cold_tpot_factor.labels(**pair).set(factor)

    def health(self) -> dict[str, Any]:
        return {"weaving": list(self.state.values())}

    async def close(self) -> None:
        for cold in sorted({p.cold for p in self.plans}):
            engine = self.engines[cold]
            if engine.is_dead:
                continue
            try:
                await _rpc(engine, "weaver_close", CLOSE_TIMEOUT_S)
            except Exception as exc:  # shutting down: start_engines unlinks what is left
                logger.warning("closing the regions of %s failed: %r", cold, exc)
        # Nothing is unlinked here: a cold engine's scheduler still owns its unified pool
        # (and publishes its stats) until the engine stops; what its owners could not
        # remove is unlinked once every engine has stopped (start_engines).


async def _rpc(engine: Any, method: str, timeout_s: float, *args: Any) -> list:
    # vLLM's own rpc timeout is enforced in the worker; a dead worker never answers at
    # all, so the gateway bounds the wait itself.
    call = engine.client.collective_rpc(method, timeout=timeout_s, args=args)
    return await asyncio.wait_for(call, timeout_s + 1.0)


def remove_leftover_regions(plans: list[PairPlan]) -> None:
    """Unlink regions whose owner could not (it died); ours by name, from the plans."""
    for plan in plans:
        paths = region_paths(plan.region_name)
        if plan.pool is not None:  # the cold engine's unified KV pool, table and stats
            paths += [os.path.join("/dev/shm", plan.pool.pool_name),
                      os.path.join("/dev/shm", plan.pool.table_name), plan.pool.stats_path]
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                logger.warning("removed leftover shared region file %s", path)
