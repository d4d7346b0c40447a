"""Weaver's scheduler (``--scheduler-cls``): vLLM's own, with a second block pool on a hot
engine and the unified pool's allocator on a cold engine that keeps its KV there.

Composed, not copied (docs/vllm-hooks.md, "Scheduler"), one collaborator per role:
- a hot engine (its ``additional_config`` carries its weaving plans, one per cold engine;
  ``HotRouting``): after vLLM's ``Scheduler.__init__`` the KV-cache manager is wrapped by
  ``RoutingKVCacheManager`` (weaver/vllm_ext/routing_kv_cache_manager.py, installed by
  patches/routing_kv_cache_manager.py), which owns the local
  ``KVCacheManager`` and one remote one per cold engine. The `i`-th remote one is built over
  ``first_i + num_remote_i`` blocks with ids ``1..first_i-1`` pinned, so it hands out
  exactly ``[first_i, first_i + num_remote_i)`` (``first_i``: past the local ids and the
  earlier colds' ranges, weaver/weaving/plan.py remote_block_offsets). Those ids travel
  unchanged to the worker, whose attention tells a request's cold engine by its first
  block id, so no side channel is needed. Admission sees every pool, which is where the hot
  model's larger batches come from. When the remote blocks live in the cold device's
  unified pool they are leased from its allocator a step at a time (``weaver.kv.lease``).
- a pool engine (a cold engine with ``unified_kv``): its block pool allocates through the
  pool's allocator, which this process owns (``weaver.kv.owner.PoolOwner``).
- an engine of a colocated group with ``unified_kv`` (``LeaseKeeper``): its block pool takes
  every block from a lease on the pool the gateway hosts (``weaver.kv.owner.HostedPool``),
  synced each step.
Any other engine runs vLLM's scheduler unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler

from weaver.kv.lease import LeasedTenantAllocator
from weaver.kv.owner import PoolClient, PoolOwner
from weaver.kv.pool_plan import PoolPlan
from weaver.patches import routing_kv_cache_manager
from weaver.vllm_ext.additional_config import hot_plans, pool_section
from weaver.vllm_ext.block_pool import AllocatorBlockPool, open_pool_owner
from weaver.vllm_ext.routing_kv_cache_manager import RoutingKVCacheManager
from weaver.weaving.placement import AdaptivePlacement, placement_for
from weaver.weaving.placement_feed import PlacementFeed
from weaver.weaving.plan import remote_block_offsets

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from weaver.weaving.plan import PairPlan

logger = logging.getLogger(__name__)

LEASE_SLACK_BLOCKS = 2  # spare remote blocks beyond what the next step is known to need
STARVED_NAP_S = 0.01  # an idle engine waiting for pool blocks sleeps this long per loop
def connect_pair_load(engine_core: Any) -> None:
    """Once an EngineCore is up: an adaptive hot scheduler reads its pair's load from its
    worker through vLLM's collective_rpc (weaver/vllm_ext/worker.py weaver_pair_load)."""
    scheduler = engine_core.scheduler
    hot = scheduler.weaver_hot if isinstance(scheduler, WeaverScheduler) else None
    if hot is not None and hot.feed is not None:
        rpc = engine_core.model_executor.collective_rpc
        hot.feed.read_pair_load = lambda report: rpc("weaver_pair_load", args=(report,))[0]

