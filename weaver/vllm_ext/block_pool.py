"""vLLM's BlockPool allocating through the unified KV pool's allocator.

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

For a pool engine (the cold engine) the allocator lives in its scheduler's process
(``weaver.kv.owner.PoolOwner``), behind the ``LockedKVAllocator``, which mirrors every
block's pages into the shared page table that the workers map; a hot engine's remote
blocks come from its lease (``weaver.kv.lease``). Prefix caching works: a cached block
keeps its pages after vLLM frees it until vLLM reuses it or the pool needs the pages
(``AllocatorBlockPool.evict_cached``, run by the ADBS thread under ``PoolOwner.lock``,
which the scheduler holds while it touches its blocks). The class of vLLM's own instance
is swapped (patches/block_pool_class.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from weaver.kv.owner import PoolOwner
from weaver.kv.pool_plan import PoolPlan
from weaver.patches import block_pool_class


class AllocatorBlockPool(BlockPool):
    """vLLM's BlockPool whose blocks are backed by pages of the unified pool.

    With prefix caching on (the cold engine, the pool's owner), a block vLLM frees while it
    is cached keeps its pages, so a later prefix hit reads what was written: a block holds
    pages exactly while a request uses it or while it is cached. Cached free blocks
    (``weaver_cached``, least recently freed first, as vLLM's free queue evicts them) are
    the tenant's evictable pages: vLLM's own allocations reuse them when the quota has no
    new pages left, and ``evict_cached`` gives them back to the pool when the quota shrinks
    under them (ADBS lends an idle cold model's memory; ``PoolOwner`` calls it)."""

    weaver_allocator: Any  # LockedKVAllocator, or a lease with its methods
    weaver_tenant: str
    weaver_first_block_id: int
    weaver_cached: dict[int, None]  # free blocks that keep pages for the prefix cache
    weaver_counting_vllm_blocks = False  # get_num_free_blocks as vLLM's own count

    @classmethod
    def adopt(cls, pool: BlockPool, allocator: Any, tenant: str,
              first_block_id: int) -> AllocatorBlockPool:
        num_ids = pool.num_gpu_blocks - first_block_id
        if first_block_id < 1 or num_ids < allocator.max_blocks(tenant):
            raise ValueError(
                f"tenant {tenant!r} may hold {allocator.max_blocks(tenant)} blocks but the "
                f"engine has ids [{first_block_id}, {pool.num_gpu_blocks}) for them; give the "
                "engine a KV budget of the whole pool"
            )
        block_pool_class.adopt(pool, cls)
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

    def weaver_lendable_blocks(self) -> int:
        """The free blocks a new sequence could get here: a lease's spares cover only the
        next step, so the blocks its quota would still grant (as of the last sync) count
        too. What a hot engine weighs its colds by (routing_kv_cache_manager.py)."""
        return self.get_num_free_blocks() + getattr(self.weaver_allocator, "num_room_blocks", 0)

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


def open_pool_owner(plan: PoolPlan, tenant: str, block_pool: BlockPool) -> PoolOwner:
    """Own the unified pool of `plan` in this (the cold engine's scheduler) process, with
    the engine's block pool allocating through it as `tenant`."""
    return PoolOwner(plan, tenant, lambda allocator: AllocatorBlockPool.adopt(
        block_pool, allocator, tenant, plan.tenant(tenant).first_block_id))
