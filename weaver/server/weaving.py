"""The gateway's side of weaving: plan the pairs, hand each engine its part, watch them.

The engines link themselves, as under plain `vllm serve` (weaver/weaving/pair_link.py): each
gets its `link` section (and a hot engine its plan) in `additional_config`, with a pairs'
directory of this server's own, so that pair names never meet another server's. The
gateway only waits for each pair to link once every engine is up, and again after an
engine restarted (a hot engine links before a step, so it is made to run one); /metrics
and /health read the files the pairs publish (weaver/weaving/pair_metrics.py). What a dead
owner left behind (a region, a unified pool) is removed when its successor starts and
once every engine has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from weaver.config.deployment import Deployment, Role
from weaver.kv.owner import HostedPool
from weaver.kv.pool_plan import PoolPlan
from weaver.server.features import ServeFeature
from weaver.vllm_ext.additional_config import (
    LinkSection,
    hot_section,
    link_section_for,
    pool_section_for,
)
from weaver.weaving.pair_link import remove_dead_cold_region
from weaver.weaving.pair_metrics import PairStatsCollector
from weaver.weaving.plan import GiB, PairPlan, default_shm_prefix, plan_pairs
from weaver.weaving.rendezvous import PairFiles

logger = logging.getLogger(__name__)

# How long a pair may take to link: at start-up (past it, start-up fails saying why) and
# after a restart (past it, the pair stays degraded, logged).
LINK_TIMEOUT_S = 120.0
LINK_LOOK_S = 0.25  # how often the gateway looks at the pair's files while it links


class UnifiedPoolMetrics:
    """The unified KV pools of cold models with unified_kv (weaver/kv), as their owners
    publish the allocator's stats."""

    def __init__(self, registry: CollectorRegistry) -> None:
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
        """The owner reports running totals, Prometheus counters take increments: add what
        `total` (reported by engine `source`) grew by since its last report."""
        key = (source, counter._name, tuple(sorted(labels.items())))
        delta = total - self._last.get(key, 0.0)
        if delta > 0:
            counter.labels(**labels).inc(delta)
        self._last[key] = max(total, self._last.get(key, 0.0))

    def forget(self, source: str) -> None:
        """A restarted owner counts from 0 again: its next totals are all new."""
        self._last = {key: total for key, total in self._last.items() if key[0] != source}

    def refresh(self, pool: Any, owner: str) -> None:
        """The owner (the cold engine's scheduler) publishes its allocator's stats as a JSON
        file next to the pool; a missing or half-written one is skipped (logged)."""
        try:
            with open(pool.stats_path) as stats_file:
                stats = json.load(stats_file)
        except (OSError, ValueError) as exc:
            logger.debug("unified KV pool stats %s unavailable: %r", pool.stats_path, exc)
            return
        self.publish(pool.pool_name, stats, owner)

    def publish(self, name: str, stats: dict, source: str) -> None:
        """Set the series of pool `name` from its allocator's stats, as reported by
        `source` (a cold engine's published file, or the gateway's own loan pool, which
        has no owner: no reclaims, no prefix cache)."""
        self.pool_size.labels(pool=name).set(stats["num_pages"])
        for tenant in stats["tenants"]:
            self.pool_pages.labels(pool=name, tenant=tenant["name"]).set(
                tenant["num_used_pages"])
            self.pool_quota.labels(pool=name, tenant=tenant["name"]).set(tenant["quota_pages"])
        self.add_total(self.pool_rebalances, {"pool": name}, stats["num_rebalances"], source)
        if "owner" not in stats:
            return
        self.add_total(self.pool_reclaims, {"pool": name}, stats["num_reclaims"], source)
        self.pool_cached_blocks.labels(pool=name).set(stats["num_cached_blocks"])
        self.add_total(self.pool_cache_evictions, {"pool": name}, stats["num_cache_evictions"],
                       source)
        for tenant, report in stats.get("tenant_reports", {}).items():
            self.add_total(self.pool_reclaim_preemptions, {"model": tenant},
                           report.get("reclaim_preemptions", 0), source)


def pair_name(index: int, plan: PairPlan) -> str:
    """The rendezvous name of the gateway's `index`-th pair: unique in its directory,
    readable, and within rendezvous.check_pair_name's alphabet."""
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", f"{plan.hot}.{plan.cold}")
    return f"p{index}-{readable}"[:64]