class WeaverScheduler(Scheduler):
    """vLLM's scheduler, with at most one collaborator per role the engine has (each None
    otherwise, and then exactly vLLM's scheduler):
    - `weaver_hot` (a weaving hot engine): its remote pools, placement and pair links;
    - `weaver_pool` (a cold engine with unified_kv): the owner of the pool its KV lives in;
    - `weaver_lease` (an engine of a colocated group with unified_kv): every block leased
      from the pool the gateway hosts."""

    weaver_hot: HotRouting | None = None
    weaver_pool: PoolOwner | None = None
    weaver_lease: LeaseKeeper | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pool = pool_section(self.vllm_config)
        if pool is not None:
            if pool[0].tenant(pool[1]).is_owner:
                self.weaver_pool = open_pool_owner(*pool, self.kv_cache_manager.block_pool)
            else:
                self.weaver_lease = LeaseKeeper.for_colocated(self, *pool)
        plans = hot_plans(self.vllm_config)
        if plans:
            self.weaver_hot = HotRouting(self, plans)

    def _pool_lock(self) -> Any:
        """The pool owner's lock around everything that touches vLLM's block pool (the ADBS
        thread evicts prefix-cached blocks under it); no lock for other engines."""
        return self.weaver_pool.lock if self.weaver_pool is not None else contextlib.nullcontext()

    def schedule(self, *args: Any, **kwargs: Any):
        if self.weaver_hot is not None:
            self.weaver_hot.before_schedule(self)
        if self.weaver_pool is not None:
            with self.weaver_pool.lock:
                # The cold model's own next step comes first: take quota back if it is short.
                self.weaver_pool.ensure_owner_blocks(blocks_for_next_step(self))
                return super().schedule(*args, **kwargs)
        if self.weaver_lease is not None:
            self.weaver_lease.before_schedule(self)
        return super().schedule(*args, **kwargs)

    def update_from_output(self, scheduler_output: Any, *args: Any, **kwargs: Any):
        hot = self.weaver_hot
        ran = hot.batch_of(self, scheduler_output) if hot is not None else None
        # The requests that ran, by id: a finished one leaves the scheduler in the update,
        # its output length is read from here after it.
        ran_requests = {r.request_id: r for r in self.running} if ran is not None else None
        with self._pool_lock():
            outputs = super().update_from_output(scheduler_output, *args, **kwargs)
        if ran is not None:
            hot.step_ended(ran, finished_lengths(outputs, ran_requests))
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any):
        with self._pool_lock():
            return super().finish_requests(*args, **kwargs)

    def reset_prefix_cache(self, *args: Any, **kwargs: Any):
        with self._pool_lock():
            return super().reset_prefix_cache(*args, **kwargs)

    def shutdown(self) -> None:
        super().shutdown()
        if self.weaver_hot is not None:
            self.weaver_hot.close()
        if self.weaver_pool is not None:
            self.weaver_pool.close()
        if self.weaver_lease is not None:
            self.weaver_lease.close()


