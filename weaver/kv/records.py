"""The records the allocator hands out: block handles, shrink tickets and metrics.

Plain frozen dataclasses, so they compare by value, pickle, and turn into JSON with
``dataclasses.asdict`` (the service sends them to other processes that way)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockHandle:
    """One live logical block and its address table.

    ``page_ids`` lists the pages in (layer, head, sub-page) row-major order."""

    tenant: str
    block_id: int
    page_ids: tuple[int, ...]
    num_kv_heads: int
    pages_per_head_block: int

    def page_id(self, layer: int, head: int, sub_page: int = 0) -> int:
        """The page holding part ``sub_page`` of (layer, head)'s K/V for this block."""
        if not (0 <= head < self.num_kv_heads and 0 <= sub_page < self.pages_per_head_block):
            raise ValueError(
                f"head {head} / sub_page {sub_page} out of range: the tenant has "
                f"{self.num_kv_heads} KV heads and {self.pages_per_head_block} pages per head"
            )
        index = (layer * self.num_kv_heads + head) * self.pages_per_head_block + sub_page
        if layer < 0 or index >= len(self.page_ids):
            raise ValueError(f"layer {layer} out of range for block {self.block_id}")
        return self.page_ids[index]


@dataclass(frozen=True)
class ShrinkTicket:
    """A quota cut the tenant's owner has to finish by freeing or migrating blocks."""

    ticket_id: int
    tenant: str
    old_quota_pages: int
    new_quota_pages: int
    num_blocks_to_release: int  # at the time the ticket was issued


@dataclass(frozen=True)
class TenantStats:
    name: str
    is_owner: bool
    num_blocks: int
    num_used_pages: int
    quota_pages: int
    pages_per_block: int
    utilisation: float
    num_failed_allocations: int
    is_shrinking: bool
    num_pages_over_quota: int


@dataclass(frozen=True)
class AllocatorStats:
    num_pages: int
    page_bytes: int
    num_free_pages: int
    num_unassigned_pages: int
    num_rebalances: int
    num_quota_pages_moved: int
    num_shrinks_requested: int
    num_shrinks_completed: int
    num_reclaimed_pages: int
    tenants: tuple[TenantStats, ...]