class Weaving(ServeFeature):
    """The deployment's weaving pairs in the serve lifecycle: each engine's link section
    (and each hot engine's plan, each unified cold pool) in the engines' blocks, the pairs
    waited for once every engine is up and after a restart, what dead owners left removed."""

    def __init__(self, deployment: Deployment, plans: list[PairPlan], root: Path) -> None:
        for spec in deployment.models:
            if spec.role is Role.HOT and not any(p.hot == spec.name for p in plans):
                raise ValueError(f"hot model {spec.name!r} is in no weaving entry; add one or "
                                 "make it dedicated")
        self.plans = plans
        self.files = PairFiles(root)
        self.names = [pair_name(index, plan) for index, plan in enumerate(plans)]
        self.lend_bytes = {spec.name: int(spec.lend_kv_gib * GiB) for spec in deployment.models
                           if spec.role is Role.COLD}
        self.engines: Mapping[str, Any] = {}
        self.pool_metrics: UnifiedPoolMetrics | None = None
        # The loan pools hosted here (pool name -> its allocator service), set up before
        # any engine starts: they outlive a restart of the cold engine or of a hot one.
        self.loan_pools: dict[str, HostedPool] = {}
        # pair name -> why it is degraded although both engines run (a failed link)
        self._link_failures: dict[str, str] = {}

    @classmethod
    def plan(cls, deployment: Deployment, model_dirs: Mapping[str, Path]) -> Weaving:
        prefix = default_shm_prefix()
        return cls(deployment, plan_pairs(deployment, dict(model_dirs), prefix),
                   Path("/dev/shm") / f"{prefix}-pairs")

    def engine_section(self, model: str) -> dict[str, Any]:
        section: dict[str, Any] = {}
        hot = [(name, plan) for name, plan in zip(self.names, self.plans, strict=True)
               if plan.hot == model]
        if hot:  # one plan per cold engine it weaves into, in the order of its entry
            section.update(hot_section([plan for _, plan in hot]))
            section.update(link_section_for(LinkSection(
                "hot", tuple(name for name, _ in hot), str(self.files.root))))
        mine = [name for name, plan in zip(self.names, self.plans, strict=True)
                if plan.cold == model]
        if mine:
            section.update(link_section_for(LinkSection(
                "cold", tuple(mine), str(self.files.root), self.lend_bytes[model], model)))
            # The cold model's own KV goes to its unified pool (it owns it); a loan pool
            # (no owner) holds the hot models' KV only and stays out of its section.
            pool = next((p.pool for p in self.plans if p.cold == model and p.pool is not None
                         and p.pool.owner is not None), None)
            if pool is not None:
                section.update(pool_section_for(pool, model))
        return section

    def set_up(self, stack: contextlib.AsyncExitStack, registry: CollectorRegistry) -> None:
        if not self.plans:
            return
        names = tuple(self.names)
        registry.register(PairStatsCollector(self.files, "hot", names))
        registry.register(PairStatsCollector(self.files, "cold", names))
        if any(plan.pool is not None for plan in self.plans):
            self.pool_metrics = UnifiedPoolMetrics(registry)
        # Runs once every engine has stopped (the loan pools close after it).
        stack.callback(self.remove_leftovers)
        for pool in loan_pools(self.plans):
            self.loan_pools[pool.pool_name] = HostedPool(pool, kind="loan pool")
            stack.callback(self.loan_pools[pool.pool_name].close)

    def before_engine_start(self, model: str) -> None:
        # A cold engine that died left its pool behind; its successor makes a new one (its
        # regions are removed by its own ColdLink when it starts) and counts from 0.
        remove_pool_files([p for p in self.plans if p.cold == model])
        if self.pool_metrics is not None:
            self.pool_metrics.forget(model)

    async def after_start(self, engines: Mapping[str, Any],
                          stack: contextlib.AsyncExitStack) -> None:
        if not self.plans:
            return
        self.engines = engines
        for name, plan in zip(self.names, self.plans, strict=True):
            await self._link(name, plan, engines[plan.hot].handle)
            logger.info("weaving %s -> %s linked (%d remote blocks, ratio %s)", plan.hot,
                        plan.cold, plan.num_remote_blocks, plan.offload_ratio)
        for engine in engines.values():
            engine.on_restarted = self.relink

    async def _link(self, name: str, plan: PairPlan, hot_engine: Any) -> None:
        """Until the hot engine has attached the region its cold engine made for it; a hot
        engine links before a step, so it is made to run one while the cold side is ready.
        RuntimeError saying why after LINK_TIMEOUT_S, or at once when the cold engine
        refused the plan or the hot engine failed to attach its region."""
        deadline = time.monotonic() + LINK_TIMEOUT_S
        failures_before = (self.files.read(name, "hot.stats") or {}).get("attach_failures", 0)
        while True:
            cold = self.files.read(name, "cold")
            if cold is not None and cold.get("status") == "refused":
                raise RuntimeError(f"weaving {plan.hot} -> {plan.cold}: the cold engine "
                                   f"refused the plan: {cold.get('reason')}")
            hot = self.files.read(name, "hot.stats") or {}
            waiting_for = not_linked_because(cold, hot)
            if waiting_for is None:
                return
            if hot.get("attach_failures", 0) > failures_before:
                raise RuntimeError(f"weaving {plan.hot} -> {plan.cold}: the hot engine could "
                                   f"not attach the cold engine's region: "
                                   f"{hot.get('last_attach_error')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"weaving {plan.hot} -> {plan.cold} not linked after "
                                   f"{LINK_TIMEOUT_S:.0f} s: {waiting_for}")
            if cold is not None and cold.get("status") == "ready":
                await hot_engine.step_once()
            await asyncio.sleep(LINK_LOOK_S)

    async def relink(self, model: str) -> None:
        """Wait for the pairs of an engine that restarted (weaver.server.supervisor) to link
        again; a pair whose other engine is down links once that one is back."""
        for name, plan in zip(self.names, self.plans, strict=True):
            if model not in (plan.hot, plan.cold):
                continue
            other = plan.cold if plan.hot == model else plan.hot
            if self.engines[other].is_dead:
                continue
            hot = self.engines[plan.hot]
            try:
                await self._link(name, plan, hot.handle)
            except Exception as exc:  # the models serve; the pair computes remote rows itself
                logger.error("weaving %s -> %s not linked again after %s restarted: %s",
                             plan.hot, plan.cold, model, exc)
                self._link_failures[name] = f"relink failed: {exc}"
                continue
            self._link_failures.pop(name, None)
            logger.info("weaving %s -> %s linked again after %s restarted", plan.hot,
                        plan.cold, model)

    def health(self) -> dict[str, Any]:
        if not self.plans:
            return {}
        return {"weaving": [self._pair_health(name, plan)
                            for name, plan in zip(self.names, self.plans, strict=True)]}

    def _pair_health(self, name: str, plan: PairPlan) -> dict[str, Any]:
        state: dict[str, Any] = {"hot": plan.hot, "cold": plan.cold, "pair": name,
                                 "offload_ratio": plan.offload_ratio,
                                 "remote_blocks": plan.num_remote_blocks,
                                 "remote_kv_in": remote_kv_home(plan)}
        if not self.engines:
            return {**state, "status": "starting", "reason": None}
        hot = self.files.read(name, "hot.stats") or {}
        placement = hot.get("placement")
        if placement:  # offload_ratio auto: is weaving on, and why (not)
            state.update(weaving_active=placement.get("weaving_active"),
                         policy_reason=placement.get("reason"))
        if self.engines[plan.hot].is_dead:
            reason = "hot engine is down"
        elif self.engines[plan.cold].is_dead:
            reason = "cold engine is down"
        else:
            reason = (hot.get("degraded_reason") or self._link_failures.get(name)
                      or not_linked_because(self.files.read(name, "cold"), hot))
        return {**state, "status": "degraded" if reason else "ok", "reason": reason}

    async def refresh(self) -> None:
        if self.pool_metrics is None:
            return
        for pool, owner in {p.pool.pool_name: (p.pool, p.cold) for p in self.plans
                            if p.pool}.values():
            hosted = self.loan_pools.get(pool.pool_name)
            if hosted is not None:
                self.pool_metrics.publish(pool.pool_name, hosted.stats(), "gateway")
            else:
                self.pool_metrics.refresh(pool, owner)

    def remove_leftovers(self) -> None:
        """Once every engine has stopped: the regions of cold engines that were killed, the
        unified pools their owners could not remove, and the pairs' directory."""
        for name in self.names:
            remove_dead_cold_region(name, self.files.read_even_if_dead(name, "cold"))
        remove_pool_files(self.plans)
        shutil.rmtree(self.files.root, ignore_errors=True)