class HotRouting:
    """A weaving hot engine's part of its scheduler: a remote pool per cold engine beside
    the local one (the RoutingKVCacheManager it installs), the placement policy and, under
    `auto`, its feed; each pair's HotLink, ticked before each step; and, when the remote
    blocks live in the cold device's unified pool, the lease on them."""

    def __init__(self, scheduler: WeaverScheduler, plans: list[PairPlan]) -> None:
        local = scheduler.kv_cache_manager
        num_local = local.block_pool.num_gpu_blocks
        self.plans = plans
        remotes = [self._remote_pool(scheduler, num_local + offset, plan.num_remote_blocks)
                   for plan, offset in zip(plans, remote_block_offsets(plans), strict=True)]
        self.lease: LeaseKeeper | None = None
        # Set when the pool's owner restarted: the lease is renewed with the new owner once
        # its region is attached (weaver/vllm_ext/pair_links.py calls cold_restarted).
        self._lease_renewal_due = False
        pooled = [index for index, plan in enumerate(plans) if plan.pool is not None]
        # Which cold's remote blocks are leased (at most one: weaver/weaving/plan.py plans
        # no more); -1: none.
        self.pooled_cold = pooled[0] if pooled else -1
        if len(pooled) > 1:  # weaver/weaving/plan.py plan_pairs refuses it first
            raise ValueError(f"weaving {plans[0].hot}: remote KV leased from more than one "
                             "pool of pages")
        if pooled:
            plan = plans[self.pooled_cold]
            # The remote blocks are the hot tenant's blocks of a pool of pages on the cold
            # side (the cold device's unified pool, or the loan pool the gateway hosts):
            # leased from its allocator, synced every step.
            lease = LeasedTenantAllocator(
                PoolClient(plan.pool), plan.hot, plan.pool.max_blocks(plan.hot),
                # before_schedule sets the target every step; this is the first one's.
                lease_blocks=plan.max_blocks_per_seq)
            first_id = num_local + remote_block_offsets(plans)[self.pooled_cold]
            AllocatorBlockPool.adopt(remotes[self.pooled_cold].block_pool, lease, plan.hot,
                                     first_id)
            self.lease = LeaseKeeper(lease, is_local=False, cold=self.pooled_cold)
        # Each pair's HotLink (weaver/weaving/pair_link.py), in plan order, set once the
        # EngineCore is up (weaver/vllm_ext/pair_links.py).
        self.links: list[Any] = []
        # One policy for the hot engine (a deployment's weaving entry holds its settings
        # for every cold it names).
        first = plans[0]
        self.placement = placement_for(first.offload_ratio, first.adaptive_targets())
        # offload_ratio auto: each step's time and batch, and the pairs' load, for the policy
        self.feed = (PlacementFeed(self.placement, first.hot)
                     if isinstance(self.placement, AdaptivePlacement) else None)
        # vLLM's FCFS preemption takes running[-1] (tests/vllm_ext/test_drift.py pins it);
        # under the priority policy the victim is chosen otherwise and is left alone.
        fcfs = scheduler.policy == SchedulingPolicy.FCFS
        routing_kv_cache_manager.install(scheduler, RoutingKVCacheManager(
            local, remotes, num_local, self.placement, remote_available=self.remote_available,
            running=(lambda: scheduler.running) if fcfs else None))
        for plan in plans:
            logger.info("weaving %s -> %s: %d local + %d remote KV blocks, offload ratio %s",
                        plan.hot, plan.cold, num_local, plan.num_remote_blocks,
                        plan.offload_ratio)

    @staticmethod
    def _remote_pool(scheduler: WeaverScheduler, first_id: int,
                     num_blocks: int) -> KVCacheManager:
        """A KVCacheManager that hands out exactly the ids [first_id, first_id + num_blocks)."""
        config = copy.deepcopy(scheduler.kv_cache_config)
        config.num_blocks = first_id + num_blocks
        remote = KVCacheManager(
            kv_cache_config=config,
            max_model_len=scheduler.max_model_len,
            max_in_flight_tokens=scheduler.vllm_config.max_in_flight_tokens,
            enable_caching=False,
            scheduler_block_size=scheduler.block_size,
            hash_block_size=scheduler.hash_block_size,
        )
        # Block 0 is the pool's null block; pin 1..first_id-1 so that it hands out only
        # ids above the local range and the earlier colds' ranges.
        remote.block_pool.get_new_blocks(first_id - 1)
        return remote

    def remote_available(self, cold: int) -> bool:
        """Sequences go to a cold engine only while its region is attached (its pair's
        HotLink) and, leased from a unified pool, while its owner is there."""
        if cold >= len(self.links) or not self.links[cold].connected:
            return False
        return (self.lease is None or cold != self.pooled_cold
                or self.lease.lease.broken_reason is None)

    def before_schedule(self, scheduler: WeaverScheduler) -> None:
        for link in self.links:
            link.tick()
        if self.feed is not None:
            manager = scheduler.kv_cache_manager
            shed_remote(scheduler, self.feed.step_starts(num_running_on=[
                manager.num_running_on(cold) for cold in range(len(self.plans))]))
        if self.lease is not None:
            if (self._lease_renewal_due and self.links[self.pooled_cold].connected
                    and not self.lease.lease.num_held_blocks):
                self.lease.renew()
                self._lease_renewal_due = False
            self.lease.before_schedule(scheduler)

    def cold_restarted(self, scheduler: WeaverScheduler) -> None:
        """The cold engine that owns the unified pool restarted and made the pool again,
        under the same names; its new region is about to be attached. Whatever this engine
        holds of the old pool goes first: the lease stops, and the requests whose blocks
        are there are preempted (vLLM recomputes them later, placed where memory then is),
        since the new owner hands out the same block ids. The lease is renewed once the new
        region is attached (before_schedule). A loan pool (no owner) is the gateway's and
        outlives the cold engine: the lease and the blocks in it stay."""
        if self.lease is None or self.plans[self.pooled_cold].pool.owner is None:
            return
        self.lease.lease.void("the unified pool's owner restarted")
        freed, num_preempted = self.lease.preempt_leased(scheduler)
        self._lease_renewal_due = True
        logger.warning("the unified pool's owner %r restarted: %d remote requests preempted "
                       "(%d blocks of the old pool); the lease is renewed once its new region "
                       "is attached", self.plans[self.pooled_cold].cold, num_preempted,
                       freed)

    def batch_of(self, scheduler: WeaverScheduler, scheduler_output: Any
                 ) -> tuple[int, int, bool] | None:
        """(local, remote) requests in the step that just ran, and whether it ran decodes
        only (one token each: no prompt chunk in it); None without an adaptive feed."""
        if self.feed is None:
            return None
        num_remote = scheduler.kv_cache_manager.num_running_remote
        is_decode_only = (scheduler_output.total_num_scheduled_tokens
                          == len(scheduler_output.num_scheduled_tokens))
        return len(scheduler.running) - num_remote, num_remote, is_decode_only

    def step_ended(self, ran: tuple[int, int, bool], finished: list[int]) -> None:
        """The step that `batch_of` described ended, finishing requests of these output
        lengths (the policy's TPOT tail, weaver/weaving/tpot_tail.py)."""
        assert self.feed is not None, "batch_of returns None without a feed"
        self.feed.step_ended(*ran)
        for num_output_tokens in finished:
            self.feed.sequence_finished(num_output_tokens)

    def close(self) -> None:
        for link in self.links:
            link.close()
        if self.lease is not None:
            self.lease.close()


