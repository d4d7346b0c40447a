"""The cold engine's scheduler allocates its KV blocks through the unified pool (issue 6).

vLLM's scheduler hands out block ids from its `BlockPool` (``vllm/v1/core/block_pool.py``).
For an engine whose KV lives in the unified pool, every block it takes must also get pages
from the pool's `UnifiedKVAllocator`, within the tenant's quota, and give them back when
vLLM frees it. `AllocatorBlockPool` does that by adopting the engine's own `BlockPool`
(composed, not copied: vLLM's free queue, ref counts and null block stay as they are):

- ``get_num_free_blocks`` is the smaller of vLLM's count and the allocator's (quota and
  pool both allow), so admission and preemption follow the quota;
- ``get_new_blocks`` asks the allocator for pages and hands out exactly the block ids it
  returned (the tenant's block b is vLLM's ``first_block_id + b``);
- ``free_blocks`` returns the pages of every block whose last reference went away.

The allocator lives in this process (the scheduler is its main client) behind the
``LockedKVAllocator``, which mirrors every block's pages into the shared page table that
the workers map. Prefix caching works: a cached block keeps its pages after vLLM frees it
until vLLM reuses it or the pool needs the pages (``AllocatorBlockPool.evict_cached``,
run by the ADBS thread under ``PoolOwner.lock``, which the scheduler holds while it
touches its blocks).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict
from multiprocessing.connection import Client, Listener

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from weaver.kv.pool_plan import PoolPlan
from weaver.kv.service import (
    KVAllocatorClient,
    KVAllocatorService,
    LockedKVAllocator,
    serve_connection,
)
from weaver.kv.shared_table import SharedPageTable

logger = logging.getLogger(__name__)


class AllocatorBlockPool(BlockPool):
    """vLLM's BlockPool whose blocks are backed by pages of the unified pool.

    With prefix caching on (the cold engine, the pool's owner), a block vLLM frees while it
    is cached keeps its pages, so a later prefix hit reads what was written: a block holds
    pages exactly while a request uses it or while it is cached. Cached free blocks
    (``weaver_cached``, least recently freed first, as vLLM's free queue evicts them) are
    the tenant's evictable pages: vLLM's own allocations reuse them when the quota has no
    new pages left, and ``evict_cached`` gives them back to the pool when the quota shrinks
    under them (ADBS lends an idle cold model's memory; ``PoolOwner`` calls it)."""

    weaver_allocator: LockedKVAllocator
    weaver_tenant: str
    weaver_first_block_id: int
    weaver_cached: dict[int, None]  # free blocks that keep pages for the prefix cache
    weaver_counting_vllm_blocks = False  # get_num_free_blocks as vLLM's own count

    @classmethod
    def adopt(cls, pool: BlockPool, allocator: LockedKVAllocator, tenant: str,
              first_block_id: int) -> AllocatorBlockPool:
        num_ids = pool.num_gpu_blocks - first_block_id
        if first_block_id < 1 or num_ids < allocator.max_blocks(tenant):
            raise ValueError(
                f"tenant {tenant!r} may hold {allocator.max_blocks(tenant)} blocks but the "
                f"engine has ids [{first_block_id}, {pool.num_gpu_blocks}) for them; give the "
                "engine a KV budget of the whole pool"
            )
        pool.__class__ = cls
        pool.weaver_allocator = allocator
        pool.weaver_tenant = tenant
        pool.weaver_first_block_id = first_block_id
        pool.weaver_cached = {}
        return pool  # type: ignore[return-value]

    def get_num_free_blocks(self) -> int:
        if self.weaver_counting_vllm_blocks:
            return super().get_num_free_blocks()
        return min(super().get_num_free_blocks(),
                   self.weaver_allocator.num_allocatable_blocks(self.weaver_tenant)
                   + len(self.weaver_cached))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        # New pages first (vLLM too hands out uncached blocks before evicting cached
        # ones); then the least recently freed cached blocks, which keep their pages.
        num_new = min(num_blocks,
                      self.weaver_allocator.num_allocatable_blocks(self.weaver_tenant))
        if num_blocks - num_new > len(self.weaver_cached):
            # vLLM checks get_num_free_blocks first, so this is a bug
            raise ValueError(
                f"cannot get {num_blocks} blocks for tenant {self.weaver_tenant!r} from the "
                f"unified pool ({self.get_num_free_blocks()} free)"
            )
        handles = self.weaver_allocator.allocate_blocks(self.weaver_tenant, num_new) or []
        if len(handles) != num_new:
            raise ValueError(f"the unified pool refused {num_new} blocks it had just offered "
                             f"to tenant {self.weaver_tenant!r}")
        blocks = [self.blocks[self.weaver_first_block_id + h.block_id] for h in handles]
        reused = [self.blocks[block_id] for block_id in list(self.weaver_cached)[
            :num_blocks - num_new]]
        for block in reused:
            del self.weaver_cached[block.block_id]
            self._maybe_evict_cached_block(block)
        for block in blocks + reused:
            if block.ref_cnt != 0 or block.is_null:
                raise RuntimeError(
                    f"the allocator handed out block {block.block_id}, which vLLM holds "
                    f"(ref_cnt {block.ref_cnt}): the pool and the engine disagree"
                )
            self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if self.metrics_collector:
                self.metrics_collector.on_block_allocated(block)
        return blocks + reused

    def _is_cached(self, block: KVCacheBlock) -> bool:
        return self.enable_caching and (block.block_hash is not None
                                        or block.block_id in self.cached_block_hashes_by_block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        ordered = list(ordered_blocks)
        super().free_blocks(ordered)
        released = []
        for block in ordered:
            if block.ref_cnt or block.is_null or block.pool not in (None, self):
                continue
            if self._is_cached(block):
                self.weaver_cached[block.block_id] = None  # keeps its pages
            else:
                released.append(block.block_id)
        self._release_pages(released)

    def touch(self, blocks) -> None:
        for block in blocks:  # a prefix hit on a free cached block: in use again
            if block.ref_cnt == 0:
                self.weaver_cached.pop(block.block_id, None)
        super().touch(blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        self._release_uncached()

    def reset_prefix_cache(self) -> bool:
        # vLLM resets only when no request holds a block, which it checks by its free
        # count: its own, not the quota-bounded one admission sees.
        self.weaver_counting_vllm_blocks = True
        try:
            reset = super().reset_prefix_cache()
        finally:
            self.weaver_counting_vllm_blocks = False
        self._release_uncached()
        return reset

    @property
    def num_evictable_pages(self) -> int:
        return len(self.weaver_cached) * self.weaver_allocator.pages_per_block(
            self.weaver_tenant)

    def evict_cached(self, num_blocks: int) -> int:
        """Drop up to ``num_blocks`` cached free blocks from the prefix cache (least
        recently freed first) and give their pages back to the pool; returns how many."""
        victims = [self.blocks[b] for b in list(self.weaver_cached)[:max(0, num_blocks)]]
        for block in victims:
            del self.weaver_cached[block.block_id]
            self._maybe_evict_cached_block(block)  # stays in vLLM's free queue, uncached
        self._release_pages([block.block_id for block in victims])
        return len(victims)

    def _release_uncached(self) -> None:
        """Cached free blocks whose hashes vLLM dropped (evict_blocks, reset_prefix_cache)
        hold nothing worth keeping: their pages go back."""
        dropped = [b for b in self.weaver_cached if not self._is_cached(self.blocks[b])]
        for block_id in dropped:
            del self.weaver_cached[block_id]
        self._release_pages(dropped)

    def _release_pages(self, block_ids: list[int]) -> None:
        if block_ids:
            self.weaver_allocator.free_blocks(
                self.weaver_tenant, [b - self.weaver_first_block_id for b in sorted(block_ids)])


class PoolOwner:
    """The allocator of one cold device's pool, its shared page table, the engine block
    pool that allocates through it (in the cold engine's scheduler process), and, when the
    plan names a service address, the listener that serves the other tenants' leases."""

    def __init__(self, plan: PoolPlan, tenant: str, block_pool: BlockPool) -> None:
        self.plan = plan
        self.tenant = tenant
        allocator = plan.build_allocator()
        self.page_table = SharedPageTable.create(plan.table_name, allocator)
        self.allocator = LockedKVAllocator(allocator, self.page_table)
        # Held by the scheduler while it allocates, frees or looks up cached blocks (vLLM's
        # BlockPool is single-threaded) and by the ADBS thread while it evicts cached ones.
        self.lock = threading.RLock()
        self._listener: Listener | None = None
        try:
            self.block_pool = AllocatorBlockPool.adopt(
                block_pool, self.allocator, tenant, plan.tenant(tenant).first_block_id)
            if plan.service_address:
                self._listener = Listener(plan.service_address, family="AF_UNIX",
                                          authkey=bytes.fromhex(plan.authkey_hex))
                threading.Thread(target=self._accept, name="weaver-kv-pool-service",
                                 daemon=True).start()
        except Exception:
            self.page_table.close()
            raise
        self.num_cache_evictions = 0  # cached blocks dropped to lend their pages
        self.num_reclaims = 0  # times the owner took quota back for its own requests
        self.num_reclaimed_blocks = 0
        self._stop = threading.Event()
        self._rebalancer: threading.Thread | None = None
        if plan.rebalance_interval_s > 0:
            self._rebalancer = threading.Thread(target=self._rebalance_loop,
                                                name="weaver-kv-pool-adbs", daemon=True)
            self._rebalancer.start()
        logger.info(
            "unified KV pool %s: %d pages of %d bytes; tenant %s allocates through it "
            "(quota %d pages = %d blocks)", plan.pool_name, plan.num_pages, plan.page_bytes,
            tenant, plan.tenant(tenant).quota_pages,
            plan.tenant(tenant).quota_pages // allocator.pages_per_block(tenant))

    def _accept(self) -> None:
        service = KVAllocatorService(self.allocator)
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):  # closed, or a peer that failed authentication
                if self._listener is None:
                    return
                logger.warning("unified KV pool %s: a connection was refused or broken",
                               self.plan.pool_name)
                continue
            threading.Thread(target=serve_connection, args=(service, conn),
                             name="weaver-kv-pool-client", daemon=True).start()

    def ensure_owner_blocks(self, num_blocks: int) -> int:
        """Make room for ``num_blocks`` more blocks of the owner (the cold model's next step):
        when its quota is short, take quota back from the other tenants
        (``reclaim_for_owner``: unassigned pages, their unused quota, then shrinks that their
        schedulers pay by preempting remote requests). Returns the blocks reclaimed."""
        new_blocks = self.allocator.num_allocatable_blocks(self.tenant)
        # Cached free blocks keep their pages (inside the quota) and are reused first.
        deficit = num_blocks - new_blocks - len(self.block_pool.weaver_cached)
        if deficit <= 0:
            return 0
        owner = self.allocator.tenant_stats(self.tenant)
        pages_per_block = owner.pages_per_block
        # Quota the owner already has but cannot use yet: pages other tenants still hold
        # over their (shrunk) quota; they come back as those tenants release blocks.
        waiting = max(0, owner.quota_pages - owner.num_used_pages - new_blocks * pages_per_block)
        missing = deficit * pages_per_block - waiting
        available = self.allocator.num_pages - owner.quota_pages
        pages = min(max(0, missing), available)
        if pages <= 0:
            return 0
        tickets = self.allocator.reclaim_for_owner(pages)
        self.num_reclaims += 1
        self.num_reclaimed_blocks += pages // pages_per_block
        logger.info("unified KV pool %s: %s reclaims %d pages (%d shrink tickets)",
                    self.plan.pool_name, self.tenant, pages, len(tickets))
        return pages // pages_per_block

    def _rebalance_loop(self) -> None:
        while not self._stop.wait(self.plan.rebalance_interval_s):
            try:
                self.rebalance()
                if not self._stop.is_set():
                    self._publish_stats()
            except Exception:  # a bookkeeping bug must show, not stop the engine
                logger.exception("unified KV pool %s: rebalance failed", self.plan.pool_name)

    def rebalance(self) -> dict[str, int]:
        """One ADBS round. The owner's prefix-cached free blocks count as unused (an idle
        cold model lends its memory even with a warm cache); those its new quota no longer
        covers are evicted before the lock is let go."""
        with self.lock:
            deltas = self.allocator.rebalance(
                {self.tenant: self.block_pool.num_evictable_pages})
            owner = self.allocator.tenant_stats(self.tenant)
            if owner.num_pages_over_quota:
                self.num_cache_evictions += self.block_pool.evict_cached(
                    -(-owner.num_pages_over_quota // owner.pages_per_block))
        return deltas

    def _publish_stats(self) -> None:
        path = self.plan.stats_path
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as out:
            json.dump(self.stats(), out)
        os.replace(tmp, path)

    def stats(self) -> dict:
        return {"pool": self.plan.pool_name, "owner": self.tenant,
                "num_reclaims": self.num_reclaims,
                "num_reclaimed_blocks": self.num_reclaimed_blocks,
                "num_cache_evictions": self.num_cache_evictions,
                "num_cached_blocks": len(self.block_pool.weaver_cached),
                "tenant_reports": dict(self.allocator.tenant_reports),
                **asdict(self.allocator.stats())}

    def close(self) -> None:
        self._stop.set()
        if self._rebalancer is not None:
            self._rebalancer.join(timeout=5)
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        self.page_table.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.plan.stats_path)


class PoolClient:
    """A remote tenant's connection to the owner's allocator service, opened at the first
    call (the owner, the cold engine, may start after the hot engine's scheduler exists;
    the first call comes with the first request, when every engine is up)."""

    CONNECT_TIMEOUT_S = 30.0

    def __init__(self, plan: PoolPlan) -> None:
        self.plan = plan
        self._client: KVAllocatorClient | None = None

    def call(self, op: str, **kwargs):
        if self._client is None:
            self._client = KVAllocatorClient(self._connect())
        return self._client.call(op, **kwargs)

    def _connect(self):
        deadline = time.monotonic() + self.CONNECT_TIMEOUT_S
        while True:
            try:
                return Client(self.plan.service_address, family="AF_UNIX",
                              authkey=bytes.fromhex(self.plan.authkey_hex))
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