def not_linked_because(cold: dict[str, Any] | None, hot: dict[str, Any]) -> str | None:
    """Why a pair is not linked, from its cold side's answer and its hot side's stats as
    read (a missing hot file: {}); None when the hot side attached the cold side's region."""
    if cold is None or cold.get("status") != "ready":
        return "the cold engine has made no region for it yet"
    if hot.get("attached_region") != cold.get("region_name"):
        return "the hot engine has not attached the cold engine's region yet"
    return None


def remote_kv_home(plan: PairPlan) -> str:
    """Where the pair's remote KV lives, as /health says it."""
    if plan.pool is None:
        return "region"  # a fixed share of the cold model's loan
    return "unified pool" if plan.pool.owner is not None else "loan pool"


def loan_pools(plans: list[PairPlan]) -> list[PoolPlan]:
    """The pools without an owner among the plans (weaver/weaving/plan.py plan_loan_pools),
    once each: the gateway hosts them."""
    return list({p.pool.pool_name: p.pool for p in plans
                 if p.pool is not None and p.pool.owner is None}.values())


def remove_pool_files(plans: list[PairPlan]) -> None:
    """Unlink the unified pools whose owner could not (it died); ours by name, from the
    plans. A loan pool is the gateway's own and closes with it."""
    for plan in plans:
        if plan.pool is None or plan.pool.owner is None:
            continue
        for path in (os.path.join("/dev/shm", plan.pool.pool_name),
                     os.path.join("/dev/shm", plan.pool.table_name), plan.pool.stats_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                logger.warning("removed leftover unified KV pool file %s", path)