class LeaseKeeper:
    """A lease on a unified KV pool, kept each step to what the next step needs: a hot
    engine's remote blocks, or (`is_local`) every block of a colocated engine whose group
    keeps its KV in one pool. When the pool's owner asks memory back, requests whose blocks
    are leased are preempted (and recomputed later, by vLLM's own preemption)."""

    def __init__(self, lease: LeasedTenantAllocator, is_local: bool, cold: int = -1) -> None:
        self.lease = lease
        self.is_local = is_local
        # A hot engine's: the index (plan order) of the cold whose remote blocks are leased.
        self.cold = cold
        self.num_reclaim_preemptions = 0  # requests preempted to give memory back
        # What the current owner has been told of them: a restarted owner counts from 0
        # (the gateway forgets the old one's totals).
        self._preemptions_before_owner = 0

    @classmethod
    def for_colocated(cls, scheduler: WeaverScheduler, plan: PoolPlan,
                      tenant: str) -> LeaseKeeper:
        """A colocated engine's KV lives in its group's pool: vLLM's block pool takes blocks
        from a lease on it. A cached free block would keep its pages in the lease, out of
        ADBS's reach while this engine idles (an idle engine never syncs), so the engine
        runs without prefix caching (weaver serve sets it; a user's flag is refused)."""
        if scheduler.cache_config.enable_prefix_caching:
            raise ValueError(
                f"{tenant!r} keeps its KV in the colocated group's pool {plan.pool_name!r}, "
                "which needs prefix caching off; remove enable_prefix_caching from its "
                "engine arguments")
        lease = LeasedTenantAllocator(
            PoolClient(plan), tenant, plan.max_blocks(tenant),
            lease_blocks=-(-scheduler.max_model_len // scheduler.block_size))
        AllocatorBlockPool.adopt(scheduler.kv_cache_manager.block_pool, lease, tenant,
                                 plan.tenant(tenant).first_block_id)
        logger.info("%s leases every KV block from pool %s (up to %d blocks)", tenant,
                    plan.pool_name, plan.max_blocks(tenant))
        return cls(lease, is_local=True)

    def before_schedule(self, scheduler: WeaverScheduler) -> None:
        # Spares for what the next step may take (+ slack), no more: idle spares are pages
        # the pool's other tenants and ADBS cannot use.
        target = blocks_for_next_step(scheduler, None if self.is_local else self.cold) \
            + LEASE_SLACK_BLOCKS
        if self.lease.sync(target):
            self._give_back(scheduler, self.lease.num_to_release)
        elif self.lease.is_starved and not scheduler.running and scheduler.waiting:
            # Nothing can run until the pool has blocks again, and vLLM's engine loop calls
            # schedule() back to back: nap instead of spinning on a shared core.
            time.sleep(STARVED_NAP_S)

    def _give_back(self, scheduler: WeaverScheduler, num_blocks: int) -> None:
        """Preempt requests whose blocks are leased until their blocks cover what the
        owner's allocator asks back, and hand those blocks over."""
        freed, num_preempted = self.preempt_leased(scheduler, num_blocks)
        self.num_reclaim_preemptions += num_preempted
        self.lease.report["reclaim_preemptions"] = (self.num_reclaim_preemptions
                                                    - self._preemptions_before_owner)
        logger.info("gave %d leased blocks back to the pool: %d requests preempted",
                    freed, num_preempted)
        self.lease.sync(0)  # hand the freed blocks over now, take none

    def preempt_leased(self, scheduler: WeaverScheduler,
                       num_blocks: int | None = None) -> tuple[int, int]:
        """Preempt running requests whose blocks are leased (a hot engine's remote ones; any
        of a colocated engine's), newest first, until their blocks cover `num_blocks` (None:
        all of them). They return to the waiting queue and are recomputed later, placed
        where the memory then is. Returns (blocks freed, requests preempted)."""
        manager = scheduler.kv_cache_manager
        victims, freed = [], 0
        for request in reversed(scheduler.running):
            if num_blocks is not None and freed >= num_blocks:
                break
            if self.is_local or manager.cold_of.get(request.request_id) == self.cold:
                victims.append(request)
                freed += len(manager.get_block_ids(request.request_id)[0])
        preempt(scheduler, victims)
        return freed, len(victims)

    def renew(self) -> None:
        """Lease from the pool's new owner (its engine restarted): the same address and
        key, a new connection."""
        client = self.lease.client
        with contextlib.suppress(OSError, EOFError):
            client.close()  # the old owner's connection; the next call opens a new one
        self.lease.renew(client)
        self._preemptions_before_owner = self.num_reclaim_preemptions

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):  # the owner may be gone already
            self.lease.client.close()


def preempt(scheduler: Scheduler, victims: list[Request]) -> None:
    """vLLM's own preemption of these running requests: their blocks freed, back to the
    waiting queue, recomputed later (placed where the memory then is)."""
    now = time.monotonic()
    for request in victims:
        scheduler.running.remove(request)
        scheduler._preempt_request(request, now)


def shed_remote(scheduler: Scheduler, shed: list[int]) -> None:
    """Preempt the newest `shed[i]` running requests whose KV is on the i-th cold (its
    TPOT is over its budget: weaver/weaving/placement.py shed_for_cold)."""
    cold_of = scheduler.kv_cache_manager.cold_of
    for cold, num in enumerate(shed):
        if num:
            preempt(scheduler, [request for request in reversed(scheduler.running)
                                if cold_of.get(request.request_id) == cold][:num])


def finished_lengths(outputs: dict[int, Any], ran: dict[str, Any]) -> list[int]:
    """The output lengths of the requests of `ran` (id -> vLLM Request) that the step's
    outputs (update_from_output's: client index -> EngineCoreOutputs) finished."""
    return [ran[out.request_id].num_output_tokens
            for engine_outputs in outputs.values() for out in engine_outputs.outputs
            if out.finish_reason is not None and out.request_id in ran]


def blocks_for_next_step(scheduler: Scheduler, on_cold: int | None = None) -> int:
    """New blocks the next step needs at most: one per running request that fills its last
    block, plus the whole prompt of the first waiting request (`on_cold`: counting only the
    running requests whose KV is remote on that cold, by plan order)."""
    manager, block_size = scheduler.kv_cache_manager, scheduler.block_size
    need = 0
    for request in scheduler.running:
        if on_cold is not None and manager.cold_of.get(request.request_id) != on_cold:
            continue
        held = len(manager.get_block_ids(request.request_id)[0])
        need += max(0, -(-(request.num_computed_tokens + 1) // block_size) - held)
    if scheduler.waiting:
        request = scheduler.waiting.peek_request()
        need += -(-request.num_tokens // block_size)
    return need
