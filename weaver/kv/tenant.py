"""Per-tenant state of the unified allocator: its blocks, dense block ids, quota and flags.

Only ``UnifiedKVAllocator`` mutates it; it is a separate module so the allocator file keeps
to the pool-wide rules and the snapshot format of one tenant sits next to its fields."""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field
from typing import Any

from weaver.kv.pages import TenantShape
from weaver.kv.records import BlockHandle, ShrinkTicket, TenantStats


@dataclass
class TenantState:
    name: str
    shape: TenantShape
    page_bytes: int
    quota_pages: int
    min_quota_pages: int = 0
    is_owner: bool = False
    blocks: dict[int, BlockHandle] = field(default_factory=dict)
    free_block_ids: list[int] = field(default_factory=list)  # a heap: lowest id first
    next_block_id: int = 0
    is_starved: bool = False  # an allocation failed since the last rebalance
    num_failed_allocations: int = 0
    shrink: ShrinkTicket | None = None
    pages_per_block: int = field(init=False)
    pages_per_head_block: int = field(init=False)

    def __post_init__(self) -> None:
        self.pages_per_block = self.shape.pages_per_block(self.page_bytes)
        self.pages_per_head_block = self.shape.pages_per_head_block(self.page_bytes)

    @property
    def num_used_pages(self) -> int:
        return len(self.blocks) * self.pages_per_block

    @property
    def num_pages_over_quota(self) -> int:
        return max(0, self.num_used_pages - self.quota_pages)

    def add_block(self, page_ids: tuple[int, ...]) -> BlockHandle:
        """Record a new block on ``page_ids`` under the lowest free block id."""
        if self.free_block_ids:
            block_id = heapq.heappop(self.free_block_ids)
        else:
            block_id = self.next_block_id
            self.next_block_id += 1
        block = BlockHandle(
            self.name, block_id, page_ids, self.shape.num_kv_heads, self.pages_per_head_block
        )
        self.blocks[block_id] = block
        return block

    def remove_block(self, block_id: int) -> BlockHandle:
        block = self.blocks.pop(block_id)
        heapq.heappush(self.free_block_ids, block_id)
        return block

    def stats(self) -> TenantStats:
        used = self.num_used_pages
        return TenantStats(
            name=self.name,
            is_owner=self.is_owner,
            num_blocks=len(self.blocks),
            num_used_pages=used,
            quota_pages=self.quota_pages,
            pages_per_block=self.pages_per_block,
            utilisation=used / self.quota_pages if self.quota_pages else 0.0,
            num_failed_allocations=self.num_failed_allocations,
            is_shrinking=self.shrink is not None,
            num_pages_over_quota=self.num_pages_over_quota,
        )

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": asdict(self.shape),
            "quota_pages": self.quota_pages,
            "min_quota_pages": self.min_quota_pages,
            "is_owner": self.is_owner,
            "blocks": [[b.block_id, list(b.page_ids)] for b in self.blocks.values()],
            "free_block_ids": list(self.free_block_ids),
            "next_block_id": self.next_block_id,
            "is_starved": self.is_starved,
            "num_failed_allocations": self.num_failed_allocations,
            "shrink": asdict(self.shrink) if self.shrink else None,
        }

    @classmethod
    def from_snapshot(cls, entry: dict[str, Any], page_bytes: int) -> TenantState:
        state = cls(
            name=entry["name"],
            shape=TenantShape(**entry["shape"]),
            page_bytes=page_bytes,
            quota_pages=entry["quota_pages"],
            min_quota_pages=entry["min_quota_pages"],
            is_owner=entry["is_owner"],
            free_block_ids=list(entry["free_block_ids"]),
            next_block_id=entry["next_block_id"],
            is_starved=entry["is_starved"],
            num_failed_allocations=entry["num_failed_allocations"],
            shrink=ShrinkTicket(**entry["shrink"]) if entry["shrink"] else None,
        )
        heapq.heapify(state.free_block_ids)
        for block_id, pages in entry["blocks"]:
            state.blocks[block_id] = BlockHandle(
                state.name,
                block_id,
                tuple(pages),
                state.shape.num_kv_heads,
                state.pages_per_head_block,
            )
        return state
