"""A vLLM-style block-id view of one tenant of the unified pool.

vLLM's scheduler thinks in integer block ids handed out by a ``BlockPool``
(``vllm/v1/core/block_pool.py``: ``get_new_blocks``, ``free_blocks``,
``get_num_free_blocks``), and the worker indexes its KV tensor with them. A tenant of the
unified pool sees the same world through this view: its blocks get stable ids in the
contiguous range ``[first_block_id, first_block_id + num_block_ids)`` (for a hot model's
remote pool, ``first_block_id`` is the number of local blocks, so remote ids follow the
local ones, as weaver/vllm_ext/scheduler.py numbers them), and the page
mapping stays behind the view in ``page_table``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from weaver.kv.allocator import UnifiedKVAllocator
from weaver.kv.records import BlockHandle
from weaver.kv.service import LockedKVAllocator


class TenantBlockView:
    """Dense integer block ids for one tenant, backed by the allocator's pages.

    Pass the ``LockedKVAllocator`` when other threads share the allocator (and to keep a
    ``SharedPageTable`` in step)."""

    def __init__(
        self,
        allocator: UnifiedKVAllocator | LockedKVAllocator,
        tenant: str,
        first_block_id: int = 0,
    ):
        if first_block_id < 0:
            raise ValueError(f"first_block_id must be >= 0, got {first_block_id}")
        self.allocator = allocator
        self.tenant = tenant
        self.first_block_id = first_block_id
        self.num_block_ids = allocator.max_blocks(tenant)
        shape = allocator.shape(tenant)
        self._num_layers = shape.num_layers
        self._num_kv_heads = shape.num_kv_heads
        self._pages_per_head_block = shape.pages_per_head_block(allocator.page_bytes)

    @property
    def block_id_range(self) -> range:
        return range(self.first_block_id, self.first_block_id + self.num_block_ids)

    def get_num_free_blocks(self) -> int:
        """Blocks the tenant can get right now (quota and pool both allow)."""
        return self.allocator.num_allocatable_blocks(self.tenant)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """``num_blocks`` new block ids, all or none, like ``BlockPool.get_new_blocks``."""
        blocks = self.allocator.allocate_blocks(self.tenant, num_blocks)
        if blocks is None:  # BlockPool raises here too; the scheduler checks the count first
            raise ValueError(
                f"cannot get {num_blocks} free blocks for tenant {self.tenant!r}: "
                f"{self.get_num_free_blocks()} available; check get_num_free_blocks() first"
            )
        return [self.first_block_id + block.block_id for block in blocks]

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        self.allocator.free_blocks(self.tenant, [self._local_id(b) for b in block_ids])

    def handle(self, block_id: int) -> BlockHandle:
        return self.allocator.get_block(self.tenant, self._local_id(block_id))

    def page_table(self, block_ids: Iterable[int]) -> np.ndarray:
        """Page ids as ``[num_blocks, num_layers, num_kv_heads, pages_per_head_block]`` int64:
        the address table a kernel needs to find (block, layer, head) in the pool."""
        rows = [self.handle(block_id).page_ids for block_id in block_ids]
        return np.asarray(rows, dtype=np.int64).reshape(
            len(rows), self._num_layers, self._num_kv_heads, self._pages_per_head_block
        )

    def _local_id(self, block_id: int) -> int:
        if block_id not in self.block_id_range:
            raise ValueError(
                f"block id {block_id} is outside tenant {self.tenant!r}'s range "
                f"[{self.block_id_range.start}, {self.block_id_range.stop})"
            )
        return block_id - self.first_block_id
